"""benchmarks/rl_step.py --quick: every saving of the RL step is measured against its baseline on one
batch of rollouts (the baseline paths still run: the old-log-prob pass, one attention call per
sequence, small micro-batches, the uncached grader), the memoised grader gives the same verdicts,
and each ratio is its baseline's median over its variant's."""

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
        assert f"{name}" in proc.stdout and f"{row['ratio']:.2f}x" in proc.stdout, name
