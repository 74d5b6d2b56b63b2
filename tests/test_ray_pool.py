"""Ray actors as environment workers: same answers and the same fault handling as the process pool."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'salvage[ray]')")

from salvage.envs import make_env  # noqa: E402
from salvage.envs.ray_pool import RayEnvPool  # noqa: E402

TASKS = make_env("scripted").list_tasks("train", num_tasks=4, length=3)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


def test_ray_pool_matches_a_plain_env():
    with RayEnvPool("scripted", num_workers=2, step_timeout_s=30) as pool:
        assert all(r.ok for r in pool.reset([(e, TASKS[e], 0) for e in range(4)]))
        acts = [TASKS[e]["solution"][0] for e in range(4)]
        got = pool.step(list(enumerate(acts)))
        for e, r in enumerate(got):
            env = make_env("scripted")
            env.reset(TASKS[e], 0)
            want = env.step(acts[e])
            assert r.ok and r.value.observation == want.observation and r.value.info == want.info
        snaps = pool.snapshot([0, 1])
        assert [s.value["actions"] for s in snaps] == [[acts[0]], [acts[1]]]


def test_ray_env_exception_fails_only_its_episode():
    with RayEnvPool("scripted", num_workers=2, step_timeout_s=30) as pool:
        pool.reset([(e, TASKS[e], 0) for e in range(4)])
        res = pool.step([(0, "a"), (1, "raise!"), (2, "c"), (3, "a")])
        assert [r.ok for r in res] == [True, False, True, True]
        assert "scripted environment failure" in res[1].error and pool.errors == 1


def test_dead_actor_fails_one_episode_and_the_rest_are_restored():
    with RayEnvPool("scripted", num_workers=2, step_timeout_s=30) as pool:
        pool.reset([(e, TASKS[e], 0) for e in range(4)])
        pool.step([(e, TASKS[e]["solution"][0]) for e in range(4)])
        # episodes 0 and 2 share actor 0: episode 2 kills its process mid-batch
        res = pool.step([(0, TASKS[0]["solution"][1]), (2, "crash!"), (1, TASKS[1]["solution"][1]),
                         (3, TASKS[3]["solution"][1])])
        assert [r.ok for r in res] == [True, False, True, True]
        assert "actor lost" in res[1].error and pool.restarts == 1
        fin = pool.step([(0, TASKS[0]["solution"][2]), (1, TASKS[1]["solution"][2])])
        assert all(r.ok for r in fin) and fin[0].value.info["won"] and fin[1].value.info["won"]
        assert fin[0].value.observation.endswith("/".join(TASKS[0]["solution"]))


def test_hung_actor_times_out_and_the_batch_completes():
    with RayEnvPool("scripted", num_workers=1, step_timeout_s=3) as pool:
        pool.reset([(0, TASKS[0], 0), (1, TASKS[1], 0)])
        res = pool.step([(0, "hang!"), (1, TASKS[1]["solution"][0])])
        assert not res[0].ok and "hung" in res[0].error
        assert res[1].ok and pool.restarts == 1 and pool.errors == 1


def test_ray_backend_settings_are_checked():
    from salvage.datamodules.agent import EnvSpec

    with pytest.raises(ValueError, match="data.env.backend"):
        EnvSpec(name="scripted", backend="slurm")
    with pytest.raises(ValueError, match="num_workers must be >= 1 with backend=ray"):
        EnvSpec(name="scripted", backend="ray", num_workers=0)
