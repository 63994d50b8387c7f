"""Importance corrections between the rollout engine's policy and the trainer's (docs/gppo.md,
"Sequence weights and rejection").

The clipped objective's ratio ``r = pi / pi_old`` is taken against the trainer's recomputed
log-probs (the proximal policy). The tokens were sampled by the engine, whose policy ``pi_behav``
differs by numerics (bf16 kernels, another attention implementation) and, for asynchronous or
partial rollouts, by the weight versions it lagged. Per token, ``rho_t = pi_old / pi_behav =
exp(old_t - rollout_t)``; per sequence ``rho_seq = prod_t rho_t`` and its geometric mean
``rho_geo = exp(mean_t log rho_t)``. Two kinds of correction, combinable:

* a **truncated importance weight** on the advantage (``rl.tis_cap``), at ``rl.is_level``:
  ``token`` (``min(rho_t, cap)``, AReaL's decoupled objective) or ``sequence``
  (``min(rho_seq, cap)`` on every token of the sequence);
* a **rejection mask** (``rl.is_reject``): tokens (``token``) or whole sequences (``sequence``:
  ``rho_seq``; ``geometric``: ``rho_geo``) whose ratio is outside ``[rl.is_reject_low,
  rl.is_reject_high]`` get weight 0 (they stay in the loss's normalisers, as in IcePop).

Kept tokens weigh 1 under a rejection mask alone, and ``min(rho, tis_cap)`` with ``rl.tis_cap``:
with ``tis_cap`` equal to the upper bound, each kept token carries its own ratio. IcePop (Ling team
2025) is that: the token mask with bounds 0.5 and 5 and the ratio as the kept tokens' weight,
``M(rho_t) = rho_t`` on [0.5, 5] (``tis_cap=5``); TRL's ``*_mask`` modes likewise, one-sided unless
their lower bound is set (``is_reject_low=0``). verl's and TRL's presets map as docs/gppo.md lists.
The weights only scale advantages: every clip region of the rule is unchanged (they depend on the
sign of A and on ``r``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from megatron_klear.rl.losses import LOG_RATIO_LIMIT, sequence_sums

IS_LEVELS = ("token", "sequence")
REJECT_MODES = ("token", "sequence", "geometric")


@dataclass(frozen=True)
class Correction:
    """The settings of :func:`rollout_correction` (the ``rl.*`` keys of the same names)."""

    tis_cap: Optional[float] = None
    is_level: str = "token"
    is_reject: Optional[str] = None
    is_reject_low: Optional[float] = None
    is_reject_high: Optional[float] = None

    def validate(self, where: str = "rl") -> None:
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"{where}.tis_cap must be > 0 (or null), got {self.tis_cap}")
        if self.is_level not in IS_LEVELS:
            raise ValueError(f"{where}.is_level must be one of {IS_LEVELS}, got {self.is_level!r}")
        if self.is_level != "token" and self.tis_cap is None:
            # the level says how the weight min(ratio, tis_cap) is taken: without a cap there is none
            raise ValueError(
                f"{where}.is_level={self.is_level} without {where}.tis_cap weights nothing: the level applies to the "
                f"truncated importance weight min(ratio, {where}.tis_cap). Set {where}.tis_cap (verl's sequence-level "
                f"IS: is_level=sequence, tis_cap=2), or for a sequence-level rejection alone {where}.is_reject=sequence"
            )
        if self.is_reject is None:
            return
        if self.is_reject not in REJECT_MODES:
            raise ValueError(f"{where}.is_reject must be one of {REJECT_MODES} (or null), got {self.is_reject!r}")
        low, high = self.reject_bounds()
        if not 0 <= low < 1 < high:
            raise ValueError(f"{where}.is_reject_low={low} and {where}.is_reject_high={high}: need 0 <= low < 1 < high")

    def reject_bounds(self) -> Tuple[float, float]:
        """``[low, high]``; ``high`` is required, ``low`` defaults to ``1 / high``."""
        if self.is_reject_high is None:
            raise ValueError("rl.is_reject is set: rl.is_reject_high (the upper bound of the kept ratios) is required")
        high = float(self.is_reject_high)
        low = 1.0 / high if self.is_reject_low is None else float(self.is_reject_low)
        return low, high

    @property
    def active(self) -> bool:
        return bool(self.tis_cap) or self.is_reject is not None


def rollout_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    correction: Correction,
    seq_ids: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Per-token weights (>= 0, detached) to multiply the advantages by, and detached sums:
    ``weight_sum`` (of the weights on counted tokens) and ``rejected`` (counted tokens given 0 by
    the rejection mask). Tensors are [batch, tokens] or a packed [1, total] with ``seq_ids``."""
    m = mask.bool()
    log_rho = (old_logprobs.detach() - rollout_logprobs.detach()).double().clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    log_rho = torch.where(m, log_rho, torch.zeros_like(log_rho))
    seq_log_rho = seq_mean_log_rho = None
    if correction.is_level == "sequence" or correction.is_reject in ("sequence", "geometric"):
        sums, counts, inverse = sequence_sums(log_rho, m, seq_ids)
        seq_log_rho = torch.zeros_like(log_rho)
        seq_log_rho[m] = sums[inverse]
        seq_mean_log_rho = torch.zeros_like(log_rho)
        seq_mean_log_rho[m] = (sums / counts)[inverse]

    weights = torch.ones_like(log_rho)
    if correction.tis_cap:
        level = seq_log_rho if correction.is_level == "sequence" else log_rho
        # the sequence product can be astronomically large or small: cap in log space
        weights = torch.exp(level.clamp(max=math.log(correction.tis_cap)))
    rejected = torch.zeros_like(m)
    if correction.is_reject is not None:
        low, high = correction.reject_bounds()
        test = {"token": log_rho, "sequence": seq_log_rho, "geometric": seq_mean_log_rho}[correction.is_reject]
        log_low = -math.inf if low == 0 else math.log(low)
        rejected = m & ((test < log_low) | (test > math.log(high)))
        weights = torch.where(rejected, torch.zeros_like(weights), weights)
    weights = torch.where(m, weights, torch.zeros_like(weights))
    sums = {"weight_sum": weights.sum(), "rejected": rejected.sum().double()}
    return weights.to(old_logprobs.dtype), sums
