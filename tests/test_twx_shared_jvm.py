"""TextWorld-Express engines on one shared JVM (``share_jvm``, the default): each engine
keeps its own game, so episodes stepped in turn on one JVM play exactly as on a JVM each;
and a process starts one JVM for many engines."""

from __future__ import annotations

import random

from tests.conftest import needs_twx

TWC2 = "numLocations=1,numItemsToPutAway=2"


def _play(envs, tasks, steps: int = 6) -> list[list[tuple[str, float, bool]]]:
    """Reset every env on its task, then step them in turn (env 0, env 1, ..., again) with
    a fixed random choice of admissible actions; each env's (observation, reward, done)."""
    rng = random.Random(11)
    out: list[list[tuple[str, float, bool]]] = [[] for _ in envs]
    for env, task in zip(envs, tasks, strict=True):
        env.reset(task, 0)
        out[envs.index(env)].append((env.observation, 0.0, False))
    for _ in range(steps):
        for i, env in enumerate(envs):
            if env._done:
                continue
            res = env.step(rng.choice(sorted(env.info["admissible"])))
            out[i].append((res.observation, res.reward, res.done))
    return out


def test_engines_on_one_jvm_play_as_engines_on_a_jvm_each():
    needs_twx()
    from salvage.envs import twx_engine
    from salvage.envs.twx import TWXEnv

    tasks = [
        *TWXEnv.list_tasks("train", game="twc", params=TWC2, num_tasks=2),
        *TWXEnv.list_tasks("train", game="coin", params="numLocations=3", num_tasks=1),
    ]
    before = twx_engine.jvms_started()
    shared = [TWXEnv(share_jvm=True) for _ in tasks]
    own = [TWXEnv(share_jvm=False) for _ in tasks]
    try:
        got = _play(shared, tasks)
        started_shared = twx_engine.jvms_started() - before
        want = _play(own, tasks)
        assert got == want
        assert all(len(x) > 1 for x in got)
        # the shared engines started at most one JVM (none when an earlier test's host lives)
        assert started_shared <= 1, started_shared
        assert twx_engine.jvms_started() - before - started_shared == len(own)
    finally:
        for env in shared + own:
            env.close()
    # closing a shared engine leaves the JVM to the others of the process
    again = TWXEnv()
    try:
        again.reset(tasks[0], 0)
        assert again.observation == got[0][0][0]
    finally:
        again.close()


def _child_plays(task) -> None:
    from salvage.envs.twx import TWXEnv

    env = TWXEnv()  # a forked child: a JVM of its own, the parent's copy left alone
    env.reset(task, 0)
    env.close()


def test_a_forked_child_starts_its_own_jvm_and_leaves_the_parents():
    needs_twx()
    import gc
    import multiprocessing as mp

    from salvage.envs.twx import TWXEnv

    task = TWXEnv.list_tasks("train", game="twc", params=TWC2, num_tasks=1)[0]
    env = TWXEnv()
    try:
        env.reset(task, 0)
        first = sorted(env.info["admissible"])[0]
        child = mp.get_context("fork").Process(target=_child_plays, args=(task,))
        child.start()
        child.join(120)
        assert child.exitcode == 0
        gc.collect()
        res = env.step(first)  # the parent's JVM still answers
        assert res.observation
    finally:
        env.close()
