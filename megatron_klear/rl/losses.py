"""Policy-gradient losses of the Klear-Reasoner recipe (GPPO and the baselines it is compared with).

Plain torch: nothing here knows about Megatron, packing or data parallelism. The actor calls the
building blocks on each packed micro-batch and passes the counts of the whole global batch, so that
the sum of the micro-batch losses equals the loss of the full batch exactly.

Notation (docs/gppo.md, "Notation"): ``r = exp(logp - old_logp)`` per token, ``A`` the
advantage of the token's sequence, ``sg`` stop-gradient, ``loss = -objective``. Every algorithm
gives a per-token gradient ``d(loss)/d(logp) = -F * A`` where:

============  ==========================================================================
algo          gradient factor F
============  ==========================================================================
ppo           ``r``, or 0 where the clip is active (symmetric: eps_high = eps_low)
clip_higher   same as ppo with the asymmetric DAPO clip [1-eps_low, 1+eps_high]
gppo          ``beta1*(1-eps_low)`` if r < 1-eps_low and A < 0;
              ``beta2*(1+eps_high)`` if r > 1+eps_high and A > 0; ``r`` otherwise
cispo         ``clip(r, 1-eps_low, 1+eps_high)`` for both signs of A (MiniMax-M1)
============  ==========================================================================

For ppo, clip_higher and gppo the dual clip (Ye et al. 2020) then caps the per-token loss of a
negative-advantage token at ``-dual_clip * A``, i.e. F = 0 where r > dual_clip and A < 0. The
dual clip must be > 1: the authors' early code effectively used 1, which zeroed the gradient of every
negative-advantage token with r > 1 (docs/recipe.md, "Bugs of the authors' code"); ``dual_clip <= 1`` is refused.

Forward values: gppo's per-token loss equals clip_higher's for any beta (the betas only scale the
gradient; CE-GPPO writes the betas into the value too, which changes nothing but the logged loss).
cispo's value is ``-A * clip(r)``, the objective whose gradient is the CISPO update.

Numerics: the log-ratio is clamped to [-20, 20] in value only (straight-through), so that a stale
old log-prob cannot overflow ``exp`` while GPPO still gets its bounded gradient on such a token.
Inputs of a lower precision are upcast to float32; float64 stays float64 (the tests use it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

import torch

ALGORITHMS = ("ppo", "clip_higher", "gppo", "cispo", "gspo", "dppo_tv", "dppo_kl")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")

# (eps_low, eps_high) used when the caller passes None.
# ppo: the classic symmetric 0.2. clip_higher / gppo: the paper's 0.2 / 0.28.
# cispo: MiniMax-M1 puts no lower bound on the importance weight ("eps_low large"; 1.0 makes the
# lower bound 0, which r never goes below) and tuned eps_high without publishing it; we take the
# paper's 0.28 so that cispo and gppo are compared with the same upper bound.
DEFAULT_EPS = {
    "ppo": (0.2, 0.2),
    "clip_higher": (0.2, 0.28),
    "gppo": (0.2, 0.28),
    "cispo": (1.0, 0.28),
    # GSPO: the paper's sequence-ratio bounds (Zheng et al. 2025, Qwen3 RL): 3e-4 / 4e-4.
    "gspo": (3e-4, 4e-4),
    # DPPO: eps are the divergence thresholds delta (verl's DPPO example: TV 0.15, binary KL 0.05).
    "dppo_tv": (0.15, 0.15),
    "dppo_kl": (0.05, 0.05),
}
# DPPO's importance ratio pi / pi_rollout is truncated at this value (detached), as verl's clip_ratio_c.
DPPO_RATIO_CAP = 20.0
DEFAULT_DUAL_CLIP = 10.0
DEFAULT_NLL_COEF = 0.1
LOG_RATIO_LIMIT = 20.0

Number = Union[int, float, torch.Tensor]


# --------------------------------------------------------------------------------------------
# Per-token losses
# --------------------------------------------------------------------------------------------
def resolve_clip_range(algo: str, eps_low: Optional[float], eps_high: Optional[float]) -> Tuple[float, float]:
    """The (eps_low, eps_high) an algorithm uses, after defaults and checks."""
    if algo not in ALGORITHMS:
        raise ValueError(f"policy loss: algo={algo!r} is not one of {ALGORITHMS}")
    if algo == "ppo":
        given = {float(v) for v in (eps_low, eps_high) if v is not None}
        if len(given) > 1:
            raise ValueError(
                f"policy loss: algo='ppo' clips symmetrically but eps_low={eps_low} != eps_high={eps_high}; "
                "use algo='clip_higher' for an asymmetric clip"
            )
        low = high = given.pop() if given else DEFAULT_EPS["ppo"][0]
    else:
        default_low, default_high = DEFAULT_EPS[algo]
        low = default_low if eps_low is None else float(eps_low)
        high = default_high if eps_high is None else float(eps_high)
    if not 0.0 <= low <= 1.0:
        raise ValueError(f"policy loss: eps_low={low} must be in [0, 1] (the lower bound is 1 - eps_low)")
    if high < 0.0:
        raise ValueError(f"policy loss: eps_high={high} must be >= 0")
    return low, high


def _straight_through_clamp(x: torch.Tensor, limit: float) -> torch.Tensor:
    """``clamp(x, -limit, limit)`` in value, identity in gradient."""
    return x + (x.clamp(-limit, limit) - x).detach()


@dataclass
class _Tokens:
    """What a rule sees: per-token ratios (with and without a graph), advantages and settings."""

    ratio: torch.Tensor
    ratio_sg: torch.Tensor
    adv: torch.Tensor
    lower: float
    upper: float
    dual_clip: Optional[float]
    beta1: float
    beta2: float
    mask: Optional[torch.Tensor]
    seq_ids: Optional[torch.Tensor]
    logprobs: Optional[torch.Tensor] = None  # the current ones, with a graph (DPPO)
    anchor_logprobs: Optional[torch.Tensor] = None  # DPPO's: the rollout's (else the old ones)

    def grad_one(self) -> torch.Tensor:
        """``r / sg(r)``: 1 in value, ``grad(logp)`` in gradient."""
        return self.ratio / self.ratio_sg

    def no_flags(self) -> torch.Tensor:
        return torch.zeros_like(self.ratio_sg, dtype=torch.bool)


def _pessimistic_clip(t: _Tokens, clipped_ratio: torch.Tensor) -> tuple:
    """PPO's ``max(-A r, -A clipped_ratio)`` and the dual clip; the flags of the clip regions."""
    loss = torch.maximum(-t.adv * t.ratio, -t.adv * clipped_ratio)
    clipped_low = (t.adv < 0) & (t.ratio_sg < t.lower)
    clipped_high = (t.adv > 0) & (t.ratio_sg > t.upper)
    dual_clipped = t.no_flags()
    if t.dual_clip is not None:
        negative = t.adv < 0
        loss = torch.where(negative, torch.minimum(loss, -t.dual_clip * t.adv), loss)
        dual_clipped = negative & (t.ratio_sg > t.dual_clip)
    return loss, clipped_low, clipped_high, dual_clipped


