"""The tables of ``salvage compare``: scores per method over seeds, the paired comparison
with the baseline and its power, GRAFT's admission by correctness."""

from __future__ import annotations

import math
from typing import Any

from salvage.commands.compare.runs import RunData, by_method
from salvage.core.stats import (
    Interval,
    ci95,
    mdd,
    mean,
    mean_auc,
    paired,
    paired_sd,
    seeds_needed,
)
from salvage.history import admission_by_direction, exchange_rows

POWER = 0.8
"""Power of the detectable difference and of the seeds needed (two-sided alpha 0.05)."""
MAX_SEEDS = 100_000
"""``seeds for +EFFECT`` above this reads ``> MAX_SEEDS``."""


def _fmt(iv: Interval, digits: int = 3) -> str:
    return iv.fmt(digits)


def power_cells(diffs: tuple[float, ...] | list[float], effect: float) -> tuple[str, str, str]:
    """``paired SD``, ``MDD (80%)`` and ``seeds for +EFFECT`` of per-seed differences
    (``salvage.core.stats.mdd`` / ``seeds_needed``); "n/a (...)" where undefined."""
    n = len(diffs)
    if n < 2:
        why = "n/a (1 seed)" if n == 1 else "n/a (no common seed)"
        return why, why, why
    sd = paired_sd(diffs)
    if sd == 0:
        return f"{sd:.3f}", "n/a (SD 0)", "n/a (SD 0)"
    need = seeds_needed(sd, effect, POWER, n_max=MAX_SEEDS)
    return f"{sd:.3f}", f"{mdd(sd, n, POWER):.3f}", str(need) if need else f"> {MAX_SEEDS}"


def _method_rows(
    methods: dict[str, list[RunData]], key: str, base_wall: float, warnings: list[str]
) -> tuple[list[str], dict[str, dict[str, dict[int, float]]]]:
    """The score table's rows of ``key``, one per method, and per method its per-seed final
    score and AUC (for the paired comparison)."""
    lines: list[str] = []
    per: dict[str, dict[str, dict[int, float]]] = {}
    for m, rs in methods.items():
        rs = [r for r in rs if r.series.get(key)]
        if not rs:
            lines.append(f"| {m} | 0 | n/a | n/a | n/a | | | | |")
            continue
        fin = {r.seed: r.final(key) for r in rs}
        best = {r.seed: max(r.curve(key)[1]) for r in rs}
        area = {r.seed: mean_auc(*r.curve(key)) for r in rs}
        first = {r.seed: r.curve(key)[1][0] for r in rs}
        start = {r.seed: r.curve(key)[0][0] for r in rs}
        per[m] = {"final": fin, "auc": area, "first": first, "start": start}
        last = sorted({int(r.curve(key)[0][-1]) for r in rs})
        if len(last) > 1:
            warnings.append(f"{m}: {key} ends at different updates over seeds: {last}")
        wall = [r.final("cost/wall_s") for r in rs if "cost/wall_s" in r.series]
        wall_iv = ci95(wall) if wall else Interval(math.nan, math.nan, 0)
        rel = wall_iv.mean / base_wall if wall and base_wall > 0 else math.nan
        extra = [
            r.final("cost/extra_token_ratio") for r in rs if "cost/extra_token_ratio" in r.series
        ]
        lines.append(
            f"| {m} | {len(rs)} | {_fmt(ci95(list(fin.values())))} "
            f"| {_fmt(ci95(list(best.values())))} | {_fmt(ci95(list(area.values())))} "
            f"| {'/'.join(map(str, last))} | {_fmt(wall_iv, 1)} s "
            f"| {'n/a' if math.isnan(rel) else f'{rel:.2f}x'} "
            f"| {_fmt(ci95(extra), 3) if extra else 'not logged'} |"
        )
    return lines, per


def baseline_gain(
    d: dict[str, dict[int, float]], baseline: str, start_name: str | None = None
) -> tuple[Interval, str]:
    """The baseline's own gain on a held-out key over the run, per seed its final value minus
    its first (mean ± 95% CI over seeds), and the sentence saying so. The first point is the
    one before update 1 where the run validated first (``ValidateFirst``); else the first
    validation's update, which the sentence names; ``start_name``: the run whose first
    validation ``d["first"]`` holds for every seed (``salvage compare --start``)."""
    gains = [d["final"][s] - d["first"][s] for s in sorted(d["final"])]
    iv = ci95(gains)
    starts = sorted({int(v) for v in d["start"].values()})
    if start_name:
        since = f"the shared start point's, `{start_name}`"
    elif starts == [0]:
        since = "before update 1 (step 0)"
    else:
        since = "at step " + "/".join(map(str, starts)) + ", after training began"
    per_seed = ", ".join(f"s{s}: {g:+.3f}" for s, g in zip(sorted(d["final"]), gains, strict=True))
    line = (
        f"Baseline `{baseline}`'s own gain (final minus its first validation, {since}): "
        f"{_fmt(iv)} ({per_seed}); half of it: {iv.mean / 2:+.3f}."
    )
    return iv, line


def powered_cell(detectable: str, gain: Interval) -> str:
    """Whether a comparison's MDD is at most half the baseline's mean gain (issue 46's power
    rule): "yes", "no (MDD x > y)", or "n/a (...)" when either is undefined or the baseline did
    not gain."""
    try:
        d = float(detectable)
    except ValueError:
        return "n/a (no MDD)"
    if math.isnan(gain.mean) or gain.mean <= 0:
        return f"n/a (baseline gain {gain.mean:+.3f})"
    half = gain.mean / 2
    return "yes" if d <= half else f"no ({d:.3f} > {half:.3f})"


