"""Behaviours of real SGLang 0.5.23 the stand-in now shows, each reproduced and then met by what the
launch commands and the client do (issue 21's divergences 1, 2, 4, 5, 7, and 6's /flush_cache):

1. ``/health`` generates a token unless ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` is false
   (``srt/environ.py``, ``entrypoints/http_server.py``): on released memory that kills the server;
2. releasing ``cuda_graph`` frees nothing without ``SGLANG_MEMORY_SAVER_CUDA_GRAPH``
   (``runner_backend/full_cuda_graph_backend.py``), which ``rollout.sglang.compat`` names;
4. SGLang 0.5.23 pins torch 2.14.1: the NCCL weight sync needs the trainer on the same build;
5. ``/health`` blocks while generation is paused and answers 503 after ``SGLANG_HEALTH_CHECK_TIMEOUT``
   seconds; behind sglang-router 0.3.2's default health checks a pause leaves no worker;
7. ``--api-key`` (``srt/utils/auth.py``): the client sends ``rollout.api_key``, also through the router;
6. ``/flush_cache`` refuses a server with running requests, or waiting ones while not paused;
8. a non-streaming ``/generate`` whose client disconnects is aborted at the next slice of
   ``SGLANG_REQUEST_STATE_WAIT_TIMEOUT`` seconds (``managers/tokenizer_manager.py``,
   ``_stream_one_response``): what a trainer cancelling its generation on a stop signal relies on.
"""

import os
import re
import threading
import time

import httpx
import pytest
import torch

