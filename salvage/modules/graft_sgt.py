"""GRAFT's SGT baseline (``mode: sgt``): no group replacement; each policy's update adds an
NLL term on one correct peer response for every prompt it did not solve (and the peer did),
optionally only on GRAFT's own selection (``restrict_to_selection``, Appendix G).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from salvage.core.graft import select_transfers, sgt_pick
from salvage.core.losses import completion_loss
from salvage.lm import target_scores
from salvage.modules.grpo import Auxiliary, GRPOModule
from salvage.types import RolloutBatch, SeqTarget


class PairModule(Protocol):
    """What ``sgt_step`` needs of ``GRAFTModule`` (structural: this module never imports
    ``salvage.modules.graft``, which imports it; the dependency points one way)."""

    @property
    def hparams(self) -> Any: ...

    a: GRPOModule
    b: GRPOModule

    def _update_both(self, ra: RolloutBatch, rb: RolloutBatch, aux: Any) -> Any: ...

    def record(self, values: dict[str, float]) -> None: ...


def sgt_step(module: PairModule, ra: RolloutBatch, rb: RolloutBatch, rng: random.Random) -> None:
    """SGT baseline: own groups untouched; NLL on one correct peer response per unsolved prompt.

    ``restrict_to_selection``: only on the prompts of GRAFT's complementary, balanced
    selection (Appendix G).
    """
    hp = module.hparams
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
    for src, dst, recv, name in ((ra, rb, module.b, "a_to_b"), (rb, ra, module.a, "b_to_a")):
        targets = sgt_targets(src, dst, recv, allowed[name], rng)
        aux[name[-1]] = sgt_auxiliary(recv, targets, hp.sgt_weight)
        counts[name] = len(targets)
    va, vb = module._update_both(ra, rb, aux)
    values = {f"a/{k}": v for k, v in va.items()} | {f"b/{k}": v for k, v in vb.items()}
    values.update(
        {
            "graft/transferred_a_to_b": float(counts["a_to_b"]),
            "graft/transferred_b_to_a": float(counts["b_to_a"]),
        }
    )
    module.record(values)


def sgt_targets(
    src: RolloutBatch,
    dst: RolloutBatch,
    recv: GRPOModule,
    only: set[int] | None,
    rng: random.Random,
) -> list[SeqTarget]:
    """Per prompt the receiver solved none of (within ``only``), one uniformly chosen correct
    response of the source, in the receiver's tokens (EOS appended) on its own prompt."""
    targets = []
    for q, (sg, dg) in enumerate(zip(src.groups, dst.groups, strict=True)):
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
    return targets


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
