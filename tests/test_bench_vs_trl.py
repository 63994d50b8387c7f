"""benchmarks/vs_trl.py --quick: the project's RL command and TRL's GRPOTrainer each train the same
budget, every stage runs (checkpoints exported and evaluated with the project's evaluation), and the
figures printed are the ones computed from the runs' own logs: samples per second = trained samples
over the wall time, the ratio of the means, the held-out gain difference."""

import json
import re
import statistics

from tests.benchmark_run import run_benchmark


def test_vs_trl_benchmark_quick(tmp_path):
    out = tmp_path / "run"
    proc = run_benchmark("vs_trl.py", "--quick", "--pairs", "clip_higher", "--out", str(out))
    details = json.loads((out / "details.json").read_text())
    runs = {r["framework"]: r for r in details["runs"]}
    assert set(runs) == {"project", "trl"}
    for fw, r in runs.items():
        assert len(r["steps"]) == 2, fw  # --quick: 2 steps each
        for s in r["steps"]:
            assert {"generate_s", "grade_s", "train_s", "sync_s", "step_s", "t", "samples"} <= set(s), (fw, s)
            assert s["step_s"] > 0 and s["generate_s"] > 0 and s["train_s"] > 0, (fw, s)
        assert r["samples"] == sum(s["samples"] for s in r["steps"]) > 0
        assert [step for step, _ in r["heldout"]] == [2], fw  # the checkpoint of step 2, evaluated
        assert 0 <= r["heldout"][0][1] <= 100
    # the same budget: TRL trains every generated sample, the project (no group filter here) too
    assert runs["trl"]["samples"] == runs["project"]["samples"] == 2 * 2 * 8
    row = details["summary"]["clip_higher"]
    ratio = (runs["project"]["samples"] / runs["project"]["seconds"]) / (
        runs["trl"]["samples"] / runs["trl"]["seconds"]
    )
    assert abs(row["ratio"] - ratio) < 1e-9
    gain = lambda r: r["heldout"][-1][1] - details["baseline"]  # noqa: E731
    assert abs(row["gain_diff"] - (gain(runs["project"]) - gain(runs["trl"]))) < 1e-9
    printed = re.search(r"\| clip_higher \| \*\*project / TRL\*\* \| \*\*([0-9.]+)x\*\*", proc.stdout)
    assert printed and float(printed.group(1)) == round(row["ratio"], 2), proc.stdout[-2000:]
    assert statistics.median(s["train_s"] for s in runs["trl"]["steps"]) == row["trl"]["split"]["train_s"]
    for name in ("heldout_vs_samples.png", "heldout_vs_seconds.png", "results.md"):
        assert (out / name).stat().st_size > 0, name


def test_the_shape_runs_summary_takes_each_sides_fastest_variant():
    """--shape runs each side in several layouts and dtypes: the headline ratio is the project's
    fastest variant over TRL's fastest, every project variant gets its ratio against TRL's fastest
    (from the command to exit, and per median step), and without a held-out evaluation no gain is
    computed (the weights are random)."""
    import benchmarks.vs_trl as vs

    def run(fw, layout, dtype, seconds, step_s):
        steps = [
            {"samples": 16, "step_s": s, "generate_s": 1.0, "grade_s": 0.0, "train_s": 1.0, "sync_s": 0.0}
            for s in step_s
        ]
        return {
            "pair": "clip_higher",
            "framework": fw,
            "layout": layout,
            "dtype": dtype,
            "variant": True,
            "samples": 16 * len(steps),
            "seconds": seconds,
            "steps": steps,
            "heldout": [],
        }

    runs = [
        run("project", "1x2", "fp32", 100.0, [20.0, 30.0, 40.0]),
        run("project", "2x1", "bf16", 60.0, [10.0, 12.0, 14.0]),
        run("trl", "1x2", "fp32", 120.0, [35.0, 40.0, 45.0]),
        run("trl", "1x2", "bf16", 80.0, [20.0, 25.0, 30.0]),
    ]
    row = vs.summarize(runs, None)["clip_higher"]
    assert row["fastest"] == {"project": "project 2x1 bf16", "trl": "trl 1x2 bf16"}
    assert abs(row["ratio"] - (48 / 60) / (48 / 80)) < 1e-12
    assert abs(row["ratios"]["project 1x2 fp32"]["run"] - (48 / 100) / (48 / 80)) < 1e-12
    assert abs(row["ratios"]["project 1x2 fp32"]["step"] - (16 / 30) / (16 / 25)) < 1e-12  # median steps
    assert abs(row["project 2x1 bf16"]["step_samples_per_s"] - 16 / 12) < 1e-12
    assert "gain_diff" not in row and "gain" not in row["trl 1x2 bf16"]
    text = vs.table(vs.summarize(runs, None), None)
    assert "| clip_higher | **project / TRL** | **1.33x** |" in text, text
    assert "| clip_higher | project 1x2 fp32 / trl 1x2 bf16 | 0.80x | 0.83x |" in text, text
