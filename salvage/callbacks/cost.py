"""Cost accounting: per-step wall time and GPU-hours (SPEC §3.4).

``cost/gpu_hours`` = devices x summed per-step wall time / 3600. A step is timed from the
start of its rollout (recorded by the datamodule in ``batch.stats.t_start``) to the
end of its update, so validation and checkpoint writing (which run after
``on_train_batch_end`` of this callback, or outside the step) are excluded. On CPU it
counts device-hours the same way. The cumulative totals are saved in checkpoints.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L

from salvage.types import PairedLearner, RolloutBatch


class CostTracker(L.Callback):
    """Logs ``perf/step_s``, ``cost/gpu_hours``, ``cost/wall_s`` and ``cost/time_*`` stages."""

    def __init__(self) -> None:
        self.total_step_s = 0.0
        self.steps = 0

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not isinstance(batch, RolloutBatch) or batch.stats.t_start is None:
            return
        step_s = time.perf_counter() - batch.stats.t_start
        self.total_step_s += step_s
        self.steps += 1
        devices = max(1, trainer.world_size)
        values = {
            "perf/step_s": step_s,
            "cost/wall_s": self.total_step_s,
            "cost/gpu_hours": devices * self.total_step_s / 3600.0,
        }
        for k, v in batch.stats.timings().items():
            values[f"cost/{k}"] = v
        record = getattr(pl_module, "record", None)
        if record is not None:
            record(values)
        else:
            pl_module.log_dict(values, on_step=True, on_epoch=False)

    def state_dict(self) -> dict[str, Any]:
        return {"total_step_s": self.total_step_s, "steps": self.steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.total_step_s = float(state_dict["total_step_s"])
        self.steps = int(state_dict["steps"])


def checkpoint_costs(best: dict[str, tuple[float, int, float]]) -> dict[str, float]:
    """SPEC §3.4 cost of the selected checkpoints.

    ``best``: per model, (best score, its step, cumulative GPU-hours at that step). Each
    model's checkpoint costs the GPU-hours through its own best step; a joint run (GRAFT)
    costs the GPU-hours through the later of the two selected checkpoints (the run had to
    reach both), i.e. the larger cumulative cost.
    """
    out = {f"cost/ckpt_gpu_hours/{name}": hours for name, (_, _, hours) in best.items()}
    if best:
        out["cost/joint_ckpt_gpu_hours"] = max(hours for _, _, hours in best.values())
        out["cost/joint_ckpt_step"] = float(max(step for _, step, _ in best.values()))
    return out


class CheckpointCost(L.Callback):
    """Tracks each model's best validation score and the GPU-hours spent to reach it (SPEC §3.4).

    Monitors ``val/aggregate`` (GRAFT: ``a/val/aggregate`` and ``b/val/aggregate``) after
    every validation; logs ``cost/ckpt_gpu_hours/<model>`` and ``cost/joint_ckpt_gpu_hours``;
    the state travels in checkpoints, and ``salvage test`` prints the table.
    """

    def __init__(self) -> None:
        self.best: dict[str, tuple[float, int, float]] = {}

    @staticmethod
    def keys(pl_module: L.LightningModule) -> dict[str, str]:
        if isinstance(pl_module, PairedLearner):  # GRAFT: each model's score
            return {n: f"{n}/val/aggregate" for n in pl_module.names}
        return {"policy": "val/aggregate"}

    @staticmethod
    def _hours(trainer: L.Trainer) -> float:
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # attached by Lightning
        cost = next((c for c in callbacks if isinstance(c, CostTracker)), None)
        return max(1, trainer.world_size) * (cost.total_step_s if cost else 0.0) / 3600.0

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        m = trainer.callback_metrics
        changed = False
        for name, key in self.keys(pl_module).items():
            if key not in m:
                continue
            score = float(m[key])
            if name not in self.best or score > self.best[name][0]:
                self.best[name] = (score, trainer.global_step, self._hours(trainer))
                changed = True
        if changed:
            for lg in trainer.loggers:  # at the step the validation belongs to
                lg.log_metrics(checkpoint_costs(self.best), step=max(0, trainer.global_step - 1))

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        from rich.console import Console
        from rich.table import Table

        table = Table(title="checkpoint cost (SPEC 3.4: GPU-hours through the selected checkpoint)")
        for col in ("model", "best val/aggregate", "step", "GPU-hours"):
            table.add_column(col, justify="left" if col == "model" else "right")
        if not self.best:
            table.add_row("-", "no validation recorded in this checkpoint", "", "")
        for name, score, step, hours in self.rows():
            table.add_row(name, "" if score is None else f"{score:.4f}", str(step), f"{hours:.4g}")
        Console().print(table)

    def rows(self) -> list[tuple[str, float | None, int, float]]:
        """(model, best score, its step, GPU-hours through it) per model, then the joint cost
        (the later of the two) when there are two models."""
        out: list[tuple[str, float | None, int, float]] = [
            (name, score, step, hours) for name, (score, step, hours) in sorted(self.best.items())
        ]
        if len(self.best) > 1:
            c = checkpoint_costs(self.best)
            out.append(
                (
                    "joint (later of the two)",
                    None,
                    int(c["cost/joint_ckpt_step"]),
                    c["cost/joint_ckpt_gpu_hours"],
                )
            )
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"best": {k: list(v) for k, v in self.best.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = {
            k: (float(v[0]), int(v[1]), float(v[2])) for k, v in state_dict.get("best", {}).items()
        }
