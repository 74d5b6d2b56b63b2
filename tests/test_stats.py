"""salvage.core.stats on hand-worked numbers (derivations in the comments)."""

from __future__ import annotations

import math

import pytest

from salvage.core.stats import auc, band, ci95, mean_auc, paired, sample_std, t975


def test_t_quantiles_table_and_expansion():
    # standard table values of t_{0.975, df}
    assert t975(1) == pytest.approx(12.7062)
    assert t975(2) == pytest.approx(4.3027)
    assert t975(4) == pytest.approx(2.7764)
    assert t975(30) == pytest.approx(2.0423)
    # beyond the table: the expansion, against the published values 2.0211, 2.0003, 1.9799
    assert t975(40) == pytest.approx(2.0211, abs=1e-4)
    assert t975(60) == pytest.approx(2.0003, abs=1e-4)
    assert t975(120) == pytest.approx(1.9799, abs=1e-4)
    assert t975(10**6) == pytest.approx(1.95996, abs=1e-4)  # -> the normal quantile
    # monotone across the table's edge
    assert t975(29) > t975(30) > t975(31) > t975(32)
    with pytest.raises(ValueError, match="degrees of freedom"):
        t975(0)


def test_ci95_hand_worked():
    # xs = 1..5: mean 3, squared deviations 4+1+0+1+4 = 10, s^2 = 10/4 = 2.5,
    # s.e. = sqrt(2.5/5) = sqrt(0.5) = 0.707107, t_{0.975,4} = 2.7764
    # -> half-width = 2.7764 * 0.707107 = 1.963211
    iv = ci95([1.0, 2.0, 3.0, 4.0, 5.0])
    assert iv.mean == 3.0 and iv.n == 5
    assert sample_std([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(math.sqrt(2.5))
    assert iv.half == pytest.approx(1.963211, abs=1e-6)
    assert (iv.low, iv.high) == pytest.approx((1.036789, 4.963211), abs=1e-6)
    assert iv.fmt(2) == "3.00 ± 1.96"
    # two seeds 0.2, 0.4: mean 0.3, s = sqrt(0.02) = 0.141421, s.e. = 0.1,
    # t_{0.975,1} = 12.7062 -> half-width 1.27062 (two seeds say almost nothing)
    assert ci95([0.2, 0.4]).half == pytest.approx(1.27062, abs=1e-5)
    # one seed: the mean, no interval
    one = ci95([0.7])
    assert one.mean == 0.7 and math.isnan(one.half) and one.fmt() == "0.700"
    # identical values: zero width
    assert ci95([0.5, 0.5, 0.5]).half == 0.0


def test_paired_differences_hand_worked():
    # method - baseline per seed: 0.5-0.4 = 0.1, 0.7-0.5 = 0.2, 0.6-0.6 = 0.0
    # mean 0.1, s^2 = (0 + 0.01 + 0.01)/2 = 0.01, s = 0.1, s.e. = 0.1/sqrt(3) = 0.057735,
    # t_{0.975,2} = 4.3027 -> half-width 0.248417
    p = paired({0: 0.5, 1: 0.7, 2: 0.6}, {0: 0.4, 1: 0.5, 2: 0.6})
    assert p.seeds == (0, 1, 2)
    assert p.diffs == pytest.approx((0.1, 0.2, 0.0))
    assert p.interval.mean == pytest.approx(0.1)
    assert p.interval.half == pytest.approx(0.248417, abs=1e-6)
    assert p.same_seeds
    # the paired interval is narrower than the unpaired one when seeds move together:
    # method = baseline + 0.1 on every seed -> zero-width paired interval
    q = paired({0: 0.3, 1: 0.9, 2: 0.5}, {0: 0.2, 1: 0.8, 2: 0.4})
    assert q.interval.mean == pytest.approx(0.1) and q.interval.half == pytest.approx(0, abs=1e-12)
    # differing seed sets: only the common seeds are paired, the others are reported
    r = paired({0: 1.0, 1: 2.0, 3: 5.0}, {0: 0.0, 1: 0.0, 2: 9.0})
    assert r.seeds == (0, 1) and r.diffs == (1.0, 2.0)
    assert r.only_method == (3,) and r.only_baseline == (2,) and not r.same_seeds


def test_auc_trapezoid_hand_worked():
    # (0,0)-(1,1): 0.5 * 1 * (0 + 1) = 0.5; (1,1)-(3,1): 0.5 * 2 * (1 + 1) = 2 -> 2.5
    assert auc([0.0, 1.0, 3.0], [0.0, 1.0, 1.0]) == pytest.approx(2.5)
    # over the x range 3: time-average 2.5 / 3
    assert mean_auc([0.0, 1.0, 3.0], [0.0, 1.0, 1.0]) == pytest.approx(2.5 / 3)
    assert auc([5.0], [0.3]) == 0.0 and mean_auc([5.0], [0.3]) == 0.3
    assert math.isnan(mean_auc([], []))
    with pytest.raises(ValueError, match="2 x values but 1"):
        auc([0.0, 1.0], [1.0])


def test_band_uses_the_seeds_present_at_each_step():
    # step 0: seeds give 0.0 and 0.2 -> mean 0.1, s = 0.141421, s.e. 0.1, half 1.27062;
    # step 5: only the first seed -> 0.4, no interval
    b = band([{0: 0.0, 5: 0.4}, {0: 0.2}])
    assert [x for x, _ in b] == [0, 5]
    assert b[0][1].mean == pytest.approx(0.1) and b[0][1].half == pytest.approx(1.27062, abs=1e-5)
    assert b[1][1].mean == 0.4 and math.isnan(b[1][1].half)
