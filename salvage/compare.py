"""``salvage compare STUDY_DIR [RUN_DIR ...]``: methods over seeds, as curves and a table.

Inputs: a study dir (``salvage study``'s ``STUDY_DIR/<method>/seed<k>``), method dirs, or
any run dirs; a run's method is its parent folder's name and its seed the number in ``seed<k>`` (else
its position). A run's metrics are all its ``version_*/metrics.csv`` read in version order,
a later version overriding an earlier one at the same step (a resumed run continues the
steps of the one it resumed).

Writes into ``--out`` (default ``STUDY_DIR/compare``, or ``./compare`` for run dirs):

- one PNG per metric: the mean over seeds per method with its 95% t band, for the held-out
  score (``[<model>/]val/success``, else ``[<model>/]val/aggregate``; ``--metric`` names
  others), training success (``rollout/success_rate``), the zero-signal fraction
  (``rollout/zero_signal_frac``), the extra-token ratio (``cost/extra_token_ratio``,
  VH-GPO) and GPU-hours (``cost/gpu_hours``), each where the runs logged it;
- ``compare.md`` (also printed): per held-out metric and method, the final and best
  held-out score and the area under the held-out curve over its step range divided by
  that range (the curve's average), each mean ± 95% CI over seeds (t-distribution, see
  ``salvage.core.stats``); wall time (``cost/wall_s``) relative to the baseline's mean and
  the extra-token ratio (VH-GPO's rescue tokens over the run's own rollout tokens, i.e.
  over what GRPO alone generates at the same batch shape); then the paired comparison with the baseline (``baseline:`` of
  the study, or ``--baseline``): per-seed differences of the final score and the AUC,
  their mean ± CI, over the seeds both have (a warning when the seed sets differ), and
  the power of that comparison on the final score: the paired SD (the sample SD of the
  per-seed differences, n - 1), the minimum detectable difference at 80% power for the n
  seeds run, ``MDD = (t_{0.975, n-1} + t_{0.8, n-1}) * SD / sqrt(n)`` (two-sided paired
  t-test at alpha 0.05, the standard approximation without the noncentral t), and the
  seeds needed for a difference of ``--effect`` (default 0.1): the smallest n >= 2 with
  ``(t_{0.975, n-1} + t_{0.8, n-1}) * SD / sqrt(n) <= effect`` at that SD; "n/a" with one
  paired seed or an SD of 0;
- GRAFT runs (``exchange.jsonl`` with per-response rows): ``compat_log_s.png``, the
  distribution of ``log s`` per direction (one panel each, one histogram per method, a
  line at ``log delta``), and per method and direction the admitted fraction of the
  correct and of the incorrect transferred responses, pooled over seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from salvage.core.stats import (
    Interval,
    band,
    ci95,
    mdd,
    mean,
    mean_auc,
    paired,
    paired_sd,
    seeds_needed,
)
from salvage.errors import ConfigError, DataError
from salvage.report import (
    admission_by_direction,
    exchange_delta,
    exchange_rows,
    load_run,
    plot_log_s,
    ranked_jsonl,
    run_lineage,
)

CURVES = (
    ("training success", r"(?:^|/)rollout/success_rate$"),
    ("zero-signal fraction", r"(?:^|/)rollout/zero_signal_frac$"),
    ("extra-token ratio", r"^cost/extra_token_ratio$"),
    ("GPU-hours", r"^cost/gpu_hours$"),
)
# method-specific curves: plotted when some run logs them, never reported missing
OPTIONAL_CURVES = (
    ("GRAFT admitted fraction", r"^graft/admitted_frac$"),
    ("GRAFT transfers", r"^graft/transferred_(a_to_b|b_to_a)$"),
)
_VERSION = re.compile(r"^version_(\d+)$")
POWER = 0.8
"""Power of the detectable difference and of the seeds needed (two-sided alpha 0.05)."""
MAX_SEEDS = 100_000
"""``seeds for +EFFECT`` above this reads ``> MAX_SEEDS``."""
_SEED = re.compile(r"seed(\d+)$")


@dataclass
class RunData:
    """One run: its method, seed, and metric -> {step: value} over all its versions."""

    method: str
    seed: int
    dir: Path
    series: dict[str, dict[float, float]] = field(default_factory=dict)
    exchange: list[dict[str, Any]] = field(default_factory=list)
    """GRAFT runs: the ``exchange.jsonl`` records over all versions (``read_exchange``)."""

    def curve(self, key: str) -> tuple[list[float], list[float]]:
        pts = sorted(self.series.get(key, {}).items())
        return [p[0] for p in pts], [p[1] for p in pts]

    def final(self, key: str) -> float:
        xs, ys = self.curve(key)
        return ys[-1] if ys else math.nan


def _versions(run_dir: Path) -> list[Path]:
    """The run's fit history (``salvage.report.run_lineage``: its versions with metrics,
    oldest first, found relative to the run dir; evaluations left out)."""
    return run_lineage(run_dir)


def read_exchange(run_dir: Path) -> list[dict[str, Any]]:
    """The ``exchange.jsonl`` records (every rank's) of every version, a later version's
    records of a step replacing an earlier one's (as ``read_run`` does with metrics)."""
    by_step: dict[float, list[dict[str, Any]]] = {}
    for v in _versions(run_dir):
        path = v / "exchange.jsonl"
        mine: dict[float, list[dict[str, Any]]] = {}
        for rec in ranked_jsonl(path if path.is_file() else None, "exchange"):
            mine.setdefault(float(rec.get("step", -1)), []).append(rec)
        by_step.update(mine)
    return [rec for step in sorted(by_step) for rec in by_step[step]]


def read_run(run_dir: Path) -> dict[str, dict[float, float]]:
    """Metric -> {step: value} over the run's whole history (``salvage.report.load_run``:
    every fit version, a later version winning at a step it redid); {} for a dir without
    fit versions."""
    if not _versions(run_dir):
        return {}
    series, _, _ = load_run(run_dir)
    return {k: dict(pts) for k, pts in series.items()}


def _is_run(p: Path) -> bool:
    return p.is_dir() and bool(run_lineage(p))


def _runs_under(p: Path) -> list[Path]:
    """``p`` if it is a run, and every run below it (method dirs, study dirs, and runs
    beside them at any depth), never looking inside ``version_*`` folders."""
    found: list[Path] = []
    if _is_run(p):
        found.append(p)
    for child in sorted(c for c in p.iterdir() if c.is_dir() and not _VERSION.match(c.name)):
        found += _runs_under(child)
    return found


def collect(paths: list[Path]) -> list[RunData]:
    """Runs under the given study dirs / run dirs (method = parent folder name): every run
    at any depth below each path, the path itself included."""
    found: list[Path] = []
    for p in paths:
        if not p.is_dir():
            raise ConfigError(f"{str(p)!r} is not a directory")
        runs = _runs_under(p)
        if not runs:
            raise DataError(
                f"{str(p)!r} holds no run dirs (RUN/version_*/metrics.csv, "
                "METHOD/RUN/... or STUDY/METHOD/RUN/...)"
            )
        found += [r for r in runs if r not in found]
    out: list[RunData] = []
    pos: dict[str, int] = {}
    for r in found:
        method = r.parent.name
        m = _SEED.search(r.name)
        seed = int(m.group(1)) if m else pos.get(method, 0)
        pos[method] = pos.get(method, 0) + 1
        out.append(RunData(method, seed, r, read_run(r), read_exchange(r)))
    return out


def read_study_json(path: Path) -> dict[str, Any]:
    """A study dir's ``study.json``; ``DataError`` naming it when it is not a JSON object."""
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise DataError(f"{str(path)!r} is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise DataError(
            f"{str(path)!r} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
            "rerun salvage study to rewrite it"
        ) from None
    if not isinstance(info, dict):
        raise DataError(f"{str(path)!r} holds a {type(info).__name__}, not a JSON object")
    return info


def heldout_keys(runs: list[RunData]) -> list[str]:
    """``[<model>/]val/success`` per model prefix, else ``[<model>/]val/aggregate`` followed
    by that model's per-benchmark ``[<model>/]val/success/<name>`` (several benchmarks)."""
    keys = {k for r in runs for k in r.series}
    prefixes = sorted(
        {m.group(1) or "" for k in keys if (m := re.match(r"^(.*/)?val/(success|aggregate)$", k))}
    )
    out = []
    for pre in prefixes:
        if f"{pre}val/success" in keys:
            out.append(f"{pre}val/success")
            continue
        out.append(f"{pre}val/aggregate")
        out += sorted(k for k in keys if re.fullmatch(re.escape(pre) + r"val/success/[^/]+", k))
    return out


def _by_method(runs: list[RunData]) -> dict[str, list[RunData]]:
    out: dict[str, list[RunData]] = {}
    for r in runs:
        out.setdefault(r.method, []).append(r)
    return out


def plot(runs: list[RunData], key: str, title: str, path: Path) -> bool:
    """Mean over seeds per method with the 95% band; False if no run logged ``key``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {
        m: [r.series[key] for r in rs if r.series.get(key)] for m, rs in _by_method(runs).items()
    }
    groups = {m: c for m, c in groups.items() if c}
    if not groups:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for m, curves in groups.items():
        b = band(curves)
        xs = [x for x, _ in b]
        ys = [iv.mean for _, iv in b]
        (line,) = ax.plot(
            xs, ys, marker="o" if len(xs) < 30 else None, ms=3, label=f"{m} (n={len(curves)})"
        )
        lo = [iv.low if not math.isnan(iv.half) else iv.mean for _, iv in b]
        hi = [iv.high if not math.isnan(iv.half) else iv.mean for _, iv in b]
        ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xlabel("step (update index, from 0)")
    ax.set_ylabel(key)
    ax.set_title(f"{title}: mean over seeds, 95% band")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


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


def table(
    runs: list[RunData], keys: list[str], baseline: str | None, effect: float = 0.1
) -> tuple[str, list[str]]:
    """The markdown table(s) and the warnings (``effect``: the difference the ``seeds for``
    column sizes the study for)."""
    warnings: list[str] = []
    methods = _by_method(runs)
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
        per: dict[str, dict[str, dict[int, float]]] = {}
        for m, rs in methods.items():
            rs = [r for r in rs if r.series.get(key)]
            if not rs:
                lines.append(f"| {m} | 0 | n/a | n/a | n/a | | | | |")
                continue
            fin = {r.seed: r.final(key) for r in rs}
            best = {r.seed: max(r.curve(key)[1]) for r in rs}
            area = {r.seed: mean_auc(*r.curve(key)) for r in rs}
            per[m] = {"final": fin, "auc": area}
            last = sorted({int(r.curve(key)[0][-1]) for r in rs})
            if len(last) > 1:
                warnings.append(f"{m}: {key} ends at different updates over seeds: {last}")
            wall = [r.final("cost/wall_s") for r in rs if "cost/wall_s" in r.series]
            wall_iv = ci95(wall) if wall else Interval(math.nan, math.nan, 0)
            rel = wall_iv.mean / base_wall if wall and base_wall > 0 else math.nan
            extra = [
                r.final("cost/extra_token_ratio")
                for r in rs
                if "cost/extra_token_ratio" in r.series
            ]
            lines.append(
                f"| {m} | {len(rs)} | {_fmt(ci95(list(fin.values())))} "
                f"| {_fmt(ci95(list(best.values())))} | {_fmt(ci95(list(area.values())))} "
                f"| {'/'.join(map(str, last))} | {_fmt(wall_iv, 1)} s "
                f"| {'n/a' if math.isnan(rel) else f'{rel:.2f}x'} "
                f"| {_fmt(ci95(extra), 3) if extra else 'not logged'} |"
            )
        lines.append("")
        if baseline is not None and baseline in per:
            lines += [
                f"Paired with the baseline `{baseline}` (method - baseline, per seed; mean ± 95% CI):",
                "",
                f"| method | seeds | Δ final | Δ AUC | per-seed Δ final | paired SD "
                f"| MDD (80%) | seeds for +{effect:g} |",
                "|---|---|---|---|---|---|---|---|",
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
                per_seed = ", ".join(
                    f"s{s}: {v:+.3f}" for s, v in zip(pf.seeds, pf.diffs, strict=True)
                )
                sd, detectable, need = power_cells(pf.diffs, effect)
                lines.append(
                    f"| {m} | {len(pf.seeds)} | {_fmt(pf.interval)} | {_fmt(pa.interval)} "
                    f"| {per_seed} | {sd} | {detectable} | {need} |"
                )
            lines += [
                "",
                "Power, of Δ final (paired t-test, two-sided alpha 0.05, power 80%, the "
                "approximation without the noncentral t): paired SD = sample SD (n - 1) of the "
                "per-seed Δ final over the n paired seeds; MDD (80%) = (t_{0.975,n-1} + "
                f"t_{{0.8,n-1}}) · SD / sqrt(n); seeds for +{effect:g} = the smallest n ≥ 2 with "
                f"(t_{{0.975,n-1}} + t_{{0.8,n-1}}) · SD / sqrt(n) ≤ {effect:g} at this SD.",
            ]
            lines.append("")
    return "\n".join(lines), warnings


def compare(
    paths: list[Path],
    out: Path,
    baseline: str | None,
    metrics: list[str] | None,
    effect: float = 0.1,
) -> str:
    """Write the PNGs and ``compare.md`` into ``out``; return the markdown. ``effect``: the
    difference of the final score the ``seeds for +EFFECT`` column sizes the study for."""
    if not effect > 0:
        raise ValueError(f"--effect must be > 0, got {effect}")
    runs = collect(paths)
    if len(paths) == 1 and (paths[0] / "study.json").is_file():
        info = read_study_json(paths[0] / "study.json")
        baseline = baseline or info.get("baseline")
        order = {m: i for i, m in enumerate(info.get("methods") or [])}
        runs.sort(key=lambda r: (order.get(r.method, len(order)), r.method, r.seed))
    keys = metrics or heldout_keys(runs)
    out.mkdir(parents=True, exist_ok=True)
    all_keys = {k for r in runs for k in r.series}
    plots: list[str] = []
    missing: list[str] = []
    for k in keys:
        (plots if plot(runs, k, "held-out", out / f"{_slug(k)}.png") else missing).append(k)
    for (title, pat), optional in [(c, False) for c in CURVES] + [
        (c, True) for c in OPTIONAL_CURVES
    ]:
        matched = sorted(k for k in all_keys if re.search(pat, k))
        if not matched and not optional:
            missing.append(title)
        for k in matched:
            if plot(runs, k, title, out / f"{_slug(k)}.png"):
                plots.append(k)
    body, warnings = table(runs, keys, baseline, effect)
    methods = _by_method(runs)
    rows = {m: exchange_rows([e for r in rs for e in r.exchange]) for m, rs in methods.items()}
    rows = {m: rs for m, rs in rows.items() if rs}
    delta = exchange_delta([e for r in runs for e in r.exchange])
    if plot_log_s(rows, delta, out / "compat_log_s.png"):
        plots.append("compat_log_s")
    md = ["# Comparison", ""]
    md.append(
        "Runs: "
        + "; ".join(f"{m}: seeds {sorted(r.seed for r in rs)}" for m, rs in methods.items())
    )
    md.append(f"Baseline: {baseline or 'none'}")
    md.append("")
    if not keys:
        md += ["No held-out metric (val/success, val/aggregate) logged; no score table.", ""]
    md.append(body)
    if rows:
        md += admission_section(rows, methods)
    md += ["Plots: " + ", ".join(f"`{_slug(k)}.png`" for k in plots)]
    if missing:
        md.append("Not logged by any run: " + ", ".join(missing))
    if warnings:
        md += ["", "Warnings:", *[f"- {w}" for w in warnings]]
    text = "\n".join(md) + "\n"
    (out / "compare.md").write_text(text, encoding="utf-8")
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    return text


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


def _slug(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key).strip("_")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="salvage compare", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("paths", nargs="+", type=Path, help="a study dir, or run dirs")
    p.add_argument("--out", type=Path, default=None, help="output folder")
    p.add_argument("--baseline", default=None, help="baseline method (default: the study's)")
    p.add_argument(
        "--metric", action="append", default=None, help="held-out metric key (repeatable)"
    )
    p.add_argument(
        "--effect",
        type=float,
        default=0.1,
        help="the difference in the final held-out score to size the study for: compare.md's "
        "'seeds for +EFFECT' column gives the seeds a paired t-test needs to detect it at "
        "80%% power (two-sided alpha 0.05) at the observed paired SD (default 0.1)",
    )
    a = p.parse_args(argv)
    out = a.out or (
        a.paths[0] / "compare" if len(a.paths) == 1 and not _is_run(a.paths[0]) else Path("compare")
    )
    try:
        print(compare(a.paths, out, a.baseline, a.metric, a.effect), end="")
    except ValueError as e:
        p.exit(2, f"salvage compare: error: {' '.join(str(e).split())}\n")
    print(f"wrote {out}")
