"""Per-token log-probabilities and entropy from vocabulary-parallel logits, in sequence chunks.

Under tensor parallelism each rank holds the logits of a contiguous slice of the vocabulary
(Megatron's ColumnParallelLinear output layer). The log-prob of the sampled token and the entropy are
computed without gathering the vocabulary anywhere: per token, two all-reduces over the TP group
(the max, then one stacked [sum-exp, target logit, sum p*z] vector). Rows are processed in chunks,
so at most one chunk of float32 logits (plus one of the same size for exp) exists at a time.

Two entry points:

- ``vocab_parallel_logprobs_and_entropy(logits_shard, targets, ...)``: the logits exist already
  (e.g. Megatron's output layer ran); chunking bounds only the float32 temporaries. Its backward
  recomputes the softmax chunk by chunk from the saved logits and needs no communication.
- ``chunked_logprobs_from_hidden(hidden, weight_shard, targets, ...)``: never materialises the full
  logits. Forward and backward compute ``hidden_chunk @ weight_shard.T`` one chunk at a time (the
  backward recomputes them), so a 32K-token sequence with a 152K vocabulary costs one chunk of logits.

Both apply the sampling temperature as the rollout engine does (``logits / T`` before the softmax),
so that log-probs recomputed here match the engine's. ``vocab_size`` (the true vocabulary size)
excludes the padding columns Megatron appends to make the vocabulary divisible by TP: they take no
part in the softmax and get zero gradient. ``targets`` are global vocabulary ids.

``group=None`` means the vocabulary is not split (one process, no communication) -- unlike
torch.distributed, where None is the world group. Outputs are float32 (float64 inputs stay float64).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

# Default chunk: this many float32 elements of logits per chunk (256 MiB), i.e. about 440 tokens
# of a 152K vocabulary at TP=1 and 3.5K at TP=8.
DEFAULT_CHUNK_ELEMENTS = 1 << 26


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(t: torch.Tensor, op, group) -> None:
    if _world(group) > 1:
        dist.all_reduce(t, op=op, group=group)


def _chunk_rows(chunk_size: Optional[int], n_rows: int, n_cols: int) -> int:
    if chunk_size is None:
        return max(1, DEFAULT_CHUNK_ELEMENTS // max(n_cols, 1))
    if int(chunk_size) < 1:
        raise ValueError(f"logprobs: chunk_size={chunk_size} must be >= 1 (or None for automatic)")
    return int(chunk_size)


def _valid_columns(v_local: int, vocab_start_index: int, vocab_size: Optional[int], group) -> Tuple[int, int]:
    """(number of non-padding columns in this shard, exclusive upper bound for target ids)."""
    if vocab_start_index < 0:
        raise ValueError(f"logprobs: vocab_start_index={vocab_start_index} must be >= 0")
    if group is None and vocab_start_index != 0:
        raise ValueError(
            f"logprobs: vocab_start_index={vocab_start_index} with group=None (unsplit vocabulary) must be 0"
        )
    if vocab_size is None:
        return v_local, v_local * _world(group)
    if vocab_size < 1:
        raise ValueError(f"logprobs: vocab_size={vocab_size} must be >= 1")
    return max(0, min(v_local, vocab_size - vocab_start_index)), vocab_size


def _check_targets(targets: torch.Tensor, limit: int) -> None:
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"logprobs: targets must be int64/int32 token ids, got {targets.dtype}")
    if targets.numel() and bool(((targets < 0) | (targets >= limit)).any()):
        bad = targets[(targets < 0) | (targets >= limit)][0].item()
        raise ValueError(
            f"logprobs: targets hold id {bad} outside the vocabulary [0, {limit}); replace ignored "
            "positions (e.g. -100) by a valid id and mask them in the loss"
        )


def _scaled_float_copy(logits: torch.Tensor, n_valid: int, temperature: float, owned: bool = False) -> torch.Tensor:
    """Float32 (or float64) non-padding columns divided by the temperature.

    A copy, unless ``owned`` (the caller's temporary, e.g. a chunk's matmul output) is already
    float32/64: then it is reused in place, saving one chunk of memory.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = logits[:, :n_valid].to(dtype, copy=not (owned and logits.dtype == dtype))
    if temperature != 1.0:
        z.div_(temperature)
    return z


