"""A fit hands over: it names its run directory when it starts, and ends with that directory
and the next commands (report, export, test, W&B) filled in, commands that then run."""

from __future__ import annotations

import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MATH_TINY = str(ROOT / "configs/grpo/math_tiny.yaml")


def test_fit_prints_its_run_dir_and_the_next_commands(tmp_path, capsys):
    from salvage.commands.cli import main

    run = tmp_path / "RUN"
    main(
        ["fit", "--config", MATH_TINY, "--trainer.default_root_dir", str(run)]
        + ["--trainer.max_steps", "1", "--trainer.enable_progress_bar", "false"]
        + ["--data.init_args.val", "{source: reasoning_gym:basic_arithmetic, size: 2}"]
        + [
            "--data.init_args.allow_overlap",
            "true",
        ]  # a val set for `salvage test`, not a held-out one
    )
    out = capsys.readouterr().out
    lines = out.splitlines()
    start = f"salvage: run dir {run} (version_0)"
    assert lines.index(start) < next(i for i, x in enumerate(lines) if "run summary" in x)
    end = lines.index(f"{start}; next:")
    nxt = [x.strip() for x in lines[end + 1 :]]
    ckpt = run / "version_0" / "checkpoints" / "last.ckpt"
    config = run / "version_0" / "config.yaml"
    assert nxt[0] == f"salvage report {run}"
    assert nxt[1] == f"salvage export {ckpt} {run / 'version_0' / 'hf'}"
    assert nxt[2] == f"salvage test --config {config} --ckpt_path {ckpt}"
    assert nxt[3].startswith("W&B: not logged (add --config configs/logger/wandb.yaml")
    # the commands it names run as printed
    for cmd in (nxt[1], nxt[2]):
        main(
            shlex.split(cmd)[1:]
            + (["--trainer.enable_progress_bar", "false"] * cmd.startswith("salvage test "))
        )
    assert (run / "version_0" / "hf" / "config.json").exists()
    assert "salvage: run dir" not in capsys.readouterr().out  # only a fit names it


def test_the_handover_names_the_wandb_run_and_the_policies_to_export(tmp_path):
    from types import SimpleNamespace

    from salvage.callbacks.summary import handover_lines, watch_line
    from salvage.loggers import WandbLogger

    ckpt = tmp_path / "RUN" / "version_3" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"")
    csv = SimpleNamespace(log_dir=str(tmp_path / "RUN" / "version_3"))
    online = WandbLogger(project="p", offline=True)
    online.run_url = "https://wandb.ai/me/p/runs/abc"
    trainer = SimpleNamespace(
        loggers=[csv, online],
        default_root_dir=str(tmp_path / "RUN"),
        checkpoint_callbacks=[SimpleNamespace(last_model_path=str(ckpt), best_model_path="")],
    )
    graft = SimpleNamespace(hparams={"policy_a": {}, "policy_b": {}})
    lines = handover_lines(trainer, graft)  # type: ignore[arg-type]
    assert lines[0] == f"salvage: run dir {tmp_path / 'RUN'} (version_3); next:"
    assert lines[2].strip().startswith(f"salvage export {ckpt} ")
    assert lines[2].endswith("--policy a  (or --policy b)")
    assert lines[-1].strip() == "W&B: https://wandb.ai/me/p/runs/abc"
    offline = WandbLogger(project="p", offline=True)
    offline.sync_dir = "RUN/version_3/wandb/offline-run-1"
    assert watch_line(SimpleNamespace(loggers=[csv, offline])) == (  # type: ignore[arg-type]
        "W&B (offline; upload it with): wandb sync RUN/version_3/wandb/offline-run-1"
    )
    offline.fail("at start", RuntimeError("no network"))
    assert "not logged" in watch_line(SimpleNamespace(loggers=[csv, offline]))  # type: ignore[arg-type]


def test_the_next_commands_start_salvage_the_way_this_process_was_started(tmp_path, monkeypatch):
    """After `make demo`, `salvage` is .venv/bin/salvage and not on PATH: the printed commands
    name that path (or `python -m salvage`), so that a copied line runs."""
    import os
    import sys

    from salvage.invocation import command

    script = tmp_path / "venv" / "bin" / "salvage"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # the venv's bin is not on it
    assert command(str(script)) == os.path.join("venv", "bin", "salvage")
    assert command("/elsewhere/bin/salvage") == "/elsewhere/bin/salvage"
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")
    assert command(str(script)) == "salvage"  # PATH finds this very script
    main_py = str(ROOT / "salvage" / "__main__.py")
    py = sys.executable
    shown = command(main_py, py)
    assert shown.endswith(" -m salvage") and os.path.samefile(
        shown.removesuffix(" -m salvage"), py
    ), shown
    assert command("-m", py) == shown
    assert command("/usr/lib/python3/pytest") == "salvage"  # main([...]) inside another program


def test_a_fit_started_by_its_script_path_prints_that_path(tmp_path):
    """The real command: `.venv/bin/salvage fit` with the venv's bin off PATH."""
    import os
    import subprocess
    import sys

    exe = Path(sys.executable).parent / "salvage"
    if not exe.exists():  # pragma: no cover - an install without the console script
        import pytest

        pytest.skip(f"no console script at {exe}")
    env = dict(os.environ, PATH="/usr/bin:/bin", OMP_NUM_THREADS="1", WANDB_MODE="offline")
    run = tmp_path / "RUN"
    proc = subprocess.run(
        [str(exe), "fit", "--config", MATH_TINY, "--trainer.default_root_dir", str(run)]
        + ["--trainer.max_steps", "1", "--trainer.enable_progress_bar", "false"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    nxt = proc.stdout.split("; next:\n", 1)[1].splitlines()
    assert nxt[0].strip() == f"{exe} report {run}"
    # and it runs as printed
    rep = subprocess.run(
        shlex.split(nxt[0]), env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert rep.returncode == 0, rep.stderr[-3000:]
