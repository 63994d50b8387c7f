"""The published layouts (verl, LiveCodeBench, math sets) read from small fixtures in JSONL and
parquet: every problem, answer and test; bad rows named with file, row and column; a malicious
pickle refused without running."""

import base64
import io
import json
import os
import pickle
import zlib

import pytest

from megatron_klear.data.formats import detect, read_problems
from megatron_klear.data.formats.livecodebench import SYSTEM_MESSAGE, WITH_STARTER, WITHOUT_STARTER
from megatron_klear.data.formats.safe_pickle import UnsafePickle, loads_str
from megatron_klear.data.jsonl import BadLineError, BadLinePolicy
from megatron_klear.data.prompts import PromptDataset

from .format_fixtures import LEETCODE_CHECK, lcb_rows, math_rows, verl_rows, write

EXTS = ("jsonl", "parquet")
LEETCODE_TESTS = {
    "kind": "expr",
    "inputs": [
        "candidate = Solution().minOperations\ncandidate(nums=[3, 1, 5, 4, 2], k=2)",
        "candidate = Solution().minOperations\ncandidate(nums=[3, 1, 5, 4, 2], k=5)",
    ],
    "outputs": [4, 5],
}
VERL_EXPECTED = {
    "math_longcot_math_verify-0": ("math", "204"),
    "aime2024-1": ("math", "73"),
    "coder1_longcot-2": ("code", {"inputs": ["1 2\n", "5 6\n"], "outputs": ["3\n", "11\n"]}),
    "coder1-3": ("code", LEETCODE_TESTS),
    "taco-4": ("code", {"inputs": ["1 2\n"], "outputs": ["3\n"]}),
    "apps_longcot-5": ("code", {"inputs": [[1, 2]], "outputs": [[3]], "fn_name": "add"}),
    "codeforces-6": ("code", {"inputs": ["1 2\n", "2 2\n"], "outputs": ["3", "4"]}),
    "livecodebench-7": ("code", {"inputs": ["1\n2"], "outputs": ["3"], "fn_name": "add"}),
    "primeintellect-8": ("code", {"inputs": ["4 4\n"], "outputs": ["8\n"]}),
    "leetcode-9": ("code", LEETCODE_TESTS),
    "kodcode_longcot-10": (
        "code",
        {
            "kind": "expr",
            "inputs": ["from solution import add\nadd(1, 2)", "from solution import add\nadd(1, -2)"],
            "outputs": [3, -1],
        },
    ),
    "humanevalplus-11": ("code", {"inputs": [[1, 2], [10, 20], [0, 0]], "outputs": [3, 30, 0], "fn_name": "add"}),
}


@pytest.mark.parametrize("ext", EXTS)
def test_verl_rows_of_every_data_source_family(tmp_path, ext):
    path = write(tmp_path / f"rl.{ext}", verl_rows())
    assert detect(path) == "verl"
    problems, summary = read_problems(path)
    got = {p["id"]: (p["task"], p.get("answer") if p["task"] == "math" else p["tests"]) for p in problems}
    assert got == VERL_EXPECTED
    assert all(
        p["messages"] == [{"role": "user", "content": f"problem {i} ({p['data_source']})"}]
        for i, p in enumerate(problems)
    )
    d = summary.as_dict()
    assert d["rows"] == 12 and d["problems"] == 12 and d["tasks"] == {"math": 2, "code": 10}
    assert d["tests_per_problem"] == {"min": 1, "mean": 1.7, "max": 3} and d["skipped_rows"] == {}
    assert d["test_kinds"] == {"stdio": 4, "expr": 3, "call": 3}
    assert "format=verl" in summary.line() and "bad rows 0" in summary.line()


def test_verl_unknown_data_source_is_an_error_naming_it(tmp_path):
    rows = verl_rows()[:2] + [dict(verl_rows()[2], data_source="my_private_set")]
    path = write(tmp_path / "rl.jsonl", rows)
    with pytest.raises(BadLineError, match=r"rl\.jsonl:3: unknown_data_source: column data_source: .*'my_private_set'"):
        read_problems(path)
    policy = BadLinePolicy(on_bad_line="skip", stream=None)
    problems, summary = read_problems(path, policy=policy)
    assert len(problems) == 2 and summary.skipped == {"unknown_data_source": 1} and policy.total == 1


