"""``salvage fit`` with a fault injected into the HF engine's ``generate`` (tests/test_engine.py).

    python tests/engine_fault_worker.py MODE fit --config ...

MODE: ``raise-once`` / ``raise-always`` (an exception inside the engine), ``hang-once`` /
``hang-always`` (a Python busy loop, as vLLM's scheduler spun on a failed request),
``stuck-native`` (a call that no signal interrupts: SIGALRM and SIGTERM blocked in the
calling thread, then a sleep). Prints ``FAULT <n>`` when call n starts its fault and
``REBUILD`` on each rebuild, on stderr.
"""

from __future__ import annotations

import signal
import sys
import time

from salvage.rollout import hf

MODE = sys.argv[1]
_orig_generate = hf.HFEngine.generate
_orig_rebuild = hf.HFEngine.rebuild
_calls = [0]


def _say(what: str) -> None:
    print(what, file=sys.stderr, flush=True)


def _faulty_generate(self, *args, **kwargs):
    _calls[0] += 1
    first = _calls[0] == 1
    if (MODE == "raise-once" and first) or MODE == "raise-always":
        _say(f"FAULT {_calls[0]}")
        raise RuntimeError(f"injected engine fault {_calls[0]}")
    if (MODE == "hang-once" and first) or MODE == "hang-always":
        _say(f"FAULT {_calls[0]}")
        x = 0
        while True:  # busy in Python: only an exception from a signal handler ends it
            x += 1
    if MODE == "stuck-native":
        _say(f"FAULT {_calls[0]}")
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGTERM})
        time.sleep(3600)
    return _orig_generate(self, *args, **kwargs)


def _counted_rebuild(self):
    _say("REBUILD")
    _orig_rebuild(self)


hf.HFEngine.generate = _faulty_generate  # type: ignore[method-assign]
hf.HFEngine.rebuild = _counted_rebuild  # type: ignore[method-assign]

if __name__ == "__main__":
    from salvage.commands.cli import main

    main(sys.argv[2:])
