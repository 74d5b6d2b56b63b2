"""salvage.core.stats on hand-worked numbers (derivations in the comments)."""

from __future__ import annotations

import math

import pytest

from salvage.core.stats import (
    auc,
    band,
    betainc,
    ci95,
    mdd,
    mean_auc,
    paired,
    paired_sd,
    sample_std,
    seeds_needed,
    t975,
    t_cdf,
    t_quantile,
)


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


def test_incomplete_beta_and_t_quantiles_by_hand():
    # I_x(a, b) for integer a, b is a binomial tail: I_0.4(2, 3) = P(Bin(4, 0.4) >= 2)
    # = 6 * 0.4^2 * 0.6^2 + 4 * 0.4^3 * 0.6 + 0.4^4 = 0.3456 + 0.1536 + 0.0256 = 0.5248
    assert betainc(2, 3, 0.4) == pytest.approx(0.5248, abs=1e-12)
    assert betainc(1, 1, 0.3) == pytest.approx(0.3, abs=1e-12)  # uniform
    assert betainc(2, 3, 0.0) == 0.0 and betainc(2, 3, 1.0) == 1.0
    # df = 1 is Cauchy: F(t) = 1/2 + atan(t) / pi, t_p = tan(pi (p - 1/2))
    assert t_cdf(1.0, 1) == pytest.approx(0.75, abs=1e-12)
    assert t_quantile(0.8, 1) == pytest.approx(math.tan(0.3 * math.pi), abs=1e-9)  # 1.3764
    # df = 2 in closed form: t_p = (2p - 1) / sqrt(2 p (1 - p)); p = 0.8: 0.6 / sqrt(0.32)
    assert t_quantile(0.8, 2) == pytest.approx(0.6 / math.sqrt(0.32), abs=1e-9)  # 1.0607
    # published t_{0.8, df} (4 decimals): df 3 0.9785, 5 0.9195, 10 0.8791, 30 0.8538
    for df, want in ((3, 0.9785), (5, 0.9195), (10, 0.8791), (30, 0.8538)):
        assert t_quantile(0.8, df) == pytest.approx(want, abs=5e-5), df
    # the 0.975 quantiles agree with the table (4 decimals), and symmetry
    for df in (1, 2, 4, 9, 30):
        assert t_quantile(0.975, df) == pytest.approx(t975(df), abs=5e-5), df
    assert t_quantile(0.2, 7) == pytest.approx(-t_quantile(0.8, 7), abs=1e-12)
    assert t_cdf(t_quantile(0.8, 12), 12) == pytest.approx(0.8, abs=1e-10)
    with pytest.raises(ValueError, match="0 < p < 1"):
        t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_quantile(0.8, 0)


def test_minimum_detectable_difference_and_seeds_needed_by_hand():
    # differences 0.1, 0.3, -0.1: mean 0.1, squared deviations 0 + 0.04 + 0.04, s^2 = 0.08/2
    # = 0.04, sd = 0.2; n = 3, t_{0.975,2} = 4.3027, t_{0.8,2} = 1.0607
    # -> MDD = (4.3027 + 1.0607) * 0.2 / sqrt(3) = 5.3634 * 0.115470 = 0.6193
    diffs = [0.1, 0.3, -0.1]
    assert sample_std(diffs) == pytest.approx(0.2)
    assert mdd(0.2, 3) == pytest.approx(0.6193, abs=1e-4)
    # seeds for effect 0.1 at sd 0.2: need (t_{0.975,n-1} + t_{0.8,n-1}) / sqrt(n) <= 0.5
    #   n = 3:  (4.3027 + 1.0607) / 1.7321 = 3.096
    #   n = 10: (2.2622 + 0.8834) / 3.1623 = 0.995
    #   n = 30: (2.0452 + 0.8542) / 5.4772 = 0.5294
    #   n = 33: (2.0369 + 0.8530) / 5.7446 = 0.5031  (> 0.5: MDD 0.1006)
    #   n = 34: (2.0345 + 0.8526) / 5.8310 = 0.4951  (<= 0.5: MDD 0.0990) -> 34
    assert mdd(0.2, 33) == pytest.approx(0.1006, abs=1e-4)
    assert mdd(0.2, 34) == pytest.approx(0.0990, abs=1e-4)
    assert seeds_needed(0.2, 0.1) == 34
    # the search equals trying n = 2, 3, ... in turn
    for sd, effect in ((0.05, 0.1), (0.1, 0.1), (0.15, 0.1), (0.3, 0.05), (0.02, 0.1)):
        n = 2
        while mdd(sd, n) > effect:
            n += 1
        assert seeds_needed(sd, effect) == n, (sd, effect)
    # sd 0.02, effect 0.1: n = 2 gives (12.7062 + 1.3764) * 0.02 / 1.4142 = 0.1992 > 0.1,
    # n = 3 gives 5.3634 * 0.02 / 1.7321 = 0.0619 -> 3
    assert seeds_needed(0.02, 0.1) == 3
    # undefined: one seed, sd 0 or NaN; out of reach: None
    assert math.isnan(mdd(0.2, 1)) and math.isnan(mdd(0.0, 5)) and math.isnan(mdd(math.nan, 3))
    assert seeds_needed(0.0, 0.1) is None and seeds_needed(math.nan, 0.1) is None
    assert seeds_needed(1.0, 1e-3, n_max=1000) is None
    with pytest.raises(ValueError, match="effect must be > 0"):
        seeds_needed(0.2, 0.0)


def test_paired_sd_calls_rounding_spread_zero():
    # 0.2 - 0.1, 0.3 - 0.2, 0.4 - 0.3 differ in the last bits only: no spread
    diffs = [0.2 - 0.1, 0.3 - 0.2, 0.4 - 0.3]
    assert sample_std(diffs) > 0 and paired_sd(diffs) == 0.0
    assert paired_sd([0.1, 0.3, -0.1]) == pytest.approx(0.2)
    assert math.isnan(paired_sd([0.5]))
