"""Baselines of the agent-RL literature (docs/baselines.md): DAPO-style dynamic sampling and
GiGPO step-level advantages. Pure logic with hand-worked numbers, then the shells."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from scripted_policies import ScriptedPolicy

from salvage.core.dynamic_sampling import Refill, draw_tasks, has_signal
from salvage.core.gigpo import (
    GiGPOConfig,
    discounted_returns,
    gigpo_advantages,
    state_key,
    step_advantages,
    turn_rewards,
)

# ---------------------------------------------------------------- dynamic sampling, pure


def test_has_signal_drops_all_fail_and_all_success_groups():
    assert not has_signal([0.0, 0.0, 0.0, 0.0])  # all fail
    assert not has_signal([10.0, 10.0, 10.0])  # all success: zero advantage too
    assert not has_signal([5.0])  # a group of one has no contrast
    assert has_signal([10.0, 0.0, 0.0])
    assert has_signal([0.0, -0.1])  # all fail, but the invalid penalty differs
    assert not has_signal([0.0, 1e-7])  # within the tolerance


def test_refill_fills_open_slots_in_batch_order_with_signal_groups_in_sampling_order():
    # batch of 5 groups; slots 1, 2, 4 have no signal -> 3 open slots
    plan = Refill([True, False, False, True, False], max_rounds=3)
    assert plan.open == [1, 2, 4] and plan.request() == 3
    # round 1: 3 fresh groups, only the 2nd has signal -> it fills slot 1
    assert plan.offer([False, True, False]) == [(1, 1)]
    assert plan.open == [2, 4] and plan.request() == 2 and plan.rounds == 1
    # round 2: 2 fresh groups, both with signal -> slots 2 and 4
    assert plan.offer([True, True]) == [(2, 0), (4, 1)]
    assert plan.open == [] and plan.request() == 0  # full: stop


def test_refill_stops_at_the_cap_and_drops_surplus():
    plan = Refill([False, False], max_rounds=2)
    assert plan.offer([False, False]) == []
    assert plan.request() == 2
    assert plan.offer([False, False]) == []
    assert plan.request() == 0 and plan.open == [0, 1]  # cap reached: slots stay open
    full = Refill([False], max_rounds=5)
    assert full.offer([True, True, True]) == [(0, 0)]  # one slot: the other two are dropped
    assert Refill([False], max_rounds=0).request() == 0  # off
    assert Refill([True, True], max_rounds=4).request() == 0  # nothing to refill
    with pytest.raises(ValueError, match="max_rounds"):
        Refill([False], max_rounds=-1)


def test_draw_tasks_excludes_used_and_is_seeded():
    a = draw_tasks(10, {0, 1, 2}, 4, random.Random(5))
    assert a == draw_tasks(10, {0, 1, 2}, 4, random.Random(5))
    assert len(set(a)) == 4 and not set(a) & {0, 1, 2}
    assert sorted(draw_tasks(4, {0, 2}, 5, random.Random(0))) == [1, 3]  # fewer left: all left
    assert draw_tasks(3, {0, 1, 2}, 2, random.Random(0)) == []


# ---------------------------------------------------------------- GiGPO, pure


def test_turn_rewards_add_up_to_the_trajectory_reward():
    # won in 3 turns with the 2nd invalid: R = 10 - 0.1 = 9.9 -> [0, -0.1, 10]
    assert turn_rewards(9.9, [False, True, False], 0.1) == pytest.approx([0.0, -0.1, 10.0])
    # lost with the last turn invalid: R = -0.1 -> [0, -0.1]
    assert turn_rewards(-0.1, [False, True], 0.1) == pytest.approx([0.0, -0.1])
    assert turn_rewards(0.0, [], 0.1) == []


def test_discounted_returns_by_hand():
    # gamma 0.5: R_2 = 10, R_1 = -0.1 + 5 = 4.9, R_0 = 0 + 2.45
    assert discounted_returns([0.0, -0.1, 10.0], 0.5) == pytest.approx([2.45, 4.9, 10.0])
    # the paper's gamma 0.95: R_1 = 10, R_0 = 9.5
    assert discounted_returns([0.0, 10.0], 0.95) == pytest.approx([9.5, 10.0])


def test_gigpo_worked_example_mean_norm():
    """Three episodes of one task, gamma 0.5, omega 1, F_norm = 1 (norm "mean").

    ep0: states s0, s1; won at turn 1          rewards [0, 10]     returns [5, 10]
    ep1: states s0, s2; lost                   rewards [0, 0]      returns [0, 0]
    ep2: states s0, s1; turn 1 invalid, lost   rewards [0, -0.1]   returns [-0.05, -0.1]
    step group s0 = {5, 0, -0.05}: mean 1.65 -> A_S = 3.35, -1.65, -1.70
    step group s1 = {10, -0.1}:    mean 4.95 -> A_S = 5.05, -5.05
    step group s2 = {0}:           one turn  -> A_S = 0
    episode level (Dr. GRPO, no std): R = [10, 0, -0.1], mean 3.3 -> A_E = 6.7, -3.3, -3.4
    A = A_E + A_S: ep0 [10.05, 11.75], ep1 [-4.95, -3.3], ep2 [-5.1, -8.45]
    """
    states = [["s0", "s1"], ["s0", "s2"], ["s0", "s1"]]
    returns = [
        discounted_returns(turn_rewards(r, inv, 0.1), 0.5)
        for r, inv in ((10.0, [False, False]), (0.0, [False, False]), (-0.1, [False, True]))
    ]
    assert returns[2] == pytest.approx([-0.05, -0.1])
    cfg = GiGPOConfig(omega=1.0, gamma=0.5, norm="mean")
    adv, sizes = gigpo_advantages([6.7, -3.3, -3.4], states, returns, cfg)
    assert sizes == [3, 2, 1]
    expected = [[10.05, 11.75], [-4.95, -3.3], [-5.1, -8.45]]
    for got, want in zip(adv, expected, strict=True):
        assert got == pytest.approx(want)
    # omega scales the step term only; omega = 0 is plain GRPO
    adv0, _ = gigpo_advantages([6.7, -3.3, -3.4], states, returns, GiGPOConfig(omega=0.0))
    assert adv0 == [[6.7, 6.7], [-3.3, -3.3], [-3.4, -3.4]]


def test_gigpo_step_std_norm_by_hand():
    # step group {5, 0}: mean 2.5, unbiased std sqrt((2.5^2 + 2.5^2) / 1) = 3.5355
    # -> A_S = +-2.5 / 3.5355 = +-0.70711; a lone turn stays 0
    adv, sizes = step_advantages([["s"], ["s", "t"]], [[5.0], [0.0, 7.0]], norm="std", eps=0.0)
    assert sizes == [2, 1]
    assert adv[0] == pytest.approx([0.70711], abs=1e-5)
    assert adv[1] == pytest.approx([-0.70711, 0.0], abs=1e-5)


def test_gigpo_state_key_and_config_errors():
    assert state_key("  You are in\nthe kitchen.   ") == "You are in the kitchen."
    cfg = GiGPOConfig()
    assert (cfg.omega, cfg.gamma, cfg.norm) == (1.0, 0.95, "std")  # the paper's defaults
    with pytest.raises(ValueError, match="gigpo.norm"):
        GiGPOConfig(norm="none")
    with pytest.raises(ValueError, match="gigpo.gamma"):
        GiGPOConfig(gamma=1.5)
    with pytest.raises(ValueError, match="2 states but 1 returns"):
        step_advantages([["a", "b"]], [[1.0]])


# ---------------------------------------------------------------- GiGPO, shell


def _turn(valid: bool = True):
    from salvage.types import Turn

    return Turn(prompt_ids=[1, 2], response_ids=[3, 4], logprobs=[0.0, 0.0], valid=valid)


def test_rows_take_the_turn_advantage_where_set():
    """A turn with its own advantage (GiGPO) trains with it; the others with the trajectory's."""
    from salvage.modules.grpo import GRPOModule
    from salvage.types import Group, RolloutBatch, Trajectory

    first, second = _turn(), _turn()
    second.advantage = -2.0
    traj = Trajectory(turns=[first, second], reward=1.0, success=True, advantage=1.5)
    rows, per_traj = GRPOModule().rows_from_batch(
        RolloutBatch(groups=[Group(task_id="t", trajectories=[traj])])
    )
    assert per_traj == [[0, 1]]
    assert [r.advantage for r in rows] == [1.5, -2.0]


