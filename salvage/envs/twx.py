"""TextWorld-Express (extra ``twx``): coin, cookingworld, twc and the other games.

A task is one generated game: ``{"game", "params", "game_seed", "fold"}``; the
episode seed is unused (the engine is deterministic given the game seed). Each split takes
its games from the engine's own seed range of its fold (train 0-999, dev 10000-10999, test
20000-20999; ``seed_offset`` moves within a fold): the engine ignores ``gameFold`` when a
seed is given, so seeds from one range would give the validation split training games.
``fold`` picks another fold than the split's: ``fold: train`` with ``seed_offset: 256`` on
the validation split gives unseen games of the training distribution (in-distribution
held-out games; twc repeats games across seeds, so such a list is best deduplicated by
content against the training games: the datamodule's ``drop_overlap``).

The oracle (``oracle_action()``, asked on demand) is a breadth-first planner over the
game's admissible actions from the current state, run on a twin instance through
replay restores: the shortest plan, deterministic. (TWX's own gold path is drawn at
random on every reset: the same seed gave gold paths of 5, 17 and 9 actions in three
processes, so it is not used; an oracle must be reproducible.) States are identified by
(observation, admissible actions, score); the plan is cached while the agent follows it,
and every plan is kept per process for the next ask from the same state (any instance).
Each instance holds its own JVM (~0.5 s to start), reused across episodes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, ClassVar

from salvage.envs.base import ReplayEnv

GAMES = (
    "coin",
    "cookingworld",
    "twc",
    "mapreader",
    "arithmetic",
    "sorting",
    "simonsays",
    "peckingorder",
)

# Easiest settings, measured in FACTS.md; override with ``params``.
DEFAULT_PARAMS = {
    "coin": "numLocations=1,includeDoors=0,numDistractorItems=0",
    "cookingworld": "numLocations=1,numIngredients=1,numDistractorItems=0,includeDoors=0,limitInventorySize=0",
    "twc": "numLocations=1,numItemsToPutAway=1",
    "mapreader": "numLocations=2,maxDistanceApart=1,includeDoors=0,maxDistractorItemsPerLocation=0",
}


FOLD_SEEDS = {"train": 0, "dev": 10000, "test": 20000}
"""First game seed of each of TextWorld-Express's folds (``getValidSeedsTrain/Dev/Test``);
the engine ignores ``gameFold`` when given a seed, so a fold IS its seed range."""
SEEDS_PER_FOLD = 1000
"""Valid seeds per fold (each fold's range holds this many)."""

PLAN_CACHE_SIZE = 4096
"""Plans kept per process (least recently used dropped first)."""
_PLANS: OrderedDict[tuple[Any, ...], tuple[str, ...] | None] = OrderedDict()
"""The planner's answer per (game, actions since reset, limits), shared by every instance
of the process: the search is deterministic, so asking again only repeats it (VH-GPO's
teacher attempts from one anchor all plan from the same state)."""


class TWXEnv(ReplayEnv):
    name: ClassVar[str] = "twx"

    def __init__(
        self, step_limit: int = 100, plan_max_nodes: int = 400, plan_max_depth: int = 30
    ) -> None:
        super().__init__()
        self.step_limit = step_limit
        self.plan_max_nodes = plan_max_nodes
        self.plan_max_depth = plan_max_depth
        self._env: Any = None
        self._loaded: tuple[str, str] | None = None
        self._task_desc = ""
        self._planner: TWXEnv | None = None
        self._plan: tuple[tuple[str, ...], list[str]] | None = None

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
        cls,
        split: str,
        game: str = "coin",
        params: str | None = None,
        num_tasks: int = 16,
        seed_offset: int = 0,
        fold: str | None = None,
    ) -> list[dict[str, Any]]:
        """``split``'s games: ``num_tasks`` seeds from ``seed_offset`` in the seed range of
        ``fold`` (None: the split's own fold, train -> train, val -> dev, test -> test)."""
        if game not in GAMES:
            raise ValueError(f"twx game must be one of {GAMES}, got {game!r}")
        own = {"train": "train", "val": "dev", "test": "test"}.get(split, split)
        if own not in FOLD_SEEDS:
            raise ValueError(f"twx split must be train, val (dev) or test, got {split!r}")
        if fold is not None and fold not in FOLD_SEEDS:
            raise ValueError(
                f"twx {split} tasks: fold must be one of {sorted(FOLD_SEEDS)}, got {fold!r}"
            )
        fold = fold or own
        if num_tasks < 1 or seed_offset < 0 or seed_offset + num_tasks > SEEDS_PER_FOLD:
            raise ValueError(
                f"twx {split} tasks: seed_offset={seed_offset} + num_tasks={num_tasks} must lie "
                f"within the fold's {SEEDS_PER_FOLD} seeds (num_tasks >= 1, seed_offset >= 0)"
            )
        p = DEFAULT_PARAMS.get(game, "") if params is None else params
        first = FOLD_SEEDS[fold] + seed_offset
        return [
            {
                "id": f"{game}/{fold}/{first + i}",
                "family": game,
                "game": game,
                "params": p,
                "game_seed": first + i,
                "fold": fold,
            }
            for i in range(num_tasks)
        ]

    def _reset(self, task: dict[str, Any], seed: int) -> tuple[str, dict[str, Any]]:
        env = self._server()
        key = (task["game"], task.get("params", ""))
        if self._loaded != key:
            env.load(*key)
            self._loaded = key
        # TWX draws a game per (seed, fold): the task's game_seed must be valid for its fold
        obs, raw = env.reset(
            seed=int(task["game_seed"]), gameFold=task.get("fold", "train"), generateGoldPath=False
        )
        self._plan = None
        self._task_desc = raw.get("taskDescription", "")
        return obs, self._info_from(raw)

    CONTENT_VERSION: ClassVar[int] = 1
    """Bumped whenever ``task_content`` changes what it shows (cached digests then miss)."""

    @classmethod
    def content_identity(cls) -> str | None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            engine = version("textworld-express")
        except PackageNotFoundError:  # an engine without its metadata: nothing to key on
            return None
        return f"twx-content-v{cls.CONTENT_VERSION}/textworld-express-{engine}"

    def task_content(self, task: dict[str, Any]) -> str:
        """The start observation, the goal, and what one action shows from the start and two
        from it along navigation moves (``move`` / ``open``): games with one start room but
        other maps differ here (the start view alone merged 6 of 16 dev coin games, 6 rooms,
        with training games of other maps; with this look-ahead none)."""
        obs, info = self.reset(task, 0)
        parts = [obs, info.get("task_description", "")]
        frontier: list[list[str]] = [[]]
        for _depth in range(2):
            nxt: list[list[str]] = []
            for path in frontier:
                self._replay(task, path)
                for a in sorted(self.info["admissible"]):
                    self._replay(task, path)
                    res = self.step(a)
                    parts.append(" > ".join([*path, a]) + " | " + res.observation)
                    if not res.done and a.split(" ", 1)[0] in ("move", "open"):
                        nxt.append([*path, a])
            frontier = nxt
        return "\n".join(parts)

    def _replay(self, task: dict[str, Any], path: list[str]) -> None:
        self.reset(task, 0)
        for a in path:
            self.step(a)

    def _info_from(self, raw: dict[str, Any]) -> dict[str, Any]:
        return {
            "won": bool(raw.get("tasksuccess", False)),
            "lost": bool(raw.get("taskfailure", False)),
            "admissible": sorted(raw.get("validActions", [])),
            "score": float(raw.get("score", 0.0)),
            "task_description": self._task_desc,
        }

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        obs, reward, done, raw = self._env.step(action)
        info = self._info_from(raw)
        return obs, reward, bool(done or info["won"] or info["lost"]), info

    # -- oracle: breadth-first planning on a twin instance ------------------------------
    def oracle_action(self) -> str | None:
        if self._task is None or self._done:
            return None
        here = tuple(self._actions)
        if self._plan is not None:
            base, plan = self._plan
            k = len(here) - len(base)
            if (
                here[: len(base)] == base
                and 0 <= k < len(plan)
                and list(here[len(base) :]) == plan[:k]
            ):
                return plan[k]
        key = self._plan_key(here)
        if key in _PLANS:  # this state was planned before (another attempt, episode or instance)
            _PLANS.move_to_end(key)
            cached = _PLANS[key]
            found = list(cached) if cached is not None else None
        else:
            found = self._bfs()
            _PLANS[key] = tuple(found) if found else None
            if len(_PLANS) > PLAN_CACHE_SIZE:
                _PLANS.popitem(last=False)
        self._plan = (here, found) if found else None
        return found[0] if found else None

    def _plan_key(self, actions: tuple[str, ...]) -> tuple[Any, ...]:
        """What the planner's answer depends on: the game, the actions since reset (the
        engine is deterministic given its game seed) and the planner's limits."""
        t = self._task or {}
        game = (t.get("game"), t.get("params", ""), t.get("game_seed"), t.get("fold", "train"))
        limits = (self.step_limit, self.plan_max_nodes, self.plan_max_depth)
        return (*game, *limits, actions)

    def _key(self, obs: str, info: dict[str, Any]) -> str:
        return f"{obs}|{','.join(info['admissible'])}|{info['score']}"

    def _bfs(self) -> list[str] | None:
        if self._planner is None:
            self._planner = TWXEnv(step_limit=self.step_limit)
        tw = self._planner
        start = self.snapshot()
        seen = {self._key(self._obs, self._info)}
        frontier: list[list[str]] = [[]]
        nodes = 0
        for _depth in range(self.plan_max_depth):
            nxt: list[list[str]] = []
            for path in frontier:
                tw.restore(
                    {
                        **start,
                        "actions": start["actions"] + path,
                        "observation": None,
                        "digest": None,
                    },
                    verify=False,
                )
                actions = list(tw.info["admissible"])
                for i, a in enumerate(actions):
                    if nodes >= self.plan_max_nodes:
                        return None
                    nodes += 1
                    res = tw.step(a)
                    if res.info["won"]:
                        return path + [a]
                    key = self._key(res.observation, res.info)
                    if not res.done and key not in seen:
                        seen.add(key)
                        nxt.append(path + [a])
                    if i == len(actions) - 1:
                        break  # the next path restores its own state
                    tw.restore(
                        {
                            **start,
                            "actions": start["actions"] + path,
                            "observation": None,
                            "digest": None,
                        },
                        verify=False,
                    )
            if not nxt:
                return None
            frontier = nxt
        return None

    def close(self) -> None:
        if self._planner is not None:
            self._planner.close()
            self._planner = None
        if self._env is not None:
            try:
                self._env.close()
            except Exception:  # noqa: BLE001 - the JVM may already be gone
                pass
            self._env = None
            self._loaded = None
