"""Every shipped YAML parses against the real classes (with the command its first line documents).

Configs whose models are built in (``tiny``, ``smollm2-135m-instruct``) are also
instantiated (module, datamodule, callbacks, trainer; weights load later, in
``configure_model``). Configs naming hub models (GPU runs) are parsed and type-checked
only: instantiating them would download a tokenizer; so are configs asking for
``accelerator: gpu`` on a machine without CUDA.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
BUILTIN = {"tiny", "smollm2-135m-instruct"}


def test_there_are_configs():
    assert CONFIGS


def _documented_configs(path: Path) -> list[str]:
    first = path.read_text().splitlines()[0]
    assert first.startswith("#"), "each YAML starts with a comment holding its command"
    words = shlex.split(first.lstrip("# "))
    configs = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--config"]
    if not configs:  # e.g. "# make demo"
        configs = [str(path.relative_to(ROOT))]
    assert str(path.relative_to(ROOT)) in configs, f"{path.name}: its command does not use it"
    return configs


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_config_parses_and_instantiates(path, monkeypatch):
    from salvage.cli import SalvageCLI

    configs = _documented_configs(path)
    text = "".join((ROOT / c).read_text() for c in configs)
    for rel in re.findall(r"source:\s*(\.\./shared/[^\s,}]+)", text):
        if not (ROOT / rel).exists():
            pytest.skip(f"{rel} is absent (configs reading ../shared/data need it)")
    args = [a for c in configs for a in ("--config", str(ROOT / c))]
    names = set(
        re.findall(r"name_or_path:\s*([^\s,}]+)", "".join((ROOT / c).read_text() for c in configs))
    )
    parse_only = bool(names - BUILTIN)
    if re.search(r"accelerator:\s*gpu", text):
        import torch

        parse_only = parse_only or not torch.cuda.is_available()  # a GPU fragment on a CPU machine

    class ParseOnly(SalvageCLI):
        def instantiate_classes(self) -> None:  # type-checked by the parser; nothing built
            self.parse_only = True

    monkeypatch.chdir(ROOT)
    cls = ParseOnly if parse_only else SalvageCLI
    cli = cls(
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        run=False,
        auto_configure_optimizers=False,
    )
    if not parse_only:
        assert cli.model is not None and cli.datamodule is not None and cli.trainer is not None
    else:
        assert cli.config["model"]["class_path"].startswith("salvage.")
