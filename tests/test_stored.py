"""GRAFT stored mode: record a run, receive it in another, re-verified; mismatches fail clearly."""

from __future__ import annotations

import json

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from salvage.callbacks.stored import RecordRollouts, StoredPeer
from salvage.datamodules.base import StepBatches
from salvage.datamodules.rlvr import RLVRDataModule
from salvage.models import PolicySpec
from salvage.modules.grpo import GRPOModule
from salvage.rollout.config import EngineConfig
from salvage.tasks.math import MathData, load_math_tasks

DATA = MathData(source="reasoning_gym:basic_arithmetic", size=8, seed=0)


def _fit(tmp, callbacks, steps=1, data_seed=0, model_seed=0):
    module = GRPOModule(
        policy=PolicySpec("tiny", seed=model_seed), lr=1e-3, num_minibatches=2, micro_batch_size=8
    )
    data = RLVRDataModule(
        train=DATA,
        prompts_per_step=2,
        group_size=4,
        engine=EngineConfig(max_new_tokens=8),
        seed=data_seed,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=CSVLogger(tmp, name=""),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp,
        callbacks=callbacks,
    )
    trainer.fit(module, datamodule=data)
    return trainer


def test_record_then_receive_round_trip(tmp_path):
    rec_dir = tmp_path / "partner" / "rollouts"
    _fit(tmp_path / "partner", [RecordRollouts(str(rec_dir))], steps=2)
    files = sorted(rec_dir.glob("step_*.json"))
    assert [f.name for f in files] == ["step_000000.json", "step_000001.json"]
    rec = json.loads(files[0].read_text())
    assert len(rec["prompts"]) == 2 and all(len(p["responses"]) == 4 for p in rec["prompts"])
    r = rec["prompts"][0]["responses"][0]
    assert set(r) == {"text", "logprobs", "finish_reason", "reward"} and r["logprobs"]
    # the receiver (another model, same data and seed) reads it step by step
    trainer = _fit(tmp_path / "recv", [StoredPeer(str(rec_dir))], steps=2, model_seed=7)
    assert trainer.global_step == 2 and "graft/transferred_stored_cum" in trainer.callback_metrics


def test_stored_responses_are_re_verified_and_transferred(tmp_path):
    # a hand-written log for the receiver's step 0: its rewards claim failure, but two
    # responses carry the right \boxed answer; re-verification finds k = 2 of 4
    tasks, _ = load_math_tasks(DATA)

    class T:
        world_size, global_rank, global_step = 1, 0, 0

    step0 = StepBatches(len(tasks), 2, 0, T()).batch(0)
    prompts = []
    for i in step0:
        t = tasks[i]
        right = {
            "text": f"so \\boxed{{{t.answer}}}",
            "logprobs": [-0.5, -0.5],
            "finish_reason": "stop",
            "reward": 0.0,
        }
        wrong = {
            "text": "\\boxed{123456}",
            "logprobs": [-0.5, -0.5],
            "finish_reason": "stop",
            "reward": 0.0,
        }
        prompts.append(
            {"task_id": t.id, "answer": t.answer, "responses": [right, wrong, right, wrong]}
        )
    d = tmp_path / "log"
    d.mkdir()
    (d / "step_000000.json").write_text(
        json.dumps({"step": 0, "temperature": 1.0, "prompts": prompts})
    )
    peer = StoredPeer(str(d), gate=False)
    trainer = _fit(tmp_path / "recv", [peer], steps=1)
    m = trainer.callback_metrics
    assert float(m["graft/transferred_stored"]) == 2  # the random tiny receiver solved none of them
    assert float(m["graft/weight_mean"]) == 1.0 and peer.transferred == 2
    assert float(m["loss/peer_clip_frac"]) >= 0  # peer tokens entered the update


def test_a_log_that_does_not_match_fails_clearly(tmp_path):
    rec_dir = tmp_path / "partner" / "rollouts"
    _fit(tmp_path / "partner", [RecordRollouts(str(rec_dir))], steps=1)
    with pytest.raises(ValueError, match="the runs differ"):
        _fit(tmp_path / "recv", [StoredPeer(str(rec_dir))], steps=1, data_seed=5)
    with pytest.raises(FileNotFoundError, match="no recorded rollouts for step 1"):
        _fit(tmp_path / "recv2", [StoredPeer(str(rec_dir))], steps=2)