def test_agent_datamodule_writes_gigpo_turn_advantages():
    """The worked example of ``test_gigpo_worked_example_mean_norm`` through the datamodule:
    states from the episodes' observations (whitespace-normalised), rewards from the
    trajectory reward and the invalid turns, episode level Dr. GRPO."""
    from salvage.datamodules.agent import AgentDataModule, EnvSpec
    from salvage.rollout.agent import Episode, Start
    from salvage.types import Group, Trajectory

    dm = AgentDataModule(
        env=EnvSpec(name="scripted"),
        advantage="drgrpo",
        group_size=3,
        gigpo=GiGPOConfig(omega=1.0, gamma=0.5, norm="mean"),
    )
    task = {"id": "t0"}

    def traj(observations, valid, reward, won):
        turns = [_turn(v) for v in valid]
        e = Episode(eid=0, start=Start(task, 0), turns=turns, observations=observations)
        return Trajectory(turns=turns, reward=reward, success=won, episode=e)

    trajs = [
        traj(["s0", "s1", "end"], [True, True], 10.0, True),
        traj(["s0 ", "s2", "x"], [True, True], 0.0, False),
        traj(["s0", "s1\n", "y"], [True, False], -0.1, False),
    ]
    relay = Trajectory(turns=[_turn()], reward=0.0, success=False)  # no episode: no step group
    group = Group(task_id="t0", trajectories=trajs)
    dm.assign_group_advantages(group)
    assert [t.advantage for t in trajs] == pytest.approx([6.7, -3.3, -3.4])
    assert dm._step_groups == [3, 2, 1]  # s0, s1, s2 (logged as gigpo/step_group_size)
    expected = [[10.05, 11.75], [-4.95, -3.3], [-5.1, -8.45]]
    for t, want in zip(trajs, expected, strict=True):
        assert [turn.advantage for turn in t.turns] == pytest.approx(want)
    group.trajectories.append(relay)
    dm.assign_group_advantages(group)
    assert relay.turns[0].advantage is None
    off = AgentDataModule(env=EnvSpec(name="scripted"), group_size=3)
    fresh = traj(["s0", "s1", "z"], [True, True], 10.0, True)
    off.assign_group_advantages(Group(task_id="t0", trajectories=[fresh, trajs[1]]))
    assert all(turn.advantage is None for turn in fresh.turns)  # off: the trajectory's


