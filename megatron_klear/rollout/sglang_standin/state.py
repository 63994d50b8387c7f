"""What one stand-in server holds: the engine, its scheduler, and the state of the memory and
weight-update routes. One per app (``app.state.standin``), so that a process can serve several."""

from __future__ import annotations

import collections
import threading
import time

from megatron_klear.rollout.sglang_standin import sglang_env
from megatron_klear.rollout.sglang_standin.contract import DEFAULT_WEIGHT_VERSION
from megatron_klear.rollout.sglang_standin.gpus import ServerGPUs
from megatron_klear.rollout.sglang_standin.scheduler import Scheduler

HOST = "127.0.0.1"


class ServerState:
    def __init__(
        self,
        engine,
        tokenizer,
        tokenizer_path,
        served_model_name,
        max_running_requests,
        max_total_tokens,
        batch_window,
        weight_sync_timeout: float = 600.0,
        return_routed_experts: bool = False,
        enable_memory_saver: bool = False,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        custom_weight_loader=(),
        gpus=None,
    ):
        self.engine, self.tokenizer = engine, tokenizer
        # its TP ranks' GPUs as CUDA gives them (--tp-size, --base-gpu-id, CUDA_VISIBLE_DEVICES): gpus.py
        self.gpus = gpus if gpus is not None else ServerGPUs()
        # --enable-memory-saver: releasing "weights" frees them (rollout.colocate); the tags released
        self.enable_memory_saver = bool(enable_memory_saver)
        self.offload_tags = set()
        self.memory_releases = 0
        self.weight_updates = collections.Counter()  # update calls that loaded or staged, by route
        # the shared-memory managers of the CPU storages loaded in memory (one per sharing process)
        self.tensor_sharers = set()
        # SGLANG_MEMORY_SAVER_CUDA_GRAPH, read at start-up as SGLang reads it when it captures its graphs:
        # without it releasing "cuda_graph" frees nothing
        self.memory_saver_cuda_graph = sglang_env.bool_env_var(sglang_env.MEMORY_SAVER_CUDA_GRAPH)
        # --api-key / --admin-api-key (SGLang's auth rules: sglang_env.auth_status)
        self.api_key, self.admin_api_key = api_key or None, admin_api_key or None
        # --enable-return-routed-experts: the engine records every token's experts (MoE models)
        self.return_routed_experts = bool(return_routed_experts) and bool(getattr(engine, "routed_layers", None))
        if self.return_routed_experts:
            engine.record_routing = True
        self.tokenizer_path = tokenizer_path
        self.served_model_name = served_model_name
        self.scheduler = Scheduler(engine, max_running_requests, max_total_tokens, window=batch_window)
        self.num_generate_requests = 0
        self.lock = threading.Lock()
        self.health_check_timeout = sglang_env.health_check_timeout()
        self.force_stream_interval = sglang_env.force_stream_interval()
        # when the scheduler last answered something (a decode step, a control call it serves): SGLang's
        # last_receive_tstamp, which a health probe waits to see move
        self.last_receive = time.monotonic()
        # a generation ran on memory the memory saver had unmapped: SGLang's scheduler dies of it
        # (launcher: the server answers that probe, then exits); the message
        self.fault = None
        self.on_fault = None  # set by the launcher: how this server dies
        self.host, self.port = HOST, 0
        # weights over a process group (SGLang's update_weights_from_distributed): the groups joined,
        # the open begin/end session, and a lock that runs these calls one at a time, as SGLang's
        # scheduler does
        self.weight_sync_timeout = float(weight_sync_timeout)
        self.update_groups = {}
        self.weight_session = None
        self.receive_buffers = {}  # the storages the last commit replaced: the next update lands there
        self.adopted = set()  # data pointers of the received buffers the model holds
        self.weight_lock = threading.Lock()
        # --custom-weight-loader: the import paths update_weights_from_tensor's load_format may name
        self.custom_weight_loader = [str(x) for x in custom_weight_loader or ()]

    def freed_memory_tags(self) -> set:
        """The released tags whose memory is really freed: none without ``--enable-memory-saver``
        (SGLang's no-op saver); ``cuda_graph`` only with ``SGLANG_MEMORY_SAVER_CUDA_GRAPH``."""
        if not self.enable_memory_saver:
            return set()
        freed = self.offload_tags & {"weights", "kv_cache"}
        if "cuda_graph" in self.offload_tags and self.memory_saver_cuda_graph:
            freed.add("cuda_graph")
        return freed

    @property
    def model_path(self) -> str:
        return self.engine.model_path or ""

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    @property
    def weight_version(self) -> str:
        v = self.engine.weight_version
        return DEFAULT_WEIGHT_VERSION if v is None else str(v)
