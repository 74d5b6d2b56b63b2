"""The regime check of ``salvage study``: short calibration runs measured against criteria.

``check_regime`` runs (or reuses) the calibration runs (``calibration_runs``), measures each
criterion on its run's metrics (``evaluate``), prints the table (``regime_table``) and
records it in ``STUDY_DIR/regime.json``; a failed criterion stops the study (exit 3) unless
``--skip-regime``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from salvage.commands import EXIT_STOPPED
from salvage.commands.study.runner import (
    EXIT_FAILED,
    STOPPED,
    now,
    ran_with_other_args,
    recorded_command,
    run_all,
    stop_code,
    stop_requested,
    write_json,
)
from salvage.commands.study.spec import COMPARISONS, Criterion, Run, Study, calibration_runs

EXIT_REGIME = 3
"""Exit status of a study whose regime check failed (no record run started)."""


@dataclass
class Verdict:
    """A criterion measured on the calibration run."""

    criterion: Criterion
    value: float | None
    """The statistic; None when the metric (or a row in ``steps``) is missing."""
    passed: bool
    rows: int
    """How many logged updates the statistic is over."""
    why: str = ""
    """Why there is no value."""
    values: list[tuple[int, float]] = field(default_factory=list)
    """The per-update values the statistic is over: (1-based update, value)."""

    def line(self) -> str:
        c = self.criterion
        if self.value is None:
            return f"{c.describe()}: {self.why}"
        return f"{c.describe()}: measured {self.value:.6g} over {self.rows} update(s)"


def _mean(v: list[float]) -> float:
    return sum(v) / len(v)


STAT_FUNCTIONS: dict[str, Callable[[list[float], int], float]] = {
    "mean": lambda v, k: _mean(v),
    "min": lambda v, k: min(v),
    "max": lambda v, k: max(v),
    "last": lambda v, k: v[-1],
    # the learning criterion: the last k updates' mean minus the first k's
    "gain": lambda v, k: _mean(v[-k:]) - _mean(v[:k]),
}
"""Each ``stat`` of a criterion on its per-update values (in update order) and its ``k``."""


def evaluate(criteria: list[Criterion], series: dict[str, dict[float, float]]) -> list[Verdict]:
    """Each criterion on a run's metrics (``salvage.commands.compare.read_run``: metric -> {step: value}).

    Update ``k`` (1-based) is the ``step`` value ``k - 1``: Lightning logs the metrics of
    update k, and the validation after it, at ``step`` = k - 1. A missing metric, or one
    without a row in ``steps``, fails the criterion and says why.
    """
    out = []
    for c in criteria:
        pts = sorted(series.get(c.metric, {}).items())
        if not pts:
            # the metrics of the same namespace first (a misspelt name is among them)
            ns = c.metric.split("/", 1)[0]
            names = sorted(series, key=lambda k: (k.split("/", 1)[0] != ns, k))
            shown = ", ".join(names[:40]) + (
                f" (+{len(names) - 40} more)" if len(names) > 40 else ""
            )
            why = (
                f"{c.metric} is not in the calibration's metrics.csv (it has: {shown or 'nothing'})"
            )
            out.append(Verdict(c, None, False, 0, why))
            continue
        if c.steps is not None:
            lo, hi = c.steps
            kept = [(s, v) for s, v in pts if lo - 1 <= s <= hi - 1]
            if not kept:
                why = (
                    f"{c.metric} has no row in updates {lo}-{hi} (logged at updates "
                    f"{int(pts[0][0]) + 1}-{int(pts[-1][0]) + 1})"
                )
                out.append(Verdict(c, None, False, 0, why))
                continue
        else:
            kept = pts
        values = [(int(s) + 1, v) for s, v in kept]
        sel = [v for _, v in kept]
        if c.stat == "gain":
            assert c.k is not None
            if len(sel) < 2 * c.k:
                why = (
                    f"{c.metric} has {len(sel)} logged update(s) where gain over k={c.k} needs "
                    f"{2 * c.k}"
                )
                out.append(Verdict(c, None, False, len(sel), why, values))
                continue
        value = STAT_FUNCTIONS[c.stat](sel, c.k or 1)
        out.append(Verdict(c, value, COMPARISONS[c.op](value, c.threshold), len(sel), "", values))
    return out


def regime_table(verdicts: list[Verdict]) -> str:
    """The criteria as a text table: metric, stat, updates, measured value, threshold, result."""
    head = ("metric", "stat", "updates", "value", "threshold", "result")
    rows = [
        (
            (f"{v.criterion.method}: " if v.criterion.method else "") + v.criterion.metric,
            v.criterion.stat + (f" k={v.criterion.k}" if v.criterion.k else ""),
            "all" if v.criterion.steps is None else "{}-{}".format(*v.criterion.steps),
            "missing" if v.value is None else f"{v.value:.6g}",
            f"{v.criterion.op} {v.criterion.threshold:g}",
            "pass" if v.passed else "FAIL",
        )
        for v in verdicts
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join(
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
        for r in [head, *rows]
    )


def _calibrate(
    study: Study, cals: list[Run], backend: str, address: str | None, jobs: int | None = None
) -> int | None:
    """Run the unfinished calibration runs, ``jobs`` at a time (None: all side by side, as the
    Ray backend does); the exit code to stop the study with when one did not finish, else
    None."""
    for c in cals:
        if c.done and ran_with_other_args(c):
            print(
                f"warning: the calibration {c.dir} is done but was run with other arguments "
                f"than the study now gives; delete {c.dir} to recalibrate",
                file=sys.stderr,
            )
    todo = [c for c in cals if not c.done]
    for c in todo:
        print(f"study {study.name}: regime check: calibration -> {c.dir}", flush=True)
    at_once = len(todo) if jobs is None else max(1, min(jobs, len(todo)))
    outcomes = run_all(study, todo, backend, address, at_once) if todo else []
    if not outcomes:
        return None
    rc = outcomes[0][1]
    print(
        f"study {study.name}: the calibration did not finish (exit {rc}); no record run started",
        file=sys.stderr,
    )
    if stop_requested():
        return stop_code()
    return EXIT_STOPPED if rc in STOPPED else EXIT_FAILED


def _record(study: Study, cals: list[Run], verdicts: list[Verdict], skip: bool) -> dict[str, Any]:
    """What ``regime.json`` holds: the verdicts, the calibration's command, when checked."""
    assert study.regime is not None
    cal = cals[0]
    return {
        "passed": all(v.passed for v in verdicts),
        "skipped": skip,
        "method": cal.method,
        "seed": cal.seed,
        "run_dir": str(cal.dir),
        "command": recorded_command(cal) or cal.command(),
        "runs": {c.method: str(c.dir) for c in cals},
        "checked": now(),
        "criteria": [
            {
                "method": v.criterion.method or study.regime.method,
                "metric": v.criterion.metric,
                "stat": v.criterion.stat,
                "steps": None if v.criterion.steps is None else list(v.criterion.steps),
                "op": v.criterion.op,
                "threshold": v.criterion.threshold,
                **({"k": v.criterion.k} if v.criterion.k is not None else {}),
                "value": v.value,
                "rows": v.rows,
                "values": [[u, x] for u, x in v.values],
                "result": "pass" if v.passed else "FAIL",
                **({"why": v.why} if v.why else {}),
            }
            for v in verdicts
        ],
    }


