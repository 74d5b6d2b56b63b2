"""TextWorld-Express engines: one JVM each vs one JVM shared (``share_jvm``), side by side.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/twx_jvm.py [--engines 32] [--rounds 2]

Makes ``--engines`` ``TWXEnv`` instances (a rollout of 16 tasks x 8 holds 128) and resets each
on its own twc game (the first reset starts the engine), then steps each once; reports the
wall seconds of that start and the resident memory of the Java processes this one started,
for ``share_jvm: false`` and ``true``, alternately (``--rounds``). Not a test; the 2 cores
are shared, so compare the rows of one run.

Last output (2026-12-07, 2 cores shared with a GRAFT study, ``--engines 32 --rounds 2``)::

    32 TWX engines (twc 2 items): start, first reset and one step each
    | share_jvm | JVMs | start + reset + step (s) | Java resident memory (MB) |
    |---|---|---|---|
    | false | 32 | 47.79 | 2337 |
    | true | 1 | 4.94 | 251 |

    start-up ratio own / shared: 9.7x
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

from salvage.envs import twx_engine
from salvage.envs.twx import TWXEnv

TWC2 = "numLocations=1,numItemsToPutAway=2"


def java_rss_mb() -> float:
    """Resident memory (MB) of the Java processes that are children of this process."""
    pids = subprocess.run(
        ["pgrep", "-P", str(os.getpid()), "java"], capture_output=True, text=True
    ).stdout.split()
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total / 1024


def one(engines: int, share: bool) -> tuple[float, float, int]:
    if twx_engine._HOST is not None:  # every measurement starts its shared JVM anew
        twx_engine._HOST[1].close()
        twx_engine._HOST = None
    tasks = TWXEnv.list_tasks("train", game="twc", params=TWC2, num_tasks=engines)
    envs = [TWXEnv(share_jvm=share) for _ in tasks]
    t0 = time.perf_counter()
    for env, task in zip(envs, tasks, strict=True):
        env.reset(task, 0)
        env.step(sorted(env.info["admissible"])[0])
    wall = time.perf_counter() - t0
    rss = java_rss_mb()
    jvms = twx_engine.jvms_started()
    for env in envs:
        env.close()
    return wall, rss, jvms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--engines", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    got: dict[bool, list[tuple[float, float, int]]] = {False: [], True: []}
    for r in range(a.rounds):
        for share in (False, True) if r % 2 == 0 else (True, False):
            got[share].append(one(a.engines, share))
    print(f"\n{a.engines} TWX engines (twc 2 items): start, first reset and one step each")
    print("| share_jvm | JVMs | start + reset + step (s) | Java resident memory (MB) |")
    print("|---|---|---|---|")
    for share in (False, True):
        rows = got[share]
        wall = statistics.mean(w for w, _, _ in rows)
        rss = statistics.mean(m for _, m, _ in rows)
        jvms = max(j for _, _, j in rows)
        print(f"| {str(share).lower()} | {jvms} | {wall:.2f} | {rss:.0f} |")
    own, shared = (statistics.mean(w for w, _, _ in got[s]) for s in (False, True))
    print(f"\nstart-up ratio own / shared: {own / shared:.1f}x")


if __name__ == "__main__":
    main()
