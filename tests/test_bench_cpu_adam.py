"""benchmarks/cpu_adam.py --quick: both sides stepped the same optimizer, only ours with the fused
kernel (what fuse_cpu_adam sets), and the ratios in the JSON and the table are the medians' own
(the figures: RESULTS.md)."""

import json

from tests.benchmark_run import run_benchmark


def test_cpu_adam_benchmark_quick(tmp_path):
    out = tmp_path / "cpu_adam.json"
    proc = run_benchmark("cpu_adam.py", "--quick", "--json", str(out))
    r = json.loads(out.read_text())
    assert r["rounds"] == 1 and r["steps"] == 2 and r["parameters"] > 10**6
    assert r["ours_fused"] is True and r["baseline_fused"] is False
    for name in ("first", "later"):
        for unit in ("cpu", "wall"):
            base, ours = r[f"baseline_{name}_{unit}_s"], r[f"ours_{name}_{unit}_s"]
            assert base > 0 and ours > 0, r
            assert abs(r[f"{name}_{unit}_ratio"] - ours / base) < 1e-12
        cpu = (r[f"baseline_{name}_cpu_s"], r[f"ours_{name}_cpu_s"], r[f"{name}_cpu_ratio"])
        assert f"| {name} | {cpu[0]:.3f} | {cpu[1]:.3f} | {cpu[2]:.2f}x" in proc.stdout, proc.stdout
