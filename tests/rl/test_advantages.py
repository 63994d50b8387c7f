"""GRPO advantages and the sample filters, against hand values and a float64 per-group reference."""

import math

import pytest
import torch

from megatron_klear.rl.advantages import (
    correct_samples,
    group_advantages,
    nonzero_spread_mask,
    overlong_keep_mask,
)


def test_hand_values_unbiased_std():
    adv = group_advantages(torch.tensor([1.0, -1.0, -1.0, 1.0]), group_size=4)
    # mean 0, unbiased std sqrt(4/3): A = +-1 / (1.1547005 + 1e-6)
    a = 1.0 / (math.sqrt(4.0 / 3.0) + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a]), rtol=1e-7, atol=0)


def test_dr_grpo_skips_the_std():
    adv = group_advantages(torch.tensor([0.25, 0.5, 1.0, 0.25]), group_size=4, normalize_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([-0.25, 0.0, 0.5, -0.25]))


def test_interleaved_group_ids_match_float64_reference():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(24, generator=g)
    group_ids = torch.tensor([7, 3, 11] * 8)  # 3 groups of 8, interleaved, arbitrary labels
    adv = group_advantages(rewards, group_ids)
    for label in (7, 3, 11):
        sel = group_ids == label
        r = rewards[sel].double()
        expected = (r - r.mean()) / (r.std(unbiased=True) + 1e-6)
        torch.testing.assert_close(adv[sel], expected.float(), rtol=1e-6, atol=1e-7)


def test_zero_spread_groups_and_singletons():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0, 1.0, -1.0, -1.0, 0.5])
    ids = [0, 0, 0, 0, 1, 1, 1, 1, 2]  # all-correct group, mixed group, singleton
    adv = group_advantages(rewards, ids)
    assert torch.all(adv[:4] == 0) and adv[8] == 0
    assert torch.all(adv[4:8] != 0)
    keep = nonzero_spread_mask(rewards, ids)
    assert keep.tolist() == [False] * 4 + [True] * 4 + [False]


def test_spread_tolerance():
    rewards = torch.tensor([0.5, 0.5 + 1e-3, 0.0, 1.0])
    assert nonzero_spread_mask(rewards, group_size=2, tol=1e-2).tolist() == [False, False, True, True]
    assert nonzero_spread_mask(rewards, group_size=2).tolist() == [True, True, True, True]


def test_overlong_filter():
    ended = torch.tensor([True, False, True])
    assert overlong_keep_mask(ended).tolist() == [True, False, True]
    assert overlong_keep_mask(ended, enabled=False).tolist() == [True, True, True]
    assert overlong_keep_mask(["stop", "length", "abort", "eos"]).tolist() == [True, False, False, True]
    with pytest.raises(ValueError, match="'timeout' of response 1"):
        overlong_keep_mask(["stop", "timeout"])


def test_correct_samples():
    rewards = torch.tensor([1.0, -1.0, 16 / 16, 15 / 16, -0.5, 1.0 - 1e-9])
    assert correct_samples(rewards).tolist() == [True, False, True, False, False, True]
    assert correct_samples(torch.tensor([1.0, 2.0]), correct_score=2.0).tolist() == [False, True]


def test_bad_grouping_is_reported():
    with pytest.raises(ValueError, match="group_size=3"):
        group_advantages(torch.zeros(8), group_size=3)
    with pytest.raises(ValueError, match="exactly one"):
        group_advantages(torch.zeros(8))
    with pytest.raises(ValueError, match="group_ids has shape"):
        group_advantages(torch.zeros(8), [0, 1])
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 4), group_size=4)


def _grade(reward, solved):
    from megatron_klear.rewards.result import GradeResult

    return GradeResult(reward=reward, passed=int(solved), total=1)


def test_rl_loop_filters_compose():
    """Zero-spread and overlong filters are independent: turning one off keeps the other."""
    from megatron_klear.config import load_config
    from megatron_klear.data.prompts import Prompt
    from megatron_klear.rl.rollout.sampling import build_samples
    from megatron_klear.rollout.base import Completion

    prompts = [
        Prompt(id="a", task="math", prompt_ids=[1, 2], answer="1"),
        Prompt(id="b", task="math", prompt_ids=[3], answer="2"),
    ]
    c = lambda finished: Completion([5, 6], [-1.0, -1.0], "stop" if finished else "length")  # noqa: E731
    completions = [[c(True), c(False), c(True)], [c(True), c(True), c(True)]]
    grades = [
        [_grade(1.0, True), _grade(-0.5, False), _grade(-1.0, False)],
        [_grade(-1.0, False)] * 3,
    ]  # group b has no reward spread
    for spread, overlong, expect in [
        (True, True, [(0, True), (0, True)]),
        (False, True, [(0, True), (0, True), (1, True), (1, True), (1, True)]),
        (True, False, [(0, True), (0, False), (0, True)]),
    ]:
        cfg = load_config(
            None, [f"rl.filter_zero_spread={str(spread).lower()}", f"rl.overlong_filter={str(overlong).lower()}"]
        )
        samples, metrics = build_samples(prompts, completions, grades, cfg)
        assert [(s.group, s.finished) for s in samples] == expect, (spread, overlong)
        assert [s.positive for s in samples][:1] == [True]


def test_per_task_metrics_of_a_mixed_batch_and_their_merge():
    """A math and code batch reports each task apart; merged over batches, a task's means are
    weighted by its own responses (a batch without code does not dilute code's accuracy)."""
    from megatron_klear.config import load_config
    from megatron_klear.data.prompts import Prompt
    from megatron_klear.rl.rollout.sampling import build_samples, merge_rollout_metrics
    from megatron_klear.rollout.base import Completion

    cfg = load_config(None, [])
    prompts = [
        Prompt(id="m", task="math", prompt_ids=[1], answer="1"),
        Prompt(id="c", task="code", prompt_ids=[2], tests={"inputs": [""], "outputs": [""]}),
    ]
    done = Completion([5], [-1.0], "stop")
    grades = [[_grade(1.0, True), _grade(-1.0, False)], [_grade(0.5, True), _grade(0.5, True)]]
    _, m = build_samples(prompts, [[done, done], [done, done]], grades, cfg)
    assert m["rollout/task/math/responses"] == 2 and m["rollout/task/code/responses"] == 2
    assert m["rollout/task/math/accuracy"] == 0.5 and m["rollout/task/code/accuracy"] == 1.0
    assert m["rollout/task/math/reward_mean"] == 0.0 and m["rollout/task/code/reward_mean"] == 0.5
    _, m2 = build_samples(prompts[:1], [[done] * 2], [[_grade(1.0, True)] * 2], cfg)
    merged = merge_rollout_metrics([m, m2])
    assert merged["rollout/task/math/responses"] == 4 and merged["rollout/task/math/accuracy"] == 0.75
    assert merged["rollout/task/code/responses"] == 2 and merged["rollout/task/code/accuracy"] == 1.0
