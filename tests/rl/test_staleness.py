"""Stale tokens in the actor's loss (issue 22): per-token weight versions in the samples, the
truncated importance weight of AReaL's decoupled objective and slime's stale-token mask.

- A partial response whose tokens are all of the trainer's version gives the synchronous
  micro-batches, loss and gradients bit for bit (with and without ``rl.mask_stale_tokens``,
  with ``rl.tis_cap``), in the loss function and through a Megatron actor update.
- With stale tokens, the per-token gradient of the actor's loss equals a float64 hand computation
  (importance weight times the GPPO factor, 0 for a masked stale token, over the counted tokens).
- ``staleness_metrics`` on hand-made samples.
"""

import math
import random

import pytest
import torch

from megatron_klear.rl.actor import Actor, mini_batch_counts
from megatron_klear.rl.batch import RolloutSample, build_rl_micro_batch, plan_mini_batch, split_mini_batches
from megatron_klear.rl.config import RLConfig
from megatron_klear.rl.staleness import oldest_version, stale_flags, staleness_metrics

POLICY = 5  # the trainer's version in these tests


def _samples(seed=0, prompts=3, per_prompt=3, versions=None):
    """Samples with rollout log-probs; ``versions(rng, n) -> list`` gives each response's versions."""
    rng = random.Random(seed)
    out = []
    for g in range(prompts):
        prompt = [rng.randrange(5, 200) for _ in range(rng.randint(2, 6))]
        for _ in range(per_prompt):
            n = rng.randint(3, 12)
            out.append(
                RolloutSample(
                    prompt_ids=prompt,
                    response_ids=[rng.randrange(5, 200) for _ in range(n)],
                    advantage=rng.uniform(-1.5, 1.5),
                    group=g,
                    positive=rng.random() < 0.4,
                    rollout_logprobs=[-rng.uniform(0.5, 4.0) for _ in range(n)],
                    versions=None if versions is None else versions(rng, n),
                )
            )
    return out


def _continued(sample, version, cut):
    """``sample`` as a partial response continued once: two pieces, concatenated as the rollout
    side does (tokens, behaviour log-probs, versions), every token of ``version``."""
    r, lp = sample.response_ids, sample.rollout_logprobs
    pieces = [(r[:cut], lp[:cut], [version] * cut), (r[cut:], lp[cut:], [version] * (len(r) - cut))]
    return RolloutSample(
        prompt_ids=list(sample.prompt_ids),
        response_ids=[t for p in pieces for t in p[0]],
        advantage=sample.advantage,
        group=sample.group,
        positive=sample.positive,
        rollout_logprobs=[x for p in pieces for x in p[1]],
        versions=[v for p in pieces for v in p[2]],
    )


def _plan(samples, ids, weight_version, max_tokens=24):
    return plan_mini_batch(
        samples,
        ids,
        dp_rank=0,
        dp_size=1,
        max_tokens=max_tokens,
        pad_id=0,
        pad_to_multiple=4,
        weight_version=weight_version,
    )


def _run_loss(rl, samples, ids, weight_version, dtype, seed=1):
    """The actor's loss over the micro-batches of mini-batch ``ids`` with seeded old / new
    log-probs; returns (summed loss, [grad per micro-batch], micro-batches, per-micro-batch metrics)."""
    mbs = _plan(samples, ids, weight_version)
    counts = mini_batch_counts(samples, ids, weight_version=weight_version, mask_stale=rl.mask_stale_tokens)
    loss_fn = Actor(None, rl)._loss_fn(counts)
    gen = torch.Generator().manual_seed(seed)
    total, grads, outs = 0.0, [], []
    for mb in mbs:
        size = mb["tokens"].shape[1]
        # old close to the behaviour log-probs (so that the weights straddle the cap), new around old
        mb["old_logprobs_local"] = (
            mb["rollout_logprobs"].double() + (torch.rand(1, size, generator=gen, dtype=torch.float64) - 0.5) * 1.6
        ).to(dtype)
        lp = (
            (mb["old_logprobs_local"].double() + (torch.rand(1, size, generator=gen, dtype=torch.float64) - 0.5) * 0.9)
            .to(dtype)
            .requires_grad_(True)
        )
        loss, out = loss_fn(mb, lp, torch.zeros(1, size, dtype=dtype))
        loss.backward()
        total = total + loss.detach()
        grads.append(lp.grad)
        mb["logprobs_used"] = lp.detach()
        outs.append(out)
    return total, grads, mbs, outs


