"""Every shipped GPU config, shrunk to ``tiny`` on CPU, learns at its own lr.

A GPU config is found by rule, not by list: a YAML whose documented composition (the
``--config`` files of its first line) resolves to ``trainer.accelerator`` other than ``cpu``.
New GPU configs are covered without touching this file.

Each is run for one RL update with its own precision, strategy fragment (if any), module
class, lr and optimiser; only the model (``tiny``, the config's dtype kept), the device (one
CPU process) and the data (a fixed rollout batch with reward contrast) are swapped. With
AdamW the first step moves every parameter by about ``lr`` (``m / sqrt(v) = sign(g)``), so in
fp32 every parameter changes; in pure bf16 a step of 1e-6 on a weight of ~0.02 is below half
an ulp (~6e-5) and rounds away. CPU supports bf16, so this catches the class of bug without
a GPU.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ALL = sorted((ROOT / "configs").rglob("*.yaml"))
POLICY_KEYS = ("policy", "policy_a", "policy_b")
MIN_CHANGED = 0.9


def _composition(path: Path) -> list[str]:
    words = shlex.split(path.read_text().splitlines()[0].lstrip("# "))
    configs = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--config"]
    return configs or [str(path.relative_to(ROOT))]


def _accelerator(configs: list[str]) -> str:
    acc = "auto"  # Lightning's default
    for c in configs:
        m = re.search(r"^\s+accelerator:\s*(\S+)", (ROOT / c).read_text(), re.M)
        if m:
            acc = m.group(1)
    return acc


def gpu_configs() -> list[Path]:
    """YAMLs whose documented composition targets a GPU (accelerator auto / gpu / cuda)."""
    return [p for p in ALL if _accelerator(_composition(p)) != "cpu"]


def test_gpu_configs_are_found():
    names = {str(p.relative_to(ROOT)) for p in gpu_configs()}
    for must in (
        "configs/graft/math_pair1.yaml",
        "configs/vhgpo/alfworld_1p5b.yaml",
        "configs/vhgpo/alfworld_7b.yaml",
        "configs/vhgpo/webshop_1p5b.yaml",
        "configs/agent/alfworld_grpo.yaml",
        "configs/agent/webshop_grpo.yaml",
        "configs/trainer/gpu.yaml",
        "configs/trainer/fsdp.yaml",
    ):
        assert must in names
    assert "configs/vhgpo/twx_tiny.yaml" not in names


def _turn(tok: Any, ref: torch.nn.Module, question: str, answer: str):
    from salvage.lm import pad_right, token_logprobs
    from salvage.types import Turn

    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    p = list(tok(text, add_special_tokens=False)["input_ids"])
    r = list(tok(answer, add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]
    ids, mask = pad_right([p + r], int(tok.pad_token_id), torch.device("cpu"))
    with torch.no_grad():
        lp = token_logprobs(ref, ids, mask, 1.0)[0, len(p) - 1 : len(p) - 1 + len(r)]
    return Turn(p, r, lp.tolist(), response_text=answer, prompt_text=text)


def contrast_batch(tok: Any, ref: torch.nn.Module, groups: int = 8):
    """``groups`` prompts x 2 responses, one right (A = +1) and one wrong (A = -1)."""
    from salvage.types import Group, RolloutBatch, Trajectory

    out = []
    for g in range(groups):
        q = f"What is {g} + {g + 3}?"
        right = Trajectory(
            [_turn(tok, ref, q, f"The answer is \\boxed{{{2 * g + 3}}}.")], 1.0, True, 1.0
        )
        wrong = Trajectory([_turn(tok, ref, q, "The answer is \\boxed{0}.")], 0.0, False, -1.0)
        out.append(Group(f"q{g}", [right, wrong]))
    return RolloutBatch(groups=out)


class _Snapshot:
    """Trainable parameters (full tensors under FSDP2) at the first batch and at the end."""

    def __init__(self) -> None:
        import lightning as L

        snap = self

        class CB(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                snap.before = snap.grab(pl_module)

            def on_train_end(self, trainer, pl_module):
                snap.after = snap.grab(pl_module)

        self.callback = CB()

    @staticmethod
    def grab(module: torch.nn.Module) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in module.named_parameters():
            if p.requires_grad:
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                out[name] = full.detach().clone()
        return out

    def changed_fraction(self) -> float:
        assert self.before and self.before.keys() == self.after.keys()
        changed = sum(int((self.before[k] != self.after[k]).sum()) for k in self.before)
        total = sum(v.numel() for v in self.before.values())
        return changed / total


def _shrink_args(configs: list[str], policy_keys: list[str], tmp: Path) -> list[str]:
    args = [a for c in configs for a in ("--config", str(ROOT / c))]
    for k in policy_keys:  # tiny, the config's dtype kept
        args += [f"--model.init_args.{k}.name_or_path", "tiny"]
    args += [
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--trainer.max_steps=1",
        "--trainer.limit_val_batches=0",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.callbacks=[]",
        f"--trainer.default_root_dir={tmp}",
        "--rescue=null",
    ]
    return args


def _parse(args: list[str]) -> Any:
    from salvage.commands.fit import SalvageCLI

    class ParseOnly(SalvageCLI):
        def instantiate_classes(self) -> None:
            pass

    return ParseOnly(
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        run=False,
        auto_configure_optimizers=False,
    ).config


# the fit is one training batch: Lightning notes there is a validation_step but no loader
@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no")
@pytest.mark.parametrize("path", gpu_configs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_gpu_config_shrunk_to_tiny_changes_most_parameters(path, tmp_path, monkeypatch):
    import lightning as L
    from jsonargparse import Namespace

    from salvage.models import PolicySpec, load_model, load_tokenizer

    monkeypatch.chdir(ROOT)
    configs = _composition(path)
    full = _parse([a for c in configs for a in ("--config", str(ROOT / c))])
    init = full["model"]["init_args"]
    keys = [k for k in POLICY_KEYS if init.get(k) is not None]
    cfg = _parse(_shrink_args(configs, keys, tmp_path))
    t, m = cfg["trainer"], cfg["model"]["init_args"]
    # what must survive the shrink: precision, strategy, lr, optimiser settings, dtypes
    assert t["precision"] == full["trainer"]["precision"]
    assert t.get("strategy") == full["trainer"].get("strategy")
    for k in ("lr", "betas", "weight_decay", "fsdp"):
        assert m.get(k) == init.get(k), k
    for k in keys:
        assert m[k]["dtype"] == init[k]["dtype"] and m[k]["name_or_path"] == "tiny"

    from salvage.commands.fit import SalvageCLI

    class NoData(SalvageCLI):  # the config's data (hub datasets, envs) is replaced by a batch
        def instantiate_classes(self) -> None:
            self.config["data"] = None
            super().instantiate_classes()

    snap = _Snapshot()
    cli = NoData(
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=_shrink_args(configs, keys, tmp_path),
        run=False,
        auto_configure_optimizers=False,
        trainer_defaults={"callbacks": [snap.callback], "enable_model_summary": False},
    )
    spec = m[keys[0]]
    spec = PolicySpec(**(spec.as_dict() if isinstance(spec, Namespace) else dict(spec)))
    tok = load_tokenizer(spec)
    ref = load_model(PolicySpec(**{**spec.__dict__, "dtype": "float32"}), tok).eval()
    batch = contrast_batch(tok, ref)
    if len(keys) == 2:  # GRAFT: both policies see their own groups (no prompt is complementary)
        from salvage.types import PairedBatch

        batch = PairedBatch(groups=[], a=batch, b=contrast_batch(tok, ref))
    assert isinstance(cli.trainer, L.Trainer)
    loader = torch.utils.data.DataLoader([batch], batch_size=None, collate_fn=lambda b: b)
    cli.trainer.fit(cli.model, train_dataloaders=loader)
    frac = snap.changed_fraction()
    assert frac >= MIN_CHANGED, (
        f"{path.relative_to(ROOT)}: one update at lr={init['lr']} with precision "
        f"{t['precision']} and dtype {[init[k]['dtype'] for k in keys]} changed only "
        f"{frac:.1%} of the trained parameters (fp32 master weights keep updates of ~lr)"
    )


# fsdp.yaml also runs on CPU with gloo (tests/test_fsdp.py): it leaves the engine to its base
CPU_TOO = {"configs/trainer/fsdp.yaml"}


@pytest.mark.parametrize(
    "path",
    [p for p in gpu_configs() if str(p.relative_to(ROOT)) not in CPU_TOO],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_gpu_config_rolls_out_with_vllm(path, monkeypatch):
    """GPU configs sample with vLLM (the papers' engine); HF stays CPU's."""
    monkeypatch.chdir(ROOT)
    cfg = _parse([a for c in _composition(path) for a in ("--config", str(ROOT / c))])
    assert cfg["data"]["init_args"]["engine"]["backend"] == "vllm"
    rescue = cfg.get("rescue")
    teacher = rescue["init_args"].get("teacher") if rescue is not None else None
    if teacher is not None and teacher["kind"] == "lm" and teacher.get("engine") is not None:
        assert teacher["engine"]["backend"] == "vllm"


def test_cpu_configs_keep_the_hf_engine(monkeypatch):
    monkeypatch.chdir(ROOT)
    for rel in ("configs/vhgpo/twx_tiny.yaml", "configs/grpo/math_tiny.yaml"):
        cfg = _parse(["--config", str(ROOT / rel)])
        assert cfg["data"]["init_args"]["engine"]["backend"] == "hf", rel
