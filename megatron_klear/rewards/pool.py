"""A pool of grading worker processes with futures, for the RL loop to grade while it generates.

    with GradingPool(cfg.reward) as pool:
        futures = [pool.submit(item) for item in items]      # returns at once
        ...                                                   # keep generating
        rewards = [f.result().reward for f in futures]
    # or, inside asyncio:  result = await pool.grade(item)

Why processes and not threads: math-verify's timeouts use signal.alarm (main thread only), sympy
can hang in C where no signal reaches it, and a hostile answer can exhaust memory. Each worker
grades one item at a time; this process keeps a hard deadline per item and, when it passes or the
worker dies, kills the worker, records the outcome *with its reason* (a GradeResult with `error`
set, never a silent 0), cleans up after the worker's sandbox, and starts a replacement.

Sizing: one worker per core by default (`RewardConfig.workers`). Code tests are subprocesses that
spend most of their time in the program, so the worker count is the number of programs running.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import itertools
import logging
import multiprocessing as mp
import os
import shutil
import signal
import threading
import time
import weakref
from concurrent.futures import Future
from multiprocessing.connection import wait as mp_wait

from .config import RewardConfig
from .items import GradeItem, failure_reward, parse_item
from .result import GradeResult

__all__ = ["GradingPool"]

log = logging.getLogger(__name__)
# forkserver_preload first: the forkserver (and through it every worker) dies with this process
_PRELOAD = [
    "megatron_klear.rewards.forkserver_preload",
    "megatron_klear.rewards.worker",
    "megatron_klear.rewards.math",
    "math_verify",
]


class _Worker:
    def __init__(self, ctx, slot: int, cfg: RewardConfig):
        from .worker import worker_main

        self.slot = slot
        parent, child = ctx.Pipe(duplex=True)
        self.conn = parent
        self.proc = ctx.Process(target=worker_main, args=(child, slot, cfg), daemon=True, name=f"klear-grader-{slot}")
        self.proc.start()
        child.close()
        self.task = None  # (task_id, future, item_dict, deadline, attempt)

    def kill(self) -> None:
        try:
            os.kill(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, TypeError):
            pass
        self.proc.join(5)
        self.conn.close()


def _signal_name(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _close_at_exit(ref) -> None:
    pool = ref()
    if pool is not None and not pool._closed:
        pool.close(cancel_pending=True)  # (bounded: the items being graded have hard deadlines)


class GradingPool:
    """Grade items in `workers` processes. Thread-safe submit(); results as futures.

    config: RewardConfig (scores, limits, sandbox). workers: overrides config.workers
    (0/None: one per CPU core).
    """

    def __init__(self, config: RewardConfig | None = None, workers: int | None = None):
        from .processes import SlotLease

        self.cfg = config or RewardConfig()
        n = workers or self.cfg.workers or os.cpu_count() or 1
        self.n_workers = n
        self._ctx = mp.get_context("forkserver")
        try:
            self._ctx.set_forkserver_preload(_PRELOAD)
        except Exception:  # noqa: BLE001 -- preload is an optimisation only
            pass
        self._leases = [SlotLease(self.cfg.sandbox.max_slots) for _ in range(n)]
        self._lock = threading.Lock()
        self._pending: collections.deque = collections.deque()
        self._ids = itertools.count()
        self._closing = False
        self._closed = False
        self._level: str | None = None
        self._isolation = None
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)
        self._workers = [_Worker(self._ctx, lease.slot, self.cfg) for lease in self._leases]
        self.stats = collections.Counter()
        self._thread = threading.Thread(target=self._dispatch, name="klear-grading-pool", daemon=True)
        self._thread.start()
        # A process that exits without close() (an error raised past the pool's owner): the
        # interpreter's exit would join the workers, and they ignore the SIGTERM multiprocessing
        # sends first (forkserver_preload.py: Slurm's job-wide SIGTERM must not take them), so the
        # process would hang instead of exiting with its error. Registered after multiprocessing's
        # own exit hook, this one runs before it and closes the pool.
        atexit.register(_close_at_exit, weakref.ref(self))

    # ------------------------------------------------------------------ public API

    @property
    def isolation(self):
        """The sandbox's IsolationReport (None until the first code item)."""
        return self._isolation

    def submit(self, item: GradeItem | dict) -> Future:
        """Queue one item; returns a Future of GradeResult.

        A malformed item is not raised: its future resolves to a GradeResult with `error` set.
        Raises SandboxUnavailable for the first code item when no acceptable sandbox exists.
        """
        raw = item.__dict__.copy() if isinstance(item, GradeItem) else item
        if isinstance(raw, dict) and raw.get("task") == "code" and self._level is None:
            self.prepare_sandbox()
        fut: Future = Future()
        with self._lock:
            if self._closing:
                raise RuntimeError("GradingPool is closed")
            self._pending.append((next(self._ids), fut, raw, 0))
        self._wake()
        return fut

    async def grade(self, item: GradeItem | dict) -> GradeResult:
        """asyncio-friendly: `await pool.grade(item)` without blocking the event loop."""
        return await asyncio.wrap_future(self.submit(item))

    def grade_many(self, items) -> list[GradeResult]:
        """Grade a batch, results in input order."""
        futs = [self.submit(it) for it in items]
        return [f.result() for f in futs]

    def close(self, cancel_pending: bool = False) -> None:
        """Finish queued work (or cancel it), stop the workers, release the sandbox slots."""
        with self._lock:
            if self._closed:
                return
            self._closed = self._closing = True
            if cancel_pending:
                while self._pending:
                    self._pending.popleft()[1].cancel()
        self._wake()
        self._thread.join()
        for w in self._workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in self._workers:
            w.proc.join(2)
            if w.proc.is_alive():
                w.kill()
            self._cleanup_slot(w.slot)
        for lease in self._leases:
            lease.release()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(cancel_pending=exc[0] is not None)

    # ------------------------------------------------------------------ internals

    def prepare_sandbox(self):
        """Probe the sandbox now (at start-up, to fail early and loudly) instead of at the first
        code item; returns the IsolationReport. Raises SandboxUnavailable."""
        from .isolation_probe import resolve_isolation

        rep = resolve_isolation(self.cfg.sandbox)
        self._isolation, self._level = rep, rep.level
        return rep

    def _wake(self) -> None:
        try:
            self._wake_w.send_bytes(b"w")
        except OSError:
            pass

    def _hard_deadline(self, raw) -> float:
        c = self.cfg
        if isinstance(raw, dict) and raw.get("task") == "code":
            n = c.code_max_tests or len((raw.get("tests") or {}).get("inputs") or [1])
            per_test = c.sandbox.wall_s + 1.0
            return min(n * per_test, c.code_sample_budget_s + per_test) + 10.0
        return c.math_timeout_s + 2.0

    def _cleanup_slot(self, slot: int) -> None:
        """After a worker was killed: kill what its sandbox left running, remove its files."""
        from .processes import _base_dir, kill_uid

        if os.getuid() == 0:
            kill_uid(self.cfg.sandbox.base_uid + slot)
        runs = os.path.join(_base_dir(), "runs")
        for name in os.listdir(runs):
            if name.startswith(f"{slot}-"):
                shutil.rmtree(os.path.join(runs, name), ignore_errors=True)

    def _finish(self, w: _Worker, res: GradeResult) -> None:
        fut = w.task[1]
        w.task = None
        self.stats["done"] += 1
        if res.error:
            self.stats["errors"] += 1
        if not fut.done():
            fut.set_result(res)

    def _replace(self, w: _Worker, reason: str, retry: bool = False) -> None:
        """Kill `w` (if alive) and start a new worker on its slot; then retry its task (crashes,
        up to `crash_retries` times) or fail it with `reason`."""
        w.kill()
        self._cleanup_slot(w.slot)
        self._workers[self._workers.index(w)] = _Worker(self._ctx, w.slot, self.cfg)
        if w.task is None:
            return
        task_id, fut, raw, _, attempt = w.task
        self.stats["killed"] += 1
        if retry and attempt < self.cfg.crash_retries:
            w.task = None
            self.stats["retried"] += 1
            with self._lock:
                self._pending.appendleft((task_id, fut, raw, attempt + 1))
            return
        task = raw.get("task") if isinstance(raw, dict) else "math"
        if attempt:
            reason += f" (after {attempt} retr{'y' if attempt == 1 else 'ies'} on a fresh worker)"
        self._finish(w, GradeResult.failure(failure_reward(task, self.cfg), reason))

    def _dispatch(self) -> None:
        try:
            self._dispatch_loop()
        except Exception:  # never leave futures hanging silently
            log.exception("grading pool dispatcher crashed")
            with self._lock:
                self._closing = True  # further submits raise
                pending = list(self._pending)
                self._pending.clear()
            for w in self._workers:
                if w.task is not None and not w.task[1].done():
                    w.task[1].set_exception(RuntimeError("grading pool dispatcher crashed"))
            for _, fut, _, _ in pending:
                if not fut.done():
                    fut.set_exception(RuntimeError("grading pool dispatcher crashed"))

    def _dispatch_loop(self) -> None:
        while True:
            # hand out work: each idle worker takes the next valid pending item
            for w in self._workers:
                while w.task is None:
                    with self._lock:
                        nxt = None
                        while self._pending:
                            cand = self._pending.popleft()
                            if cand[3] > 0 or cand[1].set_running_or_notify_cancel():
                                nxt = cand
                                break
                    if nxt is None:
                        break
                    task_id, fut, raw, attempt = nxt
                    try:
                        parse_item(raw)
                    except Exception as e:  # noqa: BLE001 -- resolved here; the worker stays free for the next
                        task = raw.get("task") if isinstance(raw, dict) else "math"
                        fut.set_result(GradeResult.failure(failure_reward(task, self.cfg), f"bad item: {e}"))
                        self.stats["done"] += 1
                        self.stats["errors"] += 1
                        continue
                    w.task = (task_id, fut, raw, time.monotonic() + self._hard_deadline(raw), attempt)
                    try:
                        w.conn.send((task_id, raw, self._level))
                    except OSError:
                        self._replace(
                            w,
                            f"grader crashed: worker {_signal_name(w.proc.exitcode)} before the item was sent",
                            retry=True,
                        )
                        break
            busy = [w for w in self._workers if w.task is not None]
            with self._lock:
                if self._closing and not busy and not self._pending:
                    return
                if self._pending and len(busy) < len(self._workers):
                    continue  # a requeued item and a fresh worker: hand out again first
            now = time.monotonic()
            timeout = min((w.task[3] for w in busy), default=now + 3600) - now
            waitables = [self._wake_r] + [w.conn for w in busy] + [w.proc.sentinel for w in self._workers]
            ready = mp_wait(waitables, timeout=max(0.0, timeout))
            if self._wake_r in ready:
                while self._wake_r.poll():
                    self._wake_r.recv_bytes()
            for w in list(self._workers):
                if w.task is not None and w.conn in ready:
                    try:
                        task_id, res = w.conn.recv()
                    except (EOFError, OSError):
                        w.proc.join(1)
                        self._replace(
                            w,
                            f"grader crashed: worker {_signal_name(w.proc.exitcode)} while grading this item",
                            retry=True,
                        )
                        continue
                    if task_id == w.task[0]:
                        self._finish(w, res)
                elif w.proc.sentinel in ready and not w.proc.is_alive():
                    self._replace(
                        w, f"grader crashed: worker {_signal_name(w.proc.exitcode)} while grading this item", retry=True
                    )
            now = time.monotonic()
            for w in list(self._workers):
                if w.task is not None and now > w.task[3]:
                    self._replace(
                        w,
                        f"timeout: no verdict within the hard deadline of "
                        f"{self._hard_deadline(w.task[2]):g} s; worker killed",
                    )
