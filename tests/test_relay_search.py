"""``relay.search: monotone`` (docs/search.md) against the paper's search (SPEC §2.2), with
scripted outcomes: exact request order, same or earlier j* with fewer student rollouts on
monotone success profiles, what it does on a non-monotone one, and the free failures from the
group's own episodes. ``paper`` itself is pinned by tests/test_relay_core.py."""

from __future__ import annotations

import random

import pytest
from test_relay_core import drive  # scripted answers -> (result, log of requests)

from salvage.core.relay import (
    Outcome,
    RelayConfig,
    StudentRequest,
    known_failure,
    relay_search,
)


def run(
    L,
    ok,
    search,
    budget=8,
    rollouts=2,
    first_fails=(),
    group_paths=(),
    backbone_path=(),
    recovery_path=(),
):
    """Search one recovery of L actions from the root anchor.

    ``ok(j)``: does a student continuation from s_j succeed. ``first_fails``: states whose
    first continuation fails whatever ``ok`` says (a stochastic state that needs two draws).
    Returns (result, [(j, number of seeds) per discovery request], student rollouts).
    """
    cfg = RelayConfig(discovery_budget=budget, discovery_rollouts=rollouts, search=search)
    drawn: dict[int, int] = {}

    def student(req):
        res = []
        for sd in req.seeds:
            k = drawn.get(req.j, 0) if req.kind == "discovery" else 1
            if req.kind == "discovery":
                drawn[req.j] = k + 1
            res.append(Outcome(ok(req.j) and not (k == 0 and req.j in first_fails), 2, 5, sd))
        return res

    res, log = drive(
        relay_search(
            ["x"] * 50,
            [0],
            cfg,
            random.Random(0),
            group_paths=group_paths,
            backbone_path=backbone_path,
        ),
        teacher=lambda r: (
            [Outcome(True, n_actions=L, path=list(recovery_path))]
            + [Outcome(False)] * (len(r.seeds) - 1)
        ),
        student=student,
    )
    disc = [
        (r.j, len(r.seeds)) for r in log if isinstance(r, StudentRequest) and r.kind == "discovery"
    ]
    n = sum(len(r.seeds) for r in log if isinstance(r, StudentRequest))
    return res, disc, n


def threshold(k):
    return lambda j: j >= k


# ---------------------------------------------------------------- exact request order


def test_monotone_request_order_one_continuation_at_a_time():
    # L = 10, success from j >= 7 (budget 8, 2 per state).
    # paper: 9 S (2), 8 S (2), 6 F (2), scan up: 7 S (2) -> j* = 7, 8 discovery rollouts.
    res, disc, n = run(10, threshold(7), "paper")
    assert disc == [(9, 2), (8, 2), (6, 2), (7, 2)] and res.j_star == 7
    assert res.discovery_rollouts == 8 and n == 8 + 4  # + 4 confirmation
    # monotone: 9 S on its first draw (1), 8 S (1), 6 F, F (2: both draws needed), bracket
    # (6, 8): mid 7 S (1) -> j* = 7 with 5 discovery rollouts, one request per draw.
    res, disc, n = run(10, threshold(7), "monotone")
    assert disc == [(9, 1), (8, 1), (6, 1), (6, 1), (7, 1)]
    assert res.j_star == 7 and res.discovery_rollouts == 5 and n == 5 + 4
    assert res.discovery == {9: True, 8: True, 6: False, 7: True} and res.search == "monotone"


def test_monotone_bisects_where_the_paper_scans():
    # budget 16, L = 16, success from j >= 11.
    # paper: 15 S, 14 S, 12 S, 8 F, scan up 9 F, 10 F, 11 S -> j* = 11, 7 tests x 2 = 14.
    res, disc, _ = run(16, threshold(11), "paper", budget=16)
    assert [j for j, _ in disc] == [15, 14, 12, 8, 9, 10, 11] and res.discovery_rollouts == 14
    # monotone: 15, 14, 12 S (1 each), 8 F (2), bisect (8, 12): 10 F (2), (10, 12): 11 S (1)
    # -> j* = 11 with 8 rollouts.
    res, disc, _ = run(16, threshold(11), "monotone", budget=16)
    assert disc == [(15, 1), (14, 1), (12, 1), (8, 1), (8, 1), (10, 1), (10, 1), (11, 1)]
    assert res.j_star == 11 and res.discovery_rollouts == 8


