"""Small things a user hits, and WebShop's data loading errors."""

from __future__ import annotations

import json
import os
import shlex
import stat
from pathlib import Path

import pytest

from salvage.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parents[1]
ALFWORLD_CONFIGS = sorted((ROOT / "configs").rglob("alfworld*.yaml"))


# ---------------------------------------------------------------------- ALFWorld data paths
def test_alfworld_error_names_the_split_keys_that_are_read(monkeypatch):
    from salvage.envs.alfworld import ALFWorldEnv

    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    for split in ("train", "val"):
        with pytest.raises(ConfigError) as e:
            ALFWorldEnv.list_tasks(split)
        msg = str(e.value)
        assert f"data.init_args.env.{split}_tasks.data_path" in msg and "ALFWORLD_DATA" in msg
        assert "kwargs" not in msg  # env.kwargs.data_path is not read by anything


@pytest.mark.parametrize("path", ALFWORLD_CONFIGS, ids=lambda p: p.name)
def test_alfworld_one_liners_set_the_data_path_of_every_split(path, tmp_path, monkeypatch):
    """The command on a config's first line, run as written, points train, val and test at the data."""
    from salvage.commands.fit import SalvageCLI

    first = path.read_text().splitlines()[0]
    assert "kwargs.data_path" not in first
    words = shlex.split(first.lstrip("# ").replace("$ALFWORLD_DATA", str(tmp_path)))
    assert words[:2] == ["salvage", "fit"]

    class ParseOnly(SalvageCLI):  # hub models: parse and type-check, build nothing
        def instantiate_classes(self) -> None:
            pass

    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    cli = ParseOnly(
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=words[2:],
        run=False,
        auto_configure_optimizers=False,
    )
    env = cli.config["data"]["init_args"]["env"]
    assert env["train_tasks"]["data_path"] == str(tmp_path)
    assert env["val_tasks"]["data_path"] == str(tmp_path)
    assert env["test_tasks"]["data_path"] == str(tmp_path)  # valid_unseen


# ---------------------------------------------------------------------- WebShop data_dir
@pytest.fixture
def webshop(monkeypatch, tmp_path):
    pytest.importorskip("rapidfuzz", reason="the webshop extra is not installed")
    monkeypatch.setenv("SALVAGE_CACHE", str(tmp_path / "cache"))
    from salvage.envs import webshop

    return webshop


def test_webshop_data_dir_starting_with_synthetic_is_the_users_folder(
    webshop, tmp_path, monkeypatch
):
    from salvage.envs.webshop_synth import write_catalogue

    monkeypatch.chdir(tmp_path)
    mine = write_catalogue(tmp_path / "synthetic_v2", seed=5, products=30, goals=12)
    assert webshop.resolve_data_dir("synthetic_v2") == mine.resolve()
    tasks = webshop.WebShopEnv.list_tasks("test", data_dir="synthetic_v2", eval_goals=12)
    assert {t["data_dir"] for t in tasks} == {str(mine.resolve())} and len(tasks) == 12
    # exactly "synthetic" (or synthetic:SEED) is the built-in catalogue
    assert webshop.resolve_data_dir("synthetic").is_relative_to(tmp_path / "cache")
    assert webshop.resolve_data_dir("synthetic:1").name.endswith("seed1")
    with pytest.raises(ConfigError, match="synthetic:SEED"):
        webshop.resolve_data_dir("synthetic:abc")


def _corrupt(tmp_path, name, content):
    from salvage.envs.webshop_synth import write_catalogue

    d = write_catalogue(tmp_path / "data", seed=0, products=20, goals=8)
    files = sorted(p.name for p in d.iterdir())
    target = next(f for f in files if f.startswith(name))
    (d / target).write_text(content if isinstance(content, str) else json.dumps(content))
    return d, d / target


@pytest.mark.parametrize(
    ("name", "content", "what"),
    [
        ("items_shuffle", {"asin": "B1"}, "holds a dict; expected a list of products"),
        ("items_shuffle", [["B1"]], "product 0 is a list, not an object"),
        ("items_shuffle", [{"asin": "B1", "name": "x"}], "product 0 (asin B1) lacks"),
        ("items_shuffle", "[{", "is not valid UTF-8 JSON"),
        ("items_ins_v2", [], "holds a list; expected an object"),
        ("items_human_ins", {"B1": "buy it"}, "the entry of B1 must be a list of objects"),
        ("items_human_ins", [], "holds a list; expected an object"),
        ("reviews", {"B1": []}, "holds a dict; expected a list of review records"),
    ],
)
def test_malformed_webshop_files_are_named(webshop, tmp_path, name, content, what):
    d, path = _corrupt(tmp_path, name, content)
    with pytest.raises(DataError) as e:
        webshop.WebShopEnv.list_tasks("test", data_dir=str(d), eval_goals=8)
    assert str(path) in str(e.value) and what in str(e.value)


# ---------------------------------------------------------------------- file modes
@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_metrics_csv_keeps_its_mode_through_a_header_rewrite(tmp_path, umask_022):
    from salvage.loggers import SafeCSVLogger

    lg = SafeCSVLogger(tmp_path, name="", flush_logs_every_n_steps=1)
    lg.log_metrics({"loss/policy": 0.5}, step=0)
    lg.save()
    path = Path(lg.experiment.metrics_file_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # as Lightning created it
    lg.log_metrics({"loss/policy": 0.4, "relay/retained": 1.0}, step=1)  # a new column
    lg.save()
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # was 0o600 (the temporary's)
    path.chmod(0o640)
    lg.log_metrics({"loss/policy": 0.3, "graft/x": 1.0}, step=2)
    lg.save()
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert path.read_text().count("\n") == 4  # header + 3 rows


def test_atomic_write_gives_a_new_file_the_umask_mode(tmp_path, umask_022):
    from salvage.io import atomic_write_text

    atomic_write_text(tmp_path / "a.json", "{}")
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o644
    os.umask(0o027)
    atomic_write_text(tmp_path / "b.json", "{}")
    assert stat.S_IMODE((tmp_path / "b.json").stat().st_mode) == 0o640
