"""benchmarks/rl_step.py --quick: every saving of the RL step is measured against its baseline on one
batch of rollouts; the update's baseline paths still run and do work their variants do not (the
old-log-prob pass's micro-batches, attention calls of one sequence, more micro-batches); the
memoised grader gives the same verdicts (the script checks them); each ratio is its baseline's
seconds over its variant's. Not checked here: the grading pair's work (a random model's responses
fail the format check before math-verify, so --quick grades without parsing)."""

import json

from tests.benchmark_run import run_benchmark


def test_rl_step_benchmark_quick(tmp_path):
    out = tmp_path / "r.json"
    proc = run_benchmark("rl_step.py", "--quick", "--out", str(tmp_path / "run"), "--json", str(out))
    summary = json.loads(out.read_text())
    assert summary["responses"] > 0 and summary["response_tokens"] > 0 and summary["graded"] == summary["responses"]
    assert set(summary["results"]) == {"old_logprobs", "packed_attention", "micro_batch", "grading"}
    for name, row in summary["results"].items():
        assert row["baseline_s"] > 0 and row["variant_s"] > 0, name
        assert abs(row["ratio"] - row["baseline_s"] / row["variant_s"]) < 1e-12, name
        if name != "grading":
            assert row["baseline_work"] > row["variant_work"] >= 0, (name, row)
        assert f"{name}" in proc.stdout and f"{row['ratio']:.2f}x" in proc.stdout, name
