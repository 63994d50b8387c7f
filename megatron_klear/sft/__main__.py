"""``python -m megatron_klear.sft`` was the sft command until 2026-12-02; it is ``python -m megatron_klear sft``
now (megatron_klear/__main__.py). This only says so: it imports nothing of the job."""

import sys

if __name__ == "__main__":
    sys.exit(
        "error: the sft command is now `python -m megatron_klear sft --config ...` "
        "(torchrun ... -m megatron_klear sft ...); see docs/training.md"
    )
