"""`make demo` and benchmarks/algos.py at tiny sizes: every stage runs and the report, the plots and
summary.json come out well formed (the learning targets are checked only by the full runs)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLOTS = (
    "sft_loss",
    "rl_reward_accuracy",
    "rl_entropy",
    "rl_response_length",
    "rl_clip_fractions",
    "heldout_before_after",
)


def _png(path):
    import matplotlib.image as mpimg

    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", path
    img = mpimg.imread(path)
    assert img.ndim == 3 and min(img.shape[:2]) > 100 and img[..., :3].std() > 0.01, path


def _check_outputs(out, quick=True):
    summary = json.load(open(os.path.join(out, "summary.json")))
    for side in ("sft", "rl"):
        for key in ("heldout_avg@8", "heldout_greedy", "heldout_pass@8"):
            assert 0.0 <= summary[side][key] <= 100.0, (side, key)
    assert summary["parity_max_abs_diff"] < 1e-4
    assert summary["round_trip_bit_exact"] is True
    assert summary["all_checks_held"] is True
    names = [c["check"] for c in summary["checks"]]
    assert any("parity" in n or "logits" in n for n in names) and any("GPPO raises" in n for n in names)
    for c in summary["checks"]:
        assert c["held"] in (True, None if quick else True), c
    for name in PLOTS:
        assert summary["plots"][name] == f"plots/{name}.png"
        _png(os.path.join(out, "plots", f"{name}.png"))
    report = open(os.path.join(out, "report.md"), encoding="utf-8").read()
    assert report.startswith("# megatron-klear demo")
    for needle in (
        "## Held-out result",
        "## Checks",
        "| SFT |",
        "| SFT + GPPO",
        "## Plots",
        "plots/heldout_before_after.png",
    ):
        assert needle in report, needle
    for c in summary["checks"]:
        assert c["check"] in report
    return summary


def test_report_from_recorded_metrics(tmp_path):
    """The report writer alone (seconds): fabricated metrics of both runs -> report, plots, summary."""
    from examples.demo_report import write_outputs
    from megatron_klear.demo_recipe import Settings

    sft = [{"step": i, "loss": 3.0 / i} for i in range(1, 21)]
    rl = [
        {
            "step": i,
            "rollout/reward_mean": -0.5 + 0.05 * i,
            "rollout/accuracy": 0.25 + 0.02 * i,
            "actor/entropy": 0.12 - 0.002 * i,
            "rollout/response_length_mean": 26.0,
            "actor/clip_frac_low": 0.001,
            "actor/clip_frac_high": 0.002 * (i % 3),
            "actor/clip_frac_dual": 0.0,
        }
        for i in range(1, 11)
    ]

    def side(avg, greedy):
        return {
            "heldout_avg@8": avg,
            "heldout_pass@8": 90.0,
            "heldout_greedy": greedy,
            "response_length_mean": 26.0,
            "truncated_frac": 0.0,
            "prompts": 126,
            "k": 8,
        }

    checks = [
        {
            "check": "HF vs Megatron logits at TP=2 x PP=2, max abs difference",
            "value": "2.6e-06",
            "target": "<= 1e-4",
            "held": True,
        },
        {"check": "GPPO raises held-out avg@8", "value": "30.0% -> 45.0%", "target": ">= +10 points", "held": True},
    ]
    summary = {
        "sft": side(30.0, 60.0),
        "rl": {**side(45.0, 70.0), "steps": 10},
        "gain_avg@8_points": 15.0,
        "gain_greedy_points": 10.0,
        "parity_max_abs_diff": 2.6e-6,
        "round_trip_bit_exact": True,
        "checks": checks,
        "all_checks_held": True,
        "examples": {
            "sft": [{"id": "chain-1p2p3", "response": "<think>1+2=3\n3+3=6</think>\n\\boxed{6}", "solved": True}],
            "rl": [{"id": "chain-1p2p3", "response": "<think>1+2=3\n3+3=6</think>\n\\boxed{6}", "solved": True}],
        },
        "timings_s": {"sft": 100.0, "rl": 150.0},
        "total_s": 300.0,
        "settings": {**Settings().__dict__},
        "machine": {"cpus": 2, "loadavg_start": [1, 1, 1], "loadavg_end": [2, 2, 2]},
        "date": "2026-01-01",
    }
    write_outputs(str(tmp_path), summary, sft, rl, ["python tools/make_tiny_model.py ..."])
    _check_outputs(str(tmp_path), quick=False)
    assert "+15.0 points" in open(tmp_path / "report.md").read()


def test_settings_round_trip_through_the_demos_command_line():
    """What the benchmarks hand to ``examples/demo.py --sft-model``: the settings that differ from
    the defaults, as ``--set key=value``, read back as they were (None, flags, floats, text)."""
    from megatron_klear.demo_recipe import QUICK, Settings, setting_args, setting_value

    s = Settings(**{**QUICK, "eval_prompts": None}, task_ops="+-", task_max_terms=20, task_tail=1.3, rl_lr=3e-5)
    args = setting_args(s)
    assert args[::2] == ["--set"] * (len(args) // 2) and "--set" not in args[1::2]
    assert "quick=true" in args and "rl_lr=3e-05" in args and not any(a.startswith("seed=") for a in args)
    values = dict(a.split("=", 1) for a in args[1::2])
    assert Settings(**{k: setting_value(k, v) for k, v in values.items()}) == s
    assert setting_value("eval_prompts", "none") is None and setting_value("eval_prompts", "6") == 6
    with pytest.raises(ValueError, match="unknown setting 'rl_stpes'"):
        setting_value("rl_stpes", "3")
    with pytest.raises(ValueError, match="true or false"):
        setting_value("quick", "yes")


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("demo") / "demo")
    proc = subprocess.run(
        [sys.executable, "examples/demo.py", "--quick", "--out", out],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, proc.stdout + proc.stderr


@pytest.mark.slow
def test_quick_demo_writes_report_plots_and_summary(quick_demo):
    out, console = quick_demo
    _check_outputs(out)
    # the console stays readable: no third-party warning pages, a summary at the end
    assert "UserWarning" not in console and "FutureWarning" not in console and "Apex" not in console
    assert "=== summary ===" in console and "checks:" in console


@pytest.mark.slow
def test_algos_benchmark_quick(quick_demo, tmp_path):
    """benchmarks/algos.py --quick on the quick demo's SFT model: every variant trains (two
    optimizer steps on one rollout batch, the second off-policy: a log-ratio off 0), the
    off-policy metrics exist, the table, the statistics (means inside their intervals) and the
    plots are written; run again, it resumes (no run is redone: every run's file is left as it
    was)."""
    demo, _ = quick_demo
    out = tmp_path / "bench"
    args = [sys.executable, "benchmarks/algos.py", "--quick", "--out", str(out), "--sft", f"{demo}/hf-sft"]
    args += ["--heldout", f"{demo}/heldout.jsonl", "--prompts", f"{demo}/rl-prompts.jsonl"]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.load(open(out / "compare-mb4.json"))
    import importlib.util

    spec = importlib.util.spec_from_file_location("algos", os.path.join(ROOT, "benchmarks", "algos.py"))
    algos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(algos)
    VARIANTS = algos.VARIANTS
    assert list(summary) == list(VARIANTS)
    for name, v in summary.items():
        assert v["seeds"] == [1] and v["heldout"]["steps"] == [0, 1], name
        for key in ("actor/entropy", "actor/outside_frac", "actor/is_ess_frac", "actor/clip_frac_low"):
            assert key in v["curves"], (name, key)
        for key in ("final", "area"):
            low, high = v[f"{key}_ci"]
            assert low <= v[f"{key}_mean"] <= high, (name, key, v)
    runs = {p.name: p.stat().st_mtime_ns for p in (out / "runs").iterdir()}
    assert len(runs) == len(VARIANTS)
    for path in (out / "runs").iterdir():
        steps = json.loads(path.read_text())["metrics"]
        assert [m["actor/optimizer_steps"] for m in steps] == [2], (path.name, steps)
        assert steps[0]["actor/log_ratio_abs_max"] > 0, (path.name, steps)  # the second step: off-policy
    table = (out / "compare-mb4.md").read_text()
    assert "| GPPO (paper) |" in table and "| GSPO |" in table and "| DPPO (TV) |" in table
    for name in (
        "heldout",
        "final",
        "entropy",
        "clip_frac_high",
        "clip_frac_low",
        "outside_frac",
        "neg_log_ratio_mean",
    ):
        _png(str(out / "plots" / "mb4" / f"{name}.png"))
    again = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and f"resuming: {len(VARIANTS)} of {len(VARIANTS)} runs already done" in again.stdout
    assert {p.name: p.stat().st_mtime_ns for p in (out / "runs").iterdir()} == runs  # none written again
