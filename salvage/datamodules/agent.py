"""Multi-turn agent datamodule: tasks x G episodes on real text environments -> rollout batches.

Each training step takes ``tasks_per_step`` tasks, runs ``group_size`` (G) episodes of
each with the live student (batched: one ``generate`` per turn for all live episodes)
on an ``EnvPool``, and hands GRPOModule a ``RolloutBatch`` whose trajectories carry one
``Turn`` per interaction. The trajectory reward is ``10 * won - 0.1 * invalid turns``
(training only); success is ``won``. An episode whose environment crashed or hung is
failed, logged, counted in ``env/errors`` and left out of its group (never trained on).
Evaluation logs success overall and per task family; for environments that grade episodes
(``reports_score``, e.g. WebShop) each trajectory carries ``Trajectory.score`` and the datamodule
adds an ``EnvScoreMetrics`` callback logging ``<prefix>/<env>_score`` (100 x mean score) and
``<prefix>/<env>_success`` (100 x fraction with score 1), SPEC §2.6.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch.callbacks import Callback

from salvage.core.agent import AgentFormat
from salvage.core.gigpo import GiGPOConfig, discounted_returns, gigpo_advantages, state_key
from salvage.core.gigpo import turn_rewards as gigpo_turn_rewards
from salvage.core.heldout import text_digest
from salvage.core.seeds import EVAL, TRAIN, step_seed
from salvage.datamodules.base import RolloutDataModule
from salvage.datamodules.digests import cached_digests
from salvage.envs import env_class
from salvage.envs.pool import EnvPool
from salvage.envs.ray_pool import resources_problem
from salvage.errors import ConfigError
from salvage.rollout.agent import AgentRunner, LMPolicy, Start
from salvage.rollout.config import EngineConfig
from salvage.types import Group, RolloutBatch, RolloutEngine, RolloutStats

log = logging.getLogger(__name__)


@dataclass
class EnvSpec:
    """Which environment, its constructor arguments, and its task lists per split."""

    name: str = "twx"
    """``twx``, ``alfworld``, ``webshop``, ``scripted`` (tests)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Constructor arguments of the env class (e.g. ``step_limit``)."""
    train_tasks: dict[str, Any] | list[dict[str, Any]] = field(default_factory=dict)
    """Arguments of the env's ``list_tasks("train", ...)`` (twx: game, params, num_tasks), or a list of them (families of mixed difficulty, each with a ``label``)."""
    val_tasks: dict[str, Any] | list[dict[str, Any]] | None = None
    """Arguments of ``list_tasks("val", ...)``, or a list of them (several sets, each with a ``label``); None: no validation."""
    test_tasks: dict[str, Any] | list[dict[str, Any]] | None = None
    """Arguments of ``list_tasks("test", ...)``, or a list (as ``val_tasks``); None: the validation tasks."""
    num_workers: int = 0
    """Environment worker processes (0: in the trainer's process) or Ray actors."""
    backend: str = "process"
    """``process`` (local worker processes) or ``ray`` (Ray actors, across machines; extra ``ray``)."""
    ray_address: str | None = None
    """backend=ray: cluster to join (None: a local Ray; ``auto``: the running cluster)."""
    ray_num_cpus: float = 1.0
    """backend=ray: CPUs reserved by each actor."""
    ray_resources: dict[str, float] | None = None
    """backend=ray: custom resources per actor (``{env_node: 1}``: only nodes started with it)."""
    step_timeout_s: float = 60.0
    """A worker silent this long on one operation is declared hung and restarted."""
    startup_timeout_s: float = 300.0
    """A worker (or Ray actor: placement, then its environment) not up within this is an error."""

    def __post_init__(self) -> None:
        env_class(self.name)  # unknown names fail at config time, naming the key
        if self.num_workers < 0:
            raise ConfigError(f"data.env.num_workers must be >= 0, got {self.num_workers}")
        if self.backend not in ("process", "ray"):
            raise ConfigError(f"data.env.backend must be 'process' or 'ray', got {self.backend!r}")
        if self.backend == "ray" and self.num_workers < 1:
            raise ConfigError(
                f"data.env.num_workers must be >= 1 with backend=ray, got {self.num_workers}"
            )
        if self.step_timeout_s <= 0:
            raise ConfigError(f"data.env.step_timeout_s must be > 0, got {self.step_timeout_s}")
        if self.startup_timeout_s <= 0:
            raise ConfigError(
                f"data.env.startup_timeout_s must be > 0, got {self.startup_timeout_s}"
            )
        problem = resources_problem(self.ray_resources)
        if problem:
            raise ConfigError(f"data.env.ray_resources={self.ray_resources!r} {problem}")


