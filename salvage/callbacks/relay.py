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
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch

from salvage.core.agent import parse_action
from salvage.core.relay import (
    RANDOM_EMPTY,
    Outcome,
    RelayConfig,
    RelayResult,
    ReplayRequest,
    StudentRequest,
    TeacherRequest,
    anchor_schedule,
    pair_index,
    random_anchor_order,
    relay_search,
    select_backbone,
    select_groups_across_ranks,
)
from salvage.core.seeds import (
    EXTRA_ROLLOUTS,
    GROUP_OFFSET,
    RELAY_DRIVE,
    RELAY_SEARCH,
    RELAY_SELECT,
    step_seed,
)
from salvage.datamodules.agent import AgentDataModule
from salvage.datamodules.base import attached_datamodule
from salvage.distributed import (
    all_reduce,
    gather_objects,
    gathered,
    load_sharded,
    run_file,
    world,
)
from salvage.models import PolicySpec, build_empty_model, load_model, load_tokenizer
from salvage.modules.grpo import GRPOModule
from salvage.progress import stage
from salvage.rollout.agent import Episode, LMPolicy, OraclePolicy, Start
from salvage.rollout.config import EngineConfig, build_engine
from salvage.types import Group, RelayData, RolloutBatch, SeqTarget, Trajectory

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


@dataclass
class TeacherSpec:
    """The frozen teacher: an environment oracle, or an LM of any size / tokenizer."""

    kind: str | None = None
    """``lm`` (the paper's frozen LM teacher) or ``oracle`` (the environment's gold path /
    handcoded expert: a CPU convenience, zero teacher tokens). No default: choose one."""
    policy: PolicySpec | None = None
    """``lm`` only: which model."""
    engine: EngineConfig | None = None
    """``lm`` only: its sampling settings (default: the student's)."""

    def __post_init__(self) -> None:
        if self.kind is None:
            raise ValueError(
                "teacher.kind must be set: 'lm' (the paper's frozen LM teacher, with "
                "teacher.policy) or 'oracle' (the environment's expert, a CPU convenience)"
            )
        if self.kind not in ("oracle", "lm"):
            raise ValueError(f"teacher.kind must be 'oracle' or 'lm', got {self.kind!r}")
        if self.kind == "lm" and self.policy is None:
            raise ValueError(
                "teacher.kind='lm' needs teacher.policy (e.g. name_or_path: Qwen/Qwen2.5-1.5B-Instruct)"
            )


class _Accounting:
    """SPEC §2.5 counters, per step and cumulative (saved in checkpoints)."""

    KEYS = (
        "zero_signal_groups",
        "selected",
        "teacher_attempts",
        "recoveries",
        "retained",
        "extra_tokens_teacher",
        "extra_tokens_search",
        "extra_tokens_confirm",
        "extra_tokens_student",
        "root_tokens",
        "sum_j",
        "sum_L",
        "relays",
        "random_fallbacks",
        "random_discards",
    )

    def __init__(self) -> None:
        self.total = dict.fromkeys(self.KEYS, 0.0)
        self.random_handoff = False
        """Random Verified Handoff: also log how often S minus j_early was empty."""

    def metrics(self, step: dict[str, float], fracs: list[float]) -> dict[str, float]:
        for k in self.KEYS:
            self.total[k] += step.get(k, 0.0)
        t = self.total
        extra = (
            t["extra_tokens_teacher"]
            + t["extra_tokens_search"]
            + t["extra_tokens_confirm"]
            + t["extra_tokens_student"]
        )
        out = {
            f"relay/{k}": step.get(k, 0.0)
            for k in (
                "zero_signal_groups",
                "selected",
                "teacher_attempts",
                "recoveries",
                "retained",
            )
        }
        out.update(
            {
                f"relay/{k}_cum": t[k]
                for k in (
                    "zero_signal_groups",
                    "selected",
                    "teacher_attempts",
                    "recoveries",
                    "retained",
                )
            }
        )
        for k in ("teacher", "search", "confirm", "student"):
            out[f"cost/extra_tokens_{k}"] = t[f"extra_tokens_{k}"]
        out["cost/extra_token_ratio"] = extra / t["root_tokens"] if t["root_tokens"] else 0.0
        if fracs:
            out["relay/teacher_frac"] = sum(fracs) / len(fracs)
        if t["sum_L"]:
            out["relay/pooled_reduction"] = 1.0 - t["sum_j"] / t["sum_L"]
        if self.random_handoff:  # searches with S minus j_early empty, and those discarded
            for k in ("random_fallbacks", "random_discards"):
                out[f"relay/{k}"] = step.get(k, 0.0)
                out[f"relay/{k}_cum"] = t[k]
        return out


