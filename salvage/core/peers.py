"""Trajectory exchange among N >= 2 peers (GRAFT generalised; docs/peers.md), pure.

GRAFT (SPEC §3) pairs two models. With N models every ordered pair (source, receiver) is a
direction. The rules below are ours (the paper names N peers as future work); with N = 2
they reduce to ``core.graft.select_transfers`` exactly, random draws included:

1. **Source choice.** For a receiver r and a prompt q, the candidates are the peers s whose
   group is complementary to r's (``core.graft.complementary``: r solved none, s some but
   not all). One candidate: it is the source. Several: ``source_rule``
   - ``compat`` (default): the candidate whose responses r finds most compatible (the
     highest mean ``min(s, 1)`` of the compatibility scores ``exp(lbar_r - lbar_s)``, the
     weight GRAFT would give without its gate), ties by more successes, then lower index;
   - ``successes``: the candidate with most successes, ties by lower index;
   - ``random``: uniformly among the candidates (one draw per such prompt).
2. **Balancing per unordered pair.** For peers i < j (pairs in index order), the
   directions i -> j and j -> i are balanced against each other exactly as GRAFT's two
   directions (``min_ratio``: each transfers at most ``ceil(rho * max(m_other, 1))`` of
   its proposed prompts, drawn uniformly, i -> j drawn first).

Ordered pairs are visited in ``pair_order``: (0, 1), (1, 0), (0, 2), (2, 0), (1, 2), ...
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from salvage.core.graft import BALANCE, complementary
from salvage.errors import ConfigError

SOURCE_RULES = ("compat", "successes", "random")

Pair = tuple[int, int]
"""An ordered pair (source index, receiver index)."""


def pair_order(n_models: int) -> list[Pair]:
    """Every ordered pair, unordered pairs in index order, i -> j before j -> i."""
    return [p for i in range(n_models) for j in range(i + 1, n_models) for p in ((i, j), (j, i))]


def candidates(k: Sequence[Sequence[int]], receiver: int, q: int, n: int) -> list[int]:
    """The peers whose group on prompt ``q`` is complementary to ``receiver``'s."""
    return [s for s in range(len(k)) if s != receiver and complementary(k[receiver][q], k[s][q], n)]


def choose_sources(
    k: Sequence[Sequence[int]],
    n: int,
    rng: random.Random,
    rule: str = "compat",
    compat: Callable[[int, int, int], float] | None = None,
) -> dict[Pair, list[int]]:
    """Step 1: per ordered pair (source, receiver), the prompts where that source was chosen.

    ``k[i][q]``: model i's successes on prompt q out of ``n``. ``compat(s, r, q)``: the mean
    capped compatibility of s's responses on q under r (called only when q has several
    candidates and ``rule == "compat"``). Receivers in index order, prompts in order.
    """
    if rule not in SOURCE_RULES:
        raise ConfigError(f"model.source_rule must be one of {SOURCE_RULES}, got {rule!r}")
    n_models = len(k)
    if n_models < 2:
        raise ValueError(f"an exchange needs at least 2 models, got {n_models}")
    n_prompts = len(k[0])
    for i, row in enumerate(k):
        if len(row) != n_prompts:
            raise ValueError(
                f"success counts of model {i} cover {len(row)} prompts, model 0's {n_prompts}"
            )
    out: dict[Pair, list[int]] = {p: [] for p in pair_order(n_models)}
    for r in range(n_models):
        for q in range(n_prompts):
            cand = candidates(k, r, q, n)
            if not cand:
                continue
            if len(cand) == 1:
                src = cand[0]
            elif rule == "random":
                src = rng.choice(cand)
            elif rule == "successes":
                src = min(cand, key=lambda s: (-k[s][q], s))
            else:
                if compat is None:
                    raise ValueError("source_rule 'compat' needs the compatibility scores")
                scores = {s: compat(s, r, q) for s in cand}
                src = min(cand, key=lambda s: (-scores[s], -k[s][q], s))
            out[(src, r)].append(q)
    return out


def balance_pairs(
    proposed: dict[Pair, list[int]],
    n_models: int,
    rng: random.Random,
    balance: str = "min_ratio",
    rho: float = 1.0,
) -> dict[Pair, list[int]]:
    """Step 2: GRAFT's direction balancing on every unordered pair (i -> j drawn first)."""
    if balance not in BALANCE:
        raise ConfigError(f"model.balance must be one of {BALANCE}, got {balance!r}")
    out = {p: list(proposed.get(p, [])) for p in pair_order(n_models)}
    if balance != "min_ratio":
        return out
    for i, j in pair_order(n_models)[::2]:  # (i, j) with i < j, each unordered pair once
        m_ij, m_ji = len(out[(i, j)]), len(out[(j, i)])
        cap_ij = math.ceil(rho * max(m_ji, 1))
        cap_ji = math.ceil(rho * max(m_ij, 1))
        if m_ij > cap_ij:
            out[(i, j)] = sorted(rng.sample(out[(i, j)], cap_ij))
        if m_ji > cap_ji:
            out[(j, i)] = sorted(rng.sample(out[(j, i)], cap_ji))
    return out


def capped_mean_compat(scores: Sequence[float]) -> float:
    """The source-choice score of one candidate group: mean of ``min(s, 1)`` (0 if empty)."""
    if not scores:
        return 0.0
    return sum(min(s, 1.0) for s in scores) / len(scores)


def transfer_matrix(counts: dict[str, float], names: Sequence[str]) -> list[list[float]]:
    """``M[s][r]``: groups sent by ``names[s]`` to ``names[r]``, from metrics keyed
    ``<s>_to_<r>`` (missing pairs count 0; the diagonal is 0)."""
    return [[float(counts.get(f"{s}_to_{r}", 0.0)) for r in names] for s in names]