def _forward_chunk(logits, targets, *, n_valid, vocab_start_index, temperature, group, owned=False):
    """Log-prob, entropy and log-sum-exp of one chunk of rows (logits: [rows, V_local])."""
    z = _scaled_float_copy(logits, n_valid, temperature, owned)
    del logits  # an owned low-precision chunk is freed here
    rows = z.shape[0]
    if n_valid > 0:
        zmax = z.max(dim=-1).values
    else:
        zmax = torch.full((rows,), float("-inf"), dtype=z.dtype, device=z.device)
    _all_reduce(zmax, dist.ReduceOp.MAX, group)
    z.sub_(zmax.unsqueeze(1))  # z - max <= 0

    local = targets - vocab_start_index
    in_shard = (local >= 0) & (local < n_valid)
    if n_valid > 0:
        target_z = z.gather(1, local.clamp(0, n_valid - 1).long().unsqueeze(1)).squeeze(1)
        target_z = torch.where(in_shard, target_z, torch.zeros_like(target_z))
        e = torch.exp(z)
        sum_exp = e.sum(dim=-1)
        sum_ez = e.mul_(z).sum(dim=-1)  # sum exp(z) * z, for the entropy
        del e
    else:
        target_z = sum_exp = sum_ez = torch.zeros(rows, dtype=z.dtype, device=z.device)
    del z
    stacked = torch.stack([sum_exp, target_z, sum_ez])
    _all_reduce(stacked, dist.ReduceOp.SUM, group)
    sum_exp, target_z, sum_ez = stacked.unbind(0)
    log_z = torch.log(sum_exp)
    logprob = target_z - log_z
    entropy = log_z - sum_ez / sum_exp  # -sum p log p with log p = z - log_z
    return logprob, entropy, zmax + log_z


def _grad_chunk(
    logits, targets, lse, entropy, g_logprob, g_entropy, *, n_valid, vocab_start_index, temperature, owned=False
):
    """d(loss)/d(logits) for one chunk, float, [rows, n_valid].

    d logp_t / d z_j = 1[j = t] - p_j;  d H / d z_j = -p_j (log p_j + H);  z = logits / T.
    """
    logp = _scaled_float_copy(logits, n_valid, temperature, owned)
    del logits
    if n_valid == 0:
        return logp
    logp.sub_(lse.unsqueeze(1))  # log p_j
    p = torch.exp(logp)
    # coefficient c_j so that grad_z = -p_j * c_j (+ g_logprob at the target)
    if g_entropy is not None:
        coef = logp.add_(entropy.unsqueeze(1)).mul_(g_entropy.unsqueeze(1))
        if g_logprob is not None:
            coef.add_(g_logprob.unsqueeze(1))
    elif g_logprob is not None:
        coef = logp.copy_(g_logprob.unsqueeze(1).expand_as(logp))
    else:
        return p.zero_()
    grad = coef.mul_(p).neg_()
    del p
    if g_logprob is not None:
        local = targets - vocab_start_index
        in_shard = (local >= 0) & (local < n_valid)
        idx = local.clamp(0, max(n_valid - 1, 0)).long().unsqueeze(1)
        grad.scatter_add_(1, idx, torch.where(in_shard, g_logprob, torch.zeros_like(g_logprob)).unsqueeze(1))
    if temperature != 1.0:
        grad.div_(temperature)
    return grad


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start_index, n_valid, temperature, chunk):
        n = logits.shape[0]
        out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        logprob = torch.empty(n, dtype=out_dtype, device=logits.device)
        entropy = torch.empty_like(logprob)
        lse = torch.empty_like(logprob)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            logprob[s:e], entropy[s:e], lse[s:e] = _forward_chunk(
                logits[s:e],
                targets[s:e],
                n_valid=n_valid,
                vocab_start_index=vocab_start_index,
                temperature=temperature,
                group=group,
            )
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.cfg = (vocab_start_index, n_valid, temperature, chunk)
        ctx.set_materialize_grads(False)
        return logprob, entropy

    @staticmethod
    def backward(ctx, g_logprob, g_entropy):
        logits, targets, lse, entropy = ctx.saved_tensors
        vocab_start_index, n_valid, temperature, chunk = ctx.cfg
        grad = torch.zeros_like(logits)
        if g_logprob is None and g_entropy is None:
            return grad, None, None, None, None, None, None
        n = logits.shape[0]
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            grad[s:e, :n_valid] = _grad_chunk(
                logits[s:e],
                targets[s:e],
                lse[s:e],
                entropy[s:e],
                None if g_logprob is None else g_logprob[s:e],
                None if g_entropy is None else g_entropy[s:e],
                n_valid=n_valid,
                vocab_start_index=vocab_start_index,
                temperature=temperature,
            )
        return grad, None, None, None, None, None, None


