#!/usr/bin/env bash
# Tiny SFT on the CPU in about a minute: makes a random tiny Qwen3, synthetic arithmetic chats,
# tokenizes them, trains with TP=2 on two gloo processes and exports the result to HF. The base
# model is made anew each time, so training starts afresh: an earlier run in $OUT/run is moved to
# $OUT/run/replaced/<time>/ (train.overwrite=true).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/sft-tiny}
mkdir -p "$OUT"
$PY tools/make_tiny_model.py --out "$OUT/hf-base" --layers 4
$PY -c "from megatron_klear.data.synthetic import write_sft_jsonl; write_sft_jsonl('$OUT/train.jsonl', 512)"
$PY tools/preprocess_sft.py --input "$OUT/train.jsonl" --tokenizer "$OUT/hf-base" \
    --output-prefix "$OUT/data" --max-length 512
$PY -m megatron_klear.platform.launch --nproc-per-node 2 -m megatron_klear sft \
    --config examples/configs/sft_tiny_cpu.yaml \
    model.path="$OUT/hf-base" data.prefix="$OUT/data" train.save_dir="$OUT/run" train.overwrite=true "$@"
STEP=$(cat "$OUT/run/latest_checkpointed_iteration.txt")
$PY tools/convert_megatron_to_hf.py --ckpt "$OUT/run/iter_$(printf %07d "$STEP")" --out "$OUT/hf-sft"
