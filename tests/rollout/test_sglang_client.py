"""The SGLang-API client against real processes: our embedded servers, the real sglang-router, and
a scriptable fake worker for faults. Every request body the client sends is validated against
SGLang 0.5.23's own request contract (``sglang/api/v1/api_types.py``)."""

import json
import os
import signal
import threading
import time

import pytest

from megatron_klear.rollout.base import FleetError, SamplingParams
from megatron_klear.rollout.embedded import EmbeddedEngine
from megatron_klear.rollout.sglang import EngineError, SGLangEngine, parse_completion
from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine
from tests.rollout.conftest import PROMPTS
from tests.rollout.processes import fake_worker, recorded, router
from tests.rollout.sglang_contract import validate_generate_request

GREEDY = SamplingParams(temperature=1.0, top_k=1, max_new_tokens=8)
FAST = dict(control_timeout_s=5, max_retries=2, retry_backoff=0.05)


def _tokens(rows):
    return [[c.token_ids for c in row] for row in rows]


def test_two_servers_split_prompts_and_reload_weights(tiny_hf, other_hf):
    servers = [EmbeddedHTTPEngine.launch(tiny_hf["untied"], startup_timeout=120) for _ in range(2)]
    try:
        client = SGLangEngine.at([s.url for s in servers], check=True, send_seed=True)
        prompts = PROMPTS * 2  # more prompts than servers
        got = client.generate(prompts, GREEDY, n=2)
        want = EmbeddedEngine.from_pretrained(tiny_hf["untied"]).generate(prompts, GREEDY, n=2)
        assert _tokens(got) == _tokens(want)
        for row_got, row_want in zip(got, want):
            for a, b in zip(row_got, row_want):
                assert a.finish_reason == b.finish_reason
                assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
        assert client.generation.requests_sent == len(prompts)  # one request per prompt, n samples each
        client.load_from_disk(other_hf, version=7)  # every server now runs the other model
        assert set(client.members.weight_versions().values()) == {"7"}
        other = EmbeddedEngine.from_pretrained(other_hf).generate(prompts, GREEDY, n=1)
        assert _tokens(client.generate(prompts, GREEDY)) == _tokens(other)
    finally:
        for s in servers:
            s.close()


@pytest.mark.parametrize("granularity", ["prompt", "sample"])
def test_every_request_follows_sglangs_contract(tmp_path, granularity):
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=3, stop_token_ids=[2, 0], seed=5)
    with fake_worker(tmp_path) as (url, record, _):
        client = SGLangEngine.at([url], request_granularity=granularity, send_seed=True, **FAST)
        out = client.generate([[1, 2, 3], [4, 5], [6]], params, n=3)
        client.check_context_length(100)
        client.load_from_disk("/some/dir", version=3)
    assert [[c.token_ids for c in row] for row in out] == [[[7, 8, 9]] * 3] * 3
    bodies = recorded(record)
    assert len(bodies) == (3 if granularity == "prompt" else 9)
    for body in bodies:
        validate_generate_request(body)  # SGLang's own decoder: raises on any violation
        sp = body["sampling_params"]
        assert sp["n"] == (3 if granularity == "prompt" else 1)
        assert sp["stop_token_ids"] == [2, 0] and sp["max_new_tokens"] == 3 and body["return_logprob"] is True
    seeds = [b["sampling_params"]["sampling_seed"] for b in bodies]
    assert len(set(seeds)) == len(seeds)  # no two requests share a seed
    update = recorded(record, "/update_weights_from_disk")
    # the cache is flushed once before the load (SGLang 0.5.23 fails a load whose flush finds a
    # request still queued), so the load itself does not flush
    assert update == [{"model_path": "/some/dir", "flush_cache": False, "weight_version": "3"}]


def test_a_prompts_seed_follows_its_key_not_its_place_in_the_call(tmp_path):
    """generate_iter's seed_keys (an evaluation that resumes sends the prompts left, keyed by their
    indices in the benchmark): each request carries the seed the whole list's call gave that prompt."""
    params = SamplingParams(temperature=0.7, max_new_tokens=3, seed=5)
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8]]
    with fake_worker(tmp_path) as (url, record, _):
        client = SGLangEngine.at([url], send_seed=True, **FAST)
        list(client.generate_iter(prompts, params, n=2, seed_keys=[0, 1, 2, 3]))
        whole = {tuple(b["input_ids"]): b["sampling_params"]["sampling_seed"] for b in recorded(record)}
        list(client.generate_iter([prompts[1], prompts[3]], params, n=2, seed_keys=[1, 3]))
        later = {tuple(b["input_ids"]): b["sampling_params"]["sampling_seed"] for b in recorded(record)[4:]}
    assert later == {tuple(prompts[1]): whole[tuple(prompts[1])], tuple(prompts[3]): whole[tuple(prompts[3])]}
    assert len(set(whole.values())) == 4


