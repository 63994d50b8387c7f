"""The parts of a model response the graders look at, shared by math and code.

Klear-Reasoner grades only the text after the *last* `</think>` (the answer section), and scores
the think format first: a response without `</think>` (usually truncated) gets `no_think_close`,
one without `<think>` gets `no_think_open`, in that order (as in the authors' reward code).
"""

from __future__ import annotations

from .config import RewardConfig

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

__all__ = ["THINK_OPEN", "THINK_CLOSE", "answer_section", "think_format_score"]


def answer_section(response: str) -> str | None:
    """Text after the last `</think>`, or None when the response has no `</think>`."""
    i = response.rfind(THINK_CLOSE)
    if i < 0:
        return None
    return response[i + len(THINK_CLOSE) :]


def think_format_score(response: str, cfg: RewardConfig) -> tuple[float, str] | None:
    """(score, reason) when the think format is broken, else None."""
    if THINK_CLOSE not in response:
        return cfg.no_think_close, f"missing {THINK_CLOSE}"
    if cfg.require_think_open and THINK_OPEN not in response[: response.rfind(THINK_CLOSE)]:
        return cfg.no_think_open, f"missing {THINK_OPEN}"
    return None