@pytest.mark.parametrize("ext", EXTS)
def test_bad_rows_are_named_counted_and_never_dropped_silently(tmp_path, ext):
    good = verl_rows()
    bad_prompt = dict(good[0], prompt=[{"role": "assistant", "content": "no question"}])
    bad_check = dict(
        good[9],
        reward_model={
            "style": "rule",
            "ground_truth": json.dumps(
                {"functional": "def test_x():\n    with pytest.raises(ValueError):\n        f(1)\n"}
            ),
        },
    )
    bad_answer = dict(good[1], reward_model={"style": "rule", "ground_truth": ""})
    path = write(tmp_path / f"rl.{ext}", [good[0], bad_prompt, bad_check, bad_answer, good[2]])
    seen = []
    policy = BadLinePolicy(on_bad_line="skip", stream=None)
    policy.report = type("R", (), {"write": lambda self, line: seen.append(json.loads(line))})()
    problems, summary = read_problems(path, policy=policy)
    assert [p["id"] for p in problems] == ["math_longcot_math_verify-0", "coder1_longcot-2"]
    assert summary.rows == 5 and summary.skipped == {"bad_messages": 1, "unsupported_tests": 1, "bad_answer": 1}
    assert [(r["file"], r["line"], r["reason"]) for r in seen] == [
        (path, 2, "bad_messages"),
        (path, 3, "unsupported_tests"),
        (path, 4, "bad_answer"),
    ]
    assert seen[0]["detail"].startswith("column prompt:")
    assert "column reward_model.ground_truth.functional:" in seen[1]["detail"] and "line 2: a With" in seen[1]["detail"]
    assert seen[2]["detail"].startswith("column reward_model.ground_truth:")
    with pytest.raises(BadLineError, match=rf"rl\.{ext}:2: bad_messages: column prompt"):
        read_problems(path)


@pytest.mark.parametrize("ext", EXTS)
def test_livecodebench_rows_windows_prompts_and_every_test(tmp_path, ext):
    path = write(tmp_path / f"lcb.{ext}", lcb_rows())
    assert detect(path) == "livecodebench"
    problems, summary = read_problems(path, since="2024-08-01", until="2025-05-01")
    assert [p["id"] for p in problems] == ["abc1_a", "3044"] and summary.outside_window == 1
    stdin, fn = problems
    assert stdin["tests"] == {"inputs": ["1 2\n", "2 3\n", "10 20\n"], "outputs": ["3\n", "5\n", "30\n"]}
    assert fn["tests"] == {
        "inputs": ["[3,1,5,4,2]\n2", "[3,1,5,4,2]\n5"],
        "outputs": ["4", "5"],
        "fn_name": "minOperations",
    }
    assert stdin["messages"][0] == {"role": "system", "content": SYSTEM_MESSAGE}
    user = stdin["messages"][1]["content"]
    assert user.startswith("### Question:\nAdd two numbers.\n\n") and WITHOUT_STARTER in user
    assert "```python\n# YOUR CODE HERE\n```" in user
    user = fn["messages"][1]["content"]
    assert (
        WITH_STARTER in user and "class Solution:\n    def minOperations(self" in user and WITHOUT_STARTER not in user
    )
    d = summary.as_dict()
    assert d["window"] == {"since": "2024-08-01", "until": "2025-05-01", "outside": 1}
    assert d["contest_dates"] == ["2024-09-01", "2025-03-01"] and d["with_starter_code"] == 1
    assert d["tests_per_problem"] == {"min": 2, "mean": 2.5, "max": 3}
    # the paper's windows: v5 holds the September problem, v6 the March one
    v5, _ = read_problems(path, since="2024-08-01", until="2025-02-01")
    v6, _ = read_problems(path, since="2025-02-01", until="2025-05-01")
    assert [p["id"] for p in v5] == ["abc1_a"] and [p["id"] for p in v6] == ["3044"]
    everything, s = read_problems(path)
    assert len(everything) == 3 and s.outside_window == 0


def test_livecodebench_functional_tests_need_func_name(tmp_path):
    rows = lcb_rows()
    rows[1]["metadata"] = "{}"
    path = write(tmp_path / "lcb.jsonl", rows)
    with pytest.raises(BadLineError, match=r"lcb\.jsonl:2: missing_field: column metadata\.func_name"):
        read_problems(path)


class _Evil:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


class _EvilOpen:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


@pytest.mark.parametrize("evil", [_Evil, _EvilOpen])
def test_a_malicious_pickle_is_refused_naming_the_row_and_never_runs(tmp_path, evil):
    target = tmp_path / "pwned"
    blob = base64.b64encode(zlib.compress(pickle.dumps(evil(str(target))))).decode()
    assert not target.exists()
    rows = lcb_rows()
    rows[1]["private_test_cases"] = blob
    path = write(tmp_path / "lcb.jsonl", rows)
    with pytest.raises(
        BadLineError,
        match=r"lcb\.jsonl:2: unsafe_pickle: column private_test_cases: refused: "
        r"opcode \w+ at byte \d+",
    ):
        read_problems(path)
    policy = BadLinePolicy(on_bad_line="skip", stream=None)
    problems, summary = read_problems(path, policy=policy)
    assert [p["id"] for p in problems] == ["abc1_a", "old1"] and summary.skipped == {"unsafe_pickle": 1}
    assert not target.exists()
    # the control: the standard unpickler would have run it
    pickle.loads(zlib.decompress(base64.b64decode(blob)))
    assert target.exists()


