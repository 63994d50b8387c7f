"""Issue 22, the client side of partial rollouts: ``SGLangEngine.stream`` (abortable requests, one
sample each), per-token weight versions read from SGLang's answers, the stale-answer rule for
weights that change while requests run, and the ``retract`` pause of a weight push. Against the
stand-in server (in-thread, the tiny model, each forward slowed so that an abort lands mid-way),
the real sglang-router, and the scriptable fake worker (request bodies validated against SGLang
0.5.23's contract)."""

import threading
import time
from dataclasses import replace

import pytest

from megatron_klear.rollout.base import SampleRequest, SamplingParams
from megatron_klear.rollout.servers.versions import stale_version, token_versions
from megatron_klear.rollout.sglang import EngineError, SGLangEngine, parse_completion
from megatron_klear.rollout.sglang.api import SGLangAPI
from tests.rollout.processes import abort_storm, fake_worker, recorded, router
from tests.rollout.sglang_contract import CONTROL_ROUTES, control_contract_errors, validate_generate_request

BUDGET = 48
PROMPTS = [[5, 17, 33, 60, 7], [40, 41], [300, 8, 250, 3], [9, 9, 120], [77, 1], [200, 13, 6]]


def _requests(seed0: int = 11, budget: int = BUDGET, prompts=PROMPTS):
    return [
        SampleRequest(
            key=("p", i),
            input_ids=list(p),
            params=SamplingParams(temperature=1.0, max_new_tokens=budget, seed=seed0 + i),
        )
        for i, p in enumerate(prompts)
    ]


def _serve(model_dir, delay: float = 0.0):
    """An in-thread stand-in server whose every forward sleeps ``delay`` s; ``(engine, server, url)``."""
    from megatron_klear.rollout.embedded import EmbeddedEngine
    from megatron_klear.rollout.sglang_standin import serve_in_thread

    engine = EmbeddedEngine.from_pretrained(model_dir)
    if delay:
        forward = engine.forward

        def slow(*args, **kwargs):
            time.sleep(delay)
            return forward(*args, **kwargs)

        engine.forward = slow
    server, url = serve_in_thread(engine, batch_window=0.2)
    return engine, server, url


def _stop(*servers):
    for s in servers:
        s.shutdown()
        s.server_close()


def _wait_steps(engines, steps: int, within: float = 30.0):
    """Until every engine has run ``steps`` more forwards."""
    start = [e.decode_steps for e in engines]
    deadline = time.monotonic() + within
    while any(e.decode_steps - s < steps for e, s in zip(engines, start)):
        assert time.monotonic() < deadline, "the servers did not decode"
        time.sleep(0.01)


def _collect(stream):
    return dict(iter(stream))


# -- unit: versions and the stale rule ----------------------------------------------------------------
def _answer(ids, reason="length", version="3", spans=None):
    """An output as SGLang 0.5.23's /generate answers it."""
    meta = {
        "id": "r",
        "finish_reason": (
            {"type": "abort", "message": "Abort", "status_code": None, "err_type": None}
            if reason == "abort"
            else {"type": reason, "length": len(ids)}
        ),
        "prompt_tokens": 2,
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "weight_version": version,
        "output_token_logprobs": [[-0.25 * (t + 1), t, None] for t in range(len(ids))],
    }
    if spans is not None:
        meta["weight_versions"] = spans
    return {"text": "", "output_ids": list(range(len(ids))), "meta_info": meta}


def test_per_token_versions_from_spans_or_the_single_version():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    c = parse_completion(_answer([0] * 5, version="4", spans=spans), url="http://w")
    assert c.versions == [3, 3, 4, 4, 4] and c.logprobs == [-0.25, -0.5, -0.75, -1.0, -1.25]
    assert parse_completion(_answer([0] * 3, version="7")).versions == [7, 7, 7]
    assert parse_completion(_answer([0] * 2, version="default")).versions == [None, None]
    # an abort with no token yet: one empty span, as SGLang's add_weight_versions_to_meta_info writes it
    empty = parse_completion(
        _answer([], reason="abort", spans=[{"version": "2", "start": 0, "end": 0}]), allow_abort=True
    )
    assert empty.aborted and empty.token_ids == [] and empty.versions == []


