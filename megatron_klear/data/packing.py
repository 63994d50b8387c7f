"""Packing variable-length examples into fixed-capacity bins, and the packed micro-batch layout.

Shared by SFT (examples from the indexed dataset) and RL (rollout samples).

Packer. :func:`pack_best_fit_decreasing` sorts items longest first and puts each into the open bin
whose free space is the smallest that still fits it (opening a new bin when none fits). Long-CoT
lengths are long-tailed (median ~6K, tail to 32K): the long items open bins and the short ones fill
the gaps, which is where best fit beats first fit. Free space is an integer in ``[0, capacity]``,
so open bins are kept in per-free-space stacks plus a boolean "non-empty" array; the smallest
sufficient free space is one vectorised ``argmax`` over that array. Cost is O(n * capacity / SIMD
width) in the worst case, a few microseconds per item at capacity 32768.

:func:`pack_in_windows` packs consecutive windows of a (shuffled) order independently: the result
keeps the randomness of the shuffle across windows (so epochs differ) and the per-window packing is
almost as tight as packing everything at once.

Layout. One bin becomes one micro-batch of a single packed row (``thd`` format). For examples
``x^1, ..., x^n`` with lengths ``L_1..L_n`` laid out back to back:

- ``tokens[o_i + t] = x^i_t``
- ``labels[o_i + t] = x^i_{t+1}`` for ``t < L_i - 1`` (the next token *of the same example*);
  the last token of each example predicts nothing: its label is the pad id and its mask 0.
- ``loss_mask[o_i + t] = m^i_{t+1}``: whether the *label* token is a trainable (assistant) token.
- ``position_ids[o_i + t] = t``: positions restart at 0 in every example.
- ``cu_seqlens = [0, o_2, ..., o_n, sum L]`` (int32) and, when the row is padded up to a multiple
  of ``pad_to_multiple``, one more entry for the padding segment; attention never crosses these
  boundaries. Padding tokens are the pad id, with restarting positions and mask 0.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pack_best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list:
    """Bins (lists of item indices) with ``sum(lengths[bin]) <= capacity``; every item once.

    Deterministic: ties in length are taken in index order, and among bins with equal free space
    the most recently touched one is used. Items inside a bin are in insertion order (longest
    first).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {lengths.shape}")
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if lengths.size == 0:
        return []
    bad = np.flatnonzero((lengths < 1) | (lengths > capacity))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"item {i} has length {int(lengths[i])}; every item must be in [1, capacity={capacity}]"
            f" ({bad.size} such items)"
        )
    order = np.argsort(-lengths, kind="stable")
    bins: list = []
    by_free: dict = {}  # free space -> stack of bin ids
    nonempty = np.zeros(capacity + 1, dtype=bool)
    for i in order.tolist():
        n = int(lengths[i])
        free = n + int(nonempty[n:].argmax())
        if nonempty[free]:
            stack = by_free[free]
            b = stack.pop()
            if not stack:
                nonempty[free] = False
        else:
            b = len(bins)
            bins.append([])
            free = capacity
        bins[b].append(i)
        rest = free - n
        if rest > 0:
            by_free.setdefault(rest, []).append(b)
            nonempty[rest] = True
    return bins


