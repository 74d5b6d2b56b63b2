"""The held-out check's task digests, cached on disk (``salvage.datamodules.digests``): read
back by a later datamodule without resetting the environment, recomputed when a file is not a
digest or the content identity changes, never cached without an identity, and a cache that
cannot be written costs only the recomputation."""

from __future__ import annotations

import json
import logging

from conftest import needs_twx

from salvage.core.heldout import text_digest
from salvage.datamodules import digests
from salvage.datamodules.digests import cached_digests, entry_path

TWC = {"game": "twc", "params": "numLocations=1,numItemsToPutAway=2"}


def test_cached_digests_compute_only_what_the_disk_lacks(tmp_path, monkeypatch):
    monkeypatch.setenv("SALVAGE_CACHE", str(tmp_path))
    calls: list[list[str]] = []

    def compute(tasks):
        calls.append([t["id"] for t in tasks])
        return [text_digest(t["id"]) for t in tasks]

    tasks = [{"id": f"t{i}"} for i in range(3)]
    want = [text_digest(f"t{i}") for i in range(3)]
    assert cached_digests("e", "v1", {}, tasks, compute) == want
    assert cached_digests("e", "v1", {}, tasks, compute) == want
    assert calls == [["t0", "t1", "t2"]]  # the second call read all three from disk
    assert len(list((tmp_path / "task-digests" / "e").rglob("*"))) == 3 + 3  # 3 dirs, 3 files
    # other constructor arguments or another identity: other entries
    assert entry_path("e", "v1", {"k": 1}, tasks[0]) != entry_path("e", "v1", {}, tasks[0])
    assert entry_path("e", "v2", {}, tasks[0]) != entry_path("e", "v1", {}, tasks[0])
    assert cached_digests("e", "v2", {}, tasks[:1], compute) == want[:1]
    # no identity: never cached
    assert cached_digests("e", None, {}, tasks[:2], compute) == want[:2]
    assert cached_digests("e", None, {}, tasks[:2], compute) == want[:2]
    assert calls[1:] == [["t0"], ["t0", "t1"], ["t0", "t1"]]
    # a file that is not a digest is recomputed and rewritten
    bad = entry_path("e", "v1", {}, tasks[1])
    bad.write_text("not a digest\n")
    assert cached_digests("e", "v1", {}, tasks, compute) == want
    assert calls[-1] == ["t1"] and bad.read_text().strip() == want[1]


def test_an_unwritable_cache_warns_once_and_loses_nothing(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SALVAGE_CACHE", str(blocker))  # a file: no directory under it
    monkeypatch.setattr(digests, "_warned", set())
    tasks = [{"id": "a"}, {"id": "b"}]
    with caplog.at_level(logging.WARNING, logger="salvage.datamodules.digests"):
        got = cached_digests("e", "v1", {}, tasks, lambda ts: [text_digest(t["id"]) for t in ts])
    assert got == [text_digest("a"), text_digest("b")]
    warned = [r for r in caplog.records if "task digest cache" in r.getMessage()]
    assert len(warned) == 1 and "digests are recomputed" in warned[0].getMessage()


def test_a_twx_datamodule_reads_its_digests_back_and_a_new_identity_recomputes(
    tmp_path, monkeypatch
):
    needs_twx()
    from salvage.datamodules.agent import AgentDataModule, EnvSpec
    from salvage.envs.twx import TWXEnv

    monkeypatch.setenv("SALVAGE_CACHE", str(tmp_path))
    spec = EnvSpec(
        name="twx", train_tasks={**TWC, "num_tasks": 3}, val_tasks={**TWC, "num_tasks": 2}
    )
    d = AgentDataModule(env=spec, tasks_per_step=2, group_size=2)
    d.setup("fit")
    try:
        got = {**d.task_digests("train"), **d.task_digests("val")}
        tasks = d.tasks["train"] + d.tasks["val"]
        # every split the guard digested (the test split repeats val's games as its own tasks)
        distinct = {json.dumps(t, sort_keys=True) for ts in d.tasks.values() for t in ts}
    finally:
        d.teardown("fit")
    env = TWXEnv()
    try:
        truth = {t["id"]: text_digest(env.task_content(t)) for t in tasks}
    finally:
        env.close()
    assert got == truth and len(got) == 5
    files = [f for f in (tmp_path / "task-digests" / "twx").rglob("*") if f.is_file()]
    assert len(files) == len(distinct) >= 5, files
    # a later datamodule reads the disk: a planted digest comes back as it is
    identity = TWXEnv.content_identity()
    assert identity is not None and identity.startswith("twx-content-v1/textworld-express-")
    planted = entry_path("twx", identity, {}, tasks[0])
    planted.write_text("0" * 40 + "\n")
    d2 = AgentDataModule(env=spec)
    d2.tasks = {"train": d.tasks["train"]}
    assert d2.task_digests("train")[tasks[0]["id"]] == "0" * 40
    # a new content function (its version bumped): new entries, computed again
    monkeypatch.setattr(TWXEnv, "CONTENT_VERSION", 2)
    d3 = AgentDataModule(env=spec)
    d3.tasks = {"train": d.tasks["train"]}
    assert d3.task_digests("train") == {t["id"]: truth[t["id"]] for t in d.tasks["train"]}
    assert (
        len([f for f in (tmp_path / "task-digests").rglob("*") if f.is_file()]) == len(distinct) + 3
    )
