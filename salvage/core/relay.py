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
"""

from __future__ import annotations

import random
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

GROUP_SELECT = ("first", "random")
HANDOFF = ("earliest", "random", "none")
ANCHOR_ORDER = ("schedule", "random")
TEACHER_TIE_BREAK = ("first", "tokens")
RANDOM_FALLBACK = ("discard", "j_early")
PAIR_WALK = ("bridge", "recovery")
SEARCH = ("paper", "monotone")
RANDOM_EMPTY = "random handoff: no discovery success besides j_early"

# seed streams: discovery and confirmation never share a seed
_DISCOVERY_STREAM = 1_000_000
_CONFIRM_STREAM = 2_000_000
_TEACHER_STREAM = 3_000_000


@dataclass
class RelayConfig:
    """VH-GPO search settings (SPEC §2.1-2.4). Defaults are SPEC's unless marked ours."""

    max_groups: int = 2
    """Zero-signal groups rescued per update."""
    group_select: str = "first"
    """Which zero-signal groups: ``first`` in batch order (ours, default) or ``random``."""
    b_min: int = 5
    """Minimum remaining budget b_t = H - t of a candidate state (ours: SPEC gives no value)."""
    stride: int = 5
    """Backtracking stride of the anchor schedule (ours: SPEC gives no value)."""
    max_backtracks: int = 4
    """Backtracks of the anchor schedule after the deepest anchor (<= 6 anchors with the root)."""
    teacher_attempts: int = 2
    """Teacher attempts per anchor (so <= 2 x 6 = 12 per group)."""
    discovery_rollouts: int = 2
    """Student continuations per tested handoff state."""
    discovery_budget: int = 8
    """Student discovery rollouts per recovery."""
    confirm_rollouts: int = 4
    """Fresh continuations from s_j*; at least one must succeed."""
    handoff: str = "earliest"
    """``earliest`` (VH-GPO), ``random`` (Random Verified Handoff), ``none`` (No Handoff)."""
    anchor_order: str = "schedule"
    """``schedule`` (VH-GPO) or ``random`` (Random Anchor Order: non-root permuted, root last)."""
    teacher_tie_break: str = "first"
    """Among equally short successful teacher attempts at one anchor (ours): ``first`` (the
    lowest attempt index) or ``tokens`` (fewest output tokens, then the lowest index)."""
    partial_tests: bool = False
    """Ours, off by default (SPEC §2.2: a state that cannot get its full ``discovery_rollouts``
    from the remaining budget is not tested). On: the last test takes what is left."""
    random_fallback: str = "discard"
    """Random Verified Handoff when S minus j_early is empty (the paper is silent; ours):
    ``discard`` (default: the ablation never hands off at the earliest success, so what it
    trains on differs from VH-GPO only in the handoff point; discards are counted in
    ``relay/random_fallbacks``) or ``j_early`` (hand off at j_early: the same relay count as
    VH-GPO, but those relays are VH-GPO's own)."""
    pair_walk: str = "bridge"
    """How far the pair's first-divergence walk goes: ``bridge`` (SPEC §2.3: teacher actions
    up to j*) or ``recovery`` (ours: the whole teacher recovery, so a bridge equal to the
    backbone still yields a pair when they diverge after j*)."""
    search: str = "paper"
    """Handoff search before confirmation: ``paper`` (SPEC §2.2: backward exponential jumps, then
    a step-by-step scan up from the first failure) or ``monotone`` (ours, docs/search.md: the
    same jumps under a monotonicity prior; continuations one at a time, a test stops at its
    first success; states the group's own failed episodes continued from at least
    ``discovery_rollouts`` times count as failures without rollouts; bisection between the
    deepest failure and the earliest success). Same budget, same confirmation and replay."""

    def __post_init__(self) -> None:
        def need(ok: bool, key: str, val: Any, why: str) -> None:
            if not ok:
                raise ValueError(f"relay.{key}={val!r} {why}")

        need(self.max_groups >= 0, "max_groups", self.max_groups, "must be >= 0")
        need(
            self.group_select in GROUP_SELECT,
            "group_select",
            self.group_select,
            f"must be one of {GROUP_SELECT}",
        )
        need(self.b_min >= 1, "b_min", self.b_min, "must be >= 1")
        need(self.stride >= 1, "stride", self.stride, "must be >= 1")
        need(self.max_backtracks >= 0, "max_backtracks", self.max_backtracks, "must be >= 0")
        need(self.teacher_attempts >= 1, "teacher_attempts", self.teacher_attempts, "must be >= 1")
        need(
            self.discovery_rollouts >= 1,
            "discovery_rollouts",
            self.discovery_rollouts,
            "must be >= 1",
        )
        need(self.discovery_budget >= 1, "discovery_budget", self.discovery_budget, "must be >= 1")
        need(self.confirm_rollouts >= 1, "confirm_rollouts", self.confirm_rollouts, "must be >= 1")
        need(self.handoff in HANDOFF, "handoff", self.handoff, f"must be one of {HANDOFF}")
        need(
            self.anchor_order in ANCHOR_ORDER,
            "anchor_order",
            self.anchor_order,
            f"must be one of {ANCHOR_ORDER}",
        )
        need(
            self.teacher_tie_break in TEACHER_TIE_BREAK,
            "teacher_tie_break",
            self.teacher_tie_break,
            f"must be one of {TEACHER_TIE_BREAK}",
        )
        need(
            self.random_fallback in RANDOM_FALLBACK,
            "random_fallback",
            self.random_fallback,
            f"must be one of {RANDOM_FALLBACK}",
        )
        need(
            self.pair_walk in PAIR_WALK, "pair_walk", self.pair_walk, f"must be one of {PAIR_WALK}"
        )
        need(self.search in SEARCH, "search", self.search, f"must be one of {SEARCH}")
        need(
            self.partial_tests or self.discovery_budget >= self.discovery_rollouts,
            "discovery_budget",
            self.discovery_budget,
            f"is below relay.discovery_rollouts={self.discovery_rollouts}: no state could get its "
            "full count, so nothing would be tested (SPEC §2.2; relay.partial_tests: true allows "
            "a smaller last test)",
        )

    def check_horizon(self, max_turns: int) -> None:
        """Cross-field check against the episode cap H (fails before any compute)."""
        if self.b_min > max_turns:
            raise ValueError(
                f"relay.b_min={self.b_min} exceeds the episode cap H = data.max_turns = {max_turns}"
            )


