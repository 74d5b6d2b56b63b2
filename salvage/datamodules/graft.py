"""GRAFT datamodule: the same prompt batch for both policies, n responses each (SPEC §3).

Each step samples ``group_size`` (n) responses per prompt from policy A and from policy
B (each through its own tokenizer, chat template and engine), scores them with the same
verifier, and computes each model's own GRPO advantages. The batch carries both rollout
batches (``batch.extras["a"]``, ``["b"]``); the exchange happens in ``GRAFTModule``.
"""

from __future__ import annotations

import time
from typing import Any

from salvage.datamodules.common import step_seed
from salvage.datamodules.rlvr import RLVRDataModule
from salvage.rollout.config import build_engine
from salvage.tasks.math import MathTask
from salvage.types import RolloutBatch

NAMES = ("a", "b")


class GraftDataModule(RLVRDataModule):
    """RLVRDataModule for two policies (same arguments; see there)."""

    def _engine_for(self, name: str) -> Any:
        learner = self.trainer.lightning_module.learner(name)
        engines = self.__dict__.setdefault("_engines", {})
        eng = engines.get(name)
        if eng is None or eng.model is not learner.policy:
            eng = engines[name] = build_engine(self.engine_cfg, learner.policy, learner.tokenizer)
        return eng

    def _both(self, tasks: list[MathTask], n: int, seed: int, **kw: Any) -> RolloutBatch:
        t0 = time.perf_counter()
        parts = {}
        for i, name in enumerate(NAMES):
            learner = self.trainer.lightning_module.learner(name)
            parts[name] = self.rollout(
                tasks,
                n,
                seed + 7919 * i,
                engine=self._engine_for(name),
                tokenizer=learner.tokenizer,
                **kw,
            )
        stats = {"t_start": t0}
        for k in ("time_generate", "time_reward", "gen_tokens", "verifier_timeouts"):
            stats[k] = sum(p.stats.get(k, 0.0) for p in parts.values())
        return RolloutBatch(
            groups=[], temperature=parts["a"].temperature, stats=stats, extras=dict(parts)
        )

    def train_rollout(self, tasks: list[MathTask]) -> RolloutBatch:
        return self._both(tasks, self.group_size, step_seed(self.seed, self.trainer.global_step, 0))

    def eval_rollout(self, tasks: list[MathTask], split: str) -> RolloutBatch:
        return self._both(
            tasks,
            self.val_samples,
            self.eval_seed(),
            temperature=self.val_temperature,
            top_p=self.val_top_p,
            advantages=False,
        )
