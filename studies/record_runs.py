"""Copy a study's finished runs into the repository: the record of what ran.

    python studies/record_runs.py runs/studies/graft_arith docs/results/graft_arith/runs

For every run dir with ``done.json`` (and the calibration runs under ``_calibration``): its
``done.json``, and per logger version ``metrics.csv``, ``config.yaml`` and the exchange /
relay records gzipped (``exchange.jsonl.gz``, ``relays.jsonl.gz``); no checkpoints. Also the
study's ``study.json`` and ``regime.json``, and ``status.json``: which runs are done,
stopped (a checkpoint but no ``done.json``) or not started. Rerun it as runs finish.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
from pathlib import Path


def record(study_dir: Path, out: Path) -> dict[str, list[str]]:
    out.mkdir(parents=True, exist_ok=True)
    for name in ("study.json", "regime.json"):
        if (study_dir / name).is_file():
            shutil.copy2(study_dir / name, out / name)
    spec = json.loads((study_dir / "study.json").read_text(encoding="utf-8"))
    status: dict[str, list[str]] = {"done": [], "stopped": [], "not_started": []}
    runs = [Path(k) for k in spec["runs"]]
    calib = sorted(p.relative_to(study_dir) for p in study_dir.glob("_calibration/*/seed*"))
    for rel in [*calib, *runs]:
        src = study_dir / rel
        if not (src / "done.json").is_file():
            if rel in runs:
                key = "stopped" if any(src.glob("**/last.ckpt")) else "not_started"
                status[key].append(str(rel))
            continue
        if rel in runs:
            status["done"].append(str(rel))
        dst = out / rel
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / "done.json", dst / "done.json")
        for version in sorted(src.glob("version_*")):
            vdst = dst / version.name
            vdst.mkdir(exist_ok=True)
            for name in ("metrics.csv", "config.yaml"):
                if (version / name).is_file():
                    shutil.copy2(version / name, vdst / name)
            for name in ("exchange.jsonl", "relays.jsonl"):
                if (version / name).is_file():
                    with (
                        (version / name).open("rb") as f,
                        gzip.open(vdst / f"{name}.gz", "wb") as g,
                    ):
                        shutil.copyfileobj(f, g)
    (out / "status.json").write_text(json.dumps(status, indent=2) + "\n", encoding="utf-8")
    return status


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("study_dir", help="the study dir (salvage study --out)")
    p.add_argument("out", help="where the record goes, e.g. docs/results/<study>/runs")
    a = p.parse_args()
    s = record(Path(a.study_dir), Path(a.out))
    print(", ".join(f"{k}: {len(v)}" for k, v in s.items()))


if __name__ == "__main__":
    main()
