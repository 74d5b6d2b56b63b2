"""Parallel environment workers with per-episode fault isolation.

``EnvPool`` runs episodes (identified by integer ids chosen by the caller) either in the
calling process (``num_workers=0``) or in worker processes (episode ``e`` lives on worker
``e % num_workers``). Every operation on a batch of episodes returns one ``EnvResult``
per item; nothing raises for an environment's fault:

- an exception inside an environment fails that item (``ok=False``), the others go on;
- a worker that dies or does not answer within ``step_timeout_s`` is killed and
  restarted; the item it was executing fails; the other episodes it hosted are
  restored on the new worker by verified replay from the parent's record of their
  actions (so they lose nothing), and its remaining items are re-run.

Counters ``errors`` and ``restarts`` feed the ``env/errors`` metric.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from dataclasses import dataclass
from typing import Any

from salvage.envs import make_env
from salvage.envs.base import ReplayEnv
from salvage.stopping import user_call

log = logging.getLogger(__name__)


@dataclass
class EnvResult:
    ok: bool
    value: Any = None
    """reset/restore: (observation, info); step: StepResult; snapshot: dict."""
    error: str | None = None
    startup_s: float = 0.0
    """Seconds spent starting a new environment instance for this item (e.g. a JVM)."""


class _Host:
    """Holds the env instances of one worker (or of the parent when in-process)."""

    def __init__(self, env_name: str, env_kwargs: dict[str, Any]) -> None:
        self.env_name = env_name
        self.env_kwargs = env_kwargs
        self.envs: dict[int, ReplayEnv] = {}
        self.free: list[ReplayEnv] = []
        self.startup_s = 0.0  # cleared by each handle(): the start-up of that item's env

    def _env(self, eid: int, create: bool) -> ReplayEnv:
        env = self.envs.get(eid)
        if env is None:
            if not create:
                raise KeyError(f"episode {eid} has no live environment (failed or released)")
            if self.free:
                env = self.free.pop()
            else:
                t0 = time.perf_counter()
                env = make_env(self.env_name, **self.env_kwargs)
                self.startup_s += time.perf_counter() - t0
            self.envs[eid] = env
        return env

    def handle(self, op: str, eid: int, arg: Any) -> EnvResult:
        self.startup_s = 0.0
        res = self._handle(op, eid, arg)
        res.startup_s = self.startup_s
        return res

    def _handle(self, op: str, eid: int, arg: Any) -> EnvResult:
        try:
            if op == "reset":
                task, seed = arg
                env = self._env(eid, create=True)
                obs, info = env.reset(task, seed)
                return EnvResult(True, (obs, info))
            if op == "step":
                res = self._env(eid, create=False).step(arg)
                return EnvResult(True, res)
            if op == "oracle":
                return EnvResult(True, self._env(eid, create=False).oracle_action())
            if op == "snapshot":
                return EnvResult(True, self._env(eid, create=False).snapshot())
            if op == "restore":
                env = self._env(eid, create=True)
                obs = env.restore(arg)
                return EnvResult(True, (obs, env.info))
            if op == "release":
                gone = self.envs.pop(eid, None)
                if gone is not None:
                    self.free.append(gone)
                return EnvResult(True)
            return EnvResult(False, error=f"unknown op {op!r}")
        except Exception as e:  # noqa: BLE001 - an env fault fails only this item
            broken = self.envs.pop(eid, None)
            if broken is not None:
                try:
                    broken.close()
                except Exception:  # noqa: BLE001
                    pass
            return EnvResult(False, error=f"{type(e).__name__}: {e}")

    def close(self) -> None:
        for env in [*self.envs.values(), *self.free]:
            try:
                env.close()
            except Exception:  # noqa: BLE001
                pass
        self.envs.clear()
        self.free.clear()


def _worker_main(conn: Any, env_name: str, env_kwargs: dict[str, Any]) -> None:
    host = _Host(env_name, env_kwargs)
    try:
        conn.send(("ready", None))  # imports done: the parent's step timeouts start now
        while True:
            msg = conn.recv()
            if msg is None:
                break
            for idx, op, eid, arg in msg:
                conn.send((idx, host.handle(op, eid, arg)))
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        host.close()


class _Worker:
    def __init__(self, ctx: Any, env_name: str, env_kwargs: dict[str, Any]) -> None:
        self.parent, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_worker_main, args=(child, env_name, env_kwargs), daemon=True
        )
        self.proc.start()
        child.close()

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.join(timeout=5)
        finally:
            self.parent.close()


def startup_of(results: list[EnvResult | None], indices: list[int]) -> float:
    """Environment start-up seconds of the answered ``results`` at ``indices``."""
    return float(sum(r.startup_s for i in indices if (r := results[i]) is not None))


def answered(results: list[EnvResult | None]) -> list[EnvResult]:
    """Every request's result (a worker answers each one, or its loss is recorded)."""
    missing = [i for i, r in enumerate(results) if r is None]
    if missing:
        raise RuntimeError(f"environment requests {missing} got no result")
    return [r for r in results if r is not None]


