"""The documented 8B journey, end to end, on a tiny Qwen3-Base-shaped model: the shipped configs
``examples/configs/sft_qwen3_8b.yaml`` and ``gppo_qwen3_8b_math.yaml`` run as users run them
(torchrun, the CLIs), with overrides only for sizes, paths and the parallel layout, plus the
learning rate (a 100K-parameter model needs a larger one than an 8B model to learn anything in 60
steps). The journey: HF base model -> conversion -> SFT -> export -> two SGLang-API servers behind
the real sglang-router -> GPPO starting from the SFT ``iter_`` directory -> export of the RL model.

The model is shaped like Qwen3-8B-Base: its EOS is ``<|endoftext|>`` while turns end with
``<|im_end|>``. SFT teaches ``<|im_end|>``, so rollouts must stop there (they would run to the
token limit if engines stopped only at EOS)."""

import json
import os
import subprocess
import sys

import pytest

from tests.launch import torchrun
from tests.rollout.processes import router

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT_CONFIG = os.path.join(ROOT, "examples/configs/sft_qwen3_8b.yaml")
GPPO_CONFIG = os.path.join(ROOT, "examples/configs/gppo_qwen3_8b_math.yaml")

pytestmark = pytest.mark.slow


def _run(*args, env=None, timeout=900):
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, f"{' '.join(args)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def test_sft_then_gppo_from_the_sft_checkpoint_through_the_router(tmp_path):
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl, write_sft_jsonl
    from megatron_klear.models.tiny import make_tiny_qwen3
    from megatron_klear.rollout.sglang import SGLangEngine
    from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine

    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    hf_base, mg_base = str(tmp_path / "hf-base"), str(tmp_path / "mg-base")
    make_tiny_qwen3(hf_base, flavor="base", num_layers=4, seed=0)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_base)
    eos, im_end = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    assert (
        tok.eos_token == "<|endoftext|>"
        and json.load(open(os.path.join(hf_base, "config.json")))["eos_token_id"] == eos
    )

    # 1. conversion and SFT data, as the README says
    _run("tools/convert_hf_to_megatron.py", "--hf-dir", hf_base, "--out", mg_base, "--tp", "2")
    write_sft_jsonl(str(tmp_path / "sft.jsonl"), 512, seed=0)
    _run(
        "tools/preprocess_sft.py",
        "--input",
        str(tmp_path / "sft.jsonl"),
        "--tokenizer",
        hf_base,
        "--output-prefix",
        str(tmp_path / "sft-data"),
        "--max-length",
        "512",
    )

    # 2. SFT with the shipped 8B config
    sft_dir = str(tmp_path / "sft-run")
    torchrun(
        "-m",
        "megatron_klear",
        "sft",
        "--config",
        SFT_CONFIG,
        f"model.path={mg_base}",
        f"data.prefix={tmp_path / 'sft-data'}",
        "data.seq_length=512",
        "data.micro_batches_per_step=1",
        "parallel.cp=1",
        "train.epochs=0",
        "train.steps=60",
        "train.save_interval=60",
        f"train.save_dir={sft_dir}",
        "optim.warmup_steps=5",
        "optim.lr=3e-3",
        "optim.min_lr=3e-4",
        env=env,
        timeout=900,
        check=True,
    )
    sft_ckpt = os.path.join(sft_dir, "iter_0000060")
    assert os.path.isdir(sft_ckpt)

    # 3. the servers' first weights: the SFT checkpoint exported to HF
    hf_sft = str(tmp_path / "hf-sft")
    _run("tools/convert_megatron_to_hf.py", "--ckpt", sft_ckpt, "--out", hf_sft)
    gen = json.load(open(os.path.join(hf_sft, "generation_config.json")))
    assert sorted(gen["eos_token_id"]) == sorted([eos, im_end]), gen

    # 4. GPPO from the SFT iter_ directory, rollouts through the real router over two servers
    write_rl_prompts_jsonl(str(tmp_path / "rl.jsonl"), 64, seed=1)
    rl_dir = str(tmp_path / "rl-run")
    servers = [EmbeddedHTTPEngine.launch(hf_sft, startup_timeout=120) for _ in range(2)]
    try:
        with router([s.url for s in servers]) as router_url:
            torchrun(
                "-m",
                "megatron_klear",
                "rl",
                "--config",
                GPPO_CONFIG,
                f"model.path={sft_ckpt}",
                "parallel.cp=1",
                f"rl.prompts=[{tmp_path / 'rl.jsonl'}]",
                "rl.prompts_per_step=4",
                "rl.oversample_prompts=8",
                "rl.responses_per_prompt=4",
                "rl.mini_batch_prompts=2",
                "rl.max_tokens_per_micro_batch=512",
                "rl.max_prompt_length=128",
                "rollout.max_new_tokens=64",
                f"rollout.urls=[{router_url}]",
                f"rollout.sync_dir={tmp_path / 'weights'}",
                "reward.workers=1",
                "train.steps=2",
                "train.save_interval=1",
                f"train.save_dir={rl_dir}",
                env=env,
                timeout=900,
                check=True,
            )
            lines = [json.loads(x) for x in open(os.path.join(rl_dir, "metrics.jsonl"))]
            last = lines[-1]["weights/version"]  # the updates that changed the weights (docs/async.md)
            # not only the trainer's own label: the steps that made an optimizer step, counted here
            assert last == sum(1 for m in lines if m.get("actor/optimizer_steps")), lines
            for s in servers:
                info = SGLangEngine.at([s.url]).server_info()
                assert info["num_generate_requests"] > 0, info  # both workers served rollouts
                # the weights' version: the number of steps that changed them (0: the start-up sync)
                assert SGLangEngine.at([s.url]).model_info()["weight_version"] == str(last)
    finally:
        for s in servers:
            s.close()
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        # the SFT model ends its turns with <|im_end|>; the engines stop there although it is not EOS
        assert m["rollout/truncated_frac"] < 0.25, m
        assert m["rollout/response_length_mean"] < 64, m

    # 5. the RL checkpoint exports to HF like any other
    _run(
        "tools/convert_megatron_to_hf.py",
        "--ckpt",
        os.path.join(rl_dir, "iter_0000002"),
        "--out",
        str(tmp_path / "hf-rl"),
    )
    assert os.path.isfile(os.path.join(tmp_path, "hf-rl", "model.safetensors.index.json"))
