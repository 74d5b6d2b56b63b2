"""Statistics for comparing methods over seeds: means, t-based 95% intervals, paired
differences, the power of a paired comparison and areas under curves. Pure functions on
plain floats (no numpy, no scipy).

The two-sided 95% interval of a mean over n seeds is ``mean ± t_{0.975, n-1} · s / sqrt(n)``
with ``s`` the sample standard deviation (n - 1 in the denominator). ``t_{0.975, df}`` comes
from a table for df 1..30 (the standard values, 4 decimals); beyond 30 from the
Cornish-Fisher expansion of the t quantile around the normal quantile z = 1.959964
(three correction terms; it gives 2.0423 at df 30, equal to the table, and its error is
below 1e-4 for every df > 30). With one seed the interval is undefined (NaN half-width).

Other t quantiles (``t_quantile``, e.g. the 0.8 one of the power calculation) invert the
t CDF, ``F(t) = 1 - I_x(df/2, 1/2) / 2`` for ``t >= 0`` with ``x = df / (df + t^2)`` and
``I`` the regularized incomplete beta function (its continued fraction), by bisection.

Power of the paired comparison (``mdd``, ``seeds_needed``): the minimum detectable
difference of a two-sided paired t-test at level alpha with power ``1 - beta`` over n seeds
is approximated without the noncentral t by
``MDD = (t_{1-alpha/2, n-1} + t_{1-beta, n-1}) * sd / sqrt(n)``, ``sd`` the sample SD of
the per-seed differences; the seeds needed for a difference ``effect`` are the smallest
``n >= 2`` with ``MDD(n) <= effect`` at that ``sd``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Z975 = 1.959963984540054

# t_{0.975, df} for df = 1..30 (index df - 1)
T975 = (
    12.7062,
    4.3027,
    3.1824,
    2.7764,
    2.5706,
    2.4469,
    2.3646,
    2.3060,
    2.2622,
    2.2281,
    2.2010,
    2.1788,
    2.1604,
    2.1448,
    2.1314,
    2.1199,
    2.1098,
    2.1009,
    2.0930,
    2.0860,
    2.0796,
    2.0739,
    2.0687,
    2.0639,
    2.0595,
    2.0555,
    2.0518,
    2.0484,
    2.0452,
    2.0423,
)


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (df >= 1)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(T975):
        return T975[df - 1]
    z = Z975
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
    )


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)`` (a, b > 0, 0 <= x <= 1).

    The continued fraction of ``I_x(a, b)`` (modified Lentz evaluation), used directly for
    ``x < (a + 1) / (a + b + 2)`` and through ``I_x(a, b) = 1 - I_{1-x}(b, a)`` above.
    """
    if a <= 0 or b <= 0:
        raise ValueError(f"betainc needs a, b > 0, got a={a}, b={b}")
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"betainc needs 0 <= x <= 1, got x={x}")
    if x in (0.0, 1.0):
        return x
    if x > (a + 1) / (a + b + 2):
        return 1.0 - betainc(b, a, 1.0 - x)
    log_front = a * math.log(x) + b * math.log1p(-x) - _log_beta(a, b)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 1000):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),  # even term d_{2m}
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),  # odd d_{2m+1}
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return math.exp(log_front) * f / a


