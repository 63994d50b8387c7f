"""Do the rollout servers serve the trainer's weights? A probe check after weight syncs.

Every server continues a fixed probe prompt greedily for :data:`PROBE_NEW_TOKENS` tokens
(``ignore_eos``) and returns the log-prob of each token (greedy: ``log_softmax`` of the logits at
temperature 1, in SGLang and in the embedded engine); the trainer recomputes the log-probs of the
same tokens with its own weights (the actor's packed forward, at temperature 1, collective over
TP/PP/CP/DP). A server whose mean absolute difference exceeds the tolerance does not hold the
trainer's weights (a corrupted transfer, a server that loaded something else, a bucket that never
arrived), and the run stops naming the first such server.

Tolerances are per dtype (the coarser of the server's and the trainer's): float32 1e-3 (CPU runs
agree to ~1e-6), float16 2e-2, bfloat16 5e-2 (SGLang and Megatron in bf16 differ in kernels and
reduction order; a wrong tensor moves log-probs by far more), and 1.5e-1 for a trainer in FP8
(``model.fp8``: its GEMMs in E4M3; a first estimate, not yet measured on a GPU). A server
reporting SGLang's ``auto`` dtype is taken as bfloat16. ``rollout.verify_tolerance`` overrides them.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from megatron_klear.platform.dtypes import canonical_name
from megatron_klear.rollout.base import WorkerGone

PROBE_TEXT = "Weight sync probe: the quick brown fox jumps over the lazy dog. 1, 2, 3, 5, 8, 13, 21"
PROBE_NEW_TOKENS = 16
# "fp8": a trainer whose linear layers run in FP8 (model.fp8) against bf16 servers. E4M3 keeps 3
# mantissa bits against bf16's 7, so the greedy probe's log-probs move several times more than
# between two bf16 stacks; a missing or wrong tensor still moves them by far more.
TOLERANCES = {"float64": 1e-3, "float32": 1e-3, "float16": 2e-2, "bfloat16": 5e-2, "fp8": 1.5e-1}


class WeightVerificationError(RuntimeError):
    pass


def dtype_tolerance(*dtypes) -> float:
    """The coarsest tolerance of ``dtypes`` (names or torch dtypes; unknown ones as bfloat16)."""
    tol = 0.0
    for d in dtypes:
        name = canonical_name(d)
        tol = max(tol, TOLERANCES.get(name, TOLERANCES["bfloat16"]))
    return tol


def probe_prompt(tokenizer, vocab_size: int | None = None) -> list:
    """The probe's token ids (the fixed text; ids beyond the model's vocabulary are dropped)."""
    ids = [int(t) for t in tokenizer.encode(PROBE_TEXT, add_special_tokens=False)]
    if vocab_size is not None:
        ids = [t for t in ids if 0 <= t < vocab_size]
    if not ids:
        raise ValueError("the weight-sync probe text has no token in the model's vocabulary")
    return ids


@torch.no_grad()
def trainer_logprob_diffs(actor, probes: list) -> list:
    """Collective (every trainer rank, same ``probes``). ``probes``: ``[(prompt_ids, response_ids,
    engine_logprobs)]``. Returns per probe ``(mean |trainer - engine|, max, tokens)`` of the
    response tokens' log-probs at temperature 1 (NaN counts as infinitely far)."""
    from megatron_klear.platform import comm_device
    from megatron_klear.rl.batch import RL_PER_TOKEN_KEYS, RolloutSample
    from megatron_klear.training.step import run_micro_batches

    n = len(probes)
    samples = [
        RolloutSample(
            prompt_ids=list(p), response_ids=list(r), advantage=0.0, group=0, rollout_logprobs=[float(x) for x in lp]
        )
        for p, r, lp in probes
    ]
    ((_, mbs),) = actor.plan(samples)  # one mini-batch (one group), this DP rank's micro-batches

    def loss_fn(local, logprobs, entropy):
        mask = local["loss_mask"].bool()
        diff = torch.nan_to_num((logprobs.double() - local["rollout_logprobs"].double()).abs(), nan=math.inf)
        seq = local["seq_ids"].round().long()
        sums, counts, maxs = (
            torch.zeros(n, dtype=torch.float64),
            torch.zeros(n, dtype=torch.float64),
            torch.zeros(n, dtype=torch.float64),
        )
        for i in range(n):
            sel = mask & (seq == i)
            if bool(sel.any()):
                d = diff[sel].cpu()
                sums[i], counts[i], maxs[i] = d.sum(), d.numel(), d.max()
        return logprobs.sum() * 0.0, {"sums": sums, "counts": counts, "maxs": maxs}

    results = run_micro_batches(
        actor.state.model,
        mbs,
        loss_fn,
        forward_only=True,
        temperature=1.0,
        chunk_size=actor.chunk_size,
        per_token_keys=RL_PER_TOKEN_KEYS,
        pad_id=actor.pad_id,
    )
    sums, counts, maxs = (torch.zeros(n, dtype=torch.float64) for _ in range(3))
    for r in results:
        sums += r["sums"]
        counts += r["counts"]
        maxs = torch.maximum(maxs, r["maxs"])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dev = comm_device()
        packed = torch.stack([sums, counts]).to(dev)
        dist.all_reduce(packed)  # TP ranks repeat both sums and counts: the means are unaffected
        top = maxs.to(dev)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        sums, counts, maxs = packed[0].cpu(), packed[1].cpu(), top.cpu()
    out = []
    for s, c, m, (_, r, _) in zip(sums.tolist(), counts.tolist(), maxs.tolist(), probes):
        out.append((s / c if c else math.inf, m, len(r)))
    return out


