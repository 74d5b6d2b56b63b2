"""GRAFT exchange logic (SPEC §3) on hand-worked values."""

from __future__ import annotations

import math
import random

import pytest
import torch

from salvage.core.graft import (
    compat_weight,
    compatibility,
    complementary,
    hacpo_clip_range,
    luffy_token_loss,
    mean_logprob,
    order_groups,
    plan_minibatches,
    pooled_advantages,
    random_admission,
    select_transfers,
    select_unidirectional,
    sequence_clipped_loss,
    sequence_ratio,
    sgt_pick,
    split_minibatches,
)


def test_complementary():
    n = 8
    assert complementary(0, 3, n)
    assert not complementary(0, 0, n)  # nobody solved it
    assert not complementary(0, 8, n)  # k_A = n: zero advantages, useless
    assert not complementary(1, 3, n)  # the receiver has its own signal


def test_selection_without_balancing():
    # prompts:  0      1      2      3      4      5
    k_a = [3, 0, 8, 0, 5, 2]
    k_b = [0, 4, 0, 0, 0, 1]
    t = select_transfers(k_a, k_b, 8, random.Random(0), balance="none")
    # A->B: k_B = 0 and 1 <= k_A <= 7: prompts 0, 4 (2 has k_A = 8, 3 has k_A = 0)
    # B->A: k_A = 0 and 1 <= k_B <= 7: prompt 1
    assert (t.a_to_b, t.b_to_a, t.m_ab, t.m_ba) == ([0, 4], [1], 2, 1)


def test_min_ratio_balancing_caps_each_direction():
    # A->B complementary on 5 prompts, B->A on 2: A->B capped at ceil(1.0 * 2) = 2
    k_a = [1, 2, 3, 4, 5, 0, 0]
    k_b = [0, 0, 0, 0, 0, 3, 4]
    seen = set()
    for s in range(30):
        t = select_transfers(k_a, k_b, 8, random.Random(s), balance="min_ratio", rho=1.0)
        assert len(t.a_to_b) == 2 and set(t.a_to_b) <= {0, 1, 2, 3, 4}
        assert t.b_to_a == [5, 6]  # cap ceil(1.0 * 5) = 5 > 2: all kept
        seen.add(tuple(t.a_to_b))
    assert len(seen) > 3  # chosen uniformly at random
    # rho = 1.5: ceil(1.5 * 2) = 3
    assert len(select_transfers(k_a, k_b, 8, random.Random(0), rho=1.5).a_to_b) == 3
    # no prompt the other way: max(m_other, 1) = 1 -> at most ceil(rho) = 1
    only_ab = select_transfers([2, 2, 2], [0, 0, 0], 8, random.Random(0))
    assert len(only_ab.a_to_b) == 1 and only_ab.b_to_a == []


def test_unidirectional_stored_mode_has_no_balancing():
    assert select_unidirectional([0, 0, 0, 2], [1, 2, 3, 0], 8) == [0, 1, 2]


def test_compatibility_and_weights_around_delta():
    # lbar_B - lbar_A = ln 0.9 -> s = 0.9 > 0.8: w = 0.9
    s = compatibility(math.log(0.9) - 1.0, -1.0)
    assert s == pytest.approx(0.9)
    assert compat_weight(s, 0.8) == pytest.approx(0.9)
    # s = 0.8 exactly: not above delta -> 0
    assert compat_weight(0.8, 0.8) == 0.0
    # s = 0.5 below delta -> 0; without floor -> min(s, 1) = 0.5; without gate -> 1
    assert compat_weight(0.5, 0.8) == 0.0
    assert compat_weight(0.5, 0.8, floor=False) == 0.5
    assert compat_weight(0.5, 0.8, gate=False) == 1.0
    # s = e^0.3 = 1.35 > 1 -> capped at 1
    assert compat_weight(compatibility(-0.7, -1.0), 0.8) == 1.0
    with pytest.raises(ValueError, match="delta=1.5"):
        compat_weight(0.9, 1.5)


def test_mean_logprob():
    assert mean_logprob([-1.0, -2.0, -3.0]) == pytest.approx(-2.0)
    with pytest.raises(ValueError):
        mean_logprob([])


