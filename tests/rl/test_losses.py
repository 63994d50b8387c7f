"""Policy losses: the gradient table of docs/gppo.md ("Worked gradients"), independent float64 gradient
formulas, the aggregation weights, global normalisation across micro-batches, the SFT term."""

import math

import numpy as np
import pytest
import torch

from megatron_klear.rl.losses import (
    LossBatch,
    LossCounts,
    LossSettings,
    aggregate,
    count_loss_units,
    per_token_policy_loss,
    policy_loss,
)

# (r, A, GPPO gradient, PPO/DAPO gradient) of d(loss)/d(logp); eps 0.2 / 0.28, c = 10.
TABLE = [
    (1.5, +1, -1.28, 0.0),
    (1.5, -1, +1.5, +1.5),
    (0.5, +1, -0.5, -0.5),
    (0.5, -1, +0.8, 0.0),
    (1.1, +1, -1.1, -1.1),
    (12.0, -1, 0.0, 0.0),
    (12.0, +1, -1.28, 0.0),
]


def _token_grads(r, a, dtype=torch.float64, **kw):
    logp = torch.tensor([math.log(v) for v in r], dtype=dtype, requires_grad=True)
    old = torch.zeros_like(logp)
    adv = torch.tensor(a, dtype=dtype)
    loss, _ = per_token_policy_loss(LossBatch(logp, old, adv), LossSettings(**kw))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    return loss.detach(), grad


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("algo,column", [("gppo", 2), ("clip_higher", 3), ("ppo", 3)])
def test_gradient_table_with_defaults(algo, column, dtype, tol):
    # Default arguments: pins eps 0.2 / 0.28 and the dual clip (r=12, A=-1 -> 0; r=1.5, A=-1 -> +1.5).
    r = [row[0] for row in TABLE]
    a = [float(row[1]) for row in TABLE]
    _, grad = _token_grads(r, a, dtype=dtype, algo=algo)
    expected = torch.tensor([row[column] for row in TABLE], dtype=torch.float64)
    torch.testing.assert_close(grad.double(), expected, atol=tol, rtol=0)


