#!/usr/bin/env python
"""HF checkpoint -> megatron-klear torch_dist model directory (loads at any TP/PP).

python tools/convert_hf_to_megatron.py --hf-dir /models/Qwen3-8B-Base --out ckpt/qwen3-8b-base --tp 2 --pp 1
"""

import argparse
import sys


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True, help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--out", required=True, help="output directory (written atomically)")
    p.add_argument("--tp", type=int, default=1, help="TP size the model will be trained with (validated, recorded)")
    p.add_argument("--pp", type=int, default=1, help="PP size the model will be trained with (validated, recorded)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="default: the HF config's dtype")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    from megatron_klear.checkpoint.convert import add_io_arguments, hf_to_megatron, io_kwargs

    add_io_arguments(p)
    args = p.parse_args(argv)

    try:
        out = hf_to_megatron(
            args.hf_dir,
            args.out,
            tp=args.tp,
            pp=args.pp,
            dtype=args.dtype,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            **io_kwargs(args),
        )
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
