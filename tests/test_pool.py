"""Environment workers: a crashed, hung or failing environment fails only its episode."""

from __future__ import annotations

import pytest

from salvage.envs import make_env
from salvage.envs.pool import EnvPool

TASKS = make_env("scripted").list_tasks("train", num_tasks=4, length=3)


@pytest.mark.parametrize("workers", [0, 2])
def test_pool_matches_a_plain_env(workers):
    with EnvPool("scripted", num_workers=workers, step_timeout_s=20) as pool:
        res = pool.reset([(e, TASKS[e], 0) for e in range(4)])
        assert all(r.ok for r in res)
        acts = [TASKS[e]["solution"][0] for e in range(4)]
        got = pool.step(list(enumerate(acts)))
        for e, r in enumerate(got):
            env = make_env("scripted")
            env.reset(TASKS[e], 0)
            want = env.step(acts[e])
            assert r.ok and r.value.observation == want.observation and r.value.info == want.info
        snaps = pool.snapshot([0, 1])
        assert [s.value["actions"] for s in snaps] == [[acts[0]], [acts[1]]]


@pytest.mark.parametrize("workers", [0, 2])
def test_raising_env_fails_only_its_episode(workers):
    with EnvPool("scripted", num_workers=workers, step_timeout_s=20) as pool:
        pool.reset([(e, TASKS[e], 0) for e in range(4)])
        res = pool.step([(0, "a"), (1, "raise!"), (2, "c"), (3, "a")])
        assert [r.ok for r in res] == [True, False, True, True]
        assert "scripted environment failure" in res[1].error
        assert pool.errors == 1
        # the failed episode has no live env any more; the others go on
        nxt = pool.step([(0, "b"), (1, "a"), (2, "a")])
        assert [r.ok for r in nxt] == [True, False, True]


def test_killed_worker_fails_one_episode_and_the_rest_are_restored():
    with EnvPool("scripted", num_workers=2, step_timeout_s=20) as pool:
        pool.reset([(e, TASKS[e], 0) for e in range(4)])
        pool.step([(e, TASKS[e]["solution"][0]) for e in range(4)])
        # episodes 0 and 2 share worker 0: episode 2 kills the process mid-batch
        res = pool.step([(0, TASKS[0]["solution"][1]), (2, "crash!"), (1, TASKS[1]["solution"][1]),
                         (3, TASKS[3]["solution"][1])])
        assert [r.ok for r in res] == [True, False, True, True]
        assert "died" in res[1].error and pool.restarts == 1
        # episode 0 lived on the killed worker: restored by replay, it finishes and wins
        fin = pool.step([(0, TASKS[0]["solution"][2]), (1, TASKS[1]["solution"][2])])
        assert all(r.ok for r in fin)
        assert fin[0].value.info["won"] and fin[1].value.info["won"]
        assert fin[0].value.observation.endswith("/".join(TASKS[0]["solution"]))


def test_hung_worker_times_out_and_the_batch_completes():
    with EnvPool("scripted", num_workers=1, step_timeout_s=2) as pool:
        pool.reset([(0, TASKS[0], 0), (1, TASKS[1], 0)])
        res = pool.step([(0, "hang!"), (1, TASKS[1]["solution"][0])])
        assert not res[0].ok and "hung" in res[0].error
        assert res[1].ok  # re-run on the restarted worker
        assert pool.restarts == 1 and pool.errors == 1


def test_bad_pool_settings_are_refused():
    with pytest.raises(ValueError, match="num_workers"):
        EnvPool("scripted", num_workers=-1)
    with pytest.raises(ValueError, match="env name must be one of"):
        make_env("nethack")
