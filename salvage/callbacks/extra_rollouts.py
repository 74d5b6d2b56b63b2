"""``ExtraStudentRollouts``: VH-GPO's budget-matched ablation (SPEC §2.4), more student
rollouts for the selected zero-signal groups instead of a teacher relay."""

from __future__ import annotations

import lightning as L

from salvage.callbacks.rescue import RescueCallback, _data
from salvage.core.relay import RelayConfig
from salvage.core.seeds import EXTRA_ROLLOUTS, step_seed
from salvage.rollout.agent import Start
from salvage.types import RolloutBatch, Trajectory


class ExtraStudentRollouts(RescueCallback):
    """Budget-matched ablation: ``extra_rollouts`` more student rollouts per selected group,
    trained with plain GRPO (advantages recomputed over the enlarged group).

    Args:
        relay: group selection (``max_groups``, ``group_select``); the search knobs are unused.
        extra_rollouts: student rollouts added to each selected zero-signal group (SPEC: 4).
        seed: seed of the extra rollouts.
        records: write ``relays.jsonl`` in the run directory.
    """

    def __init__(
        self,
        relay: RelayConfig | None = None,
        extra_rollouts: int = 4,
        seed: int = 0,
        records: bool = True,
    ) -> None:
        super().__init__(relay, seed, records)
        if extra_rollouts < 1:
            raise ValueError(f"extra_rollouts must be >= 1, got {extra_rollouts}")
        self.extra_rollouts = extra_rollouts

    def rescue(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        batch: RolloutBatch,
        selected: list[int],
        step: dict[str, float],
    ) -> list[float]:
        if not selected:
            return []
        dm = _data(trainer)
        seed = step_seed(self.seed, trainer.global_step, EXTRA_ROLLOUTS)
        starts = [
            Start(batch.groups[gi].task, seed + 1000 + k)
            for gi in selected
            for k in range(self.extra_rollouts)
        ]
        runner = dm.live_runner()
        eps = runner.run(starts, dm.student(), seed=seed, train=True)
        tokens = 0
        for n, gi in enumerate(selected):
            g = batch.groups[gi]
            new: list[Trajectory] = [
                runner.to_trajectory(e)
                for e in eps[n * self.extra_rollouts : (n + 1) * self.extra_rollouts]
                if e.error is None
            ]
            tokens += sum(t.num_response_tokens for t in new)
            g.trajectories.extend(new)
            dm.assign_group_advantages(g)
            self._write(
                trainer,
                {
                    "step": trainer.global_step,
                    "task": g.task_id,
                    "extra_rollouts": len(new),
                    "successes": sum(t.success for t in new),
                    "zero_signal_after": g.zero_signal,
                },
            )
        step["extra_tokens_student"] = float(tokens)
        return []
