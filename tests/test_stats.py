"""megatron_klear.utils.stats on inputs whose answers are known by hand or by enumeration."""

import itertools
import math

import numpy as np
import pytest

from megatron_klear.utils.stats import (
    area_under_curve,
    bootstrap_interval,
    paired_comparison,
    sign_flip_p_value,
)


def test_sign_flip_p_value_by_hand():
    # all differences positive, n = 5: only the all-plus and all-minus patterns reach |mean| = 3
    assert sign_flip_p_value([1, 2, 3, 4, 5]) == pytest.approx(2 / 32)
    # a symmetric sample: every pattern's |mean| >= 0, p = 1
    assert sign_flip_p_value([1, -1, 2, -2]) == 1.0
    # [3, 1]: pattern means 2, 1, -1, -2; |mean| >= 2 for two of four: p = 0.5
    assert sign_flip_p_value([3, 1]) == 0.5
    # enumeration of a mixed sample against the function
    d = [0.5, 1.5, -0.25, 2.0, 1.0, 0.75]
    obs = abs(sum(d) / len(d))
    hits = sum(
        abs(sum(s * x for s, x in zip(signs, d)) / len(d)) >= obs - 1e-12
        for signs in itertools.product((1, -1), repeat=len(d))
    )
    assert sign_flip_p_value(d) == pytest.approx(hits / 2 ** len(d))


def test_bootstrap_interval_brackets_the_mean_and_matches_numpy_resampling():
    values = [31.0, 35.5, 29.0, 40.0, 33.5, 36.0, 30.5, 38.0]
    low, high = bootstrap_interval(values, resamples=20000, seed=1)
    mean = sum(values) / len(values)
    assert low < mean < high
    # the same quantity by an independent resampler: the interval ends agree within resampling noise
    rng = np.random.default_rng(0)
    means = rng.choice(values, size=(200000, len(values))).mean(axis=1)
    ref_low, ref_high = np.quantile(means, [0.025, 0.975])
    assert low == pytest.approx(ref_low, abs=0.25) and high == pytest.approx(ref_high, abs=0.25)
    assert bootstrap_interval([4.0]) == (4.0, 4.0)
    assert bootstrap_interval([2.0, 2.0, 2.0]) == (2.0, 2.0)
    with pytest.raises(ValueError, match="no values"):
        bootstrap_interval([])


def test_paired_comparison_pairs_by_index():
    base = [30.0, 20.0, 40.0, 10.0, 25.0]
    better = [b + 3.0 for b in base]  # +3 on every seed: a separated interval, p = 2 / 32
    p = paired_comparison(better, base)
    assert p.mean == pytest.approx(3.0) and p.low == pytest.approx(3.0) and p.high == pytest.approx(3.0)
    assert p.separated and p.p_value == pytest.approx(2 / 32)
    noisy = [b + d for b, d in zip(base, [2.0, -2.0, 1.0, -1.0, 0.0])]
    q = paired_comparison(noisy, base)
    assert q.mean == pytest.approx(0.0) and not q.separated and q.p_value == 1.0
    with pytest.raises(ValueError, match="pair them by seed"):
        paired_comparison([1.0], [1.0, 2.0])


def test_area_under_curve_is_the_mean_height():
    assert area_under_curve([(0, 10.0), (10, 20.0)]) == pytest.approx(15.0)
    # unequal steps: (4 * (0 + 8) / 2 + 16 * (8 + 8) / 2) / 20 = (16 + 128) / 20
    assert area_under_curve([(20, 8.0), (0, 0.0), (4, 8.0)]) == pytest.approx(144 / 20)
    assert math.isclose(area_under_curve([(0, 5.0), (3, 5.0), (9, 5.0)]), 5.0)
    with pytest.raises(ValueError, match="two points"):
        area_under_curve([(0, 1.0)])
