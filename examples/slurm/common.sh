# Shared by the sbatch scripts of examples/slurm/ (sourced, not run): roles started as job steps,
# bounded waits with errors that name what did not come up, addresses from Slurm (never from DNS:
# node names do not resolve on every cluster), preemption by save-and-requeue (docs/slurm.md).
#
# Conventions: LOG_DIR is set; every role runs as one `srun --overlap` step named after it, with
# its log in $LOG_DIR/<role>.log; klear_run_trainer ends the script with the trainer's exit status.
#
# Stopping. The servers' and the router's tasks start with SIGTERM ignored, for the programs that
# keep that (the CPU stand-in); sglang-router and SGLang's / vLLM's HTTP servers install their own
# handler and stop at once when Slurm signals every process of the job (scancel, scontrol requeue,
# preemption with PreemptMode=REQUEUE: SIGTERM to all, SIGKILL KillWait seconds later). The trainer
# does not need them then: it cancels the generation in flight, ends an update without pushing it,
# and saves (docs/slurm.md, Preemption). The script stops the roles with SIGKILL once the trainer
# has ended.
# - SIGUSR1 to this script (#SBATCH --signal=B:USR1@<seconds>: the time limit or a preemption
#   announced ahead): the trainer's step gets SIGTERM (it saves and stops), then the script
#   requeues the job, which resumes from that step.
# - SIGTERM to this script (Slurm stopping the job): the trainer got it too and saves; the script
#   waits for it and ends with its status; Slurm requeues the job or not, as it was told.

# klear_nccl_for_weight_updates: NCCL's cuMem allocator and NVLink SHARP (NVLS) off for every role
# of a job whose weight-update groups put the trainer's stage leaders and the servers' ranks in one
# NCCL communicator (GPPO: both sides must match, or same-node updates hang or fail). SGLang 0.5.23
# turns both off in its own processes when unset (srt/entrypoints/engine.py _set_envs_and_config);
# vLLM 0.32 keeps NCCL's defaults, so its servers get them from here (srun passes the environment
# on). NCCL reads them once per process; a value exported before sbatch wins. An SFT job does not
# call this: it keeps NCCL's defaults (NVLS speeds its all-reduces on NVSwitch nodes).
klear_nccl_for_weight_updates() {
  export NCCL_CUMEM_ENABLE=${NCCL_CUMEM_ENABLE:-0}
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
}
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True is set by the trainer's launcher
# (examples/run_gppo_qwen3_8b.sh, run_sft_qwen3_8b.sh), not here: exported job-wide it would reach
# the servers, where SGLang's memory saver (colocated servers) does not work with expandable segments.

ROLE_PIDS=()   # srun pids of the long-running roles (servers, router)
ROLE_NAMES=()
PREEMPTED=0    # SIGUSR1: save, then requeue
STOPPING=0     # SIGTERM: Slurm stops the job

klear_log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*"; }
klear_die() { klear_log "error: $*" >&2; klear_stop_all 2; }

trap klear_on_usr1 USR1
trap klear_on_term TERM

# NODES: the allocation's node names, in Slurm's order.
klear_nodes() {
  [[ -n "${SLURM_JOB_NODELIST:-}" ]] || { echo "error: not inside a Slurm job (no SLURM_JOB_NODELIST); use sbatch" >&2; exit 2; }
  mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
}

# The address other nodes reach NODE at: Slurm's NodeAddr (the node name when Slurm has no other).
klear_addr() {
  local addr
  addr=$(scontrol show node "$1" -o | sed -n 's/.* NodeAddr=\([^ ]*\).*/\1/p')
  echo "${addr:-$1}"
}

# klear_start ROLE NODE SETUP COMMAND [SRUN FLAGS...]: one task on NODE running SETUP (shell text: the
# step's GPUs, klear_step_gpus; may be empty) then COMMAND (bash -c), in the background; the extra
# srun flags (a container image) apply to this step only.
klear_start() {
  local role=$1 node=$2 setup=$3 cmd=$4
  shift 4
  klear_log "start $role on $node: $cmd"
  # shellcheck disable=SC2068
  srun --overlap --nodes=1 --ntasks=1 --nodelist="$node" --kill-on-bad-exit=0 --job-name="$role" \
    --output="$LOG_DIR/$role.log" "$@" bash -c "trap '' TERM; $setup
$cmd" &
  ROLE_PIDS+=($!)
  ROLE_NAMES+=("$role")
}

# The first started role that has exited (its name), or nothing.
klear_dead_role() {
  local i
  for i in "${!ROLE_PIDS[@]}"; do
    if ! kill -0 "${ROLE_PIDS[$i]}" 2>/dev/null; then
      echo "${ROLE_NAMES[$i]}"
      return
    fi
  done
}

