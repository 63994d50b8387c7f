"""FP8 padding per rank: after the packers, ``pad_segments`` and the CP split that the trainer uses,
every CP rank's token count (and, under sequence parallelism, every SP shard) meets what
Transformer Engine checks for the FP8 recipe, without padding more than needed.

The requirements below are written out independently of ``padding_rule`` (see the docstring of
``megatron_klear.training.batches`` for where in TE each comes from):

- every recipe: each linear layer's local input (the SP shard under SP) has a multiple of 8 rows;
- wgrad GEMM on the CP-local tokens: a multiple of 16 (32 for mxfp8);
- quantized SP all-gather of a shard: a multiple of 32 (mxfp8) / 128 (blockwise).
"""

import random
from types import SimpleNamespace

import pytest
import torch

from megatron_klear.data.packing import build_packed_micro_batch
from megatron_klear.models.builder import FP8_RECIPES
from megatron_klear.platform.distributed import ParallelConfig
from megatron_klear.rl.batch import RL_PER_TOKEN_KEYS, RolloutSample, build_rl_micro_batch
from megatron_klear.training.batches import (
    PER_TOKEN_KEYS_DEFAULT,
    model_padding_rule,
    padding_rule,
    prepare_packed,
    row_multiple,
)

GEMM_TOKENS = {"delayed": 16, "tensorwise": 16, "blockwise": 16, "mxfp8": 32}
SHARD_TOKENS_SP = {"delayed": 8, "tensorwise": 8, "blockwise": 128, "mxfp8": 32}

LAYOUTS = [(tp, cp, sp) for tp in (1, 2, 4, 8) for cp in (1, 2, 4) for sp in (False, True) if tp > 1 or not sp]


def _check_rank_counts(row, *, tp, cp, sp, fp8, recipe, keys, real_segments):
    """Split ``row`` exactly as training.step does and check every rank; returns the padded length."""
    config = SimpleNamespace(fp8=fp8, fp8_recipe=recipe, sequence_parallel=sp)
    total_multiple = model_padding_rule(config, tp, cp).row_multiple  # what run_micro_batches passes
    padded_len, loss, labels = None, 0.0, []
    for r in range(cp):
        local, params = prepare_packed(row, cp_rank=r, cp_size=cp, per_token_keys=keys, total_multiple=total_multiple)
        cu = params.cu_seqlens_q.tolist()
        padded_len = cu[-1]
        T = local["tokens"].shape[1]
        assert all(local[k].shape[1] == T for k in keys if k in row)  # (routed_experts: router replay only)
        assert T * cp == padded_len  # every CP rank holds the same number of tokens
        if cp > 1:
            assert all((b - a) % (2 * cp) == 0 for a, b in zip(cu[:-1], cu[1:]))
        if sp:
            assert T % tp == 0
            S = T // tp
            if fp8:
                assert S % 8 == 0 and S % SHARD_TOKENS_SP[recipe] == 0, (T, S)
        if fp8:
            assert T % 8 == 0 and T % GEMM_TOKENS[recipe] == 0, T
        loss += float(local["loss_mask"].sum())
        labels += [int(x) for x, m in zip(local["labels"][0], local["loss_mask"][0]) if m]
    # nothing lost or duplicated
    assert loss == float(row["loss_mask"].sum())
    assert sorted(labels) == sorted(int(x) for x, m in zip(row["labels"][0], row["loss_mask"][0]) if m)
    # not wasteful: < one segment multiple per segment + one row multiple
    real = int(row["num_real_tokens"])
    seg = 2 * cp if cp > 1 else 1
    if real:
        assert padded_len < real + real_segments * seg + total_multiple, (padded_len, real, real_segments)
    else:
        assert padded_len == total_multiple  # a filler row
    return padded_len


@pytest.mark.parametrize("recipe", FP8_RECIPES)
@pytest.mark.parametrize("tp,cp,sp", LAYOUTS)
def test_every_rank_meets_the_recipe_sft_rows(tp, cp, sp, recipe):
    parallel = ParallelConfig(tp=tp, cp=cp, sequence_parallel=sp)
    multiple = row_multiple(parallel, "hybrid", recipe)
    rng = random.Random(f"{tp}-{cp}-{sp}-{recipe}")
    rows = [[]] + [[rng.randint(1, 700) for _ in range(rng.randint(1, 6))] for _ in range(12)]
    for lengths in rows:
        tokens = [[rng.randint(1, 99) for _ in range(n)] for n in lengths]
        masks = [[0] + [1] * (n - 1) for n in lengths]
        row = build_packed_micro_batch(tokens, masks, pad_token_id=0, pad_to_multiple=multiple)
        assert row["tokens"].shape[1] % multiple == 0
        n = _check_rank_counts(
            row,
            tp=tp,
            cp=cp,
            sp=sp,
            fp8="hybrid",
            recipe=recipe,
            keys=PER_TOKEN_KEYS_DEFAULT,
            real_segments=len(lengths),
        )
        if cp == 1:  # the packer's row is used as is
            assert n == row["tokens"].shape[1]


