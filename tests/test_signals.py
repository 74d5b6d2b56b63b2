"""A stopped ``salvage fit`` is never "done": SIGTERM exits 75, SIGINT 130, both resumable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs/grpo/math_tiny.yaml"
QUICK = [
    "--trainer.enable_progress_bar",
    "false",
    "--data.init_args.prompts_per_step",
    "2",
    "--data.init_args.engine.max_new_tokens",
    "8",
]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", WANDB_MODE="offline")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _default_sigint() -> None:
    # a background job may start with SIGINT ignored; Python then never raises KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 75), (signal.SIGINT, 130)])
def test_a_fit_stopped_by_a_signal_exits_nonzero_and_resumable(tmp_path, sig, code):
    root = tmp_path / "run"
    cmd = [sys.executable, "-m", "salvage", "fit", "--config", str(TINY), *QUICK]
    cmd += ["--trainer.max_steps", "100000", "--trainer.default_root_dir", str(root)]
    proc = subprocess.Popen(
        cmd,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )
    deadline = time.time() + 120
    while not any(root.glob("version_*/checkpoints/last.ckpt")):  # one update is done
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.time() < deadline, "no checkpoint after 120 s"
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    name = "SIGTERM" if sig == signal.SIGTERM else "SIGINT"
    assert f"salvage: fit stopped by {name} after " in err
    assert "--ckpt_path last" in err
    assert list(root.glob("version_*/checkpoints/last.ckpt"))