@pytest.mark.parametrize(
    "spans, said",
    [
        ([{"version": "3", "start": 1, "end": 5}], "span 0 covers [1, 5)"),
        ([{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 3, "end": 5}], "span 1 covers [3, 5)"),
        ([{"version": "3", "start": 0, "end": 4}], "cover 4 tokens, but the output has 5"),
        ([{"version": "3", "start": 0}], "span 0 is not an object with version, start and end"),
        ([], "is not a non-empty list"),
        ([{"version": "3", "start": 0, "end": "5"}], "start and end must be integers"),
    ],
)
def test_malformed_spans_are_named(spans, said):
    with pytest.raises(EngineError) as e:
        parse_completion(_answer([0] * 5, spans=spans), k=2, url="http://w:1")
    assert "http://w:1/generate sample 2" in str(e.value) and said in str(e.value), str(e.value)


def test_an_abort_is_a_partial_result_only_when_allowed():
    out = _answer([0] * 4, reason="abort", version="5")
    with pytest.raises(EngineError, match="finished with 'abort'"):
        parse_completion(out, url="http://w")
    c = parse_completion(out, url="http://w", allow_abort=True)
    assert c.aborted and c.token_ids == [0, 1, 2, 3] and len(c.logprobs) == 4 and c.versions == [5] * 4


def test_the_stale_rule_for_weights_that_change_while_requests_run():
    # sent at 4, finished at 5 after the push to 5: fine (async RL); a request sent at 5 answered by a
    # worker still at 4 is stale; a version ahead of the client is stale, except during a push
    assert not stale_version("5", "4", "5") and not stale_version("4", "4", "5")
    assert stale_version("4", "5", "5") and stale_version("3", "4", "5")
    assert stale_version("6", "5", "5") and not stale_version("6", "5", "5", pushing=True)
    assert not stale_version("default", None, None) and not stale_version("9", "1", None)  # no push yet
    assert not stale_version("7", None, "7") and stale_version("8", None, "7")  # sent before any push
    # not integers: equality with the version expected now
    assert stale_version("b", "a", "c") and not stale_version("c", "a", "c")
    assert token_versions({"weight_version": "12"}, 2, "x") == [12, 12]


def test_the_engine_applies_the_rule_to_each_answer():
    client = SGLangEngine.at(["http://127.0.0.1:9"], workers=["http://127.0.0.1:9"])
    client.members.set_expected_version(5)
    spans = [{"version": "4", "start": 0, "end": 2}, {"version": "5", "start": 2, "end": 3}]
    answer = _answer([0] * 3, version="5", spans=spans)  # sent at 4, ran across the push to 5
    assert client.generation._stale([answer["meta_info"]["weight_version"]], sent="4") is None
    assert client.generation._stale(["4"], sent="5") == "4"
    assert client.generation._stale(["6"], sent="5") == "6"
    with client.fleet.pushing():
        assert client.generation._stale(["6"], sent="5") is None  # the servers already hold what comes next
    client.close()


def test_the_pause_mode_of_a_push_is_the_sections_and_checked_once(tmp_path):
    with fake_worker(tmp_path) as (url, record, _):
        client = SGLangEngine.at([url], control_timeout_s=5, pause_mode="retract")  # rollout.pause_mode
        assert client.pause_mode == "retract"
        client.load_from_disk("/w", version=2)
        with pytest.raises(ValueError, match="rollout.pause_mode must be auto or one of"):
            SGLangEngine.at([url], control_timeout_s=5, pause_mode="in_place")
        assert SGLangEngine.at([url], control_timeout_s=5).pause_mode == "abort"  # auto, outside a job: abort
    assert recorded(record, "/pause_generation") == [{"mode": "retract"}]
    for body in recorded(record, "/pause_generation"):
        assert not control_contract_errors("/pause_generation", body)


