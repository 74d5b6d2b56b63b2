"""``salvage report RUN_DIR``: PNG plots and a markdown summary of a run.

Reads the run's whole history: every ``RUN_DIR/version_N`` (one per ``salvage fit``
invocation: the first run and each resume) in order, its ``metrics.csv`` (CSV logger) and,
where present, ``relays.jsonl`` (VH-GPO) and ``exchange.jsonl`` (GRAFT). A resume redoes the
updates after its checkpoint: what an interrupted version logged for those updates is
replaced by the resumed version's, never counted twice (``load_run``). Writes into
``RUN_DIR/report/``: ``rewards.png``, ``zero_signal.png``, ``extra_tokens.png``,
``relays.png`` (per-relay teacher actions kept vs omitted), ``graft.png`` (transfers per
direction, compatibility weights), ``compat.png`` (GRAFT: the distribution of ``log s`` of
the transferred responses, one panel per direction, a vertical line at ``log delta``),
``cost.png`` (GPU-hours vs score) and ``report.md``. With per-response exchange rows
(``exchange.jsonl``'s ``responses``), ``report.md`` also gets, per direction, the fraction
of correct (``success``) and of incorrect transferred responses that were admitted
(``admitted``: weight > 0), also printed. A plot whose metrics the run did not log is
skipped and named in the summary.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from salvage.core.peers import transfer_matrix
from salvage.errors import ConfigError, DataError, MissingFileError
from salvage.io import utf8_text


def _newest(run_dir: Path, name: str) -> Path | None:
    files = sorted(run_dir.rglob(name), key=lambda p: p.stat().st_mtime)
    return files[-1] if files else None


def load_metrics(path: Path) -> dict[str, list[tuple[float, float]]]:
    """Column -> [(step, value)] for every non-empty cell; a torn last row (a crash mid-write)
    is read as far as it goes. A file that is not CSV text is a ``DataError`` naming it."""
    series: dict[str, list[tuple[float, float]]] = {}
    for row in _csv_rows(path):
        step = row.get("step")
        if step in (None, ""):
            continue
        try:
            at = float(step)
        except ValueError:
            continue  # a torn row
        for k, v in row.items():
            if k in ("step", "epoch") or v in (None, "") or not isinstance(v, str):
                continue
            try:
                val = float(v)
            except ValueError:
                continue
            if math.isfinite(val):
                series.setdefault(k, []).append((at, val))
    return series


def _csv_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics CSV; ``DataError`` naming the file when it cannot be read."""
    import io

    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"metrics file {str(path)!r} cannot be read: {e.strerror or e}") from None
    text = utf8_text(raw, f"metrics file {str(path)!r}")
    try:
        return list(csv.DictReader(io.StringIO(text, newline="")))
    except csv.Error as e:
        raise DataError(f"metrics file {str(path)!r} is not readable CSV: {e}") from None


def _jsonl(path: Path | None) -> list[dict[str, Any]]:
    if path is None:
        return []
    out = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError(f"record file {str(path)!r} is not UTF-8 text") from None
    for line in text.splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line after a crash
    return out


def _train_steps(path: Path) -> list[float]:
    out = []
    for r in _csv_rows(path):
        try:
            if r.get("step") and r.get("perf/step_s"):
                out.append(float(r["step"]))
        except (TypeError, ValueError):
            continue  # a torn row
    return out


def is_evaluation(version: Path) -> bool:
    """Whether ``RUN/version_N`` was written by ``salvage validate`` / ``salvage test`` (its
    ``stage.txt``), not by a fit; a version without one (older salvage) counts as an
    evaluation when it logged only ``eval/`` or ``test/`` metrics."""
    from salvage.checkpointing import STAGE_FILE

    stage = version / STAGE_FILE
    if stage.is_file():
        return stage.read_text(encoding="utf-8").strip() != "fit"
    keys = {k for k in _header(version / "metrics.csv") if k not in ("step", "epoch")}
    return bool(keys) and all(k.startswith(("eval/", "test/")) for k in keys)