def _clip_rule(t: _Tokens) -> tuple:
    """ppo / clip_higher: the clipped ratio has no gradient outside [lower, upper]."""
    return _pessimistic_clip(t, t.ratio.clamp(t.lower, t.upper))


def _gppo_rule(t: _Tokens) -> tuple:
    """GPPO: the clip bounds written as ``bound * r / sg(r)`` (numerically the bound, gradient
    ``bound * grad(logp)``); beta scales only the gradient: ``bound * (1 + beta * (r / sg(r) - 1))``."""
    grad_one_minus_one = t.grad_one() - 1.0
    low_bound = t.lower * (1.0 + t.beta1 * grad_one_minus_one)
    high_bound = t.upper * (1.0 + t.beta2 * grad_one_minus_one)
    clipped = torch.where(t.ratio_sg < t.lower, low_bound, torch.where(t.ratio_sg > t.upper, high_bound, t.ratio))
    return _pessimistic_clip(t, clipped)


def _cispo_rule(t: _Tokens) -> tuple:
    """CISPO: value ``-A * clip(r)``, gradient ``-clip(r) * A * grad(logp)`` (a constant weight)."""
    loss = -t.adv * t.ratio_sg.clamp(t.lower, t.upper) * t.grad_one()
    return loss, t.ratio_sg < t.lower, t.ratio_sg > t.upper, t.no_flags()


