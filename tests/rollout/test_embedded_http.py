"""The embedded engine over HTTP, standing in for SGLang: a server subprocess started through the CLI
gives the in-process results; SGLang's response shapes, errors and context-length refusals; the
control routes (pause / continue / abort, weight updates, versions, info); concurrent requests
batched into one engine call with the tokens they get alone; and the real sglang-router in front
of two servers."""

import concurrent.futures
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from megatron_klear.platform.process import free_port
from megatron_klear.rollout.base import SamplingParams
from megatron_klear.rollout.embedded import EmbeddedEngine, PromptRequest, load_tokenizer
from megatron_klear.rollout.embedded.sampling import sample_seed
from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine, parse_generate_request, serve_in_thread
from tests.rollout.conftest import PROMPTS
from tests.rollout.sglang_contract import validate_generate_response


def _call(method, url, body=None, timeout=60):
    """(status, parsed JSON | text | None)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw, ctype = resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        status, raw, ctype = e.code, e.read(), e.headers.get("Content-Type", "")
    if not raw:
        return status, None
    return status, json.loads(raw) if ctype.startswith("application/json") else raw.decode()


def _post(url, body, timeout=60):
    return _call("POST", url, body, timeout)


def _get(url, timeout=60):
    return _call("GET", url, None, timeout)


def _message(payload):
    """The error text of SGLang's two 400 shapes: {"error": "..."} (contract gate) or {"error": {"message"}}."""
    err = payload["error"]
    return err if isinstance(err, str) else err["message"]


def _tensors(path):
    from megatron_klear.checkpoint.hf_io import HFReader

    reader = HFReader(path)
    return [(k, reader.get(k)) for k in sorted(reader.keys())]


def _serve(engine, **kwargs):
    server, url = serve_in_thread(engine, **kwargs)
    return server, url


def _stop(server):
    server.shutdown()
    server.server_close()


# ------------------------------------------------------------------------------------------------
# the CLI server subprocess
# ------------------------------------------------------------------------------------------------
def test_server_subprocess_matches_in_process(tiny_hf, other_hf, exec_standin_launch):
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12, stop_token_ids=[40, 41], seed=9)
    local = EmbeddedEngine.from_pretrained(tiny_hf["untied"])
    want = local.generate(PROMPTS, params, n=2)
    client = EmbeddedHTTPEngine.launch(
        tiny_hf["untied"], context_length=2048, served_model_name="tiny", startup_timeout=120
    )
    try:
        assert client.health()
        info = client.model_info()
        assert info["vocab_size"] == 389 and info["eos_token_ids"] == [2] and info["served_model_name"] == "tiny"
        status, server_info = _get(client.url + "/server_info")
        assert status == 200 and server_info["context_length"] == server_info["max_context_length"] == 2048
        assert _get(client.url + "/v1/models")[1]["data"][0]["max_model_len"] == 2048
        # one batch request with a sampling_seed: exactly the in-process engine's samples
        sp = {
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "max_new_tokens": 12,
            "stop_token_ids": [40, 41],
            "n": 2,
            "sampling_seed": 9,
        }
        status, outs = _post(
            client.url + "/generate", {"input_ids": PROMPTS, "sampling_params": sp, "return_logprob": True}
        )
        assert status == 200 and len(outs) == len(PROMPTS) * 2
        for i, samples in enumerate(want):
            for j, c in enumerate(samples):
                out = outs[i * 2 + j]
                assert out["output_ids"] == c.token_ids
                assert out["meta_info"]["finish_reason"]["type"] == c.finish_reason
                assert [p[0] for p in out["meta_info"]["output_token_logprobs"]] == pytest.approx(c.logprobs, abs=1e-6)
                assert isinstance(out["text"], str)  # the CLI server loads the model's tokenizer
        validate_generate_response(outs)
        # the SGLang client against it: reproducible with a seed, greedy at temperature 0
        got = client.generate(PROMPTS, params, n=2)
        assert [[c.token_ids for c in s] for s in client.generate(PROMPTS, params, n=2)] == [
            [c.token_ids for c in s] for s in got
        ]
        greedy = local.generate(PROMPTS, SamplingParams(top_k=1, max_new_tokens=3), n=1)
        status, one = _post(
            client.url + "/generate",
            {
                "input_ids": PROMPTS[0],
                "return_logprob": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": 3},
            },
        )
        assert status == 200 and isinstance(one, dict) and one["output_ids"] == greedy[0][0].token_ids
        # weights through a temporary safetensors directory and /update_weights_from_disk
        other = EmbeddedEngine.from_pretrained(other_hf)
        client.update_weights(_tensors(other_hf), version=5)
        assert client.model_info()["weight_version"] == "5"
        status, outs = _post(client.url + "/generate", {"input_ids": PROMPTS, "sampling_params": sp})
        assert [o["output_ids"] for o in outs] == [c.token_ids for s in other.generate(PROMPTS, params, n=2) for c in s]
        assert all(o["meta_info"]["weight_version"] == "5" for o in outs)
        with pytest.raises(RuntimeError, match="unknown tensor 'nope.weight'"):
            client.update_weights([("nope.weight", _tensors(other_hf)[0][1])])
    finally:
        client.close()
    assert not client.health()