class EnvPool:
    """Run environment operations for many episodes, in-process or across workers.

    Args:
        env_name: registered env name (``twx``, ``alfworld``, ``scripted``, ...).
        env_kwargs: constructor arguments of the env class.
        num_workers: 0 runs in the calling process; N > 0 starts N worker processes.
        step_timeout_s: a worker silent for this long on one operation is declared hung.
    """

    def __init__(
        self,
        env_name: str,
        env_kwargs: dict[str, Any] | None = None,
        num_workers: int = 0,
        step_timeout_s: float = 60.0,
        startup_timeout_s: float = 300.0,
    ) -> None:
        if num_workers < 0:
            raise ValueError(f"env num_workers must be >= 0, got {num_workers}")
        if step_timeout_s <= 0:
            raise ValueError(f"env step_timeout_s must be > 0, got {step_timeout_s}")
        self.env_name = env_name
        self.env_kwargs = dict(env_kwargs or {})
        self.num_workers = num_workers
        self.step_timeout_s = step_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._seq = 0  # every item sent carries a fresh number; stale answers are recognised
        self.errors = 0
        self.restarts = 0
        # wall seconds spent starting environments (instances, workers): one-time set-up that
        # cost accounting leaves out of step time, so a resumed run is not charged it twice
        self.startup_s = 0.0
        self.error_log: list[str] = []
        self._trace: dict[int, dict[str, Any]] = {}
        self._ctx = mp.get_context("spawn")
        self._local = _Host(env_name, self.env_kwargs) if num_workers == 0 else None
        self._workers = [
            _Worker(self._ctx, self.env_name, self.env_kwargs) for _ in range(num_workers)
        ]
        for w in self._workers:
            self._wait_ready(w)

    def _start(self) -> _Worker:
        t0 = time.perf_counter()
        w = _Worker(self._ctx, self.env_name, self.env_kwargs)
        self._wait_ready(w)
        self.startup_s += time.perf_counter() - t0
        return w

    def _wait_ready(self, w: _Worker) -> None:
        """Block until a (re)started worker has imported everything (not a step timeout)."""
        if not w.parent.poll(self.startup_timeout_s):
            w.kill()
            raise RuntimeError(
                f"env worker did not start within {self.startup_timeout_s:g} s (data.env.startup_timeout_s)"
            )
        w.parent.recv()

    # ------------------------------------------------------------------ public ops
    def reset(self, items: list[tuple[int, dict[str, Any], int]]) -> list[EnvResult]:
        return self._run([("reset", eid, (task, seed)) for eid, task, seed in items])

    def step(self, items: list[tuple[int, str]]) -> list[EnvResult]:
        return self._run([("step", eid, a) for eid, a in items])

    def oracle(self, eids: list[int]) -> list[EnvResult]:
        return self._run([("oracle", eid, None) for eid in eids])

    def snapshot(self, eids: list[int]) -> list[EnvResult]:
        return self._run([("snapshot", eid, None) for eid in eids])

    def restore(self, items: list[tuple[int, dict[str, Any]]]) -> list[EnvResult]:
        return self._run([("restore", eid, state) for eid, state in items])

    def release(self, eids: list[int]) -> None:
        self._run([("release", eid, None) for eid in eids])
        for eid in eids:
            self._trace.pop(eid, None)

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
        for w in self._workers:
            try:
                w.parent.send(None)
                w.proc.join(timeout=5)
            except (OSError, BrokenPipeError):
                pass
            if w.proc.is_alive():
                w.kill()
        self._workers = []

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ machinery
    def _record(self, op: str, eid: int, arg: Any, res: EnvResult) -> None:
        """Keep the parent's replay record of each episode (to rebuild lost workers)."""
        if not res.ok:
            self.errors += op != "release"
            self.error_log.append(f"episode {eid} {op}: {res.error}")
            log.warning("env %s: episode %d %s failed: %s", self.env_name, eid, op, res.error)
            self._trace.pop(eid, None)
            return
        if op == "reset":
            task, seed = arg
            self._trace[eid] = {
                "env": self.env_name,
                "task": task,
                "seed": seed,
                "actions": [],
                "observation": res.value[0],
            }
        elif op == "restore":
            self._trace[eid] = {
                k: arg[k] for k in ("env", "task", "seed", "actions", "observation")
            }
            self._trace[eid]["actions"] = list(arg["actions"])
        elif op == "step" and eid in self._trace:
            tr = self._trace[eid]
            tr["actions"].append(arg)
            tr["observation"] = res.value.observation

    def _run(self, ops: list[tuple[str, int, Any]]) -> list[EnvResult]:
        """Every op's result; a SIGTERM meanwhile gives it the stop grace (salvage.stopping)."""
        with user_call(f"environment {ops[0][0] if ops else 'call'}"):
            return self._run_ops(ops)

    def _run_ops(self, ops: list[tuple[str, int, Any]]) -> list[EnvResult]:
        results: list[EnvResult | None] = [None] * len(ops)
        if self._local is not None:
            done: list[EnvResult] = []
            for op, eid, arg in ops:
                res = self._local.handle(op, eid, arg)
                self.startup_s += res.startup_s
                self._record(op, eid, arg, res)
                done.append(res)
            return done
        per_worker: dict[int, list[tuple[int, int, str, int, Any]]] = {}
        for i, (op, eid, arg) in enumerate(ops):
            self._seq += 1
            per_worker.setdefault(eid % self.num_workers, []).append((self._seq, i, op, eid, arg))
        for w, items in per_worker.items():
            self._send(w, items)
        for w, items in per_worker.items():
            self._collect(w, items, results)
        # workers start their environments in parallel: the slowest worker's share is wall time
        per_w = [startup_of(results, [i for _, i, *_ in items]) for items in per_worker.values()]
        self.startup_s += max(per_w, default=0.0)
        return answered(results)

    def _send(self, w: int, items: list[tuple[int, int, str, int, Any]]) -> bool:
        try:
            self._workers[w].parent.send([(seq, op, eid, arg) for seq, _, op, eid, arg in items])
            return True
        except (OSError, BrokenPipeError):
            return False

    def _timeout(self, op: str, arg: Any) -> float:
        if op == "oracle":
            return self.step_timeout_s * 10  # a planner may search
        if op == "restore" and isinstance(arg, dict):
            return self.step_timeout_s * (1 + len(arg.get("actions", [])))
        return self.step_timeout_s

    def _collect(
        self, w: int, items: list[tuple[int, int, str, int, Any]], results: list[EnvResult | None]
    ) -> None:
        pending = list(items)
        while pending:
            seq, idx, op, eid, arg = pending[0]
            conn = self._workers[w].parent
            reason = None
            try:
                if conn.poll(self._timeout(op, arg)):
                    got, res = conn.recv()
                    if got != seq:  # a late answer to an item already given up on: drop it
                        log.warning("env worker %d: discarding a stale answer (item %s)", w, got)
                        continue
                    results[idx] = res
                    self._record(op, eid, arg, res)
                    pending.pop(0)
                    continue
                reason = f"no answer within {self._timeout(op, arg):.0f}s (hung)"
            except (EOFError, OSError, BrokenPipeError):
                reason = f"worker died (exit code {self._workers[w].proc.exitcode})"
            # the worker is lost: fail the in-flight item, rebuild the others, re-run the rest
            res = EnvResult(False, error=f"env worker {w}: {reason}")
            results[idx] = res
            self._record(op, eid, arg, res)
            pending.pop(0)
            self._restart(w, exclude={eid})
            if pending and not self._send(w, pending):
                for _, j, op2, eid2, arg2 in pending:
                    lost = EnvResult(False, error=f"env worker {w}: could not be restarted")
                    results[j] = lost
                    self._record(op2, eid2, arg2, lost)
                return

    def _restart(self, w: int, exclude: set[int]) -> None:
        self._workers[w].kill()
        self.restarts += 1
        self._workers[w] = self._start()
        hosted = [eid for eid in self._trace if eid % self.num_workers == w and eid not in exclude]
        if not hosted:
            return
        items = []
        for eid in hosted:
            self._seq += 1
            items.append((self._seq, "restore", eid, dict(self._trace[eid])))
        conn = self._workers[w].parent
        conn.send(items)
        for seq, _, eid, state in items:
            res = None
            while res is None and conn.poll(self._timeout("restore", state)):
                got, ans = conn.recv()
                res = ans if got == seq else None
            if res is None:
                res = EnvResult(False, error="restore after worker restart timed out")
            if not res.ok:
                self.errors += 1
                self.error_log.append(f"episode {eid} lost with worker {w}: {res.error}")
                self._trace.pop(eid, None)
