"""Abortable streams of requests on SGLang servers (:meth:`Streams.stream`, partial rollouts).

A stream sends one ``/generate`` per :class:`~megatron_klear.rollout.base.SampleRequest` (its ``n``,
its ``input_ids``, its own sampling parameters and budget ``max_new_tokens``; ``sampling_seed`` only
with ``send_seed``), through the same machinery as :meth:`.generation.Generation.generate_iter`:
an event loop in a helper thread, at most ``max_concurrent_requests`` in flight, retries, the
health watchdog, lost workers dropped and their requests sent again or hedged, the stale-answer
check (:mod:`.versions`). Iterating yields ``(key, Completion)`` per sample as each request ends
(``((key, k), Completion)`` for the ``n > 1`` samples of one request); each Completion carries its
tokens' weight versions (``Completion.versions``).

**Abort** (:meth:`ServerStream.abort`, returns at once). The stream stops sending (a request not
sent yet ends as an empty ``abort`` Completion, never sent) and POSTs ``/abort_request``
``{"rid": "", "abort_all": true}`` to every worker, live and rejoining (never to a router:
sglang-router 0.3.2 has no ``/abort_request`` route), again every ``ABORT_RESEND_S`` seconds while
requests remain (one sent just before the abort may reach its server after it). Every request in
flight then answers with what it generated so far (SGLang's ``abort`` finish reason: its tokens and
log-probs); a request whose worker has not answered within ``rollout.control_timeout_s`` after the
abort is cancelled and ends as an empty ``abort``. ``abort_all`` ends *every* request on those
servers: run one stream at a time. Before :meth:`~ServerStream.abort`, a server-side abort (a weight
push in ``abort`` mode) is retried as in ``generate``.

Counts: the engine's ``aborted_requests`` (requests that ended as ``abort``, with or without
tokens) and the stream's ``aborted`` (samples that did).
"""

from __future__ import annotations

import asyncio
import contextlib
import numbers
import queue
import threading
import time

from megatron_klear.rollout.base import RequestStream, SampleRequest, SamplingParams
from megatron_klear.rollout.servers.generation import CallState, aborted_empty

#: seconds between two rounds of /abort_request while an aborted stream still has requests running
ABORT_RESEND_S = 0.5


class Streams:
    """The abortable request streams of :class:`~.client.ServerClient`
    (:meth:`stream`), sent through its ``generation``."""

    def __init__(self, generation):
        self.generation = generation
        self.aborted_requests = 0  # requests of streams that ended as "abort" (this engine's lifetime)

    def stream(self, requests: list) -> "ServerStream":
        """Start every :class:`SampleRequest` now; see the module's docstring."""
        requests = list(requests)
        keys = set()
        for i, r in enumerate(requests):
            if not isinstance(r, SampleRequest):
                raise TypeError(f"rollout: stream request {i} is a {type(r).__name__}, not a SampleRequest")
            if not isinstance(r.params, SamplingParams):
                raise TypeError(f"rollout: stream request {r.key!r}: params must be SamplingParams")
            if not r.input_ids or not all(isinstance(t, numbers.Integral) and t >= 0 for t in r.input_ids):
                raise ValueError(f"rollout: stream request {r.key!r}: input_ids must be a non-empty list of token ids")
            r.params.validate()
            if not isinstance(r.n, numbers.Integral) or r.n < 1:
                raise ValueError(f"rollout: stream request {r.key!r}: n must be an integer >= 1, got {r.n!r}")
            try:
                for key in sample_keys(r):
                    if key in keys:
                        raise ValueError(f"rollout: stream request key {key!r} appears twice")
                    keys.add(key)
            except TypeError:
                raise TypeError(f"rollout: stream request key {r.key!r} is not hashable") from None
        self.generation.members.fleet  # noqa: B018 -- discovers the workers now: a router that is down fails here
        return ServerStream(self, requests)


def sample_keys(request: SampleRequest) -> list:
    """The keys a request's samples are handed back with: its key, or ``(key, k)`` with ``n > 1``."""
    return [request.key] if request.n == 1 else [(request.key, k) for k in range(request.n)]