# ---------------------------------------------------------------- dynamic sampling, shell


class _HalfStudent(ScriptedPolicy):
    """Scripted student: on a task whose solution starts with "a", the first episode of each
    group (row % 4 == 0 while all 4 are alive) plays the expert and wins; every other
    episode plays "x" (valid, loses). So "a"-tasks' groups have signal, the others not."""

    def expert(self, prompt, info, row):
        return row % 4 == 0 and info["task_description"].startswith("reach a")


def _dapo_run(tmp_path, max_rounds):
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from salvage.callbacks.dynamic_sampling import DynamicSampling
    from salvage.core.agent import AgentFormat
    from salvage.datamodules.agent import AgentDataModule, EnvSpec
    from salvage.models import PolicySpec
    from salvage.modules.vhgpo import VHGPOModule

    class Data(AgentDataModule):
        def student(self):
            return _HalfStudent(self.trainer.lightning_module.tokenizer, self.fmt)

        def rollout(self, tasks, n, seed, policy, advantages=True):
            b = super().rollout(tasks, n, seed, policy, advantages)
            self.tokens.append(b.num_response_tokens())
            return b

    data = Data(
        env=EnvSpec(
            name="scripted",
            kwargs={"max_steps": 8},
            train_tasks={"num_tasks": 6, "length": 5, "actions": ["a", "b", "c"]},
        ),
        agent=AgentFormat(history_k=1),
        max_turns=8,
        tasks_per_step=2,
        group_size=4,
    )
    data.tokens = []

    class Capture(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.batch = batch

    cap = Capture()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=CSVLogger(tmp_path, name=""),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[DynamicSampling(max_rounds=max_rounds), cap],
        default_root_dir=tmp_path,
    )
    module = VHGPOModule(policy=PolicySpec("tiny"), lr=1e-3, micro_batch_size=8)
    trainer.fit(module, datamodule=data)
    path = Path(trainer.log_dir, "relays.jsonl")
    recs = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return trainer, data, cap.batch, recs


# Token arithmetic of the scripted run: every response ("<action>x</action>" or an expert
# action) is 15 tokens of the tiny tokenizer; an episode ends after 8 actions or when won (5).
# A group of a task whose solution does not start with "a": 4 x 8 x 15 = 480 tokens, rewards
# all 0 (no signal); of an "a" task: 5 x 15 + 3 x 8 x 15 = 435 tokens, rewards [10, 0, 0, 0].
TOKENS = {False: 480, True: 435}


def _is_a(task_id: str) -> bool:
    return int(task_id.rsplit("/", 1)[1]) % 3 == 0  # tasks 0 and 3 start with "a"


