"""GPU-hour accounting of selected checkpoints (SPEC §3.3, §3.4), pure.

A run's metrics give, per logged update ``k`` (0-based), the cumulative GPU-hours after
that update (``cost/gpu_hours``) and, when it validated after it, the validation score
(logged at the same ``k``). The selected checkpoint is the first update with the highest
score; it costs the GPU-hours through that update (validation and checkpoint writing are
not in ``cost/gpu_hours``). Independent single-model baselines (GRPO) are two separate
runs: obtaining both models costs the sum of the two runs' checkpoint costs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SelectedCheckpoint:
    score: float
    """The best validation score."""
    step: int
    """Its checkpoint's step (updates done: the logged update index + 1)."""
    gpu_hours: float
    """Cumulative GPU-hours through that update."""


def best_checkpoint_cost(
    scores: Sequence[tuple[float, float]], gpu_hours: Sequence[tuple[float, float]]
) -> SelectedCheckpoint:
    """The selected checkpoint of one run and its cost.

    ``scores``: (logged step, validation score); ``gpu_hours``: (logged step, cumulative
    GPU-hours). Ties keep the earlier checkpoint (as ``ModelCheckpoint`` and
    ``CheckpointCost`` do); the cost is the last cumulative value at or before its step.
    """
    if not scores:
        raise ValueError("the run logged no validation score: no checkpoint was selected")
    best_step, best = None, None
    for step, score in sorted(scores, key=lambda x: x[0]):
        if best is None or score > best:
            best_step, best = step, score
    assert best_step is not None and best is not None  # scores is not empty
    before = [h for s, h in sorted(gpu_hours) if s <= best_step]
    if not before:
        raise ValueError(f"no cost/gpu_hours logged at or before step {best_step:g}")
    return SelectedCheckpoint(float(best), int(best_step) + 1, float(before[-1]))


def separate_runs_cost(costs: Mapping[str, SelectedCheckpoint]) -> float:
    """Joint cost of independently trained models: the sum of each run's checkpoint cost."""
    return float(sum(c.gpu_hours for c in costs.values()))
