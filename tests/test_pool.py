"""Environment workers (local processes or Ray actors): a crashed, hung or failing
environment fails only its episode; the same tests run against every backend."""

from __future__ import annotations

import importlib.util

import pytest

from salvage.envs import make_env
from salvage.envs.pool import EnvPool

TASKS = make_env("scripted").list_tasks("train", num_tasks=4, length=3)
HAS_RAY = importlib.util.find_spec("ray") is not None
RAY = pytest.param(
    "ray", marks=pytest.mark.skipif(not HAS_RAY, reason="the ray extra is not installed")
)


@pytest.fixture(scope="module")
def ray_session():
    if not HAS_RAY:
        yield None
        return
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


def pool(backend: str, workers: int, timeout: float):
    if backend == "ray":
        from salvage.envs.ray_pool import RayEnvPool

        return RayEnvPool("scripted", num_workers=max(1, workers), step_timeout_s=timeout)
    return EnvPool("scripted", num_workers=workers, step_timeout_s=timeout)


LOST = {"process": "died", "ray": "actor lost"}


@pytest.mark.parametrize(
    "backend,workers", [("process", 0), ("process", 2), pytest.param("ray", 2, marks=RAY.marks)]
)
def test_pool_matches_a_plain_env(backend, workers, ray_session):
    with pool(backend, workers, 20) as p:
        res = p.reset([(e, TASKS[e], 0) for e in range(4)])
        assert all(r.ok for r in res)
        acts = [TASKS[e]["solution"][0] for e in range(4)]
        got = p.step(list(enumerate(acts)))
        for e, r in enumerate(got):
            env = make_env("scripted")
            env.reset(TASKS[e], 0)
            want = env.step(acts[e])
            assert r.ok and r.value.observation == want.observation and r.value.info == want.info
        snaps = p.snapshot([0, 1])
        assert [s.value["actions"] for s in snaps] == [[acts[0]], [acts[1]]]


@pytest.mark.parametrize(
    "backend,workers", [("process", 0), ("process", 2), pytest.param("ray", 2, marks=RAY.marks)]
)
def test_raising_env_fails_only_its_episode(backend, workers, ray_session):
    with pool(backend, workers, 20) as p:
        p.reset([(e, TASKS[e], 0) for e in range(4)])
        res = p.step([(0, "a"), (1, "raise!"), (2, "c"), (3, "a")])
        assert [r.ok for r in res] == [True, False, True, True]
        assert "scripted environment failure" in res[1].error
        assert p.errors == 1
        # the failed episode has no live env any more; the others go on
        nxt = p.step([(0, "b"), (1, "a"), (2, "a")])
        assert [r.ok for r in nxt] == [True, False, True]


@pytest.mark.parametrize("backend", ["process", RAY])
def test_killed_worker_fails_one_episode_and_the_rest_are_restored(backend, ray_session):
    with pool(backend, 2, 20) as p:
        p.reset([(e, TASKS[e], 0) for e in range(4)])
        p.step([(e, TASKS[e]["solution"][0]) for e in range(4)])
        # episodes 0 and 2 share worker 0: episode 2 kills the process mid-batch
        res = p.step(
            [
                (0, TASKS[0]["solution"][1]),
                (2, "crash!"),
                (1, TASKS[1]["solution"][1]),
                (3, TASKS[3]["solution"][1]),
            ]
        )
        assert [r.ok for r in res] == [True, False, True, True]
        assert LOST[backend] in res[1].error and p.restarts == 1
        # episode 0 lived on the killed worker: restored by replay, it finishes and wins
        fin = p.step([(0, TASKS[0]["solution"][2]), (1, TASKS[1]["solution"][2])])
        assert all(r.ok for r in fin)
        assert fin[0].value.info["won"] and fin[1].value.info["won"]
        assert fin[0].value.observation.endswith("/".join(TASKS[0]["solution"]))


@pytest.mark.parametrize("backend", ["process", RAY])
def test_hung_worker_times_out_and_the_batch_completes(backend, ray_session):
    with pool(backend, 1, 3) as p:
        p.reset([(0, TASKS[0], 0), (1, TASKS[1], 0)])
        res = p.step([(0, "hang!"), (1, TASKS[1]["solution"][0])])
        assert not res[0].ok and "hung" in res[0].error
        assert res[1].ok  # re-run on the restarted worker
        assert p.restarts == 1 and p.errors == 1


def test_bad_pool_settings_are_refused():
    from salvage.datamodules.agent import EnvSpec

    with pytest.raises(ValueError, match="num_workers"):
        EnvPool("scripted", num_workers=-1)
    with pytest.raises(ValueError, match="env name must be one of"):
        make_env("nethack")
    with pytest.raises(ValueError, match="data.env.backend"):
        EnvSpec(name="scripted", backend="slurm")
    with pytest.raises(ValueError, match="num_workers must be >= 1 with backend=ray"):
        EnvSpec(name="scripted", backend="ray", num_workers=0)
    with pytest.raises(ValueError, match="data.env.startup_timeout_s must be > 0, got 0"):
        EnvSpec(name="scripted", startup_timeout_s=0)


def test_env_spec_startup_timeout_reaches_the_worker_pool():
    """``data.env.startup_timeout_s`` is the pool's: a worker that cannot start within it is
    an error naming the limit (here 1e-3 s: no process starts that fast)."""
    from salvage.datamodules.agent import AgentDataModule, EnvSpec

    spec = EnvSpec(name="scripted", num_workers=1, startup_timeout_s=1e-3, train_tasks={})
    dm = AgentDataModule(env=spec, tasks_per_step=2, group_size=2)
    try:
        with pytest.raises(RuntimeError, match=r"within 0.001 s \(data.env.startup_timeout_s\)"):
            dm.setup("fit")  # the pool starts its workers when the datamodule sets up
    finally:
        dm.teardown("fit")
    spec = EnvSpec(name="scripted", num_workers=1, startup_timeout_s=77.0, train_tasks={})
    dm = AgentDataModule(env=spec, tasks_per_step=2, group_size=2)
    dm.setup("fit")
    try:
        assert dm.pool.startup_timeout_s == 77.0
    finally:
        dm.teardown("fit")
