"""Reward throughput on this machine, each figure against a baseline measured in the same run.

    python benchmarks/rewards.py [--workers 2] [--math-items 400] [--code-items 48] [--tests 16]

Math: grades/s of the GradingPool (worker processes with deadlines and memory limits, our trap
handling) vs math-verify called directly in one process (parse gold, parse response, verify: what
most frameworks do).
Code: test executions/s of the GradingPool (a fresh sandboxed process per test, at every
isolation level available) vs a plain runner: one `python solution.py` subprocess per test, no
isolation, the same number of tests in flight. The ratio plain/sandboxed is the cost of isolation
(target: under 2x).
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_klear.rewards import GradingPool, RewardConfig, SandboxConfig  # noqa: E402
from megatron_klear.rewards.compare import stdio_match  # noqa: E402
from megatron_klear.rewards.sandbox import _default_python, probe_isolation  # noqa: E402

THINK = "<think>Let me solve it.</think>\n"


def math_items(n: int, seed: int = 0) -> list[dict]:
    """Varied, mostly unique answers (math-verify caches recent parses)."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        kind = i % 6
        if kind == 0:
            gold, resp = str(a * b), str(a * b if rng.random() < 0.6 else a * b + 1)
        elif kind == 1:
            gold, resp = rf"\frac{{{a}}}{{{b}}}", rf"\dfrac{{{2 * a}}}{{{2 * b}}}" if rng.random() < 0.6 else f"{a / b + 0.01:.4f}"
        elif kind == 2:
            gold, resp = f"x^2 + {a}x + {b}", f"{b} + {a}x + x^2" if rng.random() < 0.6 else f"x^2 + {b}x + {a}"
        elif kind == 3:
            gold, resp = f"({a}, {b})", f"({a},{b})" if rng.random() < 0.6 else f"({b}, {a})"
        elif kind == 4:
            gold, resp = rf"[{a}, {a + b})", rf"[{a},{a + b})" if rng.random() < 0.6 else rf"({a}, {a + b}]"
        else:
            gold, resp = rf"{a}\sqrt{{{b}}}", rf"\sqrt{{{a * a * b}}}" if rng.random() < 0.6 else rf"{a + 1}\sqrt{{{b}}}"
        items.append({"id": i, "task": "math", "response": THINK + rf"The answer is $\boxed{{{resp}}}$.",
                      "answer": gold})
    return items


def bench_math_direct(items) -> float:
    from math_verify import parse, verify

    t = time.perf_counter()
    for it in items:
        gold = parse("\\boxed{" + it["answer"] + "}")
        pred = parse(it["response"].split("</think>")[-1])
        verify(gold, pred)
    return len(items) / (time.perf_counter() - t)


def bench_math_pool(items, workers: int) -> float:
    with GradingPool(RewardConfig(), workers=workers) as pool:
        pool.grade_many(items[:workers * 2])  # workers started and warm
        t = time.perf_counter()
        res = pool.grade_many(items)
        dt = time.perf_counter() - t
    assert all(r.error is None for r in res), [r.error for r in res if r.error][:3]
    return len(items) / dt


# --------------------------------------------------------------------------- code

PROGRAMS = [
    # (solution, input generator, expected function)
    ("import sys\nnums = list(map(int, sys.stdin.read().split()))\nprint(sum(nums))",
     lambda r: " ".join(str(r.randint(-10**6, 10**6)) for _ in range(200)),
     lambda s: str(sum(map(int, s.split())))),
    ("n = int(input())\ntotal = 0\nfor i in range(n):\n    total += i * i % 7\nprint(total)",
     lambda r: str(r.randint(10**5, 3 * 10**5)),
     lambda s: str(sum(i * i % 7 for i in range(int(s))))),
    ("s = input().strip()\nprint(s[::-1])",
     lambda r: "".join(r.choice("abcdef") for _ in range(1000)),
     lambda s: s[::-1]),
]


def code_items(n: int, tests: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    items = []
    for i in range(n):
        code, gen, want = PROGRAMS[i % len(PROGRAMS)]
        ins = [gen(rng) for _ in range(tests)]
        items.append({"id": i, "task": "code",
                      "response": THINK + "```python\n" + code + "\n```",
                      "tests": {"inputs": [x + "\n" for x in ins], "outputs": [want(x) for x in ins]}})
    return items


def bench_code_plain(items, workers: int, python: str) -> float:
    """One unisolated subprocess per test, `workers` tests in flight."""
    d = tempfile.mkdtemp(prefix="klear-bench-")
    jobs = []
    for it in items:
        path = os.path.join(d, f"sol{it['id']}.py")
        with open(path, "w") as f:
            f.write(it["response"].split("```python\n")[1].split("```")[0])
        jobs += [(path, x, y) for x, y in zip(it["tests"]["inputs"], it["tests"]["outputs"])]

    def run(job):
        path, x, y = job
        p = subprocess.run([python, "-I", path], input=x.encode(), capture_output=True, timeout=30)
        return p.returncode == 0 and stdio_match(p.stdout.decode(), y)

    t = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        ok = list(ex.map(run, jobs))
    dt = time.perf_counter() - t
    assert all(ok)
    return len(jobs) / dt


def bench_code_pool(items, workers: int, level: str) -> float:
    cfg = RewardConfig(code_max_tests=None, sandbox=SandboxConfig(isolation=level, allow_fallback=True))
    with GradingPool(cfg, workers=workers) as pool:
        pool.grade_many(items[:workers])  # probe done, workers warm
        t = time.perf_counter()
        res = pool.grade_many(items)
        dt = time.perf_counter() - t
    assert all(r.reward == 1.0 for r in res), [r.detail for r in res if r.reward != 1.0][:3]
    return sum(r.total for r in res) / dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--math-items", type=int, default=400)
    ap.add_argument("--code-items", type=int, default=48)
    ap.add_argument("--tests", type=int, default=16)
    args = ap.parse_args(argv)
    w = args.workers
    print(f"reward benchmarks: {os.cpu_count()} CPUs, {w} workers, python {sys.version.split()[0]}")

    items = math_items(args.math_items)
    direct = bench_math_direct(items)
    pooled = bench_math_pool(items, w)
    print(f"math  math-verify direct, 1 process : {direct:8.1f} grades/s")
    print(f"math  GradingPool, {w} workers        : {pooled:8.1f} grades/s   ratio {pooled / direct:.2f}x of direct")

    citems = code_items(args.code_items, args.tests)
    python = _default_python(SandboxConfig())
    plain = bench_code_plain(citems, w, python)
    print(f"code  plain subprocess per test     : {plain:8.1f} tests/s ({w} in flight, no isolation)")
    rep = probe_isolation(SandboxConfig(allow_fallback=True))
    for level, ok, why in (("bwrap", rep.bwrap_ok, rep.bwrap_problems), ("fallback", rep.fallback_ok, rep.fallback_problems)):
        if not ok:
            print(f"code  sandbox {level:8s}: unavailable ({'; '.join(why)})")
            continue
        rate = bench_code_pool(citems, w, level)
        print(f"code  GradingPool sandbox={level:8s} : {rate:8.1f} tests/s   isolation cost {plain / rate:.2f}x "
              f"(target < 2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