def _gspo_rule(t: _Tokens) -> tuple:
    """GSPO (Zheng et al. 2025), in its token form: the sequence ratio ``s = exp(mean_t log r_t)``
    over the sequence's counted tokens, ``s_t = sg(s) * r_t / sg(r_t)`` (value s, gradient
    ``s * grad(logp_t)``), clipped as PPO clips a ratio: the whole sequence is in or out."""
    if t.mask is None:
        raise ValueError("policy loss: algo='gspo' needs the response mask (the sequence ratio is a mean over it)")
    m = t.mask.bool()
    log_r = torch.log(t.ratio_sg)  # the clamped log-ratio
    seq_sum, seq_len, inverse = sequence_sums(log_r, m, t.seq_ids)
    seq_ratio = torch.ones_like(log_r)
    seq_ratio[m] = torch.exp(seq_sum / seq_len)[inverse]
    s_t = seq_ratio * t.grad_one()
    loss = torch.maximum(-t.adv * s_t, -t.adv * s_t.clamp(t.lower, t.upper))
    return loss, (t.adv < 0) & (seq_ratio < t.lower), (t.adv > 0) & (seq_ratio > t.upper), t.no_flags()


def _dppo_rule(t: _Tokens, kind: str) -> tuple:
    """DPPO (Qi et al. 2026, arXiv 2602.04879; verl's ``dppo_tv`` / ``dppo_kl``): an importance-
    weighted policy gradient against the rollout policy ``mu``, ``-A * sg(min(pi / mu, cap)) *
    grad(logp)``, masked where the update would leave a divergence trust region around ``mu``: with
    ``p = pi(token)`` and ``q = mu(token)``, a positive-advantage token is masked when ``p - q >
    eps_high`` (TV) or when ``p > q`` and the binary KL(q || p) > eps_high (KL); a negative one when
    ``q - p > eps_low`` (TV) or ``p < q`` and the binary KL > eps_low. The value is the surrogate
    ``-A * min(r, cap)`` on kept tokens."""
    log_r = _straight_through_clamp(t.logprobs - t.anchor_logprobs, LOG_RATIO_LIMIT)
    r = torch.exp(log_r)
    r_sg = r.detach()
    p, q = torch.exp(t.logprobs.detach()), torch.exp(t.anchor_logprobs)
    low, high = 1.0 - t.lower, t.upper - 1.0
    if kind == "tv":
        keep_pos, keep_neg = (p - q) <= high, (p - q) >= -low
    else:
        tiny = 1e-8
        binary_kl = q * (t.anchor_logprobs - t.logprobs.detach()) + (1 - q) * torch.log((1 - q + tiny) / (1 - p + tiny))
        keep_pos, keep_neg = (binary_kl <= high) | (p <= q), (binary_kl <= low) | (p >= q)
    keep = torch.where(t.adv > 0, keep_pos, keep_neg)
    loss = torch.where(keep, -t.adv * r_sg.clamp(max=DPPO_RATIO_CAP) * (r / r_sg), torch.zeros_like(r))
    return loss, (t.adv < 0) & ~keep, (t.adv > 0) & ~keep, t.no_flags()


_RULES = {
    "ppo": _clip_rule,
    "clip_higher": _clip_rule,
    "gppo": _gppo_rule,
    "cispo": _cispo_rule,
    "gspo": _gspo_rule,
    "dppo_tv": lambda t: _dppo_rule(t, "tv"),
    "dppo_kl": lambda t: _dppo_rule(t, "kl"),
}


