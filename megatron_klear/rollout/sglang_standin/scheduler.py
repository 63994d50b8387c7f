"""The stand-in's scheduler: the only caller of the engine. A thread runs the engine's
:class:`~megatron_klear.rollout.embedded.batcher.ContinuousBatcher` one step at a time, as SGLang's
scheduler runs its event loop: /generate requests join the running batch between decode steps and
leave it when they finish. Between steps it serves pauses (``in_place`` holds the batch,
``retract`` sends it back to the queue, ``abort`` ends it) and weight updates (with no step under
way)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time

from megatron_klear.rollout.embedded.batcher import ContinuousBatcher


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
        # where SGLang would find it when aborted: "running" (in the running batch: FINISH_ABORT after
        # the step's token) or "waiting" (in the waiting queue: not started, or retracted by a pause --
        # answered from what the tokenizer manager received)
        self.abort_where = None

    def finish(self) -> None:
        """Resolve :attr:`future` (once; a no-op if it is done or its waiter was cancelled)."""
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            self.future.set_result(self)

    def matches(self, rid: str) -> bool:
        """SGLang's scheduler matches a request to abort by prefix: ``req.rid.startswith(rid)``."""
        return any(isinstance(i, str) and i.startswith(rid) for i in [self.rid, *self.ids])


