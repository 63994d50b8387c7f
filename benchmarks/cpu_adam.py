"""Adam on a CPU, as Megatron-Core's optimizer runs it without Transformer Engine or Apex: torch's
``AdamW`` on CPU parameters, one tensor at a time (torch's default there; the baseline) against
the same optimizer switched to torch's fused CPU kernel by ``fuse_cpu_adam``
(``megatron_klear/training/setup.py``; ours), in this process, one thread as a CPU rank runs.

    python benchmarks/cpu_adam.py                  # one TP=2 rank of the quick journey's model, 3 rounds
    python benchmarks/cpu_adam.py --quick --json out.json

The parameters are one rank's of the quick journey's model (Qwen3-0.6B's width, 2 layers, TP=2:
half the 151,936 x 1024 embedding and half of each layer's weights, ~93M in fp32), with random
gradients. Each round builds both sides afresh, alternating which goes first, and times the first
step (it also allocates Adam's two moments) and the mean of ``--steps`` later ones: CPU seconds
(user + system of this process) and wall seconds, medians over the rounds. The ratio printed is
ours over the baseline (< 1: faster).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from types import SimpleNamespace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

#: one TP=2 rank of Qwen3-0.6B's width with 2 layers: the embedding's half, and per layer q (2048
#: of 1024 -> half), k and v (1024 -> half each), o, gate and up, down, the two norms
RANK_SHAPES = (
    [(75968, 1024)]
    + 2 * [(1024, 1024), (512, 1024), (512, 1024), (1024, 1024)]
    + 2
    * [
        (1536, 1024),
        (1536, 1024),
        (1024, 1536),
        (1024,),
        (1024,),
    ]
)
QUICK_SHAPES = [(4096, 256), (256, 256), (512, 256), (256,)]


def one_side(shapes: list, fused: bool, steps: int, seed: int) -> dict:
    import torch

    from megatron_klear.training.setup import fuse_cpu_adam

    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    inner = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if fused:  # as Megatron-Core's chained optimizer holds it
        assert fuse_cpu_adam(SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=inner)])) == [inner]
    out = {"fused": bool(inner.param_groups[0]["fused"])}
    for name, n in (("first", 1), ("later", steps)):
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(n):
            inner.step()
        out[f"{name}_cpu_s"] = (time.process_time() - cpu) / n
        out[f"{name}_wall_s"] = (time.perf_counter() - wall) / n
    return out


def run(shapes: list, rounds: int, steps: int) -> dict:
    import torch

    torch.set_num_threads(1)  # a CPU rank's (OMP_NUM_THREADS=1 under the launchers)
    sides = {"baseline": [], "ours": []}
    for r in range(rounds):
        order = ("baseline", "ours") if r % 2 == 0 else ("ours", "baseline")
        for side in order:
            sides[side].append(one_side(shapes, fused=side == "ours", steps=steps, seed=r))
    result = {"parameters": sum(math.prod(s) for s in shapes), "rounds": rounds, "steps": steps}
    for side, runs in sides.items():
        result[f"{side}_fused"] = all(x["fused"] for x in runs)
        for key in ("first_cpu_s", "first_wall_s", "later_cpu_s", "later_wall_s"):
            result[f"{side}_{key}"] = statistics.median(x[key] for x in runs)
    for key in ("first_cpu_s", "first_wall_s", "later_cpu_s", "later_wall_s"):
        result[f"{key[:-2]}_ratio"] = result[f"ours_{key}"] / result[f"baseline_{key}"]
    return result


def table(r: dict) -> str:
    lines = [
        f"torch AdamW on {r['parameters'] / 1e6:.1f}M CPU parameters, one thread; medians of {r['rounds']} rounds",
        "| step | baseline CPU s | ours CPU s | CPU ratio | baseline wall s | ours wall s | wall ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("first", "later"):
        cells = []
        for unit in ("cpu", "wall"):
            base, ours = r[f"baseline_{name}_{unit}_s"], r[f"ours_{name}_{unit}_s"]
            cells.append(f"{base:.3f} | {ours:.3f} | {r[f'{name}_{unit}_ratio']:.2f}x")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="later steps timed per round (after the first)")
    ap.add_argument("--quick", action="store_true", help="a small model, 1 round, 2 later steps (the tests)")
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args(argv)
    if args.quick:
        result = run(QUICK_SHAPES, rounds=1, steps=2)
    else:
        result = run(RANK_SHAPES, rounds=args.rounds, steps=args.steps)
    print(table(result))
    if args.json:
        from megatron_klear.utils import atomic

        atomic.write_text(args.json, json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
