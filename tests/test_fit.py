"""End-to-end GRPO on `tiny`: parameters move, losses are finite, the CLI writes metrics."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from salvage.callbacks.cost import CostTracker
from salvage.datamodules.rlvr import RLVRDataModule
from salvage.models import PolicySpec
from salvage.modules.grpo import GRPOModule
from salvage.rollout.config import EngineConfig
from salvage.tasks.math import MathData, Reward, RewardResult
from tests import forked_cli

ROOT = Path(__file__).resolve().parents[1]

REQUIRED = [
    "rollout/reward_mean",
    "rollout/success_rate",
    "rollout/zero_signal_frac",
    "rollout/response_len",
    "loss/policy",
    "loss/kl",
    "loss/clip_frac",
    "perf/rollout_tokens_per_s",
    "perf/step_s",
    "cost/gpu_hours",
]


class DigitFraction(Reward):
    """A real, text-dependent reward with contrast for an untrained model: the share of
    digits in the response (math-verify gives a random tiny model all zeros, hence no
    gradient). Success = more than a quarter digits."""

    def __call__(self, response: str, answer: str) -> RewardResult:
        frac = sum(c.isdigit() for c in response) / max(1, len(response))
        return RewardResult(frac, frac > 0.25)


def _fit(tmp_path, num_minibatches=2, **model_kw):
    module = GRPOModule(
        policy=PolicySpec("tiny"),
        lr=1e-2,
        weight_decay=0.0,
        num_minibatches=num_minibatches,
        micro_batch_size=8,
        kl_coef=0.05,
        **model_kw,
    )
    data = RLVRDataModule(
        train=MathData(source="reasoning_gym:basic_arithmetic", size=40),
        prompts_per_step=4,
        group_size=4,
        engine=EngineConfig(max_new_tokens=16),
        reward=DigitFraction(),
    )
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=CSVLogger(tmp_path, name=""),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,  # as salvage's CLI: one step = one RL update, each one logged
        callbacks=[CostTracker()],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=data)
    return module, trainer, before


def test_short_fit_moves_every_parameter_and_losses_are_finite(tmp_path):
    module, trainer, before = _fit(tmp_path)
    assert trainer.global_step == 2  # one global step per rollout batch, not per minibatch
    unchanged = [
        n for n, p in module.policy.named_parameters() if torch.equal(p.detach(), before[n])
    ]
    assert unchanged == []
    m = trainer.callback_metrics
    for k in ("loss/policy", "loss/kl", "loss/total", "train/grad_norm"):
        assert math.isfinite(float(m[k])), k
    assert float(m["train/grad_norm"]) > 0
    assert float(m["loss/kl"]) > 0  # the policy moved away from the reference after step 1
    assert 0 <= float(m["loss/clip_frac"]) <= 1
    assert module.ref_model is not None and not any(
        p.requires_grad for p in module.ref_model.parameters()
    )
    # the reference stays the initial policy
    ref = dict(module.ref_model.named_parameters())
    assert all(torch.equal(ref[n], before[n]) for n in before)


def test_kl_zero_skips_the_reference_model(tmp_path):
    module = GRPOModule(policy=PolicySpec("tiny"), kl_coef=0.0)
    module.configure_model()
    assert module.ref_model is None


def test_first_minibatch_ratio_is_exactly_one(tmp_path):
    # fp32 on CPU: the sampler's own log-probs (engine default, no recomputed pass) equal the
    # update's up to rounding (README "HF rollouts")
    # one minibatch per step: every token's ratio is computed before any update
    module, trainer, _ = _fit(tmp_path, num_minibatches=1)
    assert float(trainer.callback_metrics["loss/ratio_mean"]) == pytest.approx(1.0, abs=1e-4)
    assert float(trainer.callback_metrics["loss/clip_frac"]) == 0.0


def test_bad_module_config_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"model.loss_agg='mean'"):
        GRPOModule(loss_agg="mean")
    with pytest.raises(ValueError, match="model.num_minibatches=0"):
        GRPOModule(num_minibatches=0)
    with pytest.raises(ValueError, match="data.group_size"):
        RLVRDataModule(group_size=1)


def _env():
    env = dict(os.environ)
    env.update(OMP_WAIT_POLICY="PASSIVE", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    return env


def _salvage(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``cmd`` (``python -m salvage ...``) as a process forked after the CLI's imports
    (tests/forked_cli.py: the same exit status and output, ~8 s of imports saved a call)."""
    assert cmd[:3] == [sys.executable, "-m", "salvage"], cmd[:3]
    return forked_cli.run(cmd[3:], cwd, _env(), timeout=300)


