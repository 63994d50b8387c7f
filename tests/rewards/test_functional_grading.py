"""Tests read from the published layouts grade honest solutions right: every code row of the verl
fixture (each data_source family), and a check-code test whose expected value is bound to a name."""

import pytest

from megatron_klear.data.formats import read_problems
from megatron_klear.rewards.code import grade_code
from megatron_klear.rewards.sandbox import Sandbox

from ..data.format_fixtures import verl_rows, write
from .conftest import code_response

ADD_STDIN = "import sys\nfor line in sys.stdin:\n    a, b = map(int, line.split())\n    print(a + b)"
ADD_FN = "def add(a, b):\n    return a + b"
MIN_OPS = (
    "class Solution:\n    def minOperations(self, nums, k):\n        seen = set()\n"
    "        for i in range(len(nums) - 1, -1, -1):\n            if nums[i] <= k:\n"
    "                seen.add(nums[i])\n            if len(seen) == k:\n                return len(nums) - i\n"
)
HONEST = {
    "coder1_longcot": ADD_STDIN,
    "coder1": MIN_OPS,
    "taco": ADD_STDIN,
    "apps_longcot": ADD_FN,
    "codeforces": ADD_STDIN,
    "livecodebench": ADD_FN,
    "primeintellect": ADD_STDIN,
    "leetcode": MIN_OPS,
    "kodcode_longcot": ADD_FN,
    "humanevalplus": ADD_FN,
}
WRONG = {
    "coder1_longcot": "print(0)",
    "coder1": "class Solution:\n    def minOperations(self, nums, k):\n        return 0",
    "leetcode": "class Solution:\n    def minOperations(self, nums, k):\n        return k",
    "kodcode_longcot": "def add(a, b):\n    return a - b",
    "humanevalplus": "def add(a, b):\n    return a * b",
    "livecodebench": "def add(a, b):\n    return a * b",
    "apps_longcot": "def add(a, b):\n    return 0",
    "taco": "print(0)",
    "codeforces": "print(3)",
    "primeintellect": "print(7)",
}


@pytest.fixture(scope="module")
def code_problems(tmp_path_factory):
    path = write(tmp_path_factory.mktemp("verl") / "rl.parquet", verl_rows())
    problems, _ = read_problems(path)
    return {p["data_source"]: p for p in problems if p["task"] == "code"}


def test_honest_solutions_pass_every_test_and_wrong_ones_fail(code_problems, reward_cfg, level):
    assert sorted(code_problems) == sorted(HONEST)
    with Sandbox(reward_cfg.sandbox, level=level) as sb:
        for ds, p in code_problems.items():
            good = grade_code(code_response(HONEST[ds]), p["tests"], reward_cfg, sandbox=sb)
            assert good.reward == 1.0 and good.passed == good.total == len(p["tests"]["inputs"]), (ds, good)
            bad = grade_code(code_response(WRONG[ds]), p["tests"], reward_cfg, sandbox=sb)
            assert bad.reward < 1.0 and bad.passed < bad.total, (ds, bad)
