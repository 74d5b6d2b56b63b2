"""What a user sees in the terminal: no third-party noise by default, progress in updates."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOISE = (
    "litlogger",
    "LitLogger",
    "GPU available",
    "DeprecationWarning",
    "Loading weights",
    "Epoch 0/-",
    "LeafSpec",
    "Seed set to",
)


def _fit(tmp_path: Path, *extra: str) -> str:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", SALVAGE_PROGRESS="0")
    env.pop("PYTHONWARNINGS", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "salvage",
            "fit",
            "--config",
            str(ROOT / "configs/grpo/math_tiny.yaml"),
            "--trainer.max_steps",
            "1",
            "--trainer.default_root_dir",
            str(tmp_path / "RUN"),
            *extra,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_no_third_party_noise_by_default_and_verbose_brings_it_back(tmp_path):
    out = _fit(tmp_path)
    assert [n for n in NOISE if n in out] == []
    assert "salvage run summary" in out  # our own output stays
    out = _fit(tmp_path, "--verbose")
    assert "GPU available" in out


def test_the_step_bar_counts_updates_against_max_steps():
    import lightning as L

    from salvage.progress import update_progress_bar

    bar = update_progress_bar()
    trainer = L.Trainer(max_steps=7, callbacks=[bar], logger=False, enable_checkpointing=False)
    bar.setup(trainer, None, "fit")  # what fit() does before the bar is drawn
    assert bar._get_train_description(3) == "updates"
    assert bar.total_train_batches == 7
    assert trainer.progress_bar_callback is bar
