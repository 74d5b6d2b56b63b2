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
