"""Exact resume: N updates straight == N/2 + checkpoint + resume + N/2 (parameters and counters)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from test_fit import DigitFraction
from test_vhgpo import CFG, ORACLE, ScriptedAgentData

from salvage.callbacks.cost import CostTracker
from salvage.callbacks.relay import VerifiedHandoff
from salvage.callbacks.sft import OracleSFT
from salvage.core.relay import RelayConfig
from salvage.datamodules.agent import EnvSpec
from salvage.datamodules.rlvr import RLVRDataModule
from salvage.models import PolicySpec
from salvage.modules.grpo import GRPOModule
from salvage.modules.vhgpo import VHGPOModule
from salvage.rollout.config import EngineConfig
from salvage.tasks.math import MathData

# Lightning's generic resume notices (the resumed Trainer runs without the checkpoint
# callback; a mid-epoch resume of a plain dataloader): what they warn of is what these
# tests check, that the resumed run equals the straight one
pytestmark = [
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
    pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before"),
]


class StopAt(L.Callback):
    """Simulates a crash: the run (configured for all n updates) stops after ``k``."""

    def __init__(self, k: int) -> None:
        self.k = k

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step >= self.k:
            trainer.should_stop = True


def _trainer(tmp, steps, callbacks):
    return L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp,
        callbacks=callbacks,
    )


def _resume_equal(tmp_path, make, n=4):
    """Run ``make()`` (module, datamodule, callbacks) straight and with a resume at n/2."""
    m1, d1, cb1 = make()
    t1 = _trainer(tmp_path / "a", n, cb1)
    t1.fit(m1, datamodule=d1)

    m2, d2, cb2 = make()
    ck = ModelCheckpoint(
        dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1, save_last=True
    )
    t2 = _trainer(tmp_path / "b", n, [*cb2, StopAt(n // 2), ck])
    t2.fit(m2, datamodule=d2)
    assert t2.global_step == n // 2
    m3, d3, cb3 = make()
    t3 = _trainer(tmp_path / "c", n, cb3)
    t3.fit(m3, datamodule=d3, ckpt_path=str(tmp_path / "ck" / "last.ckpt"))
    assert t3.global_step == t1.global_step == n
    p1 = dict(m1.policy.named_parameters())
    diff = [k for k, p in m3.policy.named_parameters() if not torch.equal(p, p1[k])]
    assert diff == []
    return (m1, t1, cb1), (m3, t3, cb3)


def test_grpo_resume_is_exact(tmp_path):
    def make():
        module = GRPOModule(
            policy=PolicySpec("tiny"),
            lr=1e-2,
            num_minibatches=2,
            micro_batch_size=8,
            kl_coef=0.05,
            lr_schedule="cosine",
            warmup_steps=1,
        )
        data = RLVRDataModule(
            train=MathData(source="reasoning_gym:basic_arithmetic", size=12),
            prompts_per_step=4,
            group_size=4,
            engine=EngineConfig(max_new_tokens=12),
            reward=DigitFraction(),
        )
        return module, data, [CostTracker()]

    (m1, t1, cb1), (m3, t3, cb3) = _resume_equal(
        tmp_path, make, n=4
    )  # 12 tasks / 4 = 3 per epoch: crosses one
    assert cb3[0].steps == cb1[0].steps == 4  # the cost tracker's step count carried over
    assert (
        t3.lr_scheduler_configs[0].scheduler.last_epoch
        == t1.lr_scheduler_configs[0].scheduler.last_epoch
    )


def test_vhgpo_resume_is_exact_with_warm_start_and_relay_counters(tmp_path):
    def make():
        module = VHGPOModule(policy=PolicySpec("tiny"), lr=1e-3, micro_batch_size=8)
        data = ScriptedAgentData(
            env=EnvSpec(
                name="scripted",
                kwargs={"max_steps": 8},
                train_tasks={"num_tasks": 4, "length": 5, "actions": ["a", "b", "c"]},
            ),
            max_turns=8,
            tasks_per_step=2,
            group_size=4,
        )
        return (
            module,
            data,
            [
                OracleSFT(episodes=4, steps=3, batch_size=4, lr=1e-2),
                VerifiedHandoff(relay=RelayConfig(**CFG), teacher=ORACLE, records=False),
            ],
        )

    (m1, t1, cb1), (m3, t3, cb3) = _resume_equal(tmp_path, make, n=4)
    assert (
        cb3[0].done and cb3[0].history == cb1[0].history
    )  # the warm start ran once, before the split
    assert cb3[1].acc.total == cb1[1].acc.total  # cumulative relay accounting and extra tokens
    assert cb1[1].acc.total["retained"] == 8  # 2 groups x 4 updates, all retained (scripted)
    ref1 = dict(m1.ref_model.named_parameters())
    assert all(
        torch.equal(p, ref1[k]) for k, p in m3.ref_model.named_parameters()
    )  # warm-started reference


def test_graft_resume_is_exact_for_both_models(tmp_path):
    from salvage.datamodules.graft import GraftDataModule
    from salvage.modules.graft import GRAFTModule

    def make():
        module = GRAFTModule(lr=1e-2, num_minibatches=2, micro_batch_size=8, gate=False)
        data = GraftDataModule(
            train=MathData(source="reasoning_gym:basic_arithmetic", size=12),
            prompts_per_step=4,
            group_size=4,
            engine=EngineConfig(max_new_tokens=8),
            reward=DigitFraction(),
        )
        return module, data, [CostTracker()]

    (m1, t1, _), (m3, t3, _) = _resume_equal(tmp_path, make, n=4)  # compares model A via .policy
    pb = dict(m1.b.policy.named_parameters())
    assert all(torch.equal(p, pb[k]) for k, p in m3.b.policy.named_parameters())  # and model B