def _paired_rows(
    per: dict[str, dict[str, dict[int, float]]],
    baseline: str,
    key: str,
    effect: float,
    warnings: list[str],
    start_name: str | None = None,
) -> list[str]:
    """The paired comparison of each method with the baseline on ``key``, and its power."""
    gain, gain_line = baseline_gain(per[baseline], baseline, start_name)
    lines = [
        gain_line,
        "",
        f"Paired with the baseline `{baseline}` (method - baseline, per seed; mean ± 95% CI):",
        "",
        f"| method | seeds | Δ final | Δ AUC | per-seed Δ final | paired SD "
        f"| MDD (80%) | seeds for +{effect:g} | MDD <= half the baseline's gain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m, d in per.items():
        if m == baseline:
            continue
        pf = paired(d["final"], per[baseline]["final"])
        pa = paired(d["auc"], per[baseline]["auc"])
        if not pf.same_seeds:
            warnings.append(
                f"{key}: {m} vs {baseline}: seeds only in {m}: {list(pf.only_method)}, "
                f"only in {baseline}: {list(pf.only_baseline)} (paired on {list(pf.seeds)})"
            )
        per_seed = ", ".join(f"s{s}: {v:+.3f}" for s, v in zip(pf.seeds, pf.diffs, strict=True))
        sd, detectable, need = power_cells(pf.diffs, effect)
        lines.append(
            f"| {m} | {len(pf.seeds)} | {_fmt(pf.interval)} | {_fmt(pa.interval)} "
            f"| {per_seed} | {sd} | {detectable} | {need} | {powered_cell(detectable, gain)} |"
        )
    return [
        *lines,
        "",
        "Power, of Δ final (paired t-test, two-sided alpha 0.05, power 80%, the "
        "approximation without the noncentral t): paired SD = sample SD (n - 1) of the "
        "per-seed Δ final over the n paired seeds; MDD (80%) = (t_{0.975,n-1} + "
        f"t_{{0.8,n-1}}) · SD / sqrt(n); seeds for +{effect:g} = the smallest n ≥ 2 with "
        f"(t_{{0.975,n-1}} + t_{{0.8,n-1}}) · SD / sqrt(n) ≤ {effect:g} at this SD.",
        "",
    ]


def table(
    runs: list[RunData],
    keys: list[str],
    baseline: str | None,
    effect: float = 0.1,
    start: tuple[str, dict[str, dict[float, float]]] | None = None,
) -> tuple[str, list[str]]:
    """The markdown table(s) and the warnings (``effect``: the difference the ``seeds for``
    column sizes the study for; ``start``: (name, metrics) of a run whose first validation
    is every run's start point, for the baseline's own gain)."""
    warnings: list[str] = []
    methods = by_method(runs)
    lines: list[str] = []
    if baseline is not None and baseline not in methods:
        warnings.append(f"baseline {baseline!r} is not among the methods {sorted(methods)}")
        baseline = None
    seedsets = {m: sorted(r.seed for r in rs) for m, rs in methods.items()}
    if len({tuple(s) for s in seedsets.values()}) > 1:
        warnings.append(f"methods have different seed sets: {seedsets}")
    base_wall = (
        mean([r.final("cost/wall_s") for r in methods.get(baseline, [])]) if baseline else math.nan
    )
    for key in keys:
        lines += [f"### {key}", ""]
        lines.append(
            "| method | seeds | final | best | AUC (mean over updates) | last step "
            "| wall time | wall / baseline | extra-token ratio |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|")
        rows, per = _method_rows(methods, key, base_wall, warnings)
        lines += [*rows, ""]
        if baseline is not None and baseline in per:
            name = None
            if start is not None:
                pts = sorted(start[1].get(key, {}).items())
                if not pts:
                    warnings.append(f"{key}: the start run {start[0]} does not log it")
                else:
                    name = start[0]
                    b = per[baseline]
                    b["first"] = dict.fromkeys(b["final"], pts[0][1])
            lines += _paired_rows(per, baseline, key, effect, warnings, name)
    return "\n".join(lines), warnings


def admission_section(
    rows: dict[str, list[dict[str, Any]]], methods: dict[str, list[RunData]]
) -> list[str]:
    """Per method and direction: the admitted fraction of the correct (``success``) and of
    the incorrect transferred responses, pooled over the method's seeds (``exchange.jsonl``
    rows; admitted: weight > 0)."""
    lines = [
        "### GRAFT admission by correctness",
        "",
        "Transferred responses admitted (weight > 0), correct (success) vs incorrect, pooled "
        "over seeds (`exchange.jsonl`):",
        "",
        "| method | direction | seeds | correct admitted | incorrect admitted |",
        "|---|---|---|---|---|",
    ]
    for m, rs in rows.items():
        seeds = sorted(r.seed for r in methods[m] if exchange_rows(r.exchange))
        for d, a in admission_by_direction(rs).items():
            lines.append(
                f"| {m} | {d.replace('_to_', ' -> ')} | {len(seeds)} "
                f"| {a.cell(a.correct_admitted, a.correct)} "
                f"| {a.cell(a.incorrect_admitted, a.incorrect)} |"
            )
    return [*lines, ""]