# --------------------------------------------------------------------------- requests


@dataclass
class TeacherRequest:
    """Run ``len(seeds)`` teacher attempts from anchor depth ``anchor`` of the backbone."""

    anchor: int
    seeds: list[int]


@dataclass
class StudentRequest:
    """Run student continuations from state ``j`` of the kept teacher recovery."""

    kind: str  # "discovery" | "confirm"
    j: int
    seeds: list[int]
    recovery: Outcome | None = None
    """The kept teacher recovery whose state j the continuations start from."""


@dataclass
class ReplayRequest:
    """Replay prefix + bridge + resume from the initial state; the answer is won (bool)."""

    anchor: int
    j: int
    resume: Outcome | None
    """The kept confirmation continuation (None: no resume, e.g. No Handoff)."""
    recovery: Outcome | None = None


@dataclass
class Outcome:
    """What one rollout did, as the shell reports it."""

    success: bool
    n_actions: int = 0
    output_tokens: int = 0
    seed: int = 0
    restored: bool = True
    """False when the start state failed to restore (the rollout never ran)."""
    ref: Any = None
    """Opaque handle of the shell (e.g. its episode), passed through untouched."""
    path: list[Any] = field(default_factory=list)
    """The rollout's steps as comparable items (the shell: (action, observation) pairs); the
    ``monotone`` search matches a teacher recovery's path against the group's own episodes."""


