#!/usr/bin/env bash
# GPPO RL of Klear-Reasoner-8B. Rollouts come from SGLang servers on dedicated nodes; the trainer
# runs on NNODES x 8 GPUs. Start the servers first (one per rollout GPU group), on a filesystem
# shared with the trainer for weight updates:
#
#   python -m sglang.launch_server --model-path runs/klear-sft-8b-hf --port 30000 --host 0.0.0.0 \
#       --tp 1 --mem-fraction-static 0.85            # one per GPU, then:
#   python -m sglang_router.launch_router --worker-urls http://r0:30000 http://r1:30000 ... --port 30000
#
# then, on every trainer node:
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 bash examples/run_gppo_qwen3_8b.sh rollout.urls=[http://router:30000]
# For code RL afterwards: CONFIG=examples/configs/gppo_qwen3_8b_code.yaml model.path=<math RL checkpoint>
set -euo pipefail
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
CONFIG=${CONFIG:-examples/configs/gppo_qwen3_8b_math.yaml}
export CUDA_DEVICE_MAX_CONNECTIONS=1

exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  -m megatron_klear.rl --config "$CONFIG" "$@"
