"""Runs that never cross, explicit checkpoint files, checked resumes, checkpoints that cannot
run code, crash-safe checkpoint writes."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from salvage.checkpointing import config_diff, find_last_checkpoint, flatten, remove_partials

ROOT = Path(__file__).resolve().parents[1]
MATH_TINY = str(ROOT / "configs/grpo/math_tiny.yaml")
GRAFT_TINY = str(ROOT / "configs/graft/math_tiny.yaml")
VHGPO_TINY = str(ROOT / "configs/vhgpo/twx_tiny.yaml")
QUIET = ["--trainer.enable_progress_bar", "false"]


def cli(args: list[str], capsys) -> tuple[int, str]:
    """Run ``salvage`` in this process; (exit code, stderr + error text)."""
    from salvage.commands.cli import main

    try:
        main(args)
        code, msg = 0, ""
    except SystemExit as e:
        code, msg = int(e.code or 0), ""
    except Exception as e:  # an error type the CLI did not turn into an exit code
        code, msg = 1, f"{type(e).__name__}: {e}"
    return code, capsys.readouterr().err + msg


def steps_of(metrics: Path) -> list[int]:
    rows = csv.DictReader(metrics.open())
    return [int(r["step"]) for r in rows if r.get("perf/step_s")]


# ---- pure helpers -------------------------------------------------------------------------


def test_config_diff_names_the_keys_outside_the_resumable_ones():
    saved = {
        "trainer": {"max_steps": 2, "default_root_dir": "a"},
        "model": {"init_args": {"lr": 1e-4, "policy": {"name_or_path": "tiny"}}},
        "ckpt_path": None,
    }
    current = {
        "trainer": {"max_steps": 5, "default_root_dir": "b"},
        "model": {"init_args": {"lr": 1e-3, "policy": {"name_or_path": "tiny"}, "beta": 0.1}},
        "ckpt_path": "x.ckpt",
    }
    assert config_diff(saved, current) == ["model.init_args.beta", "model.init_args.lr"]
    assert flatten({"a": {"b": [1, 2], "c": {}}}) == {"a.b": [1, 2], "a.c": {}}


def test_find_last_checkpoint_takes_the_newest_version_that_has_one(tmp_path):
    assert find_last_checkpoint(tmp_path) is None
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"old layout")
    assert find_last_checkpoint(tmp_path) == tmp_path / "checkpoints" / "last.ckpt"
    for v in (0, 2, 10):
        (tmp_path / f"version_{v}" / "checkpoints").mkdir(parents=True)
    (tmp_path / "version_2" / "checkpoints" / "last.ckpt").write_bytes(b"2")
    (tmp_path / "version_10" / "metrics.csv").write_text("")  # a run that crashed before any
    assert find_last_checkpoint(tmp_path) == tmp_path / "version_2" / "checkpoints" / "last.ckpt"
    (tmp_path / "version_2" / "checkpoints" / ".last.ckpt.partial-123").write_bytes(b"torn")
    assert [p.name for p in remove_partials(tmp_path / "version_2" / "checkpoints")] == [
        ".last.ckpt.partial-123"
    ]


# ---- the CLI ------------------------------------------------------------------------------


def test_runs_never_cross_and_resume_is_checked(tmp_path, capsys):
    """Two runs in one RUN dir keep their own checkpoints; `last` is the newest run's; an
    explicit checkpoint file resumes; another config is refused before anything loads."""
    run = tmp_path / "RUN"
    base = ["fit", "--config", MATH_TINY, "--trainer.default_root_dir", str(run), *QUIET]
    assert cli([*base, "--trainer.max_steps", "1"], capsys)[0] == 0
    assert cli([*base, "--trainer.max_steps", "1", "--seed_everything", "7"], capsys)[0] == 0
    ck0 = run / "version_0" / "checkpoints" / "last.ckpt"
    ck1 = run / "version_1" / "checkpoints" / "last.ckpt"
    assert ck0.exists() and ck1.exists()
    assert not list(run.rglob("last-v*.ckpt"))
    assert torch.load(ck1, weights_only=True)["global_step"] == 1
    # an explicit file (not only `last`) resumes, here the first run's
    code, err = cli([*base, "--trainer.max_steps", "2", "--ckpt_path", str(ck0)], capsys)
    assert code == 0, err[-2000:]
    assert steps_of(run / "version_2" / "metrics.csv") == [1]
    # `last` is version_2's now (the newest); resuming it under another lr is refused,
    # naming the key, before a new version dir (or any model) is made
    code, err = cli(
        [*base, "--trainer.max_steps", "3", "--ckpt_path", "last", "--model.init_args.lr", "0.5"],
        capsys,
    )
    assert code != 0 and "model.init_args.lr" in err, err[-2000:]
    assert not (run / "version_3").exists()
    # resuming the second run (seed 7) with the first run's seed is another run, too
    code, err = cli([*base, "--trainer.max_steps", "2", "--ckpt_path", str(ck1)], capsys)
    assert code != 0 and "seed_everything" in err
    # the resumable keys may change, and the override flag lets a user insist
    code, err = cli(
        [*base, "--trainer.max_steps", "3", "--ckpt_path", "last", "--model.init_args.lr", "0.5"]
        + ["--allow_config_change", "true"],
        capsys,
    )
    assert code == 0, err[-2000:]
    assert "model.init_args.lr" in err  # still told
    assert steps_of(run / "version_3" / "metrics.csv") == [2]
    # the run's history: version 3 <- 2 <- 0; version 1 (seed 7) is another run
    from salvage.commands.report import make_report
    from salvage.history import load_run

    m, _, files = load_run(run)
    assert [p.parent.name for p in files] == ["version_0", "version_2", "version_3"]
    assert [s for s, _ in m["perf/step_s"]] == [0, 1, 2]
    assert [p.parent.name for p in load_run(run, version=1)[2]] == ["version_1"]
    assert "rewards.png" in make_report(run)["written"]


@pytest.mark.parametrize(
    "config,extra",
    [
        (
            MATH_TINY,
            [
                "--data.init_args.val",
                # seed 1234: reasoning-gym draws item i of seed s as item s + i of seed 0,
                # so small seeds repeat the 200 training prompts (the held-out guard refuses)
                "{source: reasoning_gym:basic_arithmetic, size: 2, seed: 1234}",
            ],
        ),
        (
            GRAFT_TINY,
            [
                "--data.init_args.val",
                # seed 1234: reasoning-gym draws item i of seed s as item s + i of seed 0,
                # so small seeds repeat the 200 training prompts (the held-out guard refuses)
                "{source: reasoning_gym:basic_arithmetic, size: 2, seed: 1234}",
            ],
        ),
        pytest.param(
            VHGPO_TINY,
            [
                # no warm start (OracleSFT's 120 steps): the checkpoint path is what is checked
                "--trainer.callbacks",
                "[]",
                "--data.init_args.tasks_per_step",
                "2",
                "--data.init_args.env.val_tasks.num_tasks",
                "2",
            ],
            marks=pytest.mark.slow,
        ),
    ],
    ids=["grpo", "graft", "vhgpo"],
)
def test_explicit_ckpt_path_file_for_fit_validate_and_test(tmp_path, capsys, config, extra):
    run = tmp_path / "RUN"
    base = ["--config", config, "--trainer.default_root_dir", str(run), *QUIET, *extra]
    code, err = cli(["fit", *base, "--trainer.max_steps", "1"], capsys)
    assert code == 0, err[-3000:]
    ck = run / "version_0" / "checkpoints" / "last.ckpt"
    for sub in ("fit", "validate", "test"):
        more = ["--trainer.max_steps", "2"] if sub == "fit" else []
        code, err = cli([sub, *base, *more, "--ckpt_path", str(ck)], capsys)
        assert code == 0, (sub, err[-3000:])


def _tampered(src: Path, dst: Path, key: str = "policy") -> Path:
    """A checkpoint whose stored settings ask for remote code from a path that does not exist."""
    state = torch.load(src, weights_only=True)
    spec = state["hyper_parameters"][key]
    spec["name_or_path"] = str(dst.parent / "evil-model-with-code")
    spec["trust_remote_code"] = True
    torch.save(state, dst)
    return dst


def test_a_checkpoint_cannot_choose_the_model_or_turn_on_remote_code(tmp_path, capsys):
    from salvage.commands.export import ExportError, export

    run = tmp_path / "RUN"
    base = ["--config", MATH_TINY, "--trainer.default_root_dir", str(run), *QUIET]
    assert cli(["fit", *base, "--trainer.max_steps", "1"], capsys)[0] == 0
    bad = _tampered(run / "version_0" / "checkpoints" / "last.ckpt", tmp_path / "bad.ckpt")
    # `salvage test` builds the model from the user's config, not from the checkpoint
    code, err = cli(
        [
            "test",
            *base,
            "--data.init_args.test",
            "{source: reasoning_gym:basic_arithmetic, size: 2}",
            "--ckpt_path",
            str(bad),
        ],
        capsys,
    )
    assert code == 0, err[-3000:]
    # export refuses stored remote code; the user may pick the model source and allow it
    with pytest.raises(ExportError, match="trust_remote_code"):
        export(bad, tmp_path / "hf")
    out = export(bad, tmp_path / "hf", model="tiny")
    import json

    rec = json.loads((out / "salvage_export.json").read_text())
    assert rec["model_source"] == "tiny" and rec["trust_remote_code"] is False
    assert rec["model_source_in_checkpoint"].endswith("evil-model-with-code")
    # a non-empty target is refused unless --overwrite, which clears it
    (out / "stale-shard-00002.safetensors").write_bytes(b"old")
    with pytest.raises(ExportError, match="--overwrite"):
        export(run / "version_0" / "checkpoints" / "last.ckpt", out)
    export(run / "version_0" / "checkpoints" / "last.ckpt", out, overwrite=True)
    assert not (out / "stale-shard-00002.safetensors").exists()
    assert json.loads((out / "salvage_export.json").read_text())["model_source"] == "tiny"


def test_runs_without_a_root_dir_go_under_runs_not_the_cwd(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "my_exp.yaml"
    text = Path(MATH_TINY).read_text().replace("  default_root_dir: runs/grpo_math_tiny\n", "")
    assert "default_root_dir: " not in text
    cfg.write_text(text)
    monkeypatch.chdir(tmp_path)
    code, err = cli(["fit", "--config", str(cfg), "--trainer.max_steps", "1", *QUIET], capsys)
    assert code == 0, err[-3000:]
    assert (tmp_path / "runs" / "my_exp" / "version_0" / "checkpoints" / "last.ckpt").exists()
    assert not (tmp_path / "version_0").exists() and not (tmp_path / "checkpoints").exists()
    assert not (tmp_path / "config.yaml").exists()


# ---- a kill during a checkpoint write, staging on another filesystem ----------------------

_KILLER = textwrap.dedent(
    """
    # Fault injection: SIGKILL this process half-way through writing the Nth checkpoint
    # (every OS-level write into a *.ckpt* file counts; sendfile too, as used by a copy).
    import os, signal, sys
    N = int(os.environ["KILL_AT_CKPT"])
    state = {"n": 0, "bytes": 0}
    real_write, real_sendfile = os.write, os.sendfile

    def is_ckpt(fd):
        try:
            return ".ckpt" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return False

    def count(fd):
        if not is_ckpt(fd):
            return False
        if os.lseek(fd, 0, os.SEEK_CUR) == 0:  # a checkpoint file starts being written
            state["n"] += 1
            state["bytes"] = 0
        return state["n"] == N

    def write(fd, data):
        if count(fd):
            n = real_write(fd, bytes(data)[: max(1, len(data) // 2)])
            state["bytes"] += n
            if state["bytes"] > 10000:
                os.kill(os.getpid(), signal.SIGKILL)
            return n
        return real_write(fd, data)

    def sendfile(out_fd, in_fd, offset, count_):
        if count(out_fd):
            real_sendfile(out_fd, in_fd, offset, max(1, os.fstat(in_fd).st_size // 2))
            os.kill(os.getpid(), signal.SIGKILL)
        return real_sendfile(out_fd, in_fd, offset, count_)

    os.write, os.sendfile = write, sendfile
    import shutil
    shutil._USE_CP_SENDFILE = True
    from salvage.commands.cli import main
    main(sys.argv[1:])
    """
)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm (another filesystem)")
def test_kill_during_a_checkpoint_write_keeps_the_last_complete_one(tmp_path):
    run = tmp_path / "RUN"
    killer = tmp_path / "killer.py"
    killer.write_text(_KILLER)
    env = dict(os.environ, TMPDIR="/dev/shm", KILL_AT_CKPT="2", OMP_WAIT_POLICY="PASSIVE")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    base = ["--config", MATH_TINY, "--trainer.default_root_dir", str(run), *QUIET]
    proc = subprocess.run(
        [sys.executable, str(killer), "fit", *base, "--trainer.max_steps", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -9, proc.stderr[-3000:]  # killed while writing checkpoint 2
    ck = run / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(ck, weights_only=True)["global_step"] == 1  # complete, from update 1
    env.pop("KILL_AT_CKPT")
    proc = subprocess.run(
        [sys.executable, "-m", "salvage", "fit", *base, "--trainer.max_steps", "3"]
        + ["--ckpt_path", "last"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert steps_of(run / "version_1" / "metrics.csv") == [1, 2]
    assert (
        torch.load(run / "version_1" / "checkpoints" / "last.ckpt", weights_only=True)[
            "global_step"
        ]
        == 3
    )
    leftovers = [p.name for p in run.rglob("*") if ".partial-" in p.name]
    assert leftovers == []


# ---- a run's history across resumes --------------------------------------------------------


def _version(run: Path, n: int, steps: list[int], value: float, resumed_from: int | None) -> None:
    import json

    v = run / f"version_{n}"
    v.mkdir(parents=True)
    ck = (
        None if resumed_from is None else str(run / f"version_{resumed_from}/checkpoints/last.ckpt")
    )
    (v / "config.yaml").write_text(f"ckpt_path: {ck if ck else 'null'}\n")
    rows = ["step,perf/step_s,rollout/reward_mean"] + [f"{s},1.0,{value + s}" for s in steps]
    (v / "metrics.csv").write_text("\n".join(rows) + "\n")
    (v / "relays.jsonl").write_text(
        "".join(json.dumps({"step": s, "retained": True, "v": n}) + "\n" for s in steps)
    )


def test_report_reads_every_version_of_a_run_once(tmp_path):
    from salvage.history import load_run

    run = tmp_path / "RUN"
    _version(run, 0, [0, 1, 2], 0.0, None)  # crashed after logging update 2, checkpoint at 2
    _version(run, 1, [0, 1], 100.0, None)  # another run started in the same RUN dir
    _version(run, 2, [2, 3], 10.0, 0)  # resumed version 0 from its update-2 checkpoint
    m, rec, files = load_run(run)
    assert [p.parent.name for p in files] == ["version_0", "version_2"]
    # update 2 was redone: version 2's value (10 + 2), not version 0's (0 + 2), and once
    assert m["rollout/reward_mean"] == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0)]
    assert [(r["step"], r["v"]) for r in rec["relays"]] == [(0, 0), (1, 0), (2, 2), (3, 2)]
    m1, _, files1 = load_run(run, version=1)
    assert [p.parent.name for p in files1] == ["version_1"]
    assert m1["rollout/reward_mean"] == [(0, 100.0), (1, 101.0)]


def test_environment_start_up_is_not_step_time():
    """New env instances (a JVM each for TWX) are set-up: the pool measures their start-up, and
    the rollout's step clock starts after it, so a resumed run is not charged it again."""
    from salvage.envs.pool import EnvPool

    with EnvPool("scripted", {"max_steps": 4, "create_delay_s": 0.2}) as pool:
        task = {"id": "t", "solution": ["a"]}
        pool.reset([(0, task, 0), (1, task, 1)])
        assert 0.4 <= pool.startup_s < 1.0  # two new instances
        pool.release([0, 1])
        pool.reset([(2, task, 0), (3, task, 1)])  # reused from the free list
        assert pool.startup_s < 1.0
        first = pool.startup_s
        pool.reset([(4, task, 0)])  # one more instance
        assert pool.startup_s - first >= 0.2
