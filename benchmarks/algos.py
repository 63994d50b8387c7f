"""The paper's RL comparisons at toy scale, from one SFT model (the demo's digit-chain task):

* GPPO vs clip-higher (DAPO) vs CISPO (Klear-Reasoner Fig. 2), all with the alpha = 0.1 NLL term;
* GPPO with the alpha = 0.1 NLL term vs without it (Table 6).

    python benchmarks/algos.py                  # 4 variants x 3 seeds, ~45 min on 2 idle cores
    python benchmarks/algos.py --quick          # smoke run (the test suite): tiny sizes, 1 seed, 2 variants
    python benchmarks/algos.py --sft runs/demo/hf-sft --heldout runs/demo/heldout.jsonl \
        --prompts runs/demo/rl-prompts.jsonl

Each run is the RL loop itself (``megatron_klear.rl.loop.RLLoop``: embedded engine, grading pool,
Megatron actor), driven step by step in one process (TP=1, one CPU thread; ``--parallel`` runs
side by side), with the held-out evaluation (``megatron_klear.evaluation.evaluate``: avg@8 at
temperature 1.0 on every held-out problem) on the engine's current weights every ``--eval-every``
RL steps. Results: per-run curves in ``<out>/runs/*.json``, PNG plots in ``<out>/plots/``, a
markdown table in ``<out>/results.md`` (``--results-md`` also appends it to benchmarks/RESULTS.md).
The SFT model is built with the demo's settings unless ``--sft`` names one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Mini-batches: the demo takes one optimizer step per RL step, and then the importance ratio is
# exactly 1 (the update is on-policy), no token is ever clipped and GPPO, clip-higher and CISPO are
# the same update. The comparison needs off-policy mini-batches, as in the paper (8 per step): here
# 4 per step (32 prompts in mini-batches of 8), at lr 1e-4.
MINI_BATCH_PROMPTS = 8
LR = 1e-4
VARIANTS = {  # name -> RL config overrides (everything else: the demo's RL settings)
    "gppo": ["rl.algo=gppo", "rl.nll_coef=0.1"],
    "clip_higher": ["rl.algo=clip_higher", "rl.nll_coef=0.1"],
    "cispo": ["rl.algo=cispo", "rl.nll_coef=0.1"],
    "gppo_no_nll": ["rl.algo=gppo", "rl.nll_coef=0.0"],
}
LABELS = {"gppo": "GPPO", "clip_higher": "clip-higher (DAPO)", "cispo": "CISPO", "gppo_no_nll": "GPPO, alpha = 0"}


# -- one run (a worker process) ---------------------------------------------------------------------
def run_one(args) -> dict:
    """One RL run with periodic held-out evaluation; writes <out>/runs/<variant>-s<seed>.json."""
    import torch

    torch.set_num_threads(1)
    from examples.demo import Demo, Settings
    from megatron_klear.config import load_config
    from megatron_klear.data.prompts import PromptDataset
    from megatron_klear.evaluation import evaluate
    from megatron_klear.rl.loop import RLLoop
    from megatron_klear.rollout.base import SamplingParams

    s = Settings(**json.loads(args.settings))
    name = f"{args.variant}-s{args.seed}"
    save_dir = os.path.join(args.out, "rl", name)
    demo = Demo(s, args.out)
    overrides = [o for o in demo.rl_overrides(args.sft, save_dir) if not o.startswith(("parallel.tp=", "rl.prompts="))]
    overrides += [
        f"rl.prompts=[{args.prompts}]",
        "parallel.tp=1",
        f"train.seed={args.seed}",
        "train.overwrite=true",
        "train.resume=false",
        "train.save_interval=0",
        *VARIANTS[args.variant],
    ]
    if not s.quick:
        overrides += [f"rl.mini_batch_prompts={MINI_BATCH_PROMPTS}", f"optim.lr={LR}", f"optim.min_lr={LR}"]
    loop = RLLoop(load_config(None, overrides))
    bench = {"heldout": PromptDataset([args.heldout], loop.tokenizer, max_prompt_length=64).prompts}
    params = SamplingParams(temperature=s.temperature, max_new_tokens=s.max_new_tokens, seed=1000 + args.seed)

    def heldout() -> float:
        summary, _ = evaluate(
            loop.rollout.engine,
            bench,
            loop.tokenizer,
            loop.rollout.pool,
            k=s.eval_k,
            params=params,
            progress=lambda line: None,
        )
        return summary["heldout"][f"avg@{s.eval_k}"]

    curve, metrics = [(0, heldout())], []
    t0 = time.time()
    while loop.rl_step < loop.steps:
        m = loop.step()
        loop.job_run.logger.log(loop.rl_step, m, console_keys=("rollout/accuracy", "actor/entropy"))
        metrics.append({"step": loop.rl_step, **{k: v for k, v in m.items() if isinstance(v, (int, float))}})
        if loop.rl_step % args.eval_every == 0 or loop.rl_step == loop.steps:
            curve.append((loop.rl_step, heldout()))
            print(f"[{name}] step {loop.rl_step}: held-out avg@{s.eval_k} {curve[-1][1]:.1f}%", flush=True)
    loop.close()
    result = {
        "variant": args.variant,
        "seed": args.seed,
        "heldout_curve": curve,
        "metrics": metrics,
        "seconds": time.time() - t0,
    }
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    path = os.path.join(args.out, "runs", f"{name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    return result


# -- the driver ---------------------------------------------------------------------------------------
def build_sft(out: str, settings) -> dict:
    """The demo's SFT model (no parity check), and its data files."""
    from examples.demo import Demo

    demo = Demo(settings, out)
    demo.build_sft_model()
    return {
        "sft": f"{demo.out}/hf-sft",
        "heldout": f"{demo.out}/heldout.jsonl",
        "prompts": f"{demo.out}/rl-prompts.jsonl",
    }


