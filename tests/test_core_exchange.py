"""The receiver's side of a GRAFT exchange (core.exchange), with hand-worked numbers."""

from __future__ import annotations

import math

import pytest

from salvage.core.exchange import ExchangeRules, peer_responses, receive_group
from salvage.types import Group, SeqRatio, Trajectory, Turn


def _traj(reward: float, logprobs: list[float], advantage: float = 0.0) -> Trajectory:
    turn = Turn([1, 2], [3] * len(logprobs), logprobs, response_text="x")
    return Trajectory(turns=[turn], reward=reward, success=reward > 0, advantage=advantage)


def _case() -> tuple[Group, list[Trajectory], list[Turn]]:
    own = Group("q", [_traj(0.0, [-1.0]), _traj(0.0, [-1.0])])
    # source log-probs: mean -1 for both peer responses
    peers = [_traj(1.0, [-1.0, -1.0], advantage=0.7), _traj(0.0, [-1.0], advantage=-0.7)]
    # the receiver's pi_old log-probs of its re-tokenisations: means -1 and -2
    turns = [Turn([1, 2], [3, 4], [-1.5, -0.5]), Turn([1, 2], [3], [-2.0])]
    return own, peers, turns


def test_graft_weights_by_hand():
    own, peers, turns = _case()
    g = receive_group(own, peers, turns, ExchangeRules())
    # s = exp(lbar_receiver - lbar_source): exp(-1 - -1) = 1 and exp(-2 - -1) = e^-1 = 0.368;
    # w = min(s, 1) above the gate delta = 0.8, else 0
    assert [t.compat for t in g.trajectories] == pytest.approx([1.0, math.exp(-1)])
    assert [t.weight for t in g.trajectories] == pytest.approx([1.0, 0.0])
    assert [t.advantage for t in g.trajectories] == [0.7, -0.7]  # the source's, fixed
    assert g.peer and [t.source for t in g.trajectories] == ["peer", "peer"]
    assert [t.loss for t in g.trajectories] == ["clip", "clip"]
    assert all(t.seq_ratio is None for t in g.trajectories)
    # no floor: w = min(s, 1) for every response; no gate: every response weighs 1
    g = receive_group(own, peers, turns, ExchangeRules(floor=False))
    assert [t.weight for t in g.trajectories] == pytest.approx([1.0, math.exp(-1)])
    g = receive_group(own, peers, turns, ExchangeRules(gate=False))
    assert [t.weight for t in g.trajectories] == [1.0, 1.0]
    # random admission: 0 until the caller draws the admitted ones over the direction
    g = receive_group(own, peers, turns, ExchangeRules(admission="random"))
    assert [t.weight for t in g.trajectories] == [0.0, 0.0]


def test_pooled_advantages_by_hand():
    own, peers, turns = _case()
    g = receive_group(own, peers, turns, ExchangeRules(peer_advantage="pooled"))
    # pool [0, 0 | 1, 0]: mean 0.25, unbiased std sqrt((3 x 0.0625 + 0.5625) / 3) = 0.5
    # -> A = (r - 0.25) / 0.5 = [-0.5, -0.5 | 1.5, -0.5]
    assert [t.source for t in g.trajectories] == ["self", "self", "peer", "peer"]
    assert [t.advantage for t in g.trajectories] == pytest.approx([-0.5, -0.5, 1.5, -0.5], abs=1e-5)


def test_hacpo_group_by_hand():
    own, peers, turns = _case()
    rules = ExchangeRules(mode="hacpo")
    g = receive_group(own, peers, turns, rules, step=4, live=False, capability=(0.0, 0.5))
    own_t, peer_t = g.trajectories[:2], g.trajectories[2:]
    # peers: weight 1, loss label hacpo, ratio against the source mean (-1) within
    # [0.8 + 0.025 x 4, no upper bound]; own: against their own mean within [1 - 3e-4, 1 + 4e-4]
    assert [t.weight for t in peer_t] == [1.0, 1.0] and [t.loss for t in peer_t] == ["hacpo"] * 2
    assert peer_t[0].seq_ratio == SeqRatio(-1.0, pytest.approx(0.9), None)
    assert own_t[0].seq_ratio == SeqRatio(-1.0, 1 - 3e-4, 1 + 4e-4)
    # capabilities 0 and 0.5: omega = min(1, 0.05 / 0.55) = 1/11 on the peer responses;
    # b = (1/11) / (2 + 2/11) = 1/24; sigma^2 = (2 b^2 + (1/11)((1 - b)^2 + b^2)) / (24/11)
    # = 0.0399306, sigma = 0.199826 -> own A = -b / sigma = -0.208514
    assert [t.advantage for t in own_t] == pytest.approx([-0.208514] * 2, abs=1e-5)
    assert [t.advantage for t in peer_t] == [0.0, 0.0]  # outside GRAFT's selection (live False)


