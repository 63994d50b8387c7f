"""Issue 22, the engine side of partial rollouts: per-token weight versions and abort / continue,
as SGLang 0.5.23 reports them, on the stand-in server (in-process) and through the real
sglang-router 0.3.2.

- ``meta_info["weight_versions"]`` spans: checked against SGLang's own algorithm re-derived from its
  version-change events (``srt/utils/weight_versions.py``), and across a real pause(retract) ->
  /flush_cache -> /update_weights_from_disk -> /continue_generation in the middle of a request;
- every token's log-prob equals a teacher-forced float64 forward of the weights of the version
  that produced it (the spans say which);
- an aborted request answers its tokens so far; continued (prompt + partial output, the budget
  left) under newer weights, the whole response is still exact token by token.

A request is held at a chosen decode step until the control call under test has arrived (the
engine waits before its next forward), so the split points are exact, however slow the machine."""

import itertools
import random
import threading
import time

import httpx
import pytest
import torch

from megatron_klear.rollout.base import Completion, SamplingParams
from megatron_klear.rollout.embedded import EmbeddedEngine, PromptRequest
from megatron_klear.rollout.embedded.sampling import sample_seed
from megatron_klear.rollout.sglang_standin import serve_in_thread
from megatron_klear.rollout.sglang_standin.contract import completion_to_sglang, visible_spans, weight_version_spans
from tests.rollout.conftest import PROMPTS, full_logits, load_reference
from tests.rollout.processes import router
from tests.rollout.sglang_contract import (
    control_contract_errors,
    io_structs,
    validate_generate_request,
    validate_generate_response,
)

TEMPERATURE = 0.8
N = 24  # max_new_tokens of the long request
K = 9  # the decode step at which the control call lands


# -- the spans, against SGLang's event-based computation ---------------------------------------------
def _sglang_spans(versions, current):
    """SGLang 0.5.23's computation, re-derived from its events: at every version change the scheduler
    records (old version, tokens so far) for each live request that has output
    (``record_weight_version_events``); at the end, ``compute_weight_version_spans(events, current,
    tokens)``."""
    events = [(versions[i - 1], i) for i in range(1, len(versions)) if versions[i] != versions[i - 1]]
    changes, spans = events + [(current, len(versions))], []
    for version, end in changes:
        end = min(end, len(versions))
        if spans and end <= spans[-1][2]:
            continue
        if spans and version == spans[-1][0]:
            spans[-1][2] = end
            continue
        spans.append([version, spans[-1][2] if spans else 0, end])
    return [{"version": v, "start": s, "end": e} for v, s, e in spans]


def test_spans_equal_sglangs_event_computation():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randrange(0, 12)
        steps = sorted(rng.sample(range(1, 12), rng.randrange(0, 4)))
        versions, v = [], rng.randrange(3)
        for i in range(n):
            if i in steps:
                v += rng.choice([0, 1, 2])  # an update may keep the version (no event in SGLang)
            versions.append(str(v))
        current = versions[-1] if versions else str(v + 1)
        assert weight_version_spans(versions, current, n) == _sglang_spans(versions, current)
    # by hand: runs merged; None is SGLang's default name; no token: one empty span of the current version
    assert weight_version_spans([0, 0, 1, 1, 1, 3], 3, 6) == [
        {"version": "0", "start": 0, "end": 2},
        {"version": "1", "start": 2, "end": 5},
        {"version": "3", "start": 5, "end": 6},
    ]
    assert weight_version_spans([None, None, "7"], "7", 3) == [
        {"version": "default", "start": 0, "end": 2},
        {"version": "7", "start": 2, "end": 3},
    ]
    assert weight_version_spans([], 4, 0) == [{"version": "4", "start": 0, "end": 0}]
    assert weight_version_spans(None, None, 2) == [{"version": "default", "start": 0, "end": 2}]
    with pytest.raises(ValueError, match="2 versions for 3 tokens"):
        weight_version_spans([1, 1], 1, 3)


