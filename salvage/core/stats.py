"""Statistics for comparing methods over seeds: means, t-based 95% intervals, paired
differences and areas under curves. Pure functions on plain floats (no numpy, no scipy).

The two-sided 95% interval of a mean over n seeds is ``mean ± t_{0.975, n-1} · s / sqrt(n)``
with ``s`` the sample standard deviation (n - 1 in the denominator). ``t_{0.975, df}`` comes
from a table for df 1..30 (the standard values, 4 decimals); beyond 30 from the
Cornish-Fisher expansion of the t quantile around the normal quantile z = 1.959964
(three correction terms; it gives 2.0423 at df 30, equal to the table, and its error is
below 1e-4 for every df > 30). With one seed the interval is undefined (NaN half-width).
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
