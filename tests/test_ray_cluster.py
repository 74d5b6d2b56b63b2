"""A real Ray cluster on localhost: a head raylet and a worker raylet started by ``ray start``.

The head offers ``{"head_node": 1}`` and 1 CPU, the worker ``{"env_node": 2}`` and 1 CPU.
Environment actors asked to need ``env_node`` land on the worker; the worker's raylet is
killed (SIGKILL) while episodes run on it, then a fresh worker node joins, as a cluster
manager would replace a lost machine; ``salvage study --backend ray`` runs two runs at once
on the cluster and a run whose node is killed resumes on the next call.

Every process of the cluster carries ``SALVAGE_RAY_TEST=<its temp dir>`` in its environment:
teardown stops the ``ray start --block`` processes it started and then kills any process
still carrying that marker (orphaned workers, fits), never another Ray instance.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.ports import master_port

ROOT = Path(__file__).resolve().parents[1]
HAS_RAY = importlib.util.find_spec("ray") is not None

pytestmark = [
    pytest.mark.slow,
    pytest.mark.ray_cluster,
    pytest.mark.skipif(not HAS_RAY, reason="the ray extra is not installed"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux (/proc, prctl)"),
]

MARKER = "SALVAGE_RAY_TEST"
OBJECT_STORE = 200 * 2**20
AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def _env(marker: str, token: str) -> dict[str, str]:
    """Environment of every process this module starts: quiet, offline, this tree first, the
    cluster's own auth token (never ``~/.ray/auth_token``: Ray 2.60 turns token auth on for a
    head that finds that file but not for a worker joining it, which is then refused)."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        OMP_WAIT_POLICY="PASSIVE",
        WANDB_MODE="offline",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        SALVAGE_PROGRESS="0",
        RAY_USAGE_STATS_ENABLED="0",
        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])]),
    )
    env[MARKER] = marker
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    return env


def _marked(marker: str) -> list[Any]:
    """Live processes whose environment carries ``MARKER=marker`` (this cluster's)."""
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(MARKER) == marker:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


