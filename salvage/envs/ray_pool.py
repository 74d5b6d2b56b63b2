"""Environment workers as Ray actors (extra ``ray``): the same interface as ``EnvPool``.

``data.env.backend: ray`` runs the environments in Ray actors, on this machine or across
a cluster (``data.env.ray_address: auto`` joins a running one), with the local process
pool's guarantees: an environment exception fails its item; an actor that dies (its node
lost, its process killed) or does not answer within the step timeout is killed and
replaced, its in-flight item fails, the other episodes it hosted are restored on the new
actor by verified replay from the trainer's record, and its remaining items are re-run.
Episode ``e`` lives on actor ``e % num_workers``; each actor's calls run in order.
``data.env.ray_resources`` places the actors through custom resources of the nodes (e.g.
``{env_node: 1}`` with ``ray start --resources '{"env_node": 8}'`` on the environment
machines); a replacement actor waits up to the start-up timeout for a node that has them
free, and one that dies while starting (placed on a node lost before the cluster noticed) is
started again.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from salvage.envs.pool import EnvPool, EnvResult, _Host, answered, startup_of

log = logging.getLogger(__name__)


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise RuntimeError("data.env.backend=ray needs ray: pip install 'salvage[ray]'") from e
    return ray


def resources_problem(resources: Any) -> str | None:
    """What is wrong with a ``ray_resources`` mapping (None: nothing): custom resource names ->
    numbers >= 0 (not ``CPU`` / ``GPU``: ``ray_num_cpus`` reserves the CPUs)."""
    if resources is None:
        return None
    if not isinstance(resources, dict):
        return "must be a mapping resource name -> number, e.g. {env_node: 1}"
    for name, amount in resources.items():
        if not isinstance(name, str) or not name:
            return f"has the resource name {name!r}: names are non-empty strings"
        if name in ("CPU", "GPU"):
            return f"names {name!r}: only custom resources here (CPUs: data.env.ray_num_cpus)"
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount >= 0:
            return f"asks for {amount!r} of {name!r}: amounts are numbers >= 0"
    return None


class _ActorHost:
    """The body of one actor: a ``_Host`` holding that actor's environments."""

    def __init__(self, env_name: str, env_kwargs: dict[str, Any]) -> None:
        self.host = _Host(env_name, env_kwargs)

    def ready(self) -> bool:
        return True

    def node_id(self) -> str:
        """The Ray node this actor runs on (hex id)."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def handle(self, op: str, eid: int, arg: Any) -> EnvResult:
        return self.host.handle(op, eid, arg)

    def close(self) -> None:
        self.host.close()


class RayEnvPool(EnvPool):
    """``EnvPool`` whose workers are Ray actors.

    Args:
        env_name / env_kwargs / num_workers / step_timeout_s / startup_timeout_s: as ``EnvPool``
            (``num_workers`` >= 1 actors).
        address: Ray cluster to join (None: start or reuse a local Ray; ``auto``: the running cluster).
        num_cpus: CPUs each actor reserves.
        runtime_env: Ray runtime environment of the actors (e.g. ``{"env_vars": {...}}``).
        resources: custom Ray resources each actor reserves (e.g. ``{"env_node": 1}``: only
            nodes started with that resource host it); None: none.
    """

    def __init__(
        self,
        env_name: str,
        env_kwargs: dict[str, Any] | None = None,
        num_workers: int = 1,
        step_timeout_s: float = 60.0,
        startup_timeout_s: float = 300.0,
        address: str | None = None,
        num_cpus: float = 1.0,
        runtime_env: dict[str, Any] | None = None,
        resources: dict[str, float] | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(
                f"data.env.num_workers must be >= 1 with backend=ray, got {num_workers}"
            )
        problem = resources_problem(resources)
        if problem:
            raise ValueError(f"data.env.ray_resources={resources!r} {problem}")
        self.resources = dict(resources or {})
        ray = _ray()
        if not ray.is_initialized():
            ray.init(
                address=address,
                include_dashboard=False,
                log_to_driver=False,
                runtime_env=runtime_env,
                ignore_reinit_error=True,
            )
        self._actor_cls = ray.remote(
            num_cpus=num_cpus, resources=self.resources or None, max_restarts=0
        )(_ActorHost)
        self._actors: list[Any] = []
        # the base class sets up counters and records; with num_workers=0 it starts no process
        super().__init__(env_name, env_kwargs, 0, step_timeout_s, startup_timeout_s)
        self._local = None
        self.num_workers = num_workers
        self._actors = [self._start_actor() for _ in range(num_workers)]

    def _start_actor(self) -> Any:
        """A new actor, ready. One that dies while starting for a system reason (placed on a
        node that was lost before the cluster noticed) is replaced, until the start-up
        timeout; an error in its ``__init__`` or the timeout raises."""
        ray = _ray()
        deadline = time.monotonic() + self.startup_timeout_s
        attempt = 0
        while True:
            attempt += 1
            actor = self._actor_cls.remote(self.env_name, self.env_kwargs)
            try:
                ray.get(actor.ready.remote(), timeout=max(deadline - time.monotonic(), 0.01))
                return actor
            except Exception as e:  # noqa: BLE001 - GetTimeoutError, RayActorError, ...
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
                lost = isinstance(e, ray.exceptions.RayActorError) and not e.actor_init_failed
                if lost and deadline - time.monotonic() > 1.0:
                    log.warning(
                        "Ray env actor died while starting (attempt %d: %s); starting another",
                        attempt,
                        str(e).splitlines()[0][:200],
                    )
                    time.sleep(1.0)
                    continue
                where = (
                    f" (it needs the resources {self.resources}: does a live node have them free?)"
                    if self.resources
                    else ""
                )
                raise RuntimeError(
                    f"Ray env actor did not start (start-up timeout {self.startup_timeout_s:.0f}s,"
                    f" {attempt} attempt(s)){where}: {type(e).__name__}: {str(e)[:300]}"
                ) from e

    def actor_nodes(self) -> list[str]:
        """The Ray node id of each actor, in worker order."""
        ray = _ray()
        return [ray.get(a.node_id.remote(), timeout=self.step_timeout_s) for a in self._actors]

    def _run(self, ops: list[tuple[str, int, Any]]) -> list[EnvResult]:
        results: list[EnvResult | None] = [None] * len(ops)
        per_actor: dict[int, list[tuple[int, str, int, Any]]] = {}
        for i, (op, eid, arg) in enumerate(ops):
            per_actor.setdefault(eid % self.num_workers, []).append((i, op, eid, arg))
        refs = {w: self._submit(w, items) for w, items in per_actor.items()}
        for w, items in per_actor.items():
            self._gather(w, items, refs[w], results)
        self.startup_s += max(  # actors start their environments in parallel
            (startup_of(results, [i for i, *_ in items]) for items in per_actor.values()),
            default=0.0,
        )
        return answered(results)

    def _submit(self, w: int, items: list[tuple[int, str, int, Any]]) -> list[Any]:
        return [self._actors[w].handle.remote(op, eid, arg) for _, op, eid, arg in items]

    def _gather(
        self,
        w: int,
        items: list[tuple[int, str, int, Any]],
        refs: list[Any],
        results: list[EnvResult | None],
    ) -> None:
        ray = _ray()
        pending = list(zip(items, refs, strict=True))
        while pending:
            (idx, op, eid, arg), ref = pending[0]
            reason = None
            try:
                done, _ = ray.wait([ref], timeout=self._timeout(op, arg))
                if done:
                    res = ray.get(ref)
                    results[idx] = res
                    self._record(op, eid, arg, res)
                    pending.pop(0)
                    continue
                reason = f"no answer within {self._timeout(op, arg):.0f}s (hung)"
            except Exception as e:  # noqa: BLE001 - RayActorError, node loss, ...
                reason = f"actor lost ({type(e).__name__}: {str(e)[:200]})"
            res = EnvResult(False, error=f"env actor {w}: {reason}")
            results[idx] = res
            self._record(op, eid, arg, res)
            pending.pop(0)
            self._replace(w, exclude={eid})
            rest = [it for it, _ in pending]
            pending = list(zip(rest, self._submit(w, rest), strict=True))

    def _replace(self, w: int, exclude: set[int]) -> None:
        """Kill actor ``w``, start a new one and restore its other live episodes by replay."""
        ray = _ray()
        try:
            ray.kill(self._actors[w], no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.restarts += 1
        self._actors[w] = self._start_actor()
        for eid in [e for e in self._trace if e % self.num_workers == w and e not in exclude]:
            state = dict(self._trace[eid])
            try:
                res = ray.get(
                    self._actors[w].handle.remote("restore", eid, state),
                    timeout=self._timeout("restore", state),
                )
            except Exception as e:  # noqa: BLE001
                res = EnvResult(False, error=f"restore after actor restart failed: {e!r}")
            if not res.ok:
                self.errors += 1
                self.error_log.append(f"episode {eid} lost with actor {w}: {res.error}")
                self._trace.pop(eid, None)

    def kill_actor(self, w: int) -> None:
        """Kill actor ``w`` as a fault would (tests, drills); the pool notices on its next call."""
        _ray().kill(self._actors[w], no_restart=True)

    def close(self) -> None:
        ray = _ray()
        for a in self._actors:
            try:
                ray.get(a.close.remote(), timeout=10)
            except Exception:  # noqa: BLE001
                pass
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self._actors = []