def test_visible_spans_cut_to_the_tokens_sent():
    spans = [{"version": "0", "start": 0, "end": 60}, {"version": "1", "start": 60, "end": 70}]
    assert visible_spans(spans, 50) == [{"version": "0", "start": 0, "end": 50}]
    assert visible_spans(spans, 0) == [{"version": "0", "start": 0, "end": 0}]
    assert visible_spans(spans, 70) == spans


def test_answer_meta_info_versions():
    c = Completion(token_ids=[4, 5, 6], logprobs=[-1.0, -2.0, -3.0], finish_reason="length", versions=["0", "1", "1"])
    meta = completion_to_sglang(c, prompt=[1], max_new_tokens=3, return_logprob=True, rid="a", weight_version="2")[
        "meta_info"
    ]
    # the last span's version, not the engine's version at answer time
    assert meta["weight_version"] == "1" and meta["weight_versions"] == [
        {"version": "0", "start": 0, "end": 1},
        {"version": "1", "start": 1, "end": 3},
    ]
    queued = Completion(token_ids=[], logprobs=[], finish_reason="abort", versions=[])
    out = completion_to_sglang(
        queued, prompt=[1], max_new_tokens=3, return_logprob=True, rid="b", weight_version="2", waiting_interval=50
    )
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Abort in waiting queue",
    }
    assert out["meta_info"]["weight_versions"] == [{"version": "2", "start": 0, "end": 0}]
    validate_generate_response(out)


# -- servers ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def refs(tiny_hf, other_hf):
    """The float64 models of weight versions "0" (tiny_hf untied) and "1" (other_hf)."""
    return {"0": load_reference(tiny_hf["untied"]), "1": load_reference(other_hf)}


@pytest.fixture
def server(tiny_hf):
    engine = EmbeddedEngine.from_pretrained(tiny_hf["untied"])
    srv, url = serve_in_thread(engine, batch_window=0.001)
    try:
        assert _control(url, "/update_weight_version", {"new_version": "0", "abort_all_requests": False}) == 200
        yield engine, srv, url
    finally:
        httpx.post(url + "/continue_generation", json={}, timeout=10)
        httpx.post(url + "/abort_request", json={"rid": "", "abort_all": True}, timeout=10)
        srv.shutdown()
        srv.server_close()


def _control(url, route, body):
    """A control call whose body SGLang 0.5.23 would accept (its io_struct request types)."""
    if route == "/abort_request":  # http_server.py decodes it as AbortReq
        spec = io_structs()["AbortReq"]
        assert (
            set(body) <= set(spec)
            and isinstance(body.get("rid", ""), str)
            and isinstance(body.get("abort_all", False), bool)
        )
    else:
        assert control_contract_errors(route, body) == []
    return httpx.post(url + route, json=body, timeout=60).status_code


def _generate(url, body, results, key="out"):
    validate_generate_request(body)
    results[key] = httpx.post(url + "/generate", json=body, timeout=120)


def _start(url, body):
    results = {}
    t = threading.Thread(target=_generate, args=(url, body, results), daemon=True)
    t.start()
    return t, results


def _gate_on_pause(monkeypatch, sched, modes=("retract", "in_place", "abort")) -> threading.Event:
    """A gate opened by the scheduler's pause in one of ``modes``: the scheduler is marked paused
    first, so the held forward the gate releases is the engine's last before it stops."""
    gate, pause = threading.Event(), sched.pause

    def pausing(mode):
        if mode in modes:
            with sched.cond:
                sched.paused = mode
            gate.set()
        return pause(mode)

    monkeypatch.setattr(sched, "pause", pausing)
    return gate


def _hold(monkeypatch, engine, after: int, gate: threading.Event):
    """The engine waits for ``gate`` before every forward from number ``after`` on (so a request
    holds exactly ``after - start`` tokens then)."""
    forward = engine.forward

    def held(*args, **kwargs):
        if engine.decode_steps >= after:
            assert gate.wait(60), "the control call under test never came"
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine, "forward", held)


