"""`salvage report` renders non-trivial PNGs from a real VH-GPO run directory."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_vhgpo import CFG, ORACLE, VerifiedHandoff, _run

from salvage.core.relay import RelayConfig


def _non_blank(png):
    import matplotlib.image as mpimg

    img = mpimg.imread(png)
    rgb = img[..., :3]
    # a rendered plot has many pixels that are neither background white nor one flat colour
    return float((rgb < 0.95).any(axis=-1).mean()), len(
        {tuple(p) for p in rgb.reshape(-1, 3)[::97]}
    )


def test_report_on_a_vhgpo_run(tmp_path):
    trainer, _, _ = _run(tmp_path, VerifiedHandoff(relay=RelayConfig(**CFG), teacher=ORACLE))
    proc = subprocess.run(
        [sys.executable, "-m", "salvage", "report", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = tmp_path / "report"
    for name in ("rewards.png", "zero_signal.png", "extra_tokens.png", "relays.png", "cost.png"):
        png = out / name
        assert png.exists() and png.stat().st_size > 10_000, name
        inked, colours = _non_blank(png)
        assert inked > 0.02 and colours > 5, name
    md = (out / "report.md").read_text()
    assert "retained relays: 2 of 2 searched; mean j*/L 0.600" in md
    assert "graft.png (not a GRAFT run)" in md


def test_report_needs_a_run_dir(tmp_path):
    from salvage.commands.report import make_report

    with pytest.raises(FileNotFoundError, match="no metrics.csv"):
        make_report(tmp_path)
