"""rollout.router_replay with servers: SGLang 0.5.23's ``return_routed_experts`` (read from its wheel:
``srt/managers/io_struct.py`` GenerateReqInput, ``managers/scheduler.py``'s start-length checks,
``scheduler_components/batch_result_processor.py`` and ``state_capturer/`` for the rows
``[routed_experts_start_len, seqlen - 1)``, ``detokenizer_manager.py``'s base64 of int32
[tokens, layers, top_k]). Our embedded server started with ``--enable-return-routed-experts``
answers it with the experts a teacher-forced transformers forward
of the whole sequence routes each token to; the client reads them into Completion.routed_experts,
going around the real sglang-router 0.3.2, which drops the request fields."""

import base64
import os

import httpx
import numpy as np
import pytest
import torch

from tests.rollout.processes import router
from tests.rollout.sglang_contract import contract_error, io_structs, validate_generate_response

TOP_K = 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from megatron_klear.models.tiny import make_tiny_qwen3_moe

    # 3 layers, the middle one dense: SGLang reports every layer, a dense one as zeros
    return make_tiny_qwen3_moe(str(tmp_path_factory.mktemp("re") / "m"), seed=3, num_layers=3, mlp_only_layers=(1,))


@pytest.fixture(scope="module")
def servers(moe_dir):
    from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine

    on = EmbeddedHTTPEngine.launch(moe_dir, return_routed_experts=True, startup_timeout=120)
    off = EmbeddedHTTPEngine.launch(moe_dir, startup_timeout=120)
    yield on, off
    on.close()
    off.close()


