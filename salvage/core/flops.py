"""Model FLOPs of a training update, for model FLOP utilisation (MFU).

Counted per sequence of T tokens for a decoder (``salvage.core.memory.Shape``):

- matmuls: ``2 x (layers x layer params + vocab x hidden) x T`` for a forward. The input
  embedding is a lookup (no FLOPs); the LM head is a matmul (counted once, tied or not).
- attention scores and values: per layer, the token at position t multiplies with t keys
  and t values of width ``q_dim`` (heads x head dim): ``2 x 2 x q_dim x t``; summed over
  t = 1..T (causal) ``2 x q_dim x T (T + 1)``.
- an update: forward + backward = 3 forwards, plus one more when activation checkpointing
  recomputes the forward; each frozen model that scores the sequence in the update (the KL
  or pair reference) adds one forward.
"""

from __future__ import annotations

from collections.abc import Iterable

from salvage.core.memory import Shape


def forward_flops(shape: Shape, tokens: int, q_dim: int | None = None) -> float:
    """FLOPs of one forward over a sequence of ``tokens`` tokens (causal attention)."""
    q = shape.hidden if q_dim is None else q_dim
    matmul = 2 * (shape.layers * shape.layer_params + shape.vocab * shape.hidden) * tokens
    attention = shape.layers * 2 * q * tokens * (tokens + 1)
    return float(matmul + attention)


def update_flops(
    shape: Shape,
    seq_lens: Iterable[int],
    recompute: bool = False,
    frozen_forwards: int = 0,
    q_dim: int | None = None,
) -> float:
    """FLOPs of one update over sequences of ``seq_lens`` tokens: (3 + recompute +
    ``frozen_forwards``) forwards each."""
    per = 3 + int(recompute) + frozen_forwards
    return float(sum(per * forward_flops(shape, t, q_dim) for t in seq_lens))


def mfu(flops: float, seconds: float, peak_flops_per_gpu: float, gpus: int) -> float:
    """Model FLOP utilisation: achieved FLOPs per second over the GPUs' peak."""
    return flops / (seconds * peak_flops_per_gpu * gpus)