@pytest.mark.parametrize("value", [["a"], {"a": 1}, 3, b"bytes", None])
def test_the_unpickler_accepts_nothing_but_a_string(value):
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert loads_str(pickle.dumps("plain [json] " * 3, protocol=protocol)) == "plain [json] " * 3
    with pytest.raises(UnsafePickle):
        loads_str(pickle.dumps(value))
    with pytest.raises(UnsafePickle, match="not a readable pickle"):
        loads_str(b"\x80\x04garbage")


@pytest.mark.parametrize("ext", EXTS)
@pytest.mark.parametrize(
    "name,want,col",
    [
        ("aime", [("2024-I-1", "204"), ("2024-I-2", "25")], "answer"),
        ("nemo", [("n1", "2"), ("n2", "5")], "expected_answer"),
        ("math", [("1", "\\frac{1}{2}")], "solution"),
    ],
)
def test_math_sets(tmp_path, ext, name, want, col):
    path = write(tmp_path / f"{name}.{ext}", math_rows()[name])
    assert detect(path) == "math"
    problems, summary = read_problems(path)
    assert [(p["id"], p["answer"]) for p in problems] == want and all(p["task"] == "math" for p in problems)
    assert summary.as_dict()["answer_columns"] == {col: len(want)}
    first = math_rows()[name][0]
    question = first.get("problem") or first.get("Problem")
    assert problems[0]["messages"][0]["content"].startswith(question)
    assert problems[0]["messages"][0]["content"].endswith("within \\boxed{}.")


@pytest.mark.parametrize("ext", EXTS)
def test_the_authors_inference_jsonl_is_read_as_math(tmp_path, ext):
    path = write(tmp_path / f"aime24.qs.{ext}", math_rows()["klear"])
    problems, summary = read_problems(path)
    assert [(p["id"], p["answer"]) for p in problems] == [("2024-II-1", "73"), ("0", "103")]
    assert problems[0]["messages"] == [{"role": "user", "content": "Among the 900 residents ..."}]  # as given
    assert summary.as_dict()["answer_columns"] == {"meta.answer": 1, "answer": 1}


def test_math_rows_without_an_answer_are_named(tmp_path):
    path = write(tmp_path / "m.jsonl", [{"problem": "x"}, {"problem": "y", "solution": "a long worked solution " * 5}])
    policy = BadLinePolicy(on_bad_line="skip", stream=None)
    with pytest.raises(ValueError, match="no usable"):  # nothing usable: an error, not an empty set
        PromptDataset([path], _Tok(), on_bad_line="skip", stream=io.StringIO(), format="math")
    problems, summary = read_problems(path, "math", policy=policy)
    assert problems == [] and summary.skipped == {"missing_field": 1, "bad_answer": 1}


class _Tok:
    def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=True):
        return "".join(m["content"] for m in msgs)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode())}


@pytest.mark.parametrize("ext", EXTS)
def test_prompt_dataset_reads_a_verl_file_and_logs_what_it_read(tmp_path, tokenizer, ext):
    path = write(tmp_path / f"rl.{ext}", verl_rows())
    log = io.StringIO()
    ds = PromptDataset([path], tokenizer, stream=log)
    assert len(ds) == 12 and {p.task for p in ds.prompts} == {"math", "code"}
    assert "prompt data (detected format)" in log.getvalue() and "format=verl; 12 rows" in log.getvalue()
    by_id = {p.id: p for p in ds.prompts}
    assert by_id["leetcode-9"].grade_item("r")["tests"] == LEETCODE_TESTS
    assert by_id["aime2024-1"].grade_item("r")["answer"] == "73"
    given = PromptDataset([path], tokenizer, stream=io.StringIO(), format="verl")
    assert [p.id for p in given.prompts] == [p.id for p in ds.prompts]
    with pytest.raises(BadLineError, match="unknown_data_source|bad_messages|missing_field|bad_tests"):
        PromptDataset([path], tokenizer, stream=io.StringIO(), format="livecodebench")


def test_prompt_dataset_livecodebench_window(tmp_path, tokenizer):
    path = write(tmp_path / "lcb.parquet", lcb_rows())
    ds = PromptDataset([path], tokenizer, stream=io.StringIO(), since="2025-02-01", until="2025-05-01")
    assert [p.id for p in ds.prompts] == ["3044"] and ds.prompts[0].tests["fn_name"] == "minOperations"


