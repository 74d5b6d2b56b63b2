"""ValidateFirst: a held-out point before update 1, logged at step 0; not again on resume."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from tests import forked_cli

ROOT = Path(__file__).resolve().parents[1]
VAL = json.dumps(
    [{"source": "reasoning_gym:basic_arithmetic", "name": "add", "size": 8, "seed": 5000}]
)


def _fit(run: Path, cwd: Path, *extra: str):
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", WANDB_MODE="offline")
    args = [
        "fit",
        "--config",
        str(ROOT / "configs/graft/math_tiny.yaml"),
        "--trainer.default_root_dir",
        str(run),
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.val_check_interval",
        "2",
        "--trainer.check_val_every_n_epoch",
        "null",
        "--trainer.callbacks",
        '[{"class_path": "salvage.callbacks.validate_first.ValidateFirst"}]',
        "--data.init_args.val",
        VAL,
        "--data.init_args.val_samples",
        "1",
        "--data.init_args.engine",
        '{"temperature": 1.0, "max_new_tokens": 8}',
        *extra,
    ]
    proc = forked_cli.run(args, cwd, env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _val_steps(metrics: Path) -> list[str]:
    return [r["step"] for r in csv.DictReader(metrics.open()) if r.get("a/val/success/add")]


def test_validate_first_logs_a_start_point_and_not_again_on_resume(tmp_path):
    run = tmp_path / "RUN"
    _fit(run, tmp_path, "--trainer.max_steps", "2")
    (first,) = sorted(run.glob("version_*/metrics.csv"))
    # before update 1 (step 0), then after update 2 (step 1, as Lightning logs it)
    assert _val_steps(first) == ["0", "1"]
    _fit(run, tmp_path, "--trainer.max_steps", "4", "--ckpt_path", "last")
    second = sorted(run.glob("version_*/metrics.csv"))[-1]
    assert second != first
    assert _val_steps(second) == ["3"]  # after update 4 only: no second start point
