"""GRAFT stored mode: record a run, receive it in another, re-verified; mismatches fail clearly."""

from __future__ import annotations

import json
import math
from pathlib import Path

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
    # exchange.jsonl as GRAFT writes it: one row per transferred response, its score's parts
    (rec,) = [json.loads(x) for x in (Path(trainer.log_dir) / "exchange.jsonl").open()]
    assert rec["step"] == 0 and rec["transfers"] == {"stored_to_self": [0, 1]}
    rows = rec["responses"]
    assert [(r["direction"], r["prompt"]) for r in rows] == [("stored_to_self", 0)] * 4 + [
        ("stored_to_self", 1)
    ] * 4
    assert [r["reward"] for r in rows] == [1.0, 0.0] * 4  # re-verified, not the log's 0s
    for r in rows:  # the stored log-probs: -0.5, -0.5 -> lbar_src = -0.5 over 2 tokens
        assert (r["lbar_src"], r["tokens_src"]) == (-0.5, 2) and r["tokens_recv"] > 0
        assert math.log(r["s"]) == pytest.approx(r["lbar_recv"] + 0.5, abs=1e-12)
        assert r["admitted"] and r["weight"] == 1.0  # no gate: every response weighs 1


def test_a_log_that_does_not_match_fails_clearly(tmp_path):
    rec_dir = tmp_path / "partner" / "rollouts"
    _fit(tmp_path / "partner", [RecordRollouts(str(rec_dir))], steps=1)
    with pytest.raises(ValueError, match="the runs differ"):
        _fit(tmp_path / "recv", [StoredPeer(str(rec_dir))], steps=1, data_seed=5)
    with pytest.raises(FileNotFoundError, match="no recorded rollouts for step 1"):
        _fit(tmp_path / "recv2", [StoredPeer(str(rec_dir))], steps=2)


def _step0_log(tmp_path, logprobs, answer=None):
    """A stored log for the receiver's step 0 whose first response has ``logprobs``."""
    tasks, _ = load_math_tasks(DATA)

    class T:
        world_size, global_rank, global_step = 1, 0, 0

    prompts = []
    for i in StepBatches(len(tasks), 2, 0, T()).batch(0):
        t = tasks[i]
        ok = {"text": f"\\boxed{{{t.answer}}}", "logprobs": [-0.5], "finish_reason": "stop"}
        prompts.append({"task_id": t.id, "answer": answer or t.answer, "responses": [ok, dict(ok)]})
    prompts[0]["responses"][1]["logprobs"] = logprobs
    d = tmp_path / "log"
    d.mkdir()
    path = d / "step_000000.json"
    path.write_text(json.dumps({"step": 0, "temperature": 1.0, "prompts": prompts}))
    return d, path


@pytest.mark.parametrize(
    ("logprobs", "what"),
    [
        ([-0.5, float("nan")], "log-prob 1 is nan"),  # was a NonFiniteLossError
        ([], "missing or empty"),  # was "a response with no tokens has no mean log-prob"
        ([-1e30, -0.5], "log-prob 0 is -1e+30"),  # was an OverflowError in exp()
        ([-0.5, 3.0], "log-prob 1 is 3.0"),  # a probability above 1
        (None, "missing or empty"),
    ],
)
def test_a_stored_log_with_impossible_logprobs_is_refused_naming_it(tmp_path, logprobs, what):
    from salvage.errors import DataError

    d, path = _step0_log(tmp_path, logprobs)
    with pytest.raises(DataError) as e:
        _fit(tmp_path / "recv", [StoredPeer(str(d), gate=False)], steps=1)
    assert str(path) in str(e.value) and what in str(e.value)


def test_a_stored_log_of_other_data_or_not_json_is_refused(tmp_path):
    from salvage.errors import DataError

    d, path = _step0_log(tmp_path, [-0.5], answer="999999")
    with pytest.raises(ValueError, match=r"step_000000.json\) has answer .999999.*the runs differ"):
        _fit(tmp_path / "recv", [StoredPeer(str(d))], steps=1)
    path.write_text('{"step": 0, "prompts": [')
    with pytest.raises(DataError, match="is not a JSON step record"):
        _fit(tmp_path / "recv2", [StoredPeer(str(d))], steps=1)
