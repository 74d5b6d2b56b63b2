"""GRPOModule: the policy, its optimiser, and the clipped-surrogate update.

One rollout batch -> one epoch of ``num_minibatches`` optimiser steps (SPEC §1). The
module never touches an environment or a verifier: it trains on whatever
``RolloutBatch`` the datamodule (and the callbacks after it) hand it, so multi-turn
agent batches and exchanged peer groups go through the same code.

``trainer.global_step`` counts RL updates (rollout batches), not optimiser steps: the
minibatch steps before the last of a batch go to the raw optimiser, the last through
Lightning's optimiser wrapper, so ``--trainer.max_steps N`` means N updates.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import lightning as L
import torch
from lightning.fabric.utilities.data import AttributeDict

from salvage.core.evaluation import repeat_metrics
from salvage.core.grpo import (
    AGGREGATIONS,
    aggregation_denominator,
    aggregation_weights,
    kl_k3,
)
from salvage.core.packing import has_shared_prompt, micro_batch_order, pack_rows, prompt_key
from salvage.core.policy_loss import LossInputs, row_policy_loss
from salvage.core.seeds import permutation_seed
from salvage.distributed import (
    REFERENCE_KEY,
    FSDPConfig,
    all_reduce,
    all_true,
    gather_objects,
    gathered,
    global_scale,
    is_sharded,
    load_reference,
    load_sharded,
    lockstep,
    merge_eval_records,
    save_reference,
    shard_model,
    to_device,
    world,
)
from salvage.errors import ConfigError
from salvage.lm import (
    DEFAULT_LOGPROB_CHUNK,
    bump_weights_version,
    packed_token_logprobs,
    pad_right,
    set_logprob_chunk_size,
    token_logprobs,
)
from salvage.metrics import StepMetrics
from salvage.models import PolicySpec, build_empty_model, load_model, load_tokenizer
from salvage.types import RolloutBatch, SeqRatio, TokenBatch, Trajectory

log = logging.getLogger(__name__)

LR_SCHEDULES = ("constant", "linear", "cosine")

TRAIN_METRICS = (
    "rollout/reward_mean",
    "rollout/success_rate",
    "rollout/zero_signal_frac",
    "rollout/response_len",
    "rollout/verifier_timeouts",
    "rollout/invalid_turn_frac",
    "rollout/truncated_frac",
    "rollout/turns",
    "env/errors",
    "loss/policy",
    "loss/kl",
    "loss/total",
    "loss/clip_frac",
    "loss/peer_clip_frac",
    "loss/nll",
    "loss/ratio_mean",
    "train/grad_norm",
    "train/skipped_updates",
    "perf/rollout_tokens_per_s",
    "perf/update_tokens_per_s",
)


@dataclass
class _Row:
    """One training sequence: a turn's prompt + response, with what the loss needs."""

    ids: list[int]
    start: int  # index in ids[1:]-aligned tensors where the response begins
    old_logprobs: list[float]
    advantage: float
    weight: float
    seq: int
    peer: bool = False
    loss: str = "clip"  # the registered policy loss of its tokens (salvage.core.policy_loss)
    # sequence-level ratio (HACPO rows, Table 2a's variant): (reference mean log-prob, low, high)
    seq_ratio: tuple[float, float, float] | None = None


class NonFiniteLossError(RuntimeError):
    pass


T = TypeVar("T")


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


