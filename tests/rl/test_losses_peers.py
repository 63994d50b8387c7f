"""The losses peers ship beside GPPO (GSPO, DPPO) and the engine/trainer importance corrections
(sequence TIS, rejection masks, IcePop): gradients against float64 references written from the
papers' formulas, one token or one sequence at a time in plain Python, on random batches whose
ratios meet every region (clipped, masked, truncated)."""

import math
import random

import pytest
import torch

from megatron_klear.config import load_config
from megatron_klear.platform.errors import ConfigError
from megatron_klear.rl.importance import Correction, rollout_correction
from megatron_klear.rl.losses import DPPO_RATIO_CAP, LossBatch, LossSettings, per_token_policy_loss, policy_loss


def _batch(seed, lengths=(5, 9, 3, 7), spread=0.3):
    """Padded [B, T] float64 log-probs (current, old, rollout), per-sequence advantages of both signs,
    a mask of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    b, t = len(lengths), max(lengths)
    logp = (-torch.rand(b, t, generator=g, dtype=torch.float64) * 2 - 0.05).requires_grad_()
    old = logp.detach() + spread * torch.randn(b, t, generator=g, dtype=torch.float64)
    old = old.clamp(max=-1e-3)  # log-probs stay < 0
    rollout = old + 0.5 * spread * torch.randn(b, t, generator=g, dtype=torch.float64)
    rollout = rollout.clamp(max=-1e-3)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0][:b], dtype=torch.float64).unsqueeze(1).expand(b, t).clone()
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    return logp, old, rollout, adv, mask


# -- GSPO ------------------------------------------------------------------------------------------
def _gspo_reference_grad(logp, old, adv, mask, eps_low, eps_high):
    """The GSPO objective J = 1/G sum_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i) with
    s_i = (pi(y_i) / pi_old(y_i)) ** (1 / |y_i|), differentiated by hand: dJ/dlogp_{i,t} =
    A_i s_i / |y_i| where the min picks the unclipped term, 0 where it picks the clipped one."""
    grad = torch.zeros_like(logp)
    rows = logp.shape[0]
    for i in range(rows):
        idx = [t for t in range(logp.shape[1]) if mask[i, t]]
        a = float(adv[i, idx[0]])
        s = math.exp(sum(float(logp[i, t] - old[i, t]) for t in idx) / len(idx))
        clipped = min(max(s, 1 - eps_low), 1 + eps_high)
        uses_unclipped = s * a <= clipped * a  # min(s A, clip(s) A) picks s A
        for t in idx:
            grad[i, t] = -(a * s / len(idx)) / rows if uses_unclipped else 0.0  # loss = -J
    return grad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_gradient_matches_the_sequence_formula(seed):
    logp, old, _, adv, mask = _batch(seed, spread=0.08)
    eps_low, eps_high = 0.02, 0.03  # wide enough that some sequences are in, some clipped on each side
    loss, metrics = policy_loss(
        LossBatch(logp, old, adv, mask),
        LossSettings(algo="gspo", eps_low=eps_low, eps_high=eps_high, agg="seq_mean_token_mean", nll_coef=0),
    )
    (grad,) = torch.autograd.grad(loss, logp)
    expected = _gspo_reference_grad(logp.detach(), old, adv, mask, eps_low, eps_high)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)


def test_gspo_clips_whole_sequences_and_packs_like_padding():
    logp, old, _, adv, mask = _batch(3, spread=0.08)
    settings = LossSettings(algo="gspo", eps_low=0.02, eps_high=0.03, agg="seq_mean_token_mean", nll_coef=0)
    _, per_tok = per_token_policy_loss(
        LossBatch(logp, old, adv, mask), LossSettings(algo="gspo", eps_low=0.02, eps_high=0.03)
    )
    flags = per_tok["clipped_low"] | per_tok["clipped_high"]
    seen = {bool(flags[i][mask[i]].all()) == bool(flags[i][mask[i]].any()) for i in range(mask.shape[0])}
    assert seen == {True}  # a sequence is clipped whole or not at all
    assert flags[mask].any() and not flags[mask].all()
    padded, _ = policy_loss(LossBatch(logp, old, adv, mask), settings)
    (g_padded,) = torch.autograd.grad(padded, logp)
    # the same sequences packed into one row, with seq ids
    flat = lambda x: x[mask].unsqueeze(0)  # noqa: E731
    ids = torch.cat([torch.full((int(n),), i) for i, n in enumerate(mask.sum(1))]).unsqueeze(0)
    packed_logp = flat(logp.detach()).requires_grad_()
    packed, _ = policy_loss(
        LossBatch(packed_logp, flat(old), flat(adv), torch.ones_like(ids, dtype=torch.bool), seq_ids=ids), settings
    )
    (g_packed,) = torch.autograd.grad(packed, packed_logp)
    torch.testing.assert_close(packed.detach(), padded.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(g_packed, flat(g_padded), rtol=1e-12, atol=0)


# -- DPPO ------------------------------------------------------------------------------------------
def _dppo_reference(logp, rollout, adv, mask, delta_low, delta_high, kind):
    """Per token, from the paper: r = pi / mu, p = pi(y_t), q = mu(y_t); kept unless the update
    would leave the trust region (TV: |p - q| past delta on the side A pushes to; binary KL:
    KL(Bern(q) || Bern(p)) past delta, moving away); gradient of the token-mean loss:
    -A min(r, 20) / N on kept tokens. Returns (grad, kept)."""
    n = int(mask.sum())
    grad = torch.zeros_like(logp)
    kept = torch.zeros_like(mask)
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            lp, lq, a = float(logp[i, t]), float(rollout[i, t]), float(adv[i, t])
            p, q = math.exp(lp), math.exp(lq)
            if kind == "tv":
                keep = p - q <= delta_high if a > 0 else q - p <= delta_low
            else:
                kl = q * (lq - lp) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
                keep = (kl <= delta_high or p <= q) if a > 0 else (kl <= delta_low or p >= q)
            kept[i, t] = keep
            if keep:
                grad[i, t] = -a * min(math.exp(lp - lq), DPPO_RATIO_CAP) / n
    return grad, kept


@pytest.mark.parametrize("kind,delta", [("tv", 0.05), ("kl", 0.01)])
@pytest.mark.parametrize("seed", [0, 1])
def test_dppo_gradient_matches_the_token_formula_and_anchors_on_the_rollout(kind, delta, seed):
    logp, old, rollout, adv, mask = _batch(seed, spread=0.4)
    settings = LossSettings(algo=f"dppo_{kind}", eps_low=delta, eps_high=delta, nll_coef=0)
    loss, metrics = policy_loss(LossBatch(logp, old, adv, mask, rollout_logprobs=rollout), settings)
    (grad,) = torch.autograd.grad(loss, logp)
    expected, kept = _dppo_reference(logp.detach(), rollout, adv, mask, delta, delta, kind)
    assert 0 < int((kept & mask).sum()) < int(mask.sum())  # both regions met
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)
    masked = float(metrics["clip_frac_low"] + metrics["clip_frac_high"])
    assert masked == pytest.approx(1 - float((kept & mask).sum()) / float(mask.sum()))
    # the anchor is the rollout's log-probs: without them it is the old ones, another gradient
    loss_old, _ = policy_loss(LossBatch(logp, old, adv, mask), settings)
    (grad_old,) = torch.autograd.grad(loss_old, logp)
    expected_old, _ = _dppo_reference(logp.detach(), old, adv, mask, delta, delta, kind)
    torch.testing.assert_close(grad_old, expected_old, rtol=1e-12, atol=1e-15)
    assert not torch.allclose(grad_old, grad)


# -- importance corrections ------------------------------------------------------------------------
def _reference_weights(old, rollout, mask, c: Correction):
    """Per token weight from the definitions, sequence by sequence (rows are sequences)."""
    w = torch.zeros_like(old)
    for i in range(old.shape[0]):
        idx = [t for t in range(old.shape[1]) if mask[i, t]]
        logs = [float(old[i, t] - rollout[i, t]) for t in idx]
        seq, geo = math.exp(sum(logs)), math.exp(sum(logs) / len(logs))
        for t, lr in zip(idx, logs):
            rho = math.exp(lr)
            weight = 1.0
            if c.tis_cap:
                weight = min(seq if c.is_level == "sequence" else rho, c.tis_cap)
            if c.is_reject:
                low, high = c.reject_bounds()
                x = {"token": rho, "sequence": seq, "geometric": geo}[c.is_reject]
                if not low <= x <= high:
                    weight = 0.0
            w[i, t] = weight
    return w


CORRECTIONS = [
    Correction(tis_cap=2.0),
    Correction(tis_cap=2.0, is_level="sequence"),
    Correction(is_reject="token", is_reject_low=0.5, is_reject_high=5.0),  # IcePop's mask alone (weight 1)
    Correction(tis_cap=5.0, is_reject="token", is_reject_low=0.5, is_reject_high=5.0),  # IcePop
    Correction(tis_cap=2.0, is_reject="token", is_reject_low=0.8, is_reject_high=1.25),
    Correction(tis_cap=3.0, is_level="sequence", is_reject="sequence", is_reject_high=4.0),
    Correction(is_reject="geometric", is_reject_high=1.2),
]


@pytest.mark.parametrize("c", CORRECTIONS, ids=lambda c: f"{c.is_level}-{c.tis_cap}-{c.is_reject}")
def test_importance_weights_match_their_definitions(c):
    _, old, _, _, mask = _batch(5)
    b, t = old.shape
    pattern = torch.tensor([[((i * 7 + j * 3) % 9 - 4) * 0.3 for j in range(t)] for i in range(b)], dtype=old.dtype)
    rollout = old - pattern - 0.05 * torch.arange(b, dtype=old.dtype).unsqueeze(1)  # log rho in [-1.35, 1.2]
    w, sums = rollout_correction(old, rollout, mask, c)
    expected = _reference_weights(old, rollout, mask, c)
    torch.testing.assert_close(w, expected, rtol=1e-12, atol=0)
    if c.is_reject:
        assert 0 < float(sums["rejected"]) < float(mask.sum())
    elif c.tis_cap:
        assert (w[mask] == c.tis_cap).any() and (w[mask] < c.tis_cap).any()  # truncation met and not
    assert float(sums["weight_sum"]) == pytest.approx(float(expected[mask].sum()))
    # packed with seq ids: the same weights
    ids = torch.cat([torch.full((int(n),), i) for i, n in enumerate(mask.sum(1))]).unsqueeze(0)
    wp, _ = rollout_correction(old[mask].unsqueeze(0), rollout[mask].unsqueeze(0), torch.ones_like(ids).bool(), c, ids)
    torch.testing.assert_close(wp[0], expected[mask], rtol=1e-12, atol=0)


def _icepop(rho, seq):
    """IcePop (Ling team 2025): M(k) = k on [0.5, 5], 0 outside, k the token's pi_old / pi_behav."""
    return rho if 0.5 <= rho <= 5.0 else 0.0


