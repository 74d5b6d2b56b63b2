"""GRAFT stored mode (SPEC §3.2): record a run's rollouts, let a later run receive them.

``RecordRollouts`` (on any single-model RLVR run) writes, for every update, one JSON file
``<dir>/step_<k>.json`` with each prompt's task id, answer, and every response's text,
generation log-probs, finish reason and reward (plain data, written atomically: a crash
mid-write leaves no partial file).

``StoredPeer`` (on the receiver's run, same data and seed so the prompt batches match)
reads the file of each step, checks that it holds exactly this step's prompts (a log that
does not match fails with a clear error), re-verifies every stored response with the
receiver's own verifier, and applies GRAFT's one-direction selection (no balancing),
compatibility weighting and peer-token update (``salvage.modules.graft.transplant``).
The partner model is never loaded. The receiver's ``GRPOModule`` trains on the result.
Every step's transfers go into the run's ``exchange.jsonl`` as GRAFT's do (``transfers``
``{"stored_to_self": prompts}``, ``weights``, and a ``responses`` row per transferred
response: ``core.exchange.transfer_rows``), so ``salvage report`` reads them alike.

A stored log is data from elsewhere, so it is checked before use: a file that is not JSON
or not a step record, a prompt whose answer differs from the receiver's task, and a
response whose log-probs are missing, empty, not finite or outside
``[LOGPROB_MIN, LOGPROB_MAX]`` are refused with a ``DataError`` naming the file (rather
than an overflow in the compatibility weight or a non-finite loss later).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import lightning as L

from salvage.core.exchange import (
    ExchangeRules,
    admission_metrics,
    transfer_rows,
    weight_metrics,
)
from salvage.core.graft import plan_minibatches, select_unidirectional
from salvage.core.grpo import assign_advantages
from salvage.core.seeds import STORED_ADMISSION, step_seed
from salvage.datamodules.base import attached_datamodule
from salvage.datamodules.rlvr import RLVRDataModule
from salvage.distributed import gathered, run_file
from salvage.errors import DataError, MissingFileError
from salvage.io import atomic_write_text
from salvage.modules.graft import transplant
from salvage.modules.grpo import GRPOModule
from salvage.types import Group, RolloutBatch, Trajectory, Turn

# A sampled token had a probability the sampler could represent: in float32 the smallest
# positive probability is ~1.4e-45, so log-probs below ~-104 cannot come from a real
# sample; -200 leaves margin for other precisions. Above 0 only rounding (bf16) is allowed.
LOGPROB_MIN = -200.0
LOGPROB_MAX = 0.01


def check_record(rec: Any, path: Path) -> None:
    """Refuse a stored step record that could not have been written by ``RecordRollouts``."""
    if not isinstance(rec, dict) or not isinstance(rec.get("prompts"), list):
        raise DataError(f"StoredPeer: {path} is not a step record (no list of prompts)")
    temp = rec.get("temperature", 1.0)
    if not isinstance(temp, (int, float)) or not math.isfinite(temp) or temp <= 0:
        raise DataError(f"StoredPeer: {path}: temperature {temp!r} must be a number > 0")
    for p in rec["prompts"]:
        if (
            not isinstance(p, dict)
            or "task_id" not in p
            or not isinstance(p.get("responses"), list)
        ):
            raise DataError(f"StoredPeer: {path}: a prompt entry lacks task_id or responses")
        for j, r in enumerate(p["responses"]):
            where = f"StoredPeer: {path}: task {p['task_id']!r} response {j}"
            if not isinstance(r, dict) or not isinstance(r.get("text"), str):
                raise DataError(f"{where} has no text")
            lps = r.get("logprobs")
            if not isinstance(lps, list) or not lps:
                raise DataError(f"{where}: log-probs are missing or empty")
            for k, x in enumerate(lps):
                bad = (
                    isinstance(x, bool)
                    or not isinstance(x, (int, float))
                    or not math.isfinite(x)
                    or not LOGPROB_MIN <= x <= LOGPROB_MAX
                )
                if bad:
                    raise DataError(
                        f"{where}: log-prob {k} is {x!r} (a sampled token's log-prob is a finite "
                        f"number in [{LOGPROB_MIN:g}, 0])"
                    )


class RecordRollouts(L.Callback):
    """Writes every update's prompts, responses, generation log-probs and rewards.

    Args:
        dirpath: where the step files go (default: ``<run dir>/rollouts``).
    """

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath

    def _dir(self, trainer: L.Trainer) -> Path:
        return Path(self.dirpath or Path(trainer.default_root_dir) / "rollouts")

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not isinstance(batch, RolloutBatch) or trainer.global_rank != 0:
            return
        rec = {
            "step": trainer.global_step,
            "temperature": batch.temperature,
            "prompts": [
                {
                    "task_id": g.task_id,
                    "answer": g.task.get("answer"),
                    "responses": [
                        {
                            "text": t.turns[0].response_text,
                            "logprobs": list(t.turns[0].logprobs),
                            "finish_reason": t.turns[0].finish_reason,
                            "reward": t.reward,
                        }
                        for t in g.trajectories
                    ],
                }
                for g in batch.groups
            ],
        }
        atomic_write_text(
            self._dir(trainer) / f"step_{trainer.global_step:06d}.json", json.dumps(rec)
        )


class StoredPeer(L.Callback):
    """Receive a recorded partner run's groups (GRAFT stored mode, one direction).

    Args:
        dirpath: the partner's ``rollouts`` directory.
        delta: compatibility gate threshold: a peer response counts only if ``s > delta``.
        gate: apply the gate (False: every peer response weighs 1).
        floor: zero the weights under the gate (False: w = min(s, 1) for every response).
        peer_filter: ``all`` (the partner's full group) or ``success`` (its successes only).
        admission: ``compat`` (compatibility weights) or ``random`` (random admission).
        seed: seed of the random admission stream.
    """

    def __init__(
        self,
        dirpath: str,
        delta: float = 0.8,
        gate: bool = True,
        floor: bool = True,
        peer_filter: str = "all",
        admission: str = "compat",
        seed: int = 0,
    ) -> None:
        if not 0 < delta <= 1:
            raise ValueError(f"StoredPeer delta={delta!r} must be in (0, 1]")
        self.dirpath = Path(dirpath)
        self.rules = ExchangeRules(
            delta=delta, gate=gate, floor=floor, peer_filter=peer_filter, admission=admission
        )
        self.seed = seed
        self.transferred = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and not self.dirpath.is_dir():
            raise MissingFileError(
                f"StoredPeer dirpath {str(self.dirpath)!r} is not a directory of recorded steps"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"transferred": self.transferred}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.transferred = int(state_dict["transferred"])

    def load(self, step: int) -> dict[str, Any]:
        path = self.dirpath / f"step_{step:06d}.json"
        if not path.exists():
            raise MissingFileError(f"StoredPeer: no recorded rollouts for step {step} ({path})")
        try:
            rec = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"StoredPeer: {path} is not a JSON step record ({e})") from None
        check_record(rec, path)
        return rec

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not isinstance(batch, RolloutBatch):
            return
        step = trainer.global_step
        rec = self.load(step)
        stored = {p["task_id"]: p for p in rec["prompts"]}
        mine = [g.task_id for g in batch.groups]
        if set(stored) != set(mine):
            raise DataError(
                f"StoredPeer: the log of step {step} ({self.dirpath / f'step_{step:06d}.json'}) "
                f"holds prompts {sorted(stored)[:4]}... but this step's batch "
                f"is {sorted(mine)[:4]}...: the runs differ (data, seed or prompts_per_step)"
            )
        dm = attached_datamodule(trainer, RLVRDataModule)
        if not isinstance(pl_module, GRPOModule):
            raise TypeError(f"StoredPeer trains a GRPOModule, got {type(pl_module).__name__}")
        peer_groups = [self._peer_group(g, stored[g.task_id], dm, step) for g in batch.groups]
        n = max(len(g.trajectories) for g in batch.groups)
        k_recv = [sum(g.successes) for g in batch.groups]
        k_src = [sum(g.successes) for g in peer_groups]
        prompts = select_unidirectional(k_recv, k_src, n)
        with gathered(pl_module.policy):
            weights = transplant(
                RolloutBatch(groups=peer_groups, temperature=rec.get("temperature", 1.0)),
                batch,
                prompts,
                pl_module,
                self.rules,
                random.Random(step_seed(self.seed, step, STORED_ADMISSION)),
            )
        self.transferred += len(prompts)
        rows = self._write_exchange(trainer, step, batch, prompts, weights)
        batch.minibatch_groups = plan_minibatches(
            [g.peer for g in batch.groups],
            "peer-last",
            pl_module.hparams.num_minibatches,
            random.Random(0),
        )
        pl_module.record(
            {
                "graft/transferred_stored": float(len(prompts)),
                "graft/transferred_stored_cum": float(self.transferred),
            }
            | weight_metrics(weights)
            | admission_metrics(rows)
        )

    def _peer_group(self, g: Group, p: dict[str, Any], dm: RLVRDataModule, step: int) -> Group:
        """The stored responses to ``g``'s prompt, re-verified by this run, with advantages."""
        if p.get("answer") is not None and str(p["answer"]) != str(g.task["answer"]):
            raise DataError(
                f"StoredPeer: the log of step {step} ({self.dirpath / f'step_{step:06d}.json'}) "
                f"has answer {p['answer']!r} for task "
                f"{g.task_id!r}, this run {g.task['answer']!r}: the runs differ (data)"
            )
        trajs = []
        for r in p["responses"]:
            res = dm.reward_fn(r["text"], g.task["answer"])  # re-verified, never trusted
            trajs.append(
                Trajectory(
                    turns=[
                        Turn(
                            [],
                            [],
                            list(r["logprobs"]),
                            response_text=r["text"],
                            finish_reason=r["finish_reason"],
                        )
                    ],
                    reward=res.reward,
                    success=res.success,
                    source="stored",
                )
            )
        pg = Group(task_id=g.task_id, trajectories=trajs, task=g.task)
        assign_advantages(pg, dm.advantage, dm.adv_eps, dm.reward_tol, dm.adv_tol)
        return pg

    def _write_exchange(
        self,
        trainer: L.Trainer,
        step: int,
        batch: RolloutBatch,
        prompts: list[int],
        weights: list[float],
    ) -> list[dict[str, Any]]:
        """Append the step's transfers to the run's ``exchange.jsonl`` (as GRAFT's); its
        per-response rows."""
        rows = transfer_rows(batch.groups, prompts, "stored", "self", step)
        record = {
            "step": step,
            "transfers": {"stored_to_self": prompts},
            "weights": weights,
            "delta": self.rules.delta,
            "gate": self.rules.gate,
            "responses": rows,
        }
        with run_file(trainer, "exchange").open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        return rows