def per_token_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    algo: str = "gppo",
    eps_low: Optional[float] = None,
    eps_high: Optional[float] = None,
    dual_clip: Optional[float] = DEFAULT_DUAL_CLIP,
    beta1: float = 1.0,
    beta2: float = 1.0,
    mask: Optional[torch.Tensor] = None,
    seq_ids: Optional[torch.Tensor] = None,
    rollout_logprobs: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Per-token policy loss (to be minimised) and per-token diagnostics.

    All three tensors have the same shape (any shape; [batch, tokens] or a packed [1, total]).
    Positions that the aggregation masks out may hold anything finite.

    ``eps_low``/``eps_high`` default per algorithm (``DEFAULT_EPS``). ``dual_clip`` (c > 1, or
    None to disable) applies to ppo, clip_higher and gppo; cispo has no dual clip (its weight is
    already bounded by 1 + eps_high) and ignores it. ``beta1``/``beta2`` are used by gppo only.

    Returns ``(loss_tokens, metrics_tokens)``; ``metrics_tokens`` holds detached per-token tensors:
    ``ratio``, ``clipped_low``, ``clipped_high``, ``dual_clipped`` (bool: where F was replaced by a
    bound or zero) and ``approx_kl`` (``(r - 1) - log r``, the k3 estimate of KL(old || new)).
    """
    low, high = resolve_clip_range(algo, eps_low, eps_high)
    if dual_clip is not None and not float(dual_clip) > 1.0:
        raise ValueError(
            f"policy loss: dual_clip={dual_clip} must be > 1 (or None to disable); with c <= 1 every "
            "negative-advantage token with r > c gets zero gradient (the authors' c=1 bug)"
        )
    if beta1 < 0 or beta2 < 0:
        raise ValueError(f"policy loss: beta1={beta1} and beta2={beta2} must be >= 0")
    named = (("old_logprobs", old_logprobs), ("advantages", advantages), ("mask", mask))
    for name, t in named + (("rollout_logprobs", rollout_logprobs),):
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(
                f"policy loss: {name} has shape {tuple(t.shape)}, expected logprobs' shape {tuple(logprobs.shape)}"
            )

    dtype = torch.float64 if logprobs.dtype == torch.float64 else torch.float32
    logprobs = logprobs.to(dtype)
    old_logprobs = old_logprobs.detach().to(dtype)
    adv = advantages.detach().to(dtype)

    log_ratio = _straight_through_clamp(logprobs - old_logprobs, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    t = _Tokens(
        ratio=ratio,
        ratio_sg=ratio.detach(),
        adv=adv,
        lower=1.0 - low,
        upper=1.0 + high,
        dual_clip=None if dual_clip is None else float(dual_clip),
        beta1=beta1,
        beta2=beta2,
        mask=mask,
        seq_ids=seq_ids,
        logprobs=logprobs,
        anchor_logprobs=(old_logprobs if rollout_logprobs is None else rollout_logprobs.detach().to(dtype)),
    )
    loss, clipped_low, clipped_high, dual_clipped = _RULES[algo](t)

    log_ratio_sg = log_ratio.detach()
    ratio_sg = t.ratio_sg
    metrics = {
        "ratio": ratio_sg,
        "clipped_low": clipped_low,
        "clipped_high": clipped_high,
        "dual_clipped": dual_clipped,
        "approx_kl": ratio_sg - 1.0 - log_ratio_sg,
        "log_ratio": log_ratio_sg,
        "outside": (ratio_sg < t.lower) | (ratio_sg > t.upper),
        "negative": adv < 0,
    }
    return loss, metrics


# --------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------
def sequence_index(mask: torch.Tensor, seq_ids: Optional[torch.Tensor]) -> Tuple[torch.Tensor, int]:
    """For each masked token (in ``mask.nonzero()`` order), the index of its sequence; and the count.

    A sequence is a (row, seq_id) pair: packed rows give every sequence its own id, unpacked
    [batch, tokens] inputs (``seq_ids=None``) have one sequence per row. A sequence never spans rows.
    Only sequences with at least one masked token are counted.
    """
    if mask.dim() == 1:
        mask = mask.unsqueeze(0)
        seq_ids = None if seq_ids is None else seq_ids.unsqueeze(0)
    flat_mask = mask.reshape(mask.shape[0], -1)
    rows = torch.arange(flat_mask.shape[0], device=mask.device).unsqueeze(1).expand_as(flat_mask)
    if seq_ids is None:
        keys = rows[flat_mask].unsqueeze(1)
    else:
        ids = seq_ids.reshape(flat_mask.shape)[flat_mask].to(rows.dtype)
        keys = torch.stack([rows[flat_mask], ids], dim=1)
    if keys.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=mask.device), 0
    uniq, inverse = torch.unique(keys, dim=0, return_inverse=True)
    return inverse, int(uniq.shape[0])


def sequence_sums(values: torch.Tensor, mask: torch.Tensor, seq_ids: Optional[torch.Tensor] = None) -> tuple:
    """Per sequence (:func:`sequence_index`): the sum of ``values`` over its masked tokens (with a
    graph) and its token count; and each masked token's sequence index. ``mask`` is boolean."""
    inverse, n_seq = sequence_index(mask, seq_ids)
    sums = torch.zeros(n_seq, dtype=values.dtype, device=values.device).index_add(0, inverse, values[mask])
    return sums, torch.bincount(inverse, minlength=n_seq).to(values.dtype), inverse


