"""Per-update batch semantics across processes, the pure pieces by hand.

``prompts_per_step`` / ``tasks_per_step`` are the global batch of one update, split over
ranks; VH-GPO's ``max_groups`` counts rescued groups over all ranks; evaluation metrics
are reduced over all ranks' problems. The 2-process runs are in test_batch_semantics_dist.py.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from salvage.core.relay import RelayConfig, select_groups, select_groups_across_ranks
from salvage.datamodules.base import StepBatches
from salvage.distributed import gather_objects, merge_eval_records, rank_share


def test_rank_share_splits_a_global_count_with_the_remainder_first():
    # 5 over 2: 5 = 2*2 + 1, rank 0 takes 3 ([0, 3)), rank 1 takes 2 ([3, 5))
    assert [rank_share(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    # 10 over 4: 10 = 4*2 + 2, ranks 0, 1 take 3, ranks 2, 3 take 2
    assert [rank_share(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [rank_share(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert rank_share(7, 0, 1) == (0, 7)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        rank_share(5, 2, 2)


def _trainer(rank: int, world: int, step: int = 0) -> SimpleNamespace:
    return SimpleNamespace(world_size=world, global_rank=rank, global_step=step)


def test_step_batches_split_the_global_batch_over_ranks():
    """prompts_per_step 5 on 2 ranks: 3 + 2 prompts, together the 5 of one process."""
    one = StepBatches(20, 5, seed=3, trainer=_trainer(0, 1))
    r0 = StepBatches(20, 5, seed=3, trainer=_trainer(0, 2))
    r1 = StepBatches(20, 5, seed=3, trainer=_trainer(1, 2))
    assert len(one) == len(r0) == len(r1) == 4  # 20 tasks / 5 per update (not / (5 x 2))
    for step in range(6):  # across an epoch boundary too
        a, b = r0.batch(step), r1.batch(step)
        assert (len(a), len(b)) == (3, 2)
        assert a + b == one.batch(step)
    with pytest.raises(ValueError, match="data.prompts_per_step=1 is the global batch"):
        StepBatches(20, 1, seed=3, trainer=_trainer(0, 2), key="prompts_per_step")
    with pytest.raises(ValueError, match="data.tasks_per_step=21 exceeds the 20"):
        StepBatches(20, 21, seed=3, trainer=_trainer(0, 1))


def test_global_group_selection_first_in_batch_order():
    # zero-signal groups: rank 0 holds local 0, 2 (global 0, 2), rank 1 local 0, 1
    # (global 3, 4 after rank 0's 3 groups). First 2 in batch order: rank 0's two.
    cfg = RelayConfig(max_groups=2)
    assert select_groups_across_ranks([[0, 2], [0, 1]], cfg, random.Random(0)) == [[0, 2], []]
    # rank 0 has one candidate: the second comes from rank 1
    assert select_groups_across_ranks([[1], [0, 1]], cfg, random.Random(0)) == [[1], [0]]
    assert select_groups_across_ranks([[], []], cfg, random.Random(0)) == [[], []]
    assert select_groups_across_ranks([[0, 1, 2]], RelayConfig(max_groups=0), random.Random(0)) == [
        []
    ]


def test_global_random_selection_is_the_single_process_choice():
    """group_select random: the ranks' picks, mapped to global indices, are exactly what one
    process draws on the whole batch with the same seed (and never more than max_groups)."""
    cfg = RelayConfig(max_groups=2, group_select="random")
    per_rank = [[0, 2], [1], [0, 3]]  # 3 ranks holding 4, 2, 4 groups: offsets 0, 4, 6
    offsets = [0, 4, 6]
    glob = [o + i for o, idx in zip(offsets, per_rank, strict=True) for i in idx]  # [0,2,5,6,9]
    seen = set()
    for seed in range(30):
        picks = select_groups_across_ranks(per_rank, cfg, random.Random(seed))
        mapped = sorted(o + i for o, p in zip(offsets, picks, strict=True) for i in p)
        assert mapped == select_groups(glob, cfg, random.Random(seed))
        assert len(mapped) == 2
        seen.add(tuple(mapped))
    assert len(seen) > 3  # really random over the whole batch, not per rank


def test_merge_eval_records_is_the_mean_over_problems_not_of_rank_means():
    # rank 0: math p1 (1/2), p2 (2/2), aime a1 (0/2); rank 1: math p3 (0/2) and a padded
    # copy of p1 (the distributed sampler repeats the first problems), counted once.
    r0 = [(0, "math", "p1", 1.0, 2.0), (0, "math", "p2", 2.0, 2.0), (0, "aime", "a1", 0.0, 2.0)]
    r1 = [(0, "math", "p3", 0.0, 2.0), (0, "math", "p1", 2.0, 2.0)]
    got = merge_eval_records([r0, r1])
    # math: (1 + 2 + 0) / 6 = 0.5 (the mean of rank means would be (3/4 + 0/2) / 2 = 0.375)
    assert got == {(0, "math"): (3.0, 6.0), (0, "aime"): (0.0, 2.0)}
    # repeats keep their own copies of a problem
    two = merge_eval_records([[(0, "m", "p", 1.0, 1.0)], [(1, "m", "p", 0.0, 1.0)]])
    assert two == {(0, "m"): (1.0, 1.0), (1, "m"): (0.0, 1.0)}
    assert gather_objects([1, 2]) == [[1, 2]]  # one process: its own object
