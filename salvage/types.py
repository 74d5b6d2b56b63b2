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

Every response token of every turn of a trajectory carries that trajectory's advantage,
or the turn's own ``Turn.advantage`` where one was set (GiGPO).

What passes between the stages is typed here, never a free-form dict: the rollout stage
fills ``RolloutBatch.stats`` (``RolloutStats``); a rescue callback attaches
``RolloutBatch.relays`` (``RelayData``); an exchange (GRAFT, stored peers) replaces groups
(``Group.peer``), keeps the receiver's ``own_groups`` for its rollout metrics and fixes
``minibatch_groups``; a peer trajectory names its policy loss (``Trajectory.loss``,
``Trajectory.seq_ratio``). GRAFT's two-model batch is a ``PairedBatch``. ``Trajectory.info``
holds diagnostics only (seeds, ids): no stage reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
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
    advantage: float | None = None
    """A per-turn advantage (GiGPO's step-level one, ``salvage.core.gigpo``); None: the
    trajectory's ``advantage``."""

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_ids)


@dataclass(frozen=True)
class CompatParts:
    """The parts of a peer response's compatibility score (GRAFT, SPEC §3.2):
    ``s = exp(lbar_recv - lbar_src)``, each ``lbar`` the mean over that model's own tokens."""

    lbar_src: float
    """Mean token log-prob under the source's generation log-probs (its tokenisation)."""
    lbar_recv: float
    """Mean token log-prob under the receiver's pi_old (its re-tokenisation)."""
    tokens_src: int
    """Tokens ``lbar_src`` averages over."""
    tokens_recv: int
    """Tokens ``lbar_recv`` averages over."""


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
    loss: str = "clip"
    """The registered policy loss of its tokens (``salvage.core.policy_loss``): ``clip``,
    ``luffy``; ``hacpo`` labels HACPO's peer rows (clip loss with a sequence ratio)."""
    seq_ratio: SeqRatio | None = None
    """A sequence-level ratio (HACPO rows, Table 2a's peer rows): the row takes the
    ``sequence`` loss instead of ``loss``."""
    compat: float | None = None
    """A peer response's compatibility score ``s`` under the receiver (GRAFT, SPEC §3.2)."""
    compat_parts: CompatParts | None = None
    """What ``compat`` was computed from (the two mean log-probs and their token counts)."""
    score: float | None = None
    """The environment's grade of the episode (WebShop's score), where it grades."""
    episode: Any = None
    """The agent runner's episode (``salvage.rollout.agent.Episode``): its actions, turns
    and restorable states, for a rescue search (VH-GPO)."""

    @property
    def num_response_tokens(self) -> int:
        return sum(t.num_response_tokens for t in self.turns)


@dataclass(frozen=True)
class SeqRatio:
    """One ratio per sequence, ``exp(mean logp_theta - ref)``, clipped to ``[low, high]``."""

    ref: float
    """The mean token log-prob the current one is compared with."""
    low: float
    high: float | None = None
    """None: no upper bound (HACPO's peer ratio as the GRAFT paper ran it)."""


@dataclass
class Group:
    """All rollouts of one task/prompt under the frozen behaviour policy."""

    task_id: str
    trajectories: list[Trajectory]
    task: dict[str, Any] = field(default_factory=dict)
    zero_signal: bool = False
    peer: bool = False
    """The group was received from a peer (GRAFT exchange, stored mode)."""
    failed_episodes: int = 0
    """Episodes of this task dropped for an environment error (agent rollouts)."""

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
    stats: RolloutStats = field(default_factory=lambda: RolloutStats())
    """Timings and counters of the stage that produced the batch (seconds, tokens)."""
    relays: list[RelayData] = field(default_factory=list)
    """Retained VH-GPO relays, attached by a rescue callback (``salvage.callbacks.relay``)."""
    own_groups: list[Group] | None = None
    """After an exchange replaced groups: the groups this policy sampled itself (its
    rollout metrics are over these, not over what it trains on)."""
    minibatch_groups: list[list[int]] | None = None
    """Group indices of each minibatch, fixed by an exchange (GRAFT's peer-last order);
    None: the update splits the trajectories itself."""
    sampled: RolloutBatch | None = None
    """Evaluation only: the same tasks' sampled episodes (``k`` per task at a stated
    temperature) beside the greedy ones in ``groups`` (agent ``val_samples``)."""

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]

    def num_response_tokens(self) -> int:
        return sum(t.num_response_tokens for t in self.trajectories)

    # Lightning moves batches between devices; a rollout batch holds python lists, so
    # moving is a no-op. Defined so `transfer_batch_to_device` leaves it alone.
    def to(self, *_: Any, **__: Any) -> RolloutBatch:
        return self


