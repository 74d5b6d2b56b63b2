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
