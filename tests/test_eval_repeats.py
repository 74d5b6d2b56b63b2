"""``salvage test --repeats N``: N evaluation runs of one checkpoint, mean ± std (SPEC §3.4)."""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

import pytest

from salvage.callbacks.repeats import repeat_rows, repeats_argv
from salvage.core.evaluation import mean_std, repeat_metrics, repeat_stream, split_repeats
from salvage.tasks.math import Reward, RewardResult
from tests import forked_cli

ROOT = Path(__file__).resolve().parents[1]


class OddLength(Reward):
    """A test verifier whose outcome depends on the sampled text (about half succeed), so
    repeats with different seeds give different pass@1 even for an untrained model."""

    def __call__(self, response: str, answer: str) -> RewardResult:
        ok = len(response) % 2 == 1
        return RewardResult(float(ok), ok)


def test_split_repeats_and_streams():
    # 3 tasks, 2 repeats: loader indices 0..5; 4 -> repeat 1, task 1
    assert split_repeats([2, 3, 4], 3) == {0: [2], 1: [0, 1]}
    assert repeat_stream(0) == 1  # repeat 0 samples exactly like a single run
    assert len({repeat_stream(r) for r in range(5)}) == 5
    with pytest.raises(ValueError, match="n_tasks=0"):
        split_repeats([0], 0)


def test_repeat_metrics_by_hand():
    # repeat 0: math 3/4, amc 1/2 -> aggregate 0.625; repeat 1: math 1/4, amc 1/2 -> 0.375
    counts = {(0, "math"): (3, 4), (0, "amc"): (1, 2), (1, "math"): (1, 4), (1, "amc"): (1, 2)}
    m = repeat_metrics("eval", counts)
    assert m["eval/repeat_0/aggregate"] == 0.625 and m["eval/repeat_1/aggregate"] == 0.375
    # mean 0.5, sample std sqrt((0.125^2 + 0.125^2) / 1) = 0.176777
    assert m["eval/aggregate"] == 0.5
    assert m["eval/aggregate_std"] == pytest.approx(0.1767767, abs=1e-6)
    assert m["eval/success/math"] == 0.5
    assert m["eval/success/math_std"] == pytest.approx(math.sqrt(0.125), abs=1e-6)
    assert m["eval/success/amc"] == 0.5 and m["eval/success/amc_std"] == 0.0
    assert mean_std([0.7]) == (0.7, 0.0)
    with pytest.raises(ValueError, match="repeat 0 has no samples of"):
        repeat_metrics("eval", {(0, "math"): (1, 2), (1, "amc"): (1, 2)})


def test_repeats_argv():
    assert repeats_argv(["test", "--repeats", "5", "--config", "c.yaml"]) == [
        "test",
        "--config",
        "c.yaml",
        "--data.init_args.test_repeats",
        "5",
    ]
    assert repeats_argv(["test", "--repeats=2"])[-2:] == ["--data.init_args.test_repeats", "2"]
    assert repeats_argv(["fit", "--repeats", "5"]) == ["fit", "--repeats", "5"]
    with pytest.raises(SystemExit, match="whole number"):
        repeats_argv(["test", "--repeats", "0"])


def test_repeat_rows_pair_means_with_their_repeats():
    m = {
        "eval/aggregate": 0.5,
        "eval/aggregate_std": 0.1,
        "eval/repeat_0/aggregate": 0.4,
        "eval/repeat_1/aggregate": 0.6,
        "a/eval/success/x": 0.2,
        "a/eval/success/x_std": 0.0,
        "a/eval/repeat_0/success/x": 0.2,
    }
    assert repeat_rows(m) == [
        ("a/eval/success/x", 0.2, 0.0, [0.2]),
        ("eval/aggregate", 0.5, 0.1, [0.4, 0.6]),
    ]


def _test_run(tmp_path, config, extra, name):
    env = dict(
        os.environ,
        OMP_WAIT_POLICY="PASSIVE",
        TOKENIZERS_PARALLELISM="false",
        SALVAGE_PROGRESS="0",
        COLUMNS="200",
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
    )
    run = tmp_path / name
    val = (
        "[{source: 'reasoning_gym:basic_arithmetic', size: 3, name: arith},"
        " {source: 'reasoning_gym:basic_arithmetic', size: 2, seed: 1, name: arith2}]"
    )
    # a process forked after the CLI's imports (tests/forked_cli.py)
    proc = forked_cli.run(
        [
            "test",
            "--config",
            str(ROOT / config),
            "--trainer.default_root_dir",
            str(run),
            "--trainer.enable_progress_bar",
            "false",
            "--data.init_args.val",
            val,
            "--data.init_args.val_samples",
            "4",
            "--data.init_args.val_batch_size",
            "2",
            "--data.init_args.reward",
            "test_eval_repeats.OddLength",
            *extra,
        ],
        tmp_path,
        env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(next(run.glob("version_0/metrics.csv")).open()))
    merged = {
        k: float(v) for r in rows for k, v in r.items() if v not in ("", None) and k != "step"
    }
    return merged, proc.stdout


def test_salvage_test_repeats_reports_mean_and_std(tmp_path):
    m, out = _test_run(tmp_path, "configs/grpo/math_tiny.yaml", ["--repeats", "3"], "rep")
    for what in ("aggregate", "success/arith", "success/arith2"):
        per = [m[f"eval/repeat_{r}/{what}"] for r in range(3)]
        mean, std = sum(per) / 3, math.sqrt(sum((p - sum(per) / 3) ** 2 for p in per) / 2)
        assert m[f"eval/{what}"] == pytest.approx(mean, abs=1e-6), what
        assert m[f"eval/{what}_std"] == pytest.approx(std, abs=1e-6), what
    # each repeat's aggregate is the unweighted mean of its two benchmarks
    for r in range(3):
        assert m[f"eval/repeat_{r}/aggregate"] == pytest.approx(
            (m[f"eval/repeat_{r}/success/arith"] + m[f"eval/repeat_{r}/success/arith2"]) / 2
        )
    # different seeds per repeat: the sampled outcomes differ (20 samples per repeat)
    assert len({m[f"eval/repeat_{r}/aggregate"] for r in range(3)}) > 1
    assert "evaluation over 3 repeats" in out and "eval/aggregate" in out
    # repeat 0 is exactly the single run's evaluation (same seed stream)
    single, _ = _test_run(tmp_path, "configs/grpo/math_tiny.yaml", [], "one")
    assert single["eval/aggregate"] == pytest.approx(m["eval/repeat_0/aggregate"], abs=1e-9)
    assert "eval/aggregate_std" not in single and "eval/repeat_0/aggregate" not in single


# slow: the default suite keeps one model's repeats (the same code path per model)
@pytest.mark.slow
def test_salvage_test_repeats_graft_both_models(tmp_path):
    m, out = _test_run(tmp_path, "configs/graft/math_tiny.yaml", ["--repeats", "2"], "graft")
    for name in ("a", "b"):
        per = [m[f"{name}/eval/repeat_{r}/aggregate"] for r in range(2)]
        assert m[f"{name}/eval/aggregate"] == pytest.approx(sum(per) / 2, abs=1e-6)
        assert m[f"{name}/eval/aggregate_std"] == pytest.approx(
            abs(per[0] - per[1]) / math.sqrt(2), abs=1e-6
        )
    assert "evaluation over 2 repeats" in out