def _wait_steps(engine, steps, timeout=60):
    deadline = time.monotonic() + timeout
    while engine.decode_steps < steps and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine.decode_steps >= steps


def _wait_jobs(sched, rids, timeout=60):
    """Until the scheduler holds a request of every id in ``rids`` (running or waiting)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with sched.cond:
            held = {i for job in sched.jobs.values() for i in job.ids}
        if rids <= held:
            return
        time.sleep(0.005)
    raise AssertionError(f"the scheduler never held {sorted(rids - held)}")


def _body(prompt, max_new_tokens, seed, rid):
    return {
        "input_ids": prompt,
        "rid": rid,
        "return_logprob": True,
        "sampling_params": {
            "max_new_tokens": max_new_tokens,
            "temperature": TEMPERATURE,
            "ignore_eos": True,
            "sampling_seed": seed,
        },
    }


@torch.no_grad()
def _teacher_forced(refs, prompt, tokens, spans):
    """Per token, log_softmax(logits / T) of the float64 model of the version its span names, fed the
    prompt and the previous tokens."""
    logits = {v: full_logits(refs[v], prompt, tokens) for v in {s["version"] for s in spans}}
    out = []
    for s in spans:
        lp = torch.log_softmax(logits[s["version"]][s["start"] : s["end"]] / TEMPERATURE, dim=-1)
        out += lp.gather(1, torch.tensor(tokens[s["start"] : s["end"]]).unsqueeze(1)).squeeze(1).tolist()
    return out


def _logprobs(out):
    pairs = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in pairs] == out["output_ids"]
    return [lp for lp, _, _ in pairs]


def test_retract_pause_and_disk_update_mid_request(server, refs, tiny_hf, other_hf, monkeypatch):
    """pause(retract) -> /flush_cache -> /update_weights_from_disk (version "1") -> continue while a
    request runs: its first K tokens are version 0's, the rest version 1's, each token's log-prob is
    its version's float64 forward, and the version-0 part is what version 0 alone samples."""
    engine, srv, url = server
    prompt = PROMPTS[0]
    gate = _gate_on_pause(monkeypatch, srv.state.scheduler)
    start = engine.decode_steps
    _hold(monkeypatch, engine, start + K, gate)
    thread, results = _start(url, _body(prompt, N, 7, "long-1"))
    _wait_steps(engine, start + K)  # held before its next forward: K tokens sampled
    assert _control(url, "/pause_generation", {"mode": "retract"}) == 200
    assert httpx.post(url + "/flush_cache", timeout=10).status_code == 200  # retracted: nothing holds KV cache
    assert _control(url, "/update_weights_from_disk", {"model_path": other_hf, "weight_version": "1"}) == 200
    assert _control(url, "/continue_generation", {}) == 200
    thread.join(60)
    r = results["out"]
    assert r.status_code == 200, r.text
    out = r.json()
    validate_generate_response(out)
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": N} and len(out["output_ids"]) == N
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": K}, {"version": "1", "start": K, "end": N}]
    assert meta["weight_version"] == "1"
    got, want = _logprobs(out), _teacher_forced(refs, prompt, out["output_ids"], meta["weight_versions"])
    assert got == pytest.approx(want, abs=2e-4)
    # the version-1 tokens are not version 0's: the spans are what make the reference right
    wrong = _teacher_forced(refs, prompt, out["output_ids"], [{"version": "0", "start": 0, "end": N}])
    assert max(abs(a - b) for a, b in zip(got[K:], wrong[K:])) > 1e-2
    # the stand-in draws token i of a sample from its seeded stream's i-th uniform: before the
    # update, the request is what version 0 alone samples with the same seed
    alone = EmbeddedEngine.from_pretrained(tiny_hf["untied"]).generate_requests(
        [
            PromptRequest(
                prompt,
                SamplingParams(temperature=TEMPERATURE, max_new_tokens=N),
                [sample_seed(7, 0, 0)],
                ignore_eos=True,
            )
        ]
    )[0][0]
    assert out["output_ids"][:K] == alone.token_ids[:K] and out["output_ids"] != alone.token_ids


