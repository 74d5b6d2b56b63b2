"""Independent baselines' joint cost: the sum of each run through its own best checkpoint (SPEC §3.3)."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

from salvage.commands.joint_cost import joint_cost, run_checkpoint_cost
from salvage.core.cost import SelectedCheckpoint, best_checkpoint_cost, separate_runs_cost
from tests import forked_cli

ROOT = Path(__file__).resolve().parents[1]


def test_best_checkpoint_cost_by_hand():
    hours = [(0, 0.1), (1, 0.2), (2, 0.3), (3, 0.4), (4, 0.5)]
    # best 0.5 first reached after update 3 (logged step 3; checkpoint step 4): 0.4 GPU-h;
    # the later tie (step 4) does not move the selection
    c = best_checkpoint_cost([(1, 0.3), (3, 0.5), (4, 0.5)], hours)
    assert c == SelectedCheckpoint(0.5, 4, 0.4)
    # the cost is the last cumulative value at or before the validated update
    assert best_checkpoint_cost([(2, 0.7)], [(0, 0.1), (1, 0.25), (5, 0.9)]).gpu_hours == 0.25
    assert separate_runs_cost({"a": c, "b": SelectedCheckpoint(0.2, 1, 0.1)}) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no validation score"):
        best_checkpoint_cost([], hours)


def _write(path: Path, rows: list[dict[str, float]]) -> None:
    path.mkdir(parents=True)
    keys = ["step"] + sorted({k for r in rows for k in r if k != "step"})
    with (path / "metrics.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        w.writerows(rows)


def test_joint_cost_of_hand_made_runs(tmp_path):
    # run A: 0.1 GPU-h per update, val/aggregate 0.3 (step 1), 0.5 (step 3), 0.4 (step 4)
    rows = [{"step": s, "cost/gpu_hours": 0.1 * (s + 1)} for s in range(5)]
    rows += [{"step": s, "val/aggregate": v} for s, v in ((1, 0.3), (3, 0.5), (4, 0.4))]
    _write(tmp_path / "A" / "version_0", rows)
    # run B: 0.25 GPU-h per update, best val/aggregate at its first validation (step 0)
    rows = [{"step": s, "cost/gpu_hours": 0.25 * (s + 1)} for s in range(3)]
    rows += [{"step": s, "val/aggregate": v} for s, v in ((0, 0.2), (2, 0.1))]
    _write(tmp_path / "B" / "version_0", rows)
    out = joint_cost([tmp_path / "A", tmp_path / "B"])
    a, b = out["runs"][str(tmp_path / "A")], out["runs"][str(tmp_path / "B")]
    assert (a["score"], a["step"], a["gpu_hours"]) == (0.5, 4, pytest.approx(0.4))
    assert (b["score"], b["step"], b["gpu_hours"]) == (0.2, 1, pytest.approx(0.25))
    # the sum, not the later of the two (0.4) as a joint run would be charged
    assert out["joint_gpu_hours"] == pytest.approx(0.65)


def test_joint_cost_refuses_a_joint_graft_run(tmp_path):
    _write(
        tmp_path / "G" / "version_0",
        [{"step": 0, "cost/gpu_hours": 0.1}, {"step": 0, "a/val/aggregate": 0.1}],
    )
    with pytest.raises(ValueError, match="joint two-model run"):
        run_checkpoint_cost(tmp_path / "G")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        run_checkpoint_cost(tmp_path / "missing")


def _cli(args, tmp_path):
    env = dict(
        os.environ,
        OMP_WAIT_POLICY="PASSIVE",
        TOKENIZERS_PARALLELISM="false",
        SALVAGE_PROGRESS="0",
        COLUMNS="200",
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
    )
    # a process of its own, forked after the imports (tests/forked_cli.py)
    proc = forked_cli.run(args, tmp_path, env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_two_single_model_grpo_runs_joint_cost_is_the_sum(tmp_path):
    runs = []
    for side in ("a", "b"):
        run = tmp_path / f"grpo_{side}"
        _cli(
            [
                "fit",
                "--config",
                str(ROOT / f"configs/grpo/graft_tiny_{side}.yaml"),
                "--trainer.default_root_dir",
                str(run),
                "--trainer.max_steps",
                "2",
                "--trainer.enable_progress_bar",
                "false",
                "--data.init_args.reward",
                "test_eval_repeats.OddLength",  # outcomes vary, so the best step can be either
            ],
            tmp_path,
        )
        assert list(run.glob("**/best-step=*.ckpt"))  # the selected checkpoint was written
        runs.append(run)
    out = json.loads(_cli(["joint-cost", "--json", *map(str, runs)], tmp_path))
    total = 0.0
    for run in runs:
        rows = list(csv.DictReader(next(run.glob("version_0/metrics.csv")).open()))
        # CheckpointCost's own record of the best checkpoint's cost, logged during the run
        logged = [
            float(r["cost/ckpt_gpu_hours/policy"])
            for r in rows
            if r.get("cost/ckpt_gpu_hours/policy")
        ]
        got = out["runs"][str(run)]
        assert got["gpu_hours"] == pytest.approx(logged[-1], rel=1e-9)
        assert got["gpu_hours"] > 0
        total += logged[-1]
    assert out["joint_gpu_hours"] == pytest.approx(total, rel=1e-9)
    table = _cli(["joint-cost", *map(str, runs)], tmp_path)
    assert "joint (sum of the runs)" in table
