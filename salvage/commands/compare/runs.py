"""The runs ``salvage compare`` compares: found under study / method / run dirs, each with
its method, seed and metric history (``salvage.history.load_run``)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from salvage.errors import ConfigError, DataError
from salvage.history import VERSION_DIR, load_run, ranked_jsonl, run_lineage

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
    """The run's fit history (``salvage.history.run_lineage``: its versions with metrics,
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
    """Metric -> {step: value} over the run's whole history (``salvage.history.load_run``:
    every fit version, a later version winning at a step it redid); {} for a dir without
    fit versions."""
    if not _versions(run_dir):
        return {}
    series, _, _ = load_run(run_dir)
    return {k: dict(pts) for k, pts in series.items()}


def is_run(p: Path) -> bool:
    return p.is_dir() and bool(run_lineage(p))


def _runs_under(p: Path) -> list[Path]:
    """``p`` if it is a run, and every run below it (method dirs, study dirs, and runs
    beside them at any depth), never looking inside ``version_*`` folders nor folders
    named ``_*`` (a study's own ``_calibration`` runs: name such a folder to compare it)."""
    found: list[Path] = []
    if is_run(p):
        found.append(p)
    for child in sorted(
        c
        for c in p.iterdir()
        if c.is_dir() and not VERSION_DIR.match(c.name) and not c.name.startswith("_")
    ):
        found += _runs_under(child)
    return found


def unfinished(study_dir: Path, runs: list[Path]) -> list[Path]:
    """The runs of a study dir (one holding ``study.json``) without ``done.json``: fits the
    study started and has not finished (stopped, crashed, or still running)."""
    if not (study_dir / "study.json").is_file():
        return []
    return [r for r in runs if not (r / "done.json").is_file()]


def collect(
    paths: list[Path], include_unfinished: bool = False, left_out: list[Path] | None = None
) -> list[RunData]:
    """Runs under the given study dirs / run dirs (method = parent folder name): every run
    at any depth below each path, the path itself included. Below a study dir, its runs
    without ``done.json`` are left out (appended to ``left_out``) unless
    ``include_unfinished``: a verdict compares finished runs."""
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
        if not include_unfinished:
            skip = unfinished(p, runs)
            if left_out is not None:
                left_out += skip
            runs = [r for r in runs if r not in skip]
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


def by_method(runs: list[RunData]) -> dict[str, list[RunData]]:
    out: dict[str, list[RunData]] = {}
    for r in runs:
        out.setdefault(r.method, []).append(r)
    return out
