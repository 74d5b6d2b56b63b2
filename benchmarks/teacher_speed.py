"""TWX oracle teacher: seconds per attempt, the planner before the transition cache
(``TWXEnv._bfs_reference``) vs today's (``TWXEnv._bfs``), side by side in one run.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/teacher_speed.py [--games 4] [--nodes 3000]

A teacher attempt restores a student state into an env and plays the oracle from it to the
end (at most ``--max-actions`` actions), as VH-GPO's rescue does. The states: ``--games``
twc games (``numLocations=1,numItemsToPutAway=2``, train seeds 0..) after 2, 1 and 0 random
admissible actions (a fixed ``random.Random``), in that order per game (VH-GPO searches its
deepest anchor first, the root last). Every attempt plans afresh (the per-state plan cache
is cleared before each); "after" keeps its transition cache across the states, starting
empty, as one process does. Both planners' twins are warmed up on another game first.
Reports seconds and engine steps per attempt, the ratio, and whether every action sequence
matched; "after, again": the same states once more with the plan cache cleared (every state
then cached: what a repeated search of a game costs).

Last output (2026-12-07, 2-core CPU shared with another job, ``python benchmarks/teacher_speed.py``)::

    twc 2 items, plan_max_nodes 3000, 12 states, <= 8 actions per attempt

    | state | student actions | plan | before (s) | after (s) | ratio | before steps | after steps | same actions | after, again (s) |
    |---|---|---|---|---|---|---|---|---|---|
    | twc/train/0 | 2 | 4 | 2.03 | 2.87 | 0.7x | 4718 | 4718 | True | 0.0152 |
    | twc/train/0 | 1 | 5 | 4.63 | 3.02 | 1.5x | 7926 | 7926 | True | 0.0297 |
    | twc/train/0 | 0 | 5 | 3.00 | 2.01 | 1.5x | 6383 | 6349 | True | 0.0204 |
    | twc/train/1 | 2 | 4 | 2.02 | 1.77 | 1.1x | 5246 | 5246 | True | 0.0193 |
    | twc/train/1 | 1 | 4 | 1.51 | 1.30 | 1.2x | 3582 | 3582 | True | 0.0142 |
    | twc/train/1 | 0 | 5 | 3.01 | 1.33 | 2.3x | 6495 | 3656 | True | 0.0229 |
    | twc/train/2 | 2 | 4 | 0.15 | 0.16 | 0.9x | 400 | 400 | True | 0.0125 |
    | twc/train/2 | 1 | 3 | 0.12 | 0.09 | 1.3x | 182 | 116 | True | 0.0120 |
    | twc/train/2 | 0 | 4 | 0.14 | 0.06 | 2.3x | 240 | 157 | True | 0.0060 |
    | twc/train/3 | 2 | 3 | 0.49 | 0.51 | 0.9x | 1410 | 1410 | True | 0.0089 |
    | twc/train/3 | 1 | 4 | 1.31 | 0.86 | 1.5x | 2786 | 2786 | True | 0.0118 |
    | twc/train/3 | 0 | 4 | 1.06 | 0.60 | 1.8x | 2170 | 1851 | True | 0.0106 |
    | **mean per attempt** | | | 1.62 | 1.21 | **1.3x** | 3462 | 3183 | True | 0.0153 (106x) |

The goal of >= 10x per first attempt is not reached: 1.3x. The cache is keyed by action
history, and the search dedups states by (observation, admissible, score), so a search from
another state re-walks histories an earlier search pruned as duplicates; the engine has no
undo or clone, so each node not cached costs a reset and a replay of its whole history (one
JVM round trip per call, most of the time). A repeat of a cached game's states: ~100x.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from salvage.envs import twx
from salvage.envs.twx import TWXEnv

TWC2 = "numLocations=1,numItemsToPutAway=2"


def student_states(n_games: int, seed: int) -> list[tuple[dict[str, Any], list[str]]]:
    env = TWXEnv()
    rng = random.Random(seed)
    out = []
    try:
        for task in env.list_tasks("train", game="twc", params=TWC2, num_tasks=n_games):
            for k in (2, 1, 0):
                env.reset(task, 0)
                acts: list[str] = []
                for _ in range(k):
                    a = rng.choice(env.info["admissible"])
                    if env.step(a).done:
                        break
                    acts.append(a)
                out.append((task, acts))
    finally:
        env.close()
    return out


def attempt(env: TWXEnv, task: dict[str, Any], acts: list[str], max_actions: int) -> list[str]:
    """Restore the student state (a snapshot) and play the oracle from it."""
    env.reset(task, 0)
    for a in acts:
        env.step(a)
    env.restore(env.snapshot())
    played: list[str] = []
    while len(played) < max_actions and (a := env.oracle_action()) is not None:
        played.append(a)
        if env.step(a).done:
            break
    return played


def steps_of(env: TWXEnv) -> int:
    return sum(t.engine_steps for t in (env._planner, env._ref_planner) if t is not None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--games", type=int, default=4, help="twc games (3 states each)")
    ap.add_argument("--nodes", type=int, default=3000, help="plan_max_nodes")
    ap.add_argument("--max-actions", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    states = student_states(args.games, args.seed)
    before, after = TWXEnv(plan_max_nodes=args.nodes), TWXEnv(plan_max_nodes=args.nodes)
    before._bfs = before._bfs_reference  # type: ignore[method-assign]
    try:
        warm = TWXEnv.list_tasks("train", game="twc", params=TWC2, num_tasks=1, seed_offset=500)
        for env in (before, after):  # start both twins' JVMs and JIT on another game
            attempt(env, warm[0], [], args.max_actions)
        twx._TRANSITIONS.clear()

        rows = []
        for task, acts in states:
            row: dict[str, Any] = {"task": task, "acts": acts}
            for name, env in (("before", before), ("after", after)):
                twx._PLANS.clear()
                s0, t0 = steps_of(env), time.perf_counter()
                row[name] = attempt(env, task, acts, args.max_actions)
                row[name + "_s"] = time.perf_counter() - t0
                row[name + "_steps"] = steps_of(env) - s0
            rows.append(row)
        for row in rows:  # again: every state is in the transition cache now
            twx._PLANS.clear()
            s0, t0 = steps_of(after), time.perf_counter()
            again = attempt(after, row["task"], row["acts"], args.max_actions)
            row["again_s"] = time.perf_counter() - t0
            row["again_steps"] = steps_of(after) - s0
            row["again_same"] = again == row["after"]
    finally:
        before.close()
        after.close()

    print(
        f"twc 2 items, plan_max_nodes {args.nodes}, {len(rows)} states, "
        f"<= {args.max_actions} actions per attempt\n"
    )
    print(
        "| state | student actions | plan | before (s) | after (s) | ratio "
        "| before steps | after steps | same actions | after, again (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['task']['id']} | {len(r['acts'])} | {len(r['after'])} | {r['before_s']:.2f} "
            f"| {r['after_s']:.2f} | {r['before_s'] / r['after_s']:.1f}x | {r['before_steps']} "
            f"| {r['after_steps']} | {r['before'] == r['after'] and r['again_same']} "
            f"| {r['again_s']:.4f} |"
        )
    b = sum(r["before_s"] for r in rows) / len(rows)
    a = sum(r["after_s"] for r in rows) / len(rows)
    g = sum(r["again_s"] for r in rows) / len(rows)
    bs = sum(r["before_steps"] for r in rows) / len(rows)
    as_ = sum(r["after_steps"] for r in rows) / len(rows)
    same = all(r["before"] == r["after"] and r["again_same"] for r in rows)
    print(
        f"| **mean per attempt** | | | {b:.2f} | {a:.2f} | **{b / a:.1f}x** | {bs:.0f} "
        f"| {as_:.0f} | {same} | {g:.4f} ({b / g:.0f}x) |"
    )


if __name__ == "__main__":
    main()