# GPUs. No step asks Slurm for GPUs of its own: a step that names no GRES is given all of the job's
# GPUs on its node (srun(1), --gres: "By default, a job step is allocated all of the generic
# resources that have been allocated to the job"), and the script hands each server its own slice
# of that list. Steps that ask --gres=gpu:N with --overlap share instead of splitting: srun sets
# SSF_OVERLAP_FORCE, and Slurm's step manager then allocates GRES without taking them from what the
# other steps hold (gres_stepmgr_step_alloc(..., decr_job_alloc = !(flags & SSF_OVERLAP_FORCE))),
# so every server of a node got the lowest indices, GPU 0.
# The router and the evaluation use no GPU: --gres=none.

# klear_step_gpus FIRST COUNT ROLE: shell text that a step runs first: CUDA_VISIBLE_DEVICES becomes
# entries FIRST .. FIRST+COUNT-1 of the list Slurm gave the step (0 1 2 ... where it set none: a
# cluster without GPU GRES), or the step ends naming the shortfall; then the step's log says what
# ROLE got ("<role> on <node>: CUDA_VISIBLE_DEVICES=<list>").
klear_step_gpus() {
  local first=$1 count=$2 role=$3 last=$(($1 + $2))
  cat <<EOF
ids=\${CUDA_VISIBLE_DEVICES-\$(seq -s, 0 $((last - 1)))}; IFS=, read -ra ids <<<"\$ids"
if ((\${#ids[@]} < $last)); then echo "error: $role needs entries $first-$((last - 1)) of its node's GPUs, and Slurm gave this step \${#ids[@]} (CUDA_VISIBLE_DEVICES=\${CUDA_VISIBLE_DEVICES-unset}): SERVERS_PER_NODE x SERVER_TP (or GPUS_PER_NODE) is more than the job's GPUs a node" >&2; exit 2; fi
export CUDA_VISIBLE_DEVICES=\$(IFS=,; echo "\${ids[*]:$first:$count}")
echo "$role on \${SLURMD_NODENAME:-\$(hostname)}: CUDA_VISIBLE_DEVICES=\$CUDA_VISIBLE_DEVICES"
EOF
}

# klear_no_gpus: the srun flag of a step that uses no GPU (none where the cluster has no GPU GRES)
klear_no_gpus() {
  if ((${GRES_GPUS:-1} > 0)); then echo "--gres=none"; fi
}

# klear_check_grace: SHUTDOWN_TIMEOUT against the --signal lead (SIGNAL_LEAD, else this script's own
# #SBATCH --signal=B:USR1@<lead> line): the trainer's grace must end at least 30 s before the job's
# time does, or the requeue comes too late; logged, not refused.
klear_check_grace() {
  local lead=${SIGNAL_LEAD:-$(sed -n 's/^#SBATCH --signal=B:USR1@\([0-9]*\).*/\1/p' "$0" | head -1)}
  [[ -n "$lead" ]] || return 0
  if ((SHUTDOWN_TIMEOUT + 30 > lead)); then
    klear_log "warning: SHUTDOWN_TIMEOUT=$SHUTDOWN_TIMEOUT s leaves less than 30 s of the --signal lead ($lead s) to requeue the job: raise the lead (#SBATCH --signal=B:USR1@<s>, and SIGNAL_LEAD when given on the command line) or lower SHUTDOWN_TIMEOUT (docs/slurm.md, Sizing the grace)" >&2
  fi
}

klear_http_ok() { curl -sf -o /dev/null --max-time 5 "$1"; }

# klear_check_python VAR MODULE...: the interpreter named by the variable VAR finds every MODULE
# (importlib's find_spec: nothing is imported), checked before any role starts; otherwise the job
# ends at once (status 2) naming the variable to set. Each role runs from its own environment on a
# cluster (SGLang and vLLM pin their own torch), so a default of `python` for a server would
# otherwise fail only after the job waited for its nodes. Where the role has srun flags of its own
# (<ROLE>_SRUN_ARGS for <ROLE>_PY: a pyxis container image, whose python exists only inside it),
# the check runs as a one-task step with them on the first node (up to 10 minutes: the image may be
# imported first); otherwise on the batch host, within 60 s.
klear_check_python() {
  local var=$1 py=${!1} flags_var=${1%_PY}_SRUN_ARGS out missing where="here" flags=()
  shift
  read -ra flags <<<"${!flags_var:-}"
  # one marked line, so that what else the step prints (srun's or a container's notices) is not read
  # as module names; a package whose parent is missing (megatron.core) counts as missing
  local probe=("$py" -c 'import importlib.util, sys
def gone(m):
    try:
        return importlib.util.find_spec(m) is None
    except ImportError:
        return True
print("klear-missing:", " ".join(m for m in sys.argv[1:] if gone(m)))' "$@")
  if ((${#flags[@]})); then
    where="in $flags_var's environment on ${NODES[0]}"
    # shellcheck disable=SC2046
    out=$(timeout 600 srun --overlap --nodes=1 --ntasks=1 --nodelist="${NODES[0]}" --job-name="check-$var" \
      $(klear_no_gpus) "${flags[@]}" "${probe[@]}" 2>&1) ||
      klear_die "$var=$py cannot run $where ($(tail -3 <<<"$out")): set $var (and $flags_var) to the environment that has ${*} (docs/slurm.md)"
  else
    out=$(timeout 60 "${probe[@]}" 2>&1) ||
      klear_die "$var=$py cannot run here ($(tail -3 <<<"$out")): set $var to the python of the environment that has ${*} (docs/slurm.md)"
  fi
  missing=$(sed -n 's/^klear-missing: *//p' <<<"$out" | tail -1)
  grep -q '^klear-missing:' <<<"$out" ||
    klear_die "$var=$py did not answer the module check $where ($(tail -3 <<<"$out")) (docs/slurm.md)"
  [[ -z "$missing" ]] ||
    klear_die "$var=$py has no module ${missing// /, } ($where): set $var to the python of the environment that has it (docs/slurm.md)"
}

# klear_check_server_python: SERVER_PY as ENGINE needs it
klear_check_server_python() {
  case "$ENGINE" in
    sglang) klear_check_python SERVER_PY sglang ;;
    vllm) klear_check_python SERVER_PY vllm ;;
    standin) klear_check_python SERVER_PY megatron_klear torch uvicorn ;;
  esac
}

# klear_start_servers NODE...: SERVERS_PER_NODE rollout servers on each NODE (ENGINE sglang, vllm or
# standin; SERVER_PY, SERVER_MODEL, SERVER_PORT + k, SERVER_TP GPUs each, SERVER_ARGS, the srun
# flags SERVER_SRUN), then waits until each answers /health; URLS: their addresses. Shared by the
# GPPO and the evaluation scripts.
klear_start_servers() {
  local node addr k port gpus cmd url
  URLS=()
  for node in "$@"; do
    addr=$(klear_addr "$node")
    for ((k = 0; k < SERVERS_PER_NODE; k++)); do
      port=$((SERVER_PORT + k))
      # server k: entries k*SERVER_TP ... of the node's GPUs (klear_step_gpus)
      gpus=$(klear_step_gpus $((k * SERVER_TP)) "$SERVER_TP" "server-$node-$k")
      case "$ENGINE" in
        sglang) cmd="SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 $SERVER_PY -m sglang.launch_server --model-path $SERVER_MODEL --host 0.0.0.0 --port $port --tp-size $SERVER_TP $SERVER_ARGS" ;;
        # (a context beyond the checkpoint's positions, Klear's 36864 over Qwen3-Base's 32768: vLLM
        # 0.32 refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, config/model.py; SGLang's variable above)
        vllm) cmd="VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 $SERVER_PY -m vllm.entrypoints.openai.api_server --model $SERVER_MODEL --host 0.0.0.0 --port $port --tensor-parallel-size $SERVER_TP $SERVER_ARGS" ;;
        # (the CPU stand-in models SERVER_TP ranks on the GPUs it is given: rollout/sglang_standin/gpus.py)
        standin) cmd="$SERVER_PY -m megatron_klear.rollout.sglang_standin --model $SERVER_MODEL --host 0.0.0.0 --port $port --tp-size $SERVER_TP $SERVER_ARGS" ;;
        *) klear_die "ENGINE=$ENGINE: sglang, vllm or standin" ;;
      esac
      klear_start "server-$node-$k" "$node" "$gpus" "$cmd" "${SERVER_SRUN[@]}"
      URLS+=("http://$addr:$port")
    done
  done
  for url in "${URLS[@]}"; do
    klear_wait "rollout server $url" "$STARTUP_TIMEOUT" klear_http_ok "$url/health" || klear_stop_all 3
  done
}

