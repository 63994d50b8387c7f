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
