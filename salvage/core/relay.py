"""VH-GPO verified handoff search (SPEC §2), pure.

No environment, model or Lightning here: the search is a generator that *asks* for work
and is *told* the outcome, so the shell can run the requests of many groups and many
candidates in one batched call, and tests can drive it with scripted outcomes and check
the exact order of what it asks.

    gen = relay_search(backbone, cfg, rng)
    req = next(gen)                    # a TeacherRequest / StudentRequest / ReplayRequest
    while True:
        try: req = gen.send(outcomes)  # list[Outcome] (or a bool for a ReplayRequest)
        except StopIteration as stop: result = stop.value; break

Every knob is a ``RelayConfig`` field with SPEC's default. Every rule that is ours (the
sources are silent) is a ``RelayConfig`` switch, named where it is implemented:
- ``group_select``: which zero-signal groups are rescued (default the first in batch order);
- ``teacher_tie_break``: among equally short successful teacher attempts at one anchor, the
  lowest attempt index wins (default ``first``) or the fewest output tokens (``tokens``);
- ``partial_tests``: SPEC §2.2 tests a state only with its full ``discovery_rollouts``
  (default ``False``); ``True`` lets the last test take what is left of the budget;
- ``random_fallback``: Random Verified Handoff with ``S \\ {j_early}`` empty discards the
  recovery (default ``discard``) or hands off at ``j_early`` (``j_early``);
- ``pair_walk``: the pair walk covers the bridge (default ``bridge``, SPEC §2.3) or the whole
  teacher recovery (``recovery``); either way it stops where the backbone ends (a pair
  needs the student's action at that turn, so there is no alternative there);
- ``search``: how discovery and refinement pick the states to test (beyond the paper,
  ``docs/search.md``): ``paper`` (default, SPEC §2.2) or ``monotone`` (``discovery_monotone``:
  one continuation at a time, the group's own failed episodes as free failures, bisection
  between a failure and a success). Confirmation and replay are the same for both.

The settings and the requests / outcomes / result types are in ``salvage.core.relay_types``,
discovery in ``salvage.core.relay_discovery``; every name is importable from here.
"""

from __future__ import annotations

import random
from collections.abc import Generator, Sequence
from typing import Any

from salvage.core.relay_discovery import (
    backward_jumps,
    discovery,
    discovery_monotone,
    known_failure,
)
from salvage.core.relay_types import (
    ANCHOR_ORDER,
    GROUP_SELECT,
    HANDOFF,
    PAIR_WALK,
    RANDOM_EMPTY,
    RANDOM_FALLBACK,
    SEARCH,
    TEACHER_TIE_BREAK,
    Outcome,
    RelayConfig,
    RelayResult,
    ReplayRequest,
    StudentRequest,
    TeacherRequest,
)

# seed streams: discovery and confirmation never share a seed
_DISCOVERY_STREAM = 1_000_000
_CONFIRM_STREAM = 2_000_000
_TEACHER_STREAM = 3_000_000


# --------------------------------------------------------------------------- pieces


def eligible_depths(num_actions: int, terminal: bool, max_turns: int, b_min: int) -> list[int]:
    """Recorded nonterminal states s_t of a failed trajectory with b_t = H - t >= b_min."""
    last = num_actions - 1 if terminal else num_actions  # s_T is nonterminal only if not done
    return [t for t in range(0, last + 1) if max_turns - t >= b_min]


def select_backbone(
    trajectories: Sequence[tuple[int, bool]], max_turns: int, b_min: int
) -> tuple[int, list[int]] | None:
    """(backbone index, its eligible depths): the deepest eligible candidate, ties -> lowest id.

    ``trajectories`` lists (number of actions, ended in a terminal state) per failed
    trajectory, in trajectory-id order. None when no trajectory is eligible or the
    backbone has no t = 0 candidate.
    """
    best: tuple[int, list[int]] | None = None
    for i, (n, terminal) in enumerate(trajectories):
        d = eligible_depths(n, terminal, max_turns, b_min)
        if d and (best is None or max(d) > max(best[1])):
            best = (i, d)
    if best is None or 0 not in best[1]:
        return None
    return best


def anchor_schedule(depths: Sequence[int], stride: int, max_backtracks: int) -> list[int]:
    """Deepest eligible depth, then up to ``max_backtracks`` jumps of >= ``stride``; root last."""
    cands = sorted(set(depths))
    if not cands:
        return []
    anchors = [cands[-1]]
    for _ in range(max_backtracks):
        below = [d for d in cands if d <= anchors[-1] - stride]
        if not below:
            break
        anchors.append(below[-1])
    if 0 not in anchors and 0 in cands:
        anchors.append(0)
    return anchors


def random_anchor_order(anchors: Sequence[int], rng: random.Random) -> list[int]:
    """Random Anchor Order ablation: permute the non-root anchors, the root stays last."""
    non_root = [a for a in anchors if a != 0]
    rng.shuffle(non_root)
    return non_root + ([0] if 0 in anchors else [])