def _trl(mode, clip_max, clip_min=None):
    """TRL 1.16 GRPOTrainer's vLLM importance weight (``vllm_importance_sampling_mode``; the ratio is
    per token, or its product over the sequence for ``sequence_*``): ``*_truncate`` clamps it to
    [clip_min, clip_max] (a None bound: no bound), ``*_mask`` zeroes it outside and keeps it inside."""

    def weight(rho, seq):
        x = seq if mode.startswith("sequence") else rho
        low = -math.inf if clip_min is None else clip_min
        if mode.endswith("truncate"):
            return min(max(x, low), clip_max)
        return x if low <= x <= clip_max else 0.0

    return weight


# docs/gppo.md's mappings of the peers' settings, each against the peer's own definition
PEER_PRESETS = {
    "icepop": (Correction(tis_cap=5.0, is_reject="token", is_reject_low=0.5, is_reject_high=5.0), _icepop),
    "trl-token_truncate": (Correction(tis_cap=2.0), _trl("token_truncate", 2.0)),
    "trl-token_mask": (
        Correction(tis_cap=2.0, is_reject="token", is_reject_low=0.0, is_reject_high=2.0),
        _trl("token_mask", 2.0),
    ),
    "trl-token_mask-clip_min": (
        Correction(tis_cap=2.0, is_reject="token", is_reject_low=0.5, is_reject_high=2.0),
        _trl("token_mask", 2.0, clip_min=0.5),
    ),
    "trl-sequence_truncate": (Correction(tis_cap=3.0, is_level="sequence"), _trl("sequence_truncate", 3.0)),
    "trl-sequence_mask": (  # TRL's default with vLLM: sequence_mask, clip_max 3, no clip_min
        Correction(tis_cap=3.0, is_level="sequence", is_reject="sequence", is_reject_low=0.0, is_reject_high=3.0),
        _trl("sequence_mask", 3.0),
    ),
}