class ServerStream(RequestStream):
    """The requests of one :meth:`Streams.stream` call (see the module's docstring). Iterate it from
    one thread; :meth:`abort` may be called from any thread."""

    def __init__(self, streams: Streams, requests: list):
        self.streams, self.generation = streams, streams.generation
        self.requests = requests
        self.samples = sum(r.n for r in requests)
        self.ended = 0  # samples handed out by the iteration
        self.aborted = 0  # of them, ended as "abort"
        self._results: queue.Queue = queue.Queue()
        self._stop = threading.Event()  # the consumer is gone: end the loop
        self._abort = threading.Event()
        self._lock = threading.Lock()
        self._loop = self._wake = None
        self._closed = False
        self._thread = self.generation._in_thread(self._run, self._results, "sglang-stream") if requests else None

    # -- the consumer's side ---------------------------------------------------------------------------
    def __iter__(self):
        while self.ended < self.samples and not self._closed:
            kind, key, completion = self._results.get()
            if kind == "closed":  # the stream was closed (by another thread): the rest is dropped
                self._results.put((kind, key, completion))  # (for any other thread still waiting)
                return
            if kind == "error":
                self._stop.set()
                self.ended = self.samples  # nothing more comes
                raise key
            self.ended += 1
            if completion.aborted:
                self.aborted += 1
            yield key, completion

    def abort(self) -> None:
        self._abort.set()
        self._poke()

    def close(self) -> None:
        """Abort, then wait for every request to end (their results are dropped; an error the
        stream met is not raised here); a thread iterating the stream meanwhile stops. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.abort()
        if self._thread is not None:  # its loop ends once every request has (the abort's deadline
            self._thread.join()  # bounds that), or at the error it met
        self._stop.set()
        # what is left is dropped; a thread iterating the stream meanwhile (or later) ends with it
        self._results.put(("closed", None, None))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _poke(self) -> None:
        """Wake the loop (it re-reads the abort and stop flags)."""
        with self._lock:
            loop, wake = self._loop, self._wake
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(wake.set)

    # -- the event loop's side -------------------------------------------------------------------------
    async def _run(self):
        eng = self.generation
        async with eng._open_call() as call:
            wake = asyncio.Event()
            with self._lock:
                self._loop, self._wake = asyncio.get_running_loop(), wake
            sem = asyncio.Semaphore(eng.max_concurrent_requests)

            async def run(req: SampleRequest):
                body = eng._request_body(req.input_ids, req.params, req.n, req.params.seed)
                async with sem:
                    if call.aborting:
                        return aborted_empty(req.n)  # never sent
                    return await eng._post_generate(call, body, req.n)

            tasks = {asyncio.ensure_future(run(r)): r for r in self.requests}
            watchdog = asyncio.ensure_future(eng._watch_workers(call, self._stop))
            deadline = resend = None
            posts, cancelled = set(), []  # the rounds of /abort_request; requests cancelled at the deadline
            try:
                while tasks and not self._stop.is_set():
                    now = time.monotonic()
                    if self._abort.is_set() and not call.aborting:
                        call.aborting = True
                        deadline, resend = now + eng.transport.timeout, now
                    if resend is not None and now >= resend:
                        posts.add(asyncio.ensure_future(self._abort_servers(call)))
                        resend = now + ABORT_RESEND_S
                    waiter = asyncio.ensure_future(wake.wait())
                    timeout = None if resend is None else max(0.0, min(resend, deadline) - now)
                    try:
                        done, _ = await asyncio.wait(
                            set(tasks) | {watchdog, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                        )
                    finally:
                        waiter.cancel()
                    wake.clear()
                    if watchdog in done:  # it only ends by failing (too few workers left)
                        raise watchdog.exception() or RuntimeError("the health watchdog ended")
                    for t in done & set(tasks):
                        req = tasks.pop(t)
                        self._put(req, t.result())  # (a request's failure is raised here)
                    if deadline is not None and time.monotonic() >= deadline:
                        for t, req in tasks.items():  # no answer since the abort: cancelled
                            t.cancel()
                            cancelled.append(t)
                            self._put(req, aborted_empty(req.n))
                        tasks.clear()
            finally:
                pending = set(tasks) | {watchdog} | set(cancelled) | posts
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                with self._lock:
                    self._loop = None

    def _put(self, request: SampleRequest, completions: list) -> None:
        if any(c.aborted for c in completions):
            self.streams.aborted_requests += 1
        for key, completion in zip(sample_keys(request), completions):
            self._results.put(("ok", key, completion))

    async def _abort_servers(self, call: CallState) -> None:
        """The server API's abort of every request (SGLang: ``/abort_request`` ``{"rid": "",
        "abort_all": true}``) to every live and rejoining worker;
        a worker that fails it is left to the deadline (and the watchdog)."""
        eng = self.generation

        async def one(w):
            try:
                path, body = eng.dialect.abort_all
                await call.http.aside("POST", w + path, eng.transport.timeout, body)
            except Exception:  # noqa: BLE001 -- its requests end at the deadline
                return

        await asyncio.gather(*(one(w) for w in eng.members.fleet.serving()))
