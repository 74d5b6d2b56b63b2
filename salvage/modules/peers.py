"""PeerGroupModule: GRAFT's trajectory exchange among N >= 2 co-trained models (docs/peers.md).

GRAFT (SPEC §3) pairs two models; its paper names more peers as future work. Here N
models (``a``, ``b``, ``c``, ... each with its own tokenizer, optimiser and engine) see
the same prompts. For a receiver's all-failure prompt, the source is chosen among all
peers with a complementary group (``core.peers.choose_sources``, ``source_rule``), the
directions of every pair of models are balanced as GRAFT balances its two
(``core.peers.balance_pairs``), and the chosen group is received exactly as in GRAFT
(``transplant``: re-tokenised, scored by the receiver, compatibility-weighted). Each
model's update is ``GRPOModule.update`` with GRAFT's minibatch order.

With two models the transfers, weights, random draws and updates equal ``GRAFTModule``'s
(tested). Metrics: ``<name>/...`` per model; per ordered pair
``graft/transferred/<src>_to_<dst>`` and ``graft/complementary/<src>_to_<dst>``
(proposals before balancing); ``graft/transferred`` (all pairs), ``graft/weight_mean`` and
``graft/admitted_frac``. ``exchange.jsonl`` records every step's transfers per pair and,
under ``responses``, one row per transferred response (as GRAFTModule's).
"""

from __future__ import annotations

import random
from typing import Any, cast

from salvage.core.exchange import (
    admission_metrics,
    episode_logprobs,
    transfer_rows,
    weight_metrics,
)
from salvage.core.graft import compatibility, mean_logprob
from salvage.core.peers import (
    SOURCE_RULES,
    Pair,
    balance_pairs,
    candidates,
    capped_mean_compat,
    choose_sources,
    pair_order,
)
from salvage.core.seeds import GRAFT_EXCHANGE, step_seed
from salvage.distributed import gathered
from salvage.errors import ConfigError
from salvage.models import PolicySpec
from salvage.modules.graft import NAMES, GRAFTModule, peer_turns
from salvage.modules.grpo import GRPOModule
from salvage.progress import stage
from salvage.types import PairedBatch, RolloutBatch, Trajectory, Turn

Scored = tuple[list[Trajectory], list[list[Turn]]]  # peer_turns' result for one prompt
Sends = dict[Pair, list[int]]  # prompts per (source, receiver) pair

_TWO_MODEL_ONLY = {"mode": "graft", "selection": "complementary", "restrict_to_selection": False}
"""GRAFTModule arguments whose other values are two-model baselines (SGT, HACPO, count-matched
random selection): refused here."""


def default_peers() -> list[PolicySpec]:
    """Three ``tiny`` models with three different tokenizers (the CPU default)."""
    return [
        PolicySpec("tiny", vocab_size=768, seed=0),
        PolicySpec("tiny", vocab_size=384, seed=1),
        PolicySpec("tiny", vocab_size=512, seed=2),
    ]


