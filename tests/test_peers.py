"""GRAFT among N peers (salvage/core/peers.py, salvage/modules/peers.py; docs/peers.md)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from salvage.core.graft import select_transfers
from salvage.core.grpo import assign_advantages
from salvage.core.peers import (
    balance_pairs,
    capped_mean_compat,
    choose_sources,
    pair_order,
    transfer_matrix,
)
from salvage.datamodules.graft import GraftDataModule
from salvage.models import PolicySpec
from salvage.modules.graft import GRAFTModule
from salvage.modules.peers import PeerGroupModule
from salvage.rollout.config import EngineConfig
from salvage.tasks.math import MathData
from tests import forked_cli

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ core, by hand
def test_pair_order_visits_each_unordered_pair_in_index_order_forward_first():
    assert pair_order(2) == [(0, 1), (1, 0)]
    assert pair_order(3) == [(0, 1), (1, 0), (0, 2), (2, 0), (1, 2), (2, 1)]


# Successes of models a, b, c (rows) on prompts 0..3 (columns), n = 4 samples each.
# Receiver a: q0 has candidates b (1 of 4) and c (3 of 4); q1 nobody solved; q2, q3 a solved.
# Receiver b: q2 candidate a (2 of 4); q3: a solved all 4 -> not complementary.
# Receiver c: q2 candidate a; q0 and q3 c or nobody else qualifies.
K = [[0, 0, 2, 4], [1, 0, 0, 0], [3, 0, 0, 0]]


def test_choose_sources_by_successes_takes_the_peer_that_solved_most():
    got = choose_sources(K, 4, random.Random(0), "successes")
    assert got == {(0, 1): [2], (1, 0): [], (0, 2): [2], (2, 0): [0], (1, 2): [], (2, 1): []}


def test_choose_sources_by_compat_then_successes_then_index():
    def scores(table):
        return lambda s, r, q: table[(s, r, q)]

    # b's responses more compatible with a than c's: b is the source despite fewer successes
    got = choose_sources(K, 4, random.Random(0), "compat", scores({(1, 0, 0): 0.9, (2, 0, 0): 0.5}))
    assert got[(1, 0)] == [0] and got[(2, 0)] == []
    # a tie in compatibility: more successes wins (c)
    got = choose_sources(K, 4, random.Random(0), "compat", scores({(1, 0, 0): 0.7, (2, 0, 0): 0.7}))
    assert got[(2, 0)] == [0] and got[(1, 0)] == []
    # a tie in both: the lower index wins
    k = [[0], [2], [2]]
    got = choose_sources(k, 4, random.Random(0), "compat", scores({(1, 0, 0): 1, (2, 0, 0): 1}))
    assert got[(1, 0)] == [0]
    # a single candidate is never scored
    called = []
    choose_sources([[0], [1]], 4, random.Random(0), "compat", lambda *a: called.append(a) or 0.0)
    assert called == []


def test_choose_sources_at_random_draws_once_per_prompt_with_several_candidates():
    rng = random.Random(5)
    got = choose_sources(K, 4, rng, "random")
    ref = random.Random(5)
    src = ref.choice([1, 2])  # a's q0: one draw among b and c; nothing else has two
    assert got[(src, 0)] == [0] and got[(3 - src, 0)] == []
    assert rng.random() == ref.random()  # exactly one draw consumed


def test_balance_pairs_caps_each_direction_of_every_pair_by_hand():
    proposed = {(0, 1): [0, 1, 2, 3], (1, 0): [5], (2, 0): [6, 7]}
    got = balance_pairs(proposed, 3, random.Random(1), "min_ratio", 1.0)
    ref = random.Random(1)
    # (a, b): a -> b proposes 4, b -> a 1: a -> b keeps ceil(1 * max(1, 1)) = 1 drawn at random,
    # b -> a keeps its 1 (cap ceil(1 * 4) = 4)
    assert got[(0, 1)] == sorted(ref.sample([0, 1, 2, 3], 1)) and got[(1, 0)] == [5]
    # (a, c): a -> c proposes 0; c -> a proposes 2 > ceil(1 * max(0, 1)) = 1: one drawn
    assert got[(0, 2)] == [] and got[(2, 0)] == sorted(ref.sample([6, 7], 1))
    assert got[(1, 2)] == got[(2, 1)] == []
    assert balance_pairs(proposed, 3, random.Random(1), "min_ratio", 2.0)[(0, 1)] == sorted(
        random.Random(1).sample([0, 1, 2, 3], 2)
    )  # rho = 2: cap ceil(2 * 1) = 2
    assert balance_pairs(proposed, 3, random.Random(1), "none")[(0, 1)] == [0, 1, 2, 3]


def test_two_models_select_exactly_as_graft_random_draws_included():
    for trial in range(300):
        g = random.Random(trial)
        n = g.choice([2, 4, 8])
        k_a = [g.randint(0, n) for _ in range(g.randint(1, 12))]
        k_b = [g.choice([0, 0, g.randint(0, n)]) for _ in k_a]
        rho = g.choice([0.5, 1.0, 2.0])
        r1, r2 = random.Random(trial), random.Random(trial)
        want = select_transfers(k_a, k_b, n, r1, "min_ratio", rho)
        prop = choose_sources([k_a, k_b], n, r2, "compat", lambda *a: 1 / 0)
        got = balance_pairs(prop, 2, r2, "min_ratio", rho)
        assert got[(0, 1)] == want.a_to_b and got[(1, 0)] == want.b_to_a
        assert (len(prop[(0, 1)]), len(prop[(1, 0)])) == (want.m_ab, want.m_ba)
        assert r1.random() == r2.random()  # the same stream afterwards


def test_capped_mean_and_transfer_matrix_by_hand():
    assert capped_mean_compat([0.5, 2.0, 0.9]) == pytest.approx((0.5 + 1.0 + 0.9) / 3)
    assert capped_mean_compat([]) == 0.0
    m = transfer_matrix({"a_to_b": 2, "c_to_a": 1}, ["a", "b", "c"])
    assert m == [[0, 2, 0], [0, 0, 0], [1, 0, 0]]


def test_bad_inputs_are_refused_by_name():
    with pytest.raises(ValueError, match="source_rule"):
        choose_sources(K, 4, random.Random(0), "best")
    with pytest.raises(ValueError, match="model 1"):
        choose_sources([[0, 1], [0]], 4, random.Random(0))
    with pytest.raises(ValueError, match="model.policies"):
        PeerGroupModule(policies=[PolicySpec("tiny")])
    with pytest.raises(ValueError, match="model.lrs"):
        PeerGroupModule(lrs=[1e-3, 1e-3])
    with pytest.raises(ValueError, match="model.mode='hacpo'"):
        PeerGroupModule(mode="hacpo")
    with pytest.raises(ValueError, match="model.policy_a"):
        PeerGroupModule(policy_a=PolicySpec("tiny"))


# ------------------------------------------------------------------ the module
class Scripted(GraftDataModule):
    """Real rollouts of every model; outcomes overwritten by ``PLAN[name]`` (per prompt)."""

    PLAN: dict[str, list[list[int]]] = {}

    def train_rollout(self, tasks):
        batch = super().train_rollout(tasks)
        for name, part in batch.parts().items():
            rows = self.PLAN.get(name, [])
            for q, g in enumerate(part.groups):
                succ = rows[q] if q < len(rows) else [0] * len(g.trajectories)
                for t, ok in zip(g.trajectories, succ, strict=True):
                    t.success, t.reward = bool(ok), float(ok)
                assign_advantages(g, "grpo", 1e-6, 1e-6, 1e-6)
        return batch


class TwoWay(Scripted):
    # A -> B complementary on q0 and q2, B -> A on q1: min_ratio keeps one of A's two, at random
    PLAN = {
        "a": [[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]],
        "b": [[0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]],
    }


class ThreeWay(Scripted):
    # q0: a failed, b solved 1 of 4 and c 2 of 4 (a has two candidate sources);
    # q1: b failed, a solved 1 of 4 (c solved all: not complementary) -> a to b;
    # q2: c failed, b solved 3 of 4 (a solved all) -> b to c; q3: nobody solved anything
    PLAN = {
        "a": [[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]],
        "b": [[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]],
        "c": [[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]],
    }


class Capture(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.peer = {
            n: [i for i, g in enumerate(p.groups) if g.peer] for n, p in batch.parts().items()
        }


def _fit(module, tmp_path, data_cls, steps=1):
    data = data_cls(
        train=MathData(source="reasoning_gym:basic_arithmetic", size=8),
        prompts_per_step=4,
        group_size=4,
        engine=EngineConfig(max_new_tokens=8),
    )
    cap = Capture()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cap],
    )
    trainer.fit(module, datamodule=data)
    return trainer, cap


def _records(trainer):
    return [json.loads(x) for x in Path(trainer.log_dir, "exchange.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "extra",
    [{}, {"admission": "random", "delta": 0.05, "order": "uniform", "peer_advantage": "pooled"}],
)
def test_two_peers_equal_graft_module_exactly(tmp_path, extra):
    common = dict(lr=1e-3, num_minibatches=2, micro_batch_size=8, seed=3, **extra)
    specs = [PolicySpec("tiny", vocab_size=768), PolicySpec("tiny", vocab_size=384, seed=1)]
    graft = GRAFTModule(policy_a=specs[0], policy_b=specs[1], **common)
    peers = PeerGroupModule(policies=specs, **common)
    tg, cg = _fit(graft, tmp_path / "graft", TwoWay, steps=2)
    tp, cp = _fit(peers, tmp_path / "peers", TwoWay, steps=2)
    assert cg.peer == cp.peer and cg.peer["a"] == [1] and len(cg.peer["b"]) == 1
    for name in ("a", "b"):
        want = dict(graft.learner(name).policy.named_parameters())
        got = dict(peers.learner(name).policy.named_parameters())
        init = PeerGroupModule(policies=specs).learner(name)
        init.configure_model()
        moved = dict(init.policy.named_parameters())
        assert any(not torch.equal(want[k], moved[k]) for k in want)  # the update did something
        for k, p in want.items():
            assert torch.equal(got[k], p), f"{name}: {k} differs"
    for rg, rp in zip(_records(tg), _records(tp), strict=True):
        assert rp["transfers"]["a_to_b"] == rg["a_to_b"]
        assert rp["transfers"]["b_to_a"] == rg["b_to_a"]
        assert rp["complementary"] == {"a_to_b": rg["m_ab"], "b_to_a": rg["m_ba"]}
        assert sorted(rp["weights"]) == sorted(rg["weights"])
        # the per-response rows: the same responses, scores and admissions
        key = lambda r: (r["direction"], r["prompt"], r["response"])  # noqa: E731
        assert sorted(rp["responses"], key=key) == sorted(rg["responses"], key=key)
    mg, mp = tg.callback_metrics, tp.callback_metrics
    assert float(mp["graft/transferred/a_to_b"]) == float(mg["graft/transferred_a_to_b"]) == 1
    assert float(mp["graft/weight_mean"]) == pytest.approx(float(mg["graft/weight_mean"]))


class SpyScores(PeerGroupModule):
    """The real module; records each source-choice score it computed."""

    def _compat(self, src, dst, q, receiver):
        s, scored = super()._compat(src, dst, q, receiver)
        self.seen = getattr(self, "seen", []) + [(receiver, q, s)]
        return s, scored


@pytest.mark.parametrize("rule", ["successes", "compat"])
def test_three_peers_exchange_per_ordered_pair(tmp_path, rule, monkeypatch):
    import salvage.modules.graft as graft_mod
    import salvage.modules.peers as peers_mod

    scorings = []  # (source group, receiver) of every peer_turns call (the real function)

    def counted(source, own, receiver, *args, **kwargs):
        scorings.append((id(source), id(receiver)))
        return graft_mod.peer_turns.__wrapped__(source, own, receiver, *args, **kwargs)

    counted.__wrapped__ = graft_mod.peer_turns
    monkeypatch.setattr(graft_mod, "peer_turns", counted)
    monkeypatch.setattr(peers_mod, "peer_turns", counted)
    module = SpyScores(lr=1e-3, num_minibatches=2, micro_batch_size=8, source_rule=rule)
    trainer, cap = _fit(module, tmp_path, ThreeWay)
    # the chosen source's responses are scored once: for the choice, then reused
    assert len(scorings) == len(set(scorings)) == (4 if rule == "compat" else 3)
    m = trainer.callback_metrics
    (rec,) = _records(trainer)
    tr = rec["transfers"]
    assert tr["a_to_b"] == [1] and tr["b_to_c"] == [2]
    if rule == "successes":  # c solved 2 of 4 on q0, b 1 of 4
        assert tr["c_to_a"] == [0] and tr["b_to_a"] == []
    else:  # the peer whose responses a scores as more compatible
        (b_score, c_score) = [s for r, q, s in module.seen if r is module.a and q == 0]
        want = "c_to_a" if c_score >= b_score else "b_to_a"  # a tie: c solved more
        assert tr[want] == [0] and sum(len(v) for v in tr.values()) == 3
        assert len(module.seen) == 2  # only a's q0 had two candidates
    assert cap.peer == {"a": [0], "b": [1], "c": [2]}
    rows = rec["responses"]  # one row per response of each transferred group (4 per group)
    assert sorted((r["direction"], r["prompt"]) for r in rows) == sorted(
        (d, q) for d, qs in tr.items() for q in qs for _ in range(4)
    )
    assert all(r["admitted"] == (r["weight"] > 0) for r in rows)
    assert rec["complementary"]["a_to_c"] == 0 and rec["complementary"]["b_to_c"] == 1
    assert float(m["graft/transferred"]) == 3
    assert float(m["graft/transferred/a_to_b"]) == 1 and float(m["graft/transferred/c_to_b"]) == 0
    for name in ("a", "b", "c"):
        assert f"{name}/loss/peer_clip_frac" in m


def test_cli_three_peers_fit_report_matrix_and_export(tmp_path):
    run = tmp_path / "RUN"
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    salvage = [sys.executable, "-m", "salvage"]
    # the fit and the export: processes forked after the CLI's imports (tests/forked_cli.py)
    proc = forked_cli.run(
        [
            "fit",
            "--config",
            str(ROOT / "configs/graft/peers3_tiny.yaml"),
            "--trainer.max_steps",
            "1",
            "--trainer.default_root_dir",
            str(run),
            "--trainer.enable_progress_bar",
            "false",
            "--data.init_args.engine.max_new_tokens",
            "8",
        ],
        tmp_path,
        env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    header = (run / "version_0/metrics.csv").read_text().splitlines()[0].split(",")
    for key in ("graft/transferred/c_to_a", "graft/complementary/b_to_c", "c/rollout/success_rate"):
        assert key in header
    proc = subprocess.run(
        [*salvage, "report", str(run)], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = (run / "report/report.md").read_text()
    assert "transfer matrix over 1 updates" in report
    assert "| from \\ to | a | b | c |" in report and "| c | " in report
    out = tmp_path / "c_hf"
    proc = forked_cli.run(["export", str(run), str(out), "--policy", "c"], tmp_path, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == 512  # model c's tokenizer and head, not a's (768) or b's (384)
