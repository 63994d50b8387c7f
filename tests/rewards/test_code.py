"""The code grader: extraction, test formats, soft reward, sampling, verdict reasons."""

import json
import uuid

import pytest

from megatron_klear.rewards import RewardConfig
from megatron_klear.rewards.code import BadTests, extract_code, grade_code, parse_tests, select_tests
from megatron_klear.rewards.sandbox import Sandbox

from .conftest import code_response, small_limits

SUM = "a, b = map(int, input().split())\nprint(a + b)"


@pytest.fixture(scope="module")
def sandbox(level):
    sb = Sandbox(small_limits(level), level=level)
    yield sb
    sb.close()


@pytest.fixture
def cfg(level):
    return RewardConfig(sandbox=small_limits(level))


def stdio_tests(pairs):
    return {"inputs": [p[0] for p in pairs], "outputs": [p[1] for p in pairs]}


# --------------------------------------------------------------------------- extraction


def test_extract_code_takes_the_last_python_block():
    text = "```python\nprint(1)\n```\nthen\n```cpp\nint main(){}\n```\n```py\nprint(2)\n```\n"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"  # untagged fallback
    assert extract_code("```python\nprint(1)\n```\n```\nprint(3)\n```") == "print(1)\n"
    assert extract_code("```cpp\nint main(){}\n```") is None
    assert extract_code("```python\nprint(1)") is None  # unclosed (truncated)


def test_code_inside_think_does_not_count(sandbox, cfg):
    resp = "<think>```python\n" + SUM + "\n```</think>\nNo code here."
    res = grade_code(resp, stdio_tests([("1 2\n", "3")]), cfg, sandbox)
    assert res.reward == 0.0 and res.detail == "no python code block after </think>"


def test_missing_think_close_gives_zero_or_the_format_score(sandbox, cfg):
    resp = "<think>```python\n" + SUM + "\n```"
    res = grade_code(resp, stdio_tests([("1 2\n", "3")]), cfg, sandbox)
    assert res.reward == 0.0 and "missing </think>" in res.detail
    fmt = RewardConfig(code_think_format=True, sandbox=cfg.sandbox)
    assert grade_code(resp, stdio_tests([("1 2\n", "3")]), fmt, sandbox).reward == -0.5
    no_open = "x</think>```python\n" + SUM + "\n```"
    assert grade_code(no_open, stdio_tests([("1 2\n", "3")]), fmt, sandbox).reward == -2.0
    assert grade_code(no_open, stdio_tests([("1 2\n", "3")]), cfg, sandbox).reward == 1.0


# --------------------------------------------------------------------------- soft reward


def test_honest_solution_scores_one(sandbox, cfg):
    res = grade_code(code_response(SUM), stdio_tests([("1 2\n", "3"), ("-4 4\n", "0"), ("10 5\n", "15")]), cfg, sandbox)
    assert (res.reward, res.passed, res.total, res.error) == (1.0, 3, 3, None) and res.solved
    assert res.tests == ["pass"] * 3


def test_partial_solution_scores_its_exact_fraction(sandbox, cfg):
    # correct only for n < 4: passes 4 of 16 tests -> 0.25 (the paper's example)
    code = "n = int(input())\nprint(n * n if n < 4 else n * n + 1)"
    tests = stdio_tests([(f"{n}\n", str(n * n)) for n in range(16)])
    res = grade_code(code_response(code), tests, cfg, sandbox)
    assert (res.passed, res.total) == (4, 16) and res.reward == 0.25 and not res.solved
    assert res.tests[:4] == ["pass"] * 4 and set(res.tests[4:]) == {"wrong answer"}


def test_crash_after_correct_output_fails(sandbox, cfg):
    code = "print(3)\nraise SystemExit(3)"
    res = grade_code(code_response(code), stdio_tests([("", "3")]), cfg, sandbox)
    assert res.reward == 0.0 and res.tests == ["runtime error (exit 3)"]