def test_monotone_second_draw_when_the_first_fails():
    # s_9 succeeds only on its second draw: the test still counts it a success (any of 2)
    res, disc, _ = run(10, threshold(9), "monotone", first_fails={9})
    assert disc == [(9, 1), (9, 1), (8, 1), (8, 1)] and res.j_star == 9
    # the paper asks for both at once and gets the same answer
    res_p, disc_p, _ = run(10, threshold(9), "paper", first_fails={9})
    assert disc_p == [(9, 2), (8, 2)] and res_p.j_star == 9


def test_monotone_keeps_the_full_count_rule():
    # budget 3, 2 per state: 9 S (1), 8 S (1), 1 left < 2: 6 is not tested (SPEC §2.2 rule)
    res, disc, _ = run(10, threshold(0), "monotone", budget=3)
    assert disc == [(9, 1), (8, 1)] and res.j_star == 8 and res.discovery_rollouts == 2


def test_confirmation_and_replay_are_the_papers():
    res_p, _, _ = run(10, threshold(7), "paper")
    res_m, _, _ = run(10, threshold(7), "monotone")
    assert res_m.j_star == res_p.j_star and res_m.retained and res_p.retained
    assert res_m.confirm_rollouts == res_p.confirm_rollouts == 4
    assert res_m.resume.seed == res_p.resume.seed  # same fresh confirmation seeds


# ---------------------------------------------------------------- monotone profiles, counted


@pytest.mark.parametrize(
    ("L", "k", "paper", "mono"),
    [
        # success from j >= k; (j*, discovery rollouts); budget 8, 2 per state. S/F: success /
        # failure, (n): rollouts that test used.
        # 9 F (2) for both: discard
        (10, 10, (None, 2), (None, 2)),
        # paper 9S 8F = 4; monotone 9S(1) 8F(2) = 3
        (10, 9, (9, 4), (9, 3)),
        # paper 9S 8S 6F, scan 7F = 8; monotone 9S(1) 8S(1) 6F(2), bisect (6, 8): 7F(2) = 6
        (10, 8, (8, 8), (8, 6)),
        # paper 9S 8S 6S 2F = 8, budget spent; monotone 3 + 2F(2), bisect (2, 6): 4F(2) = 7
        (10, 6, (6, 8), (6, 7)),
        # paper as above -> 6; monotone 3 + 2F(2), 4S(1), bisect (2, 4): 3F(2) = 8 -> 4
        (10, 4, (6, 8), (4, 8)),
        # paper 9S 8S 6S 2S = 8 -> 2; monotone 9, 8, 6, 2, 0 S(1 each) = 5 -> 0
        (10, 0, (2, 8), (0, 5)),
        # L = 4, jumps 3, 2, 0: paper 3S 2S 0F, scan 1S = 8; monotone 1 + 1 + 2 + 1 = 5
        (4, 1, (1, 8), (1, 5)),
    ],
)
def test_hand_counted_profiles(L, k, paper, mono):
    res, _, _ = run(L, threshold(k), "paper")
    assert (res.j_early, res.discovery_rollouts) == paper
    res, _, _ = run(L, threshold(k), "monotone")
    assert (res.j_early, res.discovery_rollouts) == mono