class LocalCluster:
    """A head and worker raylets on this host, each a ``ray start --block`` child process
    (SIGTERM stops a node and its processes; SIGKILL of its raylet loses the node)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="srt-"))  # short: Unix socket paths
        self.marker = str(self.root)
        self.env = _env(self.marker, secrets.token_hex(32))
        self.port = master_port()
        self.address = f"127.0.0.1:{self.port}"
        self.ray = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
        self.head: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[bytes]] = []
        self.worker_node: str | None = None

    def _node_args(self, name: str, resources: dict[str, float]) -> list[str]:
        ports = (
            "--node-manager-port",
            "--object-manager-port",
            "--dashboard-agent-listen-port",
            "--dashboard-agent-grpc-port",
            "--runtime-env-agent-port",
            "--metrics-export-port",
        )
        args = [
            f"--temp-dir={self.root / name}",
            "--num-cpus=1",
            f"--resources={json.dumps(resources)}",
        ]
        args += [f"--object-store-memory={OBJECT_STORE}", "--disable-usage-stats", "--block"]
        # each from this session's block below the ephemeral range, handed out once
        # (tests/ports.py): binding port 0 per component let the OS hand one port out
        # twice, and CI's head refused to start with two components on it
        args += [f"{p}={master_port()}" for p in ports]
        return [*args, "--min-worker-port=0", "--max-worker-port=0"]  # 0: any free port

    def _start(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        with (self.root / f"{name}.log").open("ab") as log:
            return subprocess.Popen(
                [self.ray, "start", *args],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def start_head(self, timeout: float = 120.0) -> None:
        """Start the head and connect this process to it as a driver."""
        import ray

        args = ["--head", f"--port={self.port}"]
        args += ["--include-dashboard=false", f"--dashboard-port={master_port()}"]
        self.head = self._start("head", args + self._node_args("head", {"head_node": 1}))
        deadline = time.time() + timeout
        while not ray.is_initialized():
            assert self.head.poll() is None, self.log("head")
            assert time.time() < deadline, f"no head after {timeout:.0f}s: " + self.log("head")
            if (self.root / "head" / "ray_current_cluster").exists():  # written once it is up
                ray.init(address=self.address, log_to_driver=False)
            else:
                time.sleep(0.5)

    def alive_nodes(self) -> list[dict[str, Any]]:
        import ray

        return [n for n in ray.nodes() if n["Alive"]]

    def add_worker(self, timeout: float = 120.0) -> str:
        """Start a worker raylet and wait until the cluster shows it alive; its node id."""
        before = {n["NodeID"] for n in self.alive_nodes()}
        n = len(self.workers)
        args = [f"--address={self.address}", "--include-log-monitor=false"]
        self.workers.append(
            self._start(f"worker{n}", args + self._node_args(f"w{n}", {"env_node": 2}))
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.workers[-1].poll() is None, self.log(f"worker{n}")
            new = [
                x
                for x in self.alive_nodes()
                if x["NodeID"] not in before and x["Resources"].get("env_node") == 2
            ]
            if new:
                self.worker_node = new[0]["NodeID"]
                return str(self.worker_node)
            time.sleep(0.5)
        raise AssertionError(
            f"worker node {n} did not join within {timeout:.0f}s: " + self.log(f"worker{n}")
        )

    def log(self, name: str) -> str:
        p = self.root / f"{name}.log"
        return p.read_text(errors="replace")[-3000:] if p.exists() else ""

    def raylet(self, proc: subprocess.Popen[bytes]) -> Any:
        import psutil

        kids = [c for c in psutil.Process(proc.pid).children() if c.name().startswith("raylet")]
        assert len(kids) == 1, kids
        return kids[0]

    def kill_worker(self, wait: float = 60.0) -> list[int]:
        """SIGKILL the live worker's raylet (a lost node); the pids of the processes it ran
        (its Ray workers: they must exit on their own when their raylet is gone)."""
        import psutil

        proc = self.workers[-1]
        raylet = self.raylet(proc)
        hosted = [c.pid for c in raylet.children(recursive=True)]
        raylet.send_signal(signal.SIGKILL)
        proc.wait(timeout=wait)  # `ray start --block` kills the node's other processes, exits
        _, alive = psutil.wait_procs(
            [psutil.Process(p) for p in hosted if psutil.pid_exists(p)], timeout=wait
        )
        assert not alive, f"processes of the killed node still run: {alive}"
        return hosted

    def stop(self) -> None:
        import psutil

        for proc in [*self.workers, self.head]:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [*self.workers, self.head]:
            if proc is not None:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        left = _marked(self.marker)
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("psutil")
    c = LocalCluster()
    saved = {k: os.environ.get(k) for k in AUTH_VARS}
    os.environ.update({k: c.env[k] for k in AUTH_VARS if k in c.env})  # this driver's too
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    import ray

    if ray.is_initialized():  # another module's in-process Ray: this module has its own
        ray.shutdown()
    try:
        c.start_head()
        c.add_worker()
        yield c
    finally:
        ray.shutdown()
        c.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def live(cluster):
    """The cluster with a live worker node (a test before may have killed it)."""
    if cluster.workers[-1].poll() is not None:
        cluster.add_worker()
    return cluster


def test_two_raylets_on_localhost(live):
    import ray

    nodes = {n["NodeID"]: n for n in live.alive_nodes()}
    assert len(nodes) == 2
    head = next(i for i, n in nodes.items() if "head_node" in n["Resources"])
    assert nodes[head]["Resources"]["CPU"] == 1 and nodes[head]["Resources"]["head_node"] == 1
    worker = nodes[live.worker_node]["Resources"]
    assert worker["CPU"] == 1 and worker["env_node"] == 2 and "head_node" not in worker
    assert ray.get_runtime_context().get_node_id() == head  # the driver joined the head

    def _where() -> tuple[str, str]:  # defined here: pickled by value, not by module
        import salvage

        return ray.get_runtime_context().get_node_id(), salvage.__file__

    where = ray.remote(num_cpus=0)(_where)
    on_worker = ray.get(where.options(resources={"env_node": 1}).remote(), timeout=120)
    on_head = ray.get(where.options(resources={"head_node": 1}).remote(), timeout=120)
    assert on_worker[0] == live.worker_node and on_head[0] == head
    # the Ray workers of both nodes import this tree (the raylets' PYTHONPATH)
    for _, path in (on_worker, on_head):
        assert Path(path).resolve().is_relative_to(ROOT), path


def _tasks(n: int = 4) -> list[dict[str, Any]]:
    from salvage.envs import make_env

    return make_env("scripted").list_tasks("train", num_tasks=n, length=3)


def test_env_actors_are_placed_on_the_worker_node_by_resources(live):
    from salvage.datamodules.agent import EnvSpec
    from salvage.envs.ray_pool import RayEnvPool

    for bad, why in (
        ({"CPU": 1}, "names 'CPU': only custom resources here"),
        ({"env_node": -1}, "asks for -1 of 'env_node': amounts are numbers >= 0"),
        ("env_node", "must be a mapping resource name -> number"),
    ):
        with pytest.raises(ValueError, match=rf"data\.env\.ray_resources={bad!r} {why}"):
            EnvSpec(name="scripted", backend="ray", num_workers=1, ray_resources=bad)
    # 2 actors of half a CPU each: the worker node has one
    spec = EnvSpec(
        name="scripted",
        backend="ray",
        num_workers=2,
        ray_num_cpus=0.5,
        ray_resources={"env_node": 1},
    )
    tasks = _tasks(2)
    with RayEnvPool(
        "scripted",
        num_workers=spec.num_workers,
        address=live.address,
        num_cpus=spec.ray_num_cpus,
        resources=spec.ray_resources,
        startup_timeout_s=120,
    ) as pool:
        assert pool.actor_nodes() == [live.worker_node, live.worker_node]
        pool.reset([(e, tasks[e], 0) for e in range(2)])
        for k in range(3):
            res = pool.step([(e, tasks[e]["solution"][k]) for e in range(2)])
        assert all(r.ok and r.value.info["won"] for r in res)


def _pool(cluster: LocalCluster, **kw: Any) -> Any:
    from salvage.envs.ray_pool import RayEnvPool

    kw.setdefault("startup_timeout_s", 180)
    return RayEnvPool(
        "scripted",
        {"step_delay_s": 2.0},
        num_workers=2,
        step_timeout_s=60,
        address=cluster.address,
        num_cpus=0.5,
        resources={"env_node": 1},
        **kw,
    )


def test_worker_node_killed_mid_batch_episodes_fail_over_to_a_new_node(live):
    """Each actor is 2 s into the first of its 2 steps when its node's raylet is SIGKILLed;
    a fresh worker node joins. Per actor the step in flight fails (logged, counted), the
    actor is replaced on the new node, its other episode is restored by replay and its
    step re-run; the batch returns and those episodes go on to win."""
    tasks = _tasks(4)
    old = live.worker_node
    with _pool(live) as pool:
        pool.reset([(e, tasks[e], 0) for e in range(4)])
        first = pool.step([(e, tasks[e]["solution"][0]) for e in range(4)])
        assert all(r.ok for r in first)
        out: dict[str, Any] = {}

        def batch() -> None:
            t0 = time.time()
            try:
                out["res"] = pool.step([(e, tasks[e]["solution"][1]) for e in range(4)])
            except Exception as e:  # noqa: BLE001 - reported by the test below
                out["error"] = e
            out["s"] = time.time() - t0

        runner = threading.Thread(target=batch)
        runner.start()
        time.sleep(1.0)  # actor 0 is in episode 0's step, actor 1 in episode 1's
        hosted = live.kill_worker()
        assert hosted  # the actors' processes were on that node, and exited with it
        new = live.add_worker()
        runner.join(timeout=400)
        assert not runner.is_alive(), "the batch hangs after the node was lost"
        assert "error" not in out, repr(out.get("error"))
        res = out["res"]
        # episode e lives on actor e % 2; each actor loses exactly the step in flight
        for w in (0, 1):
            mine = [res[e] for e in (w, w + 2)]
            assert sum(not r.ok for r in mine) == 1, [r.error for r in mine]
            err = next(r.error for r in mine if not r.ok)
            assert f"env actor {w}:" in err and ("actor lost" in err or "hung" in err), err
        assert pool.restarts == 2 and pool.errors == 2
        assert len(pool.error_log) == 2
        assert new != old and pool.actor_nodes() == [new, new]
        # the surviving episodes were rebuilt on the new node: they finish and win
        alive = [e for e in range(4) if res[e].ok]
        fin = pool.step([(e, tasks[e]["solution"][2]) for e in alive])
        assert all(r.ok and r.value.info["won"] for r in fin), [r.error for r in fin]
        assert out["s"] < 300


def test_no_node_left_for_the_actors_fails_in_bounded_time(live):
    """The worker node is lost and none replaces it: the pool's call ends within the step
    and start-up timeouts with an error naming the resources (no hang)."""
    tasks = _tasks(2)
    pool = _pool(live, startup_timeout_s=20)
    try:
        pool.reset([(e, tasks[e], 0) for e in range(2)])
        live.kill_worker()
        t0 = time.time()
        with pytest.raises(RuntimeError, match=r"start-up timeout 20s.*\{'env_node': 1\}"):
            pool.step([(e, tasks[e]["solution"][0]) for e in range(2)])
        assert time.time() - t0 < 60 + 20 + 30  # step timeout + start-up timeout + slack
    finally:
        pool.close()


FIT = """\
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 3
  enable_progress_bar: false
  default_root_dir: {run}
