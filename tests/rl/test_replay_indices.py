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


def test_a_sample_without_routes_is_refused_in_the_plan_before_any_rank_builds_a_row(monkeypatch):
    """Router replay with one sample of the batch lacking the engine's routes: the actor's plan
    refuses it before it asks which data-parallel rank it is (every rank holds every sample and
    decides alike), not in the one rank's row build while the others enter their collectives."""
    import types

    from megatron.core import parallel_state

    from megatron_klear.rl.actor import Actor
    from tests.distributed.test_actor import make_samples

    def no_rank_yet():
        raise AssertionError("the plan asked for its data-parallel rank before refusing the batch")

    monkeypatch.setattr(parallel_state, "get_data_parallel_rank", no_rank_yet)
    samples = make_samples()
    for s in samples:
        s.routed_experts = _routed(len(s) - 1, seed=len(s)).to(torch.int16)
    samples[7].routed_experts = None
    arch = types.SimpleNamespace(moe_layer_pattern=[True, True], moe_topk=2)
    cfg = types.SimpleNamespace(parallel=types.SimpleNamespace(tp=1, cp=1, pp=1, vpp=None, sequence_parallel=False))
    cfg.model = types.SimpleNamespace(fp8=None, fp8_recipe="delayed")
    fake = types.SimpleNamespace(state=types.SimpleNamespace(config=cfg, arch=arch), router_replay=True)
    with pytest.raises(ValueError, match=r"sample 7 \(1 of 12 without\) carries no routed_experts"):
        Actor.plan(fake, samples)


def test_selective_recompute_of_the_moe_layer_is_refused_under_router_replay():
    """Megatron-Core's selective recompute of "moe" reruns the routers in the backward, which
    recomputed_layers does not list (their replay would take another micro-batch's routes)."""
    import types

    from megatron_klear.rl.actor import recomputed_layers

    def chunk(granularity, modules):
        config = types.SimpleNamespace(
            recompute_granularity=granularity, recompute_modules=modules, recompute_method="uniform", fp8=None
        )
        layers = [types.SimpleNamespace(layer_number=n) for n in (1, 2)]
        return types.SimpleNamespace(config=config, decoder=types.SimpleNamespace(layers=layers))

    assert recomputed_layers([chunk("selective", ["core_attn", "moe_act"])]) == set()
    assert recomputed_layers([chunk("full", None)]) == {1, 2}
    with pytest.raises(ValueError, match=r"selective recompute of 'moe'"):
        recomputed_layers([chunk("selective", ["core_attn", "moe"])])
