"""LearnerBase: the Lightning shell of one trainable policy, whatever its objective.

It holds the policy and, when something needs one, its frozen reference (FSDP meshes,
checkpointing the reference), the AdamW optimiser and its learning-rate schedule, and the
lock-step micro-batch loop every objective backpropagates through on every data-parallel
rank. ``GRPOModule`` (``salvage.modules.grpo``) loads the models (``build``) and adds the
update itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import lightning as L
import torch
from lightning.fabric.utilities.data import AttributeDict

from salvage.distributed import (
    REFERENCE_KEY,
    all_reduce,
    all_true,
    load_reference,
    lockstep,
    save_reference,
    to_device,
    world,
)
from salvage.lm import bump_weights_version, token_logprobs
from salvage.metrics import StepMetrics

T = TypeVar("T")


class LearnerBase(L.LightningModule):
    """One policy and its reference, optimiser, schedule and lock-step micro-batches."""

    policy: torch.nn.Module | None
    _ref: list[torch.nn.Module]  # a list keeps it out of state_dict / parameters
    tokenizer: Any
    total_steps_hint: int | None
    step_metrics: StepMetrics
    _count_step: bool

    @property
    def hparams(self) -> AttributeDict:
        """The saved hyper-parameters (attribute access)."""
        return cast(AttributeDict, super().hparams)

    def fsdp_mesh(self) -> Any:
        """The data-parallel mesh of ``ModelParallelStrategy`` (None under other strategies)."""
        return self.mesh_of(self.device_mesh)

    @staticmethod
    def mesh_of(mesh: Any) -> Any:
        """The data-parallel part of a strategy's device mesh (None: no mesh)."""
        if mesh is None:
            return None
        names = mesh.mesh_dim_names or ()
        if "tensor_parallel" in names and mesh["tensor_parallel"].size() > 1:
            raise ValueError(
                "salvage shards with FSDP2 only: set trainer.strategy.init_args.tensor_parallel_size=1 and "
                f"data_parallel_size to the number of devices (got a mesh of shape {tuple(mesh.shape)})"
            )
        return mesh["data_parallel"] if "data_parallel" in names else mesh

    def inference_models(self) -> list[torch.nn.Module]:
        """Models that sample or score without gradients (gathered together under FSDP)."""
        return [m for m in (self.policy, self.ref_model) if m is not None]

    def sampling_models(self) -> list[torch.nn.Module]:
        """Models that generate during rollouts (gathered for them under FSDP; the reference
        only scores in the update, where it is gathered on its own)."""
        return [self.policy] if self.policy is not None else []

    def needs_reference(self) -> bool:
        """A frozen reference only when something uses it (eta = 0 skips loading it)."""
        return self.hparams.kl_coef > 0

    def reset_reference(self) -> None:
        """Make the reference the current policy (e.g. after an SFT warm start)."""
        if self._ref:
            self._ref[0].load_state_dict(self.live_policy.state_dict())
            self._ref_reset = True

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # the reference is not a parameter of the module; when it is no longer the loaded
        # checkpoint (a warm start reset it), it must travel with the checkpoint
        if self._ref and getattr(self, "_ref_reset", False):
            save_reference(self._ref[0], checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if checkpoint.get(REFERENCE_KEY) is not None:
            if not self._ref:
                self.configure_model()
            path = self._trainer.ckpt_path if self._trainer is not None else None
            load_reference(self._ref[0], checkpoint, path)
            self._ref_reset = True

    @property
    def ref_model(self) -> torch.nn.Module | None:
        return self._ref[0] if self._ref else None

    @property
    def live_policy(self) -> torch.nn.Module:
        """The policy, which must be loaded (``configure_model`` ran)."""
        if self.policy is None:
            raise RuntimeError("the policy is not loaded: configure_model() has not run")
        return self.policy

    @property
    def reference(self) -> torch.nn.Module:
        """The frozen reference, which must be loaded (``needs_reference()``)."""
        if not self._ref:
            raise RuntimeError("no reference model is loaded (kl_coef = 0 and nothing needs one)")
        return self._ref[0]

    def on_fit_start(self) -> None:
        if self.ref_model is not None:  # an offloaded reference keeps its shards on the CPU
            to_device(self.ref_model, self.device)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        params = [p for p in self.live_policy.parameters() if p.requires_grad]
        opt = _adamw(params, lr=hp.lr, betas=tuple(hp.betas), weight_decay=hp.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, self._lr_lambda)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _lr_lambda(self, step: int) -> float:
        hp = self.hparams
        if hp.warmup_steps and step < hp.warmup_steps:
            return (step + 1) / hp.warmup_steps
        if hp.lr_schedule == "constant":
            return 1.0
        total = (
            self.trainer.max_steps
            if self._trainer is not None and self.trainer.max_steps > 0
            else None
        )
        total = total or self.total_steps_hint
        if not total or total <= hp.warmup_steps:
            return 1.0
        frac = min(1.0, (step - hp.warmup_steps) / max(1, total - hp.warmup_steps))
        decay = 1.0 - frac if hp.lr_schedule == "linear" else 0.5 * (1 + math.cos(math.pi * frac))
        return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * decay

    # ------------------------------------------------------------------ data parallel
    def global_count(self, n: float) -> float:
        """The divisor of a mean over items that ranks hold in shares: the global count over
        the number of ranks (gradients are averaged over ranks), so that every rank's
        ``sum / global_count`` backward averages to one process's mean; ``n`` on one process."""
        total = all_reduce([float(n)])[0]
        return total / world()[1]

    def finite(self, loss: torch.Tensor) -> bool:
        """Whether the loss is finite on every rank (all ranks skip together)."""
        return all_true(bool(torch.isfinite(loss).all()))

    def micro_steps(
        self, items: Sequence[T], size: int, loss_fn: Callable[[int, Sequence[T]], torch.Tensor]
    ) -> bool:
        """Backward ``loss_fn(start, part)`` on each micro-batch of ``size`` items, in lock
        step with the other ranks (a rank with fewer micro-batches runs ``keep_in_step``).

        Every micro-batch loop of an update (policy loss, VH-GPO's and SGT's auxiliary
        terms) goes through here. False: some rank's loss was not finite; every rank stopped
        and nothing more was backpropagated.
        """
        for c in range(lockstep(-(-len(items) // size))):
            start = c * size
            part = items[start : start + size]
            if not part:  # this rank has fewer micro-batches than another: keep in step
                if not self.keep_in_step():
                    return False
                continue
            loss = loss_fn(start, part)
            if not self.finite(loss):
                return False
            self.backward_loss(loss)
        return True

    def keep_in_step(self) -> bool:
        """A zero-weight micro-batch for a rank that has run out of real ones: the same
        forward, finiteness vote and backward as the others, so every rank issues the same
        collectives in the same order (FSDP all-gathers, the vote, reduce-scatters).
        False when some rank's loss was not finite (every rank stops its loop)."""
        pad = int(self.tokenizer.pad_token_id)
        ids = torch.full((1, 2), pad, dtype=torch.long, device=self.device)
        loss = token_logprobs(self.live_policy, ids, torch.ones_like(ids), 1.0).sum() * 0.0
        if not self.finite(loss):
            return False
        self.backward_loss(loss)
        return True

    def backward_loss(self, loss: torch.Tensor) -> None:
        """Backward through the strategy when attached to a trainer (plain autograd otherwise)."""
        if self._trainer is not None:
            self.manual_backward(loss)
        else:
            loss.backward()

    def _clip_and_norm(self) -> float:
        params = [p for p in self.live_policy.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.hparams.max_grad_norm or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def _optimizer_step(self, opt: Any, last: bool) -> None:
        if last and self._count_step:
            opt.step()  # through Lightning: counts one global step per rollout batch
        else:
            getattr(opt, "optimizer", opt).step()
        opt.zero_grad(set_to_none=True)

    def _finish_update(self, opt: Any, sched: Any) -> dict[str, float]:
        if sched is not None:
            sched.step()
        if self.policy is not None:  # engines holding a copy (vLLM) re-sync on a new version
            bump_weights_version(self.policy)
        values = self.step_metrics.compute()
        values.update(getattr(self, "family_metrics", {}))
        self.family_metrics: dict[str, float] = {}
        values["train/lr"] = float(opt.param_groups[0]["lr"])
        return values


def _adamw(params: list[torch.nn.Parameter], **kwargs: Any) -> torch.optim.Optimizer:
    """AdamW with the fused kernel where the device has one (CPU: 5x faster than the loop
    kernel, measured in benchmarks/vs_trl.py), else the default implementation."""
    devices = {p.device.type for p in params}
    if params and devices <= {"cpu", "cuda"}:
        try:
            return torch.optim.AdamW(params, fused=True, **kwargs)
        except (RuntimeError, TypeError, ValueError):
            pass
    return torch.optim.AdamW(params, **kwargs)