def test_no_seed_is_sent_to_sglang_by_default(tmp_path):
    with fake_worker(tmp_path) as (url, record, _):
        SGLangEngine.at([url], **FAST).generate([[1, 2]], SamplingParams(seed=3, max_new_tokens=3), n=4)
    assert "sampling_seed" not in recorded(record)[0]["sampling_params"]


def test_the_real_router_spreads_requests_and_weight_updates_reach_every_worker(tmp_path):
    with fake_worker(tmp_path, "a") as (a, rec_a, _), fake_worker(tmp_path, "b") as (b, rec_b, _), router([a, b]) as r:
        client = SGLangEngine.at([r], check=True, **FAST)  # /health of the router answers "OK", not JSON
        assert sorted(client.workers()) == sorted([a, b])  # discovered through GET /workers
        out = client.generate([[i + 1, 2] for i in range(8)], SamplingParams(max_new_tokens=3), n=2)
        assert all(len(row) == 2 for row in out)
        gen_a, gen_b = recorded(rec_a), recorded(rec_b)
        assert len(gen_a) + len(gen_b) == 8 and gen_a and gen_b  # spread, not one batch to one worker
        for body in gen_a + gen_b:  # what the router forwards (it adds keys) is still SGLang's contract
            validate_generate_request(body)
        client.load_from_disk("/weights/step_0000002", version=2)
        assert client.members.weight_versions() == {a: "2", b: "2"}
        for rec in (rec_a, rec_b):  # SGLang's sequence on each worker, never through the router
            import json

            paths = [json.loads(x)["path"] for x in open(rec)]
            i = paths.index("/pause_generation")
            assert paths[i : i + 4] == [
                "/pause_generation",
                "/flush_cache",
                "/update_weights_from_disk",
                "/continue_generation",
            ]


def test_failed_requests_are_retried_then_named(tmp_path):
    with fake_worker(tmp_path, "flaky", fail_first=1) as (url, _, _):
        client = SGLangEngine.at([url], **FAST)
        assert _tokens(client.generate([[1]], SamplingParams(max_new_tokens=3))) == [[[7, 8, 9]]]
        assert client.generation.retries == 1
    with fake_worker(tmp_path, "abort", abort_first=1) as (url, _, _):
        client = SGLangEngine.at([url], **FAST)
        client.generate([[1]], SamplingParams(max_new_tokens=3))
        assert client.generation.retries == 1
    with fake_worker(tmp_path, "broken", status=503) as (url, _, _):
        client = SGLangEngine.at([url], **FAST)
        with pytest.raises(EngineError, match=f"{url}/generate failed 3 times.*injected HTTP 503"):
            client.generate([[1]], SamplingParams(max_new_tokens=3))
    with fake_worker(tmp_path, "bad", status=400) as (url, _, _):
        client = SGLangEngine.at([url], **FAST)
        with pytest.raises(EngineError, match="HTTP 400: injected HTTP 400"):
            client.generate([[1]], SamplingParams(max_new_tokens=3))
        assert client.generation.requests_sent == 1  # a bad request is not retried


def test_a_server_that_answers_non_json_is_a_clear_error(tmp_path):
    with fake_worker(tmp_path, non_json=True) as (url, _, _):
        client = SGLangEngine.at([url], **FAST)
        with pytest.raises(EngineError, match="not JSON.*502 Bad Gateway"):
            client.generate([[1]], SamplingParams(max_new_tokens=3))
        with pytest.raises(EngineError, match="not JSON"):
            client.check_context_length(10)


def test_context_too_short_names_the_fix(tmp_path):
    with fake_worker(tmp_path, context_length=4096) as (url, _, _):
        client = SGLangEngine.at([url], **FAST)
        assert client.check_context_length(4096) == {url: 4096}
        with pytest.raises(EngineError, match="context length of 4096 tokens.*needs 36864.*--context-length 36864"):
            client.check_context_length(36864, "rl.max_prompt_length + rollout.max_new_tokens")


