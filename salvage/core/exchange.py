"""The receiver's side of a GRAFT exchange (SPEC §3.2), pure.

Given the receiver's own group on a prompt and the peer's responses already re-tokenised
by the receiver and scored under its pi_old (the shell does that: it needs the tokenizer
and the model), ``receive_group`` builds the group the receiver trains on: each peer
response's compatibility score and weight, its policy loss, and the advantages (the
source's, pooled, or HACPO's capability-weighted ones). Shared by ``GRAFTModule`` and the
stored-mode receiver ``StoredPeer`` (through ``salvage.modules.graft.transplant``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from salvage.core.graft import (
    Transfers,
    capability_advantages,
    compat_weight,
    compatibility,
    hacpo_clip_range,
    mean_logprob,
    pooled_advantages,
)
from salvage.types import CompatParts, Group, SeqRatio, Trajectory, Turn

POOLED_EPS = 1e-6
"""The epsilon of the pooled advantages' std normalisation (``peer_advantage="pooled"``)."""


@dataclass(frozen=True)
class ExchangeRules:
    """How a receiver takes in a peer group (``GRAFTModule``'s arguments of the same names)."""

    delta: float = 0.8
    gate: bool = True
    floor: bool = True
    peer_filter: str = "all"
    peer_advantage: str = "source"
    admission: str = "compat"
    peer_loss: str = "clip"
    peer_ratio: str = "token"
    mode: str = "graft"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    hacpo_clip_low: float = 3e-4
    hacpo_clip_high: float = 4e-4
    hacpo_peer_low: float = 0.8
    hacpo_peer_ramp: float = 0.025
    hacpo_peer_high: float | None = None

    @property
    def hacpo(self) -> bool:
        return self.mode == "hacpo"


def peer_responses(source: Group, rules: ExchangeRules) -> list[Trajectory]:
    """The source's responses that travel: all of them, or its successes only
    (``peer_filter="success"``; HACPO always takes the whole group)."""
    keep_all = rules.peer_filter == "all" or rules.hacpo
    return [t for t in source.trajectories if t.success or keep_all]


def episode_logprobs(turns: Sequence[Turn]) -> list[float]:
    """The log-probs of every response token of an episode's turns, in order (one turn:
    that turn's). GRAFT's ``lbar`` of a multi-turn episode is their mean (docs/peers.md)."""
    return [lp for t in turns for lp in t.logprobs]


def moved_turns(traj: Trajectory, agents: bool) -> list[Turn]:
    """The turns of a travelling response that the receiver re-tokenises: an agent episode's
    trainable turns, else the single turn of a single-turn task."""
    return [x for x in traj.turns if x.train] if agents else traj.turns[:1]


def receiver_turns(
    peers: Sequence[Trajectory],
    prompts: Sequence[list[int]],
    responses: Sequence[list[int]],
    logprobs: Sequence[list[float]],
    agents: bool,
) -> list[list[Turn]]:
    """Per travelling response, its ``moved_turns`` as the receiver sees them, from the flat
    lists (one entry per moved turn, in order) of the receiver's prompts, re-tokenised
    responses and pi_old log-probs: agents, the peer's turns with those tokens (trainable);
    single-turn tasks, a fresh turn on the receiver's prompt with the response text."""
    out: list[list[Turn]] = []
    k = 0
    for t in peers:
        src = moved_turns(t, agents)
        out.append(
            [
                replace(
                    turn,
                    prompt_ids=prompts[k + i],
                    response_ids=responses[k + i],
                    logprobs=logprobs[k + i],
                    train=True,
                )
                if agents
                else Turn(
                    prompt_ids=prompts[k + i],
                    response_ids=responses[k + i],
                    logprobs=logprobs[k + i],
                    response_text=turn.response_text,
                )
                for i, turn in enumerate(src)
            ]
        )
        k += len(src)
    return out


