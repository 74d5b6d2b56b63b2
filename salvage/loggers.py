"""A CSV logger whose file survives a crash at any moment.

Lightning's CSV writer appends rows, but rewrites the whole ``metrics.csv`` in place when a
new metric name appears (e.g. ``relay/*`` on the first rescue): a crash during that
rewrite would lose every logged step. ``SafeCSVLogger`` writes the new file beside the old
one and renames it over (atomic on POSIX), so the previous file stays intact.
"""

from __future__ import annotations

import csv
import os
import tempfile
from typing import Any

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment


class _AtomicWriter(ExperimentWriter):
    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        path = self.metrics_file_path
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        fd, tmp = tempfile.mkstemp(prefix=".metrics.", suffix=".csv", dir=os.path.dirname(path))
        try:
            with os.fdopen(fd, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=fieldnames)
                w.writeheader()
                w.writerows(rows)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


class SafeCSVLogger(CSVLogger):
    """``CSVLogger`` with an atomic header rewrite (local paths)."""

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AtomicWriter(log_dir=self.log_dir)
        return self._experiment