def test_minibatch_order():
    peer = [False, True, False, True, False, False]
    assert order_groups(peer, "peer-last", random.Random(0)) == [0, 2, 4, 5, 1, 3]
    assert order_groups(peer, "peer-first", random.Random(0)) == [1, 3, 0, 2, 4, 5]
    # peer-last with 2 minibatches: the peer groups land in the last one
    assert split_minibatches([0, 2, 4, 5, 1, 3], 2) == [[0, 2, 4], [5, 1, 3]]
    assert plan_minibatches(peer, "peer-last", 3, random.Random(0)) == [[0, 2], [4, 5], [1, 3]]
    assert plan_minibatches(peer, "peer-first", 3, random.Random(0)) == [[1, 3], [0, 2], [4, 5]]


def test_uniform_order_shuffles_the_minibatches_not_the_groups():
    # SPEC 3.3: the peer-last minibatches [[0, 2], [4, 5], [1, 3]] keep their groups (the two
    # peer groups stay together in one minibatch); only their order changes from step to step
    peer = [False, True, False, True, False, False]
    chunks = [[0, 2], [4, 5], [1, 3]]
    seen = set()
    for seed in range(40):
        got = plan_minibatches(peer, "uniform", 3, random.Random(seed))
        assert sorted(got) == sorted(chunks)
        seen.add(tuple(map(tuple, got)))
    assert len(seen) == 6  # all 3! orders occur


def test_pooled_advantages_eps():
    # receiver [0, 0], peer [1, 1]: pooled mean 0.5, unbiased std = sqrt(1/3) = 0.57735
    a_r, a_p = pooled_advantages(torch.tensor([0.0, 0.0]), torch.tensor([1.0, 1.0]))
    assert a_r.tolist() == pytest.approx([-0.866024, -0.866024], abs=1e-5)
    assert a_p.tolist() == pytest.approx([0.866024, 0.866024], abs=1e-5)


def test_luffy_shaping():
    # p = 0.9: f = 0.9 / 1.0 = 0.9 -> loss -0.9 A; p = 0.1: f = 0.5
    lp = torch.log(torch.tensor([0.9, 0.1]))
    assert luffy_token_loss(lp, torch.tensor([1.0, 2.0])).tolist() == pytest.approx(
        [-0.9, -1.0], abs=1e-6
    )


def test_sgt_pick_and_hacpo_pieces():
    assert sgt_pick([False, True, False, True], 0, random.Random(0)) in {1, 3}
    assert sgt_pick([False, True], 2, random.Random(0)) is None  # receiver solved some
    assert sgt_pick([False, False], 0, random.Random(0)) is None
    # GRAFT Appendix B: lower bound 0.8 + 0.025 step, no upper bound (and no cap on the lower)
    assert hacpo_clip_range(0) == (pytest.approx(0.8), math.inf)
    assert hacpo_clip_range(4) == (pytest.approx(0.9), math.inf)
    assert hacpo_clip_range(100) == (pytest.approx(3.3), math.inf)
    # the labelled switch: an upper bound of 1 also caps the rising lower bound
    assert hacpo_clip_range(4, high=1.0) == (pytest.approx(0.9), 1.0)
    assert hacpo_clip_range(100, high=1.0) == (1.0, 1.0)


def test_random_admission_draws_exactly_the_gate_count_by_hand():
    # s = [0.9, 0.5, 1.2, 0.7, 0.85], delta 0.8: three pass the gate (0.9, 1.2, 0.85), so exactly
    # three responses are drawn uniformly from all five; a drawn one weighs min(s, 1), so a drawn
    # s = 0.5 keeps 0.5 (the floor only sets the count), the others weigh 0
    s = [0.9, 0.5, 1.2, 0.7, 0.85]
    counts = [0] * 5
    for seed in range(300):
        w = random_admission(s, 0.8, random.Random(seed))
        drawn = [i for i, x in enumerate(w) if x > 0]
        assert len(drawn) == 3
        assert all(w[i] == pytest.approx(min(s[i], 1.0)) for i in drawn)
        for i in drawn:
            counts[i] += 1
    # uniform: each index is drawn with probability 3/5 (180 of 300 on average)
    assert all(140 < c < 220 for c in counts), counts
    assert random_admission([0.1, 0.2], 0.8, random.Random(0)) == [0.0, 0.0]  # none pass
    assert random_admission([], 0.8, random.Random(0)) == []


