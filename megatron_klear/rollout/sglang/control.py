"""Control calls of the SGLang client. They go to every *worker*, in parallel, never to the router
(``sglang-router`` has no weight-update routes), and raise naming the first worker that failed.

- weights from disk: SGLang's ``/pause_generation`` -> ``/update_weights_from_disk`` (with
  ``weight_version``) -> ``/continue_generation``, then each worker must report the new version
  (``/model_info``); the pause's mode is the engine's ``sync_pause_mode`` (:data:`PAUSE_MODES`);
- the calls of SGLang's distributed weight update (``/init_weights_update_group``,
  ``/begin_weight_update``, ``/update_weights_from_distributed``, ``/end_weight_update``,
  ``/update_weight_version``, ``/destroy_weights_update_group``), which
  :class:`megatron_klear.rollout.weight_sync.DistributedWeightSync` drives while the trainer
  broadcasts the tensors;
- :meth:`Control.probe`: one worker's greedy continuation with log-probs (the weight check of
  :mod:`megatron_klear.rl.rollout.verify`);
- colocated servers: memory release / resume (``--enable-memory-saver``);
- each worker's context length.

Bodies follow the request structs of SGLang 0.5.23's ``io_struct.py`` (the tests check them).
:class:`Control` is a part of :class:`~megatron_klear.rollout.sglang.SGLangEngine`, over the client's
:class:`.transport.Transport` and :class:`.membership.Membership`.
"""

from __future__ import annotations

import contextlib
import threading
import time

from megatron_klear.rollout.base import Completion
from megatron_klear.rollout.sglang.api import parse_completion
from megatron_klear.rollout.sglang.transport import EngineError, WorkerGone, in_background

#: the pause modes of a weight push (``sync_pause_mode``): ``abort`` ends the requests in flight (the
#: client sends them again); ``retract`` keeps them (SGLang 0.5.23 ``Scheduler.pause_generation``
#: moves them back to the waiting queue, a paused server's ``/flush_cache`` ignores that queue, and
#: after ``/continue_generation`` their KV cache is recomputed with the new weights). SGLang's third
#: mode, ``in_place``, leaves the running batch in place, which ``/flush_cache`` refuses.
PAUSE_MODES = ("abort", "retract")

#: SGLang's memory types (``GPU_MEMORY_ALL_TYPES``) for /release_memory_occupation and /resume_memory_occupation
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def answered(e: BaseException) -> bool:
    """Whether a control call's failure is the worker's own answer (an HTTP error status, or
    ``success: false``) rather than no answer at all (:class:`~.transport.WorkerGone`: a refused or
    reset connection, a timeout: the worker is gone or frozen)."""
    return not isinstance(e, WorkerGone)


#: seconds between two sends of a probe the server aborted (:func:`resent_while_aborted`)
PROBE_RESEND_S = 0.05