def check_regime(
    study: Study,
    out_dir: Path,
    backend: str = "local",
    address: str | None = None,
    skip: bool = False,
    jobs: int | None = None,
) -> tuple[int | None, dict[str, Any]]:
    """Run (or reuse) the calibration, print and record its criteria in ``regime.json``.

    Returns the exit code to stop the study with, None to go on to the record runs (every
    criterion passed, or ``skip``): 3 when a criterion failed, the calibration's failure or
    stop otherwise; and what ``regime.json`` holds (empty when the calibration did not end)."""
    from salvage.commands.compare import read_run

    cals = calibration_runs(study, out_dir)
    assert cals and study.regime is not None
    rc = _calibrate(study, cals, backend, address, jobs)
    if rc is not None:
        return rc, {}
    series = {c.method: read_run(c.dir) for c in cals}
    verdicts = [
        evaluate([k], series[k.method or study.regime.method])[0] for k in study.regime.criteria
    ]
    where = ", ".join(f"{c.label} ({c.dir})" for c in cals)
    print(f"study {study.name}: regime check on {where}:")
    print(regime_table(verdicts), flush=True)
    record = _record(study, cals, verdicts, skip)
    write_json(out_dir / "regime.json", record)
    if record["passed"]:
        return None, record
    for v in verdicts:
        if not v.passed:
            print(f"regime: FAIL: {v.line()}", file=sys.stderr)
    if skip:
        print(f"study {study.name}: --skip-regime: starting the record runs anyway", flush=True)
        return None, record
    print(
        f"study {study.name}: the regime check failed (see {out_dir / 'regime.json'}); no record "
        "run started (--skip-regime to run them anyway)",
        file=sys.stderr,
    )
    return EXIT_REGIME, record