@dataclass
class RelayResult:
    """What the search found (``retained``) or why it discarded the group."""

    retained: bool
    reason: str = ""
    anchor: int | None = None
    anchors_tried: list[int] = field(default_factory=list)
    recovery: Outcome | None = None
    L: int = 0
    j_star: int | None = None
    j_early: int | None = None
    discovery: dict[int, bool] = field(default_factory=dict)
    """Tested index -> discovery success, in test order."""
    resume: Outcome | None = None
    teacher_attempts: int = 0
    discovery_rollouts: int = 0
    confirm_rollouts: int = 0
    recovered: bool = False
    teacher_tokens: int = 0
    search_tokens: int = 0
    confirm_tokens: int = 0
    random_fallback: bool = False
    """Random Verified Handoff found S minus j_early empty (``relay.random_fallback`` applied)."""
    search: str = "paper"
    """The search strategy that ran (``relay.search``)."""
    known_failure: int | None = None
    """``monotone``: the deepest recovery index the group's own episodes showed as a failure."""

    def handoff(self) -> tuple[int, int, Outcome]:
        """(anchor, j_star, teacher recovery) of a retained relay."""
        if not self.retained or self.anchor is None or self.j_star is None:
            raise ValueError(f"a discarded search has no handoff ({self.reason})")
        if self.recovery is None:
            raise ValueError("a retained relay without a teacher recovery")
        return self.anchor, self.j_star, self.recovery


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


def backward_jumps(L: int) -> list[int]:
    """Discovery's backward indices L-1, L-2, L-4, ... clamped at 0, without repeats."""
    out: list[int] = []
    k = 0
    while True:
        j = max(0, L - 2**k)
        if j not in out:
            out.append(j)
        if j == 0:
            return out
        k += 1


# --------------------------------------------------------------------------- search

Search = Generator[Any, Any, RelayResult]


def discovery(
    L: int, cfg: RelayConfig, seeds: list[int], recovery: Outcome | None = None
) -> Generator[StudentRequest, list[Outcome], dict[int, bool]]:
    """SPEC §2.2 discovery + refinement. Yields student requests; returns {j: success}."""
    budget = cfg.discovery_budget
    tested: dict[int, bool] = {}

    def can_test() -> bool:  # SPEC: only with the full count (ours, switchable: partial)
        return budget >= (1 if cfg.partial_tests else cfg.discovery_rollouts)

    def test(j: int):  # noqa: ANN202 - a sub-generator
        nonlocal budget
        n = min(cfg.discovery_rollouts, budget)  # < discovery_rollouts only with partial_tests
        batch = [seeds.pop(0) for _ in range(n)]
        outs = yield StudentRequest("discovery", j, batch, recovery)
        budget -= n
        tested[j] = any(o.restored and o.success for o in outs)
        return tested[j]

    failed_at = None
    for j in backward_jumps(L):
        if not can_test():
            return tested
        ok = yield from test(j)
        if not ok:
            failed_at = j
            break
    if failed_at is None:
        return tested
    successes = [j for j, s in tested.items() if s]
    upper = min(successes) if successes else L
    for j in range(failed_at + 1, upper):
        if not can_test():
            break
        if (yield from test(j)):
            break
    return tested


def known_failure(
    prefix: Sequence[Any],
    recovery_path: Sequence[Any],
    group_paths: Sequence[Sequence[Any]],
    L: int,
    need: int,
) -> int | None:
    """Deepest recovery index j < L whose state the group's own failed episodes left >= need times.

    ``prefix``: the backbone's path up to the anchor; ``recovery_path``: the teacher recovery's
    path from the anchor; ``group_paths``: the paths, from the initial state, of the group's
    failed episodes (the backbone included). An episode whose path starts with
    ``prefix + recovery_path[:j]`` and goes on past it passed through s_j and then failed: one
    free continuation of the behaviour policy from s_j with s_j's remaining budget, the very
    thing a discovery rollout draws. ``need`` such failures (``discovery_rollouts``) make s_j a
    discovery failure at no cost (ours, ``relay.search: monotone``; docs/search.md).
    """
    a = len(prefix)
    best = None
    for j in range(L):
        p = list(prefix) + list(recovery_path[:j])
        n = sum(1 for g in group_paths if len(g) > a + j and list(g[: a + j]) == p)
        if n >= need:
            best = j
        else:  # the episodes that leave s_{j+1} all left s_j first: counts never grow
            break
    return best


