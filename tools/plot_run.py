#!/usr/bin/env python
"""Plot a run's metrics.jsonl as SVG charts, one per metric (or per --group of metrics).

    python tools/plot_run.py runs/klear-gppo-8b-math/metrics.jsonl --out plots/ \\
        --metric rollout/reward_mean --metric actor/entropy --group clip=actor/clip_frac_low,actor/clip_frac_high
    python tools/plot_run.py runs/a/metrics.jsonl runs/b/metrics.jsonl --metric loss   # compare runs
"""
import argparse
import json
import os
import sys


def main(argv=None):
    from megatron_klear.utils.svg_plot import line_chart

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="metrics.jsonl files")
    p.add_argument("--metric", action="append", default=[], help="one chart per metric (repeatable)")
    p.add_argument("--group", action="append", default=[], metavar="NAME=m1,m2", help="several metrics in one chart")
    p.add_argument("--out", required=True, help="output directory")
    args = p.parse_args(argv)
    runs = {}
    for path in args.runs:
        rows = []
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    print(f"error: {path}:{lineno}: {e.msg}", file=sys.stderr)
                    return 2
        runs[os.path.basename(os.path.dirname(os.path.abspath(path))) or path] = rows
    charts = {m: [m] for m in args.metric}
    for g in args.group:
        name, _, metrics = g.partition("=")
        charts[name] = metrics.split(",")
    if not charts:
        p.error("give at least one --metric or --group")
    os.makedirs(args.out, exist_ok=True)
    for name, metrics in charts.items():
        series = {}
        for run, rows in runs.items():
            for m in metrics:
                pts = [(r["step"], r[m]) for r in rows if isinstance(r.get(m), (int, float))]
                if pts:
                    series[f"{run}: {m}" if len(runs) > 1 else m] = pts
        if not series:
            print(f"warning: no values for {metrics} in {list(runs)}", file=sys.stderr)
            continue
        path = os.path.join(args.out, name.replace("/", "_") + ".svg")
        with open(path + ".tmp", "w") as f:
            f.write(line_chart(series, title=name))
        os.replace(path + ".tmp", path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    from megatron_klear.platform.entry import run_entry_point

    sys.exit(run_entry_point(main))  # a bad input file or value: one line naming it, exit status 2
