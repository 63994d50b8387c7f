"""One unit of grading work, as it arrives from the RL loop or a JSONL line, and its dispatch.

{"id": ..., "task": "math", "response": "...", "answer": "..."}
{"id": ..., "task": "code", "response": "...", "tests": {"inputs": [...], "outputs": [...],
                                                         "fn_name": optional}}
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import RewardConfig
from .result import GradeResult

__all__ = ["GradeItem", "BadItem", "parse_item", "grade_item", "failure_reward"]

TASKS = ("math", "code")


class BadItem(ValueError):
    """A malformed item; the message names the field."""


@dataclass
class GradeItem:
    id: object
    task: str
    response: str
    answer: object = None  # math: str or list of str
    tests: dict | None = None  # code


def parse_item(obj, where: str = "item") -> GradeItem:
    """Validate a decoded JSON object into a GradeItem; BadItem names `where` and the field."""
    if isinstance(obj, GradeItem):
        obj = obj.__dict__
    if not isinstance(obj, dict):
        raise BadItem(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "id" not in obj:
        raise BadItem(f"{where}: missing field 'id'")
    task = obj.get("task")
    if task not in TASKS:
        raise BadItem(f"{where}: field 'task' must be one of {TASKS}, got {task!r}")
    response = obj.get("response")
    if not isinstance(response, str):
        raise BadItem(f"{where}: field 'response' must be a string, got {type(response).__name__}")
    other = "tests" if task == "math" else "answer"
    if other in obj:  # other fields (prompt, source, ...) are carried along and ignored
        raise BadItem(f"{where}: field {other!r} does not belong to a {task} item")
    if task == "math":
        ans = obj.get("answer")
        ok = (
            isinstance(ans, (str, int, float))
            and not isinstance(ans, bool)
            or (isinstance(ans, list) and ans and all(isinstance(a, str) for a in ans))
        )
        if not ok:
            raise BadItem(f"{where}: field 'answer' must be a string or a non-empty list of strings, got {ans!r:.60}")
        return GradeItem(id=obj["id"], task=task, response=response, answer=ans)
    tests = obj.get("tests")
    if not isinstance(tests, dict):
        raise BadItem(f"{where}: field 'tests' must be an object with 'inputs' and 'outputs'")
    from .code import BadTests, parse_tests

    try:  # tests that cannot be run (0 inputs for 1 output ...) are the item's fault, not the response's
        parse_tests(tests)
    except BadTests as e:
        raise BadItem(f"{where}: {e}") from None
    return GradeItem(id=obj["id"], task=task, response=response, tests=tests)


def failure_reward(task: str, cfg: RewardConfig) -> float:
    """The reward recorded alongside an error: the 'wrong' score for math, every test failed
    for code (0, or -1 on the authors' scale with ``code_think_format``)."""
    return cfg.wrong if task == "math" else (-1.0 if cfg.code_think_format else 0.0)


def grade_item(item: GradeItem, cfg: RewardConfig, sandbox=None) -> GradeResult:
    """Grade in this process, without deadlines (the pool adds them)."""
    if item.task == "math":
        from .math import grade_math

        return grade_math(item.response, item.answer, cfg)
    from .code import grade_code

    return grade_code(item.response, item.tests, cfg, sandbox=sandbox)
