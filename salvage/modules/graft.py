"""GRAFTModule: two policies co-train; all-failure groups receive the peer's whole group (SPEC §3).

Policies A and B have their own parameters, tokenizers, optimisers (and learning rates).
Each step both see the same prompts (``GraftDataModule``). Per direction A -> B, a prompt
is complementary when B solved none and A solved some but not all (``core.graft``);
after balancing, B's group on that prompt is replaced by A's full group:

- responses travel as text with A's generation log-probs and are re-tokenised by B;
- the advantages are A's, computed inside A's group, fixed;
- the weight is ``w = min(s, 1)`` if ``s > delta`` else 0 with
  ``s = exp(lbar_B - lbar_A)`` (``lbar_B``: B's pi_old mean token log-prob of its
  re-tokenisation, ``lbar_A``: the exchanged generation log-probs);
- B's loss on them is the clipped surrogate with B's own token ratio pi_B / pi_old_B,
  times w, token-mean over the minibatch; minibatches holding peer groups run last.

Each policy's update is ``GRPOModule.update`` (the exact GRPO path), with the groups'
minibatch assignment fixed by the exchange order. Metrics: ``a/...``, ``b/...`` (each
policy's rollout and loss metrics) and ``graft/...``; ``exchange.jsonl`` in the run
directory records every step's transfers and weights and, under ``responses``, one row per
transferred response (``core.exchange.transfer_rows``: direction, ``s``, ``lbar_src``,
``lbar_recv``, both token counts, reward, weight, ``admitted``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, cast

import lightning as L
import torch
from lightning.fabric.utilities.data import AttributeDict

from salvage.core.evaluation import repeat_metrics
from salvage.core.exchange import (
    ExchangeRules,
    peer_responses,
    receive_group,
    transfer_rows,
    weight_metrics,
)
from salvage.core.graft import (
    BALANCE,
    ORDERS,
    Transfers,
    plan_minibatches,
    random_admission,
    select_transfers,
    sgt_pick,
)
from salvage.core.losses import completion_loss
from salvage.core.seeds import GRAFT_EXCHANGE, step_seed
from salvage.distributed import (
    FSDPConfig,
    gather_objects,
    gathered,
    merge_eval_records,
    run_file,
    to_device,
)
from salvage.errors import ConfigError
from salvage.lm import (
    DEFAULT_LOGPROB_CHUNK,
    response_logprobs,
    target_scores,
)
from salvage.models import PolicySpec
from salvage.modules.grpo import Auxiliary, GRPOModule
from salvage.progress import stage
from salvage.types import Group, PairedBatch, RolloutBatch, SeqTarget, Trajectory, Turn

NAMES = tuple("abcdefghijklmnopqrstuvwxyz")
"""Model names in order: GRAFT's two are ``a`` and ``b``; further peers ``c``, ``d``, ..."""


