"""Copy a study's finished runs into the repository: the record of what ran.

    python studies/record_runs.py runs/studies/graft_arith docs/results/graft_arith/runs

For every run dir with ``done.json`` (and the calibration runs under ``_calibration``): its
``done.json``, and per logger version ``metrics.csv``, ``config.yaml`` and the exchange /
relay records gzipped (``exchange.jsonl.gz``, ``relays.jsonl.gz``); no checkpoints. Also the
study's ``study.json`` and ``regime.json``, and ``status.json``: which runs are done,
stopped (a checkpoint but no ``done.json``) or not started. Rerun it as runs finish.

With ``--checkpoints``, a stopped run is recorded too, under ``_stopped/<method>/seed<k>``
(never compared: ``salvage compare`` skips ``_`` dirs): its versions' files as above plus
``checkpoints/last.ckpt``, so that a study whose runs outlast a session can go on in a fresh
checkout (stop it with SIGTERM first: each fit ends its update and writes ``last.ckpt``).
Once the run is done, recording it removes its ``_stopped`` copy.
Absolute paths of the machine (``--strip``, default the current directory and the Python
executable's environment) are cut from the text files copied, so the record names
repository-relative paths (``python`` for the interpreter).

    python studies/record_runs.py --restore docs/results/vhgpo_twx/record runs/studies/vhgpo_twx

puts a record's finished runs back into a study dir (``done.json``, ``metrics.csv``,
``config.yaml``, the exchange / relay records unzipped), and its ``_stopped`` runs with their
checkpoints: on a new machine, ``salvage study`` then skips the finished runs, resumes the
stopped ones (``--ckpt_path last``) and runs the rest, and ``salvage compare`` reads the
finished ones. It never overwrites a run dir that exists.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
from pathlib import Path

STOPPED = "_stopped"
"""Where a record keeps its stopped runs (with their checkpoints), relative to the record."""


def _strip(text: str, prefixes: list[str]) -> str:
    python = str(Path(sys.executable))
    text = text.replace(python, "python")
    for p in sorted(prefixes, key=len, reverse=True):
        text = text.replace(p.rstrip("/") + "/", "")
    return text


def _copy(src: Path, dst: Path, prefixes: list[str], gz: bool = False) -> None:
    text = _strip(src.read_text(encoding="utf-8", errors="replace"), prefixes)
    if gz:
        # mtime=0: the same text gives the same bytes, so re-recording a run changes nothing
        dst.write_bytes(gzip.compress(text.encode("utf-8"), mtime=0))
    else:
        dst.write_text(text, encoding="utf-8")


def _copy_versions(src: Path, dst: Path, prefixes: list[str], checkpoint: bool) -> None:
    """Each ``version_*`` of a run: its metrics, config, records (gzipped) and, with
    ``checkpoint``, its ``checkpoints/last.ckpt`` (bytes as they are)."""
    for version in sorted(src.glob("version_*")):
        vdst = dst / version.name
        vdst.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.csv", "config.yaml", *(("stage.txt",) if checkpoint else ())):
            if (version / name).is_file():
                _copy(version / name, vdst / name, prefixes)
        for name in ("exchange.jsonl", "relays.jsonl"):
            if (version / name).is_file():
                _copy(version / name, vdst / f"{name}.gz", prefixes, gz=True)
        ckpt = version / "checkpoints" / "last.ckpt"
        if checkpoint and ckpt.is_file():
            (vdst / "checkpoints").mkdir(exist_ok=True)
            shutil.copyfile(ckpt, vdst / "checkpoints" / "last.ckpt")


def record(
    study_dir: Path, out: Path, prefixes: list[str], checkpoints: bool = False
) -> dict[str, list[str]]:
    out.mkdir(parents=True, exist_ok=True)
    for name in ("study.json", "regime.json"):
        if (study_dir / name).is_file():
            _copy(study_dir / name, out / name, prefixes)
    spec = json.loads((study_dir / "study.json").read_text(encoding="utf-8"))
    status: dict[str, list[str]] = {"done": [], "stopped": [], "not_started": []}
    runs = [Path(k) for k in spec["runs"]]
    calib = sorted(p.relative_to(study_dir) for p in study_dir.glob("_calibration/*/seed*"))
    for rel in [*calib, *runs]:
        src = study_dir / rel
        kept = out / STOPPED / rel
        if not (src / "done.json").is_file():
            if rel in runs:
                stopped = any(src.glob("**/last.ckpt"))
                status["stopped" if stopped else "not_started"].append(str(rel))
                if stopped and checkpoints:
                    shutil.rmtree(kept, ignore_errors=True)  # the latest checkpoint only
                    _copy_versions(src, kept, prefixes, checkpoint=True)
            continue
        if rel in runs:
            status["done"].append(str(rel))
        dst = out / rel
        dst.mkdir(parents=True, exist_ok=True)
        _copy(src / "done.json", dst / "done.json", prefixes)
        _copy_versions(src, dst, prefixes, checkpoint=False)
        if kept.exists():  # done now: its checkpoint is not needed
            shutil.rmtree(kept)
            for d in kept.parents:  # and the dirs it leaves empty
                if d == out or any(d.iterdir()):
                    break
                d.rmdir()
    (out / "status.json").write_text(json.dumps(status, indent=2) + "\n", encoding="utf-8")
    return status


def restore(record_dir: Path, study_dir: Path) -> list[str]:
    """Copy the finished runs of a record back into ``study_dir``; the runs restored."""
    restored: list[str] = []
    stopped_root = record_dir / STOPPED
    done_dirs = [d.parent for d in sorted(record_dir.glob("**/done.json"))]
    done_dirs = [d for d in done_dirs if stopped_root not in d.parents]
    stopped_dirs = sorted(c.parents[2] for c in stopped_root.glob("**/checkpoints/last.ckpt"))
    for src, rel in [
        *((d, d.relative_to(record_dir)) for d in done_dirs),
        *((d, d.relative_to(stopped_root)) for d in dict.fromkeys(stopped_dirs)),
    ]:
        dst = study_dir / rel
        if dst.exists():
            continue
        dst.mkdir(parents=True)
        if (src / "done.json").is_file():
            (dst / "done.json").write_bytes((src / "done.json").read_bytes())
        for version in sorted(src.glob("version_*")):
            for f in sorted(version.rglob("*")):
                if f.is_dir():
                    continue
                target = dst / version.name / f.relative_to(version)
                target.parent.mkdir(parents=True, exist_ok=True)
                if f.suffix == ".gz":
                    with gzip.open(f, "rb") as g:
                        target.with_suffix("").write_bytes(g.read())
                else:
                    shutil.copyfile(f, target)
        restored.append(str(rel) + ("" if (src / "done.json").is_file() else " (stopped)"))
    return restored


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "study_dir", help="the study dir (salvage study --out); with --restore: the record"
    )
    p.add_argument(
        "out",
        help="where the record goes, e.g. docs/results/<study>/runs; with --restore: the study dir",
    )
    p.add_argument(
        "--restore",
        action="store_true",
        help="copy the record's finished runs back into the study dir instead",
    )
    p.add_argument(
        "--checkpoints",
        action="store_true",
        help=f"also record each stopped run with its last.ckpt, under {STOPPED}/ (to resume elsewhere)",
    )
    p.add_argument(
        "--strip",
        action="append",
        default=None,
        help="an absolute path prefix to cut from the copied text (repeatable; default: the "
        "current directory)",
    )
    a = p.parse_args()
    if a.restore:
        done = restore(Path(a.study_dir), Path(a.out))
        print(f"restored {len(done)} runs: {', '.join(done) or '-'}")
        return
    s = record(Path(a.study_dir), Path(a.out), a.strip or [str(Path.cwd())], a.checkpoints)
    print(", ".join(f"{k}: {len(v)}" for k, v in s.items()))


if __name__ == "__main__":
    main()
