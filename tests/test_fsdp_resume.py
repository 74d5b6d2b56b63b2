"""Resume under FSDP2: a warm-started reference survives ``--ckpt_path last``.

OracleSFT resets the frozen reference to the warm-started policy, so the reference is no
longer the model the config names and must travel with the checkpoint. Under FSDP2 every
rank holds its own shard of it; a resumed 2-process run must hold the same reference (and
policy) as an uninterrupted one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.ports import master_port

ROOT = Path(__file__).resolve().parents[1]

SMALL = """\
trainer:
  devices: 2
  limit_val_batches: 0
  callbacks:
    - class_path: salvage.callbacks.sft.OracleSFT
      init_args: {{episodes: 4, steps: 3, batch_size: 4, lr: 5.0e-3}}
    - class_path: fsdp_dump.DumpModels
      init_args: {{out: {out}}}
model:
  init_args:
    num_minibatches: 1
    micro_batch_size: 4
    fsdp: {{param_dtype: float32}}
data:
  init_args:
    allow_overlap: true  # 4 train / 2 val coin games of one layout overlap; no validation runs
    env:
      train_tasks: {{num_tasks: 4}}
      val_tasks: {{num_tasks: 2}}
    tasks_per_step: 2
    group_size: 2
    max_turns: 3
    engine: {{max_new_tokens: 19}}  # OracleSFT's guard: `tiny` needs 19 for "take coin"
"""


def _fit(root: Path, dump: Path, steps: int, *extra: str) -> str:
    cfg = root.parent / f"{root.name}_{dump.name}.yaml"
    cfg.write_text(SMALL.format(out=dump))
    env = dict(
        os.environ,
        OMP_WAIT_POLICY="PASSIVE",
        OMP_NUM_THREADS="1",
        SALVAGE_PROGRESS="0",
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
        MASTER_PORT=str(master_port()),
    )
    cmd = [
        sys.executable,
        "-m",
        "salvage",
        "fit",
        "--config",
        "configs/vhgpo/twx_tiny.yaml",
        "--config",
        "configs/trainer/fsdp.yaml",
        "--config",
        str(cfg),
        "--trainer.default_root_dir",
        str(root),
        "--trainer.max_steps",
        str(steps),
        "--allow_config_change",
        "true",
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_warm_started_reference_survives_fsdp_resume(tmp_path):
    _fit(tmp_path / "straight", tmp_path / "straight_dump", 2)
    _fit(tmp_path / "split", tmp_path / "first_half", 1)
    ckpt = tmp_path / "split" / "version_0" / "checkpoints" / "last.ckpt"
    assert ckpt.is_dir() and len(list(ckpt.glob("*.distcp"))) == 2
    _fit(tmp_path / "split", tmp_path / "resumed", 2, "--ckpt_path", "last")

    for name in ("reference", "policy"):
        a = torch.load(tmp_path / "straight_dump" / f"{name}.pt")
        b = torch.load(tmp_path / "resumed" / f"{name}.pt")
        assert set(a) == set(b)
        diff = {k: float((a[k] - b[k]).abs().max()) for k in a if not torch.equal(a[k], b[k])}
        assert diff == {}, f"{name} after resume differs from the uninterrupted run: {diff}"
    # the reference is the warm-started policy, not the initial one (what makes it a test)
    first = torch.load(tmp_path / "first_half" / "reference.pt")
    ref = torch.load(tmp_path / "resumed" / "reference.pt")
    assert all(torch.equal(first[k], ref[k]) for k in ref)


def test_reference_round_trip_in_one_process_and_old_fsdp_format_refused(tiny, tmp_path):
    """One process: the full reference goes under ``salvage_reference`` and comes back. A
    checkpoint of the old FSDP format (DTensors in the metadata: rank 0's shard) is refused."""
    from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh

    from salvage.distributed import REFERENCE_KEY, load_reference, save_reference
    from salvage.models import PolicySpec, load_model

    model, _ = tiny
    ckpt: dict = {"state_dict": {}}
    save_reference(model, ckpt)
    other = load_model(PolicySpec("tiny", seed=3))
    assert not all(
        torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True)
    )
    load_reference(other, ckpt, None)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True)
    )

    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        old = {k: distribute_tensor(v, mesh, [Replicate()]) for k, v in model.state_dict().items()}
        with pytest.raises(ValueError, match="only rank 0's FSDP shard"):
            load_reference(other, {REFERENCE_KEY: old}, "last.ckpt")
    finally:
        dist.destroy_process_group()
