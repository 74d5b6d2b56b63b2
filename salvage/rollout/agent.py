"""Multi-turn agent rollouts: policies acting on an ``EnvPool`` in lockstep.

All active episodes advance together: one batched policy call per turn (so an LM policy
makes one ``generate`` call for every live episode), then one batched environment step.
Episodes start fresh (``reset(task, seed)``) or from a recorded state (verified restore,
with the visible history the student saw there and the remaining budget ``H - t``) —
the latter is what VH-GPO's teacher recovery and handoff search use.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from salvage.core.agent import (
    AgentFormat,
    format_action,
    parse_action,
    render_prompt,
    trajectory_reward,
)
from salvage.envs.base import digest
from salvage.envs.pool import EnvPool
from salvage.progress import stage
from salvage.rollout.config import generate_with_retry
from salvage.types import Policy, Response, Trajectory, Turn


class LMPolicy:
    """An LM behind a rollout engine; prompts go through the tokenizer's chat template."""

    needs_oracle = False

    def __init__(
        self, engine: Any, tokenizer: Any, fmt: AgentFormat, max_prompt_tokens: int = 2048
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.max_prompt_tokens = max_prompt_tokens

    def encode(self, prompt: str) -> list[int]:
        msgs = [{"role": "user", "content": prompt}]
        if self.fmt.system_prompt:
            msgs.insert(0, {"role": "system", "content": self.fmt.system_prompt})
        text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return ids[-self.max_prompt_tokens :]

    def respond(
        self, prompts: Sequence[str], infos: Sequence[dict[str, Any]], seed: int
    ) -> list[Response]:
        ids = [self.encode(p) for p in prompts]
        out = generate_with_retry(self.engine, ids, n=1, seed=seed, stop=self.fmt.stop)
        return [
            Response(s.text, s.prompt_ids, s.response_ids, s.logprobs, s.finish_reason)
            for s in (g[0] for g in out)
        ]


class OraclePolicy:
    """The environment's oracle (planner / gold path / expert), well formatted.

    The runner asks the environments for ``oracle_action`` only for policies that set
    ``needs_oracle``. Where the oracle has no action for a state it answers an empty
    action, which the episode records as an invalid turn.
    """

    needs_oracle = True

    def __init__(self, fmt: AgentFormat) -> None:
        self.fmt = fmt

    def respond(
        self, prompts: Sequence[str], infos: Sequence[dict[str, Any]], seed: int
    ) -> list[Response]:
        out = []
        for info in infos:
            a = info.get("oracle_action")
            out.append(Response(format_action(a, self.fmt) if a else "<action></action>"))
        return out


@dataclass
class Start:
    """Where an episode begins: fresh, or at a recorded state with its visible history."""

    task: dict[str, Any]
    seed: int
    state: dict[str, Any] | None = None
    history: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Episode:
    eid: int
    start: Start
    env: str = ""
    turns: list[Turn] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)
    """Observation at each depth from the start depth on (``observations[0]`` = start)."""
    actions: list[str] = field(default_factory=list)
    history: list[tuple[str, str]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    won: bool = False
    done: bool = False
    terminal: bool = False
    """The environment ended the episode (won or lost), as opposed to the cap H."""
    error: str | None = None
    start_depth: int = 0

    @property
    def n_invalid(self) -> int:
        return sum(not t.valid for t in self.turns)

    @property
    def depth(self) -> int:
        return self.start_depth + len(self.actions)

    def state_at(self, depth: int) -> dict[str, Any]:
        """A snapshot of this episode at ``depth`` (plain data, restorable by replay)."""
        base = self.start.state or {
            "env": self.env,
            "task": self.start.task,
            "seed": self.start.seed,
            "actions": [],
            "observation": self.observations[0],
        }
        k = depth - self.start_depth
        if not 0 <= k <= len(self.actions):
            raise ValueError(
                f"depth {depth} outside this episode ({self.start_depth}..{self.depth})"
            )
        obs = self.observations[k]
        return {
            **base,
            "actions": list(base["actions"]) + self.actions[:k],
            "observation": obs,
            "digest": digest(obs),
        }


class AgentRunner:
    """Runs episodes of at most ``max_turns`` (H) interactions counted from depth 0."""

    def __init__(self, pool: EnvPool, fmt: AgentFormat, max_turns: int) -> None:
        if max_turns < 1:
            raise ValueError(f"agent max_turns (H) must be >= 1, got {max_turns}")
        self.pool = pool
        self.fmt = fmt
        self.max_turns = max_turns
        self._eids = itertools.count()
        self.env_steps = 0
        self.time_policy = 0.0
        self.time_env = 0.0

    def run(
        self, starts: Sequence[Start], policy: Policy, seed: int, train: bool = True
    ) -> list[Episode]:
        eps = [Episode(next(self._eids), s, env=self.pool.env_name) for s in starts]
        with stage(f"{self.pool.env_name} episodes", total=len(eps), unit="episode") as bar:
            self._loop(eps, policy, seed, train, bar)
        self.pool.release([e.eid for e in eps])
        return eps

    def _loop(self, eps: list[Episode], policy: Policy, seed: int, train: bool, bar: Any) -> None:
        self._begin(eps)
        bar.advance(sum(e.done for e in eps))
        turn = 0
        while True:
            live = [e for e in eps if not e.done]
            if not live:
                break
            prompts = [self._prompt(e) for e in live]
            t0 = time.perf_counter()
            if policy.needs_oracle:
                for e, res in zip(live, self.pool.oracle([e.eid for e in live]), strict=True):
                    e.info = {**e.info, "oracle_action": res.value if res.ok else None}
            resp = policy.respond(prompts, [e.info for e in live], seed=_mix(seed, turn))
            t1 = time.perf_counter()
            self.time_policy += t1 - t0
            steps = []
            for e, p, r in zip(live, prompts, resp, strict=True):
                action, valid = parse_action(r.text, self.fmt)
                t = e.depth
                e.turns.append(
                    Turn(
                        prompt_ids=r.prompt_ids,
                        response_ids=r.response_ids,
                        logprobs=r.logprobs,
                        response_text=r.text,
                        prompt_text=p,
                        action=action,
                        valid=valid,
                        depth=t,
                        budget=self.max_turns - t,
                        finish_reason=r.finish_reason,
                        train=train,
                    )
                )
                steps.append((e.eid, action))
            results = self.pool.step(steps)
            self.time_env += time.perf_counter() - t1
            self.env_steps += len(steps)
            for e, (_, action), res in zip(live, steps, results, strict=True):
                if not res.ok:
                    e.error, e.done = res.error, True
                    continue
                e.history.append((e.observations[-1], action))
                e.actions.append(action)
                e.observations.append(res.value.observation)
                e.info = res.value.info
                e.won = bool(res.value.info.get("won", False))
                if res.value.done or e.won:
                    e.done = e.terminal = True
                elif e.depth >= self.max_turns:
                    e.done = True
            bar.advance(sum(e.done for e in live))
            turn += 1

    def replay(self, items: Sequence[tuple[dict[str, Any], int, Sequence[str]]]) -> list[bool]:
        """Replay action lists from the initial state (lockstep); True where it ends won."""
        eids = [next(self._eids) for _ in items]
        won = [False] * len(items)
        alive = [
            r.ok
            for r in self.pool.reset([(e, t, s) for e, (t, s, _) in zip(eids, items, strict=True)])
        ]
        longest = max((len(a) for _, _, a in items), default=0)
        for k in range(longest):
            idx = [i for i, (_, _, a) in enumerate(items) if alive[i] and k < len(a)]
            if not idx:
                break
            results = self.pool.step([(eids[i], items[i][2][k]) for i in idx])
            self.env_steps += len(idx)
            for i, res in zip(idx, results, strict=True):
                if not res.ok:
                    alive[i] = False
                    continue
                last = k == len(items[i][2]) - 1
                if res.value.done and not last:
                    alive[i] = False  # ended before the whole relay was replayed
                won[i] = last and bool(res.value.info.get("won", False))
        for i, (_, _, a) in enumerate(items):
            won[i] = won[i] and alive[i] and len(a) > 0
        self.pool.release(eids)
        return won

    def _begin(self, eps: list[Episode]) -> None:
        fresh = [e for e in eps if e.start.state is None]
        restored = [(e, e.start.state) for e in eps if e.start.state is not None]
        for e, res in zip(
            fresh,
            self.pool.reset([(e.eid, e.start.task, e.start.seed) for e in fresh]),
            strict=True,
        ):
            self._opened(e, res, depth=0)
        results = self.pool.restore([(e.eid, state) for e, state in restored])
        for (e, state), res in zip(restored, results, strict=True):
            self._opened(e, res, depth=len(state["actions"]))
            e.history = list(e.start.history)

    def _opened(self, e: Episode, res: Any, depth: int) -> None:
        if not res.ok:
            e.error, e.done = res.error, True
            return
        obs, info = res.value
        e.observations, e.info, e.start_depth = [obs], info, depth
        if depth >= self.max_turns:
            e.done = True

    def _prompt(self, e: Episode) -> str:
        task = e.info.get("task_description") or e.start.task.get("description", "")
        return render_prompt(
            self.fmt,
            task,
            e.history,
            e.observations[-1],
            list(e.info.get("admissible", [])),
            step=e.depth,
            budget=self.max_turns - e.depth,
        )

    def to_trajectory(self, e: Episode) -> Trajectory:
        return Trajectory(
            turns=e.turns,
            reward=trajectory_reward(e.won, e.n_invalid, self.fmt),
            success=e.won,
            info={
                "eid": e.eid,
                "family": e.start.task.get("family"),
                "error": e.error,
                "n_invalid": e.n_invalid,
                "depth": e.depth,
            },
            episode=e,
        )


def _mix(seed: int, turn: int) -> int:
    return (seed * 1_000_033 + turn * 8_191 + 7) % (2**31 - 1)