from megatron_klear.rollout.base import SamplingParams
from megatron_klear.rollout.sglang import EngineError, SGLangEngine, compat

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEALTH_OFF = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}
# what docs/sglang.md and examples/run_gppo_qwen3_8b.sh give colocated servers
COLOCATED_ENV = {**HEALTH_OFF, "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "true", "SGLANG_EXPOSE_OWN_ENV_VARS": "true"}
# the router flags of examples/run_gppo_qwen3_8b.sh (the client keeps the worker list itself)
SCRIPT_ROUTER_FLAGS = ("--disable-health-check",)


@pytest.fixture(autouse=True)
def _sglang_env(monkeypatch):
    """Every test starts from SGLang's defaults (in-thread servers read this process's environment)."""
    for name in (
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION",
        "SGLANG_MEMORY_SAVER_CUDA_GRAPH",
        "SGLANG_EXPOSE_OWN_ENV_VARS",
        "SGLANG_HEALTH_CHECK_TIMEOUT",
    ):
        monkeypatch.delenv(name, raising=False)


def _serve(model_dir, **kwargs):
    from megatron_klear.rollout.embedded import EmbeddedEngine
    from megatron_klear.rollout.sglang_standin import serve_in_thread

    engine = EmbeddedEngine.from_pretrained(model_dir)
    server, url = serve_in_thread(engine, batch_window=0.001, **kwargs)
    return engine, server, url


def _stop(server):
    server.shutdown()
    server.server_close()


def _info(url, **kw):
    return httpx.get(url + "/server_info", timeout=10, **kw).json()


def _gone(url, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            httpx.get(url + "/model_info", timeout=1)
        except httpx.HTTPError:
            return True
        time.sleep(0.05)
    return False


# -- 1. health generation ---------------------------------------------------------------------------
def test_health_generates_and_a_probe_on_released_memory_kills_the_server(tiny_hf):
    engine, server, url = _serve(tiny_hf["tied"], enable_memory_saver=True)
    try:
        steps = engine.decode_steps
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        assert engine.decode_steps > steps  # the probe generated a token, as SGLang's /health does
        client = SGLangEngine.at([url], control_timeout_s=30)
        client.release_memory()
        r = httpx.get(url + "/health", timeout=30)
        assert r.status_code == 503 and "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false" in r.text, r.text
        assert _gone(url)  # the server died of it, as SGLang's scheduler does
        client.close()
    finally:
        _stop(server)


def test_with_health_generation_off_a_released_server_answers_and_stays_correct(tiny_hf, monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
    engine, server, url = _serve(tiny_hf["tied"], enable_memory_saver=True)
    client = SGLangEngine.at([url], control_timeout_s=30)
    try:
        before = client.probe(url, [5, 17, 3], 6)
        steps = engine.decode_steps
        assert httpx.get(url + "/health", timeout=10).status_code == 200 and engine.decode_steps == steps
        client.release_memory()
        for _ in range(3):
            assert httpx.get(url + "/health", timeout=10).status_code == 200  # no generation: nothing faults
        client.resume_memory(["weights"])
        client.load_from_disk(tiny_hf["tied"], version=2)
        client.resume_memory(["kv_cache", "cuda_graph"])
        after = client.probe(url, [5, 17, 3], 6)
        assert after.token_ids == before.token_ids and after.logprobs == pytest.approx(before.logprobs, abs=1e-5)
    finally:
        client.close()
        _stop(server)


def _hold_forward(engine, monkeypatch):
    """The engine's next forward waits for ``go``; ``started`` is set once it is under way."""
    started, go = threading.Event(), threading.Event()
    forward = engine.forward

    def held(*args, **kwargs):
        started.set()
        go.wait(30)
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine, "forward", held)
    return started, go


def test_a_probe_in_flight_trips_the_release(tiny_hf, monkeypatch):
    """SGLang's release asserts an idle scheduler; a health generation running is not idle."""
    engine, server, url = _serve(tiny_hf["tied"], enable_memory_saver=True)
    started, go = _hold_forward(engine, monkeypatch)
    probe = {}
    t = threading.Thread(target=lambda: probe.update(r=httpx.get(url + "/health", timeout=30)))
    t.start()
    try:
        assert started.wait(30)
        busy = httpx.post(url + "/release_memory_occupation", json={}, timeout=10)
        assert busy.status_code == 400 and "only when server is idle" in busy.text, busy.text
    finally:
        go.set()
        t.join()
        _stop(server)
    assert probe["r"].status_code == 200


def test_a_server_process_exits_when_probed_released(tiny_hf):
    from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine

    server = EmbeddedHTTPEngine.launch(tiny_hf["tied"], enable_memory_saver=True, startup_timeout=120)
    try:
        server.release_memory()
        with pytest.raises(httpx.HTTPError):  # 503 then exit, or the connection cut by the exit
            httpx.get(server.url + "/health", timeout=30).raise_for_status()
        server._process.wait(timeout=10)
        assert server._process.returncode == 1
    finally:
        server.close()


# -- 2. cuda_graph and the colocated servers' environment -------------------------------------------
@pytest.mark.parametrize("graph_saver", [False, True])
def test_cuda_graph_is_freed_only_with_its_variable(tiny_hf, monkeypatch, graph_saver):
    if graph_saver:
        monkeypatch.setenv("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "1")
    monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
    monkeypatch.setenv("SGLANG_EXPOSE_OWN_ENV_VARS", "true")
    _, server, url = _serve(tiny_hf["tied"], enable_memory_saver=True)
    client = SGLangEngine.at([url], control_timeout_s=30)
    try:
        client.release_memory()
        info = _info(url)
        assert info["released_memory_tags"] == ["cuda_graph", "kv_cache", "weights"]
        assert info["freed_memory_tags"] == (
            ["cuda_graph", "kv_cache", "weights"] if graph_saver else ["kv_cache", "weights"]
        )
        if graph_saver:
            compat.check_colocated_env(client)
        else:
            with pytest.raises(EngineError, match="without SGLANG_MEMORY_SAVER_CUDA_GRAPH=true"):
                compat.check_colocated_env(client)
    finally:
        client.close()
        _stop(server)


def test_the_colocated_check_names_health_generation_and_warns_when_it_cannot_tell(tiny_hf, monkeypatch):
    monkeypatch.setenv("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "true")
    _, server, url = _serve(tiny_hf["tied"], enable_memory_saver=True)
    client = SGLangEngine.at([url], control_timeout_s=30)
    try:
        with pytest.warns(UserWarning, match="SGLANG_EXPOSE_OWN_ENV_VARS=true"):
            compat.check_colocated_env(client)  # the server does not list its environment
        monkeypatch.setenv("SGLANG_EXPOSE_OWN_ENV_VARS", "true")
        assert _info(url)["internal_states"][0]["env_vars"]["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "true"
        with pytest.raises(EngineError, match="SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION unset"):
            compat.check_colocated_env(client)
        monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "no")  # EnvBool's false
        compat.check_colocated_env(client)
    finally:
        client.close()
        _stop(server)


# -- 4. one NCCL build ------------------------------------------------------------------------------
def test_the_nccl_path_needs_the_torch_sglang_pins(tiny_hf):
    from megatron_klear.config import load_config

    _, server, url = _serve(tiny_hf["tied"])
    client = SGLangEngine.at([url], control_timeout_s=30)
    try:
        assert _info(url)["version"] == "0.5.23"
        with pytest.raises(
            EngineError,
            match=r"SGLang 0\.5\.23, which pins torch 2\.14\.1.*torch 2\.4\.0\+cu121 "
            r"\(NCCL 2\.20\.5\).*torch==2\.14\.1.*weight_sync=disk",
        ):
            compat.check_nccl_build(client, trainer_torch="2.4.0+cu121", trainer_nccl="2.20.5")
        compat.check_nccl_build(client, trainer_torch="2.14.1+cu130", trainer_nccl="2.27.7")
        base = ["rollout.engine=sglang", f"rollout.urls=[{url}]", "rl.prompts=[p.jsonl]", "rollout.max_new_tokens=8"]
        r = load_config(None, base + ["rollout.sync_backend=nccl"]).rollout
        if torch.__version__.split("+")[0] != "2.14.1":
            with pytest.raises(EngineError, match=f"trainer runs torch {re.escape(torch.__version__)}"):
                compat.check_servers(client, r)
        compat.check_servers(client, r, weight_sync=False)  # evaluation: no weights pushed
        compat.check_servers(client, load_config(None, base + ["rollout.sync_backend=gloo"]).rollout)  # no NCCL
        compat.check_servers(
            client, load_config(None, base + ["rollout.weight_sync=disk", "rollout.sync_backend=nccl"]).rollout
        )
    finally:
        client.close()
        _stop(server)


def test_the_sglang_extra_pins_what_the_checks_know():
    setup = open(os.path.join(ROOT, "setup.py")).read()
    assert '"sglang==0.5.23"' in setup and '"sglang-router==0.3.2"' in setup and "sglang[srt]" not in setup
    assert compat.SGLANG_TORCH == {"0.5.23": "2.14.1"}


# -- 5. paused servers and the router's health checks -----------------------------------------------
@pytest.fixture(scope="module")
def paused_pair(tiny_hf):
    """Two in-thread servers whose health generation gives up after 1 s (SGLANG_HEALTH_CHECK_TIMEOUT)."""
    out = [_serve(tiny_hf["tied"]) for _ in range(2)]
    for _, server, _ in out:
        server.state.health_check_timeout = 1
    yield [url for _, _, url in out]
    for _, server, _ in out:
        _stop(server)


def _pause_then_generate(urls, router_flags, pause_s: float = 6.0):
    """Pause both servers for ``pause_s`` (a long disk reload, scaled down: the router probes every
    second and gives a probe 1 s); at its end the trainer's next step sends a request (no client
    retry: the default ones would only wait for the router's next probes), and generation
    continues. Returns (whether the router marked every worker unhealthy during the pause, the
    completions or the error). The request is sent just before continue rather than just after: the
    router's state is the same (a worker it dropped needs 2 passing probes to come back, up to 2
    intervals after continue: 2 minutes by default), without racing the scaled-down probes."""
    from tests.rollout.processes import router

    scaled = ("--health-check-interval-secs", "1", "--health-check-timeout-secs", "1")
    with router(urls, extra=scaled + tuple(router_flags)) as rurl:
        client = SGLangEngine.at([rurl], control_timeout_s=30, max_retries=0)
        try:
            t0 = time.monotonic()
            client.wire.pause()
            r = httpx.get(urls[0] + "/health", timeout=10)
            assert r.status_code == 503 and time.monotonic() - t0 >= 0.9  # blocked, then 503, as SGLang
            dropped = False
            while time.monotonic() - t0 < pause_s:
                listed = httpx.get(rurl + "/workers", timeout=10).json()["workers"]
                dropped = dropped or not any(w["is_healthy"] for w in listed)
                time.sleep(0.2)
            result = {}

            def generate():
                try:
                    result["out"] = client.generate([[5, 17, 3]], SamplingParams(max_new_tokens=2, seed=1), n=1)
                except EngineError as e:
                    result["out"] = e

            t = threading.Thread(target=generate)
            t.start()
            time.sleep(0.5)  # the request reaches the router (and a paused server holds it)
            client.wire.resume()
            t.join(60)
            return dropped, result["out"]
        finally:
            client.close()


def test_a_pause_behind_the_default_router_leaves_no_worker(paused_pair):
    dropped, out = _pause_then_generate(paused_pair, ())
    assert dropped and isinstance(out, EngineError) and "No available workers" in str(out), out


def test_a_pause_behind_the_launch_scripts_router_keeps_the_workers(paused_pair):
    script = open(os.path.join(ROOT, "examples", "run_gppo_qwen3_8b.sh")).read()
    assert all(flag in script for flag in SCRIPT_ROUTER_FLAGS)
    dropped, out = _pause_then_generate(paused_pair, SCRIPT_ROUTER_FLAGS)
    assert not dropped and len(out) == 1 and len(out[0][0].token_ids) == 2, out


# -- 7. --api-key -----------------------------------------------------------------------------------
def test_api_key_refusals_and_the_client_sending_the_key(tiny_hf):
    _, server, url = _serve(tiny_hf["tied"], api_key="sk-test")
    keyed, bare = (
        SGLangEngine.at([url], control_timeout_s=30, api_key="sk-test"),
        SGLangEngine.at([url], control_timeout_s=30),
    )
    try:
        r = httpx.post(url + "/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 1}}, timeout=10)
        assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"})
        assert httpx.get(url + "/health", timeout=30).status_code == 200  # health stays open, as SGLang's
        wrong = httpx.get(url + "/model_info", headers={"Authorization": "Bearer other"}, timeout=10)
        assert wrong.status_code == 401
        assert bare.health()
        with pytest.raises(EngineError, match="HTTP 401.*rollout.api_key"):
            bare.load_from_disk(tiny_hf["tied"], version=3)
        with pytest.raises(EngineError, match="401.*rollout.api_key"):
            bare.generate([[5, 17]], SamplingParams(max_new_tokens=2), n=1)
        keyed.load_from_disk(tiny_hf["tied"], version=3)  # pause, load, continue, version: all admin routes
        out = keyed.generate([[5, 17]], SamplingParams(max_new_tokens=2, top_k=1), n=1)  # (greedy: no EOS)
        assert len(out[0][0].token_ids) == 2 and keyed.members.weight_versions() == {url: "3"}
    finally:
        keyed.close()
        bare.close()
        _stop(server)


def test_an_admin_key_guards_the_admin_routes_only(tiny_hf):
    _, server, url = _serve(tiny_hf["tied"], api_key="user", admin_api_key="admin")
    try:
        user = {"Authorization": "Bearer user"}
        assert httpx.get(url + "/model_info", headers=user, timeout=10).status_code == 200
        assert httpx.post(url + "/pause_generation", json={}, headers=user, timeout=10).status_code == 401
        admin = {"Authorization": "Bearer admin"}
        assert httpx.post(url + "/pause_generation", json={}, headers=admin, timeout=10).status_code == 200
        assert httpx.post(url + "/continue_generation", json={}, headers=admin, timeout=10).status_code == 200
        assert httpx.get(url + "/model_info", headers=admin, timeout=10).status_code == 401  # normal: the API key
    finally:
        _stop(server)


def test_api_key_through_the_real_router(tiny_hf):
    """sglang-router 0.3.2 with --api-key refuses clients without the key (401, empty body) and sends
    it to the workers (its own health checks and registration calls too), which were started with
    the same key."""
    from tests.rollout.processes import router

    servers = [_serve(tiny_hf["tied"], api_key="sk-run") for _ in range(2)]
    urls = [u for _, _, u in servers]
    try:
        with router(urls, extra=SCRIPT_ROUTER_FLAGS, api_key="sk-run") as rurl:
            bare = SGLangEngine.at([rurl], control_timeout_s=30, max_retries=0, workers=urls)
            keyed = SGLangEngine.at([rurl], control_timeout_s=30, api_key="sk-run")
            try:
                with pytest.raises(EngineError, match="HTTP 401.*rollout.api_key"):
                    bare.generate([[5, 17]], SamplingParams(max_new_tokens=2), n=1)
                assert sorted(keyed.workers()) == sorted(urls)  # GET /workers needs the key too
                # greedy: a sampled first token can be EOS (then one token comes back)
                out = keyed.generate([[5, 17]], SamplingParams(max_new_tokens=2, top_k=1), n=1)
                assert len(out[0][0].token_ids) == 2
                keyed.load_from_disk(tiny_hf["tied"], version=4)  # the workers' admin routes, with the key
                assert keyed.members.weight_versions() == {u: "4" for u in urls}
            finally:
                bare.close()
                keyed.close()
    finally:
        for _, server, _ in servers:
            _stop(server)


# -- 6. /flush_cache refuses a busy server ------------------------------------------------------------
def test_flush_cache_refuses_running_or_waiting_requests_unless_paused(tiny_hf, monkeypatch):
    """SGLang 0.5.23's Scheduler.flush_cache: only when fully idle (waiting requests ignored while
    paused); 400 ``Flush cache failed.``, or with ?timeout=S after waiting S seconds for idle."""
    engine, server, url = _serve(tiny_hf["tied"])
    started, go = _hold_forward(engine, monkeypatch)
    body = {"input_ids": [5, 17], "sampling_params": {"max_new_tokens": 2}}
    done = {}
    t = threading.Thread(target=lambda: done.update(r=httpx.post(url + "/generate", json=body, timeout=60)))
    t.start()
    try:
        assert started.wait(30)
        busy = httpx.post(url + "/flush_cache", json={}, timeout=10)
        assert (busy.status_code, busy.text) == (400, "Flush cache failed.\n")
        timed = httpx.get(url + "/flush_cache", params={"timeout": "0.3"}, timeout=10)
        assert (timed.status_code, timed.text) == (400, "Timed out waiting for idle state.")
        threading.Timer(0.3, go.set).start()
        waited = httpx.get(url + "/flush_cache", params={"timeout": "20"}, timeout=30)  # becomes idle meanwhile
        assert waited.status_code == 200 and waited.text.startswith("Cache flushed.")
        t.join(60)
        assert done["r"].status_code == 200
        assert httpx.post(url + "/pause_generation", json={"mode": "abort"}, timeout=10).status_code == 200
        held_back = threading.Thread(target=lambda: httpx.post(url + "/generate", json=body, timeout=60))
        held_back.start()  # waits for continue: SGLang's tokenizer manager holds it, its scheduler is idle
        time.sleep(0.3)
        assert server.state.scheduler.stats()["num_waiting_reqs"] == 1
        assert httpx.post(url + "/flush_cache", json={}, timeout=10).status_code == 200
        assert httpx.post(url + "/continue_generation", json={}, timeout=10).status_code == 200
        held_back.join(60)
    finally:
        go.set()
        t.join(60)
        _stop(server)


def test_a_request_whose_client_disconnects_ends_on_the_server(tiny_hf, monkeypatch):
    """Divergence 8: the client gives up (a read timeout closes its connection) on a request that
    would decode 1500 tokens; the server aborts it at its next check for the client instead of
    decoding to the end, and is idle again."""
    from megatron_klear.rollout.sglang_standin import generate_route

    monkeypatch.setattr(generate_route, "DISCONNECT_POLL_S", 0.2)  # SGLang's 4 s, shortened
    engine, server, url = _serve(tiny_hf["tied"], max_running_requests=1)
    body = {"input_ids": [5, 17], "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/generate", json=body, timeout=httpx.Timeout(10, read=0.5))
        deadline = time.time() + 10
        while server.state.scheduler.stats()["num_running_reqs"] and time.time() < deadline:
            time.sleep(0.05)
        assert server.state.scheduler.stats()["num_running_reqs"] == 0
        steps = engine.decode_steps
        assert steps < 1500, steps  # cut short, not decoded to its end
        time.sleep(0.3)
        assert engine.decode_steps == steps  # and nothing decodes any more
    finally:
        _stop(server)
