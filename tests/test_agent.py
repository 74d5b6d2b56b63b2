"""Agent loop: format parsing, prompts, penalties, determinism, multi-turn GRPO through the CLI."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
from conftest import needs_twx

from salvage.core.agent import AgentFormat, parse_action, render_prompt, trajectory_reward
from salvage.envs.pool import EnvPool
from salvage.rollout.agent import AgentRunner, LMPolicy, OraclePolicy, Start
from salvage.rollout.hf import HFEngine
from tests import forked_cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("text", "action", "valid"),
    [
        ("<think>coin is here</think><action>take coin</action>", "take coin", True),
        ("<action>  take   coin </action>", "take coin", True),
        ("I will take the coin", "I will take the coin", False),
        ("<action></action>", "", False),
        ("<action>look around</action> and <action>take coin</action>", "take coin", False),
        ("<think>x</think><action>open fridge", "open fridge", False),
    ],
)
def test_parse_action(text, action, valid):
    assert parse_action(text, AgentFormat()) == (action, valid)


def test_require_think():
    fmt = AgentFormat(require_think=True)
    assert parse_action("<action>go</action>", fmt) == ("go", False)
    assert parse_action("<think>t</think><action>go</action>", fmt) == ("go", True)


def test_prompt_shows_last_k_history_and_budget():
    fmt = AgentFormat(history_k=2)
    hist = [("o0", "a0"), ("o1", "a1"), ("o2", "a2")]
    p = render_prompt(fmt, "find the coin", hist, "o3", ["take coin", "look"], step=3, budget=47)
    assert "o0" not in p and "a0" not in p
    assert "[step 1] observation: o1\n  action: a1" in p and "[step 2] observation: o2" in p
    assert "steps left: 47" in p and "[take coin, look]" in p and "find the coin" in p
    assert "last" not in render_prompt(AgentFormat(history_k=0), "t", hist, "o", [], 3, 1)


def test_trajectory_reward():
    fmt = AgentFormat()
    assert trajectory_reward(True, 0, fmt) == 10.0
    assert trajectory_reward(True, 3, fmt) == pytest.approx(9.7)
    assert trajectory_reward(False, 2, fmt) == pytest.approx(-0.2)


def _twx_task(game="coin"):
    from salvage.envs.twx import TWXEnv

    return TWXEnv.list_tasks("train", game=game, num_tasks=2)


def test_malformed_actions_are_penalised_and_the_episode_goes_on(tiny):
    needs_twx()
    model, tok = tiny
    fmt = AgentFormat()
    with EnvPool("twx") as pool:
        runner = AgentRunner(pool, fmt, max_turns=4)
        pol = LMPolicy(HFEngine(model, tok, max_new_tokens=12), tok, fmt)
        eps = runner.run([Start(t, seed=0) for t in _twx_task()], pol, seed=1)
    for e in eps:
        assert e.error is None
        # an untrained model writes no well-formed action: every turn is invalid, the
        # episode still runs to the cap, and each invalid turn costs 0.1 training reward
        assert len(e.turns) == 4 and e.n_invalid == 4
        assert [t.depth for t in e.turns] == [0, 1, 2, 3]
        assert [t.budget for t in e.turns] == [4, 3, 2, 1]
        traj = runner.to_trajectory(e)
        assert traj.reward == pytest.approx(-0.4) and traj.success is False
        for t in e.turns:
            assert len(t.logprobs) == len(t.response_ids) > 0 and t.prompt_ids


def test_same_seed_same_trajectory(tiny):
    needs_twx()
    model, tok = tiny
    fmt = AgentFormat()

    def play(seed):
        with EnvPool("twx") as pool:
            runner = AgentRunner(pool, fmt, max_turns=3)
            pol = LMPolicy(HFEngine(model, tok, max_new_tokens=10), tok, fmt)
            eps = runner.run([Start(t, seed=0) for t in _twx_task()], pol, seed=seed)
        return [[(t.response_ids, t.action) for t in e.turns] + e.observations for e in eps]

    assert play(5) == play(5)
    assert play(5) != play(6)


def test_oracle_wins_and_a_recorded_state_resumes_with_its_history():
    needs_twx()
    fmt = AgentFormat()
    tasks = _twx_task("twc")
    with EnvPool("twx") as pool:
        runner = AgentRunner(pool, fmt, max_turns=10)
        eps = runner.run([Start(tasks[0], seed=0)], OraclePolicy(fmt), seed=0)
        e = eps[0]
        assert e.won and all(t.valid for t in e.turns)
        # restart from depth 2 of that episode: verified restore, budget H - 2
        state = e.state_at(2)
        again = runner.run(
            [Start(tasks[0], 0, state=state, history=e.history[:2])], OraclePolicy(fmt), seed=0
        )[0]
        assert again.error is None and again.won
        assert again.turns[0].depth == 2 and again.turns[0].budget == 8
        assert again.actions == e.actions[2:]
        assert e.history[1][1] in again.turns[0].prompt_text  # the visible history is shown
        # a tampered state fails that episode at restore, it is never silently used
        bad = dict(state, observation="something else", digest=None)
        failed = runner.run([Start(tasks[0], 0, state=bad)], OraclePolicy(fmt), seed=0)[0]
        assert failed.error and "does not reproduce" in failed.error and not failed.turns


def _env():
    env = dict(os.environ)
    env.update(OMP_WAIT_POLICY="PASSIVE", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    return env


def test_cli_multiturn_grpo_fit_and_test_per_family(tmp_path):
    needs_twx()
    run = tmp_path / "RUN"
    base: list[str] = []  # python -m salvage, forked after its imports (tests/forked_cli.py)
    cfg = [
        "--config",
        str(ROOT / "configs/agent/twx_grpo.yaml"),
        "--trainer.default_root_dir",
        str(run),
        "--trainer.enable_progress_bar",
        "false",
    ]
    proc = forked_cli.run(
        [*base, "fit", *cfg, "--trainer.max_steps", "2"], tmp_path, _env(), timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(next(run.glob("version_0/metrics.csv")).open()))
    steps = [r for r in rows if r.get("rollout/turns")]
    assert len(steps) == 2 and float(steps[0]["rollout/turns"]) > 1
    assert float(steps[0]["rollout/invalid_turn_frac"]) > 0 and steps[0]["env/errors"] == "0.0"
    # the untrained student rambles: some turns end at max_new_tokens, and a cut-off answer
    # has no closing tag, so those turns are among the invalid ones
    trunc = float(steps[0]["rollout/truncated_frac"])
    assert 0 < trunc <= float(steps[0]["rollout/invalid_turn_frac"])
    # the test also samples 2 episodes per task at T 1 beside the greedy one
    proc = forked_cli.run(
        [*base, "test", *cfg, "--data.init_args.val_samples", "2"], tmp_path, _env(), timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval/success/coin" in proc.stdout and "eval/success " in proc.stdout.replace("│", " ")
    for key in ("eval/sampled_success", "eval/sampled_pass_at_k", "eval/sampled_success/coin"):
        assert key in proc.stdout


def test_sampled_evaluation_metrics_by_hand():
    from salvage.modules.grpo import _sampled_metrics
    from salvage.types import Group, RolloutBatch, Trajectory

    def group(fam, wins):
        trajs = [Trajectory(turns=[], reward=float(w), success=w) for w in wins]
        return Group(task_id=f"{fam}/{len(wins)}", trajectories=trajs, task={"family": fam})

    # 3 tasks x k = 2: coin (1 of 2), coin (0 of 2), twc (2 of 2)
    batch = RolloutBatch(
        groups=[group("coin", [True, False]), group("coin", [False, False]), group("twc", [1, 1])]
    )
    m = _sampled_metrics(batch, "val")
    assert m["val/sampled_success"] == (3 / 6, 6)  # samples that won
    assert m["val/sampled_pass_at_k"] == (2 / 3, 3)  # tasks with a win among their 2
    assert m["val/sampled_success/coin"] == (1 / 4, 4)
    assert m["val/sampled_success/twc"] == (1.0, 2)


def _sft_fit(tmp_path, sft, max_new: int, num_tasks: int, max_turns: int):
    """One tiny GRPO update on TWX coin with ``sft`` as its warm start; returns ``sft``."""
    import lightning as L

    from salvage.datamodules.agent import AgentDataModule, EnvSpec
    from salvage.models import PolicySpec
    from salvage.modules.grpo import GRPOModule
    from salvage.rollout.config import EngineConfig

    trainer = L.Trainer(
        max_steps=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
        callbacks=[sft],
    )
    data = AgentDataModule(
        env=EnvSpec(name="twx", train_tasks={"game": "coin", "num_tasks": num_tasks}),
        max_turns=max_turns,
        tasks_per_step=1,
        group_size=2,
        engine=EngineConfig(max_new_tokens=max_new),
    )
    module = GRPOModule(policy=PolicySpec("tiny", vocab_size=384, seed=1), lr=1e-4)
    trainer.fit(module, datamodule=data)
    return sft


def test_oracle_sft_refuses_a_max_new_tokens_too_short_for_the_oracle_actions(tmp_path):
    """Regression: the BPE-384 `tiny` student needs 25 tokens for
    '<think></think><action>move north</action>' (its stop string ends it there), so at
    max_new_tokens 24 every action it learned was cut off and scored invalid (the agent
    study's student B never won); OracleSFT now names the key before training."""
    needs_twx()
    from salvage.callbacks.sft import OracleSFT
    from salvage.errors import ConfigError

    def fit(max_new: int) -> OracleSFT:
        sft = OracleSFT(episodes=2, steps=1, batch_size=2)
        return _sft_fit(tmp_path, sft, max_new, num_tasks=2, max_turns=2)

    with pytest.raises(ConfigError, match=r"data\.engine\.max_new_tokens=24.*>= 2[5-9]"):
        fit(24)
    assert fit(32).done  # long enough: the warm start runs


def test_oracle_sft_plays_its_episodes_in_chunks_reusing_the_instances(tmp_path):
    """Regression: a 256-episode warm start on twc was OOM-killed because every oracle
    episode held its own TextWorld-Express instance at once. Chunks of ``chunk_size`` reuse
    the released instances: the same demonstrations, at most ``chunk_size`` instances."""
    needs_twx()
    from salvage.callbacks.sft import OracleSFT

    class Seen(OracleSFT):
        def demonstrations(self, trainer):
            self.pairs = super().demonstrations(trainer)
            host = trainer.datamodule.pool._local
            self.instances = len(host.envs) + len(host.free)
            return self.pairs

    def fit(chunk: int) -> Seen:
        sft = Seen(episodes=5, steps=1, batch_size=2, chunk_size=chunk)
        return _sft_fit(tmp_path, sft, 32, num_tasks=3, max_turns=3)

    chunked, whole = fit(2), fit(5)
    assert chunked.instances == 2 and whole.instances == 5
    assert chunked.pairs == whole.pairs and len(chunked.pairs) > 0
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        OracleSFT(chunk_size=0)