def list_task_sources(
    env: str, split: str, args: dict[str, Any] | list[dict[str, Any]], key: str
) -> list[dict[str, Any]]:
    """The tasks of one split from one source (a dict of ``list_tasks`` arguments) or several
    (a list of them, concatenated in order). A source's ``label`` (not passed on) becomes its
    tasks' ``family``: evaluation logs ``val/success/<label>`` per set, e.g. in-distribution
    and out-of-distribution games side by side. Task ids must be unique over the sources."""
    sources = args if isinstance(args, list) else [args]
    if not sources:
        raise ConfigError(f"{key} is an empty list; give one task source or more, or null")
    tasks: list[dict[str, Any]] = []
    where: dict[str, int] = {}
    for i, src in enumerate(sources):
        if not isinstance(src, dict):
            raise ConfigError(f"{key}[{i}] must be a mapping of list_tasks arguments, got {src!r}")
        src = dict(src)
        label = src.pop("label", None)
        if label is not None and (not isinstance(label, str) or not label or "/" in label):
            raise ConfigError(
                f"{key}[{i}].label must be a non-empty name without '/', got {label!r}"
            )
        for t in env_class(env).list_tasks(split, **src):
            if label is not None:
                t = {**t, "family": label}
            if t["id"] in where:
                raise ConfigError(
                    f"{key}: task {t['id']!r} is listed by sources {where[t['id']]} and {i}; "
                    "give the sources disjoint seeds / files"
                )
            where[t["id"]] = i
            tasks.append(t)
    return tasks


