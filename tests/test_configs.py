"""Every shipped YAML parses against the real classes, so none can rot."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))


def test_there_are_configs():
    assert CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_config_parses_and_instantiates(path, monkeypatch):
    from salvage.cli import SalvageCLI

    text = path.read_text()
    assert text.startswith("#"), "each YAML starts with a comment holding its command"
    fragment = "model" not in (yaml.safe_load(text) or {})  # fragments compose with an experiment
    args = ["--config", str(path)]
    if fragment:
        args = ["--config", str(ROOT / "configs/grpo/math_tiny.yaml"), *args]
    monkeypatch.chdir(ROOT)
    # run=False: parse and instantiate (module, datamodule, trainer) without fitting.
    # Built-in real models only load their tokenizer at this point.
    cli = SalvageCLI(subclass_mode_model=True, subclass_mode_data=True, args=args, run=False,
                     auto_configure_optimizers=False)
    assert cli.model is not None and cli.datamodule is not None
