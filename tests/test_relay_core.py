"""VH-GPO search logic (SPEC §2) with scripted outcomes: exact order, caps and tie-breaks."""

from __future__ import annotations

import random

import pytest

from salvage.core.relay import (
    RANDOM_EMPTY,
    Outcome,
    RelayConfig,
    ReplayRequest,
    StudentRequest,
    TeacherRequest,
    anchor_schedule,
    backward_jumps,
    eligible_depths,
    first_divergence,
    keep_resume,
    pair_index,
    random_anchor_order,
    relay_search,
    select_backbone,
    select_groups,
    shortest_success,
)


def drive(gen, teacher, student, replay=lambda req: True):
    """Run a search with scripted answers; return (result, log of requests)."""
    log = []
    try:
        req = next(gen)
        while True:
            log.append(req)
            if isinstance(req, TeacherRequest):
                ans = teacher(req)
            elif isinstance(req, StudentRequest):
                ans = student(req)
            else:
                ans = replay(req)
            req = gen.send(ans)
    except StopIteration as stop:
        return stop.value, log


def outs(*succ, n_actions=3):
    return [
        Outcome(success=s, n_actions=n_actions, output_tokens=10, seed=i)
        for i, s in enumerate(succ)
    ]


# ---------------------------------------------------------------- backbone and anchors


def test_eligible_depths_use_remaining_budget():
    # H = 10, b_min = 3: t <= 7; a terminal episode of 5 actions has nonterminal s_0..s_4
    assert eligible_depths(5, True, 10, 3) == [0, 1, 2, 3, 4]
    # truncated at H: s_10 has b = 0; eligible t = 0..7
    assert eligible_depths(10, False, 10, 3) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert eligible_depths(3, True, 10, 11) == []


def test_backbone_deepest_candidate_ties_to_lowest_id():
    # depths of deepest eligible candidate: traj0 -> 4, traj1 -> 7, traj2 -> 7
    trajs = [(5, True), (10, False), (8, True)]
    idx, depths = select_backbone(trajs, max_turns=10, b_min=3)
    assert idx == 1 and max(depths) == 7
    # b_min > H: nothing eligible -> no backbone
    assert select_backbone(trajs, max_turns=10, b_min=11) is None


@pytest.mark.parametrize(
    ("depths", "stride", "backtracks", "expected"),
    [
        (range(0, 10), 2, 4, [9, 7, 5, 3, 1, 0]),  # 1 + 4 backtracks + root = 6 anchors
        (range(0, 10), 3, 4, [9, 6, 3, 0]),  # root reached by backtracking
        (range(0, 10), 1, 4, [9, 8, 7, 6, 5, 0]),  # root appended last
        (range(0, 10), 4, 0, [9, 0]),
        ([0, 1, 2], 5, 4, [2, 0]),  # no candidate a stride below: root only
        ([0, 3, 4, 8], 3, 4, [8, 4, 0]),  # "deepest candidate with depth <= current - stride"
        ([0], 2, 4, [0]),
    ],
)
def test_anchor_schedule(depths, stride, backtracks, expected):
    assert anchor_schedule(list(depths), stride, backtracks) == expected


def test_random_anchor_order_keeps_root_last():
    rng = random.Random(0)
    a = random_anchor_order([9, 7, 5, 3, 1, 0], rng)
    assert a[-1] == 0 and sorted(a[:-1]) == [1, 3, 5, 7, 9] and a[:-1] != [9, 7, 5, 3, 1]


# ---------------------------------------------------------------- teacher recovery


def test_teacher_stops_at_first_anchor_with_a_success_and_keeps_the_shortest():
    cfg = RelayConfig(teacher_attempts=2)
    answers = {
        9: [Outcome(False), Outcome(False)],
        7: [Outcome(True, n_actions=6, seed=0), Outcome(True, n_actions=4, seed=1)],
        5: [Outcome(True, n_actions=1)],
    }
    res, log = drive(
        relay_search(["x"] * 9, [9, 7, 5, 0], cfg, random.Random(0)),
        teacher=lambda r: answers[r.anchor],
        student=lambda r: outs(True, True),
    )
    teacher_reqs = [r for r in log if isinstance(r, TeacherRequest)]
    assert [r.anchor for r in teacher_reqs] == [9, 7]
    assert res.anchor == 7 and res.L == 4 and res.recovery.seed == 1
    assert res.teacher_attempts == 4