# -- a) all tokens of the trainer's version: the synchronous step, bit for bit -------------------------
def test_fresh_partial_samples_give_the_synchronous_micro_batches():
    sync = _samples(seed=3)
    cont = [_continued(s, POLICY, cut=len(s.response_ids) // 2) for s in sync]
    for ids in split_mini_batches(sync, 2):
        a, b = _plan(sync, ids, None), _plan(cont, ids, POLICY)
        assert len(a) == len(b) > 0
        for x, y in zip(a, b):
            assert set(x) == set(y) and "stale" in x
            for k in x:
                if torch.is_tensor(x[k]):
                    assert torch.equal(x[k], y[k]), k
                else:
                    assert x[k] == y[k], k
            assert not y["stale"].any()
        assert mini_batch_counts(sync, ids) == mini_batch_counts(cont, ids, weight_version=POLICY, mask_stale=True)


@pytest.mark.parametrize(
    "options",
    [dict(), dict(mask_stale_tokens=True), dict(tis_cap=1.5), dict(tis_cap=1.5, mask_stale_tokens=True)],
    ids=["plain", "mask", "tis", "tis+mask"],
)
def test_fresh_partial_samples_give_the_synchronous_loss_bit_for_bit(options):
    sync = _samples(seed=4)
    cont = [_continued(s, POLICY, cut=1 + k % 3) for k, s in enumerate(sync)]
    ref_rl = RLConfig(tis_cap=options.get("tis_cap"))  # today's synchronous path: no versions, no mask
    rl = RLConfig(**options)
    ids = list(range(len(sync)))
    loss_a, grads_a, _, outs_a = _run_loss(ref_rl, sync, ids, None, torch.float32)
    loss_b, grads_b, _, outs_b = _run_loss(rl, cont, ids, POLICY, torch.float32)
    assert torch.equal(loss_a, loss_b)
    assert len(grads_a) == len(grads_b) > 1  # more than one micro-batch
    for ga, gb in zip(grads_a, grads_b):
        assert torch.equal(ga, gb)
        assert ga.abs().sum() > 0
    for oa, ob in zip(outs_a, outs_b):
        for k in ("loss", "pg_loss", "nll_loss", "tokens", "mismatch_abs", "mismatch_tokens", "tis_weight"):
            assert float(oa[k]) == float(ob[k]), k


# -- b) stale tokens: importance weights and masks against float64 ----------------------------------
def _gppo_factor(r, a, eps_low=0.2, eps_high=0.28, dual=10.0):
    """d(loss)/d(logp) = -F * a for one token of GPPO (beta 1), docs/gppo.md."""
    if a < 0 and r > dual:
        return 0.0
    if r < 1 - eps_low and a < 0:
        return 1 - eps_low
    if r > 1 + eps_high and a > 0:
        return 1 + eps_high
    return r


def _reference_grads(samples, ids, mbs, *, tis_cap, mask_stale, agg, nll_coef, weight_version):
    """float64 by hand: per packed position of each micro-batch, d(total loss)/d(logp), and the
    importance weights of the counted tokens."""

    def counted(s):
        fl = [v is not None and v < weight_version for v in (s.versions or [None] * len(s.response_ids))]
        return [not (mask_stale and f) for f in fl]

    n_tok = sum(sum(counted(samples[i])) for i in ids)
    n_seq = sum(1 for i in ids if any(counted(samples[i])))
    n_pos_tok = sum(sum(counted(samples[i])) for i in ids if samples[i].positive)
    n_pos_seq = sum(1 for i in ids if samples[i].positive and any(counted(samples[i])))
    grads, weights = [], []
    for mb in mbs:
        g = torch.zeros(mb["tokens"].shape[1], dtype=torch.float64)
        seq = mb["seq_ids"][0].tolist()
        old, new = mb["old_logprobs_local"][0].double().tolist(), mb["logprobs_used"][0].double().tolist()
        for sid in sorted({int(x) for x in seq if x >= 0}):
            s = samples[sid]
            off = seq.index(float(sid))
            c = counted(s)
            t_i = sum(c)
            for j, tok_counted in enumerate(c):
                if not tok_counted:
                    continue
                pos = off + len(s.prompt_ids) + j - 1  # the position that predicts response token j
                w = 1.0
                if tis_cap is not None:
                    # the behaviour log-prob as the micro-batch holds it (float32)
                    behav = float(torch.tensor(s.rollout_logprobs[j], dtype=torch.float32))
                    w = min(math.exp(old[pos] - behav), tis_cap)
                    weights.append(w)
                a = float(torch.tensor(s.advantage, dtype=torch.float32)) * w  # stored as float32 too
                f = _gppo_factor(math.exp(new[pos] - old[pos]), a)
                if agg == "token_mean":
                    g[pos] = -f * a / n_tok - (nll_coef / n_pos_tok if s.positive else 0.0)
                else:  # seq_mean_token_mean
                    g[pos] = -f * a / (t_i * n_seq) - (nll_coef / (t_i * n_pos_seq) if s.positive else 0.0)
        grads.append(g)
    return grads, weights


def _stale_versions(rng, n):
    """A partial response: a first piece of an older version, then the trainer's; some responses are
    entirely stale, some entirely fresh, some have an unknown version."""
    kind = rng.randrange(4)
    if kind == 0:
        return [POLICY - 2] * n
    if kind == 1:
        return [POLICY] * n
    cut = rng.randint(1, n - 1)
    if kind == 2:
        return [POLICY - 1] * cut + [POLICY] * (n - cut)
    return [None] * cut + [POLICY - 1] * (n - cut)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize(
    "options",
    [dict(tis_cap=1.3), dict(mask_stale_tokens=True), dict(tis_cap=1.3, mask_stale_tokens=True)],
    ids=["tis", "mask", "tis+mask"],
)
def test_stale_token_gradients_equal_a_float64_reference(options, agg):
    samples = _samples(seed=7, prompts=4, versions=_stale_versions)
    flags = [stale_flags(s, POLICY) for s in samples]
    assert any(f.all() for f in flags) and any(f.any() and not f.all() for f in flags)  # both kinds present
    rl = RLConfig(agg=agg, **options)
    ids = list(range(len(samples)))
    _, grads, mbs, outs = _run_loss(rl, samples, ids, POLICY, torch.float64)
    ref, weights = _reference_grads(
        samples,
        ids,
        mbs,
        tis_cap=rl.tis_cap,
        mask_stale=rl.mask_stale_tokens,
        agg=agg,
        nll_coef=rl.nll_coef,
        weight_version=POLICY,
    )
    assert len(mbs) > 1
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g[0], r, rtol=1e-12, atol=1e-15)
    n_counted = sum(float(o["tokens"]) for o in outs)
    stale_tokens = sum(int(f.sum()) for f in flags)
    total = sum(len(s.response_ids) for s in samples)
    assert n_counted == (total - stale_tokens if rl.mask_stale_tokens else total)
    masked_positions = sum(int(((mb["stale"] > 0) & (g == 0)).sum()) for mb, g in zip(mbs, grads))
    if rl.mask_stale_tokens:
        assert masked_positions == stale_tokens  # every stale token without gradient
    if rl.tis_cap is not None:
        assert min(weights) < 1.0 and max(weights) == rl.tis_cap  # both sides of the cap were exercised
        tis_mean = sum(float(o["tis_weight"]) for o in outs) / sum(float(o["tis_tokens"]) for o in outs)
        assert math.isclose(tis_mean, sum(weights) / len(weights), rel_tol=1e-12)


def test_float32_loss_matches_float64_with_stale_tokens():
    samples = _samples(seed=8, prompts=3, versions=_stale_versions)
    rl = RLConfig(tis_cap=1.3, mask_stale_tokens=True)
    ids = list(range(len(samples)))
    loss32, g32, _, _ = _run_loss(rl, samples, ids, POLICY, torch.float32)
    loss64, g64, _, _ = _run_loss(rl, samples, ids, POLICY, torch.float64)
    assert math.isclose(float(loss32), float(loss64), rel_tol=1e-5, abs_tol=1e-6)
    for a, b in zip(g32, g64):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-6)


