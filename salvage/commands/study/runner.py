"""How ``salvage study`` runs its fits: one process each, with locks, signals and backends.

- ``execute``: one ``salvage fit`` as its own session, its output in ``RUN/fit.log``,
  ``done.json`` on exit 0; ``RUN/.lock`` held meanwhile (``lock``: an ``flock`` recording
  pid, host and start time; ``Busy`` naming the holder).
- ``forwarding_signals``: SIGTERM / SIGINT stop the study: the first one sends SIGTERM to
  each running fit, a second one kills their process groups.
- ``run_all``: the runs on the local backend (``jobs`` at a time) or as Ray tasks
  (``ray_resources``); ``run_env``: each run's environment (W&B group, job type, name).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import yaml

import salvage
from salvage.commands import EXIT_INTERRUPTED, EXIT_STOPPED
from salvage.commands.study.spec import Run, Study
from salvage.errors import ConfigError

if sys.platform != "win32":
    import fcntl

EXIT_FAILED = 1
EXIT_BUSY = 2
STOPPED = {EXIT_STOPPED, EXIT_INTERRUPTED, -signal.SIGTERM, -signal.SIGINT}
"""Exit codes of a run stopped by a signal: not done, resumed on the next call."""


def run_env(study: Study, run: Run) -> dict[str, str]:
    """The run's environment: W&B group = study, job type = method, name = method-seed."""
    env = dict(os.environ)
    env["WANDB_RUN_GROUP"] = study.name
    env["WANDB_JOB_TYPE"] = "calibration" if run.calibration else run.method
    env["WANDB_NAME"] = f"{'calibration-' if run.calibration else ''}{run.method}-seed{run.seed}"
    # from a source checkout, the child imports the same salvage as this process
    root = Path(salvage.__file__ or ".").resolve().parents[1]
    if (root / "pyproject.toml").is_file():
        env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    return env


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # atomic: a marker is whole or absent


class Busy(ValueError):
    """A study dir or run dir locked by another live process (the message names it)."""


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _write_holder(f: IO[str], **extra: Any) -> None:
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": now()} | extra))
    f.write("\n")
    f.flush()


def _holder(text: str) -> str:
    try:
        h = json.loads(text)
        who = f"pid {h['pid']} on {h['host']} since {h['since']}"
        return who + (f" (running pid {h['child']})" if h.get("child") else "")
    except (ValueError, KeyError, TypeError):
        return "another process"


def lock(path: Path, what: str) -> IO[str]:
    """Hold an exclusive ``flock`` on ``path`` (it records pid, host and start time) until
    the returned file is closed (or every process holding it has exited); ``Busy``, naming
    the holder, when another process holds it. No lock on Windows."""
    f = path.open("a+", encoding="utf-8")
    if sys.platform == "win32":  # pragma: no cover
        return f
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        who = _holder(f.read())
        f.close()
        raise Busy(f"{what} is in use by {who} (lock {path})") from None
    _write_holder(f)
    return f


@functools.lru_cache(maxsize=1)
def _prctl() -> Any:
    """libc's ``prctl`` (Linux), looked up before any fork; None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover
        return None
    fn.restype = ctypes.c_int
    return fn


PR_SET_PDEATHSIG = 1


def _child_setup() -> Callable[[], None] | None:
    """``preexec_fn`` of a run: on Linux, SIGTERM it when the thread that started it dies
    (``kill -9`` of ``salvage study``), so a run never outlives its study unattended."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def setup() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:  # the study died before prctl took effect
            os._exit(EXIT_STOPPED)

    return setup


_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}
_CHILDREN_LOCK = threading.RLock()  # re-entrant: the signal handler runs in the main thread
_STOP = threading.Event()
_STOP_SIGNALS: list[int] = []


def _signal_children(sig: int, group: bool) -> None:
    """Send ``sig`` to every running run (its ``salvage fit``, or its whole process group)."""
    with _CHILDREN_LOCK:
        procs = list(_CHILDREN.values())
    for proc in procs:
        if proc.returncode is not None:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(proc.pid, sig)  # the run is its own session: pgid = its pid
            else:
                os.kill(proc.pid, sig)