def receive_group(
    own: Group,
    peers: Sequence[Trajectory],
    turns: Sequence[Turn | Sequence[Turn]],
    rules: ExchangeRules,
    *,
    step: int = 0,
    live: bool = True,
    capability: tuple[float, float] = (0.0, 0.0),
) -> Group:
    """The receiver's group on one prompt after the exchange (SPEC §3.2).

    ``turns[i]``: peer response i in the receiver's tokens, with the receiver's pi_old
    log-probs: one turn (single-turn tasks), or the turns of a peer episode re-rendered
    turn by turn (agents; ``lbar`` then runs over all its action tokens). Each peer
    trajectory gets ``compat = exp(lbar_receiver - lbar_source)``
    and the weight ``compat_weight`` (HACPO: 1; random admission: 0 until the caller draws
    the admitted ones). ``live`` (HACPO restricted to GRAFT's selection): False zeroes the
    peer responses' advantages. ``capability``: (receiver, source) success rates on the
    batch, HACPO's baseline weights. Own trajectories joining the group (pooled, HACPO) are
    updated in place (advantage, HACPO's sequence ratio).
    """
    peer_range = _hacpo_peer_range(rules, step) if rules.hacpo else None
    received = [
        _received(t, [item] if isinstance(item, Turn) else list(item), rules, peer_range)
        for t, item in zip(peers, turns, strict=True)
    ]
    own_t = list(own.trajectories)
    if rules.hacpo:
        _hacpo_advantages(own_t, received, rules, live, capability)
        received = own_t + received
    elif rules.peer_advantage == "pooled":  # receiver || peer, advantages over the pool
        a_own, a_peer = pooled_advantages(
            torch.tensor([t.reward for t in own_t]),
            torch.tensor([t.reward for t in received]),
            eps=POOLED_EPS,
        )
        for t, a in zip(own_t + received, a_own.tolist() + a_peer.tolist(), strict=True):
            t.advantage = a
        received = own_t + received
    return Group(task_id=own.task_id, trajectories=received, task=own.task, peer=True)


def _hacpo_peer_range(rules: ExchangeRules, step: int) -> tuple[float, float | None]:
    """HACPO's sequence-level ratio range of peer responses at ``step`` (None: no upper)."""
    low, high = hacpo_clip_range(
        step, rules.hacpo_peer_low, rules.hacpo_peer_ramp, rules.hacpo_peer_high
    )
    return low, None if high == float("inf") else high


def _peer_weight(s: float, rules: ExchangeRules) -> float:
    """A peer response's weight from its compatibility ``s``."""
    if rules.hacpo:
        return 1.0  # peer coefficient 1; the mismatch is handled by the clipped sequence ratio
    if rules.admission == "random":
        return 0.0  # drawn over the whole direction (core.graft.random_admission)
    return compat_weight(s, rules.delta, rules.gate, rules.floor)


def _received(
    t: Trajectory,
    episode: list[Turn],
    rules: ExchangeRules,
    peer_range: tuple[float, float | None] | None,
) -> Trajectory:
    """Peer trajectory ``t`` as the receiver trains on it: its response in the receiver's
    tokens (``episode``), compatibility, weight, loss and sequence-ratio range."""
    src_lps, recv_lps = episode_logprobs(t.turns), episode_logprobs(episode)
    src_mean, recv_mean = mean_logprob(src_lps), mean_logprob(recv_lps)
    s = compatibility(recv_mean, src_mean)
    seq_ratio = None
    if peer_range is not None:
        seq_ratio = SeqRatio(src_mean, *peer_range)
    elif rules.peer_ratio == "sequence" and rules.peer_loss == "clip":  # Table 2a
        seq_ratio = SeqRatio(recv_mean, 1.0 - rules.clip_eps_low, 1.0 + rules.clip_eps_high)
    return Trajectory(
        turns=episode,
        reward=t.reward,
        success=t.success,
        advantage=t.advantage,
        weight=_peer_weight(s, rules),
        source="peer",
        loss="hacpo" if rules.hacpo else rules.peer_loss,
        seq_ratio=seq_ratio,
        compat=s,
        compat_parts=CompatParts(src_mean, recv_mean, len(src_lps), len(recv_lps)),
    )


