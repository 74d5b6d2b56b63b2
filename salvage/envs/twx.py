"""TextWorld-Express (extra ``twx``): coin, cookingworld, twc and the other games.

A task is one generated game: ``{"game", "params", "game_seed", "fold"}``; the
episode seed is unused (the engine is deterministic given the game seed). The gold
path (``generateGoldPath``) is exposed per state as ``info["oracle_action"]``: the next
gold action while the agent has followed the gold path so far, else None.
Each instance holds its own JVM (~0.5 s to start), reused across episodes.
"""

from __future__ import annotations

from typing import Any, ClassVar

from salvage.envs.base import ReplayEnv

GAMES = ("coin", "cookingworld", "twc", "mapreader", "arithmetic", "sorting", "simonsays", "peckingorder")

# Easiest settings, measured in FACTS.md; override with ``params``.
DEFAULT_PARAMS = {
    "coin": "numLocations=1,includeDoors=0,numDistractorItems=0",
    "cookingworld": "numLocations=1,numIngredients=1,numDistractorItems=0,includeDoors=0,limitInventorySize=0",
    "twc": "numLocations=1,numItemsToPutAway=1",
    "mapreader": "numLocations=2,maxDistanceApart=1,includeDoors=0,maxDistractorItemsPerLocation=0",
}


class TWXEnv(ReplayEnv):
    name: ClassVar[str] = "twx"

    def __init__(self, step_limit: int = 100) -> None:
        super().__init__()
        self.step_limit = step_limit
        self._env: Any = None
        self._loaded: tuple[str, str] | None = None
        self._gold: list[str] = []
        self._gold_pos = 0
        self._task_desc = ""

    def _server(self) -> Any:
        if self._env is None:
            try:
                from textworld_express import TextWorldExpressEnv
            except ImportError as e:
                raise RuntimeError(
                    "env 'twx' needs textworld-express: pip install 'salvage[twx]' (needs Java)"
                ) from e
            self._env = TextWorldExpressEnv(envStepLimit=self.step_limit)
        return self._env

    @classmethod
    def list_tasks(
        cls, split: str, game: str = "coin", params: str | None = None, num_tasks: int = 16, seed_offset: int = 0
    ) -> list[dict[str, Any]]:
        if game not in GAMES:
            raise ValueError(f"twx game must be one of {GAMES}, got {game!r}")
        fold = {"train": "train", "val": "dev", "test": "test"}.get(split, split)
        p = DEFAULT_PARAMS.get(game, "") if params is None else params
        return [
            {"id": f"{game}/{fold}/{seed_offset + i}", "family": game, "game": game, "params": p,
             "game_seed": seed_offset + i, "fold": fold}
            for i in range(num_tasks)
        ]

    def _reset(self, task: dict[str, Any], seed: int) -> tuple[str, dict[str, Any]]:
        env = self._server()
        key = (task["game"], task.get("params", ""))
        if self._loaded != key:
            env.load(*key)
            self._loaded = key
        # TWX draws a game per (seed, fold): the task's game_seed must be valid for its fold
        obs, raw = env.reset(seed=int(task["game_seed"]), gameFold=task.get("fold", "train"), generateGoldPath=True)
        self._gold = list(env.getGoldActionSequence())
        self._gold_pos = 0
        self._task_desc = raw.get("taskDescription", "")
        return obs, self._info_from(raw)

    def _info_from(self, raw: dict[str, Any]) -> dict[str, Any]:
        nxt = self._gold[self._gold_pos] if self._gold_pos < len(self._gold) else None
        oracle = nxt if nxt is not None and nxt in raw.get("validActions", []) else None
        return {
            "won": bool(raw.get("tasksuccess", False)),
            "lost": bool(raw.get("taskfailure", False)),
            "admissible": sorted(raw.get("validActions", [])),
            "score": float(raw.get("score", 0.0)),
            "task_description": self._task_desc,
            "oracle_action": oracle,
        }

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self._gold_pos < len(self._gold) and action == self._gold[self._gold_pos]:
            self._gold_pos += 1
        obs, reward, done, raw = self._env.step(action)
        info = self._info_from(raw)
        return obs, reward, bool(done or info["won"] or info["lost"]), info

    def close(self) -> None:
        if self._env is not None:
            try:
                self._env.close()
            except Exception:  # noqa: BLE001 - the JVM may already be gone
                pass
            self._env = None
            self._loaded = None
