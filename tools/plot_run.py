#!/usr/bin/env python
"""Plot a run's metrics.jsonl with matplotlib, one chart per metric (or per --group of metrics);
PNG by default (--format svg for vector files).

    python tools/plot_run.py runs/klear-gppo-8b-math/metrics.jsonl --out plots/ \\
        --metric rollout/reward_mean --metric actor/entropy --group clip=actor/clip_frac_low,actor/clip_frac_high
    python tools/plot_run.py runs/a/metrics.jsonl runs/b/metrics.jsonl --metric loss   # compare runs
    python tools/plot_run.py runs/sync/metrics.jsonl runs/async/metrics.jsonl --preset async --out plots/

``--preset async`` draws the asynchronous / partial-rollout metrics (docs/async.md): token
staleness (mean and max), the off-policy token fraction, resumed / aborted / regenerated samples,
the step's times (generate, train, overlap, step) and samples/s; each chart is named
``async_<name>``. ``--preset eval`` draws the held-out curves of ``rl.eval`` (docs/gppo.md): every
set's ``eval/NAME/avg@k`` in one chart (``eval_avg``), their pass@k in another (``eval_pass``).
Runs are named by their directory (runs/a/metrics.jsonl -> "a"). Needs matplotlib
(the ``[logging]`` extra: pip install -e '.[logging]' in the repository's root).
"""

import argparse
import json
import os
import sys


def read_metrics(path: str) -> list:
    """The records of a metrics.jsonl; a bad line is a ValueError naming file and line."""
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: {e.msg}") from None
    return rows


# --preset NAME: chart name -> metrics (one chart each, several metrics in one)
PRESETS = {
    "async": {
        "async_staleness": ["rollout/staleness_mean", "rollout/staleness_max"],
        "async_offpolicy_token_frac": ["rollout/offpolicy_token_frac"],
        "async_partial_samples": ["rollout/resumed_samples", "rollout/aborted_samples", "rollout/stale_regenerated"],
        "async_times": ["perf/generate_s", "perf/train_s", "perf/overlap_s", "perf/step_s"],
        "async_samples_per_s": ["perf/samples_per_s"],
    },
}

TITLES = {
    "async_staleness": "Token staleness (versions behind the proximal policy): mean, max",
    "async_offpolicy_token_frac": "Fraction of trained tokens from an older weight version",
    "async_partial_samples": "Partial rollouts: samples resumed, aborted, regenerated (too stale)",
    "async_times": "Step time (s): generate, train, overlap, whole step",
    "async_samples_per_s": "Samples trained per second",
}


def eval_charts(runs: dict) -> dict:
    """``--preset eval``: one chart of every held-out set's avg@k (``rl.eval``: ``eval/NAME/avg@k``)
    and one of their pass@k, from the keys the runs logged."""
    keys = sorted({k for rows in runs.values() for r in rows for k in r if k.startswith("eval/")})
    charts = {}
    for figure in ("avg@", "pass@"):
        chosen = [k for k in keys if k.rsplit("/", 1)[-1].startswith(figure)]
        if chosen:
            charts[f"eval_{figure.rstrip('@')}"] = chosen
    return charts


def collect_series(runs: dict, metrics: list) -> dict:
    """label -> [(step, value), ...] for every (run, metric) with values; labelled by the metric,
    or ``run: metric`` when there are several runs."""
    series = {}
    for run, rows in runs.items():
        for m in metrics:
            pts = [(r["step"], r[m]) for r in rows if isinstance(r.get(m), (int, float)) and "step" in r]
            if pts:
                series[f"{run}: {m}" if len(runs) > 1 else m] = pts
    return series


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="metrics.jsonl files")
    p.add_argument("--metric", action="append", default=[], help="one chart per metric (repeatable)")
    p.add_argument("--group", action="append", default=[], metavar="NAME=m1,m2", help="several metrics in one chart")
    p.add_argument(
        "--preset",
        action="append",
        default=[],
        choices=sorted([*PRESETS, "eval"]),
        help="a set of charts (async: staleness, off-policy tokens, partial samples, step times, samples/s; "
        "eval: the held-out sets' avg@k and pass@k of rl.eval)",
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--format", choices=("png", "svg", "pdf"), default="png")
    args = p.parse_args(argv)
    charts = {m: [m] for m in args.metric}
    for preset in args.preset:
        charts.update(PRESETS.get(preset, {}))
    for g in args.group:
        name, _, metrics = g.partition("=")
        if not name or not metrics:
            p.error(f"--group {g!r}: expected NAME=metric1,metric2")
        charts[name] = metrics.split(",")
    if not charts and not args.preset:
        p.error("give at least one --metric, --group or --preset")
    from megatron_klear.utils.plots import line_chart

    runs = {}
    for path in args.runs:
        name = os.path.basename(os.path.dirname(os.path.abspath(path))) or path
        runs[name if name not in runs else path] = read_metrics(path)
    if "eval" in args.preset:
        charts.update(eval_charts(runs))
    written = 0
    for name, metrics in charts.items():
        series = collect_series(runs, metrics)
        if not series:
            print(f"warning: no values for {metrics} in {list(runs)}", file=sys.stderr)
            continue
        path = os.path.join(args.out, name.replace("/", "_") + "." + args.format)
        line_chart(path, series, title=TITLES.get(name, name))
        written += 1
        print(f"wrote {path}")
    return 0 if written else 1


if __name__ == "__main__":
    from megatron_klear.platform.entry import run_entry_point

    sys.exit(run_entry_point(main))  # a bad input file or value: one line naming it, exit status 2