def shortest_success(outcomes: Sequence[Outcome], tie_break: str = "first") -> int | None:
    """Index of the shortest successful attempt; ties (ours, ``relay.teacher_tie_break``):
    ``first`` -> the lowest index, ``tokens`` -> fewest output tokens, then the lowest index."""
    ok = [i for i, o in enumerate(outcomes) if o.restored and o.success]
    if not ok:
        return None
    if tie_break == "tokens":
        return min(ok, key=lambda i: (outcomes[i].n_actions, outcomes[i].output_tokens, i))
    return min(ok, key=lambda i: (outcomes[i].n_actions, i))


def keep_resume(outcomes: Sequence[Outcome]) -> int | None:
    """Kept resume: the successful one with fewest actions, ties by output tokens, then seed."""
    ok = [i for i, o in enumerate(outcomes) if o.restored and o.success]
    if not ok:
        return None
    return min(
        ok, key=lambda i: (outcomes[i].n_actions, outcomes[i].output_tokens, outcomes[i].seed)
    )


def first_divergence(bridge: Sequence[str], backbone_from_anchor: Sequence[str]) -> int | None:
    """First index where the bridge's and the failed backbone's executable actions differ."""
    for d, a in enumerate(bridge):
        if d >= len(backbone_from_anchor):
            return None  # ours: the backbone ended, nothing to compare against
        if a != backbone_from_anchor[d]:
            return d
    return None


# --------------------------------------------------------------------------- search

Search = Generator[Any, Any, RelayResult]


def relay_search(
    backbone_actions: Sequence[str],
    anchors: Sequence[int],
    cfg: RelayConfig,
    rng: random.Random,
    seed: int = 0,
    group_paths: Sequence[Sequence[Any]] = (),
    backbone_path: Sequence[Any] = (),
) -> Search:
    """The full search for one selected group, from its anchor list to a retained relay.

    ``backbone_actions``: the failed backbone's executed actions (for the pair walk).
    ``anchors``: the schedule (``anchor_schedule``; permuted for Random Anchor Order).
    ``group_paths``, ``backbone_path``: the group's failed episodes' and the backbone's paths
    (``Outcome.path`` items) from the initial state, for ``relay.search: monotone``'s free
    failures (``known_failure``); unused by ``paper``.
    """
    res = RelayResult(retained=False, anchors_tried=[], search=cfg.search)
    yield from _teacher_recovery(anchors, cfg, seed, res)
    if res.recovery is None:
        res.reason = "no teacher recovery from any anchor"
        return res
    res.recovered = True
    anchor, L = res.anchor, res.L
    assert anchor is not None  # set together with the recovery
    if L < 1:
        res.reason = "teacher recovery has no actions"
        return res

    if cfg.handoff == "none":  # No Handoff ablation: the whole recovery is the bridge
        res.j_star = L
        won = yield ReplayRequest(anchor, L, None, res.recovery)
        res.retained, res.reason = bool(won), "" if won else "replay failed"
        return res

    res.discovery = yield from _discover(cfg, seed, res, group_paths, backbone_path)
    j_star = _handoff_index(res, cfg, rng)
    if j_star is None:
        return res
    assert j_star < L  # SPEC: control returns before the teacher completes the task
    res.j_star = j_star
    yield from _confirm_and_replay(anchor, j_star, cfg, seed, res)
    return res


def _teacher_recovery(
    anchors: Sequence[int], cfg: RelayConfig, seed: int, res: RelayResult
) -> Generator[TeacherRequest, list[Outcome], None]:
    """Teacher attempts, anchor by anchor, until one succeeds: sets ``res.anchor``,
    ``res.recovery`` (the shortest success there) and ``res.L``; counts attempts and tokens."""
    teacher_seed = seed + _TEACHER_STREAM
    for a in anchors:
        seeds = [teacher_seed + k for k in range(cfg.teacher_attempts)]
        teacher_seed += cfg.teacher_attempts
        outs = yield TeacherRequest(a, seeds)
        res.anchors_tried.append(a)
        res.teacher_attempts += sum(o.restored for o in outs)
        res.teacher_tokens += sum(o.output_tokens for o in outs)
        best = shortest_success(outs, cfg.teacher_tie_break)
        if best is not None:
            res.anchor, res.recovery, res.L = a, outs[best], outs[best].n_actions
            return


def _discover(
    cfg: RelayConfig,
    seed: int,
    res: RelayResult,
    group_paths: Sequence[Sequence[Any]],
    backbone_path: Sequence[Any],
) -> Generator[StudentRequest, list[Outcome], dict[int, bool]]:
    """Student continuations from the kept recovery's states (``relay.search`` picks which);
    counts their rollouts and tokens; returns {tested index: success}."""
    recovery = res.recovery
    assert recovery is not None
    L = res.L
    dseeds = [seed + _DISCOVERY_STREAM + k for k in range(cfg.discovery_budget)]
    if cfg.search == "monotone":
        res.known_failure = known_failure(
            list(backbone_path[: res.anchor]),
            recovery.path,
            group_paths,
            L,
            cfg.discovery_rollouts,
        )
        gen = discovery_monotone(L, cfg, dseeds, recovery, res.known_failure)
    else:
        gen = discovery(L, cfg, dseeds, recovery)
    try:
        req = next(gen)
        while True:
            outs = yield req
            res.discovery_rollouts += len(req.seeds)
            res.search_tokens += sum(o.output_tokens for o in outs)
            req = gen.send(outs)
    except StopIteration as stop:
        tested: dict[int, bool] = stop.value
        return tested


