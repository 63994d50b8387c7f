#!/usr/bin/env bash
# GPPO RL of Klear-Reasoner-8B. Rollouts come from SGLang servers on dedicated nodes; the trainer
# runs on NNODES x 8 GPUs. model.path is the SFT checkpoint directory itself (runs/klear-sft-8b/
# iter_NNNNNNN): the trainer loads its model weights (not its optimizer) at any TP/PP.
#
# 1. Export the SFT checkpoint to HF once, for the servers' first load (the trainer then pushes its
#    own weights at start-up and after every step that changed them, labelled with their weight
#    version: +1 per update that applied at least one optimizer step, not the RL step number):
#      python tools/convert_megatron_to_hf.py --ckpt runs/klear-sft-8b/iter_NNNNNNN --out /shared/klear-sft-8b-hf
#    (the export's generation_config.json lists <|im_end|> besides Qwen3-Base's EOS <|endoftext|>;
#    the trainer also sends both as stop_token_ids with every request).
# Ports, as on every page and in examples/slurm/gppo_qwen3_8b.sbatch: server k of a node on 30000 + k,
# the router on 31000, its Prometheus endpoint on 31001.
# 2. One SGLang server per rollout GPU group. Prompt (4K) + response (32K) = 36864 tokens exceeds
#    Qwen3-8B-Base's max_position_embeddings (32768): allow it explicitly (what the authors' 32K
#    responses imply) or pick a RoPE scaling (YaRN) with --json-model-override-args:
#      # installed by docs/training.md's recipe ("Installing on a GPU cluster"): torch 2.14.1 (cu130),
#      # then sglang==0.5.23 and sglang-router==0.3.2 with -c requirements/gpu-constraints.txt
#      SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 CUDA_VISIBLE_DEVICES=$k python -m sglang.launch_server \
#          --model-path /shared/klear-sft-8b-hf --host 0.0.0.0 --port $((30000 + k)) --tp-size 1 \
#          --context-length 36864 --mem-fraction-static 0.85 --api-key "$KEY"
#    The trainer checks every server's context at start-up and stops with this advice if it is short.
#    --api-key is optional: with it every request needs "Authorization: Bearer $KEY" (/health
#    excepted); pass the same key to the router and rollout.api_key=$KEY to the trainer.
#    Weights over NCCL (the default) put the trainer and the servers in one NCCL communicator: the
#    trainer must run the torch SGLang 0.5.23 pins (2.14.1, same CUDA flavour: the same NCCL); the
#    trainer checks the servers' SGLang version against its torch at start-up.
# 3. The router, in front of all servers (requests are one per prompt, spread over the workers):
#      python -m sglang_router.launch_router --host 0.0.0.0 --port 31000 --policy cache_aware \
#          --worker-urls http://r0:30000 http://r0:30001 ... http://r1:30000 ... --request-timeout-secs 10800 \
#          --prometheus-port 31001 --disable-health-check --api-key "$KEY"
#    --request-timeout-secs must exceed the longest request (rollout.generate_timeout_s), else the
#    router re-sends it and finally answers HTTP 500; give each router on a host its own
#    --prometheus-port (the default 29000 collides; 31001 here). --disable-health-check: SGLang's /health
#    blocks while generation is paused and answers 503 after 20 s, and the router's default checks
#    (every 60 s, unhealthy after 3 failures) drop every worker during a pause of about 2 minutes
#    (a disk reload from a shared filesystem): the trainer pauses the servers itself, probes them
#    and keeps the worker list (docs/sglang.md, "The router's health checks").
# 4. On every trainer node (the default layout: two trainer nodes, node1 and node2, after the
#    rollout node; NODE_RANK 0 on node1, 1 on node2):
#      NNODES=2 NODE_RANK=$RANK MASTER_ADDR=node1 bash examples/run_gppo_qwen3_8b.sh rollout.urls=[http://router:31000]
#    The trainer asks the router for its workers (GET /workers) and updates each worker directly
#    (never through the router), checked by weight_version.
#    Weights travel without files (rollout.weight_sync=distributed, the default): the leader of each
#    pipeline stage (tp=0, dp=0, cp=0 of the stage; global rank 0 for stage 0) hosts a TCP store at
#    rollout.sync_master_port + stage (SYNC_MASTER_PORT below; 0: a free port each run) and every
#    server joins an NCCL group with it (SGLang's /init_weights_update_group; a server started with
#    --tp N takes N ranks); every step the stage leaders broadcast their layers from GPU memory in
#    buckets of rollout.sync_bucket_mb (pause -> begin_weight_update -> update_weights_from_distributed
#    per bucket -> end_weight_update -> update_weight_version -> continue). Therefore:
#      - every server must reach the stage leaders' nodes: TCP to the store port, and NCCL's own
#        connections (sockets / IB). Open them between trainer and rollout nodes; with a fixed port
#        range set SYNC_MASTER_PORT (e.g. 29600; stage s uses 29600 + s), and rollout.sync_master_addr
#        when the address routing to the servers is not the one they should dial;
#      - NCCL picks its interfaces on both sides: set NCCL_SOCKET_IFNAME (e.g. ib0 or eth0; and
#        NCCL_IB_HCA for InfiniBand) the same way for the trainer and the SGLang servers when nodes
#        have several; GLOO_SOCKET_IFNAME likewise for rollout.sync_backend=gloo;
#      - servers run with dp_size 1 and pp_size 1 (one server per replica behind the router).
#    A server that cannot join fails the start-up within rollout.sync_group_timeout_s naming it; one
#    lost during a sync fails the step within rollout.sync_bucket_timeout_s (the others stay paused;
#    restart the server and the run resumes from its last checkpoint). After the first sync, a
#    resume and every rollout.verify_interval steps each server's log-probs of a probe must equal the
#    trainer's. rollout.weight_sync=disk instead writes <rollout.sync_dir>/step_NNNNNNN (NNNNNNN: the
#    weight version; on a filesystem the servers read) and has every server reload it in parallel
#    (update_weights_from_disk).
#    Servers on the training GPUs instead (no rollout nodes), with rollout.colocate=true: the
#    servers release their memory while the actor trains and get the weights in memory, each
#    server rank from the trainer rank on its own GPU (docs/sglang.md, "Colocated servers"). Start
#    each server on its training GPU, every GPU left visible (no CUDA_VISIBLE_DEVICES: the
#    trainer maps server ranks to its own ranks by the GPU index each reports), with:
#      SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false SGLANG_MEMORY_SAVER_CUDA_GRAPH=true \
#      SGLANG_EXPOSE_OWN_ENV_VARS=true SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 \
#      python -m sglang.launch_server --base-gpu-id $GPU --model-path /shared/klear-sft-8b-hf \
#          --host 0.0.0.0 --port $((30000 + GPU)) --tp-size 1 --context-length 36864 \
#          --enable-memory-saver --mem-fraction-static 0.5
#    (health generation off: a /health probe would otherwise generate on the released memory and
#    crash the server; the CUDA-graph saver: without it releasing cuda_graph frees nothing;
#    SGLANG_EXPOSE_OWN_ENV_VARS lets the trainer check both at start-up), and the router as in 3,
#    with --disable-health-check. With rollout.weight_sync=disk the weights go through
#    rollout.sync_dir instead (the configs: /shared/<run>/weights, one per run; default
#    <train.save_dir>/weights), which every server must read: a shared filesystem across the
#    trainer's nodes (on one node, /dev/shm will do).
# For code RL afterwards: CONFIG=examples/configs/gppo_qwen3_8b_code.yaml (its model.path: the math
# RL run's last checkpoint, runs/klear-gppo-8b-math/iter_0000240)
set -euo pipefail
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
# seconds torchrun gives the ranks after forwarding a stop signal before SIGKILL (torchrun: 30): they
# finish their step and save (the stop line in the log says how long that took; docs/slurm.md)
export SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-540}  # (exported: the trainer says when a stop would need more)
CONFIG=${CONFIG:-examples/configs/gppo_qwen3_8b_math.yaml}
SYNC_MASTER_PORT=${SYNC_MASTER_PORT:-0}  # the weight-update groups' store port (stage s: + s); 0: a free one
export CUDA_DEVICE_MAX_CONNECTIONS=1
# The weight-update groups put the stage leaders and the SGLang servers' ranks in one NCCL
# communicator, and SGLang starts its processes with NCCL's cuMem allocator and NVLink SHARP off:
# the trainer's side must match, or same-node updates hang or fail. NCCL reads these once per
# process, so they are set here, before torchrun (a value already in the environment wins).
export NCCL_CUMEM_ENABLE=${NCCL_CUMEM_ENABLE:-0}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
# fewer fragmentation OOMs with packed micro-batches of varying length (the trainer's processes only)
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
# NCCL_SOCKET_IFNAME / NCCL_IB_HCA / GLOO_SOCKET_IFNAME, when set, reach every rank from here.

# megatron_klear.platform.launch is torchrun (same arguments) that ends a user error (a wrong key,
# a missing file ...) with one "error: ..." line, last, and exit status 2 (docs/training.md#user-errors-under-torchrun)
exec "${PY:-python}" -m megatron_klear.platform.launch \
  --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout "$SHUTDOWN_TIMEOUT" \
  -m megatron_klear rl --config "$CONFIG" "rollout.sync_master_port=$SYNC_MASTER_PORT" "$@"