def run_all(args, settings, files) -> list:
    """Every (variant, seed) as a worker process, ``--parallel`` at a time."""
    jobs = [(v, seed) for seed in range(1, args.seeds + 1) for v in args.variants]
    running, results, logs = [], [], os.path.join(args.out, "logs")
    os.makedirs(logs, exist_ok=True)
    t0 = time.time()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    while jobs or running:
        while jobs and len(running) < args.parallel:
            v, seed = jobs.pop(0)
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--worker",
                "--variant",
                v,
                "--seed",
                str(seed),
                "--out",
                args.out,
                "--sft",
                files["sft"],
                "--heldout",
                files["heldout"],
                "--prompts",
                files["prompts"],
                "--eval-every",
                str(args.eval_every),
                "--settings",
                json.dumps(settings.__dict__),
            ]
            log = open(os.path.join(logs, f"{v}-s{seed}.log"), "w")
            running.append(
                ((v, seed), subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log)
            )
        time.sleep(1.0)
        for item in list(running):
            (v, seed), proc, log = item
            if proc.poll() is None:
                continue
            running.remove(item)
            log.close()
            if proc.returncode != 0:
                raise RuntimeError(f"run {v} seed {seed} failed (exit {proc.returncode}); see {log.name}")
            with open(os.path.join(args.out, "runs", f"{v}-s{seed}.json")) as f:
                results.append(json.load(f))
            done, total = len(results), len(results) + len(running) + len(jobs)
            from megatron_klear.utils.progress import format_seconds

            eta = (total - done) * (time.time() - t0) / done  # runs finish at this rate, side by side
            print(
                f"  {v} seed {seed}: held-out avg@8 {results[-1]['heldout_curve'][0][1]:.1f}% -> "
                f"{results[-1]['heldout_curve'][-1][1]:.1f}%  [{done}/{total} runs, ETA {format_seconds(eta)}]",
                flush=True,
            )
    return results


def aggregate(results: list) -> dict:
    """variant -> {steps, mean, min, max, std per eval step; final mean/std; metric curves}."""
    out = {}
    for v in dict.fromkeys(r["variant"] for r in results):
        runs = [r for r in results if r["variant"] == v]
        steps = [s for s, _ in runs[0]["heldout_curve"]]
        per_step = [[dict(r["heldout_curve"])[s] for r in runs if s in dict(r["heldout_curve"])] for s in steps]
        curves = {}
        for key in (
            "actor/entropy",
            "actor/clip_frac_low",
            "actor/clip_frac_high",
            "actor/clip_frac_dual",
            "rollout/accuracy",
            "rollout/response_length_mean",
        ):
            by_step = {}
            for r in runs:
                for m in r["metrics"]:
                    if isinstance(m.get(key), (int, float)):
                        by_step.setdefault(m["step"], []).append(m[key])
            if by_step:
                curves[key] = {s: statistics.fmean(vals) for s, vals in sorted(by_step.items())}
        finals = [r["heldout_curve"][-1][1] for r in runs]
        best = [max(x for _, x in r["heldout_curve"]) for r in runs]
        out[v] = {
            "seeds": len(runs),
            "steps": steps,
            "mean": [statistics.fmean(x) for x in per_step],
            "min": [min(x) for x in per_step],
            "max": [max(x) for x in per_step],
            "start": statistics.fmean(r["heldout_curve"][0][1] for r in runs),
            "final_mean": statistics.fmean(finals),
            "final_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "best_mean": statistics.fmean(best),
            "finals": finals,
            "curves": curves,
            "minutes": statistics.fmean(r["seconds"] for r in runs) / 60,
        }
    return out


