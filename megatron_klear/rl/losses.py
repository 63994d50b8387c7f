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

ALGORITHMS = ("ppo", "clip_higher", "gppo", "cispo")
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
}
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
    for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages)):
        if t.shape != logprobs.shape:
            raise ValueError(
                f"policy loss: {name} has shape {tuple(t.shape)}, expected logprobs' shape {tuple(logprobs.shape)}"
            )

    dtype = torch.float64 if logprobs.dtype == torch.float64 else torch.float32
    logprobs = logprobs.to(dtype)
    old_logprobs = old_logprobs.detach().to(dtype)
    adv = advantages.detach().to(dtype)

    log_ratio = _straight_through_clamp(logprobs - old_logprobs, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    ratio_sg = ratio.detach()
    lower, upper = 1.0 - low, 1.0 + high

    if algo == "cispo":
        # Value -A * clip(r); gradient -clip(r) * A * grad(logp): the weight is a constant.
        grad_one = ratio / ratio_sg  # == 1, d/dlogp == 1
        loss = -adv * ratio_sg.clamp(lower, upper) * grad_one
        clipped_low = ratio_sg < lower
        clipped_high = ratio_sg > upper
        dual_clipped = torch.zeros_like(clipped_low)
    else:
        unclipped = -adv * ratio
        if algo == "gppo":
            # The clip bounds written as bound * r / sg(r): numerically the bound, gradient
            # bound * grad(logp); beta scales only the gradient: bound * (1 + beta * (r/sg(r) - 1)).
            grad_one_minus_one = ratio / ratio_sg - 1.0
            low_bound = lower * (1.0 + beta1 * grad_one_minus_one)
            high_bound = upper * (1.0 + beta2 * grad_one_minus_one)
            clipped_ratio = torch.where(ratio_sg < lower, low_bound, torch.where(ratio_sg > upper, high_bound, ratio))
        else:
            clipped_ratio = ratio.clamp(lower, upper)
        loss = torch.maximum(unclipped, -adv * clipped_ratio)
        clipped_low = (adv < 0) & (ratio_sg < lower)
        clipped_high = (adv > 0) & (ratio_sg > upper)
        if dual_clip is not None:
            negative = adv < 0
            loss = torch.where(negative, torch.minimum(loss, -float(dual_clip) * adv), loss)
            dual_clipped = negative & (ratio_sg > float(dual_clip))
        else:
            dual_clipped = torch.zeros_like(clipped_low)

    log_ratio_sg = log_ratio.detach()
    metrics = {
        "ratio": ratio_sg,
        "clipped_low": clipped_low,
        "clipped_high": clipped_high,
        "dual_clipped": dual_clipped,
        "approx_kl": ratio_sg - 1.0 - log_ratio_sg,
    }
    return loss, metrics


# --------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------
def _sequence_index(mask: torch.Tensor, seq_ids: Optional[torch.Tensor]) -> Tuple[torch.Tensor, int]:
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
    return _sequence_index(mask.bool(), seq_ids)[1]


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

    inverse, n_seq = _sequence_index(m, seq_ids)
    seq_denom = _as_denominator(global_num_seqs, n_seq, loss_tokens, "global_num_seqs")
    if agg == "seq_mean_token_sum_norm":
        if constant is None or not float(constant) > 0:
            raise ValueError(
                f"aggregate: agg='seq_mean_token_sum_norm' needs constant > 0 (the fixed length, e.g. "
                f"the maximum response length), got {constant}"
            )
        return masked.sum() / (seq_denom * float(constant))
    # seq_mean_token_mean
    values = loss_tokens[m]  # row-major, the order of _sequence_index
    if n_seq == 0:
        return masked.sum() / seq_denom  # zero, with a graph
    seq_sum = torch.zeros(n_seq, dtype=loss_tokens.dtype, device=loss_tokens.device).index_add(0, inverse, values)
    seq_len = torch.bincount(inverse, minlength=n_seq).to(loss_tokens.dtype)
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
    """
    m = mask.bool()
    n = m.sum().clamp_min(1)
    ratio = metrics_tokens["ratio"]
    out = {
        "clip_frac_low": (metrics_tokens["clipped_low"] & m).sum() / n,
        "clip_frac_high": (metrics_tokens["clipped_high"] & m).sum() / n,
        "clip_frac_dual": (metrics_tokens["dual_clipped"] & m).sum() / n,
        "ratio_mean": torch.where(m, ratio, torch.zeros_like(ratio)).sum() / n,
        "ratio_max": torch.where(m, ratio, torch.zeros_like(ratio)).max(),  # ratios are > 0
        "approx_kl": torch.where(m, metrics_tokens["approx_kl"], torch.zeros_like(ratio)).sum() / n,
        "num_tokens": m.sum().to(ratio.dtype),
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
    ``norm_constant`` is the fixed length of ``seq_mean_token_sum_norm``.

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