model:
  class_path: salvage.modules.grpo.GRPOModule
  init_args:
    policy: {{name_or_path: tiny}}
    lr: 1.0e-4
    num_minibatches: 1
    micro_batch_size: 16
    kl_coef: 0.0
data:
  class_path: salvage.datamodules.agent.AgentDataModule
  init_args:
    env:
      name: scripted
      kwargs: {{step_delay_s: 1.0}}
      train_tasks: {{num_tasks: 4, length: 3}}
      backend: ray
      num_workers: 2
      ray_address: "{address}"
      ray_num_cpus: 0.5
      ray_resources: {{env_node: 1}}
      step_timeout_s: 60
    max_turns: 3
    tasks_per_step: 2
    group_size: 2
    engine: {{temperature: 1.0, max_new_tokens: 8}}
"""


def test_fit_goes_on_when_the_env_node_is_killed_mid_update(live, tmp_path):
    """``salvage fit`` (GRPO, tiny, scripted env on 2 Ray actors on the worker node): the
    worker's raylet is SIGKILLed after update 1, a new worker node joins; the episodes in
    flight fail (logged, counted in ``env/errors``), the actors are replaced on the new node
    (the only one with ``env_node``), and the fit ends its 3 updates with exit 0."""
    run = tmp_path / "run"
    cfg = tmp_path / "fit.yaml"
    cfg.write_text(FIT.format(run=run, address=live.address), encoding="utf-8")
    log = tmp_path / "fit.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "salvage", "fit", "--config", str(cfg)],
            cwd=tmp_path,
            env=live.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.time() + 600
        while not list(run.glob("**/last.ckpt")):  # update 1 is done
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.time() < deadline, "no checkpoint after 600 s"
            time.sleep(0.5)
        time.sleep(1.0)
        live.kill_worker()
        live.add_worker()
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text(errors="replace")
    assert rc == 0, text[-3000:]
    assert "actor lost" in text or "hung" in text, text[-3000:]
    rows = list(csv.DictReader(next(run.glob("version_0/metrics.csv")).open()))
    steps = [r for r in rows if r.get("env/errors")]
    assert len(steps) == 3, rows
    errors = [float(r["env/errors"]) for r in steps]
    assert errors[0] == 0 and sum(errors) >= 1, errors  # the lost node's episodes, counted


STUDY = """\
base: {base}
baseline: grpo
seeds: [0]
overrides:
  - trainer.max_steps: 12
    trainer.enable_progress_bar: false
    data.init_args.prompts_per_step: 2
    data.init_args.engine.max_new_tokens: 8
  # 0.5 s an update: the fits last long enough to lose a node mid-run (~1 s without)
  - --trainer.callbacks+ tests.multinode.Pace
