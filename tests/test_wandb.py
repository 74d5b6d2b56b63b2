"""W&B dashboards: tiny VH-GPO and GRAFT runs with the W&B logger, offline, read
back from the files W&B writes (the ``run-<id>.wandb`` record log and ``files/media``)."""

from __future__ import annotations

import csv
import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from salvage.core.grpo import assign_advantages
from salvage.datamodules.graft import GraftDataModule

wandb = pytest.importorskip("wandb", reason="wandb (extra) is not installed")

ROOT = Path(__file__).resolve().parents[1]
WANDB_YAML = str(ROOT / "configs/logger/wandb.yaml")
QUIET = ["--trainer.enable_progress_bar", "false"]


# ---- reading an offline W&B run ---------------------------------------------------------
def wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version),
    then 32 KiB blocks of chunks (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle,
    4 last), each record a ``wandb_internal.Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    block, pos, parts, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer: padding
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and n == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 2):
            parts = chunk
        else:
            parts += chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(parts)
            out.append(rec)
    return out


def _key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


class OfflineRun:
    """One offline run dir: its run record, metric definitions, history rows, summary, files."""

    def __init__(self, d: Path) -> None:
        self.dir = d
        self.run: Any = None
        self.metrics: list[Any] = []
        self.history: list[dict[str, Any]] = []
        self.summary: dict[str, Any] = {}
        for r in wandb_records(next(d.glob("run-*.wandb"))):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                self.run = r.run
            elif kind == "metric":
                self.metrics.append(r.metric)
            elif kind == "history":
                self.history.append({_key(i): json.loads(i.value_json) for i in r.history.item})
            elif kind == "summary":
                for u in r.summary.update:
                    self.summary[_key(u)] = json.loads(u.value_json)

    def table_rows(self, key: str) -> list[list[Any]]:
        """Rows of every logged increment of table ``key`` (``files/media/table/<key>_*.json``)."""
        folder, stem = key.rsplit("/", 1)
        rows = []
        for p in sorted((self.dir / "files/media/table" / folder).glob(f"{stem}_*.table.json")):
            rows += json.loads(p.read_text())["data"]
        return rows

    def table_columns(self, key: str) -> list[str]:
        folder, stem = key.rsplit("/", 1)
        p = next((self.dir / "files/media/table" / folder).glob(f"{stem}_*.table.json"))
        return json.loads(p.read_text())["columns"]

    def images(self) -> list[str]:
        return sorted(p.name for p in (self.dir / "files/media/images/report").glob("*.png"))


