"""Repeated evaluation of one checkpoint (GRAFT SPEC §3.4), pure.

The GRAFT paper evaluates each selected checkpoint in five independent runs and reports
their mean and standard deviation. A test run with ``R`` repeats samples every benchmark
``R`` times with different seeds; these helpers map the dataloader's indices to
(repeat, task) and reduce per-repeat counts to the reported numbers. The standard
deviation is the sample one (``R - 1`` in the denominator; ours: the paper does not say
which, and it uses the sample standard deviation for its other spread, over training runs).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from salvage.core.seeds import EVAL, EVAL_REPEATS


def split_repeats(indices: Sequence[int], n_tasks: int) -> dict[int, list[int]]:
    """Index ``i`` of a test loader over ``R * n_tasks`` items -> repeat ``i // n_tasks``, task ``i % n_tasks``."""
    if n_tasks < 1:
        raise ValueError(f"a repeated evaluation needs tasks, got n_tasks={n_tasks}")
    out: dict[int, list[int]] = {}
    for i in indices:
        out.setdefault(i // n_tasks, []).append(i % n_tasks)
    return out


def repeat_stream(repeat: int) -> int:
    """Seed stream of evaluation repeat ``r``: repeat 0 keeps the single-run stream
    (``core.seeds.EVAL``), repeat r > 0 takes ``core.seeds.EVAL_REPEATS + r``."""
    return EVAL if repeat == 0 else EVAL_REPEATS + repeat


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    if not values:
        raise ValueError("mean_std of no values")
    m = sum(values) / len(values)
    if len(values) == 1:
        return m, 0.0
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def repeat_metrics(
    prefix: str, counts: Mapping[tuple[int, str], tuple[float, float]]
) -> dict[str, float]:
    """Per-repeat and summary metrics from (repeat, benchmark) -> (successes, samples).

    Per repeat r: ``<prefix>/repeat_<r>/success/<bench>`` = pass@1 and
    ``<prefix>/repeat_<r>/aggregate`` = their unweighted mean; over repeats:
    ``<prefix>/success/<bench>`` and ``<prefix>/aggregate`` = the mean, ``..._std`` the
    sample standard deviation. Every repeat must cover the same benchmarks.
    """
    repeats = sorted({r for r, _ in counts})
    benches = sorted({b for _, b in counts})
    out: dict[str, float] = {}
    per_bench: dict[str, list[float]] = {b: [] for b in benches}
    aggregates = []
    for r in repeats:
        missing = [b for b in benches if (r, b) not in counts]
        if missing:
            raise ValueError(f"evaluation repeat {r} has no samples of {missing}")
        per = {}
        for b in benches:
            succ, n = counts[(r, b)]
            per[b] = succ / max(n, 1)
            per_bench[b].append(per[b])
            out[f"{prefix}/repeat_{r}/success/{b}"] = per[b]
        agg = sum(per.values()) / len(per)
        out[f"{prefix}/repeat_{r}/aggregate"] = agg
        aggregates.append(agg)
    for b, vals in per_bench.items():
        out[f"{prefix}/success/{b}"], out[f"{prefix}/success/{b}_std"] = mean_std(vals)
    if aggregates:
        out[f"{prefix}/aggregate"], out[f"{prefix}/aggregate_std"] = mean_std(aggregates)
    return out
