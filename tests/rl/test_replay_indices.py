"""rl.actor.replay_indices: which experts a rank's routers replay for a row (router replay)."""

import pytest
import torch

from megatron_klear.rl.actor import replay_indices


def _routed(tokens, layers=2, topk=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, layers, 8, generator=g).argsort(-1)[..., :topk]


def test_the_engines_experts_are_kept_and_padding_gets_distinct_ones():
    routed = _routed(5)
    routed[3] = 0  # a padding row inside the row (pad_segments fills zeros), e.g. between CP segments
    idx = replay_indices(routed, 7)  # the model sees 2 more tokens than the engine routed
    assert idx.shape == (7, 2, 2)
    keep = [0, 1, 2, 4]
    assert torch.equal(idx[keep], routed[keep])
    for row in (3, 5, 6):  # never one expert twice for a token
        assert idx[row].tolist() == [[0, 1], [0, 1]]
    assert all(len(set(idx[t, layer].tolist())) == 2 for t in range(7) for layer in range(2))


def test_sequence_parallel_ranks_take_contiguous_slices():
    routed = _routed(8, seed=1)
    parts = [replay_indices(routed, 8, sp_rank=r, sp_size=2) for r in range(2)]
    assert torch.equal(torch.cat(parts), routed)
    with pytest.raises(ValueError, match="does not split over 3"):
        replay_indices(routed, 8, sp_rank=0, sp_size=3)


def test_top1_rows_are_left_alone():
    routed = torch.zeros(4, 1, 1, dtype=torch.long)  # top_k 1: a row of one expert is a real choice
    assert torch.equal(replay_indices(routed, 4), routed)