def test_policy_loss_defaults_reproduce_gppo_column():
    r = [row[0] for row in TABLE]
    logp = torch.tensor([[math.log(v) for v in r]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[float(row[1]) for row in TABLE]], dtype=torch.float64)
    loss, _ = policy_loss(LossBatch(logp, torch.zeros_like(logp), adv, torch.ones_like(logp)))
    (grad,) = torch.autograd.grad(loss, logp)
    # token mean over the 7 tokens
    expected = torch.tensor([[row[2] / len(TABLE) for row in TABLE]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("algo", ["gppo", "clip_higher", "ppo"])
def test_dual_clip_default_is_ten_not_one(algo):
    # The authors' early c=1 zeroed every A<0 token with r>1; verl's default is 3. With c=10 the
    # gradient of A=-1 is r up to r=10 and 0 beyond.
    r = [1.01, 2.0, 5.0, 9.9, 10.1, 50.0]
    _, grad = _token_grads(r, [-1.0] * len(r), algo=algo)
    torch.testing.assert_close(grad, torch.tensor([1.01, 2.0, 5.0, 9.9, 0.0, 0.0], dtype=torch.float64))


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_dual_clip_at_most_one_is_refused(c):
    with pytest.raises(ValueError, match="dual_clip"):
        _token_grads([1.5], [-1.0], algo="gppo", dual_clip=c)


def test_dual_clip_can_be_disabled():
    loss, grad = _token_grads([12.0], [-1.0], algo="gppo", dual_clip=None)
    assert loss.item() == pytest.approx(12.0)
    assert grad.item() == pytest.approx(12.0)


def _reference_factor(algo, r, a, el, eh, c, b1, b2):
    """Independent F of d(loss)/d(logp) = -F * A, from the formulas in the module docstring."""
    lower, upper = 1 - el, 1 + eh
    if algo == "cispo":
        return np.clip(r, lower, upper)
    f = r.copy()
    low, high = (a < 0) & (r < lower), (a > 0) & (r > upper)
    if algo == "gppo":
        f[low], f[high] = b1 * lower, b2 * upper
    else:
        f[low], f[high] = 0.0, 0.0
    if c is not None:
        f[(a < 0) & (r > c)] = 0.0
    return f


def _reference_value(algo, r, a, el, eh, c):
    clipped = np.clip(r, 1 - el, 1 + eh)
    if algo == "cispo":
        return -a * clipped
    v = np.maximum(-a * r, -a * clipped)
    if c is not None:
        v = np.where(a < 0, np.minimum(v, -c * a), v)
    return v


CASES = [
    ("gppo", dict()),
    ("gppo", dict(beta1=0.5, beta2=0.75)),
    ("gppo", dict(eps_low=0.1, eps_high=0.4, dual_clip=3.0, beta1=0.25, beta2=2.0)),
    ("gppo", dict(dual_clip=None)),
    ("clip_higher", dict()),
    ("clip_higher", dict(eps_low=0.3, eps_high=0.5, dual_clip=None)),
    ("ppo", dict()),
    ("ppo", dict(eps_low=0.1)),
    ("cispo", dict()),
    ("cispo", dict(eps_low=0.2, eps_high=0.28)),
]
DEFAULTS = {"gppo": (0.2, 0.28), "clip_higher": (0.2, 0.28), "ppo": (0.2, 0.2), "cispo": (1.0, 0.28)}


@pytest.mark.parametrize("algo,kw", CASES)
def test_random_gradients_match_float64_formula(algo, kw):
    rng = np.random.default_rng(hash((algo, tuple(sorted(kw.items())))) % 2**32)
    n = 2000
    r = np.exp(rng.uniform(-3.0, 3.5, n))  # 0.05 .. 33: all clip regions and the dual clip
    a = rng.normal(size=n)
    a[::17] = 0.0
    el = kw.get("eps_low", DEFAULTS[algo][0])
    eh = kw.get("eps_high", DEFAULTS[algo][1] if algo != "ppo" else el)
    c = kw.get("dual_clip", 10.0) if algo != "cispo" else None
    b1, b2 = kw.get("beta1", 1.0), kw.get("beta2", 1.0)

    old = rng.normal(size=n)
    logp = torch.tensor(old + np.log(r), requires_grad=True)
    loss, _ = per_token_policy_loss(LossBatch(logp, torch.tensor(old), torch.tensor(a)), LossSettings(algo=algo, **kw))
    (grad,) = torch.autograd.grad(loss.sum(), logp)

    expected_grad = -_reference_factor(algo, r, a, el, eh, c, b1, b2) * a
    np.testing.assert_allclose(grad.numpy(), expected_grad, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(loss.detach().numpy(), _reference_value(algo, r, a, el, eh, c), rtol=1e-10, atol=1e-12)


def test_gppo_forward_equals_clip_higher_for_any_beta():
    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn(64, generator=g) * 2, torch.randn(64, generator=g)
    adv = torch.randn(64, generator=g)
    ref, _ = per_token_policy_loss(LossBatch(logp, old, adv), LossSettings(algo="clip_higher"))
    for b1, b2 in [(1.0, 1.0), (0.5, 0.75), (0.0, 3.0)]:
        val, _ = per_token_policy_loss(LossBatch(logp, old, adv), LossSettings(algo="gppo", beta1=b1, beta2=b2))
        torch.testing.assert_close(val, ref, rtol=0, atol=0)
    # and the gradients differ exactly where the clip is active (sanity: the test can fail)
    lp = logp.clone().requires_grad_()
    batch = LossBatch(lp, old, adv)
    g_ch = torch.autograd.grad(per_token_policy_loss(batch, LossSettings(algo="clip_higher"))[0].sum(), lp)[0]
    g_gp = torch.autograd.grad(per_token_policy_loss(batch, LossSettings(algo="gppo"))[0].sum(), lp)[0]
    assert (g_ch != g_gp).any()


def test_extreme_log_ratio_stays_finite_and_keeps_gppo_gradient():
    logp = torch.tensor([0.0, 0.0], requires_grad=True)
    old = torch.tensor([-200.0, 200.0])  # r = e^200 (overflows float32), r = e^-200
    adv = torch.tensor([1.0, -1.0])
    loss, m = per_token_policy_loss(LossBatch(logp, old, adv), LossSettings(algo="gppo"))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert torch.isfinite(loss).all() and torch.isfinite(m["ratio"]).all()
    torch.testing.assert_close(grad, torch.tensor([-1.28, 0.8]))


# ------------------------------------------------------------------------------------------
# aggregation
# ------------------------------------------------------------------------------------------
LONG, SHORT = 6, 2  # a long sequence with per-token loss 1, a short one with per-token loss 4


def _padded():
    loss = torch.zeros(2, LONG, dtype=torch.float64)
    loss[0, :] = 1.0
    loss[1, :SHORT] = 4.0
    loss[1, SHORT:] = 99.0  # padding: must not count
    mask = torch.zeros(2, LONG, dtype=torch.bool)
    mask[0, :] = True
    mask[1, :SHORT] = True
    return loss.requires_grad_(), mask


def _packed():
    # [prompt of seq 0 (unmasked), long response, prompt of seq 1, short response, a prompt-only seq, padding]
    values = [7.0] + [1.0] * LONG + [7.0] + [4.0] * SHORT + [7.0, 7.0] + [99.0]
    ids = [0] * (1 + LONG) + [1] * (1 + SHORT) + [2, 2] + [-1]
    mask = [0] + [1] * LONG + [0] + [1] * SHORT + [0, 0] + [0]
    return (
        torch.tensor([values], dtype=torch.float64, requires_grad=True),
        torch.tensor([mask], dtype=torch.bool),
        torch.tensor([ids]),
    )


# value; per-token weight of a long-sequence token; of a short-sequence token
HAND = {
    "token_mean": ((6 * 1 + 2 * 4) / 8, 1 / 8, 1 / 8),
    "seq_mean_token_mean": ((1 + 4) / 2, 1 / (2 * 6), 1 / (2 * 2)),
    "seq_mean_token_sum_norm": ((6 * 1 + 2 * 4) / (2 * 10), 1 / 20, 1 / 20),
}


@pytest.mark.parametrize("agg", sorted(HAND))
def test_aggregation_weights_padded_and_packed(agg):
    value, w_long, w_short = HAND[agg]
    loss, mask = _padded()
    out = aggregate(loss, mask, agg, constant=10)
    (grad,) = torch.autograd.grad(out, loss)
    assert out.item() == pytest.approx(value, abs=1e-12)
    expected = torch.zeros_like(grad)
    expected[0, :] = w_long
    expected[1, :SHORT] = w_short
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)

    loss_p, mask_p, ids = _packed()
    out_p = aggregate(loss_p, mask_p, agg, seq_ids=ids, constant=10)
    (grad_p,) = torch.autograd.grad(out_p, loss_p)
    assert out_p.item() == pytest.approx(value, abs=1e-12)
    expected_p = torch.zeros_like(grad_p)
    expected_p[0, 1 : 1 + LONG] = w_long
    expected_p[0, 2 + LONG : 2 + LONG + SHORT] = w_short
    torch.testing.assert_close(grad_p, expected_p, atol=1e-12, rtol=0)


@pytest.mark.parametrize("agg", sorted(HAND))
def test_micro_batches_with_global_counts_sum_to_full_batch(agg):
    loss, mask = _padded()
    full = aggregate(loss, mask, agg, constant=10)
    parts = [
        aggregate(loss[i : i + 1], mask[i : i + 1], agg, global_num_tokens=8, global_num_seqs=2, constant=10)
        for i in range(2)
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), abs=1e-12)


def test_per_micro_batch_mean_is_not_the_global_mean():
    # The authors' per-micro-batch token mean weights the short sequence's tokens 3x more.
    loss, mask = _padded()
    local = sum(aggregate(loss[i : i + 1], mask[i : i + 1]) for i in range(2))
    assert local.item() == pytest.approx(1.0 + 4.0)
    assert aggregate(loss, mask).item() == pytest.approx(1.75)


def test_same_seq_id_in_two_rows_is_two_sequences():
    loss = torch.tensor([[1.0, 1.0], [3.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    ids = torch.zeros(2, 2, dtype=torch.long)
    out = aggregate(loss, mask, "seq_mean_token_mean", seq_ids=ids)
    assert out.item() == pytest.approx((1.0 + 3.0) / 2)


def test_aggregate_errors():
    loss, mask = _padded()
    with pytest.raises(ValueError, match="agg="):
        aggregate(loss, mask, "token-mean")
    with pytest.raises(ValueError, match="constant"):
        aggregate(loss, mask, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="mask has shape"):
        aggregate(loss, mask[:, :3])
    with pytest.raises(ValueError, match="global_num_tokens"):
        aggregate(loss, mask, global_num_tokens=0)


# ------------------------------------------------------------------------------------------
# policy_loss: SFT term, KL option, metrics, global counts
# ------------------------------------------------------------------------------------------
def _batch(seed=0, b=4, t=9):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    old = logp + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    lengths = torch.tensor([9, 3, 6, 1])[:b]
    mask = torch.arange(t)[None, :] < lengths[:, None]
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).clone()
    positive = torch.tensor([True, False, True, False])[:b, None].expand(b, t).clone()
    return logp.requires_grad_(), old, adv, mask, positive


@pytest.mark.parametrize("agg", sorted(HAND))
def test_sft_term_is_alpha_times_nll_of_positive_tokens(agg):
    logp, old, adv, mask, positive = _batch()
    settings = LossSettings(agg=agg, norm_constant=16)
    pg_only, _ = policy_loss(LossBatch(logp, old, adv, mask), settings)
    total, metrics = policy_loss(LossBatch(logp, old, adv, mask, positive=positive), settings)
    nll_tok = -logp.detach()
    if agg == "token_mean":  # positives are rows 0 (9 tokens) and 2 (6 tokens)
        nll = (nll_tok[0, :9].sum() + nll_tok[2, :6].sum()) / 15
    elif agg == "seq_mean_token_mean":
        nll = (nll_tok[0, :9].mean() + nll_tok[2, :6].mean()) / 2
    else:
        nll = (nll_tok[0, :9].sum() + nll_tok[2, :6].sum()) / (2 * 16)
    assert metrics["nll_loss"].item() == pytest.approx(nll.item(), rel=1e-12)
    assert total.item() == pytest.approx(pg_only.item() + 0.1 * nll.item(), rel=1e-12)
    # negative samples' tokens get only the policy gradient
    g_total = torch.autograd.grad(total, logp)[0]
    g_pg = torch.autograd.grad(pg_only, logp)[0]
    torch.testing.assert_close(g_total[1], g_pg[1])
    assert not torch.allclose(g_total[0], g_pg[0])


def test_no_positive_samples_gives_zero_nll():
    logp, old, adv, mask, positive = _batch()
    total, metrics = policy_loss(LossBatch(logp, old, adv, mask, positive=torch.zeros_like(positive)))
    assert metrics["nll_loss"].item() == 0.0 and torch.isfinite(total)


@pytest.mark.parametrize("agg", sorted(HAND))
def test_policy_loss_over_micro_batches_equals_full_batch(agg):
    logp, old, adv, mask, positive = _batch(seed=3)
    settings = LossSettings(agg=agg, norm_constant=16)
    full, _ = policy_loss(LossBatch(logp, old, adv, mask, positive=positive), settings)
    g_full = torch.autograd.grad(full, logp)[0]
    splits = [slice(0, 1), slice(1, 3), slice(3, 4)]
    counts = sum((count_loss_units(mask[s], positive=positive[s]) for s in splits), LossCounts(0, 0, 0, 0))
    counts = LossCounts.from_tensor(counts.as_tensor())  # the round trip the all-reduce will take
    total = sum(
        policy_loss(LossBatch(logp[s], old[s], adv[s], mask[s], positive=positive[s]), settings, counts=counts)[0]
        for s in splits
    )
    g_parts = torch.autograd.grad(total, logp)[0]
    assert total.item() == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(g_parts, g_full, rtol=1e-12, atol=1e-14)


def test_packed_policy_loss_equals_padded():
    logp, old, adv, mask, positive = _batch(seed=5)
    rows = [mask[i].nonzero().squeeze(1) for i in range(mask.shape[0])]
    pick = lambda t: torch.cat([t[i, r] for i, r in enumerate(rows)]).unsqueeze(0)  # noqa: E731
    ids = torch.cat([torch.full((len(r),), i) for i, r in enumerate(rows)]).unsqueeze(0)
    for agg in sorted(HAND):
        settings = LossSettings(agg=agg, norm_constant=16)
        padded, _ = policy_loss(LossBatch(logp, old, adv, mask, positive=positive), settings)
        packed, _ = policy_loss(
            LossBatch(
                pick(logp),
                pick(old),
                pick(adv),
                torch.ones_like(ids, dtype=torch.bool),
                positive=pick(positive),
                seq_ids=ids,
            ),
            settings,
        )
        assert packed.item() == pytest.approx(padded.item(), rel=1e-12), agg


def test_metrics_on_a_crafted_batch():
    r = [0.5, 1.5, 12.0, 1.0, 0.1]
    a = [-1.0, 1.0, -1.0, 1.0, -1.0]
    logp = torch.tensor([[math.log(v) for v in r]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    _, m = policy_loss(LossBatch(logp, torch.zeros_like(logp), torch.tensor([a], dtype=torch.float64), mask))
    assert m["clip_frac_low"].item() == pytest.approx(0.25)
    assert m["clip_frac_high"].item() == pytest.approx(0.25)
    assert m["clip_frac_dual"].item() == pytest.approx(0.25)
    assert m["ratio_mean"].item() == pytest.approx((0.5 + 1.5 + 12 + 1) / 4)
    assert m["ratio_max"].item() == pytest.approx(12.0)
    kl = np.mean([v - 1 - math.log(v) for v in r[:4]])
    assert m["approx_kl"].item() == pytest.approx(kl)
    assert m["num_tokens"].item() == 4
    # off-policy measures: r outside [0.8, 1.28] whatever the sign of A (0.5, 1.5, 12: 3 of 4)
    assert m["outside_frac"].item() == pytest.approx(0.75)
    logs = [abs(math.log(v)) for v in r[:4]]
    assert m["log_ratio_abs_mean"].item() == pytest.approx(np.mean(logs))
    assert m["log_ratio_abs_max"].item() == pytest.approx(math.log(12.0))
    assert m["ratio_sq_mean"].item() == pytest.approx(np.mean([v * v for v in r[:4]]))
    # negative-advantage counted tokens: r = 0.5 and 12 (the fifth is masked)
    assert m["neg_tokens"].item() == 2
    assert m["neg_log_ratio_sum"].item() == pytest.approx(math.log(0.5) + math.log(12.0))


def test_policy_loss_errors():
    logp, old, adv, mask, positive = _batch()
    with pytest.raises(ValueError, match="algo="):
        policy_loss(LossBatch(logp, old, adv, mask), LossSettings(algo="grpo"))
    with pytest.raises(ValueError, match="old_logprobs has shape"):
        policy_loss(LossBatch(logp, old[:, :3], adv, mask))
    with pytest.raises(ValueError, match="positive has shape"):
        policy_loss(LossBatch(logp, old, adv, mask, positive=positive[:, 0]))
    with pytest.raises(ValueError, match="num_positive_tokens"):
        policy_loss(LossBatch(logp, old, adv, mask, positive=positive), counts=count_loss_units(mask))
    with pytest.raises(ValueError, match="symmetric"):
        policy_loss(LossBatch(logp, old, adv, mask), LossSettings(algo="ppo", eps_low=0.2, eps_high=0.28))


def test_low_precision_inputs_are_computed_in_float32():
    logp = torch.tensor([[math.log(1.5), math.log(0.5)]], dtype=torch.bfloat16, requires_grad=True)
    loss, _ = policy_loss(LossBatch(logp, torch.zeros_like(logp), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)))
    assert loss.dtype == torch.float32
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.float(), torch.tensor([[-1.28 / 2, 0.8 / 2]]), atol=1e-2, rtol=0)
