"""Generation through the servers' generate route (token ids in, each token's log-prob; the dialect's body).

A call is sent as many concurrent requests, at most ``max_concurrent_requests`` in flight, one per
prompt (``n`` samples each, ``request_granularity="prompt"``) or one per sample (``"sample"``), so
that a router can spread them over its workers and no request carries a whole batch towards a
timeout. Requests go to the routers among ``urls`` or the live workers among them (the live
workers themselves with ``record_routing``), each to the one with the fewest requests in flight.
Results are handed back as each prompt completes (:meth:`Generation.generate_iter`), so grading
overlaps generation.

Failures: a request that fails in transport, answers 5xx or is aborted by the server is retried up
to ``max_retries`` times (on another URL when there are several), then the call fails naming the
URL and the server's message; a 4xx (a bad request: too long for the context, an unknown field) is
not retried.

**A lost worker does not end the step** (see :mod:`.membership` for the states):

- While requests run, every live worker's ``/health`` is probed each ``health_check_interval``
  seconds; a worker that misses ``health_failure_threshold`` probes in a row (dead, or frozen: a
  stopped process still accepts TCP connections but never answers) is dropped -- taken out of the
  fleet and of the routers. A request sent directly to a worker that could not be reached is
  followed by one ``/health`` probe of that worker; when that fails too, the worker is dropped at
  once instead of at the watchdog's next round.
- A request in flight on a dropped worker (sent to it directly) is cancelled and sent to a live
  worker, without consuming a retry. Through a router the client cannot tell which worker holds a
  request, so every request in flight through a router when a worker is dropped is **hedged** once
  the router has stopped routing to that worker: sent again, the first answer kept, the other
  cancelled. Requests on the live workers keep their progress (no work is thrown away); the cost is
  duplicate work for the requests that were fine.
- Fewer than ``rollout.min_live_workers`` live workers: the call fails with
  :class:`~megatron_klear.rollout.base.FleetError` naming every lost worker and why, within
  the watchdog's bound (``health_failure_threshold`` x (``health_check_interval`` +
  ``health_check_timeout``), plus the routers' update).
- **Stale weights**: after a weight push the client expects ``meta_info.weight_version`` (SGLang
  0.5.23 returns it with every output, ``srt/managers/tokenizer_manager.py``) to be
  :attr:`~.membership.Membership.expected_version`; a request may run across a push (``retract``
  pause), so an answer is stale only when its version is older than the one expected when the
  request was sent, or newer than the one expected now (:mod:`.versions`). A stale answer is discarded and
  the request sent again (no retry consumed; at most ``max_retries + 1`` such answers per request);
  its worker -- the URL itself, or through a router the live workers whose ``/model_info``
  reports another version -- leaves the live set to get the weights at the next push. Before the
  first push (``expected_version`` None) any version is accepted: the servers answer with the
  version they started with (SGLang's ``"default"``).

The counts of the step (workers lost and readmitted, requests sent again, stale answers) are in
:meth:`~.membership.Membership.fleet_metrics`.

:class:`Generation` is a part of :class:`~.client.ServerClient` with its own
settings and counters (``requests_sent``, ``retries``; ``record_routing`` / ``routing_layers`` /
``routing_topk``), over the client's :class:`.transport.Transport` and :class:`.membership.Membership`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import threading
import time

from megatron_klear.rollout.base import Completion, FleetError, SamplingParams, check_seed_keys, keyed_seed
from megatron_klear.rollout.servers.call_http import CallHTTP, HTTPFailure, NoAnswerInTime
from megatron_klear.rollout.servers.dialect import AbortedByServer, ServerDialect
from megatron_klear.rollout.servers.fleet import LIVE
from megatron_klear.rollout.servers.transport import EngineError, Retryable, message_of
from megatron_klear.rollout.servers.versions import stale_version

GRANULARITIES = ("prompt", "sample")


class _Request:
    """One request's wake-up: its worker was dropped (``hedge``: send it again through a router)."""

    __slots__ = ("wake", "hedge")

    def __init__(self):
        self.wake = asyncio.Event()
        self.hedge = False


def aborted_empty(n: int = 1) -> list:
    """``n`` aborted Completions without a token (a request ended by an abort before it produced any)."""
    return [Completion(token_ids=[], logprobs=[], finish_reason="abort", versions=[]) for _ in range(n)]