def test_teacher_tie_keeps_lowest_attempt_and_caps_at_twelve():
    assert shortest_success([Outcome(True, 3), Outcome(True, 3)]) == 0
    assert shortest_success([Outcome(True, 3, restored=False), Outcome(False)]) is None
    cfg = RelayConfig()
    anchors = anchor_schedule(range(30), 2, 4)
    res, log = drive(
        relay_search(["x"] * 30, anchors, cfg, random.Random(0)),
        teacher=lambda r: [Outcome(False)] * len(r.seeds),
        student=lambda r: [],
    )
    assert len(anchors) == 6 and res.teacher_attempts == 12 and not res.retained
    assert res.reason == "no teacher recovery from any anchor"
    assert not any(isinstance(r, StudentRequest) for r in log)


def test_failed_restore_at_an_anchor_skips_it():
    cfg = RelayConfig()
    answers = {5: [Outcome(True, 2, restored=False)] * 2, 0: [Outcome(True, 2), Outcome(False)]}
    res, _ = drive(
        relay_search(["x"] * 5, [5, 0], cfg, random.Random(0)),
        teacher=lambda r: answers[r.anchor],
        student=lambda r: outs(True, True),
    )
    assert res.anchor == 0 and res.teacher_attempts == 2  # restore failures are not attempts


# ---------------------------------------------------------------- discovery


def test_backward_jumps():
    assert backward_jumps(10) == [9, 8, 6, 2, 0]
    assert backward_jumps(3) == [2, 1, 0]
    assert backward_jumps(2) == [1, 0]
    assert backward_jumps(1) == [0]


def _search_with(L, student_ok, cfg=None, confirm_ok=True, replay_ok=True):
    cfg = cfg or RelayConfig()
    tested = []

    def student(req):
        if req.kind == "discovery":
            tested.append(req.j)
            return outs(*([student_ok(req.j)] * len(req.seeds)))
        return [
            Outcome(confirm_ok, n_actions=5, output_tokens=7, seed=req.seeds[0]),
            Outcome(confirm_ok, n_actions=3, output_tokens=9, seed=req.seeds[1]),
            Outcome(confirm_ok, n_actions=3, output_tokens=8, seed=req.seeds[2]),
            Outcome(False, n_actions=1, seed=req.seeds[3]),
        ]

    res, log = drive(
        relay_search(["x"] * 20, [0], cfg, random.Random(0)),
        teacher=lambda r: [Outcome(True, n_actions=L)] + [Outcome(False)] * (len(r.seeds) - 1),
        student=student,
        replay=lambda r: replay_ok,
    )
    return res, log, tested


def test_discovery_order_backward_until_failure_then_budget():
    # L = 10: 9 S, 8 S, 6 S, 2 F -> budget 8 = 4 tests spent, no refinement; j_early = 6
    res, _, tested = _search_with(10, lambda j: j >= 5)
    assert tested == [9, 8, 6, 2]
    assert res.j_early == 6 and res.j_star == 6 and res.discovery_rollouts == 8


def test_refinement_increasing_up_to_earliest_success():
    # L = 10: 9 S, 8 S, 6 F -> refine 7: S -> stop; S = {7, 8, 9}
    res, _, tested = _search_with(10, lambda j: j >= 7)
    assert tested == [9, 8, 6, 7] and res.j_early == 7
    # success only from 9: 9 S, 8 F -> refine range(9, 9) is empty
    res, _, tested = _search_with(10, lambda j: j == 9)
    assert tested == [9, 8] and res.j_early == 9


def test_refinement_stops_on_budget():
    # budget 6 (3 tests): 9 S, 8 F, refine: nothing between 8 and 9 -> j* = 9
    cfg = RelayConfig(discovery_budget=6)
    res, _, tested = _search_with(10, lambda j: j == 9, cfg)
    assert tested == [9, 8]
    # first test fails: refine j_f+1 .. L-1 is empty (j_f = L-1) -> discard
    res, log, tested = _search_with(10, lambda j: False)
    assert tested == [9] and not res.retained and res.reason == "no discovery success"
    assert not any(isinstance(r, ReplayRequest) for r in log)


def test_discovery_caps_at_budget_and_reaches_root():
    cfg = RelayConfig(discovery_budget=8, discovery_rollouts=2)
    res, log, tested = _search_with(3, lambda j: True, cfg)
    assert tested == [2, 1, 0] and res.j_early == 0 and res.discovery_rollouts == 6
    res, log, tested = _search_with(40, lambda j: True, cfg)
    assert tested == [39, 38, 36, 32]  # 4 tests x 2 = 8 rollouts
    assert (
        sum(len(r.seeds) for r in log if isinstance(r, StudentRequest) and r.kind == "discovery")
        <= 8
    )


