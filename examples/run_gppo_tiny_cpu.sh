#!/usr/bin/env bash
# GPPO on the CPU: the tiny SFT model from examples/run_sft_tiny_cpu.sh, arithmetic prompts graded
# by math-verify, the embedded rollout engine, TP=2 on two gloo processes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
SFT=${SFT:-runs/sft-tiny/hf-sft}
OUT=${OUT:-runs/gppo-tiny}
[ -d "$SFT" ] || { echo "error: $SFT: no such model; run examples/run_sft_tiny_cpu.sh first" \
    "(or set SFT=an HF model dir)" >&2; exit 2; }
mkdir -p "$OUT"
$PY -c "from megatron_klear.data.synthetic import write_rl_prompts_jsonl; write_rl_prompts_jsonl('$OUT/prompts.jsonl', 256)"
$PY -m megatron_klear.platform.launch --nproc-per-node 2 -m megatron_klear rl \
    model.path="$SFT" model.dtype=fp32 parallel.tp=2 rl.prompts="[$OUT/prompts.jsonl]" \
    rl.prompts_per_step=8 rl.oversample_prompts=16 rl.responses_per_prompt=8 rl.mini_batch_prompts=4 \
    rl.max_tokens_per_micro_batch=1024 rl.max_prompt_length=128 rollout.max_new_tokens=48 optim.lr=2e-5 optim.min_lr=2e-5 \
    optim.decay_style=constant optim.warmup_steps=2 train.steps=20 train.save_dir="$OUT/run" \
    train.save_interval=10 reward.workers=1 "$@"
