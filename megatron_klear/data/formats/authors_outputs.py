"""The Klear authors' inference output (``benchmarks/inference.py``): one JSON line per sample,
``{"id": i, "meta": <the input line>, "messages": [...the input's messages, {"role": "assistant",
"content": response}]}`` -- the input repeated n times, ``id`` counting every sample. The problem is
read from ``meta`` by the same readers as the inputs (math: the answer columns of :mod:`.math_sets`,
as their ``judge_math.py`` reads ``meta.meta.solution``; code: a project, verl or LiveCodeBench
row); samples of the same problem are grouped by its user turn.
"""

from __future__ import annotations

from megatron_klear.data.jsonl import BadLineError, BadLinePolicy, ExampleError

from . import livecodebench, math_sets, verl
from .rows import RowError, iter_rows


def problem_of(meta: dict, row_no: int) -> dict:
    if not isinstance(meta, dict):
        raise RowError("missing_field", "meta", "expected the input line (an object)")
    if "question_content" in meta:
        p = livecodebench.convert(meta, row_no)
    elif "data_source" in meta:
        p = verl.convert(meta, row_no)
    elif meta.get("task") == "code" or "tests" in meta:
        p = {
            "id": str(meta.get("id", row_no)),
            "task": "code",
            "tests": meta.get("tests"),
            "messages": meta.get("messages") or [{"role": "user", "content": meta.get("prompt")}],
        }
    else:
        p = math_sets.convert(meta, row_no)
    if p["task"] == "code":
        from megatron_klear.rewards.code import BadTests, parse_tests

        try:
            parse_tests(p["tests"])
        except BadTests as e:
            raise RowError("bad_tests", "meta.tests", str(e)) from None
    return p


def read_samples(path: str, policy: BadLinePolicy | None = None) -> tuple[dict, list]:
    """``(problems by key, samples)``: each sample ``(key, sample_id, response)``."""
    policy = policy or BadLinePolicy(on_bad_line="fail")
    problems, samples = {}, []
    for row_no, row in iter_rows(path):
        try:
            if isinstance(row, ExampleError):
                raise row
            msgs = row.get("messages")
            if (
                not isinstance(msgs, list)
                or len(msgs) < 2
                or not isinstance(msgs[-1], dict)
                or msgs[-1].get("role") != "assistant"
                or not isinstance(msgs[-1].get("content"), str)
            ):
                raise RowError(
                    "no_response",
                    "messages",
                    "the last message must be the assistant's response"
                    + (f" (the line has an error: {row['error']})" if row.get("error") else ""),
                )
            p = problem_of(row.get("meta"), row_no)
            users = [m.get("content") for m in msgs[:-1] if isinstance(m, dict) and m.get("role") == "user"]
            key = users[-1] if users else p["id"]
        except ExampleError as e:
            policy.handle(BadLineError.from_example_error(path, row_no, e))
            continue
        problems.setdefault(key, p)
        samples.append((key, row.get("id", row_no), msgs[-1]["content"]))
    return problems, samples
