"""GRAFT cross-model trajectory exchange (SPEC §3), pure.

Selection of complementary prompts, direction balancing, the compatibility score and
weight, minibatch ordering, and the per-token losses of GRAFT and of its baselines.
No models, no tokenizers, no global RNG (every random choice takes a ``random.Random``).

Rules marked "ours" in SPEC, named where implemented:
- ``balance="min_ratio"``: each direction transfers at most ``ceil(rho * max(m_other, 1))``
  prompts, chosen uniformly at random;
- uniform order (a baseline): the minibatches are packed as in peer-last (the peer groups
  together) and only their order is shuffled; the paper says only "shuffles the minibatch
  order", so the packing is ours;
- HACPO's peer lower bound ``0.8 + 0.025 step`` is not capped (the paper gives no cap);
  with the optional upper bound (a switch, off) it is capped at that bound.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

BALANCE = ("min_ratio", "none")
ORDERS = ("peer-last", "peer-first", "uniform")
CHOICES = {
    "selection": ("complementary", "random"),
    "peer_filter": ("all", "success"),
    "peer_advantage": ("source", "pooled"),
    "admission": ("compat", "random"),
    "peer_loss": ("clip", "luffy"),
    "peer_ratio": ("token", "sequence"),
    "mode": ("graft", "sgt", "hacpo"),
}
"""The allowed values of GRAFT's string settings (``GRAFTModule``'s arguments)."""


def settings_error(
    *,
    balance: str,
    order: str,
    delta: float,
    rho: float,
    hacpo_clip_low: float,
    hacpo_clip_high: float,
    hacpo_peer_high: float | None,
    restrict_to_selection: bool,
    **choices: str,
) -> str | None:
    """The first GRAFT setting out of range, as a message naming its ``model.`` key (None:
    all in range); ``choices``: the string settings of ``CHOICES``, checked in order."""
    if balance not in BALANCE:
        return f"model.balance must be one of {BALANCE}, got {balance!r}"
    if order not in ORDERS:
        return f"model.order must be one of {ORDERS}, got {order!r}"
    if not 0 < delta <= 1:
        return f"model.delta={delta!r} must be in (0, 1]"
    if rho <= 0:
        return f"model.rho={rho!r} must be > 0"
    for key, val in choices.items():
        if val not in CHOICES[key]:
            return f"model.{key} must be one of {CHOICES[key]}, got {val!r}"
    for key, bound in (("hacpo_clip_low", hacpo_clip_low), ("hacpo_clip_high", hacpo_clip_high)):
        if not 0 <= bound < 1:
            return f"model.{key}={bound!r} must be in [0, 1)"
    if hacpo_peer_high is not None and hacpo_peer_high <= 0:
        return f"model.hacpo_peer_high={hacpo_peer_high!r} must be > 0 (or null)"
    if restrict_to_selection and choices.get("mode") == "graft":
        return "model.restrict_to_selection applies to mode 'hacpo' or 'sgt' (GRAFT selects anyway)"
    return None


def complementary(k_receiver: int, k_source: int, n: int) -> bool:
    """SPEC §3.1: the receiver solved none, the source solved some but not all."""
    return k_receiver == 0 and 1 <= k_source <= n - 1


@dataclass
class Transfers:
    a_to_b: list[int]
    """Prompt indices whose A group replaces B's group."""
    b_to_a: list[int]
    m_ab: int
    """Complementary prompts A -> B before balancing."""
    m_ba: int


def select_transfers(
    k_a: Sequence[int],
    k_b: Sequence[int],
    n: int,
    rng: random.Random,
    balance: str = "min_ratio",
    rho: float = 1.0,
) -> Transfers:
    """Complementary prompts per direction, balanced (SPEC §3.1; ``min_ratio`` is ours)."""
    if balance not in BALANCE:
        raise ValueError(f"graft.balance must be one of {BALANCE}, got {balance!r}")
    if len(k_a) != len(k_b):
        raise ValueError(
            f"success counts of A ({len(k_a)}) and B ({len(k_b)}) cover different prompts"
        )
    ab = [q for q in range(len(k_a)) if complementary(k_b[q], k_a[q], n)]
    ba = [q for q in range(len(k_a)) if complementary(k_a[q], k_b[q], n)]
    m_ab, m_ba = len(ab), len(ba)
    if balance == "min_ratio":
        cap_ab = math.ceil(rho * max(m_ba, 1))
        cap_ba = math.ceil(rho * max(m_ab, 1))
        ab = sorted(rng.sample(ab, cap_ab)) if len(ab) > cap_ab else ab
        ba = sorted(rng.sample(ba, cap_ba)) if len(ba) > cap_ba else ba
    return Transfers(ab, ba, m_ab, m_ba)


