"""The stand-in's scheduler: the only caller of the engine. A thread batches the /generate requests
waiting when the engine is free into one engine call, and is the engine's ``control`` (pause
between decode steps, aborts); weight updates run through it with no decoding under way."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import threading
import time

from megatron_klear.rollout.base import Completion


class Job:
    """One /generate request: its prompts (PromptRequests keyed by this job) and what comes back.
    ``future`` resolves (with the job) once every prompt has finished, was aborted or failed; the
    HTTP side awaits it without holding a thread."""

    def __init__(self, requests: list, ids: list, rid=None):
        self.requests, self.ids, self.rid = requests, ids, rid
        self.rows = sum(len(r.seeds) for r in requests)
        self.results = [None] * len(requests)
        self.pending = len(requests)
        self.future = concurrent.futures.Future()
        self.error = None
        self.aborted = False
        self.abort_message = None  # the finish message of its aborted samples (None: SGLang's)
        # where SGLang would find it when aborted: "running" (in the running batch: FINISH_ABORT, the
        # tokens so far) or "waiting" (in the waiting queue: not started, or retracted by a pause --
        # answered from what the tokenizer manager received)
        self.abort_where = None

    def finish(self) -> None:
        """Resolve :attr:`future` (once; a no-op if it is done or its waiter was cancelled)."""
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            self.future.set_result(self)

    def matches(self, rid: str) -> bool:
        """SGLang's scheduler matches a request to abort by prefix: ``req.rid.startswith(rid)``."""
        return any(isinstance(i, str) and i.startswith(rid) for i in [self.rid, *self.ids])

    def finish_aborted(self, message: str | None = None) -> None:
        """Aborted before it ran (SGLang's waiting queue): every sample answers with no token."""
        self.aborted, self.abort_message, self.abort_where = True, message, "waiting"
        for k, r in enumerate(self.requests):
            if self.results[k] is None:
                self.results[k] = [
                    Completion(token_ids=[], logprobs=[], finish_reason="abort", versions=[]) for _ in r.seeds
                ]
        self.finish()


