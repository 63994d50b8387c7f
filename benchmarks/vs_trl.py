"""This project against a peer on the same work: TRL's ``GRPOTrainer`` (trl 1.16) and the project's
RL command, from the demo's SFT model, with the demo's RL budget and the project's math grader as
TRL's reward function.

    python benchmarks/vs_trl.py                        # builds the demo's SFT model, 3 pairs x 3 seeds
    python benchmarks/vs_trl.py --sft runs/demo/hf-sft --prompts runs/demo/rl-prompts.jsonl \\
        --heldout runs/demo/heldout.jsonl              # from an existing SFT model
    python benchmarks/vs_trl.py --quick                # every stage at tiny sizes (the test suite)
    python benchmarks/vs_trl.py --shape qwen3-0.6b     # where compute dominates (~50 minutes on 2 cores)

Pairs (the same rule on both sides, ``PAIRS``):

* ``clip_higher``: the project's ``rl.algo=clip_higher`` (no dual clip, no NLL term, no group
  filter) against TRL's ``loss_type="dapo"`` (eps 0.2 / 0.28): the same loss, normaliser included
  (tests/rl/test_losses_vs_trl.py checks it);
* ``cispo``: ``rl.algo=cispo`` against TRL's ``cispo`` (TRL's ``epsilon_high`` = 1 + ours);
* ``recipe``: the project's recipe as the demo ships it (GPPO, dynamic sampling over 40 prompts,
  alpha = 0.1 NLL) against TRL's defaults (``dapo`` with eps 0.2 / 0.2, every group trained).

The same budget on both sides: steps, 32 prompts x 8 responses per step, one optimizer step per RL
step on all of them, 40 new tokens at temperature 1, lr 3e-4 constant, Adam (0.9, 0.999, 1e-8), no
weight decay, gradient clip 1.0, fp32 (TRL's bf16 autocast off), the same processes (``--nproc``,
default 1: TRL's one process; the project at TP = nproc) and the same torch threads. Generation:
the project's embedded engine; TRL's transformers ``generate``.

Printed per pair: trained samples per second (trained samples over the wall time from the command to
its exit, start-up and saves included), the step split (generation, grading, training, weight sync;
medians over the steps), held-out avg@8 of the SFT model and of each run's checkpoints (the
project's evaluation, the demo's: ``megatron_klear/demo_recipe.py``, on both models), the ratio of samples/s and the
difference in held-out gain with its seed spread. Written: ``<out>/details.json``, ``<out>/results.md``,
``<out>/heldout_vs_samples.png`` and ``<out>/heldout_vs_seconds.png``.

``--shape qwen3-0.6b``: the same comparison where compute dominates, on a random-weight checkpoint of
Qwen3-0.6B's architecture (benchmarks/journey.py builds it: vocabulary 151,936, 28 layers, GQA 16/8
of 128, tied embeddings; ``--layers`` fewer): ``--steps`` (3) steps of 2 prompts x 8 responses of 64
new tokens (the random model seldom samples an end token: every response runs to 64), the
``clip_higher`` pair, each side in fp32 and in bf16 (TRL: ``bf16=True``, autocast over fp32 weights;
the project: ``model.dtype=bf16``, fp32 main weights in the optimizer, and the engine in bf16), the
project in its fastest shipped layout (one process, two threads) and the demo's (TP=2 under the
launcher, one thread a rank). Printed: samples/s from the command to its exit and per step (the
median step), the step split, and each project layout's ratio against TRL's faster dtype. No
held-out evaluation: the weights are random, only the figures mean something.
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

PROJECT_RULE = ["rl.dual_clip=null", "rl.nll_coef=0.0", "rl.filter_zero_spread=false", "rl.oversample_prompts=0"]
PAIRS = {  # name -> (project overrides on top of the demo's RL settings, TRL GRPOConfig settings)
    "clip_higher": (
        ["rl.algo=clip_higher", "rl.eps_low=0.2", "rl.eps_high=0.28", *PROJECT_RULE],
        {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28},
    ),
    "cispo": (["rl.algo=cispo", "rl.eps_high=0.28", *PROJECT_RULE], {"loss_type": "cispo", "epsilon_high": 1.28}),
    "recipe": ([], {}),
}


# -- TRL's side (a worker process) ------------------------------------------------------------------
def trl_worker(args) -> None:
    """One GRPOTrainer run; writes <run>/trl.json (step times) and checkpoints every --eval-every steps."""
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_klear.data.chat import generation_stop_ids, load_tokenizer
    from megatron_klear.data.prompts import PromptDataset
    from megatron_klear.rewards import GradingPool, RewardConfig
    from megatron_klear.rl.rollout.sampling import grading_text

    t_start = float(args.t_start)
    tok = load_tokenizer(args.sft)
    prompts = PromptDataset([args.prompts], tok, max_prompt_length=64, seed=args.seed).prompts
    by_text = {tok.decode(p.prompt_ids, skip_special_tokens=False): p for p in prompts}
    stop_ids = generation_stop_ids(tok, args.sft)
    timings = {"grade_s": []}
    pool = GradingPool(RewardConfig(workers=1))

    def math_reward(prompts, completion_ids, **kw):
        """The project's grader on the decoded completion ids (TRL's ``completions`` drop special
        tokens, and with them the <think> tags the grader scores)."""
        t0 = time.time()
        futures = []
        for prompt, ids in zip(prompts, completion_ids):
            futures.append(pool.submit(by_text[prompt].grade_item(grading_text(tok, ids, stop_ids))))
        rewards = [f.result().reward for f in futures]
        timings["grade_s"].append(time.time() - t0)
        return rewards

    model = AutoModelForCausalLM.from_pretrained(args.sft, dtype=torch.float32)
    model.generation_config.eos_token_id = stop_ids  # responses end at the end-of-turn token too
    pair = PAIRS[args.pair][1]
    config = GRPOConfig(
        output_dir=args.run,
        seed=args.seed,
        max_steps=args.steps,
        per_device_train_batch_size=args.prompts_per_step * 8,
        num_generations=8,
        gradient_accumulation_steps=1,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        bf16=args.trl_bf16,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="steps",
        save_steps=args.eval_every,
        save_only_model=True,
        **pair,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=math_reward,
        args=config,
        train_dataset=Dataset.from_list([{"prompt": text} for text in by_text]),
        processing_class=tok,
    )
    steps = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            self.t0 = time.time()

        def on_step_end(self, *a, **kw):
            steps.append({"step_s": time.time() - self.t0, "t": time.time() - t_start})

    generate = trainer._generate_and_score_completions
    gen_s = []

    def timed_generate(*a, **kw):  # generation and grading, as TRL runs them before its update
        t0 = time.time()
        out = generate(*a, **kw)
        gen_s.append(time.time() - t0)
        return out

    trainer._generate_and_score_completions = timed_generate
    trainer.add_callback(StepTimes())
    trainer.train()
    pool.close()
    for i, st in enumerate(steps):
        grade = timings["grade_s"][i] if i < len(timings["grade_s"]) else 0.0
        st.update(generate_s=gen_s[i] - grade, grade_s=grade, train_s=st["step_s"] - gen_s[i], sync_s=0.0)
    with open(os.path.join(args.run, "trl.json"), "w") as f:
        json.dump({"steps": steps, "seconds": time.time() - t_start}, f)


# -- the project's side -----------------------------------------------------------------------------
def project_run(args, settings, files, pair: str, seed: int, run: str, layout: tuple, dtype: str) -> dict:
    """The project's RL command (its launcher, as a user runs it) with ``layout`` = (processes,
    threads each: TP = processes) in ``dtype``; returns its step log."""
    from megatron_klear.demo_recipe import rl_overrides

    nproc, threads = layout
    overrides = rl_overrides(settings, files["sft"], run, prompts=files["prompts"], tp=nproc)
    overrides += [
        f"train.seed={seed}",
        f"train.save_interval={args.eval_every}",
        *PAIRS[pair][0],
    ]
    if dtype == "bf16":  # the trainer's weights and the embedded engine's (fp32 main weights stay in the optimizer)
        overrides += ["model.dtype=bf16", "rollout.dtype=bf16"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    t0 = time.time()
    # one process: plain python, as TRL's side runs (the package starts a world of one without a
    # launcher); more: the project's launcher, as torchrun
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "megatron_klear.platform.launch", "--nproc-per-node", str(nproc)]
    with open(os.path.join(os.path.dirname(run), os.path.basename(run) + ".log"), "w") as log:
        subprocess.run(
            [*cmd, "-m", "megatron_klear", "rl", *overrides], cwd=ROOT, env=env, stdout=log, stderr=log, check=True
        )
    return project_result(run, time.time() - t0)


def project_result(run: str, seconds: float) -> dict:
    """A finished project run's step log (its ``metrics.jsonl``) with ``seconds`` from the command to
    its exit."""
    steps = []
    with open(os.path.join(run, "metrics.jsonl")) as f:
        for line in f:
            m = json.loads(line)
            if "time/step_s" in m:
                steps.append(
                    {
                        "step_s": m["time/step_s"],
                        "generate_s": m.get("time/generate_s", 0.0),
                        "grade_s": m.get("time/grade_tail_s", 0.0),
                        "train_s": m.get("time/train_s", 0.0),
                        "sync_s": m.get("time/weight_sync_s", 0.0),
                        "samples": m.get("rollout/samples_trained", 0),
                    }
                )
    t = seconds - sum(s["step_s"] for s in steps)  # start-up; the step times follow it
    for s in steps:
        t += s["step_s"]
        s["t"] = t
    return {"steps": steps, "seconds": seconds}


def checkpoints(run: str, framework: str) -> dict:
    """step -> an HF model directory of that step's weights."""
    out = {}
    for name in sorted(os.listdir(run)):
        path = os.path.join(run, name)
        if framework == "trl" and name.startswith("checkpoint-"):
            out[int(name.split("-")[1])] = path
        elif framework == "project" and name.startswith("iter_"):
            hf = path + "-hf"
            if not os.path.isdir(hf):
                subprocess.run(
                    [sys.executable, "tools/convert_megatron_to_hf.py", "--ckpt", path, "--out", hf],
                    cwd=ROOT,
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
            out[int(name[5:])] = hf
    return out


def heldout(settings, files: dict, model_dir: str, results: str) -> float:
    """The demo's held-out avg@k of ``model_dir`` (``results``: its evaluation's record)."""
    from megatron_klear.demo_recipe import evaluate_heldout

    say = lambda line: print(f"    {line}", flush=True)  # noqa: E731
    return evaluate_heldout(settings, model_dir, files["heldout"], results, say=say)["heldout_avg@8"]


# -- the driver ---------------------------------------------------------------------------------------
def prepare(args, settings) -> dict:
    if args.sft:
        return {"sft": args.sft, "prompts": args.prompts, "heldout": args.heldout}
    out = os.path.abspath(os.path.join(args.out, "sft"))
    if args.shape != "demo":  # a random-weight checkpoint of the real architecture
        from benchmarks.journey import qwen3_0_6b
        from megatron_klear.data.synthetic import write_rl_prompts_jsonl
        from megatron_klear.models.tiny import make_tiny_model

        sft = os.path.join(out, f"hf-{args.shape}-{args.layers}l")
        if not os.path.exists(os.path.join(sft, "config.json")):
            print(f"building {args.shape} ({args.layers} layers, random weights) in {sft}", flush=True)
            make_tiny_model(sft, **qwen3_0_6b(args.layers))
        write_rl_prompts_jsonl(f"{out}/rl-prompts.jsonl", 64, seed=1)
        return {"sft": sft, "prompts": f"{out}/rl-prompts.jsonl", "heldout": None}
    if args.quick:  # a random tiny model stands in for the SFT stage (the demo's --quick covers it)
        from megatron_klear.data.synthetic import write_rl_prompts_jsonl
        from megatron_klear.models.tiny import make_tiny_qwen3

        os.makedirs(out, exist_ok=True)
        sft = make_tiny_qwen3(os.path.join(out, "hf-sft"), num_layers=2, hidden_size=64, flavor="base")
        write_rl_prompts_jsonl(f"{out}/rl-prompts.jsonl", 64, seed=1)
        write_rl_prompts_jsonl(f"{out}/heldout.jsonl", settings.eval_prompts, seed=0, split="heldout")
    else:
        from benchmarks.demo_sft_model import build_sft_model

        sft = build_sft_model(settings, out)
    return {"sft": sft, "prompts": f"{out}/rl-prompts.jsonl", "heldout": f"{out}/heldout.jsonl"}


def side(r: dict) -> str:
    """A run's side: ``project`` / ``trl``, with its layout and dtype when the runs vary them."""
    return r["framework"] + (f" {r['layout']} {r['dtype']}" if r.get("variant") else "")


def summarize(runs: list, baseline: float | None) -> dict:
    """pair -> side -> per-seed figures and their means; the project's fastest side against TRL's
    (``ratio``), every project side's ratio (``ratios``) and the held-out gain difference."""
    table = {}
    for r in runs:
        table.setdefault(r["pair"], {}).setdefault(side(r), []).append(r)
    out = {}
    for pair, sides in table.items():
        row = {}
        for name, rs in sides.items():
            row[name] = {
                "samples_per_s": [r["samples"] / r["seconds"] for r in rs],
                # per step: the median step's trained samples over its time (start-up and saves not counted)
                "step_samples_per_s": statistics.median(s["samples"] / s["step_s"] for r in rs for s in r["steps"]),
                "seconds": [r["seconds"] for r in rs],
                "split": {
                    k: statistics.median(s[k] for r in rs for s in r["steps"])
                    for k in ("generate_s", "grade_s", "train_s", "sync_s", "step_s")
                },
            }
            if baseline is not None:
                row[name]["gain"] = [r["heldout"][-1][1] - baseline for r in rs]
                row[name]["final"] = [r["heldout"][-1][1] for r in rs]
        fastest = {
            fw: max((n for n in row if n.split()[0] == fw), key=lambda n: statistics.fmean(row[n]["samples_per_s"]))
            for fw in ("project", "trl")
            if any(n.split()[0] == fw for n in row)
        }
        if len(fastest) == 2:
            p, t = row[fastest["project"]], row[fastest["trl"]]
            row["fastest"] = fastest
            row["ratio"] = statistics.fmean(p["samples_per_s"]) / statistics.fmean(t["samples_per_s"])
            row["ratios"] = {
                n: {
                    "run": statistics.fmean(row[n]["samples_per_s"]) / statistics.fmean(t["samples_per_s"]),
                    "step": row[n]["step_samples_per_s"] / t["step_samples_per_s"],
                }
                for n in list(row)
                if n.split()[0] == "project"
            }
            if baseline is not None:
                diffs = [a - b for a, b in zip(p["gain"], t["gain"])]
                row["gain_diff"] = statistics.fmean(diffs)
                row["gain_diff_spread"] = (min(diffs), max(diffs))
        out[pair] = row
    return out


def table(summary: dict, baseline: float | None) -> str:
    f = lambda xs: " / ".join(f"{x:.0f}" if x >= 10 else f"{x:.2f}" for x in xs)  # noqa: E731
    g = lambda xs: " / ".join(f"{x:.1f}" for x in xs)  # noqa: E731
    lines = [
        f"SFT model held-out avg@k: {baseline:.1f}%"
        if baseline is not None
        else "random weights: no held-out evaluation",
        "",
        "| pair | side | samples/s, command to exit (per seed) | samples/s, median step "
        "| step s: generate / grade / train / sync | held-out avg@k after (per seed) |",
        "|---|---|---|---|---|---|",
    ]
    for pair, row in summary.items():
        for name, fig in row.items():
            if not isinstance(fig, dict) or "split" not in fig:
                continue
            sp = fig["split"]
            split = f"{sp['generate_s']:.2f} / {sp['grade_s']:.2f} / {sp['train_s']:.2f} / {sp['sync_s']:.2f}"
            held = g(fig["final"]) if "final" in fig else "-"
            lines.append(
                f"| {pair} | {name} | {f(fig['samples_per_s'])} | {f([fig['step_samples_per_s']])} | {split} | {held} |"
            )
        if "ratio" in row:
            gain = ""
            if "gain_diff" in row:
                lo, hi = row["gain_diff_spread"]
                gain = f"gain difference {row['gain_diff']:+.1f} points (seeds {lo:+.1f} .. {hi:+.1f})"
            lines.append(f"| {pair} | **project / TRL** | **{row['ratio']:.2f}x** | | | {gain} |")
            if len(row["ratios"]) > 1:
                for name, x in row["ratios"].items():
                    lines.append(
                        f"| {pair} | {name} / {row['fastest']['trl']} | {x['run']:.2f}x | {x['step']:.2f}x | | |"
                    )
    return "\n".join(lines)


def plots(out: str, runs: list, baseline: float) -> None:
    """Held-out avg@k against trained samples and against wall-clock seconds (start-up included):
    one line per framework and pair, each point the mean over the seeds."""
    from megatron_klear.utils.plots import line_chart

    for x, name, label in (
        ("samples", "heldout_vs_samples.png", "trained samples"),
        ("t", "heldout_vs_seconds.png", "wall-clock s"),
    ):
        by_line = {}
        for r in runs:
            pts = [(0.0, baseline)]
            for step, acc in r["heldout"]:
                done = r["steps"][:step]
                pts.append((sum(s["samples"] for s in done) if x == "samples" else done[-1]["t"], acc))
            by_line.setdefault(f"{side(r)} {r['pair']}", []).append(pts)
        series = {
            f"{line} ({len(seeds)} seeds)": [
                (statistics.fmean(p[0] for p in column), statistics.fmean(p[1] for p in column))
                for column in zip(*seeds)
            ]
            for line, seeds in by_line.items()
        }
        line_chart(os.path.join(out, name), series, title=f"Held-out avg@k against {label}", xlabel=label, ylabel="%")


def trl_run(args, settings, files, pair: str, seed: int, run: str, dtype: str) -> dict:
    """TRL's side in a worker process (this script, ``--trl-worker``): one process, ``--threads``."""
    os.makedirs(run, exist_ok=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--trl-worker", "--run", run, "--pair", pair]
    cmd += ["--seed", str(seed), "--sft", files["sft"], "--prompts", files["prompts"], "--steps", str(args.steps)]
    cmd += ["--eval-every", str(args.eval_every), "--threads", str(args.threads), "--t-start", str(time.time())]
    cmd += ["--prompts-per-step", str(settings.rl_prompts_per_step), "--max-new-tokens", str(settings.max_new_tokens)]
    cmd += ["--lr", str(settings.rl_lr)] + (["--trl-bf16"] if dtype == "bf16" else [])
    start = time.time()
    with open(run + ".log", "w") as log:
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=log, check=True)
    result = json.load(open(os.path.join(run, "trl.json")))
    result["seconds"] = time.time() - start
    for s in result["steps"]:
        s["samples"] = settings.rl_prompts_per_step * 8
    return result


def parse_layouts(text: str) -> list:
    """ "1x2,2x1" -> [(1, 2), (2, 1)]: processes x torch threads each."""
    try:
        return [tuple(int(n) for n in part.split("x")) for part in text.split(",")]
    except ValueError:
        raise SystemExit(f"--layouts: processes x threads, comma-separated (e.g. 1x2,2x1), got {text!r}") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/vs-trl")
    p.add_argument("--shape", choices=("demo", "qwen3-0.6b"), default="demo")
    p.add_argument("--layers", type=int, default=28, help="--shape qwen3-0.6b: this many of its layers")
    p.add_argument("--sft", default=None, help="an HF SFT model (default: build the demo's)")
    p.add_argument("--prompts", default=None, help="RL prompts JSONL (with --sft)")
    p.add_argument("--heldout", default=None, help="held-out problems JSONL (with --sft)")
    p.add_argument("--pairs", default=None, help=f"of {','.join(PAIRS)} (default: all; --shape: clip_higher)")
    p.add_argument("--seeds", type=int, default=None, help="default 3 (--shape: 1)")
    p.add_argument("--steps", type=int, default=None, help="default 40 (--shape: 3)")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--nproc", type=int, default=1, help="processes on each side (the project: TP = nproc)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per process")
    p.add_argument(
        "--layouts",
        default=None,
        help="the project's layouts, processes x threads (default: nproc x threads; --shape: 1x2,2x1)",
    )
    p.add_argument(
        "--dtypes", default=None, help="fp32 and/or bf16, each side in each (default fp32; --shape: fp32,bf16)"
    )
    p.add_argument("--reuse", action="store_true", help="read back the runs already finished in --out")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None, help="also write the summary here")
    # the TRL worker
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    for k in ("run", "pair", "t-start"):
        p.add_argument(f"--{k}", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--prompts-per-step", type=int, default=32, help=argparse.SUPPRESS)
    p.add_argument("--max-new-tokens", type=int, default=40, help=argparse.SUPPRESS)
    p.add_argument("--lr", type=float, default=3e-4, help=argparse.SUPPRESS)
    p.add_argument("--trl-bf16", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.trl_worker:
        trl_worker(args)
        return 0

    from megatron_klear.demo_recipe import QUICK, Settings
    from megatron_klear.utils.atomic import write_text
    from megatron_klear.utils.progress import format_seconds

    shape = args.shape != "demo"
    args.pairs = args.pairs or ("clip_higher" if shape else ",".join(PAIRS))
    args.seeds = args.seeds or (1 if shape else 3)
    args.steps = args.steps or (3 if shape else 40)
    layouts = parse_layouts(args.layouts or ("1x2,2x1" if shape else f"{args.nproc}x{args.threads}"))
    dtypes = (args.dtypes or ("fp32,bf16" if shape else "fp32")).split(",")
    if args.quick:
        args.steps, args.eval_every, args.seeds = 2, 2, 1
    settings = Settings(**(QUICK if args.quick else {}))
    settings.rl_steps = args.steps
    if shape:  # 2 prompts x 8 responses of 64 tokens a step, one optimizer step on all of them
        args.eval_every = args.steps  # (each side saves once, at the end)
        settings.rl_prompts_per_step = settings.rl_mini_batch_prompts = 2
        settings.max_new_tokens = 64
    if args.quick:
        settings.eval_prompts, settings.eval_k = 4, 2
    os.makedirs(args.out, exist_ok=True)
    files = prepare(args, settings)
    # the evaluations' records go to <out>/eval/, not beside the SFT model
    evaluations = os.path.join(args.out, "eval")
    baseline = None
    if files["heldout"]:
        baseline = heldout(settings, files, files["sft"], os.path.join(evaluations, "eval-sft.json"))
        print(f"SFT model: held-out avg@{settings.eval_k} {baseline:.1f}%", flush=True)
    variant = len(layouts) > 1 or len(dtypes) > 1
    jobs = []
    for seed in range(args.seeds):
        for pair in args.pairs.split(","):
            for dtype in dtypes:
                jobs += [(pair, seed, "project", layout, dtype) for layout in layouts]
                jobs.append((pair, seed, "trl", (1, args.threads), dtype))
    runs, failed, t0 = [], [], time.time()
    for i, (pair, seed, fw, layout, dtype) in enumerate(jobs):
        name = f"{pair}-{fw}-{layout[0]}x{layout[1]}-{dtype}-s{seed}" if variant else f"{pair}-{fw}-s{seed}"
        run = os.path.abspath(os.path.join(args.out, "runs", name))
        os.makedirs(os.path.dirname(run), exist_ok=True)
        record = run + ".result.json"  # a finished run's figures (--reuse reads them back)
        try:
            if args.reuse and os.path.exists(record):
                result = json.load(open(record))
            elif fw == "project":
                result = project_run(args, settings, files, pair, seed, run, layout, dtype)
            else:
                result = trl_run(args, settings, files, pair, seed, run, dtype)
        except subprocess.CalledProcessError as e:  # one variant failing (out of memory) is a finding too
            why = "killed by SIGKILL (the out-of-memory killer?)" if "SIGKILL" in open(run + ".log").read() else ""
            failed.append({"run": name, "status": e.returncode, "why": why, "log": run + ".log"})
            print(
                f"  {pair} {fw} {layout[0]}x{layout[1]} {dtype} seed {seed}: FAILED ({e.returncode}) {why}", flush=True
            )
            continue
        write_text(record, json.dumps(result))
        result.update(
            pair=pair, seed=seed, framework=fw, layout=f"{layout[0]}x{layout[1]}", dtype=dtype, variant=variant
        )
        result["samples"] = sum(s.get("samples", settings.rl_prompts_per_step * 8) for s in result["steps"])
        result["heldout"] = [
            (step, heldout(settings, files, path, os.path.join(evaluations, f"eval-{pair}-{fw}-s{seed}-{step}.json")))
            for step, path in (sorted(checkpoints(run, fw).items()) if baseline is not None else [])
        ]
        runs.append(result)
        done = i + 1
        eta = (len(jobs) - done) * (time.time() - t0) / done
        held = f", held-out {' '.join(f'{a:.1f}' for _, a in result['heldout'])}" if result["heldout"] else ""
        print(
            f"  {pair} {side(result)} seed {seed}: {result['samples'] / result['seconds']:.2f} samples/s "
            f"({result['seconds']:.0f} s){held}  [{done}/{len(jobs)}, ETA {format_seconds(eta)}]",
            flush=True,
        )
    summary = summarize(runs, baseline)
    text = table(summary, baseline)
    text += "".join(f"\n\nfailed: {f['run']} (status {f['status']}) {f['why']}; see {f['log']}" for f in failed)
    print(text, flush=True)
    if baseline is not None:
        plots(args.out, runs, baseline)
    details = {"baseline": baseline, "summary": summary, "runs": runs, "failed": failed, "args": vars(args)}

    write_text(os.path.join(args.out, "details.json"), json.dumps(details, indent=1))
    write_text(os.path.join(args.out, "results.md"), text + "\n")
    if args.json:
        write_text(args.json, json.dumps(details, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
