#!/usr/bin/env python
"""Write a random Qwen3-shaped HF checkpoint (with the project's small tokenizer): tiny for CPU runs
and tests, or a real model's shape (``--shape qwen3-0.6b``) for a cluster's smoke job."""

import argparse

from megatron_klear.models.tiny import REAL_SHAPES, make_tiny_qwen3

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument(
        "--shape", choices=sorted(REAL_SHAPES), default=None, help="a real model's shape (the flags below: tiny)"
    )
    p.add_argument("--tied", action="store_true")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=24, help="per attention head (vLLM's CPU build needs 32, 64, ...)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--flavor",
        choices=("base", "instruct"),
        default="base",
        help="base (default): EOS <|endoftext|> while turns end with <|im_end|>, like Qwen3-8B-Base; "
        "instruct: EOS <|im_end|>",
    )
    a = p.parse_args()
    shape = (
        REAL_SHAPES[a.shape]
        if a.shape
        else dict(tied=a.tied, num_layers=a.layers, hidden_size=a.hidden, head_dim=a.head_dim)
    )
    print(make_tiny_qwen3(a.out, seed=a.seed, flavor=a.flavor, **shape))
