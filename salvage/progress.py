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
