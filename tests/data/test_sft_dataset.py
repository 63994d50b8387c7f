"""The training-side reader: every example once per epoch, equal micro-batch counts per DP rank,
row contents equal the stored examples, determinism, exact resume (also across a DP resize)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from megatron_klear.data.preprocess import PreprocessConfig, preprocess
from megatron_klear.data.sft_dataset import PackedSFTDataset, assign_bins_to_ranks
from tests.data.helpers import synthetic_rows, write_jsonl

SEQ = 384
PAD = 8


@pytest.fixture(scope="module")
def prefix(tmp_path_factory, tokenizer_dir):
    d = tmp_path_factory.mktemp("sft")
    path = write_jsonl(d / "train.jsonl", synthetic_rows(90, seed=3, max_sentences=10))
    cfg = PreprocessConfig(
        inputs=[path],
        tokenizer=tokenizer_dir,
        output_prefix=str(d / "ds"),
        max_length=SEQ,
        overlong="truncate",
        progress_every_s=1e9,
    )
    preprocess(cfg)
    return cfg.output_prefix


def make(prefix, **kw):
    kw.setdefault("seq_length", SEQ)
    kw.setdefault("seed", 7)
    kw.setdefault("pad_to_multiple", PAD)
    kw.setdefault("pack_window", 40)
    return PackedSFTDataset(prefix, **kw)


def rank_batches(prefix, dp_size, m, epochs=1, **kw):
    """Every rank's micro-batches for ``epochs`` epochs, as lists."""
    return [
        list(make(prefix, dp_rank=r, dp_size=dp_size, micro_batches_per_step=m, num_epochs=epochs, **kw))
        for r in range(dp_size)
    ]


def test_epoch_covers_every_example_once_with_equal_counts_per_rank(prefix):
    per_rank = rank_batches(prefix, dp_size=2, m=3)
    ds = make(prefix, dp_size=2, micro_batches_per_step=3)
    n = len(ds.reader)
    assert n > 80
    assert len({len(b) for b in per_rank}) == 1  # same number of micro-batches on every rank
    assert len(per_rank[0]) == 3 * ds.steps_in_epoch(0)
    seen = [i for batches in per_rank for b in batches for i in b["example_ids"]]
    assert sorted(seen) == list(range(n))  # every example exactly once
    for batches in per_rank:
        for k, b in enumerate(batches):
            assert b["step"] == k // 3 and b["epoch"] == 0
            S = b["tokens"].shape[1]
            assert S % PAD == 0 and S <= SEQ
            # padded to the multiple, not to seq_length (a filler row is one multiple of padding)
            assert S - b["num_real_tokens"] < PAD or (b["num_examples"] == 0 and S == PAD)
    stats = ds.epoch_stats(0)
    assert stats["examples"] == n and stats["dropped_examples"] == 0
    assert stats["real_tokens"] == int(ds.reader.lengths.sum())
    assert 0.5 < stats["packing_efficiency"] <= 1.0


def test_rows_hold_the_stored_examples_with_shifted_labels(prefix):
    ds = make(prefix, num_epochs=1)
    reader = ds.reader
    for b in itertools.islice(ds, 6):
        tokens, labels = b["tokens"][0].numpy(), b["labels"][0].numpy()
        mask, pos, cu = b["loss_mask"][0].numpy(), b["position_ids"][0].numpy(), b["cu_seqlens"].tolist()
        assert b["num_examples"] == len(b["example_ids"]) >= 1
        assert cu[0] == 0 and cu[-1] == tokens.size
        real_segments = cu[: b["num_examples"] + 1]
        assert real_segments[-1] == b["num_real_tokens"]
        for k, i in enumerate(b["example_ids"]):
            s, e = real_segments[k], real_segments[k + 1]
            ex_tokens, ex_mask = reader.tokens(i), reader.loss_mask(i)
            assert e - s == ex_tokens.size
            assert (tokens[s:e] == ex_tokens).all()
            assert (pos[s:e] == np.arange(e - s)).all()  # positions restart per example
            for t in range(e - s - 1):  # label = next token of the same example
                assert labels[s + t] == ex_tokens[t + 1]
                assert mask[s + t] == ex_mask[t + 1]
            assert mask[e - 1] == 0 and labels[e - 1] == reader.pad_token_id
        if len(cu) > b["num_examples"] + 1:  # padding segment
            p = cu[-2]
            assert (tokens[p:] == reader.pad_token_id).all() and (mask[p:] == 0).all()
            assert (pos[p:] == np.arange(tokens.size - p)).all()
        assert b["max_seqlen"] == max(np.diff(cu))
        assert b["num_loss_tokens"] == int(mask.sum()) > 0


