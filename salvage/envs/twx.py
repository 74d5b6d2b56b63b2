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

import json
from collections import OrderedDict
from typing import Any, ClassVar

from salvage.envs.base import ReplayEnv
from salvage.envs.twx_engine import new_engine
from salvage.errors import ConfigError

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

PLANNERS = ("cached", "reference")
"""``TWXEnv(planner=...)``: the oracle's breadth-first search with the transition cache, or
the one before it (``_bfs_reference``)."""

TRANSITION_CACHE_SIZE = 200_000
"""Engine states kept per process for the planner (least recently used dropped first)."""
_TRANSITIONS: OrderedDict[tuple[Any, ...], tuple[str, dict[str, Any], bool]] = OrderedDict()
"""(observation, info, done) per ((game, params, game_seed, fold, step_limit), actions since
reset), for every state the planner's twin reached, shared by every instance of the process:
the engine is deterministic given the game and the actions (``_plan_key`` assumes it too), so
a search reaching a state some earlier search reached reads it here instead of restoring the
twin (a reset and a replay of the whole history) and stepping it."""


def _remember(
    game: tuple[Any, ...], actions: tuple[str, ...], obs: str, info: dict[str, Any], done: bool
) -> None:
    key = (game, actions)
    _TRANSITIONS[key] = (obs, info, done)
    _TRANSITIONS.move_to_end(key)
    if len(_TRANSITIONS) > TRANSITION_CACHE_SIZE:
        _TRANSITIONS.popitem(last=False)