def _parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_a_server_from_the_tests_fork_server_is_the_clis_server(tiny_hf, tmp_path, standin_fork_server):
    """The tests fork their stand-in servers from one warm process (tests/rollout/standin_zygote.py):
    such a server answers as one started as a new interpreter (python -m ...) with the same flags
    and environment does: the same answers to a seeded batch, the same info, the caller's working
    directory and environment; it ends with the exit status the interpreter's would (SIGTERM,
    SIGKILL, a missing model)."""
    from megatron_klear.rollout.sglang_standin import launcher
    from tests.rollout.standin_zygote import ForkedProcess

    if standin_fork_server is None:
        pytest.skip("KLEAR_TEST_EXEC_STANDIN=1: no fork server in this run")

    env = {"SGLANG_EXPOSE_OWN_ENV_VARS": "true", "SGLANG_TEST_ONLY_MARK": "forked-or-not"}
    sp = {"temperature": 0.7, "top_k": 20, "max_new_tokens": 8, "n": 2, "sampling_seed": 3}
    body = {"input_ids": PROMPTS, "sampling_params": sp, "return_logprob": True}
    seen = {}
    for how in ("interpreter", "fork server"):
        start = launcher.start_server_process if how == "interpreter" else standin_fork_server.start
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(EmbeddedHTTPEngine, "start_process", staticmethod(start))
            client = EmbeddedHTTPEngine.launch(tiny_hf["tied"], served_model_name="tiny", env=env, startup_timeout=120)
        proc = client._process
        try:
            assert isinstance(proc, ForkedProcess) == (how == "fork server")
            parent = _parent_pid(proc.pid)
            assert (parent == os.getpid()) == (how == "interpreter"), (how, parent)
            assert os.readlink(f"/proc/{proc.pid}/cwd") == os.getcwd()
            status, info = _get(client.url + "/server_info")
            assert status == 200
            outs = _post(client.url + "/generate", body)[1]
            seen[how] = {
                "model_info": client.model_info(),
                "env_vars": info["internal_states"][0]["env_vars"],
                "generated": [(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in outs],
            }
        finally:
            client.close()
        seen[how]["terminated"] = proc.returncode
    assert seen["fork server"] == seen["interpreter"]
    assert seen["interpreter"]["env_vars"]["SGLANG_TEST_ONLY_MARK"] == "forked-or-not"
    assert len(seen["interpreter"]["generated"]) == len(PROMPTS) * 2
    # SIGKILL: the status Popen gives; a model that is not there: the launch names exit status 1
    client = EmbeddedHTTPEngine.launch(tiny_hf["tied"], startup_timeout=120)
    proc = client._process
    proc.kill()
    assert proc.wait(timeout=10) == -9
    client.close()
    assert not client.health()
    with pytest.raises(RuntimeError, match=r"exited with code 1 before serving(.|\n)*no-such-model"):
        EmbeddedHTTPEngine.launch(str(tmp_path / "no-such-model"), startup_timeout=120)


# ------------------------------------------------------------------------------------------------
# an in-process server (no tokenizer: responses carry no text)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def thread_server(tiny_hf):
    engine = EmbeddedEngine.from_pretrained(tiny_hf["untied"])
    server, url = _serve(engine)
    yield engine, url, server
    _stop(server)


def test_response_shapes_and_order(thread_server):
    engine, url, _ = thread_server
    sp = {"temperature": 1.0, "max_new_tokens": 5, "n": 2, "sampling_seed": 3, "stop_token_ids": [7]}
    status, outs = _post(
        url + "/generate", {"input_ids": PROMPTS, "sampling_params": sp, "return_logprob": True, "rid": "req"}
    )
    assert status == 200 and len(outs) == len(PROMPTS) * 2
    want = engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, stop_token_ids=[7], seed=3), n=2)
    for i, samples in enumerate(want):  # prompt-major: sample j of prompt i at i * n + j
        for j, c in enumerate(samples):
            out = outs[i * 2 + j]
            assert out["output_ids"] == c.token_ids and "text" not in out  # no tokenizer here
            assert out["meta_info"]["id"] == f"req_{i * 2 + j}"
            assert out["meta_info"]["prompt_tokens"] == len(PROMPTS[i])
            assert out["meta_info"]["completion_tokens"] == len(c.token_ids)
            assert [p[0] for p in out["meta_info"]["output_token_logprobs"]] == c.logprobs
            assert out["meta_info"]["output_token_logprobs"][0][2] is None
            reason = out["meta_info"]["finish_reason"]
            assert reason == (
                {"type": "stop", "matched": c.token_ids[-1]}
                if c.finish_reason == "stop"
                else {"type": "length", "length": 5}
            )
    # without return_logprob there are no log-probs; a single prompt with n > 1 answers a list
    status, outs = _post(url + "/generate", {"input_ids": PROMPTS[1], "sampling_params": {"n": 2, "max_new_tokens": 2}})
    assert status == 200 and isinstance(outs, list) and len(outs) == 2
    assert "output_token_logprobs" not in outs[0]["meta_info"]
    assert _get(url + "/health") == (200, None)


@pytest.mark.parametrize(
    "body, message",
    [
        ({"text": "hello"}, "field 'text'='hello' is not supported.*send token ids"),
        ({"input_ids": [1, 2], "stream": True}, "field 'stream'=True"),
        ({"input_ids": [1, 2], "logprob_start_len": 0}, "field 'logprob_start_len'=0"),
        ({"input_ids": [1, 2], "return_entropy": True}, "field 'return_entropy'=True"),
        ({"input_ids": [1, 2], "sampling_params": {"stop": ["</s>"]}}, r"sampling_params.stop=\['</s>'\]"),
        (
            {"input_ids": [1, 2], "sampling_params": {"repetition_penalty": 2.5}},
            r"repetition_penalty must be in \(0, 2\] \(1.0 = no penalty\), got 2.5.",
        ),
        ({"input_ids": [1, 2], "sampling_params": {"min_new_tokens": 2}}, "sampling_params.min_new_tokens=2"),
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 1.5}}, r"top_p must be in \(0, 1\], got 1.5."),
        ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, r"top_k must be -1 \(disable\) or at least 1, got 0."),
        (
            {"input_ids": [1, 2], "sampling_params": {"temperature": -1}},
            "temperature must be a non-negative finite number",
        ),
        (
            {"input_ids": [[1, 2], [3]], "sampling_params": [{"n": 1}, {"n": 2}]},
            "parallel_sample_num should be the same",
        ),
        ({"input_ids": [[1, 2], [3]], "rid": ["a"]}, "rids length mismatch"),
        ({"input_ids": [1, 999]}, r"holds 999, not a token id of the model's vocabulary \[0, 389\)"),
        ({"sampling_params": {}}, "Either text, input_ids or input_embeds should be provided"),
    ],
)
def test_requests_we_cannot_honour_are_400_naming_the_field(thread_server, body, message):
    _, url, _ = thread_server
    status, payload = _post(url + "/generate", body)
    assert status == 400 and isinstance(payload["error"], dict), payload  # SGLang's {"error": {"message"}}
    assert re.search(message, payload["error"]["message"]), payload