def _discovery_sizes(log):
    return [
        (r.j, len(r.seeds)) for r in log if isinstance(r, StudentRequest) and r.kind == "discovery"
    ]


def test_every_tested_state_gets_the_full_count():
    # SPEC 2.2: a state that cannot get its full discovery_rollouts is not tested.
    # L = 10, every continuation succeeds. Budget 3, 2 per state: 9 (2) -> 1 left < 2: stop.
    cfg = RelayConfig(discovery_budget=3, discovery_rollouts=2)
    res, log, tested = _search_with(10, lambda j: True, cfg)
    assert _discovery_sizes(log) == [(9, 2)] and res.discovery_rollouts == 2
    assert res.j_early == res.j_star == 9 and res.retained
    # budget 5: 9 (2), 8 (2), then 1 left: 6 is not tested (it used to get 1 continuation)
    cfg = RelayConfig(discovery_budget=5, discovery_rollouts=2)
    res, log, tested = _search_with(10, lambda j: True, cfg)
    assert _discovery_sizes(log) == [(9, 2), (8, 2)] and res.j_early == 8
    # refinement too: 9 S, 8 F (4 spent), refine range(9, 9) empty; budget 7 and L = 20:
    # 19 S, 18 S, 16 F (6 spent) -> refine 17 would need 2, 1 left: not tested
    cfg = RelayConfig(discovery_budget=7, discovery_rollouts=2)
    res, log, tested = _search_with(20, lambda j: j >= 17, cfg)
    assert _discovery_sizes(log) == [(19, 2), (18, 2), (16, 2)] and res.j_early == 18


def test_budget_below_one_full_test_is_a_config_error_unless_partial():
    with pytest.raises(
        ValueError, match="relay.discovery_budget=1 is below relay.discovery_rollouts=2"
    ):
        RelayConfig(discovery_budget=1, discovery_rollouts=2)
    # partial_tests (ours, off by default): the old rule, the last test takes what is left;
    # with budget 1 a relay is retained on one continuation
    cfg = RelayConfig(discovery_budget=1, discovery_rollouts=2, partial_tests=True)
    res, log, _ = _search_with(10, lambda j: True, cfg)
    assert _discovery_sizes(log) == [(9, 1)] and res.retained
    cfg = RelayConfig(discovery_budget=5, discovery_rollouts=2, partial_tests=True)
    res, log, _ = _search_with(40, lambda j: True, cfg)
    assert _discovery_sizes(log) == [(39, 2), (38, 2), (36, 1)]


# ---------------------------------------------------------------- confirmation, replay, handoff


def test_confirmation_seeds_are_fresh_and_resume_tie_breaks():
    res, log, _ = _search_with(10, lambda j: j >= 5)
    disc = {
        s for r in log if isinstance(r, StudentRequest) and r.kind == "discovery" for s in r.seeds
    }
    conf = [r for r in log if isinstance(r, StudentRequest) and r.kind == "confirm"]
    assert len(conf) == 1 and conf[0].j == 6 and len(conf[0].seeds) == 4
    assert disc.isdisjoint(conf[0].seeds)
    # fewest actions (3, 3) then fewer output tokens (8 < 9) -> the third continuation
    assert res.resume.seed == conf[0].seeds[2]
    assert keep_resume([Outcome(True, 3, 8, seed=5), Outcome(True, 3, 8, seed=2)]) == 1
    assert isinstance(log[-1], ReplayRequest) and log[-1].j == 6 and log[-1].resume is res.resume
    assert res.retained and res.j_star < res.L


def test_failed_confirmation_or_replay_discards():
    res, log, _ = _search_with(10, lambda j: j >= 5, confirm_ok=False)
    assert not res.retained and res.reason == "confirmation failed"
    assert not any(isinstance(r, ReplayRequest) for r in log)
    res, _, _ = _search_with(10, lambda j: j >= 5, replay_ok=False)
    assert not res.retained and res.reason == "replay failed"


def test_random_verified_handoff_excludes_j_early():
    cfg = RelayConfig(handoff="random")
    picks = set()
    for s in range(20):
        gen = relay_search(["x"] * 20, [0], cfg, random.Random(s))
        res, _ = drive(
            gen,
            teacher=lambda r: [Outcome(True, n_actions=10), Outcome(False)],
            student=lambda r: outs(*([r.j >= 7] * len(r.seeds))),
        )
        assert res.j_early == 7 and res.j_star in {8, 9}
        picks.add(res.j_star)
    assert picks == {8, 9}
    # only j_early available -> discard (ours, the default of relay.random_fallback)
    res, _, _ = _search_with(10, lambda j: j == 9, cfg)
    assert not res.retained and "besides j_early" in res.reason and res.random_fallback


