"""A toy MoE layer stack at EP=1 and EP=2 against a dense stack with the same active parameters:
tokens/s of forward + backward, so the router's and the token dispatcher's cost shows as a ratio.

    python benchmarks/moe.py                 # hidden 256, 8 experts of 256, top-2, 4 layers, 2048 tokens/rank
    python benchmarks/moe.py --quick         # small sizes, a few seconds of measuring (the test runs it)
    python benchmarks/moe.py --json out.json

Each layer is ``x + mlp(rmsnorm(x))``, where ``mlp`` is built from the project's own layer spec and
``TransformerConfig`` (``models/builder.py``, as the Qwen3-MoE model builds it): for the MoE stack
Megatron-Core's ``MoELayer`` (softmax top-k router, renormalised; the alltoall token dispatcher;
local experts as ``SequentialMLP`` on CPU), for the dense stack Megatron's gated ``MLP`` with
``intermediate = top-k x moe_intermediate``: both do the same expert-MLP FLOPs per token (the MoE
stack adds the router, ``hidden x experts`` per token, and the permutation/dispatch work). The
load-balancing loss is off (coefficient 0): this measures the MoE layer's dispatch, not the loss.

Two runs, each measuring its dense and MoE stacks interleaved (median of ``--repeats`` steps after a
warm-up; on a shared machine other jobs only ever add time, so ``best`` is reported too):

- one process (``world=1``): dense vs MoE at EP=1 (every expert local, the dispatcher only permutes);
- two processes over gloo (``world=2``): dense (data-parallel, each rank its own tokens, no
  communication) vs MoE at EP=2 (each rank holds half of the experts; tokens travel by all-to-all).

One torch thread per process. Reported: tokens/s (all ranks together), ``moe_vs_dense`` at each
world size (the MoE layer's overhead at equal active parameters), and ``ep2_vs_ep1`` (aggregate
MoE throughput of two processes over one: 2.0 would be perfect scaling).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def hf_config(kind: str, a) -> dict:
    """A Qwen3(-MoE) config.json of the toy sizes: the dense one has the MoE's active MLP width."""
    cfg = {
        "model_type": "qwen3",
        "hidden_size": a.hidden,
        "num_hidden_layers": a.layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": a.hidden // 4,
        "vocab_size": 1024,
        "intermediate_size": a.topk * a.moe_intermediate,
    }
    if kind == "moe":
        cfg.update(
            model_type="qwen3_moe",
            num_experts=a.experts,
            num_experts_per_tok=a.topk,
            moe_intermediate_size=a.moe_intermediate,
            norm_topk_prob=True,
            router_aux_loss_coef=0.0,
        )
    return cfg


