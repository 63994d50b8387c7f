"""The servers' side of the distributed weight update, written once for every family of servers
(:class:`Wire`, a :class:`~megatron_klear.rollout.base.WeightWire`): the trainer's sync
(:mod:`megatron_klear.rollout.weight_sync.distributed`) forms update groups with every worker,
then per push pauses generation, flushes the caches, opens a session, streams the buckets, closes
the session, sets the version, continues and checks. What each call is on the wire (route, body,
the server's refusals) is the family's :class:`~.dialect.ServerDialect`:

- SGLang 0.5.23: ``/init_weights_update_group`` (after dropping a stale group of the same name),
  ``/begin_weight_update``, ``/update_weights_from_distributed``, ``/end_weight_update``,
  ``/update_weight_version``, ``/destroy_weights_update_group``, ``/pause_generation``,
  ``/flush_cache`` (refused with HTTP 400 while a request still leaves: tried again);
- vLLM's weight-transfer API with the project's transfer engine (:mod:`..vllm.transfer_engine`):
  ``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update``, ``/shutdown_weight_transfer_engine``, ``/pause``,
  ``/reset_prefix_cache``.

Every call goes to every *worker* in parallel, never to a router, and raises naming the first
worker that failed. The weight check's probe (:meth:`Wire.probe`, one worker's greedy continuation
with log-probs) lives here too: the sync's received check is one.
"""

from __future__ import annotations

import contextlib
import threading
import time

from megatron_klear.rollout.base import Completion, EngineError, WorkerGone
from megatron_klear.rollout.servers.transport import in_background


def answered(e: BaseException) -> bool:
    """Whether a control call's failure is the worker's own answer (an HTTP error status, or
    ``success: false``) rather than no answer at all (:class:`WorkerGone`: a refused or reset
    connection, a timeout: the worker is gone or frozen)."""
    return not isinstance(e, WorkerGone)


#: seconds between two sends of a probe the server aborted (:func:`resent_while_aborted`)
PROBE_RESEND_S = 0.05


def resent_while_aborted(ask, timeout: float, what: str, enough=None) -> Completion:
    """``ask(seconds left)`` -> a probe's :class:`Completion` (aborted answers included), asked again
    while the server aborts it, for up to ``timeout`` seconds, then :class:`WorkerGone`. An abort of
    every request on a server (a stream of partial rollouts ending its batch, which with
    ``rl.async_steps=1`` runs while the weights are pushed and checked) ends a probe in flight too:
    that says nothing of the worker. ``enough(aborted answer)``: an aborted answer that serves the
    caller anyway (by default none)."""
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


class BucketPost:
    """One bucket's receive call, posted to every member of the update group at once (a
    :class:`~megatron_klear.rollout.base.BucketPosting`). What its answer says depends on the
    backend (SGLang 0.5.23's handler receives, loads, then answers, with no host synchronisation):
    over gloo the receive blocks the server's host, so the answer comes once the bytes arrived; over
    NCCL the receive is only enqueued on the server's GPU stream, so the answer says the bucket was
    accepted, not that it arrived -- except the first broadcast of a new group, whose communicator
    NCCL builds lazily, blocking the host until every member joins. What a sync can know it checks
    afterwards (:meth:`Wire.check_received`).

    What HTTP shows before the broadcast is an *early* answer: a server refuses a bucket at once
    when it has no open session, does not know the group, or is unreachable (it checks these before
    it starts receiving). :meth:`refusals` waits until every post has answered or ``grace`` seconds
    have passed since the post, and returns the early failures: the sender broadcasts only when
    there are none (a broadcast to a group with a member that is not receiving never completes:
    with NCCL, only the watchdog ends it). The sender may gather the bucket's tensors meanwhile
    (:meth:`grace_over` tells, without waiting, when it may broadcast). ``post(worker, path, body,
    timeout)``: the wire's call."""

    def __init__(self, post, workers, call: tuple, timeout: float):
        self.posted_at = time.monotonic()
        self.workers = list(workers)
        self.errors: dict = {}
        self._done = {w: threading.Event() for w in self.workers}
        path, body = call
        self._threads = [
            threading.Thread(target=self._post, args=(post, w, path, body, timeout), daemon=True, name="weights-bucket")
            for w in self.workers
        ]
        for t in self._threads:
            t.start()

    def _post(self, post, w, path, body, timeout):
        try:
            post(w, path, body, timeout=timeout)
        except Exception as e:  # noqa: BLE001 -- collected, reported by refusals() / result()
            self.errors[w] = e
        finally:
            self._done[w].set()

    def refusals(self, grace: float) -> dict:
        """``{worker: error}`` of the posts that failed within ``grace`` seconds of the post (or
        before every post answered, whichever comes first)."""
        deadline = self.posted_at + float(grace)
        for ev in self._done.values():
            if not ev.wait(max(0.0, deadline - time.monotonic())):
                break
        return dict(self.errors)

    def grace_over(self, grace: float) -> bool:
        """Whether :meth:`refusals` would answer now without waiting."""
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


