"""Stale tokens of asynchronous and partial rollouts: which response tokens were sampled by an older
weight version than the trainer's, and the per-step staleness metrics.

Weight versions count the updates that changed the weights (``Actor.weight_version``;
docs/async.md): the trainer's weights before an update are its proximal policy, of version
``weight_version``. A response token carries the version that sampled it
(``RolloutSample.versions``; SGLang's ``meta_info["weight_versions"]`` spans); its staleness is
``weight_version - version``, and it is *stale* when that is positive.
A sample without versions, or a token whose version is unknown (``None``), counts as on-policy:
synchronous rollouts have no stale token.

How the actor treats stale tokens (docs/gppo.md, "Stale tokens"): with ``rl.tis_cap`` each token's
advantage is weighted by ``min(pi_prox / pi_behav, tis_cap)`` (AReaL's decoupled objective);
with ``rl.mask_stale_tokens`` stale tokens leave the loss and its normalisers (slime's choice).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


def version_array(versions: Sequence, *, where="versions") -> tuple:
    """``versions`` (ints, None where unknown) -> (int64 array with -1 for unknown, bool array of
    the known ones). A non-int entry is an error naming ``where``."""
    if None in versions:
        known = np.array([v is not None for v in versions], dtype=bool)
        values = [0 if v is None else v for v in versions]
    else:
        known, values = None, versions
    arr = np.asarray(values)
    if arr.size and (arr.ndim != 1 or arr.dtype.kind not in "iu"):
        bad = next((v for v in values if isinstance(v, bool) or not isinstance(v, (int, np.integer))), values[0])
        raise ValueError(f"{where}: {bad!r} is not an int weight version (or None)")
    arr = arr.astype(np.int64).reshape(-1)
    if known is None:
        known = np.ones(arr.shape[0], dtype=bool)
    return np.where(known, arr, -1), known


def _ages(index, sample, weight_version: Optional[int]):
    """Per response token of ``sample``: ``weight_version - version`` (0 where unknown), or None
    without versions or without a policy version. Checks the length and that no version is newer
    than the policy's."""
    versions = getattr(sample, "versions", None)
    if versions is None:
        return None
    if len(versions) != len(sample.response_ids):
        raise ValueError(
            f"sample {index}: versions holds {len(versions)} entries for "
            f"{len(sample.response_ids)} response tokens (one weight version per response token)"
        )
    arr, known = version_array(versions, where=f"sample {index}: versions")
    if weight_version is None:
        return None
    newer = known & (arr > weight_version)
    if newer.any():
        j = int(np.argmax(newer))
        raise ValueError(
            f"sample {index}: versions[{j}]={int(arr[j])} is newer than the trainer's policy version "
            f"{weight_version} (weight_version is the version of the weights before this update)"
        )
    return np.where(known, weight_version - arr, 0)


def stale_flags(sample, weight_version: Optional[int], *, index=None) -> np.ndarray:
    """Per response token of ``sample`` (bool array): True where its version is older than
    ``weight_version``. All False without versions, or with ``weight_version`` None. Raises
    ValueError (naming the sample: ``index``) for a versions list of the wrong length, a non-int
    version, or a version newer than the policy's."""
    ages = _ages("?" if index is None else index, sample, weight_version)
    if ages is None:
        return np.zeros(len(sample.response_ids), dtype=bool)
    return ages > 0


def counted_tokens(sample, weight_version: Optional[int], mask_stale: bool, *, index=None) -> int:
    """The response tokens of ``sample`` that enter the loss: all of them, or with ``mask_stale``
    those that are not stale."""
    if not mask_stale:
        return len(sample.response_ids)
    return int((~stale_flags(sample, weight_version, index=index)).sum())


def oldest_version(versions: Optional[Sequence]) -> Optional[int]:
    """The oldest known version in a per-token ``versions`` list (None entries are unknown); None
    when there is none (no versions, an empty response, or every entry unknown). A partial
    response whose oldest token is more than ``rl.max_staleness`` versions behind the policy is
    regenerated from scratch."""
    known = [v for v in (versions or ()) if v is not None]
    return min(known) if known else None


def staleness_metrics(samples: Sequence, weight_version: Optional[int]) -> dict:
    """Staleness of the trained responses of ``samples`` against ``weight_version`` (the version of
    the trainer's weights before this update):

    - per response token: ``rollout/staleness_mean``, ``rollout/staleness_max`` of
      ``weight_version - version`` (0 for tokens without a known version), and
      ``rollout/offpolicy_token_frac``, the fraction of tokens with ``version < weight_version``;
    - per response (trajectory), as the peers log it: ``rollout/response_versions_mean`` / ``_max``,
      how many versions one response spans (newest - oldest + 1 of its known versions; 1 without
      any), and ``rollout/response_staleness_mean`` / ``_max``, the age of its oldest token.

    With ``weight_version`` None (or no response token) the ages are 0.
    """
    total = stale = 0
    age_sum = age_max = 0
    spans, oldest_ages = [], []
    for i, s in enumerate(samples):
        ages = _ages(i, s, weight_version)
        total += len(s.response_ids)
        if not len(s.response_ids):
            continue
        known = [v for v in (getattr(s, "versions", None) or ()) if v is not None]
        spans.append(max(known) - min(known) + 1 if known else 1)
        if ages is None or not ages.size:
            oldest_ages.append(0)
            continue
        stale += int((ages > 0).sum())
        age_sum += int(ages.sum())
        age_max = max(age_max, int(ages.max()))
        oldest_ages.append(int(ages.max()))
    return {
        "rollout/staleness_mean": age_sum / total if total else 0.0,
        "rollout/staleness_max": float(age_max),
        "rollout/offpolicy_token_frac": stale / total if total else 0.0,
        "rollout/response_versions_mean": sum(spans) / len(spans) if spans else 0.0,
        "rollout/response_versions_max": float(max(spans, default=0)),
        "rollout/response_staleness_mean": sum(oldest_ages) / len(oldest_ages) if oldest_ages else 0.0,
        "rollout/response_staleness_max": float(max(oldest_ages, default=0)),
    }
