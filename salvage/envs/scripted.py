"""A scripted, deterministic environment for exact tests of search order and faults.

The state is the list of actions taken. A task names a ``solution`` (list of actions):
the episode is won when the actions taken so far end with the full solution in order
from the start (any wrong action makes the episode unwinnable), and ends after
``max_steps`` actions. Fault injection for tests: the action ``"crash!"`` kills the
process (``os._exit``), ``"hang!"`` sleeps far past any timeout, ``"raise!"`` raises;
``step_delay_s`` makes every step take that long (a fault can then land mid-batch).
"""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar

from salvage.envs.base import ReplayEnv


class ScriptedEnv(ReplayEnv):
    name: ClassVar[str] = "scripted"

    def __init__(
        self, max_steps: int = 50, create_delay_s: float = 0.0, step_delay_s: float = 0.0
    ) -> None:
        super().__init__()
        if create_delay_s > 0:  # stands in for a slow start-up (a JVM, a simulator)
            time.sleep(create_delay_s)
        self.max_steps = max_steps
        self.step_delay_s = step_delay_s
        self._solution: list[str] = []
        self._alive = True

    @classmethod
    def list_tasks(
        cls, split: str, num_tasks: int = 4, length: int = 3, actions: list[str] | None = None
    ) -> list[dict[str, Any]]:
        pool = actions or ["a", "b", "c"]
        tasks = []
        for i in range(num_tasks):
            sol = [pool[(i + j) % len(pool)] for j in range(length)]
            tasks.append(
                {
                    "id": f"scripted/{split}/{i}",
                    "family": f"len{length}",
                    "solution": sol,
                    "actions": list(pool),
                }
            )
        return tasks

    def _render(self) -> str:
        return f"step {self.depth_now}: history {'/'.join(self._taken)}"

    def _reset(self, task: dict[str, Any], seed: int) -> tuple[str, dict[str, Any]]:
        self._solution = list(task["solution"])
        self._pool = list(task.get("actions", sorted(set(self._solution))))
        self._taken: list[str] = []
        self.depth_now = 0
        self._alive = True
        return self._render(), self._scripted_info()

    def _scripted_info(self) -> dict[str, Any]:
        d = len(self._taken)
        won = self._alive and self._taken == self._solution
        oracle = self._solution[d] if self._alive and d < len(self._solution) else None
        return {
            "won": won,
            "admissible": list(self._pool),
            "score": float(won),
            "task_description": f"reach {'/'.join(self._solution)}",
            "oracle_action": oracle,
        }

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if action == "crash!":
            # the process dies DURING this step: earlier steps' replies have gone out. (Ray
            # sends an actor task's reply asynchronously; an exit at the very instant the
            # step starts can lose the finished reply of the previous task on that actor,
            # which no pool can tell apart from a crash in that task: a flaky test.)
            time.sleep(0.5)
            os._exit(17)
        if action == "hang!":
            time.sleep(3600)
        if action == "raise!":
            raise RuntimeError("scripted environment failure")
        if self.step_delay_s > 0:  # stands in for a slow simulator step
            time.sleep(self.step_delay_s)
        d = len(self._taken)
        if d >= len(self._solution) or action != self._solution[d]:
            self._alive = False
        self._taken.append(action)
        self.depth_now = len(self._taken)
        info = self._scripted_info()
        done = info["won"] or len(self._taken) >= self.max_steps
        return self._render(), 10.0 * info["won"], done, info