class PeerGroupModule(GRAFTModule):
    """GRAFT among N >= 2 models (docs/peers.md).

    Args:
        policies: the models in order, named a, b, c, ... (at least 2; sizes and
            tokenizers may differ; None: three ``tiny`` models of different vocabularies).
        lrs: per-model learning rates, one per policy (None: ``lr`` for every model).
        source_rule: the source of a receiver's all-failure prompt when several peers
            qualify: ``compat`` (most compatible responses, then most successes, then
            order), ``successes`` (most successes, then order) or ``random``.
        lr: the learning rate of every model unless ``lrs`` is given.
        **kwargs: GRAFTModule's exchange and optimisation arguments (``lr``, ``delta``,
            ``gate``, ``balance``, ``rho``, ``order``, ...); its two-model baselines
            (``mode`` sgt / hacpo, ``selection`` random, ``restrict_to_selection``) are refused.
    """

    def __init__(
        self,
        policies: list[PolicySpec] | None = None,
        lrs: list[float] | None = None,
        source_rule: str = "compat",
        lr: float = 1e-6,
        **kwargs: Any,
    ) -> None:
        specs = list(policies) if policies is not None else default_peers()
        if not 2 <= len(specs) <= len(NAMES):
            raise ConfigError(
                f"model.policies must list 2 to {len(NAMES)} models, got {len(specs)}"
            )
        if source_rule not in SOURCE_RULES:
            raise ConfigError(
                f"model.source_rule must be one of {SOURCE_RULES}, got {source_rule!r}"
            )
        for key in ("policy_a", "policy_b", "lr_b"):
            if key in kwargs:
                raise ConfigError(
                    f"model.{key}: PeerGroupModule takes model.policies (and model.lrs) instead"
                )
        for key, allowed in _TWO_MODEL_ONLY.items():
            if key in kwargs and kwargs[key] != allowed:
                raise ConfigError(
                    f"model.{key}={kwargs[key]!r} is a two-model baseline of GRAFTModule; "
                    f"PeerGroupModule supports {key}={allowed!r} only"
                )
        rates = list(lrs) if lrs is not None else [lr] * len(specs)
        if len(rates) != len(specs):
            raise ConfigError(
                f"model.lrs has {len(rates)} learning rates for {len(specs)} policies"
            )
        super().__init__(policy_a=specs[0], policy_b=specs[1], lr=rates[0], lr_b=rates[1], **kwargs)
        self._names = NAMES[: len(specs)]
        for name, spec, rate in zip(self._names[2:], specs[2:], rates[2:], strict=True):
            setattr(self, name, GRPOModule(policy=spec, lr=rate, **self._common))
        for key in ("policy_a", "policy_b", "lr_b"):
            self.hparams.pop(key, None)
        self.hparams["policies"] = [lr.hparams["policy"] for lr in self.learners()]
        self.hparams["lrs"] = rates
        self.hparams["lr"] = rates[0]

    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    # ------------------------------------------------------------------ exchange
    def _compat(
        self, src: RolloutBatch, dst: RolloutBatch, q: int, receiver: GRPOModule
    ) -> tuple[float, Scored]:
        """The source-choice score of ``src``'s group on prompt ``q`` for ``receiver``, and the
        scored peer turns it came from (reused by the exchange if this source is chosen)."""
        peers, turns = peer_turns(
            src.groups[q],
            dst.groups[q],
            receiver,
            self.rules,
            dst.temperature,
            self.encoder(receiver),
        )
        score = capped_mean_compat(
            [
                compatibility(
                    mean_logprob(episode_logprobs(ep)), mean_logprob(episode_logprobs(t.turns))
                )
                for t, ep in zip(peers, turns, strict=True)
            ]
        )
        return score, (peers, turns)

    def training_step(self, batch: PairedBatch, batch_idx: int) -> None:
        hp = self.hparams
        parts = batch.parts()
        if tuple(parts) != self.names:
            raise ValueError(
                f"the batch holds models {tuple(parts)}, the module {self.names}: use "
                "GraftDataModule (it rolls out every model of the module)"
            )
        batches = [parts[n] for n in self.names]
        rng = random.Random(step_seed(hp.seed, self.global_step, GRAFT_EXCHANGE))
        # every model receives from the others' own (pre-exchange) groups
        own = [RolloutBatch(groups=list(b.groups), temperature=b.temperature) for b in batches]
        pairs = pair_order(len(batches))
        proposed, sends, scored = self._choose_transfers(own, pairs, rng)
        total = sum(len(v) for v in sends.values())
        weights = self._receive_all(own, batches, pairs, sends, scored, rng, total)
        step = self.global_step
        rows = [
            row
            for s, r in pairs
            for row in transfer_rows(
                batches[r].groups, sends[(s, r)], self.names[s], self.names[r], step
            )
        ]
        for b in batches:
            self._order(b, rng)
        per_model = self._update_all(batches)
        values = self._peer_metrics(per_model, pairs, sends, proposed, total, weights)
        values.update(admission_metrics(rows))
        self._step_log.update(values)
        self.log_dict(values, on_step=True, on_epoch=False, logger=False)
        self._write(
            {
                "step": self.global_step - 1,
                "transfers": {
                    f"{self.names[s]}_to_{self.names[r]}": sends[(s, r)] for s, r in pairs
                },
                "complementary": {
                    f"{self.names[s]}_to_{self.names[r]}": len(proposed[(s, r)]) for s, r in pairs
                },
                "weights": weights,
                "delta": hp.delta,
                "gate": hp.gate,
                "responses": rows,
            }
        )

    def _choose_transfers(
        self, own: list[RolloutBatch], pairs: list[Pair], rng: random.Random
    ) -> tuple[Sends, Sends, dict[tuple[int, int, int], Scored]]:
        """Choose the sources and balance the pairs: proposed, sent and scored (``compat``)."""
        hp = self.hparams
        learners = self.learners()
        n = max((len(g.trajectories) for g in own[0].groups), default=0)
        k = [[sum(g.successes) for g in b.groups] for b in own]
        # receiver likelihoods are local forwards under FSDP: each receiver is gathered only
        # while it scores, and every rank enters every receiver's context in the same order
        proposed: Sends = {p: [] for p in pairs}
        sends = proposed
        # the chosen source's responses, scored once for the choice: the exchange reuses them
        # (no receiver update in between, so they are the very values it would compute)
        scored: dict[tuple[int, int, int], Scored] = {}
        if hp.exchange:
            table: dict[tuple[int, int, int], float] = {}
            if hp.source_rule == "compat":  # score only prompts with several candidates
                for r, lr in enumerate(learners):
                    with gathered(lr.policy):
                        for q in range(len(k[r])):
                            cand = candidates(k, r, q, n)
                            for s in cand if len(cand) > 1 else []:
                                table[(s, r, q)], scored[(s, r, q)] = self._compat(
                                    own[s], own[r], q, lr
                                )
            proposed = choose_sources(k, n, rng, hp.source_rule, lambda s, r, q: table[(s, r, q)])
            sends = balance_pairs(proposed, len(own), rng, hp.balance, hp.rho)
        return proposed, sends, scored

    def _receive_all(
        self,
        own: list[RolloutBatch],
        batches: list[RolloutBatch],
        pairs: list[Pair],
        sends: Sends,
        scored: dict[tuple[int, int, int], Scored],
        rng: random.Random,
        total: int,
    ) -> list[float]:
        """Every pair's transfer into its receiver's batch, in ``pairs`` order; the weights."""
        learners = self.learners()
        weights: list[float] = []
        with stage("GRAFT exchange", total=total, unit="group") as bar:
            for s, r in pairs:
                with gathered(learners[r].policy):
                    weights += self.receive(
                        own[s],
                        batches[r],
                        sends[(s, r)],
                        learners[r],
                        rng,
                        bar,
                        scored={q: v for (a, b, q), v in scored.items() if (a, b) == (s, r)},
                    )
        return weights

    def _peer_metrics(
        self,
        per_model: list[dict[str, float]],
        pairs: list[Pair],
        sends: Sends,
        proposed: Sends,
        total: int,
        weights: list[float],
    ) -> dict[str, float]:
        """The step's metrics: each model's update, the transfers per pair and in all."""
        values: dict[str, float] = {}
        for name, v in zip(self.names, per_model, strict=True):
            values.update({f"{name}/{key}": x for key, x in v.items()})
        for s, r in pairs:
            tag = f"{self.names[s]}_to_{self.names[r]}"
            values[f"graft/transferred/{tag}"] = float(len(sends[(s, r)]))
            values[f"graft/complementary/{tag}"] = float(len(proposed[(s, r)]))
        values["graft/transferred"] = float(total)
        values.update(weight_metrics(weights))
        peer = [v["loss/peer_clip_frac"] for v in per_model if "loss/peer_clip_frac" in v]
        if peer:
            values["graft/peer_clip_frac"] = sum(peer) / len(peer)
        return values

    def _update_all(self, batches: list[RolloutBatch]) -> list[dict[str, float]]:
        """Each model's update in order; the last one counts Lightning's step."""
        opts = cast(list[Any], self.optimizers())
        scheds = cast(list[Any], self.lr_schedulers())
        last = len(batches) - 1
        return [
            lr.update(b, opts[i], scheds[i], self.global_step, i == last)
            for i, (lr, b) in enumerate(zip(self.learners(), batches, strict=True))
        ]
