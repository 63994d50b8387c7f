"""Which rollout servers serve now: the membership of an SGLang engine's workers.

A worker is in one of three states:

- **live**: it holds the current weights and takes generation requests;
- **rejoining**: it answered again after it was lost (restarted at its URL, or newly listed by the
  router); it takes the control calls of the next weight push (the current weights, then the version
  and probe check) but no generation request until :meth:`Fleet.admit` makes it live;
- **lost**: it died, froze or kept failing; nothing is sent to it until it is recalled.

:class:`Fleet` only keeps that state (thread-safe: the generation's event loop, the watchdog and
the control calls' threads all report to it) and counts the events for the step's metrics; the
HTTP side (probing a lost worker, telling the router) is the engine's
(:mod:`megatron_klear.rollout.servers.transport`). Losing a worker is an event, not an error, while at
least ``min_live`` workers remain live; below that, :class:`FleetError` names every lost worker and
why it was lost.

During a weight push (:meth:`Fleet.pushing`) the rejoining workers the push includes count as about
to serve for that check: a live worker lost in a push whose only other worker rejoins in it is not
an error yet. The check is made strictly (live workers only) once the push ended, after the
rejoining workers that hold the pushed weights were admitted; a rejoining worker dropped during the
push no longer counts.
"""

from __future__ import annotations

import contextlib
import threading
import time

from megatron_klear.rollout.base import FleetError

LIVE, REJOINING, LOST = "live", "rejoining", "lost"


class Fleet:
    def __init__(self, workers=(), min_live: int = 1):
        if int(min_live) < 1:
            raise ValueError(f"rollout.min_live_workers must be >= 1, got {min_live}")
        self.min_live = int(min_live)
        self._lock = threading.RLock()
        self._state: dict = {}  # worker -> LIVE | REJOINING | LOST, in the order they became known
        self._why: dict = {}  # lost worker -> (why, time.monotonic() when lost)
        self.failures = 0  # workers lost, every event counted (a worker lost twice counts twice)
        self.rejoins = 0  # lost workers made live again
        self.resent = 0  # /generate requests sent again because their worker was lost (or answered stale)
        self.stale = 0  # /generate answers discarded: made with other weights than the expected version
        self._pushes = 0  # weight pushes under way (:meth:`pushing`)
        self.pushes_started = 0  # every push ever entered (the watchdog discards probes that overlapped one)
        for w in workers:
            self._state[w] = LIVE

    # -- reading ------------------------------------------------------------------------------------
    def known(self) -> list:
        with self._lock:
            return list(self._state)

    def _in(self, *states) -> list:
        with self._lock:
            return [w for w, s in self._state.items() if s in states]

    def live(self) -> list:
        """Workers that take generation requests."""
        return self._in(LIVE)

    def serving(self) -> list:
        """Workers that take control calls (weights, versions, probes): live and rejoining."""
        return self._in(LIVE, REJOINING)

    def rejoining(self) -> list:
        return self._in(REJOINING)

    def lost(self) -> dict:
        """``{worker: why it was lost}``."""
        with self._lock:
            return {w: self._why.get(w, ("", 0.0))[0] for w, s in self._state.items() if s == LOST}

    def state(self, worker: str) -> str | None:
        with self._lock:
            return self._state.get(worker)

    # -- changes ------------------------------------------------------------------------------------
    def add(self, worker: str, state: str = LIVE) -> bool:
        """A worker that was not known (a router listing a new one): ``REJOINING`` unless it is
        known to hold the current weights. Returns whether it was new."""
        with self._lock:
            if worker in self._state:
                return False
            self._state[worker] = state
            return True

    def lose(self, worker: str, why: str) -> bool:
        """``worker`` died, froze or kept failing: nothing more is sent to it. Returns whether this
        changed its state (it was live or rejoining). Raises :class:`FleetError` when fewer than
        ``min_live`` live workers remain."""
        with self._lock:
            if self._state.get(worker) == LOST:
                return False
            was = self._state.get(worker)
            self._state[worker] = LOST
            self._why[worker] = (why, time.monotonic())
            if was == LIVE:
                self.failures += 1
            self.check()
            return was is not None

    @contextlib.contextmanager
    def pushing(self):
        """A weight push: meanwhile :meth:`check` counts the rejoining workers as about to serve (the
        push gives them the weights, then they are admitted); on leaving without an error, the strict
        check (live workers only)."""
        with self._lock:
            self._pushes += 1
            self.pushes_started += 1
        try:
            yield self
        finally:
            with self._lock:
                self._pushes -= 1
        self.check()

    def is_pushing(self) -> bool:
        """A weight push is under way (the servers are paused: their ``/health`` blocks, then 503s)."""
        with self._lock:
            return self._pushes > 0

    def check(self) -> None:
        """Raise :class:`FleetError` unless at least ``min_live`` workers are live (during a push:
        live or rejoining, see :meth:`pushing`)."""
        with self._lock:
            live = self.live() if not self._pushes else self.serving()
            if len(live) >= self.min_live:
                return
            lost = "; ".join(f"{w}: {why}" for w, why in self.lost().items()) or "none"
            raise FleetError(
                f"rollout: {len(live)} rollout server(s) left serving, fewer than rollout.min_live_workers = "
                f"{self.min_live}. Lost: {lost}. Restart the lost servers (they rejoin at the next weight push) "
                "or lower rollout.min_live_workers"
            )

    def demote(self, worker: str, why: str) -> bool:
        """A live worker holds other weights than the current ones (it answered with another
        version): it takes no generation request until the next push has given it the weights and
        :meth:`admit` made it live again. Counted as a failure. Raises :class:`FleetError` below
        ``min_live``."""
        with self._lock:
            if self._state.get(worker) != LIVE:
                return False
            self._state[worker] = REJOINING
            self._why[worker] = (why, time.monotonic())
            self.failures += 1
            self.check()
            return True

    def count(self, resent: int = 0, stale: int = 0) -> None:
        """Count requests sent again and answers discarded as stale (the generation reports them)."""
        with self._lock:
            self.resent += int(resent)
            self.stale += int(stale)

    def recall(self, worker: str) -> bool:
        """A lost worker answers again: it takes the next push's control calls (``REJOINING``)."""
        with self._lock:
            if self._state.get(worker) != LOST:
                return False
            self._state[worker] = REJOINING
            return True

    def admit(self, worker: str) -> bool:
        """A rejoining worker holds the current weights (version and probe checked): it takes
        generation requests again. Counted as a rejoin when it had been lost or demoted (a worker
        new to the fleet joins without counting)."""
        with self._lock:
            if self._state.get(worker) != REJOINING:
                return False
            self._state[worker] = LIVE
            if self._why.pop(worker, None) is not None:
                self.rejoins += 1
            return True

    def metrics(self) -> dict:
        with self._lock:
            return {
                "rollout/live_workers": len(self.live()),
                "rollout/worker_failures": self.failures,
                "rollout/worker_rejoins": self.rejoins,
                "rollout/resent_requests": self.resent,
                "rollout/stale_responses": self.stale,
            }
