"""TextWorld-Express engines that share one JVM per process.

``textworld_express.TextWorldExpressEnv`` starts a JVM (py4j gateway) per instance: ~0.7 s
and ~80 MB each, and a rollout of 16 tasks x 8 episodes holds 128 of them (plus the
planner's twins). The game lives in a Java ``PythonInterface`` object, and one gateway can
host many: every engine of a process after the first gets its own ``PythonInterface`` on
the first one's JVM (~2 ms), with its own Python-side state (score, step history, step
limit). Each worker process (and a forked child) starts its own JVM. ``share_jvm=False``
gives every engine its own, as before.
"""

from __future__ import annotations

import os
from typing import Any

_HOST: tuple[int, Any] | None = None
"""(pid, the engine whose JVM the others of this process use); never handed out itself."""
_SHARED_CLASS: Any = None
_INHERITED: list[Any] = []
"""Hosts a forked child inherited from its parent: never closed nor collected here."""


def _shared_class() -> Any:
    """The ``TextWorldExpressEnv`` subclass whose instances use a JVM they do not own."""
    global _SHARED_CLASS
    if _SHARED_CLASS is None:
        import tempfile

        from textworld_express import TextWorldExpressEnv

        class SharedJVMEngine(TextWorldExpressEnv):
            """A ``TextWorldExpressEnv`` on another engine's JVM (its own game)."""

            def __init__(self, gateway: Any, envStepLimit: int = 100) -> None:  # noqa: N803
                # the fields of TextWorldExpressEnv.__init__ (textworld-express 1.x), without
                # launching a JVM
                self._gateway = gateway
                self.server = gateway.jvm.textworldexpress.runtime.PythonInterface()
                self.lastStepScore = 0
                self.envStepLimit = envStepLimit
                self.runHistory: list[dict[str, Any]] = []
                self.seed = None
                self.gameName = None
                self.gameParams = ""
                self.gameFold = "train"
                self.generateGoldPath = False
                self._obj_tree_tempfile = tempfile.NamedTemporaryFile()

            def close(self) -> None:
                self.server = None  # the JVM is the host's: it stays for the others

        _SHARED_CLASS = SharedJVMEngine
    return _SHARED_CLASS


def _alive(engine: Any) -> bool:
    proc = getattr(getattr(engine, "_gateway", None), "java_process", None)
    return proc is not None and proc.poll() is None


def new_engine(step_limit: int, share_jvm: bool = True) -> Any:
    """A TextWorld-Express engine: on this process's shared JVM (started by the first call,
    again if it died), or with a JVM of its own (``share_jvm=False``)."""
    from textworld_express import TextWorldExpressEnv

    if not share_jvm:
        return TextWorldExpressEnv(envStepLimit=step_limit)
    global _HOST
    if _HOST is not None and _HOST[0] != os.getpid():
        # a forked child's copy of its parent's host: closing it (its __del__ does) would
        # shut the parent's JVM down through the inherited pipe, and collecting it would
        # delete the parent's temporary file; it is kept, untouched
        _HOST[1].close = lambda: None
        _INHERITED.append(_HOST[1])
        _HOST = None
    if _HOST is None or not _alive(_HOST[1]):
        _HOST = (os.getpid(), TextWorldExpressEnv(envStepLimit=step_limit))
    return _shared_class()(_HOST[1]._gateway, step_limit)


def jvms_started() -> int:
    """Java processes that are children of this process (for tests and benchmarks)."""
    import subprocess

    out = subprocess.run(
        ["pgrep", "-P", str(os.getpid()), "java"], capture_output=True, text=True
    ).stdout
    return len(out.split())