def test_runtime_error_reason_names_the_exception(sandbox, cfg):
    res = grade_code(code_response("print(1 // 0)"), stdio_tests([("", "3")]), cfg, sandbox)
    assert res.tests[0].startswith("runtime error (exit 1): ZeroDivisionError")


def test_float_output_within_tolerance(sandbox, cfg):
    res = grade_code(code_response("print(1/3)"), stdio_tests([("", "0.333333"), ("", "0.3334")]), cfg, sandbox)
    assert res.tests == ["pass", "wrong answer"]


def test_large_input_and_output_pass_through(sandbox, cfg):
    n = 200_000
    data = "\n".join(str(i) for i in range(n)) + "\n"
    want = "\n".join(str(2 * i) for i in range(n))  # > 1 MiB: the cap follows the expected size
    code = "import sys\nsys.stdout.write('\\n'.join(str(2 * int(x)) for x in sys.stdin.read().split()))"
    assert len(want) > cfg.sandbox.output_limit_bytes
    res = grade_code(code_response(code), stdio_tests([(data, want)]), cfg, sandbox)
    assert res.reward == 1.0, res


# --------------------------------------------------------------------------- function calls


def test_function_call_tests(sandbox, cfg):
    code = "def add(a, b):\n    print('debug output is ignored')\n    return a + b"
    tests = {"inputs": [[1, 2], "3\n4", [[1], [2]]], "outputs": [3, "7", [[1, 2]]], "fn_name": "add"}
    res = grade_code(code_response(code), tests, cfg, sandbox)
    assert res.tests == ["pass", "pass", "pass"], res


def test_leetcode_class_solution_with_typing_hints(sandbox, cfg):
    code = (
        "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
        "        seen = {}\n        for i, x in enumerate(nums):\n"
        "            if target - x in seen:\n                return [seen[target - x], i]\n"
        "            seen[x] = i\n"
    )
    tests = {
        "inputs": ["[2,7,11,15]\n9", "[3,2,4]\n6", "[3,3]\n6"],
        "outputs": ["[0,1]", "[1,2]", "[1,0]"],
        "fn_name": "twoSum",
    }
    res = grade_code(code_response(code), tests, cfg, sandbox)
    assert res.tests == ["pass", "pass", "wrong answer"] and res.reward == pytest.approx(2 / 3)


def test_function_returning_tuple_set_and_float(sandbox, cfg):
    code = "def f(x):\n    return (x, 0.1 + 0.2, sorted({3, 1}))"
    res = grade_code(
        code_response(code), {"inputs": [[5]], "outputs": [[5, 0.3, [1, 3]]], "fn_name": "f"}, cfg, sandbox
    )
    assert res.reward == 1.0


def test_missing_function_is_a_runtime_error(sandbox, cfg):
    res = grade_code(
        code_response("def g(x):\n    return x"), {"inputs": [[1]], "outputs": [1], "fn_name": "f"}, cfg, sandbox
    )
    assert res.reward == 0.0 and "NameError" in res.tests[0]


def test_expected_outputs_never_enter_the_sandbox(sandbox, cfg):
    secret = "EXPECTED-" + uuid.uuid4().hex
    # the spy looks everywhere it can and prints any expected output it found, else its input: a
    # leak would pass the test; what it saw is not printed whole (on a machine whose /tmp is full,
    # that would outgrow the output limit)
    spy = r"""
import os, re, sys
given = sys.stdin.read()
seen = [repr(sys.argv), repr(dict(os.environ)), given]
harness_dir = os.path.dirname(os.path.abspath(sys.modules["__main__"].__file__))
for d in (os.getcwd(), "/tmp", "/", "/sandbox", harness_dir, os.environ.get("HOME", "/")):
    try:
        for n in os.listdir(d):
            p = os.path.join(d, n)
            seen.append(p)
            if os.path.isfile(p):
                try:
                    seen.append(open(p, errors="replace").read(1 << 14))
                except OSError:
                    pass
    except OSError:
        pass
found = sorted(set(re.findall(r"EXPECTED-[0-9a-f]{32}", "\n".join(seen))))
print("\n".join(found) if found else given, end="")
"""
    res = grade_code(code_response(spy), stdio_tests([("the input\n", secret)]), cfg, sandbox)
    assert res.reward == 0.0 and res.tests == ["wrong answer"]
    # the same program, shown its own output: it did run and saw its input, but never the answer
    with sandbox.program(spy) as prog:
        out = prog.run(b"the input\n").stdout.decode()
    assert "the input" in out and "EXPECTED-" not in out


