#!/usr/bin/env python
"""Write a random Qwen3-shaped HF checkpoint (with the project's small tokenizer): tiny for CPU runs
and tests, or a real model's shape (``--shape qwen3-0.6b``) for a cluster's smoke job."""

import argparse

from megatron_klear.models.tiny import make_tiny_qwen3

# real models' shapes (their config.json), for runs that need the size but not the weights
SHAPES = {
    "qwen3-0.6b": dict(
        num_layers=28,
        hidden_size=1024,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        tied=True,
        max_position_embeddings=40960,
        init_std=0.02,
        max_shard_size="2GB",
        dtype="bfloat16",
    ),
}

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="a real model's shape (the flags below: tiny)")
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
        SHAPES[a.shape]
        if a.shape
        else dict(tied=a.tied, num_layers=a.layers, hidden_size=a.hidden, head_dim=a.head_dim)
    )
    print(make_tiny_qwen3(a.out, seed=a.seed, flavor=a.flavor, **shape))