@pytest.mark.parametrize("via", ["direct", "router"])
def test_abort_then_continue_under_new_weights(server, refs, other_hf, monkeypatch, via):
    """/abort_request abort_all mid-generation answers the K tokens so far and the token of the step
    that ran after it (SGLang sets ``to_finish``; the next step's token is kept: FINISH_ABORT, their
    log-probs, their span); continued as prompt + partial output with the budget left, after a
    weight update, the whole response matches, token by token, the forward of each token's
    version. ``router``: generation goes through the real sglang-router 0.3.2, which does not route
    /abort_request (404): the abort goes to the worker."""
    engine, srv, url = server
    prompt = PROMPTS[2]
    gate, sched = threading.Event(), srv.state.scheduler
    abort_request = sched.abort_request

    def aborting(rid="", abort_all=False):
        count = abort_request(rid, abort_all)
        if count:  # a request was aborted: the held engine goes on (and ends it)
            gate.set()
        return count

    monkeypatch.setattr(sched, "abort_request", aborting)
    with router([url], extra=("--disable-health-check",)) if via == "router" else _nothing(url) as front:
        if via == "router":
            assert (
                httpx.post(front + "/abort_request", json={"rid": "", "abort_all": True}, timeout=10).status_code == 404
            )
            assert not gate.is_set()
        start = engine.decode_steps  # (after the router's health probes, which generate)
        _hold(monkeypatch, engine, start + K, gate)
        thread, results = _start(front, _body(prompt, N, 3, "part-1"))
        _wait_steps(engine, start + K)  # held before its next forward: K tokens sampled
        # a rid no request has (a prefix of one) is ignored, as by SGLang's tokenizer manager
        assert _control(url, "/abort_request", {"rid": "part"}) == 200
        thread.join(0.3)
        assert thread.is_alive() and not gate.is_set()
        assert _control(url, "/abort_request", {"rid": "", "abort_all": True}) == 200
        thread.join(60)
        r = results["out"]
        assert r.status_code == 200, r.text
        part = r.json()
        validate_generate_response(part)
        meta = part["meta_info"]
        assert meta["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        cut = K + 1  # the K sampled before the abort, and the one of the step after it
        assert len(part["output_ids"]) == cut and meta["completion_tokens"] == cut
        assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": cut}] and meta["weight_version"] == "0"
        assert _logprobs(part) == pytest.approx(
            _teacher_forced(refs, prompt, part["output_ids"], meta["weight_versions"]), abs=2e-4
        )
        # the next step: new weights, then the partial response continues with the budget left
        assert _control(url, "/update_weights_from_disk", {"model_path": other_hf, "weight_version": "1"}) == 200
        results = {}
        _generate(front, _body(prompt + part["output_ids"], N - cut, 4, "part-2"), results)
        assert results["out"].status_code == 200, results["out"].text
        rest = results["out"].json()
        validate_generate_response(rest)
    assert rest["meta_info"]["finish_reason"] == {"type": "length", "length": N - cut}
    assert rest["meta_info"]["weight_versions"] == [{"version": "1", "start": 0, "end": N - cut}]
    tokens = part["output_ids"] + rest["output_ids"]
    spans = [{"version": "0", "start": 0, "end": cut}, {"version": "1", "start": cut, "end": N}]
    assert _logprobs(part) + _logprobs(rest) == pytest.approx(_teacher_forced(refs, prompt, tokens, spans), abs=2e-4)


def test_an_abort_keeps_the_token_of_the_step_after_it_even_a_stop_token(server, monkeypatch):
    """SGLang 0.5.23: an abort of a running request takes effect after the running decode step, whose
    token is appended before ``update_finish_state`` returns on ``to_finish`` -- so an ``abort``
    answer can end in a stop token. The client cuts it there and treats it as finished."""
    engine, srv, url = server
    prompt = PROMPTS[1]
    for seed in range(3, 40):  # a seed whose token K+1 first appears there: the stop id of the test
        alone = engine.generate_requests(
            [
                PromptRequest(
                    prompt, SamplingParams(temperature=TEMPERATURE, max_new_tokens=N), [sample_seed(seed, 0, 0)]
                )
            ]
        )[0][0]
        if len(alone.token_ids) > K + 1 and alone.token_ids[K] not in alone.token_ids[:K]:
            break
    stop = alone.token_ids[K]
    body = _body(prompt, N, seed, "ends-1")
    body["sampling_params"] = {**body["sampling_params"], "ignore_eos": False, "stop_token_ids": [stop]}
    gate = threading.Event()
    start = engine.decode_steps
    _hold(monkeypatch, engine, start + K, gate)  # held before the forward of token K+1's logits
    thread, results = _start(url, body)
    _wait_steps(engine, start + K)
    assert _control(url, "/abort_request", {"rid": "ends-1"}) == 200
    gate.set()
    thread.join(60)
    out = results["out"].json()
    validate_generate_response(out)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["output_ids"] == alone.token_ids[: K + 1] and out["output_ids"][-1] == stop
    answer = Completion(token_ids=out["output_ids"], logprobs=_logprobs(out), finish_reason="abort")
    ended = answer.cut_at_stop([stop])
    assert ended.finish_reason == "stop" and ended.token_ids == out["output_ids"] and ended.finished
    # tokens after the stop (speculative decoding accepts a run): cut after the first stop token
    longer = Completion(token_ids=[*out["output_ids"], 1, stop], logprobs=[0.0] * (K + 3), finish_reason="abort")
    assert longer.cut_at_stop([stop]).token_ids == out["output_ids"]
    assert answer.cut_at_stop([-1]) is answer  # no stop token: a partial answer, to continue


def test_abort_request_matches_ids_by_prefix_once_one_is_exact(server, monkeypatch):
    """SGLang's scheduler aborts every request whose id starts with the rid (once the tokenizer
    manager found the rid itself among its requests): "q1" ends "q1" and "q10", not "z"."""
    engine, srv, url = server
    gate, sched = threading.Event(), srv.state.scheduler
    abort_request = sched.abort_request

    def aborting(rid="", abort_all=False):
        count = abort_request(rid, abort_all)
        if count:
            gate.set()
        return count

    monkeypatch.setattr(sched, "abort_request", aborting)
    start = engine.decode_steps
    _hold(monkeypatch, engine, start + K, gate)
    started = [_start(url, _body(PROMPTS[i], N, i, rid)) for i, rid in enumerate(["q1", "q10", "z"])]
    _wait_steps(engine, start + K)
    _wait_jobs(sched, {"q1", "q10", "z"})  # (one sent late may still be on its way when the others hold)
    assert _control(url, "/abort_request", {"rid": "q"}) == 200  # not an id: ignored
    assert not gate.is_set() and all(t.is_alive() for t, _ in started)
    assert _control(url, "/abort_request", {"rid": "q1"}) == 200
    outs = []
    for thread, results in started:
        thread.join(60)
        assert results["out"].status_code == 200
        outs.append(results["out"].json())
    reasons = [o["meta_info"]["finish_reason"]["type"] for o in outs]
    assert reasons == ["abort", "abort", "length"] and len(outs[2]["output_ids"]) == N


def test_a_request_held_by_a_retract_pause_aborts_from_the_waiting_queue(server, monkeypatch):
    """SGLang puts retracted requests back in its waiting queue: aborted there (here by
    pause(mode=abort)), a request that does not stream answers only the tokens sent to the tokenizer
    manager (every 50): none of its K, with finish_reason "Abort in waiting queue" and the scheduler's
    span cut to them (its version stays the version of its tokens)."""
    engine, srv, url = server
    gate = _gate_on_pause(monkeypatch, srv.state.scheduler, modes=("retract",))
    start = engine.decode_steps
    _hold(monkeypatch, engine, start + K, gate)
    thread, results = _start(url, _body(PROMPTS[0], N, 1, "held-1"))
    _wait_steps(engine, start + K)
    assert _control(url, "/pause_generation", {"mode": "retract"}) == 200
    assert _control(url, "/update_weight_version", {"new_version": "1", "abort_all_requests": False}) == 200
    assert _control(url, "/pause_generation", {"mode": "abort"}) == 200
    thread.join(60)
    out = results["out"].json()
    validate_generate_response(out)
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["output_token_logprobs"] == [] and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 0}] and meta["weight_version"] == "0"


