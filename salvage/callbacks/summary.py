"""Prints a short table at the end of ``fit``: first vs last value of the key metrics."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_only

from salvage.types import Learner

DEFAULT_KEYS = (
    "rollout/reward_mean",
    "rollout/success_rate",
    "rollout/zero_signal_frac",
    "rollout/response_len",
    "a/rollout/success_rate",
    "b/rollout/success_rate",
    "c/rollout/success_rate",
    "graft/transferred",
    "graft/transferred_a_to_b",
    "graft/transferred_b_to_a",
    "graft/weight_mean",
    "relay/zero_signal_groups_cum",
    "relay/selected_cum",
    "relay/recoveries_cum",
    "relay/retained_cum",
    "relay/teacher_frac",
    "relay/pooled_reduction",
    "cost/extra_token_ratio",
    "perf/step_s",
    "cost/gpu_hours",
)


class RunSummary(L.Callback):
    """Collects the value of ``keys`` logged at every step; prints first / last / mean.

    Keys a run does not log (e.g. ``relay/*`` without a rescue stage) are left out.
    ``*_cum`` and ``cost/*`` are cumulative: their "last" is the run total.

    Args:
        keys: the metrics to show (None: a default list of the key metrics).
    """

    def __init__(self, keys: list[str] | None = None) -> None:
        self.keys = list(keys or DEFAULT_KEYS)
        self.history: dict[str, list[float]] = {k: [] for k in self.keys}

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any
    ) -> None:
        logged = pl_module.step_values() if isinstance(pl_module, Learner) else {}
        m = logged if logged else trainer.callback_metrics
        for k in self.keys:
            if k in m:
                self.history[k].append(float(m[k]))

    def rows(self) -> list[tuple[str, float, float, float]]:
        """(metric, first, last, mean) of every key the run logged, in ``keys`` order."""
        return [(k, v[0], v[-1], sum(v) / len(v)) for k, v in self.history.items() if v]

    @rank_zero_only
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"salvage run summary ({trainer.global_step} updates)")
        for col in ("metric", "first", "last", "mean"):
            table.add_column(col, justify="right" if col != "metric" else "left")
        for k, first, last, mean in self.rows():
            table.add_row(k, f"{first:.4g}", f"{last:.4g}", f"{mean:.4g}")
        console = Console()
        console.print(table)
        for cb in trainer.callbacks:  # type: ignore[attr-defined]  # stages that name themselves (e.g. the VH-GPO teacher)
            describe = getattr(cb, "describe", None)
            if callable(describe):
                console.print(describe(), soft_wrap=True, markup=False)
