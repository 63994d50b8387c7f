"""Continuous batching in the embedded engine (rollout/embedded/batcher.py): a request that joins a
running batch mid-way gets the tokens it gets alone; rows leave when they finish and their padding
with them; the running-request and KV-token bounds hold at every step, with retraction when the
tokens run short, and a retracted row resumes with the same tokens."""

import pytest
import torch

from megatron_klear.rollout.base import SamplingParams
from megatron_klear.rollout.embedded import EmbeddedEngine, PromptRequest
from tests.rollout.conftest import PROMPTS

LOGPROB_ATOL = 1e-5  # float rounding of the batched forward (the batch's rows and padding differ)


@pytest.fixture(scope="module")
def model(tiny_hf):
    return EmbeddedEngine.from_pretrained(tiny_hf["untied"]).model


def _request(prompt, seed, new_tokens, key=None, ignore_eos=True):
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    return PromptRequest(prompt, params, [seed], ignore_eos=ignore_eos, key=key)


def _submit(batcher, request, on_done):
    (checked,) = batcher.engine.checked([request])
    return batcher.submit(checked, on_done)


def _alone(engine, request):
    return engine.generate_requests([request])[0][0]


def _drive(batcher, on_step=None, limit=10_000):
    steps = 0
    while batcher.busy:
        batcher.step()
        steps += 1
        if on_step is not None:
            on_step(batcher)
        assert steps < limit
    return steps


def _same(got, want):
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=LOGPROB_ATOL)


def test_a_request_joining_mid_way_gets_its_tokens_alone_and_padding_leaves_with_rows(model):
    engine = EmbeddedEngine(model)
    long_prompt = PROMPTS[0] * 3  # 21 tokens: the widest row while it runs
    first, late = _request(long_prompt, 7, 12, "first"), _request(PROMPTS[1], 8, 30, "late")
    want = {"first": _alone(engine, first), "late": _alone(engine, late)}
    got = {}
    batcher = engine.batcher()
    _submit(batcher, first, lambda cs: got.__setitem__("first", cs[0]))
    for _ in range(5):
        batcher.step()
    _submit(batcher, late, lambda cs: got.__setitem__("late", cs[0]))
    widths = []

    def check(b):
        if b.running:  # the cache is as wide as its longest row, not as the longest that ever ran
            width = max(lane.batch.width for lane in b.lanes)
            widths.append((width, max(r.held for r in b.running), len(b.running)))

    _drive(batcher, check)
    assert list(batcher.history) == [(1, 1), (1, 1)] and len(widths) >= 25
    _same(got["first"], want["first"])
    _same(got["late"], want["late"])
    assert widths[0][2] == 2 and widths[-1][2] == 1  # it joined while the first ran; the first left
    assert all(width == held for width, held, _ in widths), widths  # no padding stays behind


def test_the_running_bound_admits_rows_as_others_finish(model):
    engine = EmbeddedEngine(model, max_running_requests=3)
    requests = [_request(PROMPTS[i % 3], 20 + i, 4 + 3 * i) for i in range(6)]
    seen = []
    out = [None] * len(requests)
    batcher = engine.batcher()
    for i, r in enumerate(requests):
        _submit(batcher, r, lambda cs, i=i: out.__setitem__(i, cs[0]))
    _drive(batcher, lambda b: seen.append(len(b.running)))
    assert max(seen) == 3 and len(batcher.history) > 2  # rows joined a running batch
    assert any(rows < 3 for _, rows in list(batcher.history)[1:])
    for r, c in zip(requests, out):
        _same(c, _alone(EmbeddedEngine(model), r))


