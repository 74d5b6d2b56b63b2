"""``relay.search`` through the real rescue stage: the scripted environment end to end (the
same hand-worked setting as tests/test_vhgpo.py), and a CLI fit of twx_tiny with
``--rescue.init_args.relay.search monotone`` writing records that name the strategy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_vhgpo import CFG, ORACLE, _run

from salvage.callbacks.relay import VerifiedHandoff
from salvage.core.relay import RelayConfig


def test_scripted_end_to_end_paper_and_monotone(tmp_path):
    # test_vhgpo's setting: the root anchor recovers, L = 5, the student succeeds from j >= 3.
    # paper: 4 S, 3 S, 1 F, scan 2 F -> j* = 3 with 8 discovery + 4 confirmation rollouts.
    # monotone: the group's 4 episodes all left the initial state s_0 (known failure 0);
    # 4 S (1 draw), 3 S (1), 1 F (2), bisect (1, 3): 2 F (2) -> j* = 3 with 6 + 4.
    _, _, paper = _run(tmp_path / "p", VerifiedHandoff(relay=RelayConfig(**CFG), teacher=ORACLE))
    vh = VerifiedHandoff(relay=RelayConfig(**CFG, search="monotone"), teacher=ORACLE)
    assert "search=monotone" in vh.describe()
    _, cap, mono = _run(tmp_path / "m", vh)
    assert len(paper) == len(mono) == 2
    for p, m in zip(paper, mono, strict=True):
        assert p["search"] == "paper" and p["known_failure"] is None
        assert list(p["discovery"]) == ["4", "3", "1", "2"] and p["discovery_rollouts"] == 8
        assert p["student_rollouts"] == 12 and p["j_star"] == 3 and p["retained"]
        assert m["search"] == "monotone" and m["known_failure"] == 0
        assert list(m["discovery"].items()) == [
            ("4", True),
            ("3", True),
            ("1", False),
            ("2", False),
        ]
        assert m["discovery_rollouts"] == 6 and m["confirm_rollouts"] == 4
        assert m["student_rollouts"] == 10 and m["j_star"] == 3 and m["retained"]
        assert m["tokens"]["search"] < p["tokens"]["search"]
    assert len(cap.relays) == 2


@pytest.mark.slow  # ~80 s (TextWorld-Express JVMs); the scripted test above covers the stage
def test_cli_twx_tiny_monotone_search(tmp_path):
    """A 2-update CLI fit of configs/vhgpo/twx_tiny.yaml with the switch on the command line,
    without its SFT warm start (the records are under test, not the student)."""
    pytest.importorskip(
        "textworld_express", reason="textworld-express (extra twx) is not installed"
    )
    if shutil.which("java") is None:
        pytest.skip("TextWorld-Express needs Java")
    root = Path(__file__).resolve().parents[1]
    run = tmp_path / "RUN"
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "salvage",
            "fit",
            "--config",
            str(root / "configs/vhgpo/twx_tiny.yaml"),
            "--rescue.init_args.relay.search",
            "monotone",
            "--trainer.callbacks",
            "[]",
            "--trainer.max_steps",
            "2",
            "--trainer.default_root_dir",
            str(run),
            "--trainer.enable_progress_bar",
            "false",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [
        json.loads(x) for x in next(run.glob("version_0/relays.jsonl")).read_text().splitlines()
    ]
    assert recs and all(r["search"] == "monotone" for r in recs)
    for r in (r for r in recs if "student_rollouts" in r):
        assert r["student_rollouts"] == r["discovery_rollouts"] + r["confirm_rollouts"]
        assert r["discovery_rollouts"] <= 8
    cfg = next(run.glob("version_0/config.yaml")).read_text()
    assert "search: monotone" in cfg
