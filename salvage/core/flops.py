"""Model FLOPs of a training update, for model FLOP utilisation (MFU), and the memory floor
of decoding.

Counted per sequence of T tokens for a decoder (``salvage.core.memory.Shape``):

- matmuls: ``2 x (layers x layer params + vocab x hidden) x T`` for a forward. The input
  embedding is a lookup (no FLOPs); the LM head is a matmul (counted once, tied or not).
- attention scores and values: per layer, the token at position t multiplies with t keys
  and t values of width ``q_dim`` (heads x head dim): ``2 x 2 x q_dim x t``; summed over
  t = 1..T (causal) ``2 x q_dim x T (T + 1)``.
- an update: forward + backward = 3 forwards, plus one more when activation checkpointing
  recomputes the forward; each frozen model that scores the sequence in the update (the KL
  or pair reference) adds one forward.
- ``scored``: the positions the LM head is needed at (a loss over the response needs its
  logits only: ``len(response)`` positions); default all ``tokens``.
- decoding: each step of a batch of B sequences reads every matmul weight once (layers and
  LM head; the embedding lookup reads B rows, left out, as is the KV cache), so at
  ``bandwidth`` bytes/s it emits at most ``B x bandwidth / weight bytes`` tokens/s.
"""

from __future__ import annotations

from collections.abc import Iterable

from salvage.core.memory import Shape


def forward_flops(
    shape: Shape, tokens: int, q_dim: int | None = None, scored: int | None = None
) -> float:
    """FLOPs of one forward over a sequence of ``tokens`` tokens (causal attention), the LM
    head at ``scored`` positions (default: all)."""
    q = shape.hidden if q_dim is None else q_dim
    head = tokens if scored is None else scored
    matmul = 2 * (shape.layers * shape.layer_params * tokens + shape.vocab * shape.hidden * head)
    attention = shape.layers * 2 * q * tokens * (tokens + 1)
    return float(matmul + attention)


def update_flops(
    shape: Shape,
    seq_lens: Iterable[int],
    recompute: bool = False,
    frozen_forwards: int = 0,
    q_dim: int | None = None,
    scored_lens: Iterable[int] | None = None,
) -> float:
    """FLOPs of one update over sequences of ``seq_lens`` tokens: (3 + recompute +
    ``frozen_forwards``) forwards each; ``scored_lens``: per sequence, the positions the LM
    head is needed at (default: all)."""
    per = 3 + int(recompute) + frozen_forwards
    lens = list(seq_lens)
    scored = list(lens if scored_lens is None else scored_lens)
    if len(scored) != len(lens):
        raise ValueError(f"scored_lens has {len(scored)} entries, seq_lens {len(lens)}")
    return float(
        sum(per * forward_flops(shape, t, q_dim, s) for t, s in zip(lens, scored, strict=True))
    )


def decode_weight_bytes(shape: Shape, weight_bytes: int = 4) -> float:
    """Bytes of weights one decode step reads: every decoder layer's and the LM head's."""
    return float((shape.layers * shape.layer_params + shape.vocab * shape.hidden) * weight_bytes)


def decode_floor_tokens_per_s(
    shape: Shape, batch: int, bandwidth: float, weight_bytes: int = 4
) -> float:
    """The memory-bandwidth floor of decoding ``batch`` sequences at ``bandwidth`` bytes/s:
    one step (one token per sequence) per read of the weights."""
    return batch * bandwidth / decode_weight_bytes(shape, weight_bytes)


def mfu(flops: float, seconds: float, peak_flops_per_gpu: float, gpus: int) -> float:
    """Model FLOP utilisation: achieved FLOPs per second over the GPUs' peak."""
    return flops / (seconds * peak_flops_per_gpu * gpus)