# klear_start_router NODE: sglang-router on NODE in front of URLS (ROUTER_PY, ROUTER_PORT,
# ROUTER_METRICS_PORT, the srun flags ROUTER_SRUN), waits until it lists every server;
# ROUTER_URL: its address.
klear_start_router() {
  ROUTER_URL="http://$(klear_addr "$1"):$ROUTER_PORT"
  klear_start router "$1" "" "$ROUTER_PY -m sglang_router.launch_router --host 0.0.0.0 --port $ROUTER_PORT \
    --worker-urls ${URLS[*]} --policy cache_aware --request-timeout-secs 10800 \
    --prometheus-port $ROUTER_METRICS_PORT --disable-health-check" $(klear_no_gpus) "${ROUTER_SRUN[@]}"
  klear_wait "the router at $ROUTER_URL with ${#URLS[@]} workers" "$STARTUP_TIMEOUT" \
    klear_router_has "$ROUTER_URL" "${#URLS[@]}" || klear_stop_all 3
}

# klear_router_has URL N: the sglang-router at URL lists N workers (GET /workers).
klear_router_has() {
  local n
  n=$(curl -sf --max-time 5 "$1/workers" | grep -o '"url"' | wc -l) || return 1
  ((n >= $2))
}

# klear_wait WHAT TIMEOUT CHECK...: run CHECK every 2 s until it succeeds (0), TIMEOUT seconds pass
# or a started role dies (1, with an error naming WHAT or the dead role and its log).
klear_wait() {
  local what=$1 timeout=$2 start=$SECONDS dead
  shift 2
  until "$@"; do
    dead=$(klear_dead_role)
    if [[ -n "$dead" ]]; then
      klear_log "error: $dead exited while waiting for $what; see $LOG_DIR/$dead.log" >&2
      return 1
    fi
    if ((SECONDS - start > timeout)); then
      klear_log "error: $what did not come up within ${timeout}s; see the logs in $LOG_DIR" >&2
      return 1
    fi
    sleep 2
  done
  klear_log "up: $what ($((SECONDS - start))s)"
}