def resent_while_aborted(ask, timeout: float, what: str, enough=None) -> Completion:
    """``ask(seconds left)`` -> a probe's :class:`Completion` (aborted answers included), asked again
    while the server aborts it, for up to ``timeout`` seconds, then :class:`~.transport.WorkerGone`.
    An abort of every request on a server (``abort_all``: a stream of partial rollouts ending its
    batch, which with ``rl.async_steps=1`` runs while the weights are pushed and checked) ends a
    probe in flight too: that says nothing of the worker. ``enough(aborted answer)``: an aborted
    answer that serves the caller anyway (by default none)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WorkerGone(
                f"rollout: {what} was aborted by the server at every send for {timeout:g} s (rollout.control_timeout_s)"
            )
        out = ask(left)
        if out.finish_reason != "abort" or (enough is not None and enough(out)):
            return out
        time.sleep(min(PROBE_RESEND_S, max(0.0, deadline - time.monotonic())))


# SGLang 0.5.23's speculative algorithms whose context check reserves draft tokens (spec_info.is_eagle)
EAGLE_FAMILY = ("EAGLE", "EAGLE3", "FROZEN_KV_MTP", "NEXTN")


class BucketPost:
    """One bucket's ``/update_weights_from_distributed``, posted to every member of the update group
    at once. What its answer says depends on the backend (SGLang 0.5.23's handler receives, loads,
    then answers, with no host synchronisation): over gloo the receive blocks the server's host, so
    the answer comes once the bytes arrived; over NCCL the receive is only enqueued on the server's
    GPU stream, so the answer says the bucket was accepted, not that it arrived -- except the first
    broadcast of a new group, whose communicator NCCL builds lazily, blocking the host until every
    member joins. What a sync can know it checks afterwards (:meth:`Control.check_received`).

    What HTTP shows before the broadcast is an *early* answer: a server refuses a bucket at once
    when it has no open session, does not know the group, or is unreachable (SGLang checks these
    before it starts receiving). :meth:`refusals` waits until every post has answered or ``grace``
    seconds have passed since the post, and returns the early failures: the sender broadcasts only
    when there are none (a broadcast to a group with a member that is not receiving never completes:
    with NCCL, only the watchdog ends it). The sender may gather the bucket's tensors meanwhile
    (:meth:`grace_over` tells, without waiting, when it may broadcast)."""

    def __init__(self, engine, workers, body: dict, timeout: float, path: str = "/update_weights_from_distributed"):
        import time

        self.path = path  # (vLLM's control posts its buckets to /update_weights)
        self.posted_at = time.monotonic()
        self.workers = list(workers)
        self.errors: dict = {}
        self._done = {w: threading.Event() for w in self.workers}
        self._threads = [
            threading.Thread(target=self._post, args=(engine, w, body, timeout), daemon=True, name="weights-bucket")
            for w in self.workers
        ]
        for t in self._threads:
            t.start()

    def _post(self, engine, w, body, timeout):
        try:
            engine._post_weights(w, self.path, body, timeout=timeout)
        except Exception as e:  # noqa: BLE001 -- collected
            self.errors[w] = e
        finally:
            self._done[w].set()

    def refusals(self, grace: float) -> dict:
        """``{worker: error}`` of the posts that failed within ``grace`` seconds of the post (or
        before every post answered, whichever comes first)."""
        import time

        deadline = self.posted_at + float(grace)
        for ev in self._done.values():
            if not ev.wait(max(0.0, deadline - time.monotonic())):
                break
        return dict(self.errors)

    def grace_over(self, grace: float) -> bool:
        """Whether :meth:`refusals` would answer now without waiting."""
        import time

        return self.done() or time.monotonic() >= self.posted_at + float(grace)

    def done(self) -> bool:
        return all(ev.is_set() for ev in self._done.values())

    def result(self) -> dict:
        """Wait for every answer; ``{worker: error}`` of the posts that failed."""
        for t in self._threads:
            t.join()
        return dict(self.errors)


def bucket_error(errors: dict) -> str:
    """One message for a bucket's failed posts: a server that cannot be reached (gone) first, the
    others' failures follow from it."""
    failed = sorted(errors.items(), key=lambda we: answered(we[1]))
    return "; ".join(str(e) for _, e in failed)


