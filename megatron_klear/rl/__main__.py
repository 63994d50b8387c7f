"""``python -m megatron_klear.rl`` was the rl command until 2026-12-02; it is ``python -m megatron_klear rl``
now (megatron_klear/__main__.py). This only says so: it imports nothing of the job."""

import sys

if __name__ == "__main__":
    sys.exit(
        "error: the rl command is now `python -m megatron_klear rl --config ...` "
        "(torchrun ... -m megatron_klear rl ...); see docs/training.md"
    )
