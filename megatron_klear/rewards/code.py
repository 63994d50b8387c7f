"""Code reward: run the response's program on sampled tests in the sandbox; reward = fraction passed.

Klear-Reasoner's "soft reward" (section 4): up to K=16 tests are sampled per problem and the reward
is the fraction that pass (4 of 16 -> 0.25; LiveCodeBench v5 61.0 vs 59.2 for all-or-nothing).
By default (`code_test_sampling="fixed"`) the sample depends only on the seed and the problem's
tests, so all responses of a GRPO group are graded on the same tests; "per_call" draws a fresh
sample on every grading call, as the authors' code does. With `code_think_format` the reward is
on the authors' scale: the mean of +1 per passed and -1 per failed test, with the think-format
scores (-0.5 / -2) on that scale (config.py).

The program is the last fenced python block after the last `</think>`. Three test styles:
- stdin/stdout: `inputs[i]` is fed on stdin, stdout is compared with `outputs[i]` (compare.py).
- function call (`fn_name` set): `inputs[i]` is the argument list, either a JSON list or
  LiveCodeBench's string of one JSON value per line; the function (or method of a LeetCode-style
  `class Solution`) is called and its return value compared with `outputs[i]` (a JSON value, or a
  string holding JSON; a one-element list also matches its element, as in APPS).
- expression (`"kind": "expr"`): a `functional` test's check turned into (call, expected) pairs by
  data/formats/functional.py; the call (Python source ending in an expression) runs after the
  program's code and its JSON value is compared here with the expected value, which never enters
  the sandbox: exiting early, patching `assert` or `__eq__`, or printing a verdict cannot pass.

Every test runs in a fresh sandboxed process. Verdicts come from comparing the bytes the program
handed over with the expected output, here in the grader; the expected outputs never enter the
sandbox, and neither the program's exit code nor anything it prints about itself can make it pass.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
import time
from dataclasses import dataclass

from .compare import parse_json_output, stdio_match, values_match
from .config import RewardConfig
from .harness import RESULT_MARKER
from .response import answer_section, think_format_score
from .result import GradeResult

__all__ = ["grade_code", "code_reward", "extract_code", "parse_tests", "select_tests", "CodeTests", "BadTests"]

_FENCE = re.compile(r"```[ \t]*([^\n`]*)\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = {"python", "py", "python3", "py3"}


class BadTests(ValueError):
    """The problem's tests are malformed (a data error, reported naming the field)."""


def extract_code(section: str) -> str | None:
    """The last ```python block (or, when there is none, the last untagged ``` block)."""
    tagged, untagged = None, None
    for m in _FENCE.finditer(section):
        tag = m.group(1).strip().lower()
        if tag in _PYTHON_TAGS:
            tagged = m.group(2)
        elif tag == "":
            untagged = m.group(2)
    return tagged if tagged is not None else untagged


@dataclass
class Case:
    stdin: bytes  # stdio: the input; call: the JSON list of arguments
    expected: object  # stdio: expected stdout (str); call: list of acceptable values
    size: int  # rough size of the expected output in bytes (for the output cap)


@dataclass
class CodeTests:
    cases: list[Case]
    fn_name: str | None
    key: str  # stable digest of the tests: seeds the per-problem test sample
    kind: str = "stdio"  # "stdio" | "call" (fn_name) | "expr"


def _call_args(x, where: str) -> bytes:
    if isinstance(x, str):  # LiveCodeBench: one JSON value per line
        args = []
        for j, line in enumerate(ln for ln in x.split("\n") if ln.strip()):
            try:
                args.append(json.loads(line))
            except ValueError as e:
                raise BadTests(f"{where}: line {j + 1} is not JSON ({e})") from None
        return json.dumps(args).encode()
    if isinstance(x, list):
        return json.dumps(x).encode()
    raise BadTests(f"{where}: expected a list of arguments or a string of JSON lines, got {type(x).__name__}")