class _nothing:
    """``with _nothing(url) as front``: no router, the worker itself."""

    def __init__(self, url):
        self.url = url

    def __enter__(self):
        return self.url

    def __exit__(self, *exc):
        return False


def test_in_place_pause_tags_from_the_next_forward(server, refs, other_hf, monkeypatch):
    """Paused in_place, the held request keeps its KV cache; the token sampled first after continue
    comes from logits the old weights computed before the pause (version 0, exactly its forward),
    the later ones from the new weights (version 1)."""
    engine, srv, url = server
    prompt = PROMPTS[1]
    gate = _gate_on_pause(monkeypatch, srv.state.scheduler)
    start = engine.decode_steps
    _hold(monkeypatch, engine, start + K, gate)
    thread, results = _start(url, _body(prompt, N, 5, "inplace-1"))
    _wait_steps(engine, start + K)  # held before its next forward: K tokens sampled
    assert _control(url, "/pause_generation", {"mode": "in_place"}) == 200
    assert httpx.post(url + "/flush_cache", timeout=10).status_code == 400  # KV cache of the old weights is held
    assert (
        _control(
            url, "/update_weights_from_disk", {"model_path": other_hf, "weight_version": "1", "flush_cache": False}
        )
        == 200
    )
    assert _control(url, "/continue_generation", {}) == 200
    thread.join(60)
    out = results["out"].json()
    assert out["meta_info"]["weight_versions"] == [
        {"version": "0", "start": 0, "end": K + 1},
        {"version": "1", "start": K + 1, "end": N},
    ]
    got = _logprobs(out)
    want = _teacher_forced(refs, prompt, out["output_ids"], [{"version": "0", "start": 0, "end": K + 1}])
    assert got[: K + 1] == pytest.approx(want, abs=2e-4)


def test_embedded_engine_tags_tokens_and_aborted_rows(tiny_hf):
    """In process: every token carries the engine's version; a row aborted between steps keeps its
    tokens and their versions; a request aborted before it starts has none."""
    engine = EmbeddedEngine.from_pretrained(tiny_hf["untied"])
    engine.weight_version = 5
    steps = itertools.count()

    def aborted(key):
        return key == "gone" or (key == "cut" and next(steps) >= 4)

    params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=10)
    out = engine.generate_requests(
        [
            PromptRequest(PROMPTS[0], params, [1], key="cut", ignore_eos=True),
            PromptRequest(PROMPTS[1], params, [2], key="gone", ignore_eos=True),
        ],
        aborted=aborted,
    )
    cut, gone = out[0][0], out[1][0]
    assert cut.finish_reason == "abort" and 0 < len(cut.token_ids) < 10
    assert cut.versions == [5] * len(cut.token_ids) and len(cut.logprobs) == len(cut.token_ids)
    assert gone.finish_reason == "abort" and gone.token_ids == [] and gone.versions == []
