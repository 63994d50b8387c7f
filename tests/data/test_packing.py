"""Packer and packed-row layout, against hand-computed values and a naive reference packer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_klear.data.packing import (
    build_packed_micro_batch,
    pack_best_fit_decreasing,
    pack_in_windows,
    packing_efficiency,
)


def reference_bfd(lengths, capacity):
    """Textbook best-fit decreasing, O(n * bins): scan all bins for the tightest fit.

    Tie rules of the real packer: items of equal length in index order; among bins with equal
    free space, the one most recently given that free space.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins, free, stamp = [], [], []
    clock = 0
    for i in order:
        best = None
        for b in range(len(bins)):
            if free[b] >= lengths[i] and (
                best is None or free[b] < free[best] or (free[b] == free[best] and stamp[b] > stamp[best])
            ):
                best = b
        if best is None:
            bins.append([])
            free.append(capacity)
            stamp.append(0)
            best = len(bins) - 1
        bins[best].append(i)
        free[best] -= lengths[i]
        clock += 1
        stamp[best] = clock
    return bins


def test_hand_computed_example():
    # 5 -> A(free 5); 4 -> A(1); 3 -> B(7); 3 -> B(4); 2 -> B(2); 2 -> B(0); 1 -> A(0)
    assert pack_best_fit_decreasing([5, 4, 3, 3, 2, 2, 1], 10) == [[0, 1, 6], [2, 3, 4, 5]]


def test_best_fit_not_first_fit():
    # 7 -> A(free 3); 4 -> B(6); 4 -> B(2); 1 -> B, the tightest bin (first fit would pick A).
    assert pack_best_fit_decreasing([7, 4, 4, 1], 10) == [[0], [1, 2, 3]]
    # Tie in free space (A and B both have 4 left): the most recently filled bin (B) is used.
    assert pack_best_fit_decreasing([6, 6, 1], 10) == [[0], [1, 2]]


@pytest.mark.parametrize("seed", range(6))
def test_matches_reference_and_invariants(seed):
    rng = np.random.default_rng(seed)
    capacity = int(rng.integers(20, 200))
    n = int(rng.integers(1, 300))
    lengths = rng.integers(1, capacity + 1, size=n)
    lengths[rng.random(n) < 0.3] = rng.integers(1, 6)  # plenty of ties
    bins = pack_best_fit_decreasing(lengths, capacity)
    assert bins == reference_bfd(lengths.tolist(), capacity)
    flat = [i for b in bins for i in b]
    assert sorted(flat) == list(range(n))  # every item exactly once
    assert all(sum(lengths[b]) <= capacity for b in bins)  # no bin over capacity
    assert all(b for b in bins)
    assert pack_best_fit_decreasing(lengths, capacity) == bins  # deterministic
    # Best fit leaves no two bins that could be merged when one of them holds a single item that
    # fits into another's free space... weaker but certain: at most one bin is at most half full.
    half = [b for b in bins if 2 * sum(lengths[b]) <= capacity]
    assert len(half) <= 1


def test_rejects_items_outside_capacity():
    with pytest.raises(ValueError, match="item 1 has length 11"):
        pack_best_fit_decreasing([3, 11, 2], 10)
    with pytest.raises(ValueError, match="item 0 has length 0"):
        pack_best_fit_decreasing([0, 1], 10)
    assert pack_best_fit_decreasing([], 10) == []


def test_windows_pack_independently():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 50, size=103)
    order = rng.permutation(103)
    bins = pack_in_windows(lengths, 64, order, window=25)
    window_of = {int(i): w // 25 for w, i in enumerate(order)}
    assert all(len({window_of[i] for i in b}) == 1 for b in bins)  # no bin spans two windows
    assert sorted(i for b in bins for i in b) == list(range(103))
    whole = pack_in_windows(lengths, 64, order, window=0)
    assert sorted(i for b in whole for i in b) == list(range(103))
    assert len(whole) <= len(bins)
    assert packing_efficiency(lengths, whole, 64) == pytest.approx(lengths.sum() / (len(whole) * 64))


def test_packed_row_hand_computed():
    b = build_packed_micro_batch(
        [np.array([10, 11, 12]), np.array([20, 21])],
        [np.array([0, 1, 1]), np.array([0, 1])],
        pad_token_id=0,
        pad_to_multiple=4,
    )
    assert b["tokens"].tolist() == [[10, 11, 12, 20, 21, 0, 0, 0]]
    # labels: next token within each example; last token of an example and padding -> pad id
    assert b["labels"].tolist() == [[11, 12, 0, 21, 0, 0, 0, 0]]
    # loss_mask[t] = mask of the label token: 11 (1), 12 (1), none, 21 (1)
    assert b["loss_mask"].tolist() == [[1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert b["cu_seqlens"].tolist() == [0, 3, 5, 8]
    assert b["cu_seqlens"].dtype == torch.int32
    assert b["tokens"].dtype == torch.int64 and b["loss_mask"].dtype == torch.float32
    assert (b["max_seqlen"], b["num_real_tokens"], b["num_loss_tokens"], b["num_examples"]) == (3, 5, 3, 2)


def test_packed_row_without_padding_and_empty_row():
    b = build_packed_micro_batch([np.array([5, 6])], [np.array([1, 1])], pad_token_id=9, pad_to_multiple=1)
    assert b["tokens"].tolist() == [[5, 6]] and b["labels"].tolist() == [[6, 9]]
    assert b["loss_mask"].tolist() == [[1.0, 0.0]] and b["cu_seqlens"].tolist() == [0, 2]
    empty = build_packed_micro_batch([], [], pad_token_id=9, pad_to_multiple=8)
    assert empty["tokens"].tolist() == [[9] * 8] and empty["cu_seqlens"].tolist() == [0, 8]
    assert (empty["num_real_tokens"], empty["num_loss_tokens"], empty["max_seqlen"]) == (0, 0, 8)
    assert empty["position_ids"].tolist() == [list(range(8))]


def test_packed_row_errors():
    with pytest.raises(ValueError, match="exceeds capacity 8"):
        build_packed_micro_batch([np.arange(7), np.arange(3)], [np.ones(7), np.ones(3)], pad_token_id=0, capacity=8)
    with pytest.raises(ValueError, match="example 1: 3 tokens but a loss mask of 2"):
        build_packed_micro_batch([np.arange(2), np.arange(3)], [np.ones(2), np.ones(2)], pad_token_id=0)
