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

The module's shell (the policies by name, their models and optimisers, step metrics, the
exchange records, per-model evaluation) is ``salvage.modules.cotrain``; the SGT baseline is
``salvage.modules.graft_sgt``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import fields
from typing import Any, cast

from salvage.core.exchange import (
    ExchangeRules,
    admission_metrics,
    exchange_metrics,
    moved_turns,
    peer_responses,
    receive_group,
    receiver_turns,
    transfer_rows,
)
from salvage.core.graft import (
    Transfers,
    plan_minibatches,
    random_admission,
    select_transfers,
    settings_error,
)
from salvage.core.seeds import GRAFT_EXCHANGE, step_seed
from salvage.distributed import FSDPConfig, gathered
from salvage.errors import ConfigError
from salvage.lm import DEFAULT_LOGPROB_CHUNK, response_logprobs
from salvage.models import PolicySpec
from salvage.modules.cotrain import NAMES, CoTrainModule
from salvage.modules.graft_sgt import sgt_auxiliary, sgt_step
from salvage.modules.grpo import Auxiliary, GRPOModule
from salvage.progress import stage
from salvage.types import Group, PairedBatch, RolloutBatch, Trajectory, Turn


class GRAFTModule(CoTrainModule):
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
        why = settings_error(
            balance=balance,
            order=order,
            delta=delta,
            rho=rho,
            selection=selection,
            peer_filter=peer_filter,
            peer_advantage=peer_advantage,
            admission=admission,
            peer_loss=peer_loss,
            peer_ratio=peer_ratio,
            mode=mode,
            hacpo_clip_low=hacpo_clip_low,
            hacpo_clip_high=hacpo_clip_high,
            hacpo_peer_high=hacpo_peer_high,
            restrict_to_selection=restrict_to_selection,
        )
        if why is not None:
            raise ConfigError(why)
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
        self._step_log = {}
        self._records = None

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
        rng = random.Random(step_seed(hp.seed, self.global_step, GRAFT_EXCHANGE))
        if hp.exchange and hp.mode == "sgt":
            return self._sgt_step(ra, rb, rng)
        tr, live_ab, live_ba = self._plan(ra, rb, rng)
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
        self.record(
            exchange_metrics(va, vb, tr, weights, live_ab, live_ba) | admission_metrics(rows)
        )
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

    def _plan(
        self, ra: RolloutBatch, rb: RolloutBatch, rng: random.Random
    ) -> tuple[Transfers, list[int] | None, list[int] | None]:
        """This step's transfers by ``mode`` and ``selection`` (none without ``exchange``)
        and, for HACPO restricted to GRAFT's selection, the prompts whose peer responses keep
        their advantage in each direction (None: all)."""
        hp = self.hparams
        n = max((len(g.trajectories) for g in ra.groups), default=0)
        k_a = [sum(g.successes) for g in ra.groups]
        k_b = [sum(g.successes) for g in rb.groups]
        if not hp.exchange:
            return Transfers([], [], 0, 0), None, None
        if hp.mode == "hacpo":  # every prompt, both directions
            every = list(range(len(ra.groups)))
            tr = Transfers(every, list(every), len(every), len(every))
            if not hp.restrict_to_selection:
                return tr, None, None
            # Appendix G: peer loss only on GRAFT's selection
            sel = select_transfers(k_a, k_b, n, rng, hp.balance, hp.rho)
            tr.m_ab, tr.m_ba = sel.m_ab, sel.m_ba
            return tr, sel.a_to_b, sel.b_to_a
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
        return tr, None, None

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
        """SGT baseline (``salvage.modules.graft_sgt``)."""
        sgt_step(self, ra, rb, rng)


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
    prompts, resp = [], []
    for t in peers:
        for turn in moved_turns(t, agents=encode is not None):
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
    return peers, receiver_turns(peers, prompts, resp, old, agents=encode is not None)


__all__ = ["NAMES", "GRAFTModule", "peer_turns", "sgt_auxiliary", "transplant"]