def _handoff_index(res: RelayResult, cfg: RelayConfig, rng: random.Random) -> int | None:
    """j*, the handoff among the discovery successes S (``relay.handoff``), and
    ``res.j_early``; None when the search ends here (``res.reason`` says why)."""
    S = sorted(j for j, ok in res.discovery.items() if ok)
    if not S:
        res.reason = "no discovery success"
        return None
    res.j_early = S[0]
    if cfg.handoff != "random":
        return S[0]
    others = S[1:]
    if others:
        return rng.choice(others)
    res.random_fallback = True  # the paper is silent here (ours): relay.random_fallback
    if cfg.random_fallback == "discard":
        res.reason = RANDOM_EMPTY
        return None
    return S[0]


def _confirm_and_replay(
    anchor: int, j_star: int, cfg: RelayConfig, seed: int, res: RelayResult
) -> Generator[StudentRequest | ReplayRequest, Any, None]:
    """Confirmation from s_j* with fresh seeds (keeps the resume), then the full replay from
    the initial state; sets ``res.retained`` when both succeed."""
    cseeds = [seed + _CONFIRM_STREAM + k for k in range(cfg.confirm_rollouts)]
    outs = yield StudentRequest("confirm", j_star, cseeds, res.recovery)
    res.confirm_rollouts += len(cseeds)
    res.confirm_tokens += sum(o.output_tokens for o in outs)
    k = keep_resume(outs)
    if k is None:
        res.reason = "confirmation failed"
        return
    res.resume = outs[k]
    won = yield ReplayRequest(anchor, j_star, res.resume, res.recovery)
    if not won:
        res.reason = "replay failed"
        return
    res.retained = True


def pair_index(
    recovery_actions: Sequence[str],
    backbone_actions: Sequence[str],
    anchor: int,
    j_star: int,
    walk: str = "bridge",
) -> int | None:
    """Index into the recovery of the action-preference pair (first divergence), if any.

    ``walk`` (``relay.pair_walk``): ``bridge`` compares the teacher's first ``j_star`` actions
    (SPEC §2.3), ``recovery`` all of them (ours). Either stops where the backbone ends.
    """
    limit = j_star if walk == "bridge" else len(recovery_actions)
    return first_divergence(list(recovery_actions[:limit]), list(backbone_actions[anchor:]))


def select_groups(zero_signal: Sequence[int], cfg: RelayConfig, rng: random.Random) -> list[int]:
    """Which zero-signal groups to rescue this update (at most ``max_groups``)."""
    if cfg.group_select == "random":
        picked = list(zero_signal)
        rng.shuffle(picked)
        return sorted(picked[: cfg.max_groups])
    return list(zero_signal)[: cfg.max_groups]


def select_groups_across_ranks(
    zero_signal: Sequence[Sequence[int]], cfg: RelayConfig, rng: random.Random
) -> list[list[int]]:
    """Per rank, which of its zero-signal groups to rescue: at most ``max_groups`` in all.

    ``zero_signal[r]``: rank r's zero-signal group indices (into its own batch). Ranks hold
    contiguous slices of the global batch in rank order, so rank-major order is the global
    batch order; the choice is ``select_groups`` on the whole batch (every rank computes the
    same, with ``rng`` seeded alike), mapped back to each rank's indices. SPEC §2: "per
    update" means across all processes.
    """
    flat = [(r, i) for r, idx in enumerate(zero_signal) for i in idx]
    picked = select_groups(list(range(len(flat))), cfg, rng)
    out: list[list[int]] = [[] for _ in zero_signal]
    for k in picked:
        r, i = flat[k]
        out[r].append(i)
    return out


__all__ = [
    "ANCHOR_ORDER",
    "GROUP_SELECT",
    "HANDOFF",
    "PAIR_WALK",
    "RANDOM_EMPTY",
    "RANDOM_FALLBACK",
    "SEARCH",
    "TEACHER_TIE_BREAK",
    "Outcome",
    "RelayConfig",
    "RelayResult",
    "ReplayRequest",
    "Search",
    "StudentRequest",
    "TeacherRequest",
    "anchor_schedule",
    "backward_jumps",
    "discovery",
    "discovery_monotone",
    "eligible_depths",
    "first_divergence",
    "keep_resume",
    "known_failure",
    "pair_index",
    "random_anchor_order",
    "relay_search",
    "select_backbone",
    "select_groups",
    "select_groups_across_ranks",
    "shortest_success",
]
