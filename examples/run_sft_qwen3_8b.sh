#!/usr/bin/env bash
# Long-CoT SFT of Qwen3-8B at 32K on NNODES x 8 GPUs. Run the same command on every node:
#
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 bash examples/run_sft_qwen3_8b.sh [key=value ...]
#   CONFIG=examples/configs/sft_qwen3_30b_a3b.yaml NNODES=8 ... bash examples/run_sft_qwen3_8b.sh   # another model
#
# Before: convert the base model and tokenize the data once:
#   python tools/convert_hf_to_megatron.py --hf-dir /models/Qwen3-8B-Base --out ckpt/qwen3-8b-base --tp 2
#   python tools/preprocess_sft.py --input sft.jsonl --tokenizer /models/Qwen3-8B-Base \
#       --output-prefix data/klear_sft --max-length 32768 --overlong drop --workers 32
# After: export for evaluation / RL:
#   python tools/convert_megatron_to_hf.py --ckpt runs/klear-sft-8b/iter_NNNNNNN --out /shared/klear-sft-8b-hf
set -euo pipefail
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
CONFIG=${CONFIG:-examples/configs/sft_qwen3_8b.yaml}
# seconds torchrun gives the ranks after forwarding a stop signal before SIGKILL (torchrun: 30): they
# finish their step and save (the stop line in the log says how long that took; docs/slurm.md)
export SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-540}  # (exported: the trainer says when a stop would need more)
export CUDA_DEVICE_MAX_CONNECTIONS=1   # needed by Megatron's TP/SP communication overlap
# NCCL's NVLS and cuMem stay NCCL's defaults here: no weight-update group shares a communicator
# with servers (examples/run_gppo_qwen3_8b.sh turns both off for that); export them to choose.
# fewer fragmentation OOMs with packed micro-batches of varying length
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

# megatron_klear.platform.launch is torchrun (same arguments) that ends a user error (a wrong key,
# a missing file ...) with one "error: ..." line, last, and exit status 2 (docs/training.md#user-errors-under-torchrun)
exec "${PY:-python}" -m megatron_klear.platform.launch \
  --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout "$SHUTDOWN_TIMEOUT" \
  -m megatron_klear sft --config "$CONFIG" "$@"
