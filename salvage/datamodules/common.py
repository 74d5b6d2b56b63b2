"""Pieces both datamodules share: per-step seeds, advantages on a group."""

from __future__ import annotations

import torch

from salvage.core.grpo import group_advantages, is_zero_signal
from salvage.types import Group


def step_seed(seed: int, step: int, stream: int = 0) -> int:
    """Deterministic per-step seed for one named random stream (no global RNG)."""
    return (seed * 2_654_435_761 + step * 40_503 + stream * 97) % (2**31 - 1)


def assign_advantages(
    group: Group, estimator: str, eps: float, reward_tol: float, adv_tol: float
) -> None:
    """Write each trajectory's advantage and the group's zero-signal flag (SPEC §1)."""
    rewards = torch.tensor(group.rewards, dtype=torch.float32)
    adv = group_advantages(rewards, estimator, eps)  # type: ignore[arg-type]
    for t, a in zip(group.trajectories, adv.tolist(), strict=True):
        t.advantage = a
    group.zero_signal = is_zero_signal(
        rewards, torch.tensor(group.successes), adv, reward_tol, adv_tol
    )
