"""SIGTERM stops a fit whose user code hangs (salvage.stopping): a reward that never returns
gets the stop grace, then the update in flight is dropped, one line names what was running,
the fit exits 75 and last.ckpt holds the last finished update."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from salvage.errors import ConfigError
from salvage.stopping import DEFAULT_STOP_GRACE_S, STOP_GRACE_ENV, stop_grace_s

ROOT = Path(__file__).resolve().parents[1]
MATH_TINY = str(ROOT / "configs" / "grpo" / "math_tiny.yaml")

HANG = '''
import time
from salvage.tasks.math import Reward, RewardResult


class Hang(Reward):
    """Scores 0; from its 41st call (the third update of 4 x 4 samples) it sleeps an hour."""

    def __init__(self):
        self.timeouts = 0
        self.calls = 0

    def __call__(self, response, answer):
        self.calls += 1
        if self.calls > 40:
            open("hanging", "w").close()
            time.sleep(3600)
        return RewardResult(0.0, False)
'''


def test_stop_grace_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(STOP_GRACE_ENV, raising=False)
    assert stop_grace_s() == DEFAULT_STOP_GRACE_S
    monkeypatch.setenv(STOP_GRACE_ENV, "2.5")
    assert stop_grace_s() == 2.5
    for bad in ("soon", "-1", "nan", "inf"):
        monkeypatch.setenv(STOP_GRACE_ENV, bad)
        with pytest.raises(ConfigError, match=rf"\${STOP_GRACE_ENV} .* got '{bad}'"):
            stop_grace_s()


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_stops_a_fit_whose_reward_hangs(tmp_path):
    (tmp_path / "hangmod.py").write_text(HANG)
    run = tmp_path / "run"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]),
        OMP_NUM_THREADS="1",
        OMP_WAIT_POLICY="PASSIVE",
        WANDB_MODE="offline",
        HF_HUB_OFFLINE="1",
        **{STOP_GRACE_ENV: "2"},
    )
    cmd = [sys.executable, "-m", "salvage", "fit", "--config", MATH_TINY]
    cmd += ["--data.init_args.reward", "hangmod.Hang", "--trainer.max_steps", "100"]
    cmd += ["--trainer.default_root_dir", str(run), "--trainer.enable_progress_bar", "false"]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.time() + 300
    while not (tmp_path / "hanging").exists():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.time() < deadline, "the reward never started hanging"
        time.sleep(0.1)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    took = time.time() - t0
    assert proc.returncode == 75, out[-3000:]
    assert took < 60, f"{took:.0f} s after SIGTERM (grace 2 s)"
    assert "SIGTERM: a reward call was still in progress after the 2 s stop grace" in out, out
    m = re.search(r"fit stopped by SIGTERM after (\d+) update", out)
    assert m and int(m.group(1)) == 2, out[-3000:]
    ckpt = next(run.glob("version_*/checkpoints/last.ckpt"))
    assert torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"] == 2
