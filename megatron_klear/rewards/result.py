"""What a grader returns for one sample.

`error` is reserved for grades that are *not* a clean verdict: the grader timed out or crashed,
the input was malformed, the sandbox failed. A wrong answer, a missing `</think>`, or a program
that fails its tests are verdicts (error None; `detail` says what happened). The RL loop can then
drop samples with an error instead of teaching the policy from an infrastructure failure.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["GradeResult"]


@dataclass
class GradeResult:
    reward: float
    passed: int  # math: 1 if correct; code: tests passed
    total: int  # math: 1; code: tests run (after sampling)
    error: str | None = None
    detail: str = ""  # e.g. "correct", "missing </think>", "wrong answer: parsed 7"
    #: Code only: one verdict per test run, e.g. "pass", "wrong answer", "timeout (wall 6s)".
    tests: list[str] = field(default_factory=list)

    @property
    def solved(self) -> bool:
        """Full marks: the math answer is correct, or the program passed every test it ran.
        (Klear adds its NLL term on exactly these rollouts.)"""
        return self.error is None and self.total > 0 and self.passed == self.total

    def to_record(self, item_id) -> dict:
        """The JSONL output record: the item's id, then the grade."""
        d = asdict(self)
        return {"id": item_id, **d}

    @classmethod
    def failure(cls, reward: float, error: str, total: int = 1) -> "GradeResult":
        """A grade that could not be computed (timeout, crash, bad input)."""
        return cls(reward=reward, passed=0, total=total, error=error, detail=error)