# klear_signal_step NAME SIGNAL: SIGNAL to every task of this job's step NAME (srun --job-name).
klear_signal_step() {
  local step
  for step in $(squeue -h -s -j "$SLURM_JOB_ID" -o "%i %j" | awk -v n="$1" '$2 == n {print $1}'); do
    scancel --signal="$2" "$step" 2>/dev/null
  done
}

# Stop the trainer (SIGTERM: it saves) and every started role (SIGKILL). With GRACE (seconds), a
# trainer still running that long after SIGTERM is killed: when a role it needs is gone (the router,
# a server) it cannot finish its step, and torchrun would wait its whole --shutdown-timeout.
klear_stop_roles() {
  local role grace=${1:-} start=$SECONDS
  if [[ -n "${TRAINER_PID:-}" ]]; then
    klear_signal_step trainer TERM
    while [[ -n "$grace" ]] && kill -0 "$TRAINER_PID" 2>/dev/null; do
      if ((SECONDS - start >= grace)); then
        klear_log "the trainer did not stop within ${grace}s of SIGTERM (DEAD_ROLE_GRACE): killing it" >&2
        klear_signal_step trainer KILL
        break
      fi
      sleep 1
    done
    wait "$TRAINER_PID" 2>/dev/null
  fi
  for role in "${ROLE_NAMES[@]}"; do klear_signal_step "$role" KILL; done
  wait 2>/dev/null
}
klear_stop_all() {
  klear_stop_roles
  # a script's last words before it ends (the smoke job's table), when it defines them
  if declare -F klear_before_exit >/dev/null; then klear_before_exit "${1:-0}"; fi
  exit "${1:-0}"
}

klear_on_usr1() {
  ((PREEMPTED == 0)) || return 0
  PREEMPTED=1
  if [[ -z "${TRAINER_PID:-}" ]]; then
    klear_log "preempted before the trainer started"
    klear_requeue
  fi
  klear_log "preempted (SIGUSR1): the trainer saves its step and stops; the job is requeued after"
  klear_signal_step trainer TERM
}
klear_on_term() {
  STOPPING=1
  klear_log "Slurm stops the job (SIGTERM): the trainer saves its step; the servers wait for it"
  [[ -n "${TRAINER_PID:-}" ]] || klear_stop_all 143
}

# Stop the roles and put the job back in the queue (this script ends with it).
klear_requeue() {
  klear_stop_roles
  klear_log "requeueing job $SLURM_JOB_ID (it resumes from the step just saved)"
  scontrol requeue "$SLURM_JOB_ID" ||
    { klear_log "error: scontrol requeue $SLURM_JOB_ID failed: submit the job again (it resumes from the step saved)" >&2; exit 4; }
  exit 0
}

