"""RL data filters from the paper (Klear-Reasoner, section 4), as a tool over JSONL problems.

- Code: drop problems with fewer than `min_tests` (16) test cases, and problems whose reference
  samples pass too rarely: the documented rule is pass@16 >= 0.5 (`code_k` = 16, `code_min_pass`
  = 0.5; a problem a strong model almost never solves usually has faulty tests). With exactly 16
  references, pass@16 is 1 when any of them passes.
- Math: drop prompts unless most reference samples pass: pass rate (`math_k` = 1) >= 0.5 ("most of
  16 pass"). Thresholds are configurable and inclusive.

    python tools/filter_rl_data.py --input problems.jsonl --output kept.jsonl --dropped dropped.jsonl

Each problem line is {"id", "task": "code", "tests": {...}, ...} or {"id", "task": "math",
"answer", ...} plus ONE source of reference results:
    "reference_passed":    [true, false, ...]        precomputed
    "reference_responses": ["<think>..</think>..."]  graded here, exactly like rollouts
    "reference_solutions": ["print(...)", ...]       code only: bare programs, graded here
or, for lines without those fields, the samples of a reference model that tools/eval.py graded
(``--references results/ref.samples.jsonl``: each sample's ``solved``, by problem id; tools/eval.py
grades code on every test, as this filter does):

    python tools/eval.py --url http://router:31000 --tokenizer /shared/ref-model --k 16 \
        --bench code=data/code_rl_raw.jsonl --output results/code-ref.json
    python tools/filter_rl_data.py --input data/code_rl_raw.jsonl --references results/code-ref.samples.jsonl \
        --output data/code_rl.jsonl --dropped data/code_rl.dropped.jsonl
A reference response passes when it earns the full score: the `correct` score for math, every
test (all of them, not a sample) for code. The pass metric is the unbiased pass@k estimator over
the n references (k=1: the plain pass rate; fewer than k references: dropped, saying so). Kept
lines are copied verbatim; dropped ones are listed with their line number and reason.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass

from megatron_klear.utils.atomic import atomic_file
from megatron_klear.utils.progress import Progress

from .config import RewardConfig
from .jsonl_io import count_lines, decode_line, numbered_lines, write_manifest

__all__ = ["FilterConfig", "pass_at_k", "structural_drop_reason", "pass_drop_reason", "filter_file", "filter_main"]

REFERENCE_FIELDS = ("reference_passed", "reference_responses", "reference_solutions")


@dataclass
class FilterConfig:
    min_tests: int = 16
    code_min_pass: float = 0.5
    math_min_pass: float = 0.5
    code_k: int = 16  # code: pass@16 of the references >= code_min_pass
    math_k: int = 1  # math: the plain pass rate >= math_min_pass
    #: False: apply only the structural filters (test counts), keep lines without references.
    pass_filter: bool = True

    def __post_init__(self):
        if self.min_tests < 0 or self.code_k < 1 or self.math_k < 1:
            raise ValueError(
                f"FilterConfig: need min_tests >= 0 and code_k, math_k >= 1 "
                f"(got {self.min_tests}, {self.code_k}, {self.math_k})"
            )
        for name in ("code_min_pass", "math_min_pass"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"FilterConfig.{name}={getattr(self, name)}: expected a fraction in [0, 1]")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021): 1 - C(n-c,k)/C(n,k)."""
    if not 0 <= c <= n or n < 1:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and n >= 1, got n={n}, c={c}")
    if k > n:
        raise ValueError(f"pass_at_k: k={k} is larger than the number of samples n={n}")
    if n - c < k:
        return 1.0
    prob_all_fail = 1.0
    for i in range(n - c + 1, n + 1):  # prod_{i} (1 - k/i)
        prob_all_fail *= 1.0 - k / i
    return 1.0 - prob_all_fail


def structural_drop_reason(obj: dict, fcfg: FilterConfig) -> str | None:
    """Why a problem is unusable regardless of references, or None."""
    task = obj.get("task")
    if task not in ("math", "code"):
        return f"field 'task' must be 'math' or 'code', got {task!r}"
    if task == "math":
        ans = obj.get("answer")
        if not (isinstance(ans, str) and ans.strip()) and not (isinstance(ans, list) and ans):
            return "math problem without an 'answer'"
        return None
    from .code import BadTests, parse_tests

    try:
        spec = parse_tests(obj.get("tests"))
    except BadTests as e:
        return f"bad tests: {e}"
    if len(spec.cases) < fcfg.min_tests:
        return f"fewer than {fcfg.min_tests} tests ({len(spec.cases)})"
    return None


