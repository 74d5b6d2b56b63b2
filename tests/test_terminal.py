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


def test_vllm_start_up_lines_are_silenced_unless_verbose(monkeypatch):
    """vLLM reads VLLM_LOGGING_LEVEL when it is imported (an engine build, after this) and
    its workers inherit it; --verbose skips quiet_third_parties, so its lines come back."""
    import os

    from salvage.commands.cli import quiet_third_parties

    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    quiet_third_parties(heavy=False)  # study / compare / report never build an engine
    assert "VLLM_LOGGING_LEVEL" not in os.environ
    quiet_third_parties()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # a user's own choice stands
    quiet_third_parties()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
