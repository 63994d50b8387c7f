"""GPPO against the losses peers ship, at toy scale, in a regime where the clipping rules differ.

Two parts, both from one SFT model of the demo's digit-chain task (``examples/demo.py --sft-model``;
its settings: ``megatron_klear/demo_recipe.py``):

* ``sweep``: where does clipping bite? Levers of the update (mini-batches per rollout batch, the
  learning rate, a bf16 rollout engine against the fp32 trainer, longer responses) each run a few
  RL steps of GPPO, measuring per step the fraction of response tokens whose ratio is outside
  [1 - eps_low, 1 + eps_high], the mean and max |log ratio|, the effective sample size of the
  importance weights, and whether learning happens (rollout accuracy, held-out avg@8).
* ``compare``: in a regime chosen from the sweep, every variant of :data:`VARIANTS` x ``--seeds``
  seeds (a seed sets the prompt order, the sampling and the evaluation's sampling), held-out avg@8
  every ``--eval-every`` steps; the final value and the area under the held-out curve with a 95%
  bootstrap interval per variant, each variant paired with GPPO by seed (mean difference, interval,
  sign-flip p-value: ``megatron_klear.utils.stats``), the paper's mechanisms per step (entropy,
  clip fractions, the log-ratio of negative-advantage tokens), and plots.

    python benchmarks/algos.py sweep                                # the regime table: 6 min
    python benchmarks/algos.py compare --regime mb16-lr1.5e-4 --seeds 8   # 9 variants x 8 seeds: 41 min
    python benchmarks/algos.py compare --regime mb4 --seeds 5       # the near on-policy contrast: 20 min
    python benchmarks/algos.py --quick                              # the machinery, in the test suite (~25 s)

Times on 2 cores (benchmarks/RESULTS.md, 2026-12-05), plus ~3 min for the demo's SFT model and ~5
min for the long task's when they are not given (``--sft``) or built before: about 80 minutes for
everything RESULTS.md reports.

Resumable: every run writes ``<out>/runs/<name>.json`` when it ends and a killed command re-run
with the same arguments skips the runs already written. Runs are the RL loop itself
(``megatron_klear.rl.loop.RLLoop``: embedded engine, grading pool, Megatron actor at TP=1, one CPU
thread), ``--parallel`` side by side; progress and an ETA are printed as runs end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The levers of the sweep: name -> (demo settings, RL overrides). The base is the demo's RL step
# (32 prompts x 8 responses, gppo, alpha 0.1) at TP=1; "mbN" takes N optimizer steps per rollout
# batch (32 / N prompts per mini-batch).
_MB = {n: [f"rl.mini_batch_prompts={32 // n}"] for n in (1, 2, 4, 8, 16)}
LONG_TASK = {"task_terms": 10, "task_max_terms": 20, "task_max_digit": 3, "max_new_tokens": 200}
LONG_TASK.update(max_prompt_length=96, sft_seq_length=2048, sft_steps=300, sft_examples=8000)
REGIMES = {
    "mb1": ({}, _MB[1] + ["optim.lr=3e-4"]),
    "mb2": ({}, _MB[2] + ["optim.lr=3e-4"]),
    "mb4": ({}, _MB[4] + ["optim.lr=3e-4"]),
    "mb8": ({}, _MB[8] + ["optim.lr=3e-4"]),
    "mb16": ({}, _MB[16] + ["optim.lr=3e-4"]),
    "mb4-lr1e-4": ({}, _MB[4] + ["optim.lr=1e-4"]),
    "mb4-lr1e-3": ({}, _MB[4] + ["optim.lr=1e-3"]),
    "mb8-lr1e-4": ({}, _MB[8] + ["optim.lr=1e-4"]),
    "mb16-lr1e-4": ({}, _MB[16] + ["optim.lr=1e-4"]),
    "mb16-lr1.5e-4": ({}, _MB[16] + ["optim.lr=1.5e-4"]),
    "mb16-lr2e-4": ({}, _MB[16] + ["optim.lr=2e-4"]),
    "mb1-bf16": ({}, _MB[1] + ["optim.lr=3e-4", "rollout.dtype=bf16"]),
    "mb4-bf16": ({}, _MB[4] + ["optim.lr=3e-4", "rollout.dtype=bf16"]),
    "long-mb1": (LONG_TASK, _MB[1] + ["optim.lr=3e-4"]),
    "long-mb4": (LONG_TASK, _MB[4] + ["optim.lr=3e-4"]),
    "long-mb2-lr1e-4": (LONG_TASK, _MB[2] + ["optim.lr=1e-4"]),
    "long-mb4-lr1e-4": (LONG_TASK, _MB[4] + ["optim.lr=1e-4"]),
}
# The comparison: name -> RL overrides on top of the regime's (alpha 0.1 unless said otherwise).
VARIANTS = {
    "gppo": ["rl.algo=gppo"],
    "gppo_b05": ["rl.algo=gppo", "rl.beta1=0.5"],
    "ce_gppo": ["rl.algo=gppo", "rl.beta1=0.75", "rl.beta2=1.0"],
    "clip_higher": ["rl.algo=clip_higher"],
    "cispo": ["rl.algo=cispo"],
    "ppo": ["rl.algo=ppo"],
    "gspo": ["rl.algo=gspo", "rl.agg=seq_mean_token_mean"],
    "dppo_tv": ["rl.algo=dppo_tv"],
    "gppo_no_nll": ["rl.algo=gppo", "rl.nll_coef=0.0"],
}
LABELS = {
    "gppo": "GPPO (paper)",
    "gppo_b05": "GPPO beta1 0.5",
    "ce_gppo": "CE-GPPO (beta1 0.75)",
    "clip_higher": "clip-higher (DAPO)",
    "cispo": "CISPO",
    "ppo": "PPO clip",
    "gspo": "GSPO",
    "dppo_tv": "DPPO (TV)",
    "gppo_no_nll": "GPPO, alpha = 0",
}
# per-step metrics kept from every run (the RL loop's names)
KEPT = (
    "rollout/accuracy",
    "rollout/response_length_mean",
    "actor/entropy",
    "actor/clip_frac_low",
    "actor/clip_frac_high",
    "actor/clip_frac_dual",
    "actor/outside_frac",
    "actor/log_ratio_abs_mean",
    "actor/log_ratio_abs_max",
    "actor/is_ess_frac",
    "actor/neg_log_ratio_mean",
    "actor/behav_outside_frac",
    "actor/logprob_mismatch_mean",
    "actor/grad_norm",
    "actor/optimizer_steps",
)


# -- one run (in a worker process) -------------------------------------------------------------------
def run_one(spec: dict, files: dict, out: str) -> dict:
    """One RL run with held-out evaluations; writes ``<out>/runs/<name>.json`` (atomically)."""
    import torch

    torch.set_num_threads(1)
    from megatron_klear.config import load_config
    from megatron_klear.data.prompts import PromptDataset
    from megatron_klear.demo_recipe import Settings, rl_overrides
    from megatron_klear.evaluation import evaluate
    from megatron_klear.rl.loop import RLLoop
    from megatron_klear.rollout.base import SamplingParams
    from megatron_klear.utils import atomic

    s = Settings(**spec["settings"])
    save_dir = os.path.join(out, "rl", spec["name"].replace("/", "-"))
    overrides = rl_overrides(s, files["sft"], save_dir, prompts=files["prompts"], tp=1)
    overrides += [f"train.seed={spec['seed']}"]
    overrides += ["train.overwrite=true", "train.resume=false", "train.save_interval=0", *spec["overrides"]]
    overrides += [f"optim.min_lr={o.split('=', 1)[1]}" for o in spec["overrides"] if o.startswith("optim.lr=")]
    loop = RLLoop(load_config(None, overrides))
    bench = {
        "heldout": PromptDataset([files["heldout"]], loop.tokenizer, max_prompt_length=s.max_prompt_length).prompts
    }
    if s.eval_prompts:
        bench["heldout"] = bench["heldout"][: s.eval_prompts]
    params = SamplingParams(temperature=s.temperature, max_new_tokens=s.max_new_tokens, seed=1000 + spec["seed"])

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

    t0 = time.time()
    curve, metrics = [(0, _start_value(out, files["sft"], spec["seed"], s, heldout))], []
    while loop.rl_step < loop.steps:
        m = loop.step()
        loop.job_run.logger.log(loop.rl_step, m, console_keys=("rollout/accuracy", "actor/outside_frac"))
        metrics.append({"step": loop.rl_step, **{k: m[k] for k in KEPT if isinstance(m.get(k), (int, float))}})
        if loop.rl_step % spec["eval_every"] == 0 or loop.rl_step == loop.steps:
            curve.append((loop.rl_step, heldout()))
            print(f"[{spec['name']}] step {loop.rl_step}: held-out avg@{s.eval_k} {curve[-1][1]:.1f}%", flush=True)
    loop.close()
    result = {**spec, "heldout_curve": curve, "metrics": metrics, "seconds": time.time() - t0}
    with atomic.atomic_file(_run_path(out, spec["name"])) as f:
        json.dump(result, f)
    return result


def _start_value(out: str, sft: str, seed: int, s, measure) -> float:
    """The held-out value at step 0: the SFT model's, the same for every variant of a seed (same
    weights, same evaluation seed), measured once and kept in ``<out>/start/``."""
    import hashlib

    from megatron_klear.utils import atomic

    key = json.dumps([os.path.abspath(sft), seed, s.eval_prompts, s.eval_k, s.max_new_tokens, s.temperature])
    path = os.path.join(out, "start", hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")
    if os.path.exists(path):
        return json.load(open(path))["value"]
    value = measure()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with atomic.atomic_file(path) as f:
        json.dump({"key": key, "value": value}, f)
    return value


def _run_path(out: str, name: str) -> str:
    return os.path.join(out, "runs", name.replace("/", "-") + ".json")


# -- the driver ---------------------------------------------------------------------------------------
def build_sft(out: str, settings) -> dict:
    """The demo's SFT model (no parity check) and its data files, built once per task."""
    from benchmarks.demo_sft_model import build_sft_model

    out = os.path.abspath(out)
    files = {"sft": f"{out}/hf-sft", "heldout": f"{out}/heldout.jsonl", "prompts": f"{out}/rl-prompts.jsonl"}
    if not all(os.path.exists(p) for p in files.values()):
        build_sft_model(settings, out)
    return files


