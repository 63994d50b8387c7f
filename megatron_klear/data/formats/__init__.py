"""Readers for the data as published: the verl/Klear RL layout, LiveCodeBench releases, and math
benchmarks (AIME/HMMT/MATH-style, NeMo-Skills, the authors' inference JSONL); JSONL or parquet.

Each turns rows into problems in the project's own layout (data/prompts.py: ``{"id", "task",
"messages", "answer" | "tests"}``). :func:`read_problems` reads one file in a given format or the
one :func:`detect` finds; every bad row goes to the :class:`~megatron_klear.data.jsonl.BadLinePolicy`
as ``file:row: reason: column C: detail`` (fail, or skip and count) and :class:`ReadSummary` says
what was read: rows, problems per task, tests per problem, skipped rows by reason, the window.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from megatron_klear.data.jsonl import BadLineError, BadLinePolicy, ExampleError

from . import livecodebench, math_sets, verl
from .rows import RowError, columns, iter_rows

FORMATS = ("project", "verl", "livecodebench", "math")


def detect(path: str) -> str:
    """The format of a file from its columns; ValueError naming them when none fits."""
    cols = set(columns(path))
    low = {c.lower() for c in cols}
    if {"data_source", "reward_model"} <= cols:
        return "verl"
    if {"question_content", "public_test_cases"} <= cols:
        return "livecodebench"
    if {"prompt", "task", "tests"} & cols:
        return "project"
    if (low & {"problem", "question", "messages"}) and (low & {"expected_answer", "answer", "solution", "meta"}):
        return "math"
    if not path.endswith(".parquet"):
        return "project"  # the project's JSONL: its own reader names what is wrong with each line
    raise ValueError(f"{path}: cannot tell its format from its columns {sorted(cols)}; give one of {FORMATS}")


@dataclass
class ReadSummary:
    path: str
    format: str
    rows: int = 0
    problems: int = 0
    tasks: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)
    outside_window: int = 0
    window: tuple = (None, None)
    tests_per_problem: list = field(default_factory=list)
    test_kinds: Counter = field(default_factory=Counter)
    problem_rows: list = field(default_factory=list)  # the row of each problem
    stats: dict = field(
        default_factory=lambda: {
            "data_sources": Counter(),
            "question_columns": Counter(),
            "answer_columns": Counter(),
            "platforms": Counter(),
            "dates": [],
            "with_starter_code": 0,
        }
    )

    def as_dict(self) -> dict:
        t = self.tests_per_problem
        out = {
            "file": self.path,
            "format": self.format,
            "rows": self.rows,
            "problems": self.problems,
            "tasks": dict(self.tasks),
            "skipped_rows": dict(self.skipped),
        }
        if self.window != (None, None):
            out["window"] = {"since": self.window[0], "until": self.window[1], "outside": self.outside_window}
        if t:
            out["tests_per_problem"] = {"min": min(t), "mean": round(sum(t) / len(t), 2), "max": max(t)}
            out["test_kinds"] = dict(self.test_kinds)
        s = self.stats
        for key in ("data_sources", "question_columns", "answer_columns", "platforms"):
            if s[key]:
                out[key] = dict(s[key])
        if s["dates"]:
            out["contest_dates"] = [min(s["dates"]), max(s["dates"])]
            out["with_starter_code"] = s["with_starter_code"]
        return out

    def line(self) -> str:
        d = self.as_dict()
        parts = [
            f"{self.path}: format={self.format}",
            f"{self.rows} rows",
            f"{self.problems} problems {dict(self.tasks)}",
        ]
        if "tests_per_problem" in d:
            tp = d["tests_per_problem"]
            parts.append(f"tests/problem min {tp['min']} mean {tp['mean']} max {tp['max']} {d['test_kinds']}")
        if "window" in d:
            parts.append(f"window {self.window[0]}..{self.window[1]} ({self.outside_window} rows outside)")
        if "contest_dates" in d:
            parts.append(f"contest dates {d['contest_dates'][0]}..{d['contest_dates'][1]}")
        if "data_sources" in d:
            parts.append(f"data_source {d['data_sources']}")
        if "answer_columns" in d:
            parts.append(f"answers from {d['answer_columns']}")
        parts.append(f"bad rows {sum(self.skipped.values())}" + (f" {dict(self.skipped)}" if self.skipped else ""))
        return "; ".join(parts)


def _validate(problem: dict) -> None:
    if problem["task"] != "code":
        return
    from megatron_klear.rewards.code import BadTests, parse_tests

    try:
        parse_tests(problem["tests"])
    except BadTests as e:
        raise RowError("bad_tests", "tests", str(e)) from None


def read_problems(
    path: str,
    fmt: str = "auto",
    *,
    policy: BadLinePolicy | None = None,
    since: str | None = None,
    until: str | None = None,
    math_template: str = math_sets.DEFAULT_TEMPLATE,
) -> tuple[list, ReadSummary]:
    """``(problems, summary)`` of one file. ``since``/``until``: LiveCodeBench's date window."""
    policy = policy or BadLinePolicy(on_bad_line="fail")
    if fmt == "auto":
        fmt = detect(path)
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: expected one of auto, {', '.join(FORMATS)}")
    if (since or until) and fmt != "livecodebench":
        raise ValueError(f"since/until select LiveCodeBench contest dates; {path} is read as {fmt}")
    lo = livecodebench.parse_date(since, "since") if since else None
    hi = livecodebench.parse_date(until, "until") if until else None
    summary = ReadSummary(path=path, format=fmt, window=(since, until))
    problems = []
    for row_no, row in iter_rows(path):
        summary.rows += 1
        try:
            if isinstance(row, ExampleError):
                raise row
            if fmt == "verl":
                problem = verl.convert(row, row_no, stats=summary.stats)
            elif fmt == "livecodebench":
                problem = livecodebench.convert(row, row_no, since=lo, until=hi, stats=summary.stats)
            elif fmt == "math":
                problem = math_sets.convert(row, row_no, template=math_template, stats=summary.stats)
            else:
                problem = row
            if problem is None:
                summary.outside_window += 1
                continue
            if fmt != "project":
                _validate(problem)
        except ExampleError as e:
            err = BadLineError.from_example_error(path, row_no, e)
            summary.skipped[e.reason] += 1
            policy.handle(err)
            continue
        problems.append(problem)
        summary.problem_rows.append(row_no)
        summary.problems += 1
        summary.tasks[problem.get("task", "math")] += 1
        if problem.get("task") == "code" and isinstance(problem.get("tests"), dict):
            tests = problem["tests"]
            summary.tests_per_problem.append(len(tests.get("inputs") or []))
            summary.test_kinds[tests.get("kind") or ("call" if tests.get("fn_name") else "stdio")] += 1
    return problems, summary
