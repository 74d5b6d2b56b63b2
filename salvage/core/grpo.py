"""GRPO mathematics (SPEC §1): advantages, zero-signal test, clipped surrogate, KL, aggregation.

Pure functions over tensors; no Lightning, no transformers, no global RNG.

Choices SPEC leaves open, named here so they can be found:
- std in the GRPO advantage is the unbiased sample std (``correction=1``), as in verl and
  TRL; a group of one rollout has std 0 and gets advantage 0.
- RLOO uses the leave-one-out mean and no std division.
"""

from __future__ import annotations

from typing import Literal

import torch

from salvage.types import Group

AdvantageEstimator = Literal["grpo", "drgrpo", "rloo"]
Aggregation = Literal["token-mean", "seq-mean-token-mean"]

ADVANTAGE_ESTIMATORS: tuple[str, ...] = ("grpo", "drgrpo", "rloo")
AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean")


def group_advantages(
    rewards: torch.Tensor, estimator: AdvantageEstimator | str = "grpo", eps: float = 1e-6
) -> torch.Tensor:
    """Advantages of the rollouts of ONE group (1-D tensor of rewards).

    - ``grpo``:   (R_i - mean R) / (std R + eps)
    - ``drgrpo``: R_i - mean R                      (Dr. GRPO: no std normalisation)
    - ``rloo``:   R_i - mean_{j != i} R_j = G/(G-1) (R_i - mean R)
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (one group), got shape {tuple(rewards.shape)}")
    r = rewards.to(torch.float64)
    g = r.numel()
    if g == 0:
        return r.to(torch.float32)
    centred = r - r.mean()
    if estimator == "grpo":
        std = r.std(correction=1) if g > 1 else torch.zeros((), dtype=r.dtype)
        adv = centred / (std + eps)
    elif estimator == "drgrpo":
        adv = centred
    elif estimator == "rloo":
        adv = centred * (g / (g - 1)) if g > 1 else torch.zeros_like(r)
    else:
        raise ValueError(
            f"advantage estimator must be one of {ADVANTAGE_ESTIMATORS}, got {estimator!r}"
        )
    return adv.to(torch.float32)


def is_zero_signal(
    rewards: torch.Tensor,
    successes: torch.Tensor,
    advantages: torch.Tensor,
    reward_tol: float = 1e-6,
    adv_tol: float = 1e-6,
) -> bool:
    """SPEC §1 zero-signal group: every rollout failed, rewards (near) equal, advantages (near) 0.

    An all-failure group whose rewards differ (e.g. by the -0.1 invalid-format penalty) is
    NOT zero-signal: it still has a gradient.
    """
    if rewards.numel() == 0:
        return False
    all_failed = not bool(successes.bool().any())
    flat = float(rewards.max() - rewards.min()) <= reward_tol
    no_adv = bool((advantages.abs() <= adv_tol).all())
    return all_failed and flat and no_adv


def assign_advantages(
    group: Group,
    estimator: AdvantageEstimator | str = "grpo",
    eps: float = 1e-6,
    reward_tol: float = 1e-6,
    adv_tol: float = 1e-6,
) -> None:
    """Write each trajectory's advantage (inside its group) and the group's zero-signal flag
    (SPEC §1)."""
    rewards = torch.tensor(group.rewards, dtype=torch.float32)
    adv = group_advantages(rewards, estimator, eps)
    for t, a in zip(group.trajectories, adv.tolist(), strict=True):
        t.advantage = a
    group.zero_signal = is_zero_signal(
        rewards, torch.tensor(group.successes), adv, reward_tol, adv_tol
    )


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO/GRPO loss ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)``.

    Returns (loss per token, ratio, clipped indicator): a token counts as clipped when
    the clipped branch is the one selected by the min and differs from the unclipped one.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = (clipped < unclipped).to(logprobs.dtype)
    return loss, ratio, was_clipped


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - cur) - (ref - cur) - 1 (>= 0)."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def aggregation_weights(
    mask: torch.Tensor, seq_index: torch.Tensor, mode: Aggregation = "token-mean"
) -> torch.Tensor:
    """Per-token weights w such that ``sum(w * x)`` is the chosen aggregate of x.

    Computed once over a whole minibatch, so micro-batches that each sum ``w * x`` add up
    to exactly the minibatch aggregate (no re-normalisation per micro-batch).

    - ``token-mean``: every counted token of the minibatch weighs 1 / (number of tokens).
    - ``seq-mean-token-mean``: mean over sequences of each sequence's token-mean; a
      sequence is identified by ``seq_index`` (rows of one multi-turn trajectory share it).
    """
    m = mask.to(torch.float32)
    total = m.sum()
    if total <= 0:
        return torch.zeros_like(m)
    if mode == "token-mean":
        return m / total
    if mode == "seq-mean-token-mean":
        row_tokens = m.sum(dim=1)
        n_seq = int(seq_index.max().item()) + 1
        seq_tokens = torch.zeros(n_seq, dtype=m.dtype, device=m.device).index_add_(
            0, seq_index, row_tokens
        )
        present = (seq_tokens > 0).sum()
        per_row = 1.0 / (seq_tokens[seq_index].clamp(min=1.0) * present)
        return m * per_row[:, None]
    raise ValueError(f"loss aggregation must be one of {AGGREGATIONS}, got {mode!r}")


def aggregation_denominator(
    mask: torch.Tensor, seq_index: torch.Tensor, mode: Aggregation = "token-mean"
) -> float:
    """The count ``aggregation_weights`` divides by: tokens (token-mean) or sequences with
    tokens (seq-mean-token-mean). Summed over data-parallel ranks, it is the global count
    that makes a sharded update equal one process's (``salvage.distributed.global_scale``).
    """
    m = mask.to(torch.float32)
    if m.numel() == 0 or m.sum() <= 0:
        return 0.0
    if mode == "token-mean":
        return float(m.sum())
    if mode == "seq-mean-token-mean":
        row_tokens = m.sum(dim=1)
        n_seq = int(seq_index.max().item()) + 1
        seq_tokens = torch.zeros(n_seq, dtype=m.dtype).index_add_(
            0, seq_index.cpu(), row_tokens.cpu()
        )
        return float((seq_tokens > 0).sum())
    raise ValueError(f"loss aggregation must be one of {AGGREGATIONS}, got {mode!r}")