@pytest.mark.parametrize(("budget", "rollouts"), [(8, 2), (4, 2), (16, 2), (12, 3)])
def test_every_monotone_profile_same_or_earlier_with_no_more_rollouts(budget, rollouts):
    # every recovery length L = 1..24 and threshold k = 0..L (k = L: the student never
    # succeeds): the monotone search never hands off later nor uses more discovery rollouts,
    # and uses fewer in total. At the paper's budget (8, 2 per state), of the 324 profiles:
    # 232 use fewer rollouts, 136 hand off earlier; 1998 rollouts in all against 2340.
    fewer = earlier = total_p = total_m = 0
    for L in range(1, 25):
        for k in range(L + 1):
            p, _, _ = run(L, threshold(k), "paper", budget, rollouts)
            m, _, _ = run(L, threshold(k), "monotone", budget, rollouts)
            jp = L if p.j_early is None else p.j_early
            jm = L if m.j_early is None else m.j_early
            assert jm <= jp, (L, k)
            assert m.discovery_rollouts <= p.discovery_rollouts, (L, k)
            fewer += m.discovery_rollouts < p.discovery_rollouts
            earlier += jm < jp
            total_p += p.discovery_rollouts
            total_m += m.discovery_rollouts
    assert fewer > 0 and total_m < total_p
    if (budget, rollouts) == (8, 2):
        assert (fewer, earlier, total_p, total_m) == COUNTS_8_2


COUNTS_8_2 = (232, 136, 2340, 1998)


def test_one_rollout_per_state_can_hand_off_later():
    # discovery_rollouts = 1: no draw to save, and bisection under a tight budget can stop
    # with a wider bracket than the paper's scan (documented in docs/search.md).
    # L = 16, budget 5, success from j >= 9: paper 15S 14S 12S 8F, scan 9S -> 9 (5 rollouts);
    # monotone 15S 14S 12S 8F, bisect (8, 12): 10S, budget spent -> 10.
    p, _, _ = run(16, threshold(9), "paper", budget=5, rollouts=1)
    m, disc, _ = run(16, threshold(9), "monotone", budget=5, rollouts=1)
    assert p.j_early == 9 and m.j_early == 10 and [j for j, _ in disc] == [15, 14, 12, 8, 10]


# ---------------------------------------------------------------- non-monotone profile


def test_non_monotone_profile_bisection_trusts_the_prior():
    # budget 16, L = 16, successes at {15, 14, 12, 9} only (10 and 11 fail, 9 succeeds):
    # paper: 15S 14S 12S 8F, scan up 9S -> j* = 9 (10 rollouts).
    # monotone: 15S 14S 12S (1 each) 8F (2), bisect (8, 12): 10F (2), (10, 12): 11F (2)
    # -> j* = 12 (9 rollouts): the prior says 10 failing means 9 fails; it never tests 9.
    ok = {15, 14, 12, 9}.__contains__
    p, disc_p, _ = run(16, ok, "paper", budget=16)
    m, disc_m, _ = run(16, ok, "monotone", budget=16)
    assert [j for j, _ in disc_p] == [15, 14, 12, 8, 9] and p.j_star == 9
    assert disc_m == [(15, 1), (14, 1), (12, 1), (8, 1), (8, 1), (10, 1), (10, 1), (11, 1), (11, 1)]
    assert m.j_star == 12 and m.retained  # later, still confirmed and replayed


# ---------------------------------------------------------------- the group's own episodes


def test_known_failure_counts_episodes_that_left_a_state():
    rec = ["r0", "r1", "r2"]
    group = [["r0", "x"], ["r0", "r1", "y"], ["r0", "z", "z"], ["q"]]
    # s_0 (empty prefix): all 4 left it; s_1 ("r0"): 3 left it; s_2 ("r0", "r1"): 1 -> stop
    assert known_failure([], rec, group, L=3, need=2) == 1
    assert known_failure([], rec, group, L=3, need=4) == 0
    assert known_failure([], rec, group, L=3, need=5) is None
    # an episode that ENDS at s_1 did not continue from it: not evidence
    assert known_failure([], rec, [["r0"], ["r0"]], L=3, need=2) == 0
    # non-root anchor: the prefix is the backbone's path up to the anchor
    assert known_failure(["b0"], rec, [["b0", "r0", "x"], ["b0", "r0", "y"]], L=3, need=2) == 1
    assert known_failure(["b0"], rec, [["c0", "r0", "x"], ["b0", "r0", "y"]], L=3, need=2) is None