def offline_runs(version_dir: Path) -> list[OfflineRun]:
    return [OfflineRun(d) for d in sorted((version_dir / "wandb").glob("offline-run-*"))]


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """Offline W&B with every W&B directory under tmp_path; runs start in tmp_path/cwd."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var, sub in (
        ("WANDB_DIR", "wandb_dir"),
        ("WANDB_CACHE_DIR", "wandb_cache"),
        ("WANDB_CONFIG_DIR", "wandb_config"),
    ):
        (tmp_path / sub).mkdir()
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.delenv("WANDB_DATA_DIR", raising=False)  # the logger puts it in the run dir
    for var in ("WANDB_RUN_GROUP", "WANDB_JOB_TYPE", "WANDB_NAME", "WANDB_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SALVAGE_PROGRESS", "0")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def cli(args: list[str], capsys) -> str:
    """``salvage`` in this process; asserts exit 0 and returns stderr.

    ``wandb.teardown()`` afterwards, as the end of a process would: the W&B service has
    written every record before the test reads them, and the next run reads its settings
    (``WANDB_RUN_GROUP``, ...) from the environment afresh.
    """
    from salvage.commands.cli import main

    try:
        main(args)
    finally:
        wandb.teardown()
    return capsys.readouterr().err


def csv_rows(version_dir: Path) -> list[dict[str, str]]:
    return list(csv.DictReader((version_dir / "metrics.csv").open()))


# ---- VH-GPO -------------------------------------------------------------------------------
# slow (a VH-GPO fit on TextWorld-Express, 40 s on a make-test worker): the default suite keeps
# GRAFT's run with its exchange table, plots and summary in the offline W&B run
@pytest.mark.slow
def test_vhgpo_tiny_relay_table_plots_and_summary_in_the_offline_run(wandb_env, tmp_path, capsys):
    import shutil

    pytest.importorskip("textworld_express", reason="textworld-express (extra twx) is absent")
    if shutil.which("java") is None:
        pytest.skip("TextWorld-Express needs Java")
    run = tmp_path / "RUN"
    cli(
        [
            "fit",
            "--config",
            str(ROOT / "configs/vhgpo/twx_tiny.yaml"),
            "--config",
            WANDB_YAML,
            "--trainer.callbacks",
            "[]",  # no SFT warm start: the untrained student leaves groups to rescue
            "--data.init_args.tasks_per_step",
            "4",
            "--trainer.max_steps",
            "1",
            "--trainer.default_root_dir",
            str(run),
            *QUIET,
        ],
        capsys,
    )
    v0 = run / "version_0"
    # W&B's files and the saved config in the run directory, nothing in the cwd
    assert sorted(p.name for p in wandb_env.iterdir()) == []
    assert (v0 / "config.yaml").is_file() and (v0 / "metrics.csv").is_file()
    (wb,) = offline_runs(v0)
    assert json.loads((v0 / "wandb_run.json").read_text())["id"] == wb.run.run_id
    # every metric against the RL update
    axis = [m for m in wb.metrics if m.glob_name == "*"]
    assert [m.step_metric for m in axis] == ["update"]
    train = [h for h in wb.history if "rollout/reward_mean" in h]
    assert [h["update"] for h in train] == [0]
    assert {k.split("/")[0] for h in train for k in h} >= {"rollout", "loss", "relay", "cost"}
    # one row per searched group, as in relays.jsonl and relay/selected
    recs = [json.loads(x) for x in (v0 / "relays.jsonl").read_text().splitlines()]
    selected = sum(float(r["relay/selected"]) for r in csv_rows(v0) if r.get("relay/selected"))
    rows = wb.table_rows("relay/records")
    assert len(recs) == selected > 0 and len(rows) == len(recs)
    cols = wb.table_columns("relay/records")
    got = [dict(zip(cols, r, strict=True)) for r in rows]
    assert [(g["update"], g["task"], g["retained"], g["reason"]) for g in got] == [
        (r["step"], r["task"], r["retained"], r["reason"]) for r in recs
    ]
    # the report plots as images, the run summary as a table and summary keys
    written = sorted(p.stem for p in (run / "report").glob("*.png"))
    assert written and sorted({n.split("_")[0] for n in wb.images()}) == sorted(
        {w.split("_")[0] for w in written}
    )
    assert len(wb.images()) == len(written)
    summary_rows = wb.table_rows("summary/run")
    assert "relay/selected_cum" in [r[0] for r in summary_rows]
    assert wb.summary["run_summary/relay/selected_cum/last"] == selected
    assert wb.summary["run_summary/updates"] == 1


# ---- GRAFT --------------------------------------------------------------------------------
class ScriptedGraft(GraftDataModule):
    """Real rollouts of both tiny models; outcomes set so that prompt 0 is complementary
    A -> B (A: 1 of 4 solved, B: none) and prompt 1 B -> A (B: 2 of 4, A: none)."""

    def train_rollout(self, tasks):
        batch = super().train_rollout(tasks)
        plan = {"a": [[1, 0, 0, 0], [0, 0, 0, 0]], "b": [[0, 0, 0, 0], [1, 1, 0, 0]]}
        for name, rows in plan.items():
            for g, succ in zip(batch.parts()[name].groups, rows + [[0] * 4] * 8, strict=False):
                for t, ok in zip(g.trajectories, succ, strict=True):
                    t.success, t.reward = bool(ok), float(ok)
                assign_advantages(g, "grpo", 1e-6, 1e-6, 1e-6)
        return batch


def test_graft_tiny_study_run_exchange_table_resume_and_test(
    wandb_env, tmp_path, capsys, monkeypatch
):
    """A GRAFT run of a study (W&B group = study, job type = method), resumed once, then
    tested: the exchange table, no row twice after the resume, the evaluation and
    checkpoint-cost tables of ``salvage test``."""
    from salvage.commands.study import load_study, plan, run_env

    study_file = tmp_path / "s.yaml"
    study_file.write_text(
        f"name: wb_study\nbase: {ROOT / 'configs/graft/math_tiny.yaml'}\nseeds: [0]\n"
        "methods: {graft: []}\n"
    )
    study = load_study(study_file)
    (r,) = plan(study, tmp_path / "study")
    for k, v in run_env(study, r).items():
        if k.startswith("WANDB_"):
            monkeypatch.setenv(k, v)
    run = r.dir
    common = [
        *r.args,
        "--config",
        WANDB_YAML,
        "--data.class_path",
        f"{__name__}.ScriptedGraft",
        "--data.init_args.val",
        "{source: 'reasoning_gym:basic_arithmetic', size: 2, seed: 1234, name: arith}",
        "--data.init_args.val_samples",
        "2",
        "--data.init_args.val_batch_size",
        "2",
        *QUIET,
    ]
    fit = [
        "fit",
        *common,
        "--trainer.val_check_interval",
        "1",
        "--trainer.check_val_every_n_epoch",
        "null",
    ]
    cli([*fit, "--trainer.max_steps", "2"], capsys)
    v0 = run / "version_0"
    (wb0,) = offline_runs(v0)
    # the study's group and the method's job type
    assert (wb0.run.run_group, wb0.run.job_type, wb0.run.display_name) == (
        "wb_study",
        "graft",
        "graft-seed0",
    )
    # one row per transferred group, as exchange.jsonl says
    recs = [json.loads(x) for x in (v0 / "exchange.jsonl").read_text().splitlines()]
    rows = wb0.table_rows("graft/exchange")
    cols = wb0.table_columns("graft/exchange")
    got = [dict(zip(cols, x, strict=True)) for x in rows]
    assert len(rows) == sum(len(r["a_to_b"]) + len(r["b_to_a"]) for r in recs) == 4
    assert [(g["update"], g["prompt"], g["direction"], g["k_A"], g["k_B"]) for g in got] == [
        (u, q, d, k_a, k_b)
        for u in (0, 1)
        for q, d, k_a, k_b in ((0, "a_to_b", 1, 0), (1, "b_to_a", 0, 2))
    ]
    weights = [float(w) for g in got for w in g["weights"].split()]
    every = [w for r in recs for w in r["weights"]]
    assert sorted(weights) == pytest.approx(sorted(every), abs=1e-3)
    assert sum(g["peer_responses"] for g in got) == len(every) > 0
    assert sum(g["admitted"] for g in got) == sum(w > 0 for w in every)

    # a resume continues the same W&B run and never logs a row twice: as if the first process
    # had also logged update 2's rows and died before its checkpoint, update 2 is redone
    side = json.loads((v0 / "wandb_run.json").read_text())
    assert side == {"id": wb0.run.run_id, "logged": {"graft/exchange": 1}}
    side["logged"]["graft/exchange"] = 2
    (v0 / "wandb_run.json").write_text(json.dumps(side))
    cli([*fit, "--trainer.max_steps", "3", "--ckpt_path", "last"], capsys)
    v1 = run / "version_1"
    (wb1,) = offline_runs(v1)
    assert wb1.run.run_id == wb0.run.run_id
    assert [h["update"] for h in wb1.history if "graft/transferred_a_to_b" in h] == [2]
    assert wb1.table_rows("graft/exchange") == []  # update 2's rows: already in the W&B run
    assert len(json.loads((v1 / "exchange.jsonl").read_text().splitlines()[0])["a_to_b"]) == 1

    # `salvage test` logs the evaluation and the checkpoint-cost tables, and the plots
    cli(["test", *common, "--ckpt_path", str(v1 / "checkpoints" / "last.ckpt")], capsys)
    (wb2,) = offline_runs(run / "version_2")
    assert wb2.run.run_id == wb0.run.run_id
    ev = {(m, b): p for m, b, p, _ in wb2.table_rows("eval/table")}
    assert set(ev) == {("a", "arith"), ("a", "aggregate"), ("b", "arith"), ("b", "aggregate")}
    assert ev[("a", "aggregate")] == wb2.summary["a/eval/aggregate"]
    cost = wb2.table_rows("cost/checkpoint_table")
    assert [c[0] for c in cost] == ["a", "b", "joint (later of the two)"]
    assert cost[2][3] == max(cost[0][3], cost[1][3]) > 0
    assert wb2.images()


# ---- failures -----------------------------------------------------------------------------
@pytest.mark.parametrize("when", ["start", "mid-run"])
def test_a_wandb_failure_is_one_warning_and_the_run_goes_on_in_csv(
    wandb_env, tmp_path, capsys, monkeypatch, when
):
    from wandb.sdk.wandb_run import Run

    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise ConnectionError("W&B unreachable (test)")

    if when == "start":
        monkeypatch.setattr(wandb, "init", broken)
    else:
        monkeypatch.setattr(Run, "log", broken)
    run = tmp_path / "RUN"
    err = cli(
        [
            "fit",
            "--config",
            str(ROOT / "configs/grpo/math_tiny.yaml"),
            "--config",
            WANDB_YAML,
            "--trainer.max_steps",
            "2",
            "--trainer.default_root_dir",
            str(run),
            *QUIET,
        ],
        capsys,
    )
    assert len(calls) == 1  # W&B is off after the first failure
    warnings = [line for line in err.splitlines() if "W&B failed" in line]
    assert len(warnings) == 1, err[-3000:]
    assert "W&B unreachable (test)" in warnings[0] and "metrics.csv" in warnings[0]
    rows = [r for r in csv_rows(run / "version_0") if r.get("perf/step_s")]
    assert [int(r["step"]) for r in rows] == [0, 1] and all(r["loss/policy"] for r in rows)
    assert (run / "version_0" / "checkpoints" / "last.ckpt").is_file()
    assert wandb.run is None
    assert not (run / "report").exists()  # no plots rendered for a W&B that is off


# ---- wiring and helpers (no training) -------------------------------------------------------
def test_lightnings_wandb_logger_in_a_config_runs_as_salvages_beside_a_csv_logger(
    wandb_env, tmp_path, monkeypatch
):
    from salvage.callbacks.dashboard import WandbDashboard
    from salvage.commands.fit import SalvageCLI
    from salvage.loggers import SafeCSVLogger, WandbLogger

    # as `salvage` runs it: no command-line arguments besides ``args`` (pytest's would be)
    monkeypatch.setattr(sys, "argv", ["salvage"])
    run = tmp_path / "RUN"
    cli = SalvageCLI(
        args=[
            "--config",
            str(ROOT / "configs/grpo/math_tiny.yaml"),
            "--trainer.logger",
            "{class_path: lightning.pytorch.loggers.WandbLogger, init_args: {project: p}}",
            "--trainer.default_root_dir",
            str(run),
            "--trainer.callbacks",
            "[{class_path: salvage.callbacks.dashboard.WandbDashboard, init_args: {table_every: 3}}]",
        ],
        run=False,
        subclass_mode_model=True,
        subclass_mode_data=True,
        auto_configure_optimizers=False,
    )
    csv_logger, wb = cli.trainer.loggers
    assert type(csv_logger) is SafeCSVLogger and type(wb) is WandbLogger
    assert wb.name == "p" and wandb.run is None  # W&B starts with the trainer, not before
    # the CSV logger names the run dir: config.yaml, checkpoints and W&B's files go there
    assert Path(cli.trainer.log_dir) == run / "version_0"
    # a config's own dashboard replaces the default one (tables would be logged twice)
    boards = [c for c in cli.trainer.callbacks if isinstance(c, WandbDashboard)]
    assert [b.table_every for b in boards] == [3]


def test_eval_rows_per_model_and_benchmark_with_the_std_over_repeats():
    from salvage.callbacks.dashboard import eval_rows

    metrics = {
        "a/eval/success/aime": 0.25,
        "a/eval/success/aime_std": 0.05,
        "a/eval/aggregate": 0.25,
        "a/eval/aggregate_std": 0.05,
        "a/eval/repeat_0/success/aime": 0.2,
        "b/eval/success/aime": 0.5,
        "b/eval/aggregate": 0.5,
        "eval/response_len": 31.0,
    }
    assert eval_rows(metrics) == [
        ["a", "aggregate", 0.25, 0.05],
        ["a", "aime", 0.25, 0.05],
        ["b", "aggregate", 0.5, None],
        ["b", "aime", 0.5, None],
    ]
    assert eval_rows({"eval/success": 0.75}) == [["policy", "all", 0.75, None]]
