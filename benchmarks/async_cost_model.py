"""The cost model behind ``python benchmarks/async_rl.py --long-cot``: one step of Klear's math RL on
Qwen3-8B at 32K tokens, on the paper's layout (rollout GPUs apart from the training GPUs), with
decode time modelled rather than measured (the arithmetic in benchmarks/RESULTS.md).

:class:`LongCoT` holds the assumptions (the model's KV cache per token, an 80 GB GPU's KV pool,
memory-bound decode steps, lognormal response lengths capped at the budget) and plays one SGLang
server's admission, retraction and decoding of its share of the responses;
:func:`long_cot_estimate` puts the servers together and gives each schedule's step: synchronous,
partial rollouts, one step ahead, and both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class LongCoT:
    """Assumptions of the estimate (each stated in benchmarks/RESULTS.md): Qwen3-8B in bf16 on
    80 GB H100/H800-class GPUs, one SGLang server (TP=1) per rollout GPU, decode memory-bound."""

    layers: int = 36
    kv_heads: int = 8
    head_dim: int = 128
    q_dim: int = 4096  # 32 heads x 128
    params: float = 8.19e9
    hbm: float = 80e9
    bandwidth: float = 3.35e12  # HBM3
    efficiency: float = 0.7  # of the bandwidth a decode step achieves
    mem_fraction: float = 0.85  # SGLang's --mem-fraction-static
    reserve: float = 4e9  # activations, CUDA graphs
    step_overhead_s: float = 2e-3  # scheduling and sampling per decode step
    prompt_tokens: int = 500
    budget: int = 32768
    median: float = 12000.0  # response lengths: lognormal per prompt, then per sample, capped at budget
    prompt_sigma: float = 0.6
    sample_sigma: float = 0.45

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * 2  # K and V, bf16

    @property
    def kv_pool_tokens(self) -> float:
        return (self.hbm * self.mem_fraction - 2 * self.params - self.reserve) / self.kv_bytes_per_token

    def step_s(self, live_tokens: float) -> float:
        """One decode step: read the weights and the live KV cache."""
        return (2 * self.params + live_tokens * self.kv_bytes_per_token) / (
            self.bandwidth * self.efficiency
        ) + self.step_overhead_s

    def lengths(self, rng, prompts: int, n: int):
        med = np.exp(rng.normal(np.log(self.median), self.prompt_sigma, prompts))
        return np.minimum(med[:, None] * np.exp(rng.normal(0.0, self.sample_sigma, (prompts, n))), self.budget).astype(
            int
        )

    def server_finish_s(self, lengths, trace: list | None = None):
        """Finish time of each response on one server: requests admitted in order while the KV pool
        holds their context plus 1,000 tokens of headroom each, the newest retracted (progress kept)
        when the pool overflows, every running sequence one token per decode step. ``trace``: gets
        ``(time, tokens generated since the previous entry)``."""
        n, gen, live = len(lengths), np.zeros(len(lengths)), np.zeros(len(lengths), bool)
        fin, t, queue, cap = np.full(n, np.nan), 0.0, list(range(n)), self.kv_pool_tokens
        while np.isnan(fin).any():
            while queue and (
                not live.any()
                or (self.prompt_tokens + gen[live]).sum() + self.prompt_tokens + gen[queue[0]] + 1000 * (live.sum() + 1)
                < cap
            ):
                live[queue.pop(0)] = True
            ctx = (self.prompt_tokens + gen[live]).sum()
            while ctx > cap and live.sum() > 1:
                i = np.flatnonzero(live)[-1]
                live[i] = False
                queue.insert(0, i)
                ctx = (self.prompt_tokens + gen[live]).sum()
            k = int(max(1, min((lengths[live] - gen[live]).min(), 256)))  # steps until the next finish (at most 256)
            t += k * self.step_s(ctx + live.sum() * k / 2)
            gen[live] += k
            if trace is not None:
                trace.append((t, k * int(live.sum())))
            ended = live & (gen >= lengths)
            fin[ended], live[ended] = t, False
        return fin


def long_cot_estimate(
    seed: int = 0,
    cfg: LongCoT | None = None,
    *,
    servers: int = 32,
    prompts: int = 256,
    n: int = 8,
    trained_prompts: int = 128,
    train_gpus: int = 32,
    peak_flops: float = 989e12,
    mfu: float = 0.4,
    sync_s: float = 5.0,
) -> dict:
    """One step of Klear's math RL on Qwen3-8B at 32K (prompts x n generated, trained_prompts x n
    trained), on ``servers`` rollout GPUs and ``train_gpus`` training GPUs: the synchronous step's
    generation (until its last response), the full-pool rate the servers reach when kept busy
    (what partial rollouts approach), the training time, and the step of each mode."""
    cfg = cfg or LongCoT()
    rng = np.random.default_rng(seed)
    lengths = cfg.lengths(rng, prompts, n)
    trace: list = []
    finish = np.concatenate([cfg.server_finish_s(lengths[s::servers].ravel(), trace) for s in range(servers)])
    flat = np.concatenate([lengths[s::servers].ravel() for s in range(servers)])
    generate_sync = float(finish.max())
    tokens = int(flat.sum())
    # partial rollouts' cut: the step ends once trained_prompts groups are complete; what is still
    # running then is aborted (continued at the next step)
    by_prompt = np.zeros((prompts, n))
    at = 0
    for s in range(servers):
        mine = list(range(s, prompts, servers))
        by_prompt[mine] = finish[at : at + len(mine) * n].reshape(len(mine), n)
        at += len(mine) * n
    quota_s = float(np.sort(by_prompt.max(axis=1))[trained_prompts - 1])
    running = by_prompt > quota_s
    done_tokens = sum(k for t, k in trace if t <= quota_s)
    done_by_half = sum(k for t, k in trace if t <= generate_sync / 2) / tokens
    # a pool kept full: a response of length L holds it L steps at L/2 on average, so the mean live
    # context is the prompt plus E[L^2] / (2 E[L])
    live_ctx = cfg.prompt_tokens + float((flat.astype(float) ** 2).mean() / (2 * flat.mean()))
    full_rate = cfg.kv_pool_tokens / live_ctx / cfg.step_s(cfg.kv_pool_tokens)
    generate_partial = tokens / (servers * full_rate)
    trained = trained_prompts * n * (cfg.prompt_tokens + flat.mean())
    # fwd + bwd (6), the old log-prob pass (2), full activation recompute (2); attention 4 x layers x q_dim
    # x the mean context, over the five forward-equivalents
    flops = trained * (10 * cfg.params + 5 * 4 * cfg.layers * cfg.q_dim * (cfg.prompt_tokens + flat.mean() / 2))
    train = flops / (train_gpus * peak_flops * mfu) + sync_s
    steps = {
        "sync": generate_sync + train,
        "partial": generate_partial + train,
        "async": max(generate_sync, train),
        "async_partial": max(generate_partial, train),
    }
    return {
        "lengths": {
            "p50": float(np.percentile(flat, 50)),
            "p90": float(np.percentile(flat, 90)),
            "max": int(flat.max()),
            "mean": float(flat.mean()),
            "capped": float((flat >= cfg.budget).mean()),
        },
        "tokens": tokens,
        "kv_pool_tokens": cfg.kv_pool_tokens,
        "full_pool_live_context": live_ctx,
        "full_pool_tokens_per_s": full_rate,
        "sync_tokens_per_s": tokens / generate_sync / servers,
        "finished_by_half_step": done_by_half,
        "generate_sync_s": generate_sync,
        "generate_partial_s": generate_partial,
        # in the synchronous schedule: when the quota of complete groups is met, and what partial
        # rollouts would abort then (samples, and the tokens they still have to generate)
        "quota_s": quota_s,
        "aborted_at_quota": float(running.mean()),
        "tokens_left_at_quota": 1.0 - done_tokens / tokens,
        "train_s": train,
        "step_s": steps,
        "speedup": {k: steps["sync"] / v for k, v in steps.items()},
    }
