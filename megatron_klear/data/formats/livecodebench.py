"""LiveCodeBench ``code_generation_lite`` rows -> code problems with every test.

Columns (LiveCodeBench ``lcb_runner/benchmarks/code_generation.py``): ``question_title``,
``question_content``, ``platform``, ``question_id``, ``contest_id``, ``contest_date`` (ISO),
``starter_code``, ``difficulty``, ``public_test_cases`` (JSON), ``private_test_cases`` (JSON, or
base64 of zlib of a pickle of that JSON: decoded by :mod:`.safe_pickle`, which refuses anything
but a string), ``metadata`` (JSON; ``func_name`` for function-call problems). Each test is
``{"input", "output", "testtype": "stdin"|"functional"}``; as in LiveCodeBench the tests are the
public ones then the private ones, all graded. The version windows select on ``contest_date``
like LiveCodeBench (``since <= date <= until``, dates as ``YYYY-MM-DD``).

The prompt is LiveCodeBench's generic one (``lcb_runner/prompts/code_generation.py``): its
system message, then the question with the starter code (function-call problems) or the stdin
instruction.
"""

from __future__ import annotations

import json
from datetime import datetime

from .rows import RowError
from .safe_pickle import UnsafePickle, decode_private_tests

SYSTEM_MESSAGE = (
    "You are an expert Python programmer. You will be given a question (problem specification) "
    "and will generate a correct Python program that matches the specification and passes all tests."
)
WITH_STARTER = (
    "You will use the following starter code to write the solution to the problem and enclose your code "
    "within delimiters."
)
WITHOUT_STARTER = (
    "Read the inputs from stdin solve the problem and write the answer to stdout (do not directly test "
    "on the sample inputs). Enclose your code within delimiters as follows. Ensure that when the python "
    "program runs, it reads the inputs, runs the algorithm and writes output to STDOUT."
)
#: The windows the paper reports (docs/data.md).
WINDOWS = {"v5": ("2024-08-01", "2025-02-01"), "v6": ("2025-02-01", "2025-05-01")}
#: How many problems each window holds across LiveCodeBench's release files, as the benchmark's
#: users report them (v5: 279; v6: 175): tools/eval.py prints a window's count beside it, so a
#: window read from too few release files shows.
PUBLISHED_COUNTS = {"v5": 279, "v6": 175}


def prompt(question: str, starter_code: str | None) -> str:
    text = f"### Question:\n{question}\n\n"
    if starter_code:
        text += f"### Format: {WITH_STARTER}\n```python\n{starter_code}\n```\n\n"
    else:
        text += f"### Format: {WITHOUT_STARTER}\n```python\n# YOUR CODE HERE\n```\n\n"
    return text + "### Answer: (use the provided format with backticks)\n\n"


def parse_date(text: str, what: str) -> datetime:
    try:
        return datetime.fromisoformat(text)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: {text!r} is not a date (YYYY-MM-DD)") from None


def _tests_json(row: dict, col: str) -> list:
    raw = row.get(col)
    if raw is None:
        raise RowError("missing_field", col, "missing")
    if isinstance(raw, list):
        tests = raw
    elif not isinstance(raw, str):
        raise RowError("bad_tests", col, f"expected a string, got {type(raw).__name__}")
    else:
        try:
            tests = json.loads(raw)
        except ValueError:
            if col != "private_test_cases":
                raise RowError("bad_tests", col, "not JSON") from None
            try:
                tests = json.loads(decode_private_tests(raw))
            except UnsafePickle as e:
                raise RowError("unsafe_pickle", col, f"refused: {e}") from None
            except ValueError as e:
                raise RowError("bad_tests", col, f"the decoded text is not JSON ({e})") from None
    if not isinstance(tests, list) or not all(isinstance(t, dict) for t in tests):
        raise RowError("bad_tests", col, "expected a list of test objects")
    for i, t in enumerate(tests):
        if not isinstance(t.get("input"), str) or not isinstance(t.get("output"), str):
            raise RowError("bad_tests", f"{col}[{i}]", "input and output must be strings")
        if t.get("testtype") not in ("stdin", "functional"):
            raise RowError("bad_tests", f"{col}[{i}].testtype", f"{t.get('testtype')!r} is not stdin/functional")
    return tests


def convert(row: dict, row_no: int, *, since=None, until=None, stats=None) -> dict | None:
    """The problem, or None when its contest_date is outside the window (counted by the caller)."""
    for col in ("question_content", "contest_date"):
        if not isinstance(row.get(col), str) or not row[col].strip():
            raise RowError("missing_field", col, "missing or empty")
    try:
        date = datetime.fromisoformat(row["contest_date"]).replace(tzinfo=None)  # dates compare as written
    except ValueError:
        raise RowError("bad_field", "contest_date", f"{row['contest_date']!r} is not an ISO date") from None
    if (since is not None and date < since) or (until is not None and date > until):
        return None
    meta = row.get("metadata") or "{}"
    try:
        meta = json.loads(meta) if isinstance(meta, str) else meta
    except ValueError:
        raise RowError("bad_field", "metadata", "not JSON") from None
    if not isinstance(meta, dict):
        raise RowError("bad_field", "metadata", "expected a JSON object")
    tests = _tests_json(row, "public_test_cases") + _tests_json(row, "private_test_cases")
    if not tests:
        raise RowError("bad_tests", "public_test_cases/private_test_cases", "no tests")
    kinds = {t["testtype"] for t in tests}
    if len(kinds) > 1:
        raise RowError("bad_tests", "public_test_cases/private_test_cases", "stdin and functional tests mixed")
    out = {"inputs": [t["input"] for t in tests], "outputs": [t["output"] for t in tests]}
    if kinds == {"functional"}:
        if not meta.get("func_name"):
            raise RowError("missing_field", "metadata.func_name", "functional tests need the function's name")
        out["fn_name"] = meta["func_name"]
    starter = row.get("starter_code") or None
    if stats is not None:
        stats["dates"].append(row["contest_date"][:10])
        stats["platforms"][row.get("platform") or "?"] += 1
        stats["with_starter_code"] += bool(starter)
    return {
        "id": str(row.get("question_id") or row_no),
        "task": "code",
        "messages": [
            {"role": "system", "content": SYSTEM_MESSAGE},
            {"role": "user", "content": prompt(row["question_content"], starter)},
        ],
        "tests": out,
        "meta": {
            "platform": row.get("platform"),
            "contest_date": row["contest_date"],
            "difficulty": row.get("difficulty"),
            "title": row.get("question_title"),
        },
    }
