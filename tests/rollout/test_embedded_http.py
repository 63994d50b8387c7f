"""The embedded engine over HTTP: a server subprocess started through the CLI, the client
(EmbeddedHTTPEngine) giving the in-process results, SGLang's response shape, weight updates from
disk, and requests the server must refuse."""
import json
import urllib.error
import urllib.request

import pytest

from megatron_klear.rollout.base import SamplingParams
from megatron_klear.rollout.embedded import EmbeddedEngine
from megatron_klear.rollout.embedded_http import EmbeddedHTTPEngine, parse_generate_request, serve_in_thread
from tests.rollout.conftest import PROMPTS


def _post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _tensors(path):
    from megatron_klear.checkpoint.hf_io import HFReader

    reader = HFReader(path)
    return [(k, reader.get(k)) for k in sorted(reader.keys())]


def test_server_subprocess_matches_in_process(tiny_hf, other_hf):
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12, stop_token_ids=[40, 41], seed=9)
    local = EmbeddedEngine.from_pretrained(tiny_hf["untied"])
    want = local.generate(PROMPTS, params, n=2)
    client = EmbeddedHTTPEngine.launch(tiny_hf["untied"], startup_timeout=120)
    try:
        assert client.health()
        assert client.model_info()["vocab_size"] == 389 and client.model_info()["eos_token_ids"] == [2]
        got = client.generate(PROMPTS, params, n=2)
        assert [[c.token_ids for c in s] for s in got] == [[c.token_ids for c in s] for s in want]
        assert [[c.finish_reason for c in s] for s in got] == [[c.finish_reason for c in s] for s in want]
        for gs, ws in zip(got, want):
            for g, w in zip(gs, ws):
                assert g.logprobs == pytest.approx(w.logprobs, abs=1e-6)
        # SGLang's shape: a single flat prompt with n=1 answers one object with text (tokenizer present)
        status, one = _post(client.url + "/generate", {"input_ids": PROMPTS[0], "return_logprob": True,
                                                       "sampling_params": {"temperature": 0, "max_new_tokens": 3}})
        assert status == 200 and isinstance(one, dict) and isinstance(one["text"], str)
        assert one["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
        assert [p[1] for p in one["meta_info"]["output_token_logprobs"]] == one["output_ids"]
        greedy = local.generate([PROMPTS[0]], SamplingParams(top_k=1, max_new_tokens=3))[0][0]
        assert one["output_ids"] == greedy.token_ids  # temperature 0 is greedy, as in SGLang
        # weights through a temporary safetensors directory and /update_weights_from_disk
        other = EmbeddedEngine.from_pretrained(other_hf)
        client.update_weights(_tensors(other_hf), version=5)
        assert client.model_info()["weight_version"] == "5"
        assert client.generate(PROMPTS, params, n=2) == other.generate(PROMPTS, params, n=2)
        with pytest.raises(RuntimeError, match="unknown tensor 'nope.weight'"):
            client.update_weights([("nope.weight", _tensors(other_hf)[0][1])])
    finally:
        client.close()
    assert not client.health()


@pytest.fixture(scope="module")
def thread_server(tiny_hf):
    engine = EmbeddedEngine.from_pretrained(tiny_hf["untied"])
    server, url = serve_in_thread(engine)
    yield engine, url
    server.shutdown()
    server.server_close()


def test_response_shapes_and_order(thread_server):
    engine, url = thread_server
    sp = {"temperature": 1.0, "max_new_tokens": 5, "n": 2, "sampling_seed": 3, "stop_token_ids": [7]}
    status, outs = _post(url + "/generate", {"input_ids": PROMPTS, "sampling_params": sp, "return_logprob": True})
    assert status == 200 and len(outs) == len(PROMPTS) * 2
    want = engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, stop_token_ids=[7], seed=3), n=2)
    for i, samples in enumerate(want):  # prompt-major: sample j of prompt i at i * n + j
        for j, c in enumerate(samples):
            out = outs[i * 2 + j]
            assert out["output_ids"] == c.token_ids and "text" not in out  # no tokenizer loaded here
            assert out["meta_info"]["prompt_tokens"] == len(PROMPTS[i])
            assert out["meta_info"]["completion_tokens"] == len(c.token_ids)
            assert [p[0] for p in out["meta_info"]["output_token_logprobs"]] == c.logprobs
            assert out["meta_info"]["output_token_logprobs"][0][2] is None
            reason = out["meta_info"]["finish_reason"]
            assert reason == ({"type": "stop", "matched": c.token_ids[-1]} if c.finish_reason == "stop"
                              else {"type": "length", "length": 5})
    # without return_logprob there are no log-probs; a single prompt with n > 1 answers a list
    status, outs = _post(url + "/generate", {"input_ids": PROMPTS[1], "sampling_params": {"n": 2, "max_new_tokens": 2}})
    assert status == 200 and isinstance(outs, list) and len(outs) == 2
    assert "output_token_logprobs" not in outs[0]["meta_info"]
    with urllib.request.urlopen(url + "/health", timeout=10) as resp:
        assert resp.status == 200


@pytest.mark.parametrize("body, message", [
    ({"text": "hello"}, "field 'text'='hello' is not supported"),
    ({"input_ids": [1, 2], "stream": True}, "field 'stream'=True"),
    ({"input_ids": [1, 2], "sampling_params": {"stop": ["</s>"]}}, "sampling_params.stop="),
    ({"input_ids": [1, 2], "sampling_params": {"frobnicate": 1}}, "sampling_params.frobnicate is not supported"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 1.5}}, "top_p must be in"),
    ({"input_ids": [[1, 2], [3, "x"]]}, r"input_ids\[1\]\[1\] must be an integer"),
    ({"input_ids": [1, 999]}, r"prompts\[0\]\[1\] = 999"),
    ({"input_ids": [1], "sampling_params": [{"n": 1}]}, "per-prompt sampling params"),
])
def test_bad_requests_are_400_naming_the_field(thread_server, body, message):
    import re

    _, url = thread_server
    status, payload = _post(url + "/generate", body)
    assert status == 400 and re.search(message, payload["error"]["message"]), payload


def test_update_weights_from_disk_errors(thread_server, tmp_path):
    _, url = thread_server
    status, payload = _post(url + "/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert status == 400 and payload["success"] is False and "no model.safetensors" in payload["message"]
    client = EmbeddedHTTPEngine(url, timeout=5)
    with pytest.raises(RuntimeError, match="HTTP 404"):
        client._request("GET", "/nope")


def test_parse_generate_request_defaults():
    prompts, single, params, n, logprob, _ = parse_generate_request({"input_ids": [4, 5]})
    assert prompts == [[4, 5]] and single and n == 1 and not logprob
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (1.0, 1.0, -1, None)


def test_client_timeouts_and_unreachable_server():
    import socket

    with socket.socket() as s:  # a port that accepts connections but never answers
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        client = EmbeddedHTTPEngine(f"http://127.0.0.1:{s.getsockname()[1]}", timeout=0.5)
        with pytest.raises(RuntimeError, match=r"timeout 0.5 s"):
            client.model_info()
    assert not EmbeddedHTTPEngine("http://127.0.0.1:9", timeout=1).health()