def test_the_context_check_counts_the_tokens_eagle_reserves(tmp_path):
    # SGLang 0.5.23 adds max(topk * steps, draft tokens) to every prompt when it checks the context
    # (managers/utils.py compute_num_reserved_tokens): here max(4 * 3, 8) = 12
    spec = {
        "speculative_algorithm": "EAGLE3",
        "speculative_eagle_topk": 4,
        "speculative_num_steps": 3,
        "speculative_num_draft_tokens": 8,
    }
    with fake_worker(tmp_path, context_length=4096, server_info=json.dumps(spec)) as (url, _, _):
        client = SGLangEngine.at([url], **FAST)
        assert client.upkeep.reserved_tokens(url) == 12
        assert client.check_context_length(4084) == {url: 4096}
        with pytest.raises(EngineError, match="needs 4085 and the 12 tokens its speculative decoding reserves"):
            client.check_context_length(4085)
    with fake_worker(
        tmp_path, name="plain", context_length=4096, server_info=json.dumps({**spec, "speculative_algorithm": None})
    ) as (url, _, _):
        assert SGLangEngine.at([url], **FAST).check_context_length(4096) == {url: 4096}  # no speculation, no reserve


def test_a_server_with_data_parallel_replicas_is_refused_at_start_up(tmp_path):
    from megatron_klear.config import load_config
    from megatron_klear.rollout.sglang import compat

    SHORT = ["rl.max_prompt_length=64", "rollout.max_new_tokens=64"]

    info = {"dp_size": 2, "attn_dp_size": 1}
    with fake_worker(tmp_path, server_info=json.dumps(info)) as (url, _, _):
        client = SGLangEngine.at([url], **FAST)
        base = [
            "rollout.engine=sglang",
            f"rollout.urls=[{url}]",
            "rl.prompts=[p.jsonl]",
            "rollout.sync_backend=gloo",
            *SHORT,
        ]
        with pytest.raises(EngineError, match=r"dp_size=2.*refuses weight update groups unless dp_size is 1"):
            compat.check_servers(client, load_config(None, base).rollout)
        compat.check_servers(client, load_config(None, base + ["rollout.weight_sync=disk"]).rollout)  # no group
    with fake_worker(tmp_path, name="attn", server_info=json.dumps({"dp_size": 1, "attn_dp_size": 4})) as (url, _, _):
        base = [
            "rollout.engine=sglang",
            f"rollout.urls=[{url}]",
            "rl.prompts=[p.jsonl]",
            "rollout.sync_backend=gloo",
            *SHORT,
        ]
        compat.check_servers(SGLangEngine.at([url], **FAST), load_config(None, base).rollout)  # attention DP is fine


def test_generate_timeout_is_the_configured_one(tmp_path):
    with fake_worker(tmp_path, generate_delay=5) as (url, _, _):
        client = SGLangEngine.at([url], generate_timeout_s=0.5, **FAST)
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="within rollout.generate_timeout_s = 0.5 s"):
            client.generate([[1]], SamplingParams(max_new_tokens=3))
        assert time.monotonic() - t0 < 4


def test_router_down_at_start_is_a_clear_error():
    with pytest.raises(EngineError, match="127.0.0.1:9/health does not answer"):
        SGLangEngine.at(["http://127.0.0.1:9"], control_timeout_s=2, check=True)
    with pytest.raises(EngineError, match="cannot reach http://127.0.0.1:9"):
        SGLangEngine.at(["http://127.0.0.1:9"], control_timeout_s=2).workers()


WATCH = dict(health_check_interval_s=0.3, health_check_timeout_s=0.5, health_failure_threshold=2, **FAST)


def _fails_within(client, seconds, match):
    t0 = time.monotonic()
    with pytest.raises(FleetError, match=match):
        client.generate([[1, 2], [3, 4], [5, 6], [7, 8]], SamplingParams(max_new_tokens=3), n=2)
    elapsed = time.monotonic() - t0
    assert elapsed < seconds, elapsed


def test_a_frozen_worker_behind_the_router_is_noticed(tmp_path):
    """SIGSTOP: the worker still accepts connections but never answers; without the health probe
    the client would wait for the whole generation timeout (an hour by default). With
    rollout.min_live_workers = 2 the call cannot go on with the other worker alone: it fails
    naming the frozen one (tests/rollout/test_fleet.py: with 1 it goes on)."""
    with (
        fake_worker(tmp_path, "a", generate_delay=60) as (a, _, proc_a),
        fake_worker(tmp_path, "b") as (b, _, _),
        router([a, b]) as r,
    ):
        client = SGLangEngine.at([r], generate_timeout_s=3600, min_live_workers=2, **WATCH)
        client.workers()
        os.kill(proc_a.pid, signal.SIGSTOP)
        _fails_within(client, 20, f"{a}: stopped answering /health")


