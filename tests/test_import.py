"""`import salvage` stays light: no vllm, no wandb."""

from __future__ import annotations

import subprocess
import sys


def test_import_salvage_does_not_import_vllm_or_wandb():
    code = (
        "import sys, salvage, salvage.types, salvage.core.grpo, salvage.commands.cli, salvage.commands.fit, salvage.modules.grpo, "
        "salvage.datamodules.rlvr, salvage.rollout.hf, salvage.callbacks.cost\n"
        "bad = [m for m in ('vllm', 'wandb') if m in sys.modules]\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
