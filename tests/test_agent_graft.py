"""GRAFT for agents: episodes transplanted turn by turn between two students (docs/peers.md)."""

from __future__ import annotations

import math
import random

import lightning as L
import pytest
import torch
from conftest import needs_twx

from salvage.core.agent import AgentFormat
from salvage.core.grpo import assign_advantages
from salvage.datamodules.agent import EnvSpec
from salvage.datamodules.agent_peers import AgentPeersDataModule
from salvage.envs.pool import EnvPool
from salvage.errors import ConfigError
from salvage.models import PolicySpec
from salvage.modules.graft import GRAFTModule, transplant
from salvage.rollout.agent import AgentRunner, LMPolicy, Start
from salvage.rollout.config import EngineConfig
from salvage.rollout.hf import HFEngine
from salvage.types import Group, RolloutBatch

COIN = {"game": "coin", "params": "numLocations=6,includeDoors=0,numDistractorItems=0"}


def _students():
    module = GRAFTModule(
        policy_a=PolicySpec("tiny", vocab_size=768),
        policy_b=PolicySpec("tiny", vocab_size=384, seed=1),
        gate=False,
    )
    module.configure_model()
    return module


def _group(runner, learner, fmt, task, seed, wins):
    pol = LMPolicy(
        HFEngine(learner.policy, learner.tokenizer, max_new_tokens=12), learner.tokenizer, fmt
    )
    eps = runner.run([Start(task, seed=seed + j) for j in range(len(wins))], pol, seed=seed)
    trajs = [runner.to_trajectory(e) for e in eps]
    for t, ok in zip(trajs, wins, strict=True):  # scripted outcomes on real episodes
        t.success, t.reward = ok, 10.0 * ok
    g = Group(task_id=task["id"], trajectories=trajs, task=task)
    assign_advantages(g, "grpo", 1e-6, 1e-6, 1e-6)
    return g


def test_a_peer_episode_is_re_rendered_turn_by_turn_in_the_receivers_format():
    needs_twx()
    from salvage.envs.twx import TWXEnv

    module = _students()
    fmt = AgentFormat(history_k=2)  # later turns' prompts carry the recorded history
    (task,) = TWXEnv.list_tasks("train", num_tasks=1, **COIN)
    with EnvPool("twx") as pool:
        runner = AgentRunner(pool, fmt, max_turns=3)
        src = RolloutBatch(
            groups=[_group(runner, module.a, fmt, task, 0, [True, False, True, False])]
        )
        dst = RolloutBatch(groups=[_group(runner, module.b, fmt, task, 50, [False] * 4)])
    source = src.groups[0].trajectories
    encode_b = LMPolicy(None, module.b.tokenizer, fmt, 2048).encode
    weights = transplant(src, dst, [0], module.b, module.rules, random.Random(0), encode=encode_b)
    got = dst.groups[0]
    assert got.peer and [t.source for t in got.trajectories] == ["peer"] * 4
    assert weights == [1.0] * 4  # gate off
    tb = module.b.tokenizer
    module.b.policy.eval()
    for s, t in zip(source, got.trajectories, strict=True):
        assert len(t.turns) == len(s.turns) == 3  # every turn of the episode travels
        assert t.advantage == s.advantage and t.success == s.success
        b_lps, a_lps = [], []
        for st, rt in zip(s.turns, t.turns, strict=True):
            # b's chat template and tokenizer over the same rendered prompt (task, history)
            assert rt.prompt_ids == encode_b(st.prompt_text) != st.prompt_ids
            want = list(tb(st.response_text, add_special_tokens=False)["input_ids"])
            if st.finish_reason == "stop":
                want.append(tb.eos_token_id)
            assert rt.response_ids == want and rt.action == st.action and rt.depth == st.depth
            with torch.no_grad():  # b's pi_old log-probs by an independent forward pass
                ids = torch.tensor([rt.prompt_ids + want])
                lp = torch.log_softmax(module.b.policy(input_ids=ids).logits[0, :-1].float(), -1)
                lp = lp.gather(-1, ids[0, 1:, None]).squeeze(-1)[len(rt.prompt_ids) - 1 :]
            assert rt.logprobs == pytest.approx(lp.tolist(), abs=1e-5)
            b_lps += lp.tolist()
            a_lps += st.logprobs
        # compatibility over all of the receiver's action tokens of the episode
        want_s = math.exp(sum(b_lps) / len(b_lps) - sum(a_lps) / len(a_lps))
        assert t.compat == pytest.approx(want_s, rel=1e-5)


class ScriptedAgents(AgentPeersDataModule):
    """Real episodes of both students; outcomes scripted: task 0 complementary A -> B
    (A won 1 of 4, B none), task 1 B -> A (B won 2 of 4, A none)."""

    def train_rollout(self, tasks):
        batch = super().train_rollout(tasks)
        plan = {"a": [[1, 0, 0, 0], [0, 0, 0, 0]], "b": [[0, 0, 0, 0], [1, 1, 0, 0]]}
        for name, rows in plan.items():
            for q, g in enumerate(batch.parts()[name].groups):
                wins = rows[q] if q < len(rows) else [0] * len(g.trajectories)
                for t, ok in zip(g.trajectories, wins, strict=True):
                    t.success, t.reward = bool(ok), 10.0 * ok
                assign_advantages(g, "grpo", 1e-6, 1e-6, 1e-6)
        return batch


class Capture(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batch = batch


def test_agent_graft_fit_exchanges_episodes_both_ways_and_trains_on_them(tmp_path):
    needs_twx()
    module = GRAFTModule(
        policy_a=PolicySpec("tiny", vocab_size=768),
        policy_b=PolicySpec("tiny", vocab_size=384, seed=1),
        lr=1e-3,
        num_minibatches=2,
        micro_batch_size=8,
        gate=False,
    )
    data = ScriptedAgents(
        env=EnvSpec(name="twx", train_tasks={**COIN, "num_tasks": 4}),
        agent=AgentFormat(history_k=0),
        max_turns=2,
        tasks_per_step=2,
        group_size=4,
        engine=EngineConfig(max_new_tokens=8),
    )
    cap = Capture()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cap],
    )
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.b.policy.named_parameters()}
    trainer.fit(module, datamodule=data)
    m = trainer.callback_metrics
    assert float(m["graft/transferred_a_to_b"]) == 1 and float(m["graft/transferred_b_to_a"]) == 1
    ra, rb = cap.batch.a, cap.batch.b
    got = rb.groups[0]  # B's group on task 0: A's four episodes, in B's tokens
    assert got.peer and all(len(t.turns) == 2 for t in got.trajectories)
    src_turns = [t.turns for t in ra.groups[0].trajectories]
    for t, st in zip(got.trajectories, src_turns, strict=True):
        assert [x.prompt_ids for x in t.turns] == [data.encoder("b")(x.prompt_text) for x in st]
    assert ra.groups[1].peer and not ra.groups[0].peer
    assert "b/loss/peer_clip_frac" in m and "a/loss/peer_clip_frac" in m
    moved = any(not torch.equal(before[n], p) for n, p in module.b.policy.named_parameters())
    assert moved


def test_agent_exchange_refuses_single_response_modes():
    needs_twx()
    data = AgentPeersDataModule(
        env=EnvSpec(name="twx", train_tasks={**COIN, "num_tasks": 2}), tasks_per_step=2
    )
    module = GRAFTModule(mode="hacpo")
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False)
    with pytest.raises(ConfigError, match="model.mode='hacpo' is not defined for agent episodes"):
        trainer.fit(module, datamodule=data)