class Scheduler:
    """The engine's only caller: a thread that takes the requests waiting when the engine is free
    (in arrival order, at most ``max_batch_size`` sequences, at least one request) and decodes them
    in one :meth:`EmbeddedEngine.generate_requests` call. It is also the engine's ``control``
    (pause between steps, aborts).

    A batch does not admit requests that arrive while it decodes, so when the engine is idle and
    requests start arriving the scheduler lets them gather first: it takes them once no new one has
    come for ``settle`` seconds, or after ``window`` seconds (a client sending hundreds of requests
    at once then fills one batch instead of having its first request decoded alone)."""

    def __init__(self, engine, max_batch_size: int | None = None, *, window: float = 0.05, settle: float = 0.005):
        self.engine = engine
        self.max_batch_size = max_batch_size if max_batch_size is not None else getattr(engine, "max_batch_size", None)
        self.window, self.settle = float(window), float(settle)
        self.cond = threading.Condition()
        self.queue = collections.deque()
        self.running = []
        self.paused = None  # None | "abort" | "retract" | "in_place"
        self.parked = False  # the engine waits between two steps for continue
        self.updates = 0  # weight updates waiting for the running requests to finish
        self.abort_epoch = 0  # bumped by every abort of a running request (wakes a held engine)
        self.closed = False
        self.batches = 0
        self.history = collections.deque(maxlen=1024)  # (requests, sequences) of the recent engine calls
        self._thread = threading.Thread(target=self._loop, name="standin-scheduler", daemon=True)
        self._thread.start()

    # -- the engine's control ----------------------------------------------------------------------
    def pause_mode(self):
        with self.cond:
            return self.paused if self.paused in ("in_place", "retract") and not self.closed else None

    def wait_while_paused(self) -> None:
        """Hold the engine until continue or, paused with ``retract``, until an abort is to be served
        (the engine then ends the aborted rows and comes back while still paused). SGLang 0.5.23:
        retracted requests wait in the waiting queue, where an abort ends them at once; a request
        held ``in_place`` stays in the running batch, whose aborts take effect at its next decode
        step, after continue."""
        with self.cond:
            self.parked = True
            self.cond.notify_all()
            epoch = self.abort_epoch
            while (
                self.paused in ("in_place", "retract")
                and not self.closed
                and not (self.paused == "retract" and self.abort_epoch != epoch)
            ):
                self.cond.wait()
            self.parked = False

    def aborted(self, job) -> bool:
        return job is not None and (job.aborted or self.closed)

    # -- requests -----------------------------------------------------------------------------------
    def submit(self, job: Job) -> Job:
        """Queue ``job``; its :attr:`Job.future` says when it is done."""
        with self.cond:
            if self.closed:
                raise RuntimeError("the server is shutting down")
            self.queue.append(job)
            self.cond.notify_all()
        return job

    def _gather(self) -> None:
        """(Holding the lock, the engine idle.) Let concurrent arrivals join before a batch starts."""
        end = time.monotonic() + self.window
        seen = len(self.queue)
        while not self.closed and not self.paused and not self.updates:
            if self.max_batch_size is not None and sum(job.rows for job in self.queue) >= self.max_batch_size:
                return
            left = end - time.monotonic()
            if left <= 0:
                return
            self.cond.wait(min(self.settle, left))
            if len(self.queue) == seen:
                return
            seen = len(self.queue)

    def _take(self) -> list:
        batch, rows = [], 0
        while self.queue:
            job = self.queue[0]
            if batch and self.max_batch_size is not None and rows + job.rows > self.max_batch_size:
                break
            batch.append(self.queue.popleft())
            rows += job.rows
        return batch

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.closed and (not self.queue or self.paused or self.updates):
                    self.cond.wait()
                if self.closed:
                    return
                self._gather()
                if self.closed:
                    return
                if not self.queue or self.paused or self.updates:
                    continue
                batch = self._take()
                self.running = batch
                self.batches += 1
                self.history.append((len(batch), sum(job.rows for job in batch)))
            owners = [(job, k) for job in batch for k in range(len(job.requests))]

            def on_done(i, completions, owners=owners):
                job, k = owners[i]
                job.results[k] = completions
                job.pending -= 1
                if job.pending == 0:
                    job.finish()

            try:
                self.engine.generate_requests(
                    [job.requests[k] for job, k in owners], control=self, on_prompt_done=on_done
                )
            except Exception as e:  # noqa: BLE001 -- handed to the requests, answered by their handlers
                for job in batch:
                    if not job.future.done():
                        job.error = e
                        job.finish()
            finally:
                with self.cond:
                    self.running = []
                    self.cond.notify_all()

    def abort_request(self, rid: str = "", abort_all: bool = False) -> int:
        """SGLang 0.5.23's ``/abort_request`` (``TokenizerManager.abort_request`` with one tokenizer
        worker): an empty ``rid`` without ``abort_all`` is ignored (it would prefix-match every
        request), and so is a ``rid`` that is not the id of a live request; else the scheduler aborts
        every request whose id starts with ``rid`` (:meth:`abort`)."""
        if not abort_all:
            if not rid:
                return 0
            with self.cond:
                if not any(rid in job.ids for job in [*self.queue, *self.running] if not job.aborted):
                    return 0
        return self.abort(rid, abort_all)

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str | None = None) -> int:
        """Abort the queued and running requests matching ``rid`` (a prefix of their ids) or all.
        ``message``: their finish message (None: SGLang's, "Aborted" / "Abort in waiting queue")."""
        count = 0
        with self.cond:
            for job in list(self.queue):
                if abort_all or job.matches(rid):
                    self.queue.remove(job)
                    job.finish_aborted(message)
                    count += 1
            for job in self.running:
                if not job.aborted and (abort_all or job.matches(rid)):
                    job.aborted, job.abort_message = True, message
                    job.abort_where = "waiting" if self.paused == "retract" else "running"
                    count += 1
                    self.abort_epoch += 1
            self.cond.notify_all()
        return count

    def pause(self, mode: str) -> None:
        with self.cond:
            if mode == "abort":  # what runs or waits now ends (requests a retract pause holds are in
                self.abort(abort_all=True)  # SGLang's waiting queue); later requests wait for continue
            self.paused = mode
            self.cond.notify_all()
        with self.cond:  # answer once nothing decodes: the running requests ended, or the engine holds
            while self.running and not self.closed and not (mode != "abort" and self.parked):
                self.cond.wait()

    def resume(self) -> None:
        with self.cond:
            self.paused = None
            self.cond.notify_all()

    def run_update(self, fn):
        """Run ``fn`` (a weight update) with no decoding under way: paused, at once (the held
        requests continue with the new weights); else after the running requests, holding new ones.
        Returns ``(fn(), number of requests held paused)``."""
        with self.cond:
            paused = self.paused is not None
            held = sum(1 for _ in self.running) if paused else 0
            if not paused:
                self.updates += 1
                while self.running and not self.closed:
                    self.cond.wait()
        try:
            return fn(), held
        finally:
            if not paused:
                with self.cond:
                    self.updates -= 1
                    self.cond.notify_all()

    def cache_flushable(self) -> bool:
        """SGLang's condition for flushing the cache after a weight update (``Scheduler.flush_cache``:
        fully idle, the waiting requests ignored while paused), asked during :meth:`run_update`: no
        request holds KV cache computed with the old weights. Paused with ``retract``, the held
        requests recompute theirs on continue; paused ``in_place``, they keep it (not flushable)."""
        with self.cond:
            return not self.running or self.paused == "retract"

    def idle_for_flush(self) -> bool:
        """SGLang's condition for ``/flush_cache`` (``Scheduler.flush_cache``: ``is_fully_idle(ignore_waiting=
        paused)``): nothing holds KV cache (as :meth:`cache_flushable`) and nothing waits, unless paused
        (a request waiting here while paused is one SGLang's tokenizer manager holds, or one its paused
        scheduler ignores)."""
        with self.cond:
            return (not self.running or self.paused == "retract") and (not self.queue or self.paused is not None)

    def stats(self) -> dict:
        with self.cond:
            return {
                "num_running_reqs": len(self.running),
                "num_waiting_reqs": len(self.queue),
                "paused": self.paused,
                "num_batches": self.batches,
            }

    def close(self) -> None:
        with self.cond:
            self.closed = True
            pending = list(self.queue)
            self.queue.clear()
            self.cond.notify_all()
        for job in pending:
            job.error = RuntimeError("the server shut down")
            job.finish()

    def join(self, timeout: float | None = None) -> None:
        """(After :meth:`close`.) Wait for the engine to stop: it ends the running rows at its next
        decode step. A process exiting while the engine computes aborts ("terminate called without
        an active exception")."""
        self._thread.join(timeout)
