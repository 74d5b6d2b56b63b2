"""Progress bars for the long stages inside one update (rollout, rescue search, SFT, ...).

Shown with rich on an interactive terminal only, transient (each bar disappears when its
stage ends, so Lightning's step bar stays readable); quiet in non-interactive runs (CI,
logs piped to a file). ``SALVAGE_PROGRESS=0`` turns them off, ``=1`` forces them on.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def enabled() -> bool:
    flag = os.environ.get("SALVAGE_PROGRESS")
    if flag is not None:
        return flag not in ("0", "false", "no", "")
    return sys.stderr.isatty() and not os.environ.get("CI")


class _Quiet:
    def advance(self, n: float = 1.0, **fields: Any) -> None:
        pass


class _Bar:
    def __init__(self, progress: Any, task: int) -> None:
        self._p, self._t = progress, task

    def advance(self, n: float = 1.0, **fields: Any) -> None:
        self._p.update(self._t, advance=n, **fields)


@contextmanager
def stage(
    description: str, total: float | None, unit: str = "it", console: Any = None
) -> Iterator[Any]:
    """``with stage("rollout", total=H, unit="turn") as bar: ... bar.advance()``."""
    if not enabled():
        yield _Quiet()
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cols = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("[cyan]{task.fields[rate]}"),
        TimeElapsedColumn(),
    ]
    with Progress(*cols, transient=True, console=console or Console(stderr=True)) as p:
        task = p.add_task(description, total=total, rate="")
        bar = _Bar(p, task)

        def advance(n: float = 1.0, **fields: Any) -> None:
            t = p.tasks[task]
            speed = t.speed
            rate = f"{speed:.1f} {unit}/s" if speed else ""
            p.update(task, advance=n, rate=rate, **fields)

        bar.advance = advance  # type: ignore[method-assign]
        yield bar


def update_progress_bar() -> Any:
    """Lightning's rich step bar counting RL updates: ``updates 3/20`` across epochs and resumes
    (one epoch is one pass over the task list, which says nothing to an RL user)."""
    from lightning.pytorch.callbacks import RichProgressBar

    class UpdateProgressBar(RichProgressBar):
        """The trainer's progress bar as updates done / ``trainer.max_steps``."""

        def _get_train_description(self, current_epoch: int) -> str:
            return "updates"

        @property
        def total_train_batches(self) -> int | float:
            steps = self.trainer.max_steps
            return steps if steps and steps > 0 else super().total_train_batches

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            if self.is_disabled:
                return
            if self.progress is not None and self.train_progress_bar_id is None:
                self.train_progress_bar_id = self._add_task(
                    self.total_train_batches, self._get_train_description(0)
                )
                self._update(self.train_progress_bar_id, trainer.global_step)
            self.refresh()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            if self.is_disabled:
                return
            if self.train_progress_bar_id is None:
                self._initialize_train_progress_bar_id()
            self._update(self.train_progress_bar_id, trainer.global_step)
            self._update_metrics(trainer, pl_module)
            self.refresh()

    return UpdateProgressBar()
