"""The SFT data policy: pass rates, easy/hard selection, exact dedup, bad lines, grading path."""

from __future__ import annotations

import json

import pytest

from megatron_klear.data import jsonl as J
from megatron_klear.data.curate import (
    DROP_DUPLICATE,
    DROP_GRADING_ERROR,
    DROP_INCORRECT_EASY,
    INCONSISTENT_PROMPT,
    CurateConfig,
    curate,
    format_summary,
    grading_item,
    verdict_from_grade,
)
from megatron_klear.data.jsonl import BadLineError
from tests.data.helpers import write_jsonl


def R(pid, response, correct, prompt=None):
    return {"prompt_id": pid, "prompt": prompt or f"prompt {pid}", "response": response, "correct": correct}


ROWS = [
    R("A", "a1", True),
    R("B", "b1", True),
    R("A", "a2", True),
    R("A", "a2", True),  # exact duplicate of the line above
    R("A", "a3", False),  # A: 3/4 correct -> easy: a3 dropped
    R("B", "b2", False),
    R("B", "b3", False),
    R("B", "b4", False),  # B: 1/4 -> hard: all kept
    R("C", "c1", False),
    R("C", "c2", False),  # C: 0/2 -> hard, never solved: both kept
    R("D", "d1", False),
    R("D", "d2", True),  # D: 1/2 = threshold -> easy (hard means strictly below)
    R(7, "x", True),  # integer ids are fine: 1/1 easy
]


def _out(path):
    return [json.loads(x) for x in open(path)]


def test_policy_selection_and_counts(tmp_path):
    src = write_jsonl(tmp_path / "teacher.jsonl", ROWS)
    out = str(tmp_path / "sft.jsonl")
    s = curate(CurateConfig(inputs=[src], output=out, hard_below=0.5, report=str(tmp_path / "r.json")))
    kept = _out(out)
    assert [(r["prompt_id"], r["response"]) for r in kept] == [
        ("A", "a1"),
        ("B", "b1"),
        ("A", "a2"),
        ("B", "b2"),
        ("B", "b3"),
        ("B", "b4"),
        ("C", "c1"),
        ("C", "c2"),
        ("D", "d2"),
        (7, "x"),
    ]
    by = {(r["prompt_id"], r["response"]): r for r in kept}
    assert by[("A", "a1")]["pass_rate"] == 0.75 and by[("A", "a1")]["difficulty"] == "easy"
    assert by[("B", "b2")]["pass_rate"] == 0.25 and by[("B", "b2")]["difficulty"] == "hard"
    assert by[("B", "b2")]["correct"] is False and by[("B", "b2")]["prompt"] == "prompt B"
    assert by[("D", "d2")]["pass_rate"] == 0.5 and by[("D", "d2")]["difficulty"] == "easy"
    r = s["responses"]
    assert r["read"] == 13 and r["kept"] == 10
    assert r["dropped"] == {DROP_DUPLICATE: 1, DROP_INCORRECT_EASY: 2}
    assert r["kept_by"] == {"easy/correct": 4, "hard/correct": 1, "hard/incorrect": 5}
    assert s["prompts"] == {
        "total": 5,
        "easy": 3,
        "hard": 2,
        "hard_unsolved": 1,
        "no_graded_response": 0,
        "with_kept_responses": 5,
    }
    assert json.load(open(tmp_path / "r.json")) == s
    text = format_summary(s)
    assert "2 hard with pass rate < 0.5" in text and f"dropped ({DROP_INCORRECT_EASY}): 2" in text


def test_threshold_is_configurable(tmp_path):
    src = write_jsonl(tmp_path / "teacher.jsonl", ROWS)
    out = str(tmp_path / "sft.jsonl")
    s = curate(CurateConfig(inputs=[src], output=out, hard_below=0.8))  # now A (0.75) and D are hard
    assert s["prompts"]["hard"] == 4
    assert ("A", "a3") in {(r["prompt_id"], r["response"]) for r in _out(out)}
    s = curate(CurateConfig(inputs=[src], output=out, hard_below=0.0))  # nothing is hard
    assert all(r["correct"] for r in _out(out)) and s["prompts"]["hard"] == 0


BAD = [
    R("A", "a1", True),
    "{broken",
    {"prompt": "p", "response": "r", "correct": True},
    {"prompt_id": "A", "prompt": "prompt A", "response": "r", "correct": "yes"},
    {"prompt_id": "A", "prompt": "prompt A", "response": "r"},
    R("A", "a9", True, prompt="another prompt text"),
    R("A", "a2", False),
]


def test_bad_lines_fail_with_file_and_line(tmp_path):
    src = write_jsonl(tmp_path / "bad.jsonl", BAD)
    with pytest.raises(BadLineError, match=rf"{src}:2: {J.INVALID_JSON}"):
        curate(CurateConfig(inputs=[src], output=str(tmp_path / "o.jsonl")))
    assert not (tmp_path / "o.jsonl").exists()