def test_stale_flags_sit_with_the_label_shift():
    s = RolloutSample(
        prompt_ids=[7, 8, 9], response_ids=[10, 11, 12, 13], advantage=1.0, group=0, versions=[3, None, 4, 5]
    )
    mb = build_rl_micro_batch([s], [0], pad_id=0, pad_to_multiple=8, weight_version=5)
    # response token j is predicted at position len(prompt) + j - 1
    assert mb["stale"][0].tolist() == [0, 0, 1, 0, 1, 0, 0, 0]
    assert mb["loss_mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 0, 0]
    none = build_rl_micro_batch([s], [0], pad_id=0, pad_to_multiple=8, weight_version=None)
    assert not none["stale"].any()


def test_bad_versions_are_errors_naming_the_sample():
    s = RolloutSample(prompt_ids=[1], response_ids=[2, 3], advantage=1.0, group=0, versions=[1])
    with pytest.raises(ValueError, match="sample 4: versions holds 1 entries for 2 response tokens"):
        build_rl_micro_batch([s], [4], pad_id=0, pad_to_multiple=1, weight_version=2)
    s.versions = [1, 3]
    with pytest.raises(ValueError, match=r"sample 0: versions\[1\]=3 is newer than the trainer's policy version 2"):
        mini_batch_counts([s], [0], weight_version=2, mask_stale=True)
    s.versions = [1, "x"]
    with pytest.raises(ValueError, match="sample 0: versions: 'x' is not an int"):
        staleness_metrics([s], 2)


def test_mini_batch_counts_leave_out_masked_tokens_and_emptied_sequences():
    def mk(n, versions, positive):
        return RolloutSample(
            prompt_ids=[1], response_ids=[2] * n, advantage=1.0, group=0, positive=positive, versions=versions
        )

    samples = [mk(3, [1, 1, 1], True), mk(4, [1, 2, 2, 2], True), mk(2, None, False), mk(2, [2, 2], False)]
    ids = [0, 1, 2, 3]
    c = mini_batch_counts(samples, ids, weight_version=2, mask_stale=True)
    assert (c.num_tokens, c.num_seqs, c.num_positive_tokens, c.num_positive_seqs) == (7.0, 3.0, 3.0, 1.0)
    c = mini_batch_counts(samples, ids, weight_version=2, mask_stale=False)
    assert (c.num_tokens, c.num_seqs, c.num_positive_tokens, c.num_positive_seqs) == (11.0, 4.0, 7.0, 2.0)


# -- c) staleness metrics -------------------------------------------------------------------------
def test_staleness_metrics_by_hand():
    def mk(versions, n=None):
        n = len(versions) if versions is not None else n
        return RolloutSample(prompt_ids=[1], response_ids=[2] * n, advantage=0.0, group=0, versions=versions)

    samples = [mk([4, 4, 5, 5]), mk([2, None, 5]), mk(None, n=3)]
    m = staleness_metrics(samples, 5)
    # ages: 1 1 0 0 | 3 0 0 | 0 0 0  -> 10 tokens, 3 stale, sum 5, max 3
    # per response: spans 2 (4..5), 4 (2..5), 1 (no version); oldest token's age 1, 3, 0
    assert m == {
        "rollout/staleness_mean": 0.5,
        "rollout/staleness_max": 3.0,
        "rollout/offpolicy_token_frac": 0.3,
        "rollout/response_versions_mean": 7 / 3,
        "rollout/response_versions_max": 4.0,
        "rollout/response_staleness_mean": 4 / 3,
        "rollout/response_staleness_max": 3.0,
    }
    assert staleness_metrics(samples, None) == {
        "rollout/staleness_mean": 0.0,
        "rollout/staleness_max": 0.0,
        "rollout/offpolicy_token_frac": 0.0,
        "rollout/response_versions_mean": 7 / 3,
        "rollout/response_versions_max": 4.0,
        "rollout/response_staleness_mean": 0.0,
        "rollout/response_staleness_max": 0.0,
    }
    assert staleness_metrics([], 3)["rollout/offpolicy_token_frac"] == 0.0
    assert oldest_version([None, 4, 2, 5]) == 2
    assert oldest_version([None]) is None and oldest_version(None) is None


def test_a_mini_batch_left_without_tokens_makes_no_step():
    """rl.mask_stale_tokens: a mini-batch whose tokens are all stale has no forward and no optimizer
    step (every rank sees the same counts); the other mini-batches train as usual."""
    from types import SimpleNamespace

    class Optimizer:
        param_groups = [{"lr": 0.1}]
        steps = 0

        def zero_grad(self):
            """Nothing to clear: the model is stubbed."""

        def step(self):
            Optimizer.steps += 1
            return True, 1.0, None

    samples = _samples(seed=2, prompts=4, versions=lambda rng, n: [POLICY] * n)
    for s in samples:
        if s.group in (0, 1):  # the first mini-batch: every token of an older version
            s.versions = [POLICY - 1] * len(s.response_ids)
    rl = RLConfig(mask_stale_tokens=True, mini_batch_prompts=2, prompts_per_step=4)
    state = SimpleNamespace(
        model=[],
        optimizer=Optimizer(),
        config=SimpleNamespace(),
        scheduler=SimpleNamespace(step=lambda increment: None),
    )
    actor = Actor(state, rl)
    ran = []
    actor.plan = lambda samples, weight_version=None: [
        (mini_batch_counts(samples, ids, weight_version=weight_version, mask_stale=True), ids)
        for ids in split_mini_batches(samples, rl.mini_batch_prompts)
    ]
    actor.recompute_old_logprobs = lambda plans: ran.append(("old", [ids for _, ids in plans]))
    actor._run = lambda ids, loss_fn, forward_only: ran.append(("train", ids)) or []
    actor.weight_version = POLICY
    out = actor.update(samples)
    second = [i for i, s in enumerate(samples) if s.group in (2, 3)]
    # the one mini-batch left trains first: its old log-probs are its own forward's, none recomputed
    assert ran == [("old", []), ("train", second)]
    assert Optimizer.steps == 1 and out["actor/optimizer_steps"] == 1 and out["actor/skipped_mini_batches"] == 1
    assert out["actor/stale_tokens_masked"] == sum(len(s.response_ids) for s in samples if s.group in (0, 1))
    for s in samples:
        s.versions = [POLICY - 1] * len(s.response_ids)
    ran.clear()
    out = actor.update(samples)  # nothing left at all: no step, and the weights keep their version
    assert ran == [] and Optimizer.steps == 1 and actor.weight_version == POLICY + 1
    assert out["actor/optimizer_steps"] == 0 and out["actor/skipped_mini_batches"] == 2
