"""Single-turn RLVR datamodule: math tasks -> rollout batches with rewards and advantages."""

from __future__ import annotations

import logging
import time
from typing import Any

from salvage.core.seeds import TRAIN, step_seed
from salvage.datamodules.base import RolloutDataModule
from salvage.datamodules.repeats import RepeatedTest
from salvage.errors import ConfigError, DataError
from salvage.rollout.config import EngineConfig, generate_with_retry
from salvage.stopping import user_call
from salvage.tasks.math import (
    MathData,
    MathTask,
    MathVerifyReward,
    Reward,
    load_math_tasks,
    source_labels,
    task_digest,
)
from salvage.types import Group, RolloutBatch, RolloutStats, Sample, Trajectory, Turn

log = logging.getLogger(__name__)


class RLVRDataModule(RepeatedTest, RolloutDataModule):
    """Math RLVR rollouts: ``prompts_per_step`` prompts x ``group_size`` samples per step.

    Args:
        train: where training tasks come from: one source, or a list whose tasks are pooled
            (e.g. two slices of a task family; task ids are prefixed by each source's label).
        val: evaluation tasks (``None``: no validation).
        test: test tasks (``None``: the validation tasks).
        prompts_per_step: prompts per rollout batch of one update, over all ranks (a
            multi-process run splits them; the first ``prompts_per_step % ranks`` ranks
            take one more).
        group_size: samples per prompt (G / n).
        engine: sampling settings for training rollouts.
        val_temperature: evaluation sampling temperature (SPEC §3.4: 0.6). A list of
            benchmarks in ``val`` / ``test`` is the evaluation harness: each gets
            ``val/success/<name>`` = pass@1 and ``val/aggregate`` = their unweighted mean.
        val_top_p: evaluation nucleus sampling (SPEC §3.4: 0.95).
        val_samples: evaluation samples per problem; pass@1 is their mean (SPEC §3.4: 8).
        val_batch_size: evaluation prompts per batch.
        advantage: ``grpo`` (std-normalised), ``drgrpo`` (no std) or ``rloo``.
        adv_eps: epsilon of the std normalisation.
        reward_tol: zero-signal test: a group's rewards differ by at most this (SPEC §1).
        adv_tol: zero-signal test: every advantage is at most this in size (SPEC §1).
        max_prompt_tokens: longer prompts keep their last tokens (counted).
        reward: the verifier; default math-verify on the last \\boxed{}.
        seed: seed of the task order and of every sampling stream.
        test_repeats: ``salvage test`` samples the test benchmarks this many times, each
            with its own seed, and reports per repeat, the mean and the sample std
            (``salvage test --repeats N`` sets it; the GRAFT paper averages 5 runs).
        allow_overlap: fit even when a validation / test prompt is a training prompt (or a
            warm-start one) by normalised text; default False refuses such a fit.
    """

    def __init__(
        self,
        train: MathData | list[MathData] | None = None,
        val: MathData | list[MathData] | None = None,
        test: MathData | list[MathData] | None = None,
        prompts_per_step: int = 8,
        group_size: int = 4,
        engine: EngineConfig | None = None,
        val_temperature: float = 0.6,
        val_top_p: float = 0.95,
        val_samples: int = 1,
        val_batch_size: int = 8,
        advantage: str = "grpo",
        adv_eps: float = 1e-6,
        reward_tol: float = 1e-6,
        adv_tol: float = 1e-6,
        max_prompt_tokens: int = 1024,
        reward: Reward | None = None,
        seed: int = 0,
        test_repeats: int = 1,
        allow_overlap: bool = False,
    ) -> None:
        super().__init__(
            prompts_per_step,
            engine,
            val_batch_size,
            seed,
            group_size,
            advantage,
            adv_eps,
            reward_tol,
            adv_tol,
            tasks_key="prompts_per_step",
            allow_overlap=allow_overlap,
        )
        if val_samples < 1:
            raise ConfigError(f"data.val_samples must be >= 1, got {val_samples}")
        if test_repeats < 1:
            raise ConfigError(f"data.test_repeats must be >= 1, got {test_repeats}")
        self.test_repeats = test_repeats
        if max_prompt_tokens < 8:
            raise ConfigError(f"data.max_prompt_tokens must be >= 8, got {max_prompt_tokens}")
        if isinstance(train, list) and not train:
            raise ConfigError("data.train: an empty list of sources (give at least one)")
        self.train_data = train or MathData()
        self.val_data = val
        self.test_data = test
        self.prompts_per_step = prompts_per_step
        self.val_temperature = val_temperature
        self.val_top_p = val_top_p
        self.val_samples = val_samples
        self.max_prompt_tokens = max_prompt_tokens
        self.reward_fn: Reward = reward or MathVerifyReward()
        self.data_report: dict[str, Any] = {}
        # keyed by the messages themselves, not the task id: a prompt can never be served
        # to another task, whatever the ids (also across splits)
        self._prompt_cache: dict[tuple[int, tuple[tuple[str, str], ...]], list[int]] = {}

    def load_split(self, split: str) -> list[MathTask] | None:
        data = {
            "train": self.train_data,
            "val": self.val_data,
            "test": self.test_data or self.val_data,
        }[split]
        if data is None:
            return None
        sources = data if isinstance(data, list) else [data]
        key = "data.val" if split == "test" and self.test_data is None else f"data.{split}"
        tasks: list[MathTask] = []
        reports = []
        digests: set[str] = set()
        for src, label in zip(sources, source_labels(sources, key), strict=True):
            part, rep = load_math_tasks(src, label)
            # pooled training sources: a prompt repeated across them counts once (evaluation
            # sources are benchmarks of their own and keep every problem)
            if split == "train" and src.dedupe:
                fresh = [t for t in part if task_digest(t) not in digests]
                rep["duplicates"] += len(part) - len(fresh)
                part = fresh
            digests.update(task_digest(t) for t in part)
            tasks += part
            reports.append(rep)
        seen: set[str] = set()
        for t in tasks:  # unique by construction (labels differ, ids are unique per file)
            if t.id in seen:
                raise DataError(f"{key}: two tasks share the id {t.id!r}")
            seen.add(t.id)
        self.data_report[split] = reports
        return tasks

    def task_digests(self, split: str) -> dict[str, str]:
        return {t.id: task_digest(t) for t in self.tasks[split]}

    def split_source(self, split: str) -> str:
        return "data.val" if split == "test" and self.test_data is None else f"data.{split}"

    def benchmarks(self, split: str) -> list[str]:
        """Names of the benchmarks of an evaluation split, in config order."""
        seen: dict[str, None] = {}
        for t in self.tasks.get(split, []):
            seen.setdefault(t.meta.get("family", ""), None)
        return list(seen)

    def prompt_ids(self, task: MathTask, tokenizer: Any = None) -> list[int]:
        tok = tokenizer if tokenizer is not None else self.module.tokenizer
        key = (id(tok), tuple((m["role"], m["content"]) for m in task.messages))
        ids = self._prompt_cache.get(key)
        if ids is None:
            text = tok.apply_chat_template(
                task.messages, tokenize=False, add_generation_prompt=True
            )
            ids = list(tok(text, add_special_tokens=False)["input_ids"])
            if len(ids) > self.max_prompt_tokens:
                ids = ids[-self.max_prompt_tokens :]
            self._prompt_cache[key] = ids
        return ids

    def train_rollout(self, tasks: list[MathTask]) -> RolloutBatch:
        return self.rollout(
            tasks, n=self.group_size, seed=step_seed(self.seed, self.trainer.global_step, TRAIN)
        )

    def eval_rollout(self, tasks: list[MathTask], split: str) -> RolloutBatch:
        return self.rollout(
            tasks,
            n=self.val_samples,
            seed=self.eval_seed(),
            temperature=self.val_temperature,
            top_p=self.val_top_p,
            advantages=False,
        )

    def rollout(
        self,
        tasks: list[MathTask],
        n: int,
        seed: int,
        temperature: float | None = None,
        top_p: float | None = None,
        advantages: bool = True,
        engine: Any = None,
        tokenizer: Any = None,
    ) -> RolloutBatch:
        """Sample ``n`` responses per task, score them, group them, compute advantages.

        ``engine`` / ``tokenizer``: another policy's (two-model runs); default the module's.
        """
        t0 = time.perf_counter()
        engine = engine if engine is not None else self.engine
        prompts = [self.prompt_ids(t, tokenizer) for t in tasks]
        samples = generate_with_retry(
            engine, prompts, n=n, seed=seed, temperature=temperature, top_p=top_p
        )
        t_gen = time.perf_counter()
        timeouts_before = self.reward_fn.timeouts
        groups = self._score_samples(tasks, samples)
        if advantages:
            for g in groups:
                self.assign_group_advantages(g)
        t_end = time.perf_counter()
        gen_tokens = sum(len(s.response_ids) for row in samples for s in row)
        used_t = engine.temperature if temperature is None else temperature
        return RolloutBatch(
            groups=groups,
            temperature=used_t if used_t > 0 else 1.0,
            stats=RolloutStats(
                t_start=t0,
                time_generate=t_gen - t0,
                time_reward=t_end - t_gen,
                gen_tokens=float(gen_tokens),
                verifier_timeouts=float(self.reward_fn.timeouts - timeouts_before),
            ),
        )

    def _score_samples(self, tasks: list[MathTask], samples: list[list[Sample]]) -> list[Group]:
        """Score every sample with the verifier: one group of trajectories per task."""
        groups: list[Group] = []
        with user_call("reward call"):  # SIGTERM: the stop grace, not a wait on a hung reward
            return self._score_all(tasks, samples, groups)

    def _score_all(
        self, tasks: list[MathTask], samples: list[list[Sample]], groups: list[Group]
    ) -> list[Group]:
        for task, group_samples in zip(tasks, samples, strict=True):
            trajs = []
            for s in group_samples:
                r = self.reward_fn(s.text, task.answer)
                turn = Turn(
                    prompt_ids=s.prompt_ids,
                    response_ids=s.response_ids,
                    logprobs=s.logprobs,
                    response_text=s.text,
                    finish_reason=s.finish_reason,
                )
                trajs.append(
                    Trajectory(
                        turns=[turn],
                        reward=r.reward,
                        success=r.success,
                        info={"verifier_timeout": r.timed_out, "seed": s.seed},
                    )
                )
            groups.append(
                Group(
                    task_id=task.id, trajectories=trajs, task={"answer": task.answer, **task.meta}
                )
            )
        return groups
