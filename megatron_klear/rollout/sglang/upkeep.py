"""Server upkeep of the SGLang client: the calls that keep SGLang servers fit to serve, besides
generation (:mod:`megatron_klear.rollout.servers.generation`) and the weight update's wire
(:mod:`megatron_klear.rollout.servers.wire`). They go to every *worker*, in parallel, never to the
router (``sglang-router`` has no such routes), and raise naming the first worker that failed.

- weights from disk: ``/pause_generation`` -> ``/flush_cache`` -> ``/update_weights_from_disk``
  (with ``weight_version``) -> ``/continue_generation``, then each worker must report the new
  version (``/model_info``);
- each worker's dtype and context length (with the tokens speculative decoding reserves);
- colocated servers: memory release / resume (``--enable-memory-saver``).

Bodies follow the request structs of SGLang 0.5.23's ``io_struct.py`` (the tests check them).
:class:`SGLangUpkeep` is a part of :class:`~megatron_klear.rollout.sglang.SGLangEngine`.
"""

from __future__ import annotations

from megatron_klear.rollout.base import EngineError

#: SGLang's memory types (``GPU_MEMORY_ALL_TYPES``) for /release_memory_occupation and /resume_memory_occupation
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")

# SGLang 0.5.23's speculative algorithms whose context check reserves draft tokens (spec_info.is_eagle)
EAGLE_FAMILY = ("EAGLE", "EAGLE3", "FROZEN_KV_MTP", "NEXTN")


