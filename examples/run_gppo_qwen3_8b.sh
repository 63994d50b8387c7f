#!/usr/bin/env bash
# GPPO RL of Klear-Reasoner-8B. Rollouts come from SGLang servers on dedicated nodes; the trainer
# runs on NNODES x 8 GPUs. model.path is the SFT checkpoint directory itself (runs/klear-sft-8b/
# iter_NNNNNNN): the trainer loads its model weights (not its optimizer) at any TP/PP.
#
# 1. Export the SFT checkpoint to HF once, for the servers' first load (the trainer then pushes its
#    own weights at start-up and after every step, as weight_version = RL step):
#      python tools/convert_megatron_to_hf.py --ckpt runs/klear-sft-8b/iter_NNNNNNN --out /shared/klear-sft-8b-hf
#    (the export's generation_config.json lists <|im_end|> besides Qwen3-Base's EOS <|endoftext|>;
#    the trainer also sends both as stop_token_ids with every request).
# 2. One SGLang server per rollout GPU group. Prompt (4K) + response (32K) = 36864 tokens exceeds
#    Qwen3-8B-Base's max_position_embeddings (32768): allow it explicitly (what the authors' 32K
#    responses imply) or pick a RoPE scaling (YaRN) with --json-model-override-args:
#      SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 python -m sglang.launch_server \
#          --model-path /shared/klear-sft-8b-hf --host 0.0.0.0 --port 30000 --tp 1 \
#          --context-length 36864 --mem-fraction-static 0.85
#    The trainer checks every server's context at start-up and stops with this advice if it is short.
# 3. The router, in front of all servers (requests are one per prompt, spread over the workers):
#      python -m sglang_router.launch_router --host 0.0.0.0 --port 30000 --policy cache_aware \
#          --worker-urls http://r0:30000 http://r1:30000 ... --request-timeout-secs 10800 \
#          --prometheus-port 29000
#    --request-timeout-secs must exceed the longest request (rollout.generate_timeout_s), else the
#    router re-sends it and finally answers HTTP 500; give each router on a host its own
#    --prometheus-port (the default 29000 collides).
# 4. On every trainer node:
#      NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 bash examples/run_gppo_qwen3_8b.sh rollout.urls=[http://router:30000]
#    The trainer asks the router for its workers (GET /workers) and sends weight updates to each
#    (pause -> update_weights_from_disk -> continue, checked by weight_version); rollout.sync_dir
#    must be on a filesystem the servers read.
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