def test_cli_fit_math_tiny_writes_metrics_csv(tmp_path):
    run = tmp_path / "RUN"
    cmd = [
        sys.executable,
        "-m",
        "salvage",
        "fit",
        "--config",
        str(ROOT / "configs/grpo/math_tiny.yaml"),
        "--trainer.max_steps",
        "2",
        "--trainer.default_root_dir",
        str(run),
        "--trainer.enable_progress_bar",
        "false",
    ]
    proc = _salvage(cmd, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list(run.glob("**/metrics.csv"))
    assert len(files) == 1
    rows = list(csv.DictReader(files[0].open()))
    header = rows[0].keys()
    missing = [k for k in REQUIRED if k not in header]
    assert missing == []
    steps = [r for r in rows if r["perf/step_s"]]
    assert len(steps) == 2
    gpu_h = [float(r["cost/gpu_hours"]) for r in steps]
    assert 0 < gpu_h[0] < gpu_h[1]  # cumulative
    assert list(run.glob("**/checkpoints/last.ckpt"))


def test_cli_resume_with_ckpt_path_last(tmp_path):
    run = tmp_path / "RUN"
    base = [
        sys.executable,
        "-m",
        "salvage",
        "fit",
        "--config",
        str(ROOT / "configs/grpo/math_tiny.yaml"),
        "--trainer.default_root_dir",
        str(run),
        "--trainer.enable_progress_bar",
        "false",
    ]
    first = _salvage([*base, "--trainer.max_steps", "2"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert list(run.glob("**/last.ckpt"))
    again = _salvage([*base, "--trainer.max_steps", "3", "--ckpt_path", "last"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    newest = sorted(run.glob("version_*/metrics.csv"))[-1]
    steps = [r["step"] for r in csv.DictReader(newest.open()) if r.get("perf/step_s")]
    assert steps == ["2"]  # continued at update 2, did not start over


def test_cli_refuses_bad_config_before_loading_anything(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "salvage",
        "fit",
        "--config",
        str(ROOT / "configs/grpo/math_tiny.yaml"),
        "--model.init_args.clip_eps_low",
        "1.5",
        "--trainer.default_root_dir",
        str(tmp_path),
    ]
    proc = _salvage(cmd, tmp_path)
    assert proc.returncode != 0
    assert "clip_eps_low" in proc.stderr and "1.5" in proc.stderr
    assert not list(tmp_path.glob("**/metrics.csv"))


def test_trainable_layers_freezes_the_rest(tmp_path):
    spec = PolicySpec("tiny", num_layers=2, trainable_layers=1)
    module = GRPOModule(policy=spec, lr=1e-2, num_minibatches=1, micro_batch_size=8)
    module.configure_model()
    trainable = {n for n, p in module.policy.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("model.layers.1.", "model.norm")) for n in trainable)
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    data = RLVRDataModule(
        train=MathData(source="reasoning_gym:basic_arithmetic", size=8),
        prompts_per_step=2,
        group_size=4,
        engine=EngineConfig(max_new_tokens=12),
        reward=DigitFraction(),
    )
    L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(module, datamodule=data)
    for n, p in module.policy.named_parameters():
        assert torch.equal(p, before[n]) == (n not in trainable), n
    with pytest.raises(ValueError, match="trainable_layers must be >= 1"):
        PolicySpec("tiny", trainable_layers=0)


def test_unknown_ablation_callback_is_refused_naming_it(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "salvage",
        "fit",
        "--config",
        str(ROOT / "configs/vhgpo/twx_tiny.yaml"),
        "--trainer.callbacks+=salvage.callbacks.relay.NoSuchHandoff",
        "--trainer.default_root_dir",
        str(tmp_path),
    ]
    proc = _salvage(cmd, tmp_path)
    assert proc.returncode != 0
    assert "NoSuchHandoff" in proc.stderr
    assert not list(tmp_path.glob("**/metrics.csv"))
