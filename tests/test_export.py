"""`salvage export` writes an HF directory that `from_pretrained` loads with the trained weights."""

from __future__ import annotations

import subprocess
import sys

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from test_fit import DigitFraction

from salvage.datamodules.rlvr import RLVRDataModule
from salvage.models import PolicySpec
from salvage.modules.grpo import GRPOModule
from salvage.rollout.config import EngineConfig
from salvage.tasks.math import MathData


def test_export_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    module = GRPOModule(policy=PolicySpec("tiny"), lr=1e-2, num_minibatches=1)
    data = RLVRDataModule(
        train=MathData(source="reasoning_gym:basic_arithmetic", size=8),
        prompts_per_step=2,
        group_size=4,
        engine=EngineConfig(max_new_tokens=8),
        reward=DigitFraction(),
    )
    ck = ModelCheckpoint(
        dirpath=tmp_path / "ck", save_last=True, every_n_train_steps=1, save_top_k=0
    )
    L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ck],
    ).fit(module, datamodule=data)
    out = tmp_path / "hf"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "salvage",
            "export",
            str(tmp_path / "ck" / "last.ckpt"),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    text = "What is 2 + 3? \\boxed{5}"
    ids = torch.tensor([tok(text)["input_ids"]])
    assert tok(text)["input_ids"] == module.tokenizer(text)["input_ids"]
    module.policy.eval()
    with torch.no_grad():
        assert torch.allclose(
            model(input_ids=ids).logits, module.policy(input_ids=ids).logits, atol=1e-5
        )


def test_export_refuses_an_ambiguous_graft_checkpoint(tmp_path):
    from salvage.commands.export import export

    torch.save(
        {"hyper_parameters": {}, "state_dict": {"a.policy.x": torch.zeros(1)}}, tmp_path / "g.ckpt"
    )
    with pytest.raises(ValueError, match="pass --policy a or --policy b"):
        export(tmp_path / "g.ckpt", tmp_path / "out")


def test_export_of_a_run_dir_takes_its_newest_versions_last_checkpoint(tmp_path):
    from salvage.commands.export import export

    run = tmp_path / "run"
    for v in ("version_0", "version_1"):
        (run / v / "checkpoints").mkdir(parents=True)
    (run / "version_0" / "checkpoints" / "last.ckpt").write_bytes(b"not a checkpoint")
    torch.save(
        {"hyper_parameters": {}, "state_dict": {"a.policy.x": torch.zeros(1)}},
        run / "version_1" / "checkpoints" / "last.ckpt",
    )
    # version_1's GRAFT checkpoint is the one read (version_0's file would not even load)
    with pytest.raises(ValueError, match="pass --policy a or --policy b"):
        export(run, tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no last.ckpt"):
        export(tmp_path / "empty", tmp_path / "out2")