def test_per_prompt_sampling_params_and_rids(thread_server):
    engine, url, _ = thread_server
    body = {
        "input_ids": PROMPTS[:2],
        "rid": ["a", "b"],
        "return_logprob": True,
        "sampling_params": [
            {"max_new_tokens": 4, "sampling_seed": 1, "temperature": 0.5},
            {"max_new_tokens": 2, "sampling_seed": 2, "top_k": 3},
        ],
    }
    status, outs = _post(url + "/generate", body)
    assert status == 200 and [o["meta_info"]["id"] for o in outs] == ["a", "b"]
    # each prompt as its own request: prompt i of the batch draws from sample_seed(seed_i, i, 0)
    a = engine.generate_with_seeds(
        [PROMPTS[0]], SamplingParams(temperature=0.5, max_new_tokens=4), [[sample_seed(1, 0, 0)]]
    )
    b = engine.generate_with_seeds([PROMPTS[1]], SamplingParams(top_k=3, max_new_tokens=2), [[sample_seed(2, 1, 0)]])
    assert [o["output_ids"] for o in outs] == [a[0][0].token_ids, b[0][0].token_ids]
    assert len(outs[1]["output_ids"]) == 2


def test_update_weights_from_disk_is_all_or_nothing(tiny_hf, other_hf, tmp_path):
    from megatron_klear.checkpoint.hf_io import HFWriter

    engine = EmbeddedEngine.from_pretrained(tiny_hf["untied"])
    server, url = _serve(engine)
    try:
        body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 6, "sampling_seed": 4}}
        before = _post(url + "/generate", body)[1]["output_ids"]
        status, payload = _post(url + "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
        assert status == 400 and payload["success"] is False and "Rolling back" in payload["message"]
        # a checkpoint of the other model with its last tensor replaced by a wrong shape: nothing is copied
        tensors = _tensors(other_hf)
        writer = HFWriter(str(tmp_path / "bad"), max_shard_bytes=1 << 20)
        for k, v in tensors[:-1]:
            writer.add(k, v)
        writer.add(tensors[-1][0], torch.zeros(3))
        bad = writer.finish(config={"note": "test"})
        status, payload = _post(url + "/update_weights_from_disk", {"model_path": bad, "weight_version": "7"})
        assert status == 400 and payload == {"success": False, "num_paused_requests": 0, "message": payload["message"]}
        assert f"tensor '{tensors[-1][0]}' has shape (3,)" in payload["message"]
        assert _post(url + "/generate", body)[1]["output_ids"] == before  # the old weights, whole
        assert _get(url + "/model_info")[1]["weight_version"] == "default"
        status, payload = _post(
            url + "/update_weights_from_disk",
            {"model_path": other_hf, "weight_version": "7", "flush_cache": True, "abort_all_requests": False},
        )
        assert status == 200 and payload["success"] is True and payload["num_paused_requests"] == 0
        other = EmbeddedEngine.from_pretrained(other_hf).generate(
            [PROMPTS[0]], SamplingParams(max_new_tokens=6, seed=4)
        )
        out = _post(url + "/generate", body)[1]
        assert out["output_ids"] == other[0][0].token_ids and out["meta_info"]["weight_version"] == "7"
        status, payload = _post(url + "/update_weight_version", {"new_version": "v8"})
        assert status == 200 and payload == {
            "success": True,
            "message": "Weight version updated to v8",
            "new_version": "v8",
        }
        assert _get(url + "/model_info")[1]["weight_version"] == "v8"
    finally:
        _stop(server)


def test_info_routes_have_sglang_shapes(thread_server, sglang_contract):
    engine, url, server = thread_server
    status, info = _get(url + "/model_info")
    assert status == 200 and _get(url + "/get_model_info")[1] == info
    sglang_contract.GetModelInfoResponse.from_json_value(info)
    assert info["model_path"] == engine.model_path and info["is_generation"] is True and info["context_length"] == 4096
    status, sinfo = _get(url + "/server_info")
    sglang_contract.GetServerInfoResponse.from_json_value(sinfo)
    assert sinfo["context_length"] == sinfo["max_context_length"] == engine.context_length == 4096
    assert sinfo["version"] == "0.5.23" and "max_total_num_tokens" in sinfo
    status, models = _get(url + "/v1/models")
    assert status == 200 and models["object"] == "list"
    card = models["data"][0]
    assert card["object"] == "model" and card["id"] == engine.model_path and card["max_model_len"] == 4096
    assert _get(url + "/v1/models/" + card["id"])[1]["max_model_len"] == 4096
    assert _get(url + "/v1/models/nope")[0] == 404
    status, text = _post(url + "/flush_cache", {})
    assert status == 200 and text.startswith("Cache flushed")
    assert _get(url + "/nope") == (404, {"detail": "Not Found"})
    with pytest.raises(RuntimeError, match="HTTP 404"):
        EmbeddedHTTPEngine(url, timeout=5).transport.request("GET", "/nope")


def test_repetition_penalty_sent_by_the_sglang_client_is_sglangs_rule(thread_server, tiny_hf):
    """The SGLang client sends the repetition penalty and the stand-in applies SGLang's rule: greedy
    tokens equal a float64 reference in which each token the RESPONSE already holds (not the
    prompt's: SGLang's penalizer gathers output tokens only) has its logit divided by the penalty
    when positive, multiplied when negative. A prompt whose tokens the plain response repeats tells
    this rule from vLLM's, which counts the prompt too."""
    from transformers import AutoModelForCausalLM

    from megatron_klear.rollout.sglang import SGLangEngine

    _, url, _ = thread_server
    client = SGLangEngine.at([url], control_timeout_s=30)
    penalty, n = 1.8, 10
    model = AutoModelForCausalLM.from_pretrained(tiny_hf["untied"], dtype=torch.float64).eval()

    def greedy(prompt: list, count_prompt: bool) -> list:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
                seen = sorted(set(ids if count_prompt else ids[len(prompt) :]))
                if seen:
                    z = logits[seen]
                    logits[seen] = torch.where(z > 0, z / penalty, z * penalty)
                ids.append(int(logits.argmax()))
        return ids[len(prompt) :]

    # a prompt on which the two rules differ (its tokens come back in the response)
    candidates = [[5, 17, 33, 60, 7] + [t] * 3 for t in range(40, 80)]
    prompt = next(q for q in candidates if greedy(q, False) != greedy(q, True))
    out = client.generate([prompt], SamplingParams(top_k=1, max_new_tokens=n, repetition_penalty=penalty))[0][0]
    plain = client.generate([prompt], SamplingParams(top_k=1, max_new_tokens=n))[0][0]
    sglang_rule = greedy(prompt, False)
    assert out.token_ids == sglang_rule[: len(out.token_ids)] and len(out.token_ids) >= 2
    assert out.token_ids != plain.token_ids[: len(out.token_ids)]  # (the penalty changed something)


def test_parse_generate_request_defaults():
    call = parse_generate_request({"input_ids": [4, 5]})
    assert call.prompts == [[4, 5]] and call.single and call.n == 1 and not call.return_logprob
    p = call.params[0]
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens, p.seed) == (1.0, 1.0, -1, 128, None)
    call = parse_generate_request({"input_ids": [[4]], "sampling_params": {"max_new_tokens": None, "top_k": 1 << 30}})
    assert call.params[0].max_new_tokens is None and call.params[0].top_k == -1 and not call.single