class RescueCallback(L.Callback):
    """Shared shell of the rescue stages: selection, accounting, logging, records.

    Args:
        relay: search settings (``max_groups`` and ``group_select`` pick the groups).
        seed: seed of the stage's random streams.
        records: write ``relays.jsonl`` in the run directory.
    """

    def __init__(
        self, relay: RelayConfig | None = None, seed: int = 0, records: bool = True
    ) -> None:
        self.cfg = relay or RelayConfig()
        self.seed = seed
        self.records = records
        self.acc = _Accounting()
        self._records_path: Path | None = None
        self.teacher_model: torch.nn.Module | None = None
        """A frozen LM teacher this stage loaded (None: none, or an oracle)."""

    # -- lifecycle -----------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        dm = getattr(trainer, "datamodule", None)  # attached by Lightning at run time
        self._records_path = (
            run_file(trainer, "relays") if self.records else None
        )  # every rank: log_dir syncs
        if not isinstance(dm, AgentDataModule):
            raise TypeError(
                f"{type(self).__name__} needs an AgentDataModule (restorable env states), "
                f"got {type(dm).__name__}"
            )
        self.cfg.check_horizon(dm.max_turns)

    def state_dict(self) -> dict[str, Any]:
        return {"total": dict(self.acc.total)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.acc.total.update(state_dict["total"])

    def _rng(self, trainer: L.Trainer) -> random.Random:
        return random.Random(step_seed(self.seed, trainer.global_step, RELAY_SELECT))

    def _write(self, trainer: L.Trainer, rec: dict[str, Any]) -> None:
        if not self.records:
            return
        if self._records_path is None:
            self._records_path = run_file(trainer, "relays")
        with self._records_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _log(
        self, pl_module: L.LightningModule, step: dict[str, float], fracs: list[float]
    ) -> None:
        if world()[1] > 1:  # per update = over all ranks (SPEC §2.5): sum the rank shares
            keys = _Accounting.KEYS
            step = dict(zip(keys, all_reduce([step.get(k, 0.0) for k in keys]), strict=True))
            fracs = [f for part in gather_objects(fracs) for f in part]
        self.emit(pl_module, self.acc.metrics(step, fracs))

    def emit(self, pl_module: L.LightningModule, values: dict[str, float]) -> None:
        """Send this update's accounting to the trained module's step metrics."""
        _learner(pl_module).record(values)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not isinstance(batch, RolloutBatch):
            return
        zero, selected = self.select(trainer, batch)
        step = {
            "zero_signal_groups": float(len(zero)),
            "selected": float(len(selected)),
            "root_tokens": float(batch.num_response_tokens()),
        }
        try:
            with gathered(*self.inference_models(pl_module)):  # FSDP: searches sample locally
                fracs = self.rescue(trainer, pl_module, batch, selected, step)
        finally:
            for e in _data(trainer).live_engines():
                e.release()  # vLLM: memory back to training
        self._log(pl_module, step, fracs)

    def select(self, trainer: L.Trainer, batch: RolloutBatch) -> tuple[list[int], list[int]]:
        """This rank's zero-signal groups and those of them it rescues.

        At most ``max_groups`` per update over all ranks (SPEC §2): every rank's candidates
        are gathered and every rank makes the same choice, the one a single process would
        make on the whole batch (each rank holds a contiguous slice of it, in rank order).
        """
        zero = [i for i, g in enumerate(batch.groups) if g.zero_signal]
        everyone = gather_objects(zero)  # a collective: every rank, every step
        picked = select_groups_across_ranks(everyone, self.cfg, self._rng(trainer))
        return zero, picked[world()[0]]

    def rescue(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        batch: RolloutBatch,
        selected: list[int],
        step: dict[str, float],
    ) -> list[float]:
        raise NotImplementedError

    def inference_models(self, pl_module: L.LightningModule) -> list[torch.nn.Module]:
        """The student's sampling models and a frozen LM teacher, gathered for a search (FSDP;
        the reference is not used here)."""
        models = _learner(pl_module).sampling_models()
        return models + ([self.teacher_model] if self.teacher_model is not None else [])


def frozen_lm_policy(
    spec: PolicySpec, module: GRPOModule, dm: Any, engine: EngineConfig | None = None
) -> tuple[LMPolicy, torch.nn.Module]:
    """A frozen LM loaded from ``spec`` as an agent policy on ``module``'s device (sharded or
    offloaded like the reference under FSDP), sampling with ``engine`` (None: the
    datamodule's settings); returns the policy and its model."""
    tok = load_tokenizer(spec)
    mesh = module.fsdp_mesh()
    if mesh is not None:  # FSDP: the teacher is sharded (or offloaded) like the reference
        model = load_sharded(
            lambda: load_model(spec, tok),
            lambda: build_empty_model(spec, tok),
            mesh,
            module.fsdp,
            frozen=True,
            device=module.device,
        )
    else:
        model = load_model(spec, tok).eval().requires_grad_(False).to(module.device)
    eng = build_engine(engine or dm.engine_cfg, model, tok, frozen=True)
    return LMPolicy(eng, tok, dm.fmt, dm.max_prompt_tokens), model


def _data(trainer: L.Trainer) -> AgentDataModule:
    return attached_datamodule(trainer, AgentDataModule)


def _learner(pl_module: L.LightningModule) -> GRPOModule:
    if not isinstance(pl_module, GRPOModule):
        raise TypeError(f"a rescue stage trains a GRPOModule, got {type(pl_module).__name__}")
    return pl_module


def _path(e: Episode) -> list[tuple[str, str]]:
    """The episode's steps as (action, observation after it): what identifies a state here."""
    return list(zip(e.actions, e.observations[1:], strict=False))


def _outcome(e: Episode, seed: int) -> Outcome:
    return Outcome(
        success=e.won,
        n_actions=len(e.actions),
        output_tokens=sum(len(t.response_ids) for t in e.turns),
        seed=seed,
        restored=bool(e.observations),
        ref=e,
        path=_path(e),
    )


@dataclass
class _Search:
    gi: int
    group: Group
    backbone: Episode
    gen: Any
    req: Any = None
    result: RelayResult | None = None

    @property
    def outcome(self) -> RelayResult:
        """The finished search's result."""
        if self.result is None:
            raise RuntimeError(f"the search of group {self.gi} has not finished")
        return self.result


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
        H = dm.max_turns
        searches: list[_Search] = []
        for gi in selected:
            g = batch.groups[gi]
            eps: list[Episode] = [t.episode for t in g.trajectories]
            bb = select_backbone([(len(e.actions), e.terminal) for e in eps], H, self.cfg.b_min)
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
                continue
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
                    _path(e)
                    for e in eps
                    if not e.won and e.error is None and e.observations[:1] == start_obs
                ],
                backbone_path=_path(eps[idx]),
            )
            s = _Search(gi, g, eps[idx], gen)
            s.req = next(gen)
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

    def _drive(
        self, searches: list[_Search], dm: Any, student: LMPolicy, base_seed: int, bar: Any
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
        searches: list[_Search],
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
        self, live: list[_Search], dm: Any, answers: dict[int, Any], seed: int
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
                _outcome(e, sd) for (o, sd), e in zip(owners, eps, strict=True) if o is s
            ]

    def _run_student(
        self, live: list[_Search], dm: Any, student: LMPolicy, answers: dict[int, Any], seed: int
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
                _outcome(e, sd) for (o, sd), e in zip(owners, eps, strict=True) if o is s
            ]

    def _run_replay(self, live: list[_Search], dm: Any, answers: dict[int, Any]) -> None:
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
    def _relay(self, s: _Search, student: LMPolicy, fmt: Any, rec: dict[str, Any]) -> RelayData:
        r = s.outcome
        anchor, j_star, found = r.handoff()
        recovery: Episode = found.ref
        tok = student.tokenizer
        bridge = []
        for turn in recovery.turns[:j_star]:
            bridge.append(
                SeqTarget(
                    student.encode(turn.prompt_text),
                    list(tok(turn.response_text, add_special_tokens=False)["input_ids"]),
                )
            )
        resume = []
        if r.resume is not None:
            resume = [
                SeqTarget(list(t.prompt_ids), list(t.response_ids))
                for t in r.resume.ref.turns
                if t.response_ids
            ]
        pair = None
        d = pair_index(recovery.actions, s.backbone.actions, anchor, j_star, self.cfg.pair_walk)
        if d is not None:
            failed_turn = s.backbone.turns[anchor + d]
            h = list(failed_turn.prompt_ids) or student.encode(failed_turn.prompt_text)
            pair = (
                _action_target(h, recovery.turns[d].response_text, tok, fmt),
                _action_target(h, failed_turn.response_text, tok, fmt),
            )
            rec["pair_depth"] = anchor + d
        return RelayData(bridge=bridge, resume=resume, pair=pair, record=rec)

    def _record(self, trainer: L.Trainer, s: _Search) -> dict[str, Any]:
        r = s.outcome
        R = r.resume.n_actions if r.resume is not None else 0
        return {
            "step": trainer.global_step,
            "task": s.group.task_id,
            "family": s.group.task.get("family"),
            "retained": r.retained,
            "reason": r.reason,
            "teacher": self.teacher_name(),
            "anchors": r.anchors_tried,
            "anchor": r.anchor,
            "L": r.L,
            "j_star": r.j_star,
            "j_early": r.j_early,
            "random_fallback": r.random_fallback,
            "R": R,
            "teacher_frac": (r.handoff()[1] / r.L) if r.retained and r.L else None,
            "discovery": {str(k): v for k, v in r.discovery.items()},
            "teacher_attempts": r.teacher_attempts,
            "discovery_rollouts": r.discovery_rollouts,
            "confirm_rollouts": r.confirm_rollouts,
            "search": r.search,
            "known_failure": r.known_failure,
            "student_rollouts": r.discovery_rollouts + r.confirm_rollouts,
            "tokens": {
                "teacher": r.teacher_tokens,
                "search": r.search_tokens,
                "confirm": r.confirm_tokens,
            },
        }