def test_random_handoff_fallback_switch():
    # 9 S, 8 F -> S = {9}: S minus j_early is empty
    res, log, _ = _search_with(10, lambda j: j == 9, RelayConfig(handoff="random"))
    assert res.reason == RANDOM_EMPTY and res.random_fallback and res.j_star is None
    assert not any(r.kind == "confirm" for r in log if isinstance(r, StudentRequest))
    cfg = RelayConfig(handoff="random", random_fallback="j_early")
    res, log, _ = _search_with(10, lambda j: j == 9, cfg)
    assert res.retained and res.random_fallback and res.j_early == res.j_star == 9
    assert [r.j for r in log if isinstance(r, StudentRequest) and r.kind == "confirm"] == [9]
    # a non-empty S minus j_early never falls back
    res, _, _ = _search_with(10, lambda j: j >= 5, cfg)
    assert not res.random_fallback and res.j_star in {8, 9}
    # the earliest handoff never sets it
    res, _, _ = _search_with(10, lambda j: j == 9)
    assert not res.random_fallback and res.retained


def test_no_handoff_keeps_the_whole_recovery_and_skips_search():
    cfg = RelayConfig(handoff="none")
    res, log, tested = _search_with(6, lambda j: True, cfg)
    assert tested == [] and res.j_star == 6 and res.resume is None and res.retained
    assert [type(r).__name__ for r in log] == ["TeacherRequest", "ReplayRequest"]


# ---------------------------------------------------------------- pair and group selection


def test_teacher_tie_break_switch():
    two = [
        Outcome(True, 3, output_tokens=9),
        Outcome(True, 3, output_tokens=5),
        Outcome(True, 4, 1),
    ]
    assert shortest_success(two) == 0  # default: the lowest attempt index
    assert shortest_success(two, "tokens") == 1  # fewer output tokens among the shortest
    cfg = RelayConfig(teacher_tie_break="tokens")
    res, _ = drive(
        relay_search(["x"] * 9, [0], cfg, random.Random(0)),
        teacher=lambda r: [Outcome(True, 3, 9, seed=0), Outcome(True, 3, 5, seed=1)],
        student=lambda r: outs(*([True] * len(r.seeds))),
    )
    assert res.recovery.seed == 1


def test_pair_walk_switch():
    # backbone from the anchor: a b x y; teacher recovery: a b c d; j* = 2
    backbone = ["s0", "a", "b", "x", "y"]
    recovery = ["a", "b", "c", "d"]
    assert pair_index(recovery, backbone, 1, 2) is None  # SPEC: no divergence in the bridge
    assert pair_index(recovery, backbone, 1, 2, "recovery") == 2
    assert pair_index(["a", "c"], backbone, 1, 2) == 1
    assert pair_index(recovery, ["s0", "a"], 1, 4, "recovery") is None  # the backbone ended


def test_first_divergence():
    assert first_divergence(["a", "b", "c"], ["a", "x", "c"]) == 1
    assert first_divergence(["a", "b"], ["a", "b", "z"]) is None  # no divergence inside the bridge
    assert first_divergence(["a", "b", "c"], ["a"]) is None
    assert first_divergence(["q"], ["a"]) == 0


def test_group_selection():
    cfg = RelayConfig(max_groups=2)
    assert select_groups([1, 4, 6], cfg, random.Random(0)) == [1, 4]
    rnd = RelayConfig(max_groups=2, group_select="random")
    seen = {tuple(select_groups([1, 4, 6], rnd, random.Random(s))) for s in range(20)}
    assert all(len(p) == 2 for p in seen) and len(seen) > 1


def test_bad_relay_config_names_the_key():
    with pytest.raises(ValueError, match="relay.confirm_rollouts=0"):
        RelayConfig(confirm_rollouts=0)
    with pytest.raises(ValueError, match="relay.handoff='late'"):
        RelayConfig(handoff="late")
    with pytest.raises(ValueError, match="relay.random_fallback='keep'"):
        RelayConfig(random_fallback="keep")
    with pytest.raises(ValueError, match="relay.teacher_tie_break='last'"):
        RelayConfig(teacher_tie_break="last")
    with pytest.raises(ValueError, match="relay.pair_walk='all'"):
        RelayConfig(pair_walk="all")
    with pytest.raises(ValueError, match="b_min=60 exceeds"):
        RelayConfig(b_min=60).check_horizon(50)
