"""The training commands, at the top of the package (they read the whole job config):

    torchrun --nproc-per-node 8 -m megatron_klear sft --config examples/configs/sft_qwen3_8b.yaml [key=value ...]
    torchrun --nproc-per-node 8 -m megatron_klear rl  --config examples/configs/gppo_qwen3_8b_math.yaml [key=value ...]

(``python -m megatron_klear.platform.launch`` takes torchrun's arguments and ends a user's mistake
with one line: docs/training.md). A wrong key, a missing file or a busy run directory ends with one
``error: ...`` line and exit status 2 (platform/entry.py).
"""

from __future__ import annotations

import argparse
import sys

JOBS = {
    "sft": "long chain-of-thought SFT on Megatron-Core (megatron_klear/sft/trainer.py)",
    "rl": "GPPO reinforcement learning on Megatron-Core, Klear-Reasoner (megatron_klear/rl/loop.py)",
}


def _run(job: str, cfg) -> dict:
    if job == "sft":
        from megatron_klear.sft.trainer import train

        return train(cfg)
    from megatron_klear.rl.loop import RLLoop

    return RLLoop(cfg).run()


def main(argv=None) -> int:
    from megatron_klear.config import load_config
    from megatron_klear.platform.entry import run_entry_point

    p = argparse.ArgumentParser(prog="python -m megatron_klear", description="megatron-klear training jobs")
    jobs = p.add_subparsers(dest="job", required=True, metavar="{sft,rl}")
    for name, help in JOBS.items():
        sub = jobs.add_parser(name, help=help, description=help)
        sub.add_argument("--config", default=None, help="YAML config (see examples/configs/)")
        sub.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    args = p.parse_args(argv)
    return run_entry_point(lambda: _run(args.job, load_config(args.config, args.overrides)))


if __name__ == "__main__":
    sys.exit(main())
