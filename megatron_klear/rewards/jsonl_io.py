"""JSONL in and out for the reward tools: numbered lines, atomic output, a manifest, progress.

Kept inside rewards/ (rather than shared with data/) because rewards/ is a leaf that must run as a
separate service without the rest of megatron_klear.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Iterator

__all__ = ["numbered_lines", "decode_line", "atomic_writer", "write_manifest", "Progress"]


def numbered_lines(path: str) -> Iterator[tuple[int, str | None]]:
    """(1-based line number, text) for every non-blank line; text None when not UTF-8."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield lineno, None
                continue
            if text.strip():
                yield lineno, text


def decode_line(path: str, lineno: int, text: str | None):
    """The JSON object on a line, or raise ValueError naming the file and line."""
    if text is None:
        raise ValueError(f"{path}:{lineno}: not valid UTF-8")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
    return obj


def count_lines(path: str) -> int:
    return sum(1 for _ in numbered_lines(path))


@contextmanager
def atomic_writer(path: str):
    """Write to a temporary name next to `path`, rename on success, remove on failure."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    f = open(tmp, "w", encoding="utf-8")
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, path)
    except BaseException:
        f.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_manifest(output: str, tool: str, inputs: dict, extra: dict) -> str:
    """`<output>.manifest.json`: what made the output, from what, when."""
    path = output + ".manifest.json"
    with atomic_writer(path) as f:
        json.dump(
            {
                "tool": tool,
                "output": os.path.abspath(output),
                "inputs": inputs,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                **extra,
            },
            f,
            indent=2,
            sort_keys=True,
            default=str,
        )
        f.write("\n")
    return path


class Progress:
    """`done/total items (rate items/s, ETA)` on stderr, at most every `every` seconds."""

    def __init__(self, total: int, what: str, every: float = 1.0, stream=None):
        self.total, self.what, self.every = total, what, every
        self.stream = stream or sys.stderr
        self.start = self._last = time.monotonic()
        self.done = 0
        self.errors = 0

    def step(self, error: bool = False) -> None:
        self.done += 1
        self.errors += int(error)
        now = time.monotonic()
        if self.done < self.total and now - self._last < self.every:
            return
        self._last = now
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        if self.done >= self.total:
            msg = f"{self.what}: {self.done}/{self.total} items in {elapsed:.1f} s ({rate:.1f} items/s)"
        else:
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            msg = f"{self.what}: {self.done}/{self.total} items, {rate:.1f} items/s, ETA {eta:.0f} s"
        self.stream.write(f"{msg}, {self.errors} errors\n")
        self.stream.flush()