@dataclass(kw_only=True)
class PairedBatch(RolloutBatch):
    """GRAFT's batch: the same prompts rolled out by policy A and by policy B.

    Its own ``groups`` stay empty; ``stats`` are the two rollouts' together, timed from the
    first one's start.
    """

    a: RolloutBatch
    b: RolloutBatch
    more: dict[str, RolloutBatch] = field(default_factory=dict)
    """The batches of models after the first two (``PeerGroupModule``: c, d, ...)."""

    def parts(self) -> dict[str, RolloutBatch]:
        """The per-model batches by name, in model order."""
        return {"a": self.a, "b": self.b, **self.more}


@dataclass
class RolloutStats:
    """Timings (seconds) and counters of one rollout; None: the stage has no such part."""

    t_start: float | None = None
    """``time.perf_counter()`` when the step's rollout began (the step clock's start)."""
    time_generate: float | None = None
    time_reward: float | None = None
    time_env: float | None = None
    time_env_startup: float | None = None
    """Environment start-up (new instances after a start or resume): set-up, not step time."""
    time_rollout: float | None = None
    gen_tokens: float = 0.0
    verifier_timeouts: float = 0.0
    env_errors: float | None = None
    env_steps: float | None = None

    def timings(self) -> dict[str, float]:
        """The ``time_*`` stages this rollout had, by name."""
        return {
            f.name: float(v)
            for f in fields(self)
            if f.name.startswith("time_") and (v := getattr(self, f.name)) is not None
        }

    def plus(self, other: RolloutStats) -> RolloutStats:
        """Both rollouts' timings and counters summed; the clock starts at this one's."""
        out = RolloutStats(t_start=self.t_start)
        for f in fields(self):
            if f.name == "t_start":
                continue
            x, y = getattr(self, f.name), getattr(other, f.name)
            setattr(out, f.name, y if x is None else x if y is None else x + y)
        return out


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples continuations of prompts from a policy (HF generate on CPU, vLLM on GPU).

    A rollout phase is ``prepare()``, any number of ``generate`` calls, ``release()``; every
    rank calls ``prepare`` and ``release`` (they may hold collectives). The settings are
    the defaults of a ``generate`` call that does not override them.
    """

    model: torch.nn.Module
    """The live policy it samples from (an engine holding a copy re-syncs in ``prepare``)."""
    tokenizer: Any
    temperature: float
    top_p: float
    max_new_tokens: int
    stop: tuple[str, ...]
    calls: int
    """``generate`` calls so far: an unseeded call takes it as its seed."""

    def prepare(self) -> None:
        """Make the engine ready to sample the current weights (vLLM: wake, re-sync)."""
        ...

    def release(self) -> None:
        """Give the engine's memory back to training at the end of a rollout phase."""
        ...

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

    def close(self) -> None:
        """The engine is done: free what it holds (vLLM: its ``LLM``, temporary files)."""
        ...


@dataclass
class Response:
    """A policy's answer to one agent prompt (an oracle's has text only, no tokens)."""

    text: str
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "stop"


@runtime_checkable
class Policy(Protocol):
    """Answers a batch of agent prompts (the visible history, as text), one per live episode.

    Used by VH-GPO for teachers and students alike: an LM policy wraps an engine
    (``salvage.rollout.agent.LMPolicy``), an oracle policy answers the environment's
    ``oracle_action`` (``OraclePolicy``, ``needs_oracle``: the runner asks the
    environments for it first, into ``infos``).
    """

    needs_oracle: bool

    def respond(
        self, prompts: Sequence[str], infos: Sequence[dict[str, Any]], seed: int
    ) -> list[Response]: ...


@runtime_checkable
class Learner(Protocol):
    """What the data and callback stages use of the module being trained (``GRPOModule`` and
    its subclasses, ``GRAFTModule``): the policy to sample from, its tokenizer, the models to
    gather for a rollout phase, and the step-metric sink."""

    @property
    def policy(self) -> torch.nn.Module | None: ...

    @property
    def tokenizer(self) -> Any: ...

    def inference_models(self) -> list[torch.nn.Module]:
        """Models that sample or score without gradients (gathered together under FSDP)."""
        ...

    def sampling_models(self) -> list[torch.nn.Module]:
        """Models that generate during rollouts (gathered for them under FSDP)."""
        ...

    def record(self, values: dict[str, float]) -> None:
        """Log metrics of the current update (once per update, at step = update index)."""
        ...

    def step_values(self) -> dict[str, float]:
        """The metrics recorded so far in the current update."""
        ...


@runtime_checkable
class PairedLearner(Learner, Protocol):
    """A module training several policies (GRAFT: ``a`` and ``b``; ``PeerGroupModule``:
    ``a``, ``b``, ``c``, ...): each by name, ``names`` in model order."""

    @property
    def names(self) -> tuple[str, ...]: ...

    def learner(self, name: str) -> Learner: ...


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

    @property
    def info(self) -> dict[str, Any]:
        """The current state's info: ``won``, ``admissible``, ``score``, ``done``."""
        ...

    def oracle_action(self) -> str | None:
        """The gold / expert next action where the environment knows one."""
        ...

    def close(self) -> None: ...


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