def _teacher_forced(moe_dir, seq):
    """[len(seq), MoE layers, top_k] experts of a transformers forward of ``seq`` (sorted per token)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([seq]), output_router_logits=True)
    return torch.stack([lg.topk(TOP_K, dim=-1).indices for lg in out.router_logits], dim=1).sort(-1).values


def test_the_request_fields_are_sglangs():
    fields = io_structs()["GenerateReqInput"]
    assert fields["return_routed_experts"][0] == "bool" and fields["routed_experts_start_len"][0] == "int"
    assert contract_error({"input_ids": [1, 2], "return_routed_experts": True, "routed_experts_start_len": 1}) is None


def test_the_real_router_drops_the_request_fields(tmp_path):
    """sglang-router 0.3.2 rebuilds each /generate body from its own struct, which lacks
    return_routed_experts and routed_experts_start_len: what the worker receives has neither. So
    the client sends router-replay generation to the workers directly (SGLangEngine.generation_urls).
    Should a newer router forward them, this fails and the detour can go."""
    from tests.rollout.processes import fake_worker, recorded

    with fake_worker(tmp_path) as (worker, record, _):
        with router([worker]) as url:
            httpx.post(
                url + "/generate",
                json={
                    "input_ids": [5, 17],
                    "return_routed_experts": True,
                    "routed_experts_start_len": 1,
                    "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 2},
                },
                timeout=60,
            )
        got = recorded(record)[-1]
    assert got["input_ids"] == [5, 17] and got["return_logprob"] is True  # the request itself arrived
    assert "return_routed_experts" not in got and "routed_experts_start_len" not in got


def test_a_server_returns_every_tokens_experts(moe_dir, servers):
    on, _ = servers
    prompt = [5, 17, 33, 60, 7]
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "return_routed_experts": True,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 6, "sampling_seed": 4, "n": 2},
    }
    assert contract_error(body) is None
    outs = httpx.post(on.url + "/generate", json=body, timeout=120).json()
    validate_generate_response(outs)
    assert len(outs) == 2
    for out in outs:
        ids = out["output_ids"]
        seq = prompt + ids[:-1]  # every token fed to the model: seqlen - 1 rows
        got = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
        got = torch.from_numpy(got.copy()).reshape(len(seq), 3, TOP_K)
        assert torch.all(got[:, 1] == 0)  # the dense layer
        assert torch.equal(got[:, [0, 2]].long().sort(-1).values, _teacher_forced(moe_dir, seq))
    # routed_experts_start_len skips the first rows; SGLang's checks refuse a start outside the prompt
    start = httpx.post(
        on.url + "/generate",
        json={**body, "routed_experts_start_len": 3, "sampling_params": {**body["sampling_params"], "n": 1}},
        timeout=120,
    ).json()
    seq = prompt + start["output_ids"][:-1]
    rows = np.frombuffer(base64.b64decode(start["meta_info"]["routed_experts"]), dtype=np.int32).reshape(-1, 3, TOP_K)
    assert rows.shape[0] == len(seq) - 3
    assert torch.equal(
        torch.from_numpy(rows[:, [0, 2]].copy()).long().sort(-1).values, _teacher_forced(moe_dir, seq)[3:]
    )
    bad = httpx.post(on.url + "/generate", json={**body, "routed_experts_start_len": 6}, timeout=60)
    assert bad.status_code == 400
    assert "routed_experts_start_len=6 is higher than the number of input tokens" in bad.text
    assert (
        "is lower than 0"
        in httpx.post(on.url + "/generate", json={**body, "routed_experts_start_len": -1}, timeout=60).text
    )


def test_the_client_reads_them_and_names_the_missing_server_flag(moe_dir, servers):
    from megatron_klear.rollout.base import SamplingParams
    from megatron_klear.rollout.sglang import EngineError, SGLangEngine

    on, off = servers
    prompts = [[5, 17, 33], [7, 8, 9, 10, 11]]
    with router([on.url]) as url:  # given the router, the client asks it for its workers and goes to them
        client = SGLangEngine.at([url], control_timeout_s=30)
        client.generation.record_routing, client.generation.routing_layers, client.generation.routing_topk = (
            True,
            [0, 2],
            TOP_K,
        )
        assert client.generation.generation_urls() == [on.url]
        outs = client.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=5, seed=2), n=2)
    for prompt, completions in zip(prompts, outs):
        for c in completions:
            seq = prompt + c.token_ids[:-1]
            assert c.routed_experts.dtype == torch.int16 and c.routed_experts.shape == (len(seq), 2, TOP_K)
            assert torch.equal(c.routed_experts.long().sort(-1).values, _teacher_forced(moe_dir, seq))
    # a server without --enable-return-routed-experts leaves the field out (as SGLang does)
    plain = httpx.post(
        off.url + "/generate",
        json={"input_ids": [5, 17], "return_routed_experts": True, "sampling_params": {"max_new_tokens": 2}},
        timeout=60,
    ).json()
    assert "routed_experts" not in plain["meta_info"]
    client = SGLangEngine.at([off.url], control_timeout_s=30, max_retries=0)
    client.generation.record_routing, client.generation.routing_layers, client.generation.routing_topk = (
        True,
        [0, 2],
        TOP_K,
    )
    with pytest.raises(EngineError, match="--enable-return-routed-experts"):
        client.generate([[5, 17]], SamplingParams(max_new_tokens=2))
    assert os.path.isdir(moe_dir)


@pytest.mark.slow
def test_the_rl_loop_replays_the_servers_experts(moe_dir, servers, tmp_path):
    """rollout.engine=sglang with router_replay: the loop (given the router) asks the workers for the
    experts, the old-log-prob pass replays them, the weights go back over the update group, and the
    servers' sampling log-probs equal the trainer's recompute."""
    import json

    from megatron_klear.data.synthetic import write_rl_prompts_jsonl
    from tests.distributed.helper import run_distributed
    from tests.distributed.test_rl_loop import _overrides, _run

    on, _ = servers
    prompts = write_rl_prompts_jsonl(str(tmp_path / "prompts.jsonl"), 12, seed=3)
    save = str(tmp_path / "run")
    with router([on.url]) as url:
        args = [
            a
            for a in _overrides({"model": moe_dir, "prompts": prompts}, save)
            if not a.startswith(("parallel.tp", "train.steps"))
        ]
        args += [
            "parallel.tp=1",
            "train.steps=2",
            "rollout.engine=sglang",
            f"rollout.urls=[{url}]",
            "rollout.router_replay=true",
            "rl.filter_zero_spread=false",
            "rollout.max_concurrent_requests=4",
        ]
        run_distributed(_run, 1, args)
    lines = [json.loads(x) for x in open(os.path.join(save, "metrics.jsonl"))]
    stepped = [m for m in lines if m.get("actor/optimizer_steps")]
    assert len(stepped) == 2, lines
    for m in stepped:
        assert m["actor/router_replay_micro_batches"] >= 1  # the micro-batches carried the servers' experts
        assert m["actor/logprob_mismatch_max"] < 1e-3, m["actor/logprob_mismatch_max"]
    assert httpx.get(on.url + "/model_info", timeout=10).json()["weight_version"] == "2"
