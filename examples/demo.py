#!/usr/bin/env python
"""`make demo`: the whole pipeline on a tiny Qwen3-shaped model, on the CPU, and the proof that GPPO
learns: held-out accuracy before and after RL.

1. A random tiny Qwen3-Base-shaped HF checkpoint (tools/make_tiny_model.py).
2. HF -> Megatron torch_dist conversion, then HF logits parity at TP=2 x PP=2 (4 gloo processes),
   and the bit-exactness of the HF -> Megatron -> HF round trip.
3. SFT on digit chains (megatron_klear/data/synthetic.py: "What is 7+5+8?" -> a <think> trace, one
   partial sum per line, and a \\boxed{} answer), written by an imperfect teacher: 60% of its
   responses have one slip (a partial sum off by 1 or 2), as distillation data has wrong responses
   (Klear keeps incorrect teacher responses for hard prompts); preprocessing into the indexed
   dataset, training at TP=2.
4. Export to HF, and held-out evaluation with megatron_klear.evaluation (avg@8 at the RL
   temperature 1.0, and greedy) on problems that appear in no SFT chat and no RL prompt.
5. GPPO (`python -m megatron_klear rl`, embedded rollout engine, math grader, actor at TP=2,
   weight sync each step) from the SFT model on training problems.
6. Export and the same held-out evaluation; report, plots and summary in runs/demo/.

The SFT model knows the arithmetic (its greedy answer is usually right) but samples the teacher's
slips at temperature 1; GPPO, rewarded by the grader, learns to stop slipping. `make demo` exits
non-zero when a check fails (runs/demo/report.md lists them). ``--quick``: tiny sizes, every stage
and output, no learning targets (the test suite's smoke run). The settings, the task, the data
files, the RL overrides and the held-out evaluation are megatron_klear/demo_recipe.py's (``--set
KEY=VALUE`` changes a setting); ``--sft-model``: stages 1-3 and the export without the parity check,
the SFT model the benchmarks start from (benchmarks/algos.py, vs_trl.py, async_rl.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
PY = sys.executable

from megatron_klear.demo_recipe import (  # noqa: E402
    QUICK,
    Settings,
    evaluate_heldout,
    make_task,
    rl_overrides,
    setting_value,
    write_task_files,
)
from megatron_klear.platform.process import free_port  # noqa: E402

# seconds per stage of the full run on 2 idle cores (for the ETA; scaled by the speed observed so far)
NOMINAL = {"model": 6, "convert": 30, "sft": 120, "export": 20, "eval_sft": 20, "rl": 150, "eval_rl": 25, "report": 10}


class Demo:
    """The demo's stages, each a command a user would type (printed, and listed in the report), with
    the checks of their results; everything goes into ``out``."""

    def __init__(self, s: Settings, out: str):
        self.s, self.out = s, os.path.abspath(out)
        self.timings: dict = {}
        self.checks: list = []
        self.commands: list = []
        self.t0 = time.time()
        self.env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self.task = make_task(s)

    # -- console -------------------------------------------------------------------------------
    def stage(self, key: str, title: str):
        done = sum(NOMINAL[k] for k in self.timings if k in NOMINAL)
        left = sum(v for k, v in NOMINAL.items() if k not in self.timings)
        elapsed = time.time() - self.t0
        speed = elapsed / done if done and not self.s.quick else 1.0
        from megatron_klear.utils.progress import format_seconds

        n = list(NOMINAL).index(key) + 1
        eta = "" if self.s.quick else f", ETA {format_seconds(left * speed)}"
        print(f"\n[{n}/{len(NOMINAL)}] {title}  (elapsed {format_seconds(elapsed)}{eta})", flush=True)
        return _Timer(self.timings, key)

    def sh(self, *args, capture: bool = False) -> str:
        """Run a command; its step lines (``step N/M | ...``) are thinned to about ten per run."""
        shown = " ".join(os.path.relpath(a, ROOT) if os.path.isabs(a) and a.startswith(ROOT) else a for a in args)
        self.commands.append(shown)
        print(f"  $ {shown}", flush=True)
        proc = subprocess.Popen(
            args, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        lines = []
        for line in proc.stdout:
            lines.append(line)
            m = re.match(r"step (\d+)/(\d+) ", line)
            if m:
                i, total = int(m.group(1)), int(m.group(2))
                if i != total and i % max(1, total // 10):
                    continue
            sys.stdout.write("    " + line)
            sys.stdout.flush()
        if proc.wait() != 0:
            raise RuntimeError(f"command failed with exit status {proc.returncode}: {shown}")
        return "".join(lines) if capture else ""

    def torchrun(self, n: int, *args, capture: bool = False) -> str:
        return self.sh(
            PY,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(n),
            "--master-port",
            str(free_port()),
            *args,
            capture=capture,
        )

    def check(self, name: str, ok: bool | None, value, target: str) -> None:
        """ok=None: not checked (a --quick run)."""
        self.checks.append({"check": name, "value": value, "target": target, "held": ok if ok is None else bool(ok)})
        mark = {True: "OK  ", False: "FAIL", None: "n/a "}[ok if ok is None else bool(ok)]
        print(f"  check {mark} {name}: {value} (target: {target})", flush=True)

    # -- stages --------------------------------------------------------------------------------
    def run(self) -> int:
        s, out = self.s, self.out
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        load_before = _loadavg()
        self.make_model()
        parity, exact = self.convert(parity=True)
        sft = self.train_sft()
        self.export_sft()
        with self.stage("eval_sft", "held-out evaluation of the SFT model"):
            before = self.evaluate(f"{out}/hf-sft", "sft")
            self.check(
                "SFT reaches partial held-out accuracy",
                None if s.quick else 5 <= before["heldout_avg@8"] <= 70,
                f"avg@{s.eval_k} {before['heldout_avg@8']:.1f}%",
                "5-70% (room for RL)",
            )

        with self.stage("rl", f"GPPO from the SFT model ({s.rl_steps} steps, embedded engine, TP=2)"):
            overrides = rl_overrides(s, f"{out}/hf-sft", f"{out}/rl-run", prompts=f"{out}/rl-prompts.jsonl")
            self.torchrun(2, "-m", "megatron_klear", "rl", *overrides)
            rl = _read_jsonl(f"{out}/rl-run/metrics.jsonl")
            mismatch = max((m.get("actor/logprob_mismatch_max", 0.0) for m in rl), default=float("nan"))
            self.check("engine vs trainer log-probs agree (weight sync)", mismatch < 1e-3, f"{mismatch:.1e}", "< 1e-3")
            step = int(open(f"{out}/rl-run/latest_checkpointed_iteration.txt").read())
            self.sh(
                PY,
                "tools/convert_megatron_to_hf.py",
                "--ckpt",
                f"{out}/rl-run/iter_{step:07d}",
                "--out",
                f"{out}/hf-rl",
            )

        with self.stage("eval_rl", "the same held-out evaluation of the GPPO model"):
            after = self.evaluate(f"{out}/hf-rl", "rl")
            gain = after["heldout_avg@8"] - before["heldout_avg@8"]
            self.check(
                f"GPPO raises held-out avg@{s.eval_k}",
                None if s.quick else gain >= s.min_gain_points,
                f"{before['heldout_avg@8']:.1f}% -> {after['heldout_avg@8']:.1f}% ({gain:+.1f} points)",
                f">= +{s.min_gain_points:.0f} points",
            )

        with self.stage("report", "report, plots, summary"):
            total = time.time() - self.t0
            summary = self.summary(before, after, parity, exact, sft, rl, total, load_before)
            from examples.demo_report import write_outputs

            write_outputs(out, summary, sft, rl, self.commands)
        self.print_summary(summary)
        return 0 if all(c["held"] is not False for c in self.checks) else 1

    def build_sft_model(self) -> str:
        """Stages 1-3 and the export without the parity check (``--sft-model``): <out>/hf-sft."""
        os.makedirs(self.out, exist_ok=True)
        self.make_model()
        self.convert(parity=False)
        self.train_sft()
        self.export_sft()
        return f"{self.out}/hf-sft"

    def make_model(self) -> None:
        s = self.s
        with self.stage("model", "tiny Qwen3-Base-shaped HF checkpoint"):
            self.sh(
                PY,
                "tools/make_tiny_model.py",
                "--out",
                f"{self.out}/hf-base",
                "--layers",
                str(s.layers),
                "--hidden",
                str(s.hidden),
                "--head-dim",
                str(s.head_dim),
                "--seed",
                str(s.seed),
            )

    def convert(self, parity: bool = True) -> tuple:
        s, out = self.s, self.out
        hf_base, mg_base = f"{out}/hf-base", f"{out}/mg-base"
        with self.stage("convert", "HF -> Megatron, logits parity at TP=2 x PP=2, round trip"):
            self.sh(
                PY, "tools/convert_hf_to_megatron.py", "--hf-dir", hf_base, "--out", mg_base, "--tp", "2", "--pp", "2"
            )
            if not parity:
                return None, None
            text = self.torchrun(
                4,
                "tools/check_parity.py",
                "--hf-dir",
                hf_base,
                "--ckpt",
                mg_base,
                "--tp",
                "2",
                "--pp",
                "2",
                "--tol",
                str(s.parity_tol),
                capture=True,
            )
            m = re.search(r"max \|logits diff\| = ([0-9.eE+-]+)", text)
            diff = float(m.group(1)) if m else float("nan")
            self.check(
                "HF vs Megatron logits at TP=2 x PP=2, max abs difference",
                diff <= s.parity_tol,
                f"{diff:.2e}",
                f"<= {s.parity_tol:.0e}",
            )
            self.sh(PY, "tools/convert_megatron_to_hf.py", "--ckpt", mg_base, "--out", f"{out}/hf-roundtrip")
            exact = _bit_exact(hf_base, f"{out}/hf-roundtrip")
            self.check("HF -> Megatron -> HF round trip bit-exact", exact, exact, "True")
        return diff, exact

    def train_sft(self) -> list:
        s, out = self.s, self.out
        with self.stage("sft", f"SFT on digit chains at TP=2 ({s.sft_steps} steps)"):
            self.sft_data()
            self.torchrun(
                2,
                "-m",
                "megatron_klear",
                "sft",
                "--config",
                "examples/configs/sft_tiny_cpu.yaml",
                f"model.path={out}/mg-base",
                f"data.prefix={out}/sft-data",
                f"train.save_dir={out}/sft-run",
                f"train.steps={s.sft_steps}",
                f"data.seq_length={s.sft_seq_length}",
                f"optim.lr={s.sft_lr}",
                f"optim.min_lr={s.sft_lr / 10}",
                f"train.seed={s.seed}",
                "train.save_interval=0",
            )
            sft = _read_jsonl(f"{out}/sft-run/metrics.jsonl")
            first, last = sft[0]["loss"], sft[-1]["loss"]
            self.check("SFT loss falls", last < first, f"{first:.3f} -> {last:.3f}", "last < first")
        return sft

    def export_sft(self) -> None:
        out = self.out
        with self.stage("export", "export the SFT checkpoint to HF"):
            step = int(open(f"{out}/sft-run/latest_checkpointed_iteration.txt").read())
            self.sh(
                PY,
                "tools/convert_megatron_to_hf.py",
                "--ckpt",
                f"{out}/sft-run/iter_{step:07d}",
                "--out",
                f"{out}/hf-sft",
            )

    def sft_data(self) -> None:
        """SFT chats of training problems, checked disjoint from the held-out problems, preprocessed."""
        s, out = self.s, self.out
        split = write_task_files(s, out, self.task)
        self.check(
            "held-out problems in no SFT chat and no RL prompt",
            split["split_held"],
            f"{split['training']} training questions, {split['heldout']} held-out, {split['shared']} shared",
            "0 shared",
        )
        self.sh(
            PY,
            "tools/preprocess_sft.py",
            "--input",
            f"{out}/sft.jsonl",
            "--tokenizer",
            f"{out}/hf-base",
            "--output-prefix",
            f"{out}/sft-data",
            "--max-length",
            str(s.sft_max_length),
        )

    def evaluate(self, model_dir: str, name: str) -> dict:
        """The held-out evaluation (demo_recipe.evaluate_heldout); results in <out>/eval-<name>.json
        (+ .samples.jsonl)."""
        s = self.s
        self.commands.append(
            f"megatron_klear.evaluation.evaluate({os.path.relpath(model_dir, ROOT)}, heldout, "
            f"k={s.eval_k}, temperature={s.temperature}) and k=1 greedy"
        )
        return evaluate_heldout(
            s,
            model_dir,
            f"{self.out}/heldout.jsonl",
            f"{self.out}/eval-{name}.json",
            say=lambda line: print(f"    {line}", flush=True),
        )

    def summary(self, before, after, parity, exact, sft, rl, total, load_before) -> dict:
        s = self.s
        strip = lambda d: {k: v for k, v in d.items() if k != "examples"}  # noqa: E731
        return {
            "sft": {**strip(before), "steps": s.sft_steps, "loss_first": sft[0]["loss"], "loss_last": sft[-1]["loss"]},
            "rl": {
                **strip(after),
                "steps": s.rl_steps,
                "algo": s.rl_algo,
                "train_accuracy_first": rl[0].get("rollout/accuracy"),
                "train_accuracy_last": rl[-1].get("rollout/accuracy"),
            },
            "gain_avg@8_points": after["heldout_avg@8"] - before["heldout_avg@8"],
            "gain_greedy_points": after["heldout_greedy"] - before["heldout_greedy"],
            "parity_max_abs_diff": parity,
            "round_trip_bit_exact": exact,
            "checks": self.checks,
            "all_checks_held": all(c["held"] is not False for c in self.checks),
            "examples": {"sft": before["examples"], "rl": after["examples"]},
            "timings_s": {k: round(v, 1) for k, v in self.timings.items()},
            "total_s": round(total, 1),
            "settings": dataclasses.asdict(s),
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "loadavg_start": load_before,
                "loadavg_end": _loadavg(),
            },
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }

    def print_summary(self, summary: dict) -> None:
        from megatron_klear.utils.progress import format_seconds

        b, a = summary["sft"], summary["rl"]
        k = self.s.eval_k
        print("\n=== summary ===")
        print(f"held-out problems: {b['prompts']} (never in SFT or RL data), temperature {self.s.temperature}")
        print(f"{'':22}{'avg@' + str(k):>10}{'pass@' + str(k):>10}{'greedy':>10}")
        for name, r in (("SFT", b), ("SFT + GPPO", a)):
            print(f"{name:22}{r['heldout_avg@8']:>9.1f}%{r['heldout_pass@8']:>9.1f}%{r['heldout_greedy']:>9.1f}%")
        print(f"{'gain':22}{summary['gain_avg@8_points']:>+9.1f} {'':>10}{summary['gain_greedy_points']:>+9.1f}")
        failed = [c for c in self.checks if c["held"] is False]
        print(
            f"checks: {sum(c['held'] is True for c in self.checks)} held, {len(failed)} failed"
            + (f", {sum(c['held'] is None for c in self.checks)} not checked (--quick)" if self.s.quick else "")
        )
        for c in failed:
            print(f"  FAILED: {c['check']}: {c['value']} (target {c['target']})")
        print(
            f"report: {os.path.relpath(self.out, ROOT)}/report.md, plots in {os.path.relpath(self.out, ROOT)}/plots/, "
            f"summary.json  (total {format_seconds(summary['total_s'])})"
        )
        if failed:
            print("demo FAILED", file=sys.stderr)


class _Timer:
    def __init__(self, timings, key):
        self.timings, self.key = timings, key

    def __enter__(self):
        self.t = time.time()
        return self

    def __exit__(self, *exc):
        self.timings[self.key] = time.time() - self.t
        return False


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _read_jsonl(path: str) -> list:
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def _bit_exact(a_dir: str, b_dir: str) -> bool:
    import torch

    from megatron_klear.checkpoint.hf_io import HFReader

    a, b = HFReader(a_dir), HFReader(b_dir)
    return a.keys() == b.keys() and all(torch.equal(a.get(k), b.get(k)) for k in a.keys())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "demo"))
    p.add_argument("--quick", action="store_true", help="tiny sizes: every stage and output, no learning targets")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a setting (e.g. --set rl_steps=40); see Settings in megatron_klear/demo_recipe.py",
    )
    p.add_argument(
        "--sft-model",
        action="store_true",
        help="only build the SFT model (stages 1-3 and the export, no parity check): <out>/hf-sft",
    )
    args = p.parse_args(argv)
    values = dict(QUICK) if args.quick else {}
    values["seed"] = args.seed
    for item in args.set:
        key, _, raw = item.partition("=")
        try:
            values[key] = setting_value(key, raw)
        except ValueError as e:
            p.error(f"--set {item}: {e}")
    demo = Demo(Settings(**values), args.out)
    if args.sft_model:
        print(f"SFT model: {demo.build_sft_model()}", flush=True)
        return 0
    return demo.run()


if __name__ == "__main__":
    sys.exit(main())
