"""Our embedded server against SGLang 0.5.23's own contract (``sglang/api/v1/api_types.py``, the
generated types SGLang's /generate gate enforces): every answer shape decodes as GenerateResponse,
the bodies sglang-router forwards are accepted, and where the contract refuses a body we refuse
it too, with the contract's text."""

import pytest

from megatron_klear.rollout.embedded import EmbeddedEngine, load_tokenizer
from megatron_klear.rollout.sglang_standin import SAMPLING_FIELDS, serve_in_thread
from tests.rollout.conftest import PROMPTS
from tests.rollout.sglang_contract import (
    contract_error,
    load_contract,
    validate_generate_request,
    validate_generate_response,
)
from tests.rollout.test_embedded_http import _post

# what sglang-router 0.3.2 adds to a /generate body it forwards (measured)
ROUTER_KEYS = {
    "model": None,
    "stream": False,
    "log_metrics": True,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
    "return_text_in_logprobs": False,
}


@pytest.fixture(scope="module")
def server(tiny_hf):
    engine = EmbeddedEngine.from_pretrained(tiny_hf["untied"])
    srv, url = serve_in_thread(engine, tokenizer=load_tokenizer(tiny_hf["untied"]), tokenizer_path=tiny_hf["untied"])
    yield engine, url, srv
    srv.shutdown()
    srv.server_close()


def test_our_sampling_fields_are_the_contracts(sglang_contract):
    assert tuple(SAMPLING_FIELDS) == tuple(sglang_contract.SamplingParams.__struct_fields__)
    defaults = sglang_contract.SamplingParams()
    for name, (_, default) in SAMPLING_FIELDS.items():
        assert getattr(defaults, name) == default, name


