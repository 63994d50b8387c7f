"""Packed rows for context parallelism: every segment padded to 2*CP, the row to TP*2*CP, each CP
rank's slice splits over TP, and no token or loss position is lost or duplicated."""

import random

import pytest
import torch

from megatron_klear.data.packing import build_packed_micro_batch
from megatron_klear.training.batches import prepare_packed


@pytest.mark.parametrize("tp,cp", [(1, 2), (2, 2), (4, 2), (2, 4), (8, 2)])
def test_cp_slices_split_evenly_and_cover_every_token(tp, cp):
    rng = random.Random(tp * 10 + cp)
    for _ in range(20):
        lengths = [rng.randint(2, 23) for _ in range(rng.randint(1, 5))]
        tokens = [[rng.randint(1, 99) for _ in range(n)] for n in lengths]
        masks = [[0] + [1] * (n - 1) for n in lengths]
        row = build_packed_micro_batch(tokens, masks, pad_token_id=0, pad_to_multiple=tp * 2 * cp)
        seen_labels, loss = [], 0.0
        for r in range(cp):
            local, params = prepare_packed(row, cp_rank=r, cp_size=cp, total_multiple=tp * 2 * cp)
            S = local["tokens"].shape[1]
            assert S % tp == 0  # sequence parallelism can scatter it
            cu = params.cu_seqlens_q.tolist()
            assert all((b - a) % (2 * cp) == 0 for a, b in zip(cu[:-1], cu[1:]))
            assert cu[-1] == S * cp and cu[-1] % (tp * 2 * cp) == 0
            loss += float(local["loss_mask"].sum())
            seen_labels += [int(x) for x, m in zip(local["labels"][0], local["loss_mask"][0]) if m]
        assert loss == float(row["loss_mask"].sum())
        want = [int(x) for x, m in zip(row["labels"][0], row["loss_mask"][0]) if m]
        assert sorted(seen_labels) == sorted(want)


def test_a_per_token_key_with_more_values_per_token_is_padded_and_split_with_the_tokens():
    """router replay: ``routed_experts`` [1, row, layers, top_k] follows the tokens through the CP
    padding and slicing (zeros where padding was inserted); a key absent from the batch is skipped."""
    lengths = [5, 3]
    row = build_packed_micro_batch(
        [[10 + i for i in range(n)] for n in lengths], [[1] * n for n in lengths], pad_token_id=0
    )
    T = row["tokens"].shape[1]
    # each token's "experts" encode its token id, so that the two can be compared after slicing
    row["routed_experts"] = row["tokens"][..., None, None].expand(1, T, 3, 2).clone()
    keys = ("tokens", "labels", "loss_mask", "position_ids", "routed_experts", "absent")
    for r in range(2):
        local, _ = prepare_packed(row, cp_rank=r, cp_size=2, per_token_keys=keys, total_multiple=4)
        assert "absent" not in local
        experts = local["routed_experts"]
        assert experts.shape == (1, local["tokens"].shape[1], 3, 2)
        assert torch.equal(experts, local["tokens"][..., None, None].expand_as(experts))
