"""VH-GPO rescue stage: environment-state callbacks between rollout and update.

The rescue stage is the config key ``rescue`` of ``salvage fit`` (its own key, so an
ablation fragment overrides only what differs and keeps the base config's teacher and
budgets; a rescue callback in ``trainer.callbacks`` works too). The method and its
ablations (SPEC §2.4):

- ``VerifiedHandoff``        the full method; ``relay.handoff: random`` is Random Verified
                             Handoff (from S \\ {j_early}), ``relay.handoff: none`` No Handoff,
                             ``relay.anchor_order: random`` Random Anchor Order;
- ``ExtraStudentRollouts``   budget-matched: 4 extra student rollouts per selected group,
                             trained with plain GRPO (no teacher, no relay).

``RandomVerifiedHandoff``, ``RandomAnchorOrder`` and ``NoHandoff`` remain as names of
``VerifiedHandoff`` with that switch set. The teacher has no default: the paper's frozen LM
(``teacher.kind: lm``) or, opted into explicitly, the environment's oracle (a CPU
convenience with no teacher tokens), named in the run summary and in ``relays.jsonl``.

Each runs in ``on_train_batch_start``: it restores recorded states, drives the pure search
of ``salvage.core.relay`` with batched teacher / student rollouts (all requests of all
selected groups at one search stage go to the engine together), and attaches the
retained relays to ``batch.relays`` for ``VHGPOModule``. It reports SPEC §2.5's
accounting each step and cumulatively, and appends one record per searched group to
``relays.jsonl`` in the run directory.

Rollout seeds identify rollouts (discovery and confirmation streams never share one);
the batched engine draws all rows of one call from one seeded stream.

Layout: the shared shell (selection, accounting, records, the teacher) is
``salvage.callbacks.rescue``, the search's per-group state and its relay data
``salvage.callbacks.relay_data``, ``ExtraStudentRollouts`` ``salvage.callbacks.extra_rollouts``;
``VerifiedHandoff``'s search driver is here. Every name is importable from here.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import lightning as L

from salvage.callbacks.extra_rollouts import ExtraStudentRollouts
from salvage.callbacks.relay_data import (
    GroupSearch,
    episode_path,
    outcome_of,
    relay_of,
    search_record,
)
from salvage.callbacks.rescue import (
    RescueCallback,
    TeacherSpec,
    _Accounting,
    _data,
    _learner,
    frozen_lm_policy,
)
from salvage.core.relay import (
    RANDOM_EMPTY,
    RelayConfig,
    ReplayRequest,
    StudentRequest,
    TeacherRequest,
    anchor_schedule,
    random_anchor_order,
    relay_search,
    select_backbone,
)
from salvage.core.seeds import GROUP_OFFSET, RELAY_DRIVE, RELAY_SEARCH, step_seed
from salvage.progress import stage
from salvage.rollout.agent import Episode, LMPolicy, OraclePolicy, Start
from salvage.types import RelayData, RolloutBatch

log = logging.getLogger(__name__)

RESCUE_TIMES = (
    "rescue",
    "rescue_teacher",
    "rescue_teacher_policy",
    "rescue_discovery",
    "rescue_confirm",
    "rescue_replay",
    "rescue_policy",
    "rescue_env",
)
"""``cost/time_<name>`` of a search (seconds per update): the whole search; the wall time of
its teacher, discovery, confirmation and replay runner calls (a call holding discovery and
confirmation rollouts together is split by their share of its output tokens); the teacher's
policy part (an LM teacher's engine, or the oracle's planning); the student calls' policy
(engine) part and the rest of the student and replay calls (environment restores and steps,
prompts)."""


class VerifiedHandoff(RescueCallback):
    """Full VH-GPO: teacher recovery, earliest confirmed handoff, verified relay (SPEC §2).

    Args:
        relay: search settings (every knob of SPEC §2 with its default; ``handoff`` and
            ``anchor_order`` select the ablations).
        teacher: the frozen teacher, required: ``{kind: lm, policy: ...}`` (the paper's) or
            ``{kind: oracle}`` (explicit opt-in; named in the run summary and records).
        seed: seed of the search's random streams (group selection, random ablations).
        records: write ``relays.jsonl`` in the run directory.
    """

    handoff: str | None = None
    anchor_order: str | None = None

    def __init__(
        self,
        relay: RelayConfig | None = None,
        teacher: TeacherSpec | None = None,
        seed: int = 0,
        records: bool = True,
    ) -> None:
        super().__init__(relay, seed, records)
        if self.handoff is not None:
            self.cfg = replace(self.cfg, handoff=self.handoff)
        if self.anchor_order is not None:
            self.cfg = replace(self.cfg, anchor_order=self.anchor_order)
        if teacher is None:
            raise ValueError(
                f"{type(self).__name__} needs a teacher (rescue.init_args.teacher): "
                "{kind: lm, policy: {name_or_path: ...}} for the paper's frozen LM, or "
                "{kind: oracle} to opt into the environment's expert (a CPU convenience)"
            )
        self.teacher_spec = teacher
        self._teacher: Any = None
        self._times = dict.fromkeys(RESCUE_TIMES, 0.0)  # this update's search (rescue resets it)
        self.acc.random_handoff = self.cfg.handoff == "random"

    def student_policy(self, pl_module: L.LightningModule, dm: Any) -> Any:
        """The policy whose group is rescued (the datamodule's live student)."""
        return dm.student()

    def teacher_name(self) -> str:
        """The teacher as ``relays.jsonl`` names it (``lm``, ``oracle``)."""
        return str(self.teacher_spec.kind)

    def describe(self) -> str:
        """One line for the run summary: the rescue stage, its variant and its teacher."""
        t = self.teacher_spec
        name = t.policy.name_or_path if t.policy is not None else "?"
        who = "oracle (environment expert)" if t.kind == "oracle" else f"lm {name}"
        return (
            f"rescue: {type(self).__name__} (handoff={self.cfg.handoff}, "
            f"anchor_order={self.cfg.anchor_order}, search={self.cfg.search}), teacher: {who}"
        )

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        dm = _data(trainer)
        module = _learner(pl_module)
        if self.teacher_spec.kind == "oracle":
            self._teacher = OraclePolicy(dm.fmt)
        elif self._teacher is None and self.teacher_spec.policy is not None:
            self._teacher, self.teacher_model = frozen_lm_policy(
                self.teacher_spec.policy, module, dm, self.teacher_spec.engine
            )

    # -- search driver ---------------------------------------------------------------
    @contextmanager
    def _timed(self, dm: Any, phase: str, kinds: list[str] | None) -> Iterator[list[Episode]]:
        """Add the wall time of the runner call inside to ``phase`` (``student``: split
        over ``kinds``, one per episode, by output tokens) and its policy / other split."""
        times = self._times
        eps: list[Episode] = []
        tp, t0 = dm.runner.time_policy, time.perf_counter()
        yield eps
        wall, policy = time.perf_counter() - t0, dm.runner.time_policy - tp
        if phase == "teacher":
            times["rescue_teacher"] += wall
            times["rescue_teacher_policy"] += policy
            return
        times["rescue_policy"] += policy
        times["rescue_env"] += wall - policy
        if kinds is None:
            times[f"rescue_{phase}"] += wall
            return
        weight = {"discovery": 0.0, "confirm": 0.0}
        for k, e in zip(kinds, eps, strict=True):
            weight[k] += sum(len(t.response_ids) for t in e.turns) or 1e-9
        total = sum(weight.values()) or 1.0
        for k, w in weight.items():
            times[f"rescue_{k}"] += wall * w / total

    def rescue(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        batch: RolloutBatch,
        selected: list[int],
        step: dict[str, float],
    ) -> list[float]:
        dm = _data(trainer)
        rng = self._rng(trainer)
        searches: list[GroupSearch] = []
        for gi in selected:  # in batch order: each search draws from ``rng`` as it starts
            s = self._start(trainer, batch, gi, dm, rng)
            if s is not None:
                searches.append(s)
        student = self.student_policy(pl_module, dm)
        base_seed = step_seed(self.seed, trainer.global_step, RELAY_DRIVE)
        self._times = dict.fromkeys(RESCUE_TIMES, 0.0)
        t0 = time.perf_counter()
        with stage("verified handoff search", total=len(searches), unit="group") as bar:
            self._drive(searches, dm, student, base_seed, bar)
        self._times["rescue"] = time.perf_counter() - t0
        self.emit(pl_module, {f"cost/time_{k}": v for k, v in self._times.items()})
        return self._collect(trainer, batch, searches, student, dm, step)

    def _start(
        self, trainer: L.Trainer, batch: RolloutBatch, gi: int, dm: Any, rng: random.Random
    ) -> GroupSearch | None:
        """Group ``gi``'s search, started (its first request pending); None (recorded) when
        the group has no eligible backbone."""
        g = batch.groups[gi]
        eps: list[Episode] = [t.episode for t in g.trajectories]
        bb = select_backbone(
            [(len(e.actions), e.terminal) for e in eps], dm.max_turns, self.cfg.b_min
        )
        if bb is None:
            self._write(
                trainer,
                {
                    "step": trainer.global_step,
                    "task": g.task_id,
                    "retained": False,
                    "reason": "no eligible backbone with a t=0 candidate",
                    "search": self.cfg.search,
                },
            )
            return None
        idx, depths = bb
        anchors = anchor_schedule(depths, self.cfg.stride, self.cfg.max_backtracks)
        if self.cfg.anchor_order == "random":
            anchors = random_anchor_order(anchors, rng)
        start_obs = eps[idx].observations[:1]
        gen = relay_search(
            eps[idx].actions,
            anchors,
            self.cfg,
            rng,
            seed=step_seed(self.seed, trainer.global_step, RELAY_SEARCH) + GROUP_OFFSET * gi,
            group_paths=[  # monotone search: the group's failed episodes, same start
                episode_path(e)
                for e in eps
                if not e.won and e.error is None and e.observations[:1] == start_obs
            ],
            backbone_path=episode_path(eps[idx]),
        )
        s = GroupSearch(gi, g, eps[idx], gen)
        s.req = next(gen)
        return s

    def _drive(
        self, searches: list[GroupSearch], dm: Any, student: LMPolicy, base_seed: int, bar: Any
    ) -> None:
        round_ = 0
        while any(s.result is None for s in searches):
            live = [s for s in searches if s.result is None]
            answers: dict[int, Any] = {}
            self._run_teacher(
                [s for s in live if isinstance(s.req, TeacherRequest)],
                dm,
                answers,
                base_seed + round_,
            )
            self._run_student(
                [s for s in live if isinstance(s.req, StudentRequest)],
                dm,
                student,
                answers,
                base_seed + round_,
            )
            self._run_replay([s for s in live if isinstance(s.req, ReplayRequest)], dm, answers)
            for s in live:
                try:
                    s.req = s.gen.send(answers[id(s)])
                except StopIteration as stop:
                    s.result = stop.value
                    bar.advance(1)
            round_ += 1

    def _collect(
        self,
        trainer: L.Trainer,
        batch: RolloutBatch,
        searches: list[GroupSearch],
        student: LMPolicy,
        dm: Any,
        step: dict[str, float],
    ) -> list[float]:
        relays: list[RelayData] = batch.relays
        fracs = []
        for s in searches:
            r = s.outcome
            step["teacher_attempts"] = step.get("teacher_attempts", 0.0) + r.teacher_attempts
            step["recoveries"] = step.get("recoveries", 0.0) + float(r.recovered)
            step["extra_tokens_teacher"] = step.get("extra_tokens_teacher", 0.0) + r.teacher_tokens
            step["extra_tokens_search"] = step.get("extra_tokens_search", 0.0) + r.search_tokens
            step["extra_tokens_confirm"] = step.get("extra_tokens_confirm", 0.0) + r.confirm_tokens
            if r.random_fallback:  # Random Verified Handoff with S minus j_early empty
                step["random_fallbacks"] = step.get("random_fallbacks", 0.0) + 1
                if not r.retained and r.reason == RANDOM_EMPTY:
                    step["random_discards"] = step.get("random_discards", 0.0) + 1
            rec = self._record(trainer, s)
            if r.retained:
                relays.append(self._relay(s, student, dm.fmt, rec))
                _, j_star, _ = r.handoff()
                step["retained"] = step.get("retained", 0.0) + 1
                step["sum_j"] = step.get("sum_j", 0.0) + j_star
                step["sum_L"] = step.get("sum_L", 0.0) + r.L
                fracs.append(j_star / r.L)
            self._write(trainer, rec)
        return fracs

    def _run_teacher(
        self, live: list[GroupSearch], dm: Any, answers: dict[int, Any], seed: int
    ) -> None:
        if not live:
            return
        starts, owners = [], []
        for s in live:
            a = s.req.anchor
            state = s.backbone.state_at(a)
            for sd in s.req.seeds:
                starts.append(
                    Start(
                        s.group.task,
                        s.backbone.start.seed,
                        state=state,
                        history=s.backbone.history[:a],
                    )
                )
                owners.append((s, sd))
        with self._timed(dm, "teacher", None):
            eps = dm.runner.run(starts, self._teacher, seed=seed, train=False)
        for s in live:
            answers[id(s)] = [
                outcome_of(e, sd) for (o, sd), e in zip(owners, eps, strict=True) if o is s
            ]

    def _run_student(
        self,
        live: list[GroupSearch],
        dm: Any,
        student: LMPolicy,
        answers: dict[int, Any],
        seed: int,
    ) -> None:
        if not live:
            return
        starts, owners = [], []
        for s in live:
            rec: Episode = s.req.recovery.ref
            depth = rec.start_depth + s.req.j
            state = rec.state_at(depth)
            hist = rec.history[: len(rec.start.history) + s.req.j]
            for sd in s.req.seeds:
                starts.append(Start(s.group.task, s.backbone.start.seed, state=state, history=hist))
                owners.append((s, sd))
        kinds = [s.req.kind for s, _ in owners]
        with self._timed(dm, "student", kinds) as eps_out:
            eps = dm.runner.run(starts, student, seed=seed + 1, train=True)
            eps_out.extend(eps)
        for s in live:
            answers[id(s)] = [
                outcome_of(e, sd) for (o, sd), e in zip(owners, eps, strict=True) if o is s
            ]

    def _run_replay(self, live: list[GroupSearch], dm: Any, answers: dict[int, Any]) -> None:
        if not live:
            return
        items = []
        for s in live:
            rec: Episode = s.req.recovery.ref
            resume = s.req.resume.ref.actions if s.req.resume is not None else []
            acts = s.backbone.actions[: s.req.anchor] + rec.actions[: s.req.j] + list(resume)
            items.append((s.group.task, s.backbone.start.seed, acts))
        with self._timed(dm, "replay", None):
            wins = dm.runner.replay(items)
        for s, won in zip(live, wins, strict=True):
            answers[id(s)] = won

    # -- relay assembly ----------------------------------------------------------------
    def _relay(self, s: GroupSearch, student: LMPolicy, fmt: Any, rec: dict[str, Any]) -> RelayData:
        return relay_of(s, student, fmt, rec, self.cfg.pair_walk)

    def _record(self, trainer: L.Trainer, s: GroupSearch) -> dict[str, Any]:
        return search_record(trainer.global_step, s, self.teacher_name())


class RandomVerifiedHandoff(VerifiedHandoff):
    """Ablation: the handoff is drawn uniformly from S \\ {j_early}; confirmation and replay unchanged."""

    handoff = "random"


class RandomAnchorOrder(VerifiedHandoff):
    """Ablation: non-root anchors in random order, the root last."""

    anchor_order = "random"


class NoHandoff(VerifiedHandoff):
    """Ablation: keep the whole teacher recovery as the bridge; no handoff search, no resume."""

    handoff = "none"


__all__ = [
    "RESCUE_TIMES",
    "ExtraStudentRollouts",
    "GroupSearch",
    "NoHandoff",
    "RandomAnchorOrder",
    "RandomVerifiedHandoff",
    "RescueCallback",
    "TeacherSpec",
    "VerifiedHandoff",
    "_Accounting",
    "_data",
    "_learner",
    "frozen_lm_policy",
]
