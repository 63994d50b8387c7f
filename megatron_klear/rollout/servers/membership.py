"""Which workers the client of rollout servers uses, and sglang-router's list kept in step with it.

The workers are the servers behind ``urls``: listed explicitly (``rollout.workers``), or
asked from each URL that is a router (``GET /workers``; a URL without that route is a server
itself). Their state (live / rejoining / lost) is :attr:`Membership.fleet`
(:class:`~megatron_klear.rollout.servers.fleet.Fleet`): control calls go to the live and rejoining
workers (:meth:`Membership.workers`), generation only to live ones.

sglang-router 0.3.2's membership routes (tried against the installed router): ``GET /workers``
lists ``{"workers": [{"id", "url", "is_healthy", ...}]}``; ``POST /workers`` with ``{"url"}``
(and the worker's ``api_key``) queues an addition (202; the worker is listed once the router has
checked it); ``DELETE /workers/{id}`` queues a removal (202). It has no ``/add_worker`` or
``/remove_worker``. Both changes are asynchronous, so the client waits (bounded by
``rollout.control_timeout_s``) until ``GET /workers`` shows them. Whether the router runs its own
health checks or not (``--disable-health-check``), the client removes a worker it lost and adds it
back only once it holds the current weights: a router whose health check saw a restarted server
answer again would otherwise route to it while it still holds its start-up weights.

- :meth:`Membership.drop_worker`: the worker is lost for the rest of the step (and later ones,
  until recalled); the router stops routing to it. While fewer than ``rollout.min_live_workers``
  would remain, :class:`~megatron_klear.rollout.base.FleetError` is raised instead and the
  router's list is left as it is (the step fails; a restarted job finds the workers listed there).
- :meth:`Membership.recall_workers`: lost workers that answer ``/model_info`` again, and workers the
  router lists that this client did not know, become *rejoining*: the next weight push includes
  them (:meth:`workers` lists them) but nothing is generated on them yet.
- :meth:`Membership.admit_workers`: rejoining workers that report the pushed version become live
  and are added to the router again.

What counts as a worker that is **gone** (:class:`~megatron_klear.rollout.servers.transport.WorkerGone`):
it cannot be reached or does not answer in time -- connection refused or reset, the connection
closed without an answer, a timeout. An answer, whatever its status (4xx, 5xx, a paused server's
503), is a worker that is there and refused the call: that fails the call as before.

:class:`Membership` is a part of :class:`~.client.ServerClient` with its own
state (the fleet, the routers, the expected weight version), over the client's
:class:`.transport.Transport`; generation and control are given it.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import httpx

from megatron_klear.rollout.base import FleetError
from megatron_klear.rollout.servers.fleet import LIVE, REJOINING, Fleet
from megatron_klear.rollout.servers.transport import EngineError, WorkerGone, in_parallel

#: longest wait for the router to show a worker added or removed (it queues both as jobs)
ROUTER_SETTLE_S = 10.0


def note(message: str) -> None:
    """A fleet event worth a line in the job's log (stderr): a worker lost, recalled, admitted."""
    print(message, file=sys.stderr, flush=True)