methods:
  grpo: []
  drgrpo: [{{data.init_args.advantage: drgrpo}}]
"""


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _logged_step(run: Path) -> bool:
    """Whether a metrics.csv of ``run`` holds a row with a step."""
    for path in run.glob("version_*/metrics.csv"):
        try:
            with path.open(newline="") as f:
                if any(r.get("step") for r in csv.DictReader(f)):
                    return True
        except (OSError, csv.Error):
            continue
    return False


def test_study_runs_two_runs_at_once_and_a_run_whose_node_dies_resumes(live, tmp_path):
    """``salvage study --backend ray --ray-address`` on the cluster: each run a Ray task of one
    CPU, one per node, both fits at once. The worker's raylet is SIGKILLed once its run has a
    checkpoint: that run is reported lost, the other finishes; the next call resumes it from
    its ``last.ckpt`` (``--ckpt_path last``) and the study completes."""
    import psutil

    f = tmp_path / "s.yaml"
    f.write_text(STUDY.format(base=ROOT / "configs/grpo/math_tiny.yaml"), encoding="utf-8")
    out = tmp_path / "study"
    cmd = [sys.executable, "-m", "salvage", "study", str(f), "--out", str(out)]
    cmd += ["--backend", "ray", "--ray-address", live.address]
    runs = {m: out / m / "seed0" for m in ("grpo", "drgrpo")}
    log = tmp_path / "study1.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            cmd, env=live.env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.time() + 600
        pids: dict[str, int | None] = {}
        while not all(pids.get(m) for m in runs):  # both fits start: two runs at once
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.time() < deadline, "the two fits did not both start"
            pids = {m: _pid(d / "child.pid") for m, d in runs.items()}
            time.sleep(0.5)
        assert all(psutil.pid_exists(p) for p in pids.values() if p)
        on_worker = {c.pid for c in live.raylet(live.workers[-1]).children(recursive=True)}
        lost = [m for m, p in pids.items() if p in on_worker]
        assert len(lost) == 1, (pids, on_worker)  # one run on each node
        victim, other = lost[0], next(m for m in runs if m != lost[0])
        # a checkpoint and a logged step: Lightning writes last.ckpt before that step's
        # metrics row, and a kill in between would leave the killed run without one
        while not (_logged_step(runs[victim]) and list(runs[victim].glob("**/last.ckpt"))):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.time() < deadline, "the run on the worker wrote no checkpoint"
            time.sleep(0.5)
        live.kill_worker()  # the run's Ray worker and its fit end with the node
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    first = log.read_text(errors="replace")
    assert rc == 1, first[-3000:]
    assert (runs[other] / "done.json").exists() and not (runs[victim] / "done.json").exists()
    assert f"{victim}/seed0" in first and "resumes on the next call" in first, first[-3000:]

    live.add_worker()
    res = subprocess.run(cmd, env=live.env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "2 runs, 1 done, 1 to run" in res.stdout
    done = json.loads((runs[victim] / "done.json").read_text())
    assert done["returncode"] == 0 and done["command"][-2:] == ["--ckpt_path", "last"]
    # the resumed fit went on from the checkpoint: a second version, updates up to 12 in all
    versions = sorted(p.parent.name for p in runs[victim].glob("version_*/metrics.csv"))
    assert versions == ["version_0", "version_1"], versions
    steps = {
        v: sorted(
            int(r["step"])
            for r in csv.DictReader((runs[victim] / v / "metrics.csv").open())
            if r.get("step")
        )
        for v in versions
    }
    assert steps["version_0"][-1] < 11, steps  # stopped by the node's loss
    assert 0 < steps["version_1"][0] <= steps["version_0"][-1] + 1, steps  # not from scratch
    assert steps["version_1"][-1] == 11, steps
