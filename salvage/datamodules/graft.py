"""GRAFT datamodule: the same prompt batch for both policies, n responses each (SPEC §3).

Each step samples ``group_size`` (n) responses per prompt from policy A and from policy
B (each through its own tokenizer, chat template and engine), scores them with the same
verifier, and computes each model's own GRPO advantages. The batch is a ``PairedBatch``
of both rollout batches (``batch.a``, ``batch.b``); the exchange happens in ``GRAFTModule``.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, cast

import torch

from salvage.core.seeds import PEER_OFFSET, TRAIN, step_seed
from salvage.datamodules.rlvr import RLVRDataModule
from salvage.distributed import gathered
from salvage.rollout.config import build_engine
from salvage.tasks.math import MathTask
from salvage.types import Learner, PairedBatch, PairedLearner, RolloutBatch, RolloutEngine

NAMES = ("a", "b")


class PerModelRollouts:
    """Shared by the multi-model datamodules: each model of the module (``names``) by name,
    its own engine on its own policy and tokenizer, and the per-model batches as one
    ``PairedBatch``."""

    trainer: Any
    engine_cfg: Any
    _engines: dict[str, RolloutEngine]

    def _names(self) -> tuple[str, ...]:
        """The module's models in order (GRAFT: a, b; PeerGroupModule: a, b, c, ...)."""
        return tuple(getattr(self.trainer.lightning_module, "names", NAMES))

    def _learner(self, name: str) -> Learner:
        return cast(PairedLearner, self.trainer.lightning_module).learner(name)

    def _engine_for(self, name: str, cfg: Any = None, key: str | None = None) -> RolloutEngine:
        """Model ``name``'s engine (``cfg``: other sampling settings, cached under ``key``)."""
        learner = self._learner(name)
        if learner.policy is None:
            raise RuntimeError(f"policy {name} is not loaded (configure_model has not run)")
        key = key or name
        eng = self._engines.get(key)
        if eng is None or eng.model is not learner.policy:
            eng = self._engines[key] = build_engine(
                cfg or self.engine_cfg, learner.policy, learner.tokenizer
            )
        return eng

    def rollout_models(self) -> list[torch.nn.Module]:
        """None for the whole phase: each policy is gathered around its own rollout."""
        return []

    @staticmethod
    def _paired(parts: dict[str, RolloutBatch], t0: float) -> PairedBatch:
        """One batch of the per-model batches (stats summed, the clock from ``t0``)."""
        a, b, *more = parts.values()
        stats = a.stats
        for p in [b, *more]:
            stats = stats.plus(p.stats)
        extra = {k: v for k, v in parts.items() if k not in ("a", "b")}
        return PairedBatch(
            groups=[],
            temperature=a.temperature,
            stats=replace(stats, t_start=t0),
            a=a,
            b=b,
            more=extra,
        )


class GraftDataModule(PerModelRollouts, RLVRDataModule):
    """RLVRDataModule for two (or, with ``PeerGroupModule``, N) policies (same arguments;
    see there)."""

    def _both(self, tasks: list[MathTask], n: int, seed: int, **kw: Any) -> PairedBatch:
        t0 = time.perf_counter()
        parts = {}
        for i, name in enumerate(self._names()):
            learner = self._learner(name)
            with gathered(learner.policy):  # FSDP: only the model that samples now
                parts[name] = self.rollout(
                    tasks,
                    n,
                    seed + PEER_OFFSET * i,
                    engine=self._engine_for(name),
                    tokenizer=learner.tokenizer,
                    **kw,
                )
        return self._paired(parts, t0)

    def train_rollout(self, tasks: list[MathTask]) -> PairedBatch:
        return self._both(
            tasks, self.group_size, step_seed(self.seed, self.trainer.global_step, TRAIN)
        )

    def eval_rollout(self, tasks: list[MathTask], split: str) -> PairedBatch:
        return self._both(
            tasks,
            self.val_samples,
            self.eval_seed(),
            temperature=self.val_temperature,
            top_p=self.val_top_p,
            advantages=False,
        )