class Scheduler:
    """The engine's only caller (see the module docstring). ``max_running_requests`` and
    ``max_total_tokens`` bound the batch as SGLang's flags do (default: the engine's).

    When the engine is idle and requests start arriving, the scheduler lets them gather first: it
    admits them once no new one has come for ``settle`` seconds, or after ``window`` seconds, so
    that the samples of one prompt sent as separate requests share one prefill (the stand-in has no
    prefix cache; SGLang's radix cache shares them)."""

    def __init__(
        self,
        engine,
        max_running_requests: int | None = None,
        max_total_tokens: int | None = None,
        *,
        window: float = 0.05,
        settle: float = 0.005,
    ):
        self.engine = engine
        self.batcher = ContinuousBatcher(
            engine,
            max_running_requests=max_running_requests or engine.max_running_requests,
            max_total_tokens=max_total_tokens or engine.max_total_tokens,
            aborted=self.aborted,
        )
        self.max_running_requests = self.batcher.max_running_requests
        self.max_total_tokens = self.batcher.max_total_tokens
        self.window, self.settle = float(window), float(settle)
        self.cond = threading.Condition()
        self.jobs = {}  # id -> the jobs submitted and not yet answered
        self.paused = None  # None | "abort" | "retract" | "in_place"
        self.stepping = False  # a batcher step is under way
        self.updates = 0  # weight updates waiting for the running requests to finish
        self.closed = False
        self._thread = threading.Thread(target=self._loop, name="standin-scheduler", daemon=True)
        self._thread.start()

    @property
    def batches(self) -> int:
        """Prefill waves so far (each admits the rows waiting at a step)."""
        return self.batcher.waves

    @property
    def history(self):
        """``(requests, rows)`` of the recent prefill waves."""
        return self.batcher.history

    def aborted(self, job) -> bool:
        return job is not None and (job.aborted or self.closed)

    # -- requests -----------------------------------------------------------------------------------
    def submit(self, job: Job) -> Job:
        """Queue ``job``; its :attr:`Job.future` says when it is done (with ``job.error`` set for a
        request the server's bounds can never hold)."""
        try:
            for r in job.requests:
                self.batcher.check(r)
        except ValueError as e:
            job.error = e
            job.finish()
            return job
        with self.cond:
            if self.closed:
                raise RuntimeError("the server is shutting down")
            self.jobs[id(job)] = job
            for k, r in enumerate(job.requests):
                self.batcher.submit(r, lambda completions, k=k: self._done(job, k, completions))
            self.cond.notify_all()
        return job

    def _done(self, job: Job, k: int, completions: list) -> None:
        job.results[k] = completions
        job.pending -= 1
        if job.pending == 0:
            self.jobs.pop(id(job), None)
            job.finish()

    def _gather(self) -> None:
        """(Holding the lock, nothing running.) Let concurrent arrivals join before a wave starts."""
        end = time.monotonic() + self.window
        seen = len(self.batcher.waiting)
        while not self.closed and not self.paused and not self.updates:
            if self.max_running_requests is not None and seen >= self.max_running_requests:
                return
            left = end - time.monotonic()
            if left <= 0:
                return
            self.cond.wait(min(self.settle, left))
            if len(self.batcher.waiting) == seen:
                return
            seen = len(self.batcher.waiting)

    def _admitting(self) -> bool:
        return not self.paused and not self.updates and not self.closed

    def _loop(self) -> None:
        b = self.batcher
        while True:
            with self.cond:
                while True:
                    if self.closed and not b.running:
                        return
                    if self.paused == "retract" and b.running:
                        b.retract_all()  # SGLang: the running requests go back to the waiting queue
                    holding = self.paused in ("in_place", "retract") and not self.closed
                    if not holding and (b.running or (self._admitting() and b.waiting)):
                        break
                    self.cond.notify_all()
                    self.cond.wait()
                if not b.running:
                    self._gather()
                admit = self._admitting()
                if not admit and not b.running:
                    continue
                self.stepping = True
            try:
                b.step(admit=admit)
            except Exception as e:  # noqa: BLE001 -- handed to the requests, answered by their handlers
                for ticket in b.drop_running():
                    job = ticket.key
                    if not job.future.done():
                        job.error = e
                        self.jobs.pop(id(job), None)
                        job.finish()
            finally:
                with self.cond:
                    self.stepping = False
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
                if not any(rid in job.ids for job in self.jobs.values() if not job.aborted):
                    return 0
        return self.abort(rid, abort_all)

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str | None = None) -> int:
        """Abort the requests matching ``rid`` (a prefix of their ids) or all: waiting ones answer at
        once, running ones after their next decode step (SGLang's ``to_finish``). ``message``: their
        finish message (None: SGLang's, "Aborted" / "Abort in waiting queue")."""
        count = 0
        with self.cond:
            running = self.batcher.running_keys() if self.paused != "retract" else set()
            for job in list(self.jobs.values()):
                if not job.aborted and (abort_all or job.matches(rid)):
                    job.aborted, job.abort_message = True, message
                    job.abort_where = "running" if id(job) in running else "waiting"
                    count += 1
            self.batcher.serve_waiting_aborts()
            self.cond.notify_all()
        return count

    def pause(self, mode: str) -> None:
        """SGLang's three pauses; answers once nothing decodes: ``abort`` ends what runs or waits now
        (the running rows after one more step) and holds later requests until continue; ``in_place``
        holds the batch between two steps; ``retract`` sends its rows back to the queue."""
        with self.cond:
            if mode == "abort":
                self.abort(abort_all=True)
            self.paused = mode
            self.cond.notify_all()
            while not self.closed and (self.stepping or (mode != "in_place" and self.batcher.running)):
                self.cond.wait()

    def resume(self) -> None:
        with self.cond:
            self.paused = None
            self.cond.notify_all()

    def _held(self) -> int:
        """Requests a pause holds: running, or retracted with tokens."""
        b = self.batcher
        with b.lock:
            rows = [*b.running, *(r for r in b.waiting if r.logits_version is not None)]
        return len({id(r.ticket.key) for r in rows})

    def run_update(self, fn):
        """Run ``fn`` (a weight update) with no decoding under way: paused, at once (the held
        requests continue with the new weights); else after the running requests, holding new ones.
        Returns ``(fn(), number of requests held paused)``."""
        with self.cond:
            paused = self.paused is not None
            if not paused:
                self.updates += 1
            while not self.closed and (self.stepping or (not paused and self.batcher.running)):
                self.cond.wait()
            held = self._held() if paused else 0
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
            return not self.batcher.running or self.paused == "retract"

    def idle_for_flush(self) -> bool:
        """SGLang's condition for ``/flush_cache`` (``Scheduler.flush_cache``: ``is_fully_idle(ignore_waiting=
        paused)``): nothing holds KV cache (as :meth:`cache_flushable`) and nothing waits, unless paused
        (a request waiting here while paused is one SGLang's tokenizer manager holds, or one its paused
        scheduler ignores)."""
        with self.cond:
            return self.cache_flushable() and (not self.batcher.waiting or self.paused is not None)

    def stats(self) -> dict:
        b = self.batcher
        with self.cond, b.lock:
            return {
                "num_running_reqs": len(b.running),
                "num_waiting_reqs": len(b.waiting),
                "num_used_tokens": sum(r.held for r in b.running),
                "paused": self.paused,
                "num_batches": b.waves,
                "num_retractions": b.retractions,
            }

    def close(self) -> None:
        """Stop: the waiting requests fail ("the server shut down"), the running ones end at the
        next step."""
        with self.cond:
            self.closed = True
            b = self.batcher
            with b.lock:
                running = {id(r.ticket.key) for r in b.running}
                pending = [j for j in self.jobs.values() if id(j) not in running]
            for job in pending:
                self.jobs.pop(id(job), None)
                job.error = RuntimeError("the server shut down")
                job.finish()
            self.cond.notify_all()

    def join(self, timeout: float | None = None) -> None:
        """(After :meth:`close`.) Wait for the engine to stop: it ends the running rows at its next
        decode step. A process exiting while the engine computes aborts ("terminate called without
        an active exception")."""
        self._thread.join(timeout)
