"""benchmarks/startup.py, one round of the Megatron-Core import pair: both sides ran in fresh
processes, the JSON holds the medians and the ratios are theirs (the figures: RESULTS.md)."""

import json

from tests.benchmark_run import run_benchmark


def test_startup_benchmark_one_round(tmp_path):
    out = tmp_path / "startup.json"
    proc = run_benchmark("startup.py", "--rounds", "1", "--only", "megatron_import", "--json", str(out))
    results = json.loads(out.read_text())
    assert list(results) == ["megatron_import"]
    r = results["megatron_import"]
    assert r["rounds"] == 1
    for side in ("baseline", "ours"):
        assert r[f"{side}_wall_s"] > 0 and r[f"{side}_cpu_s"] > 0, r
    assert abs(r["wall_ratio"] - r["ours_wall_s"] / r["baseline_wall_s"]) < 1e-12
    assert abs(r["cpu_ratio"] - r["ours_cpu_s"] / r["baseline_cpu_s"]) < 1e-12
    assert (
        f"| megatron_import | {r['baseline_wall_s']:.2f} | {r['ours_wall_s']:.2f} | {r['wall_ratio']:.2f}x"
        in proc.stdout
    )
