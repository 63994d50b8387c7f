"""Round-trip time of the rollout servers' control calls: the client's kept-alive connection against
a fresh client per call (what ``SGLangEngine`` did before), against the same servers in one run.

    python benchmarks/control_latency.py            # two embedded servers of a tiny Qwen3, 50 calls each way
    python benchmarks/control_latency.py --json out.json

A weight sync makes ~7 control calls per server (pause, begin, one per bucket, end, version,
continue, version check), a run one sync per step; generation requests go through their own
kept-alive async client and are not measured here. Reported: the median milliseconds of one
``GET /model_info`` each way (``fresh_ms``, ``kept_alive_ms``, ``fresh_vs_kept_alive``) and of the
control sequence of one sync around no buckets on both servers at once (``sync_control_ms``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    import httpx

    from megatron_klear.models.tiny import make_tiny_qwen3
    from megatron_klear.rollout.sglang import SGLangEngine
    from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine

    work = tempfile.mkdtemp(prefix="klear-bench-control-")
    servers = []
    try:
        model = make_tiny_qwen3(os.path.join(work, "tiny"))
        servers = [EmbeddedHTTPEngine.launch(model, startup_timeout=300, timeout=60) for _ in range(2)]
        urls = [s.url for s in servers]
        client = SGLangEngine.at(urls, control_timeout_s=60)
        times = {"fresh": [], "kept_alive": [], "sync_control": []}
        for k in range(args.calls):  # interleaved: background load hits both alike
            t = time.perf_counter()
            httpx.request("GET", urls[k % 2] + "/model_info", timeout=60)
            times["fresh"].append(time.perf_counter() - t)
            t = time.perf_counter()
            client.model_info(urls[k % 2])
            times["kept_alive"].append(time.perf_counter() - t)
        for k in range(max(5, args.calls // 5)):
            t = time.perf_counter()
            client.wire.pause("abort")
            client.wire.begin()
            client.wire.end()
            client.wire.set_version(f"bench-{k}")
            client.wire.resume()
            client.members.check_weight_versions(f"bench-{k}")
            times["sync_control"].append(time.perf_counter() - t)
        client.close()
    finally:
        for s in servers:
            s.close()
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "calls": args.calls,
        "fresh_ms": med["fresh"],
        "kept_alive_ms": med["kept_alive"],
        "fresh_vs_kept_alive": med["fresh"] / med["kept_alive"],
        "sync_control_ms": med["sync_control"],
        "all_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in times.items()},
    }
    print(
        f"GET /model_info, median of {args.calls}: fresh client {med['fresh']:.2f} ms, kept-alive "
        f"{med['kept_alive']:.2f} ms ({out['fresh_vs_kept_alive']:.1f}x)"
    )
    print(
        f"a sync's control calls on 2 servers (pause, begin, end, version, continue, check): "
        f"{med['sync_control']:.1f} ms"
    )
    print("RESULTS " + json.dumps({k: v for k, v in out.items() if k != "all_ms"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
