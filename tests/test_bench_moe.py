"""benchmarks/moe.py --quick: both runs (one process; two gloo processes at EP=2) complete, and the
printed table and RESULTS line parse into consistent numbers; the parameter counts show each EP=2
rank holding half of the experts, against counts computed here from the sizes."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_moe_benchmark_quick(tmp_path):
    out = tmp_path / "moe.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/moe.py", "--quick", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    results = json.loads(next(line for line in lines if line.startswith("RESULTS "))[len("RESULTS ") :])
    assert json.loads(out.read_text()) == results
    h, i, experts, topk, layers = 64, 32, 8, 2, 2  # --quick's sizes
    assert {k: results["setup"][k] for k in ("hidden", "moe_intermediate", "experts", "topk", "layers")} == {
        "hidden": h,
        "moe_intermediate": i,
        "experts": experts,
        "topk": topk,
        "layers": layers,
    }
    dense = layers * (h + 3 * h * topk * i)  # norm + gated MLP of the active width
    moe = {ep: layers * (h + experts * h + experts // ep * 3 * h * i) for ep in (1, 2)}  # norm, router, local experts
    for key, ep in (("ep1", 1), ("ep2", 2)):
        r = results[key]
        assert r["dense"]["params_per_rank"] == dense and r["moe"]["params_per_rank"] == moe[ep], r
        for kind in ("dense", "moe"):
            assert r[kind]["tokens_per_s"] > 0 and r[kind]["best_tokens_per_s"] >= r[kind]["tokens_per_s"]
        assert abs(r["moe_vs_dense"] - r["moe"]["tokens_per_s"] / r["dense"]["tokens_per_s"]) < 1e-9
    assert (
        abs(results["ep2_vs_ep1"] - results["ep2"]["moe"]["tokens_per_s"] / results["ep1"]["moe"]["tokens_per_s"])
        < 1e-9
    )
    # the printed table carries the same ratios
    table = {line.split("  ")[0]: line.split() for line in lines if line.startswith(("1 process", "2 processes"))}
    assert float(table["1 process, EP=1"][-2]) == round(results["ep1"]["moe_vs_dense"], 3)
    assert float(table["2 processes, EP=2"][-2]) == round(results["ep2"]["moe_vs_dense"], 3)
