"""Policy-loss registry: per-token policy losses with one signature, looked up by name.

Every training row (a turn's response) names the loss its tokens take: ``clip`` (the clipped
surrogate of SPEC §1: own rows and GRAFT's peer rows, the receiver's token ratio), ``luffy``
(LUFFY-style peer tokens, SPEC §3.3) or ``sequence`` (a sequence-level ratio: HACPO rows and
Table 2a's variant). The update asks ``row_policy_loss`` for the per-token loss of a micro-batch
whose rows may mix kinds; a new baseline registers its loss here and the trainer does not
change. Pure functions over tensors: no module, no trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from salvage.core.graft import luffy_token_loss, sequence_clipped_loss
from salvage.core.grpo import clipped_surrogate


@dataclass(frozen=True)
class LossInputs:
    """What a policy loss may read, per micro-batch (``[rows, T]`` unless noted)."""

    logprobs: torch.Tensor
    """Current token log-probs (with gradient)."""
    old_logprobs: torch.Tensor
    """Behaviour (pi_old) token log-probs."""
    advantages: torch.Tensor
    """The row's advantage on each of its tokens."""
    mask: torch.Tensor
    """1 on counted response tokens."""
    eps_low: float = 0.2
    """Token-ratio clip: lower delta."""
    eps_high: float = 0.28
    """Token-ratio clip: upper delta."""
    seq_ref: torch.Tensor | None = None
    """``sequence`` rows, ``[rows]``: the reference mean log-prob of the sequence ratio."""
    seq_low: torch.Tensor | None = None
    """``sequence`` rows, ``[rows]``: lower clip bound of the ratio."""
    seq_high: torch.Tensor | None = None
    """``sequence`` rows, ``[rows]``: upper clip bound (``inf``: none)."""


PolicyLoss = Callable[[LossInputs], tuple[torch.Tensor, torch.Tensor]]
"""``inputs -> (loss per token, clipped flag per token)``, both ``[rows, T]``."""

POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    def add(fn: PolicyLoss) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered twice")
        POLICY_LOSSES[name] = fn
        return fn

    return add


def get_policy_loss(name: str) -> PolicyLoss:
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy loss {name!r}; registered: {sorted(POLICY_LOSSES)}"
        ) from None


@register_policy_loss("clip")
def clip_loss(x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC §1: ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``, r the token ratio."""
    loss, _, clipped = clipped_surrogate(
        x.logprobs, x.old_logprobs, x.advantages, x.eps_low, x.eps_high
    )
    return loss, clipped


@register_policy_loss("luffy")
def luffy_loss(x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """LUFFY-style peer tokens: ``-f(p) A``, ``f(p) = p / (p + 0.1)``; never clipped."""
    return luffy_token_loss(x.logprobs, x.advantages), torch.zeros_like(x.logprobs)


@register_policy_loss("sequence")
def sequence_loss(x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """One clipped ratio per row, ``exp(mean logp - seq_ref)``, written on every token."""
    if x.seq_ref is None or x.seq_low is None or x.seq_high is None:
        raise ValueError("the 'sequence' policy loss needs seq_ref, seq_low and seq_high")
    return sequence_clipped_loss(x.logprobs, x.mask, x.seq_ref, x.advantages, x.seq_low, x.seq_high)


def row_policy_loss(kinds: Sequence[str], x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and clipped flag of rows whose losses may differ (``kinds[i]`` per row)."""
    if len(kinds) != x.logprobs.shape[0]:
        raise ValueError(f"{len(kinds)} loss kinds for {x.logprobs.shape[0]} rows")
    loss: torch.Tensor | None = None
    clipped = torch.zeros_like(x.logprobs)
    for kind in dict.fromkeys(kinds):  # each kind once, in first-seen order
        part_loss, part_clip = get_policy_loss(kind)(x)
        rows = torch.tensor([k == kind for k in kinds], device=x.logprobs.device)[:, None]
        loss = part_loss if loss is None else torch.where(rows, part_loss, loss)
        clipped = torch.where(rows, part_clip.to(clipped.dtype), clipped)
    assert loss is not None
    return loss, clipped
