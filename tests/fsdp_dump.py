"""A callback for the 2-process CLI tests: the trained models, gathered, on disk (rank 0)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from salvage.distributed import is_sharded


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict of ``model`` on every rank, sharded (FSDP2) or not; a collective."""
    if not is_sharded(model):
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=False)
    return get_model_state_dict(model, options=opts)


class DumpModels(L.Callback):
    """At the end of fit, write the full policy and reference to ``out/{policy,reference}.pt``.

    Args:
        out: directory of the dumps (rank 0 writes them).
    """

    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        states = {"policy": full_state(pl_module.policy)}
        if pl_module.ref_model is not None:
            states["reference"] = full_state(pl_module.ref_model)
        if trainer.is_global_zero:
            self.out.mkdir(parents=True, exist_ok=True)
            for name, sd in states.items():
                torch.save(sd, self.out / f"{name}.pt")