def select_unidirectional(k_receiver: Sequence[int], k_source: Sequence[int], n: int) -> list[int]:
    """Stored mode: one direction, no balancing."""
    return [q for q in range(len(k_source)) if complementary(k_receiver[q], k_source[q], n)]


def mean_logprob(logprobs: Sequence[float]) -> float:
    """``lbar``: mean token log-prob of a response under one model's own tokenisation."""
    if not logprobs:
        raise ValueError("a response with no tokens has no mean log-prob")
    return float(sum(logprobs) / len(logprobs))


def compatibility(lbar_receiver: float, lbar_source: float) -> float:
    """``s(o|q) = exp(lbar_B - lbar_A)``: a proxy, not a density ratio (SPEC §3.2)."""
    return math.exp(lbar_receiver - lbar_source)


def compat_weight(s: float, delta: float = 0.8, gate: bool = True, floor: bool = True) -> float:
    """``w = min(s, 1)`` if ``s > delta`` else 0; ``gate=False``: w = 1; ``floor=False``: w = min(s, 1)."""
    if not 0 < delta <= 1:
        raise ValueError(f"graft.delta={delta!r} must be in (0, 1]")
    if not gate:
        return 1.0
    w = min(s, 1.0)
    if floor and s <= delta:
        return 0.0
    return w


def random_admission(scores: Sequence[float], delta: float, rng: random.Random) -> list[float]:
    """Random-admission baseline (SPEC §3.3): as many responses as pass the gate, drawn at random.

    ``scores``: the compatibility ``s`` of every response of the transferred peer groups (one
    direction, one step). ``m = #{s > delta}`` responses are sampled uniformly without
    replacement from all of them; each sampled one weighs ``min(s, 1)`` (the floor only sets
    the count), every other one 0.
    """
    if not 0 < delta <= 1:
        raise ValueError(f"graft.delta={delta!r} must be in (0, 1]")
    m = sum(s > delta for s in scores)
    chosen = set(rng.sample(range(len(scores)), m))
    return [min(s, 1.0) if i in chosen else 0.0 for i, s in enumerate(scores)]


def order_groups(is_peer: Sequence[bool], order: str, rng: random.Random) -> list[int]:
    """Group order whose contiguous chunks are the minibatches: peer groups last or first.

    ``uniform`` packs like ``peer-last`` (groups stay where selection put them); the order
    of the minibatches themselves is shuffled by ``plan_minibatches``.
    """
    if order not in ORDERS:
        raise ValueError(f"graft.order must be one of {ORDERS}, got {order!r}")
    own = [i for i, p in enumerate(is_peer) if not p]
    peer = [i for i, p in enumerate(is_peer) if p]
    if order == "peer-first":
        return peer + own
    return own + peer


def plan_minibatches(
    is_peer: Sequence[bool], order: str, num_minibatches: int, rng: random.Random
) -> list[list[int]]:
    """Group indices of each minibatch, in update order (SPEC §3.2 peer-last; §3.3 variants).

    ``peer-last`` / ``peer-first``: the peer groups fill the last / first minibatches.
    ``uniform``: the peer-last minibatches, their order shuffled uniformly (every step).
    """
    chunks = split_minibatches(order_groups(is_peer, order, rng), num_minibatches)
    if order == "uniform":
        rng.shuffle(chunks)
    return chunks