class AgentDataModule(RolloutDataModule):
    """Agent rollouts for GRPO (and, through callbacks, VH-GPO).

    Args:
        env: environment, tasks and workers.
        agent: prompt/answer format, history length, penalties.
        max_turns: episode cap H (environment interactions).
        tasks_per_step: tasks per rollout batch of one update, over all ranks (split as
            ``prompts_per_step`` of RLVRDataModule).
        group_size: episodes per task (G).
        engine: sampling settings of the student.
        val_temperature: sampling temperature of evaluation episodes (0 = greedy).
        val_samples: besides those, ``k`` sampled episodes per evaluation task at
            ``val_sample_temperature``, logged as ``val/sampled_success`` (pass@1 over the
            k samples), ``val/sampled_pass_at_k`` and per family (0 = none).
        val_sample_temperature: sampling temperature of the ``val_samples`` episodes.
        val_batch_size: evaluation episodes per batch.
        advantage: ``grpo`` (std-normalised), ``drgrpo`` (no std) or ``rloo``.
        adv_eps: epsilon of the std normalisation.
        reward_tol: zero-signal test: a group's rewards differ by at most this (SPEC §1).
        adv_tol: zero-signal test: every advantage is at most this in size (SPEC §1).
        max_prompt_tokens: longer prompts keep their last tokens.
        seed: seed of task order and of every sampling stream.
        allow_overlap: fit even when a validation / test task shows the same initial
            observation and goal as a training task; default False refuses such a fit.
        drop_overlap: instead of refusing, drop each validation / test task with a training
            task's content, and each repeat of an earlier task of its split (counts logged as
            ``data/heldout_dropped/<split>``): for sources that repeat games (twc seeds).
        gigpo: GiGPO step-level advantages (``salvage.core.gigpo``, docs/baselines.md): each
            turn's advantage is its episode's plus ``omega`` x its anchor-state step group's
            relative discounted return; logs ``gigpo/step_group_size`` (mean) and
            ``gigpo/repeated_turn_frac`` (turns in a step group of two or more). None
            (default): off, every turn carries its trajectory's advantage.
    """

    def __init__(
        self,
        env: EnvSpec | None = None,
        agent: AgentFormat | None = None,
        max_turns: int = 50,
        tasks_per_step: int = 4,
        group_size: int = 8,
        engine: EngineConfig | None = None,
        val_temperature: float = 0.0,
        val_samples: int = 0,
        val_sample_temperature: float = 1.0,
        val_batch_size: int = 16,
        advantage: str = "grpo",
        adv_eps: float = 1e-6,
        reward_tol: float = 1e-6,
        adv_tol: float = 1e-6,
        max_prompt_tokens: int = 2048,
        seed: int = 0,
        gigpo: GiGPOConfig | None = None,
        allow_overlap: bool = False,
        drop_overlap: bool = False,
    ) -> None:
        super().__init__(
            tasks_per_step,
            engine,
            val_batch_size,
            seed,
            group_size,
            advantage,
            adv_eps,
            reward_tol,
            adv_tol,
            allow_overlap=allow_overlap,
            drop_overlap=drop_overlap,
        )
        if max_turns < 1:
            raise ConfigError(f"data.max_turns (H) must be >= 1, got {max_turns}")
        if val_samples < 0:
            raise ConfigError(f"data.val_samples must be >= 0, got {val_samples}")
        if val_samples and not val_sample_temperature > 0:
            raise ConfigError(
                f"data.val_sample_temperature must be > 0 with val_samples, got "
                f"{val_sample_temperature}"
            )
        self.val_samples = val_samples
        self.val_sample_temperature = val_sample_temperature
        self.env_spec = env or EnvSpec()
        self.fmt = agent or AgentFormat()
        self.max_turns = max_turns
        self.val_temperature = val_temperature
        self.max_prompt_tokens = max_prompt_tokens
        self.pool: EnvPool | None = None
        self.runner: AgentRunner | None = None
        self.env_errors_total = 0
        self.gigpo = gigpo
        self._step_groups: list[int] = []  # GiGPO step-group sizes of the current rollout
        self._digests: dict[str, str] = {}  # task (as JSON) -> content digest (held-out check)

    def assign_group_advantages(self, group: Group) -> None:
        """Each trajectory's advantage and the group's zero-signal flag (SPEC §1); with
        ``gigpo``, also each turn's (GiGPO: episode advantage + omega x step advantage).
        The zero-signal flag stays the episode-level one."""
        super().assign_group_advantages(group)
        if self.gigpo is None:
            return
        # own episodes from the initial state only (a relay's or a peer's have no step group)
        trajs = [
            t
            for t in group.trajectories
            if t.episode is not None
            and t.episode.start_depth == 0
            and len(t.episode.observations) >= len(t.turns)
        ]
        states = [
            [state_key(t.episode.observations[k]) for k in range(len(t.turns))] for t in trajs
        ]
        returns = [
            discounted_returns(
                gigpo_turn_rewards(
                    t.reward, [not turn.valid for turn in t.turns], self.fmt.invalid_penalty
                ),
                self.gigpo.gamma,
            )
            for t in trajs
        ]
        adv, sizes = gigpo_advantages([t.advantage for t in trajs], states, returns, self.gigpo)
        self._step_groups.extend(sizes)
        for t, row in zip(trajs, adv, strict=True):
            for turn, a in zip(t.turns, row, strict=True):
                turn.advantage = a

    # ------------------------------------------------------------------ set-up
    def load_split(self, split: str) -> list[dict[str, Any]] | None:
        spec = self.env_spec
        args = {
            "train": spec.train_tasks,
            "val": spec.val_tasks,
            "test": spec.test_tasks or spec.val_tasks,
        }[split]
        if args is None:
            return None
        return list_task_sources(spec.name, split, args, self.split_source(split))

    def split_source(self, split: str) -> str:
        if split == "test" and self.env_spec.test_tasks is None:
            return "data.env.val_tasks"
        return f"data.env.{split}_tasks"

    def task_digests(self, split: str) -> dict[str, str]:
        """Digest of each task's initial observation and goal (one local instance of the
        environment resets each task once; digests are cached per task, in memory and on
        disk where the environment allows: ``salvage.datamodules.digests``)."""
        tasks = self.tasks[split]
        keys = [json.dumps(t, sort_keys=True, default=str) for t in tasks]
        todo = [(k, t) for k, t in zip(keys, tasks, strict=True) if k not in self._digests]
        if todo:
            cls = env_class(self.env_spec.name)

            def compute(missing: list[dict[str, Any]]) -> list[str]:
                env = cls(**self.env_spec.kwargs)
                try:
                    return [text_digest(env.task_content(t)) for t in missing]
                finally:
                    env.close()

            got = cached_digests(
                self.env_spec.name,
                cls.content_identity(),
                dict(self.env_spec.kwargs),
                [t for _, t in todo],
                compute,
            )
            self._digests.update(zip([k for k, _ in todo], got, strict=True))
        return {t["id"]: self._digests[k] for k, t in zip(keys, tasks, strict=True)}

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.pool is None:
            spec = self.env_spec
            if spec.backend == "ray":
                from salvage.envs.ray_pool import RayEnvPool

                self.pool = RayEnvPool(
                    spec.name,
                    spec.kwargs,
                    spec.num_workers,
                    spec.step_timeout_s,
                    spec.startup_timeout_s,
                    address=spec.ray_address,
                    num_cpus=spec.ray_num_cpus,
                    resources=spec.ray_resources,
                )
            else:
                self.pool = EnvPool(
                    spec.name,
                    spec.kwargs,
                    spec.num_workers,
                    spec.step_timeout_s,
                    spec.startup_timeout_s,
                )
            self.runner = AgentRunner(self.pool, self.fmt, self.max_turns)
        trainer = getattr(self, "trainer", None)
        if (
            self.reports_score
            and trainer is not None
            and not any(isinstance(c, EnvScoreMetrics) for c in trainer.callbacks)
        ):
            trainer.callbacks.append(EnvScoreMetrics(self.env_spec.name))

    @property
    def reports_score(self) -> bool:
        """Whether the environment grades episodes with a score in [0, 1] (``info["score"]``)."""
        return bool(getattr(env_class(self.env_spec.name), "reports_score", False))

    def teardown(self, stage: str) -> None:
        super().teardown(stage)
        if self.pool is not None:
            self.pool.close()
            self.pool = None
            self.runner = None

    def live_runner(self) -> AgentRunner:
        """The episode runner (set up with the environment pool in ``setup``)."""
        if self.runner is None:
            raise RuntimeError("the agent datamodule is not set up (no environment pool)")
        return self.runner

    def student(self) -> LMPolicy:
        return LMPolicy(self.engine, self.module.tokenizer, self.fmt, self.max_prompt_tokens)

    # ------------------------------------------------------------------ rollouts
    def train_rollout(self, tasks: list[dict[str, Any]]) -> RolloutBatch:
        seed = step_seed(self.seed, self.trainer.global_step, TRAIN)
        self._step_groups = []
        batch = self.rollout(tasks, self.group_size, seed, self.student())
        record = getattr(self.module, "record_later", None)
        if self.gigpo is not None and self._step_groups and record is not None:
            sizes = self._step_groups  # the paper's "average size of step-level groups"
            record(
                {
                    "gigpo/step_group_size": sum(sizes) / len(sizes),
                    "gigpo/repeated_turn_frac": sum(n for n in sizes if n > 1) / sum(sizes),
                }
            )
        return batch

    def eval_rollout(self, tasks: list[dict[str, Any]], split: str) -> RolloutBatch:
        policy = self.student()
        policy.engine = self._eval_engine(self.val_temperature)
        seed = step_seed(self.seed, self.trainer.global_step, EVAL)
        batch = self.rollout(tasks, 1, seed, policy, advantages=False)
        if self.val_samples:
            sampler = self.student()
            sampler.engine = self._eval_engine(self.val_sample_temperature)
            # its own seeds: episode j of a task draws with seed + 1 + j (greedy used seed)
            batch.sampled = self.rollout(
                tasks, self.val_samples, seed + 1, sampler, advantages=False
            )
        return batch

    def _eval_engine(self, temperature: float) -> RolloutEngine:
        from dataclasses import replace

        from salvage.rollout.config import build_engine

        return build_engine(
            replace(self.engine_cfg, temperature=temperature),
            self.policy(),
            self.module.tokenizer,
        )

    def rollout(
        self, tasks: list[dict[str, Any]], n: int, seed: int, policy: Any, advantages: bool = True
    ) -> RolloutBatch:
        t0 = time.perf_counter()
        assert self.runner is not None and self.pool is not None
        errors_before = self.pool.errors
        startup_before = self.pool.startup_s
        steps_before = self.runner.env_steps
        tp, te = self.runner.time_policy, self.runner.time_env
        starts = [Start(task=t, seed=seed + j) for t in tasks for j in range(n)]
        episodes = self.runner.run(starts, policy, seed)
        groups: list[Group] = []
        for i, task in enumerate(tasks):
            eps = episodes[i * n : (i + 1) * n]
            trajs = [self.runner.to_trajectory(e) for e in eps if e.error is None]
            if self.reports_score:
                for t in trajs:
                    t.score = float(t.episode.info.get("score", 0.0))
            for e in eps:
                if e.error is not None:
                    log.warning("task %s episode %d failed: %s", task["id"], e.eid, e.error)
            if not trajs:
                continue
            g = Group(task_id=task["id"], trajectories=trajs, task=task)
            g.failed_episodes = n - len(trajs)
            if advantages and len(trajs) > 1:
                self.assign_group_advantages(g)
            groups.append(g)
        gen_tokens = sum(t.num_response_tokens for g in groups for t in g.trajectories)
        errors = self.pool.errors - errors_before
        self.env_errors_total += errors
        t_end = time.perf_counter()
        startup = self.pool.startup_s - startup_before
        return RolloutBatch(
            groups=groups,
            temperature=self.engine_cfg.temperature if self.engine_cfg.temperature > 0 else 1.0,
            stats=RolloutStats(
                # environment start-up (new instances, e.g. JVMs, after a start or a resume)
                # is set-up, not step time: the step clock starts that much later
                t_start=t0 + startup,
                time_env_startup=startup,
                time_generate=self.runner.time_policy - tp,
                time_env=self.runner.time_env - te,
                time_rollout=t_end - t0,
                gen_tokens=float(gen_tokens),
                env_errors=float(errors),
                env_steps=float(self.runner.env_steps - steps_before),
            ),
        )


class EnvScoreMetrics(Callback):
    """``<prefix>/<env>_score`` = 100 x mean score and ``<prefix>/<env>_success`` = 100 x fraction
    with score 1 over evaluation episodes (``val`` in fit, ``eval`` in test), for environments
    that grade episodes (WebShop's Score and Succ., SPEC §2.6). Added by ``AgentDataModule``.

    Args:
        env_name: the environment's name, used in the metric names.
    """

    def __init__(self, env_name: str) -> None:
        self.env_name = env_name

    def _log(self, pl_module: Any, batch: Any, prefix: str) -> None:
        if not isinstance(batch, RolloutBatch):
            return
        scores = [t.score for t in batch.trajectories if t.score is not None]
        if not scores:
            return
        n = len(scores)
        for key, value in (
            ("score", sum(scores) / n),
            ("success", sum(s == 1.0 for s in scores) / n),
        ):
            pl_module.log(
                f"{prefix}/{self.env_name}_{key}",
                100.0 * value,
                on_step=False,
                on_epoch=True,
                batch_size=n,
                sync_dist=True,
            )

    def on_validation_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._log(pl_module, batch, "val")

    def on_test_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._log(pl_module, batch, "eval")
