"""Rendezvous ports for the multi-process runs that tests start, apart per xdist worker.

Asking the OS for a free port and releasing it (what Lightning does when ``MASTER_PORT`` is
unset, and ``socket.bind(("", 0))`` helpers) races with every other process doing the same:
under ``make test``'s two workers a 2-process FSDP2 fit failed with ``EADDRINUSE`` on a port
that the other worker's run had taken in between. Here each worker takes ports from its own
block below Linux's ephemeral range (32768-60999, where the OS picks), the next one on each
call, skipping any that cannot be bound now.
"""

from __future__ import annotations

import itertools
import os
import socket

BASE, BLOCK = 20000, 1000
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
_INDEX = int(_worker[2:]) if _worker[2:].isdigit() else 0  # "gw3" -> 3; no xdist -> 0
_counter = itertools.count()


def master_port() -> int:
    """A port for ``MASTER_PORT`` that no other test process of this session hands out."""
    for _ in range(BLOCK):
        port = BASE + (_INDEX % 12) * BLOCK + next(_counter) % BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {BASE + (_INDEX % 12) * BLOCK} + {BLOCK}")