def _call_expected(y) -> list:
    cands = []
    if isinstance(y, str):
        try:
            cands.append(json.loads(y))
        except ValueError:
            pass
    cands.append(y)
    if isinstance(y, list) and len(y) == 1:
        cands.append(y[0])
    return cands


def parse_tests(tests) -> CodeTests:
    """Validate {"inputs": [...], "outputs": [...], "fn_name": optional, "kind": optional};
    errors name the field. ``"kind": "expr"``: each input is Python source (setup statements, then
    one expression, e.g. ``candidate = Solution().f\ncandidate(nums=[1, 2])``) evaluated after the
    program's code; its value is compared here with the output (a JSON value)."""
    if not isinstance(tests, dict):
        raise BadTests(f"tests: expected an object with inputs/outputs, got {type(tests).__name__}")
    unknown = set(tests) - {"inputs", "outputs", "fn_name", "kind"}
    if unknown:
        raise BadTests(f"tests: unknown key(s) {sorted(unknown)}")
    kind = tests.get("kind")
    if kind not in (None, "stdio", "call", "expr"):
        raise BadTests(f"tests.kind: {kind!r} is not one of stdio, call, expr")
    inputs, outputs = tests.get("inputs"), tests.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise BadTests("tests.inputs and tests.outputs must be lists")
    if len(inputs) != len(outputs):
        raise BadTests(f"tests: {len(inputs)} inputs but {len(outputs)} outputs")
    if not inputs:
        raise BadTests("tests: no test cases")
    fn_name = tests.get("fn_name")
    if fn_name is not None and (not isinstance(fn_name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", fn_name)):
        raise BadTests(f"tests.fn_name: {fn_name!r} is not a Python identifier")
    fn_name = fn_name or None
    if kind == "expr" and fn_name:
        raise BadTests("tests: kind 'expr' takes no fn_name (the expression names what it calls)")
    if kind == "call" and not fn_name:
        raise BadTests("tests: kind 'call' needs fn_name")
    cases = []
    for i, (x, y) in enumerate(zip(inputs, outputs)):
        if kind == "expr":
            if not isinstance(x, str) or not x.strip():
                raise BadTests(f"tests.inputs[{i}]: an expression test must be a non-empty string of Python")
            try:
                tree = ast.parse(x, f"tests.inputs[{i}]")
            except SyntaxError as e:
                raise BadTests(f"tests.inputs[{i}]: not Python ({e.msg}, line {e.lineno})") from None
            if not tree.body or not isinstance(tree.body[-1], ast.Expr):
                raise BadTests(f"tests.inputs[{i}]: must end with an expression (the value to compare)")
            cases.append(Case(x.encode("utf-8"), [y], len(json.dumps(y))))
            continue
        if fn_name:
            cases.append(Case(_call_args(x, f"tests.inputs[{i}]"), _call_expected(y), len(json.dumps(y))))
            continue
        if not isinstance(x, str):
            raise BadTests(f"tests.inputs[{i}]: stdin must be a string, got {type(x).__name__}")
        if isinstance(y, list) and all(isinstance(s, str) for s in y):
            y = "\n".join(y)
        if not isinstance(y, str):
            raise BadTests(f"tests.outputs[{i}]: expected stdout must be a string, got {type(y).__name__}")
        cases.append(Case(x.encode("utf-8", "surrogatepass"), y, len(y.encode("utf-8", "replace"))))
    digest = hashlib.sha256(json.dumps([inputs, outputs, fn_name], sort_keys=True, default=str).encode()).hexdigest()
    if kind == "expr":
        digest = hashlib.sha256(json.dumps([inputs, outputs, "expr"], sort_keys=True, default=str).encode()).hexdigest()
    return CodeTests(
        cases=cases, fn_name=fn_name, key=digest, kind="expr" if kind == "expr" else "call" if fn_name else "stdio"
    )


def select_tests(n: int, k: int | None, seed: int, key: str, fresh: bool = False) -> list[int]:
    """Indices of the tests to run: all when n <= k, else a sample of k (sorted), seeded by
    ``seed`` and the problem's ``key``, or drawn afresh from the OS's entropy when ``fresh``."""
    if k is None or n <= k:
        return list(range(n))
    rng = random.Random() if fresh else random.Random(f"{seed}:{key}")
    return sorted(rng.sample(range(n), k))


def code_reward(passed: int, total: int, cfg: RewardConfig) -> float:
    """The soft reward: the pass fraction in [0, 1], or with ``code_think_format`` the authors'
    mean of +1 per passed and -1 per failed test, in [-1, 1] (the scale of the format scores)."""
    frac = passed / total if total else 0.0
    return 2.0 * frac - 1.0 if cfg.code_think_format else frac


def _judge(res, case: Case, kind: str, limits, tol: float) -> str:
    reason = res.failure_reason(limits)
    if reason is not None:
        return reason
    out = res.stdout
    if kind == "stdio":
        return "pass" if stdio_match(out.decode("utf-8", "replace"), case.expected, tol) else "wrong answer"
    i = out.rfind(RESULT_MARKER)
    if i < 0:
        return "no result (the program exited without returning)"
    try:
        value = parse_json_output(out[i + len(RESULT_MARKER) :].strip())
    except ValueError:
        return "unreadable result"
    ok = any(values_match(value, e, tol) for e in case.expected)
    return "pass" if ok else "wrong answer"


def grade_code(response: str, tests, cfg: RewardConfig | None = None, sandbox=None) -> GradeResult:
    """Grade one code response. `sandbox`: a sandbox.Sandbox (one is created when None)."""
    cfg = cfg or RewardConfig()
    fail = code_reward(0, 1, cfg)
    if not isinstance(response, str):
        return GradeResult.failure(fail, f"response must be a string, got {type(response).__name__}")
    try:
        spec = parse_tests(tests)
    except BadTests as e:
        return GradeResult.failure(fail, str(e))
    picked = select_tests(
        len(spec.cases), cfg.code_max_tests, cfg.code_seed, spec.key, fresh=cfg.code_test_sampling == "per_call"
    )
    total = len(picked)
    if cfg.code_think_format:
        fmt = think_format_score(response, cfg)
        if fmt is not None:
            return GradeResult(reward=fmt[0], passed=0, total=total, detail=fmt[1])
    section = answer_section(response)
    if section is None:
        return GradeResult(reward=fail, passed=0, total=total, detail="missing </think>: no answer section")
    code = extract_code(section)
    if code is None or not code.strip():
        return GradeResult(reward=fail, passed=0, total=total, detail="no python code block after </think>")

    own = sandbox is None
    if own:
        from .isolation_probe import resolve_isolation
        from .sandbox import Sandbox

        sandbox = Sandbox(cfg.sandbox, level=resolve_isolation(cfg.sandbox).level)
    verdicts: list[str] = []
    failures: list[str] = []
    start = time.monotonic()
    try:
        with sandbox.program(code) as prog:
            for idx in picked:
                if time.monotonic() - start > cfg.code_sample_budget_s:
                    verdicts.append(f"skipped (sample budget {cfg.code_sample_budget_s:g} s spent)")
                    continue
                case = spec.cases[idx]
                limit = max(sandbox.cfg.output_limit_bytes, 2 * case.size + (64 << 10))
                res = prog.run(case.stdin, call=spec.fn_name, output_limit=limit, expr=spec.kind == "expr")
                if not res.started:
                    failures.append(res.failure_reason(sandbox.cfg))
                verdicts.append(_judge(res, case, spec.kind, sandbox.cfg, cfg.code_float_tol))
    finally:
        if own:
            sandbox.close()
    passed = sum(v == "pass" for v in verdicts)
    detail = f"{passed}/{total} tests passed"
    first_fail = next((v for v in verdicts if v != "pass"), None)
    if first_fail:
        detail += f"; first failure: {first_fail}"
    error = None
    if failures:
        error = f"{len(failures)} of {total} runs could not start: {failures[0]}"
    return GradeResult(
        reward=code_reward(passed, total, cfg), passed=passed, total=total, error=error, detail=detail, tests=verdicts
    )