# -- the fake worker: bodies, the deadline ------------------------------------------------------------
def test_stream_bodies_follow_sglangs_contract_and_an_unanswered_abort_ends_at_the_deadline(tmp_path, monkeypatch):
    monkeypatch.setitem(CONTROL_ROUTES, "/abort_request", "AbortReq")
    reqs = [
        SampleRequest(
            key=k,
            input_ids=[k + 1, 2],
            params=SamplingParams(max_new_tokens=3 + k, seed=40 + k, top_k=5, stop_token_ids=[2]),
        )
        for k in range(3)
    ]
    with fake_worker(tmp_path) as (url, record, _):
        client = SGLangEngine.at([url], control_timeout_s=5, send_seed=True)
        got = _collect(client.stream(reqs))
        assert {k: c.token_ids for k, c in got.items()} == {0: [7, 8, 9], 1: [7, 8, 9], 2: [7, 8, 9]}
        assert all(c.versions == [0, 0, 0] for c in got.values())
        bodies = sorted(recorded(record), key=lambda b: b["input_ids"])
        assert [b["input_ids"] for b in bodies] == [[1, 2], [2, 2], [3, 2]]
        for k, body in enumerate(bodies):
            validate_generate_request(body)
            sp = body["sampling_params"]
            assert sp["n"] == 1 and sp["max_new_tokens"] == 3 + k and sp["sampling_seed"] == 40 + k
            assert sp["top_k"] == 5 and sp["stop_token_ids"] == [2] and body["return_logprob"] is True
    # a worker that never answers the abort (this one has no /abort_request and sleeps 30 s per request):
    # every request ends as an empty abort once rollout.control_timeout_s has passed
    with fake_worker(tmp_path, "slow", generate_delay=30) as (url, record, _):
        client = SGLangEngine.at([url], control_timeout_s=0.5, max_concurrent_requests=2)
        stream = client.stream(reqs)
        time.sleep(0.3)
        t0 = time.monotonic()
        stream.abort()
        got = _collect(stream)
        assert time.monotonic() - t0 < 3.0
        assert all(c.aborted and c.token_ids == [] and c.versions == [] for c in got.values()) and len(got) == 3
        assert stream.aborted == 3 and client.streams.aborted_requests == 3
        assert len(recorded(record)) == 2  # the third was never sent
        aborts = recorded(record, "/abort_request")
        assert aborts and all(b == {"rid": "", "abort_all": True} for b in aborts)
        assert all(not control_contract_errors("/abort_request", b) for b in aborts)
        stream.close()


def test_a_thread_iterating_a_stream_stops_when_another_closes_it(tmp_path):
    # partial rollouts read the stream in a thread of their own; when the step fails, the stream is
    # closed from the step's thread, and neither thread may wait for a result the other one took
    reqs = [SampleRequest(k, [k + 1, 2], SamplingParams(max_new_tokens=3)) for k in range(3)]
    with fake_worker(tmp_path, "slow", generate_delay=30) as (url, _, _):
        client = SGLangEngine.at([url], control_timeout_s=0.5)
        stream = client.stream(reqs)
        seen = []
        reader = threading.Thread(target=lambda: seen.extend(stream), daemon=True)
        reader.start()
        time.sleep(0.3)
        closer = threading.Thread(target=stream.close, daemon=True)
        closer.start()
        closer.join(10)
        reader.join(10)
        assert not closer.is_alive() and not reader.is_alive()
        assert all(c.aborted for _, c in seen) and len(seen) <= 3
        client.close()


