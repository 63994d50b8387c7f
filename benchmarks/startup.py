"""Process start-up on a CPU: what every rank, conversion and export process pays before its work,
against the baseline of the same run.

    python benchmarks/startup.py                 # 5 rounds of each pair, alternating
    python benchmarks/startup.py --rounds 1 --json out.json

Two pairs, each measured in fresh processes, the two sides alternating round by round (the same
machine load for both), median wall and CPU seconds (user + system) of the child:

- ``megatron_import``: ``import megatron_klear`` then the Megatron-Core modules a trainer rank
  imports (``megatron.core``, its GPT model, optimizer and DDP). Baseline: Megatron-Core's own
  ``jit_fuser`` (``KLEAR_EAGER_TORCH_COMPILE=1``: ``torch.compile`` at its import, which imports
  TorchDynamo and Inductor); ours: the fusions compiled at their first call
  (``megatron_klear/platform/deferred_compile.py``).
- ``torch_dist_shapes``: the shapes and dtypes of a torch_dist checkpoint's tensors, what an export
  reads before it copies anything (a tiny converted Qwen3). Baseline: Megatron-Core's
  ``dist_checkpointing.load_tensors_metadata`` (it needs Megatron-Core and a process group of one,
  as the export did before); ours: ``StoredChunks(path).tensors``, the checkpoint's own metadata.

The ratio printed is ours over the baseline (< 1: faster).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

IMPORTS = (
    "import megatron_klear, megatron.core, megatron.core.models.gpt, megatron.core.optimizer, megatron.core.distributed"
)
SHAPES_MEGATRON = (
    "import sys, megatron_klear\n"
    "from megatron.core import dist_checkpointing\n"
    "from megatron_klear.platform import init_parallel\n"
    "init_parallel()\n"
    "print(len(dist_checkpointing.load_tensors_metadata(sys.argv[1])))"
)
SHAPES_OURS = (
    "import sys, megatron_klear\n"
    "from megatron_klear.checkpoint.stored_chunks import StoredChunks\n"
    "print(len(StoredChunks(sys.argv[1]).tensors))"
)
DIST_ENV = {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}


def measure(code: str, args: list, env: dict) -> tuple:
    """(wall seconds, CPU seconds, stdout) of ``python -c code args`` in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        timeout=600,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"startup: {code.splitlines()[0]} ... failed:\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc.stdout.strip()


def _checkpoint(workdir: str) -> str:
    """A tiny Qwen3 converted to torch_dist (in this process: Megatron-Core is imported here)."""
    from megatron_klear.checkpoint import convert
    from megatron_klear.models.tiny import make_tiny_qwen3

    hf = make_tiny_qwen3(os.path.join(workdir, "hf"), num_layers=2, seed=0)
    return convert.convert(hf, os.path.join(workdir, "mg"), to="torch_dist", progress=False)


def pairs(workdir: str) -> dict:
    """name -> a function giving ((baseline code, args, env), (ours code, args, env))."""
    return {
        "megatron_import": lambda: ((IMPORTS, [], {"KLEAR_EAGER_TORCH_COMPILE": "1"}), (IMPORTS, [], {})),
        "torch_dist_shapes": lambda: (
            (SHAPES_MEGATRON, [_checkpoint(workdir)], {**DIST_ENV, "MASTER_PORT": ""}),
            (SHAPES_OURS, [os.path.join(workdir, "mg")], {}),
        ),
    }


def run(rounds: int, only: list, workdir: str) -> dict:
    results = {}
    for name, make in pairs(workdir).items():
        if only and name not in only:
            continue
        base, ours = make()
        runs = {"baseline": [], "ours": []}
        outputs = set()
        for _ in range(rounds):
            for side, (code, args, env) in (("baseline", base), ("ours", ours)):
                if "MASTER_PORT" in env:
                    from megatron_klear.platform.process import free_port

                    env = {**env, "MASTER_PORT": str(free_port())}
                wall, cpu, out = measure(code, args, env)
                runs[side].append((wall, cpu))
                outputs.add(out)
        if len(outputs) != 1:  # both sides must answer the same (the count of tensors, or nothing)
            raise SystemExit(f"startup: {name}: the two sides disagree: {sorted(outputs)}")
        row = {}
        for side, values in runs.items():
            row[f"{side}_wall_s"] = statistics.median(w for w, _ in values)
            row[f"{side}_cpu_s"] = statistics.median(c for _, c in values)
        row["wall_ratio"] = row["ours_wall_s"] / row["baseline_wall_s"]
        row["cpu_ratio"] = row["ours_cpu_s"] / row["baseline_cpu_s"]
        row["rounds"] = rounds
        results[name] = row
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", default="", help="comma-separated: megatron_import, torch_dist_shapes")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    only = [x for x in args.only.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="klear-startup-") as workdir:
        results = run(args.rounds, only, workdir)
    print(f"process start-up, median of {args.rounds} fresh processes a side, {os.cpu_count()} cores")
    print("| what | baseline wall s | ours wall s | wall ratio | baseline CPU s | ours CPU s | CPU ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['baseline_wall_s']:.2f} | {r['ours_wall_s']:.2f} | {r['wall_ratio']:.2f}x "
            f"| {r['baseline_cpu_s']:.2f} | {r['ours_cpu_s']:.2f} | {r['cpu_ratio']:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
