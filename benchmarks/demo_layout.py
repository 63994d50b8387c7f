"""The demo's RL layout against one process: ``python -m megatron_klear rl`` with the demo's settings
(``megatron_klear/demo_recipe.py``) at TP=2 under torchrun (two ranks of one thread each, what
``make demo`` runs) and at TP=1 in one process (torch's two threads), alternated ``--repeats`` times.

    python benchmarks/demo_layout.py                       # builds the demo's SFT model first (~3 min)
    python benchmarks/demo_layout.py --sft runs/demo/hf-sft --prompts runs/demo/rl-prompts.jsonl

Printed per layout: the wall time from the command to its exit, the median step, its generation and
its update; then one process's speed-up over TP=2 (the ratio of the medians).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def run_layout(settings, sft: str, prompts: str, tp: int, steps: int, run: str) -> dict:
    from megatron_klear.demo_recipe import rl_overrides

    overrides = rl_overrides(settings, sft, run, prompts=prompts, tp=tp) + [f"train.steps={steps}"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp)]
    cmd = (launcher if tp > 1 else [sys.executable]) + ["-m", "megatron_klear", "rl", *overrides]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": run}
    t0 = time.perf_counter()
    with open(os.path.join(os.path.dirname(run), f"{os.path.basename(run)}.log"), "w") as log:
        subprocess.run(cmd, cwd=ROOT, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    with open(os.path.join(run, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if '"step"' in line]

    def median(key):
        return statistics.median(r.get(key, 0.0) for r in rows)

    return {
        "wall_s": wall,
        "step_s": median("perf/step_s"),
        "generate_s": median("perf/generate_s"),
        "train_s": median("time/train_s"),
    }


def main(argv=None) -> int:
    from megatron_klear.demo_recipe import Settings

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft", default="", help="the demo's SFT model (default: built into the work directory)")
    ap.add_argument("--prompts", default="", help="its RL prompts (with --sft)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    settings = Settings()
    work = tempfile.mkdtemp(prefix="klear-demo-layout-")
    if not args.sft:
        from demo_sft_model import build_sft_model  # benchmarks/demo_sft_model.py

        args.sft = build_sft_model(settings, os.path.join(work, "demo"))
        args.prompts = os.path.join(work, "demo", "rl-prompts.jsonl")
    results = {"tp2": [], "tp1": []}
    for k in range(args.repeats):
        for label, tp in (("tp2", 2), ("tp1", 1)):
            r = run_layout(settings, args.sft, args.prompts, tp, args.steps, os.path.join(work, f"{label}-{k}"))
            results[label].append(r)
            print(f"{label} (repeat {k + 1}): " + ", ".join(f"{n} {v:.3f}" for n, v in r.items()), flush=True)
    med = {label: {n: statistics.median(r[n] for r in rs) for n in rs[0]} for label, rs in results.items()}
    print("| layout | wall s | step s | generation s | update s |\n|---|---|---|---|---|")
    for label, name in (("tp2", "TP=2, torchrun, 1 thread a rank (the demo)"), ("tp1", "TP=1, one process, 2 threads")):
        m = med[label]
        print(f"| {name} | {m['wall_s']:.2f} | {m['step_s']:.3f} | {m['generate_s']:.3f} | {m['train_s']:.3f} |")
    ratio = med["tp2"]["step_s"] / med["tp1"]["step_s"]
    by_wall = med["tp2"]["wall_s"] / med["tp1"]["wall_s"]
    print(f"one process against the demo's TP=2: {ratio:.2f}x the steps/s, {by_wall:.2f}x by wall time")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": results, "medians": med, "speedup_one_process": ratio}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
