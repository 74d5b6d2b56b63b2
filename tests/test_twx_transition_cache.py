"""The TWX planner's transition cache (issue 45 item 4): the same plans as the planner
without it (``_bfs_reference``), with fewer engine steps once a game's states are cached."""

from __future__ import annotations

import random

from tests.conftest import needs_twx

TWC2 = "numLocations=1,numItemsToPutAway=2"


def test_cached_plans_equal_the_reference_and_step_the_engine_less():
    needs_twx()
    from salvage.envs import twx
    from salvage.envs.twx import TWXEnv

    twx._TRANSITIONS.clear()
    task = TWXEnv.list_tasks("train", game="twc", params=TWC2, num_tasks=1, seed_offset=2)[0]
    env = TWXEnv(plan_max_nodes=400)
    try:
        env.reset(task, 0)
        rng = random.Random(7)
        plans = []
        for _ in range(2):  # the start state, then one random action on
            ref = env._bfs_reference()
            before = env._planner.engine_steps if env._planner is not None else 0
            new = env._bfs()
            cold = env._planner.engine_steps - before
            before = env._planner.engine_steps
            again = env._bfs()
            warm = env._planner.engine_steps - before
            assert new == again == ref and ref, (ref, new, again)
            assert warm == 0  # every state of the second search is cached
            plans.append(cold)
            env.step(rng.choice(env.info["admissible"]))
        # from the child state the search reaches states the first one cached: fewer steps
        cold0, cold1 = plans
        assert cold1 < cold0, plans
    finally:
        env.close()


def test_the_reference_planner_is_a_switch_with_the_same_oracle_actions():
    """``planner: reference`` (the search before the cache, for before/after benchmarks)
    plays the same oracle actions from a restored state; a bad value names the field."""
    import pytest

    from salvage.envs import twx
    from salvage.envs.twx import TWXEnv
    from salvage.errors import ConfigError

    with pytest.raises(ConfigError, match=r"planner='bfs'.*cached, reference"):
        TWXEnv(planner="bfs")  # refused before any engine starts
    needs_twx()

    task = TWXEnv.list_tasks("train", game="twc", params=TWC2, num_tasks=1, seed_offset=2)[0]
    played = {}
    for planner in ("reference", "cached"):
        twx._PLANS.clear()
        twx._TRANSITIONS.clear()
        env = TWXEnv(plan_max_nodes=400, planner=planner)
        try:
            env.reset(task, 0)
            env.step(random.Random(3).choice(env.info["admissible"]))  # a student's action
            actions = []
            while (a := env.oracle_action()) is not None and len(actions) < 8:
                actions.append(a)
                env.step(a)
            played[planner] = (actions, env.info["won"])
            ref_twin, twin = env._ref_planner, env._planner
            assert (ref_twin is not None, twin is not None) == (
                planner == "reference",
                planner == "cached",
            )  # each planner searched with its own twin only
        finally:
            env.close()
    assert played["reference"] == played["cached"] and played["cached"][1], played