@contextlib.contextmanager
def forwarding_signals() -> Iterator[None]:
    """While the study runs: SIGTERM / SIGINT stop it. The first signal sends SIGTERM to each
    running fit (it ends its update, writes ``last.ckpt`` and exits 75) and starts no
    further run; a second one kills the runs' process groups (SIGKILL). Main thread only."""
    _STOP.clear()
    _STOP_SIGNALS.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: Any) -> None:
        first = not _STOP.is_set()
        _STOP.set()
        _STOP_SIGNALS.append(signum)
        name = signal.Signals(signum).name
        msg = (
            f"salvage study: {name}: stopping the running fits (each ends its update and "
            "checkpoints); no further run starts; again to kill them\n"
            if first
            else f"salvage study: {name} again: killing the running fits\n"
        )
        os.write(2, msg.encode())  # not print: the handler may interrupt a print
        _signal_children(signal.SIGTERM if first else signal.SIGKILL, group=not first)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def execute(cmd: list[str], run_dir: str, env: dict[str, str]) -> int:
    """Run one fit, its output appended to ``RUN/fit.log``; write ``done.json`` on exit 0.

    The fit is its own session (a Ctrl-C at the terminal reaches the study, which stops it
    cleanly) and, on Linux, gets SIGTERM when the study dies. ``RUN/.lock`` is held while it
    runs (by this process and the fit: ``Busy`` when another holds it) and ``RUN/child.pid``
    holds its pid. Module-level so a Ray worker can call it."""
    d = Path(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    held = lock(d / ".lock", f"run dir {d}")
    try:
        with (d / "fit.log").open("a", encoding="utf-8") as log:
            log.write(f"\n$ {shlex.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                pass_fds=(held.fileno(),),  # the lock lasts as long as the fit, too
                preexec_fn=_child_setup(),
            )
            with _CHILDREN_LOCK:
                _CHILDREN[proc.pid] = proc
            try:
                _write_holder(held, child=proc.pid)
                (d / "child.pid").write_text(f"{proc.pid}\n", encoding="utf-8")
                if _STOP.is_set():  # the study was stopped while this run was starting
                    _signal_children(signal.SIGTERM, group=False)
                rc = proc.wait()
            finally:
                with _CHILDREN_LOCK:
                    _CHILDREN.pop(proc.pid, None)
                (d / "child.pid").unlink(missing_ok=True)
    finally:
        held.close()
    if rc == 0:
        write_json(
            d / "done.json",
            {
                "command": cmd,
                "returncode": rc,
                "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            },
        )
    return rc


def recorded_args(run: Run) -> list[str] | None:
    """The fit arguments a finished run recorded (without a resume's ``--ckpt_path``)."""
    try:
        cmd = json.loads((run.dir / "done.json").read_text(encoding="utf-8"))["command"]
        args = cmd[cmd.index("fit") + 1 :]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return args[:-2] if args[-2:] == ["--ckpt_path", "last"] else args


def ran_with_other_args(run: Run) -> bool:
    """Whether a finished run recorded fit arguments other than the plan's. A run restored
    from a committed record (``studies/record_runs.py --restore``) has the machine's paths
    made relative to the checkout, so the plan's paths are compared relative to it too."""
    had = recorded_args(run)
    if had is None or had == run.args:
        return False
    root = str(Path.cwd()).rstrip("/") + "/"
    return had != [a.replace(root, "") for a in run.args]


def recorded_command(run: Run) -> list[str] | None:
    try:
        cmd = json.loads((run.dir / "done.json").read_text(encoding="utf-8"))["command"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return cmd if isinstance(cmd, list) else None


def log_tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _merged_config(study: Study, configs: list[Path]) -> dict[str, Any]:
    """Base configs and fragments deep-merged (enough to read trainer.accelerator/devices)."""

    def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        out = dict(a)
        for k, v in b.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        return out

    cfg: dict[str, Any] = {}
    for c in [*study.base, *configs]:
        try:
            loaded = yaml.safe_load(c.read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"config file {str(c)!r} is not readable YAML: {first}") from None
        if isinstance(loaded, dict):
            cfg = merge(cfg, loaded)
    return cfg


def ray_resources(study: Study, run: Run, cluster_gpus: float = 0.0) -> dict[str, float]:
    """Ray task resources of a run: ``ray_resources`` from the study, else from the config
    and overrides: ``num_gpus = trainer.devices`` on a gpu/cuda accelerator (``auto``: when
    the cluster has GPUs), one CPU."""
    if study.ray_resources is not None:
        return dict(study.ray_resources)
    trainer = _merged_config(study, study.methods[run.method][0]).get("trainer") or {}
    acc, devices = trainer.get("accelerator", "auto"), trainer.get("devices", 1)
    toks = study.overrides + study.methods[run.method][1]
    for i, t in enumerate(toks[:-1]):
        if t == "--trainer.accelerator":
            acc = toks[i + 1]
        elif t == "--trainer.devices":
            devices = yaml.safe_load(toks[i + 1])
    acc = str(acc).lower()
    gpu = acc in ("gpu", "cuda") or (acc == "auto" and cluster_gpus > 0)
    if isinstance(devices, list):
        n = len(devices)
    elif isinstance(devices, int) and devices > 0:
        n = devices
    else:  # "auto" / -1: all of a node's devices; ask for one, set ray_resources for more
        n = 1
    return {"num_cpus": 1.0, "num_gpus": float(n) if gpu else 0.0}


Outcome = tuple[Run, int | None]
"""A run that did not finish: its exit code, or None when it was not started (study stopped)."""


def _report(r: Run, rc: int | None) -> None:
    log = r.dir / "fit.log"
    if rc is None:
        return
    if rc in STOPPED:
        print(f"  {r.label}: stopped by a signal (exit {rc}); resumes on the next call", flush=True)
    else:
        print(
            f"  {r.label}: exit code {rc}; last lines of {log}:\n" + log_tail(log), file=sys.stderr
        )


def _run_local(study: Study, todo: list[Run], jobs: int = 1) -> list[Outcome]:
    """Run ``todo`` in plan order, ``jobs`` runs at a time (each its own process); the runs
    that did not finish, with their exit codes."""

    def one(i: int, r: Run) -> Outcome | None:
        if _STOP.is_set():
            return r, None
        cmd = r.command()
        how = "resuming" if "--ckpt_path" in cmd else "starting"
        print(f"[{i}/{len(todo)}] {how} {r.label} -> {r.dir}", flush=True)
        try:
            rc = execute(cmd, str(r.dir), run_env(study, r))
        except Busy as e:
            print(f"  {r.label}: not started: {e}", file=sys.stderr)
            return r, EXIT_BUSY
        if rc == 0:
            return None
        _report(r, rc)
        return r, rc

    if jobs <= 1:
        res = [one(i, r) for i, r in enumerate(todo, 1)]
    else:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            res = list(pool.map(one, range(1, len(todo) + 1), todo))
    return [o for o in res if o is not None]


def _run_ray(study: Study, todo: list[Run], address: str | None) -> list[Outcome]:
    try:
        import ray
    except ImportError as e:  # pragma: no cover - depends on the install
        raise SystemExit("--backend ray needs ray: pip install 'salvage[ray]'") from e
    ray.init(address=address, ignore_reinit_error=True)
    # no retry by Ray: a retry would re-run the command as submitted (from scratch, not from
    # the run's last.ckpt) and can meet the lost fit still holding RUN/.lock; the next call resumes
    task = ray.remote(max_retries=0)(execute)
    gpus = float(ray.cluster_resources().get("GPU", 0.0))
    refs = {}
    for r in todo:
        opts = ray_resources(study, r, gpus)
        print(f"submitting {r.label} ({opts}) -> {r.dir}", flush=True)
        refs[task.options(**opts).remote(r.command(), str(r.dir), run_env(study, r))] = r
    failed: list[Outcome] = []
    for ref, r in refs.items():
        try:
            rc = ray.get(ref)
        except ray.exceptions.RayError as e:  # its worker or node lost, or execute raised
            cause = getattr(e, "cause", None)
            if isinstance(cause, Busy):
                print(f"  {r.label}: not started: {cause}", file=sys.stderr)
                failed.append((r, EXIT_BUSY))
                continue
            why = (str(e).strip().splitlines() or [""])[0][:200]
            print(
                f"  {r.label}: its Ray task failed ({type(e).__name__}: {why}); "
                "resumes on the next call",
                file=sys.stderr,
            )
            failed.append((r, EXIT_FAILED))
            continue
        if rc != 0:
            _report(r, rc)
            failed.append((r, rc))
    return failed


def run_all(
    study: Study, todo: list[Run], backend: str, address: str | None, jobs: int
) -> list[Outcome]:
    return _run_ray(study, todo, address) if backend == "ray" else _run_local(study, todo, jobs)


def stop_requested() -> bool:
    """Whether a SIGTERM / SIGINT asked the study to stop (no further run starts)."""
    return _STOP.is_set()


def stop_code() -> int:
    """The study's exit code after a signal: 130 for SIGINT, else 75."""
    return EXIT_INTERRUPTED if _STOP_SIGNALS[:1] == [signal.SIGINT] else EXIT_STOPPED