def test_the_token_bound_retracts_and_the_retracted_row_resumes_with_the_same_tokens(model):
    # each row: 4 prompt tokens + 40 new (no EOS in this random model's first 40 tokens). SGLang's
    # admission counts a running row as 4 + k + 0.7 * (40 - k) tokens and a new one as 44, so the
    # second row starts beside the first within 80; together they grow to 88: one is retracted and
    # resumes later
    bound = 80
    engine = EmbeddedEngine(model, max_total_tokens=bound)
    requests = [_request(PROMPTS[2], 31 + i, 40, ignore_eos=False) for i in range(3)]  # (seeds without EOS)
    out = [None] * len(requests)
    batcher = engine.batcher()
    for i, r in enumerate(requests):
        _submit(batcher, r, lambda cs, i=i: out.__setitem__(i, cs[0]))
    held = []
    _drive(batcher, lambda b: held.append(sum(r.held for r in b.running)))
    assert max(held) <= bound and batcher.retractions >= 1
    for r, c in zip(requests, out):
        _same(c, _alone(EmbeddedEngine(model), r))
    assert all(c.finish_reason == "length" for c in out)
    with pytest.raises(ValueError, match="max_total_tokens=80"):
        engine.generate_requests([_request(PROMPTS[0], 1, 74)])  # 7 + 74 tokens can never fit


def _partitions(n: int):
    """Every split of range(n) into contiguous runs."""
    if n == 0:
        yield []
        return
    for k in range(1, n + 1):
        for rest in _partitions(n - k):
            yield [list(range(k))] + [[i + k for i in run] for run in rest]


def test_split_by_width_is_the_cheapest_contiguous_split():
    """Against every contiguous split of the sorted rows (brute force, an independent reference)."""
    import random

    from megatron_klear.rollout.embedded.batcher import split_by_width

    rng = random.Random(0)
    for _ in range(200):
        widths = [rng.choice([3, 5, 8, 40, 41, 120, 300]) for _ in range(rng.randint(1, 9))]
        fixed = rng.choice([1, 50, 400, 3500])
        order = sorted(range(len(widths)), key=lambda i: widths[i])
        best = min(
            sum(fixed + len(run) * max(widths[order[i]] for i in run) for run in split)
            for split in _partitions(len(widths))
        )
        got = split_by_width(widths, fixed)
        assert sorted(i for g in got for i in g) == list(range(len(widths)))
        assert sum(fixed + len(g) * max(widths[i] for i in g) for g in got) == best, (widths, fixed, got)
    assert split_by_width([10] * 30 + [300] * 2, 3500) == [list(range(30)), [30, 31]]  # 2 x 290 pads < 3500
    assert len(split_by_width([10] * 30 + [300] * 20, 3500)) == 2


def test_rows_of_far_apart_contexts_decode_in_lanes_that_merge_once_close_and_get_their_tokens_alone(
    model,
):
    """Eight samples of a 3-token prompt beside a 30-token and a 25-token context: the wave is split
    in two lanes (two forwards a step, neither padded to the other's width); once the 30-token row
    ends the lanes are 22 columns apart, under the cost of a forward, and merge. Every sample's tokens
    are those it gets alone."""
    engine = EmbeddedEngine(model)
    wide = _request((PROMPTS[0] * 5)[:30], 3, 5, "wide")
    middle = _request((PROMPTS[2] * 7)[:25], 4, 20, "middle")
    narrow = PromptRequest(PROMPTS[2][:3], SamplingParams(temperature=1.0, max_new_tokens=20), list(range(50, 58)))
    narrow = PromptRequest(narrow.prompt, narrow.params, narrow.seeds, ignore_eos=True, key="narrow")
    want = {r.key: engine.generate_requests([r])[0] for r in (wide, middle, narrow)}
    got = {}
    batcher = engine.batcher()
    batcher.lane_forward_cost = 200  # split at 30 vs 3 (x8), merged at 22 apart
    for r in (wide, middle, narrow):
        _submit(batcher, r, lambda cs, k=r.key: got.__setitem__(k, cs))
    lanes = []
    _drive(batcher, lambda b: lanes.append(sorted(len(lane.rows) for lane in b.lanes)))
    assert lanes[:4] == [[2, 8]] * 4  # two forwards a step
    assert lanes[4] == [9]  # the wide row ended with its 5th token: the other two lanes merged
    for key, cs in got.items():
        for c, w in zip(cs, want[key]):
            _same(c, w)