def pass_drop_reason(task: str, passed: list[bool], fcfg: FilterConfig) -> str | None:
    """Why a problem fails the reference pass filter, or None to keep it."""
    n, c = len(passed), sum(bool(p) for p in passed)
    if n == 0:
        return "no reference results"
    k = fcfg.code_k if task == "code" else fcfg.math_k
    if k > n:
        return f"only {n} reference results, fewer than k={k}"
    rate = pass_at_k(n, c, k)
    need = fcfg.code_min_pass if task == "code" else fcfg.math_min_pass
    if rate < need:
        return f"reference pass@{k} {rate:.3f} < {need:g} ({c}/{n} passed)"
    return None


def _reference_items(obj: dict) -> list[dict] | list[bool] | None:
    """Precomputed flags, or the grading items for the references, or None when there are none."""
    present = [f for f in REFERENCE_FIELDS if f in obj]
    if len(present) > 1:
        raise ValueError(f"give one of {REFERENCE_FIELDS}, not {present}")
    if not present:
        return None
    field, refs = present[0], obj[present[0]]
    if not isinstance(refs, list):
        raise ValueError(f"field '{field}' must be a list")
    if field == "reference_passed":
        if not all(isinstance(x, bool) for x in refs):
            raise ValueError("field 'reference_passed' must be a list of true/false")
        return refs
    if not all(isinstance(x, str) for x in refs):
        raise ValueError(f"field '{field}' must be a list of strings")
    task = obj["task"]
    if field == "reference_solutions":
        if task != "code":
            raise ValueError("field 'reference_solutions' is for code problems (math: reference_responses)")
        refs = ["<think>reference</think>\n```python\n" + r + "\n```" for r in refs]
    key = {"answer": obj["answer"]} if task == "math" else {"tests": obj["tests"]}
    return [{"id": i, "task": task, "response": r, **key} for i, r in enumerate(refs)]


def _passed(task: str, res, rcfg: RewardConfig) -> bool:
    if res.error is not None:
        return False
    return res.reward == rcfg.correct if task == "math" else (res.total > 0 and res.passed == res.total)


def load_eval_references(paths) -> dict:
    """``{problem id: [solved, ...]}`` from tools/eval.py sample files (``<output>.samples.jsonl``:
    one line per sample with ``id`` and ``solved``), in sample order. A line without them is an
    error naming the file and line."""
    refs = {}
    for path in paths:
        for lineno, text in numbered_lines(path):
            obj = decode_line(path, lineno, text)
            if "id" not in obj or not isinstance(obj.get("solved"), bool):
                raise ValueError(
                    f"{path}:{lineno}: not a tools/eval.py sample line (needs 'id' and a true/false 'solved')"
                )
            refs.setdefault(str(obj["id"]), []).append(obj["solved"])
    return refs


