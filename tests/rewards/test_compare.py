"""Output comparison, in the trusted grader (LiveCodeBench-style lines, numeric tolerance)."""

import pytest

from megatron_klear.rewards.compare import parse_json_output, stdio_match, values_match


@pytest.mark.parametrize(
    "actual,expected,ok",
    [
        ("3\n", "3", True),
        ("  3  \r\n\n", "3\n", True),  # surrounding whitespace and CRLF
        ("1 2\n3 4\n", "1 2\n3 4", True),
        ("1  2\n", "1 2", True),  # tokens, not exact spacing
        ("1 2 3\n", "1 2", False),
        ("1\n2\n", "1 2", False),  # line structure matters
        ("\n\n", "", True),
        ("", "0", False),
        ("0.3333333\n", "0.333333333", True),  # relative difference 3e-7 <= 1e-6
        ("0.33\n", "0.333333333", False),
        ("0.50", "0.5", True),  # equal decimals
        ("1e-7", "0", False),  # no absolute tolerance: small numbers differ
        ("1e-9", "2e-9", False),
        ("0.0000001", "0.0000002", False),
        ("1.0000001e-9", "1e-9", True),  # relative 1e-7
        ("-0.0", "0", True),
        ("1000000.5", "1000000.0", True),  # relative tolerance 1e-6 of 1e6
        ("1000001.5", "1000000.0", False),
        ("1000000000000000001", "1000000000000000000", False),  # integers exactly, no float rounding
        ("007", "7", True),
        ("-0", "0", True),
        ("nan", "nan", True),  # identical text
        ("nan", "1.0", False),
        ("inf", "1e309", False),
        ("YES", "yes", False),  # case matters, as in LiveCodeBench
        ("a 1.0000001", "a 1", True),
        ("b 1", "a 1", False),
    ],
)
def test_stdio_match(actual, expected, ok):
    assert stdio_match(actual, expected) is ok


def test_stdio_tolerance_is_configurable():
    assert stdio_match("0.5001", "0.5", tol=1e-3)
    assert not stdio_match("0.5001", "0.5", tol=1e-6)


def test_huge_integer_tokens_compare_exactly():
    a = "9" * 5000
    assert stdio_match(a, a) and not stdio_match(a, "9" * 4999 + "8")


@pytest.mark.parametrize(
    "actual,expected,ok",
    [
        ([1, 2, 3], [1, 2, 3], True),
        ([1, 2, 3], [1, 2], False),
        ([1, 2], [2, 1], False),
        (1.0000001, 1, True),
        (1e-9, 2e-9, False),  # no absolute tolerance
        (1e-7, 0, False),
        (1e-7, 0.0, False),
        (0.0, 0, True),
        (1.0000001e-30, 1e-30, True),
        (2, 2.0, True),
        (10**18 + 1, 10**18, False),
        (True, 1, False),  # JSON true is not 1
        (None, 0, False),
        ("1", 1, False),
        ({"a": [1.0, "x"]}, {"a": [1.0000000001, "x"]}, True),
        ({"a": 1}, {"b": 1}, False),
        ([[1, 2], [3]], [[1, 2], [3]], True),
        (float("nan"), float("nan"), False),
        (float("inf"), float("inf"), True),
    ],
)
def test_values_match(actual, expected, ok):
    assert values_match(actual, expected) is ok


def test_parse_json_output_rejects_non_json_and_oversize():
    assert parse_json_output(b'[1, "a", null]') == [1, "a", None]
    with pytest.raises(ValueError):
        parse_json_output(b"<object at 0x1>")
    with pytest.raises(ValueError):
        parse_json_output(b"1" * 100, limit=10)