def test_capability_weighted_baseline_by_hand():
    from salvage.core.graft import capability_advantages

    # receiver [0, 0], peer [1, 0]; capabilities c_recv 0.0, c_peer 0.45 -> omega = 0.05 / 0.5 = 0.1
    # weights [1, 1, 0.1, 0.1]: b = 0.1 / 2.2 = 0.0454545; var = (2 b^2 + 0.1 (1-b)^2 + 0.1 b^2) / 2.2
    a_own, a_peer = capability_advantages(
        torch.tensor([0.0, 0.0]), torch.tensor([1.0, 0.0]), 0.0, 0.45
    )
    b = 0.1 / 2.2
    sigma = math.sqrt((2 * b**2 + 0.1 * (1 - b) ** 2 + 0.1 * b**2) / 2.2)
    assert a_peer[0].item() == pytest.approx((1 - b) / sigma, abs=1e-4)
    assert a_own[0].item() == pytest.approx(-b / sigma, abs=1e-4)
    # equal capabilities: omega = 1, the plain (population-std) pooled baseline
    a_own, a_peer = capability_advantages(
        torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]), 0.5, 0.5
    )
    assert a_own.tolist() == pytest.approx(
        [1.0, -1.0], abs=1e-4
    ) and a_peer.tolist() == pytest.approx([1.0, -1.0], abs=1e-4)


def test_sequence_clipped_loss_by_hand():
    # row 0: target mean log-prob -1.0, source mean -1.5 -> rho = e^0.5 = 1.6487, A = +1: with no
    #   upper bound (HACPO as the GRAFT paper ran it) min(1.6487, clip(1.6487, 0.8, inf)) = 1.6487
    #   -> loss -1.6487 on each of its 2 tokens, not clipped
    # row 1: target mean -2.0, source -1.0 -> rho = e^-1 = 0.3679, A = -2:
    #   min(-0.7358, clip -> 0.8 * -2 = -1.6) = -1.6 -> loss +1.6, clipped; its padding stays 0
    lp = torch.tensor([[-1.0, -1.0], [-2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    ref = torch.tensor([-1.5, -1.0])
    assert sequence_ratio(lp, mask, ref).tolist() == pytest.approx(
        [math.exp(0.5), math.exp(-1.0)], abs=1e-6
    )
    low, high = hacpo_clip_range(0)
    loss, clipped = sequence_clipped_loss(lp, mask, ref, adv, low, high)
    e = math.exp(0.5)
    assert torch.allclose(loss, torch.tensor([[-e, -e], [1.6, 0.0]]), atol=1e-4)
    assert clipped.tolist() == [[0.0, 0.0], [1.0, 0.0]]
    # with the upper-bound switch at 1, row 0 is clipped to 1 -> loss -1
    loss, clipped = sequence_clipped_loss(lp, mask, ref, adv, *hacpo_clip_range(0, high=1.0))
    assert torch.allclose(loss, torch.tensor([[-1.0, -1.0], [1.6, 0.0]]), atol=1e-4)
    assert clipped.tolist() == [[1.0, 1.0], [1.0, 0.0]]
    # HACPO's own responses: deltas 3e-4 / 4e-4; mean log-ratio 1e-3 -> rho = 1.0010005 > 1.0004,
    # A = +1 -> clipped at 1.0004; per-row bounds (row 1: peer bounds, inside the range: rho = e^-0.1)
    loss, clipped = sequence_clipped_loss(
        torch.tensor([[-0.999], [-1.1]]),
        torch.ones(2, 1),
        torch.tensor([-1.0, -1.0]),
        torch.ones(2, 1),
        torch.tensor([1 - 3e-4, 0.8]),
        torch.tensor([1 + 4e-4, math.inf]),
    )
    assert loss[:, 0].tolist() == pytest.approx([-1.0004, -math.exp(-0.1)], abs=1e-6)
    assert clipped[:, 0].tolist() == [1.0, 0.0]
