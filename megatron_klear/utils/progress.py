"""Progress on stderr for long work: count, rate, ETA (and errors, where items can fail); throttled
so logs stay readable. Standard library only (the reward tools use it)."""

from __future__ import annotations

import sys
import time


def format_seconds(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class Progress:
    """``Progress(total, "what", unit="items")``; call ``step(n)`` as work is done, or ``update(done)``
    where the work is measured by a position (the bytes of a file read so far); prints at most every
    ``every`` s, and the line of the finished work (time taken, rate) once. ``count_errors``:
    ``step(error=True)`` counts a failed item, and each line says how many. ``note``: appended to
    the line."""

    def __init__(
        self, total: int, what: str, unit: str = "items", every: float = 2.0, stream=None, count_errors: bool = False
    ):
        self.total, self.what, self.unit, self.every = total, what, unit, every
        self.stream = stream or sys.stderr
        self.start = self._last = time.monotonic()
        self.done = self.errors = 0
        self.count_errors = count_errors
        self._finished = False

    def step(self, n: int = 1, note: str = "", error: bool = False) -> None:
        self.errors += int(error)
        self.update(self.done + n, note)

    def update(self, done, note: str = "") -> None:
        self.done = done
        now = time.monotonic()
        finished = self.done >= self.total * (1 - 1e-9)  # (float totals: sums of float steps)
        if self._finished or (not finished and now - self._last < self.every):
            return
        self._last, self._finished = now, finished
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        errors = f", {self.errors} errors" if self.count_errors else ""
        done, total = (f"{x:.0f}" if isinstance(x, float) else x for x in (self.done, self.total))
        head = f"{self.what}: {done}/{total} {self.unit}"
        if finished:
            line = f"{head} in {format_seconds(elapsed)} ({rate:.1f} {self.unit}/s)"
        else:
            eta = (self.total - self.done) / rate if rate > 0 else 0.0
            line = f"{head} ({rate:.1f} {self.unit}/s, ETA {format_seconds(eta)})"
        self.stream.write(line + errors + (f" {note}" if note else "") + "\n")
        self.stream.flush()
