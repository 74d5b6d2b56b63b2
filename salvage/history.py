"""A run directory's logged history, read back: what ``salvage report``, ``salvage compare``,
``salvage joint-cost``, a study's regime check and the W&B dashboard's plots all read.

- Run layout: every ``salvage fit`` / ``validate`` / ``test`` invocation writes one
  ``RUN/version_N`` (``run_versions``); ``RUN/version_N/stage.txt`` (``STAGE_FILE``) names
  the stage that wrote it, so evaluations stay out of the fit history (``is_evaluation``).
- A run's fit history is the lineage of versions it resumed through (``run_lineage``, found
  relative to the run dir, so a copied run keeps its history); ``load_run`` merges their
  ``metrics.csv`` and ``relays`` / ``exchange`` JSONL records, a resume's rows replacing the
  ones it redid (``merge_versions``).
- GRAFT exchange records: the per-response rows (``exchange_rows``), ``log s`` of a row,
  the admission of correct and incorrect transferred responses per direction, the groups
  sent per ordered pair (``exchange_counts``).

Light on purpose: the standard library and ``yaml`` only (no torch, no Lightning), so the
commands that read runs start fast.
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from salvage.errors import ConfigError, DataError, MissingFileError
from salvage.io import utf8_text

VERSION_DIR = re.compile(r"^version_(\d+)$")
"""The name of a run version's folder, ``version_N``."""
STAGE_FILE = "stage.txt"
"""``RUN/version_N/stage.txt``: the stage that wrote the version (``fit``, ``validate``,
``test``), so readers of a run's fit history leave evaluations out."""


def run_versions(root: str | Path) -> list[Path]:
    """``root/version_N`` directories in increasing N."""
    r = Path(root)
    if not r.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in r.iterdir() if (m := VERSION_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


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


def exchange_counts(records: list[dict[str, Any]]) -> dict[str, float]:
    """Groups transferred per ordered pair (``<src>_to_<dst>``) over a run's exchange
    records: GRAFT's (``a_to_b`` / ``b_to_a`` lists) and N peers' (``transfers``)."""
    out: dict[str, float] = {}
    for rec in records:
        pairs = rec.get("transfers") or {k: rec[k] for k in ("a_to_b", "b_to_a") if k in rec}
        for pair, prompts in pairs.items():
            out[pair] = out.get(pair, 0.0) + len(prompts)
    return out


def retained_relays(relays: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The VH-GPO relay records that were retained (with their teacher prefix length ``L``)."""
    return [r for r in relays if r.get("retained") and r.get("L")]
