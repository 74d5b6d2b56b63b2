"""ALFWorld text games (extra ``alfworld``) through the alfworld package's TextWorld machinery.

A task is one game file: ``{"id", "gamefile", "family"}``. Data come from
``data_path`` (``env.train_tasks.data_path``, ``env.val_tasks.data_path``: the arguments of
``list_tasks``, one per split) or ``$ALFWORLD_DATA``, laid out as ``alfworld-download`` lays them
out (``<split dir>/<task folder>/<trial>/{game.tw-pddl, traj_data.json}``). Split dirs:
train -> ``json_2.1.1/train`` or ``train``; val -> ``valid_seen``; test -> ``valid_unseen``
(configurable). The handcoded expert (which re-plans from the observed history, so it
works from any restored state) is ``info["oracle_action"]``. ALFWorld has no state copy:
restore is the universal verified replay (reset 1-4 s, step 0.15-0.25 s here).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, ClassVar

from salvage.envs.base import ReplayEnv
from salvage.errors import ConfigError, MissingFileError

# alfworld task_type -> SPEC §2.6 family name
FAMILIES = {
    "pick_and_place_simple": "pick_and_place",
    "pick_two_obj_and_place": "pick_two_obj",
    "look_at_obj_in_light": "look_at_obj_in_light",
    "pick_heat_then_place_in_recep": "pick_heat_then_place",
    "pick_cool_then_place_in_recep": "pick_cool_then_place",
    "pick_clean_then_place_in_recep": "pick_clean_then_place",
}
SPLIT_DIRS = {
    "train": ("json_2.1.1/train", "train"),
    "val": ("json_2.1.1/valid_seen", "valid_seen"),
    "test": ("json_2.1.1/valid_unseen", "valid_unseen"),
}
_TASK_RE = re.compile(r"Your task is to:\s*(.+)")


def data_root(data_path: str | None, split: str = "train") -> Path:
    """The ALFWorld data folder of a split: its ``data_path`` (task-list key), else $ALFWORLD_DATA."""
    key = f"data.init_args.env.{split}_tasks.data_path"
    if split == "test":
        key += " (or env.val_tasks.data_path when test_tasks is unset)"
    root = data_path or os.environ.get("ALFWORLD_DATA")
    if not root:
        raise ConfigError(
            f"alfworld {split} tasks need their data folder: set {key} or $ALFWORLD_DATA "
            "(the folder alfworld-download fills)"
        )
    p = Path(os.path.expandvars(root)).expanduser()
    if not p.is_dir():
        raise MissingFileError(
            f"alfworld data_path {str(p)!r} ({key} or $ALFWORLD_DATA) is not a directory"
        )
    return p


class ALFWorldEnv(ReplayEnv):
    name: ClassVar[str] = "alfworld"

    def __init__(self, expert: str = "handcoded", max_steps: int = 200) -> None:
        super().__init__()
        if expert not in ("handcoded", "planner"):
            raise ValueError(f"alfworld expert must be 'handcoded' or 'planner', got {expert!r}")
        self.expert = expert
        self.max_steps = max_steps
        self._env: Any = None
        self._gamefile: str | None = None
        self._task_desc = ""

    @classmethod
    def list_tasks(
        cls,
        split: str,
        data_path: str | None = None,
        split_dir: str | None = None,
        num_tasks: int | None = None,
        families: list[str] | None = None,
    ) -> list[dict[str, Any]]:
        root = data_root(data_path, split)
        candidates = [split_dir] if split_dir else list(SPLIT_DIRS.get(split, (split,)))
        base = next((root / c for c in candidates if (root / c).is_dir()), None)
        if base is None:
            raise FileNotFoundError(f"alfworld: no split dir {candidates} under {root}")
        tasks = []
        for traj in sorted(base.rglob("traj_data.json")):
            folder = traj.parent
            game = folder / "game.tw-pddl"
            if "movable" in str(folder) or "Sliced" in str(folder) or not game.exists():
                continue
            try:
                ttype = json.loads(traj.read_text())["task_type"]
                if not json.loads(game.read_text()).get("solvable", False):
                    continue
            except (json.JSONDecodeError, KeyError, OSError):
                continue
            family = FAMILIES.get(ttype, ttype)
            if families and family not in families:
                continue
            tasks.append(
                {"id": str(folder.relative_to(root)), "gamefile": str(game), "family": family}
            )
            if num_tasks and len(tasks) >= num_tasks:
                break
        if not tasks:
            raise FileNotFoundError(f"alfworld: no solvable games under {base}")
        return tasks

    def _load(self, gamefile: str) -> None:
        try:
            import textworld
            from alfworld.agents.environment.alfred_tw_env import (
                AlfredDemangler,
                AlfredExpert,
                AlfredInfos,
            )
        except ImportError as e:
            raise RuntimeError(
                "env 'alfworld' needs the alfworld package: pip install 'salvage[alfworld]'"
            ) from e
        if self._env is not None:
            self._env.close()
        infos = textworld.EnvInfos(
            won=True, admissible_commands=True, extras=["gamefile", "expert_plan"]
        )
        self._env = textworld.start(
            gamefile,
            request_infos=infos,
            wrappers=[
                AlfredDemangler(shuffle=False),
                AlfredInfos,
                AlfredExpert(expert_type=self.expert),
            ],
        )
        self._gamefile = gamefile

    @classmethod
    def task_text(cls, task: dict[str, Any]) -> str | None:
        """The game file (its layout, objects and goal): resetting thousands of games at
        start-up to read their first observation would take an hour."""
        return Path(task["gamefile"]).read_text(encoding="utf-8", errors="replace")

    def _reset(self, task: dict[str, Any], seed: int) -> tuple[str, dict[str, Any]]:
        if self._gamefile != task["gamefile"]:
            self._load(task["gamefile"])
        st = self._env.reset()
        m = _TASK_RE.search(st["feedback"])
        self._task_desc = m.group(1).strip() if m else ""
        return st["feedback"], self._state_info(st)

    def _state_info(self, st: Any) -> dict[str, Any]:
        plan = st.get("extra.expert_plan") or []
        return {
            "won": bool(st.get("won", False)),
            "admissible": [a for a in st.get("admissible_commands", []) if a != "help"],
            "score": float(bool(st.get("won", False))),
            "task_description": self._task_desc,
            "oracle_action": plan[0] if plan else None,
        }

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        st, reward, done = self._env.step(action)
        info = self._state_info(st)
        return (
            st["feedback"],
            float(reward),
            bool(done or info["won"] or self.depth + 1 >= self.max_steps),
            info,
        )

    def close(self) -> None:
        if self._env is not None:
            try:
                self._env.close()
            except Exception:  # noqa: BLE001
                pass
            self._env = None
            self._gamefile = None