def split_minibatches(order: Sequence[int], num_minibatches: int) -> list[list[int]]:
    """Contiguous, near-equal chunks of ``order`` (so peer-last puts peers in the last ones)."""
    k = max(1, min(num_minibatches, len(order)))
    return [list(order[i * len(order) // k : (i + 1) * len(order) // k]) for i in range(k)]


# --------------------------------------------------------------------------- baselines


def pooled_advantages(
    r_receiver: torch.Tensor, r_peer: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pooled groups: GRPO advantages over receiver || peer rewards (SPEC §3.3, eps 1e-6)."""
    r = torch.cat([r_receiver, r_peer]).to(torch.float64)
    std = r.std(correction=1) if r.numel() > 1 else torch.zeros((), dtype=r.dtype)
    a = ((r - r.mean()) / (std + eps)).to(torch.float32)
    return a[: r_receiver.numel()], a[r_receiver.numel() :]


def luffy_token_loss(
    logprobs: torch.Tensor, advantages: torch.Tensor, gamma: float = 0.1
) -> torch.Tensor:
    """LUFFY-style peer tokens: ``-f(p) A`` with ``f(p) = p / (p + gamma)``, behaviour prob 1, no clip."""
    p = torch.exp(logprobs)
    return -(p / (p + gamma)) * advantages


def sgt_pick(successes: Sequence[bool], k_receiver: int, rng: random.Random) -> int | None:
    """SGT: one uniformly chosen correct peer response when the receiver solved none."""
    ok = [i for i, s in enumerate(successes) if s]
    if k_receiver != 0 or not ok:
        return None
    return rng.choice(ok)


def hacpo_clip_range(
    step: int, start: float = 0.8, ramp: float = 0.025, high: float | None = None
) -> tuple[float, float]:
    """HACPO's peer-ratio range at ``step``: lower bound ``start + ramp * step``, no upper bound.

    ``high`` (a switch, off in the GRAFT paper's configuration): an upper bound; the lower
    bound is then capped at it. Returns (low, high) with ``high = inf`` when unbounded.
    """
    low = start + ramp * step
    if high is None:
        return low, math.inf
    return min(low, high), high


def sequence_ratio(
    logprobs: torch.Tensor, mask: torch.Tensor, ref_mean: torch.Tensor
) -> torch.Tensor:
    """Sequence-level ratio per row: ``exp(mean_t logp_theta - ref_mean)`` over the masked tokens.

    ``ref_mean``: the behaviour's mean token log-prob of the row (the receiver's pi_old for
    its own or re-tokenised rows; the source's generation log-probs for HACPO peer rows).
    """
    m = mask.to(logprobs.dtype)
    mean_lp = (logprobs * m).sum(-1) / m.sum(-1).clamp(min=1)
    return torch.exp(mean_lp - ref_mean.to(logprobs.dtype))


def sequence_clipped_loss(
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    ref_mean: torch.Tensor,
    advantages: torch.Tensor,
    low: torch.Tensor | float,
    high: torch.Tensor | float = math.inf,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped surrogate with a sequence-level ratio (HACPO; Table 2a's sequence-ratio variant).

    Per row: ``-min(rho A, clip(rho, low, high) A)`` with ``rho = sequence_ratio(...)``, written
    on every response token of the row (token-mean aggregation then weighs rows by length).
    ``low``/``high``: scalars or per-row tensors (``inf``: no upper bound). Returns (per-token
    loss, per-token clipped flag). ``logprobs``/``mask``/``advantages``: [rows, T];
    ``ref_mean``: [rows].
    """
    m = mask.to(logprobs.dtype)
    rho = sequence_ratio(logprobs, mask, ref_mean)
    adv = (advantages * m).sum(-1) / m.sum(-1).clamp(min=1)
    lo = torch.as_tensor(low, dtype=rho.dtype, device=rho.device)
    hi = torch.as_tensor(high, dtype=rho.dtype, device=rho.device)
    unclipped, clipped_rho = rho * adv, torch.minimum(torch.maximum(rho, lo), hi) * adv
    surrogate = torch.minimum(unclipped, clipped_rho)
    was_clipped = (clipped_rho < unclipped).to(logprobs.dtype)
    return -surrogate[:, None] * m, was_clipped[:, None] * m


def capability_advantages(
    r_receiver: torch.Tensor,
    r_peer: torch.Tensor,
    c_receiver: float,
    c_peer: float,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HACPO's capability-weighted group baseline over receiver || peer responses (ours where SPEC is silent).

    The peer's responses count with weight ``omega = min(1, (c_receiver + 0.05) / (c_peer + 0.05))``
    (``c``: each model's success rate on this batch), so a stronger peer does not raise
    the receiver's baseline beyond its own reach: ``b = sum(w r) / sum(w)``,
    ``sigma^2 = sum(w (r - b)^2) / sum(w)``, ``A = (r - b) / (sigma + eps)`` for all responses.
    """
    omega = min(1.0, (c_receiver + 0.05) / (c_peer + 0.05))
    r = torch.cat([r_receiver, r_peer]).to(torch.float64)
    w = torch.cat([torch.ones(r_receiver.numel()), torch.full((r_peer.numel(),), omega)]).to(
        torch.float64
    )
    b = (w * r).sum() / w.sum()
    sigma = ((w * (r - b) ** 2).sum() / w.sum()).sqrt()
    a = ((r - b) / (sigma + eps)).to(torch.float32)
    return a[: r_receiver.numel()], a[r_receiver.numel() :]
