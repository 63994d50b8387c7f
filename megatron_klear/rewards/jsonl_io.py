"""JSONL in and out for the reward tools: numbered lines, a manifest (atomic output: utils/atomic.py;
progress: utils/progress.py).

Kept inside rewards/ (rather than shared with data/) because rewards/ is a leaf that must run as a
separate service without the rest of megatron_klear.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from typing import Iterator

from megatron_klear.utils.atomic import atomic_file

__all__ = ["numbered_lines", "decode_line", "write_manifest"]


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


def write_manifest(output: str, tool: str, inputs: dict, extra: dict) -> str:
    """`<output>.manifest.json`: what made the output, from what, when."""
    path = output + ".manifest.json"
    with atomic_file(path) as f:
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
