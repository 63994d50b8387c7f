"""tools/grade.py and tools/filter_rl_data.py: JSONL in, JSONL out, bad lines by number."""

import json
import math
import os
import subprocess
import sys

import pytest

from megatron_klear.rewards import isolation_probe
from megatron_klear.rewards.cli import grade_main
from megatron_klear.rewards.config import RewardConfig
from megatron_klear.rewards.filters import FilterConfig, filter_file, filter_main, pass_at_k, pass_drop_reason

from .conftest import T, code_response

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write_lines(path, lines):
    with open(path, "w") as f:
        for ln in lines:
            f.write((ln if isinstance(ln, str) else json.dumps(ln)) + "\n")
    return str(path)


def _read_jsonl(path):
    with open(path) as f:
        return [json.loads(ln) for ln in f]


GRADE_LINES = [
    {"id": "m1", "task": "math", "response": T + r"\boxed{42}", "answer": "42"},
    {"id": "m2", "task": "math", "response": T + r"\boxed{41}", "answer": "42"},
    "this is not json",
    "",
    {
        "id": "c1",
        "task": "code",
        "response": code_response("print(int(input()) * 2)"),
        "tests": {"inputs": ["1\n", "2\n", "3\n", "4\n"], "outputs": ["2", "4", "7", "8"]},
    },
    {"id": "m3", "task": "math", "response": T + r"\boxed{1}"},
    [1, 2],
    {"id": "x", "task": "poetry", "response": "roses"},
]


def test_grade_cli_end_to_end(tmp_path, capfd):
    inp = _write_lines(tmp_path / "in.jsonl", GRADE_LINES)
    out = str(tmp_path / "out.jsonl")
    rc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "grade.py"), "--input", inp, "--output", out, "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert rc.returncode == 2, rc.stderr  # malformed lines: graded the rest, but not a success (a user error)
    assert rc.stderr.strip().splitlines()[-1] == (
        f"error: 4 malformed input line(s) in {inp} (more than --max-bad-lines 0); "
        "their records have reward null and the reason in 'error'"
    )
    recs = _read_jsonl(out)
    assert [r["id"] for r in recs] == ["m1", "m2", None, "c1", "m3", None, "x"]  # one per non-blank line
    by_id = {r["id"]: r for r in recs if r["id"]}
    assert (by_id["m1"]["reward"], by_id["m1"]["passed"], by_id["m1"]["error"]) == (1.0, 1, None)
    assert by_id["m2"]["reward"] == -1.0
    assert (by_id["c1"]["reward"], by_id["c1"]["passed"], by_id["c1"]["total"]) == (0.75, 3, 4)
    assert by_id["m3"]["error"] == f"{inp}:6: field 'answer' must be a string or a non-empty list of strings, got None"
    assert recs[2]["error"].startswith(f"{inp}:3: invalid JSON")
    assert recs[5]["error"] == f"{inp}:7: expected a JSON object, got list"
    assert by_id["x"]["error"].startswith(f"{inp}:8: field 'task'")
    for r in recs:
        assert set(r) >= {"id", "reward", "passed", "total", "error"}
    # malformed lines get no score at all, never one that looks like a wrong answer
    assert [r["reward"] for r in recs] == [1.0, -1.0, None, 0.75, None, None, None]
    assert f"{inp}:3" in rc.stderr and f"{inp}:7" in rc.stderr and "items/s" in rc.stderr
    manifest = json.load(open(out + ".manifest.json"))
    assert manifest["summary"]["bad_lines"] == 4 and manifest["summary"]["items"] == 7
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_grade_cli_exit_status_and_max_bad_lines(tmp_path, capsys):
    """Every line malformed used to exit 0; --max-bad-lines sets how many are tolerated."""
    all_bad = _write_lines(tmp_path / "bad.jsonl", ["not json", {"id": 1, "task": "math"}])
    out = str(tmp_path / "out.jsonl")
    assert grade_main(["--input", all_bad, "--output", out, "--workers", "1"]) == 2
    assert [r["reward"] for r in _read_jsonl(out)] == [None, None]
    assert "error: 2 malformed input line(s)" in capsys.readouterr().err
    some_bad = _write_lines(tmp_path / "some.jsonl", GRADE_LINES[:3])
    assert grade_main(["--input", some_bad, "--output", out, "--workers", "1", "--max-bad-lines", "1"]) == 0
    assert [r["reward"] for r in _read_jsonl(out)] == [1.0, -1.0, None]
    good = _write_lines(tmp_path / "ok.jsonl", GRADE_LINES[:2])
    assert grade_main(["--input", good, "--output", out, "--workers", "1"]) == 0


def test_grade_cli_refuses_without_a_sandbox_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(isolation_probe, "_resolved", {})
    monkeypatch.setattr(isolation_probe, "bwrap_path", lambda: None)
    inp = _write_lines(tmp_path / "in.jsonl", GRADE_LINES[:1] + GRADE_LINES[4:5])
    out = tmp_path / "out.jsonl"
    assert grade_main(["--input", inp, "--output", str(out), "--workers", "1", "--isolation", "bwrap"]) == 2
    assert "bubblewrap (bwrap) is not installed" in capsys.readouterr().err
    assert not out.exists() and os.listdir(tmp_path) == ["in.jsonl"]


# --------------------------------------------------------------------------- filters


