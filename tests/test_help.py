"""Every knob a user can set has a description that ``salvage fit --help`` shows."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import typing

import lightning as L
import pytest
from jsonargparse import ArgumentParser

import salvage.commands.fit  # noqa: F401  (turns on dataclass attribute docstrings in help)

PACKAGES = ("salvage.modules", "salvage.datamodules", "salvage.callbacks")
SKIP_ACTIONS = ("_ActionConfigLoad", "_ActionHelpClassPath", "ActionConfigFile", "_HelpAction")


def user_classes() -> list[type]:
    """Every module, datamodule and callback class salvage defines."""
    out = []
    for pkg in PACKAGES:
        mod = importlib.import_module(pkg)
        for info in pkgutil.iter_modules(mod.__path__):
            m = importlib.import_module(f"{pkg}.{info.name}")
            for name, obj in vars(m).items():
                if (
                    inspect.isclass(obj)
                    and obj.__module__ == m.__name__
                    and not name.startswith("_")
                    and issubclass(obj, (L.LightningModule, L.LightningDataModule, L.Callback))
                ):
                    out.append(obj)
    return out


def _dataclasses_in(tp: typing.Any) -> list[type]:
    out = [tp] if dataclasses.is_dataclass(tp) and isinstance(tp, type) else []
    for arg in typing.get_args(tp):
        out += _dataclasses_in(arg)
    return out


def config_dataclasses() -> list[type]:
    """The config dataclasses reachable from the classes' init arguments (recursively)."""
    todo = [
        dc
        for cls in user_classes()
        for tp in typing.get_type_hints(cls.__init__).values()
        for dc in _dataclasses_in(tp)
    ]
    seen: list[type] = []
    while todo:
        dc = todo.pop()
        if dc in seen:
            continue
        seen.append(dc)
        todo += [d for tp in typing.get_type_hints(dc).values() for d in _dataclasses_in(tp)]
    return sorted(seen, key=lambda c: c.__name__)


def undocumented(cls: type) -> list[str]:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "x", fail_untyped=False)
    missing = []
    for action in parser._actions:
        dest = getattr(action, "dest", "")
        if not dest.startswith("x.") or dest.endswith(".help"):
            continue
        if type(action).__name__ in SKIP_ACTIONS:
            continue
        text = (action.help or "").strip()
        if not text or text.startswith("(type"):
            missing.append(dest[2:])
    return missing


def test_the_walk_finds_the_classes_users_configure():
    names = {c.__name__ for c in user_classes()}
    assert {"GRPOModule", "VHGPOModule", "GRAFTModule", "RLVRDataModule", "AgentDataModule"} <= (
        names
    )
    assert {"VerifiedHandoff", "OracleSFT", "StoredPeer", "RunSummary"} <= names
    dcs = {c.__name__ for c in config_dataclasses()}
    assert {"PolicySpec", "EngineConfig", "RelayConfig", "MathData", "EnvSpec"} <= dcs


@pytest.mark.parametrize("cls", user_classes() + config_dataclasses(), ids=lambda c: c.__name__)
def test_every_init_argument_has_a_description(cls):
    assert undocumented(cls) == []


def test_cli_help_shows_the_descriptions(capsys):
    from salvage.commands.cli import main

    with pytest.raises(SystemExit):
        main(["fit", "--model.help", "salvage.modules.grpo.GRPOModule"])
    out = capsys.readouterr().out
    assert "AdamW learning rate" in out and "RL updates of linear learning-rate warm-up" in out
    with pytest.raises(SystemExit):
        main(["fit", "--data.help", "salvage.datamodules.rlvr.RLVRDataModule"])
    assert "zero-signal test" in capsys.readouterr().out