@pytest.mark.parametrize("recipe", ["delayed", "blockwise", "mxfp8"])
@pytest.mark.parametrize("tp,cp,sp", [(2, 2, True), (4, 2, True), (2, 4, False), (8, 1, True), (1, 2, False)])
def test_every_rank_meets_the_recipe_rl_rows(tp, cp, sp, recipe):
    parallel = ParallelConfig(tp=tp, cp=cp, sequence_parallel=sp)
    multiple = row_multiple(parallel, "e4m3", recipe)
    rng = random.Random(7 * tp + cp)
    for _ in range(8):
        samples = [
            RolloutSample(
                prompt_ids=[rng.randint(1, 99) for _ in range(rng.randint(1, 40))],
                response_ids=[rng.randint(1, 99) for _ in range(rng.randint(1, 300))],
                advantage=rng.uniform(-1, 1),
                group=0,
            )
            for _ in range(rng.randint(0, 5))
        ]
        row = build_rl_micro_batch(samples, list(range(len(samples))), pad_id=0, pad_to_multiple=multiple)
        _check_rank_counts(
            row, tp=tp, cp=cp, sp=sp, fp8="e4m3", recipe=recipe, keys=RL_PER_TOKEN_KEYS, real_segments=len(samples)
        )


@pytest.mark.parametrize("tp,cp,sp", LAYOUTS)
def test_without_fp8_the_rule_is_unchanged(tp, cp, sp):
    parallel = ParallelConfig(tp=tp, cp=cp, sequence_parallel=sp)
    for recipe in FP8_RECIPES:  # the recipe does not matter without FP8
        assert row_multiple(parallel, None, recipe) == (tp * 2 * cp if cp > 1 else tp)
    rng = random.Random(tp + 10 * cp)
    for _ in range(5):
        lengths = [rng.randint(1, 50) for _ in range(rng.randint(1, 4))]
        row = build_packed_micro_batch(
            [[5] * n for n in lengths],
            [[0] + [1] * (n - 1) for n in lengths],
            pad_token_id=0,
            pad_to_multiple=row_multiple(parallel),
        )
        _check_rank_counts(
            row,
            tp=tp,
            cp=cp,
            sp=sp,
            fp8=None,
            recipe="delayed",
            keys=PER_TOKEN_KEYS_DEFAULT,
            real_segments=len(lengths),
        )


def test_rule_values():
    # TP=2 + SP, CP=2 (issue 8): 16 tokens per CP rank, 8 per SP shard with delayed scaling
    r = padding_rule(2, 2, True, "hybrid", "delayed")
    assert (r.row_multiple, r.local_multiple, r.shard_multiple, r.segment_multiple) == (32, 16, 8, 4)
    assert padding_rule(2, 2, True, "hybrid", "blockwise").shard_multiple == 128
    assert padding_rule(2, 2, False, "hybrid", "blockwise").row_multiple == 32  # no quantized all-gather
    assert padding_rule(1, 1, False, "hybrid", "mxfp8").row_multiple == 32
    assert padding_rule(4, 1, True, "hybrid", "mxfp8").row_multiple == 128
    assert padding_rule(8, 4, True, "hybrid", "tensorwise").row_multiple == 256
    with pytest.raises(ValueError, match="fp8_recipe"):
        padding_rule(1, 1, False, "hybrid", "nvfp4")
    with pytest.raises(ValueError, match="fp8"):
        padding_rule(1, 1, False, "e5m2", "delayed")


def test_explicit_pad_to_multiple():
    parallel = ParallelConfig(tp=2, cp=2, sequence_parallel=True)
    assert row_multiple(parallel, "hybrid", "blockwise", explicit=0) == 512
    assert row_multiple(parallel, "hybrid", "blockwise", explicit=1024) == 1024
    with pytest.raises(ValueError, match=r"data\.pad_to_multiple=256 .*multiple of 512"):
        row_multiple(parallel, "hybrid", "blockwise", explicit=256)
    with pytest.raises(ValueError, match=r"data\.pad_to_multiple=16 .*multiple of 32"):
        row_multiple(parallel, "hybrid", "delayed", explicit=16)
    # without FP8 only the hard requirement (the row splits over CP and, under SP, over TP)
    assert row_multiple(parallel, None, "delayed", explicit=4) == 4
    with pytest.raises(ValueError, match=r"data\.pad_to_multiple=2 "):
        row_multiple(parallel, None, "delayed", explicit=2)


def test_packer_padding_is_resized_not_stacked():
    """With CP the packer's trailing padding segment is resized: no second round of padding."""
    tokens = [list(range(1, 62))]  # 61 tokens; the packer pads to 64 with a 3-token segment
    row = build_packed_micro_batch(tokens, [[1] * 61], pad_token_id=0, pad_to_multiple=4)
    assert row["cu_seqlens"].tolist() == [0, 61, 64]
    local, params = prepare_packed(row, cp_rank=0, cp_size=2, total_multiple=4)
    assert params.cu_seqlens_q.tolist() == [0, 64]  # not [0, 64, 68]
    assert local["tokens"].shape[1] == 32
    filler = build_packed_micro_batch([], [], pad_token_id=0, pad_to_multiple=4)
    local, params = prepare_packed(filler, cp_rank=1, cp_size=2, total_multiple=32)
    assert params.cu_seqlens_q.tolist() == [0, 32] and local["tokens"].shape[1] == 16
    assert torch.all(local["loss_mask"] == 0)