def test_bad_stream_requests_are_named():
    client = SGLangEngine.at(["http://127.0.0.1:9"], workers=["http://127.0.0.1:9"])
    with pytest.raises(ValueError, match=r"request 'a': input_ids must be"):
        client.stream([SampleRequest("a", [], SamplingParams())])
    with pytest.raises(ValueError, match=r"key 'a' appears twice"):
        client.stream([SampleRequest("a", [1], SamplingParams()), SampleRequest("a", [2], SamplingParams())])
    with pytest.raises(ValueError, match="max_new_tokens"):
        client.stream([SampleRequest("a", [1], SamplingParams(max_new_tokens=0))])
    with pytest.raises(ValueError, match=r"request 'a': n must be an integer >= 1, got 0"):
        client.stream([SampleRequest("a", [1], SamplingParams(), n=0)])
    with pytest.raises(ValueError, match=r"key \('a', 1\) appears twice"):  # a sample's key is (key, k)
        client.stream([SampleRequest("a", [1], SamplingParams(), n=2), SampleRequest(("a", 1), [2], SamplingParams())])
    assert list(client.stream([])) == []


# -- the stand-in: abort mid-way, continue ------------------------------------------------------------
@pytest.mark.parametrize("via_router", [False, True], ids=["direct", "router"])
def test_abort_mid_way_answers_the_output_so_far_and_continuing_finishes(tiny_hf, via_router):
    (ea, sa, a), (eb, sb, b) = _serve(tiny_hf["untied"], delay=0.01), _serve(tiny_hf["untied"], delay=0.01)
    try:
        with router([a, b]) if via_router else _nothing() as r:
            client = SGLangEngine.at([r] if via_router else [a, b], control_timeout_s=10, send_seed=True)
            reference = _collect(client.stream(_requests()))  # the same requests, run to the end
            assert all(not c.aborted and len(c.versions) == len(c.token_ids) for c in reference.values())
            long = [req for req in _requests() if len(reference[req.key].token_ids) >= 24]
            assert len(long) >= 3, {k: len(c.token_ids) for k, c in reference.items()}
            stream = client.stream(long)
            _wait_steps([ea, eb], 6)
            stream.abort()
            got = _collect(stream)
            assert set(got) == {req.key for req in long}
            # a request still waiting in a server's queue when the abort comes ends with no token: at
            # least one was decoding
            assert any(got[req.key].token_ids for req in long), got
            for req in long:
                c, full = got[req.key], reference[req.key]
                assert c.aborted and 0 <= len(c.token_ids) < len(full.token_ids) <= BUDGET, (req.key, c)
                assert len(c.logprobs) == len(c.token_ids) == len(c.versions)
                # the stand-in's seeded sampling is per sample: the partial response is a prefix of the full one
                assert c.token_ids == full.token_ids[: len(c.token_ids)]
                assert c.logprobs == pytest.approx(full.logprobs[: len(c.token_ids)], abs=1e-5)
            assert stream.aborted == len(long) and client.generation.retries == 0
            # continue each: the prompt and its partial response as the input, the budget left
            cont = [
                SampleRequest(
                    req.key,
                    req.input_ids + got[req.key].token_ids,
                    SamplingParams(max_new_tokens=BUDGET - len(got[req.key].token_ids), seed=99),
                )
                for req in long
            ]
            rest = _collect(client.stream(cont))
            for req in cont:
                c = rest[req.key]
                assert c.finish_reason in ("stop", "length") and 0 < len(c.token_ids) <= req.params.max_new_tokens
                assert c.finish_reason == "stop" or len(c.token_ids) == req.params.max_new_tokens
            # one request for n samples (a group not started yet): they come back as (key, k), and an
            # abort answers each with its output so far
            group = [replace(long[0], key="g", n=3)]
            full = _collect(client.stream(group))
            assert set(full) == {("g", 0), ("g", 1), ("g", 2)} and len({tuple(c.token_ids) for c in full.values()}) > 1
            before = client.streams.aborted_requests
            stream = client.stream(group)
            start = ea.decode_steps + eb.decode_steps  # (one server runs it)
            deadline = time.monotonic() + 30
            while ea.decode_steps + eb.decode_steps < start + 6:
                assert time.monotonic() < deadline, "the servers did not decode"
                time.sleep(0.01)
            stream.abort()
            got = _collect(stream)
            assert set(got) == set(full) and stream.aborted == 3 and client.streams.aborted_requests == before + 1
            for k, c in got.items():
                assert c.aborted and len(c.token_ids) < len(full[k].token_ids)
                assert c.token_ids == full[k].token_ids[: len(c.token_ids)] and len(c.versions) == len(c.token_ids)
            assert any(c.token_ids for c in got.values())
            client.close()
    finally:
        _stop(sa, sb)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# -- a push during a stream -----------------------------------------------------------------------------
