"""DAPO-style dynamic sampling (Yu et al. 2025, "DAPO"), pure: which groups fill the batch.

DAPO over-samples and drops every group whose rewards are all equal (all-fail or
all-success: every advantage is zero, no gradient) until the batch holds ``tasks_per_step``
groups with signal, with a cap on the number of extra generation rounds. Here the batch
keeps its slots: a slot whose group has no signal is *open*; each extra round samples
fresh groups (as many as there are open slots) and fills the open slots, in batch order,
with the new groups that have signal, in their sampling order. A round's groups without
signal are dropped (their tokens were spent: the shell counts them). After
``max_rounds`` rounds, open slots keep their original group (zero advantage: no gradient,
the batch size stays the same). The shell (``salvage.callbacks.dynamic_sampling``) runs
the rollouts; this module decides.

Ours (DAPO's paper is silent or the setting differs), documented in ``docs/baselines.md``:
- a round samples exactly the number of open slots (DAPO samples a whole generation batch);
- the fresh tasks of a round are drawn uniformly without replacement from the training tasks
  not yet used at this update (``draw_tasks``); when fewer are left, all that are left;
- at the cap, open slots keep their zero-signal group (DAPO's reference code raises).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field


def has_signal(rewards: Sequence[float], tol: float = 1e-6) -> bool:
    """DAPO's filter: a group has signal when its rewards are not all equal (within ``tol``).

    An all-success group (every reward 10) has no signal either; a group of one has none.
    """
    if len(rewards) < 2:
        return False
    return max(rewards) - min(rewards) > tol


@dataclass
class Refill:
    """The state of one update's dynamic sampling.

    ``signal[i]`` says whether the batch's group ``i`` has signal. ``request()`` is how many
    fresh groups to sample next (0: stop), ``offer(flags)`` hands over that round's groups'
    signal flags and returns the (slot, candidate) pairs that replace open slots.
    """

    signal: Sequence[bool]
    max_rounds: int
    rounds: int = 0
    """Extra rounds run so far."""
    open: list[int] = field(default_factory=list)
    """Slots still without signal, in batch order."""

    def __post_init__(self) -> None:
        if self.max_rounds < 0:
            raise ValueError(f"max_rounds must be >= 0, got {self.max_rounds}")
        self.open = [i for i, s in enumerate(self.signal) if not s]

    def request(self) -> int:
        """Fresh groups to sample in the next round: the open slots, or 0 when done (no open
        slot, or ``max_rounds`` rounds run)."""
        if self.rounds >= self.max_rounds:
            return 0
        return len(self.open)

    def offer(self, flags: Sequence[bool]) -> list[tuple[int, int]]:
        """One round's groups (their signal flags, in sampling order) -> (slot, candidate) pairs:
        the first open slots take the candidates with signal, in order; the rest are dropped."""
        self.rounds += 1
        good = [j for j, f in enumerate(flags) if f]
        pairs = list(zip(self.open, good, strict=False))
        self.open = self.open[len(pairs) :]
        return pairs


def draw_tasks(n_tasks: int, used: set[int], k: int, rng: random.Random) -> list[int]:
    """``k`` task indices drawn uniformly without replacement from ``range(n_tasks)`` minus
    ``used`` (fewer if fewer are left), in draw order. ``used`` is not changed."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    pool = [i for i in range(n_tasks) if i not in used]
    return rng.sample(pool, min(k, len(pool)))
