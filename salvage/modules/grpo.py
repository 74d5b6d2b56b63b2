"""GRPOModule: the policy, its optimiser, and the clipped-surrogate update.

One rollout batch -> one epoch of ``num_minibatches`` optimiser steps (SPEC §1). The
module never touches an environment or a verifier: it trains on whatever
``RolloutBatch`` the datamodule (and the callbacks after it) hand it, so multi-turn
agent batches and exchanged peer groups go through the same code.

``trainer.global_step`` counts RL updates (rollout batches), not optimiser steps: the
minibatch steps before the last of a batch go to the raw optimiser, the last through
Lightning's optimiser wrapper, so ``--trainer.max_steps N`` means N updates.

The update's phases are here; the module's shell lives beside it: the models, optimiser,
schedule and lock-step micro-batches in ``salvage.modules.learner`` (``LearnerBase``), the
step / rollout / evaluation metrics in ``salvage.modules.reporting``, the batch -> rows ->
minibatches plumbing in ``salvage.modules.grpo_batch``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from salvage.core.grpo import AGGREGATIONS, kl_k3
from salvage.core.policy_loss import row_policy_loss
from salvage.distributed import (
    FSDPConfig,
    all_reduce,
    gathered,
    global_scale,
    is_sharded,
    load_sharded,
    lockstep,
    shard_model,
    world,
)
from salvage.errors import ConfigError
from salvage.lm import (
    DEFAULT_LOGPROB_CHUNK,
    packed_token_logprobs,
    set_logprob_chunk_size,
    token_logprobs,
)
from salvage.metrics import StepMetrics
from salvage.models import PolicySpec, build_empty_model, load_model, load_tokenizer
from salvage.modules.grpo_batch import (
    Minibatch,
    _Row,
    add_stats,
    collate_rows,
    count_positions,
    local_denominator,
    log_minibatch,
    loss_inputs,
    reference_rows,
    row_order,
    row_weights,
    rows_of,
    split_minibatches,
)
from salvage.modules.learner import LearnerBase
from salvage.modules.reporting import TRAIN_METRICS, PolicyReport, _sampled_metrics
from salvage.types import RolloutBatch, TokenBatch, Trajectory

log = logging.getLogger(__name__)

LR_SCHEDULES = ("constant", "linear", "cosine")


class NonFiniteLossError(RuntimeError):
    pass


@dataclass
class Auxiliary:
    """An auxiliary objective that joins an update once, in its last minibatch (ours).

    The module or callback that owns the objective builds it (VH-GPO's relay terms:
    ``VHGPOModule.auxiliary``; SGT's NLL term: ``GRAFTModule``).
    """

    present: bool
    """This rank holds data for it (the ranks decide together whether it runs)."""
    backward: Callable[[], torch.Tensor | None]
    """Backpropagates the objective; returns its detached total (NaN: not finite; None:
    nothing to add). Called on every rank when any rank has data."""


class GRPOModule(LearnerBase, PolicyReport):
    """GRPO / Dr. GRPO / RLOO policy update with asymmetric clipping and optional k3 KL.

    Args:
        policy: which model to train (``tiny``, ``smollm2-135m-instruct``, a path, a hub id).
        lr: AdamW learning rate (peak, after warm-up).
        weight_decay: AdamW decoupled weight decay.
        betas: AdamW (beta1, beta2).
        lr_schedule: ``constant``, ``linear`` or ``cosine`` decay after ``warmup_steps``
            (in RL updates) down to ``min_lr_ratio * lr`` at ``trainer.max_steps``.
        warmup_steps: RL updates of linear learning-rate warm-up from 0.
        min_lr_ratio: the decayed learning rate's floor, as a fraction of ``lr``.
        num_minibatches: optimiser steps per rollout batch (one epoch over the batch).
        micro_batch_size: sequences per forward/backward (gradient accumulation inside a
            minibatch; the loss normalisation is over the whole minibatch).
        clip_eps_low: lower clip of the token ratio, ``1 - clip_eps_low`` (0.2).
        clip_eps_high: upper clip of the token ratio, ``1 + clip_eps_high`` (DAPO 0.28;
            standard GRPO 0.2).
        loss_agg: ``token-mean`` (default) or ``seq-mean-token-mean``.
        kl_coef: eta; 0 skips loading the reference model entirely.
        max_grad_norm: gradient clipping by global norm (0 disables).
        shuffle_minibatches: shuffle trajectories before splitting into minibatches.
        max_nonfinite_in_a_row: a non-finite loss or gradient skips the update; this
            many in a row stops the run.
        seed: seed of the minibatch shuffling stream.
        fsdp: FSDP2 sharding of the policy and the reference under
            ``ModelParallelStrategy`` (mixed precision, activation checkpointing,
            offloading); ignored by other strategies.
        logprob_chunk_size: positions per LM-head chunk when scoring tokens (update,
            reference, behaviour log-probs): at most this many x vocab logits exist at once
            instead of micro-batch x length x vocab; 0 computes the full logits at once.
        pack_prompts: score the rows of a micro-batch that share a prompt in one packed
            sequence, each prompt computed once (ours; the same loss; false: a padded row each).
        length_aware_micro_batches: order each minibatch's rows by length (rows sharing a
            prompt together) before cutting micro-batches, to cut padding (ours; same loss).
    """

    METRICS: tuple[str, ...] = TRAIN_METRICS

    def __init__(
        self,
        policy: PolicySpec | None = None,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        lr_schedule: str = "constant",
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.0,
        num_minibatches: int = 1,
        micro_batch_size: int = 8,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.28,
        loss_agg: str = "token-mean",
        kl_coef: float = 0.0,
        max_grad_norm: float = 1.0,
        shuffle_minibatches: bool = True,
        max_nonfinite_in_a_row: int = 3,
        seed: int = 0,
        fsdp: FSDPConfig | None = None,
        logprob_chunk_size: int = DEFAULT_LOGPROB_CHUNK,
        pack_prompts: bool = True,
        length_aware_micro_batches: bool = True,
    ) -> None:
        init_args = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        super().__init__()
        _check(lr > 0, "model.lr", lr, "must be > 0")
        _check(
            lr_schedule in LR_SCHEDULES,
            "model.lr_schedule",
            lr_schedule,
            f"must be one of {LR_SCHEDULES}",
        )
        _check(warmup_steps >= 0, "model.warmup_steps", warmup_steps, "must be >= 0")
        _check(0 <= min_lr_ratio <= 1, "model.min_lr_ratio", min_lr_ratio, "must be in [0, 1]")
        _check(num_minibatches >= 1, "model.num_minibatches", num_minibatches, "must be >= 1")
        _check(micro_batch_size >= 1, "model.micro_batch_size", micro_batch_size, "must be >= 1")
        _check(0 <= clip_eps_low < 1, "model.clip_eps_low", clip_eps_low, "must be in [0, 1)")
        _check(clip_eps_high >= 0, "model.clip_eps_high", clip_eps_high, "must be >= 0")
        _check(
            loss_agg in AGGREGATIONS, "model.loss_agg", loss_agg, f"must be one of {AGGREGATIONS}"
        )
        _check(kl_coef >= 0, "model.kl_coef", kl_coef, "must be >= 0")
        _check(max_grad_norm >= 0, "model.max_grad_norm", max_grad_norm, "must be >= 0")
        _check(
            max_nonfinite_in_a_row >= 1,
            "model.max_nonfinite_in_a_row",
            max_nonfinite_in_a_row,
            "must be >= 1",
        )
        _check(
            logprob_chunk_size >= 0, "model.logprob_chunk_size", logprob_chunk_size, "must be >= 0"
        )
        self.spec = policy or PolicySpec()
        self.fsdp = fsdp or FSDPConfig()
        # explicit (no frame inspection): the module may be built inside another's __init__
        self.save_hyperparameters(init_args)
        self._plain_hparams()
        self.automatic_optimization = False
        self.tokenizer = load_tokenizer(self.spec)
        self.policy: torch.nn.Module | None = None
        self._ref: list[torch.nn.Module] = []  # a list keeps it out of state_dict / parameters
        self.step_metrics = StepMetrics(self.METRICS, sums=("train/skipped_updates", "env/errors"))
        self._nonfinite_in_a_row = 0
        self.skipped_updates = 0
        self._step_log: dict[str, float] = {}
        self._opt: Any = None
        self._step = 0
        self._count_step = True
        self.total_steps_hint: int | None = None
        self.forward_positions = [0, 0, 0]
        """Update forwards of the policy: [positions run (padding included), tokens run,
        response tokens scored]; counted for benchmarks, never reset here."""

    def _plain_hparams(self) -> None:
        """Hyper-parameters as plain data, so checkpoints load with ``weights_only=True``."""
        self.hparams["policy"] = dataclasses.asdict(self.spec)
        self.hparams["betas"] = list(self.hparams["betas"])
        self.hparams["fsdp"] = dataclasses.asdict(self.fsdp)

    # ------------------------------------------------------------------ model
    def configure_model(self) -> None:
        self.build(self.fsdp_mesh())

    def build(self, mesh: Any = None) -> None:
        """Load the policy (and the reference when something needs one); shard both with
        FSDP2 on ``mesh`` (None: unsharded). Idempotent.

        On a mesh, only rank 0 reads the weights (``fsdp.init_on_rank0``): the other ranks
        build the models on the meta device and receive their shards (``load_sharded``)."""
        spec, tok = self.spec, self.tokenizer

        def load() -> torch.nn.Module:
            return load_model(spec, tok)

        def empty() -> torch.nn.Module:
            return build_empty_model(spec, tok)

        if self.policy is None:
            self.policy = load() if mesh is None else load_sharded(load, empty, mesh, self.fsdp)
        if self.needs_reference() and not self._ref:
            if mesh is None:
                ref = load().eval().requires_grad_(False)
            else:
                ref = load_sharded(load, empty, mesh, self.fsdp, frozen=True, device=self.device)
            self._ref.append(ref)
        for m in (self.policy, *self._ref):
            set_logprob_chunk_size(m, self.hparams.get("logprob_chunk_size", DEFAULT_LOGPROB_CHUNK))
        if mesh is not None:
            if not is_sharded(self.policy):
                shard_model(self.policy, mesh, self.fsdp)
            if self._ref and not is_sharded(self._ref[0]):
                self._ref[0].to(self.device)
                shard_model(self._ref[0], mesh, self.fsdp, frozen=True)

    # ------------------------------------------------------------------ batch -> rows
    def rows_from_batch(self, batch: RolloutBatch) -> tuple[list[_Row], list[list[int]]]:
        """Training rows (one per trainable turn) and, per trajectory, its row indices."""
        return rows_of(self.trajectories_for_update(batch))

    def trajectories_for_update(self, batch: RolloutBatch) -> list[Trajectory]:
        """The trajectories whose tokens enter the policy loss (subclasses extend)."""
        return batch.trajectories

    def collate(self, rows: list[_Row]) -> TokenBatch:
        return collate_rows(rows, int(self.tokenizer.pad_token_id), self.device)

    def _minibatches(
        self, per_traj: list[list[int]], batch: RolloutBatch | None = None
    ) -> list[list[int]]:
        hp = self.hparams
        return split_minibatches(
            per_traj, batch, hp.num_minibatches, hp.shuffle_minibatches, hp.seed, self._step
        )

    def micro_order(self, rows: Sequence[_Row]) -> list[int]:
        """The order in which ``rows`` are cut into micro-batches: as given, or (with
        ``length_aware_micro_batches``) by length, rows sharing a prompt together when
        ``pack_prompts`` is on. Only the order of gradient accumulation changes."""
        hp = self.hparams
        return row_order(rows, hp.length_aware_micro_batches, hp.pack_prompts)

    def _count_positions(self, part: Sequence[_Row]) -> None:
        count_positions(self.forward_positions, part, self.hparams.pack_prompts)

    # ------------------------------------------------------------------ update
    def training_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        values = self.update(batch, self.optimizers(), self.lr_schedulers(), self.global_step)
        self.record(values)
        for k in ("rollout/reward_mean", "loss/policy"):
            if k in values:
                self.log(
                    k.split("/")[1],
                    values[k],
                    on_step=True,
                    on_epoch=False,
                    prog_bar=True,
                    logger=False,
                )

    def update(
        self,
        batch: RolloutBatch,
        opt: Any,
        sched: Any,
        step: int,
        count_step: bool = True,
        aux: Auxiliary | None = None,
    ) -> dict[str, float]:
        """One RL update of this policy on ``batch``; returns the step's metrics.

        ``opt``/``sched`` are this policy's (Lightning-wrapped) optimiser and scheduler;
        ``count_step=False`` keeps Lightning's step counter untouched (a second policy in
        the same update, GRAFT). ``aux``: an auxiliary objective from the caller (default:
        this module's own, ``auxiliary``). Callable on a module not attached to a trainer.
        """
        hp = self.hparams
        self._opt, self._step, self._count_step = opt, step, count_step
        self.log_rollout(batch)
        rows, per_traj = self.rows_from_batch(batch)
        aux = aux if aux is not None else self.auxiliary(batch)
        has_aux = aux is not None and aux.present
        # data-parallel ranks decide together (each rank holds its own share of the batch)
        n_rows, n_aux = all_reduce([float(len(rows)), float(has_aux)])
        if not n_rows and not n_aux:
            log.warning("step %d: rollout batch has no trainable tokens; update skipped", step)
            return self._finish_update(opt, sched)
        ref_lp = None
        if hp.kl_coef > 0 and n_rows:
            with gathered(self.ref_model):
                ref_lp = self._ref_logprobs(rows, batch.temperature)
        extra = aux.backward if n_aux and aux is not None else None
        self._run_minibatches(batch, rows, per_traj, ref_lp, extra, opt)
        return self._finish_update(opt, sched)

    def _run_minibatches(
        self,
        batch: RolloutBatch,
        rows: list[_Row],
        per_traj: list[list[int]],
        ref_lp: list[torch.Tensor] | None,
        extra: Callable[[], torch.Tensor | None] | None,
        opt: Any,
    ) -> None:
        """One epoch over the batch, an optimiser step per minibatch (every rank runs as
        many); ``extra``, an auxiliary objective, joins the last minibatch only (ours)."""
        minibatches = self._minibatches(per_traj, batch) or [[]]
        minibatches += [[] for _ in range(lockstep(len(minibatches)) - len(minibatches))]
        t0 = time.perf_counter()
        tokens = 0
        for k, mb in enumerate(minibatches):
            last = k == len(minibatches) - 1
            ok = self._update_minibatch(
                [rows[i] for i in mb], mb, ref_lp, batch.temperature, extra if last else None
            )
            tokens += sum(len(rows[i].old_logprobs) for i in mb)
            if ok:
                self._optimizer_step(opt, last)
            elif last:
                # No gradients (set to None): the optimiser leaves every parameter alone,
                # but Lightning still counts the update, so global_step = rollout batches.
                opt.zero_grad(set_to_none=True)
                self._optimizer_step(opt, last=True)
        dt = time.perf_counter() - t0
        self.step_metrics.update("perf/update_tokens_per_s", tokens / max(dt, 1e-9))

    def auxiliary(self, batch: RolloutBatch) -> Auxiliary | None:
        """This module's auxiliary objective on ``batch`` (None: it has none; subclasses add)."""
        return None

    def row_logprobs(
        self, model: torch.nn.Module, part: Sequence[_Row], tb: TokenBatch, temperature: float
    ) -> torch.Tensor:
        """Token log-probs of a micro-batch in ``tb``'s layout: packed by shared prompts
        (``pack_prompts``) or one padded row per sequence."""
        if self.hparams.pack_prompts:
            return packed_token_logprobs(
                model,
                [r.ids for r in part],
                [r.start for r in part],
                int(self.tokenizer.pad_token_id),
                temperature,
                self.device,
            )
        # the LM head runs from the first response position of the micro-batch on
        first = min(r.start for r in part)
        return token_logprobs(model, tb.input_ids, tb.attention_mask, temperature, first=first)

    @torch.no_grad()
    def _ref_logprobs(self, rows: list[_Row], temperature: float) -> list[torch.Tensor]:
        out: list[torch.Tensor] = [torch.empty(0)] * len(rows)
        mbs = self.hparams.micro_batch_size
        order = self.micro_order(rows)
        for s in range(0, len(rows), mbs):
            idx = order[s : s + mbs]
            part = [rows[i] for i in idx]
            lp = self.row_logprobs(self.reference, part, self.collate(part), temperature)
            for j, i in enumerate(idx):
                out[i] = lp[j]
        return out

    def _update_minibatch(
        self,
        rows: list[_Row],
        row_ids: list[int],
        ref_lp: list[torch.Tensor] | None,
        temperature: float,
        extra: Any = None,
    ) -> bool:
        """Accumulate gradients of one minibatch; False if non-finite (gradients dropped)."""
        mb = self._minibatch(rows, row_ids, ref_lp, temperature)
        # micro-batches in length order (the per-row weights stay the minibatch's)
        finite = self.micro_steps(
            self.micro_order(rows),
            self.hparams.micro_batch_size,
            lambda _, idx: self._micro_loss(mb, idx),
        )
        if finite and extra is not None:
            aux = extra()
            finite = aux is None or bool(torch.isfinite(aux))
        grad_norm = self._clip_and_norm()
        if not finite or not math.isfinite(grad_norm):
            self._skip_minibatch("loss" if not finite else "gradient")
            return False
        self._nonfinite_in_a_row = 0
        log_minibatch(self.step_metrics, mb, grad_norm, self.hparams.kl_coef)
        return True

    def _minibatch(
        self,
        rows: list[_Row],
        row_ids: list[int],
        ref_lp: list[torch.Tensor] | None,
        temperature: float,
    ) -> Minibatch:
        """The minibatch with its normalisation weights (over the whole minibatch, before it
        is cut into micro-batches); several ranks normalise by the global count (token-mean
        over all ranks' tokens)."""
        loss_agg = self.hparams.loss_agg
        lengths, weights = row_weights(rows, loss_agg)
        _, n_world = world()
        scale = None
        if n_world > 1:
            local = local_denominator(rows, loss_agg)
            scale = global_scale(local, all_reduce([local])[0], n_world)
        return Minibatch(rows, row_ids, ref_lp, temperature, lengths, weights, scale)

    def _micro_loss(self, mb: Minibatch, idx: Sequence[int]) -> torch.Tensor:
        """The loss of the micro-batch ``idx`` of ``mb`` (its share of the minibatch's);
        adds its numbers to ``mb.stats``."""
        hp = self.hparams
        part = [mb.rows[i] for i in idx]
        tb = self.collate(part)
        lp = self.row_logprobs(self.live_policy, part, tb, mb.temperature)
        self._count_positions(part)
        # each row's tokens take its registered policy loss (clip, luffy, sequence, ...)
        loss_tok, clipped = row_policy_loss(
            [r.loss for r in part], loss_inputs(part, lp, tb, hp.clip_eps_low, hp.clip_eps_high)
        )
        ratio = torch.exp(lp - tb.old_logprobs).detach()
        aw = torch.zeros_like(lp)
        for i, r in enumerate(part):
            aw[i, r.start : r.start + len(r.old_logprobs)] = mb.weights[idx[i]].to(self.device)
        aw = aw * tb.response_mask
        pol = (aw * tb.weights * loss_tok).sum()
        loss = pol
        if mb.ref_lp is not None:
            kl = (aw * kl_k3(lp, reference_rows(mb, idx, lp))).sum()
            loss = loss + hp.kl_coef * kl
            mb.stats["kl"] += float(kl.detach())
        # (a non-finite loss stops the loop and drops these numbers with the minibatch)
        add_stats(mb.stats, part, pol, aw, clipped, ratio)
        return loss * mb.scale if mb.scale is not None else loss

    def _skip_minibatch(self, what: str) -> None:
        """Drop a non-finite minibatch's gradients; too many in a row stop the run."""
        hp = self.hparams
        self._opt.zero_grad(set_to_none=True)
        self._nonfinite_in_a_row += 1
        self.skipped_updates += 1
        self.step_metrics.update("train/skipped_updates", 1.0)
        log.warning(
            "step %d: non-finite %s; minibatch update skipped (%d in a row)",
            self._step,
            what,
            self._nonfinite_in_a_row,
        )
        if self._nonfinite_in_a_row >= hp.max_nonfinite_in_a_row:
            raise NonFiniteLossError(
                f"{self._nonfinite_in_a_row} non-finite updates in a row "
                f"(model.max_nonfinite_in_a_row={hp.max_nonfinite_in_a_row}); stopping. "
                "Lower model.lr or check the rewards and the data."
            )


def _check(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} {why}")


__all__ = [
    "LR_SCHEDULES",
    "TRAIN_METRICS",
    "Auxiliary",
    "GRPOModule",
    "NonFiniteLossError",
    "_Row",
    "_sampled_metrics",
]
