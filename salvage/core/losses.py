"""VH-GPO auxiliary objectives (SPEC §2.3), pure tensor maths.

``s_theta(y|h)`` is the mean token log-prob of the counted tokens of y given h:
``seq_mean_logprob``. Each objective is normalised on its own (mean over its items);
a term with no items is omitted by the caller, never a NaN or a zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def seq_mean_logprob(token_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row mean of token log-probs over ``mask`` (rows with no counted token -> 0)."""
    m = mask.to(token_logprobs.dtype)
    return (token_logprobs * m).sum(-1) / m.sum(-1).clamp(min=1.0)


def pair_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """Per-pair ``-log sigmoid(beta * (p_theta - p_ref))`` with p = s(chosen) - s(rejected)."""
    p_theta = chosen - rejected
    p_ref = ref_chosen - ref_rejected
    return -F.logsigmoid(beta * (p_theta - p_ref))


def completion_loss(seq_scores: torch.Tensor) -> torch.Tensor:
    """Bridge / resume objective: ``-mean over (h, y) of s_theta(y|h)`` (per item, to be averaged)."""
    return -seq_scores
