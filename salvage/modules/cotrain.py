"""CoTrainModule: the Lightning shell of modules that co-train several policies (GRAFT's
two, ``PeerGroupModule``'s N): the policies by name (each a ``GRPOModule`` with its own
optimiser), their models, per-update step metrics, the exchange records
(``exchange.jsonl``) and per-model evaluation metrics.

The exchange and the update are the subclass's (``salvage.modules.graft``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import torch
from lightning.fabric.utilities.data import AttributeDict

from salvage.core.evaluation import repeat_metrics
from salvage.distributed import gather_objects, merge_eval_records, run_file, to_device
from salvage.modules.grpo import GRPOModule
from salvage.modules.reporting import StepLog
from salvage.types import PairedBatch

NAMES = tuple("abcdefghijklmnopqrstuvwxyz")
"""Model names in order: GRAFT's two are ``a`` and ``b``; further peers ``c``, ``d``, ..."""


def _refuse_plain_ddp(trainer: Any) -> None:
    """Co-training on DDP without ``find_unused_parameters``: each model's backward leaves the
    other's parameters unused, which plain DDP refuses at the first backward. Refused here,
    before any model is built, naming the switch (measured: 2 processes, gloo). With
    ``find_unused_parameters`` DDP trains it, to the one-process step (tests/test_fsdp.py)."""
    from lightning.pytorch.strategies import DDPStrategy

    strategy = getattr(trainer, "strategy", None)
    if isinstance(strategy, DDPStrategy) and not strategy._ddp_kwargs.get("find_unused_parameters"):
        from salvage.errors import ConfigError

        raise ConfigError(
            "trainer.strategy: ddp cannot train co-trained models (GRAFT, peers): each model's "
            "backward leaves the other's parameters unused, which DDP refuses; use FSDP2 "
            "(--config configs/trainer/fsdp.yaml, what the GRAFT configs use) or "
            "--trainer.strategy ddp_find_unused_parameters_true"
        )


class CoTrainModule(StepLog):
    """Policies ``a``, ``b`` (and further peers) trained side by side, one optimiser each."""

    a: GRPOModule
    b: GRPOModule
    _records: Path | None

    @property
    def hparams(self) -> AttributeDict:
        """The saved hyper-parameters (attribute access)."""
        return cast(AttributeDict, super().hparams)

    @property
    def names(self) -> tuple[str, ...]:
        """The models' names, in model order."""
        return NAMES[:2]

    def learner(self, name: str) -> GRPOModule:
        """The model ``name`` (one of ``names``)."""
        if name not in self.names:
            raise KeyError(f"no model {name!r} in this module (models: {', '.join(self.names)})")
        return cast(GRPOModule, getattr(self, name))

    def learners(self) -> list[GRPOModule]:
        """Every model, in order."""
        return [self.learner(n) for n in self.names]

    @property
    def tokenizer(self) -> Any:  # the datamodule's default (A's); GRAFT passes each explicitly
        return self.a.tokenizer

    @property
    def policy(self) -> torch.nn.Module | None:
        return self.a.policy

    def configure_model(self) -> None:
        _refuse_plain_ddp(self._trainer)
        mesh = self.a.mesh_of(self.device_mesh)
        for child in self.learners():  # every policy sharded on the strategy's one mesh
            child.build(mesh)

    def inference_models(self) -> list[torch.nn.Module]:
        return [m for lr in self.learners() for m in lr.inference_models()]

    def sampling_models(self) -> list[torch.nn.Module]:
        return [m for lr in self.learners() for m in lr.sampling_models()]

    def configure_optimizers(self) -> Any:
        return [lr.configure_optimizers() for lr in self.learners()]

    def on_fit_start(self) -> None:
        self._records = run_file(
            self.trainer, "exchange"
        )  # on every rank (log_dir is a collective)
        for lr in self.learners():
            lr.total_steps_hint = self.trainer.max_steps if self.trainer.max_steps > 0 else None
            if lr.ref_model is not None:  # an offloaded reference keeps its shards on the CPU
                to_device(lr.ref_model, self.device)

    def _write(self, rec: dict[str, Any]) -> None:
        if self._records is None:
            self._records = run_file(self.trainer, "exchange")
        with self._records.open("a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")

    # ------------------------------------------------------------------ eval
    def on_validation_epoch_start(self) -> None:
        # per model, one record per evaluated problem: (repeat, benchmark, task, successes, samples)
        self._eval_acc: dict[str, list[tuple[int, str, str, float, float]]] = {
            n: [] for n in self.names
        }

    on_test_epoch_start = on_validation_epoch_start

    def validation_step(self, batch: PairedBatch, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: PairedBatch, batch_idx: int) -> None:
        self._eval_step(batch, "eval")

    def _eval_step(self, batch: PairedBatch, prefix: str) -> None:
        for name, part in batch.parts().items():
            recs = self._eval_acc[name]
            for g in part.groups:
                recs.append(
                    (
                        int(g.task.get("repeat", 0)),
                        str(g.task.get("family", "all")),
                        str(g.task_id),
                        float(sum(t.success for t in g.trajectories)),
                        float(len(g.trajectories)),
                    )
                )

    def _eval_end(self, prefix: str) -> None:
        """Per model, pass@1 per benchmark and the aggregate over the problems of all ranks
        (every rank logs the same global numbers: checkpoint selection and CheckpointCost
        see the whole evaluation, not one rank's share)."""
        for name in self.names:
            mine = getattr(self, "_eval_acc", {}).get(name, [])
            acc = merge_eval_records(gather_objects(mine))  # a collective: every rank
            if not acc:
                continue
            values = repeat_metrics(f"{name}/{prefix}", acc)
            if len({r for r, _ in acc}) == 1:  # one run: pass@1 per benchmark and the aggregate
                values = {
                    k: v for k, v in values.items() if "/repeat_" not in k and "_std" not in k
                }
            for k, v in values.items():
                self.log(k, v, on_epoch=True, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        self._eval_end("val")

    def on_test_epoch_end(self) -> None:
        self._eval_end("eval")
