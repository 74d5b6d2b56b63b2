"""Agent rollouts of every model of a multi-model module: GRAFT for agents (docs/peers.md).

Each step runs ``group_size`` (G) episodes of the same ``tasks_per_step`` tasks with each
model of a ``GRAFTModule`` (two students) or ``PeerGroupModule`` (N), each through its own
tokenizer, chat template and engine, on the same environment pool; every model's episode
seeds are offset as GRAFT's sampling streams are. The batch is a ``PairedBatch`` of the
per-model batches (``batch.a``, ``batch.b``, ``batch.more``), aligned by task (a task whose
episodes all failed for one model, an environment error, is left out for every model).

The exchange then works as for math (``GRAFTModule``): a student whose group of episodes
on a task all failed receives a peer's successful group, each turn of each peer episode
re-rendered in the receiver's prompt format (``encoder``: the same task, observations and
actions, through the receiver's chat template and tokenizer), its action re-tokenised by
the receiver, and the compatibility score taken over the receiver's action tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from salvage.core.seeds import EVAL, PEER_OFFSET, TRAIN, step_seed
from salvage.datamodules.agent import AgentDataModule
from salvage.datamodules.graft import PerModelRollouts
from salvage.distributed import gathered
from salvage.errors import ConfigError
from salvage.rollout.agent import LMPolicy
from salvage.types import PairedBatch, RolloutBatch

log = logging.getLogger(__name__)

AGENT_RULES = {"mode": ("graft",), "peer_ratio": ("token",)}
"""The exchange settings defined for multi-turn episodes (SGT and HACPO take one response
per prompt; the sequence ratio is per response)."""


class AgentPeersDataModule(PerModelRollouts, AgentDataModule):
    """AgentDataModule for two (GRAFTModule) or N (PeerGroupModule) students (same
    arguments; see there)."""

    def setup(self, stage: str) -> None:
        super().setup(stage)
        module = getattr(getattr(self, "trainer", None), "lightning_module", None)
        if module is None:
            return
        if not hasattr(module, "names"):
            raise ConfigError(
                f"AgentPeersDataModule needs a multi-model module (GRAFTModule or "
                f"PeerGroupModule), got {type(module).__name__}"
            )
        for key, allowed in AGENT_RULES.items():
            value = module.hparams.get(key)
            if value is not None and value not in allowed:
                raise ConfigError(
                    f"model.{key}={value!r} is not defined for agent episodes "
                    f"(AgentPeersDataModule): use {' or '.join(map(repr, allowed))}"
                )

    def encoder(self, name: str) -> Callable[[str], list[int]]:
        """Model ``name``'s prompt encoder: a rendered agent prompt through its chat
        template and tokenizer (what its own episodes' turns were sampled from)."""
        return LMPolicy(
            None, self._learner(name).tokenizer, self.fmt, self.max_prompt_tokens
        ).encode

    def student_policy(self, name: str) -> LMPolicy:
        """Model ``name`` as an agent policy: its training engine, tokenizer and prompts
        (its own rollouts; a peer's handoff teacher in ``PeerHandoff``)."""
        learner = self._learner(name)
        return LMPolicy(self._engine_for(name), learner.tokenizer, self.fmt, self.max_prompt_tokens)

    def _per_model(
        self, tasks: list[dict[str, Any]], n: int, seed: int, train: bool
    ) -> PairedBatch:
        t0 = time.perf_counter()
        parts: dict[str, RolloutBatch] = {}
        for i, name in enumerate(self._names()):
            policy = self.student_policy(name)
            if not train:  # evaluation episodes at the validation temperature
                cfg = replace(self.engine_cfg, temperature=self.val_temperature)
                policy.engine = self._engine_for(name, cfg, key=f"{name}/eval")
            with gathered(self._learner(name).policy):  # FSDP: only the model that samples
                parts[name] = self.rollout(
                    tasks, n, seed + PEER_OFFSET * i, policy, advantages=train
                )
        return self._paired(_aligned(parts), t0)

    def train_rollout(self, tasks: list[dict[str, Any]]) -> PairedBatch:
        seed = step_seed(self.seed, self.trainer.global_step, TRAIN)
        return self._per_model(tasks, self.group_size, seed, train=True)

    def eval_rollout(self, tasks: list[dict[str, Any]], split: str) -> PairedBatch:
        seed = step_seed(self.seed, self.trainer.global_step, EVAL)
        return self._per_model(tasks, 1, seed, train=False)


def _aligned(parts: dict[str, RolloutBatch]) -> dict[str, RolloutBatch]:
    """Every model's groups on the tasks all models have (same order): a group index is the
    same task for every model, as the exchange assumes."""
    common = set.intersection(*({g.task_id for g in b.groups} for b in parts.values()))
    for name, b in parts.items():
        dropped = [g.task_id for g in b.groups if g.task_id not in common]
        if dropped:
            log.warning("model %s: tasks %s left out (another model has no episode)", name, dropped)
            b.groups = [g for g in b.groups if g.task_id in common]
    return parts
