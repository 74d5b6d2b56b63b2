"""What a W&B run shows beyond the scalar metrics: tables, report plots, the run summary.

``WandbDashboard`` is always on (``salvage fit``) and does nothing without a W&B logger.
With one (``configs/logger/wandb.yaml``) it logs, on rank 0:

- ``relay/records``: one row per searched VH-GPO group (retained or not, with the reason),
  read from ``relays.jsonl`` (all ranks' files) of this run version as the rescue stage
  appends to it;
- ``graft/exchange``: one row per transferred GRAFT group (prompt, direction, k_A, k_B, the
  peer responses' compatibility weights, how many were admitted), from the update's batch;
- both as incremental W&B tables: each flush logs only the new rows, so a crashed run keeps
  what it logged, and a resume skips the updates the W&B run already holds
  (``salvage.loggers.WandbLogger.logged_through``);
- at the end of ``fit`` and ``test``: the ``salvage report`` plots as images
  (``report/<plot>``, drawn by ``salvage.plots`` into ``RUN/report/``) and ``summary/run``
  (``RunSummary``'s table) as a table and as the run summary keys
  ``run_summary/<metric>/{first,last,mean}``;
- at the end of ``test``: ``eval/table`` (pass@1 per benchmark and model, with the std over
  repeats) and ``cost/checkpoint_table`` (``CheckpointCost``: GPU-hours through each model's
  best validation, and the joint cost of GRAFT's two models).

A W&B error inside any of this prints one warning and turns W&B off; the run goes on.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any

import lightning as L

from salvage.types import PairedBatch

SUMMARY_COLUMNS: list[Any] = ["metric", "first", "last", "mean"]
RELAY_KEY = "relay/records"
EXCHANGE_KEY = "graft/exchange"
RELAY_COLUMNS: list[Any] = [
    "update",
    "task",
    "family",
    "retained",
    "reason",
    "teacher",
    "anchor",
    "L",
    "j_star",
    "j_early",
    "R",
    "teacher_frac",
    "teacher_attempts",
    "tokens_teacher",
    "tokens_search",
    "tokens_confirm",
]
EXCHANGE_COLUMNS: list[Any] = [
    "update",
    "prompt",
    "task",
    "direction",
    "k_A",
    "k_B",
    "peer_responses",
    "weights",
    "weight_mean",
    "admitted",
]


def relay_row(rec: dict[str, Any]) -> list[Any]:
    """One ``relays.jsonl`` record as a ``relay/records`` row."""
    tokens = rec.get("tokens") or {}

    def num(v: Any) -> float | None:
        return None if v is None else float(v)

    return [
        int(rec.get("step", -1)),
        str(rec.get("task")),
        None if rec.get("family") is None else str(rec["family"]),
        bool(rec.get("retained")),
        None if rec.get("reason") is None else str(rec["reason"]),
        None if rec.get("teacher") is None else str(rec["teacher"]),
        num(rec.get("anchor")),
        num(rec.get("L")),
        num(rec.get("j_star")),
        num(rec.get("j_early")),
        num(rec.get("R")),
        num(rec.get("teacher_frac")),
        num(rec.get("teacher_attempts")),
        num(tokens.get("teacher")),
        num(tokens.get("search")),
        num(tokens.get("confirm")),
    ]


def exchange_rows(batch: Any, step: int) -> list[list[Any]]:
    """One ``graft/exchange`` row per group a GRAFT update transferred (both directions).

    A receiver's transferred group is marked ``peer``; k_A and k_B are the successes of each
    model's own group on that prompt (``own_groups``: before the exchange replaced any).
    """
    if not isinstance(batch, PairedBatch):
        return []
    ra, rb = batch.a, batch.b
    own = {
        n: r.own_groups if r.own_groups is not None else r.groups for n, r in batch.parts().items()
    }
    rows = []
    for direction, receiver in (("a_to_b", rb), ("b_to_a", ra)):
        for q, g in enumerate(receiver.groups):
            if not g.peer:
                continue
            peers = [t for t in g.trajectories if t.source == "peer"]
            w = [float(t.weight) for t in peers]
            rows.append(
                [
                    step,
                    q,
                    str(g.task_id),
                    direction,
                    sum(own["a"][q].successes),
                    sum(own["b"][q].successes),
                    len(peers),
                    " ".join(f"{x:.3f}" for x in w),
                    sum(w) / len(w) if w else None,
                    sum(x > 0 for x in w),
                ]
            )
    return rows


_EVAL = re.compile(r"^(?:(?P<model>[a-z])/)?eval/(?:success/(?P<bench>.+)|(?P<agg>aggregate))$")


def eval_rows(metrics: dict[str, float]) -> list[list[Any]]:
    """``eval/table`` rows (model, benchmark, pass@1, std over repeats) from the test metrics.

    Per benchmark ``[a/|b/]eval/success/<bench>`` and the unweighted mean ``eval/aggregate``;
    without benchmarks (one family), the overall ``eval/success``.
    """
    rows = []
    for key in sorted(metrics):
        m = _EVAL.match(key)
        if not m or key.endswith("_std"):
            continue
        bench = m["bench"] or "aggregate"
        std = metrics.get(f"{key}_std")
        rows.append([m["model"] or "policy", bench, float(metrics[key]), std])
    if not rows:
        for model in ("", *(f"{n}/" for n in "abcdefgh")):
            if f"{model}eval/success" in metrics:
                rows.append(
                    [model[:-1] or "policy", "all", float(metrics[f"{model}eval/success"]), None]
                )
    return rows


def _incremental_table(columns: list[Any]) -> Any:
    """An empty W&B table that logs only its new rows each time (None: W&B too old)."""
    import wandb

    try:
        return wandb.Table(columns=columns, log_mode="INCREMENTAL", allow_mixed_types=True)
    except (AssertionError, TypeError, ValueError):
        return None


class WandbDashboard(L.Callback):
    """Tables, report plots and the run summary of a run into its W&B logger (if any).

    Args:
        tables: log ``relay/records`` and ``graft/exchange``.
        report: log the ``salvage report`` plots at the end of ``fit`` and ``test``.
        table_every: updates between two table flushes (None: the fewest that keep a fit
            within 100 flushes, W&B shows the latest 100 increments of a table; at least 1).
    """

    def __init__(
        self, tables: bool = True, report: bool = True, table_every: int | None = None
    ) -> None:
        if table_every is not None and table_every < 1:
            raise ValueError(f"WandbDashboard.table_every must be >= 1, got {table_every}")
        self.tables = tables
        self.report = report
        self.table_every = table_every
        self._loggers: list[Any] = []
        self._offsets: dict[str, int] = {}
        self._pending: dict[str, list[list[Any]]] = {RELAY_KEY: [], EXCHANGE_KEY: []}
        self._tables: dict[str, Any] = {}
        self._every = 1
        self._since_flush = 0
        self._warned = False
        self._dir = Path(".")

    # -- plumbing ------------------------------------------------------------------------
    def _active(self, trainer: L.Trainer) -> bool:
        """Rank 0 with a W&B logger that has not failed."""
        live = [lg for lg in self._loggers if not getattr(lg, "failed", False)]
        return bool(live) and trainer.global_rank == 0

    def _fail(self, lg: Any, where: str, exc: BaseException) -> None:
        fail = getattr(lg, "fail", None)
        if callable(fail):  # salvage's WandbLogger: one warning, W&B off
            fail(where, exc)
            return
        if not self._warned:
            print(
                f"salvage: warning: W&B failed {where} ({type(exc).__name__}: {exc}); "
                "the run continues, metrics stay in the CSV logger's metrics.csv",
                file=sys.stderr,
                flush=True,
            )
        self._warned = True
        self._loggers = [x for x in self._loggers if x is not lg]

    def _each(self, where: str, fn: Any) -> None:
        for lg in list(self._loggers):
            if getattr(lg, "failed", False):
                continue
            try:
                fn(lg)
            except Exception as e:  # noqa: BLE001 - W&B is never required for a run
                self._fail(lg, where, e)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from lightning.pytorch.loggers import WandbLogger

        self._loggers = [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]
        self._tables, self._offsets, self._since_flush = {}, {}, 0  # a new stage, a new W&B run
        self._pending = {RELAY_KEY: [], EXCHANGE_KEY: []}
        if self._loggers:  # every rank: trainer.log_dir is a collective
            self._dir = Path(trainer.log_dir or trainer.default_root_dir)
        if self.table_every is not None:
            self._every = self.table_every
        else:
            max_steps = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else 0
            self._every = max(1, math.ceil(max_steps / 100))

    # -- tables --------------------------------------------------------------------------
    def _new_relay_records(self, trainer: L.Trainer) -> list[dict[str, Any]]:
        import json

        out = []
        for path in sorted(self._dir.glob("relays*.jsonl")):
            start = self._offsets.get(str(path), 0)
            with path.open("rb") as f:
                f.seek(start)
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line being written is read next time
            self._offsets[str(path)] = start + end
            for line in data[:end].decode("utf-8").splitlines():
                if line.strip():
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue
        return out

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if not self.tables or not self._active(trainer):
            return
        step = trainer.global_step - 1  # the update just done (the metrics' step)
        self._pending[RELAY_KEY] += [relay_row(r) for r in self._new_relay_records(trainer)]
        self._pending[EXCHANGE_KEY] += exchange_rows(batch, step)
        self._since_flush += 1
        if self._since_flush >= self._every:
            self.flush(step)

    def flush(self, step: int) -> None:
        """Log the pending rows of each table as one increment (rows of updates the W&B run
        already holds, after a resume, are dropped)."""
        import wandb

        self._since_flush = 0
        for key, columns in ((RELAY_KEY, RELAY_COLUMNS), (EXCHANGE_KEY, EXCHANGE_COLUMNS)):
            rows, self._pending[key] = self._pending[key], []
            if not rows:
                continue

            def log(lg: Any, key: str = key, columns: list[Any] = columns, rows=rows) -> None:
                done = lg.logged_through(key) if hasattr(lg, "logged_through") else -1
                new = [r for r in rows if r[0] > done]
                if not new:
                    return
                table = self._tables.get(key)
                if table is None:
                    table = _incremental_table(columns)
                    if table is None:  # a W&B without incremental tables: each flush its own
                        table = wandb.Table(columns=columns, allow_mixed_types=True)
                    else:
                        self._tables[key] = table
                for r in new:
                    table.add_data(*r)
                lg.log_metrics({key: table}, step=step)
                if hasattr(lg, "mark_logged"):
                    lg.mark_logged(key, max(r[0] for r in new))

            self._each(f"while logging the {key} table", log)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        """A crashing fit still sends the rows it has (they are in the jsonl files too)."""
        if self.tables and self._active(trainer) and trainer.state.fn == "fit":
            self.flush(max(0, trainer.global_step - 1))

    # -- end of a stage ------------------------------------------------------------------
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._active(trainer):
            return
        step = max(0, trainer.global_step - 1)
        if self.tables:
            self.flush(step)
        self._log_summary(trainer, step)
        self._log_report(trainer, step)

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._active(trainer):
            return
        import wandb

        step = trainer.global_step
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        rows = eval_rows(metrics)
        if rows:
            cols: list[Any] = ["model", "benchmark", "pass@1", "std"]
            self._each(
                "while logging the evaluation table",
                lambda lg: lg.log_metrics({"eval/table": wandb.Table(cols, rows)}, step=step),
            )
        from salvage.callbacks.cost import CheckpointCost

        cost = next((c for c in _callbacks(trainer) if isinstance(c, CheckpointCost)), None)
        if cost is not None and cost.best:
            cost_cols: list[Any] = ["model", "best val/aggregate", "step", "GPU-hours"]
            crow = cost.rows()
            self._each(
                "while logging the checkpoint-cost table",
                lambda lg: lg.log_metrics(
                    {"cost/checkpoint_table": wandb.Table(cost_cols, crow)}, step=step
                ),
            )
        self._log_report(trainer, step, of_this_version=False)

    def _log_summary(self, trainer: L.Trainer, step: int) -> None:
        import wandb

        from salvage.callbacks.summary import RunSummary

        summary = next((c for c in _callbacks(trainer) if isinstance(c, RunSummary)), None)
        rows = summary.rows() if summary is not None else []
        if not rows:
            return
        values: dict[str, Any] = {"run_summary/updates": trainer.global_step}
        for k, first, last, mean in rows:
            values.update(
                {f"run_summary/{k}/first": first, f"run_summary/{k}/last": last}
                | {f"run_summary/{k}/mean": mean}
            )
        table = [list(r) for r in rows]

        def log(lg: Any) -> None:
            lg.log_metrics({"summary/run": wandb.Table(SUMMARY_COLUMNS, table)}, step=step)
            if hasattr(lg, "update_summary"):
                lg.update_summary(values)
            else:
                lg.experiment.summary.update(values)

        self._each("while logging the run summary", log)

    def _log_report(self, trainer: L.Trainer, step: int, of_this_version: bool = True) -> None:
        """The run report's plots as W&B images: of this logger version's lineage at the end
        of a fit; at the end of ``salvage test`` (a version of its own, which a report leaves
        out of the fit history) of the run's newest fit lineage."""
        if not self.report:
            return
        from lightning.pytorch.loggers import CSVLogger

        from salvage.plots import plot_run

        csvs = [lg for lg in trainer.loggers if isinstance(lg, CSVLogger)]
        for lg in csvs:  # the plots read metrics.csv: write what is buffered
            lg.save()
        version = csvs[0].version if csvs and of_this_version else None
        try:
            res = plot_run(trainer.default_root_dir, version if isinstance(version, int) else None)
        except Exception as e:  # noqa: BLE001 - a plot never ends a run
            print(f"salvage: warning: no report plots for W&B: {e}", file=sys.stderr)
            return
        out = res.dir
        pngs = [n for n in res.written if n.endswith(".png")]
        if not pngs:
            return

        def log(lg: Any) -> None:
            for name in pngs:
                lg.log_image(
                    f"report/{Path(name).stem}", [str(out / name)], step=step, caption=[name]
                )

        self._each("while logging the report plots", log)


def _callbacks(trainer: L.Trainer) -> list[Any]:
    """The trainer's callbacks (an attribute Lightning attaches at run time)."""
    return list(trainer.callbacks)  # type: ignore[attr-defined]
