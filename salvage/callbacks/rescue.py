"""The shell every rescue stage shares (VH-GPO's ``VerifiedHandoff`` and its ablations,
``ExtraStudentRollouts``, ``DynamicSampling``, ``PeerHandoff``): group selection across
ranks, SPEC §2.5's accounting (per step and cumulative, checkpointed), its logging, and the
``relays.jsonl`` records; and the frozen teacher's spec and loading.

A stage subclasses ``RescueCallback`` and implements ``rescue``; ``salvage.callbacks.relay``
describes the method and its ablations.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch

from salvage.core.relay import RelayConfig, select_groups_across_ranks
from salvage.core.seeds import RELAY_SELECT, step_seed
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
from salvage.rollout.agent import LMPolicy
from salvage.rollout.config import EngineConfig, build_engine
from salvage.types import RolloutBatch


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
        if t["selected"]:  # of the groups selected so far, the share with a relay retained
            out["relay/retained_frac_cum"] = t["retained"] / t["selected"]
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