def write_outputs(out: str, agg: dict, meta: dict) -> str:
    from megatron_klear.utils.plots import band_chart, line_chart

    plots = os.path.join(out, "plots")
    label = lambda v: f"{LABELS.get(v, v)} ({agg[v]['seeds']} seeds)"  # noqa: E731
    groups = {
        "algos": [v for v in ("gppo", "clip_higher", "cispo") if v in agg],
        "nll": [v for v in ("gppo", "gppo_no_nll") if v in agg],
    }
    written = []
    for g, variants in groups.items():
        if not variants:
            continue
        band_chart(
            os.path.join(plots, f"heldout_{g}.png"),
            {label(v): (agg[v]["steps"], agg[v]["mean"], agg[v]["min"], agg[v]["max"]) for v in variants},
            title="Held-out avg@8 (T=1.0) over RL steps: mean, min-max band over seeds",
            xlabel="RL step",
            ylabel="avg@8 (%)",
        )
        written.append(f"plots/heldout_{g}.png")
    everything = list(agg)
    for key, title in (
        ("actor/entropy", "Policy entropy (nats/token), mean over seeds"),
        ("actor/clip_frac_high", "Fraction of tokens clipped above (r > 1 + eps_high, A > 0)"),
        ("actor/clip_frac_low", "Fraction of tokens clipped below (r < 1 - eps_low, A < 0)"),
        ("rollout/accuracy", "Rollout accuracy on training problems (T=1.0), mean over seeds"),
    ):
        series = {label(v): sorted(agg[v]["curves"][key].items()) for v in everything if key in agg[v]["curves"]}
        if series:
            name = key.split("/")[-1]
            line_chart(os.path.join(plots, f"{name}.png"), series, title=title, xlabel="RL step", markers=False)
            written.append(f"plots/{name}.png")
    lines = [
        f"**Toy-scale RL comparisons** ({meta['date']}, {meta['machine']}; `benchmarks/algos.py"
        f"{' --quick' if meta['quick'] else ''}`, {meta['minutes']:.0f} min). From one SFT model of the demo's "
        f"digit-chain task (tiny Qwen3, {meta['heldout']} held-out problems), {meta['steps']} RL steps of "
        f"{meta['prompts_per_step']} prompts x 8 responses in mini-batches of {meta['mini_batch_prompts']} prompts "
        f"(off-policy updates, where the clipping differs), lr {meta['lr']:g}; held-out avg@8 at T=1.0 "
        f"(SFT model: {meta['start']:.1f}%).",
        "",
        "| variant | seeds | held-out avg@8 at the end (mean ± std) | best along the run (mean) | final runs |",
        "|---|---|---|---|---|",
    ]
    for v, a in agg.items():
        lines.append(
            f"| {LABELS.get(v, v)} | {a['seeds']} | {a['final_mean']:.1f} ± {a['final_std']:.1f} | "
            f"{a['best_mean']:.1f} | {', '.join(f'{x:.1f}' for x in a['finals'])} |"
        )
    lines += ["", "Plots: " + ", ".join(f"`{os.path.relpath(os.path.join(out, w), ROOT)}`" for w in written), ""]
    text = "\n".join(lines)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "aggregate.json"), "w") as f:
        json.dump({"meta": meta, "variants": agg}, f, indent=2)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-algos"))
    p.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, 1 seed, gppo and cispo")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the demo's)")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--parallel", type=int, default=2, help="runs side by side (one CPU thread each)")
    p.add_argument("--sft", default=None, help="HF SFT model (default: build the demo's)")
    p.add_argument("--heldout", default=None)
    p.add_argument("--prompts", default=None)
    p.add_argument("--results-md", default=None, help="append the table to this markdown file")
    # worker mode
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--settings", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.out = os.path.abspath(args.out)
    if args.worker:
        run_one(args)
        return 0
    from examples.demo import QUICK, Settings

    values = dict(QUICK) if args.quick else {}
    if args.steps:
        values["rl_steps"] = args.steps
    settings = Settings(**values)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.quick:
        args.seeds, args.variants, args.eval_every = 1, ["gppo", "cispo"], 1
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    if args.sft:
        files = {
            "sft": os.path.abspath(args.sft),
            "heldout": os.path.abspath(args.heldout),
            "prompts": os.path.abspath(args.prompts),
        }
    else:
        print("building the SFT model (the demo's settings) ...", flush=True)
        files = build_sft(os.path.join(args.out, "sft"), settings)
    print(
        f"RL: {len(args.variants)} variants x {args.seeds} seeds, {settings.rl_steps} steps each, "
        f"{args.parallel} at a time",
        flush=True,
    )
    results = run_all(args, settings, files)
    agg = aggregate(results)
    import platform

    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
        f"load average {os.getloadavg()[0]:.1f} at the end",
        "quick": args.quick,
        "minutes": (time.time() - t0) / 60,
        "steps": settings.rl_steps,
        "prompts_per_step": settings.rl_prompts_per_step,
        "lr": settings.rl_lr if args.quick else LR,
        "mini_batch_prompts": settings.rl_mini_batch_prompts if args.quick else MINI_BATCH_PROMPTS,
        "heldout": sum(1 for _ in open(files["heldout"])),
        "start": statistics.fmean(a["start"] for a in agg.values()),
    }
    text = write_outputs(args.out, agg, meta)
    print("\n" + text)
    if args.results_md:
        with open(args.results_md, "a") as f:
            f.write("\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