class Membership:
    """The workers behind a ``rollout`` section's ``urls`` (``workers``: listed explicitly instead of
    asked from routers), and the fewest live ones a step goes on with (``min_live_workers``)."""

    def __init__(self, transport, config, dialect):
        self.transport = transport
        self.dialect = dialect  # where a server tells its version, how it resumes
        self.urls = [u.rstrip("/") for u in config.urls]
        self._explicit_workers = [w.rstrip("/") for w in config.workers] if config.workers else None
        self.min_live_workers = int(config.min_live_workers)
        self._fleet = None  # made on first use (discovery asks the routers)
        self._routers = {}  # url -> whether it is a router (answers GET /workers with a list)
        self._membership_lock = threading.RLock()
        self._reported = {}  # the fleet's counters at the last fleet_metrics() (per-step deltas)
        self.expected_version = None  # the weight version every live worker holds (None: no push yet)

    # -- the fleet -----------------------------------------------------------------------------------
    @property
    def fleet(self) -> Fleet:
        """The workers' states; on first use filled from ``workers=`` or the routers' lists (all live:
        they serve the weights the job starts from)."""
        with self._membership_lock:
            if self._fleet is None:
                found = list(self._explicit_workers) if self._explicit_workers is not None else self._discover()
                self._fleet = Fleet(found, self.min_live_workers)
            return self._fleet

    def _router_list(self, url: str):
        """The worker entries a router lists (``[{"id", "url", "is_healthy", ...}]``), or None when
        ``url`` is not a router (no ``GET /workers`` list). Raises EngineError when unreachable."""
        try:
            resp = self.transport.client().get(url + "/workers", timeout=self.transport.timeout)
        except httpx.TimeoutException:
            raise WorkerGone(
                f"rollout: {url} did not answer GET /workers within {self.transport.timeout:g} s "
                "(rollout.control_timeout_s): is it hung?"
            ) from None
        except httpx.HTTPError as e:
            raise WorkerGone(
                f"rollout: cannot reach {url} ({type(e).__name__}: {e}); is the server or router "
                "running, and is rollout.urls right?"
            ) from None
        listed = None
        if resp.status_code == 200:
            try:
                listed = resp.json().get("workers")
            except (json.JSONDecodeError, AttributeError):
                listed = None
        if not isinstance(listed, list):
            self._routers[url] = False
            return None
        self._routers[url] = True
        return [w for w in listed if isinstance(w, dict) and w.get("url")]

    def _discover(self) -> list:
        found = []
        for u in self.urls:
            listed = self._router_list(u)
            if listed is None:
                found.append(u)
                continue
            if not listed:
                raise EngineError(f"rollout: the router {u} has no workers registered ({u}/workers)")
            found += [w["url"].rstrip("/") for w in listed]
        return list(dict.fromkeys(found))

    def routers(self) -> list:
        """The URLs that are routers (asked once each; a URL that cannot be reached now counts as none)."""
        out = []
        for u in self.urls:
            if u not in self._routers:
                try:
                    self._router_list(u)
                except EngineError:
                    continue
            if self._routers.get(u):
                out.append(u)
        return out

    def workers(self, refresh: bool = False) -> list:
        """The workers that take control calls now: live and rejoining (:meth:`Fleet.serving`).
        ``refresh``: first ask the routers for workers this client does not know yet (they enter as
        rejoining, see :meth:`recall_workers`)."""
        fleet = self.fleet
        if refresh:
            self._refresh_from_routers()
        return fleet.serving()

    def generation_targets(self) -> list:
        """Where ``/generate`` may go now: the routers among ``urls`` and the live workers among
        them (a URL that is a worker and not live is left out)."""
        fleet = self.fleet
        return [u for u in self.urls if fleet.state(u) in (None, LIVE)]

    # -- calls on every worker ---------------------------------------------------------------------
    def on_workers(self, fn, timeout_hint: str = "", tolerate_loss: bool = False):
        """Run ``fn(worker_url)`` on every worker of :meth:`workers` in parallel.

        ``tolerate_loss=False``: the results as a list aligned with ``workers()`` at the call; the
        first failure is raised after all finish. ``tolerate_loss=True``: a worker whose call failed
        because it is gone (:class:`WorkerGone`: unreachable, reset, no answer in time) is dropped
        (:meth:`drop_worker`) and the others' results come back as ``{worker: result}`` (the workers
        that succeeded, in ``workers()`` order); :class:`FleetError` when fewer than
        ``rollout.min_live_workers`` live workers remain; any other failure (an answer refusing the
        call) is raised after all finish, as without it."""
        workers = self.workers()
        results, errors = in_parallel(fn, workers)
        if not tolerate_loss:
            first = next((e for e in errors if e is not None), None)
            if first is not None:
                raise first
            return results
        refused = next((e for e in errors if e is not None and not isinstance(e, WorkerGone)), None)
        gone = [(w, e) for w, e in zip(workers, errors) if isinstance(e, WorkerGone)]
        for w, e in gone:
            self.drop_worker(w, str(e))
        if refused is not None:
            raise refused
        return {w: r for w, r, e in zip(workers, results, errors) if e is None}

    def on_workers_loading(self, fn, what: str) -> None:
        """``fn(worker)`` (a weight load) on every worker, in parallel. A worker that is gone is
        dropped (:class:`FleetError` below the live minimum); one that *answers* with a failure is an
        error for a live worker -- the same cause would usually hit every server, and it must be
        seen -- while a rejoining one is only dropped again (it keeps its old weights and gets no
        request). ``what`` names the load in the drop's reason."""
        refused = {}

        def run(w):
            try:
                fn(w)
            except EngineError as e:
                if isinstance(e, WorkerGone):
                    raise  # gone: on_workers drops it
                refused[w] = e

        rejoining = set(self.fleet.rejoining())
        self.on_workers(run, tolerate_loss=True)
        for w, e in refused.items():
            if w in rejoining:
                self.drop_worker(w, f"its {what} as it rejoined failed: {e}")
        live_failures = [e for w, e in refused.items() if w not in rejoining]
        if live_failures:
            raise live_failures[0]

    def weight_versions(self) -> dict:
        """``{worker: the weight version it reports}`` of every worker that answers (a gone one is
        dropped)."""
        return self.on_workers(lambda w: self.dialect.weight_version(self.transport, w), tolerate_loss=True)

    def check_weight_versions(self, version) -> None:
        """Every worker must report ``version``: a live one that does not is an error, a rejoining one
        is dropped again (it gets no request)."""
        rejoining = set(self.fleet.rejoining())
        for w, reported in self.weight_versions().items():
            if str(reported) == str(version):
                continue
            why = f"rollout: {w} reports weight_version {reported!r} after the update, expected {str(version)!r}"
            if w not in rejoining:
                raise EngineError(why)
            self.drop_worker(w, why)

    def alive(self, workers) -> list:
        """Whether each of ``workers`` answers at all, in parallel: ``/model_info`` within
        ``rollout.health_check_timeout_s``, any answer counts. Not ``/health``: SGLang 0.5.23's blocks
        while generation is paused (a weight sync pauses it) and answers 503 after 20 s."""
        wait = min(self.transport.timeout, self.transport.health_check_timeout)

        def ask(w):
            try:
                self.dialect.weight_version(self.transport, w, timeout=wait)
            except WorkerGone:
                return False
            except EngineError:
                return True  # it answered (with an error status): it is there
            return True

        return in_parallel(ask, list(workers))[0]

    # -- membership changes -------------------------------------------------------------------------
    def drop_worker(self, worker: str, why: str) -> bool:
        """``worker`` is lost (dead, frozen, failing): nothing more is sent to it, and the routers
        stop routing to it (best effort). Returns whether it was live or rejoining. Raises
        :class:`FleetError` (naming every lost worker) when fewer than ``rollout.min_live_workers``
        live workers remain; the routers' lists are then left as they are."""
        changed = self.fleet.lose(worker, why)  # raises FleetError below min_live
        if changed:
            note(f"rollout: worker {worker} lost ({why}); {len(self.fleet.live())} live worker(s) go on")
            self._router_remove(worker)
        return changed

    def rejoining_workers(self) -> list:
        return list(self.fleet.rejoining())

    def pushing(self):
        return self.fleet.pushing()

    def recall_workers(self) -> list:
        """Lost workers that answer ``/model_info`` again (each probe bounded by
        ``rollout.health_check_timeout_s``) and workers a router lists that this client did not know
        become rejoining (removed from the routers until :meth:`admit_workers`). Returns them.

        Not ``/health``: SGLang 0.5.23's blocks while generation is paused and answers 503 after
        20 s, and a worker dropped during a weight sync was left paused by it. A recalled worker is
        told ``/continue_generation`` (best effort; a restarted server is not paused): it takes no
        generation request until admitted, and the next push pauses it again."""
        fleet = self.fleet
        lost = list(fleet.lost())
        answered = self.alive(lost)  # /model_info: any answer counts
        wait = min(self.transport.timeout, self.transport.health_check_timeout)
        back = [w for w, ok in zip(lost, answered) if ok and fleet.recall(w)]
        for w in back:
            try:
                self.dialect.resume(self.transport, w, timeout=wait)
            except EngineError as e:
                note(f"rollout: worker {w} answers again but refused to resume generation: {e}")
            note(f"rollout: worker {w} answers again; it rejoins at the next weight push")
        return back + self._refresh_from_routers()

    def _refresh_from_routers(self) -> list:
        """Workers the routers list that are not live here: unknown ones enter as rejoining; any
        listed worker that is not live is removed from the router. Returns the new ones."""
        if self._explicit_workers is not None:
            return []
        fleet, new = self.fleet, []
        for u in self.routers():
            try:
                listed = self._router_list(u) or []
            except EngineError as e:
                note(f"rollout: cannot list the workers of the router {u}: {e}")
                continue
            for entry in listed:
                w = entry["url"].rstrip("/")
                if fleet.add(w, REJOINING):
                    new.append(w)
                    note(f"rollout: the router {u} lists a new worker {w}; it joins at the next weight push")
                if fleet.state(w) != LIVE:
                    self._router_remove(w, routers=[u])
        return new

    def admit_workers(self, version) -> list:
        """Rejoining workers that report ``version`` (``/model_info``'s ``weight_version``; the
        rollout manager has loaded and verified them) become live and are added to the routers
        again. Sets :attr:`expected_version` to ``version``. Returns the admitted workers."""
        self.set_expected_version(version)
        admitted = []
        for w in self.fleet.rejoining():
            try:
                reported = self.dialect.weight_version(self.transport, w)
            except EngineError as e:
                note(f"rollout: rejoining worker {w} not admitted: {e}")
                continue
            if str(reported) != str(version):
                note(
                    f"rollout: rejoining worker {w} reports weight_version {reported!r}, not {str(version)!r}: "
                    "not admitted"
                )
                continue
            if self.fleet.admit(w):
                self._router_add(w)
                admitted.append(w)
                note(f"rollout: worker {w} holds weight version {version} and serves again")
        return admitted

    def set_expected_version(self, version) -> None:
        """After a weight push: every live worker now holds ``version``; a ``/generate`` answer made
        with another ``meta_info.weight_version`` is discarded and sent again. ``None``: accept any
        (before the first push, servers answer with whatever version they started with)."""
        self.expected_version = None if version is None else str(version)

    def demote_worker(self, worker: str, why: str) -> bool:
        """A live worker found holding other weights than :attr:`expected_version`: it leaves the
        routers and waits (rejoining) for the next weight push. FleetError below min_live."""
        changed = self.fleet.demote(worker, why)
        if changed:
            note(f"rollout: worker {worker} {why}; it gets the weights again at the next push")
            self._router_remove(worker)
        return changed

    def audit_versions(self) -> list:
        """Every live worker must report :attr:`expected_version` (``/model_info``); one that reports
        another is demoted (rejoining, out of the routers), and workers the routers list that this
        client does not know join as rejoining. A worker that cannot be asked is left to the
        watchdog. Returns the demoted workers."""
        if self.expected_version is None:
            return []
        demoted = []
        for w in self.fleet.live():
            try:
                reported = self.dialect.weight_version(self.transport, w)
            except EngineError:
                continue
            if reported is not None and str(reported) != self.expected_version:
                why = f"reports weight_version {reported!r}, expected {self.expected_version!r}"
                if self.demote_worker(w, why):
                    demoted.append(w)
        self._refresh_from_routers()
        return demoted

    def fleet_metrics(self) -> dict:
        """``rollout/live_workers`` (now) and, since the previous call (the rollout manager calls it
        once per step), ``rollout/worker_failures``, ``rollout/worker_rejoins``,
        ``rollout/resent_requests`` and ``rollout/stale_responses``."""
        totals = self.fleet.metrics()
        with self._membership_lock:
            out = {k: v - self._reported.get(k, 0) if k != "rollout/live_workers" else v for k, v in totals.items()}
            self._reported = totals
        return out

    # -- the routers' lists ----------------------------------------------------------------------------
    def _router_remove(self, worker: str, routers=None) -> bool:
        """``DELETE /workers/{id}`` of ``worker`` on each router, then wait until it is no longer
        listed (at most ``ROUTER_SETTLE_S``). Best effort: a failure is noted, not raised."""
        ok = True
        for u in self.routers() if routers is None else routers:
            try:
                for entry in self._router_list(u) or []:
                    if entry["url"].rstrip("/") == worker and entry.get("id"):
                        self.transport.request("DELETE", f"/workers/{entry['id']}", url=u, expect_json=False)
                ok &= self._router_settle(u, worker, listed=False)
            except EngineError as e:
                note(f"rollout: could not remove {worker} from the router {u}: {e}")
                ok = False
        return ok

    def _router_add(self, worker: str) -> bool:
        """``POST /workers`` of ``worker`` on each router, then wait until it is listed healthy (at
        most ``ROUTER_SETTLE_S``). Best effort: a failure is noted, not raised."""
        ok = True
        body = {"url": worker}
        if self.transport.api_key:
            body["api_key"] = self.transport.api_key  # what the router sends the worker (its --api-key)
        for u in self.routers():
            try:
                if not any(e["url"].rstrip("/") == worker for e in self._router_list(u) or []):
                    self.transport.request("POST", "/workers", body, url=u, expect_json=False)
                ok &= self._router_settle(u, worker, listed=True)
            except EngineError as e:
                note(f"rollout: could not add {worker} to the router {u}: {e}")
                ok = False
        return ok

    def _router_settle(self, router: str, worker: str, listed: bool) -> bool:
        deadline = time.monotonic() + min(ROUTER_SETTLE_S, max(self.transport.timeout, 1.0))
        while True:
            entries = [e for e in self._router_list(router) or [] if e["url"].rstrip("/") == worker]
            if (bool(entries) and all(e.get("is_healthy", True) for e in entries)) if listed else not entries:
                return True
            if time.monotonic() > deadline:
                note(
                    f"rollout: the router {router} still {'lacks' if listed else 'lists'} {worker} after "
                    f"{ROUTER_SETTLE_S:g} s"
                )
                return False
            time.sleep(0.05)


__all__ = ["FleetError", "Membership"]