def test_sequence_peer_ratio_and_success_filter():
    own, peers, turns = _case()
    g = receive_group(own, peers, turns, ExchangeRules(peer_ratio="sequence"))
    # Table 2a: one ratio per response against the receiver's pi_old mean, clip 0.2 / 0.28
    assert [t.seq_ratio for t in g.trajectories] == [
        SeqRatio(-1.0, 0.8, 1.28),
        SeqRatio(-2.0, 0.8, 1.28),
    ]
    src = Group("q", peers)
    assert peer_responses(src, ExchangeRules(peer_filter="success")) == peers[:1]
    assert peer_responses(src, ExchangeRules(peer_filter="success", mode="hacpo")) == peers


def test_weight_metrics_by_hand():
    from salvage.core.exchange import weight_metrics

    # weights 0, 0.5, 1, 0: mean 1.5 / 4 = 0.375; admitted (w > 0) 2 of 4 = 0.5
    assert weight_metrics([0.0, 0.5, 1.0, 0.0]) == {
        "graft/weight_mean": 0.375,
        "graft/admitted_frac": 0.5,
    }
    # no transfers: no admitted fraction at all (not 0, "none admitted")
    assert weight_metrics([]) == {"graft/weight_mean": 0.0}


def test_admission_metrics_by_hand():
    from salvage.core.exchange import admission_metrics

    def row(success, admitted):
        return {"success": success, "admitted": admitted}

    # 4 correct responses, 1 admitted: 0.25; 2 incorrect, both admitted: 1.0; gap -0.75
    rows = [row(True, True), row(True, False), row(True, False), row(True, False)]
    rows += [row(False, True), row(False, True)]
    assert admission_metrics(rows) == {
        "graft/admitted_correct_frac": 0.25,
        "graft/admitted_incorrect_frac": 1.0,
        "graft/admission_gap": -0.75,
    }
    # only correct ones transferred (stored success-only logs): no incorrect fraction, no gap
    assert admission_metrics([row(True, True), row(True, False)]) == {
        "graft/admitted_correct_frac": 0.5
    }
    assert admission_metrics([]) == {}


def test_transfer_rows_by_hand():
    from salvage.core.exchange import transfer_rows

    own, peers, turns = _case()
    g = receive_group(own, peers, turns, ExchangeRules())
    rows = transfer_rows([own, g], [1], "a", "b", step=3)
    # source means -1, -1 (2 and 1 tokens); receiver means -1 (2 tokens), -2 (1 token)
    assert [(r["direction"], r["prompt"], r["response"], r["step"]) for r in rows] == [
        ("a_to_b", 1, 0, 3),
        ("a_to_b", 1, 1, 3),
    ]
    assert [(r["lbar_src"], r["lbar_recv"]) for r in rows] == [(-1.0, -1.0), (-1.0, -2.0)]
    assert [(r["tokens_src"], r["tokens_recv"]) for r in rows] == [(2, 2), (1, 1)]
    assert [r["s"] for r in rows] == pytest.approx([1.0, math.exp(-1)])
    assert [(r["reward"], r["weight"], r["admitted"]) for r in rows] == [
        (1.0, 1.0, True),
        (0.0, 0.0, False),
    ]
    assert transfer_rows([own, g], [0], "a", "b", step=3) == []  # no peer response there


def test_admission_by_direction_by_hand():
    from salvage.commands.report import admission_lines
    from salvage.history import Admission, admission_by_direction, log_s

    rows = [
        {"direction": "a_to_b", "success": True, "admitted": True},
        {"direction": "a_to_b", "success": True, "admitted": False},
        {"direction": "a_to_b", "success": False, "admitted": True},
        {"direction": "b_to_a", "reward": 1.0, "admitted": False},  # no success: reward > 0
        {"direction": "b_to_a", "reward": 0.0, "admitted": False},
    ]
    t = admission_by_direction(rows)
    assert t["a_to_b"] == Admission(2, 1, 1, 1) and t["b_to_a"] == Admission(1, 0, 1, 0)
    assert admission_lines(t)[2:] == [
        "| a -> b | 1/2 (0.500) | 1/1 (1.000) |",
        "| b -> a | 0/1 (0.000) | 0/1 (0.000) |",
    ]
    assert Admission.cell(0, 0) == "0/0 (n/a)"
    assert log_s({"lbar_src": -2.0, "lbar_recv": -2.5, "s": 9.0}) == -0.5  # the parts first
    assert log_s({"s": math.e}) == pytest.approx(1.0)
