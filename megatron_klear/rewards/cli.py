"""`python tools/grade.py --input IN.jsonl --output OUT.jsonl [--workers N]`: grade a JSONL file.

Input lines:  {"id": ..., "task": "math", "response": ..., "answer": ...}
              {"id": ..., "task": "code", "response": ..., "tests": {"inputs", "outputs", "fn_name"?}}
Output lines, one per non-blank input line, in input order:
              {"id": ..., "reward": float, "passed": int, "total": int, "error": null | reason,
               "detail": ..., "tests": [...]}
A bad (malformed) line is reported on stderr with its file and line number and gets a record
with ``reward: null`` and the reason in ``error`` (id null when it had none), never a score that
looks like a wrong answer; the other lines are graded. The exit status is 2 (a user error, as
everywhere in the project) when there were more bad lines than ``--max-bad-lines`` (default 0),
after writing everything; the last line of stderr then says so. Progress (items/s, ETA)
goes to stderr. The output is written under a temporary name and renamed when complete, next to a
manifest.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys
import time

from megatron_klear.utils.atomic import atomic_file
from megatron_klear.utils.progress import Progress

from .config import ISOLATION_LEVELS, RewardConfig
from .items import parse_item
from .jsonl_io import count_lines, decode_line, numbered_lines, write_manifest
from .result import GradeResult

__all__ = ["grade_main", "grade_file"]


def _load_config(args) -> RewardConfig:
    d = {}
    if args.config:
        import yaml

        with open(args.config, encoding="utf-8") as f:
            d = yaml.safe_load(f) or {}
        if not isinstance(d, dict):
            raise SystemExit(f"{args.config}: expected a mapping of RewardConfig fields")
        d = d.get("reward", d)
    sandbox = dict(d.pop("sandbox", None) or {})
    if args.isolation:
        sandbox["isolation"] = args.isolation
    if args.allow_fallback:
        sandbox["allow_fallback"] = True
    if args.code_max_tests is not None:
        d["code_max_tests"] = args.code_max_tests or None
    if args.seed is not None:
        d["code_seed"] = args.seed
    if args.workers is not None:
        d["workers"] = args.workers
    try:
        return RewardConfig.from_dict({**d, "sandbox": sandbox})
    except (TypeError, ValueError) as e:
        raise SystemExit(f"{args.config or 'command line'}: {e}") from None


def grade_file(inp: str, out: str, cfg: RewardConfig, progress_every: float = 1.0) -> dict:
    """Grade `inp` into `out`; returns summary counts. Raises SandboxUnavailable (nothing written)."""
    from .pool import GradingPool

    total = count_lines(inp)
    prog = Progress(total, "grade", every=progress_every, count_errors=True)
    summary = collections.Counter()
    rewards = collections.defaultdict(list)
    window = collections.deque()  # (lineno, id, task, future | record of a malformed line), in input order
    t0 = time.monotonic()

    def drain(f, keep: int) -> None:
        import json

        while len(window) > keep:
            lineno, item_id, task, fut = window.popleft()
            res = fut if isinstance(fut, (GradeResult, dict)) else fut.result()
            record = res if isinstance(res, dict) else res.to_record(item_id)  # a dict: a malformed line
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            error = record["error"] is not None
            summary["items"] += 1
            summary["errors"] += error
            if task in ("math", "code") and not error:
                rewards[task].append(record["reward"])
            prog.step(error=error)

    with GradingPool(cfg) as pool, atomic_file(out) as f:
        max_window = max(64, 16 * pool.n_workers)
        for lineno, text in numbered_lines(inp):
            item_id, task = None, None
            try:
                obj = decode_line(inp, lineno, text)
                item_id, task = obj.get("id"), obj.get("task")
                parse_item(obj, where=f"{inp}:{lineno}")
                window.append((lineno, item_id, task, pool.submit(obj)))
            except ValueError as e:
                print(f"bad input line: {e}", file=sys.stderr)
                summary["bad_lines"] += 1
                # no grade at all (reward null), never a score that looks like a wrong answer
                bad = {**GradeResult.failure(0.0, str(e), total=0).to_record(item_id), "reward": None}
                window.append((lineno, item_id, task, bad))
            drain(f, max_window)
        drain(f, 0)
        isolation = pool.isolation.summary() if pool.isolation else "not used (no code items)"
    summary["seconds"] = round(time.monotonic() - t0, 3)
    for task, rs in rewards.items():
        summary[f"mean_reward_{task}"] = round(sum(rs) / len(rs), 6)
        summary[f"items_{task}"] = len(rs)
    write_manifest(
        out,
        "tools/grade.py",
        {"input": os.path.abspath(inp)},
        {"summary": dict(summary), "isolation": isolation, "config": dataclasses.asdict(cfg)},
    )
    return dict(summary)


def grade_main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="tools/grade.py", description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--input", required=True, help="JSONL of items to grade")
    ap.add_argument("--output", required=True, help="JSONL of grades (written atomically)")
    ap.add_argument("--workers", type=int, default=None, help="grading processes (default: one per core)")
    ap.add_argument("--config", default=None, help="YAML with RewardConfig fields (or a 'reward:' section)")
    ap.add_argument("--isolation", choices=ISOLATION_LEVELS, default=None)
    ap.add_argument(
        "--allow-fallback",
        action="store_true",
        help="run code without bubblewrap (rlimits + separate uid + seccomp) if it cannot isolate",
    )
    ap.add_argument("--code-max-tests", type=int, default=None, help="tests sampled per code item (0: all)")
    ap.add_argument("--seed", type=int, default=None, help="seed of the test sampling")
    ap.add_argument(
        "--max-bad-lines",
        type=int,
        default=0,
        help="malformed input lines tolerated before the exit status is 2 (default 0); they are "
        "written with reward null either way",
    )
    args = ap.parse_args(argv)
    cfg = _load_config(args)
    from .sandbox import SandboxUnavailable

    try:
        summary = grade_file(args.input, args.output, cfg)
    except SandboxUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    means = ", ".join(
        f"mean reward {t} {summary[f'mean_reward_{t}']:.4f} over {summary[f'items_{t}']} graded"
        for t in ("math", "code")
        if f"mean_reward_{t}" in summary
    )
    print(
        f"graded {summary.get('items', 0)} items ({summary.get('errors', 0)} errors, "
        f"{summary.get('bad_lines', 0)} bad lines) in {summary['seconds']:.1f} s"
        + (f"; {means}" if means else "")
        + f" -> {args.output}",
        file=sys.stderr,
    )
    bad = summary.get("bad_lines", 0)
    if bad > args.max_bad_lines:
        print(
            f"error: {bad} malformed input line(s) in {args.input} (more than --max-bad-lines {args.max_bad_lines}); "
            "their records have reward null and the reason in 'error'",
            file=sys.stderr,
        )
        return 2
    return 0