def _log_beta(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


def t_cdf(t: float, df: float) -> float:
    """Student's t CDF with ``df`` degrees of freedom (df > 0)."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    tail = 0.5 * betainc(df / 2, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (0 < p < 1, df >= 1):
    ``t_cdf`` inverted by bisection to 1e-12 (``t975`` keeps the table's 0.975 values)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if not 0.0 < p < 1.0:
        raise ValueError(f"a quantile needs 0 < p < 1, got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, 2.0 * hi
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = (lo + hi) / 2
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _t_upper(q: float, df: int) -> float:
    """``t_{q, df}``: the table's for 0.975 (as the intervals use), ``t_quantile`` otherwise."""
    return t975(df) if q == 0.975 else t_quantile(q, df)


def paired_sd(diffs: Sequence[float]) -> float:
    """The sample SD (n - 1) of per-seed differences, 0 when their spread is only float
    rounding (below 1e-9 of their size: e.g. 0.2 - 0.1 and 0.3 - 0.2, equal differences
    read from logged scores); NaN for fewer than 2."""
    sd = sample_std(diffs)
    if math.isfinite(sd) and sd <= 1e-9 * max(1.0, *(abs(d) for d in diffs)):
        return 0.0
    return sd


def mdd(sd: float, n: int, power: float = 0.8, alpha: float = 0.05) -> float:
    """Minimum detectable difference of a two-sided paired t-test over ``n`` seeds:
    ``(t_{1-alpha/2, n-1} + t_{power, n-1}) * sd / sqrt(n)`` (the standard approximation,
    no noncentral t). NaN when it is undefined: fewer than 2 seeds, or ``sd`` 0 or NaN
    (identical differences on every seed say nothing about the seed-to-seed spread)."""
    if n < 2 or not math.isfinite(sd) or sd <= 0:
        return math.nan
    return (_t_upper(1 - alpha / 2, n - 1) + _t_upper(power, n - 1)) * sd / math.sqrt(n)


def seeds_needed(
    sd: float, effect: float, power: float = 0.8, alpha: float = 0.05, n_max: int = 100_000
) -> int | None:
    """The smallest ``n >= 2`` with ``mdd(sd, n, power, alpha) <= effect``. None when it is
    undefined (``sd`` 0 or NaN) or above ``n_max``.

    ``mdd`` falls strictly with n (both t quantiles fall with the degrees of freedom, and
    so does ``1 / sqrt(n)``), so n is found by doubling and then halving the step: the same
    n as trying n = 2, 3, ... in turn, in O(log n) evaluations.
    """
    if not effect > 0:
        raise ValueError(f"the effect must be > 0, got {effect}")
    if not math.isfinite(sd) or sd <= 0:
        return None

    def ok(n: int) -> bool:
        return mdd(sd, n, power, alpha) <= effect

    if ok(2):
        return 2
    lo, hi = 2, 4  # invariant: not ok(lo)
    while not ok(hi):
        if hi >= n_max:
            return None
        lo, hi = hi, min(2 * hi, n_max)
    while hi - lo > 1:  # not ok(lo), ok(hi)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def mean(xs: Sequence[float]) -> float:
    """Arithmetic mean (NaN for an empty sequence)."""
    return sum(xs) / len(xs) if xs else math.nan


def sample_std(xs: Sequence[float]) -> float:
    """Standard deviation with n - 1 in the denominator (NaN for fewer than 2 values)."""
    n = len(xs)
    if n < 2:
        return math.nan
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))


@dataclass(frozen=True)
class Interval:
    """A mean over ``n`` values with the half-width of its two-sided 95% t interval."""

    mean: float
    half: float
    n: int

    @property
    def low(self) -> float:
        return self.mean - self.half

    @property
    def high(self) -> float:
        return self.mean + self.half

    def fmt(self, digits: int = 3) -> str:
        """``mean ± half`` (``mean`` alone when the interval is undefined)."""
        if math.isnan(self.mean):
            return "n/a"
        if math.isnan(self.half):
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} ± {self.half:.{digits}f}"


def ci95(xs: Sequence[float]) -> Interval:
    """Mean and 95% t-interval half-width over the values (one value per seed)."""
    n = len(xs)
    if n < 2:
        return Interval(mean(xs), math.nan, n)
    return Interval(mean(xs), t975(n - 1) * sample_std(xs) / math.sqrt(n), n)


@dataclass(frozen=True)
class Paired:
    """Per-seed differences method - baseline over the seeds both have."""

    seeds: tuple[int, ...]
    diffs: tuple[float, ...]
    interval: Interval
    only_method: tuple[int, ...]
    only_baseline: tuple[int, ...]

    @property
    def same_seeds(self) -> bool:
        return not self.only_method and not self.only_baseline


def paired(method: Mapping[int, float], baseline: Mapping[int, float]) -> Paired:
    """Paired comparison: differences ``method[s] - baseline[s]`` for the common seeds,
    their mean and 95% t interval, and the seeds only one side has (reported, not used)."""
    common = tuple(sorted(set(method) & set(baseline)))
    diffs = tuple(method[s] - baseline[s] for s in common)
    return Paired(
        seeds=common,
        diffs=diffs,
        interval=ci95(diffs),
        only_method=tuple(sorted(set(method) - set(baseline))),
        only_baseline=tuple(sorted(set(baseline) - set(method))),
    )


def auc(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Area under the piecewise-linear curve through (xs, ys) (trapezoid rule; xs sorted).
    0 for fewer than two points."""
    if len(xs) != len(ys):
        raise ValueError(f"auc: {len(xs)} x values but {len(ys)} y values")
    return sum((xs[i] - xs[i - 1]) * (ys[i] + ys[i - 1]) / 2 for i in range(1, len(xs)))


def mean_auc(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Area under the curve over the x range it spans: the curve's time-average (the value
    itself for a single point, NaN for none)."""
    if not xs:
        return math.nan
    if len(xs) == 1 or xs[-1] == xs[0]:
        return float(ys[-1])
    return auc(xs, ys) / (xs[-1] - xs[0])


def band(curves: Sequence[Mapping[float, float]]) -> list[tuple[float, Interval]]:
    """Per x: the mean and 95% interval over the curves that have a value at that x."""
    xs = sorted({x for c in curves for x in c})
    return [(x, ci95([c[x] for c in curves if x in c])) for x in xs]
