"""Tokenize SFT JSONL once into the indexed dataset the trainer reads.

    python tools/preprocess_sft.py --input a.jsonl [b.jsonl ...] --tokenizer HF_DIR \\
        --output-prefix data/sft --max-length 32768 --overlong truncate --on-bad-line skip --workers 8

Writes OUT.bin/.idx (tokens), OUT_loss_spans.bin/.idx, OUT.meta.json and OUT.rejected.jsonl; see
megatron_klear/data/indexed.py for the format and megatron_klear/data/preprocess.py for the
policies.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv=None) -> int:
    from megatron_klear.data.preprocess import OVERLONG_CHOICES, PreprocessConfig, preprocess

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--input", nargs="+", required=True, help="JSONL files ({'messages': [...]} or {'prompt', 'response'})"
    )
    p.add_argument(
        "--tokenizer", required=True, help="HF checkpoint or tokenizer directory (its chat template is used)"
    )
    p.add_argument("--output-prefix", required=True, help="output path prefix (OUT.bin, OUT.idx, OUT.meta.json, ...)")
    p.add_argument("--max-length", type=int, required=True, help="longest example in tokens (the SFT seq length)")
    p.add_argument(
        "--overlong", choices=OVERLONG_CHOICES, default="fail", help="what to do with longer examples (default: fail)"
    )
    p.add_argument(
        "--on-bad-line",
        choices=("skip", "fail"),
        default="fail",
        help="skip-and-count invalid lines, or stop at the first (default: fail)",
    )
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    p.add_argument(
        "--loss-on",
        choices=("all", "last"),
        default="all",
        help="train every assistant turn, or only the last one (default: all)",
    )
    p.add_argument(
        "--template-kwargs",
        default="{}",
        help="JSON object passed to the chat template, e.g. '{\"enable_thinking\": true}'",
    )
    p.add_argument("--chunk-lines", type=int, default=32, help="lines per work item")
    args = p.parse_args(argv)
    try:
        template_kwargs = json.loads(args.template_kwargs)
        if not isinstance(template_kwargs, dict):
            raise ValueError("not an object")
    except ValueError as e:
        p.error(f"--template-kwargs must be a JSON object ({e})")
    cfg = PreprocessConfig(
        inputs=args.input,
        tokenizer=args.tokenizer,
        output_prefix=args.output_prefix,
        max_length=args.max_length,
        overlong=args.overlong,
        on_bad_line=args.on_bad_line,
        workers=args.workers,
        loss_on=args.loss_on,
        template_kwargs=template_kwargs,
        chunk_lines=args.chunk_lines,
    )
    try:
        preprocess(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