class Control:
    """The control calls over the client's ``transport`` to the workers ``members`` lists.
    ``weight_update_timeout``: one worker's weight load (``rollout.weight_update_timeout_s``);
    ``sync_pause_mode``: how a push pauses the servers (:data:`PAUSE_MODES`, checked now and at each
    push)."""

    #: tries of /flush_cache before a weight load (see :meth:`Control.flush_cache`)
    flush_attempts = 8

    def __init__(self, transport, members, config, *, sync_pause_mode: str = "abort"):
        self.transport, self.members = transport, members
        self.weight_update_timeout = float(config.weight_update_timeout_s)
        self.sync_pause_mode = sync_pause_mode
        self.push_pause_mode()  # one of PAUSE_MODES, or a ValueError naming it now

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
    def flush_cache(self, worker: str) -> None:
        """SGLang's ``/flush_cache`` on one worker, retried while it refuses: SGLang 0.5.23 flushes only
        a fully idle scheduler (``Scheduler.flush_cache``; while paused, the waiting queue is ignored)
        and otherwise answers HTTP 400 (``Flush cache failed.``), e.g. while the requests aborted by
        ``/pause_generation`` are still leaving the running batch. ``flush_attempts`` tries, the waits
        between them doubling from 0.1 s up to 2 s; then :class:`EngineError` naming the worker."""
        import time

        last = None
        for attempt in range(max(1, int(self.flush_attempts))):
            try:
                # no body: SGLang's route reads only an optional ``timeout`` query parameter
                self.transport.request("POST", "/flush_cache", None, url=worker, expect_json=False)
                return
            except EngineError as e:
                if "HTTP 400" not in str(e):  # gone, or another answer than SGLang's refusal
                    raise
                last = e
            time.sleep(min(2.0, 0.1 * 2**attempt))
        raise EngineError(
            f"rollout: {worker} refused to flush its cache {self.flush_attempts} times (requests still "
            f"running or queued after /pause_generation); last: {last}"
        )

    def load_from_disk(self, model_dir: str, *, version=None) -> None:
        """Every worker (live and rejoining) loads the HF checkpoint ``model_dir`` (a path the servers
        can read), in parallel: pause -> flush the cache (once, retried: see :meth:`flush_cache`) ->
        update_weights_from_disk (``flush_cache=False``: SGLang would fail the load if a request were
        still queued) -> continue; then each must report ``version``.

        A worker that is gone (no answer: refused connection, reset, timeout) is dropped from the
        fleet and the others go on (:class:`~.fleet.FleetError` below ``min_live_workers``). A worker
        that *answers* with a failure (the path unreadable there, its weights released, a wrong
        version) is an error for a live worker -- the same cause would usually hit every server, and
        it must be seen -- while a rejoining one is only dropped again (it keeps its old weights and
        gets no request)."""
        version = None if version is None else str(version)
        mode = self.push_pause_mode()

        def update(w):
            self.transport.request("POST", "/pause_generation", {"mode": mode}, url=w)
            try:
                self.flush_cache(w)
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
                    self.transport.request("POST", "/continue_generation", {}, url=w)
                except Exception as cleanup:  # noqa: BLE001
                    cause.add_note(f"(then {w}/continue_generation failed too: {cleanup})")
                raise
            self.transport.request("POST", "/continue_generation", {}, url=w)
            if version is not None:
                reported = (self.transport.model_info(w) or {}).get("weight_version")
                if str(reported) != version:
                    raise EngineError(
                        f"rollout: {w} reports weight_version {reported!r} after loading "
                        f"{model_dir}, expected {version!r}"
                    )

        self.members.on_workers_loading(update, "weight load")

    def weight_versions(self) -> dict:
        """``{worker: the weight_version it reports}`` of every worker that answers (a gone one is
        dropped)."""
        return self.members.weight_versions()

    # -- weights over a process group (SGLang's update_weights_from_distributed) ---------------------
    # The trainer side (megatron_klear.rollout.weight_sync.DistributedWeightSync) drives these; each
    # runs on every worker in parallel and raises EngineError naming the first worker that failed.
    def _post_weights(self, worker: str, path: str, body: dict, timeout: float | None = None) -> dict:
        """POST a weight-control call; SGLang answers ``{"success", "message"}`` (400 on failure)."""
        result = self.transport.request("POST", path, body, timeout=timeout, url=worker)
        if isinstance(result, dict) and result.get("success") is False:
            raise EngineError(f"rollout: POST {worker}{path} failed: {result.get('message')}")
        return result if isinstance(result, dict) else {}

    def update_group_layout(self) -> list:
        """``[(worker, ranks)]``: each worker joins an update group with one rank per TP rank of its
        model (SGLang: ``rank_offset + tp_rank``). Refuses layouts SGLang cannot update this way."""
        return list(zip(self.members.workers(), self.members.on_workers(self._update_group_ranks)))

    def check_update_group_layout(self) -> dict:
        """At start-up: :meth:`update_group_layout`'s refusals (``dp_size`` > 1, pipeline
        parallelism) by name, a worker gone meanwhile dropped as by the other start-up checks;
        ``{worker: TP ranks}`` of the others."""
        return self.members.on_workers(self._update_group_ranks, tolerate_loss=True)

    def _update_group_ranks(self, w: str) -> int:
        """One worker's ranks in an update group (its TP size); refuses dp_size > 1 and pipeline parallelism."""
        info = self.transport.server_info(w) or {}
        tp, pp, dp = (int(info.get(k) or 1) for k in ("tp_size", "pp_size", "dp_size"))
        if dp > 1:  # SGLang 0.5.23: assert dp_size == 1, answered as a bare HTTP 500
            raise EngineError(
                f"rollout: {w} runs {dp} data-parallel replicas (dp_size={dp}); SGLang refuses weight "
                "update groups unless dp_size is 1 (data-parallel attention, attn_dp_size, is fine): "
                "start one server per replica (behind the router), or use rollout.weight_sync=disk"
            )
        if pp > 1:
            raise EngineError(
                f"rollout: {w} runs pipeline parallelism (pp_size={pp}), which SGLang's "
                "update_weights_from_distributed does not cover: use rollout.weight_sync=disk"
            )
        return tp

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
        """Start ``/init_weights_update_group`` on every worker (each first drops a stale group of that
        name, left by a trainer that died); returns ``{worker: concurrent.futures.Future}`` (the
        call blocks on the server until the whole group has joined; one left waiting on a server
        that never joins does not hold the trainer's exit)."""

        def join(w):
            try:
                self._post_weights(w, "/destroy_weights_update_group", {"group_name": group_name})
            except EngineError as e:
                if "does not exist" not in str(e):
                    raise
            return self._post_weights(
                w,
                "/init_weights_update_group",
                {
                    "master_address": master_address,
                    "master_port": int(master_port),
                    "rank_offset": int(rank_offsets[w]),
                    "world_size": int(world_size),
                    "group_name": group_name,
                    "backend": backend,
                },
                timeout=timeout,
            )

        return in_background(join, list(rank_offsets), "weights-init")

    def destroy_weights_update_group(self, group_name: str, timeout: float | None = None) -> None:
        """Drop the group on every worker (best effort: a worker without it, or gone, is skipped);
        ``timeout``: each call's (a server answers after the weight call it is still busy with)."""

        def drop(w):
            with contextlib.suppress(EngineError):
                self._post_weights(w, "/destroy_weights_update_group", {"group_name": group_name}, timeout=timeout)

        self.members.on_workers(drop)

    def push_pause_mode(self) -> str:
        """The engine's ``sync_pause_mode``, checked against :data:`PAUSE_MODES`."""
        mode = self.sync_pause_mode
        if mode not in PAUSE_MODES:
            raise ValueError(f"rollout: sync_pause_mode must be one of {PAUSE_MODES}, got {mode!r}")
        return mode

    def pause_generation(self, mode: str | None = None) -> None:
        """``/pause_generation`` on every worker; ``mode`` None: :meth:`push_pause_mode`."""
        mode = self.push_pause_mode() if mode is None else mode
        self.members.on_workers(lambda w: self.transport.request("POST", "/pause_generation", {"mode": mode}, url=w))

    def continue_generation(self) -> None:
        self.members.on_workers(lambda w: self.transport.request("POST", "/continue_generation", {}, url=w))

    def begin_weight_update(self) -> None:
        """Open a weight-update session on every worker (SGLang 0.5.23 refuses updates outside one).
        A session left open by a trainer that died is closed first."""

        def begin(w):
            try:
                self._post_weights(w, "/begin_weight_update", {})
            except EngineError as e:
                if "already open" not in str(e):
                    raise
                try:
                    self._post_weights(w, "/end_weight_update", {})
                except EngineError:
                    pass  # a failed stale session (ours: nothing applied) still closes
                self._post_weights(w, "/begin_weight_update", {})

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
    ) -> BucketPost:
        """Post one bucket to every worker (``workers``: the update group's members), without waiting:
        the sender broadcasts it once :meth:`BucketPost.refusals` is empty. ``flush_cache`` stays
        False: the cache is flushed once before the first bucket (:meth:`flush_caches`); SGLang
        0.5.23 fails a bucket whose flush finds a request still queued."""
        body = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": bool(flush_cache),
            "abort_all_requests": False,
        }
        if load_format is not None:
            body["load_format"] = load_format
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        timeout = self.weight_update_timeout if timeout is None else timeout
        return BucketPost(self, self.members.workers() if workers is None else workers, body, timeout)

    def update_weights_from_distributed(
        self,
        names: list,
        dtypes: list,
        shapes: list,
        *,
        group_name: str,
        load_format: str | None = None,
        flush_cache: bool = False,
        weight_version: str | None = None,
        timeout: float | None = None,
    ) -> None:
        """Every worker receives one bucket (the sender broadcasts it meanwhile); raises naming the
        workers that failed."""
        errors = self.post_bucket(
            names,
            dtypes,
            shapes,
            group_name=group_name,
            load_format=load_format,
            flush_cache=flush_cache,
            weight_version=weight_version,
            timeout=timeout,
        ).result()
        if errors:
            raise EngineError(bucket_error(errors))

    def flush_caches(self) -> None:
        """:meth:`flush_cache` on every worker, in parallel; the first failure is raised."""
        self.members.on_workers(self.flush_cache)

    def end_weight_update(self) -> None:
        self.members.on_workers(
            lambda w: self._post_weights(w, "/end_weight_update", {}, timeout=self.weight_update_timeout)
        )

    def set_weight_version(self, version) -> None:
        """``/update_weight_version`` on every worker, aborting nothing (generation is paused)."""
        body = {"new_version": str(version), "abort_all_requests": False}
        self.members.on_workers(lambda w: self._post_weights(w, "/update_weight_version", body))

    def check_weight_versions(self, version) -> None:
        """Every worker must report ``version`` (``/model_info``'s ``weight_version``): a live one that
        does not is an error, a rejoining one is dropped again (it gets no request)."""
        self.members.check_weight_versions(version)

    def check_received(self) -> dict:
        """After a distributed update: one greedy token from every worker, each within
        ``rollout.control_timeout_s``. Over NCCL, a bucket's answer does not say that its bytes
        arrived (SGLang 0.5.23 enqueues the receive on the GPU stream and answers without a host
        synchronisation, ``model_runner_components/weight_updater.py``); a forward runs on that stream
        after every receive, so a generation's answer does. A worker that does not answer in time
        (a peer lost mid-bucket leaves its stream waiting on the broadcast) is dropped as gone; it
        rejoins at a later push once restarted. An answer aborted before its token (an abort of
        every request on the server, as partial rollouts send, can meet the check's request) is
        asked again within the same time (:func:`resent_while_aborted`). Returns ``{worker: Completion}``
        of the others."""

        def one_token(w):
            return self.probe(w, [0], 1, enough=lambda c: bool(c.token_ids))

        return self.members.on_workers(one_token, tolerate_loss=True)

    # -- verification ------------------------------------------------------------------------------
    def probe(
        self, worker: str, prompt_ids: list, max_new_tokens: int, *, timeout: float | None = None, enough=None
    ) -> Completion:
        """Greedy continuation of ``prompt_ids`` by one worker (not through the router), exactly
        ``max_new_tokens`` tokens (``ignore_eos``), with the log-prob of each token (greedy:
        ``log_softmax`` of the logits at temperature 1, in SGLang and in the embedded engine), within
        ``timeout`` (default ``rollout.control_timeout_s``; past it :class:`~.transport.WorkerGone`).
        An answer the server aborted is asked again (:func:`resent_while_aborted`, ``enough``)."""
        body = {
            "input_ids": [int(t) for t in prompt_ids],
            "return_logprob": True,
            "sampling_params": {
                "temperature": 0.0,
                "max_new_tokens": int(max_new_tokens),
                "ignore_eos": True,
                "skip_special_tokens": False,
            },
        }

        def ask(left):
            out = self.transport.request("POST", "/generate", body, timeout=left, url=worker)
            return parse_completion(out[0] if isinstance(out, list) else out, url=worker, allow_abort=True)

        # bounded by the control timeout, not the generation one: 16 greedy tokens on an idle server
        # (right after a push) take well under a second, and a frozen server must not hold the step
        wait = self.transport.timeout if timeout is None else timeout
        return resent_while_aborted(ask, wait, f"the probe of {worker}/generate", enough)

    def worker_dtypes(self) -> dict:
        """{worker: the dtype its model runs in} from ``/server_info`` (``dtype``; SGLang's ``auto``
        is reported as is)."""
        return {w: str((self.transport.server_info(w) or {}).get("dtype") or "auto") for w in self.members.workers()}

    def update_weights(self, named_tensors, *, version: int | None = None) -> None:
        """Every worker loads the tensors through a temporary HF directory
        (:func:`~megatron_klear.rollout.weight_sync.disk.load_through_directory`)."""
        from megatron_klear.rollout.weight_sync.disk import load_through_directory

        load_through_directory(named_tensors, self.load_from_disk, version=version, who="SGLangEngine")

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
