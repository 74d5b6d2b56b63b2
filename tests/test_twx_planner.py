"""The TWX oracle's planner with its transition cache (``TWXEnv._bfs``) returns exactly the
plans of the planner before it (``_bfs_reference``: restore + step for every node), and a
later search of the same game reuses the states earlier ones reached (fewer engine steps)."""

from __future__ import annotations

import random

import pytest
from conftest import needs_twx

from salvage.envs import make_env

TWC2 = "numLocations=1,numItemsToPutAway=2"
COIN4 = "numLocations=4,includeDoors=0,numDistractorItems=0"


@pytest.fixture
def fresh_caches():
    needs_twx()
    from salvage.envs import twx

    twx._TRANSITIONS.clear()
    twx._PLANS.clear()
    yield twx
    twx._TRANSITIONS.clear()
    twx._PLANS.clear()


def _walk(env, task, n, rng):
    """Reset and take ``n`` random admissible actions (fewer if the game ends)."""
    env.reset(task, 0)
    acts = []
    for _ in range(n):
        a = rng.choice(env.info["admissible"])
        acts.append(a)
        if env.step(a).done:
            break
    return acts


def _goto(env, task, acts):
    env.reset(task, 0)
    for a in acts:
        env.step(a)


def _plans_match(env, task, acts):
    _goto(env, task, acts)
    ref = env._bfs_reference()
    _goto(env, task, acts)
    new = env._bfs()
    assert new == ref, (task["id"], acts, env.plan_max_nodes)
    return new


def test_engine_is_deterministic_and_the_lean_twin_steps_like_the_wrapper(fresh_caches):
    """What the caches assume, on two JVMs (one after another game): the same game and
    actions give the same observation, info and done at every step; the planner twin's
    one-call steps give what ``TextWorldExpressEnv.step`` gives, the step limit included."""
    a, b = make_env("twx", step_limit=6), make_env("twx", step_limit=6)
    b._lean = True
    try:
        coin = a.list_tasks("train", game="coin", params=COIN4, num_tasks=1)[0]
        b.reset(coin, 0)  # b's JVM played another game first
        for task in a.list_tasks("train", game="twc", params=TWC2, num_tasks=2):
            for walk in range(3):
                rng = random.Random(walk)
                a.reset(task, 0)
                assert b.reset(task, 0) == (a.observation, a.info)
                for _ in range(8):
                    act = "help" if rng.random() < 0.1 else rng.choice(a.info["admissible"])
                    ra, rb = a.step(act), b.step(act)
                    assert (rb.observation, rb.reward, rb.done, rb.info) == (
                        ra.observation,
                        ra.reward,
                        ra.done,
                        ra.info,
                    ), (task["id"], a._actions)
                    if ra.done:
                        break
        assert b.engine_steps > 0
    finally:
        a.close()
        b.close()


def test_same_plan_and_a_second_search_steps_the_engine_less(fresh_caches):
    twx = fresh_caches
    env = make_env("twx", plan_max_nodes=400)
    try:
        task = env.list_tasks("train", game="twc", params=TWC2, num_tasks=1)[0]
        first = _walk(env, task, 1, random.Random(0))
        steps = []
        for acts in (first, []):  # the start's search holds the first state's histories
            _goto(env, task, acts)
            ref_before = env._ref_planner.engine_steps if env._ref_planner else 0
            ref = env._bfs_reference()
            ref_steps = env._ref_planner.engine_steps - ref_before
            _goto(env, task, acts)
            new_before = env._planner.engine_steps if env._planner else 0
            assert env._bfs() == ref
            steps.append((ref_steps, env._planner.engine_steps - new_before))
        assert steps[0][1] <= steps[0][0]
        assert steps[1][1] < steps[1][0], steps  # reused the first search's states

        # everything the search reads is in the cache: again, with no engine at all
        twin, env._planner = env._planner, None
        try:
            env._twin = lambda: pytest.fail("the planner asked the engine")  # type: ignore[method-assign]
            _goto(env, task, [])
            assert env._bfs() == ref
        finally:
            del env._twin
            env._planner = twin
        assert len(twx._TRANSITIONS) > 0
    finally:
        env.close()


@pytest.mark.slow
@pytest.mark.parametrize("max_nodes", [400, 3000])
def test_same_plans_as_the_reference_planner(fresh_caches, max_nodes):
    """3 twc games (2 items) from the start and after 1 and 2 random actions, and a coin
    game after a detour: the cached planner's plan equals the reference planner's."""
    env = make_env("twx", plan_max_nodes=max_nodes)
    try:
        rng = random.Random(1234)
        found = 0
        for task in env.list_tasks("train", game="twc", params=TWC2, num_tasks=3):
            for n in (0, 1, 2):
                acts = _walk(env, task, n, rng)
                if env._done:
                    continue
                found += _plans_match(env, task, acts) is not None
        coin = env.list_tasks("train", game="coin", params=COIN4, num_tasks=1)[0]
        assert _plans_match(env, coin, ["inventory"]) is not None
        assert found > 0
    finally:
        env.close()
