"""VH-GPO search vocabulary (SPEC §2), pure: its settings and what passes between the
search and its shell.

``RelayConfig`` holds every knob; the search (``salvage.core.relay``) yields
``TeacherRequest`` / ``StudentRequest`` / ``ReplayRequest`` and is told ``Outcome``s (a bool
for a replay); it returns a ``RelayResult``. All of these are importable from
``salvage.core.relay`` too.
"""

from __future__ import annotations

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