def test_client_timeouts_and_unreachable_server():
    with socket.socket() as s:  # a port that accepts connections but never answers
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        client = EmbeddedHTTPEngine(f"http://127.0.0.1:{s.getsockname()[1]}", timeout=0.5)
        with pytest.raises(RuntimeError, match=r"0.5 s"):
            client.model_info()
    assert not EmbeddedHTTPEngine("http://127.0.0.1:9", timeout=1).health()


# ------------------------------------------------------------------------------------------------
# HTTP behaviour (FastAPI + uvicorn): methods, the body limit, kept-alive connections
# ------------------------------------------------------------------------------------------------
def _raw(url, method, path, body=b"", headers=()):
    """(status, parsed JSON | None) over a fresh http.client connection (headers sent as given)."""
    conn = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=30)
    try:
        conn.putrequest(method, path)
        for k, v in headers:
            conn.putheader(k, v)
        conn.endheaders(body or None)
        r = conn.getresponse()
        raw = r.read()
        return r.status, json.loads(raw) if raw else None
    finally:
        conn.close()


def test_methods_and_unknown_routes_answer_as_sglangs_fastapi_server(thread_server):
    _, url, _ = thread_server
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2, "sampling_seed": 1}}
    assert _call("PUT", url + "/generate", body)[0] == 200  # /generate takes POST and PUT
    assert _get(url + "/generate") == (405, {"detail": "Method Not Allowed"})
    assert _post(url + "/health", {}) == (405, {"detail": "Method Not Allowed"})
    assert _get(url + "/weights_checker")[1]["success"] is True  # GET and POST
    for path in ("/health/", "/docs", "/openapi.json", "/redoc"):  # no redirects, no docs routes
        assert _get(url + path) == (404, {"detail": "Not Found"}), path
    # bodies are decoded by the server (never FastAPI's 422): not JSON, or over the 1 GiB limit, is a 400
    status, payload = _raw(
        url, "POST", "/generate", b"{nope", [("Content-Type", "application/json"), ("Content-Length", "5")]
    )
    assert status == 400 and payload["error"]["message"].startswith("the request body is not valid JSON")
    status, payload = _raw(url, "POST", "/pause_generation", headers=[("Content-Length", str((1 << 30) + 1))])
    assert status == 400 and "over the 1073741824-byte limit" in payload["error"]["message"], payload


def test_kept_alive_connections_have_tcp_nodelay_survive_errors_and_close_on_shutdown(tiny_hf, monkeypatch):
    engine = EmbeddedEngine.from_pretrained(tiny_hf["untied"])
    server, url = _serve(engine)
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)

    def ask(method, path, body=None):
        conn.request(
            method, path, body=None if body is None else json.dumps(body), headers={"Content-Type": "application/json"}
        )
        r = conn.getresponse()
        raw = r.read()
        return r.status, json.loads(raw) if raw else None

    try:
        assert ask("GET", "/health") == (200, None)
        (served,) = server.uvicorn.server_state.connections  # one connection serves every request below
        sock = served.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)  # no 40 ms delayed-ACK stall

        def broken(*args, **kwargs):
            raise RuntimeError("boom")

        monkeypatch.setattr(engine, "forward", broken)
        assert ask("POST", "/generate", {"input_ids": [1, 2]}) == (500, {"error": {"message": "RuntimeError: boom"}})
        assert ask("GET", "/ready") == (200, None)  # the same connection, still open
        assert set(server.uvicorn.server_state.connections) == {served}
        t0 = time.monotonic()
        _stop(server)
        assert time.monotonic() - t0 < 3.0
        assert conn.sock.recv(1) == b""  # the idle kept-alive connection was closed by the server
    finally:
        conn.close()
        _stop(server)


