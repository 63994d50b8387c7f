"""The grading worker process: one item at a time, under a deadline and a memory limit.

Started by pool.GradingPool through multiprocessing's forkserver with this module preloaded, so
a replacement worker (after a timeout or a crash) starts in milliseconds with math-verify and
sympy already imported.

Inside, math grading runs on the main thread with an interval timer whose handler raises
`GradeTimeout`, a BaseException: math-verify and sympy catch `Exception` internally and would
swallow an ordinary exception, turning a timeout into a silent "wrong". Code in C (big-integer
arithmetic) cannot be interrupted by a signal; that is what the parent's hard deadline, which
kills the whole worker, is for.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import traceback
from contextlib import contextmanager

from .config import RewardConfig
from .items import failure_reward, grade_item, parse_item
from .result import GradeResult

__all__ = ["GradeTimeout", "deadline", "worker_main"]


class GradeTimeout(BaseException):
    """Raised from the interval timer when an item's deadline passes."""


@contextmanager
def deadline(seconds: float):
    """Raise GradeTimeout in the main thread after `seconds` (wall clock)."""

    def _fire(signum, frame):
        raise GradeTimeout()

    old = signal.signal(signal.SIGALRM, _fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# Graded once before any real item. math-verify's first gradings pay one-time costs: sympy
# submodules imported on first use and the LaTeX parser's (ANTLR) prediction caches, ~0.4 s of CPU
# against ~5 ms for the same item afterwards. Charged to a worker's first item they could exceed
# its math_timeout_s on a loaded machine: a correct answer scored as a timeout.
_WARM_UP_ITEMS = (
    (r"(x+1)^2", "x^2+2x+1"),
    (r"\frac{1}{2}", "0.5"),
    (r"\sqrt{2}\pi", r"\sqrt{2} \cdot \pi"),
    (r"(2, 1)", r"(1, 2)"),
    (r"(-\infty, 3)", r"(-\infty, 3]"),
)
_warm = False


def _warm_up() -> None:
    """Pay math-verify's one-time costs once per process image: in the forkserver (preloaded by
    ``forkserver_preload``), so that every worker forked from it starts warm; in a worker only
    when its forkserver did not (a forkserver started without our preload)."""
    global _warm
    if _warm:
        return
    _warm = True
    try:
        from .math import _configs, grade_math

        _configs()
        for answer, gold in _WARM_UP_ITEMS:
            grade_math("<think>warm-up</think>\n\\boxed{" + answer + "}", gold)
    except Exception:  # noqa: BLE001 -- a broken install surfaces on the first math item, with its message
        pass


def _limit_memory(mb: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    want = mb << 20
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    resource.setrlimit(resource.RLIMIT_AS, (want, hard))


def worker_main(conn, slot: int, cfg: RewardConfig) -> None:
    """Serve (task_id, item_dict, isolation_level) messages until None or EOF."""
    from megatron_klear.platform.process import die_with_parent

    from .processes import become_subreaper
    from .sandbox import Sandbox

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    die_with_parent()  # the forkserver we were forked from exits with the trainer: so do we
    become_subreaper()
    _limit_memory(cfg.math_memory_mb)
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)
    _warm_up()
    sandbox = None
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            if msg is None:
                return
            task_id, raw, level = msg
            task = raw.get("task") if isinstance(raw, dict) else None
            try:
                item = parse_item(raw)
                if item.task == "math":
                    with deadline(cfg.math_timeout_s):
                        res = grade_item(item, cfg)
                else:
                    if sandbox is None:
                        sandbox = Sandbox(cfg.sandbox, level=level, slot=slot)
                    res = grade_item(item, cfg, sandbox=sandbox)
            except GradeTimeout:
                res = GradeResult.failure(
                    failure_reward(task, cfg), f"timeout: grading took more than {cfg.math_timeout_s:g} s"
                )
            except MemoryError:
                res = GradeResult.failure(
                    failure_reward(task, cfg), f"memory limit: grading needed more than {cfg.math_memory_mb} MB"
                )
            except Exception as e:  # noqa: BLE001 -- a grader bug must not take the pool down, nor hide
                tb = traceback.format_exc(limit=3).strip().splitlines()
                res = GradeResult.failure(
                    failure_reward(task, cfg),
                    f"grader error: {type(e).__name__}: {e} ({tb[-2].strip() if len(tb) > 1 else ''})",
                )
            try:
                conn.send((task_id, res))
            except (BrokenPipeError, OSError):
                return
    finally:
        if sandbox is not None:
            sandbox.close()
        os._exit(0)
