"""Policy-gradient losses of the Klear-Reasoner recipe (GPPO and the baselines it is compared with).

Plain torch: nothing here knows about Megatron, packing or data parallelism. The actor calls the
building blocks on each packed micro-batch and passes the counts of the whole global batch, so that
the sum of the micro-batch losses equals the loss of the full batch exactly.

The policy losses are one table, ``POLICY_LOSSES`` (``rl.algo`` -> :class:`PolicyLossSpec`): each
entry holds the loss's name, its default (eps_low, eps_high), its per-token function and what else
it declares (a symmetric clip, whether it reads the engine's log-probs, whether its ratio is over
whole sequences). :func:`register_loss` adds one; the config's validation and the actor read the
table, so a new loss is its function, its entry and its tests (docs/gppo.md, "Adding a loss").
Every loss has the same signature: a :class:`LossBatch` of tensors and the :class:`LossSettings`.

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
gspo          the sequence's geometric-mean ratio ``s``, or 0 where ``s`` is clipped
dppo_tv/_kl   ``min(pi/mu, 20)``, or 0 where the update leaves the divergence region
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

from dataclasses import dataclass, replace
from typing import Callable, Dict, NamedTuple, Optional, Tuple, Union

import torch

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")

# DPPO's importance ratio pi / pi_rollout is truncated at this value (detached), as verl's clip_ratio_c.
DPPO_RATIO_CAP = 20.0
DEFAULT_DUAL_CLIP = 10.0
DEFAULT_NLL_COEF = 0.1
LOG_RATIO_LIMIT = 20.0

Number = Union[int, float, torch.Tensor]


# --------------------------------------------------------------------------------------------
# What a loss is given
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LossBatch:
    """The tensors of one (micro-)batch, all of ``logprobs``' shape: [batch, tokens], or a packed
    [1, total] with ``seq_ids``. Positions the mask leaves out may hold anything finite.

    ``logprobs`` are the current policy's (with a graph); ``old_logprobs`` the proximal policy's
    (the denominator of ``r``); ``advantages`` per token (each sequence's, broadcast); ``mask`` 1 on
    the tokens that count (required by :func:`policy_loss` and by a sequence-level loss);
    ``seq_ids`` tell packed sequences apart; ``positive`` marks the tokens of solved rollouts (the
    NLL term); ``rollout_logprobs`` are the engine's, read by a loss that declares
    ``uses_rollout_logprobs`` (DPPO's anchor; without them it anchors on ``old_logprobs``).
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: Optional[torch.Tensor] = None
    seq_ids: Optional[torch.Tensor] = None
    positive: Optional[torch.Tensor] = None
    rollout_logprobs: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class LossSettings:
    """The settings of the loss: the ``rl.*`` keys of the same names (``RLConfig.loss_settings``).
    The defaults are the paper's: gppo, the loss's own eps (gppo: 0.2 / 0.28), dual clip 10, global
    token mean, alpha = 0.1.

    ``eps_low`` / ``eps_high``: None takes the loss's default (its table entry). ``dual_clip``: c > 1,
    or None to disable; used by ppo, clip_higher and gppo. ``beta1`` / ``beta2``: gppo's gradient
    scales. ``agg`` / ``norm_constant``: the reduction (:func:`aggregate`). ``nll_coef``: the weight
    of the NLL term on positive samples.
    """

    algo: str = "gppo"
    eps_low: Optional[float] = None
    eps_high: Optional[float] = None
    dual_clip: Optional[float] = DEFAULT_DUAL_CLIP
    beta1: float = 1.0
    beta2: float = 1.0
    agg: str = "token_mean"
    norm_constant: Optional[float] = None
    nll_coef: float = DEFAULT_NLL_COEF

    def clip_range(self, prefix: str = "") -> Tuple[float, float]:
        """The (eps_low, eps_high) the loss uses, after its defaults and checks. ``prefix`` is put
        before the keys the errors name (the config passes ``"rl."``)."""
        spec = loss_spec(self.algo)
        default_low, default_high = spec.eps
        if spec.symmetric:
            given = {float(v) for v in (self.eps_low, self.eps_high) if v is not None}
            if len(given) > 1:
                raise ValueError(
                    f"policy loss: {prefix}algo={self.algo!r} clips symmetrically but {prefix}eps_low={self.eps_low} "
                    f"!= {prefix}eps_high={self.eps_high}; use {prefix}algo='clip_higher' for an asymmetric clip"
                )
            low = high = given.pop() if given else default_low
        else:
            low = default_low if self.eps_low is None else float(self.eps_low)
            high = default_high if self.eps_high is None else float(self.eps_high)
        if not 0.0 <= low <= 1.0:
            raise ValueError(f"policy loss: {prefix}eps_low={low} must be in [0, 1] (the lower bound is 1 - eps_low)")
        if high < 0.0:
            raise ValueError(f"policy loss: {prefix}eps_high={high} must be >= 0")
        return low, high

    def resolved(self, prefix: str = "") -> "LossSettings":
        """These settings checked, with ``eps_low`` / ``eps_high`` filled in (:meth:`clip_range`)
        and ``dual_clip`` a float (or None)."""
        low, high = self.clip_range(prefix)
        if self.dual_clip is not None and not float(self.dual_clip) > 1.0:
            raise ValueError(
                f"policy loss: {prefix}dual_clip={self.dual_clip} must be > 1 (or None to disable); with c <= 1 "
                "every negative-advantage token with r > c gets zero gradient (the authors' c=1 bug)"
            )
        if self.beta1 < 0 or self.beta2 < 0:
            raise ValueError(f"policy loss: {prefix}beta1={self.beta1} and {prefix}beta2={self.beta2} must be >= 0")
        dual_clip = None if self.dual_clip is None else float(self.dual_clip)
        return replace(self, eps_low=low, eps_high=high, dual_clip=dual_clip)


@dataclass(frozen=True)
class Tokens:
    """What a per-token loss sees: the batch with its log-probs upcast (float32, float64 kept; the
    old and rollout log-probs and the advantages detached), the resolved settings (eps filled in),
    the ratio ``r`` (its log clamped to [-20, 20] in value only) with its graph and without,
    the clamped log-ratio (detached) and the clip range ``[lower, upper] = [1 - eps_low, 1 + eps_high]``."""

    batch: LossBatch
    settings: LossSettings
    ratio: torch.Tensor
    ratio_sg: torch.Tensor
    log_ratio_sg: torch.Tensor
    lower: float
    upper: float

    @property
    def adv(self) -> torch.Tensor:
        return self.batch.advantages

    def grad_one(self) -> torch.Tensor:
        """``r / sg(r)``: 1 in value, ``grad(logp)`` in gradient."""
        return self.ratio / self.ratio_sg

    def no_flags(self) -> torch.Tensor:
        return torch.zeros_like(self.ratio_sg, dtype=torch.bool)


class TokenLoss(NamedTuple):
    """What a per-token loss returns: the loss of every token (to be minimised, with a graph) and
    the bool flags of where its factor F was replaced by a bound or zero (the ``clip_frac_*``
    metrics): below the range, above it, and by the dual clip."""

    loss: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    dual_clipped: torch.Tensor


# --------------------------------------------------------------------------------------------
# The table of policy losses
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PolicyLossSpec:
    """One policy loss, as ``rl.algo`` names it.

    ``eps``: the (eps_low, eps_high) used where ``rl.eps_low`` / ``rl.eps_high`` are null.
    ``per_token``: the loss itself, :class:`Tokens` -> :class:`TokenLoss`. ``symmetric``: one eps
    clips both sides (eps_low and eps_high, where both are given, must be equal).
    ``uses_rollout_logprobs``: it reads ``batch.rollout_logprobs`` (the actor passes the engine's
    log-probs only to such a loss). ``sequence_level``: its ratio is over whole sequences, so it
    needs the mask and every token of a sequence on one rank (``parallel.cp > 1`` is refused).
    """

    name: str
    eps: Tuple[float, float]
    per_token: Callable[[Tokens], TokenLoss]
    symmetric: bool = False
    uses_rollout_logprobs: bool = False
    sequence_level: bool = False


POLICY_LOSSES: Dict[str, PolicyLossSpec] = {}


def register_loss(spec: PolicyLossSpec) -> PolicyLossSpec:
    """Add ``spec`` to the table: ``rl.algo=<spec.name>`` is accepted and trains with it."""
    if spec.name in POLICY_LOSSES:
        raise ValueError(f"policy loss: {spec.name!r} is already registered")
    if len(spec.eps) != 2:
        raise ValueError(f"policy loss {spec.name!r}: eps={spec.eps} must be (eps_low, eps_high)")
    POLICY_LOSSES[spec.name] = spec
    return spec


def unregister_loss(name: str) -> PolicyLossSpec:
    """Take ``name`` out of the table (tests that register a loss of their own)."""
    return POLICY_LOSSES.pop(name)


def loss_names() -> Tuple[str, ...]:
    """The registered ``rl.algo`` values, in the order they were registered."""
    return tuple(POLICY_LOSSES)


def loss_spec(name: str) -> PolicyLossSpec:
    """The table's entry for ``rl.algo=name``."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"policy loss: algo={name!r} is not one of {loss_names()}")
    return POLICY_LOSSES[name]


# --------------------------------------------------------------------------------------------
# Per-token losses
# --------------------------------------------------------------------------------------------
def _straight_through_clamp(x: torch.Tensor, limit: float) -> torch.Tensor:
    """``clamp(x, -limit, limit)`` in value, identity in gradient."""
    return x + (x.clamp(-limit, limit) - x).detach()


def _pessimistic_clip(t: Tokens, clipped_ratio: torch.Tensor) -> TokenLoss:
    """PPO's ``max(-A r, -A clipped_ratio)`` and the dual clip; the flags of the clip regions."""
    loss = torch.maximum(-t.adv * t.ratio, -t.adv * clipped_ratio)
    clipped_low = (t.adv < 0) & (t.ratio_sg < t.lower)
    clipped_high = (t.adv > 0) & (t.ratio_sg > t.upper)
    dual_clipped = t.no_flags()
    dual_clip = t.settings.dual_clip
    if dual_clip is not None:
        negative = t.adv < 0
        loss = torch.where(negative, torch.minimum(loss, -dual_clip * t.adv), loss)
        dual_clipped = negative & (t.ratio_sg > dual_clip)
    return TokenLoss(loss, clipped_low, clipped_high, dual_clipped)


def _clip_rule(t: Tokens) -> TokenLoss:
    """ppo / clip_higher: the clipped ratio has no gradient outside [lower, upper]."""
    return _pessimistic_clip(t, t.ratio.clamp(t.lower, t.upper))


def _gppo_rule(t: Tokens) -> TokenLoss:
    """GPPO: the clip bounds written as ``bound * r / sg(r)`` (numerically the bound, gradient
    ``bound * grad(logp)``); beta scales only the gradient: ``bound * (1 + beta * (r / sg(r) - 1))``."""
    grad_one_minus_one = t.grad_one() - 1.0
    low_bound = t.lower * (1.0 + t.settings.beta1 * grad_one_minus_one)
    high_bound = t.upper * (1.0 + t.settings.beta2 * grad_one_minus_one)
    clipped = torch.where(t.ratio_sg < t.lower, low_bound, torch.where(t.ratio_sg > t.upper, high_bound, t.ratio))
    return _pessimistic_clip(t, clipped)


def _cispo_rule(t: Tokens) -> TokenLoss:
    """CISPO: value ``-A * clip(r)``, gradient ``-clip(r) * A * grad(logp)`` (a constant weight)."""
    loss = -t.adv * t.ratio_sg.clamp(t.lower, t.upper) * t.grad_one()
    return TokenLoss(loss, t.ratio_sg < t.lower, t.ratio_sg > t.upper, t.no_flags())


def _gspo_rule(t: Tokens) -> TokenLoss:
    """GSPO (Zheng et al. 2025), in its token form: the sequence ratio ``s = exp(mean_t log r_t)``
    over the sequence's counted tokens, ``s_t = sg(s) * r_t / sg(r_t)`` (value s, gradient
    ``s * grad(logp_t)``), clipped as PPO clips a ratio: the whole sequence is in or out."""
    m = t.batch.mask.bool()
    log_r = torch.log(t.ratio_sg)  # the clamped log-ratio
    seq_sum, seq_len, inverse = sequence_sums(log_r, m, t.batch.seq_ids)
    seq_ratio = torch.ones_like(log_r)
    seq_ratio[m] = torch.exp(seq_sum / seq_len)[inverse]
    s_t = seq_ratio * t.grad_one()
    loss = torch.maximum(-t.adv * s_t, -t.adv * s_t.clamp(t.lower, t.upper))
    return TokenLoss(loss, (t.adv < 0) & (seq_ratio < t.lower), (t.adv > 0) & (seq_ratio > t.upper), t.no_flags())


def _dppo_rule(t: Tokens, kind: str) -> TokenLoss:
    """DPPO (Qi et al. 2026, arXiv 2602.04879; verl's ``dppo_tv`` / ``dppo_kl``): an importance-
    weighted policy gradient against the rollout policy ``mu``, ``-A * sg(min(pi / mu, cap)) *
    grad(logp)``, masked where the update would leave a divergence trust region around ``mu``: with
    ``p = pi(token)`` and ``q = mu(token)``, a positive-advantage token is masked when ``p - q >
    eps_high`` (TV) or when ``p > q`` and the binary KL(q || p) > eps_high (KL); a negative one when
    ``q - p > eps_low`` (TV) or ``p < q`` and the binary KL > eps_low. The value is the surrogate
    ``-A * min(r, cap)`` on kept tokens. ``mu`` is the batch's rollout log-probs, else the old ones."""
    logprobs = t.batch.logprobs
    anchor = t.batch.old_logprobs if t.batch.rollout_logprobs is None else t.batch.rollout_logprobs
    log_r = _straight_through_clamp(logprobs - anchor, LOG_RATIO_LIMIT)
    r = torch.exp(log_r)
    r_sg = r.detach()
    p, q = torch.exp(logprobs.detach()), torch.exp(anchor)
    low, high = 1.0 - t.lower, t.upper - 1.0
    if kind == "tv":
        keep_pos, keep_neg = (p - q) <= high, (p - q) >= -low
    else:
        tiny = 1e-8
        binary_kl = q * (anchor - logprobs.detach()) + (1 - q) * torch.log((1 - q + tiny) / (1 - p + tiny))
        keep_pos, keep_neg = (binary_kl <= high) | (p <= q), (binary_kl <= low) | (p >= q)
    keep = torch.where(t.adv > 0, keep_pos, keep_neg)
    loss = torch.where(keep, -t.adv * r_sg.clamp(max=DPPO_RATIO_CAP) * (r / r_sg), torch.zeros_like(r))
    return TokenLoss(loss, (t.adv < 0) & ~keep, (t.adv > 0) & ~keep, t.no_flags())


def _dppo_tv_rule(t: Tokens) -> TokenLoss:
    """DPPO with the total-variation region (:func:`_dppo_rule`)."""
    return _dppo_rule(t, "tv")


def _dppo_kl_rule(t: Tokens) -> TokenLoss:
    """DPPO with the binary-KL region (:func:`_dppo_rule`)."""
    return _dppo_rule(t, "kl")


# The table. eps: ppo, the classic symmetric 0.2; clip_higher / gppo, the paper's 0.2 / 0.28.
# cispo: MiniMax-M1 puts no lower bound on the importance weight ("eps_low large"; 1.0 makes the
# lower bound 0, which r never goes below) and tuned eps_high without publishing it; we take the
# paper's 0.28 so that cispo and gppo are compared with the same upper bound. gspo: the paper's
# sequence-ratio bounds (Zheng et al. 2025, Qwen3 RL), 3e-4 / 4e-4. dppo: eps are the divergence
# thresholds delta (verl's DPPO example: TV 0.15, binary KL 0.05).
for _spec in (
    PolicyLossSpec("ppo", (0.2, 0.2), _clip_rule, symmetric=True),
    PolicyLossSpec("clip_higher", (0.2, 0.28), _clip_rule),
    PolicyLossSpec("gppo", (0.2, 0.28), _gppo_rule),
    PolicyLossSpec("cispo", (1.0, 0.28), _cispo_rule),
    PolicyLossSpec("gspo", (3e-4, 4e-4), _gspo_rule, sequence_level=True),
    PolicyLossSpec("dppo_tv", (0.15, 0.15), _dppo_tv_rule, uses_rollout_logprobs=True),
    PolicyLossSpec("dppo_kl", (0.05, 0.05), _dppo_kl_rule, uses_rollout_logprobs=True),
):
    register_loss(_spec)


def _check_shapes(batch: LossBatch) -> None:
    shape = batch.logprobs.shape
    for name in ("old_logprobs", "advantages", "mask", "rollout_logprobs"):
        t = getattr(batch, name)
        if t is not None and t.shape != shape:
            raise ValueError(f"policy loss: {name} has shape {tuple(t.shape)}, expected logprobs' shape {tuple(shape)}")


def _tokens(batch: LossBatch, settings: LossSettings) -> Tokens:
    """The :class:`Tokens` of ``batch`` under resolved ``settings``."""
    dtype = torch.float64 if batch.logprobs.dtype == torch.float64 else torch.float32
    logprobs = batch.logprobs.to(dtype)
    old_logprobs = batch.old_logprobs.detach().to(dtype)
    rollout = batch.rollout_logprobs
    upcast = replace(
        batch,
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=batch.advantages.detach().to(dtype),
        rollout_logprobs=None if rollout is None else rollout.detach().to(dtype),
    )
    log_ratio = _straight_through_clamp(logprobs - old_logprobs, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    lower, upper = 1.0 - settings.eps_low, 1.0 + settings.eps_high
    return Tokens(upcast, settings, ratio, ratio.detach(), log_ratio.detach(), lower, upper)


def per_token_policy_loss(
    batch: LossBatch, settings: Optional[LossSettings] = None
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Per-token policy loss (to be minimised) of ``settings.algo`` (the table's entry) and per-token
    diagnostics. ``batch``'s tensors have any one shape; ``mask`` is needed by a sequence-level loss
    only, ``positive`` is not read. ``settings``: by default ``LossSettings()``.

    Returns ``(loss_tokens, metrics_tokens)``; ``metrics_tokens`` holds detached per-token tensors:
    ``ratio``, ``clipped_low``, ``clipped_high``, ``dual_clipped`` (bool: where F was replaced by a
    bound or zero), ``approx_kl`` (``(r - 1) - log r``, the k3 estimate of KL(old || new)),
    ``log_ratio``, ``outside`` (r outside the clip range) and ``negative`` (A < 0).
    """
    settings = (settings or LossSettings()).resolved()
    spec = loss_spec(settings.algo)
    _check_shapes(batch)
    if spec.sequence_level and batch.mask is None:
        raise ValueError(f"policy loss: algo={spec.name!r} needs the response mask (its ratio is over whole sequences)")
    t = _tokens(batch, settings)
    out = spec.per_token(t)
    ratio_sg = t.ratio_sg
    metrics = {
        "ratio": ratio_sg,
        "clipped_low": out.clipped_low,
        "clipped_high": out.clipped_high,
        "dual_clipped": out.dual_clipped,
        "approx_kl": ratio_sg - 1.0 - t.log_ratio_sg,
        "log_ratio": t.log_ratio_sg,
        "outside": (ratio_sg < t.lower) | (ratio_sg > t.upper),
        "negative": t.adv < 0,
    }
    return out.loss, metrics


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
    batch: LossBatch, settings: Optional[LossSettings] = None, *, counts: Optional[LossCounts] = None
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The Klear-Reasoner loss: policy loss + ``nll_coef`` * NLL on positive samples (no KL term: the
    recipe has no reference model, docs/gppo.md).

    ``batch`` (:class:`LossBatch`) needs its ``mask`` (1 on response tokens); ``settings``: by default
    ``LossSettings()``, the paper's (gppo, eps 0.2 / 0.28, dual clip 10, global token mean, alpha = 0.1).

    ``batch.positive`` (per token, like ``advantages``) marks rollouts whose reward is exactly the
    correct score (see ``rl.advantages.correct_samples``); the SFT term is the NLL of their response
    tokens, aggregated with the same ``agg`` but normalised by the positive tokens / sequences (the
    paper's ``1 / sum_{j in positives} T_j``); absent or all-false, it is zero. ``counts`` carries the
    global batch's normalisers (``LossCounts``); by default this batch's own counts are used.

    Returns ``(loss, metrics)``: ``loss`` the scalar to minimise (this batch's share of the global
    loss), ``metrics`` detached 0-d tensors: ``pg_loss``, ``nll_loss`` and those of
    :func:`summarize_token_metrics`.
    """
    settings = settings or LossSettings()
    logprobs, mask, positive, seq_ids = batch.logprobs, batch.mask, batch.positive, batch.seq_ids
    if mask is None or mask.shape != logprobs.shape:
        got = None if mask is None else tuple(mask.shape)
        raise ValueError(f"policy_loss: mask has shape {got}, expected logprobs' {tuple(logprobs.shape)}")
    if positive is not None and positive.shape != mask.shape:
        raise ValueError(
            f"policy_loss: positive has shape {tuple(positive.shape)}, expected the mask's {tuple(mask.shape)} "
            "(broadcast the per-sequence flag over its tokens)"
        )
    if settings.nll_coef < 0:
        raise ValueError(f"policy_loss: nll_coef={settings.nll_coef} must be >= 0")

    m = mask.bool()
    if counts is None:
        counts = count_loss_units(m, seq_ids, positive)
    agg, agg_kwargs = settings.agg, dict(seq_ids=seq_ids, constant=settings.norm_constant)

    loss_tokens, metrics_tokens = per_token_policy_loss(replace(batch, mask=m), settings)
    pg = aggregate(
        loss_tokens, m, agg, global_num_tokens=counts.num_tokens, global_num_seqs=counts.num_seqs, **agg_kwargs
    )
    total = pg
    zero = pg.new_zeros(())

    nll = zero
    if positive is not None and settings.nll_coef > 0:
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
        total = total + settings.nll_coef * nll

    metrics = summarize_token_metrics(metrics_tokens, m)
    metrics.update(pg_loss=pg.detach(), nll_loss=nll.detach())
    return total, metrics
