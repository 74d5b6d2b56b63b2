"""VH-GPO's search of one group as the rescue stage holds it (``GroupSearch``), and what a
finished search turns into: the relay's training data (bridge, resume and pair targets in
the student's tokens, SPEC §2.3) and its ``relays.jsonl`` record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from salvage.core.agent import parse_action
from salvage.core.relay import Outcome, RelayResult, pair_index
from salvage.rollout.agent import Episode, LMPolicy
from salvage.types import Group, RelayData, SeqTarget


def episode_path(e: Episode) -> list[tuple[str, str]]:
    """The episode's steps as (action, observation after it): what identifies a state here."""
    return list(zip(e.actions, e.observations[1:], strict=False))


def outcome_of(e: Episode, seed: int) -> Outcome:
    """An episode as the pure search sees it (the episode itself rides along as ``ref``)."""
    return Outcome(
        success=e.won,
        n_actions=len(e.actions),
        output_tokens=sum(len(t.response_ids) for t in e.turns),
        seed=seed,
        restored=bool(e.observations),
        ref=e,
        path=episode_path(e),
    )


@dataclass
class GroupSearch:
    """The search of one selected group: its backbone, the running ``relay_search``
    generator, its pending request, and its result once finished."""

    gi: int
    group: Group
    backbone: Episode
    gen: Any
    req: Any = None
    result: RelayResult | None = None

    @property
    def outcome(self) -> RelayResult:
        """The finished search's result."""
        if self.result is None:
            raise RuntimeError(f"the search of group {self.gi} has not finished")
        return self.result


def relay_of(
    s: GroupSearch, student: LMPolicy, fmt: Any, rec: dict[str, Any], pair_walk: str
) -> RelayData:
    """A retained search's training data: the teacher bridge up to j* (the student's prompts,
    the teacher's responses re-tokenised), the kept resume turns, and the action-preference
    pair at the first divergence (``relay.pair_walk``; its depth goes into ``rec``)."""
    r = s.outcome
    anchor, j_star, found = r.handoff()
    recovery: Episode = found.ref
    tok = student.tokenizer
    bridge = []
    for turn in recovery.turns[:j_star]:
        bridge.append(
            SeqTarget(
                student.encode(turn.prompt_text),
                list(tok(turn.response_text, add_special_tokens=False)["input_ids"]),
            )
        )
    resume = []
    if r.resume is not None:
        resume = [
            SeqTarget(list(t.prompt_ids), list(t.response_ids))
            for t in r.resume.ref.turns
            if t.response_ids
        ]
    pair = None
    d = pair_index(recovery.actions, s.backbone.actions, anchor, j_star, pair_walk)
    if d is not None:
        failed_turn = s.backbone.turns[anchor + d]
        h = list(failed_turn.prompt_ids) or student.encode(failed_turn.prompt_text)
        pair = (
            action_target(h, recovery.turns[d].response_text, tok, fmt),
            action_target(h, failed_turn.response_text, tok, fmt),
        )
        rec["pair_depth"] = anchor + d
    return RelayData(bridge=bridge, resume=resume, pair=pair, record=rec)


def search_record(step: int, s: GroupSearch, teacher: str) -> dict[str, Any]:
    """The ``relays.jsonl`` record of a finished search (retained or not)."""
    r = s.outcome
    R = r.resume.n_actions if r.resume is not None else 0
    return {
        "step": step,
        "task": s.group.task_id,
        "family": s.group.task.get("family"),
        "retained": r.retained,
        "reason": r.reason,
        "teacher": teacher,
        "anchors": r.anchors_tried,
        "anchor": r.anchor,
        "L": r.L,
        "j_star": r.j_star,
        "j_early": r.j_early,
        "random_fallback": r.random_fallback,
        "R": R,
        "teacher_frac": (r.handoff()[1] / r.L) if r.retained and r.L else None,
        "discovery": {str(k): v for k, v in r.discovery.items()},
        "teacher_attempts": r.teacher_attempts,
        "discovery_rollouts": r.discovery_rollouts,
        "confirm_rollouts": r.confirm_rollouts,
        "search": r.search,
        "known_failure": r.known_failure,
        "student_rollouts": r.discovery_rollouts + r.confirm_rollouts,
        "tokens": {
            "teacher": r.teacher_tokens,
            "search": r.search_tokens,
            "confirm": r.confirm_tokens,
        },
    }


def action_target(prompt_ids: list[int], response: str, tok: Any, fmt: Any) -> SeqTarget:
    """A response scored over its executable-action tokens only (SPEC §2.3 pair)."""
    action, _ = parse_action(response, fmt)
    enc = tok(response, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    tagged = list(fmt._action_re.finditer(response))
    if tagged:  # the span inside the (last) action tag, surrounding spaces excluded
        m = tagged[-1]
        inner = m.group(1)
        start = m.start(1) + (len(inner) - len(inner.lstrip()))
        end = m.end(1) - (len(inner) - len(inner.rstrip()))
    else:  # no tag: the text the environment received
        start = response.rfind(action) if action else -1
        end = start + len(action)
    if start < 0 or end <= start:
        return SeqTarget(prompt_ids, ids, None)
    mask = [1 if (a < end and b > start) else 0 for a, b in enc["offset_mapping"]]
    return SeqTarget(prompt_ids, ids, mask if any(mask) else None)