def pack_in_windows(
    lengths: Sequence[int], capacity: int, order: Optional[Sequence[int]] = None, window: int = 0
) -> list:
    """Best-fit-decreasing over consecutive windows of ``order`` (default: index order).

    ``window <= 0`` packs everything at once. Returns bins of indices into ``lengths``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.arange(lengths.size) if order is None else np.asarray(order, dtype=np.int64)
    if window <= 0:
        window = max(order.size, 1)
    bins = []
    for w0 in range(0, order.size, window):
        ids = order[w0 : w0 + window]
        for b in pack_best_fit_decreasing(lengths[ids], capacity):
            bins.append(ids[b].tolist())
    return bins


def assign_bins_to_ranks(costs, dp_size: int, per_rank: int) -> list:
    """Deal bins (by index into ``costs``) to ``dp_size`` ranks, ``per_rank`` slots each.

    Largest cost first to the least-loaded rank with a free slot (ties: lowest rank). Slots left
    when there are fewer bins than ``dp_size * per_rank`` hold ``None`` (a filler row).
    """
    if len(costs) > dp_size * per_rank:
        raise ValueError(f"{len(costs)} bins do not fit {dp_size} ranks x {per_rank} slots")
    loads = [0] * dp_size
    slots = [[] for _ in range(dp_size)]
    for b in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min((r for r in range(dp_size) if len(slots[r]) < per_rank), key=lambda r: (loads[r], r))
        slots[r].append(b)
        loads[r] += costs[b]
    for s in slots:
        s.extend([None] * (per_rank - len(s)))
    return slots


def packing_efficiency(lengths: Sequence[int], bins: Sequence[Sequence[int]], capacity: int) -> float:
    """Real tokens / (number of bins * capacity)."""
    if not bins:
        return 1.0
    lengths = np.asarray(lengths, dtype=np.int64)
    return float(sum(int(lengths[b].sum()) for b in bins)) / (len(bins) * capacity)


def build_packed_micro_batch(
    token_arrays: Sequence,
    loss_masks: Sequence,
    *,
    pad_token_id: int,
    pad_to_multiple: int = 1,
    capacity: Optional[int] = None,
) -> dict:
    """Lay out examples in one packed row (see module docstring) and return torch tensors.

    ``loss_masks[i][t]`` is 1 where token t of example i is trainable (not yet shifted). An empty
    list of examples gives a row of ``pad_to_multiple`` padding tokens with no loss (used to give
    every data-parallel rank the same number of micro-batches).

    Returns ``tokens``, ``labels``, ``position_ids`` ([1, S] int64), ``loss_mask`` ([1, S]
    float32), ``cu_seqlens`` ([n+1] int32, n counting a final padding segment), ``max_seqlen``,
    ``num_real_tokens``, ``num_loss_tokens`` (ints) and ``num_examples``.
    """
    import torch

    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    if len(token_arrays) != len(loss_masks):
        raise ValueError(f"{len(token_arrays)} token arrays but {len(loss_masks)} loss masks")
    lens = [len(t) for t in token_arrays]
    for i, (n, m) in enumerate(zip(lens, loss_masks)):
        if n < 1:
            raise ValueError(f"example {i} is empty")
        if len(m) != n:
            raise ValueError(f"example {i}: {n} tokens but a loss mask of {len(m)}")
    real = sum(lens)
    size = max(round_up(real, pad_to_multiple), pad_to_multiple)
    if capacity is not None and size > capacity:
        raise ValueError(f"packed row of {real} tokens (padded to {size}) exceeds capacity {capacity}")
    tokens = np.full(size, pad_token_id, dtype=np.int64)
    labels = np.full(size, pad_token_id, dtype=np.int64)
    loss_mask = np.zeros(size, dtype=np.float32)
    positions = np.zeros(size, dtype=np.int64)
    cu = [0]
    off = 0
    for t, m, n in zip(token_arrays, loss_masks, lens):
        t = np.asarray(t)
        tokens[off : off + n] = t
        labels[off : off + n - 1] = t[1:]
        loss_mask[off : off + n - 1] = np.asarray(m[1:], dtype=np.float32)
        positions[off : off + n] = np.arange(n)
        off += n
        cu.append(off)
    if size > off:
        positions[off:] = np.arange(size - off)
        cu.append(size)
    seg = np.diff(cu)
    return {
        "tokens": torch.from_numpy(tokens).unsqueeze(0),
        "labels": torch.from_numpy(labels).unsqueeze(0),
        "loss_mask": torch.from_numpy(loss_mask).unsqueeze(0),
        "position_ids": torch.from_numpy(positions).unsqueeze(0),
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
        "max_seqlen": int(seg.max()),
        "num_real_tokens": int(real),
        "num_loss_tokens": int(loss_mask.sum()),
        "num_examples": len(lens),
    }