def _check_mask(loss_tokens: torch.Tensor, mask: torch.Tensor, seq_ids: Optional[torch.Tensor]) -> torch.Tensor:
    if mask.shape != loss_tokens.shape:
        raise ValueError(
            f"aggregate: mask has shape {tuple(mask.shape)}, expected the loss's shape {tuple(loss_tokens.shape)}"
        )
    if seq_ids is not None and seq_ids.shape != mask.shape:
        raise ValueError(
            f"aggregate: seq_ids has shape {tuple(seq_ids.shape)}, expected the mask's {tuple(mask.shape)}"
        )
    return mask.bool()


def _as_denominator(value: Optional[Number], local: Number, like: torch.Tensor, name: str) -> torch.Tensor:
    if value is None:
        return torch.as_tensor(max(float(local), 1.0), dtype=like.dtype, device=like.device)
    if not isinstance(value, torch.Tensor) and not float(value) > 0:
        raise ValueError(f"aggregate: {name}={value} must be > 0")
    return torch.as_tensor(value, dtype=like.dtype, device=like.device).clamp_min(1e-12)


def count_sequences(mask: torch.Tensor, seq_ids: Optional[torch.Tensor] = None) -> int:
    """Sequences with at least one masked token (the unit of the seq_mean_* modes)."""
    return sequence_index(mask.bool(), seq_ids)[1]


