"""VH-GPO discovery (SPEC §2.2), pure: which states of a teacher recovery the student is
tested from, for ``relay.search: paper`` (``discovery``) and ``monotone``
(``discovery_monotone``, with ``known_failure``'s free failures; docs/search.md).

Each is a generator that yields ``StudentRequest``s and is sent the outcomes; it returns
{tested index: success}. ``salvage.core.relay.relay_search`` drives them.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

from salvage.core.relay_types import Outcome, RelayConfig, StudentRequest


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