def build_stack(kind: str, a, ep: int):
    """[(norm, mlp)] * layers, through the project's layer spec and TransformerConfig."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer.spec_utils import build_module

    from megatron_klear.models.arch import arch_from_dict
    from megatron_klear.models.builder import ModelOptions, _patch_moe_without_te, layer_spec, transformer_config
    from megatron_klear.models.norm import RMSNorm
    from megatron_klear.platform.distributed import ParallelConfig

    arch = arch_from_dict(hf_config(kind, a), "benchmark")
    config = transformer_config(
        arch, ModelOptions(backend="local", dtype="fp32"), ParallelConfig(ep=ep if kind == "moe" else 1)
    )
    spec = layer_spec(arch, "local", moe=kind == "moe").submodules.mlp
    if kind == "moe":
        _patch_moe_without_te()
        kwargs = {}  # MoELayer takes Megatron's default process groups (EP, expert TP)
    else:
        kwargs = {"tp_group": parallel_state.get_tensor_model_parallel_group()}
    layers = []
    for i in range(a.layers):
        mlp = build_module(spec, config=config, **kwargs)
        if hasattr(mlp, "set_layer_number"):
            mlp.set_layer_number(i + 1)
        layers.append((RMSNorm(config, a.hidden, eps=1e-6), mlp))
    return torch.nn.ModuleList([torch.nn.ModuleList(pair) for pair in layers])


def step(stack, x):
    h = x
    for norm, mlp in stack:
        out, _ = mlp(norm(h))
        h = h + out
    h.float().pow(2).mean().backward()


def _worker(rank, world, a):
    import torch
    import torch.distributed as dist

    from megatron_klear.platform import init_parallel
    from megatron_klear.platform.distributed import ParallelConfig

    init_parallel(ParallelConfig(ep=world), seed=1)
    torch.manual_seed(100 + rank)  # each rank its own tokens
    stacks = {"dense": build_stack("dense", a, world), "moe": build_stack("moe", a, world)}
    x = torch.randn(a.tokens, 1, a.hidden)  # [sequence, batch, hidden]: Megatron's layout
    times = {k: [] for k in stacks}
    for r in range(a.warmup + a.repeats):
        for kind, stack in stacks.items():
            stack.zero_grad(set_to_none=True)
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            step(stack, x.clone().requires_grad_(True))
            if world > 1:
                dist.barrier()  # the step ends when the slowest rank's does
            if r >= a.warmup:
                times[kind].append(time.perf_counter() - t0)
    params = {k: sum(p.numel() for p in s.parameters()) for k, s in stacks.items()}
    return {"times": times, "params": params}


def measure(a, world: int) -> dict:
    from tests.distributed.helper import run_distributed  # the test suite's gloo spawner

    out = run_distributed(_worker, world, a, timeout=a.timeout)[0]
    res = {}
    for kind, ts in out["times"].items():
        med, best = statistics.median(ts), min(ts)
        res[kind] = {
            "step_s": med,
            "best_step_s": best,
            "tokens_per_s": world * a.tokens / med,
            "best_tokens_per_s": world * a.tokens / best,
            "params_per_rank": out["params"][kind],
        }
    res["moe_vs_dense"] = res["moe"]["tokens_per_s"] / res["dense"]["tokens_per_s"]
    res["moe_vs_dense_best"] = res["moe"]["best_tokens_per_s"] / res["dense"]["best_tokens_per_s"]
    return res


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--moe-intermediate", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank per step")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats (a smoke test)")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)
    if a.quick:
        a.hidden, a.moe_intermediate, a.layers, a.tokens, a.warmup, a.repeats = 64, 32, 2, 256, 1, 3
    started = time.time()
    results = {"ep1": measure(a, 1), "ep2": measure(a, 2)}
    results["ep2_vs_ep1"] = results["ep2"]["moe"]["tokens_per_s"] / results["ep1"]["moe"]["tokens_per_s"]
    results["dense2_vs_dense1"] = results["ep2"]["dense"]["tokens_per_s"] / results["ep1"]["dense"]["tokens_per_s"]
    results["setup"] = {
        k: getattr(a, k)
        for k in ("hidden", "experts", "topk", "moe_intermediate", "layers", "tokens", "warmup", "repeats", "quick")
    }
    results["machine"] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "platform": platform.platform(),
        "seconds": round(time.time() - started, 1),
    }
    print(
        f"MoE layer stack vs dense, same active parameters (hidden {a.hidden}, {a.experts} experts of "
        f"{a.moe_intermediate}, top-{a.topk}, {a.layers} layers, {a.tokens} tokens/rank, fwd+bwd, fp32, "
        "1 thread/process)"
    )
    print(f"{'run':<24}{'dense tok/s':>14}{'MoE tok/s':>14}{'MoE/dense':>11}{'(best)':>9}")
    for key, label in (("ep1", "1 process, EP=1"), ("ep2", "2 processes, EP=2")):
        r = results[key]
        print(
            f"{label:<24}{r['dense']['tokens_per_s']:>14.0f}{r['moe']['tokens_per_s']:>14.0f}"
            f"{r['moe_vs_dense']:>11.3f}{r['moe_vs_dense_best']:>9.3f}"
        )
    print(
        f"MoE EP=2 / EP=1 (aggregate): {results['ep2_vs_ep1']:.3f}; "
        f"dense 2 processes / 1: {results['dense2_vs_dense1']:.3f}"
    )
    print("RESULTS " + json.dumps(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