# klear_run_trainer NODELIST COMMAND [SRUN FLAGS...]: the trainer, one task per node (NODE_RANK =
# SLURM_NODEID of the step), each with the first GPUS_PER_NODE of its node's GPUs (TRAINER_LOG:
# the logs' name, trainer-node<i>.log by default); ends the script: with the trainer's status (when
# a node failed, the first failed node's), after stopping the other roles; when a role dies first, the trainer is
# stopped and the job fails naming it; when preempted, the job is requeued once the trainer has
# saved (its status 143: it stopped on the forwarded signal). The step states its task count: it
# would otherwise inherit the job's (SLURM_NTASKS), and on fewer nodes than the job has start
# several launchers per node.
# When one node's launcher fails (a crash, the node's out-of-memory killer), srun ends the others
# (--kill-on-bad-exit: SIGTERM, SIGKILL KillWait seconds later), so none waits in a collective for
# the lost ranks. Each task's bash records when its launcher ended and with what status (it catches
# SIGTERM, which Slurm sends to every process of the step, only to wait for the launcher), and the
# job's log names the node that failed first.
klear_run_trainer() {
  local nodes=$1 rc
  klear_train "$@"
  rc=$TRAINER_RC
  if ((rc != 0 && PREEMPTED == 0)); then
    # the job ends with the status of the node that failed first (srun's own is the highest of its
    # tasks': the others' 143, from the SIGTERM it sent them, would hide a node's 137)
    klear_first_failed_trainer_node "$nodes"
    rc=${FIRST_FAILED_STATUS:-$rc}
  fi
  ((PREEMPTED)) && klear_requeue
  klear_stop_all "$rc"
}

# klear_train NODELIST COMMAND [SRUN FLAGS...]: the trainer's step as klear_run_trainer starts it;
# returns once it has ended (TRAINER_RC: its status), the other roles left running; a role that
# dies first ends the job as there.
klear_train() {
  local nodes=$1 cmd=$2 n dead gpus
  shift 2
  n=$(tr ',' '\n' <<<"$nodes" | wc -l)
  gpus=$(klear_step_gpus 0 "$GPUS_PER_NODE" 'trainer-node$SLURM_NODEID')
  rm -f "$LOG_DIR"/trainer-node*.exit
  klear_log "start the trainer on $nodes"
  srun --overlap --nodes="$n" --ntasks="$n" --ntasks-per-node=1 --nodelist="$nodes" --kill-on-bad-exit=1 \
    --job-name=trainer --output="$LOG_DIR/${TRAINER_LOG:-trainer}-node%t.log" "$@" \
    bash -c "trap true TERM; $gpus
$cmd; rc=\$?; echo \"\$rc \$(date +%s.%N)\" > $LOG_DIR/trainer-node\$SLURM_NODEID.exit; exit \$rc" &
  TRAINER_PID=$!
  while kill -0 "$TRAINER_PID" 2>/dev/null; do
    dead=$(klear_dead_role)
    if [[ -n "$dead" && $PREEMPTED == 0 && $STOPPING == 0 ]]; then
      klear_log "error: $dead exited while the trainer runs; see $LOG_DIR/$dead.log; stopping the trainer" >&2
      klear_stop_roles "${DEAD_ROLE_GRACE:-60}"
      exit 3
    fi
    sleep 2 &
    wait $! 2>/dev/null
  done
  wait "$TRAINER_PID"
  TRAINER_RC=$?
  TRAINER_PID=
  klear_log "the trainer ended with status $TRAINER_RC"
}

# klear_first_failed_trainer_node NODELIST: the line that names the trainer node whose launcher
# ended first with a failure (from the tasks' trainer-node<i>.exit records), and its log;
# FIRST_FAILED_STATUS: that launcher's status.
klear_first_failed_trainer_node() {
  local first i code how
  first=$(for f in "$LOG_DIR"/trainer-node*.exit; do
    [[ -f "$f" ]] || continue
    read -r code at <"$f"
    ((code != 0)) && echo "$at ${f##*trainer-node} $code"
  done | sort -n | head -1)
  [[ -n "$first" ]] || return 0
  read -r _ i code <<<"$first"
  i=${i%.exit}
  FIRST_FAILED_STATUS=$code
  how="status $code"
  ((code > 128)) && how="$how (killed by SIG$(kill -l $((code - 128)) 2>/dev/null || echo $((code - 128))))"
  klear_log "error: the trainer's launcher on $(tr ',' '\n' <<<"$1" | sed -n "$((i + 1))p") (trainer node $i) failed first, with $how; see $LOG_DIR/trainer-node$i.log; srun ended the other nodes' launchers (--kill-on-bad-exit)" >&2
}