@pytest.mark.parametrize("n,c,k", [(16, 4, 1), (16, 8, 1), (16, 1, 4), (10, 3, 5), (16, 0, 16), (5, 5, 2)])
def test_pass_at_k_matches_the_combinatorial_formula(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_drop_reason_threshold_is_inclusive():
    f = FilterConfig(code_k=1)
    assert pass_drop_reason("math", [True] * 8 + [False] * 8, f) is None
    assert pass_drop_reason("code", [True] * 6 + [False] * 10, f) == "reference pass@1 0.375 < 0.5 (6/16 passed)"
    assert pass_drop_reason("code", [], f) == "no reference results"


def test_filter_defaults_are_the_documented_rule(tmp_path, capsys):
    """Code: pass@16 of the references >= 0.5; math: most references pass (pass rate >= 0.5).
    The defaults used to be a pass rate (k=1) for code too."""
    f = FilterConfig()
    assert (f.min_tests, f.code_k, f.code_min_pass, f.math_k, f.math_min_pass) == (16, 16, 0.5, 1, 0.5)
    assert pass_drop_reason("code", [True] + [False] * 15, f) is None  # pass@16 = 1
    assert pass_drop_reason("code", [False] * 16, f) == "reference pass@16 0.000 < 0.5 (0/16 passed)"
    assert pass_drop_reason("code", [True] + [False] * 31, f) is None  # pass@16 = 16/32
    assert pass_drop_reason("code", [True] * 4 + [False] * 4, f) == "only 8 reference results, fewer than k=16"
    assert pass_drop_reason("math", [True] * 8 + [False] * 8, f) is None
    assert pass_drop_reason("math", [True] * 6 + [False] * 10, f) == "reference pass@1 0.375 < 0.5 (6/16 passed)"
    # the tool's defaults are the same rule
    lines = [
        _code_problem("rare-but-solvable", 16, reference_passed=[True] + [False] * 15),
        _code_problem("never-solved", 16, reference_passed=[False] * 16),
        {"id": "math-most", "task": "math", "answer": "7", "reference_passed": [True] * 9 + [False] * 7},
        {"id": "math-few", "task": "math", "answer": "7", "reference_passed": [True] * 2 + [False] * 14},
    ]
    inp = _write_lines(tmp_path / "p.jsonl", lines)
    out, dropped = str(tmp_path / "kept.jsonl"), str(tmp_path / "dropped.jsonl")
    assert filter_main(["--input", inp, "--output", out, "--dropped", dropped]) == 0
    assert [json.loads(x)["id"] for x in open(out).read().splitlines()] == ["rare-but-solvable", "math-most"]
    assert {r["id"]: r["reason"] for r in _read_jsonl(dropped)} == {
        "never-solved": "reference pass@16 0.000 < 0.5 (0/16 passed)",
        "math-few": "reference pass@1 0.125 < 0.5 (2/16 passed)",
    }
    assert filter_main(["--input", inp, "--output", out, "--k", "1"]) == 0  # both pass rates
    assert [json.loads(x)["id"] for x in open(out).read().splitlines()] == ["math-most"]


def _code_problem(pid, n_tests, **refs):
    return {
        "id": pid,
        "task": "code",
        "prompt": "double it",
        "tests": {"inputs": [f"{i}\n" for i in range(n_tests)], "outputs": [str(2 * i) for i in range(n_tests)]},
        **refs,
    }


def test_filter_tool(tmp_path, capsys):
    good, wrong = "print(2 * int(input()))", "print(int(input()) + 2)"
    lines = [
        _code_problem("keep-code", 20, reference_solutions=[good, good, good, wrong]),
        _code_problem("few-tests", 10, reference_solutions=[good]),
        _code_problem("faulty-tests", 16, reference_solutions=[wrong, wrong, wrong, good]),
        {"id": "keep-math", "task": "math", "answer": "7", "reference_passed": [True, True, False, False]},
        {
            "id": "hard-math",
            "task": "math",
            "answer": "7",
            "reference_responses": [T + r"\boxed{7}", T + r"\boxed{8}", T + r"\boxed{9}", "<think>cut off"],
        },
        {"id": "no-refs", "task": "math", "answer": "7"},
        "{broken",
    ]
    inp = _write_lines(tmp_path / "p.jsonl", lines)
    out, dropped = str(tmp_path / "kept.jsonl"), str(tmp_path / "dropped.jsonl")
    s = filter_file(inp, out, dropped, FilterConfig(code_k=1), RewardConfig(workers=2))
    kept_text = open(out).read().splitlines()
    src = open(inp).read().splitlines()
    assert kept_text == [src[0], src[3]]  # verbatim
    d = {r["id"]: r for r in _read_jsonl(dropped)}
    assert d["few-tests"]["reason"] == "fewer than 16 tests (10)"
    assert d["faulty-tests"]["reason"] == "reference pass@1 0.250 < 0.5 (1/4 passed)"
    assert d["hard-math"]["reason"] == "reference pass@1 0.250 < 0.5 (1/4 passed)"
    assert d["no-refs"]["reason"].startswith("no reference results")
    assert d[None]["line"] == 7 and d[None]["reason"].startswith(f"{inp}:7: invalid JSON")
    assert s["kept"] == 2 and s["dropped"] == 5 and s["bad_lines"] == 1
    assert f"{inp}:7" in capsys.readouterr().err
    # only the structural filter
    s2 = filter_file(inp, out, None, FilterConfig(pass_filter=False), RewardConfig(workers=1))
    assert [json.loads(x)["id"] for x in open(out).read().splitlines()] == [
        "keep-code",
        "faulty-tests",
        "keep-math",
        "hard-math",
        "no-refs",
    ]
    assert s2["kept"] == 5


def test_filter_config_validation():
    with pytest.raises(ValueError, match="code_min_pass"):
        FilterConfig(code_min_pass=1.5)
    with pytest.raises(ValueError, match="larger than the number of samples"):
        pass_at_k(4, 1, 5)