def test_an_idle_connection_closes_after_sglangs_keep_alive_and_the_client_lets_go_first(tiny_hf, monkeypatch):
    """SGLang 0.5.23 closes a kept-alive connection idle for SGLANG_TIMEOUT_KEEP_ALIVE seconds (5); the
    client's pools drop theirs sooner, so a request is never sent on a connection being closed."""
    from megatron_klear.rollout.servers.transport import CLIENT_KEEPALIVE_S

    engine = EmbeddedEngine.from_pretrained(tiny_hf["untied"])
    server, _ = _serve(engine)
    try:
        assert server.uvicorn.config.timeout_keep_alive == 5 and CLIENT_KEEPALIVE_S < 5
    finally:
        _stop(server)
    monkeypatch.setenv("SGLANG_TIMEOUT_KEEP_ALIVE", "1")
    server, _ = _serve(engine)
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    try:
        conn.request("GET", "/ready")
        assert conn.getresponse().read() == b""
        t0 = time.monotonic()
        assert conn.sock.recv(1) == b""  # closed by the server once idle for a second
        assert 0.8 < time.monotonic() - t0 < 5
    finally:
        conn.close()
        _stop(server)


# ------------------------------------------------------------------------------------------------
# context length
# ------------------------------------------------------------------------------------------------
def test_context_length_as_sglang(tiny_hf):
    model = EmbeddedEngine.from_pretrained(tiny_hf["untied"]).model
    with pytest.raises(
        ValueError,
        match=r"User-specified context_length \(5000\) is greater than the derived "
        r"context_length \(4096\)",
    ):
        EmbeddedEngine(model, context_length=5000)
    engine = EmbeddedEngine(model, context_length=16)
    too_long = "The input (16 tokens) is longer than the model's context length (16 tokens)."
    over = (
        "Requested token count exceeds the model's maximum context length of 16 tokens. You requested a total "
        "of 17 tokens: 10 tokens from the input messages and 7 tokens for the completion. Please reduce the "
        "number of tokens in the input messages or the completion to fit within the limit."
    )
    with pytest.raises(ValueError) as e:  # the in-process engine refuses with the same text
        engine.generate([[5] * 16], SamplingParams(max_new_tokens=1))
    assert str(e.value) == too_long
    with pytest.raises(ValueError) as e:
        engine.generate([[5] * 10], SamplingParams(max_new_tokens=7))
    assert str(e.value) == over
    assert len(engine.generate([[5] * 10], SamplingParams(max_new_tokens=6, top_k=1))[0][0].token_ids) <= 6
    server, url = _serve(engine)
    try:
        status, payload = _post(url + "/generate", {"input_ids": [5] * 16, "sampling_params": {"max_new_tokens": 1}})
        assert status == 400 and payload == {"error": {"message": too_long}}
        status, payload = _post(
            url + "/generate", {"input_ids": [[1], [5] * 10], "sampling_params": {"max_new_tokens": 7}}
        )
        assert status == 400 and payload == {"error": {"message": over}}
        # max_new_tokens null: up to the context (SGLang: context - 1 - prompt), never refused for length
        status, out = _post(
            url + "/generate", {"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": None, "ignore_eos": True}}
        )
        assert (
            status == 200
            and len(out["output_ids"]) == 5
            and out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
        )
        assert _get(url + "/v1/models")[1]["data"][0]["max_model_len"] == 16
    finally:
        _stop(server)


# ------------------------------------------------------------------------------------------------
# EOS of a base checkpoint (Qwen3-8B-Base's layout)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_hf(tmp_path_factory):
    from megatron_klear.models.tiny import make_tiny_qwen3

    return make_tiny_qwen3(str(tmp_path_factory.mktemp("base_hf") / "base"), seed=7, flavor="base")


def test_base_flavor_eos_stops_and_im_end_only_when_asked(base_hf):
    from megatron_klear.models.tiny import ENDOFTEXT_ID, IM_END_ID

    tokenizer = load_tokenizer(base_hf)
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    engine = EmbeddedEngine.from_pretrained(base_hf)
    assert engine.eos_token_ids == [ENDOFTEXT_ID]  # config.json, generation_config.json and the tokenizer agree
    bias = torch.zeros(engine.vocab_size)
    engine.model.lm_head.register_forward_hook(lambda module, args, out: out + bias)  # steer greedy decoding
    server, url = _serve(engine, tokenizer=tokenizer, tokenizer_path=base_hf)
    greedy = {"temperature": 0, "max_new_tokens": 5}
    try:
        bias[IM_END_ID] = 100.0  # <|im_end|> every step: not an EOS of a base model
        status, out = _post(url + "/generate", {"input_ids": [5, 6], "sampling_params": greedy})
        assert out["output_ids"] == [IM_END_ID] * 5 and out["meta_info"]["finish_reason"] == {
            "type": "length",
            "length": 5,
        }
        status, out = _post(
            url + "/generate", {"input_ids": [5, 6], "sampling_params": {**greedy, "stop_token_ids": [IM_END_ID]}}
        )
        assert out["output_ids"] == [IM_END_ID] and out["meta_info"]["finish_reason"] == {
            "type": "stop",
            "matched": IM_END_ID,
        }
        assert out["text"] == ""  # the matched stop token is trimmed from the text, as SGLang's detokenizer does
        bias[IM_END_ID], bias[ENDOFTEXT_ID] = 0.0, 100.0  # <|endoftext|>: the EOS
        status, out = _post(url + "/generate", {"input_ids": [5, 6], "sampling_params": greedy, "return_logprob": True})
        assert out["output_ids"] == [ENDOFTEXT_ID]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ENDOFTEXT_ID}
        (decoded,) = validate_generate_response(out)  # the stop shape, as SGLang's contract reads it
        assert decoded.meta_info.finish_reason.matched == ENDOFTEXT_ID
        status, out = _post(url + "/generate", {"input_ids": [5, 6], "sampling_params": {**greedy, "ignore_eos": True}})
        assert out["output_ids"] == [ENDOFTEXT_ID] * 5  # ignore_eos: SGLang's rule
    finally:
        _stop(server)


