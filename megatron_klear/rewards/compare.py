"""Trusted comparison of a program's output with the expected output.

Runs in the grader, never in the sandbox: the program only ever hands over bytes, which are
parsed here with the standard library, so nothing the program defines (an object whose `==` is
always true, a patched `json`) takes part in the verdict.

stdin/stdout tests follow LiveCodeBench: both outputs are stripped, split into lines, each line
stripped; lines must match one to one. A line that differs as text still matches when it has the
same whitespace-separated tokens, numbers compared by value: integers exactly (so that 10^18+1
never equals 10^18 through float rounding), decimals exactly as decimals (``0.50`` = ``0.5``,
LiveCodeBench's own rule), else within a *relative* tolerance ``tol`` (1e-6: 0.3333333 matches
0.333333333). There is no absolute tolerance: it would make every small number equal (1e-9 and
2e-9, or 1e-7 and 0).
"""

from __future__ import annotations

import decimal
import json
import math
import re

__all__ = ["stdio_match", "values_match", "parse_json_output"]

_INT = re.compile(r"[+-]?\d+")
_NUM = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def _canonical_int(s: str) -> str:
    """'+007' -> '7', '-0' -> '0': exact integer comparison without int() (which refuses
    more than 4300 digits by default)."""
    neg = s.startswith("-")
    digits = s.lstrip("+-").lstrip("0") or "0"
    return "-" + digits if neg and digits != "0" else digits


def _tokens_match(a: str, b: str, tol: float) -> bool:
    if a == b:
        return True
    if _INT.fullmatch(a) and _INT.fullmatch(b):
        return _canonical_int(a) == _canonical_int(b)
    if _NUM.fullmatch(a) and _NUM.fullmatch(b):
        try:
            if decimal.Decimal(a) == decimal.Decimal(b):
                return True
        except (decimal.InvalidOperation, ValueError):  # pragma: no cover - _NUM matched
            pass
        return _close(float(a), float(b), tol)
    return False


def _close(x: float, y: float, tol: float) -> bool:
    """Relative closeness only (no absolute floor); infinities and NaN never match here."""
    if not (math.isfinite(x) and math.isfinite(y)):
        return False
    return abs(x - y) <= tol * max(abs(x), abs(y))


def _lines(text: str) -> list[str]:
    text = text.replace("\r\n", "\n").replace("\r", "\n").strip()
    return [ln.strip() for ln in text.split("\n")] if text else []


def stdio_match(actual: str, expected: str, tol: float = 1e-6) -> bool:
    """Does a program's stdout match the expected stdout (LiveCodeBench-style)?"""
    got, want = _lines(actual), _lines(expected)
    if len(got) != len(want):
        return False
    for g, w in zip(got, want):
        if g == w:
            continue
        gt, wt = g.split(), w.split()
        if len(gt) != len(wt) or not all(_tokens_match(x, y, tol) for x, y in zip(gt, wt)):
            return False
    return True


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def values_match(actual, expected, tol: float = 1e-6) -> bool:
    """Deep comparison of JSON values: exact for ints, strings, bools and None (True is not 1);
    floats equal or within the relative tolerance `tol` (no absolute one); lists element-wise;
    dicts key-wise."""
    if _number(actual) and _number(expected):
        if isinstance(actual, int) and isinstance(expected, int):
            return actual == expected
        x, y = float(actual), float(expected)
        if math.isnan(x) or math.isnan(y):
            return False
        if math.isinf(x) or math.isinf(y):
            return x == y
        return x == y or _close(x, y, tol)
    if type(actual) is not type(expected):
        return False
    if isinstance(actual, list):
        return len(actual) == len(expected) and all(values_match(a, e, tol) for a, e in zip(actual, expected))
    if isinstance(actual, dict):
        return actual.keys() == expected.keys() and all(values_match(actual[k], expected[k], tol) for k in actual)
    return actual == expected  # str, bool, None


def parse_json_output(data: bytes, limit: int = 64 << 20):
    """Parse the result a function-call test printed; raises ValueError when it is not JSON."""
    if len(data) > limit:
        raise ValueError(f"result larger than {limit} bytes")
    return json.loads(data.decode("utf-8", errors="strict"))