class GRPOModule(L.LightningModule):
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

    @property
    def hparams(self) -> AttributeDict:
        """The saved hyper-parameters (attribute access)."""
        return cast(AttributeDict, super().hparams)

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

    # ------------------------------------------------------------------ batch -> rows
    def rows_from_batch(self, batch: RolloutBatch) -> tuple[list[_Row], list[list[int]]]:
        """Training rows (one per trainable turn) and, per trajectory, its row indices."""
        rows: list[_Row] = []
        per_traj: list[list[int]] = []
        for seq, traj in enumerate(self.trajectories_for_update(batch)):
            idx = []
            for turn in traj.turns:
                if not turn.train or not turn.response_ids:
                    continue
                idx.append(len(rows))
                rows.append(
                    _Row(
                        ids=list(turn.prompt_ids) + list(turn.response_ids),
                        start=len(turn.prompt_ids) - 1,
                        old_logprobs=list(turn.logprobs),
                        advantage=traj.advantage if turn.advantage is None else turn.advantage,
                        weight=traj.weight,
                        seq=seq,
                        peer=traj.source != "self",
                        loss=_loss_kind(traj),
                        seq_ratio=_seq_ratio(traj.seq_ratio),
                    )
                )
            per_traj.append(idx)
        return rows, per_traj

    def trajectories_for_update(self, batch: RolloutBatch) -> list[Trajectory]:
        """The trajectories whose tokens enter the policy loss (subclasses extend)."""
        return batch.trajectories

    def collate(self, rows: list[_Row]) -> TokenBatch:
        ids, mask = pad_right([r.ids for r in rows], int(self.tokenizer.pad_token_id), self.device)
        shape = (len(rows), ids.shape[1] - 1)
        # fp32 whatever the default dtype (bf16-true sets bf16: +-1.3% ratio error)
        dev, f32 = self.device, torch.float32
        resp = torch.zeros(shape, device=dev, dtype=f32)
        old = torch.zeros(shape, device=dev, dtype=f32)
        adv = torch.zeros(shape, device=dev, dtype=f32)
        w = torch.zeros(shape, device=dev, dtype=f32)
        for i, r in enumerate(rows):
            n = len(r.old_logprobs)
            sl = slice(r.start, r.start + n)
            resp[i, sl] = 1.0
            old[i, sl] = torch.tensor(r.old_logprobs, device=dev, dtype=f32)
            adv[i, sl] = r.advantage
            w[i, sl] = r.weight
        seq = torch.tensor([r.seq for r in rows], device=self.device)
        return TokenBatch(ids, mask, resp, old, adv, w, seq)

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
        minibatches = self._minibatches(per_traj, batch) or [[]]
        minibatches += [[] for _ in range(lockstep(len(minibatches)) - len(minibatches))]
        t0 = time.perf_counter()
        tokens = 0
        for k, mb in enumerate(minibatches):
            last = k == len(minibatches) - 1
            # auxiliary objectives (VH-GPO) join the update once, in its last minibatch (ours)
            extra = aux.backward if last and n_aux and aux is not None else None
            ok = self._update_minibatch([rows[i] for i in mb], mb, ref_lp, batch.temperature, extra)
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
        return self._finish_update(opt, sched)

    def auxiliary(self, batch: RolloutBatch) -> Auxiliary | None:
        """This module's auxiliary objective on ``batch`` (None: it has none; subclasses add)."""
        return None

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

    def _minibatches(
        self, per_traj: list[list[int]], batch: RolloutBatch | None = None
    ) -> list[list[int]]:
        fixed = batch.minibatch_groups if batch is not None else None
        if batch is not None and fixed is not None:
            # the caller fixed the minibatches by groups (GRAFT's peer-last order)
            first, spans = 0, []
            for g in batch.groups:
                spans.append(range(first, first + len(g.trajectories)))
                first += len(g.trajectories)
            return [[r for gi in mb for t in spans[gi] for r in per_traj[t]] for mb in fixed]
        order = list(range(len(per_traj)))
        if self.hparams.shuffle_minibatches:
            gen = torch.Generator().manual_seed(permutation_seed(self.hparams.seed, self._step))
            order = torch.randperm(len(per_traj), generator=gen).tolist()
        order = [t for t in order if per_traj[t]]
        k = min(self.hparams.num_minibatches, len(order))
        chunks = [order[i * len(order) // k : (i + 1) * len(order) // k] for i in range(k)]
        return [[r for t in chunk for r in per_traj[t]] for chunk in chunks]

    def micro_order(self, rows: Sequence[_Row]) -> list[int]:
        """The order in which ``rows`` are cut into micro-batches: as given, or (with
        ``length_aware_micro_batches``) by length, rows sharing a prompt together when
        ``pack_prompts`` is on. Only the order of gradient accumulation changes."""
        if not self.hparams.length_aware_micro_batches:
            return list(range(len(rows)))
        lengths = [len(r.ids) for r in rows]
        if not self.hparams.pack_prompts:
            return micro_batch_order(lengths)
        keys = [prompt_key(r.ids, r.start) for r in rows]
        return micro_batch_order(lengths, keys, [r.start + 1 for r in rows])

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
        hp = self.hparams
        # normalisation weights over the whole minibatch, then split into micro-batches
        lengths = torch.tensor([len(r.old_logprobs) for r in rows], dtype=torch.float32)
        seq = torch.tensor([r.seq for r in rows], dtype=torch.long)
        per_row_w = []
        if rows:
            agg = aggregation_weights(_ragged_mask(lengths), seq, hp.loss_agg)
            per_row_w = [agg[i, : int(lengths[i])] for i in range(len(rows))]
        # Several ranks: normalise by the global count (token-mean over all ranks' tokens)
        _, n_world = world()
        scale = 1.0
        if n_world > 1:
            local = (
                aggregation_denominator(_ragged_mask(lengths), seq, hp.loss_agg) if rows else 0.0
            )
            scale = global_scale(local, all_reduce([local])[0], n_world)
        stats = {
            "policy": 0.0,
            "kl": 0.0,
            "clip": 0.0,
            "ratio": 0.0,
            "peer_clip": 0.0,
            "peer_w": 0.0,
        }

        def micro(_: int, idx: Sequence[int]) -> torch.Tensor:
            part = [rows[i] for i in idx]
            tb = self.collate(part)
            lp = self.row_logprobs(self.live_policy, part, tb, temperature)
            self._count_positions(part)
            # each row's tokens take its registered policy loss (clip, luffy, sequence, ...)
            seq = [r.seq_ratio or (0.0, 0.0, math.inf) for r in part]
            has_seq = any(r.seq_ratio is not None for r in part)
            inputs = LossInputs(
                logprobs=lp,
                old_logprobs=tb.old_logprobs,
                advantages=tb.advantages,
                mask=tb.response_mask,
                eps_low=hp.clip_eps_low,
                eps_high=hp.clip_eps_high,
                seq_ref=torch.tensor([x[0] for x in seq], device=lp.device) if has_seq else None,
                seq_low=torch.tensor([x[1] for x in seq], device=lp.device) if has_seq else None,
                seq_high=torch.tensor([x[2] for x in seq], device=lp.device) if has_seq else None,
            )
            loss_tok, clipped = row_policy_loss([r.loss for r in part], inputs)
            ratio = torch.exp(lp - tb.old_logprobs).detach()
            aw = torch.zeros_like(lp)
            for i, r in enumerate(part):
                aw[i, r.start : r.start + len(r.old_logprobs)] = per_row_w[idx[i]].to(self.device)
            aw = aw * tb.response_mask
            pol = (aw * tb.weights * loss_tok).sum()
            loss = pol
            if ref_lp is not None:
                ref = torch.zeros_like(lp)
                for i in range(len(part)):
                    rl = ref_lp[row_ids[idx[i]]]
                    ref[i, : rl.shape[0]] = rl[: ref.shape[1]]
                kl = (aw * kl_k3(lp, ref)).sum()
                loss = loss + hp.kl_coef * kl
                stats["kl"] += float(kl.detach())
            # (a non-finite loss stops the loop and drops these numbers with the minibatch)
            stats["policy"] += float(pol.detach())
            stats["clip"] += float((aw * clipped).sum().detach())
            if any(r.peer for r in part):
                pm = torch.tensor([float(r.peer) for r in part], device=aw.device)[:, None] * aw
                stats["peer_clip"] += float((pm * clipped).sum().detach())
                stats["peer_w"] += float(pm.sum().detach())
            stats["ratio"] += float((aw * ratio).sum().detach())
            return loss * scale if n_world > 1 else loss

        # micro-batches in length order (per-row weights above stay the minibatch's)
        finite = self.micro_steps(self.micro_order(rows), hp.micro_batch_size, micro)
        if finite and extra is not None:
            aux = extra()
            finite = aux is None or bool(torch.isfinite(aux))
        grad_norm = self._clip_and_norm()
        if not finite or not math.isfinite(grad_norm):
            self._opt.zero_grad(set_to_none=True)
            self._nonfinite_in_a_row += 1
            self.skipped_updates += 1
            self.step_metrics.update("train/skipped_updates", 1.0)
            log.warning(
                "step %d: non-finite %s; minibatch update skipped (%d in a row)",
                self._step,
                "loss" if not finite else "gradient",
                self._nonfinite_in_a_row,
            )
            if self._nonfinite_in_a_row >= hp.max_nonfinite_in_a_row:
                raise NonFiniteLossError(
                    f"{self._nonfinite_in_a_row} non-finite updates in a row "
                    f"(model.max_nonfinite_in_a_row={hp.max_nonfinite_in_a_row}); stopping. "
                    "Lower model.lr or check the rewards and the data."
                )
            return False
        self._nonfinite_in_a_row = 0
        n_tok = float(lengths.sum())
        self.step_metrics.update("train/grad_norm", grad_norm)
        if not rows:
            return True
        self.step_metrics.update("loss/policy", stats["policy"], n_tok)
        self.step_metrics.update("loss/clip_frac", stats["clip"], n_tok)
        if stats["peer_w"] > 0:
            self.step_metrics.update(
                "loss/peer_clip_frac", stats["peer_clip"] / stats["peer_w"], stats["peer_w"]
            )
        self.step_metrics.update("loss/ratio_mean", stats["ratio"], n_tok)
        if ref_lp is not None:
            self.step_metrics.update("loss/kl", stats["kl"], n_tok)
        self.step_metrics.update("loss/total", stats["policy"] + hp.kl_coef * stats["kl"], n_tok)
        return True

    def _count_positions(self, part: Sequence[_Row]) -> None:
        if self.hparams.pack_prompts:
            seqs, starts = [r.ids for r in part], [r.start for r in part]
            if has_shared_prompt(seqs, starts):
                layout = pack_rows(seqs, starts)
                self.forward_positions[0] += len(layout.input_ids) * layout.width
                self.forward_positions[1] += sum(len(s) for s in layout.input_ids)
                self.forward_positions[2] += sum(len(r.ids) - 1 - r.start for r in part)
                return
        self.forward_positions[0] += len(part) * max(len(r.ids) for r in part)
        self.forward_positions[1] += sum(len(r.ids) for r in part)
        self.forward_positions[2] += sum(len(r.ids) - 1 - r.start for r in part)

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
        values["train/lr"] = float(opt.param_groups[0]["lr"])
        return values

    # ------------------------------------------------------------------ step logging
    def step_values(self) -> dict[str, float]:
        """The metrics recorded so far in the current update (sent to the loggers at its end)."""
        return dict(self._step_log)

    def record(self, values: dict[str, float]) -> None:
        """Log metrics of the current update (module and callbacks alike).

        Values go to ``callback_metrics`` at once and to the loggers once per update, at
        step = update index, in ``on_train_batch_end``. (Lightning's own on-step logging
        re-sends a key's last value on later steps where it was not logged, which would
        make "no data this step" look like data.)
        """
        self._step_log.update({k: float(v) for k, v in values.items()})
        self.log_dict(values, on_step=True, on_epoch=False, logger=False)

    def record_later(self, values: dict[str, float]) -> None:
        """Buffer metrics for the loggers only (from hooks where ``self.log`` is not allowed)."""
        self._step_log.update({k: float(v) for k, v in values.items()})

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._step_log:
            for lg in self.loggers:
                lg.log_metrics(dict(self._step_log), step=self.global_step - 1)
            self._step_log = {}

    def log_rollout(self, batch: RolloutBatch) -> None:
        """``rollout/*``: this policy's own rollouts (before any exchange replaced groups)."""
        groups = batch.groups if batch.own_groups is None else batch.own_groups
        trajs = [t for g in groups for t in g.trajectories]
        m = self.step_metrics
        for t in trajs:
            m.update("rollout/reward_mean", t.reward)
            m.update("rollout/success_rate", float(t.success))
            m.update("rollout/response_len", float(t.num_response_tokens))
            m.update("rollout/turns", float(len(t.turns)))
            for turn in t.turns:
                m.update("rollout/invalid_turn_frac", float(not turn.valid))
                # responses cut off at engine.max_new_tokens (no EOS, no stop string)
                m.update("rollout/truncated_frac", float(turn.finish_reason == "length"))
        for g in groups:
            m.update("rollout/zero_signal_frac", float(g.zero_signal))
        st = batch.stats
        if st.time_generate is not None and st.time_generate > 0:
            m.update("perf/rollout_tokens_per_s", st.gen_tokens / st.time_generate)
        m.update("rollout/verifier_timeouts", st.verifier_timeouts)
        if st.env_errors is not None:
            m.update("env/errors", st.env_errors)

    # ------------------------------------------------------------------ eval
    def on_validation_epoch_start(self) -> None:
        # one record per evaluated problem: (repeat, benchmark, task id, successes, samples)
        self._eval_records: list[tuple[int, str, str, float, float]] = []

    on_test_epoch_start = on_validation_epoch_start

    def on_validation_epoch_end(self) -> None:
        self._log_aggregate("val")

    def on_test_epoch_end(self) -> None:
        self._log_aggregate("eval")

    def _log_aggregate(self, prefix: str) -> None:
        """``<prefix>/success`` (over all samples), ``<prefix>/success/<benchmark>`` (pass@1)
        and ``<prefix>/aggregate`` (their unweighted mean, SPEC §3.4) over the problems of all
        ranks, each problem once: every rank logs the same global numbers, so checkpoint
        selection and CheckpointCost see the whole evaluation, not one rank's share."""
        mine = getattr(self, "_eval_records", [])
        merged = merge_eval_records(gather_objects(mine))  # a collective: every rank
        if not merged:
            return
        succ, n = (sum(v[i] for v in merged.values()) for i in (0, 1))
        self.log(
            f"{prefix}/success", succ / max(n, 1.0), on_step=False, on_epoch=True, sync_dist=True
        )
        counts = {k: v for k, v in merged.items() if k[1]}  # groups with a benchmark (family)
        if not counts:
            return
        values = repeat_metrics(prefix, counts)
        if len({r for r, _ in counts}) == 1:  # one run: pass@1 per benchmark and the aggregate
            values = {k: v for k, v in values.items() if "/repeat_" not in k and "_std" not in k}
        for k, v in values.items():
            self.log(k, v, on_step=False, on_epoch=True, sync_dist=True)

    def validation_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        self._eval_step(batch, "eval")

    def _log_sampled(self, batch: RolloutBatch, prefix: str) -> None:
        for k, (v, n) in _sampled_metrics(batch, prefix).items():
            self.log(k, v, on_step=False, on_epoch=True, batch_size=n, sync_dist=True)

    def _eval_step(self, batch: RolloutBatch, prefix: str) -> None:
        """Success (pass@1 over samples) overall and per task family / benchmark."""
        trajs = batch.trajectories
        n = len(trajs)
        if not n:
            return
        lens = sum(t.num_response_tokens for t in trajs) / n
        self.log(
            f"{prefix}/response_len",
            lens,
            on_step=False,
            on_epoch=True,
            batch_size=n,
            sync_dist=True,
        )
        if batch.sampled is not None:
            self._log_sampled(batch.sampled, prefix)
        acc = getattr(self, "_eval_records", None)
        if acc is None:
            acc = self._eval_records = []
        for g in batch.groups:  # "": no benchmark (counted in <prefix>/success only)
            fam = g.task.get("family")
            if g.trajectories:
                acc.append(
                    (
                        int(g.task.get("repeat", 0)),
                        str(fam or ""),
                        str(g.task_id),
                        float(sum(t.success for t in g.trajectories)),
                        float(len(g.trajectories)),
                    )
                )


def _sampled_metrics(batch: RolloutBatch, prefix: str) -> dict[str, tuple[float, int]]:
    """Sampled evaluation episodes: ``<prefix>/sampled_success`` (the share of successful
    samples), ``<prefix>/sampled_pass_at_k`` (the share of tasks with a success among their
    k samples), and ``sampled_success/<family>``; each as (value, count it averages over)."""
    out: dict[str, tuple[float, int]] = {}
    trajs = batch.trajectories
    if not trajs:
        return out
    out[f"{prefix}/sampled_success"] = (sum(t.success for t in trajs) / len(trajs), len(trajs))
    groups = [g for g in batch.groups if g.trajectories]
    out[f"{prefix}/sampled_pass_at_k"] = (
        sum(any(t.success for t in g.trajectories) for g in groups) / len(groups),
        len(groups),
    )
    fams: dict[str, list[bool]] = {}
    for g in groups:
        fam = g.task.get("family")
        if fam:
            fams.setdefault(str(fam), []).extend(bool(t.success) for t in g.trajectories)
    for fam, hits in fams.items():
        out[f"{prefix}/sampled_success/{fam}"] = (sum(hits) / len(hits), len(hits))
    return out


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


def _loss_kind(traj: Trajectory) -> str:
    """A trajectory's registered policy loss: ``sequence`` for a row with a sequence-level
    ratio (HACPO rows, Table 2a's peer rows), else ``traj.loss`` (``clip`` or ``luffy``;
    ``hacpo`` only labels HACPO's rows)."""
    if traj.seq_ratio is not None:
        return "sequence"
    return "clip" if traj.loss == "hacpo" else traj.loss


def _seq_ratio(value: SeqRatio | None) -> tuple[float, float, float] | None:
    """A sequence ratio as (reference mean log-prob, low, high; no upper bound: inf)."""
    if value is None:
        return None
    return value.ref, value.low, math.inf if value.high is None else value.high


def _ragged_mask(lengths: torch.Tensor) -> torch.Tensor:
    width = int(lengths.max()) if lengths.numel() else 0
    return (torch.arange(width)[None, :] < lengths[:, None]).to(torch.float32)


def _check(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} {why}")