def test_a_retract_push_during_a_stream_loses_nothing_and_later_tokens_carry_the_new_version(tiny_hf, other_hf):
    (ea, sa, a), (eb, sb, b) = _serve(tiny_hf["untied"], delay=0.01), _serve(tiny_hf["untied"], delay=0.01)
    try:
        client = SGLangEngine.at(
            [a, b],
            control_timeout_s=10,
            send_seed=True,
            health_check_interval_s=0.1,
            health_check_timeout_s=1.0,
            health_failure_threshold=2,
            pause_mode="retract",
        )
        with client.fleet.pushing():  # version 1 everywhere, as the RL loop's first push
            client.load_from_disk(tiny_hf["untied"], version=1)
            client.admit_workers(1)
        stream = client.stream(_requests(budget=40))
        _wait_steps([ea, eb], 6)
        sent = client.generation.requests_sent
        with client.fleet.pushing():  # the rollout manager's push: the watchdog keeps off the paused servers
            client.load_from_disk(other_hf, version=2)
            client.admit_workers(2)
        got = _collect(stream)
        assert len(got) == len(PROMPTS) and all(not c.aborted for c in got.values())
        assert (
            client.generation.requests_sent == sent and client.generation.retries == 0
        )  # nothing lost, retried or sent again
        metrics = client.fleet_metrics()
        assert metrics["rollout/resent_requests"] == 0 and metrics["rollout/stale_responses"] == 0, metrics
        assert metrics["rollout/worker_failures"] == 0 and metrics["rollout/live_workers"] == 2, metrics
        spanning = [c for c in got.values() if set(c.versions) == {1, 2}]
        assert spanning, {k: c.versions for k, c in got.items()}
        for c in got.values():
            assert len(c.versions) == len(c.token_ids) and c.versions == sorted(c.versions)
        assert client.members.weight_versions() == {a: "2", b: "2"}
        client.close()
    finally:
        _stop(sa, sb)


@pytest.mark.parametrize("in_push", [True, False], ids=["in-a-push", "outside-a-push"])
def test_the_watchdog_leaves_servers_paused_by_a_push_alone(tiny_hf, in_push):
    """A paused server's /health blocks: within ``Fleet.pushing()`` the watchdog does not probe and
    the stream goes on; the same pause outside a push looks like a frozen server and drops it."""
    from megatron_klear.rollout.base import FleetError

    engine, server, url = _serve(tiny_hf["untied"], delay=0.01)
    try:
        client = SGLangEngine.at(
            [url],
            control_timeout_s=10,
            health_check_interval_s=0.1,
            health_check_timeout_s=1.0,
            health_failure_threshold=2,
        )
        stream = client.stream(_requests(budget=24, prompts=PROMPTS[:3]))
        _wait_steps([engine], 3)
        with client.fleet.pushing() if in_push else _nothing():
            client.wire.pause("retract")
            time.sleep(3.0)  # outside a push: two probes that get no answer within 1 s
            client.wire.resume()
        if in_push:
            got = _collect(stream)
            assert len(got) == 3 and all(c.finish_reason in ("stop", "length") for c in got.values())
            assert client.fleet.live() == [url] and client.fleet_metrics()["rollout/worker_failures"] == 0
        else:
            with pytest.raises(FleetError, match="stopped answering /health"):
                _collect(stream)
        stream.close()
        client.close()
    finally:
        _stop(server)