# --------------------------------------------------------------------------- sampling


def test_sampling_is_seeded_per_problem():
    assert select_tests(10, 16, 0, "k") == list(range(10))
    a = select_tests(40, 16, 0, "problem-a")
    assert len(a) == 16 and a == sorted(set(a)) and a == select_tests(40, 16, 0, "problem-a")
    assert a != select_tests(40, 16, 1, "problem-a")
    assert a != select_tests(40, 16, 0, "problem-b")
    assert select_tests(40, None, 0, "k") == list(range(40))


def test_all_responses_of_a_problem_see_the_same_tests(sandbox, cfg):
    tests = stdio_tests([(f"{n}\n", str(n)) for n in range(40)])
    echo = "print(int(input()))"
    r1 = grade_code(code_response(echo), tests, cfg, sandbox)
    assert (r1.passed, r1.total) == (16, 16)
    # a program right only on even inputs: its score is the share of even inputs in the sample
    picked = select_tests(40, 16, cfg.code_seed, parse_tests(tests).key)
    evens = sum(1 for i in picked if i % 2 == 0)
    r2 = grade_code(code_response("n = int(input())\nprint(n if n % 2 == 0 else -1)"), tests, cfg, sandbox)
    assert r2.passed == evens and r2.reward == evens / 16


def test_per_call_sampling_draws_a_fresh_sample_on_every_call(sandbox, cfg, monkeypatch):
    """code_test_sampling="per_call" (the authors): a new random sample of k tests on every
    grading call; the default "fixed" sample stays the seeded one."""
    draws = {tuple(select_tests(40, 16, 0, "p", fresh=True)) for _ in range(20)}
    assert len(draws) > 10 and all(len(d) == 16 and list(d) == sorted(set(d)) for d in draws)
    assert {tuple(select_tests(40, 16, 0, "p")) for _ in range(5)} == {tuple(select_tests(40, 16, 0, "p"))}
    assert select_tests(10, 16, 0, "p", fresh=True) == list(range(10))
    import megatron_klear.rewards.code as code_mod

    picks = []
    real = code_mod.select_tests
    monkeypatch.setattr(code_mod, "select_tests", lambda *a, **kw: picks.append(real(*a, **kw)) or picks[-1])
    tests = stdio_tests([(f"{n}\n", str(n)) for n in range(40)])
    echo = code_response("print(int(input()))")
    per_call = RewardConfig(code_test_sampling="per_call", code_max_tests=4, sandbox=cfg.sandbox)
    for _ in range(3):
        res = grade_code(echo, tests, per_call, sandbox)
        assert (res.passed, res.total) == (4, 4)
    fixed = RewardConfig(code_max_tests=4, sandbox=cfg.sandbox)
    for _ in range(2):
        grade_code(echo, tests, fixed, sandbox)
    assert len({tuple(p) for p in picks[:3]}) > 1  # all three equal: probability 1/C(40,4)^2
    assert picks[3] == picks[4] == select_tests(40, 4, 0, parse_tests(tests).key)
    with pytest.raises(ValueError, match="code_test_sampling"):
        RewardConfig(code_test_sampling="sometimes")