def test_group_failures_replace_rollouts():
    # L = 4 from the root; two of the group's episodes followed the teacher's first step
    # ("p0") and failed after it, two others went elsewhere: s_0 left 4 times, s_1 twice ->
    # known failure 1. Success from j >= 2.
    # paper: 3S 2S 0F, scan 1F -> j* = 2 with 8 rollouts (it ignores the group's episodes).
    # monotone: 3S(1) 2S(1); next jump 0 <= 1 is known: bracket (1, 2) closed -> j* = 2, 2.
    rec = ["p0", "p1", "p2", "p3"]
    group = [["p0", "x"], ["p0", "y", "y"], ["q"], ["r", "r"]]
    p, disc_p, _ = run(4, threshold(2), "paper", group_paths=group, recovery_path=rec)
    assert [j for j, _ in disc_p] == [3, 2, 0, 1] and p.j_star == 2
    assert p.discovery_rollouts == 8 and p.known_failure is None
    m, disc_m, _ = run(4, threshold(2), "monotone", group_paths=group, recovery_path=rec)
    assert disc_m == [(3, 1), (2, 1)] and m.j_star == 2 and m.discovery_rollouts == 2
    assert m.known_failure == 1 and m.retained


def test_every_state_known_failed_discards_without_rollouts():
    # L = 2: two episodes took the teacher's first step and failed after it -> s_0, s_1
    # both known failures: nothing to test, no rollout spent (the paper spends 2 on s_1)
    group = [["p0", "x"], ["p0", "y"]]
    m, disc, n = run(2, threshold(0), "monotone", group_paths=group, recovery_path=["p0", "p1"])
    assert disc == [] and n == 0 and not m.retained and m.reason == "no discovery success"
    assert m.known_failure == 1


def test_every_result_names_its_search():
    # a group discarded before discovery (no teacher recovery) still says which search ran
    cfg = RelayConfig(search="monotone")
    res, _ = drive(
        relay_search(["x"] * 5, [2, 0], cfg, random.Random(0)),
        teacher=lambda r: [Outcome(False)] * len(r.seeds),
        student=lambda r: [],
    )
    assert not res.retained and res.search == "monotone" and res.discovery_rollouts == 0


def test_search_switch_is_validated():
    with pytest.raises(ValueError, match="relay.search='bisect' must be one of"):
        RelayConfig(search="bisect")


def test_known_failure_that_the_student_contradicts_hands_off_later():
    # Two of the group's episodes took the teacher's first step and failed from s_1 (known
    # failure 1), yet a fresh continuation from s_1 would succeed (success from j >= 1): the
    # prior takes the group's word.
    # paper: 3S 2S 0F, scan 1S -> j* = 1; monotone: 3S 2S, bracket (1, 2) closed -> j* = 2.
    rec = ["p0", "p1", "p2", "p3"]
    group = [["p0", "x"], ["p0", "y"]]
    p, _, _ = run(4, threshold(1), "paper", group_paths=group, recovery_path=rec)
    m, disc, _ = run(4, threshold(1), "monotone", group_paths=group, recovery_path=rec)
    assert p.j_star == 1 and m.known_failure == 1 and disc == [(3, 1), (2, 1)]
    assert m.j_star == 2 and m.retained


@pytest.mark.parametrize("k", [0, 2, 4, 7, 10])
def test_paper_ignores_the_group_episodes(k):
    # relay.search: paper asks for exactly the same requests with or without group paths
    group = [["p0", "x"], ["p0", "y"], ["p0", "z"]]
    rec = [f"p{i}" for i in range(10)]
    logs = []
    for gp in ((), group):
        cfg = RelayConfig()
        _, log = drive(
            relay_search(["x"] * 50, [0], cfg, random.Random(0), group_paths=gp),
            teacher=lambda r: [Outcome(True, n_actions=10, path=rec), Outcome(False)],
            student=lambda r: [Outcome(r.j >= k, 2, 5, sd) for sd in r.seeds],
        )
        logs.append(
            [
                (
                    type(r).__name__,
                    getattr(r, "kind", ""),
                    r.j if hasattr(r, "j") else r.anchor,
                    getattr(r, "seeds", []),
                )
                for r in log
            ]
        )
    assert logs[0] == logs[1]
