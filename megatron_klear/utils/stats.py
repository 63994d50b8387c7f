"""Small-sample statistics for comparing runs across seeds (benchmarks/algos.py, docs/gppo.md).

With 5-10 seeds per variant nothing here assumes normality:

* :func:`bootstrap_interval`: the percentile bootstrap interval of a mean (resampling the seeds);
* :func:`paired_comparison`: a variant against a baseline run with the same seeds (same prompt
  order, sampling and evaluation sampling): the mean of the per-seed differences, its bootstrap
  interval, and the exact two-sided sign-flip permutation p-value (every one of the ``2**n`` sign
  patterns for n <= 16 seeds, a seeded Monte Carlo sample beyond);
* :func:`area_under_curve`: the trapezoid area under an evaluation curve divided by its step span
  (the curve's mean height: a variant that learns sooner scores higher at the same final value).

Everything is deterministic for a given ``seed``.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Sequence, Tuple


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def bootstrap_interval(
    values: Sequence[float], level: float = 0.95, resamples: int = 10000, seed: int = 0
) -> Tuple[float, float]:
    """The percentile bootstrap interval of the mean of ``values``."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("bootstrap_interval: no values")
    if not 0 < level < 1:
        raise ValueError(f"bootstrap_interval: level={level} must be in (0, 1)")
    if len(values) == 1:
        return values[0], values[0]
    rng = random.Random(seed)
    n = len(values)
    means = sorted(_mean([values[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    tail = (1.0 - level) / 2
    return _quantile(means, tail), _quantile(means, 1.0 - tail)


def sign_flip_p_value(differences: Sequence[float], exact_up_to: int = 16, samples: int = 20000, seed: int = 0):
    """Two-sided p-value of "the mean difference is 0" by flipping the signs of the paired
    differences: the share of sign patterns whose |mean| is at least the observed one."""
    d = [float(x) for x in differences]
    if not d:
        raise ValueError("sign_flip_p_value: no differences")
    observed = abs(_mean(d)) - 1e-12
    if len(d) <= exact_up_to:
        patterns = itertools.product((1.0, -1.0), repeat=len(d))
        hits = total = 0
        for signs in patterns:
            total += 1
            hits += abs(_mean([s * x for s, x in zip(signs, d)])) >= observed
        return hits / total
    rng = random.Random(seed)
    hits = sum(abs(_mean([x if rng.random() < 0.5 else -x for x in d])) >= observed for _ in range(samples))
    return (hits + 1) / (samples + 1)


@dataclass(frozen=True)
class Paired:
    """A variant against the baseline, seed by seed: ``variant - baseline``."""

    n: int
    mean: float
    low: float
    high: float
    p_value: float

    @property
    def separated(self) -> bool:
        """The interval excludes 0."""
        return self.low > 0 or self.high < 0


def paired_comparison(variant: Sequence[float], baseline: Sequence[float], level: float = 0.95, seed: int = 0):
    """:class:`Paired` of two equal-length lists, index i of both from the same seed."""
    if len(variant) != len(baseline):
        raise ValueError(f"paired_comparison: {len(variant)} values against {len(baseline)} (pair them by seed)")
    d = [float(a) - float(b) for a, b in zip(variant, baseline)]
    low, high = bootstrap_interval(d, level=level, seed=seed)
    return Paired(n=len(d), mean=_mean(d), low=low, high=high, p_value=sign_flip_p_value(d, seed=seed))


def area_under_curve(points: Sequence[Tuple[float, float]]) -> float:
    """Trapezoid area under ``[(step, value), ...]`` divided by the step span (the mean height)."""
    pts = sorted((float(x), float(y)) for x, y in points)
    if len(pts) < 2:
        raise ValueError("area_under_curve: needs at least two points")
    span = pts[-1][0] - pts[0][0]
    if span <= 0:
        raise ValueError("area_under_curve: the steps span no interval")
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(pts, pts[1:]))
    return area / span