class GRAFTModule(L.LightningModule):
    """Two-model co-training with trajectory exchange.

    Args:
        policy_a: model A (sizes and tokenizers of A and B may differ).
        policy_b: model B.
        lr: learning rate of A (and of B unless ``lr_b``).
        lr_b: learning rate of B (None: same as ``lr``).
        weight_decay: AdamW weight decay, both policies.
        num_minibatches: optimiser steps per rollout batch, both policies (GRAFT: 4).
        micro_batch_size: sequences per forward/backward, both policies.
        clip_eps_low: lower clip of the token ratio, both policies.
        clip_eps_high: upper clip of the token ratio, both policies.
        loss_agg: ``token-mean`` (GRAFT) or ``seq-mean-token-mean``.
        kl_coef: KL weight to each policy's frozen reference (0: no reference loaded).
        max_grad_norm: gradient clipping by global norm, per policy (0 disables).
        exchange: False turns GRAFT into two independent GRPO runs (baseline).
        balance: direction balancing: ``min_ratio`` (ours, SPEC 3.1) or ``none``.
        rho: ``min_ratio`` balancing: a direction transfers at most ``ceil(rho * max(m_other, 1))``.
        delta: compatibility gate threshold: a peer response counts only if ``s > delta`` (0.8).
        gate: apply the gate (False: every peer response weighs w = 1).
        floor: zero the weights under the gate (False: w = min(s, 1) for every response).
        order: ``peer-last`` (default), ``peer-first`` or ``uniform`` (the peer-last
            minibatches in an order shuffled every step) minibatch order.
        selection: ``complementary`` (GRAFT) or ``random`` (count-matched random prompts:
            as many prompts per direction as GRAFT would pick, drawn from all prompts).
        peer_filter: ``all`` (the peer's full group) or ``success`` (success-only peer responses).
        peer_advantage: ``source`` (the source's advantages, GRAFT) or ``pooled`` (the
            receiver's group and the peer's, advantages over the pool, eps 1e-6).
        admission: ``compat`` (compatibility weight) or ``random`` (random admission: as
            many responses as have ``s > delta``, drawn uniformly from the direction's
            transferred groups, each weighing ``min(s, 1)``, the rest 0).
        peer_loss: ``clip`` (the receiver's clipped token ratio, GRAFT) or ``luffy``
            (LUFFY-style: ``-f(p) A`` with ``f(p) = p / (p + 0.1)``, behaviour prob 1, no clip).
        peer_ratio: ``token`` (the receiver's token ratio, GRAFT) or ``sequence`` (Table 2a:
            one ratio per peer response, ``exp(mean logp_theta - mean logp_old)``, clipped
            to ``[1 - clip_eps_low, 1 + clip_eps_high]``).
        mode: ``graft`` (replace the group), ``sgt`` (SGT baseline: no replacement; an
            NLL term of weight ``sgt_weight`` on one uniformly chosen correct peer response
            for every prompt with k_receiver = 0 and k_source >= 1) or ``hacpo`` (HACPO
            baseline: on every prompt both models pool the peer's group with their own,
            capability-weighted group baseline, sequence-level ratios: own responses
            ``exp(mean logp_theta - mean logp_old)`` clipped to ``[1 - hacpo_clip_low,
            1 + hacpo_clip_high]``, peer responses ``exp(mean logp_theta - mean
            logp_source)`` with the lower bound ``hacpo_peer_low + hacpo_peer_ramp * step``,
            peer coefficient 1; ``configs/graft/ablations/hacpo.yaml`` sets KL 1e-3 and
            64-prompt minibatches).
        restrict_to_selection: HACPO / SGT restricted to GRAFT's selection (Appendix G):
            HACPO's peer responses keep their advantage only on the prompts GRAFT's
            complementary, balanced selection picks (0 elsewhere); SGT's NLL term only on
            those prompts. Off: the baselines' own prompt rules.
        sgt_weight: SGT baseline: weight of the NLL term on a correct peer response (0.1).
        hacpo_clip_low: HACPO: lower sequence-level clip delta of own responses (3e-4).
        hacpo_clip_high: HACPO: upper sequence-level clip delta of own responses (4e-4).
        hacpo_peer_low: HACPO: the peer-ratio lower bound at step 0 (0.8).
        hacpo_peer_ramp: HACPO: the lower bound's rise per step (0.025; not capped).
        hacpo_peer_high: an upper bound on HACPO's peer ratio (None: none, as the GRAFT
            paper ran HACPO; e.g. 1.0 to cap it, which also caps the rising lower bound).
        lr_schedule: ``constant``, ``linear`` or ``cosine`` decay after ``warmup_steps``, both
            policies (as GRPOModule).
        warmup_steps: RL updates of linear learning-rate warm-up from 0, both policies.
        min_lr_ratio: the decayed learning rate's floor, as a fraction of each policy's lr.
        seed: seed of the balancing and ordering streams.
        fsdp: FSDP2 sharding of both policies on the strategy's one mesh (as GRPOModule).
        logprob_chunk_size: positions per LM-head chunk when scoring tokens (as GRPOModule;
            0: the full logits at once).
        pack_prompts: both policies score rows that share a prompt (a group's samples, a
            peer group) in one packed sequence, each prompt once (as GRPOModule).
        length_aware_micro_batches: both policies cut micro-batches from rows ordered by
            length (as GRPOModule).
    """

    def __init__(
        self,
        policy_a: PolicySpec | None = None,
        policy_b: PolicySpec | None = None,
        lr: float = 1e-6,
        lr_b: float | None = None,
        weight_decay: float = 0.0,
        num_minibatches: int = 4,
        micro_batch_size: int = 8,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.28,
        loss_agg: str = "token-mean",
        kl_coef: float = 0.0,
        max_grad_norm: float = 1.0,
        exchange: bool = True,
        balance: str = "min_ratio",
        rho: float = 1.0,
        delta: float = 0.8,
        gate: bool = True,
        floor: bool = True,
        order: str = "peer-last",
        selection: str = "complementary",
        peer_filter: str = "all",
        peer_advantage: str = "source",
        admission: str = "compat",
        peer_loss: str = "clip",
        peer_ratio: str = "token",
        mode: str = "graft",
        sgt_weight: float = 0.1,
        restrict_to_selection: bool = False,
        hacpo_clip_low: float = 3e-4,
        hacpo_clip_high: float = 4e-4,
        hacpo_peer_low: float = 0.8,
        hacpo_peer_ramp: float = 0.025,
        hacpo_peer_high: float | None = None,
        lr_schedule: str = "constant",
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.0,
        seed: int = 0,
        fsdp: FSDPConfig | None = None,
        logprob_chunk_size: int = DEFAULT_LOGPROB_CHUNK,
        pack_prompts: bool = True,
        length_aware_micro_batches: bool = True,
    ) -> None:
        super().__init__()
        if balance not in BALANCE:
            raise ConfigError(f"model.balance must be one of {BALANCE}, got {balance!r}")
        if order not in ORDERS:
            raise ConfigError(f"model.order must be one of {ORDERS}, got {order!r}")
        if not 0 < delta <= 1:
            raise ConfigError(f"model.delta={delta!r} must be in (0, 1]")
        if rho <= 0:
            raise ConfigError(f"model.rho={rho!r} must be > 0")
        for key, val, allowed in (
            ("selection", selection, ("complementary", "random")),
            ("peer_filter", peer_filter, ("all", "success")),
            ("peer_advantage", peer_advantage, ("source", "pooled")),
            ("admission", admission, ("compat", "random")),
            ("peer_loss", peer_loss, ("clip", "luffy")),
            ("peer_ratio", peer_ratio, ("token", "sequence")),
            ("mode", mode, ("graft", "sgt", "hacpo")),
        ):
            if val not in allowed:
                raise ConfigError(f"model.{key} must be one of {allowed}, got {val!r}")
        for key, bound in (
            ("hacpo_clip_low", hacpo_clip_low),
            ("hacpo_clip_high", hacpo_clip_high),
        ):
            if not 0 <= bound < 1:
                raise ConfigError(f"model.{key}={bound!r} must be in [0, 1)")
        if hacpo_peer_high is not None and hacpo_peer_high <= 0:
            raise ConfigError(f"model.hacpo_peer_high={hacpo_peer_high!r} must be > 0 (or null)")
        if restrict_to_selection and mode == "graft":
            raise ConfigError(
                "model.restrict_to_selection applies to mode 'hacpo' or 'sgt' (GRAFT selects anyway)"
            )
        self.automatic_optimization = False
        self._common: dict[str, Any] = dict(
            weight_decay=weight_decay,
            num_minibatches=num_minibatches,
            micro_batch_size=micro_batch_size,
            clip_eps_low=clip_eps_low,
            clip_eps_high=clip_eps_high,
            loss_agg=loss_agg,
            kl_coef=kl_coef,
            max_grad_norm=max_grad_norm,
            shuffle_minibatches=False,
            logprob_chunk_size=logprob_chunk_size,
            lr_schedule=lr_schedule,
            warmup_steps=warmup_steps,
            min_lr_ratio=min_lr_ratio,
            seed=seed,
            fsdp=fsdp,
            pack_prompts=pack_prompts,
            length_aware_micro_batches=length_aware_micro_batches,
        )
        self.a = GRPOModule(policy=policy_a or PolicySpec("tiny"), lr=lr, **self._common)
        self.b = GRPOModule(
            policy=policy_b or PolicySpec("tiny", vocab_size=384, seed=1),
            lr=lr_b or lr,
            **self._common,
        )
        self.save_hyperparameters(ignore=["policy_a", "policy_b", "fsdp"])
        self.hparams["fsdp"] = self.a.hparams["fsdp"]
        self.hparams["policy_a"] = self.a.hparams["policy"]
        self.hparams["policy_b"] = self.b.hparams["policy"]
        self._step_log: dict[str, float] = {}
        self._records: Path | None = None

    @property
    def hparams(self) -> AttributeDict:
        """The saved hyper-parameters (attribute access)."""
        return cast(AttributeDict, super().hparams)

    @property
    def names(self) -> tuple[str, ...]:
        """The models' names, in model order."""
        return NAMES[:2]

    def learner(self, name: str) -> GRPOModule:
        """The model ``name`` (one of ``names``)."""
        if name not in self.names:
            raise KeyError(f"no model {name!r} in this module (models: {', '.join(self.names)})")
        return cast(GRPOModule, getattr(self, name))

    def learners(self) -> list[GRPOModule]:
        """Every model, in order."""
        return [self.learner(n) for n in self.names]

    @property
    def tokenizer(self) -> Any:  # the datamodule's default (A's); GRAFT passes each explicitly
        return self.a.tokenizer

    @property
    def policy(self) -> torch.nn.Module | None:
        return self.a.policy

    def configure_model(self) -> None:
        mesh = self.a.mesh_of(self.device_mesh)
        for child in self.learners():  # every policy sharded on the strategy's one mesh
            child.build(mesh)

    def inference_models(self) -> list[torch.nn.Module]:
        return [m for lr in self.learners() for m in lr.inference_models()]

    def sampling_models(self) -> list[torch.nn.Module]:
        return [m for lr in self.learners() for m in lr.sampling_models()]

    def configure_optimizers(self) -> Any:
        return [lr.configure_optimizers() for lr in self.learners()]

    def on_fit_start(self) -> None:
        self._records = run_file(
            self.trainer, "exchange"
        )  # on every rank (log_dir is a collective)
        for lr in self.learners():
            lr.total_steps_hint = self.trainer.max_steps if self.trainer.max_steps > 0 else None
            if lr.ref_model is not None:  # an offloaded reference keeps its shards on the CPU
                to_device(lr.ref_model, self.device)

    # ------------------------------------------------------------------ exchange
    def receive(
        self,
        src: RolloutBatch,
        dst: RolloutBatch,
        prompts: list[int],
        receiver: GRPOModule,
        rng: random.Random | None = None,
        bar: Any = None,
        live: list[int] | None = None,
        scored: dict[int, tuple[list[Trajectory], list[list[Turn]]]] | None = None,
    ) -> list[float]:
        """Replace ``dst``'s groups on ``prompts`` by ``src``'s, re-tokenised and weighted.

        ``live`` (HACPO restricted to GRAFT's selection): the prompts whose peer responses
        keep their advantage; None: all of ``prompts``. ``scored``: ``peer_turns`` results
        already computed for some prompts (by the same receiver, since its last update).
        """
        return transplant(
            src,
            dst,
            prompts,
            receiver,
            self.rules,
            rng or random.Random(self.hparams.seed),
            bar,
            step=self.global_step,
            live=live,
            encode=self.encoder(receiver),
            scored=scored,
        )

    def encoder(self, receiver: GRPOModule) -> Callable[[str], list[int]] | None:
        """Agent runs: the receiver's prompt encoder, from the datamodule (None: single-turn
        tasks, where a peer response goes on the receiver's own prompt of the task)."""
        dm = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        make = getattr(dm, "encoder", None)
        if make is None:
            return None
        name = next(n for n in self.names if self.learner(n) is receiver)
        return cast(Callable[[str], list[int]], make(name))

    @property
    def rules(self) -> ExchangeRules:
        """The exchange settings among this module's arguments."""
        return ExchangeRules(**{f.name: self.hparams[f.name] for f in fields(ExchangeRules)})

    def _order(self, batch: RolloutBatch, rng: random.Random) -> None:
        is_peer = [g.peer for g in batch.groups]
        batch.minibatch_groups = plan_minibatches(
            is_peer, self.hparams.order, self.hparams.num_minibatches, rng
        )

    def training_step(self, batch: PairedBatch, batch_idx: int) -> None:
        hp = self.hparams
        ra, rb = batch.a, batch.b
        n = max((len(g.trajectories) for g in ra.groups), default=0)
        rng = random.Random(step_seed(hp.seed, self.global_step, GRAFT_EXCHANGE))
        if hp.exchange and hp.mode == "sgt":
            return self._sgt_step(ra, rb, rng)
        k_a = [sum(g.successes) for g in ra.groups]
        k_b = [sum(g.successes) for g in rb.groups]
        live_ab: list[int] | None = None
        live_ba: list[int] | None = None
        if hp.exchange and hp.mode == "hacpo":  # every prompt, both directions
            every = list(range(len(ra.groups)))
            tr = Transfers(every, list(every), len(every), len(every))
            if hp.restrict_to_selection:  # Appendix G: peer loss only on GRAFT's selection
                sel = select_transfers(k_a, k_b, n, rng, hp.balance, hp.rho)
                live_ab, live_ba = sel.a_to_b, sel.b_to_a
                tr.m_ab, tr.m_ba = sel.m_ab, sel.m_ba
        elif hp.exchange:
            tr = select_transfers(k_a, k_b, n, rng, hp.balance, hp.rho)
            if hp.selection == "random":  # count-matched random prompts
                q = list(range(len(k_a)))
                tr = Transfers(
                    sorted(rng.sample(q, len(tr.a_to_b))),
                    sorted(rng.sample(q, len(tr.b_to_a))),
                    tr.m_ab,
                    tr.m_ba,
                )
                overlap = set(tr.a_to_b) & set(tr.b_to_a)
                tr.b_to_a = [x for x in tr.b_to_a if x not in overlap]  # a prompt goes one way only
        else:
            tr = Transfers([], [], 0, 0)
        # B receives from A and A from B, each from the other's own (pre-exchange) groups
        own_a = RolloutBatch(groups=list(ra.groups), temperature=ra.temperature)
        own_b = RolloutBatch(groups=list(rb.groups), temperature=rb.temperature)
        # receiver likelihoods: local forwards under FSDP, each receiver gathered only while
        # it scores (one full model at a time; every rank enters both, in this order)
        total = len(tr.a_to_b) + len(tr.b_to_a)
        with stage("GRAFT exchange", total=total, unit="group") as bar:
            with gathered(self.b.policy):
                w_b = self.receive(own_a, rb, tr.a_to_b, self.b, rng, bar, live_ab)
            with gathered(self.a.policy):
                w_a = self.receive(own_b, ra, tr.b_to_a, self.a, rng, bar, live_ba)
        step = self.global_step
        rows = transfer_rows(rb.groups, tr.a_to_b, "a", "b", step)
        rows += transfer_rows(ra.groups, tr.b_to_a, "b", "a", step)
        self._order(ra, rng)
        self._order(rb, rng)
        va, vb = self._update_both(ra, rb)
        weights = w_a + w_b
        values = {f"a/{k}": v for k, v in va.items()} | {f"b/{k}": v for k, v in vb.items()}
        values.update(
            {
                "graft/transferred_a_to_b": float(len(tr.a_to_b)),
                "graft/transferred_b_to_a": float(len(tr.b_to_a)),
                "graft/complementary_a_to_b": float(tr.m_ab),
                "graft/complementary_b_to_a": float(tr.m_ba),
            }
            | weight_metrics(weights)
        )
        if live_ab is not None and live_ba is not None:
            values["graft/selected_a_to_b"] = float(len(live_ab))
            values["graft/selected_b_to_a"] = float(len(live_ba))
        peer = [v[k] for v in (va, vb) for k in ("loss/peer_clip_frac",) if k in v]
        if peer:
            values["graft/peer_clip_frac"] = sum(peer) / len(peer)
        self._step_log.update(values)
        self.log_dict(values, on_step=True, on_epoch=False, logger=False)
        self._write(
            {
                "step": self.global_step - 1,
                "a_to_b": tr.a_to_b,
                "b_to_a": tr.b_to_a,
                "m_ab": tr.m_ab,
                "m_ba": tr.m_ba,
                "weights": weights,
                "delta": hp.delta,
                "gate": hp.gate,
                "responses": rows,
            }
        )

    def _update_both(
        self,
        ra: RolloutBatch,
        rb: RolloutBatch,
        aux: dict[str, Auxiliary] | None = None,
    ) -> tuple[dict[str, float], dict[str, float]]:
        opt_a, opt_b = cast(list[Any], self.optimizers())
        sch_a, sch_b = cast(list[Any], self.lr_schedulers())
        aux = aux or {}
        va = self.a.update(ra, opt_a, sch_a, self.global_step, False, aux.get("a"))
        vb = self.b.update(rb, opt_b, sch_b, self.global_step, True, aux.get("b"))
        return va, vb

    def _sgt_step(self, ra: RolloutBatch, rb: RolloutBatch, rng: random.Random) -> None:
        """SGT baseline: own groups untouched; NLL on one correct peer response per unsolved prompt.

        ``restrict_to_selection``: only on the prompts of GRAFT's complementary, balanced
        selection (Appendix G).
        """
        hp = self.hparams
        allowed: dict[str, set[int] | None] = {"a_to_b": None, "b_to_a": None}
        if hp.restrict_to_selection:
            n = max((len(g.trajectories) for g in ra.groups), default=0)
            sel = select_transfers(
                [sum(g.successes) for g in ra.groups],
                [sum(g.successes) for g in rb.groups],
                n,
                rng,
                hp.balance,
                hp.rho,
            )
            allowed = {"a_to_b": set(sel.a_to_b), "b_to_a": set(sel.b_to_a)}
        counts = {}
        aux: dict[str, Auxiliary] = {}
        for src, dst, recv, name in ((ra, rb, self.b, "a_to_b"), (rb, ra, self.a, "b_to_a")):
            targets = []
            for q, (sg, dg) in enumerate(zip(src.groups, dst.groups, strict=True)):
                only = allowed[name]
                if only is not None and q not in only:
                    continue
                pick = sgt_pick(sg.successes, sum(dg.successes), rng)
                if pick is None:
                    continue
                text = sg.trajectories[pick].turns[0].response_text
                ids = list(recv.tokenizer(text, add_special_tokens=False)["input_ids"])
                if recv.tokenizer.eos_token_id is not None:
                    ids.append(int(recv.tokenizer.eos_token_id))
                targets.append(SeqTarget(list(dg.trajectories[0].turns[0].prompt_ids), ids))
            aux[name[-1]] = sgt_auxiliary(recv, targets, hp.sgt_weight)
            counts[name] = len(targets)
        va, vb = self._update_both(ra, rb, aux)
        values = {f"a/{k}": v for k, v in va.items()} | {f"b/{k}": v for k, v in vb.items()}
        values.update(
            {
                "graft/transferred_a_to_b": float(counts["a_to_b"]),
                "graft/transferred_b_to_a": float(counts["b_to_a"]),
            }
        )
        self._step_log.update(values)
        self.log_dict(values, on_step=True, on_epoch=False, logger=False)

    def step_values(self) -> dict[str, float]:
        """The metrics recorded so far in the current update (sent to the loggers at its end)."""
        return dict(self._step_log)

    def record(self, values: dict[str, float]) -> None:
        """Callbacks' step metrics (cost, ...) go out with the module's, once per update."""
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

    def _write(self, rec: dict[str, Any]) -> None:
        if self._records is None:
            self._records = run_file(self.trainer, "exchange")
        with self._records.open("a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")

    # ------------------------------------------------------------------ eval
    def on_validation_epoch_start(self) -> None:
        # per model, one record per evaluated problem: (repeat, benchmark, task, successes, samples)
        self._eval_acc: dict[str, list[tuple[int, str, str, float, float]]] = {
            n: [] for n in self.names
        }

    on_test_epoch_start = on_validation_epoch_start

    def validation_step(self, batch: PairedBatch, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: PairedBatch, batch_idx: int) -> None:
        self._eval_step(batch, "eval")

    def _eval_step(self, batch: PairedBatch, prefix: str) -> None:
        for name, part in batch.parts().items():
            recs = self._eval_acc[name]
            for g in part.groups:
                recs.append(
                    (
                        int(g.task.get("repeat", 0)),
                        str(g.task.get("family", "all")),
                        str(g.task_id),
                        float(sum(t.success for t in g.trajectories)),
                        float(len(g.trajectories)),
                    )
                )

    def _eval_end(self, prefix: str) -> None:
        """Per model, pass@1 per benchmark and the aggregate over the problems of all ranks
        (every rank logs the same global numbers: checkpoint selection and CheckpointCost
        see the whole evaluation, not one rank's share)."""
        for name in self.names:
            mine = getattr(self, "_eval_acc", {}).get(name, [])
            acc = merge_eval_records(gather_objects(mine))  # a collective: every rank
            if not acc:
                continue
            values = repeat_metrics(f"{name}/{prefix}", acc)
            if len({r for r, _ in acc}) == 1:  # one run: pass@1 per benchmark and the aggregate
                values = {
                    k: v for k, v in values.items() if "/repeat_" not in k and "_std" not in k
                }
            for k, v in values.items():
                self.log(k, v, on_epoch=True, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        self._eval_end("val")

    def on_test_epoch_end(self) -> None:
        self._eval_end("eval")


def sgt_auxiliary(learner: GRPOModule, targets: list[SeqTarget], weight: float) -> Auxiliary:
    """SGT's term on one learner: ``weight * mean over targets of -s(y|h)`` (the NLL of one
    correct peer response per prompt the learner did not solve), in its update's last
    minibatch. Metric ``loss/nll``."""

    def backward() -> torch.Tensor | None:
        denom = learner.global_count(len(targets))
        if not denom:
            return None
        total = 0.0
        pad = int(learner.tokenizer.pad_token_id)

        def nll(_: int, part: Sequence[SeqTarget]) -> torch.Tensor:
            nonlocal total
            scores = target_scores(
                learner.live_policy, part, pad, learner.device, packed=learner.hparams.pack_prompts
            )
            loss = completion_loss(scores).sum() / denom
            total += float(loss.detach())
            return weight * loss

        if not learner.micro_steps(targets, learner.hparams.micro_batch_size, nll):
            return torch.tensor(float("nan"))
        learner.step_metrics.update("loss/nll", total)
        return torch.tensor(weight * total)

    return Auxiliary(present=bool(targets), backward=backward)


def transplant(
    src: RolloutBatch,
    dst: RolloutBatch,
    prompts: list[int],
    receiver: GRPOModule,
    rules: ExchangeRules,
    rng: random.Random,
    bar: Any = None,
    *,
    step: int = 0,
    live: list[int] | None = None,
    encode: Callable[[str], list[int]] | None = None,
    scored: dict[int, tuple[list[Trajectory], list[list[Turn]]]] | None = None,
) -> list[float]:
    """Replace ``dst``'s groups on ``prompts`` by ``src``'s, re-tokenised and weighted (SPEC §3.2).

    The shell of the exchange: the receiver's tokenizer re-tokenises each peer response and
    its policy scores it (pi_old log-probs); ``core.exchange.receive_group`` does the rest.
    ``step``: the update index (HACPO's rising peer bound); ``live``: HACPO restricted to
    GRAFT's selection, the prompts whose peer responses keep their advantage (None: all);
    ``encode``: agents, the receiver's prompt encoder (``peer_turns``); ``scored``: prompts
    whose ``peer_turns`` result the caller already has (N peers score a candidate source to
    choose it). Shared by GRAFTModule and the stored-mode receiver (``StoredPeer``). Returns
    the peer responses' weights.
    """
    peer_trajs: list[Trajectory] = []
    # the receiver's own groups, for its rollout metrics (what it sampled, not what it trains on)
    if dst.own_groups is None:
        dst.own_groups = list(dst.groups)
    # HACPO: each model's capability = its success rate on this batch (before any exchange)
    cap_src = sum(t.success for t in src.trajectories) / max(1, len(src.trajectories))
    cap_recv = sum(t.success for t in dst.trajectories) / max(1, len(dst.trajectories))
    for q in prompts:
        sg, dg = src.groups[q], dst.groups[q]
        if scored is not None and q in scored:
            peers, turns = scored[q]
        else:
            peers, turns = peer_turns(sg, dg, receiver, rules, dst.temperature, encode)
        if not peers:
            continue
        group = receive_group(
            dg,
            peers,
            turns,
            rules,
            step=step,
            live=live is None or q in live,
            capability=(cap_recv, cap_src),
        )
        dst.groups[q] = group
        peer_trajs.extend(t for t in group.trajectories if t.source == "peer")
        if bar is not None:
            bar.advance(1)
    if rules.admission == "random" and not rules.hacpo:  # as many as pass the gate, at random
        scores = [t.compat if t.compat is not None else 0.0 for t in peer_trajs]
        for t, w in zip(peer_trajs, random_admission(scores, rules.delta, rng), strict=True):
            t.weight = w
    return [t.weight for t in peer_trajs]


def peer_turns(
    source: Group,
    own: Group,
    receiver: GRPOModule,
    rules: ExchangeRules,
    temperature: float,
    encode: Callable[[str], list[int]] | None = None,
) -> tuple[list[Trajectory], list[list[Turn]]]:
    """The source's travelling responses on one prompt and, for each, its turns as the
    receiver sees them: the receiver's prompt, the response re-tokenised by the receiver's
    tokenizer (EOS appended when the response ended rather than being truncated) and its
    pi_old log-probs at ``temperature``.

    Single-turn tasks (``encode`` None): one turn on the receiver's own prompt of the task.
    Agents: every trainable turn of the peer's episode, its prompt text (the task, the
    recorded observations and actions) re-rendered by ``encode``, the receiver's prompt
    encoder (chat template and tokenizer).
    """
    peers = peer_responses(source, rules)
    if not peers:
        return [], []
    tok = receiver.tokenizer
    own_prompt = list(own.trajectories[0].turns[0].prompt_ids)  # the receiver's own format
    prompts, resp, shape = [], [], []
    for t in peers:
        turns = [x for x in t.turns if x.train] if encode is not None else t.turns[:1]
        shape.append(len(turns))
        for turn in turns:
            ids = list(tok(turn.response_text, add_special_tokens=False)["input_ids"])
            if turn.finish_reason == "stop" and tok.eos_token_id is not None:  # ended
                ids.append(int(tok.eos_token_id))
            resp.append(ids or [int(tok.eos_token_id)])
            prompts.append(encode(turn.prompt_text) if encode is not None else own_prompt)
    # responses to one prompt: packed (each prompt computed once) under pack_prompts
    old = response_logprobs(
        receiver.live_policy,
        prompts,
        resp,
        int(tok.pad_token_id),
        temperature=temperature,
        batch_size=receiver.hparams.micro_batch_size,
        packed=receiver.hparams.pack_prompts,
    )
    out: list[list[Turn]] = []
    k = 0
    for t, n in zip(peers, shape, strict=True):
        src = [x for x in t.turns if x.train] if encode is not None else t.turns[:1]
        out.append(
            [
                replace(
                    turn,
                    prompt_ids=prompts[k + i],
                    response_ids=resp[k + i],
                    logprobs=old[k + i],
                    train=True,
                )
                if encode is not None
                else Turn(
                    prompt_ids=prompts[k + i],
                    response_ids=resp[k + i],
                    logprobs=old[k + i],
                    response_text=turn.response_text,
                )
                for i, turn in enumerate(src)
            ]
        )
        k += n
    return peers, out
