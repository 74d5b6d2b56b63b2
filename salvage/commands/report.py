"""``salvage report RUN_DIR``: PNG plots and a markdown summary of a run.

Reads the run's whole history: every ``RUN_DIR/version_N`` (one per ``salvage fit``
invocation: the first run and each resume) in order, its ``metrics.csv`` (CSV logger) and,
where present, ``relays.jsonl`` (VH-GPO) and ``exchange.jsonl`` (GRAFT). A resume redoes the
updates after its checkpoint: what an interrupted version logged for those updates is
replaced by the resumed version's, never counted twice (``salvage.history.load_run``).
Writes into
``RUN_DIR/report/``: ``rewards.png``, ``zero_signal.png``, ``extra_tokens.png``,
``relays.png`` (per-relay teacher actions kept vs omitted), ``graft.png`` (transfers per
direction, compatibility weights), ``compat.png`` (GRAFT: the distribution of ``log s`` of
the transferred responses, one panel per direction, a vertical line at ``log delta``),
``cost.png`` (GPU-hours vs score) and ``report.md``. With per-response exchange rows
(``exchange.jsonl``'s ``responses``), ``report.md`` also gets, per direction, the fraction
of correct (``success``) and of incorrect transferred responses that were admitted
(``admitted``: weight > 0), also printed. A plot whose metrics the run did not log is
skipped and named in the summary. The plots are drawn by ``salvage.plots`` (the W&B
dashboard logs the same ones).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from salvage.history import (
    Admission,
    admission_by_direction,
    exchange_counts,
    exchange_delta,
    exchange_rows,
    is_correct,
    is_evaluation,
    load_metrics,
    load_run,
    log_s,
    merge_versions,
    ranked_jsonl,
    retained_relays,
    run_lineage,
)
from salvage.plots import plot_log_s, render_run_plots

__all__ = [
    "admission_lines",
    "main",
    "make_report",
    "summary_lines",
    # moved to the library (salvage.history, salvage.plots); still importable from here
    "Admission",
    "admission_by_direction",
    "exchange_counts",
    "exchange_delta",
    "exchange_rows",
    "is_correct",
    "is_evaluation",
    "load_metrics",
    "load_run",
    "log_s",
    "merge_versions",
    "plot_log_s",
    "ranked_jsonl",
    "run_lineage",
]


def admission_lines(table: dict[str, Admission]) -> list[str]:
    """The markdown table of ``admission_by_direction``."""
    lines = [
        "| direction | correct admitted | incorrect admitted |",
        "|---|---|---|",
    ]
    for d, a in table.items():
        lines.append(
            f"| {d.replace('_to_', ' -> ')} | {Admission.cell(a.correct_admitted, a.correct)} "
            f"| {Admission.cell(a.incorrect_admitted, a.incorrect)} |"
        )
    return lines


def _metric_lines(m: dict[str, list[tuple[float, float]]]) -> list[str]:
    """First and last value of every rollout / relay / cost / loss / GRAFT / eval metric."""
    lines = ["| metric | first | last |", "|---|---|---|"]
    for k in sorted(m):
        if k.split("/")[0] in ("rollout", "relay", "cost", "loss", "graft", "val", "eval", "sft"):
            lines.append(f"| {k} | {m[k][0][1]:.4g} | {m[k][-1][1]:.4g} |")
    return lines


def _transfer_lines(exchange: list[dict[str, Any]]) -> list[str]:
    """GRAFT / N peers: the groups each model (row) sent to each (column); [] without any."""
    counts = exchange_counts(exchange)
    if not counts:
        return []
    from salvage.core.peers import transfer_matrix  # torch: only for a run that exchanged

    models = sorted({n for pair in counts for n in pair.split("_to_")})
    matrix = transfer_matrix(counts, models)
    lines = [
        "",
        f"transfer matrix over {len(exchange)} updates (groups sent, row -> column):",
        "",
        "| from \\ to | " + " | ".join(models) + " |",
        "|---|" + "---|" * len(models),
    ]
    for name, row in zip(models, matrix, strict=True):
        cells = ["-" if c == name else f"{x:g}" for c, x in zip(models, row, strict=True)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def summary_lines(
    run: Path,
    m: dict[str, list[tuple[float, float]]],
    records: dict[str, list[dict[str, Any]]],
    mpaths: list[Path],
) -> list[str]:
    """``report.md`` without its plot lines: the metric files, the teacher, the metrics'
    first and last values, GRAFT's transfers and admission, VH-GPO's retained relays."""
    relays, exchange = records["relays"], records["exchange"]
    lines = [
        f"# salvage run report: {run}",
        "",
        f"metrics: {', '.join(f'`{p.relative_to(run)}`' for p in mpaths)}, {len(m)} series",
        "",
    ]
    teachers = sorted({str(r["teacher"]) for r in relays if r.get("teacher")})
    if teachers:  # VH-GPO: which teacher recovered (an oracle is named, never implied)
        names = {"oracle": "oracle (the environment's expert, not the paper's LM teacher)"}
        lines += ["teacher: " + ", ".join(names.get(t, t) for t in teachers), ""]
    lines += _metric_lines(m) + _transfer_lines(exchange)
    rows = exchange_rows(exchange)
    if rows:
        lines += [
            "",
            f"admission by correctness over {len(rows)} transferred responses "
            "(admitted: weight > 0; correct: success):",
            "",
            *admission_lines(admission_by_direction(rows)),
        ]
    kept = retained_relays(relays)
    if kept:
        fr = [r["j_star"] / r["L"] for r in kept]
        lines += [
            "",
            f"retained relays: {len(kept)} of {len(relays)} searched; mean j*/L {sum(fr) / len(fr):.3f}",
        ]
    return lines


def make_report(run_dir: str | Path, version: int | None = None) -> dict[str, Any]:
    """Render the plots (``salvage.plots``) and the summary into ``RUN_DIR/report/``;
    returns {"written": [...], "skipped": {...}, "dir": ..., "admission": {...}}."""
    run = Path(run_dir)
    m, records, mpaths = load_run(run, version)
    plots = render_run_plots(m, records, run / "report")
    written, skipped = list(plots.written), dict(plots.skipped)
    lines = summary_lines(run, m, records, mpaths)
    lines += ["", "plots: " + ", ".join(f"![{w}]({w})" for w in written)]
    if skipped:
        lines += ["", "skipped: " + "; ".join(f"{k} ({v})" for k, v in skipped.items())]
    (plots.dir / "report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    written.append("report.md")
    return {
        "written": written,
        "skipped": skipped,
        "dir": str(plots.dir),
        "admission": admission_by_direction(exchange_rows(records["exchange"])),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="salvage report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("run_dir", help="a run directory (trainer.default_root_dir)")
    ap.add_argument(
        "--version",
        type=int,
        default=None,
        help="report the run ending in RUN_DIR/version_N (default: the newest), with the "
        "versions it resumed from",
    )
    a = ap.parse_args(argv)
    res = make_report(a.run_dir, a.version)
    print(f"wrote {', '.join(res['written'])} to {res['dir']}")
    if res["admission"]:
        print("admitted transferred responses, correct vs incorrect:")
        print("\n".join(admission_lines(res["admission"])))
    for k, why in res["skipped"].items():
        print(f"skipped {k}: {why}")
