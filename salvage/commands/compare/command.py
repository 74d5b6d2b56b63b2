"""``salvage compare``, the command: the plots, ``compare.md``, the command line (the
outputs are documented in ``salvage.commands.compare``)."""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import Any

from salvage.commands.compare.runs import (
    RunData,
    by_method,
    collect,
    heldout_keys,
    is_run,
    read_run,
    read_study_json,
)
from salvage.commands.compare.tables import admission_section, table
from salvage.core.stats import band
from salvage.errors import DataError
from salvage.history import exchange_delta, exchange_rows
from salvage.plots import plot_log_s, pyplot

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


def plot(runs: list[RunData], key: str, title: str, path: Path) -> bool:
    """Mean over seeds per method with the 95% band; False if no run logged ``key``."""
    plt = pyplot()
    groups = {
        m: [r.series[key] for r in rs if r.series.get(key)] for m, rs in by_method(runs).items()
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


def _plots(runs: list[RunData], keys: list[str], out: Path) -> tuple[list[str], list[str]]:
    """One PNG per held-out metric and per logged curve, and the compatibility histogram;
    (plotted keys, what no run logged)."""
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
    rows = _exchange_rowsby_method(runs)
    delta = exchange_delta([e for r in runs for e in r.exchange])
    if plot_log_s(rows, delta, out / "compat_log_s.png"):
        plots.append("compat_log_s")
    return plots, missing


def _exchange_rowsby_method(runs: list[RunData]) -> dict[str, list[dict[str, Any]]]:
    """GRAFT: the per-response exchange rows of each method's runs (methods with some)."""
    rows = {
        m: exchange_rows([e for r in rs for e in r.exchange]) for m, rs in by_method(runs).items()
    }
    return {m: rs for m, rs in rows.items() if rs}


def compare(
    paths: list[Path],
    out: Path,
    baseline: str | None,
    metrics: list[str] | None,
    effect: float = 0.1,
    include_unfinished: bool = False,
    start: Path | None = None,
) -> str:
    """Write the PNGs and ``compare.md`` into ``out``; return the markdown. ``effect``: the
    difference of the final score the ``seeds for +EFFECT`` column sizes the study for;
    ``start``: a run whose first validation is every run's start point (a shared warm start)
    for the baseline's own gain."""
    if not effect > 0:
        raise ValueError(f"--effect must be > 0, got {effect}")
    info = {}
    if len(paths) == 1 and (paths[0] / "study.json").is_file():
        info = read_study_json(paths[0] / "study.json")
    left_out: list[Path] = []
    runs = collect(paths, include_unfinished, left_out)
    if not runs:
        raise DataError(
            f"no finished run under {', '.join(repr(str(p)) for p in paths)} "
            f"({len(left_out)} unfinished: no done.json); --include-unfinished compares them"
        )
    if info:
        baseline = baseline or info.get("baseline")
        order = {m: i for i, m in enumerate(info.get("methods") or [])}
        runs.sort(key=lambda r: (order.get(r.method, len(order)), r.method, r.seed))
    keys = metrics or heldout_keys(runs)
    out.mkdir(parents=True, exist_ok=True)
    plots, missing = _plots(runs, keys, out)
    start_at = None
    if start is not None:
        if not is_run(start):
            raise DataError(f"--start {str(start)!r}: no run there (no version_*/metrics.csv)")
        start_at = (str(start), read_run(start))
    body, warnings = table(runs, keys, baseline, effect, start_at)
    if left_out:
        warnings.insert(
            0,
            f"left out {len(left_out)} unfinished runs (no done.json; --include-unfinished "
            "keeps them): " + ", ".join(f"{r.parent.name}/{r.name}" for r in left_out),
        )
    methods = by_method(runs)
    rows = _exchange_rowsby_method(runs)
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


def _slug(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key).strip("_")


def main(argv: list[str] | None = None) -> None:
    from salvage.commands import compare as package  # its docstring is the help

    p = argparse.ArgumentParser(
        prog="salvage compare",
        description=package.__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
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
    p.add_argument(
        "--include-unfinished",
        action="store_true",
        help="below a study dir, also compare its runs without done.json (stopped, crashed "
        "or still running); by default they are left out, named in a warning",
    )
    p.add_argument(
        "--start",
        type=Path,
        default=None,
        help="a run whose first validation is every run's start (e.g. the study's shared "
        "warm start): the baseline's own gain is its final minus that (default: each run's "
        "first validation)",
    )
    a = p.parse_args(argv)
    out = a.out or (
        a.paths[0] / "compare" if len(a.paths) == 1 and not is_run(a.paths[0]) else Path("compare")
    )
    try:
        print(
            compare(a.paths, out, a.baseline, a.metric, a.effect, a.include_unfinished, a.start),
            end="",
        )
    except ValueError as e:
        p.exit(2, f"salvage compare: error: {' '.join(str(e).split())}\n")
    print(f"wrote {out}")
