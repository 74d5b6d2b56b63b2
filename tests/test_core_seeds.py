"""Pure pieces other layers import: named seed streams and the group advantage assignment."""

from __future__ import annotations

import pytest

from salvage.core import seeds
from salvage.core.evaluation import repeat_stream
from salvage.core.grpo import assign_advantages
from salvage.types import Group, Trajectory, Turn


def test_step_seed_by_hand():
    # (1 * 2_654_435_761 + 2 * 40_503 + 3 * 97) mod (2^31 - 1)
    # = 2_654_517_058 - 2_147_483_647 = 507_033_411
    assert seeds.step_seed(1, 2, 3) == 507_033_411
    # seed 0, step 0: every stream is 97 x its number
    assert seeds.step_seed(0, 0, seeds.GRAFT_EXCHANGE) == 21 * 97


def test_named_streams_are_distinct_and_keep_their_numbers():
    # the numbers are what seeded runs have always drawn from: renaming must not move them
    named = {
        "TRAIN": 0,
        "EVAL": 1,
        "RELAY_SELECT": 7,
        "RELAY_SEARCH": 11,
        "RELAY_DRIVE": 13,
        "EXTRA_ROLLOUTS": 17,
        "GRAFT_EXCHANGE": 21,
        "STORED_ADMISSION": 31,
    }
    assert {k: getattr(seeds, k) for k in named} == named
    assert repeat_stream(0) == seeds.EVAL and repeat_stream(3) == 1003
    assert seeds.permutation_seed(5, 2) == 5 * 1_000_003 + 2


def _group(rewards: list[float], successes: list[bool]) -> Group:
    trajs = [
        Trajectory(turns=[Turn([1], [2], [-0.1])], reward=r, success=s)
        for r, s in zip(rewards, successes, strict=True)
    ]
    return Group("q", trajs)


def test_assign_advantages_by_hand():
    # rewards [1, 0, 0, 0]: mean 0.25, centred [0.75, -0.25, -0.25, -0.25],
    # unbiased std = sqrt((0.5625 + 3 x 0.0625) / 3) = 0.5 -> [1.5, -0.5, -0.5, -0.5]
    g = _group([1.0, 0.0, 0.0, 0.0], [True, False, False, False])
    assign_advantages(g, "grpo", eps=0.0)
    assert [t.advantage for t in g.trajectories] == pytest.approx([1.5, -0.5, -0.5, -0.5])
    assert not g.zero_signal
    # Dr. GRPO: centred only
    assign_advantages(g, "drgrpo")
    assert [t.advantage for t in g.trajectories] == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_assign_advantages_marks_zero_signal_groups_only():
    flat = _group([0.0] * 4, [False] * 4)  # all failed, flat: zero-signal, advantages 0
    assign_advantages(flat)
    assert flat.zero_signal and [t.advantage for t in flat.trajectories] == [0.0] * 4
    penalty = _group([-0.1, 0.0, 0.0, 0.0], [False] * 4)  # a format penalty still has signal
    assign_advantages(penalty)
    assert not penalty.zero_signal
