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
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_klear.rewards import GradingPool, RewardConfig, SandboxConfig
from megatron_klear.rewards.compare import stdio_match
from megatron_klear.rewards.isolation_probe import probe_isolation
from megatron_klear.rewards.sandbox import program_python

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
            gold, resp = (
                rf"\frac{{{a}}}{{{b}}}",
                rf"\dfrac{{{2 * a}}}{{{2 * b}}}" if rng.random() < 0.6 else f"{a / b + 0.01:.4f}",
            )
        elif kind == 2:
            gold, resp = f"x^2 + {a}x + {b}", f"{b} + {a}x + x^2" if rng.random() < 0.6 else f"x^2 + {b}x + {a}"
        elif kind == 3:
            gold, resp = f"({a}, {b})", f"({a},{b})" if rng.random() < 0.6 else f"({b}, {a})"
        elif kind == 4:
            gold, resp = rf"[{a}, {a + b})", rf"[{a},{a + b})" if rng.random() < 0.6 else rf"({a}, {a + b}]"
        else:
            gold, resp = (
                rf"{a}\sqrt{{{b}}}",
                rf"\sqrt{{{a * a * b}}}" if rng.random() < 0.6 else rf"{a + 1}\sqrt{{{b}}}",
            )
        items.append(
            {"id": i, "task": "math", "response": THINK + rf"The answer is $\boxed{{{resp}}}$.", "answer": gold}
        )
    return items


_TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int) -> float:
    """CPU seconds of a process and of its reaped descendants (utime+stime+cutime+cstime)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / _TICK


def _self_cpu(children: bool = False) -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    total = r.ru_utime + r.ru_stime
    if children:
        c = resource.getrusage(resource.RUSAGE_CHILDREN)
        total += c.ru_utime + c.ru_stime
    return total


def bench_math_direct(items) -> tuple[float, float]:
    """(grades/s, CPU ms per grade)."""
    from math_verify import parse, verify

    c, t = _self_cpu(), time.perf_counter()
    for it in items:
        gold = parse("\\boxed{" + it["answer"] + "}")
        pred = parse(it["response"].split("</think>")[-1])
        verify(gold, pred)
    return len(items) / (time.perf_counter() - t), (_self_cpu() - c) * 1e3 / len(items)


def bench_math_inprocess(items) -> tuple[float, float]:
    from megatron_klear.rewards.math import grade_math

    c, t = _self_cpu(), time.perf_counter()
    for it in items:
        grade_math(it["response"], it["answer"])
    return len(items) / (time.perf_counter() - t), (_self_cpu() - c) * 1e3 / len(items)


def bench_pool(pool, items) -> tuple[float, float, list]:
    """(units/s, CPU ms per unit, results); units: items (math) or test executions (code).
    CPU = this process + the workers + everything they ran and reaped (the sandboxes)."""
    pids = [w.proc.pid for w in pool._workers]
    c0 = _self_cpu() + sum(_proc_cpu(p) for p in pids)
    t = time.perf_counter()
    res = pool.grade_many(items)
    dt = time.perf_counter() - t
    assert [w.proc.pid for w in pool._workers] == pids, "a worker was replaced during the measurement"
    cpu = _self_cpu() + sum(_proc_cpu(p) for p in pids) - c0
    assert all(r.error is None for r in res), [r.error for r in res if r.error][:3]
    units = sum(r.total for r in res)
    return units / dt, cpu * 1e3 / units, res


# --------------------------------------------------------------------------- code

PROGRAMS = [
    # (solution, input generator, expected function)
    (
        "import sys\nnums = list(map(int, sys.stdin.read().split()))\nprint(sum(nums))",
        lambda r: " ".join(str(r.randint(-(10**6), 10**6)) for _ in range(200)),
        lambda s: str(sum(map(int, s.split()))),
    ),
    (
        "n = int(input())\ntotal = 0\nfor i in range(n):\n    total += i * i % 7\nprint(total)",
        lambda r: str(r.randint(10**5, 3 * 10**5)),
        lambda s: str(sum(i * i % 7 for i in range(int(s)))),
    ),
    (
        "s = input().strip()\nprint(s[::-1])",
        lambda r: "".join(r.choice("abcdef") for _ in range(1000)),
        lambda s: s[::-1],
    ),
]


def code_items(n: int, tests: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    items = []
    for i in range(n):
        code, gen, want = PROGRAMS[i % len(PROGRAMS)]
        ins = [gen(rng) for _ in range(tests)]
        items.append(
            {
                "id": i,
                "task": "code",
                "response": THINK + "```python\n" + code + "\n```",
                "tests": {"inputs": [x + "\n" for x in ins], "outputs": [want(x) for x in ins]},
            }
        )
    return items


def bench_code_plain(items, workers: int, python: str, d: str) -> tuple[float, float]:
    """One unisolated subprocess per test, `workers` tests in flight."""
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

    c, t = _self_cpu(children=True), time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        ok = list(ex.map(run, jobs))
    dt = time.perf_counter() - t
    assert all(ok)
    return len(jobs) / dt, (_self_cpu(children=True) - c) * 1e3 / len(jobs)


def _median(xs):
    return statistics.median(xs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--math-items", type=int, default=400)
    ap.add_argument("--code-items", type=int, default=48)
    ap.add_argument("--tests", type=int, default=16)
    ap.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="baseline and measured runs alternate, round by round: on a shared machine "
        "both see the same background load; medians are reported",
    )
    args = ap.parse_args(argv)
    w, rounds = args.workers, args.rounds
    print(
        f"reward benchmarks: {os.cpu_count()} CPUs, {w} workers, python {sys.version.split()[0]}, "
        f"{rounds} alternating rounds (medians)"
    )

    # ---- math
    items = math_items(args.math_items)
    chunks = [items[i::rounds] for i in range(rounds)]
    direct, inproc, pooled = [], [], []
    with GradingPool(RewardConfig(), workers=w) as pool:
        pool.grade_many(math_items(4 * w, seed=99))  # workers started and warm
        for ch in chunks:
            direct.append(bench_math_direct(ch))
            inproc.append(bench_math_inprocess(ch))
            pooled.append(bench_pool(pool, ch)[:2])
    med = lambda rows, k: _median([r[k] for r in rows])  # noqa: E731
    d = med(direct, 0)
    print(f"math  math-verify direct, 1 process  : {d:7.1f} grades/s  {med(direct, 1):6.2f} CPU ms/grade")
    print(
        f"math  grade_math in-process, no pool : {med(inproc, 0):7.1f} grades/s  {med(inproc, 1):6.2f} CPU ms/grade"
        f"   CPU {med(inproc, 1) / med(direct, 1):.2f}x of direct"
    )
    ratios = [b[0] / a[0] for a, b in zip(direct, pooled)]
    print(
        f"math  GradingPool, {w} workers         : {med(pooled, 0):7.1f} grades/s  {med(pooled, 1):6.2f} CPU ms/grade"
        f"   CPU {med(pooled, 1) / med(direct, 1):.2f}x of direct; grades/s {_median(ratios):.2f}x of direct "
        f"(rounds {', '.join(f'{r:.2f}' for r in ratios)})"
    )

    # ---- code
    citems = code_items(args.code_items, args.tests)
    cchunks = [citems[i::rounds] for i in range(rounds)]
    python = program_python(SandboxConfig())
    rep = probe_isolation(SandboxConfig(allow_fallback=True))
    pools = {}
    for level, ok, why in (
        ("bwrap", rep.bwrap_ok, rep.bwrap_problems),
        ("fallback", rep.fallback_ok, rep.fallback_problems),
    ):
        if not ok:
            print(f"code  sandbox {level}: unavailable ({'; '.join(why)})")
            continue
        cfg = RewardConfig(code_max_tests=None, sandbox=SandboxConfig(isolation=level, allow_fallback=True))
        pools[level] = GradingPool(cfg, workers=w)
        pools[level].grade_many(code_items(w, 2, seed=99))  # probe done, workers warm
    plain, sandboxed = [], {lv: [] for lv in pools}
    tmp = tempfile.mkdtemp(prefix="klear-bench-")
    try:
        for ch in cchunks:
            plain.append(bench_code_plain(ch, w, python, tmp))
            for lv, pool in pools.items():
                rate, cpu, res = bench_pool(pool, ch)
                assert all(r.reward == 1.0 for r in res), [r.detail for r in res if r.reward != 1.0][:3]
                sandboxed[lv].append((rate, cpu))
    finally:
        for pool in pools.values():
            pool.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"code  plain subprocess per test      : {med(plain, 0):7.1f} tests/s   {med(plain, 1):6.2f} CPU ms/test "
        f"({w} in flight, no isolation)"
    )
    for lv, rows in sandboxed.items():
        wall = [a[0] / b[0] for a, b in zip(plain, rows)]
        cpu = med(rows, 1) / med(plain, 1)
        print(
            f"code  GradingPool sandbox={lv:8s}  : {med(rows, 0):7.1f} tests/s   {med(rows, 1):6.2f} CPU ms/test "
            f"  isolation cost: CPU {cpu:.2f}x, tests/s {_median(wall):.2f}x (target < 2x; "
            f"rounds {', '.join(f'{c:.2f}' for c in wall)})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
