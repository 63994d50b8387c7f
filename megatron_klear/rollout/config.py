"""The ``rollout`` section of a job config: which engine generates (the table of engines is
:mod:`.engines`), how requests reach the servers, how weights reach them, and whether they share the
trainer's GPUs (validated at start; errors name the key)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_klear.platform.errors import ConfigError
from megatron_klear.rollout.engines import engine_spec

#: how a weight push pauses the servers (``rollout.pause_mode``): ``abort`` ends the requests in
#: flight (the client sends them again, with the new weights); ``retract`` keeps them (the servers
#: recompute their KV cache with the new weights and continue: their later tokens carry the new
#: version). Each family's dialect names them in its server's words.
PAUSE_MODES = ("abort", "retract")


@dataclass
class RolloutConfig:
    """Where responses come from. Sampling temperature is rl.temperature (one value for the engine
    and for the trainer's log-prob recompute).

    ``engine=sglang``: SGLang servers, directly or behind sglang-router (``urls``). Generation is sent as
    concurrent requests (one per prompt with ``n`` samples, or one per sample), at most
    ``max_concurrent_requests`` in flight; weight updates go to every worker (``workers``, or the
    router's ``GET /workers``), never to the router."""

    # embedded (torch, in the driver process) | sglang (SGLang servers / sglang-router; "http" before) |
    # vllm (vLLM servers): the table of engines, megatron_klear/rollout/engines.py
    engine: str = "embedded"
    urls: list = field(default_factory=list)  # servers: where /generate goes: one sglang-router, or the servers
    workers: list = field(
        default_factory=list
    )  # servers: the servers for weight updates (default: asked from the router)
    max_new_tokens: int = 32768
    top_p: float = 1.0
    top_k: int = -1
    dtype: str = "fp32"  # embedded engine dtype
    sync_dir: str = ""  # servers: shared directory for weight updates from disk (default <save_dir>/weights)
    generate_timeout_s: float = 3600.0  # one /generate request (one prompt's samples)
    control_timeout_s: float = 60.0  # health, info, pause/continue
    weight_update_timeout_s: float = 1800.0  # one server's reload of the weights
    max_concurrent_requests: int = 512  # /generate requests in flight
    request_granularity: str = "prompt"  # prompt (one request per prompt, n samples) | sample (one per sample)
    max_retries: int = 2  # per request, after a transport error, a 5xx or an abort
    health_check_interval_s: float = 10.0  # probe every worker's /health this often while generating
    health_check_timeout_s: float = 10.0
    health_failure_threshold: int = 3  # missed probes in a row before a worker is dropped for the step
    # The fleet (rollout/servers/fleet.py): a worker that dies, freezes or keeps failing is dropped and
    # its requests go to the others; the step fails, naming the lost workers, once fewer than this remain.
    # A dropped worker that answers again is given the current weights at the next push, then rejoins.
    min_live_workers: int = 1
    api_key: str = ""  # servers: the servers' (and router's) --api-key, sent as "Authorization: Bearer <key>"
    send_seed: bool = False  # send sampling_seed (SGLang honours it only with --enable-deterministic-inference)
    # Partial rollouts (docs/async.md): once rl.prompts_per_step groups of the over-sampled prompts are
    # complete and graded, the requests still running are aborted and their partial responses continued
    # first at the next step (under the new weights). Needs rollout servers (engine=sglang or vllm).
    partial: bool = False
    chunk_prompts: int = 0  # embedded engine: prompts per generate call, graded while the next runs (0: one call)
    # servers: how weights reach the servers. distributed: SGLang's update_weights_from_distributed, a
    # bucketed broadcast from each pipeline stage's leader over a process group with every server
    # (rollout/weight_sync/distributed.py); disk: a versioned HF directory in sync_dir that every server reloads;
    # memory (colocate): buckets shared in memory, each server rank mapping the copy of the trainer rank on its
    # own GPU (relayed from rank 0),
    # loaded through SGLang's update_weights_from_tensor (rollout/weight_sync/in_memory.py; disk where it cannot).
    # auto: distributed, or memory with colocate (NCCL cannot pair the trainer's rank with a server on its own GPU).
    weight_sync: str = "auto"  # auto | distributed | disk | memory
    # servers: how a weight push pauses them: abort (requests in flight end and are sent again) |
    # retract (they survive the push and continue with the new weights) | auto (retract when
    # rl.async_steps > 0, else abort)
    pause_mode: str = "auto"
    sync_bucket_mb: float = 1024.0  # distributed: tensors per broadcast (one dtype per bucket)
    sync_backend: str = "auto"  # distributed: auto (nccl on GPU, gloo on CPU) | nccl | gloo
    # distributed: the address servers reach the stage leaders at ("": the interface routing to the first server)
    sync_master_addr: str = ""
    sync_master_port: int = 0  # distributed: stage s hosts its group's TCP store at this port + s (0: a free port)
    sync_group_timeout_s: float = 120.0  # distributed: creating the group with every server
    sync_bucket_timeout_s: float = 300.0  # distributed: one bucket's broadcast (and the servers' answer)
    # distributed: after the first sync, send per tensor only the elements whose value changed (their
    # positions and values), or the tensor whole when that is smaller: off | on | auto (on where the
    # servers take it: vLLM with this package's transfer engine; SGLang 0.5.23 does not). YAML's
    # on/off (read as true/false) are taken as they are meant.
    sync_delta: bool | str = "off"
    sync_full_every: int = 50  # sync_delta: a full sync after this many delta syncs (a safety net)
    # Probe check: the servers' log-probs of a fixed greedy probe must equal the trainer's (within a
    # dtype-aware tolerance) after the first sync, after a resume, and every verify_interval steps
    # (0: only those two; -1: never); verify_tolerance 0: by dtype (rl/rollout/verify.py).
    verify_interval: int = 10
    verify_tolerance: float = 0.0
    # MoE models: the trainer's old-log-prob pass routes each token to the experts the engine chose
    # (Megatron-Core's RouterReplay), so that routing differences do not enter the old log-probs.
    # The embedded engine records them; SGLang servers return them when started with
    # --enable-return-routed-experts (return_routed_experts). Any TP/SP/PP/CP/EP layout.
    router_replay: bool = False
    # servers: the SGLang servers share the trainer's GPUs (started with --enable-memory-saver): they
    # release their KV cache, weights and CUDA graphs (/release_memory_occupation) before the trainer
    # builds its state and before every update; each sync resumes their weights, loads them (in memory,
    # or from disk), then resumes the rest. Needs weight_sync=memory or disk (auto picks memory).
    colocate: bool = False
    # colocate: the trainer frees its gradient buffers and moves its optimizer state to host memory
    # from each sync until the next update, while the servers hold theirs (training/offload.py)
    offload_trainer: bool = True
    # colocate: Megatron's NCCL communicators release their GPU memory while the servers hold theirs
    # (from each sync until the next update; training/comm_memory.py CommSuspension). auto: where
    # PyTorch (2.12+) and NCCL (2.29.7+) can; on: refused where they cannot; off: never (the default
    # until tools/gpu_session.sh has passed its suspension check on the pinned torch: docs/sglang.md)
    suspend_nccl: bool | str = "off"

    @property
    def servers(self) -> bool:
        """Rollout servers (SGLang or vLLM) rather than the in-process engine."""
        return engine_spec(self.engine).servers

    def validate(self):
        if isinstance(self.sync_delta, bool):  # YAML's on / off
            self.sync_delta = "on" if self.sync_delta else "off"
        if isinstance(self.suspend_nccl, bool):
            self.suspend_nccl = "on" if self.suspend_nccl else "off"
        if self.suspend_nccl not in ("auto", "on", "off"):
            raise ConfigError(f"rollout.suspend_nccl must be auto, on or off, got {self.suspend_nccl!r}")
        if self.suspend_nccl == "on" and not self.colocate:
            raise ConfigError(
                "rollout.suspend_nccl=on releases the trainer's NCCL memory for servers on its GPUs: it needs "
                "rollout.colocate=true"
            )
        spec = engine_spec(self.engine)
        self.engine = spec.name  # an older name (http) is read as the engine's own
        if spec.check is not None:
            spec.check(self)
        if self.pause_mode == "auto":  # a job's config derives it from rl.async_steps first
            self.pause_mode = "abort"
        if self.pause_mode not in PAUSE_MODES:
            raise ConfigError(f"rollout.pause_mode must be auto or one of {PAUSE_MODES}, got {self.pause_mode!r}")
        if self.max_new_tokens < 1:
            raise ConfigError("rollout.max_new_tokens must be >= 1")
        if self.request_granularity not in ("prompt", "sample"):
            raise ConfigError(f"rollout.request_granularity must be prompt or sample, got {self.request_granularity!r}")
        if self.min_live_workers < 1:
            raise ConfigError(f"rollout.min_live_workers must be >= 1, got {self.min_live_workers}")
        if self.max_concurrent_requests < 1 or self.health_failure_threshold < 1 or self.max_retries < 0:
            raise ConfigError(
                "rollout: max_concurrent_requests and health_failure_threshold must be >= 1, max_retries >= 0"
            )
        for key in (
            "generate_timeout_s",
            "control_timeout_s",
            "weight_update_timeout_s",
            "health_check_interval_s",
            "health_check_timeout_s",
            "sync_bucket_mb",
            "sync_group_timeout_s",
            "sync_bucket_timeout_s",
        ):
            if getattr(self, key) <= 0:
                raise ConfigError(f"rollout.{key} must be > 0, got {getattr(self, key)}")
        if self.weight_sync not in ("auto", "distributed", "disk", "memory"):
            raise ConfigError(
                f"rollout.weight_sync must be auto, distributed, disk or memory, got {self.weight_sync!r}"
            )
        if self.colocate and not self.servers:
            raise ConfigError(
                "rollout.colocate is for rollout servers on the trainer's GPUs (rollout.engine=sglang); the "
                "embedded engine already runs inside the trainer's driver process"
            )
        if self.colocate and self.weight_sync == "distributed":
            raise ConfigError(
                "rollout.colocate with rollout.weight_sync=distributed: a server on the trainer's own GPU "
                "cannot join the trainer's NCCL group (NCCL refuses two ranks of one group on one "
                "device); use rollout.weight_sync=memory or disk (or auto)"
            )
        if self.weight_sync == "memory" and not self.colocate:
            raise ConfigError(
                "rollout.weight_sync=memory hands the trainer's weights to servers on its own GPUs "
                "(rollout.colocate=true); servers on their own GPUs take them over update groups "
                "(rollout.weight_sync=distributed, or auto)"
            )
        if self.weight_sync == "auto":
            self.weight_sync = "memory" if self.colocate else "distributed"
        if self.sync_delta not in ("off", "on", "auto"):
            raise ConfigError(f"rollout.sync_delta must be off, on or auto, got {self.sync_delta!r}")
        if self.sync_delta == "on" and self.weight_sync != "distributed":
            raise ConfigError(
                f"rollout.sync_delta=on streams changes over the update groups: it needs "
                f"rollout.weight_sync=distributed, got {self.weight_sync!r}"
            )
        if self.sync_full_every < 1:
            raise ConfigError(f"rollout.sync_full_every must be >= 1, got {self.sync_full_every}")
        if self.sync_backend not in ("auto", "nccl", "gloo"):
            raise ConfigError(f"rollout.sync_backend must be auto, nccl or gloo, got {self.sync_backend!r}")
        if not 0 <= self.sync_master_port < 65536:
            raise ConfigError(
                f"rollout.sync_master_port must be a port number (0: a free one), got {self.sync_master_port}"
            )

        if self.verify_interval < -1 or self.verify_tolerance < 0:
            raise ConfigError("rollout.verify_interval must be >= -1 and rollout.verify_tolerance >= 0")
