"""Small files in each published layout (verl, LiveCodeBench code_generation_lite, math sets), as
the tests write them: JSONL or parquet. The layouts are the ones docs/data.md cites."""

from __future__ import annotations

import base64
import json
import pickle
import zlib

from megatron_klear.data.formats.rows import write_parquet

LEETCODE_CHECK = (
    "def check(candidate):\n    assert candidate(nums = [3,1,5,4,2], k = 2) == 4\n"
    "    assert candidate(nums = [3,1,5,4,2], k = 5) == 5\n\n\ncheck(Solution().minOperations)"
)
KODCODE_TESTS = (
    "from solution import add\n\ndef test_small():\n    assert add(1, 2) == 3\n\n"
    "def test_negative():\n    expected = -1\n    assert add(1, -2) == expected\n"
)
HUMANEVAL_TESTS = (
    "import math\n\ndef check(candidate):\n    inputs = [[1, 2], [10, 20], [0, 0]]\n"
    "    results = [3, 30, 0]\n    for i, (inp, exp) in enumerate(zip(inputs, results)):\n"
    "        assertion(candidate(*inp), exp, 0)\n\ncheck(add)"
)


def _msg(text):
    return [{"role": "user", "content": text}]


def verl_rows() -> list:
    """One math row and a code row of each data_source family (the ground truth as published: a
    JSON string)."""

    def row(ds, gt, i, ability="code"):
        return {
            "data_source": ds,
            "prompt": _msg(f"problem {i} ({ds})"),
            "ability": ability,
            "reward_model": {"style": "rule", "ground_truth": gt},
            "extra_info": {"split": "train", "index": i},
        }

    lcb = [{"input": "1\n2", "output": "3", "testtype": "functional", "metadata": {"func_name": "add"}}]
    return [
        row("math_longcot_math_verify", "204", 0, "math"),
        row("aime2024", "73", 1, "math"),
        row("coder1_longcot", json.dumps({"inputs": ["1 2\n", "5 6\n"], "outputs": ["3\n", "11\n"]}), 2),
        row("coder1", json.dumps({"functional": LEETCODE_CHECK}), 3),
        row("taco", json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]}), 4),
        row("apps_longcot", json.dumps({"inputs": [[1, 2]], "outputs": [[3]], "fn_name": "add"}), 5),
        row("codeforces", json.dumps([{"input": "1 2\n", "output": "3"}, {"input": "2 2\n", "output": "4"}]), 6),
        row("livecodebench", json.dumps(lcb), 7),
        row("primeintellect", json.dumps([{"input": "4 4\n", "output": "8\n"}]), 8),
        row("leetcode", json.dumps({"functional": LEETCODE_CHECK}), 9),
        row("kodcode_longcot", json.dumps(KODCODE_TESTS), 10),
        row("humanevalplus", json.dumps(HUMANEVAL_TESTS), 11),
    ]


def private_blob(tests: list) -> str:
    """LiveCodeBench's encoding: base64(zlib(pickle(json string)))."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode()


def lcb_rows() -> list:
    stdin_public = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]
    stdin_private = [
        {"input": "2 3\n", "output": "5\n", "testtype": "stdin"},
        {"input": "10 20\n", "output": "30\n", "testtype": "stdin"},
    ]
    fn_public = [{"input": "[3,1,5,4,2]\n2", "output": "4", "testtype": "functional"}]
    fn_private = [{"input": "[3,1,5,4,2]\n5", "output": "5", "testtype": "functional"}]
    base = {"platform": "atcoder", "contest_id": "abc1", "difficulty": "easy"}
    return [
        {
            **base,
            "question_title": "A+B",
            "question_content": "Add two numbers.",
            "question_id": "abc1_a",
            "contest_date": "2024-09-01T00:00:00",
            "starter_code": "",
            "public_test_cases": json.dumps(stdin_public),
            "private_test_cases": private_blob(stdin_private),
            "metadata": "{}",
        },
        {
            **base,
            "platform": "leetcode",
            "question_title": "ops",
            "question_content": "Minimum operations.",
            "question_id": "3044",
            "contest_date": "2025-03-01T00:00:00",
            "starter_code": "class Solution:\n    def minOperations(self, nums: List[int], k: int) -> int:\n        ",
            "public_test_cases": json.dumps(fn_public),
            "private_test_cases": private_blob(fn_private),
            "metadata": json.dumps({"func_name": "minOperations"}),
        },
        {
            **base,
            "question_title": "old",
            "question_content": "An old problem.",
            "question_id": "old1",
            "contest_date": "2023-05-01T00:00:00",
            "starter_code": "",
            "public_test_cases": json.dumps(stdin_public),
            "private_test_cases": json.dumps(stdin_private),
            "metadata": "{}",
        },
    ]


def math_rows() -> dict:
    """name -> rows: AIME-style (HF columns), NeMo-Skills, MATH (boxed solution), the authors' qs."""
    return {
        "aime": [
            {"ID": "2024-I-1", "Problem": "Find x.", "Solution": "long ...", "Answer": 204},
            {"ID": "2024-I-2", "Problem": "Find y.", "Solution": "long ...", "Answer": 25},
        ],
        "nemo": [
            {"problem": "What is 1+1?", "expected_answer": "2", "id": "n1"},
            {"problem": "What is 2+3?", "expected_answer": "5", "id": "n2"},
        ],
        "math": [{"problem": "Simplify 2/4.", "solution": "It is $\\boxed{\\frac{1}{2}}$."}],
        "klear": [
            {
                "messages": _msg("Among the 900 residents ..."),
                "meta": {"unique_id": "2024-II-1", "solution": "73", "answer": "73"},
            },
            {"id": 0, "messages": _msg("Compute the sum ..."), "solution": "\\boxed{103}", "answer": "103"},
        ],
    }


def write(path, rows) -> str:
    path = str(path)
    if path.endswith(".parquet"):
        write_parquet(path, rows)
    else:
        with open(path, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return path
