"""DAPO-style dynamic sampling for agent runs (a baseline, docs/baselines.md).

A rescue stage (the ``rescue`` key of ``salvage fit``, like VH-GPO's): in
``on_train_batch_start`` it takes the groups whose rewards are all equal (all-fail or
all-success: zero advantage) as open slots and runs extra rounds of fresh tasks x G episodes
with the live student until every open slot holds a group with signal or ``max_rounds``
rounds have run (``salvage.core.dynamic_sampling`` decides; open slots at the cap keep their
group). Every token of the extra rounds' episodes, kept or dropped, counts as
``cost/extra_tokens_student``, so ``cost/extra_token_ratio`` is computed exactly as for
VH-GPO and Extra Student Rollouts (extra tokens over the batch's own rollout tokens).
Rollout metrics (``rollout/*``) stay over the first generation batch (``own_groups``), as for
plain GRPO; the update trains on the refilled batch.

Logged per update: ``dapo/rounds``, ``dapo/sampled_groups`` (fresh groups sampled),
``dapo/filled`` (open slots filled) and ``dapo/open`` (open slots left at the cap); one
record per round in ``relays.jsonl``.
"""

from __future__ import annotations

import random

import lightning as L

from salvage.callbacks.relay import RescueCallback, _data, _learner
from salvage.core.dynamic_sampling import Refill, draw_tasks, has_signal
from salvage.core.relay import RelayConfig
from salvage.core.seeds import DYNAMIC_SAMPLING, GROUP_OFFSET, step_seed
from salvage.distributed import all_reduce, world
from salvage.types import RolloutBatch

METRICS = ("rounds", "sampled_groups", "filled", "open")


class DynamicSampling(RescueCallback):
    """DAPO-style dynamic sampling: refill the batch's zero-advantage groups with fresh groups
    that have signal (agent data).

    Args:
        max_rounds: cap on extra sampling rounds per update (each samples as many fresh tasks
            as there are open slots); open slots left at the cap keep their zero-advantage
            group. 0 turns the refill off. Default 10 (DAPO's reference recipe caps its extra
            generation batches at 10; ours are smaller, one task per open slot).
        seed: seed of the fresh tasks and of their rollouts.
        records: write one record per round to ``relays.jsonl`` in the run directory.
    """

    def __init__(self, max_rounds: int = 10, seed: int = 0, records: bool = True) -> None:
        super().__init__(RelayConfig(b_min=1), seed, records)  # no search: no horizon constraint
        if max_rounds < 0:
            raise ValueError(f"max_rounds must be >= 0, got {max_rounds}")
        self.max_rounds = max_rounds

    def describe(self) -> str:
        """One line for the run summary."""
        return f"rescue: DynamicSampling (DAPO, max_rounds={self.max_rounds})"

    def select(self, trainer: L.Trainer, batch: RolloutBatch) -> tuple[list[int], list[int]]:
        """This rank's zero-signal groups (SPEC §1, for the accounting) and its groups without
        signal in DAPO's sense (all rewards equal), which it refills. No collective: each
        rank refills its own share of the batch."""
        tol = _data(trainer).reward_tol
        zero = [i for i, g in enumerate(batch.groups) if g.zero_signal]
        flat = [i for i, g in enumerate(batch.groups) if not has_signal(g.rewards, tol)]
        return zero, flat

    def rescue(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        batch: RolloutBatch,
        selected: list[int],
        step: dict[str, float],
    ) -> list[float]:
        dm = _data(trainer)
        open_set = set(selected)
        plan = Refill([i not in open_set for i in range(len(batch.groups))], self.max_rounds)
        counts = dict.fromkeys(METRICS, 0.0)
        if plan.request() > 0:
            if batch.own_groups is None:
                batch.own_groups = list(batch.groups)  # rollout metrics: the first batch
            train = dm.tasks["train"]
            ids = {g.task_id for g in batch.groups}
            used = {j for j, t in enumerate(train) if t["id"] in ids}
            base = step_seed(self.seed, trainer.global_step, DYNAMIC_SAMPLING)
            rng = random.Random(base + world()[0] * GROUP_OFFSET)
            tokens = 0
            while (k := plan.request()) > 0:
                idx = draw_tasks(len(train), used, k, rng)
                if not idx:
                    break  # every training task was used at this update
                used.update(idx)
                seed = base + (plan.rounds + 1) * GROUP_OFFSET
                sub = dm.rollout([train[j] for j in idx], dm.group_size, seed, dm.student())
                tokens += sub.num_response_tokens()
                flags = [has_signal(g.rewards, dm.reward_tol) for g in sub.groups]
                pairs = plan.offer(flags)
                for slot, cand in pairs:
                    batch.groups[slot] = sub.groups[cand]
                counts["sampled_groups"] += len(sub.groups)
                counts["filled"] += len(pairs)
                self._write(
                    trainer,
                    {
                        "step": trainer.global_step,
                        "round": plan.rounds,
                        "tasks": [train[j]["id"] for j in idx],
                        "with_signal": sum(flags),
                        "filled": len(pairs),
                        "open_after": len(plan.open),
                    },
                )
            step["extra_tokens_student"] = float(tokens)
            counts["rounds"] = float(plan.rounds)
        counts["open"] = float(len(plan.open))
        values = all_reduce([counts[k] for k in METRICS])
        if world()[1] > 1:
            values[0] = all_reduce([counts["rounds"]], op="max")[0]
        _learner(pl_module).record({f"dapo/{k}": v for k, v in zip(METRICS, values, strict=True)})
        return []


__all__ = ["DynamicSampling"]
