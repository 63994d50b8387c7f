"""The shipped configs the journey test does not run, run as users run them (torchrun, the CLIs) on
tiny models, with overrides only for sizes, paths and the parallel layout (two CPU processes):

- ``examples/configs/sft_tiny_cpu.yaml`` (the demo's SFT config) on a tiny dense model;
- ``examples/configs/sft_qwen3_32b.yaml`` on a tiny dense model at TP=2 with sequence parallelism;
- ``examples/configs/sft_qwen3_30b_a3b.yaml`` on a tiny Qwen3-MoE model at EP=2, then
  ``examples/configs/gppo_qwen3_30b_a3b_math.yaml`` from its ``iter_`` directory with an
  SGLang-API server (our embedded one) taking the weights at EP=2.

An example that drifts from what the code accepts (a renamed key, a default that no longer
validates) fails here before a user copies it."""

import json
import math
import os

import pytest

from tests.launch import torchrun
from tests.test_journey import ROOT, _run

pytestmark = pytest.mark.slow

CONFIGS = os.path.join(ROOT, "examples", "configs")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tiny dense and a tiny MoE Qwen3-Base-shaped model, SFT data tokenized by the dense one's
    tokenizer (both share it), RL prompts."""
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl, write_sft_jsonl
    from megatron_klear.models.tiny import make_tiny_qwen3, make_tiny_qwen3_moe

    d = tmp_path_factory.mktemp("shipped")
    dense, moe = str(d / "hf-dense"), str(d / "hf-moe")
    make_tiny_qwen3(dense, flavor="base", num_layers=2, seed=0)
    make_tiny_qwen3_moe(moe, flavor="base", num_layers=2, seed=1)
    write_sft_jsonl(str(d / "sft.jsonl"), 64, seed=0)
    _run(
        "tools/preprocess_sft.py",
        "--input",
        str(d / "sft.jsonl"),
        "--tokenizer",
        dense,
        "--output-prefix",
        str(d / "sft-data"),
        "--max-length",
        "256",
    )
    write_rl_prompts_jsonl(str(d / "rl.jsonl"), 16, seed=1)
    # the authors' RL data layout (verl parquet): two math rows and two code rows (Code-R1 check
    # code, a Codeforces stdin problem), read by rl.prompts as published
    from tests.data.format_fixtures import verl_rows, write

    write(d / "verl-math-code.parquet", [verl_rows()[i] for i in (0, 1, 3, 6)])
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(d), "WANDB_SILENT": "true"}
    return {
        "dir": d,
        "dense": dense,
        "moe": moe,
        "prefix": str(d / "sft-data"),
        "rl": str(d / "rl.jsonl"),
        "verl": str(d / "verl-math-code.parquet"),
        "env": env,
    }


def _sft(data, config, model, layout, name):
    save = str(data["dir"] / name)
    torchrun(
        "-m",
        "megatron_klear",
        "sft",
        "--config",
        os.path.join(CONFIGS, config),
        f"model.path={model}",
        f"data.prefix={data['prefix']}",
        "data.seq_length=256",
        "data.micro_batches_per_step=2",
        *layout,
        "train.epochs=0",
        "train.steps=2",
        "train.save_interval=2",
        f"train.save_dir={save}",
        "optim.warmup_steps=1",
        env=data["env"],
        timeout=900,
        check=True,
    )
    lines = [json.loads(x) for x in open(os.path.join(save, "metrics.jsonl"))]
    steps = [m for m in lines if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2], lines
    assert all(math.isfinite(m["loss"]) and m["loss"] > 0 for m in steps), steps
    ckpt = os.path.join(save, "iter_0000002")
    assert os.path.isdir(ckpt)
    return ckpt, steps


def test_sft_tiny_cpu(data):
    _sft(data, "sft_tiny_cpu.yaml", data["dense"], [], "sft-tiny")


def test_sft_qwen3_32b_at_tp2_with_sequence_parallelism(data):
    _sft(data, "sft_qwen3_32b.yaml", data["dense"], ["parallel.tp=2", "parallel.pp=1", "parallel.cp=1"], "sft-32b")


def test_sft_then_gppo_qwen3_30b_a3b_at_ep2(data):
    from megatron_klear.rollout.sglang import SGLangEngine
    from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine

    layout = ["parallel.tp=1", "parallel.sequence_parallel=false", "parallel.cp=1", "parallel.ep=2"]
    ckpt, steps = _sft(data, "sft_qwen3_30b_a3b.yaml", data["moe"], layout, "sft-30b")
    assert all("moe/aux_loss" in m for m in steps), steps  # the config's aux loss is logged

    rl_dir = str(data["dir"] / "rl-30b")
    server = EmbeddedHTTPEngine.launch(data["moe"], startup_timeout=120)
    try:
        torchrun(
            "-m",
            "megatron_klear",
            "rl",
            "--config",
            os.path.join(CONFIGS, "gppo_qwen3_30b_a3b_math.yaml"),
            f"model.path={ckpt}",
            *layout,
            f"rl.prompts=[{data['verl']}]",
            "rl.prompts_per_step=2",
            "rl.oversample_prompts=4",
            "rl.responses_per_prompt=4",
            "rl.mini_batch_prompts=1",
            "rl.max_tokens_per_micro_batch=512",
            "rl.max_prompt_length=128",
            "rollout.max_new_tokens=32",
            f"rollout.urls=[{server.url}]",
            f"rollout.sync_dir={data['dir'] / 'weights'}",
            "rollout.max_concurrent_requests=8",
            "reward.workers=1",
            "train.steps=2",
            "train.save_interval=2",
            f"train.save_dir={rl_dir}",
            env=data["env"],
            timeout=900,
            check=True,
        )
        lines = [json.loads(x) for x in open(os.path.join(rl_dir, "metrics.jsonl"))]
        last = lines[-1]["weights/version"]
        # not only the trainer's own label: the steps that made an optimizer step, counted here
        assert last == sum(1 for m in lines if m.get("actor/optimizer_steps")), lines
        # the server holds the trainer's weights at their version: the steps that changed them (0: start-up)
        assert SGLangEngine.at([server.url]).model_info()["weight_version"] == str(last)
    finally:
        server.close()
    assert [m["step"] for m in lines] == [1, 2], lines
    assert os.path.isdir(os.path.join(rl_dir, "iter_0000002"))
    # the verl parquet's four prompts make each generation batch (rl.oversample_prompts=4; dynamic
    # sampling may add batches): 2 math and 2 code prompts x 4 responses each, both tasks graded
    first = lines[0]
    per_task = 8 * first["rollout/generation_batches"]
    assert first["rollout/task/math/responses"] == per_task and first["rollout/task/code/responses"] == per_task, first
