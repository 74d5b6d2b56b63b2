"""Progress bars: rendered on a terminal (or when forced), silent otherwise."""

from __future__ import annotations

import io

from rich.console import Console

from salvage.progress import enabled, stage


def test_quiet_when_not_interactive(monkeypatch):
    monkeypatch.delenv("SALVAGE_PROGRESS", raising=False)
    monkeypatch.setenv("CI", "true")
    assert not enabled()
    buf = io.StringIO()
    with stage("rollout", total=3, console=Console(file=buf, force_terminal=True)) as bar:
        bar.advance(3)
    assert buf.getvalue() == ""


def test_forced_bar_renders_description_count_and_rate(monkeypatch):
    monkeypatch.setenv("SALVAGE_PROGRESS", "1")
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=100)
    with stage("verified handoff search", total=4, unit="group", console=console) as bar:
        for _ in range(4):
            bar.advance(1)
        console.print("done")  # a live render happens around prints
    out = buf.getvalue()
    assert "verified handoff search" in out and "4/4" in out
