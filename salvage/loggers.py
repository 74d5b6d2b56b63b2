"""A CSV logger whose file survives a crash at any moment.

Lightning's CSV writer appends rows, but rewrites the whole ``metrics.csv`` in place when a
new metric name appears (e.g. ``relay/*`` on the first rescue): a crash during that
rewrite would lose every logged step. ``SafeCSVLogger`` writes the new file beside the old
one and renames it over (atomic on POSIX), so the previous file stays intact.
"""

from __future__ import annotations

import csv
import io
from typing import Any

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment

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