def test_a_frozen_embedded_server_is_noticed(tiny_hf):
    server = EmbeddedHTTPEngine.launch(tiny_hf["untied"], startup_timeout=120)
    try:
        client = SGLangEngine.at([server.url], generate_timeout_s=3600, **WATCH)
        assert client.workers() == [server.url]  # a server, not a router: it has no /workers
        os.kill(server._process.pid, signal.SIGSTOP)
        _fails_within(client, 20, f"{server.url}: stopped answering /health")
    finally:
        os.kill(server._process.pid, signal.SIGCONT)
        server.close()


def test_a_worker_killed_mid_rollout_is_a_clear_error(tmp_path):
    with fake_worker(tmp_path, generate_delay=60) as (url, _, proc):
        client = SGLangEngine.at([url], generate_timeout_s=3600, **WATCH)
        threading.Timer(1.0, proc.kill).start()
        _fails_within(client, 20, url.replace(".", r"\."))


def test_malformed_responses_are_named():
    with pytest.raises(EngineError, match="return_logprob"):
        parse_completion({"output_ids": [1], "meta_info": {"finish_reason": {"type": "stop"}}})
    with pytest.raises(EngineError, match="do not match output_ids"):
        parse_completion(
            {
                "output_ids": [1, 2],
                "meta_info": {
                    "finish_reason": {"type": "stop"},
                    "output_token_logprobs": [[-0.1, 1, None], [-0.2, 3, None]],
                },
            }
        )
    with pytest.raises(EngineError, match="abort"):
        parse_completion(
            {
                "output_ids": [1],
                "meta_info": {"finish_reason": {"type": "abort"}, "output_token_logprobs": [[-0.1, 1, None]]},
            }
        )
    c = parse_completion(
        {
            "output_ids": [5, 2],
            "meta_info": {
                "finish_reason": {"type": "stop", "matched": 2},
                "output_token_logprobs": [[-0.5, 5, None], [-0.25, 2, None]],
            },
        }
    )
    assert (c.token_ids, c.logprobs, c.finish_reason) == ([5, 2], [-0.5, -0.25], "stop")


def test_rollout_config_reaches_the_client(tmp_path):
    """Every rollout.* timeout and limit reaches the engine the RL loop builds (the old
    rollout.request_timeout_s never reached the generate timeout)."""
    from megatron_klear.config import load_config
    from megatron_klear.rollout.factory import make_engine

    with fake_worker(tmp_path) as (url, _, _):
        cfg = load_config(
            None,
            [
                "rollout.engine=sglang",
                f"rollout.urls=[{url}]",
                "rollout.generate_timeout_s=123",
                "rollout.control_timeout_s=7",
                "rollout.weight_update_timeout_s=99",
                "rollout.max_concurrent_requests=3",
                "rollout.request_granularity=sample",
                "rollout.max_retries=4",
                "rollout.health_check_interval_s=2",
                "rollout.health_check_timeout_s=3",
                "rollout.health_failure_threshold=5",
                "rollout.send_seed=true",
                f"rollout.workers=[{url}]",
            ],
        )
        engine = make_engine(cfg.rollout)
    assert (engine.generation.generate_timeout, engine.transport.timeout, engine.wire.weight_update_timeout) == (
        123,
        7,
        99,
    )
    assert (
        engine.generation.max_concurrent_requests,
        engine.generation.request_granularity,
        engine.generation.max_retries,
    ) == (3, "sample", 4)
    assert (
        engine.generation.health_check_interval,
        engine.transport.health_check_timeout,
        engine.generation.health_failure_threshold,
    ) == (2, 3, 5)
    assert engine.generation.dialect.send_seed and engine.workers() == [url]


def test_a_failed_disk_update_is_reported_not_the_resume_after_it(tmp_path):
    """Issue 20 item 6: the /continue_generation of the cleanup used to replace the update's error."""
    with fake_worker(tmp_path, fail_post="/update_weights_from_disk,/continue_generation") as (url, record, _):
        client = SGLangEngine.at([url], **FAST)
        with pytest.raises(EngineError, match=r"/update_weights_from_disk failed") as e:
            client.load_from_disk("/some/dir", version=3)
    assert "/continue_generation" in " ".join(getattr(e.value, "__notes__", [])), e.value
    assert len(recorded(record, "/continue_generation")) >= 1  # the resume was still tried
