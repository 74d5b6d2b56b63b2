"""studies/record_runs.py: a study's finished runs copied into the repository and back.

A record keeps ``done.json``, ``metrics.csv``, ``config.yaml`` and the relay / exchange
records (gzipped) of each finished run, cuts the machine's absolute paths, and lists the
runs done, stopped and not started; ``--restore`` puts the finished runs back in a study dir
(what a new machine needs to resume a study), never over a run dir that exists.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("record_runs", ROOT / "studies/record_runs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _study(tmp: Path) -> Path:
    study = tmp / "checkout" / "runs" / "studies" / "s"
    runs = ["grpo/seed0", "vhgpo/seed0", "grpo/seed1"]
    study.mkdir(parents=True)
    (study / "study.json").write_text(json.dumps({"runs": runs}))
    (study / "regime.json").write_text(json.dumps({"passed": True}))
    done = {
        "command": [
            sys.executable,
            "-m",
            "salvage",
            "fit",
            "--trainer.default_root_dir",
            str(tmp / "checkout" / "runs" / "studies" / "s" / "grpo" / "seed0"),
        ],
        "returncode": 0,
    }
    for rel in ("grpo/seed0", "_calibration/grpo/seed0"):
        v = study / rel / "version_0"
        v.mkdir(parents=True)
        (study / rel / "done.json").write_text(json.dumps(done))
        (v / "metrics.csv").write_text("step,val/success\n19,0.25\n39,0.5\n")
        (v / "config.yaml").write_text(f"root: {tmp / 'checkout' / 'runs'}\n")
        (v / "relays.jsonl").write_text('{"retained": true}\n')
        (v / "last.ckpt").write_bytes(b"not copied")
    stopped = study / "vhgpo/seed0/version_0/checkpoints"
    stopped.mkdir(parents=True)
    (stopped / "last.ckpt").write_bytes(b"x")
    return study


def test_record_then_restore_gives_back_the_finished_runs(tmp_path):
    rr = _module()
    study = _study(tmp_path)
    out = tmp_path / "record"
    status = rr.record(study, out, [str(tmp_path / "checkout")])
    assert status == {
        "done": ["grpo/seed0"],
        "stopped": ["vhgpo/seed0"],
        "not_started": ["grpo/seed1"],
    }
    assert json.loads((out / "status.json").read_text()) == status
    v = out / "grpo/seed0/version_0"
    assert sorted(p.name for p in v.iterdir()) == ["config.yaml", "metrics.csv", "relays.jsonl.gz"]
    assert (v / "config.yaml").read_text() == "root: runs\n"  # the machine's path cut
    cmd = json.loads((out / "grpo/seed0/done.json").read_text())["command"]
    assert cmd[0] == "python" and cmd[-1] == "runs/studies/s/grpo/seed0"
    assert gzip.open(v / "relays.jsonl.gz", "rt").read() == '{"retained": true}\n'
    assert not (out / "vhgpo").exists()

    fresh = tmp_path / "fresh"
    restored = rr.restore(out, fresh)
    assert restored == ["_calibration/grpo/seed0", "grpo/seed0"]
    r = fresh / "grpo/seed0"
    assert (r / "done.json").read_text() == (out / "grpo/seed0/done.json").read_text()
    assert (r / "version_0/metrics.csv").read_text() == "step,val/success\n19,0.25\n39,0.5\n"
    assert (r / "version_0/relays.jsonl").read_text() == '{"retained": true}\n'
    assert (fresh / "_calibration/grpo/seed0/version_0/metrics.csv").is_file()
    # a run dir that exists is left as it is
    (r / "version_0/metrics.csv").write_text("mine\n")
    assert rr.restore(out, fresh) == []
    assert (r / "version_0/metrics.csv").read_text() == "mine\n"


def test_checkpoints_keep_a_stopped_run_to_resume_in_a_fresh_checkout(tmp_path):
    # --checkpoints: the stopped run goes under _stopped/ with its last.ckpt (and metrics);
    # --restore puts it back where salvage study resumes it; once done, its copy goes
    rr = _module()
    study = _study(tmp_path)
    v = study / "vhgpo/seed0/version_0"
    (v / "metrics.csv").write_text("step,rollout/success_rate\n0,0.1\n")
    (v / "relays.jsonl").write_text('{"retained": false}\n')
    (v / "checkpoints/last.ckpt").write_bytes(b"\x00\x01ckpt")
    (v / "stage.txt").write_text("fit\n")
    out = tmp_path / "record"
    assert rr.record(study, out, [str(tmp_path / "checkout")])["stopped"] == ["vhgpo/seed0"]
    assert not (out / "_stopped").exists()  # without --checkpoints: as before
    status = rr.record(study, out, [str(tmp_path / "checkout")], checkpoints=True)
    assert status["stopped"] == ["vhgpo/seed0"]
    kept = out / "_stopped/vhgpo/seed0/version_0"
    assert sorted(str(p.relative_to(kept)) for p in kept.rglob("*") if p.is_file()) == [
        "checkpoints/last.ckpt",
        "metrics.csv",
        "relays.jsonl.gz",
        "stage.txt",
    ]
    assert not (out / "vhgpo").exists()  # not among the finished runs

    fresh = tmp_path / "fresh"
    assert rr.restore(out, fresh) == [
        "_calibration/grpo/seed0",
        "grpo/seed0",
        "vhgpo/seed0 (stopped)",
    ]
    r = fresh / "vhgpo/seed0"
    assert not (r / "done.json").exists()
    assert (r / "version_0/checkpoints/last.ckpt").read_bytes() == b"\x00\x01ckpt"
    assert (r / "version_0/relays.jsonl").read_text() == '{"retained": false}\n'
    assert (r / "version_0/metrics.csv").read_text() == "step,rollout/success_rate\n0,0.1\n"

    (study / "vhgpo/seed0/done.json").write_text(json.dumps({"command": ["python"]}))
    status = rr.record(study, out, [str(tmp_path / "checkout")], checkpoints=True)
    assert status["done"] == ["grpo/seed0", "vhgpo/seed0"] and status["stopped"] == []
    assert not (out / "_stopped").exists()
    assert not (out / "vhgpo/seed0/version_0/checkpoints").exists()