def test_detect_refuses_an_unknown_parquet_naming_its_columns(tmp_path):
    path = write(tmp_path / "x.parquet", [{"foo": 1, "bar": "b"}])
    with pytest.raises(ValueError, match=r"cannot tell its format from its columns \['bar', 'foo'\]"):
        detect(path)


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    import builtins

    path = write(tmp_path / "rl.parquet", verl_rows()[:1])
    real = builtins.__import__

    def no_pyarrow(name, *a, **k):
        if name.startswith("pyarrow"):
            raise ImportError("no pyarrow")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[data\]'"):
        read_problems(path)


def test_rl_prompts_format_is_validated():
    from megatron_klear.config import ConfigError
    from megatron_klear.rl.config import RLConfig

    RLConfig(prompts_format="verl").validate()
    with pytest.raises(ConfigError, match="rl.prompts_format='parquet'"):
        RLConfig(prompts_format="parquet").validate()


def test_leetcode_check_code_becomes_call_expected_pairs():
    from megatron_klear.data.formats.functional import NotConvertible, convert

    assert convert(LEETCODE_CHECK) == LEETCODE_TESTS
    # an expected value bound to a name stays with the grader: it is not in what the sandbox gets
    t = convert(
        "from solution import f\ndef test_a():\n    data = [1, 2]\n    want = 'SECRET'\n    assert f(data) == want\n"
    )
    assert t["outputs"] == ["SECRET"] and "SECRET" not in t["inputs"][0] and "data = [1, 2]" in t["inputs"][0]
    assert convert("assert not f(1)\nassert f(2) is None\nassert g(3)")["outputs"] == [False, None, True]
    for bad, line in (
        ("assert f(1) != 2", 1),
        ("def test_a():\n    for i in range(3):\n        assert f(i) == i", 2),
        ("assert f(1) == g(2)", 1),
    ):
        with pytest.raises(NotConvertible, match=f"line {line}"):
            convert(bad)


def test_prepare_data_writes_the_project_jsonl_a_summary_and_the_rejected_rows(tmp_path, tokenizer):
    from tools.prepare_data import main

    rows = verl_rows() + [dict(verl_rows()[0], data_source="ifeval")]
    src = write(tmp_path / "rl.parquet", rows)
    out = tmp_path / "out" / "rl.jsonl"
    with pytest.raises(
        BadLineError,
        match=r"rl\.parquet:13: unknown_data_source: column data_source: data_source 'ifeval' has no verifier",
    ):
        main(["--input", src, "--output", str(out)])
    assert main(["--input", src, "--output", str(out), "--on-bad-row", "skip"]) == 0
    written = [json.loads(x) for x in out.read_text().splitlines()]
    assert {
        w["id"]: (w["task"], w.get("answer") if w["task"] == "math" else w["tests"]) for w in written
    } == VERL_EXPECTED
    rejected = [json.loads(x) for x in (tmp_path / "out" / "rl.jsonl.rejected.jsonl").read_text().splitlines()]
    assert [(r["line"], r["reason"]) for r in rejected] == [(13, "unknown_data_source")]
    summary = json.load(open(tmp_path / "out" / "rl.summary.json"))
    assert (
        summary[0]["rows"] == 13
        and summary[0]["problems"] == 12
        and summary[0]["skipped_rows"] == {"unknown_data_source": 1}
    )
    # what it wrote is the project's own layout: read back as it is
    ds = PromptDataset([str(out)], tokenizer, stream=io.StringIO())
    assert sorted(p.id for p in ds.prompts) == sorted(VERL_EXPECTED)
    lcb = write(tmp_path / "lcb.jsonl", lcb_rows())
    assert main(["--input", lcb, "--window", "v5", "--output", str(tmp_path / "v5.jsonl")]) == 0
    assert [json.loads(x)["id"] for x in (tmp_path / "v5.jsonl").read_text().splitlines()] == ["abc1_a"]


def test_code_r1_functional_lists_and_primeintellect_literals(tmp_path):
    from megatron_klear.data.formats.verl import code_tests

    two = code_tests("coder1", json.dumps({"functional": ["assert f(1) == 2", "assert f(2) == 4\nassert f(3) == 6"]}))
    assert two == {"kind": "expr", "inputs": ["f(1)", "f(2)", "f(3)"], "outputs": [2, 4, 6]}
    lit = code_tests("primeintellect", json.dumps(str([{"input": "1\n", "output": "2\n", "fn_name": None}])))
    assert lit == {"inputs": ["1\n"], "outputs": ["2\n"]}
    fn = code_tests("primeintellect", json.dumps([{"input": [1], "output": [2], "fn_name": "double"}]))
    assert fn == {"inputs": [[1]], "outputs": [[2]], "fn_name": "double"}
