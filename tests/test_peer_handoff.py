"""A co-trained peer as VH-GPO's handoff teacher (salvage/callbacks/peer_handoff.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from scripted_policies import RightFromDepth

from salvage.callbacks.peer_handoff import PeerHandoff
from salvage.core.agent import AgentFormat
from salvage.core.relay import RelayConfig
from salvage.datamodules.agent import EnvSpec
from salvage.datamodules.agent_peers import AgentPeersDataModule
from salvage.errors import ConfigError
from salvage.models import PolicySpec, load_model
from salvage.modules.graft import GRAFTModule
from salvage.modules.peer_handoff import PeerHandoffModule


class ScriptedPeers(AgentPeersDataModule):
    # a is right everywhere (its groups all win: not zero-signal); b only from depth 3 on (its
    # groups all fail, zero-signal). b's rescue: a recovers from the root, b resumes from 3.
    K = {"a": 0, "b": 3}

    def student_policy(self, name):
        return RightFromDepth(self._learner(name).tokenizer, self.fmt, self.K[name], logprob=-1.0)


class Capture(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.relays = {n: list(p.relays) for n, p in batch.parts().items()}


def _data():
    return ScriptedPeers(
        env=EnvSpec(
            name="scripted",
            kwargs={"max_steps": 8},
            train_tasks={"num_tasks": 2, "length": 5, "actions": ["a", "b", "c"]},
        ),
        agent=AgentFormat(history_k=1),
        max_turns=8,
        tasks_per_step=2,
        group_size=4,
    )


def _trainer(tmp_path, callbacks):
    """One update, CSV metrics and relays.jsonl in ``tmp_path``."""
    return L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=CSVLogger(tmp_path, name=""),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        default_root_dir=tmp_path,
    )


def test_each_student_is_rescued_by_its_peer_at_current_weights(tmp_path):
    module = PeerHandoffModule(
        policy_a=PolicySpec("tiny", vocab_size=768),
        policy_b=PolicySpec("tiny", vocab_size=384, seed=1),
        lr=1e-3,
        micro_batch_size=8,
    )
    rescue = PeerHandoff(relay=RelayConfig(b_min=2, stride=2, max_backtracks=4, max_groups=2))
    cap = Capture()
    trainer = _trainer(tmp_path, [rescue, cap])
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.b.policy.named_parameters()}
    trainer.fit(module, datamodule=_data())
    recs = [json.loads(x) for x in Path(trainer.log_dir, "relays.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and {r["student"] for r in recs} == {"b"}
    for r in recs:  # the same search as with an oracle teacher: only the root recovers
        assert r["teacher"] == "peer:a" and r["retained"]
        assert r["anchors"] == [6, 4, 2, 0] and r["anchor"] == 0
        assert (r["j_early"], r["j_star"], r["L"]) == (3, 3, 5)
        assert r["tokens"]["teacher"] > 0  # the peer's recovery tokens are teacher tokens
    assert cap.relays["a"] == [] and len(cap.relays["b"]) == 2
    relay = cap.relays["b"][0]
    assert len(relay.bridge) == 3 and len(relay.resume) == 2
    tok_b = module.b.tokenizer  # the bridge is in the student's tokens, not the teacher's
    assert tok_b.decode(relay.bridge[0].response_ids).strip().endswith("</action>")
    m = trainer.callback_metrics
    assert float(m["b/relay/retained"]) == 2 and float(m["b/relay/zero_signal_groups"]) == 2
    assert float(m["a/relay/zero_signal_groups"]) == 0
    assert float(m["b/cost/extra_tokens_teacher"]) == sum(r["tokens"]["teacher"] for r in recs)
    assert float(m["a/cost/extra_tokens_teacher"]) == 0
    assert float(m["cost/extra_token_ratio"]) > 0
    for k in ("b/loss/pair", "b/loss/bridge", "b/loss/resume"):
        assert math.isfinite(float(m[k])), k
    assert any(not torch.equal(before[n], p) for n, p in module.b.policy.named_parameters())


def test_peer_handoff_needs_vhgpo_students(tmp_path):
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        callbacks=[PeerHandoff()],
        default_root_dir=tmp_path,
    )
    with pytest.raises(ConfigError, match="not a VH-GPO learner"):
        trainer.fit(GRAFTModule(), datamodule=_data())


# slow (47 s on a make-test worker): the default suite keeps the live peer's handoff
# (test_each_student_is_rescued_by_its_peer_at_current_weights) and the switch's refusal
@pytest.mark.slow
def test_frozen_teacher_is_a_copy_of_the_peer_at_its_initial_weights(tmp_path):
    """``teacher: frozen`` (the issue's comparison): b is rescued by a frozen copy of a's
    initial weights, loaded from a's policy spec, that no update touches; the records name it."""
    spec_a = PolicySpec("tiny", vocab_size=768)
    module = PeerHandoffModule(
        policy_a=spec_a,
        policy_b=PolicySpec("tiny", vocab_size=384, seed=1),
        lr=1e-1,
        micro_batch_size=8,
    )
    rescue = PeerHandoff(
        relay=RelayConfig(b_min=2, stride=2, max_backtracks=4, max_groups=2), teacher="frozen"
    )
    trainer = _trainer(tmp_path, [rescue])
    trainer.fit(module, datamodule=_data())
    assert set(rescue._frozen) == {"a", "b"}  # each student's rescuer: a for b, b for a
    frozen_a = rescue._frozen["a"]
    assert frozen_a.engine.calls > 0  # the search sampled from the frozen copy
    fresh = dict(load_model(spec_a).named_parameters())
    frozen_params = dict(frozen_a.engine.model.named_parameters())
    assert all(torch.equal(p, fresh[k]) and not p.requires_grad for k, p in frozen_params.items())
    assert frozen_a.engine.model is not module.a.policy
    assert len(rescue.inference_models(module)) == len(module.sampling_models()) + 2
    recs = [json.loads(x) for x in Path(trainer.log_dir, "relays.jsonl").read_text().splitlines()]
    assert recs and {r["student"] for r in recs} == {"b"}
    assert {r["teacher"] for r in recs} == {"frozen:a"}
    assert "frozen copy of the peer" in rescue.describe()


def test_peer_handoff_teacher_must_be_live_or_frozen():
    with pytest.raises(ConfigError, match=r"rescue\.init_args\.teacher.*'stale'"):
        PeerHandoff(teacher="stale")
