"""Start ``salvage fit`` as a multi-node job on this machine (loopback, gloo, CPU).

Used by ``test_multinode.py``. A "node" here is a set of processes given a node rank; all of
them talk through ``127.0.0.1``, the way the same command would run on N machines with
``MASTER_ADDR`` set to the first one. Three ways to start them, each the way a cluster does:

- ``torchrun``: one ``torchrun --nnodes N --node-rank r`` agent per node (its static
  rendezvous on ``MASTER_ADDR:MASTER_PORT``), each starting its node's processes; Lightning
  detects ``TorchElasticEnvironment``.
- ``env``: every process started by hand with ``MASTER_ADDR``, ``MASTER_PORT``,
  ``NODE_RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``RANK`` (``LightningEnvironment``:
  Lightning starts nothing when ``LOCAL_RANK`` is set).
- ``node``: one command per node with ``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK`` and
  ``WORLD_SIZE`` (Lightning's own way for a cluster without a launcher: it starts the
  node's other processes itself; ``LightningEnvironment``).
- ``slurm``: every process with the variables ``srun`` exports (``SLURM_NTASKS``,
  ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``, ...; ``SLURMEnvironment``).

``start`` runs any such commands, e.g. ``scripts/slurm_fit.sbatch`` under ``sbatch_env`` with
the ``srun`` / ``scontrol`` of ``fake_slurm`` first on ``PATH``, or ``scripts/torchrun_fit.sh``
once per node under ``torchrun_env``. ``python -m salvage`` is the ``salvage`` entry point. The runs use a reward that depends
on the sampled text (``OddLength``), so that groups have a learning signal and the
parameters move; ``Capture`` (a callback appended with ``--trainer.callbacks+``) records
which tasks each global rank trained on at each step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L

from salvage.tasks.math import Reward, RewardResult
from salvage.types import RolloutBatch
from tests.ports import master_port

ROOT = Path(__file__).resolve().parents[1]
CAPTURE_VAR = "SALVAGE_TEST_CAPTURE"
DIE_VAR = "SALVAGE_TEST_DIE"
"""``RANK:STEP``: global rank RANK kills itself (SIGKILL) when step STEP starts."""
_LAUNCH_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip


class OddLength(Reward):
    """1 for a response of odd length in characters: a verdict on the sample itself."""

    def __call__(self, response: str, answer: str) -> RewardResult:
        ok = len(response) % 2 == 1
        return RewardResult(reward=float(ok), success=ok)


class Pace(L.Callback):
    """Sleep ``seconds`` after each update: a 12-update tiny fit takes ~1 s here, too short
    for a test to kill its node between its first checkpoint and its end."""

    def __init__(self, seconds: float = 0.5) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        time.sleep(self.seconds)


class Capture(L.Callback):
    """Write ``tasks_<global rank>_<step>.json`` (the task ids of the rank's rollout batch)
    and ``ranks_<global rank>.json`` (global / local / node rank, world size, how many times
    the process read the model's weights) into
    ``$SALVAGE_TEST_CAPTURE``; with ``$SALVAGE_TEST_DIE`` set, kill that rank at that step."""

    def __init__(self) -> None:
        self.out = Path(os.environ[CAPTURE_VAR])
        self.out.mkdir(parents=True, exist_ok=True)
        self.loads = 0  # real weights read by this process (GRPO's load_model, still called)
        from salvage.modules import grpo

        real = grpo.load_model

        def counted(*a: Any, **kw: Any) -> Any:
            self.loads += 1
            return real(*a, **kw)

        grpo.load_model = counted  # type: ignore[assignment]

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        ranks = {
            "global": trainer.global_rank,
            "local": trainer.local_rank,
            "node": trainer.node_rank,
            "world": trainer.world_size,
            "cluster": type(trainer.strategy.cluster_environment).__name__,
            "weight_loads": self.loads,
        }
        (self.out / f"ranks_{trainer.global_rank}.json").write_text(json.dumps(ranks))

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        die = os.environ.get(DIE_VAR)
        if die and tuple(map(int, die.split(":"))) == (trainer.global_rank, trainer.global_step):
            os.kill(os.getpid(), signal.SIGKILL)  # a node lost mid-run: no clean-up at all
        if isinstance(batch, RolloutBatch):
            ids = [g.task_id for g in batch.groups]
            name = f"tasks_{trainer.global_rank}_{trainer.global_step}.json"
            (self.out / name).write_text(json.dumps(ids))


def free_port() -> int:
    """A rendezvous port no other worker of this test session hands out (tests/ports.py)."""
    return master_port()


def fit_args(
    out: Path,
    nodes: int | None,
    devices: int | None,
    steps: int = 2,
    *extra: str,
    fsdp: bool = False,
    method: str = "grpo",
) -> list[str]:
    """``salvage fit`` of GRPO on ``tiny`` (configs/grpo/math_tiny.yaml), DDP on CPU (``fsdp``:
    FSDP2, ``configs/trainer/fsdp.yaml`` in float32); without ``--trainer.num_nodes`` /
    ``--trainer.devices`` when None (a launch script sets them). ``method``: another entry
    of ``METHODS`` (GRAFT's pair, VH-GPO on TextWorld-Express) instead of GRPO."""
    strategy = ["--trainer.strategy", "ddp"]
    if fsdp or method == "graft":  # co-training runs on FSDP2 (DDP refuses it: cotrain.py)
        strategy = ["--config", "configs/trainer/fsdp.yaml"]
        strategy += ["--model.init_args.fsdp.param_dtype", "float32"]
    shape: list[str] = []
    if nodes is not None:
        shape += ["--trainer.num_nodes", str(nodes)]
    if devices is not None:
        shape += ["--trainer.devices", str(devices)]
    return [
        "fit",
        *METHODS[method],
        *strategy,
        "--trainer.accelerator",
        "cpu",
        *shape,
        "--trainer.max_steps",
        str(steps),
        "--trainer.default_root_dir",
        str(out),
        "--trainer.callbacks+",
        "tests.multinode.Capture",
        *extra,
    ]


METHODS: dict[str, list[str]] = {
    "grpo": ["--config", "configs/grpo/math_tiny.yaml", "--data.init_args.reward", "tests.multinode.OddLength"],
    # the pair of tokenizers, each model's groups scored by the sample's length: groups where
    # one model fails and the other succeeds, so the exchange moves responses
    "graft": ["--config", "configs/graft/math_tiny.yaml", "--data.init_args.reward", "tests.multinode.OddLength"],
    # VH-GPO's study setting on twc (docs/results/vhgpo_twx): its warm-started student (an
    # untrained one makes only invalid moves, so every group is alike and nothing trains),
    # the oracle teacher, 4 games x G 4; each rank runs its own environment pool
    "vhgpo": [
        "--config", "configs/vhgpo/twx_tiny.yaml", "--trainer.callbacks", "[]",
        "--model.init_args.policy", '{"name_or_path": "docs/results/vhgpo_twx/warmstart_policy"}',
        "--model.init_args.lr", "1e-3",
        "--data.init_args.tasks_per_step", "4", "--data.init_args.max_turns", "8",
        "--data.init_args.max_prompt_tokens", "1024",
        "--data.init_args.agent", '{"history_k": 2, "invalid_penalty": 0.0}',
        "--data.init_args.engine", '{"temperature": 1.0, "max_new_tokens": 48}',
        "--data.init_args.env.kwargs", '{"plan_max_nodes": 3000}',
        "--data.init_args.env.train_tasks",
        '{"game": "twc", "params": "numLocations=1,numItemsToPutAway=2", "num_tasks": 16}',
        "--trainer.limit_val_batches", "0",
    ],
}  # fmt: skip
"""The ``salvage fit`` arguments of each method's run (before the strategy and shape)."""


def _base_env(capture: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        OMP_WAIT_POLICY="PASSIVE",
        SALVAGE_PROGRESS="0",
        WANDB_MODE="offline",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env[CAPTURE_VAR] = str(capture)
    return env


def _wait(
    procs: list[subprocess.Popen[str]], logs: list[Path], timeout: float, check: bool = True
) -> list[str]:
    """Wait for every process; when one fails or the time is up, kill the rest (as
    ``srun --kill-on-bad-exit`` and torchrun do) and, if ``check``, fail with the logs."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    texts = [log.read_text() for log in logs]
    bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    if bad and check:
        msg = "\n".join(f"--- process {i} (exit {rc}):\n{texts[i][-3000:]}" for i, rc in bad)
        raise AssertionError(f"multi-node run failed: {bad}\n{msg}")
    return texts


def launch(
    style: str,
    out: Path,
    nodes: int,
    devices: int,
    *extra: str,
    steps: int = 2,
    timeout: float = 900,
    capture: str = "capture",
    env: dict[str, str] | None = None,
    check: bool = True,
    fsdp: bool = False,
    method: str = "grpo",
) -> list[str]:
    """Run ``salvage fit`` on ``nodes`` x ``devices`` processes started as ``style`` starts
    them (``torchrun``, ``env``, ``node``, ``slurm``; ``single``: one command on one node,
    Lightning starting the other local processes). ``capture``: the folder of ``out`` that
    ``Capture`` writes to (and the prefix of the logs); ``env``: more variables for every
    process; ``check``: fail if a process fails; ``fsdp``: FSDP2 instead of DDP; ``method``: see
    ``fit_args``. Returns each started process's output."""
    env0 = dict(_base_env(out / capture), **(env or {}))
    port = str(free_port())
    args = fit_args(out, nodes, devices, steps, *extra, fsdp=fsdp, method=method)
    cmds: list[tuple[list[str], dict[str, str]]] = []
    if style == "single":
        assert nodes == 1
        # Lightning starts the other local processes; the port is ours, not one it picks
        cmds.append(([sys.executable, "-m", "salvage", *args], dict(env0, MASTER_PORT=port)))
    elif style == "node":
        for node in range(nodes):
            env = dict(env0, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node))
            env["WORLD_SIZE"] = str(nodes * devices)
            cmds.append(([sys.executable, "-m", "salvage", *args], env))
    elif style == "torchrun":
        for node in range(nodes):
            run = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}"]
            run += [f"--nproc-per-node={devices}", f"--node-rank={node}"]
            run += ["--master-addr=127.0.0.1", f"--master-port={port}"]
            cmds.append(([*run, "-m", "salvage", *args], env0))
    else:
        world = nodes * devices
        for node in range(nodes):
            for local in range(devices):
                rank = node * devices + local
                env = dict(env0, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                if style == "env":
                    env.update(
                        NODE_RANK=str(node), LOCAL_RANK=str(local), RANK=str(rank),
                        WORLD_SIZE=str(world),
                    )  # fmt: skip
                elif style == "slurm":
                    env.update(slurm_env(nodes, devices, node, local))
                else:
                    raise ValueError(style)
                cmds.append(([sys.executable, "-m", "salvage", *args], env))
    return start(cmds, out, timeout, prefix=capture, check=check)


def start(
    cmds: list[tuple[list[str], dict[str, str]]],
    out: Path,
    timeout: float = 900,
    prefix: str = "launch",
    check: bool = True,
) -> list[str]:
    """Start every ``(command, environment)`` at once (in the repository root), output to
    ``out/<prefix>_<i>.log``; wait for all of them (see ``_wait``) and return their output."""
    out.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    for i, (cmd, env) in enumerate(cmds):
        log = out / f"{prefix}_{i}.log"
        logs.append(log)
        with open(log, "w") as f:
            procs.append(
                subprocess.Popen(
                    cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, text=True
                )
            )
    return _wait(procs, logs, timeout, check)


FAKE_SRUN = """#!{python}
# srun for one machine: start SLURM_NNODES x SLURM_NTASKS_PER_NODE tasks of the command with
# the per-task variables srun exports; exit with the worst exit status.
import os, subprocess, sys

args = sys.argv[1:]
while args and args[0].startswith("-"):
    args.pop(0)  # srun's own options
nodes, per = int(os.environ["SLURM_NNODES"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
procs = []
for node in range(nodes):
    for local in range(per):
        env = dict(os.environ, SLURM_NODEID=str(node), SLURM_LOCALID=str(local),
                   SLURM_PROCID=str(node * per + local), SLURM_NTASKS=str(nodes * per),
                   SLURM_NODELIST=os.environ["SLURM_JOB_NODELIST"])
        procs.append(subprocess.Popen(args, env=env))
sys.exit(max(p.wait() for p in procs))
"""


def fake_slurm(bin_dir: Path) -> Path:
    """``srun`` and ``scontrol`` for this machine in ``bin_dir`` (put it first on ``PATH``):
    every "node" of the job is 127.0.0.1."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    srun = bin_dir / "srun"
    srun.write_text(FAKE_SRUN.replace("{python}", sys.executable))
    scontrol = bin_dir / "scontrol"
    scontrol.write_text("#!/bin/sh\n# scontrol show hostnames LIST\necho 127.0.0.1\n")
    for f in (srun, scontrol):
        f.chmod(0o755)
    return bin_dir


def sbatch_env(capture: Path, nodes: int, tasks_per_node: int, bin_dir: Path) -> dict[str, str]:
    """The environment ``sbatch --nodes N --ntasks-per-node T`` gives the batch script."""
    env = _base_env(capture)
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="salvage-fit",
        SLURM_JOB_NODELIST="127.0.0.1",
        SLURM_NNODES=str(nodes),
        SLURM_NTASKS=str(nodes * tasks_per_node),
        SLURM_NTASKS_PER_NODE=str(tasks_per_node),
        SLURM_CPUS_PER_TASK="1",
        MASTER_PORT=str(free_port()),
        SALVAGE=f"{sys.executable} -m salvage",
    )
    return env


def torchrun_env(capture: Path, nodes: int, node: int, gpus: int, port: int) -> dict[str, str]:
    """The variables ``scripts/torchrun_fit.sh`` reads on node ``node``."""
    env = _base_env(capture)
    env.update(
        NNODES=str(nodes),
        NODE_RANK=str(node),
        GPUS_PER_NODE=str(gpus),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHRUN=f"{sys.executable} -m torch.distributed.run",
    )
    return env


def slurm_env(nodes: int, tasks_per_node: int, node: int, local: int) -> dict[str, str]:
    """What ``srun`` exports to task ``local`` of node ``node`` in an ``sbatch --nodes N
    --ntasks-per-node T`` job (the variables Lightning's ``SLURMEnvironment`` reads)."""
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "salvage-fit",
        "SLURM_NNODES": str(nodes),
        "SLURM_NTASKS": str(nodes * tasks_per_node),
        "SLURM_NTASKS_PER_NODE": str(tasks_per_node),
        "SLURM_NODELIST": "127.0.0.1",
        "SLURM_NODEID": str(node),
        "SLURM_PROCID": str(node * tasks_per_node + local),
        "SLURM_LOCALID": str(local),
    }
