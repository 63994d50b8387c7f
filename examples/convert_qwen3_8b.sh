#!/usr/bin/env bash
# Qwen3-8B: HF -> Megatron torch_dist, a logits parity check at TP=2, and back to HF.
# Needs a few GB of RAM (the weights stream in pieces of --piece-mb, 64 MiB) and no GPU.
set -euo pipefail
HF=${HF:-/models/Qwen3-8B}
OUT=${OUT:-ckpt/qwen3-8b}
python tools/convert_hf_to_megatron.py --hf-dir "$HF" --out "$OUT" --tp 2
# float32 parity on random tokens (on GPUs, or slowly on CPU with gloo):
torchrun --nproc-per-node 2 tools/check_parity.py --hf-dir "$HF" --ckpt "$OUT" --tp 2 --tol 1e-3
python tools/convert_megatron_to_hf.py --ckpt "$OUT" --out "$OUT-hf"
