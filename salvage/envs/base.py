"""Restorable text environments: the universal replay implementation of the Env protocol.

Every intermediate state of an episode must be restorable exactly (VH-GPO, SPEC §2).
``ReplayEnv`` records the task, the seed and the action list since ``reset``; its
``snapshot()`` is that record (plain JSON data, never pickle) plus the observation seen
at that point, and ``restore(state)`` replays the actions from ``reset(task, seed)``
and **verifies** that the observation it reaches equals the recorded one. A mismatch
raises ``RestoreError``: a restore that does not match is a failed restore, never
silently used.

Subclasses implement ``_reset`` and ``_step`` and normalise ``info`` to carry:
``won`` (bool), ``admissible`` (list of str), ``score`` (float), ``done`` (bool), and,
where the environment knows one, ``oracle_action`` (the gold/expert next action).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, ClassVar

from salvage.types import StepResult


class RestoreError(RuntimeError):
    """A snapshot could not be restored exactly (replay diverged or the record is corrupt)."""


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class ReplayEnv:
    """Base class: recording, snapshot and verified restore by deterministic replay."""

    name: ClassVar[str] = "base"

    def __init__(self) -> None:
        self._task: dict[str, Any] | None = None
        self._seed: int = 0
        self._actions: list[str] = []
        self._obs: str = ""
        self._info: dict[str, Any] = {}
        self._done = False

    # -- to implement -------------------------------------------------------------
    def _reset(self, task: dict[str, Any], seed: int) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        raise NotImplementedError

    @classmethod
    def list_tasks(cls, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        """Task dicts of a split (the first argument); each has ``id`` and ``family``.
        Each environment names its own further arguments."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    @classmethod
    def task_text(cls, task: dict[str, Any]) -> str | None:
        """What the agent is shown of a task at its start, when the task dict alone tells
        (e.g. WebShop's instruction); None: ``task_content`` resets an instance."""
        return None

    @classmethod
    def content_identity(cls) -> str | None:
        """What fixes ``task_content`` besides the task and the constructor arguments (the
        engine's version, the content function's), for a cache of task digests on disk
        (``salvage.datamodules.digests``); None: this environment's digests are not cached."""
        return None

    def task_content(self, task: dict[str, Any]) -> str:
        """The held-out check's content of a task: its initial observation and goal."""
        text = self.task_text(task)
        if text is not None:
            return text
        obs, info = self.reset(task, 0)
        return f"{obs}\n{info.get('task_description', '')}"

    def oracle_action(self) -> str | None:
        """The oracle's next action at the current state (None: it has none).

        Asked on demand (only oracle policies ask), so an expensive planner costs nothing
        in student rollouts. Default: what the environment put in ``info``.
        """
        return self._info.get("oracle_action")

    # -- protocol -----------------------------------------------------------------
    def reset(self, task: dict[str, Any], seed: int = 0) -> tuple[str, dict[str, Any]]:
        obs, info = self._reset(task, seed)
        self._task, self._seed, self._actions = dict(task), int(seed), []
        self._obs, self._info, self._done = obs, info, False
        return obs, info

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise RuntimeError(f"{self.name}: step() before reset()")
        if self._done:
            raise RuntimeError(f"{self.name}: step() after the episode ended")
        obs, reward, done, info = self._step(action)
        self._actions.append(action)
        self._obs, self._info, self._done = obs, info, bool(done)
        return StepResult(obs, float(reward), bool(done), info)

    @property
    def depth(self) -> int:
        return len(self._actions)

    @property
    def info(self) -> dict[str, Any]:
        return self._info

    @property
    def observation(self) -> str:
        return self._obs

    def snapshot(self) -> dict[str, Any]:
        if self._task is None:
            raise RuntimeError(f"{self.name}: snapshot() before reset()")
        return {
            "env": self.name,
            "task": self._task,
            "seed": self._seed,
            "actions": list(self._actions),
            "observation": self._obs,
            "digest": digest(self._obs),
        }

    def restore(self, state: dict[str, Any], verify: bool = True) -> str:
        """Replay ``state`` from reset and verify the observation; returns it.

        ``verify=False`` is for internal planners replaying their own, unrecorded paths.
        """
        try:
            if state["env"] != self.name:
                raise RestoreError(f"snapshot is for env {state['env']!r}, not {self.name!r}")
            task, seed, actions = state["task"], int(state["seed"]), list(state["actions"])
            want = state["observation"]
        except (KeyError, TypeError, ValueError) as e:
            raise RestoreError(f"{self.name}: malformed snapshot ({e!r})") from e
        if verify and state.get("digest") not in (None, digest(want)):
            raise RestoreError(
                f"{self.name}: snapshot digest does not match its observation (tampered?)"
            )
        obs, _ = self.reset(task, seed)
        for t, a in enumerate(actions):
            if self._done:
                raise RestoreError(f"{self.name}: replay ended at depth {t} of {len(actions)}")
            obs = self.step(a).observation
        if verify and obs != want:
            raise RestoreError(
                f"{self.name}: restore at depth {len(actions)} does not reproduce the recorded "
                f"observation: got {obs[:120]!r}, recorded {want[:120]!r}"
            )
        return obs


def check_json(state: dict[str, Any]) -> dict[str, Any]:
    """Round-trip a snapshot through JSON (snapshots must be plain data)."""
    return json.loads(json.dumps(state))
