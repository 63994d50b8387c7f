"""benchmarks/async_rl.py --quick: the four variants (sync, partial, async, async_partial) run through
a stand-in server behind the real sglang-router, and the JSON has the issue's shape with sane
values: every variant trains the same samples, sync has no stale token, the throughput is the
samples over the seconds of the steps as logged, the ratios printed are the JSON's."""
import json
import os
import re
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = {"samples_per_s", "step_s_median", "heldout_avg@8", "staleness_mean", "offpolicy_token_frac"}
VARIANTS = ("sync", "partial", "async", "async_partial")


def test_async_rl_benchmark_quick(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "benchmarks/async_rl.py", "--quick", "--json", str(out), "--out",
                           str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert set(results) == {"variants", "lengths"}
    assert list(results["variants"]) == list(VARIANTS)
    for name, r in results["variants"].items():
        assert set(r) == FIELDS, (name, r)
        assert r["samples_per_s"] > 0 and r["step_s_median"] > 0, (name, r)
        assert 0 <= r["heldout_avg@8"] <= 100 and r["staleness_mean"] >= 0 and 0 <= r["offpolicy_token_frac"] <= 1
    assert results["variants"]["sync"]["staleness_mean"] == 0 and results["variants"]["sync"]["offpolicy_token_frac"] == 0
    lengths = results["lengths"]
    assert set(lengths) == {"p50", "p90", "max"} and 1 <= lengths["p50"] <= lengths["p90"] <= lengths["max"] <= 48

    details = json.loads((tmp_path / "run" / "details.json").read_text())
    assert details["results"] == results
    runs = details["runs"]
    assert sorted(r["variant"] for r in runs) == sorted(VARIANTS) and all(r["seed"] == 1 for r in runs)
    # the same trained samples in every variant: 2 steps x 2 prompts x 8 responses
    assert {r["samples_trained"] for r in runs} == {2 * 2 * 8}, [r["samples_trained"] for r in runs]
    for r in runs:
        steps = r["metrics"]
        assert [m["step"] for m in steps] == [1, 2]
        # samples/s from the logged steps (step 1 left out), the median step from each step's time
        assert abs(r["samples_per_s"] - steps[1]["rollout/samples_trained"] / steps[1]["perf/step_s"]) < 1e-9
        assert r["step_s_median"] == statistics.median(m["perf/step_s"] for m in steps)
        assert results["variants"][r["variant"]]["samples_per_s"] == r["samples_per_s"]  # one seed: the mean is it
        for key in ("rollout/resumed_samples", "rollout/aborted_samples", "perf/generate_s", "perf/overlap_s"):
            assert all(key in m for m in steps), (r["variant"], key)
        if r["variant"] == "sync":
            assert all(m["rollout/staleness_max"] == 0 and m["rollout/resumed_samples"] == 0 for m in steps)
            assert all(m["perf/overlap_s"] == 0 for m in steps)
    # the printed ratios are the JSON's
    sync = results["variants"]["sync"]["samples_per_s"]
    for name, r in results["variants"].items():
        m = re.search(rf"^{name}: ([0-9.]+)x sync's samples/s", proc.stdout, re.M)
        assert m and float(m.group(1)) == round(r["samples_per_s"] / sync, 2), (name, proc.stdout[-2000:])