def _action_target(prompt_ids: list[int], response: str, tok: Any, fmt: Any) -> SeqTarget:
    """A response scored over its executable-action tokens only (SPEC §2.3 pair)."""
    action, _ = parse_action(response, fmt)
    enc = tok(response, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    tagged = list(fmt._action_re.finditer(response))
    if tagged:  # the span inside the (last) action tag, surrounding spaces excluded
        m = tagged[-1]
        inner = m.group(1)
        start = m.start(1) + (len(inner) - len(inner.lstrip()))
        end = m.end(1) - (len(inner) - len(inner.rstrip()))
    else:  # no tag: the text the environment received
        start = response.rfind(action) if action else -1
        end = start + len(action)
    if start < 0 or end <= start:
        return SeqTarget(prompt_ids, ids, None)
    mask = [1 if (a < end and b > start) else 0 for a, b in enc["offset_mapping"]]
    return SeqTarget(prompt_ids, ids, mask if any(mask) else None)


class RandomVerifiedHandoff(VerifiedHandoff):
    """Ablation: the handoff is drawn uniformly from S \\ {j_early}; confirmation and replay unchanged."""

    handoff = "random"


class RandomAnchorOrder(VerifiedHandoff):
    """Ablation: non-root anchors in random order, the root last."""

    anchor_order = "random"


class NoHandoff(VerifiedHandoff):
    """Ablation: keep the whole teacher recovery as the bridge; no handoff search, no resume."""

    handoff = "none"


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


__all__ = [
    "ExtraStudentRollouts",
    "NoHandoff",
    "RandomAnchorOrder",
    "RandomVerifiedHandoff",
    "RescueCallback",
    "TeacherSpec",
    "VerifiedHandoff",
]