def _header(path: Path) -> list[str]:
    try:
        with path.open(newline="", encoding="utf-8") as f:
            return next(csv.reader(f), [])
    except (OSError, UnicodeDecodeError):
        return []


def _resumed_from(run: Path, version: Path, by_name: dict[str, Path]) -> Path | None | bool:
    """The version of ``run`` that ``version`` resumed from (``ckpt_path`` in its
    ``config.yaml``), found relative to the run dir, so a copied or moved run keeps its
    history: a checkpoint under the run dir it was written in (``trainer.default_root_dir``
    of the same config) is looked up at the same relative place in ``run``. None: a fresh
    start or another run's checkpoint; False: no ``config.yaml`` to tell."""
    import os

    import yaml

    cfg_file = version / "config.yaml"
    if not cfg_file.exists():
        return False
    try:
        cfg = yaml.safe_load(cfg_file.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise DataError(f"{cfg_file}: not a readable run config ({type(e).__name__})") from None
    ckpt = cfg.get("ckpt_path") if isinstance(cfg, dict) else None
    if not ckpt:
        return None
    root = ((cfg.get("trainer") or {}) if isinstance(cfg, dict) else {}).get("default_root_dir")
    rel: Path | None = None
    if root:
        c, r = str(ckpt), str(root)
        if os.path.isabs(c) != os.path.isabs(r):
            c, r = os.path.abspath(c), os.path.abspath(r)
        c, r = os.path.normpath(c), os.path.normpath(r)
        if c.startswith(r.rstrip(os.sep) + os.sep):
            rel = Path(os.path.relpath(c, r))
    if rel is None:  # no recorded root: the checkpoint as it lies now
        resolved = Path(ckpt).resolve()
        if run.resolve() in resolved.parents:
            rel = resolved.relative_to(run.resolve())
    if rel is None or not rel.parts:
        return None
    return by_name.get(rel.parts[0])  # RUN/version_M/checkpoints/last.ckpt -> version_M


def _lineage(run: Path, versions: list[Path], version: int | None) -> list[Path]:
    """The versions of one run, oldest first: from the chosen (default newest) version back
    through the checkpoint each one resumed from (``_resumed_from``). A second run started
    in the same RUN dir is another lineage and is left out."""
    by_name = {v.name: v for v in versions}
    cur = by_name.get(f"version_{version}") if version is not None else versions[-1]
    if cur is None:
        raise DataError(f"{run} has no fit version_{version} with metrics")
    chain = [cur]
    while True:
        prev = _resumed_from(run, cur, by_name)
        if prev is False:  # no record of where it resumed from: take the dir order
            n = int(cur.name.split("_")[1])
            older = [v for v in versions if int(v.name.split("_")[1]) < n]
            return [v for v in older if v not in chain] + chain[::-1]
        if prev is None or prev in chain:
            return chain[::-1]
        assert isinstance(prev, Path)
        chain.append(prev)
        cur = prev


def run_lineage(run_dir: str | Path, version: int | None = None) -> list[Path]:
    """The ``version_N`` dirs of a run's fit history, oldest first (``_lineage``); the
    versions ``salvage validate`` / ``test`` wrote into the run dir are left out
    (``is_evaluation``). [] when ``run_dir`` has no ``version_N`` with metrics."""
    from salvage.checkpointing import run_versions

    run = Path(run_dir)
    versions = [
        v for v in run_versions(run) if (v / "metrics.csv").is_file() and not is_evaluation(v)
    ]
    return _lineage(run, versions, version) if versions else []


def merge_versions(
    per_version: list[dict[str, list[tuple[float, float]]]], starts: list[float | None]
) -> dict[str, list[tuple[float, float]]]:
    """One run's metric series from its versions' (oldest first): version k+1's first
    training step s marks where it resumed, so version k's points at steps >= s (updates
    that were interrupted and redone) are dropped, and a later version's point at a step
    replaces an earlier one's at that step."""
    series: dict[str, list[tuple[float, float]]] = {}
    for k in range(len(per_version) - 1, -1, -1):  # newest first: later versions win
        later = [s for s in starts[k + 1 :] if s is not None]
        cut = min(later) if later else math.inf
        for key, pts in per_version[k].items():
            have = {st for st, _ in series.get(key, [])}
            series.setdefault(key, []).extend(
                (st, val) for st, val in pts if st < cut and st not in have
            )
    for pts in series.values():
        pts.sort(key=lambda p: p[0])
    return series


def load_run(
    run_dir: str | Path, version: int | None = None
) -> tuple[dict[str, list[tuple[float, float]]], dict[str, list[dict[str, Any]]], list[Path]]:
    """A run's history across resumes: (metric series, jsonl records by stem, metric files).

    The versions of the run (``run_lineage``: fit versions only, found relative to the run
    dir) are merged by ``merge_versions``; ``relays`` / ``exchange`` records of an
    interrupted version at steps a later version redid are dropped too. A run dir without
    ``version_N`` folders falls back to the newest ``metrics.csv`` below it.
    """
    run = Path(run_dir)
    if not run.exists():
        raise MissingFileError(f"run dir {str(run)!r} does not exist")
    if not run.is_dir():
        raise ConfigError(f"run dir {str(run)!r} is not a directory")
    versions = run_lineage(run, version)
    if not versions:
        newest = _newest(run, "metrics.csv")
        if newest is None:
            raise MissingFileError(
                f"run dir {str(run)!r} holds no metrics.csv (is it a run directory, "
                "trainer.default_root_dir of a fit?)"
            )
        versions = [newest.parent]
    per: list[dict[str, list[tuple[float, float]]]] = []
    recs: list[dict[str, list[dict[str, Any]]]] = []
    starts: list[float | None] = []
    for v in versions:
        recs.append(
            {
                stem: ranked_jsonl(
                    v / f"{stem}.jsonl" if (v / f"{stem}.jsonl").exists() else None, stem
                )
                for stem in ("relays", "exchange")
            }
        )
        per.append(load_metrics(v / "metrics.csv"))
        steps = _train_steps(v / "metrics.csv")
        starts.append(min(steps) if steps else None)
    series = merge_versions(per, starts)
    records: dict[str, list[dict[str, Any]]] = {"relays": [], "exchange": []}
    for k, rs_by_stem in enumerate(recs):
        later = [s for s in starts[k + 1 :] if s is not None]
        cut = min(later) if later else math.inf  # a later version redid these steps
        for stem, rs in rs_by_stem.items():
            records[stem].extend(r for r in rs if float(r.get("step", -1)) < cut)
    return series, records, [v / "metrics.csv" for v in versions]


def ranked_jsonl(path: Path | None, stem: str) -> list[dict[str, Any]]:
    """Records of rank 0 (``<stem>.jsonl``) and of the other ranks (``<stem>.rank<r>.jsonl``)."""
    if path is None:
        return []
    out = _jsonl(path)
    for extra in sorted(path.parent.glob(f"{stem}.rank*.jsonl")):
        out.extend(_jsonl(extra))
    return out


# ------------------------------------------------------------------ GRAFT exchange rows


def exchange_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-response rows (``responses``) of a run's exchange records, in order (records
    written before rows were recorded have none)."""
    return [row for rec in records for row in rec.get("responses") or []]


def log_s(row: dict[str, Any]) -> float:
    """``log s = lbar_recv - lbar_src`` of an exchange row (``log(s)`` without the parts)."""
    if row.get("lbar_recv") is not None and row.get("lbar_src") is not None:
        return float(row["lbar_recv"]) - float(row["lbar_src"])
    s = row.get("s")
    return math.log(s) if isinstance(s, (int, float)) and s > 0 else -math.inf


def is_correct(row: dict[str, Any]) -> bool:
    """A transferred response is correct when it succeeded (``reward > 0`` without ``success``)."""
    ok = row.get("success")
    return bool(ok) if ok is not None else float(row.get("reward") or 0.0) > 0


@dataclass
class Admission:
    """Transferred responses of one direction, correct and incorrect, and how many of each
    were admitted."""

    correct: int = 0
    correct_admitted: int = 0
    incorrect: int = 0
    incorrect_admitted: int = 0

    def add(self, row: dict[str, Any]) -> None:
        admitted = bool(row.get("admitted"))
        if is_correct(row):
            self.correct += 1
            self.correct_admitted += admitted
        else:
            self.incorrect += 1
            self.incorrect_admitted += admitted

    @staticmethod
    def cell(k: int, n: int) -> str:
        """``k/n (fraction)``; ``0/0 (n/a)`` when there were none."""
        return f"{k}/{n} ({k / n:.3f})" if n else "0/0 (n/a)"


def admission_by_direction(rows: list[dict[str, Any]]) -> dict[str, Admission]:
    """Per direction (``<src>_to_<dst>``, in first-seen order): correct / incorrect transferred
    responses and the admitted ones among them."""
    out: dict[str, Admission] = {}
    for row in rows:
        out.setdefault(str(row.get("direction")), Admission()).add(row)
    return out


def exchange_delta(records: list[dict[str, Any]]) -> float | None:
    """The gate threshold ``delta`` the records name (the first one; None if none does)."""
    return next((float(r["delta"]) for r in records if r.get("delta") is not None), None)


def plot_log_s(
    rows_by_label: dict[str, list[dict[str, Any]]], delta: float | None, path: Path
) -> bool:
    """Histograms of ``log s``, one panel per direction, one histogram per label (a run or a
    method), a vertical line at ``log delta``. False when there are no rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directions = list(
        dict.fromkeys(str(r.get("direction")) for rs in rows_by_label.values() for r in rs)
    )
    if not directions:
        return False
    fig, axes = plt.subplots(
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


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


def make_report(run_dir: str | Path, version: int | None = None) -> dict[str, Any]:
    """Render the plots and the summary; returns {"written": [...], "skipped": {...}}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    m, records, mpaths = load_run(run, version)
    relays, exchange = records["relays"], records["exchange"]
    out = run / "report"
    out.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    skipped: dict[str, str] = {}

    def plot_lines(name: str, keys: list[str], title: str, ylabel: str) -> None:
        have = [k for k in keys if k in m]
        if not have:
            skipped[name] = f"none of {keys} logged"
            return
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for k in have:
            xs, ys = zip(*m[k], strict=True)
            ax.plot(xs, ys, marker="o", ms=3, label=k)
        ax.set_xlabel("update")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)

    plot_lines(
        "rewards.png",
        [
            "rollout/reward_mean",
            "rollout/success_rate",
            "val/success",
            "a/rollout/success_rate",
            "b/rollout/success_rate",
        ],
        "reward and success",
        "value",
    )
    plot_lines(
        "zero_signal.png",
        ["rollout/zero_signal_frac"],
        "zero-signal groups (fraction of the batch)",
        "fraction",
    )
    plot_lines(
        "extra_tokens.png",
        [
            "cost/extra_tokens_teacher",
            "cost/extra_tokens_search",
            "cost/extra_tokens_confirm",
            "cost/extra_tokens_student",
        ],
        "cumulative extra output tokens",
        "tokens",
    )

    kept = [r for r in relays if r.get("retained") and r.get("L")]
    if kept:
        fig, ax = plt.subplots(figsize=(6, 3.6))
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
        fig.tight_layout()
        fig.savefig(out / "relays.png", dpi=110)
        plt.close(fig)
        written.append("relays.png")
    else:
        skipped["relays.png"] = "no retained relay in relays.jsonl"

    pair_keys = ["graft/transferred_a_to_b", "graft/transferred_b_to_a"]
    pair_keys += sorted(k for k in m if k.startswith("graft/transferred/"))
    if exchange or any(k in m for k in pair_keys):
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
        for k in pair_keys:
            if k in m:
                xs, ys = zip(*m[k], strict=True)
                axes[0].plot(xs, ys, marker="o", ms=3, label=k)
        axes[0].set_title("transfers per direction")
        axes[0].set_xlabel("update")
        axes[0].legend(fontsize=7)
        weights = [w for e in exchange for w in e.get("weights", [])]
        axes[1].hist(weights or [0.0], bins=20, range=(0, 1))
        axes[1].set_title("compatibility weights")
        fig.tight_layout()
        fig.savefig(out / "graft.png", dpi=110)
        plt.close(fig)
        written.append("graft.png")
    else:
        skipped["graft.png"] = "not a GRAFT run"

    rows = exchange_rows(exchange)
    if plot_log_s({"run": rows}, exchange_delta(exchange), out / "compat.png"):
        written.append("compat.png")
    else:
        skipped["compat.png"] = "no per-response rows in exchange.jsonl"

    score_key = next(
        (k for k in ("val/aggregate", "val/success", "rollout/success_rate") if k in m), None
    )
    if "cost/gpu_hours" in m and score_key:
        cost = dict(m["cost/gpu_hours"])
        pts = [(cost[s], v) for s, v in m[score_key] if s in cost]
        if pts:
            fig, ax = plt.subplots(figsize=(6, 3.6))
            ax.plot(*zip(*pts, strict=True), marker="o", ms=3)
            ax.set_xlabel("GPU-hours (device-hours on CPU)")
            ax.set_ylabel(score_key)
            ax.set_title("score vs cost")
            ax.grid(alpha=0.3)
            fig.tight_layout()
            fig.savefig(out / "cost.png", dpi=110)
            plt.close(fig)
            written.append("cost.png")
    if "cost.png" not in written:
        skipped["cost.png"] = "cost/gpu_hours or a score not logged"

    last = {k: v[-1][1] for k, v in m.items()}
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
    lines += ["| metric | first | last |", "|---|---|---|"]
    for k in sorted(m):
        if k.split("/")[0] in ("rollout", "relay", "cost", "loss", "graft", "val", "eval", "sft"):
            lines.append(f"| {k} | {m[k][0][1]:.4g} | {last[k]:.4g} |")
    counts = exchange_counts(exchange)
    if counts:  # GRAFT / N peers: groups sent by each model (row) to each (column)
        models = sorted({n for pair in counts for n in pair.split("_to_")})
        matrix = transfer_matrix(counts, models)
        lines += [
            "",
            f"transfer matrix over {len(exchange)} updates (groups sent, row -> column):",
            "",
            "| from \\ to | " + " | ".join(models) + " |",
            "|---|" + "---|" * len(models),
        ]
        for name, row in zip(models, matrix, strict=True):
            cells = ["-" if c == name else f"{x:g}" for c, x in zip(models, row, strict=True)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if rows:
        lines += [
            "",
            f"admission by correctness over {len(rows)} transferred responses "
            "(admitted: weight > 0; correct: success):",
            "",
            *admission_lines(admission_by_direction(rows)),
        ]
    if kept:
        fr = [r["j_star"] / r["L"] for r in kept]
        lines += [
            "",
            f"retained relays: {len(kept)} of {len(relays)} searched; mean j*/L {sum(fr) / len(fr):.3f}",
        ]
    lines += ["", "plots: " + ", ".join(f"![{w}]({w})" for w in written)]
    if skipped:
        lines += ["", "skipped: " + "; ".join(f"{k} ({v})" for k, v in skipped.items())]
    (out / "report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    written.append("report.md")
    return {
        "written": written,
        "skipped": skipped,
        "dir": str(out),
        "admission": admission_by_direction(rows),
    }


def exchange_counts(records: list[dict[str, Any]]) -> dict[str, float]:
    """Groups transferred per ordered pair (``<src>_to_<dst>``) over a run's exchange
    records: GRAFT's (``a_to_b`` / ``b_to_a`` lists) and N peers' (``transfers``)."""
    out: dict[str, float] = {}
    for rec in records:
        pairs = rec.get("transfers") or {k: rec[k] for k in ("a_to_b", "b_to_a") if k in rec}
        for pair, prompts in pairs.items():
            out[pair] = out.get(pair, 0.0) + len(prompts)
    return out


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
