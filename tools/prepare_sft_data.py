#!/usr/bin/env python
"""Convert a published long chain-of-thought SFT set (parquet or JSONL, as downloaded) to the SFT
input that tools/preprocess_sft.py reads: one ``{"messages": [...]}`` line per conversation.

    hf download open-thoughts/OpenThoughts3-1.2M --repo-type dataset --local-dir data/OpenThoughts3
    python tools/prepare_sft_data.py --input 'data/OpenThoughts3/data/*.parquet' --output data/sft.jsonl \\
        --on-bad-row skip

Rows: ShareGPT ``conversations`` ({from, value}), ``messages`` ({role, content, reasoning_content}),
or ``prompt``/``response`` (megatron_klear/data/formats/sft_sets.py). Every assistant turn must hold
its chain of thought (``<think>...</think>`` inline, or ``reasoning_content``, which is written
inline so that any chat template trains it); a row without is a bad row. Bad rows are named with
file, row and column; --on-bad-row skip counts them (and lists them in <output>.rejected.jsonl)
instead of stopping. --input is repeatable and takes quoted globs.
"""

import argparse
import json
import os
import sys


def main(argv=None):
    from megatron_klear.data.formats.rows import RowError, iter_rows
    from megatron_klear.data.formats.sft_sets import to_messages
    from megatron_klear.data.jsonl import BadLineError, ExampleError, RejectedRows, expand_input_files
    from megatron_klear.utils import atomic

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", action="append", required=True, help="a .parquet or .jsonl file or a quoted glob")
    p.add_argument("--output", required=True, help="the SFT input JSONL ({'messages': [...]} lines)")
    p.add_argument("--on-bad-row", choices=("fail", "skip"), default="fail")
    args = p.parse_args(argv)
    try:
        paths = expand_input_files(args.input)
    except (FileNotFoundError, ValueError) as e:
        p.error(f"--input: {e}")
    rejected = RejectedRows(args.output, args.on_bad_row)
    policy = rejected.policy
    written = 0
    with atomic.atomic_file(args.output) as out:
        for path in paths:
            rows = 0
            for row, obj in iter_rows(path):
                rows += 1
                try:
                    if isinstance(obj, ExampleError):
                        raise obj
                    messages = to_messages(obj)
                except (RowError, ExampleError) as e:
                    policy.handle(BadLineError.from_example_error(path, row, e))
                    continue
                out.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
                written += 1
            print(f"{path}: {rows} rows", file=sys.stderr)
    rejected.save()
    if not written:
        os.remove(args.output)
        raise ValueError(f"no conversation kept from {', '.join(paths)}")
    skipped = f" ({policy.total} bad rows skipped: {policy.reasons()})" if policy.total else ""
    print(f"wrote {written} conversations to {args.output}{skipped}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from megatron_klear.platform.entry import run_entry_point

    sys.exit(run_entry_point(main))