@pytest.mark.parametrize("name", sorted(PEER_PRESETS))
def test_peer_presets_weight_the_kept_tokens_as_the_peers_do(name):
    """IcePop and TRL's masks keep a token (or sequence) with its ratio as the weight, not 1; TRL's
    masks are one-sided unless clip_min is given (the project's is_reject_low defaults to 1/high)."""
    c, peer = PEER_PRESETS[name]
    _, old, _, _, mask = _batch(5)
    b, t = old.shape
    pattern = torch.tensor([[((i * 7 + j * 3) % 9 - 4) * 0.3 for j in range(t)] for i in range(b)], dtype=old.dtype)
    rollout = old - pattern - 0.05 * torch.arange(b, dtype=old.dtype).unsqueeze(1)  # log rho in [-1.35, 1.2]
    w, _ = rollout_correction(old, rollout, mask, c)
    expected = torch.zeros_like(old)
    rhos, seqs = torch.zeros_like(old), torch.zeros_like(old)
    for i in range(b):
        idx = [j for j in range(t) if mask[i, j]]
        seq = math.exp(sum(float(old[i, j] - rollout[i, j]) for j in idx))
        for j in idx:
            rho = math.exp(float(old[i, j] - rollout[i, j]))
            expected[i, j], rhos[i, j], seqs[i, j] = peer(rho, seq), rho, seq
    torch.testing.assert_close(w, expected, rtol=1e-12, atol=0)
    level = seqs if c.is_level == "sequence" else rhos
    kept = mask & (w > 0)
    assert kept.any()
    if c.is_reject:  # kept tokens carry their ratio (not 1), and some are rejected
        # (to float64 rounding: the product of the ratios and math.exp of the summed logs differ in the last bit)
        assert torch.allclose(w[kept], level[kept], rtol=1e-12, atol=0) and (w[kept] != 1.0).any()
        assert (mask & (w == 0)).any()
        if c.is_reject_low == 0.0:  # one-sided: ratios below 1 / high are kept
            assert (kept & (level < 1.0 / c.is_reject_high)).any()