def aggregate(
    loss_tokens: torch.Tensor,
    mask: torch.Tensor,
    agg: str = "token_mean",
    *,
    global_num_tokens: Optional[Number] = None,
    global_num_seqs: Optional[Number] = None,
    seq_ids: Optional[torch.Tensor] = None,
    constant: Optional[float] = None,
) -> torch.Tensor:
    """Reduce per-token losses to this batch's share of the global-batch loss.

    ``mask`` selects the tokens that count (non-zero = counted). Sequences are rows, or (row, seq_id)
    pairs when ``seq_ids`` is given (packed rows). With l_t the per-token loss, T_s the counted
    tokens of sequence s, the global batch being everything that goes into one optimizer step
    (all micro-batches on all data-parallel ranks):

    - ``token_mean`` (default; the paper's ``1 / sum_j T_j``):
      ``sum_t l_t / N_tok``, N_tok = ``global_num_tokens`` (default: this batch's count).
      Every token weighs the same; long responses weigh more than short ones.
    - ``seq_mean_token_mean``: ``sum_s (sum_{t in s} l_t / T_s) / N_seq``,
      N_seq = ``global_num_seqs`` (default: this batch's sequences with T_s > 0). Every sequence
      weighs the same. Exact across micro-batches only if no sequence is split between them.
    - ``seq_mean_token_sum_norm`` (Dr.GRPO): ``sum_t l_t / (constant * N_seq)`` with ``constant``
      a fixed length (the generation budget); required.

    The authors' released code takes a token mean per micro-batch, which weighs a token by the
    inverse of its micro-batch's token count; we normalise by the global batch instead (pass the
    global counts), so the loss does not depend on how the batch was split. When the caller sums
    these shares over micro-batches and data-parallel ranks it gets the global loss; if its gradient
    reduction averages over data-parallel ranks instead of summing, it must scale by their number.
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"aggregate: agg={agg!r} is not one of {AGGREGATIONS}")
    m = _check_mask(loss_tokens, mask, seq_ids)
    masked = torch.where(m, loss_tokens, torch.zeros((), dtype=loss_tokens.dtype, device=loss_tokens.device))
    if agg == "token_mean":
        denom = _as_denominator(global_num_tokens, int(m.sum()), loss_tokens, "global_num_tokens")
        return masked.sum() / denom

    seq_sum, seq_len, _ = sequence_sums(loss_tokens, m, seq_ids)
    n_seq = seq_sum.shape[0]
    seq_denom = _as_denominator(global_num_seqs, n_seq, loss_tokens, "global_num_seqs")
    if agg == "seq_mean_token_sum_norm":
        if constant is None or not float(constant) > 0:
            raise ValueError(
                f"aggregate: agg='seq_mean_token_sum_norm' needs constant > 0 (the fixed length, e.g. "
                f"the maximum response length), got {constant}"
            )
        return masked.sum() / (seq_denom * float(constant))
    # seq_mean_token_mean
    if n_seq == 0:
        return masked.sum() / seq_denom  # zero, with a graph
    return (seq_sum / seq_len).sum() / seq_denom


# --------------------------------------------------------------------------------------------
# Global counts
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LossCounts:
    """The normalisers of the global batch: response tokens and sequences, overall and positive.

    Compute one per micro-batch with ``count_loss_units``, sum them over the micro-batches of the
    optimizer step and all-reduce over data-parallel ranks (``as_tensor``/``from_tensor``), then
    pass the total to ``policy_loss(..., counts=...)`` on every micro-batch.
    """

    num_tokens: float
    num_seqs: float
    num_positive_tokens: float = 0.0
    num_positive_seqs: float = 0.0

    def __add__(self, other: "LossCounts") -> "LossCounts":
        return LossCounts(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple())))

    def as_tuple(self) -> Tuple[float, float, float, float]:
        return (self.num_tokens, self.num_seqs, self.num_positive_tokens, self.num_positive_seqs)

    def as_tensor(self, device=None) -> torch.Tensor:
        return torch.tensor(self.as_tuple(), dtype=torch.float64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "LossCounts":
        return cls(*(float(v) for v in t.tolist()))


def count_loss_units(
    mask: torch.Tensor, seq_ids: Optional[torch.Tensor] = None, positive: Optional[torch.Tensor] = None
) -> LossCounts:
    """Local ``LossCounts`` of one (micro-)batch; ``positive`` is the per-token positive-sample mask."""
    m = mask.bool()
    pos = None if positive is None else m & positive.bool()
    return LossCounts(
        num_tokens=float(m.sum()),
        num_seqs=float(count_sequences(m, seq_ids)),
        num_positive_tokens=0.0 if pos is None else float(pos.sum()),
        num_positive_seqs=0.0 if pos is None else float(count_sequences(pos, seq_ids)),
    )


# --------------------------------------------------------------------------------------------
# The whole loss
# --------------------------------------------------------------------------------------------
def summarize_token_metrics(metrics_tokens: Dict[str, torch.Tensor], mask: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Masked means of the per-token diagnostics (detached 0-d tensors; no host sync).

    ``clip_frac_*`` are fractions of counted tokens; ``ratio_max`` is the largest ratio among them.
    How far the update is off-policy: ``outside_frac`` (tokens whose ratio is outside the rule's
    range, whatever the sign of A), ``log_ratio_abs_mean`` / ``_max``, ``ratio_sq_mean`` (with
    ``ratio_mean``, the importance weights' effective sample size ``mean(r)^2 / mean(r^2)``), and
    ``neg_log_ratio_sum`` over the ``neg_tokens`` of negative advantage (how fast the policy moves off
    the responses it is pushed away from).
    """
    m = mask.bool()
    n = m.sum().clamp_min(1)
    ratio = metrics_tokens["ratio"]
    zero = torch.zeros_like(ratio)
    abs_log_ratio = torch.where(m, metrics_tokens["log_ratio"].abs(), zero)
    negative = m & metrics_tokens["negative"]
    out = {
        "clip_frac_low": (metrics_tokens["clipped_low"] & m).sum() / n,
        "clip_frac_high": (metrics_tokens["clipped_high"] & m).sum() / n,
        "clip_frac_dual": (metrics_tokens["dual_clipped"] & m).sum() / n,
        "ratio_mean": torch.where(m, ratio, torch.zeros_like(ratio)).sum() / n,
        "ratio_max": torch.where(m, ratio, torch.zeros_like(ratio)).max(),  # ratios are > 0
        "approx_kl": torch.where(m, metrics_tokens["approx_kl"], torch.zeros_like(ratio)).sum() / n,
        "num_tokens": m.sum().to(ratio.dtype),
        "outside_frac": (metrics_tokens["outside"] & m).sum() / n,
        "log_ratio_abs_mean": abs_log_ratio.sum() / n,
        "log_ratio_abs_max": abs_log_ratio.max() if abs_log_ratio.numel() else zero.sum(),
        "ratio_sq_mean": torch.where(m, ratio * ratio, zero).sum() / n,
        "neg_log_ratio_sum": torch.where(negative, metrics_tokens["log_ratio"], zero).sum(),
        "neg_tokens": negative.sum().to(ratio.dtype),
    }
    return out


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    algo: str = "gppo",
    eps_low: Optional[float] = None,
    eps_high: Optional[float] = None,
    dual_clip: Optional[float] = DEFAULT_DUAL_CLIP,
    beta1: float = 1.0,
    beta2: float = 1.0,
    agg: str = "token_mean",
    *,
    seq_ids: Optional[torch.Tensor] = None,
    norm_constant: Optional[float] = None,
    counts: Optional[LossCounts] = None,
    positive: Optional[torch.Tensor] = None,
    nll_coef: float = DEFAULT_NLL_COEF,
    rollout_logprobs: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The Klear-Reasoner loss: policy loss + ``nll_coef`` * NLL on positive samples (no KL term: the
    recipe has no reference model, docs/gppo.md).

    Tensors are [batch, tokens] (or packed [1, total] with ``seq_ids``); ``advantages`` is per token
    (already broadcast), ``mask`` is 1 on response tokens. Defaults are the paper's: gppo,
    eps 0.2 / 0.28, dual clip 10, global token mean, alpha = 0.1.

    ``positive`` (per token, like ``advantages``) marks rollouts whose reward is exactly the correct
    score (see ``rl.advantages.correct_samples``); the SFT term is the NLL of their response tokens,
    aggregated with the same ``agg`` but normalised by the positive tokens / sequences (the paper's
    ``1 / sum_{j in positives} T_j``); absent or all-false, it is zero. ``counts`` carries the global
    batch's normalisers (``LossCounts``); by default this batch's own counts are used.
    ``norm_constant`` is the fixed length of ``seq_mean_token_sum_norm``. ``rollout_logprobs``: the
    engine's, DPPO's anchor (without them DPPO anchors on ``old_logprobs``).

    Returns ``(loss, metrics)``: ``loss`` the scalar to minimise (this batch's share of the global
    loss), ``metrics`` detached 0-d tensors: ``pg_loss``, ``nll_loss``, clip fractions
    (low / high / dual), ``ratio_mean``, ``ratio_max``, ``approx_kl``, ``num_tokens``.
    """
    if mask.shape != logprobs.shape:
        raise ValueError(f"policy_loss: mask has shape {tuple(mask.shape)}, expected logprobs' {tuple(logprobs.shape)}")
    if positive is not None and positive.shape != mask.shape:
        raise ValueError(
            f"policy_loss: positive has shape {tuple(positive.shape)}, expected the mask's {tuple(mask.shape)} "
            "(broadcast the per-sequence flag over its tokens)"
        )
    if nll_coef < 0:
        raise ValueError(f"policy_loss: nll_coef={nll_coef} must be >= 0")

    m = mask.bool()
    if counts is None:
        counts = count_loss_units(m, seq_ids, positive)
    agg_kwargs = dict(seq_ids=seq_ids, constant=norm_constant)

    loss_tokens, metrics_tokens = per_token_policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        algo=algo,
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip=dual_clip,
        beta1=beta1,
        beta2=beta2,
        mask=m,
        seq_ids=seq_ids,
        rollout_logprobs=rollout_logprobs,
    )
    pg = aggregate(
        loss_tokens, m, agg, global_num_tokens=counts.num_tokens, global_num_seqs=counts.num_seqs, **agg_kwargs
    )
    total = pg
    zero = pg.new_zeros(())

    nll = zero
    if positive is not None and nll_coef > 0:
        pos_mask = m & positive.bool()
        if counts.num_positive_tokens <= 0 and bool(pos_mask.any()):
            raise ValueError(
                "policy_loss: this batch has positive response tokens but counts.num_positive_tokens is 0; "
                "build counts with count_loss_units(mask, seq_ids, positive)"
            )
        nll_tokens = -logprobs.to(loss_tokens.dtype)
        nll = aggregate(
            nll_tokens,
            pos_mask,
            agg,
            global_num_tokens=max(counts.num_positive_tokens, 1.0),
            global_num_seqs=max(counts.num_positive_seqs, 1.0),
            **agg_kwargs,
        )
        total = total + nll_coef * nll

    metrics = summarize_token_metrics(metrics_tokens, m)
    metrics.update(pg_loss=pg.detach(), nll_loss=nll.detach())
    return total, metrics
