#!/usr/bin/env python
"""megatron-klear torch_dist model directory -> HF checkpoint (sharded safetensors + index,
config.json, tokenizer files) that ``transformers`` loads directly.

    python tools/convert_megatron_to_hf.py --ckpt ckpt/qwen3-8b-base --out ckpt/qwen3-8b-base-hf
    python tools/convert_megatron_to_hf.py --ckpt runs/klear-sft-8b/iter_NNNNNNN --out /shared/klear-sft-8b-hf

--ckpt may be any training checkpoint (its optimizer state, RNG and common state are skipped),
written at any TP/PP with either layer backend (Transformer Engine's _extra_state is skipped).
"""

import argparse
import sys


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="converted model or a training checkpoint's iter_* directory")
    p.add_argument("--out", required=True, help="output HF directory (written atomically)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="default: the checkpoint's dtype")
    p.add_argument(
        "--max-shard-size-gb", type=float, default=2.0, help="output shard size (shards are laid out up front)"
    )
    from megatron_klear.checkpoint.convert import add_io_arguments, io_kwargs, megatron_to_hf

    add_io_arguments(p, pieces=False)
    args = p.parse_args(argv)

    try:
        out = megatron_to_hf(
            args.ckpt,
            args.out,
            dtype=args.dtype,
            max_shard_bytes=int(args.max_shard_size_gb * 1024**3),
            **io_kwargs(args),
        )
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
