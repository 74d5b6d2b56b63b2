"""``salvage joint-cost RUN_DIR [RUN_DIR ...]``: the paper's cost of independent baselines.

GRAFT's GRPO baselines are separate single-model runs (``configs/grpo/graft_*.yaml``);
obtaining both models costs the sum of each run's GPU-hours through its own best
``val/aggregate`` checkpoint (SPEC §3.3, §3.4). This reads each run's whole fit history
(``salvage.history.load_run``: every ``version_N/metrics.csv`` of its lineage, found relative
to the run dir, a resume's rows replacing the ones it redid, ``salvage test`` versions left
out) for ``cost/gpu_hours`` and the validation score, and prints one row per run and the
sum. A negative or non-finite cost is refused, naming the run and the step. A GRAFT run is one joint run (its cost is the later of its two checkpoints,
printed by ``salvage test``) and is refused here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from salvage.core.cost import SelectedCheckpoint, best_checkpoint_cost, separate_runs_cost
from salvage.errors import ConfigError, DataError
from salvage.history import load_run


def run_checkpoint_cost(run_dir: str | Path, key: str = "val/aggregate") -> SelectedCheckpoint:
    """The best ``key`` checkpoint of one run and the GPU-hours through it."""
    run = Path(run_dir)
    series, _, files = load_run(run)
    where = ", ".join(str(f.relative_to(run)) if run in f.parents else str(f) for f in files)
    if key not in series:
        joint = sorted(k for k in series if k.endswith(f"/{key}"))
        if joint:
            raise ConfigError(
                f"{run}: logs {joint}, a joint two-model run: its cost is the later of its "
                "checkpoints (salvage test prints it), not a sum of separate runs"
            )
        raise DataError(f"{run}: {where} has no {key!r} (did the run validate?)")
    if "cost/gpu_hours" not in series:
        raise DataError(f"{run}: {where} has no 'cost/gpu_hours' (CostTracker off?)")
    for step, hours in series["cost/gpu_hours"]:
        if hours < 0:
            raise DataError(
                f"{run}: cost/gpu_hours is negative ({hours:g}) at step {step:g}; a cost "
                "never is (a hand-edited or corrupt metrics.csv?)"
            )
    return best_checkpoint_cost(series[key], series["cost/gpu_hours"])


def joint_cost(run_dirs: list[str | Path], key: str = "val/aggregate") -> dict[str, Any]:
    """Per run (its checkpoint) and ``joint_gpu_hours``, the sum over the runs."""
    runs = {str(r): run_checkpoint_cost(r, key) for r in run_dirs}
    return {
        "runs": {r: c.__dict__ for r, c in runs.items()},
        "joint_gpu_hours": separate_runs_cost(runs),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="salvage joint-cost",
        description="GPU-hours of separate single-model runs, each through its own best "
        "checkpoint, and their sum (the paper's cost of independent GRPO baselines).",
    )
    p.add_argument("run_dirs", nargs="+", help="run directories (trainer.default_root_dir)")
    p.add_argument("--key", default="val/aggregate", help="validation score that selects")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    try:
        out = joint_cost(args.run_dirs, args.key)
    except (FileNotFoundError, ValueError) as e:
        print(f"salvage joint-cost: error: {' '.join(str(e).split())}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.json:
        print(json.dumps(out, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="checkpoint cost of separate runs (SPEC 3.3: the sum)")
    for col in ("run", f"best {args.key}", "step", "GPU-hours"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for run, c in out["runs"].items():
        table.add_row(run, f"{c['score']:.4f}", str(c["step"]), f"{c['gpu_hours']:.6g}")
    table.add_row("joint (sum of the runs)", "", "", f"{out['joint_gpu_hours']:.6g}")
    Console(width=200).print(table)