def test_dynamic_sampling_refills_the_zero_advantage_groups(tmp_path):
    trainer, data, batch, recs = _dapo_run(tmp_path, max_rounds=10)
    own = [g.task_id for g in batch.own_groups]
    assert len(own) == 2 and not any(_is_a(t) for t in own)  # seed 0: two flat groups
    assert data.tokens[0] == 2 * TOKENS[False] == 960  # the batch's own rollouts
    drawn = [t for r in recs for t in r["tasks"]]
    assert len(set(drawn)) == len(drawn) and not set(drawn) & set(own)  # fresh tasks only
    for r in recs:  # each round samples the open slots, fills them with its "a" tasks
        assert r["with_signal"] == r["filled"] == sum(_is_a(t) for t in r["tasks"])
    assert recs[-1]["open_after"] == 0 and sum(r["filled"] for r in recs) == 2
    # the refilled batch: the two "a" tasks, each with one win
    assert sorted(g.task_id for g in batch.groups) == ["scripted/train/0", "scripted/train/3"]
    assert all(g.rewards == [10.0, 0.0, 0.0, 0.0] for g in batch.groups)
    extra = sum(TOKENS[_is_a(t)] for t in drawn)
    assert extra == sum(data.tokens[1:])  # every extra token, kept or dropped
    m = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert m["cost/extra_tokens_student"] == extra
    assert m["cost/extra_token_ratio"] == pytest.approx(extra / 960)
    assert m["dapo/rounds"] == len(recs) and m["dapo/filled"] == 2 and m["dapo/open"] == 0
    assert m["dapo/sampled_groups"] == len(drawn)
    assert m["rollout/zero_signal_frac"] == 1.0  # rollout metrics: the first batch, as GRPO


def test_dynamic_sampling_cap_keeps_open_slots(tmp_path):
    trainer, data, batch, recs = _dapo_run(tmp_path, max_rounds=1)
    assert len(recs) == 1 and len(recs[0]["tasks"]) == 2
    filled = recs[0]["filled"]
    m = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert m["dapo/rounds"] == 1 and m["dapo/open"] == 2 - filled
    kept = [g for g in batch.groups if g in batch.own_groups]
    assert len(kept) == 2 - filled and all(g.rewards == [0.0] * 4 for g in kept)
    assert m["cost/extra_tokens_student"] == sum(TOKENS[_is_a(t)] for t in recs[0]["tasks"])


# ---------------------------------------------------------------- both configs, CLI on TWX


# ~60-80 s each on 2 cores (TextWorld-Express JVMs): slow. The scripted-environment tests above
# cover the dynamic-sampling shell and the datamodule's GiGPO advantages in the default suite.
@pytest.mark.slow
@pytest.mark.parametrize(
    "fragment, extra, metric",
    [
        ("dapo_dynamic_sampling", ["--rescue.init_args.max_rounds", "1"], "dapo/rounds"),
        ("gigpo", [], "gigpo/step_group_size"),
    ],
)
def test_cli_twx_tiny_baseline_configs_fit(tmp_path, fragment, extra, metric):
    """Each baseline fragment on the TWX tiny config fits 2 updates (no SFT, no validation)."""
    import csv
    import os
    import shutil
    import subprocess
    import sys

    pytest.importorskip(
        "textworld_express", reason="textworld-express (extra twx) is not installed"
    )
    if shutil.which("java") is None:
        pytest.skip("TextWorld-Express needs Java")
    root = Path(__file__).resolve().parents[1]
    run = tmp_path / "RUN"
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    args = ["--config", str(root / "configs/vhgpo/twx_tiny.yaml")]
    args += ["--config", str(root / f"configs/vhgpo/ablations/{fragment}.yaml")]
    args += ["--trainer.max_steps", "2", "--trainer.default_root_dir", str(run)]
    args += ["--trainer.enable_progress_bar", "false", "--trainer.callbacks=[]"]
    args += ["--trainer.limit_val_batches", "0", "--data.init_args.tasks_per_step", "2"]
    proc = subprocess.run(
        [sys.executable, "-m", "salvage", "fit", *args, *extra],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(next(run.glob("version_0/metrics.csv")).open()))
    assert len(rows) == 2
    assert all(r[metric] != "" for r in rows)
    if fragment == "gigpo":
        assert all(float(r[metric]) >= 1 for r in rows)
    else:  # the ratio is VH-GPO's: extra (dropped or kept) tokens over the batch's own
        assert all(float(r["dapo/rounds"]) <= 1 for r in rows)
        zero = [float(r["relay/selected"]) for r in rows]
        ratio = float(rows[-1]["cost/extra_token_ratio"])
        assert (ratio > 0) == (sum(zero) > 0)