# ------------------------------------------------------------------------------------------------
# concurrent requests are batched, with the tokens they get alone
# ------------------------------------------------------------------------------------------------
def _bodies():
    """Requests with different prompts, samples, parameters and seeds (some equal, some not)."""
    out = []
    for k in range(10):
        sp = {
            "max_new_tokens": 3 + k % 4,
            "n": 1 + k % 3,
            "sampling_seed": 100 + k,
            "temperature": [1.0, 0.7, 0.0][k % 3],
            "top_k": [-1, 20][k % 2],
            "top_p": [1.0, 0.9][k // 5],
        }
        if k % 4 == 1:
            sp["stop_token_ids"] = [7, 40]
        prompt = PROMPTS[k % 3] + [k + 1]
        out.append(
            {
                "input_ids": prompt if k % 2 else [prompt, PROMPTS[(k + 1) % 3]],
                "sampling_params": sp,
                "return_logprob": True,
                "rid": f"r{k}",
            }
        )
    return out


def test_concurrent_requests_are_batched_with_the_tokens_they_get_alone(tiny_hf):
    engine = EmbeddedEngine.from_pretrained(tiny_hf["untied"])
    bodies = _bodies()
    rows = [
        (len(b["input_ids"]) if isinstance(b["input_ids"][0], list) else 1) * b["sampling_params"]["n"] for b in bodies
    ]
    server, url = _serve(engine)
    try:
        alone = [_post(url + "/generate", b)[1] for b in bodies]  # one at a time: one prefill wave each
        sched = server.state.scheduler
        assert sched.batches == len(bodies)
        # the same requests arriving together: hold the engine, queue them all, let go
        assert _post(url + "/pause_generation", {"mode": "in_place"})[0] == 200
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            futures = [pool.submit(_post, url + "/generate", b) for b in bodies]
            deadline = time.monotonic() + 30
            while sched.stats()["num_waiting_reqs"] < sum(rows) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert sched.stats()["num_waiting_reqs"] == sum(rows)  # every sample is a request (SGLang's)
            assert _post(url + "/continue_generation", {})[0] == 200
            together = [f.result()[1] for f in futures]
        assert sched.batches == len(bodies) + 1  # all ten in one prefill wave
    finally:
        _stop(server)
    # the same tokens, finish reasons and ids; the log-probs up to float rounding (the forward's
    # batch differs)
    for a, b in zip(alone, together):
        for x, y in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
            assert x["output_ids"] == y["output_ids"]
            assert {**x["meta_info"], "e2e_latency": 0, "output_token_logprobs": 0} == {
                **y["meta_info"],
                "e2e_latency": 0,
                "output_token_logprobs": 0,
            }
            lx, ly = x["meta_info"]["output_token_logprobs"], y["meta_info"]["output_token_logprobs"]
            assert [p[1] for p in lx] == [p[1] for p in ly]
            assert [p[0] for p in lx] == pytest.approx([p[0] for p in ly], abs=1e-5)
    assert len({len(ids) for r in together for ids in _ids(r)}) >= 3
    # arriving together at an idle server (no pause): they gather into few batches (the batch window)
    server, url = _serve(EmbeddedEngine(engine.model), batch_window=2.0)
    try:
        server.state.scheduler.settle = 0.1  # generous, for a loaded machine
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            gathered = [r[1] for r in pool.map(lambda b: _post(url + "/generate", b), bodies)]
        assert server.state.scheduler.batches <= 3, list(server.state.scheduler.history)
    finally:
        _stop(server)
    assert [_ids(r) for r in gathered] == [_ids(r) for r in alone]
    # a server decoding at most 4 sequences at a time (--max-running-requests): rows join as others
    # finish, and get the same tokens again
    server, url = _serve(EmbeddedEngine(engine.model, max_running_requests=4))
    try:
        sched = server.state.scheduler
        assert _post(url + "/pause_generation", {"mode": "retract"})[0] == 200
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            futures = [pool.submit(_post, url + "/generate", b) for b in bodies]
            while sched.stats()["num_waiting_reqs"] < sum(rows):
                time.sleep(0.01)
            _post(url + "/continue_generation", {})
            small = [f.result()[1] for f in futures]
        sizes = list(sched.history)
    finally:
        _stop(server)
    assert [_ids(r) for r in small] == [_ids(r) for r in alone]
    assert sum(r for _, r in sizes) == sum(rows) and len(sizes) > sum(rows) // 4
    assert all(r <= 4 for _, r in sizes) and max(jobs for jobs, _ in sizes) > 1, sizes
    assert any(r < 4 for _, r in sizes[1:]), sizes  # rows joined a running batch


def _ids(response):
    return [o["output_ids"] for o in (response if isinstance(response, list) else [response])]


# ------------------------------------------------------------------------------------------------
# pause / continue / abort, health during generation
# ------------------------------------------------------------------------------------------------
LONG = {"max_new_tokens": 3000, "ignore_eos": True, "sampling_seed": 5}  # seconds of decoding: must be cut short


@pytest.fixture()
def control_server(tiny_hf, other_hf):
    engine = EmbeddedEngine.from_pretrained(tiny_hf["untied"], context_length=4096)
    server, url = _serve(engine)
    yield engine, url, server
    _post(url + "/continue_generation", {})
    _post(url + "/abort_request", {"abort_all": True})
    _stop(server)


def _start(url, body):
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(_post, url + "/generate", body, 120)
    pool.shutdown(wait=False)
    return future


def _wait_steps(engine, steps, timeout=30):
    deadline = time.monotonic() + timeout
    while engine.decode_steps < steps and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine.decode_steps >= steps


def _hold_until_paused(monkeypatch, engine, server, after_steps, timeout=60):
    """From forward number ``after_steps`` on, the engine waits for /pause_generation to have arrived
    before each forward: a short request cannot finish before the test pauses it, however slow the
    machine (without this, a loaded CI machine could run all its tokens between two lines of the
    test). Once the pause has arrived, forwards run freely (after continue too)."""
    forward, scheduler, pause_arrived = engine.forward, server.state.scheduler, threading.Event()
    pause = scheduler.pause

    def recorded_pause(mode):
        pause_arrived.set()
        return pause(mode)

    def held_forward(*args, **kwargs):
        if engine.decode_steps >= after_steps:
            pause_arrived.wait(timeout)
        return forward(*args, **kwargs)

    monkeypatch.setattr(scheduler, "pause", recorded_pause)
    monkeypatch.setattr(engine, "forward", held_forward)


def test_health_answers_during_generation_and_abort_request_ends_it(control_server):
    engine, url, server = control_server
    start = engine.decode_steps
    running = _start(url, {"input_ids": PROMPTS[0], "sampling_params": LONG, "rid": "long-1"})
    _wait_steps(engine, start + 5)
    t0 = time.monotonic()
    assert _get(url + "/health", timeout=5) == (200, None)
    assert time.monotonic() - t0 < 1.0 and not running.done()
    assert _get(url + "/health_generate", timeout=30)[0] == 200  # the engine is making progress
    assert _post(url + "/abort_request", {"rid": "long-1"}) == (200, None)
    status, out = running.result(timeout=60)
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < LONG["max_new_tokens"] and out["meta_info"]["id"] == "long-1"
    validate_generate_response(out)


def test_a_short_request_sent_while_a_long_one_decodes_joins_it_and_finishes_first(control_server):
    engine, url, server = control_server
    start = engine.decode_steps
    long = _start(url, {"input_ids": PROMPTS[0], "sampling_params": LONG, "rid": "long-2"})
    _wait_steps(engine, start + 5)
    joined = engine.decode_steps
    # ignore_eos: an unseeded sample of the tiny model may be its EOS (id 2) and end at one token
    short = {"max_new_tokens": 4, "ignore_eos": True}
    status, out = _post(url + "/generate", {"input_ids": PROMPTS[1], "sampling_params": short})
    assert status == 200 and len(out["output_ids"]) == 4
    # answered after a few steps of the running batch (it joined it), while the long one still runs
    assert not long.done() and engine.decode_steps - joined < 40
    assert server.state.scheduler.stats()["num_running_reqs"] == 1
    _post(url + "/abort_request", {"rid": "long-2"})
    assert long.result(timeout=60)[1]["meta_info"]["finish_reason"]["type"] == "abort"


def test_pause_abort_ends_running_requests_and_holds_new_ones(control_server):
    engine, url, server = control_server
    start = engine.decode_steps
    running = _start(url, {"input_ids": PROMPTS[1], "sampling_params": LONG})
    _wait_steps(engine, start + 5)
    assert _post(url + "/pause_generation", {"mode": "abort"}) == (
        200,
        {"message": "Generation paused successfully.", "status": "ok"},
    )
    assert server.state.scheduler.stats()["num_running_reqs"] == 0  # answered once nothing runs
    status, out = running.result(timeout=30)
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) < LONG["max_new_tokens"]
    waiting = _start(url, {"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 3, "sampling_seed": 1}})
    time.sleep(0.3)
    assert not waiting.done() and _get(url + "/ready")[0] == 503
    server.state.health_check_timeout = 0.3
    assert _get(url + "/health_generate")[0] == 503  # nothing can run while paused
    assert _post(url + "/continue_generation", {})[0] == 200
    status, out = waiting.result(timeout=60)
    assert status == 200 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert _get(url + "/health_generate")[0] == 200


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_holds_running_requests_and_continue_resumes_them(control_server, other_hf, mode, monkeypatch):
    engine, url, server = control_server
    body = {
        "input_ids": PROMPTS[2],
        "sampling_params": {"max_new_tokens": 200, "ignore_eos": True, "sampling_seed": 11},
        "return_logprob": True,
    }
    want = engine.generate_requests(
        [PromptRequest(PROMPTS[2], SamplingParams(max_new_tokens=200), [sample_seed(11, 0, 0)], ignore_eos=True)]
    )[0][0]
    start = engine.decode_steps
    _hold_until_paused(monkeypatch, engine, server, start + 3)
    running = _start(url, body)
    _wait_steps(engine, start + 3)
    assert _post(url + "/pause_generation", {"mode": mode})[0] == 200
    held = engine.decode_steps
    time.sleep(0.3)
    assert engine.decode_steps == held and not running.done()  # held between two steps
    assert _post(url + "/continue_generation", {})[0] == 200
    status, out = running.result(timeout=60)
    assert status == 200 and out["output_ids"] == want.token_ids  # resumed exactly where it was
    # one forward per token, plus (retract) the recomputation of the KV cache on continue
    assert engine.decode_steps - start == 200 + (mode == "retract")
    got = [p[0] for p in out["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(want.logprobs, abs=1e-5)


def test_abort_while_paused_in_place_answers_after_continue_retracted_at_once(control_server):
    """SGLang 0.5.23: a request held in_place stays in the running batch, whose abort takes effect at
    its next decode step (after continue); a retracted one waits in the waiting queue, where an abort
    answers at once with the output the tokenizer manager received (every 50 tokens: none of a
    request that does not stream and made fewer)."""
    engine, url, server = control_server
    start = engine.decode_steps
    running = _start(url, {"input_ids": PROMPTS[0], "sampling_params": LONG, "rid": "held"})
    other = _start(url, {"input_ids": PROMPTS[1], "sampling_params": LONG, "rid": "kept", "return_logprob": True})
    _wait_steps(engine, start + 5)
    assert _post(url + "/pause_generation", {"mode": "in_place"})[0] == 200
    held = engine.decode_steps
    assert _post(url + "/abort_request", {"rid": "held"})[0] == 200
    time.sleep(0.3)
    assert engine.decode_steps == held and not running.done() and not other.done()
    assert _post(url + "/continue_generation", {})[0] == 200
    status, out = running.result(timeout=30)
    assert status == 200 and out["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    n = len(out["output_ids"])
    assert 0 < n < LONG["max_new_tokens"] and out["meta_info"]["weight_versions"] == [
        {"version": "default", "start": 0, "end": n}
    ]
    _wait_steps(engine, held + 120)
    assert _post(url + "/pause_generation", {"mode": "retract"})[0] == 200
    tokens = engine.decode_steps - start  # at least the other request's tokens so far
    assert _post(url + "/update_weight_version", {"new_version": "w2"})[0] == 200  # aborts all by default
    status, out = other.result(timeout=30)  # answered while the server stays paused
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert server.state.scheduler.paused == "retract" and "prompt_tokens" not in meta
    kept = len(out["output_ids"])
    assert kept % 50 == 0 and kept >= 50 and kept <= tokens and len(meta["output_token_logprobs"]) == kept
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": kept}]
    assert meta["weight_version"] == "default" and meta["completion_tokens"] == kept


def test_weights_update_while_paused_in_place(control_server, other_hf, monkeypatch):
    engine, url, server = control_server
    start = engine.decode_steps
    _hold_until_paused(monkeypatch, engine, server, start + 3)
    running = _start(url, {"input_ids": PROMPTS[0], "sampling_params": {**LONG, "max_new_tokens": 150}})
    _wait_steps(engine, start + 3)
    assert _post(url + "/pause_generation", {"mode": "in_place"})[0] == 200
    tokens_before = engine.decode_steps
    status, payload = _post(url + "/update_weights_from_disk", {"model_path": other_hf, "weight_version": "2"})
    assert status == 200 and payload["success"] and payload["num_paused_requests"] == 1
    assert engine.decode_steps == tokens_before and not running.done()
    assert _post(url + "/continue_generation", {})[0] == 200
    status, out = running.result(timeout=60)
    assert len(out["output_ids"]) == 150 and out["meta_info"]["weight_version"] == "2"


# ------------------------------------------------------------------------------------------------
# the real sglang-router in front of two servers
# ------------------------------------------------------------------------------------------------
def test_sglang_router_in_front_of_two_servers(tiny_hf):
    pytest.importorskip("sglang_router")
    engine = EmbeddedEngine.from_pretrained(tiny_hf["untied"])
    servers = [_serve(EmbeddedEngine(engine.model)) for _ in range(2)]
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *[u for _, u in servers],
        "--port",
        str(port),
        "--policy",
        "round_robin",
        "--log-level",
        "warn",
        "--prometheus-port",
        str(free_port()),
        "--prometheus-host",
        "127.0.0.1",
    ]
    router = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline, listed = time.monotonic() + 60, []
        while time.monotonic() < deadline and router.poll() is None:
            try:
                listed = [w["url"] for w in _get(url + "/workers", timeout=5)[1]["workers"]]
            except (OSError, TypeError, KeyError, json.JSONDecodeError):
                listed = []
            if len(listed) == 2:
                break
            time.sleep(0.2)
        assert router.poll() is None, router.stdout.read().decode()[-3000:]
        assert sorted(listed) == sorted(
            u for _, u in servers
        )  # registered after probing /health, /server_info, /model_info
        assert _get(url + "/health") == (200, "OK")
        body = {
            "input_ids": PROMPTS[0],
            "sampling_params": {"max_new_tokens": 4, "sampling_seed": 3, "n": 2},
            "return_logprob": True,
        }
        want = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=4, seed=3), n=2)
        for _ in range(4):  # round robin: both workers serve, with the same answer
            status, outs = _post(url + "/generate", body)
            assert status == 200 and [o["output_ids"] for o in outs] == [c.token_ids for c in want[0]]
            validate_generate_response(outs)
        assert [s.state.num_generate_requests for s, _ in servers] == [2, 2]
        # errors come back through the router with the worker's status and body
        status, payload = _post(url + "/generate", {"input_ids": [5] * 5000})
        assert status == 400 and "longer than the model's context length (4096 tokens)" in _message(payload)
        # sglang-router 0.3.2 re-serialises sampling_params and drops keys it does not know: an unknown
        # key that a worker alone refuses (400) passes through the router unnoticed
        status, _ = _post(url + "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1, "frob": 1}})
        assert status == 200
        assert _post(servers[0][1] + "/generate", {"input_ids": [5, 6], "sampling_params": {"frob": 1}})[0] == 400
        assert _post(url + "/update_weights_from_disk", {"model_path": "/nope"})[0] == 404  # no weight routes
    finally:
        router.terminate()
        try:
            router.wait(timeout=10)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait()
        for server, _ in servers:
            _stop(server)