def _hacpo_advantages(
    own: list[Trajectory],
    peers: list[Trajectory],
    rules: ExchangeRules,
    live: bool,
    capability: tuple[float, float],
) -> None:
    """HACPO (receiver || peer): capability-weighted baseline advantages, in place; own
    responses get the clipped sequence ratio, peers outside GRAFT's selection no advantage."""
    a_own, a_peer = capability_advantages(
        torch.tensor([t.reward for t in own]),
        torch.tensor([t.reward for t in peers]),
        *capability,
    )
    own_clip = (1.0 - rules.hacpo_clip_low, 1.0 + rules.hacpo_clip_high)
    for t, a in zip(own, a_own.tolist(), strict=True):
        t.advantage = a
        t.seq_ratio = SeqRatio(mean_logprob(t.turns[0].logprobs), *own_clip)
    for t, a in zip(peers, a_peer.tolist(), strict=True):
        t.advantage = a if live else 0.0  # outside GRAFT's selection: no advantage


def weight_metrics(weights: Sequence[float]) -> dict[str, float]:
    """``graft/weight_mean`` of an update's peer-response weights (0 without any), and
    ``graft/admitted_frac``, the fraction the gate admitted (w > 0), only when there were
    transfers (a 0 there would read as "none admitted")."""
    if not weights:
        return {"graft/weight_mean": 0.0}
    return {
        "graft/weight_mean": sum(weights) / len(weights),
        "graft/admitted_frac": sum(w > 0 for w in weights) / len(weights),
    }


def admission_metrics(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """What the gate let in, by outcome, from an update's ``transfer_rows``:
    ``graft/admitted_correct_frac`` (of the peer's successful responses, the fraction
    admitted) and ``graft/admitted_incorrect_frac`` (of its failed ones); each only when
    the update transferred such responses; and ``graft/admission_gap``, the first minus the
    second, when both are there (a complementary group always holds both). A gate that
    reads compatibility as quality has a gap >= 0."""
    values = {}
    for key, outcome in (("correct", True), ("incorrect", False)):
        mine = [r["admitted"] for r in rows if bool(r["success"]) is outcome]
        if mine:
            values[f"graft/admitted_{key}_frac"] = sum(mine) / len(mine)
    if len(values) == 2:
        gap = values["graft/admitted_correct_frac"] - values["graft/admitted_incorrect_frac"]
        values["graft/admission_gap"] = gap
    return values


def transfer_rows(
    groups: Sequence[Group], prompts: Sequence[int], source: str, receiver: str, step: int
) -> list[dict[str, Any]]:
    """One ``exchange.jsonl`` row per peer response the receiver took in on ``prompts``
    (``groups``: its batch after the exchange), in order: the direction, the compatibility
    score ``s = exp(lbar_recv - lbar_src)`` and its parts, the reward, the weight and
    ``admitted``, whether the response enters the loss at all (``weight > 0``: the gate's
    ``s > delta`` under the compatibility weight; every response without the gate or under
    HACPO; the drawn ones under random admission)."""
    rows = []
    for q in prompts:
        for j, t in enumerate(u for u in groups[q].trajectories if u.source == "peer"):
            p = t.compat_parts
            rows.append(
                {
                    "step": step,
                    "source": source,
                    "receiver": receiver,
                    "direction": f"{source}_to_{receiver}",
                    "prompt": q,
                    "task_id": groups[q].task_id,
                    "response": j,
                    "s": t.compat,
                    "lbar_src": p.lbar_src if p else None,
                    "lbar_recv": p.lbar_recv if p else None,
                    "tokens_src": p.tokens_src if p else None,
                    "tokens_recv": p.tokens_recv if p else None,
                    "reward": t.reward,
                    "success": t.success,
                    "weight": t.weight,
                    "admitted": t.weight > 0,
                }
            )
    return rows


def exchange_metrics(
    va: dict[str, float],
    vb: dict[str, float],
    tr: Transfers,
    weights: Sequence[float],
    live_ab: Sequence[int] | None = None,
    live_ba: Sequence[int] | None = None,
) -> dict[str, float]:
    """A GRAFT step's metrics: both updates' (``a/...``, ``b/...``) and the exchange's
    (``graft/...``: transfers, complementary prompts, weights, HACPO's selection when
    restricted (``live_*``), the peer tokens' clip fraction)."""
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
    return values
