"""Environment adapters behind the Env protocol; heavy imports happen inside the classes."""

from __future__ import annotations

from typing import Any

from salvage.envs.base import ReplayEnv, RestoreError

ENV_CLASSES = {
    "twx": "salvage.envs.twx:TWXEnv",
    "alfworld": "salvage.envs.alfworld:ALFWorldEnv",
    "scripted": "salvage.envs.scripted:ScriptedEnv",
    "webshop": "salvage.envs.webshop:WebShopEnv",
}


def env_class(name: str) -> type[ReplayEnv]:
    if name not in ENV_CLASSES:
        raise ValueError(f"env name must be one of {sorted(ENV_CLASSES)}, got {name!r}")
    import importlib

    mod, cls = ENV_CLASSES[name].split(":")
    return getattr(importlib.import_module(mod), cls)


def make_env(name: str, **kwargs: Any) -> ReplayEnv:
    return env_class(name)(**kwargs)


__all__ = ["ENV_CLASSES", "ReplayEnv", "RestoreError", "env_class", "make_env"]