class TWXEnv(ReplayEnv):
    name: ClassVar[str] = "twx"

    def __init__(
        self,
        step_limit: int = 100,
        plan_max_nodes: int = 400,
        plan_max_depth: int = 30,
        planner: str = "cached",
        share_jvm: bool = True,
    ) -> None:
        """Args:
        step_limit: the engine's step limit per game (``done`` past it).
        plan_max_nodes: the oracle's breadth-first search gives up after this many nodes.
        plan_max_depth: ... and below this depth.
        planner: the oracle's search: ``cached`` (reads the process's transition cache) or
            ``reference`` (the search before it: a reset and replay per node; same plans,
            kept for checks and before/after benchmarks).
        share_jvm: this process's engines share one JVM (each its own game; ~2 ms and no
            extra memory an engine instead of ~0.7 s and ~80 MB); false: a JVM each.
        """
        super().__init__()
        if planner not in PLANNERS:
            raise ConfigError(f"twx env planner={planner!r}: must be one of {', '.join(PLANNERS)}")
        self.planner = planner
        self.share_jvm = share_jvm
        self.step_limit = step_limit
        self.plan_max_nodes = plan_max_nodes
        self.plan_max_depth = plan_max_depth
        self._env: Any = None
        self._loaded: tuple[str, str] | None = None
        self._task_desc = ""
        self._planner: TWXEnv | None = None
        self._ref_planner: TWXEnv | None = None  # ``_bfs_reference``'s twin (today's steps)
        self._plan: tuple[tuple[str, ...], list[str]] | None = None
        self.engine_steps = 0
        """Steps this instance asked of its engine (resets not counted)."""
        self._lean = False  # the planner's twin: one engine call per step (``_lean_step``)
        self._descs: dict[tuple[Any, ...], str] = {}
        self._lean_raw: dict[str, Any] = {}
        self._lean_moves = 0
        self._lean_score = 0.0

    def _server(self) -> Any:
        if self._env is None:
            try:
                import textworld_express  # noqa: F401
            except ImportError as e:
                raise RuntimeError(
                    "env 'twx' needs textworld-express: pip install 'salvage[twx]' (needs Java)"
                ) from e
            self._env = new_engine(self.step_limit, self.share_jvm)
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
        seed_, fold = int(task["game_seed"]), task.get("fold", "train")
        self._plan = None
        if self._lean:
            raw = json.loads(env.server.generateNewGameJSON(seed_, fold, False))
            game = (*key, seed_, fold)
            if game not in self._descs:  # the same for every reset of one game
                self._descs[game] = env.server.getTaskDescription()
            self._task_desc = self._descs[game]
            self._lean_raw, self._lean_moves, self._lean_score = raw, 0, 0.0
            return raw["observation"], self._info_from(raw)
        obs, raw = env.reset(seed=seed_, gameFold=fold, generateGoldPath=False)
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
        if self._lean:
            obs, reward, done, raw = self._lean_step(action)
        else:
            obs, reward, done, raw = self._env.step(action)
        self.engine_steps += 1
        info = self._info_from(raw)
        return obs, reward, bool(done or info["won"] or info["lost"]), info

    def _lean_step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """``TextWorldExpressEnv.step`` in one engine call instead of two (it asks the engine
        for the task description on every step; a game's is fixed, fetched at its first
        reset): the same observation, reward, done and fields ``_info_from`` reads, checked
        against it in tests/test_twx_planner.py. The planner's twin steps this way; a step
        costs one round trip to the JVM, which is most of its time."""
        if action == "help":  # the wrapper answers it itself: no engine step, no move
            return self._task_desc, 0, False, dict(self._lean_raw)
        raw = json.loads(self._env.server.stepJSON(action))
        self._lean_moves += 1
        score = raw["score"]
        reward, self._lean_score = score - self._lean_score, score
        done = (
            self._lean_moves > self.step_limit
            or score >= 1.0
            or bool(raw["tasksuccess"])
            or bool(raw["taskfailure"])
        )
        self._lean_raw = raw
        return raw["observation"], reward, done, raw

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
            found = self._bfs() if self.planner == "cached" else self._bfs_reference()
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

    def _game_id(self) -> tuple[Any, ...]:
        """What the engine's transitions depend on besides the actions since reset: the game
        and the step limit (``done`` turns true past it)."""
        t = self._task or {}
        return (
            t.get("game"),
            t.get("params", ""),
            t.get("game_seed"),
            t.get("fold", "train"),
            self.step_limit,
        )

    def _twin(self) -> TWXEnv:
        if self._planner is None:
            self._planner = TWXEnv(step_limit=self.step_limit, share_jvm=self.share_jvm)
            self._planner._lean = True
        return self._planner

    def _engine_at(self, actions: tuple[str, ...]) -> TWXEnv:
        """The twin at the state after ``actions`` since reset: stepped on from where it is
        when it stands on a prefix of them, else reset and replayed. Every state it passes is
        recorded in the transition cache."""
        tw = self._twin()
        game = self._game_id()
        have = tuple(tw._actions)
        if (
            tw._task is None
            or tw._game_id() != game
            or tw._done
            or len(have) > len(actions)
            or actions[: len(have)] != have
        ):
            assert self._task is not None
            tw.reset(self._task, self._seed)
            have = ()
            _remember(game, (), tw.observation, tw.info, False)
        for t in range(len(have), len(actions)):
            if tw._done:  # the history ends the game before its last action (not a planner path)
                raise RuntimeError(f"twx planner: {actions[:t]} ends the game")
            res = tw.step(actions[t])
            _remember(game, actions[: t + 1], res.observation, res.info, res.done)
        return tw

    def _state(self, actions: tuple[str, ...]) -> tuple[str, dict[str, Any], bool]:
        """(observation, info, done) after ``actions`` since reset: the cache, else the twin."""
        game = self._game_id()
        hit = _TRANSITIONS.get((game, actions))
        if hit is not None:
            _TRANSITIONS.move_to_end((game, actions))
            return hit
        tw = self._engine_at(actions)
        return tw.observation, tw.info, tw._done

    def _bfs(self) -> list[str] | None:
        """Breadth-first search over the admissible actions from the current state, shortest
        plan first; the same search as ``_bfs_reference`` (same order, same dedup of states by
        ``_key``, the same node count against ``plan_max_nodes``), but each state's outcome
        comes from the process's transition cache when some earlier search (this one, another
        attempt, anchor or instance of the game) reached it, and the twin steps only for states
        not cached yet, restored only when it does not already stand on the parent."""
        start = tuple(self._actions)
        game = self._game_id()
        # the current state is the root (the engine is deterministic given the actions)
        _remember(game, start, self._obs, self._info, self._done)
        seen = {self._key(self._obs, self._info)}
        frontier: list[tuple[str, ...]] = [()]
        nodes = 0
        for _depth in range(self.plan_max_depth):
            nxt: list[tuple[str, ...]] = []
            for path in frontier:
                parent = start + path
                actions = list(self._state(parent)[1]["admissible"])
                for a in actions:
                    if nodes >= self.plan_max_nodes:
                        return None
                    nodes += 1
                    obs, info, done = self._state((*parent, a))
                    if info["won"]:
                        return [*path, a]
                    key = self._key(obs, info)
                    if not done and key not in seen:
                        seen.add(key)
                        nxt.append((*path, a))
            if not nxt:
                return None
            frontier = nxt
        return None

    def _bfs_reference(self) -> list[str] | None:
        """The planner before the transition cache (kept to check ``_bfs`` against): every
        node restores the twin (reset + replay of the whole history), then steps."""
        if self._ref_planner is None:
            self._ref_planner = TWXEnv(step_limit=self.step_limit, share_jvm=self.share_jvm)
        tw = self._ref_planner
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
        for twin in (self._planner, self._ref_planner):
            if twin is not None:
                twin.close()
        self._planner = self._ref_planner = None
        if self._env is not None:
            try:
                self._env.close()
            except Exception:  # noqa: BLE001 - the JVM may already be gone
                pass
            self._env = None
            self._loaded = None
