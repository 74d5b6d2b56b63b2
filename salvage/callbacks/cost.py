"""Cost accounting: per-step wall time and GPU-hours (SPEC §3.4).

``cost/gpu_hours`` = devices x summed per-step wall time / 3600. A step is timed from the
start of its rollout (recorded by the datamodule in ``batch.stats["t_start"]``) to the
end of its update, so validation and checkpoint writing (which run after
``on_train_batch_end`` of this callback, or outside the step) are excluded. On CPU it
counts device-hours the same way. The cumulative totals are saved in checkpoints.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L

from salvage.types import RolloutBatch


class CostTracker(L.Callback):
    """Logs ``perf/step_s``, ``cost/gpu_hours``, ``cost/wall_s`` and ``cost/time_*`` stages."""

    def __init__(self) -> None:
        self.total_step_s = 0.0
        self.steps = 0

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not isinstance(batch, RolloutBatch) or "t_start" not in batch.stats:
            return
        step_s = time.perf_counter() - batch.stats["t_start"]
        self.total_step_s += step_s
        self.steps += 1
        devices = max(1, trainer.world_size)
        values = {
            "perf/step_s": step_s,
            "cost/wall_s": self.total_step_s,
            "cost/gpu_hours": devices * self.total_step_s / 3600.0,
        }
        for k, v in batch.stats.items():
            if k.startswith("time_"):
                values[f"cost/{k}"] = float(v)
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