class Wire:
    """The weight update's calls over the client's ``transport`` to the workers ``members`` lists,
    in the family's ``dialect``. ``pause_mode``: how a push pauses the servers (the ``rollout``
    section's, checked by its validation); ``weight_update_timeout``: one worker's load of a bucket
    or a session's end (``rollout.weight_update_timeout_s``)."""

    #: tries of the cache flush before a weight load (see :meth:`flush_cache`)
    flush_attempts = 8

    def __init__(self, transport, members, dialect, *, pause_mode: str, weight_update_timeout: float):
        self.transport, self.members, self.dialect = transport, members, dialect
        self.pause_mode = pause_mode
        self.weight_update_timeout = float(weight_update_timeout)
        self.ranks: dict = {}  # {worker: its ranks in an update group}, as the last layout found

    def delta_refusal(self) -> str | None:
        """Why the workers cannot take delta buckets (the dialect's answer), or None."""
        return self.dialect.delta_refusal(self.transport, self.members.workers())

    def post(self, worker: str, path: str, body, timeout: float | None = None) -> dict:
        """POST a weight-control call; an answer ``{"success": false, "message"}`` is an error."""
        result = self.transport.request("POST", path, body, timeout=timeout, url=worker)
        if isinstance(result, dict) and result.get("success") is False:
            raise EngineError(f"rollout: POST {worker}{path} failed: {result.get('message')}")
        return result if isinstance(result, dict) else {}

    # -- pauses and caches, per worker (the disk load uses them too) ---------------------------------
    def pause_worker(self, worker: str, mode: str | None = None) -> None:
        path, body = self.dialect.pause_call(self.pause_mode if mode is None else mode)
        self.transport.request("POST", path, body, url=worker)

    def resume_worker(self, worker: str) -> None:
        self.dialect.resume(self.transport, worker)

    def flush_cache(self, worker: str) -> None:
        """Drop one worker's prefix cache, tried again while the server refuses because a request
        is still leaving (SGLang 0.5.23 flushes only a fully idle scheduler and otherwise answers
        HTTP 400, e.g. while the requests a pause aborted are still leaving the running batch):
        ``flush_attempts`` tries, the waits between them doubling from 0.1 s up to 2 s; then
        :class:`EngineError` naming the worker."""
        path, body = self.dialect.flush_call
        refused = self.dialect.flush_refused_text
        last = None
        for attempt in range(max(1, int(self.flush_attempts))):
            try:
                self.transport.request("POST", path, body, url=worker, expect_json=False)
                return
            except EngineError as e:
                if not refused or refused not in str(e):  # gone, or another answer than the refusal
                    raise
                last = e
            time.sleep(min(2.0, 0.1 * 2**attempt))
        raise EngineError(
            f"rollout: {worker} refused to flush its cache {self.flush_attempts} times (requests still "
            f"running or queued after the pause); last: {last}"
        )

    # -- every worker -------------------------------------------------------------------------------
    def pause(self, mode: str | None = None) -> None:
        """Pause generation on every worker (``mode`` None: the push's)."""
        self.members.on_workers(lambda w: self.pause_worker(w, mode))

    def resume(self) -> None:
        self.members.on_workers(self.resume_worker)

    def flush_caches(self) -> None:
        """:meth:`flush_cache` on every worker, in parallel; the first failure is raised."""
        self.members.on_workers(self.flush_cache)

    def set_version(self, version) -> None:
        """Set the weight version on every worker, aborting nothing (generation is paused)."""
        path, body = self.dialect.version_call(str(version))
        self.members.on_workers(lambda w: self.post(w, path, body))

    # -- update groups ------------------------------------------------------------------------------
    def update_group_layout(self) -> list:
        """``[(worker, ranks)]``: each worker's ranks in an update group; refuses, by name, what the
        family's update cannot cover (:meth:`~.dialect.ServerDialect.group_ranks`)."""
        ranks = self.members.on_workers(lambda w: self.dialect.group_ranks(self.transport, w))
        layout = list(zip(self.members.workers(), ranks))
        self.ranks.update(layout)
        return layout

    def check_update_group_layout(self) -> dict:
        """At start-up: :meth:`update_group_layout`'s refusals by name, a worker gone meanwhile
        dropped as by the other start-up checks; ``{worker: ranks}`` of the others."""
        found = self.members.on_workers(lambda w: self.dialect.group_ranks(self.transport, w), tolerate_loss=True)
        self.ranks.update(found)
        return found

    def join_group_async(
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
        """Start joining the group on every worker of ``rank_offsets``; ``{worker: Future}`` (the
        last call blocks on the server until the whole group has joined; one left waiting on a
        server that never joins does not hold the trainer's exit)."""

        def join(w):
            group = {
                "master_address": master_address,
                "master_port": int(master_port),
                "rank_offset": int(rank_offsets[w]),
                "world_size": int(world_size),
                "group_name": group_name,
                "backend": backend,
            }
            out = None
            for path, body, ignored in self.dialect.join_calls(group, timeout):
                try:
                    out = self.post(w, path, body, timeout=timeout)
                except EngineError as e:
                    if not ignored or ignored not in str(e):
                        raise
            return out

        return in_background(join, list(rank_offsets), "weights-init")

    def leave_group(self, group_name: str, timeout: float | None = None) -> None:
        """Drop the group on every worker (best effort: a worker without it, or gone, is skipped);
        ``timeout``: each call's (a server answers after the weight call it is still busy with)."""
        path, body = self.dialect.leave_call(group_name)

        def drop(w):
            with contextlib.suppress(EngineError):
                self.post(w, path, body, timeout=timeout)

        self.members.on_workers(drop)

    # -- a push -------------------------------------------------------------------------------------
    def begin(self) -> None:
        """Open a weight-update session on every worker (the servers refuse updates outside one). A
        session left open by a trainer that died is closed first."""
        begin, end = self.dialect.begin_call, self.dialect.end_call

        def open_session(w):
            try:
                self.post(w, *begin)
            except EngineError as e:
                if self.dialect.session_open_text not in str(e):
                    raise
                with contextlib.suppress(EngineError):  # a failed stale session (nothing applied) still closes
                    self.post(w, *end)
                self.post(w, *begin)

        self.members.on_workers(open_session)

    def end(self) -> None:
        path, body = self.dialect.end_call
        self.members.on_workers(lambda w: self.post(w, path, body, timeout=self.weight_update_timeout))
        if self.dialect.flush_after_update:
            self.flush_caches()

    def start_update(self) -> None:
        """Pause generation, flush every cache once (buckets are then received without a flush:
        SGLang 0.5.23 fails a bucket whose flush finds a request still queued) and open a session."""
        self.pause()
        self.flush_caches()
        self.begin()

    def post_bucket(
        self,
        names: list,
        dtypes: list,
        shapes: list,
        *,
        group_name: str,
        workers=None,
        load_format: str | None = None,
        timeout: float | None = None,
        counts=None,
    ) -> BucketPost:
        """Post one bucket to every worker (``workers``: the update group's members), without
        waiting: the sender broadcasts it once :meth:`BucketPost.refusals` is empty. ``counts``: a
        delta bucket's per-tensor counts (:mod:`.update_group`), where the servers take them."""
        workers = self.members.workers() if workers is None else list(workers)
        ranks = max((int(self.ranks.get(w, 1)) for w in workers), default=1)
        timeout = self.weight_update_timeout if timeout is None else timeout
        call = self.dialect.bucket_call(
            names,
            dtypes,
            shapes,
            group_name=group_name,
            load_format=load_format,
            counts=counts,
            ranks=ranks,
            timeout=timeout,
        )
        return BucketPost(self.post, workers, call, timeout)

    def check_group(self, group_name: str, workers) -> dict:
        """``{worker: error}`` of the ``workers`` that do not hold the update group ``group_name``
        (the dialect's :meth:`~.dialect.ServerDialect.group_check_call`, asked in parallel; a
        family without one: none)."""
        call = self.dialect.group_check_call(group_name)
        if call is None:
            return {}
        return BucketPost(self.post, workers, call, self.transport.timeout).result()

    def failed_load(self, error, group_name: str) -> str | None:
        """The marked name of ``group_name`` when the worker's answer ``error`` says its delta
        loader failed on that group (:meth:`~.dialect.ServerDialect.failed_load`), or None."""
        return self.dialect.failed_load(str(error), group_name)

    def tensor_refusal(self) -> str | None:
        """Why the workers cannot load tensors shared in memory (:meth:`load_tensors`), or None."""
        return self.dialect.tensor_refusal(self.transport, self.members.workers())

    def tensor_gpus(self) -> dict:
        """``{worker: [the physical GPU each of its ranks runs on]}`` (:meth:`~.dialect.ServerDialect.tensor_gpus`)."""
        return {w: self.dialect.tensor_gpus(self.transport, w) for w in self.members.workers()}

    def load_tensors(self, payload: dict) -> None:
        """Inside a session (:meth:`start_update`): every worker loads one bucket the trainer shares
        in memory (:meth:`~.dialect.ServerDialect.tensor_call`), in parallel; raises naming the
        first worker that failed. ``payload``: ``{worker: [handles for each of its ranks]}`` (each
        rank those of a copy on its own GPU, pickled for it alone)."""

        def load(w):
            handles = payload.get(w)
            if handles is None:
                raise EngineError(f"rollout: no copy of the bucket on {w}'s GPUs (it joined after the push began)")
            path, body = self.dialect.tensor_call(list(handles), self.transport, w)
            self.post(w, path, body, timeout=self.weight_update_timeout)

        self.members.on_workers(load)

    def receive_bucket(self, names: list, dtypes: list, shapes: list, *, group_name: str, **keys) -> None:
        """:meth:`post_bucket` and wait: every worker receives one bucket (the sender broadcasts it
        meanwhile); raises naming the workers that failed."""
        errors = self.post_bucket(names, dtypes, shapes, group_name=group_name, **keys).result()
        if errors:
            raise EngineError(bucket_error(errors))

    def finish_update(self, version, *, check_received: bool, before_resume=None) -> None:
        """Close the session, set ``version``, call ``before_resume`` (colocated servers take back
        their KV cache there), continue generation, then every worker must report ``version`` (a
        rejoining one that does not is dropped again); ``check_received``: then
        :meth:`check_received`."""
        self.end()
        self.set_version(version)
        if before_resume is not None:
            before_resume()
        self.resume()
        self.members.check_weight_versions(version)
        if check_received:
            self.check_received()

    def check_received(self) -> dict:
        """After a distributed update: one greedy token from every worker, each within
        ``rollout.control_timeout_s``. Over NCCL, a bucket's answer does not say that its bytes
        arrived (the server enqueues the receive on its GPU stream and answers without a host
        synchronisation); a forward runs on that stream after every receive, so a generation's
        answer does. A worker that does not answer in time (a peer lost mid-bucket leaves its
        stream waiting on the broadcast) is dropped as gone; it rejoins at a later push once
        restarted. An answer aborted before its token is asked again within the same time
        (:func:`resent_while_aborted`). Returns ``{worker: Completion}`` of the others."""

        def one_token(w):
            return self.probe(w, [0], 1, enough=lambda c: bool(c.token_ids))

        return self.members.on_workers(one_token, tolerate_loss=True)

    # -- the weight check ---------------------------------------------------------------------------
    def probe(
        self, worker: str, prompt_ids: list, max_new_tokens: int, *, timeout: float | None = None, enough=None
    ) -> Completion:
        """Greedy continuation of ``prompt_ids`` by one worker (not through a router), exactly
        ``max_new_tokens`` tokens (EOS ignored), with the log-prob of each token (greedy: the
        ``log_softmax`` of the logits at temperature 1, in SGLang, vLLM and the embedded engine),
        within ``timeout`` (default ``rollout.control_timeout_s``; past it :class:`WorkerGone`).
        Bounded by the control timeout, not the generation one: a few greedy tokens on an idle
        server (right after a push) take well under a second, and a frozen server must not hold the
        step. An answer the server aborted is asked again (:func:`resent_while_aborted`, ``enough``)."""
        body = self.dialect.probe_body(prompt_ids, max_new_tokens)
        path = self.dialect.generate_path
        where = f"{worker}{path}"

        def ask(left):
            out = self.transport.request("POST", path, body, timeout=left, url=worker)
            return self.dialect.read_probe(out, where)

        wait = self.transport.timeout if timeout is None else timeout
        return resent_while_aborted(ask, wait, f"the probe of {where}", enough)
