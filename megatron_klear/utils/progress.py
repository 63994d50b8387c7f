"""Progress on stderr for long work: count, rate, ETA; throttled so logs stay readable."""

from __future__ import annotations

import sys
import time


def format_seconds(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class Progress:
    """``Progress(total, "what", unit="items")``; call ``step(n)``; prints at most every ``every`` s."""

    def __init__(self, total: int, what: str, unit: str = "items", every: float = 2.0, stream=None):
        self.total, self.what, self.unit, self.every = total, what, unit, every
        self.stream = stream or sys.stderr
        self.start = self._last = time.time()
        self.done = 0

    def step(self, n: int = 1, note: str = "") -> None:
        self.done += n
        now = time.time()
        finished = self.done >= self.total
        if not finished and now - self._last < self.every:
            return
        self._last = now
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        if finished:
            self.stream.write(f"{self.what}: {self.done}/{self.total} {self.unit} in {format_seconds(elapsed)}\n")
        else:
            eta = (self.total - self.done) / rate if rate > 0 else 0.0
            self.stream.write(
                f"{self.what}: {self.done}/{self.total} {self.unit} ({rate:.1f} {self.unit}/s, "
                f"ETA {format_seconds(eta)}) {note}\n"
            )
        self.stream.flush()
