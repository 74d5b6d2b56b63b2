"""salvage: RL for language models that turns all-failure GRPO groups into signal.

Importing the package is cheap: heavy or optional dependencies (transformers models,
vllm, wandb, environments) are imported where they are used.

The subcommands live in ``salvage.commands`` (``python -m salvage``). Their old module
paths (``salvage.cli``, ``salvage.study``, ``salvage.compare``, ``salvage.report``,
``salvage.export``, ``salvage.joint_cost``) still import, as the moved modules themselves,
with a ``DeprecationWarning`` naming the new path; ``python -m salvage.cli ...`` still runs
the command, with a note on stderr.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import warnings
from types import FrameType
from typing import Any

__version__ = "0.1.0"

MOVED_MODULES = {
    "salvage.cli": "salvage.commands.cli",
    "salvage.study": "salvage.commands.study",
    "salvage.compare": "salvage.commands.compare",
    "salvage.report": "salvage.commands.report",
    "salvage.export": "salvage.commands.export",
    "salvage.joint_cost": "salvage.commands.joint_cost",
}
"""Old module path -> where the module lives now."""


def _importer_stacklevel() -> int:
    """The ``stacklevel`` of the frame that asked for the import (past importlib's own
    frames and this file's), so the warning names the user's line."""
    level = 1
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename == __file__ or "importlib" in frame.f_code.co_filename
    ):
        level += 1
        frame = frame.f_back
    return level


class _MovedLoader:
    """Loads an old path as the module that moved (the same module object, not a copy)."""

    def __init__(self, new: str) -> None:
        self.new = new
        self._spec: Any = None

    def create_module(self, spec: Any) -> Any:
        warnings.warn(
            f"{spec.name} moved to {self.new}: import {self.new}",
            DeprecationWarning,
            stacklevel=_importer_stacklevel(),
        )
        module = importlib.import_module(self.new)
        self._spec = module.__spec__  # the import system sets the alias spec on it next
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = self._spec  # already executed: only give it its own spec back

    def get_code(self, fullname: str) -> Any:
        """``python -m salvage.cli ARGS``: a note on stderr, then the ``salvage`` command (the
        other old modules were never commands: a one-line error naming the new one)."""
        sub = fullname.rsplit(".", 1)[1].replace("_", "-")
        if fullname == "salvage.cli":
            body = (
                "sys.stderr.write('salvage: note: `python -m salvage.cli` is deprecated: run "
                "`python -m salvage` (or the `salvage` command)\\n')\n"
                "from salvage.commands.cli import main\n"
                "main()\n"
            )
        else:
            body = (
                f"sys.exit('salvage: `python -m {fullname}` is not a command: {fullname} moved "
                f"to {self.new}; run `python -m salvage {sub} ...`')\n"
            )
        source = "import sys\nif __name__ == '__main__':\n" + "".join(
            f"    {line}\n" for line in body.splitlines()
        )
        return compile(source, f"<{fullname}, moved to {self.new}>", "exec")


class _MovedFinder:
    """A ``sys.meta_path`` finder for the modules in ``MOVED_MODULES``."""

    @staticmethod
    def find_spec(fullname: str, path: Any = None, target: Any = None) -> Any:
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        loader: Any = _MovedLoader(new)  # a loader by its methods (no importlib.abc import)
        return importlib.machinery.ModuleSpec(fullname, loader)


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedFinder())  # first: a stale file of an old install never wins
