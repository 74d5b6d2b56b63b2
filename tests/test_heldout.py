"""Held-out data is held out: TextWorld-Express folds from the engine's own seed ranges,
math pools deduplicated and split by content, and the overlap guard of every datamodule
(refuses a fit whose validation / test tasks are training tasks, naming both sources),
run over every shipped config and study file."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml
from conftest import needs_twx

from salvage.core.heldout import (
    digest_fraction,
    in_digest_part,
    normalise_text,
    overlap,
    text_digest,
)
from salvage.errors import ConfigError
from salvage.tasks.math import MathData, load_math_tasks, task_digest

ROOT = Path(__file__).resolve().parents[1]
ADD = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 1,
    "operators": ["+", "-"],
    "allow_parentheses": False,
    "allow_negation": False,
}


# ---------------------------------------------------------------------- the pure core
def test_digests_ignore_case_and_whitespace_and_splits_partition_the_pool():
    assert normalise_text("  Calculate\t5 +  4. ") == "calculate 5 + 4."
    assert text_digest("Calculate 5 + 4.") == text_digest("calculate  5 + 4. ")
    assert text_digest("a", "b") != text_digest("a b")  # parts stay apart
    d = "8" + "0" * 39  # first 52 bits = 0x8000000000000 -> exactly one half
    assert digest_fraction(d) == 0.5
    assert in_digest_part(d, 0.6, "heldout") and not in_digest_part(d, 0.6, "train")
    assert in_digest_part(d, 0.5, "train") and not in_digest_part(d, 0.5, "heldout")
    o = overlap("val", {"t0": "x", "t1": "y", "t2": "x"}, {"v0": "x", "v1": "z"})
    assert o.pairs == (("v0", "t0"),) and o.count == 1 and o.frac == 0.5


# ---------------------------------------------------------------------- TextWorld-Express
def test_twx_folds_take_the_engines_own_seed_ranges_and_dev_games_are_unseen():
    needs_twx()
    from salvage.envs.twx import TWXEnv

    params = "numLocations=6,includeDoors=0,numDistractorItems=0"
    train = TWXEnv.list_tasks("train", "coin", params, num_tasks=16)
    dev = TWXEnv.list_tasks("val", "coin", params, num_tasks=8, seed_offset=3)
    test = TWXEnv.list_tasks("test", "coin", params, num_tasks=8)
    assert [t["game_seed"] for t in train] == list(range(16))
    assert [t["game_seed"] for t in dev] == list(range(10003, 10011))
    assert [t["game_seed"] for t in test] == list(range(20000, 20008))
    assert {t["fold"] for t in dev} == {"dev"} and dev[0]["id"] == "coin/dev/10003"
    with pytest.raises(ValueError, match="seed_offset=995 \\+ num_tasks=8"):
        TWXEnv.list_tasks("val", "coin", params, num_tasks=8, seed_offset=995)
    env = TWXEnv()
    try:
        seen = {text_digest(env.task_content(t)) for t in train}
        starts = {env.reset(t, 0)[0] for t in train}
        for t in dev + test:
            assert text_digest(env.task_content(t)) not in seen, t["id"]
        # the old scheme (dev seeds = training seeds) gave the training games back
        old = {**dev[0], "game_seed": 3}
        assert env.reset(old, 0)[0] == env.reset(train[3], 0)[0]
    finally:
        env.close()
    assert len(starts) > 1


def _agent_dm(train, val, allow=False):
    from salvage.datamodules.agent import AgentDataModule, EnvSpec

    return AgentDataModule(
        env=EnvSpec(name="twx", train_tasks=train, val_tasks=val), allow_overlap=allow
    )


def test_overlap_guard_refuses_an_agent_fit_on_training_games_naming_both_sources():
    needs_twx()
    one_room = {"game": "coin", "params": "numLocations=1,includeDoors=0,numDistractorItems=0"}
    dm = _agent_dm({**one_room, "num_tasks": 4}, {**one_room, "num_tasks": 2})
    with pytest.raises(ConfigError) as e:
        dm.setup("fit")
    msg = str(e.value)
    assert "2 of 2 val tasks" in msg and "data.env.val_tasks" in msg
    assert "data.env.train_tasks" in msg and "'coin/dev/10000'" in msg
    assert "data.allow_overlap: true" in msg and "\n" not in msg
    dm = _agent_dm({**one_room, "num_tasks": 4}, {**one_room, "num_tasks": 2}, allow=True)
    dm.setup("fit")
    try:
        assert dm.heldout_metrics["data/heldout_overlap/val"] == 1.0
    finally:
        dm.teardown("fit")
    six = {"game": "coin", "params": "numLocations=6,includeDoors=0,numDistractorItems=0"}
    dm = _agent_dm({**six, "num_tasks": 8}, {**six, "num_tasks": 4})
    dm.setup("fit")
    try:
        assert dm.heldout_metrics == {
            "data/heldout_overlap": 0.0,
            "data/heldout_overlap/val": 0.0,
            "data/heldout_overlap/test": 0.0,
        }
    finally:
        dm.teardown("fit")


# slow (~140 games digested by hand, 41 s on a make-test worker): the default suite keeps the
# folds' seed ranges (test_twx_folds_take_...) and the guard's refusal on training games
@pytest.mark.slow
def test_twx_fold_key_gives_unseen_training_fold_games_and_drop_overlap_keeps_them_distinct():
    """In-distribution held-out games: the validation split drawn from the training fold
    (``fold: train`` past the training seeds), each game once and none a training game's
    (twc repeats games across seeds), labelled beside the dev games."""
    needs_twx()
    from salvage.datamodules.agent import AgentDataModule, EnvSpec
    from salvage.envs.twx import TWXEnv

    twc = {"game": "twc", "params": "numLocations=1,numItemsToPutAway=2"}
    tr = TWXEnv.list_tasks("val", **twc, num_tasks=3, seed_offset=256, fold="train")
    assert [t["game_seed"] for t in tr] == [256, 257, 258] and tr[0]["id"] == "twc/train/256"
    assert {t["fold"] for t in tr} == {"train"}
    with pytest.raises(ValueError, match="fold must be one of .* got 'valid'"):
        TWXEnv.list_tasks("val", **twc, fold="valid")
    sources = [
        {**twc, "fold": "train", "num_tasks": 6, "label": "indist"},  # training games: dropped
        {**twc, "fold": "train", "seed_offset": 64, "num_tasks": 48, "label": "indist"},
        {**twc, "num_tasks": 24, "label": "dev"},
    ]
    train = {**twc, "num_tasks": 64}

    def dm(**kw):
        spec = EnvSpec(name="twx", train_tasks=train, val_tasks=sources)
        return AgentDataModule(env=spec, **kw)

    with pytest.raises(ConfigError, match="val tasks .*data.env.val_tasks"):
        dm().setup("fit")
    with pytest.raises(ConfigError, match="allow_overlap and data.drop_overlap"):
        dm(allow_overlap=True, drop_overlap=True)
    d = dm(drop_overlap=True)
    d.setup("fit")
    try:
        env = TWXEnv()
        try:
            digest = {}
            for t in TWXEnv.list_tasks("train", **twc, num_tasks=64) + [
                t for s in sources for t in TWXEnv.list_tasks("val", **s_args(s))
            ]:
                digest[t["id"]] = text_digest(env.task_content(t))
        finally:
            env.close()
        seen = {digest[f"twc/train/{i}"] for i in range(64)}
        listed = [t for s in sources for t in TWXEnv.list_tasks("val", **s_args(s))]
        expect, kept_d = [], set()
        for t in listed:  # by hand: first of each content, none a training game
            if digest[t["id"]] not in seen and digest[t["id"]] not in kept_d:
                kept_d.add(digest[t["id"]])
                expect.append(t["id"])
        val = d.tasks["val"]
        assert [t["id"] for t in val] == expect
        assert 6 + 1 <= len(listed) - len(val)  # the 6 training games and >= 1 repeat (twc)
        assert d.heldout_metrics["data/heldout_dropped/val"] == len(listed) - len(val)
        assert d.heldout_metrics["data/heldout_overlap/val"] == 0.0
        assert {t["family"] for t in val} == {"indist", "dev"}
        assert all(t["fold"] == ("train" if t["family"] == "indist" else "dev") for t in val)
        assert len({digest[t["id"]] for t in val}) == len(val)
    finally:
        d.teardown("fit")
    dup = EnvSpec(name="twx", train_tasks=train, val_tasks=[sources[2], sources[2]])
    with pytest.raises(ConfigError, match="'twc/dev/10000' is listed by sources 0 and 1"):
        AgentDataModule(env=dup).setup("fit")
    bad = EnvSpec(name="twx", train_tasks=train, val_tasks=[{**twc, "label": "a/b"}])
    with pytest.raises(ConfigError, match=r"val_tasks\[0\].label"):
        AgentDataModule(env=bad).setup("fit")


def s_args(source):
    return {k: v for k, v in source.items() if k != "label"}


# ---------------------------------------------------------------------- math
def test_math_pools_are_deduplicated_and_digest_splits_are_disjoint():
    pool = MathData(source="reasoning_gym:basic_arithmetic", size=600, seed=0, rg_kwargs=ADD)
    tasks, rep = load_math_tasks(pool)
    digests = [task_digest(t) for t in tasks]
    assert len(set(digests)) == len(digests) and rep["duplicates"] > 0
    assert rep["rows"] == 600 == len(tasks) + rep["duplicates"]
    raw, _ = load_math_tasks(MathData(**{**pool.__dict__, "dedupe": False}))
    assert len(raw) == 600 and len({task_digest(t) for t in raw}) == len(tasks)
    parts = {
        p: load_math_tasks(MathData(**{**pool.__dict__, "split_frac": 0.25, "split_part": p}))[0]
        for p in ("train", "heldout")
    }
    tr = {task_digest(t) for t in parts["train"]}
    held = {task_digest(t) for t in parts["heldout"]}
    assert not tr & held and tr | held == set(digests)
    assert 0.1 < len(held) / len(digests) < 0.4  # about split_frac of the distinct prompts
    with pytest.raises(ConfigError, match="split_part"):
        MathData(split_frac=0.2, split_part="val")


def _rlvr(val_seed, allow=False, **val):
    from salvage.datamodules.rlvr import RLVRDataModule

    src = {"source": "reasoning_gym:basic_arithmetic", "rg_kwargs": ADD}
    return RLVRDataModule(
        train=MathData(**src, name="add", size=200, seed=0),
        val=MathData(**src, name="add", size=32, seed=val_seed, **val),
        allow_overlap=allow,
    )


def test_overlap_guard_refuses_math_validation_prompts_from_the_training_pool():
    dm = _rlvr(100)  # the old study's validation set: every prompt is in the RL pool
    with pytest.raises(ConfigError) as e:
        dm.setup("fit")
    assert "val tasks (data.val)" in str(e.value) and "(data.train)" in str(e.value)
    dm = _rlvr(100, allow=True)
    dm.setup("fit")
    assert dm.heldout_metrics["data/heldout_overlap/val"] > 0.5
    from salvage.datamodules.rlvr import RLVRDataModule

    src = {"source": "reasoning_gym:basic_arithmetic", "rg_kwargs": ADD, "size": 2000}
    dm = RLVRDataModule(
        train=MathData(**src, split_frac=0.25, split_part="train"),
        val=MathData(**src, split_frac=0.25, split_part="heldout"),
    )
    dm.setup("fit")
    assert dm.heldout_metrics["data/heldout_overlap"] == 0.0 and len(dm.tasks["val"]) > 20


# ---------------------------------------------------------------------- shipped files
def _datamodule(args: list[str]):
    """The datamodule of a CLI command line (config files and overrides), nothing else."""
    import lightning as L
    from jsonargparse import ArgumentParser

    from salvage.commands.fit import SalvageCLI

    class ParseOnly(SalvageCLI):
        def instantiate_classes(self) -> None:
            pass

    cli = ParseOnly(
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        run=False,
        auto_configure_optimizers=False,
    )
    p = ArgumentParser()
    p.add_subclass_arguments(L.LightningDataModule, "data")
    data = cli.config["data"].as_dict()
    callbacks = cli.config["trainer"].as_dict().get("callbacks") or []
    return p.instantiate(p.parse_object({"data": data})).data, callbacks


def _sft_digests(callbacks) -> dict[str, str]:
    """Digest -> AnswerSFT source name of every warm-start prompt of a config."""
    out = {}
    for cb in callbacks:
        if isinstance(cb, dict) and cb.get("class_path", "").endswith("AnswerSFT"):
            data = cb["init_args"].get("data") or {}
            for src in data if isinstance(data, list) else [data]:
                for t in load_math_tasks(MathData(**src))[0]:
                    out[task_digest(t)] = src.get("name") or src.get("source")
    return out


def _check(args: list[str], extra_sft: dict[str, str] | None = None) -> dict[str, float]:
    try:
        dm, callbacks = _datamodule(args)
        dm.setup("fit")
    except (ValueError, FileNotFoundError) as e:  # ConfigError is a ValueError
        if "held-out" in str(e):
            raise
        pytest.skip(f"needs external data: {e}")
    try:
        sft = {**_sft_digests(callbacks), **(extra_sft or {})}
        for split in ("val", "test"):
            if split in dm.tasks:
                hit = set(dm.task_digests(split).values()) & set(sft)
                assert not hit, f"{split} prompts are warm-start prompts ({sorted(hit)[:2]})"
        return dm.heldout_metrics
    finally:
        dm.teardown("fit")


def _documented(path: Path) -> list[str]:
    words = shlex.split(path.read_text().splitlines()[0].lstrip("# "))
    configs = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--config"]
    return [a for c in (configs or [str(path.relative_to(ROOT))]) for a in ("--config", c)]


def _data_configs() -> list[Path]:
    out, seen = [], set()
    for p in sorted((ROOT / "configs").rglob("*.yaml")):
        key = json.dumps((yaml.safe_load(p.read_text()) or {}).get("data"), sort_keys=True)
        if key != "null" and key not in seen:  # fragments without their own data repeat a base
            seen.add(key)
            out.append(p)
    return out


@pytest.mark.parametrize("path", _data_configs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_config_has_no_heldout_overlap(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    if any(w in path.read_text() for w in ("game: ", "name: twx")):
        needs_twx()
    text = path.read_text()
    if "../shared/" in text and not (ROOT.parent / "shared" / "data").is_dir():
        pytest.skip("reads ../shared/data, which is absent")
    metrics = _check(_documented(path))
    assert metrics.get("data/heldout_overlap", 0.0) == 0.0


STUDIES = sorted((ROOT / "studies").glob("*.yaml")) + sorted(
    (ROOT / "studies/scale").glob("*.yaml")
)


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: p.name)
def test_every_study_has_no_heldout_overlap_with_its_runs_or_warm_starts(path, monkeypatch):
    from salvage.commands.study import load_study, plan

    monkeypatch.chdir(ROOT)
    if "twx" in path.read_text():
        needs_twx()
    study = load_study(path)
    sft: dict[str, str] = {}
    for _creates, args in study.prepare:  # the shared warm starts the runs load
        if args[0] == "fit":
            sft.update(_sft_digests(_datamodule(args[1:])[1]))
    run = plan(study, ROOT / "runs" / "_unused")[0]
    assert run.args[-2] == "--trainer.default_root_dir"
    args = run.args[:-2]
    assert _check(args, sft).get("data/heldout_overlap", 0.0) == 0.0
