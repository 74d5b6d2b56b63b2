"""salvage's loggers: a crash-safe CSV logger and a W&B logger that cannot end a run.

``SafeCSVLogger``: a CSV logger whose file survives a crash at any moment.

Lightning's CSV writer appends rows, but rewrites the whole ``metrics.csv`` in place when a
new metric name appears (e.g. ``relay/*`` on the first rescue): a crash during that
rewrite would lose every logged step. ``SafeCSVLogger`` writes the new file beside the old
one and renames it over (atomic on POSIX), so the previous file stays intact.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from lightning.fabric.loggers.logger import _DummyExperiment as DummyExperiment
from lightning.fabric.utilities.logger import _add_prefix
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers import WandbLogger as _LightningWandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only

from salvage.io import atomic_write_text


class _AtomicWriter(ExperimentWriter):
    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        path = self.metrics_file_path
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        buf = io.StringIO(newline="")
        w = csv.DictWriter(buf, fieldnames=fieldnames)
        w.writeheader()
        w.writerows(rows)
        atomic_write_text(path, buf.getvalue(), newline="")


class SafeCSVLogger(CSVLogger):
    """``CSVLogger`` with an atomic header rewrite (local paths)."""

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AtomicWriter(log_dir=self.log_dir)
        return self._experiment


# ----------------------------------------------------------------------------- W&B
_RUN_FILE = "wandb_run.json"


class WandbLogger(_LightningWandbLogger):
    """Lightning's ``WandbLogger`` with salvage's conventions; a W&B failure never ends a run.

    - x-axis: every metric is plotted against ``update`` (the RL update index that salvage
      passes as the step, ``define_metric("*", step_metric="update")``); names keep their
      namespaces (``rollout/``, ``loss/``, ``relay/``, ``graft/``, ``cost/``, ``eval/``,
      ``a/``, ``b/``), which W&B shows as sections.
    - where: ``salvage fit|test`` writes ``wandb/`` into the run directory
      (``RUN/version_N``, beside ``metrics.csv`` and ``config.yaml``); artifact staging
      (``WANDB_DATA_DIR``, unless set) goes to ``RUN/version_N/wandb/data``. ``save_dir``
      other than ``.`` (Lightning's default) writes elsewhere.
    - resume: a run resumed from a checkpoint of ``RUN/version_N`` continues that version's
      W&B run (its id is kept in ``RUN/version_N/wandb_run.json``, with the last update of
      each incremental table already logged, so a resume never logs a row twice).
    - failure: an error of W&B (at start or in any later call) prints one warning and turns
      this logger off; the run continues and the CSV logger keeps every metric.
    - the whole resolved run config is logged as the W&B config key ``salvage``.

    Args:
        save_dir: where W&B writes ``wandb/`` (None or ``.``: the run directory).
        group: W&B group (default: ``WANDB_RUN_GROUP``; ``salvage study`` sets the study name).
        job_type: W&B job type (default: ``WANDB_JOB_TYPE``; ``salvage study``: the method).
        tags: W&B tags of the run.
        notes: W&B notes of the run.
        **kwargs: the other arguments of Lightning's ``WandbLogger`` (``project``, ``name``,
            ``id``, ``offline``, ``log_model``, ...) and of ``wandb.init``.
    """

    def __init__(
        self,
        save_dir: str | None = None,
        group: str | None = None,
        job_type: str | None = None,
        tags: list[str] | None = None,
        notes: str | None = None,
        **kwargs: Any,
    ) -> None:
        extra: dict[str, Any] = {"group": group, "job_type": job_type, "tags": tags, "notes": notes}
        kwargs.update({k: v for k, v in extra.items() if v})
        if save_dir is not None:  # None: Lightning's default, or a ``dir`` given in kwargs
            kwargs["save_dir"] = save_dir
        super().__init__(**kwargs)
        self._explicit_dir = self._wandb_init.get("dir") not in (None, ".")
        self._explicit_id = self._wandb_init.get("id") is not None
        self._run_dir: Callable[[], str] | None = None
        self._resume_from: str | None = None
        self._config_yaml: str | None = None
        self._failed = False
        self._dead_run: Any = None
        self._own_data_dir = False
        self._logged: dict[str, int] = {}
        self.run_url: str | None = None
        """The W&B run's page (None: offline, or W&B not started); kept after the run closes."""
        self.sync_dir: str | None = None
        """An offline run's directory, for ``wandb sync`` (None: online or not started)."""

    # -- wiring by the CLI -------------------------------------------------------------
    def bind(
        self,
        run_dir: Callable[[], str],
        resume_from: str | None = None,
        config_yaml: str | None = None,
    ) -> None:
        """The run directory (resolved when W&B starts), the checkpoint a run resumes from,
        and the resolved config to log (called by ``salvage fit`` before the trainer starts)."""
        self._run_dir, self._resume_from, self._config_yaml = run_dir, resume_from, config_yaml

    @property
    def failed(self) -> bool:
        return self._failed

    def fail(self, where: str, exc: BaseException) -> None:
        """Turn W&B off for the rest of the run, with one warning (the first failure)."""
        if not self._failed:
            print(
                f"salvage: warning: W&B failed {where} ({type(exc).__name__}: {exc}); "
                "continuing without W&B, metrics stay in the CSV logger's metrics.csv",
                file=sys.stderr,
                flush=True,
            )
        self._failed = True
        if self._experiment is not None:  # closed at the end of the stage (``finalize``)
            self._dead_run, self._experiment = self._experiment, None

    def _start(self) -> Any:
        import wandb

        run_dir = self._run_dir() if self._run_dir is not None else None
        if run_dir is not None and not self._explicit_dir:
            os.makedirs(run_dir, exist_ok=True)
            self._wandb_init["dir"] = self._save_dir = run_dir
            if "WANDB_DATA_DIR" not in os.environ:  # artifact (table) staging: in the run dir
                os.environ["WANDB_DATA_DIR"] = os.path.join(run_dir, "wandb", "data")
                self._own_data_dir = True
        previous = _read_run_file(self._resume_from)
        if previous and not self._explicit_id and self._wandb_init.get("id") is None:
            self._wandb_init["id"] = previous.get("id")  # continue the resumed version's run
            self._logged = {str(k): int(v) for k, v in previous.get("logged", {}).items()}
        if self._offline:
            os.environ["WANDB_MODE"] = "dryrun"
        attach_id = getattr(self, "_attach_id", None)
        if wandb.run is not None:  # a run started by the caller (e.g. a W&B sweep agent)
            run = wandb.run
        elif attach_id is not None and hasattr(wandb, "_attach"):
            run = wandb._attach(attach_id)
        else:
            run = wandb.init(**self._wandb_init)
        run.define_metric("update")
        run.define_metric("*", step_metric="update", step_sync=True)
        if self._config_yaml:
            import yaml

            run.config.update({"salvage": yaml.safe_load(self._config_yaml)}, allow_val_change=True)
        self._id = run.id
        self._write_run_file()
        self._record_where(run)
        return run

    def _record_where(self, run: Any) -> None:
        """Where to watch this run (its URL) or how to upload it (offline: its sync dir)."""
        try:
            if getattr(run, "offline", False):
                self.sync_dir = getattr(run, "sync_dir", None) or os.path.dirname(run.dir)
            else:
                self.run_url = getattr(run, "url", None)
        except Exception:  # noqa: BLE001, S110 - only the hand-over line at the end needs it
            pass

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._failed:
            return DummyExperiment()
        if self._experiment is None:
            try:
                self._experiment = self._start()
            except Exception as e:  # noqa: BLE001 - W&B is never required for a run
                self.fail("at start", e)
                return DummyExperiment()
        return self._experiment

    def _guard(self, where: str, fn: Callable[[], Any]) -> Any:
        if self._failed:
            return None
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            self.fail(where, e)
            return None

    # -- logging ----------------------------------------------------------------------
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        def log() -> None:
            exp = self.experiment
            if self._failed:
                return
            values = _add_prefix(dict(metrics), self._prefix, self.LOGGER_JOIN_CHAR)
            exp.log(values if step is None else {**values, "update": step})

        self._guard("while logging", log)

    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        self._guard(
            "while logging the config", lambda: super(WandbLogger, self).log_hyperparams(params)
        )

    @rank_zero_only
    def update_summary(self, values: Mapping[str, Any]) -> None:
        """Set keys of the W&B run summary (shown in the run's overview and the runs table)."""

        def update() -> None:
            exp = self.experiment
            if not self._failed:
                exp.summary.update(dict(values))

        self._guard("while writing the summary", update)

    def logged_through(self, key: str) -> int:
        """The last update whose rows of table ``key`` reached this W&B run (-1: none)."""
        return self._logged.get(key, -1)

    @rank_zero_only
    def mark_logged(self, key: str, step: int) -> None:
        self._logged[key] = max(step, self._logged.get(key, -1))
        self._guard("while recording the logged tables", self._write_run_file)

    def _write_run_file(self) -> None:
        if self._run_dir is None or self._id is None:
            return
        path = os.path.join(self._run_dir(), _RUN_FILE)
        atomic_write_text(path, json.dumps({"id": self._id, "logged": self._logged}) + "\n")

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        self._guard(
            "while logging a checkpoint",
            lambda: super(WandbLogger, self).after_save_checkpoint(checkpoint_callback),
        )

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Close the W&B run at the end of the trainer's stage (a later stage resumes it)."""
        self._guard("at the end", lambda: super(WandbLogger, self).finalize(status))
        if self._experiment is not None and not self._failed:
            run, self._experiment = self._experiment, None
            self._wandb_init["id"] = self._id  # a later stage in this process continues it
            self._guard("at the end", lambda: run.finish(exit_code=0 if status == "success" else 1))
        if self._dead_run is not None:  # failed mid-run: close what W&B still holds open
            run, self._dead_run = self._dead_run, None
            try:
                run.finish(exit_code=1)
            except Exception:  # noqa: BLE001, S110 - already reported once
                pass
        if self._own_data_dir:
            os.environ.pop("WANDB_DATA_DIR", None)
            self._own_data_dir = False


def _read_run_file(ckpt_path: str | None) -> dict[str, Any] | None:
    """``wandb_run.json`` of the version a checkpoint belongs to (``RUN/version_N/checkpoints``)."""
    if not ckpt_path or ckpt_path in ("hpc", "registry", "last", "best"):
        return None
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(ckpt_path))), _RUN_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("id") else None