def test_global_loss_token_count_per_step(prefix):
    per_rank = rank_batches(prefix, dp_size=3, m=2)
    for step in range(len(per_rank[0]) // 2):
        rows = [b for batches in per_rank for b in batches[2 * step : 2 * step + 2]]
        total = sum(b["num_loss_tokens"] for b in rows)
        assert {b["num_loss_tokens_in_step"] for b in rows} == {total}


def test_deterministic_and_epochs_differ(prefix):
    a = [b["example_ids"] for b in make(prefix, num_epochs=2)]
    b = [b["example_ids"] for b in make(prefix, num_epochs=2)]
    assert a == b
    ds = make(prefix)
    e0, e1 = ds.epoch_bins(0), ds.epoch_bins(1)
    assert e0 != e1 and sorted(map(sorted, e0)) != sorted(map(sorted, e1))  # different packing too
    assert [x["example_ids"] for x in make(prefix, seed=8, num_epochs=1)] != a[: len(e0)]


@pytest.mark.parametrize("stop_after", [1, 5, 8])  # mid-step, step boundary, next epoch
def test_resume_gives_exactly_the_uninterrupted_batches(prefix, stop_after):
    kw = dict(dp_rank=1, dp_size=2, micro_batches_per_step=2, num_epochs=2)
    full = list(make(prefix, **kw))
    assert len(full) > stop_after + 4
    first = make(prefix, **kw)
    head = [next(first) for _ in range(stop_after)]
    state = first.state_dict()
    resumed = make(prefix, **kw)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(head) + len(rest) == len(full)
    for got, want in zip(head + rest, full):
        assert got["example_ids"] == want["example_ids"]
        assert (got["tokens"] == want["tokens"]).all() and (got["loss_mask"] == want["loss_mask"]).all()


def test_resume_with_a_different_dp_size_at_a_step_boundary(prefix):
    """Two ranks stop after 2 steps; one rank carries on: the epoch still sees every example once."""
    old = [make(prefix, dp_rank=r, dp_size=2, micro_batches_per_step=2, num_epochs=1) for r in range(2)]
    seen = [i for ds in old for _ in range(4) for i in next(ds)["example_ids"]]
    new = make(prefix, dp_size=1, micro_batches_per_step=3, num_epochs=1)
    new.load_state_dict(old[0].state_dict())
    seen += [i for b in new for i in b["example_ids"]]
    assert sorted(seen) == list(range(len(new.reader)))


def test_resume_refuses_a_different_order(prefix):
    ds = make(prefix, dp_size=2, micro_batches_per_step=2)
    next(ds)
    state = ds.state_dict()
    with pytest.raises(ValueError, match="seed=7 but this run has seed=8"):
        make(prefix, seed=8, dp_size=2, micro_batches_per_step=2).load_state_dict(state)
    with pytest.raises(ValueError, match="saved mid-step"):
        make(prefix, dp_size=1, micro_batches_per_step=2).load_state_dict(state)


def test_remainder_drop_skips_the_partial_step(prefix):
    pad = make(prefix, dp_size=2, micro_batches_per_step=4)
    drop = make(prefix, dp_size=2, micro_batches_per_step=4, remainder="drop")
    bins = len(pad.epoch_bins(0))
    assert bins % 8  # there is a partial step
    assert pad.steps_in_epoch(0) == bins // 8 + 1 and drop.steps_in_epoch(0) == bins // 8
    assert pad.epoch_stats(0)["filler_micro_batches"] == 8 - bins % 8
    assert drop.epoch_stats(0)["dropped_examples"] == sum(len(b) for b in drop.epoch_bins(0)[bins // 8 * 8 :])
    fillers = [
        b
        for r in range(2)
        for b in make(prefix, dp_rank=r, dp_size=2, micro_batches_per_step=4, num_epochs=1)
        if b["num_examples"] == 0
    ]
    assert len(fillers) == 8 - bins % 8
    assert all(f["num_loss_tokens"] == 0 and f["tokens"].shape == (1, PAD) for f in fillers)


def test_examples_longer_than_seq_length_are_refused(prefix):
    with pytest.raises(ValueError, match=r"tokens > seq_length 128 .*--max-length"):
        make(prefix, seq_length=128)
    with pytest.raises(ValueError, match="multiple of pad_to_multiple"):
        make(prefix, pad_to_multiple=7)


def test_assign_bins_to_ranks_balances_tokens():
    slots = assign_bins_to_ranks([10, 9, 8, 7, 1, 1], dp_size=2, per_rank=3)
    # 10 -> r0; 9 -> r1; 8 -> r1 (9 < 10); 7 -> r0 (10 < 17); 1 -> r0 (17 = 17: lowest rank);
    # r0 now has its 3 slots: 1 -> r1.
    assert slots == [[0, 3, 4], [1, 2, 5]]
    assert assign_bins_to_ranks([5], dp_size=2, per_rank=2) == [[0, None], [None, None]]


def test_epoch_start_logs_packing_efficiency(prefix, caplog):
    import logging

    ds = make(prefix, num_epochs=2)
    with caplog.at_level(logging.INFO, logger="megatron_klear.data.sft_dataset"):
        list(ds)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[1].startswith("SFT data epoch 1:")
    eff = 100 * ds.epoch_stats(0)["packing_efficiency"]
    assert f"packing efficiency {eff:.2f}%" in lines[0]


def test_segment_multiple_keeps_cp_padded_rows_within_seq_length(prefix):
    """With CP every example is later padded to a multiple of 2*CP: packing uses rounded lengths."""
    seg = 16
    ds = make(prefix, segment_multiple=seg)
    lengths = ds.reader.lengths
    overflow_without = 0
    for b in ds.epoch_bins(0):
        assert sum(-(-int(lengths[i]) // seg) * seg for i in b) <= SEQ
    for b in make(prefix).epoch_bins(0):
        overflow_without += sum(-(-int(lengths[i]) // seg) * seg for i in b) > SEQ
    assert overflow_without > 0  # the plain packing would overflow after per-example padding
    assert sorted(i for b in ds.epoch_bins(0) for i in b) == list(range(len(ds.reader)))
