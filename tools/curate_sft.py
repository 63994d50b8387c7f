"""Apply the Klear-Reasoner SFT data policy to teacher responses.

    python tools/curate_sft.py --input teacher.jsonl [more.jsonl ...] --output sft.jsonl \\
        [--hard-below 0.5] [--on-bad-line skip] [--report curate_report.json]

Each input line: {"prompt_id", "prompt", "response"} plus either "correct" (true/false) or "answer"
(math, graded with megatron_klear.rewards.math) or "tests" (code, graded with
megatron_klear.rewards.code). Easy prompts (pass rate >= --hard-below) keep only correct
responses; hard prompts keep all; exact duplicates are removed. See megatron_klear/data/curate.py.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    from megatron_klear.data.curate import CurateConfig, curate, format_summary
    from megatron_klear.data.jsonl import BadLineError

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="teacher-response JSONL files")
    p.add_argument("--output", required=True, help="curated JSONL (prompt/response records)")
    p.add_argument(
        "--hard-below", type=float, default=0.5, help="a prompt is hard when its pass rate is below this (default 0.5)"
    )
    p.add_argument("--on-bad-line", choices=("skip", "fail"), default="fail")
    p.add_argument("--report", help="also write the summary as JSON here")
    p.add_argument(
        "--grading-workers",
        type=int,
        default=None,
        help="grading processes for records without a 'correct' flag (default: one per core)",
    )
    args = p.parse_args(argv)
    cfg = CurateConfig(
        inputs=args.input,
        output=args.output,
        hard_below=args.hard_below,
        on_bad_line=args.on_bad_line,
        report=args.report,
        grading_workers=args.grading_workers,
    )
    try:
        summary = curate(cfg)
    except (BadLineError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