def test_the_weights_scale_the_gradient_and_keep_the_clip_regions():
    """Weighting A by w: each token's gradient is w times the unweighted one, for every rule."""
    logp, old, rollout, adv, mask = _batch(7, spread=0.3)
    w, _ = rollout_correction(old, rollout, mask, Correction(tis_cap=2.0, is_level="sequence"))
    for algo in ("gppo", "clip_higher", "cispo", "gspo"):
        base, _ = per_token_policy_loss(LossBatch(logp, old, adv, mask), LossSettings(algo=algo))
        weighted, _ = per_token_policy_loss(LossBatch(logp, old, adv * w, mask), LossSettings(algo=algo))
        (g0,) = torch.autograd.grad(base[mask].sum(), logp)
        (g1,) = torch.autograd.grad(weighted[mask].sum(), logp)
        torch.testing.assert_close(g1, g0 * w, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(
    "override,words",
    [
        ("rl.algo=dppo", "rl.algo must be one of"),
        ("rl.is_level=seq", "rl.is_level must be one of"),
        ("rl.is_reject=token", "rl.is_reject_high"),
        ("rl.is_reject=tokens", "rl.is_reject must be one of"),
        # the level of a weight with no cap: nothing would be weighted (it was silently a no-op)
        ("rl.is_level=sequence", r"rl.is_level=sequence without rl.tis_cap weights nothing"),
    ],
)
def test_bad_keys_are_refused_by_name(override, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, [override])


@pytest.mark.parametrize("algo", ["dppo_tv", "dppo_kl"])
def test_dppo_with_tis_cap_is_refused_by_name(algo):
    """DPPO's ratio is against the rollout policy: a truncated weight on top weights twice."""
    with pytest.raises(ConfigError, match=rf"rl.algo={algo} with rl.tis_cap=2.0: .* weight every token twice"):
        load_config(None, [f"rl.algo={algo}", "rl.tis_cap=2"])
    # a rejection mask (weights 0 or 1) and stale-token masking combine with it; tis_cap with the rest
    rl = load_config(
        None, [f"rl.algo={algo}", "rl.is_reject=token", "rl.is_reject_high=5", "rl.mask_stale_tokens=true"]
    ).rl
    assert (rl.algo, rl.tis_cap, rl.is_reject) == (algo, None, "token")
    assert load_config(None, ["rl.algo=gppo", "rl.tis_cap=2"]).rl.tis_cap == 2.0


def test_bad_reject_bounds_are_refused():
    with pytest.raises(ConfigError, match="need 0 <= low < 1 < high"):
        load_config(None, ["rl.is_reject=token", "rl.is_reject_high=0.9"])


def test_shipped_variant_configs_load():
    """Klear's variants and the peers' losses ship as configs; each loads and says what it is."""
    import glob
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    seen = {}
    for path in sorted(glob.glob(os.path.join(root, "examples/configs/losses/*.yaml"))):
        rl = load_config(path, []).rl
        seen[os.path.basename(path)] = (rl.algo, rl.beta1, rl.beta2)
    assert seen["gppo_general_beta1_0.5.yaml"] == ("gppo", 0.5, 1.0)
    assert seen["gppo_general_beta1_0.25.yaml"] == ("gppo", 0.25, 1.0)
    assert seen["gppo_only_high.yaml"] == ("gppo", 0.0, 1.0)
    assert seen["ce_gppo.yaml"] == ("gppo", 0.75, 1.0)
    assert seen["gspo.yaml"][0] == "gspo" and seen["dppo_tv.yaml"][0] == "dppo_tv"
    random.seed(0)


def test_a_variant_config_starts_from_its_base(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("rl:\n  algo: gppo\n  beta1: 1.0\n  nll_coef: 0.2\n")
    (tmp_path / "v").mkdir()
    variant = tmp_path / "v" / "variant.yaml"
    variant.write_text("base: ../base.yaml\nrl:\n  beta1: 0.5\n")
    rl = load_config(str(variant), ["rl.beta2=0.9"]).rl
    assert (rl.algo, rl.beta1, rl.beta2, rl.nll_coef) == ("gppo", 0.5, 0.9, 0.2)
    base.write_text("base: v/variant.yaml\n")
    with pytest.raises(ConfigError, match="'base' makes a cycle"):
        load_config(str(variant))
    variant.write_text("base: ../missing.yaml\n")
    with pytest.raises(ConfigError, match="missing.yaml .the base of"):
        load_config(str(variant))


@pytest.mark.parametrize(
    "keys",
    [["rl.algo=gspo"], ["rl.tis_cap=2", "rl.is_level=sequence"], ["rl.is_reject=geometric", "rl.is_reject_high=2"]],
)
def test_sequence_ratios_are_refused_with_context_parallelism(keys):
    with pytest.raises(ConfigError, match="whole sequences and is not supported with parallel.cp > 1"):
        load_config(None, keys + ["parallel.cp=2", "parallel.tp=1"])
