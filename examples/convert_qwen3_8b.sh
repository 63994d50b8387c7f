#!/usr/bin/env bash
# Qwen3-8B-Base: HF -> Megatron torch_dist, a logits parity check at TP=2, and back to HF
# (docs/checkpoints.md). No GPU needed. The two conversions hold a few GB of RAM (the weights stream
# in pieces of --piece-mb, 64 MiB); the parity check holds whole models: each of its two ranks loads
# the full HF model in fp32 (about 33 GB) beside its fp32 half of the Megatron model (about 16 GB,
# on the GPU when there is one), so about 66 GB of host memory on a GPU node, 100 GB without GPUs.
set -euo pipefail
HF=${HF:-/models/Qwen3-8B-Base}
OUT=${OUT:-ckpt/qwen3-8b-base}
python tools/convert_hf_to_megatron.py --hf-dir "$HF" --out "$OUT" --tp 2
# float32 parity on random tokens (on GPUs, or slowly on CPU with gloo); 1e-3, not the tool's default
# 1e-4, as on every page (docs/checkpoints.md, "Checking parity")
torchrun --nproc-per-node 2 tools/check_parity.py --hf-dir "$HF" --ckpt "$OUT" --tp 2 --tol 1e-3
python tools/convert_megatron_to_hf.py --ckpt "$OUT" --out "$OUT-hf"
