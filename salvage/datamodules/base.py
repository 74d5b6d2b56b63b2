"""Base of the rollout-producing datamodules.

The dataloaders yield only task indices (cheap, safe to prefetch). The rollout itself
runs in ``on_after_batch_transfer``, i.e. right before the step's callbacks and
``training_step``: Lightning prefetches one batch ahead, so generating inside the
dataloader would sample with the weights of the previous step. Callbacks then see the
finished ``RolloutBatch`` in ``on_train_batch_start`` (where rescue stages attach to it).
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar, cast

import lightning as L
import torch
from torch.utils.data import DataLoader

from salvage.core.grpo import ADVANTAGE_ESTIMATORS, assign_advantages
from salvage.core.heldout import Overlap, dedupe, overlap
from salvage.core.seeds import permutation_seed
from salvage.distributed import gathered, rank_share
from salvage.errors import ConfigError
from salvage.rollout.config import EngineConfig, build_engine
from salvage.types import Group, Learner, RolloutBatch, RolloutEngine

log = logging.getLogger(__name__)

SPLITS_FOR_STAGE = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",)}


class _Indices(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _collate(items: list[int]) -> list[int]:
    return list(items)


class StepBatches:
    """Training batches of task indices where batch k of the run is a pure function of (seed, k).

    Epoch e is one permutation of the tasks (seeded by ``seed`` and e); iteration starts at
    the trainer's current global step, so a run resumed from a checkpoint (even mid-epoch)
    sees exactly the batches the uninterrupted run would have seen. ``batch_size`` is the
    global batch of one update (the papers' number, whatever the number of processes):
    each rank takes its contiguous share of it (``rank_share``: the first
    ``batch_size % world`` ranks one task more), so all ranks together hold exactly the
    batch one process would (no DistributedSampler needed).
    """

    def __init__(
        self, n: int, batch_size: int, seed: int, trainer: Any, key: str = "tasks_per_step"
    ) -> None:
        self.n, self.batch_size, self.seed, self.trainer = n, batch_size, seed, trainer
        self.world = max(1, trainer.world_size)
        self.rank = trainer.global_rank
        if batch_size < self.world:
            raise ConfigError(
                f"data.{key}={batch_size} is the global batch of one update, split over the "
                f"{self.world} ranks: it must be at least the number of ranks"
            )
        self.per_epoch = n // batch_size
        if self.per_epoch < 1:
            raise ConfigError(f"data.{key}={batch_size} exceeds the {n} training tasks")
        self.start, self.stop = rank_share(batch_size, self.rank, self.world)

    def __len__(self) -> int:
        return self.per_epoch

    def global_batch(self, step: int) -> list[int]:
        """The whole batch of update ``step`` (every rank's share, in rank order)."""
        epoch, k = divmod(step, self.per_epoch)
        perm = torch.randperm(
            self.n, generator=torch.Generator().manual_seed(permutation_seed(self.seed, epoch))
        )
        return perm[k * self.batch_size : (k + 1) * self.batch_size].tolist()

    def batch(self, step: int) -> list[int]:
        """This rank's share of the batch of update ``step``."""
        return self.global_batch(step)[self.start : self.stop]

    def __iter__(self) -> Any:
        start = self.trainer.global_step
        first_epoch = start // self.per_epoch
        step = start
        while step // self.per_epoch == first_epoch:
            yield self.batch(step)
            step += 1


class RolloutDataModule(L.LightningDataModule):
    """Task lists per split, index dataloaders, the engine on the live policy.

    Args:
        tasks_per_step: tasks (prompts) per rollout batch.
        engine: sampling settings of training rollouts.
        val_batch_size: evaluation tasks per batch.
        seed: seed of the task order and of every sampling stream.
        group_size: samples (episodes) per task, G / n.
        advantage: ``grpo`` (std-normalised), ``drgrpo`` (no std) or ``rloo``.
        adv_eps: epsilon of the std normalisation.
        reward_tol: zero-signal test: a group's rewards differ by at most this (SPEC §1).
        adv_tol: zero-signal test: every advantage is at most this in size (SPEC §1).
        tasks_key: the subclass's name of ``tasks_per_step`` in error messages.
        allow_overlap: run a fit even when validation / test tasks have the content of a
            training task (by digest; ``data/heldout_overlap`` logs the share). Default
            False: such a fit is refused before any compute.
        drop_overlap: drop, instead of refusing, each validation / test task with a
            training task's content and each repeat of an earlier task of its split (counts
            logged as ``data/heldout_dropped/<split>``, and a warning).
    """

    trainer: L.Trainer  # attached by Lightning before any hook that rolls out

    def __init__(
        self,
        tasks_per_step: int,
        engine: EngineConfig | None,
        val_batch_size: int,
        seed: int,
        group_size: int = 2,
        advantage: str = "grpo",
        adv_eps: float = 1e-6,
        reward_tol: float = 1e-6,
        adv_tol: float = 1e-6,
        tasks_key: str = "tasks_per_step",
        allow_overlap: bool = False,
        drop_overlap: bool = False,
    ) -> None:
        super().__init__()
        if allow_overlap and drop_overlap:
            raise ConfigError(
                "data.allow_overlap and data.drop_overlap are both true: keep overlapping "
                "held-out tasks (allow) or drop them (drop), not both"
            )
        self.allow_overlap = allow_overlap
        self.drop_overlap = drop_overlap
        self.heldout_overlap: dict[str, Overlap] = {}
        self.heldout_metrics: dict[str, float] = {}
        self.tasks_key = tasks_key
        if tasks_per_step < 1:
            raise ConfigError(f"data.{tasks_key} must be >= 1, got {tasks_per_step}")
        if group_size < 2:
            raise ConfigError(
                f"data.group_size must be >= 2 (a group needs contrast), got {group_size}"
            )
        if advantage not in ADVANTAGE_ESTIMATORS:
            raise ConfigError(
                f"data.advantage must be one of {ADVANTAGE_ESTIMATORS}, got {advantage!r}"
            )
        if val_batch_size < 1:
            raise ConfigError(f"data.val_batch_size must be >= 1, got {val_batch_size}")
        self.group_size = group_size
        self.advantage = advantage
        self.adv_eps = adv_eps
        self.reward_tol = reward_tol
        self.adv_tol = adv_tol
        self.tasks_per_step = tasks_per_step
        self.engine_cfg = engine or EngineConfig()
        self.val_batch_size = val_batch_size
        self.seed = seed
        self.tasks: dict[str, list[Any]] = {}
        self._engine: RolloutEngine | None = None
        self._engines: dict[str, RolloutEngine] = {}  # per-model engines (two-model runs)

    def assign_group_advantages(self, group: Group) -> None:
        """Each trajectory's advantage and the group's zero-signal flag (SPEC §1)."""
        assign_advantages(group, self.advantage, self.adv_eps, self.reward_tol, self.adv_tol)

    def load_split(self, split: str) -> list[Any] | None:
        """The tasks of ``train`` / ``val`` / ``test`` (None: split not configured)."""
        raise NotImplementedError

    def setup(self, stage: str) -> None:
        splits = SPLITS_FOR_STAGE.get(stage, ())
        if stage == "fit":
            splits = (*splits, "test")  # a fit checks every held-out split against training
        for split in splits:
            if split not in self.tasks:
                tasks = self.load_split(split)
                if tasks is not None:
                    self.tasks[split] = tasks
        if stage == "fit" and "train" in self.tasks:  # before any weights load
            n = len(self.tasks["train"])
            if self.tasks_per_step > n:
                raise ConfigError(
                    f"data.{self.tasks_key}={self.tasks_per_step} exceeds the {n} training "
                    "tasks (data.train); lower it or give more tasks"
                )
        if stage == "fit" and not self.heldout_overlap:
            self.check_heldout()
        trainer = getattr(self, "trainer", None)
        if stage == "fit" and "val" not in self.tasks and trainer is not None:
            trainer.limit_val_batches = 0  # no validation tasks: no validation loop to run

    # ------------------------------------------------------------------ held-out check
    def task_digests(self, split: str) -> dict[str, str]:
        """Task id -> content digest of a loaded split (``salvage.core.heldout``)."""
        raise NotImplementedError

    def split_source(self, split: str) -> str:
        """The config key a split's tasks come from (named in the overlap error)."""
        return f"data.{split}"

    def check_heldout(self) -> dict[str, Overlap]:
        """Overlap by content between the training tasks and each held-out split; refuses
        (``ConfigError``) any overlap unless ``allow_overlap``; logs ``data/heldout_overlap``
        (overlapping held-out tasks / held-out tasks, val and test together) and per split."""
        if "train" not in self.tasks:
            return {}
        train = self.task_digests("train")
        dropped = self._drop_overlap(train) if self.drop_overlap else {}
        found: dict[str, Overlap] = {}
        for split in ("val", "test"):
            if split in self.tasks:
                found[split] = overlap(split, train, self.task_digests(split))
        self.heldout_overlap = found
        bad = [o for o in found.values() if o.count]
        if bad and not self.allow_overlap:
            o = bad[0]
            held, tr = o.pairs[0]
            raise ConfigError(
                f"held-out data is not held out: {o.count} of {o.n_heldout} {o.split} tasks "
                f"({self.split_source(o.split)}) have the content of a training task "
                f"({self.split_source('train')}), e.g. {o.split} task {held!r} = training "
                f"task {tr!r}; use disjoint sources, or set data.allow_overlap: true"
            )
        for o in bad:
            log.warning("%d of %d %s tasks are training tasks", o.count, o.n_heldout, o.split)
        n = sum(o.n_heldout for o in found.values())
        metrics = {"data/heldout_overlap": sum(o.count for o in found.values()) / n if n else 0.0}
        metrics.update({f"data/heldout_overlap/{o.split}": o.frac for o in found.values()})
        metrics.update({f"data/heldout_dropped/{k}": float(v) for k, v in dropped.items()})
        self.heldout_metrics = metrics
        return found

    def _drop_overlap(self, train: dict[str, str]) -> dict[str, int]:
        """``drop_overlap``: each held-out split keeps the first task of each content that
        no training task has; returns the number dropped per split."""
        train_digests = set(train.values())
        dropped: dict[str, int] = {}
        for split in ("val", "test"):
            if split not in self.tasks:
                continue
            tasks = self.tasks[split]
            digests = list(self.task_digests(split).values())  # one per task, in task order
            if len(digests) != len(tasks):
                raise ConfigError(f"{self.split_source(split)}: task ids are not unique")
            keep = [i for i in dedupe(digests) if digests[i] not in train_digests]
            dropped[split] = len(tasks) - len(keep)
            if not keep:
                raise ConfigError(
                    f"data.drop_overlap left no {split} task: all {len(tasks)} of "
                    f"{self.split_source(split)} are training tasks or repeats"
                )
            if dropped[split]:
                log.warning(
                    "drop_overlap: %d of %d %s tasks dropped (a training task's content, or a "
                    "repeat); %d kept",
                    dropped[split],
                    len(tasks),
                    split,
                    len(keep),
                )
            self.tasks[split] = [tasks[i] for i in keep]
        return dropped

    def train_dataloader(self) -> StepBatches:
        return StepBatches(
            len(self.tasks["train"]), self.tasks_per_step, self.seed, self.trainer, self.tasks_key
        )

    def _eval_loader(self, split: str) -> DataLoader | list:
        if split not in self.tasks:
            return []
        return DataLoader(
            _Indices(len(self.tasks[split])),
            batch_size=self.val_batch_size,
            shuffle=False,
            collate_fn=_collate,
        )

    def val_dataloader(self) -> DataLoader | list:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader | list:
        return self._eval_loader("test")

    @property
    def module(self) -> Learner:
        """The module being trained (what the data stage uses of it)."""
        return cast(Learner, self.trainer.lightning_module)

    def policy(self) -> torch.nn.Module:
        """The live policy of the module being trained (loaded by then)."""
        policy = self.module.policy
        if policy is None:
            raise RuntimeError("the module's policy is not loaded (configure_model has not run)")
        return policy

    @property
    def engine(self) -> RolloutEngine:
        policy = self.policy()
        if self._engine is None or self._engine.model is not policy:
            self._engine = build_engine(self.engine_cfg, policy, self.module.tokenizer)
        return self._engine

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if isinstance(batch, RolloutBatch):
            return batch
        if self.heldout_metrics and self.trainer.training:
            record = getattr(self.module, "record_later", None)
            if record is not None:
                record(self.heldout_metrics)  # once per process: the first update logs it
                self.heldout_metrics = {}
        # only the models that generate are gathered (the reference scores in the update)
        models = self.rollout_models()
        engines = self.live_engines()
        for e in engines:  # vLLM: wake, re-sync weights (collectives: every rank, same order)
            e.prepare()
        try:
            # FSDP: one all-gather per rollout phase, then local sampling. The precision
            # plugin's context (bf16-mixed: autocast) wraps the rollout as it wraps the update,
            # so behaviour log-probs and the update share numerics (first ratio 1)
            with gathered(*models), self.trainer.precision_plugin.forward_context():
                if self.trainer.training:
                    return self.train_rollout([self.tasks["train"][i] for i in batch])
                split = "test" if self.trainer.testing else "val"
                return self.eval_rollout([self.tasks[split][i] for i in batch], split)
        finally:
            for e in engines:
                e.release()  # vLLM: give the memory back to training

    def rollout_models(self) -> list[torch.nn.Module]:
        """The models all-gathered for the whole rollout phase under FSDP: the module's
        samplers. A datamodule that samples its models one after the other returns none
        here and gathers each around its own rollout (one full model at a time)."""
        return self.module.sampling_models()

    def teardown(self, stage: str) -> None:
        """Close the engines built for this stage (vLLM: shut the ``LLM`` down, remove its
        temporary checkpoint); a later stage builds them again on first use."""
        for e in self.live_engines():
            e.close()
        self._engine = None
        self._engines = {}

    def live_engines(self) -> list[RolloutEngine]:
        """The engines built so far (the module's, and per-model ones of two-model runs)."""
        found = [self._engine, *self._engines.values()]
        return [e for e in found if e is not None]

    def train_rollout(self, tasks: list[Any]) -> RolloutBatch:
        raise NotImplementedError

    def eval_rollout(self, tasks: list[Any], split: str) -> RolloutBatch:
        raise NotImplementedError


D = TypeVar("D", bound=L.LightningDataModule)


def attached_datamodule(trainer: L.Trainer, kind: type[D]) -> D:
    """The trainer's datamodule, which a stage needs to be a ``kind`` (Lightning attaches it
    at run time; a wrong pairing of callback and data fails here, naming both)."""
    dm = getattr(trainer, "datamodule", None)
    if not isinstance(dm, kind):
        raise TypeError(f"this stage needs data of type {kind.__name__}, got {type(dm).__name__}")
    return dm
