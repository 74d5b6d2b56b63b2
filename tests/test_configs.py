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
    from salvage.commands.fit import SalvageCLI

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


# ---------------------------------------------------------------- fidelity of the configs


def _resolve(*configs: str) -> dict:
    from salvage.commands.fit import SalvageCLI

    class ParseOnly(SalvageCLI):
        def instantiate_classes(self) -> None:
            pass

    cli = ParseOnly(
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=[a for c in configs for a in ("--config", str(ROOT / c))],
        run=False,
        auto_configure_optimizers=False,
    )
    return cli.config.as_dict()


def _flat(d: object, prefix: str = "") -> dict[str, object]:
    if isinstance(d, dict):
        out: dict[str, object] = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: d}


# VH-GPO runs and their GRPO baselines (SPEC 1: "unchanged standard GRPO")
STANDARD_GRPO = sorted(
    {str(p.relative_to(ROOT)) for p in (ROOT / "configs/vhgpo").rglob("*.yaml")}
    | {"configs/demo.yaml", "configs/agent/alfworld_grpo.yaml", "configs/agent/webshop_grpo.yaml"}
)


@pytest.mark.parametrize("rel", STANDARD_GRPO)
def test_vhgpo_configs_use_standard_grpo(rel, monkeypatch):
    monkeypatch.chdir(ROOT)
    m = _resolve(*_documented_configs(ROOT / rel))["model"]["init_args"]
    assert (m["clip_eps_low"], m["clip_eps_high"], m["loss_agg"]) == (
        0.2,
        0.2,
        "seq-mean-token-mean",
    )


def test_dapo_settings_stay_switches():
    from salvage.modules.vhgpo import VHGPOModule

    m = VHGPOModule(clip_eps_high=0.28, loss_agg="token-mean")
    assert (m.hparams.clip_eps_high, m.hparams.loss_agg) == (0.28, "token-mean")
    assert (VHGPOModule().hparams.clip_eps_high, VHGPOModule().hparams.loss_agg) == (
        0.2,
        "seq-mean-token-mean",
    )


ABLATIONS = sorted((ROOT / "configs/vhgpo/ablations").glob("*.yaml"))


@pytest.mark.parametrize(
    "base",
    [
        "configs/vhgpo/alfworld_1p5b.yaml",
        # slow (every fragment parsed again, 38 s on a make-test worker): the same fragments
        # on ALFWorld's config stay in the default suite
        pytest.param("configs/vhgpo/webshop_1p5b.yaml", marks=pytest.mark.slow),
    ],
)
def test_vhgpo_ablation_fragments_change_only_their_own_keys(base, monkeypatch):
    """Composed with a GPU config, each fragment keeps its LM teacher, budgets and all else."""
    import yaml

    monkeypatch.chdir(ROOT)
    ref = _resolve(base)
    assert ref["rescue"]["init_args"]["teacher"]["kind"] == "lm"
    flat_ref = _flat(ref)
    for frag in ABLATIONS:
        rel = str(frag.relative_to(ROOT))
        own = yaml.safe_load(frag.read_text())
        keys = set(_flat(own))
        if own.get("rescue") is None or "class_path" in own["rescue"]:
            keys.add("rescue")  # a different (or no) rescue stage: its whole subtree
        got = _resolve(base, rel)
        flat = _flat(got)
        differ = {k for k in flat_ref.keys() | flat.keys() if flat_ref.get(k) != flat.get(k)}
        differ.discard("config")  # the list of --config files itself
        stray = {d for d in differ if not any(d == k or d.startswith(k + ".") for k in keys)}
        assert not stray, f"{rel} on {base} also changes {sorted(stray)}"
        assert differ, f"{rel} changes nothing on {base}"
        rescue = got.get("rescue")
        # the search budgets are the base config's (a stage without them: DynamicSampling)
        if rescue is not None and "relay" in rescue["init_args"]:
            assert rescue["init_args"]["relay"] | _flat_relay(own) == rescue["init_args"]["relay"]
            for k, v in ref["rescue"]["init_args"]["relay"].items():
                if k not in _flat_relay(own):
                    assert rescue["init_args"]["relay"][k] == v, (rel, k)
            if rescue["class_path"].endswith("VerifiedHandoff"):
                assert rescue["init_args"]["teacher"] == ref["rescue"]["init_args"]["teacher"]


def _flat_relay(own: dict) -> dict:
    r = own.get("rescue") or {}
    return dict((r.get("init_args") or {}).get("relay") or {})


def test_random_verified_handoff_fragment_resolves_to_the_switch(monkeypatch):
    monkeypatch.chdir(ROOT)
    got = _resolve(
        "configs/vhgpo/alfworld_1p5b.yaml", "configs/vhgpo/ablations/random_verified_handoff.yaml"
    )
    relay = got["rescue"]["init_args"]["relay"]
    assert relay["handoff"] == "random" and relay["random_fallback"] == "discard"
    assert got["rescue"]["init_args"]["teacher"]["policy"]["name_or_path"].startswith("Qwen/")
