"""The demo's SFT model, for the benchmarks that start from it (algos.py, vs_trl.py, async_rl.py):
``python examples/demo.py --sft-model`` run as a user runs it (a tiny Qwen3, converted to Megatron,
SFT at TP=2 on an imperfect teacher's chats of the settings' task, exported to HF), its output on
this console."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_sft_model(settings, out: str) -> str:
    """The demo's stages 1-3 and the export with ``settings`` (:class:`megatron_klear.demo_recipe.Settings`)
    into ``out``, beside the task's data files (``sft.jsonl``, ``rl-prompts.jsonl``, ``heldout.jsonl``);
    returns the HF SFT model, ``<out>/hf-sft``."""
    from megatron_klear.demo_recipe import setting_args

    out = os.path.abspath(out)
    cmd = [sys.executable, os.path.join("examples", "demo.py"), "--sft-model", "--out", out, *setting_args(settings)]
    subprocess.run(cmd, cwd=ROOT, check=True)
    return os.path.join(out, "hf-sft")
