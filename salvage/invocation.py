"""How this process was started, so that the commands a run prints next run as typed.

After ``make demo`` the ``salvage`` script lives in ``.venv/bin`` and is not on ``PATH``; a
hand-over line ``salvage report RUN`` would then fail when copied. ``command()`` is the
prefix that works: ``salvage`` when that is what ``PATH`` finds, else the script's path
(``.venv/bin/salvage``), or ``PYTHON -m salvage`` for ``python -m salvage``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys


def _same(a: str | None, b: str) -> bool:
    try:
        return a is not None and os.path.samefile(a, b)
    except OSError:
        return False


def _shown(path: str) -> str:
    """``path`` relative to the current directory when it lies under it, else absolute."""
    full = os.path.abspath(path)
    rel = os.path.relpath(full)
    return rel if not rel.startswith("..") else full


def command(argv0: str | None = None, executable: str | None = None) -> str:
    """The shell prefix that starts ``salvage`` the way this process was started."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    executable = sys.executable if executable is None else executable
    base = os.path.basename(argv0)
    if base == "salvage":  # the console script
        if _same(shutil.which("salvage"), argv0):
            return "salvage"
        return shlex.quote(_shown(argv0))
    in_package = os.path.basename(os.path.dirname(argv0)) == "salvage"
    if argv0 == "-m" or (base == "__main__.py" and in_package):  # python -m salvage
        py = os.path.basename(executable)
        shown = py if _same(shutil.which(py), executable) else _shown(executable)
        return f"{shlex.quote(shown)} -m salvage"
    return "salvage"  # called in process (main([...]) from another program)