class CallState:
    """What one generate call's (or stream's) requests share on its event loop: the HTTP clients
    (:class:`.call_http.CallHTTP`: requests, probes), the requests in flight per URL, the attempts
    in flight (to cancel or hedge them when a worker is dropped). ``aborting``: the stream was asked
    to abort (:mod:`.streams`): an ``abort`` answer is then the partial result, and nothing is sent
    or sent again."""

    def __init__(self, http: CallHTTP):
        self.http = http
        self.in_flight: dict = {}  # url -> requests in flight there
        self.attempts: dict = {}  # attempt task -> (url, its _Request)
        self.probes: dict = {}  # worker -> the running quick /health probe (shared)
        self.audit = asyncio.Lock()  # one version audit at a time
        self.audited_at = 0.0
        self.aborting = False


class Generation:
    """``/generate`` over the client's ``transport`` to the workers ``members`` lists, with the
    ``rollout`` section's settings (see the module's docstring: ``generate_timeout_s``, the
    concurrency and granularity of requests, retries, the watchdog's ``health_check_interval_s`` and
    ``health_failure_threshold``, ``send_seed``). ``routed_experts``: ``(MoE layer indices, top_k)``
    to ask for the experts every token was routed to; ``retry_backoff``: seconds before a retry
    (doubling)."""

    def __init__(
        self,
        transport,
        members,
        config,
        dialect: ServerDialect,
        *,
        routed_experts: tuple | None = None,
        retry_backoff: float = 1.0,
    ):
        self.transport, self.members = transport, members
        self.dialect = dialect
        self.generate_timeout = float(config.generate_timeout_s)
        self.max_concurrent_requests = int(config.max_concurrent_requests)
        self.request_granularity = config.request_granularity
        self.max_retries, self.retry_backoff = int(config.max_retries), float(retry_backoff)
        self.health_check_interval = float(config.health_check_interval_s)
        self.health_failure_threshold = int(config.health_failure_threshold)
        # rollout.router_replay (MoE): ask each server for the experts every token was routed to
        # (``return_routed_experts``); the model's MoE layer indices and top_k to read them
        self.record_routing, self.routing_layers, self.routing_topk = False, [], 0
        if routed_experts is not None:
            layers, top_k = routed_experts
            if int(top_k) < 1:
                raise ValueError(
                    f"rollout: routed_experts needs (MoE layer indices, top_k >= 1), got {routed_experts!r}"
                )
            self.record_routing, self.routing_layers, self.routing_topk = True, [int(x) for x in layers], int(top_k)
        self.requests_sent = 0  # /generate requests, retries included
        self.retries = 0

    def generation_urls(self) -> list:
        """Where /generate requests go now: the routers among ``urls`` and the live workers among
        them (:meth:`~.membership.Membership.generation_targets`), each request to the one with the
        fewest in flight. With ``record_routing`` the live workers themselves: the real
        sglang-router (0.3.2) rebuilds each request from its own struct, which has no
        ``return_routed_experts`` / ``routed_experts_start_len``, so the servers would never be
        asked for the experts (tests/rollout/test_routed_experts.py sends one through it)."""
        return self.members.fleet.live() if self.record_routing else self.members.generation_targets()

    def _request_body(self, input_ids, params: SamplingParams, n: int, seed) -> dict:
        """One generate body (the server API's): token ids in, ``n`` samples, the sampled tokens'
        log-probs back."""
        return self.dialect.generate_body(input_ids, params, n, seed, routing=self.record_routing)

    def generate(self, prompts: list, params: SamplingParams, n: int = 1) -> list:
        out = [None] * len(prompts)
        for i, completions in self.generate_iter(prompts, params, n):
            out[i] = completions
        return out

    def generate_iter(
        self,
        prompts: list,
        params: SamplingParams,
        n: int = 1,
        *,
        chunk_size: int | None = None,
        cancel=None,
        seed_keys: list | None = None,
    ):
        """Yield ``(prompt index, [n Completions])`` in the order prompts complete. The requests run
        on an event loop in a helper thread; closing the iterator early, or setting ``cancel`` (a
        ``threading.Event``) from another thread, cancels them (their connections close, which ends
        them on the servers) and ends the iteration. (``chunk_size`` is for in-process engines;
        requests here are already one per prompt or per sample.) ``seed_keys``: prompt ``i``'s
        request is seeded by ``seed_keys[i]`` instead of ``i`` (``RolloutEngine.generate_iter``)."""
        check_seed_keys(prompts, seed_keys)
        params.validate()
        if not prompts:
            return
        self.members.fleet  # noqa: B018 -- discovers the workers here, so that a router that is down fails now
        results: queue.Queue = queue.Queue()
        stop = threading.Event()
        thread = self._in_thread(
            lambda: self._generate_all(prompts, params, int(n), results, stop, seed_keys), results, "sglang-client"
        )
        done = 0
        try:
            while done < len(prompts):
                try:
                    kind, a, b = results.get(timeout=0.2 if cancel is not None else None)
                except queue.Empty:
                    kind = None
                if cancel is not None and cancel.is_set():
                    return
                if kind is None:
                    continue
                if kind == "error":
                    raise a
                done += 1
                yield a, b
        finally:
            stop.set()
            thread.join()

    @staticmethod
    def _in_thread(make_coro, results: queue.Queue, name: str) -> threading.Thread:
        """Run the coroutine ``make_coro()`` on an event loop of its own in a daemon thread (started);
        an exception it raises reaches ``results`` as ``("error", exception, None)``."""

        def run():
            try:
                asyncio.run(make_coro())
            except BaseException as e:  # noqa: BLE001 -- handed to the consumer
                keep = isinstance(e, (EngineError, FleetError))
                results.put(("error", e if keep else EngineError(f"rollout: {type(e).__name__}: {e}"), None))

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        return thread

    @contextlib.asynccontextmanager
    async def _open_call(self):
        """The :class:`CallState` of one generate call or stream: its HTTP clients, closed on leaving
        (room for a hedge of every request in flight)."""
        async with CallHTTP(
            2 * self.max_concurrent_requests + 8,
            read_timeout=self.generate_timeout,
            connect_timeout=self.transport.timeout,
            headers=self.transport.auth_headers(),
        ) as http:
            yield CallState(http)

    async def _generate_all(self, prompts, params, n, results, stop, seed_keys=None):
        base_seed = params.seed
        keys = seed_keys if seed_keys is not None else range(len(prompts))
        per_sample = self.request_granularity == "sample" and n > 1
        units = (
            [(i, j) for i in range(len(prompts)) for j in range(n)]
            if per_sample
            else [(i, None) for i in range(len(prompts))]
        )
        sem = asyncio.Semaphore(self.max_concurrent_requests)
        partial = {i: [None] * n for i in range(len(prompts))} if per_sample else None
        async with self._open_call() as call:

            async def run(unit):
                i, j = unit
                if base_seed is None:
                    seed = None
                elif j is None:
                    seed = keyed_seed(base_seed, keys[i])
                else:
                    seed = ((base_seed * 1_000_003 + keys[i]) * 1_000_033 + j) % (1 << 63)
                body = self._request_body(prompts[i], params, 1 if per_sample else n, seed)
                async with sem:
                    return unit, await self._post_generate(call, body, 1 if per_sample else n)

            tasks = [asyncio.ensure_future(run(u)) for u in units]
            watchdog = asyncio.ensure_future(self._watch_workers(call, stop))
            pending = set(tasks) | {watchdog}
            try:
                while True:
                    done, pending = await asyncio.wait(pending, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                    if stop.is_set():
                        return
                    failed = [t.exception() for t in done if t.exception() is not None]  # (retrieves them all)
                    if failed:  # a request that exhausted its retries, or too few workers left
                        raise next((e for e in failed if isinstance(e, FleetError)), failed[0])
                    for t in done:
                        if t is watchdog:
                            continue
                        (i, j), completions = t.result()
                        if not per_sample:
                            results.put(("ok", i, completions))
                        else:
                            partial[i][j] = completions[0]
                            if all(c is not None for c in partial[i]):
                                results.put(("ok", i, partial.pop(i)))
                    if pending == {watchdog}:
                        return
            finally:
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)

    # -- one request ---------------------------------------------------------------------------------
    def _pick(self, call: CallState, avoid: str | None) -> str:
        urls = self.generation_urls()
        if not urls:
            self.members.fleet.check()  # FleetError naming the lost workers
            raise EngineError("rollout: no live rollout server to send /generate to")
        if avoid is not None and len(urls) > 1:
            urls = [u for u in urls if u != avoid] or urls
        return min(urls, key=lambda u: call.in_flight.get(u, 0))

    def _start(self, call: CallState, me: _Request, url: str, body: dict, n: int) -> asyncio.Task:
        call.in_flight[url] = call.in_flight.get(url, 0) + 1
        self.requests_sent += 1
        task = asyncio.ensure_future(self._post_once(call, url, body, n))
        call.attempts[task] = (url, me)
        return task

    def _finish(self, call: CallState, task: asyncio.Task) -> str:
        url, _ = call.attempts.pop(task)
        call.in_flight[url] -= 1
        return url

    async def _post_generate(self, call: CallState, body: dict, n: int) -> list:
        """One request, until an answer made with the expected weights: retried after a failure
        (``max_retries``), sent again without consuming a retry when its worker is dropped or it
        answered with stale weights, hedged through a router (see the module's docstring). Once
        ``call.aborting``: nothing is sent or sent again, an ``abort`` answer is the result (the
        output so far), and a request left with no attempt ends as an empty abort."""
        me, mine = _Request(), set()
        last, retries, stale = None, 0, 0
        sent_at = {}  # attempt -> the version the client expected when it was sent
        try:
            while True:
                if call.aborting and (not mine or me.hedge):
                    if not mine:
                        return aborted_empty(n)
                    me.hedge = False  # no hedge once aborting: the running attempt answers
                if not mine or me.hedge:
                    if me.hedge:
                        self.members.fleet.count(resent=1)
                    me.hedge = False
                    task = self._start(call, me, self._pick(call, last.url if last else None), body, n)
                    sent_at[task] = self.members.expected_version
                    mine.add(task)
                waiter = asyncio.ensure_future(me.wake.wait())
                try:
                    done, _ = await asyncio.wait(mine | {waiter}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
                me.wake.clear()
                for task in done - {waiter}:
                    mine.discard(task)
                    url = self._finish(call, task)
                    if task.cancelled():  # its worker was dropped: sent again, no retry consumed
                        if not call.aborting:
                            self.members.fleet.count(resent=1)
                        continue
                    e = task.exception()
                    if e is None:
                        completions, versions = task.result()
                        wrong = self._stale(versions, sent_at.get(task))
                        if wrong is None:
                            return completions
                        stale += 1
                        self.members.fleet.count(stale=1, resent=1)
                        if call.aborting:
                            continue  # not sent again: ends as an empty abort
                        if stale > self.max_retries + 1:
                            raise EngineError(
                                f"rollout: POST {url}/generate answered with weight_version {wrong!r} {stale} times, "
                                f"expected {self.members.expected_version!r} (a worker the client cannot tell is "
                                "serving "
                                "other weights)"
                            )
                        await self._demote_stale(call, url, wrong)
                        continue
                    if not isinstance(e, Retryable):
                        raise e
                    if call.aborting:
                        continue  # not retried once aborting
                    if e.gone and await self._worker_is_gone(call, url, e.message):
                        self.members.fleet.count(resent=1)  # its worker was dropped: sent again, no retry consumed
                        continue
                    if mine:
                        continue  # a hedge of this request is still running
                    last = e
                    if retries >= self.max_retries:
                        raise EngineError(
                            f"rollout: POST {last.url}/generate failed {self.max_retries + 1} times; "
                            f"last: {last.message}"
                        )
                    retries += 1
                    self.retries += 1
                    await asyncio.sleep(self.retry_backoff * (2 ** (retries - 1)))
        finally:
            for task in mine:
                task.cancel()
                self._finish(call, task)

    def _stale(self, versions: list, sent=None):
        """The first final ``weight_version`` of an answer that is stale for a request sent while the
        client expected ``sent`` (:func:`.versions.stale_version`); None: none."""
        pushing = self.members.fleet.is_pushing()
        return next((v for v in versions if stale_version(v, sent, self.members.expected_version, pushing)), None)

    async def _demote_stale(self, call: CallState, url: str, version) -> None:
        """An answer made with other weights: its worker (``url``, or through a router the live
        workers reporting another version) leaves the live set until the next push."""
        why = f"answered /generate with weight_version {version!r}, expected {self.members.expected_version!r}"
        if self.members.fleet.state(url) is not None:
            await asyncio.to_thread(self.members.demote_worker, url, why)
            return
        asked = time.monotonic()
        async with call.audit:
            if call.audited_at < asked:  # (an audit that started after this answer came covers it)
                await asyncio.to_thread(self.members.audit_versions)
                call.audited_at = time.monotonic()

    async def _worker_is_gone(self, call: CallState, url: str, message: str) -> bool:
        """A request to the worker ``url`` could not reach it: one /health probe (shared by the
        requests that failed alike) decides whether it is dropped now. True when it was dropped
        (now or before); False for a router, or a worker that answers (the failure is retried)."""
        state = self.members.fleet.state(url)
        if state is None or (state == LIVE and self.members.fleet.is_pushing()):
            return False  # a router: its own failure; or paused by a push (/health blocks): retried
        if state != LIVE:
            return True
        probe = call.probes.get(url)
        if probe is None:
            probe = call.probes[url] = asyncio.ensure_future(self._probe(call, url))
        try:
            ok, why = await asyncio.shield(probe)
        finally:
            if probe.done():
                call.probes.pop(url, None)
        if ok:
            return False
        await self._lose(call, url, f"POST /generate failed ({message}), then /health: {why}")
        return True

    async def _lose(self, call: CallState, worker: str, why: str) -> None:
        """Drop ``worker`` (fleet and routers; FleetError below min_live), then send its requests
        again: those sent to it directly are cancelled (their requests pick another worker), those
        in flight through a router are hedged."""
        if not await asyncio.to_thread(self.members.drop_worker, worker, why):
            return
        for task, (url, req) in list(call.attempts.items()):
            if url == worker:
                task.cancel()
            elif self.members.fleet.state(url) is None:  # through a router: it may hold the request
                req.hedge = True
            else:
                continue
            req.wake.set()

    async def _post_once(self, call: CallState, url: str, body: dict, n: int):
        """One POST; ``(completions, each sample's weight_version)``. An ``abort`` answer is retried
        unless the call is aborting (then it is the output so far)."""
        path = self.dialect.generate_path
        try:
            resp = await call.http.post(url + path, body)
        except NoAnswerInTime:
            raise EngineError(
                f"rollout: POST {url}{path} did not answer within rollout.generate_timeout_s = "
                f"{self.generate_timeout:g} s"
            ) from None
        except HTTPFailure as e:
            raise Retryable(url, str(e), gone=e.gone) from None
        if resp.status_code >= 500:
            raise Retryable(url, f"HTTP {resp.status_code}: {message_of(resp)}")
        if resp.status_code >= 400:
            raise EngineError(f"rollout: POST {url}{path} failed with HTTP {resp.status_code}: {message_of(resp)}")
        try:
            payload = resp.json()
        except json.JSONDecodeError:
            raise EngineError(
                f"rollout: POST {url}{path} answered a body that is not JSON: {resp.text[:200]!r}"
            ) from None
        routing = (
            (len(body[self.dialect.prompt_key]), self.routing_layers, self.routing_topk)
            if self.record_routing
            else None
        )
        try:
            return self.dialect.read_generate(payload, n, where=url + path, routing=routing, allow_abort=call.aborting)
        except AbortedByServer as e:
            raise Retryable(url, str(e)) from None

    # -- the watchdog ----------------------------------------------------------------------------------
    async def _probe(self, call: CallState, w: str):
        try:
            r = await call.http.aside("GET", w + "/health", self.transport.health_check_timeout)
            return r.status_code < 400, f"HTTP {r.status_code}"
        except NoAnswerInTime:
            return False, f"no answer within {self.transport.health_check_timeout:g} s"
        except HTTPFailure as e:
            return False, str(e)

    async def _watch_workers(self, call: CallState, stop: threading.Event):
        """Probe every live worker's /health while requests run; drop one that misses
        ``health_failure_threshold`` probes in a row (FleetError when too few remain). No probe while
        a weight push is under way (``Fleet.pushing``: a paused server's /health blocks, then 503s),
        and a round of probes that overlapped a push counts for nothing."""
        misses, first_miss = {}, {}
        while not stop.is_set():
            await asyncio.sleep(self.health_check_interval)
            pushes = self.members.fleet.pushes_started
            if self.members.fleet.is_pushing():
                continue
            workers = self.members.fleet.live()
            probed = await asyncio.gather(*(self._probe(call, w) for w in workers))
            if self.members.fleet.is_pushing() or self.members.fleet.pushes_started != pushes:
                continue
            for w, (ok, why) in zip(workers, probed):
                if ok:
                    misses.pop(w, None)
                    first_miss.pop(w, None)
                    continue
                misses[w] = misses.get(w, 0) + 1
                first_miss.setdefault(w, time.monotonic())
                if misses[w] >= self.health_failure_threshold:
                    why = (
                        f"stopped answering /health during generation ({misses.pop(w)} probes in a row over "
                        f"{time.monotonic() - first_miss.pop(w):.0f} s; last: {why})"
                    )
                    await self._lose(call, w, why)
