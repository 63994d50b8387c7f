#!/usr/bin/env python
"""Convert published data (verl/Klear RL parquet, LiveCodeBench releases, AIME/HMMT/MATH/NeMo-Skills
math sets) to the project's prompt JSONL, for inspection; rl.prompts and tools/eval.py --bench read
the published files directly (docs/data.md).

    python tools/prepare_data.py --format verl --input KlearReasoner-MathSub-30K/train.parquet \\
        --output data/math_sub.jsonl
    python tools/prepare_data.py --format livecodebench --input lcb/test6.jsonl --window v6 \\
        --output data/lcb_v6.jsonl

Every bad row is named with file, row and column; --on-bad-row skip counts them (and lists them in
<output>.rejected.jsonl) instead of stopping. A summary of what was read is printed (and written
to <output>.summary.json).
"""

import argparse
import json
import os
import sys


def main(argv=None):
    from megatron_klear.data.formats import FORMATS, read_problems
    from megatron_klear.data.formats.livecodebench import WINDOWS
    from megatron_klear.data.formats.math_sets import DEFAULT_TEMPLATE
    from megatron_klear.data.jsonl import RejectedRows
    from megatron_klear.utils import atomic

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", default="auto", choices=("auto",) + FORMATS)
    p.add_argument("--input", action="append", required=True, help="a .parquet or .jsonl file (repeatable)")
    p.add_argument("--output", required=True, help="the project's prompt JSONL")
    p.add_argument("--since", help="livecodebench: first contest date (YYYY-MM-DD, inclusive)")
    p.add_argument("--until", help="livecodebench: last contest date (YYYY-MM-DD, inclusive, as LiveCodeBench)")
    p.add_argument("--window", choices=sorted(WINDOWS), help="livecodebench: the paper's window (v5, v6)")
    p.add_argument(
        "--math-template",
        default=DEFAULT_TEMPLATE,
        help="math rows with a problem column: the user turn ({problem} is replaced)",
    )
    p.add_argument("--on-bad-row", choices=("fail", "skip"), default="fail")
    args = p.parse_args(argv)
    if args.window:
        if args.since or args.until:
            p.error("--window and --since/--until: give one")
        args.since, args.until = WINDOWS[args.window]
    if "{problem}" not in args.math_template:
        p.error("--math-template must contain {problem}")
    rejected = RejectedRows(args.output, args.on_bad_row)
    policy = rejected.policy
    out, summaries = [], []
    for path in args.input:
        problems, summary = read_problems(
            path, args.format, policy=policy, since=args.since, until=args.until, math_template=args.math_template
        )
        print(summary.line(), file=sys.stderr)
        summaries.append(summary.as_dict())
        out += problems
    if not out:
        raise ValueError(f"no problems read from {args.input}")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)) or ".", exist_ok=True)
    atomic.write_text(args.output, "".join(json.dumps(q, ensure_ascii=False) + "\n" for q in out))
    rejected.save()
    atomic.write_text(os.path.splitext(args.output)[0] + ".summary.json", json.dumps(summaries, indent=2))
    skipped = len(rejected.lines)
    print(f"wrote {len(out)} problems to {args.output}" + (f" ({skipped} bad rows skipped)" if skipped else ""))
    return 0


if __name__ == "__main__":
    from megatron_klear.platform.entry import run_entry_point

    sys.exit(run_entry_point(main))
