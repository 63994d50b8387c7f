"""Group-relative advantages and the sample filters of the Klear-Reasoner recipe.

One reward per response; responses to the same prompt form a group (``group_ids``). The functions
take and return per-response tensors; broadcasting over tokens is the packer's job.

- ``group_advantages``: GRPO's ``(R - mean_g) / (std_g + 1e-6)`` with the unbiased std, or Dr.GRPO's
  ``R - mean_g`` (``normalize_by_std=False``).
- ``nonzero_spread_mask``: drop groups whose rewards are all equal (their advantages are all zero,
  they only dilute the token normaliser). The authors over-sample prompts (256 x 8), filter, and
  keep 128 x 8 without re-generating; choosing which kept groups to use is the loop's business.
- ``overlong_keep_mask``: the overlong filter (drop responses that did not end with EOS), optional.
- ``correct_samples``: responses whose reward is exactly the correct score (the SFT term's samples).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

ADVANTAGE_EPS = 1e-6

# SGLang / OpenAI finish reasons: "stop" is a stop token (EOS) or stop string; "length" hit the budget.
FINISH_REASON_ENDED = {"stop": True, "eos": True, "length": False, "abort": False}


def _group_index(
    rewards: torch.Tensor, group_ids: Optional[Union[torch.Tensor, Sequence[int]]], group_size: Optional[int]
) -> Tuple[torch.Tensor, int]:
    if rewards.dim() != 1:
        raise ValueError(f"advantages: rewards must be 1-D (one per response), got shape {tuple(rewards.shape)}")
    n = rewards.shape[0]
    if (group_ids is None) == (group_size is None):
        raise ValueError("advantages: pass exactly one of group_ids (per response) and group_size (consecutive groups)")
    if group_size is not None:
        if group_size < 1 or n % group_size:
            raise ValueError(f"advantages: group_size={group_size} does not divide the {n} rewards")
        return torch.arange(n, device=rewards.device) // group_size, n // group_size
    ids = torch.as_tensor(group_ids, device=rewards.device)
    if ids.shape != rewards.shape:
        raise ValueError(
            f"advantages: group_ids has shape {tuple(ids.shape)}, expected the rewards' {tuple(rewards.shape)}"
        )
    uniq, inverse = torch.unique(ids, return_inverse=True)
    return inverse, int(uniq.shape[0])


def _group_stats(rewards: torch.Tensor, inverse: torch.Tensor, num_groups: int):
    r = rewards.to(torch.float64)
    count = torch.bincount(inverse, minlength=num_groups).to(torch.float64)
    mean = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add(0, inverse, r) / count
    sq = torch.zeros_like(mean).index_add(0, inverse, (r - mean[inverse]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp_min(1.0))  # unbiased (n - 1), as torch.std
    return r, count, mean, std


def group_advantages(
    rewards: torch.Tensor,
    group_ids: Optional[Union[torch.Tensor, Sequence[int]]] = None,
    *,
    group_size: Optional[int] = None,
    normalize_by_std: bool = True,
    eps: float = ADVANTAGE_EPS,
) -> torch.Tensor:
    """Per-response advantage ``(R - mean) / (std + eps)`` within each group (float32).

    Groups are given by ``group_ids`` (any integer label per response) or ``group_size`` (consecutive
    blocks). The std is the unbiased one (divides by n - 1), as in the paper and verl's GRPO.
    ``normalize_by_std=False`` gives Dr.GRPO's ``R - mean``. A group of one response has no baseline:
    its advantage is 0 (verl instead passes the raw reward through).
    """
    inverse, num_groups = _group_index(rewards, group_ids, group_size)
    r, count, mean, std = _group_stats(rewards, inverse, num_groups)
    adv = r - mean[inverse]
    if normalize_by_std:
        adv = adv / (std[inverse] + eps)
    adv = torch.where(count[inverse] > 1, adv, torch.zeros_like(adv))
    return adv.to(torch.float32)


def nonzero_spread_mask(
    rewards: torch.Tensor,
    group_ids: Optional[Union[torch.Tensor, Sequence[int]]] = None,
    *,
    group_size: Optional[int] = None,
    tol: float = 0.0,
) -> torch.Tensor:
    """Bool per response: True where its group's rewards are not all equal (max - min > tol)."""
    inverse, num_groups = _group_index(rewards, group_ids, group_size)
    r = rewards.to(torch.float64)
    hi = torch.full((num_groups,), float("-inf"), dtype=torch.float64, device=r.device).scatter_reduce(
        0, inverse, r, reduce="amax"
    )
    lo = torch.full((num_groups,), float("inf"), dtype=torch.float64, device=r.device).scatter_reduce(
        0, inverse, r, reduce="amin"
    )
    return (hi - lo > tol)[inverse]


def overlong_keep_mask(
    ended: Union[torch.Tensor, Sequence[str], Sequence[bool]], *, enabled: bool = True
) -> torch.Tensor:
    """Bool per response: False for a response that did not end with EOS, when the filter is enabled.

    ``ended`` is a bool per response (True = ended with EOS) or the engine's finish reasons
    (``"stop"``/``"eos"`` ended, ``"length"``/``"abort"`` did not). Disabled, everything is kept.
    A dropped response stays in its group for the advantage; the caller zeroes its loss mask (DAPO's
    "overlong filtering"), so it adds neither gradient nor tokens to the normaliser.
    """
    if isinstance(ended, torch.Tensor):
        flags = ended.bool()
    else:
        values = list(ended)
        out = []
        for i, v in enumerate(values):
            if isinstance(v, str):
                if v not in FINISH_REASON_ENDED:
                    raise ValueError(
                        f"overlong filter: finish reason {v!r} of response {i} is not one of "
                        f"{sorted(FINISH_REASON_ENDED)}"
                    )
                out.append(FINISH_REASON_ENDED[v])
            else:
                out.append(bool(v))
        flags = torch.tensor(out, dtype=torch.bool)
    return flags if enabled else torch.ones_like(flags)


def correct_samples(rewards: torch.Tensor, correct_score: float = 1.0, *, atol: float = 1e-6) -> torch.Tensor:
    """Bool per response: the reward equals the correct score (math: correct answer; code: all tests).

    With the soft code reward (fraction of tests passed) only 1.0 counts; ``atol`` absorbs float
    round-off of that fraction, not partial credit.
    """
    return (rewards.to(torch.float64) - float(correct_score)).abs() <= atol