def filter_file(
    inp: str, out: str, dropped_path: str | None, fcfg: FilterConfig, rcfg: RewardConfig, references=None
) -> dict:
    """Filter `inp` into `out` (kept lines, verbatim) and `dropped_path` (line, id, reason).
    ``references``: ``{problem id: [passed, ...]}`` for lines without reference fields
    (:func:`load_eval_references`)."""
    from .pool import GradingPool

    # Code references run on every test: a reference must solve the problem, not a sample of it.
    rcfg = dataclasses.replace(rcfg, code_max_tests=None)
    summary = collections.Counter()
    reasons = collections.Counter()
    prog = Progress(count_lines(inp), "filter", every=1.0, count_errors=True)
    window = collections.deque()  # (lineno, text, obj, task, drop_reason | None, flags | futures)
    t0 = time.monotonic()
    pool = None

    def decide_and_write(entry, kept_f, dropped_f):
        lineno, text, obj, task, reason, refs = entry
        if reason is None and refs is not None:
            flags = [r if isinstance(r, bool) else _passed(task, r.result(), rcfg) for r in refs]
            summary["reference_grading_errors"] += sum(
                1 for r in refs if not isinstance(r, bool) and r.result().error is not None
            )
            reason = pass_drop_reason(task, flags, fcfg)
        if reason is None:
            kept_f.write(text if text.endswith("\n") else text + "\n")
            summary["kept"] += 1
        else:
            summary["dropped"] += 1
            reasons[reason.split(" (")[0].split(":")[0]] += 1
            if dropped_f is not None:
                dropped_f.write(
                    json.dumps(
                        {"line": lineno, "id": obj.get("id") if obj else None, "reason": reason}, ensure_ascii=False
                    )
                    + "\n"
                )
        prog.step(error=reason is not None and reason.startswith(f"{inp}:"))

    try:
        with atomic_file(out) as kept_f, atomic_file(dropped_path) if dropped_path else _nullcontext() as dropped_f:
            for lineno, text in numbered_lines(inp):
                obj, task, reason, refs = None, None, None, None
                try:
                    obj = decode_line(inp, lineno, text)
                    task = obj.get("task")
                    reason = structural_drop_reason(obj, fcfg)
                    if reason is None and fcfg.pass_filter:
                        items = _reference_items(obj)
                        if items is None and references is not None:
                            items = references.get(str(obj.get("id")))
                        if items is None:
                            reason = (
                                "no reference results (give reference_passed, reference_responses "
                                "or reference_solutions, or disable the pass filter)"
                            )
                        elif items and isinstance(items[0], dict):
                            if pool is None:
                                pool = GradingPool(rcfg)
                            refs = [pool.submit(it) for it in items]
                        else:
                            refs = items
                except ValueError as e:
                    msg = str(e)
                    reason = msg if msg.startswith(f"{inp}:") else f"{inp}:{lineno}: {msg}"
                    print(f"bad input line: {reason}", file=sys.stderr)
                    summary["bad_lines"] += 1
                window.append((lineno, text or "", obj, task, reason, refs))
                while len(window) > 256:
                    decide_and_write(window.popleft(), kept_f, dropped_f)
            while window:
                decide_and_write(window.popleft(), kept_f, dropped_f)
    finally:
        if pool is not None:
            pool.close(cancel_pending=True)
    summary["seconds"] = round(time.monotonic() - t0, 3)
    write_manifest(
        out,
        "tools/filter_rl_data.py",
        {"input": os.path.abspath(inp)},
        {
            "summary": dict(summary),
            "drop_reasons": dict(reasons),
            "filter": dataclasses.asdict(fcfg),
            "reward_config": dataclasses.asdict(rcfg),
        },
    )
    return {**summary, "drop_reasons": dict(reasons)}


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def filter_main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="tools/filter_rl_data.py",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True, help="kept problems, lines copied verbatim")
    ap.add_argument("--dropped", default=None, help="JSONL of dropped problems: line, id, reason")
    ap.add_argument("--min-tests", type=int, default=16)
    ap.add_argument("--code-min-pass", type=float, default=0.5)
    ap.add_argument("--math-min-pass", type=float, default=0.5)
    ap.add_argument(
        "--code-k",
        type=int,
        default=16,
        help="code: pass@k over the references (default 16: pass@16 >= --code-min-pass)",
    )
    ap.add_argument(
        "--math-k",
        type=int,
        default=1,
        help="math: pass@k over the references (default 1: the pass rate >= --math-min-pass)",
    )
    ap.add_argument("--k", type=int, default=None, help="set --code-k and --math-k together")
    ap.add_argument(
        "--no-pass-filter",
        action="store_true",
        help="only the test-count filter; keep problems without reference results",
    )
    ap.add_argument(
        "--references",
        action="append",
        default=[],
        metavar="SAMPLES.jsonl",
        help="tools/eval.py sample files of a reference model: each problem's graded samples, by id, "
        "for lines without reference fields (repeatable)",
    )
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument(
        "--allow-fallback", action="store_true", help="grade code references without bubblewrap if it cannot isolate"
    )
    args = ap.parse_args(argv)
    try:
        fcfg = FilterConfig(
            min_tests=args.min_tests,
            code_min_pass=args.code_min_pass,
            math_min_pass=args.math_min_pass,
            code_k=args.k or args.code_k,
            math_k=args.k or args.math_k,
            pass_filter=not args.no_pass_filter,
        )
        rcfg = RewardConfig(workers=args.workers or 0)
        rcfg.sandbox.allow_fallback = args.allow_fallback
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from .sandbox import SandboxUnavailable

    try:
        references = load_eval_references(args.references) if args.references else None
        s = filter_file(args.input, args.output, args.dropped, fcfg, rcfg, references)
    except ValueError as e:  # a references file that is not tools/eval.py's
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SandboxUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"kept {s.get('kept', 0)}, dropped {s.get('dropped', 0)} ({s.get('bad_lines', 0)} bad lines) "
        f"in {s['seconds']:.1f} s; reasons: {s['drop_reasons']} -> {args.output}",
        file=sys.stderr,
    )
    return 0