class SGLangUpkeep:
    """The upkeep calls over the client's ``transport`` to the workers ``members`` lists; pauses and
    cache flushes go through the client's ``wire``; ``config``: the ``rollout`` section
    (``weight_update_timeout_s``: one worker's weight load)."""

    def __init__(self, transport, members, wire, config):
        self.transport, self.members, self.wire = transport, members, wire
        self.weight_update_timeout = float(config.weight_update_timeout_s)

    def check_started(self) -> None:
        """SGLang servers need no check at start-up beyond ``/health`` (:mod:`.compat` checks the
        environment of colocated servers and the NCCL build)."""

    # -- context length ----------------------------------------------------------------------------
    def context_length(self, url: str) -> int | None:
        """The longest prompt + response a worker accepts: ``/v1/models``' ``max_model_len``
        (SGLang's model_config.context_len), else ``/server_info``'s context length."""
        try:
            models = self.transport.request("GET", "/v1/models", url=url)
            cards = models.get("data") if isinstance(models, dict) else None
            if cards and isinstance(cards[0], dict) and cards[0].get("max_model_len"):
                return int(cards[0]["max_model_len"])
        except EngineError as e:
            if "HTTP 404" not in str(e):  # a server without the route falls back; anything else is an error
                raise
        info = self.transport.request("GET", "/server_info", url=url)
        for key in ("max_context_length", "context_length"):
            if isinstance(info, dict) and isinstance(info.get(key), int) and info[key] > 0:
                return int(info[key])
        return None

    def reserved_tokens(self, url: str) -> int:
        """The tokens SGLang 0.5.23 adds to every prompt in its context check for speculative decoding
        (``managers/utils.py`` ``compute_num_reserved_tokens``): with an EAGLE-family algorithm
        (EAGLE, EAGLE3, FROZEN_KV_MTP, NEXTN), ``max(speculative_eagle_topk * speculative_num_steps,
        speculative_num_draft_tokens)``, from ``/server_info``; else 0."""
        info = self.transport.server_info(url) or {}
        if str(info.get("speculative_algorithm") or "").upper() not in EAGLE_FAMILY:
            return 0
        topk, steps, draft = (
            int(info.get(k) or 0)
            for k in ("speculative_eagle_topk", "speculative_num_steps", "speculative_num_draft_tokens")
        )
        return max(topk * steps, draft)

    def check_context_length(self, needed: int, what: str = "") -> dict:
        """Fail unless every worker's context holds ``needed`` tokens (prompt + max_new_tokens) plus
        the tokens its speculative decoding reserves (:meth:`reserved_tokens`); returns {worker:
        context length}."""

        def ask(w):
            return self.context_length(w), self.reserved_tokens(w)

        answers = self.members.on_workers(ask, tolerate_loss=True)  # a worker gone is dropped
        lengths = {w: c for w, (c, _) in answers.items()}
        short = {w: (c, r) for w, (c, r) in answers.items() if c is not None and c < needed + r}
        if short:
            w, (c, r) = next(iter(short.items()))
            spec = f" and the {r} tokens its speculative decoding reserves (EAGLE)" if r else ""
            raise EngineError(
                f"rollout: the server {w} has a context length of {c} tokens, but {what or 'a request'} needs "
                f"{needed}{spec} (SGLang answers every such request with HTTP 400). Start the servers with "
                f"`--context-length {needed + r}` (beyond the model's max_position_embeddings also set "
                "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1, or choose a RoPE scaling such as YaRN with "
                "--json-model-override-args), or lower rl.max_prompt_length / rollout.max_new_tokens"
            )
        return lengths

    # -- weights -----------------------------------------------------------------------------------
    def load_from_disk(self, model_dir: str, *, version=None, before_resume=None) -> None:
        """Every worker (live and rejoining) loads the HF checkpoint ``model_dir`` (a path the servers
        can read), in parallel: pause -> flush the cache (once, retried by the wire's flush) ->
        update_weights_from_disk (``flush_cache=False``: SGLang would fail the load if a request were
        still queued) -> continue; then each must report ``version``.

        A worker that is gone (no answer: refused connection, reset, timeout) is dropped from the
        fleet and the others go on (:class:`~megatron_klear.rollout.base.FleetError` below
        ``min_live_workers``). A worker that *answers* with a failure (the path unreadable there, its
        weights released, a wrong version) is an error for a live worker -- the same cause would
        usually hit every server, and it must be seen -- while a rejoining one is only dropped again
        (it keeps its old weights and gets no request). ``before_resume(worker)``: called between a
        worker's load and its continue (colocated servers take their KV cache back there)."""
        version = None if version is None else str(version)

        def update(w):
            self.wire.pause_worker(w)
            try:
                self.wire.flush_cache(w)
                body = {"model_path": model_dir, "flush_cache": False}
                if version is not None:
                    body["weight_version"] = version
                result = self.transport.request(
                    "POST", "/update_weights_from_disk", body, timeout=self.weight_update_timeout, url=w
                )
                if not isinstance(result, dict) or not result.get("success", False):
                    message = (result or {}).get("message")
                    raise EngineError(f"rollout: {w}/update_weights_from_disk failed: {message}")
            except BaseException as cause:
                # resume the worker, but the update's failure is the one reported (the resume's, if
                # it fails too, rides along as a note)
                try:
                    self.wire.resume_worker(w)
                except Exception as cleanup:  # noqa: BLE001 -- a note on the update's own failure
                    cause.add_note(f"(then {w}/continue_generation failed too: {cleanup})")
                raise
            if before_resume is not None:
                before_resume(w)
            self.wire.resume_worker(w)
            if version is not None:
                reported = (self.transport.model_info(w) or {}).get("weight_version")
                if str(reported) != version:
                    raise EngineError(
                        f"rollout: {w} reports weight_version {reported!r} after loading "
                        f"{model_dir}, expected {version!r}"
                    )

        self.members.on_workers_loading(update, "weight load")

    def worker_dtypes(self) -> dict:
        """{worker: the dtype its model runs in} from ``/server_info`` (``dtype``; SGLang's ``auto``
        is reported as is)."""
        return {w: str((self.transport.server_info(w) or {}).get("dtype") or "auto") for w in self.members.workers()}

    # -- servers colocated with the trainer (rollout.colocate) ------------------------------------------
    def check_memory_saver(self) -> None:
        """Every worker must run with ``--enable-memory-saver``: without it SGLang's
        ``/release_memory_occupation`` frees nothing (a no-op saver), and the trainer would meet the
        server's weights and KV cache on its GPU."""

        def ask(w):
            if not (self.transport.server_info(w) or {}).get("enable_memory_saver"):
                raise EngineError(
                    f"rollout.colocate: {w} was not started with --enable-memory-saver, so releasing its "
                    "memory would free nothing: restart it with that flag (pip install "
                    "torch-memory-saver), or give the servers their own GPUs (rollout.colocate=false)"
                )

        self.members.on_workers(ask)

    def release_memory(self, tags=None) -> list:
        """SGLang's ``/release_memory_occupation`` on every worker (they must be idle): ``tags`` of
        ``weights``, ``kv_cache``, ``cuda_graph`` (None: all). Released weights lose their content:
        resume them, then load weights, before generating. A worker that is gone is dropped.
        Returns the workers that released."""
        body = {"tags": list(tags)} if tags else {}
        done = self.members.on_workers(
            lambda w: self.transport.request("POST", "/release_memory_occupation", body, url=w), tolerate_loss=True
        )
        return list(done)

    def resume_memory(self, tags=None, workers=None) -> None:
        """SGLang's ``/resume_memory_occupation`` on every worker -- or only on ``workers``, those
        that released ``tags`` (a worker that restarted since holds its memory) -- for ``tags``
        released before (None: all; resuming a tag that is not released fails SGLang's scheduler).
        A worker that is gone is dropped."""
        body = {"tags": list(tags)} if tags else {}
        only = None if workers is None else set(workers)

        def resume(w):
            if only is None or w in only:
                self.transport.request("POST", "/resume_memory_occupation", body, url=w)

        self.members.on_workers(resume, tolerate_loss=True)