def run_all(specs: list, files_of, out: str, parallel: int) -> list:
    """Every spec not already written, ``parallel`` worker processes at a time (a spec list per
    worker in ``--quick``); returns every spec's result."""
    from megatron_klear.utils.progress import format_seconds

    todo = [s for s in specs if not os.path.exists(_run_path(out, s["name"]))]
    if len(todo) < len(specs):
        print(f"  resuming: {len(specs) - len(todo)} of {len(specs)} runs already done", flush=True)
    groups = [[s] for s in todo] if parallel else [todo] if todo else []
    logs = os.path.join(out, "logs")
    os.makedirs(logs, exist_ok=True)
    running, done, t0 = [], 0, time.time()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    while groups or running:
        while groups and len(running) < max(parallel, 1):
            group = groups.pop(0)
            job = {"specs": group, "files": {s["name"]: files_of(s) for s in group}, "out": out}
            log = open(os.path.join(logs, group[0]["name"].replace("/", "-") + ".log"), "w")
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(job)]
            running.append((group, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        time.sleep(0.5)
        for item in list(running):
            group, proc, log = item
            if proc.poll() is None:
                continue
            running.remove(item)
            log.close()
            if proc.returncode != 0:
                raise RuntimeError(f"run {group[0]['name']} failed (exit {proc.returncode}); see {log.name}")
            done += len(group)
            left = len(todo) - done
            eta = left * (time.time() - t0) / done
            curve = json.load(open(_run_path(out, group[-1]["name"])))["heldout_curve"]
            print(
                f"  {group[-1]['name']}: held-out {curve[0][1]:.1f}% -> {curve[-1][1]:.1f}%  "
                f"[{done}/{len(todo)} runs, ETA {format_seconds(eta)}]",
                flush=True,
            )
    return [json.load(open(_run_path(out, s["name"]))) for s in specs]


# -- what the runs show -----------------------------------------------------------------------------
def _series(run: dict, key: str) -> list:
    return [(m["step"], m[key]) for m in run["metrics"] if key in m]


def _mean_of(run: dict, key: str, skip_first: bool = False) -> float | None:
    values = [v for s, v in _series(run, key) if not (skip_first and s == 1)]
    return statistics.fmean(values) if values else None


def sweep_table(runs: list) -> str:
    """The regime table: per lever, the means over its RL steps."""
    lines = [
        "| regime | mini-batches | lr | engine | response tokens | outside clip range | clipped low / high "
        "| mean / max abs log r | IS ESS | engine-trainer abs log r / outside | rollout acc. first -> last "
        "| held-out start -> end |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        o = " ".join(r["overrides"])
        mb = 32 // int(o.split("rl.mini_batch_prompts=")[1].split()[0])
        lr = o.split("optim.lr=")[1].split()[0]
        engine = "bf16" if "rollout.dtype=bf16" in o else "fp32"
        acc = [v for _, v in _series(r, "rollout/accuracy")]
        get = lambda k, r=r: _mean_of(r, k) or 0.0  # noqa: E731
        behav = _mean_of(r, "actor/behav_outside_frac")
        lines.append(
            f"| {r['regime']} | {mb} | {lr} | {engine} | {get('rollout/response_length_mean'):.0f} | "
            f"{100 * get('actor/outside_frac'):.2f}% | {100 * get('actor/clip_frac_low'):.2f}% / "
            f"{100 * get('actor/clip_frac_high'):.2f}% | {get('actor/log_ratio_abs_mean'):.4f} / "
            f"{max(v for _, v in _series(r, 'actor/log_ratio_abs_max')):.2f} | {get('actor/is_ess_frac'):.3f} | "
            f"{get('actor/logprob_mismatch_mean'):.1e} / {'-' if behav is None else f'{100 * behav:.2f}%'} | "
            f"{100 * acc[0]:.1f} -> {100 * acc[-1]:.1f} | "
            f"{r['heldout_curve'][0][1]:.1f} -> {r['heldout_curve'][-1][1]:.1f} |"
        )
    return "\n".join(lines)


def sweep_plots(runs: list, plots: str) -> list:
    """Per regime, the per-step share of tokens outside the clip range and the rollout accuracy."""
    from megatron_klear.utils.plots import line_chart

    return [
        line_chart(
            os.path.join(plots, f"{key.split('/')[-1]}.png"),
            {r["regime"]: _series(r, key) for r in runs if _series(r, key)},
            title=title,
            xlabel="RL step",
            markers=False,
        )
        for key, title in (
            ("actor/outside_frac", "Tokens with r outside [1 - eps_low, 1 + eps_high], per regime (GPPO)"),
            ("rollout/accuracy", "Rollout accuracy on training problems (T=1.0), per regime"),
        )
    ]


def compare_summary(runs: list, baseline: str = "gppo") -> dict:
    """variant -> seeds, finals and areas (by seed), their means and 95% intervals, the pairing
    with ``baseline``, and the per-step mechanism curves (means over seeds)."""
    from megatron_klear.utils.stats import area_under_curve, bootstrap_interval, paired_comparison

    out = {}
    for v in dict.fromkeys(r["variant"] for r in runs):
        mine = sorted((r for r in runs if r["variant"] == v), key=lambda r: r["seed"])
        final = {r["seed"]: r["heldout_curve"][-1][1] for r in mine}
        area = {r["seed"]: area_under_curve(r["heldout_curve"]) for r in mine}
        curves = {}
        for key in KEPT:
            by_step = {}
            for r in mine:
                for s, x in _series(r, key):
                    by_step.setdefault(s, []).append(x)
            if by_step:
                curves[key] = sorted((s, statistics.fmean(x)) for s, x in by_step.items())
        steps = [s for s, _ in mine[0]["heldout_curve"]]
        held = [[dict(r["heldout_curve"]).get(s) for r in mine] for s in steps]
        out[v] = {
            "seeds": [r["seed"] for r in mine],
            "final": final,
            "area": area,
            "final_mean": statistics.fmean(final.values()),
            "final_ci": bootstrap_interval(list(final.values())),
            "area_mean": statistics.fmean(area.values()),
            "area_ci": bootstrap_interval(list(area.values())),
            "collapsed": sum(x < 0.5 * r["heldout_curve"][0][1] for r, x in zip(mine, final.values())),
            "heldout": {
                "steps": steps,
                "mean": [statistics.fmean(h) for h in held],
                "min": [min(h) for h in held],
                "max": [max(h) for h in held],
            },
            "curves": curves,
            "minutes": statistics.fmean(r["seconds"] for r in mine) / 60,
        }
    base = out.get(baseline)
    for v, a in out.items():
        if base is None or v == baseline:
            continue
        common = sorted(set(a["final"]) & set(base["final"]))
        if len(common) >= 2:
            a["vs_baseline"] = {
                key: paired_comparison([a[key][s] for s in common], [base[key][s] for s in common]).__dict__
                for key in ("final", "area")
            }
    return out


def compare_table(summary: dict, baseline: str = "gppo") -> str:
    lines = [
        "| variant | seeds | held-out at the end, mean [95% CI] | area under the curve [95% CI] | "
        f"end - {LABELS[baseline]} (paired) [95% CI], p | area - {LABELS[baseline]} [95% CI], p | "
        "clipped low / high | entropy at the end | collapsed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for v, a in summary.items():
        pair = a.get("vs_baseline")
        fmt = lambda p: f"{p['mean']:+.1f} [{p['low']:+.1f}, {p['high']:+.1f}], {p['p_value']:.2f}"  # noqa: E731
        clip = lambda k, a=a: statistics.fmean(x for _, x in a["curves"].get(k, [(0, 0.0)]))  # noqa: E731
        ent = a["curves"].get("actor/entropy", [(0, float("nan"))])[-1][1]
        lines.append(
            f"| {LABELS.get(v, v)} | {len(a['seeds'])} | {a['final_mean']:.1f} [{a['final_ci'][0]:.1f}, "
            f"{a['final_ci'][1]:.1f}] | {a['area_mean']:.1f} [{a['area_ci'][0]:.1f}, {a['area_ci'][1]:.1f}] | "
            f"{fmt(pair['final']) if pair else '-'} | {fmt(pair['area']) if pair else '-'} | "
            f"{100 * clip('actor/clip_frac_low'):.2f}% / {100 * clip('actor/clip_frac_high'):.2f}% | {ent:.3f} | "
            f"{a['collapsed']}/{len(a['seeds'])} |"
        )
    return "\n".join(lines)


def compare_plots(summary: dict, plots: str) -> list:
    from megatron_klear.utils.plots import band_chart, interval_chart, line_chart

    label = lambda v: LABELS.get(v, v)  # noqa: E731
    written = [
        band_chart(
            os.path.join(plots, "heldout.png"),
            {
                label(v): (a["heldout"]["steps"], a["heldout"]["mean"], a["heldout"]["min"], a["heldout"]["max"])
                for v, a in summary.items()
            },
            title="Held-out avg@8 (T=1.0): mean, min-max band over seeds",
            xlabel="RL step",
            ylabel="avg@8 (%)",
        )
    ]
    written.append(
        interval_chart(
            os.path.join(plots, "final.png"),
            {label(v): (a["final_ci"][0], a["final_mean"], a["final_ci"][1]) for v, a in summary.items()},
            title="Held-out avg@8 at the end: mean and 95% bootstrap interval over seeds",
            xlabel="avg@8 (%)",
        )
    )
    paired = {label(v): a["vs_baseline"]["final"] for v, a in summary.items() if "vs_baseline" in a}
    if paired:
        written.append(
            interval_chart(
                os.path.join(plots, "paired.png"),
                {k: (p["low"], p["mean"], p["high"]) for k, p in paired.items()},
                title=f"Each variant minus {LABELS['gppo']}, paired by seed (95% interval)",
                xlabel="held-out avg@8 difference (points)",
                reference=0.0,
            )
        )
    for key, title in (
        ("actor/entropy", "Policy entropy (nats/token)"),
        ("actor/clip_frac_low", "Clipped below (r < 1 - eps_low, A < 0): GPPO keeps a bounded gradient"),
        ("actor/clip_frac_high", "Clipped above (r > 1 + eps_high, A > 0): GPPO keeps a bounded gradient"),
        ("actor/outside_frac", "Tokens with r outside the rule's range"),
        ("actor/neg_log_ratio_mean", "Mean log r of negative-advantage tokens (falls as they are pushed down)"),
        ("rollout/accuracy", "Rollout accuracy on training problems (T=1.0)"),
    ):
        series = {label(v): a["curves"][key] for v, a in summary.items() if key in a["curves"]}
        if series:
            name = key.split("/")[-1]
            written.append(
                line_chart(os.path.join(plots, f"{name}.png"), series, title=title, xlabel="RL step", markers=False)
            )
    return written


# -- commands ---------------------------------------------------------------------------------------
def _settings(values: dict):
    from megatron_klear.demo_recipe import Settings

    return Settings(**values)


def _meta(t0: float) -> str:
    return (
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
        f"{(time.time() - t0) / 60:.0f} min"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", choices=("sweep", "compare"), default="compare")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-algos"))
    p.add_argument("--quick", action="store_true", help="every variant one step on the quick demo's sizes")
    p.add_argument("--regime", default="mb4", help=f"compare: one of {', '.join(REGIMES)}")
    p.add_argument("--regimes", default=",".join(REGIMES), help="sweep: comma-separated")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (sweep: 6, compare: 20)")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--eval-prompts", type=int, default=64, help="held-out problems per evaluation")
    p.add_argument("--parallel", type=int, default=2, help="runs side by side (one CPU thread each)")
    p.add_argument("--sft", default=None, help="HF SFT model of the default task (default: build the demo's)")
    p.add_argument("--heldout", default=None)
    p.add_argument("--prompts", default=None)
    p.add_argument("--results-md", default=None, help="append the tables to this markdown file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        job = json.loads(args.worker)
        for spec in job["specs"]:
            run_one(spec, job["files"][spec["name"]], job["out"])
        return 0
    from megatron_klear.demo_recipe import QUICK

    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    base = dict(QUICK) if args.quick else {}
    base.update(eval_prompts=args.eval_prompts if not args.quick else 6)
    sft_cache: dict = {}

    def files_of(spec) -> dict:
        task = {k: v for k, v in spec["settings"].items() if k in LONG_TASK and k.startswith("task_")}
        key = json.dumps(task, sort_keys=True)
        if key not in sft_cache:
            if not task and args.sft:
                sft_cache[key] = {
                    "sft": os.path.abspath(args.sft),
                    "heldout": os.path.abspath(args.heldout),
                    "prompts": os.path.abspath(args.prompts),
                }
            else:
                where = os.path.join(args.out, "sft-long" if task else "sft")
                print(f"building the SFT model in {where} ...", flush=True)
                long = {k: v for k, v in LONG_TASK.items() if task}
                sft_cache[key] = build_sft(where, _settings({**base, **long, "eval_prompts": 128}))
        return sft_cache[key]

    def spec(name, regime, variant, seed, steps, eval_every):
        settings, overrides = REGIMES[regime]
        if args.quick:  # two prompts per step: one per mini-batch (two optimizer steps, off-policy)
            overrides = [
                o if not o.startswith("rl.mini_batch_prompts=") else "rl.mini_batch_prompts=1" for o in overrides
            ]
        return {
            "name": name,
            "regime": regime,
            "variant": variant,
            "seed": seed,
            "settings": {**base, **settings, "rl_steps": steps},
            "eval_every": eval_every,
            "overrides": overrides + VARIANTS[variant],
        }

    if args.command == "sweep":
        regimes = [r for r in args.regimes.split(",") if r]
        unknown = set(regimes) - set(REGIMES)
        if unknown:
            p.error(f"unknown regimes {sorted(unknown)}; choose from {', '.join(REGIMES)}")
        steps = args.steps or (1 if args.quick else 6)
        specs = [spec(f"sweep/{r}", r, "gppo", 1, steps, steps) for r in regimes]
        for s in specs:
            files_of(s)  # the SFT models first, one at a time
        runs = run_all(specs, files_of, args.out, 0 if args.quick else args.parallel)
        plots = sweep_plots(runs, os.path.join(args.out, "plots", f"sweep-{steps}"))
        text = (
            f"**Where clipping bites** ({_meta(t0)}; `benchmarks/algos.py sweep`): GPPO, {steps} RL steps "
            "of 32 prompts x 8 responses per regime, seed 1; means over the steps.\n\n"
            + sweep_table(runs)
            + "\n\nPlots: "
            + ", ".join(f"`{os.path.relpath(x, ROOT)}`" for x in plots)
        )
        name = "sweep"
    else:
        variants = [v for v in args.variants.split(",") if v]
        unknown = set(variants) - set(VARIANTS)
        if unknown:
            p.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
        if args.regime not in REGIMES:
            p.error(f"unknown regime {args.regime!r}; choose from {', '.join(REGIMES)}")
        seeds = 1 if args.quick else args.seeds
        steps = args.steps or (1 if args.quick else 20)
        eval_every = 1 if args.quick else args.eval_every
        specs = [
            spec(f"{args.regime}/{v}/s{seed}", args.regime, v, seed, steps, eval_every)
            for seed in range(1, seeds + 1)
            for v in variants
        ]
        files_of(specs[0])
        runs = run_all(specs, files_of, args.out, 0 if args.quick else args.parallel)
        summary = compare_summary(runs)
        plots = compare_plots(summary, os.path.join(args.out, "plots", args.regime))
        with open(os.path.join(args.out, f"compare-{args.regime}.json"), "w") as f:
            json.dump(summary, f, indent=1)
        text = (
            f"**GPPO and its rivals, regime {args.regime}** ({_meta(t0)}; `benchmarks/algos.py compare "
            f"--regime {args.regime} --seeds {seeds}`): {steps} RL steps, held-out avg@8 at T=1.0 on "
            f"{base['eval_prompts']} problems every {eval_every} steps; intervals: percentile bootstrap over "
            "seeds; paired: the same seeds, sign-flip p-value.\n\n"
            + compare_table(summary)
            + "\n\nPlots: "
            + ", ".join(f"`{os.path.relpath(x, ROOT)}`" for x in plots)
        )
        name = f"compare-{args.regime}"
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(text + "\n")
    print("\n" + text)
    if args.results_md:
        with open(args.results_md, "a") as f:
            f.write("\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
