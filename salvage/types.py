"""Shared vocabulary of salvage: turns, trajectories, groups, rollout batches, protocols.

Only the standard library and torch are imported here, so every room of the package
(core, envs, rollout, modules, callbacks) can speak the same types.

Layout of a rollout batch::

    RolloutBatch
      groups: [Group]            one per task/prompt, G (VH-GPO) or n (GRAFT) rollouts
        trajectories: [Trajectory]
          turns: [Turn]          single-turn RLVR: exactly one turn
          reward, success        trajectory level (training reward vs. success metric)
          advantage              filled by the advantage estimator (core/grpo.py)

Every response token of every turn of a trajectory carries that trajectory's advantage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass
class Sample:
    """One sampled continuation of one prompt, as a rollout engine returns it."""

    prompt_ids: list[int]
    response_ids: list[int]
    text: str
    logprobs: list[float]
    """Log-probs of the sampled tokens under the behaviour policy (one per response id)."""
    finish_reason: str
    """``"stop"`` (eos or a stop string) or ``"length"`` (max new tokens reached)."""
    seed: int | None = None


@dataclass
class Turn:
    """One model call inside an episode (single-turn RLVR: the only one)."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    response_text: str = ""
    prompt_text: str = ""
    action: str | None = None
    valid: bool = True
    depth: int = 0
    budget: int | None = None
    finish_reason: str = "stop"
    train: bool = True
    """False for turns whose tokens must not enter the policy loss (e.g. a teacher's)."""

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_ids)


@dataclass
class Trajectory:
    """A complete rollout: one or more turns, one scalar reward."""

    turns: list[Turn]
    reward: float
    success: bool
    advantage: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    source: str = "self"
    """Who produced it: ``"self"``, or a peer/teacher name (GRAFT, VH-GPO)."""
    weight: float = 1.0
    """Per-trajectory loss weight (GRAFT's compatibility weight; 1 for own rollouts)."""

    @property
    def num_response_tokens(self) -> int:
        return sum(t.num_response_tokens for t in self.turns)


@dataclass
class Group:
    """All rollouts of one task/prompt under the frozen behaviour policy."""

    task_id: str
    trajectories: list[Trajectory]
    task: dict[str, Any] = field(default_factory=dict)
    zero_signal: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def successes(self) -> list[bool]:
        return [t.success for t in self.trajectories]


@dataclass
class RolloutBatch:
    """What a rollout stage hands to the update: groups plus bookkeeping.

    ``temperature`` is the sampling temperature the behaviour log-probs were computed
    at (logits / T); the update recomputes current log-probs the same way so that the
    token ratio compares like with like.
    """

    groups: list[Group]
    temperature: float = 1.0
    stats: dict[str, float] = field(default_factory=dict)
    """Timings and counters of the stage that produced the batch (seconds, tokens)."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Attachments of later stages (relays, exchanged groups, ...)."""

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]

    def num_response_tokens(self) -> int:
        return sum(t.num_response_tokens for t in self.trajectories)

    # Lightning moves batches between devices; a rollout batch holds python lists, so
    # moving is a no-op. Defined so `transfer_batch_to_device` leaves it alone.
    def to(self, *_: Any, **__: Any) -> RolloutBatch:
        return self


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples continuations of prompts from a policy (HF generate on CPU, vLLM on GPU)."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int = 1,
        *,
        seed: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        max_new_tokens: int | None = None,
        stop: Sequence[str] | None = None,
    ) -> list[list[Sample]]:
        """For each prompt (token ids) return ``n`` samples."""
        ...


@runtime_checkable
class Policy(Protocol):
    """Maps an observation (the visible history, as text) to an answer text.

    Used by VH-GPO for teachers and students alike; an LM policy wraps an engine, an
    oracle policy reads an environment's gold path.
    """

    def act(self, prompts: Sequence[str], *, seed: int | None = None) -> list[str]: ...


@dataclass
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict[str, Any]


@runtime_checkable
class Env(Protocol):
    """A restorable text environment.

    ``snapshot`` returns JSON-serialisable data; ``restore`` must verify that the
    restored observation equals the recorded one and raise on mismatch.
    """

    def reset(self, task: dict[str, Any], seed: int) -> tuple[str, dict[str, Any]]: ...

    def step(self, action: str) -> StepResult: ...

    def snapshot(self) -> dict[str, Any]: ...

    def restore(self, state: dict[str, Any]) -> str: ...


@dataclass
class TokenBatch:
    """Right-padded tensors for one (micro)batch of the update."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    """1 on response tokens that count in the loss; aligned with ``input_ids[:, 1:]``."""
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    """Per-token advantage, aligned like ``response_mask``."""
    weights: torch.Tensor
    """Per-token loss weight, aligned like ``response_mask``."""
    seq_index: torch.Tensor
    """Row -> trajectory index in the batch (for sequence-level aggregation)."""


@dataclass
class SeqTarget:
    """A prompt and a target response in the student's tokens, for likelihood objectives."""

    prompt_ids: list[int]
    response_ids: list[int]
    mask: list[int] | None = None
    """1 on the response tokens that count (e.g. the executable action); None: all."""


@dataclass
class RelayData:
    """Training data of one retained VH-GPO relay (SPEC §2.3), attached to a rollout batch."""

    bridge: list[SeqTarget]
    """Teacher bridge turns: student-visible prompt, teacher's complete response."""
    resume: list[SeqTarget]
    """The kept, independently confirmed student resume turns."""
    pair: tuple[SeqTarget, SeqTarget] | None = None
    """(chosen = teacher, rejected = failed student) at the first divergence, masked to actions."""
    record: dict[str, Any] = field(default_factory=dict)
