"""What a fit tells its user: the run directory when it starts; at the end, a short table
(first vs last value of the key metrics), then the run directory again and the next commands
with it filled in (report, export, test, W&B)."""

from __future__ import annotations

import os
import shlex
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_only

from salvage.invocation import command
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


def run_dir(trainer: L.Trainer) -> tuple[str, str | None]:
    """(the run directory, its ``version_N``) of a trainer: ``RUN`` and ``version_N`` when the
    logger writes to ``RUN/version_N`` (salvage's CSV logger), else (its log dir, None)."""
    # the first logger's own dir: ``trainer.log_dir`` broadcasts, which rank 0 alone must not
    log_dir = trainer.loggers[0].log_dir if trainer.loggers else None
    if not log_dir:
        return trainer.default_root_dir, None
    head, tail = os.path.split(os.path.normpath(log_dir))
    if tail.startswith("version_"):
        return head, tail
    return log_dir, None


def _quote(path: str) -> str:
    return shlex.quote(str(path))


def _checkpoint(trainer: L.Trainer) -> str | None:
    """The checkpoint this fit wrote last (``last.ckpt`` when kept), if any."""
    for cb in trainer.checkpoint_callbacks:
        for path in (getattr(cb, "last_model_path", ""), getattr(cb, "best_model_path", "")):
            if path and os.path.exists(path):
                return str(path)
    return None


def _policies(pl_module: L.LightningModule) -> list[str]:
    """The ``--policy`` names of a module holding several policies (GRAFT, N peers)."""
    hp = getattr(pl_module, "hparams", {}) or {}
    peers = hp.get("policies")
    if isinstance(peers, list | tuple) and peers:
        return [chr(ord("a") + i) for i in range(len(peers))]
    return ["a", "b"] if "policy_a" in hp else []


def watch_line(trainer: L.Trainer) -> str:
    """How to see this run in W&B: its URL (online), ``wandb sync DIR`` (offline), or how
    to turn W&B on."""
    from salvage.loggers import WandbLogger

    for lg in trainer.loggers:
        if isinstance(lg, WandbLogger) and not lg.failed:
            if lg.run_url:
                return f"W&B: {lg.run_url}"
            if lg.sync_dir:
                return f"W&B (offline; upload it with): wandb sync {_quote(lg.sync_dir)}"
    return "W&B: not logged (add --config configs/logger/wandb.yaml to a fit)"


def handover_lines(trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
    """The run directory and the next commands, with this run's paths filled in."""
    root, version = run_dir(trainer)
    here = os.path.join(root, version) if version else root  # this version's own files
    where = f" ({version})" if version else ""
    lines = [f"salvage: run dir {root}{where}; next:"]
    run = command()  # as this process was started: `salvage` may not be on PATH
    lines.append(f"  {run} report {_quote(root)}")
    ckpt = _checkpoint(trainer)
    if ckpt is None:
        lines.append(
            "  (salvage export / salvage test need a checkpoint: this run kept none, "
            "e.g. trainer.enable_checkpointing is false)"
        )
    else:
        names = _policies(pl_module)
        pick = f" --policy {names[0]}" if names else ""
        out = os.path.join(here, "hf" + (f"_{names[0]}" if names else ""))
        also = f"  (or --policy {', '.join(names[1:])})" if names else ""
        lines.append(f"  {run} export {_quote(ckpt)} {_quote(out)}{pick}{also}")
        config = os.path.join(here, "config.yaml")
        if os.path.exists(config):
            lines.append(f"  {run} test --config {_quote(config)} --ckpt_path {_quote(ckpt)}")
    lines.append(f"  {watch_line(trainer)}")
    return lines


class RunSummary(L.Callback):
    """Collects the value of ``keys`` logged at every step; prints first / last / mean.

    Keys a run does not log (e.g. ``relay/*`` without a rescue stage) are left out.
    ``*_cum`` and ``cost/*`` are cumulative: their "last" is the run total. A fit also prints
    ``salvage: run dir RUN (version_N)`` when it starts and, after the table, the run dir
    and the next commands with its paths filled in (``salvage report``, ``salvage export``,
    ``salvage test``, W&B). Rank 0 only.

    Args:
        keys: the metrics to show (None: a default list of the key metrics).
    """

    def __init__(self, keys: list[str] | None = None) -> None:
        self.keys = list(keys or DEFAULT_KEYS)
        self.history: dict[str, list[float]] = {k: [] for k in self.keys}

    @rank_zero_only
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        root, version = run_dir(trainer)
        print(f"salvage: run dir {root}" + (f" ({version})" if version else ""), flush=True)

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
        print("\n".join(handover_lines(trainer, pl_module)), flush=True)
