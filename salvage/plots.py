"""The plots of one run, as PNG files: what ``salvage report`` writes and what the W&B
dashboard (``salvage.callbacks.dashboard``) logs as images.

``render_run_plots`` draws, from a run's history (``salvage.history.load_run``):
``rewards.png``, ``zero_signal.png``, ``extra_tokens.png``, ``relays.png`` (per-relay teacher
actions kept vs omitted), ``graft.png`` (transfers per direction, compatibility weights),
``compat.png`` (GRAFT: the distribution of ``log s`` of the transferred responses, one panel
per direction, a vertical line at ``log delta``) and ``cost.png`` (GPU-hours vs score); a
plot whose metrics the run did not log is skipped, with the reason. ``plot_run`` reads the
run and draws them into ``RUN_DIR/report/``.

matplotlib is imported (with the ``Agg`` backend) only when a plot is drawn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from salvage.history import exchange_delta, exchange_rows, load_run, log_s, retained_relays

Series = dict[str, list[tuple[float, float]]]
"""Metric -> [(step, value)], as ``salvage.history.load_run`` returns it."""

LINE_PLOTS: tuple[tuple[str, tuple[str, ...], str, str], ...] = (
    (
        "rewards.png",
        (
            "rollout/reward_mean",
            "rollout/success_rate",
            "val/success",
            "a/rollout/success_rate",
            "b/rollout/success_rate",
        ),
        "reward and success",
        "value",
    ),
    (
        "zero_signal.png",
        ("rollout/zero_signal_frac",),
        "zero-signal groups (fraction of the batch)",
        "fraction",
    ),
    (
        "extra_tokens.png",
        (
            "cost/extra_tokens_teacher",
            "cost/extra_tokens_search",
            "cost/extra_tokens_confirm",
            "cost/extra_tokens_student",
        ),
        "cumulative extra output tokens",
        "tokens",
    ),
)
"""(file, metrics, title, y label) of the line plots over updates."""
SCORE_KEYS = ("val/aggregate", "val/success", "rollout/success_rate")
"""The score of ``cost.png``: the first of these the run logged."""


@dataclass
class RunPlots:
    """What ``render_run_plots`` wrote into ``dir`` and what it skipped (file -> why)."""

    dir: Path
    written: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def record(self, name: str, drawn: bool, why: str) -> None:
        """``name`` was drawn, or skipped because ``why``."""
        if drawn:
            self.written.append(name)
        else:
            self.skipped[name] = why


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the ``Agg`` backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> None:
    plt = pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_lines(series: Series, keys: tuple[str, ...], title: str, ylabel: str, path: Path) -> bool:
    """The logged ones of ``keys`` over updates; False when none was logged."""
    have = [k for k in keys if k in series]
    if not have:
        return False
    fig, ax = pyplot().subplots(figsize=(6, 3.6))
    for k in have:
        xs, ys = zip(*series[k], strict=True)
        ax.plot(xs, ys, marker="o", ms=3, label=k)
    ax.set_xlabel("update")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)
    return True


def plot_relays(relays: list[dict[str, Any]], path: Path) -> bool:
    """Per retained VH-GPO relay: the teacher actions kept (``j*``) and omitted (``L - j*``);
    False when no relay was retained."""
    kept = retained_relays(relays)
    if not kept:
        return False
    fig, ax = pyplot().subplots(figsize=(6, 3.6))
    idx = list(range(len(kept)))
    j = [r["j_star"] for r in kept]
    omitted = [r["L"] - r["j_star"] for r in kept]
    ax.bar(idx, j, label="teacher actions kept (j*)", color="tab:blue")
    ax.bar(idx, omitted, bottom=j, label="omitted (L - j*)", color="tab:orange")
    ax.set_xlabel("retained relay")
    ax.set_ylabel("teacher actions")
    ax.set_title(
        f"per-relay L vs j* (pooled reduction {1 - sum(j) / sum(r['L'] for r in kept):.0%})"
    )
    ax.legend(fontsize=7)
    _save(fig, path)
    return True


def plot_graft(series: Series, exchange: list[dict[str, Any]], path: Path) -> bool:
    """GRAFT: transfers per direction over updates and the histogram of the compatibility
    weights; False for a run that is not a GRAFT run."""
    pair_keys = ["graft/transferred_a_to_b", "graft/transferred_b_to_a"]
    pair_keys += sorted(k for k in series if k.startswith("graft/transferred/"))
    if not exchange and not any(k in series for k in pair_keys):
        return False
    fig, axes = pyplot().subplots(1, 2, figsize=(9, 3.6))
    for k in pair_keys:
        if k in series:
            xs, ys = zip(*series[k], strict=True)
            axes[0].plot(xs, ys, marker="o", ms=3, label=k)
    axes[0].set_title("transfers per direction")
    axes[0].set_xlabel("update")
    axes[0].legend(fontsize=7)
    weights = [w for e in exchange for w in e.get("weights", [])]
    axes[1].hist(weights or [0.0], bins=20, range=(0, 1))
    axes[1].set_title("compatibility weights")
    _save(fig, path)
    return True


def plot_log_s(
    rows_by_label: dict[str, list[dict[str, Any]]], delta: float | None, path: Path
) -> bool:
    """Histograms of ``log s``, one panel per direction, one histogram per label (a run or a
    method), a vertical line at ``log delta``. False when there are no rows."""
    directions = list(
        dict.fromkeys(str(r.get("direction")) for rs in rows_by_label.values() for r in rs)
    )
    if not directions:
        return False
    fig, axes = pyplot().subplots(
        1, len(directions), figsize=(4.2 * len(directions), 3.6), squeeze=False
    )
    finite = [v for rs in rows_by_label.values() for r in rs if math.isfinite(v := log_s(r))]
    lo, hi = (min(finite), max(finite)) if finite else (-1.0, 1.0)
    if delta is not None:
        lo, hi = min(lo, math.log(delta)), max(hi, math.log(delta))
    if hi - lo < 1e-6:
        lo, hi = lo - 0.5, hi + 0.5
    for ax, d in zip(axes[0], directions, strict=True):
        for label, rs in rows_by_label.items():
            vals = [v for r in rs if r.get("direction") == d and math.isfinite(v := log_s(r))]
            if vals:
                ax.hist(vals, bins=30, range=(lo, hi), alpha=0.5, label=f"{label} (n={len(vals)})")
        if delta is not None:
            ax.axvline(math.log(delta), color="k", ls="--", lw=1, label=f"log delta ({delta:g})")
        ax.set_title(f"log s, {d.replace('_to_', ' -> ')}")
        ax.set_xlabel("log s = lbar_recv - lbar_src")
        ax.set_ylabel("responses")
        ax.legend(fontsize=7)
    _save(fig, path)
    return True


def plot_cost(series: Series, path: Path) -> bool:
    """The score (the first of ``SCORE_KEYS`` logged) against GPU-hours; False when the run
    logged no ``cost/gpu_hours`` or no score at a step with a cost."""
    score_key = next((k for k in SCORE_KEYS if k in series), None)
    if "cost/gpu_hours" not in series or not score_key:
        return False
    cost = dict(series["cost/gpu_hours"])
    pts = [(cost[s], v) for s, v in series[score_key] if s in cost]
    if not pts:
        return False
    fig, ax = pyplot().subplots(figsize=(6, 3.6))
    ax.plot(*zip(*pts, strict=True), marker="o", ms=3)
    ax.set_xlabel("GPU-hours (device-hours on CPU)")
    ax.set_ylabel(score_key)
    ax.set_title("score vs cost")
    ax.grid(alpha=0.3)
    _save(fig, path)
    return True


def render_run_plots(
    series: Series, records: dict[str, list[dict[str, Any]]], out: Path
) -> RunPlots:
    """Every plot of a run into ``out`` (created), from its metric series and its
    ``relays`` / ``exchange`` records (``salvage.history.load_run``)."""
    out.mkdir(parents=True, exist_ok=True)
    res = RunPlots(out)
    for name, keys, title, ylabel in LINE_PLOTS:
        drawn = plot_lines(series, keys, title, ylabel, out / name)
        res.record(name, drawn, f"none of {list(keys)} logged")
    relays, exchange = records.get("relays", []), records.get("exchange", [])
    res.record(
        "relays.png", plot_relays(relays, out / "relays.png"), "no retained relay in relays.jsonl"
    )
    res.record("graft.png", plot_graft(series, exchange, out / "graft.png"), "not a GRAFT run")
    drawn = plot_log_s(
        {"run": exchange_rows(exchange)}, exchange_delta(exchange), out / "compat.png"
    )
    res.record("compat.png", drawn, "no per-response rows in exchange.jsonl")
    res.record(
        "cost.png", plot_cost(series, out / "cost.png"), "cost/gpu_hours or a score not logged"
    )
    return res


def plot_run(run_dir: str | Path, version: int | None = None) -> RunPlots:
    """A run's plots in ``RUN_DIR/report/``: of the lineage ending in ``version_N`` (default:
    the newest fit version), across its resumes."""
    run = Path(run_dir)
    series, records, _ = load_run(run, version)
    return render_run_plots(series, records, run / "report")
