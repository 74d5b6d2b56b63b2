"""A run's history for report, compare and joint-cost: every fit version of its lineage,
found relative to the run dir, evaluations left out (hand-made run dirs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from salvage.commands.compare import collect, read_run
from salvage.commands.joint_cost import run_checkpoint_cost
from salvage.history import load_run, run_lineage


def _version(
    run: Path,
    n: int,
    rows: list[dict[str, float]],
    resumed_from: int | None = None,
    recorded_root: str | None = None,
    stage: str | None = "fit",
) -> Path:
    """``run/version_n`` as a fit writes it; ``recorded_root``: where the run dir was when
    the version ran (its config's ``trainer.default_root_dir``; default: where it is)."""
    v = run / f"version_{n}"
    v.mkdir(parents=True)
    root = recorded_root or str(run)
    ckpt = (
        "null" if resumed_from is None else f"{root}/version_{resumed_from}/checkpoints/last.ckpt"
    )
    (v / "config.yaml").write_text(f"trainer:\n  default_root_dir: {root}\nckpt_path: {ckpt}\n")
    if stage is not None:
        (v / "stage.txt").write_text(stage + "\n")
    keys = sorted({k for r in rows for k in r if k != "step"})
    lines = [",".join(["step", *keys])]
    lines += [",".join([str(r["step"]), *(str(r.get(k, "")) for k in keys)]) for r in rows]
    (v / "metrics.csv").write_text("\n".join(lines) + "\n")
    return v


def _train(steps: range, hours_per_step: float = 0.1) -> list[dict[str, float]]:
    return [
        {"step": s, "perf/step_s": 1.0, "cost/gpu_hours": round(hours_per_step * (s + 1), 6)}
        for s in steps
    ]


def _resumed_run(run: Path, recorded_root: str) -> None:
    """Version 0: updates 0-2, best val/aggregate 0.9 after update 1; killed; version 1
    resumed its update-2 checkpoint (redoing update 2) and ran to update 4 (val 0.7)."""
    _version(
        run,
        0,
        [*_train(range(3)), {"step": 1, "val/aggregate": 0.9}, {"step": 2, "val/aggregate": 0.1}],
        recorded_root=recorded_root,
    )
    _version(
        run,
        1,
        [*_train(range(2, 5), 0.2), {"step": 3, "val/aggregate": 0.7}],
        resumed_from=0,
        recorded_root=recorded_root,
    )


@pytest.mark.parametrize("recorded_root", [None, "/somewhere/else/RUN", "runs/RUN"])
def test_joint_cost_and_report_read_the_whole_lineage_of_a_moved_run(tmp_path, recorded_root):
    run = tmp_path / "RUN"
    _resumed_run(run, recorded_root or str(run))
    assert [v.name for v in run_lineage(run)] == ["version_0", "version_1"]
    # the best is version 0's 0.9 after update 1 (checkpoint step 2), not the newest file's
    c = run_checkpoint_cost(run)
    assert (c.score, c.step, c.gpu_hours) == (0.9, 2, pytest.approx(0.2))
    m, _, files = load_run(run)
    assert [f.parent.name for f in files] == ["version_0", "version_1"]
    # update 2 was redone by version 1: its values, once; version 0's val at 2 is dropped
    assert m["cost/gpu_hours"] == [(0, 0.1), (1, 0.2), (2, 0.6), (3, 0.8), (4, 1.0)]
    assert m["val/aggregate"] == [(1, 0.9), (3, 0.7)]
    assert read_run(run)["val/aggregate"] == {1: 0.9, 3: 0.7}


def test_evaluations_written_into_the_run_dir_are_left_out(tmp_path):
    run = tmp_path / "RUN"
    _resumed_run(run, str(run))
    # `salvage test` and `salvage validate` into the run dir, from its last checkpoint
    _version(run, 2, [{"step": 4, "eval/aggregate": 0.3}], resumed_from=1, stage="test")
    _version(run, 3, [{"step": 4, "val/aggregate": 0.01}], resumed_from=1, stage="validate")
    # an older salvage's test version (no stage.txt): only eval/ metrics tell it
    _version(run, 4, [{"step": 0, "eval/success": 0.3}], resumed_from=1, stage=None)
    assert [v.name for v in run_lineage(run)] == ["version_0", "version_1"]
    c = run_checkpoint_cost(run)
    assert (c.score, c.step) == (0.9, 2)
    m, _, _ = load_run(run)
    assert m["val/aggregate"] == [(1, 0.9), (3, 0.7)] and "eval/aggregate" not in m


def test_another_run_in_the_same_dir_is_another_lineage(tmp_path):
    run = tmp_path / "RUN"
    _resumed_run(run, "/old/RUN")
    _version(run, 2, _train(range(2)), recorded_root="/old/RUN")  # a fresh start
    assert [v.name for v in run_lineage(run)] == ["version_2"]
    assert [v.name for v in run_lineage(run, version=1)] == ["version_0", "version_1"]
    # a checkpoint of another run dir (a warm start) is not this run's history
    v3 = _version(run, 3, _train(range(2, 3)), recorded_root="/old/RUN")
    (v3 / "config.yaml").write_text(
        "trainer:\n  default_root_dir: /old/RUN\n"
        "ckpt_path: /elsewhere/OTHER/version_0/checkpoints/last.ckpt\n"
    )
    assert [v.name for v in run_lineage(run)] == ["version_3"]


def test_compare_finds_runs_beside_method_dirs_at_any_depth(tmp_path):
    d = tmp_path / "D"
    _version(d / "baseline_run", 0, [{"step": 0, "val/success": 0.1}])
    _version(d / "vh" / "seed0", 0, [{"step": 0, "val/success": 0.2}])
    _version(d / "vh" / "seed1", 0, [{"step": 0, "val/success": 0.3}])
    _version(d / "group" / "grpo" / "seed0", 0, [{"step": 0, "val/success": 0.4}])
    runs = collect([d])
    assert sorted((r.method, r.seed, r.final("val/success")) for r in runs) == [
        ("D", 0, 0.1),
        ("grpo", 0, 0.4),
        ("vh", 0, 0.2),
        ("vh", 1, 0.3),
    ]
    # a run dir given itself is one run, and given twice is counted once
    assert [r.dir for r in collect([d / "vh" / "seed0", d / "vh" / "seed0"])] == [
        d / "vh" / "seed0"
    ]


def test_a_torn_metrics_file_is_read_as_far_as_it_goes_or_named(tmp_path):
    from salvage.errors import DataError
    from salvage.history import load_metrics

    torn = tmp_path / "torn.csv"
    torn.write_bytes(b"step,a,b\n0,1,2\n1,3,4\n2,5")  # a crash mid-row
    assert load_metrics(torn) == {"a": [(0, 1.0), (1, 3.0), (2, 5.0)], "b": [(0, 2.0), (1, 4.0)]}
    cut = tmp_path / "cut.csv"
    cut.write_bytes("step,note\n0,1\n1,é".encode()[:-1])  # cut inside a UTF-8 character
    with pytest.raises(DataError, match="not UTF-8") as e:
        load_metrics(cut)
    assert str(cut) in str(e.value) and "line 3" in str(e.value)