def test_a_server_side_abort_before_abort_is_asked_is_retried(tmp_path):
    with fake_worker(tmp_path, abort_first=1) as (url, record, _):
        client = SGLangEngine.at([url], control_timeout_s=5, retry_backoff=0.01)
        got = _collect(client.stream([SampleRequest("k", [1, 2], SamplingParams(max_new_tokens=3))]))
    assert got["k"].finish_reason == "stop" and got["k"].token_ids == [7, 8, 9]
    assert client.generation.retries == 1 and len(recorded(record)) == 2 and client.streams.aborted_requests == 0


def test_a_probe_that_meets_an_abort_of_every_request_is_asked_again_within_the_control_timeout(tiny_hf):
    """With ``rl.async_steps=1 rollout.partial=true`` the next batch's stream ends (``abort_all`` to
    every server) whenever it has its groups, also while the weight check probes a server: the
    probe, and the token of ``check_received``, are asked again, not read as a failed check."""
    from megatron_klear.rollout.base import WorkerGone

    eng, server, url = _serve(tiny_hf["untied"], delay=0.01)
    try:
        client = SGLangEngine.at([url], control_timeout_s=10)
        prompt = [5, 17, 33, 60, 7]
        calm = client.probe(url, prompt, 16)
        body = {"input_ids": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}}
        with abort_storm(url + SGLangAPI.abort_all[0], SGLangAPI.abort_all[1]):
            # the hazard: a request of 16 slowed forwards under the storm is aborted
            hit = client.transport.request("POST", "/generate", body)
            assert hit["meta_info"]["finish_reason"]["type"] == "abort", hit["meta_info"]
            t0 = time.monotonic()
            # past the time: "aborted by the server at every send", or the last send's own timeout
            with pytest.raises(WorkerGone, match="aborted by the server at every send for 0.5 s|did not answer within"):
                client.wire.probe(url, prompt, 16, timeout=0.5)
            assert time.monotonic() - t0 < 5
        with abort_storm(url + SGLangAPI.abort_all[0], SGLangAPI.abort_all[1], for_s=0.4) as sent:
            out = client.probe(url, prompt, 16)  # aborted while the storm lasts, then whole
            assert out.finish_reason == "length" and out.token_ids == calm.token_ids
            assert out.logprobs == pytest.approx(calm.logprobs, abs=1e-6)
            got = client.wire.check_received()  # the storm is over by now: a token at once
            assert len(got[url].token_ids) == 1
        assert sent[0] >= 3  # the storm ran (posts every 5 ms, slower on a loaded machine)
        client.close()
    finally:
        _stop(server)


def test_partial_rollouts_stop_with_the_error_met_while_reading_their_stream(tiny_hf):
    # a stand-in no trainer pushed weights to answers without a step number as the tokens' version:
    # the step fails with the error that names it, and its reader thread ends (the stream closed
    # under it: test_a_thread_iterating_a_stream_stops_when_another_closes_it)
    from megatron_klear.config import JobConfig
    from megatron_klear.data.prompts import Prompt
    from megatron_klear.rl.rollout.partial import PartialRollouts

    class Prompts:
        def take(self, n):
            return [Prompt(id=f"p{i}", task="math", prompt_ids=list(PROMPTS[i]), answer="1") for i in range(n)]

    cfg = JobConfig()
    cfg.rl.prompts_per_step, cfg.rl.oversample_prompts, cfg.rl.responses_per_prompt = 2, 3, 2
    cfg.rollout.max_new_tokens = BUDGET
    _, server, url = _serve(tiny_hf["untied"])
    client = SGLangEngine.at([url], control_timeout_s=5)
    try:
        producer = PartialRollouts(cfg, client, pool=None, tokenizer=None, stop_token_ids=[])
        failed = []

        def step():
            try:
                producer.produce(Prompts(), 0, 0)
            except ValueError as e:
                failed.append(e)

        thread = threading.Thread(target=step, daemon=True)
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), "the step hangs"
        assert failed and "the weight version of every token" in str(failed[0])
    finally:
        client.close()
        _stop(server)