def first_mismatch(workers: list, diffs: list, tolerances: list):
    """``(worker, mean, max, tolerance)`` of the first worker over its tolerance, or None."""
    for w, (mean, top, _), tol in zip(workers, diffs, tolerances):
        if not mean <= tol:  # NaN / inf included
            return w, mean, top, tol
    return None


def verification_due(
    syncs: int, step: int, interval: int, *, since: int | None = None, first_delta: bool = False
) -> bool:
    """After the first push of this process (a fresh start or a resume), after the first delta sync
    that follows a full one (``first_delta``, ``rollout.sync_delta``: the servers' delta loader is
    checked as soon as it is used, not an interval later), and every ``interval`` RL steps
    (``rollout.verify_interval``: 0 only those, -1 never): a push after step ``step`` is checked
    when a multiple of ``interval`` lies in ``(since, step]``, ``since`` the step of the previous
    push (default ``step - 1``). Steps that changed no weight push nothing, so the check they were
    due for runs at the next push, and the cadence stays in steps."""
    if interval < 0:
        return False
    if syncs == 1 or first_delta:
        return True
    previous = step - 1 if since is None else since
    return bool(interval) and step // interval > previous // interval


def _probe_workers(engine, prompt, only_rejoining: bool):
    """Rank 0: ``(workers, [(token ids, log-probs)], {worker: dtype}, rejoining)`` of the workers
    probed -- every serving one, or only the rejoining ones -- leaving out (and dropping from the
    fleet) those that are gone by now; an error naming the lost workers
    when too few live ones remain."""
    rejoining = engine.rejoining_workers()
    candidates = rejoining if only_rejoining else list(engine.workers())
    workers, outs, dtypes = [], [], {}
    for w in candidates:
        try:
            out = engine.probe(w, prompt, PROBE_NEW_TOKENS)
            dtype = str((engine.server_info(w) or {}).get("dtype") or "auto")
        except WorkerGone as e:
            engine.drop_worker(w, f"gone at the weight check: {e}")
            continue
        workers.append(w)
        outs.append((out.token_ids, out.logprobs))
        dtypes[w] = dtype
    return workers, outs, dtypes, rejoining


def verify_servers(
    engine,
    actor,
    tokenizer,
    vocab_size: int,
    version: int,
    tolerance: float = 0.0,
    *,
    only_rejoining: bool = False,
    trainer_turn=contextlib.nullcontext,
) -> dict:
    """Collective: every server's log-probs of the probe must equal the trainer's within the
    dtype-aware tolerance (``tolerance`` > 0 overrides it); else :class:`WeightVerificationError`
    naming the first server that differs, on every rank. ``engine``: rank 0's (None elsewhere).

    With a fleet (servers), the workers probed are the serving ones (live and rejoining), or
    with ``only_rejoining`` the rejoining ones alone (a push that is not due for the check still
    checks every worker that rejoins). A rejoining worker that differs is dropped again (it gets no
    request; rank 0 drops it), a live one that differs is the error above; a worker gone by the
    time it is probed is dropped. Returns metrics (``weights/verify_mean_diff_max``, over the
    workers probed). ``trainer_turn()``: the context the trainer's scoring runs in (colocated
    servers give up their KV cache for it when the trainer's communicators are suspended)."""
    from megatron_klear.checkpoint.model_weights import unwrap
    from megatron_klear.platform import broadcast_from_rank0, is_rank0

    prompt = probe_prompt(tokenizer, vocab_size)
    payload = None
    if is_rank0():
        try:
            payload = _probe_workers(engine, prompt, only_rejoining)
        except Exception as e:  # noqa: BLE001 -- reported on every rank
            payload = f"rollout: the weight check could not probe the servers: {e}"
    payload = broadcast_from_rank0(payload)
    if isinstance(payload, str):
        raise WeightVerificationError(payload)
    workers, outs, dtypes, rejoining = payload
    if not workers:
        return {}
    with trainer_turn():
        diffs = trainer_logprob_diffs(actor, [(prompt, ids, lps) for ids, lps in outs])
    config = unwrap(actor.state.model[0]).config
    trainer_dtype = "fp8" if config.fp8 else config.params_dtype  # FP8 GEMMs under bf16 parameters
    tols = [tolerance or dtype_tolerance(dtypes.get(w), trainer_dtype) for w in workers]
    for w, (mean, _top, _), tol in zip(workers, diffs, tols):
        if w in rejoining and not mean <= tol and is_rank0():
            engine.drop_worker(
                w,
                f"rejoined without the trainer's weights (weight version {version}): its "
                f"log-probs of the probe differ by {mean:.3g} on average, above {tol:g}",
            )
    live = [i for i, w in enumerate(workers) if w not in rejoining]
    bad = first_mismatch([workers[i] for i in live], [diffs[i] for i in live], [tols[i] for i in live])
    if bad is not None:
        w, mean, top, tol = bad
        raise WeightVerificationError(
            f"rollout: the server {w} does not serve the trainer's weights (weight version {version}): its "
            f"log-probs of the probe differ from the trainer's by {mean:.3g} on average (max {top:.3g}) over "
            f"{PROBE_NEW_TOKENS} tokens, above the tolerance {tol:g} (dtypes: server {dtypes.get(w)}, trainer "
            f"{canonical_name(trainer_dtype)}; rollout.verify_tolerance). A corrupted or incomplete "
            "transfer, or a server loading other weights: stopping"
        )
    return {"weights/verify_mean_diff_max": max(d[0] for d in diffs)}
