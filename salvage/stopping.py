"""A stop signal is obeyed even while user code hangs (a reward, an environment step).

Lightning turns SIGTERM into "stop after the update in flight": a reward function that
never returns would keep the process alive until ``kill -9``. Inside ``user_call(what)``,
a SIGTERM still marks the run stopped as Lightning does, then gives the call
``SALVAGE_STOP_GRACE_S`` seconds (default 10) to return: if it does, the update finishes
and is checkpointed as usual; if not, one line names what was still running and the
update in flight is dropped (``SIGTERMException`` out of the call, so ``salvage fit``
exits 75 and ``last.ckpt`` holds the last finished update). A call
stuck in native code, where no Python exception can reach it, ends the process itself
``STOP_HARD_EXIT_S`` seconds after that (same exit status, ``last.ckpt`` untouched).
SIGINT needs none of this: Python raises ``KeyboardInterrupt`` in the call (exit 130).

Signals are the main thread's: from another thread the call runs as it is.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

from salvage.errors import ConfigError

STOP_GRACE_ENV = "SALVAGE_STOP_GRACE_S"
DEFAULT_STOP_GRACE_S = 10.0
STOP_HARD_EXIT_S = 15.0
"""Past the grace, how long the process may take to exit (a call that no exception reaches, a
worker thread stuck in it) before it exits by itself."""
EXIT_STOPPED = 75  # salvage.commands.EXIT_STOPPED (the library does not import the commands)


def stop_grace_s() -> float:
    """``$SALVAGE_STOP_GRACE_S`` (seconds, >= 0), else the default."""
    raw = os.environ.get(STOP_GRACE_ENV)
    if raw is None or raw == "":
        return DEFAULT_STOP_GRACE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ConfigError(f"${STOP_GRACE_ENV} must be a number of seconds >= 0, got {raw!r}")
    return value


def _say(line: str) -> None:
    os.write(2, (line + "\n").encode())  # not print: a signal may interrupt a print


class _Stop:
    """The state of one ``user_call``: the signal seen, the grace's timer, its expiry."""

    def __init__(self, what: str, grace: float) -> None:
        self.what, self.grace = what, grace
        self.started = False
        self.expired = False
        self.timers: list[threading.Timer] = []
        self.main = threading.main_thread().ident or 0

    def start(self) -> None:
        self.started = True
        for delay, fn in ((self.grace, self.expire), (self.grace + STOP_HARD_EXIT_S, self.exit)):
            t = threading.Timer(delay, fn)
            t.daemon = True
            t.start()
            self.timers.append(t)

    def expire(self) -> None:
        """The grace is over: wake the main thread (its handler then raises)."""
        self.expired = True
        _say(
            f"salvage: SIGTERM: a {self.what} was still in progress after the "
            f"{self.grace:g} s stop grace (${STOP_GRACE_ENV}); dropping the update in flight "
            "(last.ckpt holds the last finished update)"
        )
        with contextlib.suppress(Exception):
            signal.pthread_kill(self.main, signal.SIGTERM)

    def exit(self) -> None:
        _say(
            f"salvage: the {self.what} did not return {STOP_HARD_EXIT_S:g} s after that "
            f"(stuck outside Python); exiting with status {EXIT_STOPPED}"
        )
        os._exit(EXIT_STOPPED)

    def cancel(self) -> None:
        """The call returned: no timer fires. Past the grace the hard exit stays armed: a
        worker thread still stuck in the call could keep the process from exiting."""
        for t in self.timers[: 1 if self.expired else None]:
            t.cancel()


def stop_requested(handler: Any) -> bool:
    """Whether Lightning's SIGTERM handler (``handler``, maybe one of several composed) has
    already seen a SIGTERM (its connector's ``received_sigterm``)."""
    for h in getattr(handler, "signal_handlers", None) or [handler]:
        if getattr(getattr(h, "__self__", None), "received_sigterm", False):
            return True
    return False


@contextlib.contextmanager
def user_call(what: str) -> Iterator[None]:
    """Run user code (``what``: "reward call", "environment step") so that SIGTERM ends it
    within the grace period (module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    grace = stop_grace_s()
    prev = signal.getsignal(signal.SIGTERM)
    if not callable(prev) or prev is signal.default_int_handler:
        yield  # no Lightning handler (not in a fit): SIGTERM ends the process as it would
        return
    state = _Stop(what, grace)
    if stop_requested(prev):  # SIGTERM came before this call: it gets the grace from now
        state.start()

    def handler(signum: int, frame: Any) -> None:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if state.expired:
            raise SIGTERMException
        if not state.started:
            prev(signum, frame)  # Lightning's: the run is marked stopped
            state.start()

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        state.cancel()
        signal.signal(signal.SIGTERM, prev)