def vocab_parallel_logprobs_and_entropy(
    logits_shard: torch.Tensor,
    targets: torch.Tensor,
    *,
    group=None,
    vocab_start_index: int = 0,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``targets`` and entropy, from this rank's slice of the logits.

    ``logits_shard`` [..., V_local] holds global vocabulary columns
    ``[vocab_start_index, vocab_start_index + V_local)``; ``targets`` [...] are global ids, the same
    on every rank of ``group``. Returns float32 ``(logprobs, entropy)`` of ``targets.shape``, both
    differentiable w.r.t. ``logits_shard``. ``chunk_size`` is in rows (tokens); None picks one
    (``DEFAULT_CHUNK_ELEMENTS``). Every rank of the group must make the same call.
    """
    if logits_shard.shape[:-1] != targets.shape:
        raise ValueError(
            f"logprobs: logits_shard has shape {tuple(logits_shard.shape)}; expected targets' shape "
            f"{tuple(targets.shape)} plus a vocabulary dimension"
        )
    if not temperature > 0:
        raise ValueError(f"logprobs: temperature={temperature} must be > 0")
    v_local = logits_shard.shape[-1]
    n_valid, limit = _valid_columns(v_local, vocab_start_index, vocab_size, group)
    _check_targets(targets, limit)
    logits2d = logits_shard.reshape(-1, v_local)
    chunk = _chunk_rows(chunk_size, logits2d.shape[0], v_local)
    logprob, entropy = _VocabParallelLogprobEntropy.apply(
        logits2d, targets.reshape(-1), group, vocab_start_index, n_valid, float(temperature), chunk
    )
    return logprob.view(targets.shape), entropy.view(targets.shape)


class _ChunkedLinearLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, targets, group, vocab_start_index, n_valid, temperature, chunk, reduce_grad_hidden
    ):
        n = hidden.shape[0]
        out_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        logprob = torch.empty(n, dtype=out_dtype, device=hidden.device)
        entropy = torch.empty_like(logprob)
        lse = torch.empty_like(logprob)
        w = weight[:n_valid]
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            logprob[s:e], entropy[s:e], lse[s:e] = _forward_chunk(
                hidden[s:e] @ w.t(),
                targets[s:e],
                n_valid=n_valid,
                vocab_start_index=vocab_start_index,
                temperature=temperature,
                group=group,
                owned=True,
            )
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.cfg = (group, vocab_start_index, n_valid, temperature, chunk, reduce_grad_hidden)
        ctx.set_materialize_grads(False)
        return logprob, entropy

    @staticmethod
    def backward(ctx, g_logprob, g_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        group, vocab_start_index, n_valid, temperature, chunk, reduce_grad_hidden = ctx.cfg
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        none7 = (None,) * 7
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        if (g_logprob is None and g_entropy is None) or not (need_hidden or need_weight):
            return (grad_hidden, torch.zeros_like(weight) if need_weight else None) + none7
        w = weight[:n_valid]
        # Weight gradient summed over chunks in float32. With a low-precision weight each chunk's
        # product is computed in that precision (rounded once, as one micro-batch's gradient is
        # before it reaches Megatron's fp32 main_grad) into a buffer of the weight's size.
        if need_weight:
            grad_w = torch.zeros(
                weight.shape,
                dtype=torch.float32 if weight.dtype != torch.float64 else weight.dtype,
                device=weight.device,
            )
            product = None if weight.dtype == grad_w.dtype else torch.empty_like(w)
        n = hidden.shape[0]
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            h = hidden[s:e]
            g = _grad_chunk(
                h @ w.t(),
                targets[s:e],
                lse[s:e],
                entropy[s:e],
                None if g_logprob is None else g_logprob[s:e],
                None if g_entropy is None else g_entropy[s:e],
                n_valid=n_valid,
                vocab_start_index=vocab_start_index,
                temperature=temperature,
                owned=True,
            )
            g = g.to(hidden.dtype)
            if need_hidden:
                torch.matmul(g, w, out=grad_hidden[s:e])
            if need_weight:
                if product is None:
                    grad_w[:n_valid].addmm_(g.t(), h)
                else:
                    torch.matmul(g.t(), h, out=product)
                    grad_w[:n_valid].add_(product)
            del g
        if need_hidden and reduce_grad_hidden:
            _all_reduce(grad_hidden, dist.ReduceOp.SUM, group)
        return (grad_hidden, grad_w.to(weight.dtype) if need_weight else None) + none7


def chunked_logprobs_from_hidden(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    targets: torch.Tensor,
    *,
    group=None,
    vocab_start_index: int = 0,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
    reduce_grad_hidden: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``targets`` and entropy from the final hidden states, one chunk of logits at a time.

    ``hidden`` [..., H] is the input of the output layer, the same on every rank of ``group``
    (gather sequence-parallel activations first); ``weight_shard`` [V_local, H] is this rank's rows
    of the output layer (Megatron's ColumnParallelLinear layout, no bias); ``targets`` [...] global
    ids. Returns float32 ``(logprobs, entropy)`` of ``targets.shape``, differentiable w.r.t. both.

    The gradient of ``hidden`` is all-reduced over ``group`` (as ColumnParallelLinear's input
    gradient is); pass ``reduce_grad_hidden=False`` when the caller's own op reduces it (e.g. the
    reduce-scatter in the backward of a sequence-parallel gather). The weight gradient is this
    shard's, summed over chunks in float32 (a bf16 weight costs a float32 accumulator and one bf16
    product buffer of the shard's size during backward). Backward recomputes each chunk's logits: one
    extra matmul per chunk for peak memory of one chunk instead of the whole [tokens, V_local].
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"logprobs: hidden has shape {tuple(hidden.shape)}; expected targets' shape {tuple(targets.shape)} "
            "plus a hidden dimension"
        )
    if weight_shard.dim() != 2 or weight_shard.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"logprobs: weight_shard has shape {tuple(weight_shard.shape)}; expected [V_local, {hidden.shape[-1]}]"
        )
    if not temperature > 0:
        raise ValueError(f"logprobs: temperature={temperature} must be > 0")
    if weight_shard.dtype != hidden.dtype:
        raise ValueError(f"logprobs: weight_shard is {weight_shard.dtype} but hidden is {hidden.dtype}")
    v_local = weight_shard.shape[0]
    n_valid, limit = _valid_columns(v_local, vocab_start_index, vocab_size, group)
    _check_targets(targets, limit)
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    chunk = _chunk_rows(chunk_size, hidden2d.shape[0], v_local)
    logprob, entropy = _ChunkedLinearLogprobEntropy.apply(
        hidden2d,
        weight_shard,
        targets.reshape(-1),
        group,
        vocab_start_index,
        n_valid,
        float(temperature),
        chunk,
        bool(reduce_grad_hidden),
    )
    return logprob.view(targets.shape), entropy.view(targets.shape)