@pytest.mark.parametrize(
    "body",
    [
        {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 4, "sampling_seed": 1}, "return_logprob": True},
        {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 3, "n": 3, "sampling_seed": 2}},
        {
            "input_ids": PROMPTS,
            "sampling_params": {"max_new_tokens": 5, "n": 2, "stop_token_ids": [7, 40], "sampling_seed": 4},
            "return_logprob": True,
            "rid": "batch",
        },
        {
            "input_ids": PROMPTS[:2],
            "rid": ["x", "y"],
            "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3, "temperature": 0}],
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "return_prompt_token_ids": True,
        },
        {"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 0}},
        {
            "input_ids": PROMPTS[1],
            "sampling_params": {
                "max_new_tokens": 3,
                "skip_special_tokens": False,
                "no_stop_trim": True,
                "top_k": 1 << 30,
                "temperature": None,
            },
        },
    ],
    ids=["single", "n>1", "batch-n>1", "per-prompt", "zero-tokens", "text-options"],
)
def test_every_answer_decodes_as_sglang_generate_response(server, sglang_contract, body):
    _, url, _ = server
    validate_generate_request(body)  # a body SGLang accepts ...
    status, out = _post(url + "/generate", body)
    assert status == 200, out
    decoded = validate_generate_response(out)  # ... answered in SGLang's shape
    prompts = body["input_ids"] if isinstance(body["input_ids"][0], list) else [body["input_ids"]]
    sp = (
        body["sampling_params"]
        if isinstance(body["sampling_params"], list)
        else [body["sampling_params"]] * len(prompts)
    )
    n = sp[0].get("n", 1)
    assert len(decoded) == len(prompts) * n and isinstance(out, dict) == (
        len(decoded) == 1 and prompts == [body["input_ids"]]
    )
    for k, d in enumerate(decoded):
        reason = d.meta_info.finish_reason
        assert isinstance(reason, (sglang_contract.FinishStop, sglang_contract.FinishLength))
        assert d.meta_info.completion_tokens == len(d.output_ids) and d.meta_info.prompt_tokens == len(prompts[k // n])
        assert isinstance(d.text, str) and d.meta_info.weight_version == "default"
        if body.get("return_logprob"):
            assert [e.token_id for e in d.meta_info.output_token_logprobs] == d.output_ids
        if body.get("return_prompt_token_ids"):
            assert d.prompt_token_ids == prompts[k // n]
        if body.get("return_text_in_logprobs"):
            assert all(isinstance(e.text, str) for e in d.meta_info.output_token_logprobs)
    if sp[0].get("max_new_tokens") == 0:
        assert decoded[0].output_ids == [] and decoded[0].meta_info.finish_reason == sglang_contract.FinishLength(
            length=0
        )


def test_the_abort_answer_decodes_as_sglang_generate_response(server, sglang_contract):
    import time
    from concurrent.futures import ThreadPoolExecutor

    engine, url, srv = server
    body = {"input_ids": PROMPTS[0], "rid": "to-abort", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(_post, url + "/generate", body)
        start = engine.decode_steps
        while engine.decode_steps < start + 3:
            time.sleep(0.005)
        assert _post(url + "/abort_request", {"rid": "to-abort"})[0] == 200
        status, out = future.result(timeout=60)
    (d,) = validate_generate_response(out)
    assert isinstance(d.meta_info.finish_reason, sglang_contract.FinishAbort) and d.meta_info.id == "to-abort"
    assert 0 < len(d.output_ids) < 3000


def test_bodies_the_router_forwards_are_accepted(server):
    _, url, _ = server
    body = {
        "input_ids": PROMPTS[2],
        "sampling_params": {"max_new_tokens": 4, "sampling_seed": 8, "n": 2},
        "return_logprob": True,
        "rid": "r",
    }
    forwarded = {**ROUTER_KEYS, **body}
    validate_generate_request(forwarded)
    plain, routed = _post(url + "/generate", body), _post(url + "/generate", forwarded)
    assert plain[0] == routed[0] == 200
    strip = [{**o, "meta_info": {**o["meta_info"], "e2e_latency": 0}} for o in plain[1]]
    assert [{**o, "meta_info": {**o["meta_info"], "e2e_latency": 0}} for o in routed[1]] == strip
    # top-level keys neither SGLang nor we know are ignored, as SGLang's GenerateRequest does
    assert _post(url + "/generate", {**body, "some_future_key": [1, 2]})[0] == 200


@pytest.mark.parametrize(
    "sampling_params",
    [
        {"frobnicate": 1},
        {"max_new_tokens": 2, "seed": 3},  # SGLang's key is sampling_seed
        {"watermark": {"enabled": False, "nope": 1}},
    ],
)
def test_unknown_sampling_keys_get_the_contracts_400(server, sampling_params):
    _, url, _ = server
    body = {"input_ids": [1, 2], "sampling_params": sampling_params}
    expected = contract_error(body)
    assert expected is not None and expected.startswith("unknown field `")  # the contract refuses it ...
    status, payload = _post(url + "/generate", body)
    assert status == 400 and payload == {"error": expected}  # ... and so do we, with its text and gate shape


@pytest.mark.parametrize(
    "body",
    [
        {"input_ids": [1, "x"]},
        {"input_ids": [[1, 2], [3, 1.5]]},
        {"input_ids": "hello"},
        {"input_ids": [1], "sampling_params": {"temperature": "hot"}},
        {"input_ids": [1], "sampling_params": {"max_new_tokens": 2.5}},
        {"input_ids": [1], "sampling_params": {"stop_token_ids": 7}},
        {"input_ids": [1], "sampling_params": {"n": True}},
        {"input_ids": [1], "sampling_params": [{"top_k": "1"}]},
        {"input_ids": [1], "sampling_params": "greedy"},
        {"input_ids": [1], "return_logprob": "yes"},
        {"input_ids": [1], "rid": 5},
        {"input_ids": [1], "stream": 0},
        {"input_ids": [1], "return_prompt_token_ids": None},
    ],
)
def test_type_violations_are_refused_as_the_contract_does(server, body):
    _, url, _ = server
    expected = contract_error(body)
    assert expected is not None
    status, payload = _post(url + "/generate", body)
    assert status == 400 and isinstance(payload["error"], str), payload
    assert payload["error"].endswith(expected)  # the contract's text, after the field's path


@pytest.mark.parametrize(
    "body, field",
    [
        ({"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
        ({"input_ids": [1], "sampling_params": {"regex": "a+"}}, "regex"),
        ({"input_ids": [1], "sampling_params": {"logit_bias": {"5": 1.0}}}, "logit_bias"),
        ({"input_ids": [1], "sampling_params": {"beam_width": 2}}, "beam_width"),
        ({"input_ids": [1], "top_logprobs_num": 3}, "top_logprobs_num"),
        ({"input_ids": [1], "return_hidden_states": True}, "return_hidden_states"),
        ({"input_ids": [1], "lora_path": "adapter"}, "lora_path"),
        ({"input_ids": [1], "image_data": "x.png"}, "image_data"),
    ],
)
def test_valid_bodies_we_cannot_honour_name_the_field(server, body, field):
    _, url, _ = server
    assert contract_error(body) is None  # SGLang would serve it ...
    status, payload = _post(url + "/generate", body)
    assert status == 400 and field in payload["error"]["message"]  # ... we refuse it rather than ignore it


def test_contract_loader_names_the_fix(monkeypatch, tmp_path):
    from tests.rollout import sglang_contract

    monkeypatch.setattr(sglang_contract, "CONTRACT_FILE", str(tmp_path / "missing.py"))
    sglang_contract.load_contract.cache_clear()
    try:
        with pytest.raises(sglang_contract.ContractMissing, match=r"run make venv \(tools/fetch_sglang_contract.py\)"):
            sglang_contract.load_contract()
    finally:
        monkeypatch.undo()
        sglang_contract.load_contract.cache_clear()
    assert load_contract().GenerateResponse is not None