# --------------------------------------------------------------------------- format scores


def test_think_format_scores_share_the_soft_reward_scale(sandbox, cfg):
    """code_think_format=True: the authors' scale, mean of +1 per passed / -1 per failed test, with
    -0.5 (no </think>, usually truncated) and -2 (no <think>) on it: a truncated response ranks
    above an all-fail one and below a partial one, and so do their advantages in a group."""
    import torch

    from megatron_klear.rl.advantages import group_advantages

    fmt = RewardConfig(code_think_format=True, sandbox=cfg.sandbox)
    tests = stdio_tests([(f"{n}\n", str(2 * n)) for n in range(4)])
    responses = {
        "no_think_open": "reasoning</think>\n```python\nprint(2 * int(input()))\n```",
        "all_fail": code_response("print(-1)"),
        "truncated": "<think>still thinking about print(2 * int(input())) when the budget ran out",
        "partial": code_response("n = int(input())\nprint(2 * n if n < 3 else 0)"),  # 3 of 4
        "all_pass": code_response("print(2 * int(input()))"),
    }
    got = {k: grade_code(r, tests, fmt, sandbox) for k, r in responses.items()}
    rewards = {k: g.reward for k, g in got.items()}
    assert rewards == {"no_think_open": -2.0, "all_fail": -1.0, "truncated": -0.5, "partial": 0.5, "all_pass": 1.0}
    assert all(g.error is None for g in got.values()) and got["all_pass"].solved
    # the authors' reward for a graded program: mean of +-1 per test
    assert rewards["partial"] == (3 * 1 + 1 * -1) / 4
    order = ["no_think_open", "all_fail", "truncated", "partial", "all_pass"]
    adv = group_advantages(
        torch.tensor([rewards[k] for k in order], dtype=torch.float64), torch.zeros(len(order), dtype=torch.long)
    )
    assert all(adv[i] < adv[i + 1] for i in range(len(order) - 1)), adv
    # off (the default): the paper's pass fraction, no format score; truncated = all-fail = 0
    plain = {k: grade_code(r, tests, cfg, sandbox).reward for k, r in responses.items()}
    assert plain == {"no_think_open": 1.0, "all_fail": 0.0, "truncated": 0.0, "partial": 0.75, "all_pass": 1.0}


# --------------------------------------------------------------------------- bad tests


@pytest.mark.parametrize(
    "tests,msg",
    [
        ({"inputs": ["1"], "outputs": []}, "1 inputs but 0 outputs"),
        ({"inputs": [], "outputs": []}, "no test cases"),
        ({"inputs": [1], "outputs": ["1"]}, "tests.inputs[0]: stdin must be a string"),
        ({"inputs": ["1"], "outputs": [1]}, "tests.outputs[0]"),
        ({"inputs": ["x y"], "outputs": [1], "fn_name": "f"}, "tests.inputs[0]: line 1 is not JSON"),
        ({"inputs": ["1"], "outputs": ["1"], "fn_name": "not valid"}, "tests.fn_name"),
        ({"inputs": ["1"], "outputs": ["1"], "extra": 1}, "unknown key(s) ['extra']"),
        ("not a dict", "expected an object"),
    ],
)
def test_bad_tests_are_errors_naming_the_field(tests, msg):
    with pytest.raises(BadTests, match=None) as e:
        parse_tests(tests)
    assert msg in str(e.value)
    res = grade_code(code_response("print(1)"), tests, RewardConfig(), sandbox=object())
    assert res.error is not None and msg in res.error and res.reward == 0.0


def test_tests_accept_apps_style_output_lists():
    spec = parse_tests({"inputs": ["1\n"], "outputs": [["a", "b"]]})
    assert spec.cases[0].expected == "a\nb"
    spec = parse_tests({"inputs": [[1]], "outputs": [json.dumps([1, 2])], "fn_name": "f"})
    assert [1, 2] in spec.cases[0].expected