def test_bad_lines_skipped_and_counted(tmp_path, capsys):
    src = write_jsonl(tmp_path / "bad.jsonl", BAD)
    out = str(tmp_path / "o.jsonl")
    s = curate(CurateConfig(inputs=[src], output=out, on_bad_line="skip"))
    assert s["responses"]["bad_lines"] == {
        J.INVALID_JSON: 1,
        J.MISSING_FIELD: 2,
        J.INVALID_FIELD: 1,
        INCONSISTENT_PROMPT: 1,
    }
    err = capsys.readouterr().err
    assert f"{src}:3: missing_field: 'prompt_id' is missing" in err
    assert f"{src}:5: missing_field: need 'correct'" in err
    assert f"{src}:6: {INCONSISTENT_PROMPT}: prompt_id 'A' has a different prompt text than at {src}:1" in err
    # A: 1 correct of 2 valid -> 0.5 -> easy: only a1 kept.
    assert [(r["response"], r["pass_rate"]) for r in _out(out)] == [("a1", 0.5)]


def test_grading_path_uses_the_adapter_and_drops_errors(tmp_path):
    rows = [
        {"prompt_id": "m", "prompt": "2+2?", "response": "4", "answer": "4"},
        {"prompt_id": "m", "prompt": "2+2?", "response": "5", "answer": "4"},
        {"prompt_id": "m", "prompt": "2+2?", "response": "??", "answer": "4"},
        {"prompt_id": "m", "prompt": "2+2?", "response": "6", "correct": False},  # flag wins
    ]
    calls = []

    def grader(records):
        calls.append([r["response"] for r in records])
        return [
            (None, "grader crashed") if r["response"] == "??" else (r["response"] == r["answer"], "ok") for r in records
        ]

    out = str(tmp_path / "o.jsonl")
    cfg = CurateConfig(inputs=[write_jsonl(tmp_path / "t.jsonl", rows)], output=out, grading_batch=2)
    s = curate(cfg, grader=grader)
    assert calls == [["4", "5"], ["??"]]  # batches of grading_batch, only records without a flag
    # pass rate over graded responses only: 1 of 3 (4 yes, 5 no, 6 no) -> hard -> 4, 5, 6 kept
    assert [(r["response"], r["pass_rate"]) for r in _out(out)] == [("4", 1 / 3), ("5", 1 / 3), ("6", 1 / 3)]
    assert s["responses"]["dropped"] == {DROP_GRADING_ERROR: 1}
    assert s["first_grading_errors"] == [f"{tmp_path / 't.jsonl'}:3: grader crashed"]


def test_verdict_from_grade_result():
    rewards = pytest.importorskip("megatron_klear.rewards")
    G = rewards.GradeResult
    assert verdict_from_grade(G(reward=1.0, passed=1, total=1, detail="correct")) == (True, "correct")
    assert verdict_from_grade(G(reward=0.5, passed=8, total=16, detail="8/16")) == (False, "8/16")  # not all tests
    assert verdict_from_grade(G(reward=1.0, passed=16, total=16, detail="16/16")) == (True, "16/16")
    assert verdict_from_grade(G.failure(0.0, "sandbox failed")) == (None, "sandbox failed")
    assert grading_item(3, {"response": "r", "answer": "4"}) == {
        "id": 3,
        "task": "math",
        "response": "r",
        "answer": "4",
    }
    assert grading_item(0, {"response": "r", "tests": {"inputs": []}})["task"] == "code"


def test_math_answers_graded_by_project_grading_pool(tmp_path):
    pytest.importorskip("megatron_klear.rewards.pool")
    # No <think> opener (templates that put it in the prompt): not penalised in curation.
    think = "Let me compute.\n</think>\n\n"
    rows = [
        {"prompt_id": 1, "prompt": "6*7?", "response": think + "The answer is \\boxed{42}.", "answer": "42"},
        {"prompt_id": 1, "prompt": "6*7?", "response": think + "The answer is \\boxed{41}.", "answer": "42"},
        {"prompt_id": 1, "prompt": "6*7?", "response": think + "So \\boxed{\\frac{84}{2}}.", "answer": "42"},
    ]
    out = str(tmp_path / "o.jsonl")
    s = curate(CurateConfig(inputs=[write_jsonl(tmp_path / "t.jsonl", rows)], output=out, grading_workers=1))
    kept = _out(out)
    assert [r["correct"] for r in kept] == [True, True]  # 2/3 -> easy: the wrong one is dropped
    assert kept[0]["pass_rate"] == pytest.approx(2 / 3)
    assert s["responses"]["graded_by_grader"] == 3


def test_cli(tmp_path, capsys):
    from tools.curate_sft import main

    src = write_jsonl(tmp_path / "teacher.jsonl", ROWS)
    assert main(["--input", src, "--output", str(tmp_path / "o.jsonl")]) == 0
    assert "kept 10" in capsys.readouterr().out
    bad = write_jsonl(tmp_path / "bad.jsonl", BAD)
    assert main(["--input", bad, "--output", str(tmp_path / "o2.jsonl")]) == 1
    assert f"error: {bad}:2: invalid_json" in capsys.readouterr().err