def discovery_monotone(
    L: int,
    cfg: RelayConfig,
    seeds: list[int],
    recovery: Outcome | None = None,
    known_fail: int | None = None,
) -> Generator[StudentRequest, list[Outcome], dict[int, bool]]:
    """``relay.search: monotone`` (ours, docs/search.md). Yields student requests; returns
    {j: success} of the tested states, like ``discovery``.

    A monotonicity prior: success from s_j makes success from any later state of the same
    recovery likely, failure from s_j failure from any earlier one. Same budget and the same
    test as SPEC §2.2 (a state is tested only when the budget holds its full
    ``discovery_rollouts``; it is a success when one continuation succeeds), but:
    1. a test asks for one continuation at a time and stops at its first success (the answer
       is the same as asking for all at once; the rollouts it did not need stay in the budget);
    2. ``known_fail`` (``known_failure``: the group's own episodes) is a failure at no cost, and
       by the prior so is every earlier state;
    3. the backward jumps L-1, L-2, L-4, ... stop at the first failure or at ``known_fail``;
       then bisection between the deepest failure ``lo`` and the earliest success ``hi``
       (mid = (lo + hi) // 2) instead of the step-by-step scan up from ``lo``.
    """
    budget = cfg.discovery_budget
    tested: dict[int, bool] = {}

    def can_test() -> bool:
        return budget >= (1 if cfg.partial_tests else cfg.discovery_rollouts)

    def test(j: int):  # noqa: ANN202 - a sub-generator
        nonlocal budget
        n = min(cfg.discovery_rollouts, budget)
        ok = False
        for _ in range(n):
            outs = yield StudentRequest("discovery", j, [seeds.pop(0)], recovery)
            budget -= 1
            if any(o.restored and o.success for o in outs):
                ok = True
                break
        tested[j] = ok
        return ok

    lo = -1 if known_fail is None else known_fail  # deepest failure (-1: none yet)
    hi = L  # earliest success (L: the teacher's terminal state)
    for j in backward_jumps(L):
        if j <= lo:
            break
        if not can_test():
            return tested
        if (yield from test(j)):
            hi = j
        else:
            lo = j
            break
    while hi - lo > 1 and lo >= 0 and can_test():
        mid = (lo + hi) // 2
        if (yield from test(mid)):
            hi = mid
        else:
            lo = mid
    return tested


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
    teacher_seed = seed + _TEACHER_STREAM
    # -- teacher recovery, anchor by anchor
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
            break
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

    # -- discovery (student continuations from recovery states)
    dseeds = [seed + _DISCOVERY_STREAM + k for k in range(cfg.discovery_budget)]
    if cfg.search == "monotone":
        res.known_failure = known_failure(
            list(backbone_path[: res.anchor]),
            res.recovery.path,
            group_paths,
            L,
            cfg.discovery_rollouts,
        )
        gen = discovery_monotone(L, cfg, dseeds, res.recovery, res.known_failure)
    else:
        gen = discovery(L, cfg, dseeds, res.recovery)
    tested: dict[int, bool]
    try:
        req = next(gen)
        while True:
            outs = yield req
            res.discovery_rollouts += len(req.seeds)
            res.search_tokens += sum(o.output_tokens for o in outs)
            req = gen.send(outs)
    except StopIteration as stop:
        tested = stop.value
    res.discovery = tested
    S = sorted(j for j, ok in tested.items() if ok)
    if not S:
        res.reason = "no discovery success"
        return res
    res.j_early = S[0]
    if cfg.handoff == "random":
        others = S[1:]
        if not others:  # the paper is silent here (ours): relay.random_fallback
            res.random_fallback = True
            if cfg.random_fallback == "discard":
                res.reason = RANDOM_EMPTY
                return res
            j_star = S[0]
        else:
            j_star = rng.choice(others)
    else:
        j_star = S[0]
    assert j_star < L  # SPEC: control returns before the teacher completes the task
    res.j_star = j_star

    # -- confirmation with fresh seeds
    cseeds = [seed + _CONFIRM_STREAM + k for k in range(cfg.confirm_rollouts)]
    outs = yield StudentRequest("confirm", j_star, cseeds, res.recovery)
    res.confirm_rollouts += len(cseeds)
    res.confirm_tokens += sum(o.output_tokens for o in outs)
    k = keep_resume(outs)
    if k is None:
        res.reason = "confirmation failed"
        return res
    res.resume = outs[k]

    # -- full replay from the initial state
    won = yield ReplayRequest(anchor, j_star, res.resume, res.recovery)
    if not won:
        res.reason = "replay failed"
        return res
    res.retained = True
    return res


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
