"""GRPO maths (SPEC §1) against values worked out by hand in each test."""

from __future__ import annotations

import math

import pytest
import torch

from salvage.core.grpo import (
    aggregation_weights,
    clipped_surrogate,
    group_advantages,
    is_zero_signal,
    kl_k3,
)


def test_grpo_advantage_std_normalised():
    # R = [1, 0, 0, 1]: mean 0.5; unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.57735
    # A = +-0.5 / 0.57735 = +-0.866025
    a = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), "grpo", eps=0.0)
    assert a.tolist() == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-5)


def test_grpo_advantage_eps_enters_denominator():
    # R = [2, 0]: mean 1, unbiased std = sqrt(2) = 1.414214; eps 0.5 -> A = +-1/1.914214
    a = group_advantages(torch.tensor([2.0, 0.0]), "grpo", eps=0.5)
    assert a.tolist() == pytest.approx([0.522408, -0.522408], abs=1e-5)


def test_drgrpo_advantage_no_std():
    # R = [3, 1, 2]: mean 2 -> [1, -1, 0]
    a = group_advantages(torch.tensor([3.0, 1.0, 2.0]), "drgrpo")
    assert a.tolist() == pytest.approx([1.0, -1.0, 0.0])


def test_rloo_advantage_leave_one_out():
    # R = [1, 0, 0, 0]: R_0 - mean(0,0,0) = 1; R_1 - mean(1,0,0) = -1/3
    a = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), "rloo")
    assert a.tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3], abs=1e-6)


def test_constant_group_has_zero_advantage_for_every_estimator():
    for est in ("grpo", "drgrpo", "rloo"):
        assert group_advantages(torch.zeros(4), est).abs().max() == 0.0


def test_unknown_estimator_is_a_clear_error():
    with pytest.raises(ValueError, match="advantage estimator"):
        group_advantages(torch.zeros(2), "ppo")  # type: ignore[arg-type]


def test_zero_signal_all_fail_flat():
    r = torch.zeros(4)
    assert is_zero_signal(r, torch.zeros(4, dtype=torch.bool), group_advantages(r))


def test_all_failure_with_format_penalty_is_not_zero_signal():
    # SPEC §1: -0.1 invalid-format penalty makes rewards differ -> gradient exists
    r = torch.tensor([0.0, -0.1, 0.0, -0.2])
    assert not is_zero_signal(r, torch.zeros(4, dtype=torch.bool), group_advantages(r))


def test_all_success_is_not_zero_signal_candidate():
    # every rollout succeeded: flat and zero advantage, but not "every rollout failed"
    r = torch.full((4,), 10.0)
    assert not is_zero_signal(r, torch.ones(4, dtype=torch.bool), group_advantages(r))


def test_zero_signal_tolerances():
    r = torch.tensor([0.0, 1e-7])
    adv = torch.tensor([0.0, 1e-7])
    assert is_zero_signal(r, torch.zeros(2, dtype=torch.bool), adv, reward_tol=1e-6, adv_tol=1e-6)
    assert not is_zero_signal(r, torch.zeros(2, dtype=torch.bool), adv, reward_tol=1e-8)


def test_clipped_surrogate_hand_values():
    # ratios r = exp(lp - old) chosen as 1.5, 0.5, 1.1, 0.7 with A = +1, +1, -1, -1
    # eps_low 0.2, eps_high 0.28:
    #  r=1.5,A=+1: min(1.5, 1.28) = 1.28 -> loss -1.28, clipped
    #  r=0.5,A=+1: min(0.5, 0.8) = 0.5  -> loss -0.5, not clipped
    #  r=1.1,A=-1: min(-1.1, -1.1) = -1.1 -> loss 1.1, not clipped
    #  r=0.7,A=-1: min(-0.7, -0.8) = -0.8 -> loss 0.8, clipped
    ratios = torch.tensor([1.5, 0.5, 1.1, 0.7])
    old = torch.zeros(4)
    lp = torch.log(ratios)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, ratio, clipped = clipped_surrogate(lp, old, adv, 0.2, 0.28)
    assert loss.tolist() == pytest.approx([-1.28, -0.5, 1.1, 0.8], abs=1e-6)
    assert ratio.tolist() == pytest.approx([1.5, 0.5, 1.1, 0.7], abs=1e-6)
    assert clipped.tolist() == [1.0, 0.0, 0.0, 1.0]


def test_clipped_surrogate_gradient_zero_when_clipped():
    lp = torch.log(torch.tensor([1.5, 1.0])).requires_grad_(True)
    loss, _, _ = clipped_surrogate(lp, torch.zeros(2), torch.tensor([1.0, 1.0]))
    loss.sum().backward()
    # clipped token: no gradient; unclipped: d(-r A)/d lp = -r A = -1
    assert lp.grad.tolist() == pytest.approx([0.0, -1.0])


def test_kl_k3_hand_values():
    # d = ref - cur; k3 = e^d - d - 1. d = 0 -> 0; d = ln 2 -> 2 - 0.693147 - 1 = 0.306853
    # d = -1 -> e^-1 + 1 - 1 = 0.367879
    cur = torch.tensor([0.0, 0.0, 0.0])
    ref = torch.tensor([0.0, math.log(2.0), -1.0])
    assert kl_k3(cur, ref).tolist() == pytest.approx([0.0, 0.306853, 0.367879], abs=1e-6)


def test_token_mean_aggregation():
    # rows with 3 and 1 counted tokens: every token weighs 1/4
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    w = aggregation_weights(mask, torch.tensor([0, 1]), "token-mean")
    x = torch.tensor([[1.0, 2.0, 3.0], [10.0, 99.0, 99.0]])
    assert float((w * x).sum()) == pytest.approx((1 + 2 + 3 + 10) / 4)


def test_seq_mean_token_mean_aggregation():
    # seq 0 mean = 2, seq 1 mean = 10 -> (2 + 10) / 2 = 6
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    w = aggregation_weights(mask, torch.tensor([0, 1]), "seq-mean-token-mean")
    x = torch.tensor([[1.0, 2.0, 3.0], [10.0, 99.0, 99.0]])
    assert float((w * x).sum()) == pytest.approx(6.0)


def test_seq_mean_groups_rows_of_one_trajectory():
    # rows 0 and 1 are two turns of trajectory 0 (tokens 1,2 and 3), row 2 is trajectory 1
    # traj 0 mean = (1+2+3)/3 = 2, traj 1 mean = 10 -> 6
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    x = torch.tensor([[1.0, 2.0], [3.0, 0.0], [10.0, 0.0]])
    w = aggregation_weights(mask, torch.tensor([0, 0, 1]), "seq-mean-token-mean")
    assert float((w * x).sum()) == pytest.approx(6.0)


def test_microbatch_sums_equal_full_minibatch():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    x = torch.randn(3, 3, generator=torch.Generator().manual_seed(0))
    for mode in ("token-mean", "seq-mean-token-mean"):
        w = aggregation_weights(mask, torch.tensor([0, 1, 2]), mode)
        full = (w * x).sum()
        parts = (w[:1] * x[:1]).sum() + (w[1:] * x[1:]).sum()
        assert float(parts) == pytest.approx(float(full))
