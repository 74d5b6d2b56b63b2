"""Agent turn format, pure: prompt building, action parsing, trajectory reward.

The model answers ``<think>...</think><action>...</action>`` (tags configurable). A
response without a well-formed action tag is an *invalid* action: the text after the
last tag-like marker (or the whole stripped response) is still sent to the environment
(every turn is one environment interaction, so replay stays exact), the turn is
flagged invalid, and the trajectory's training reward gets ``invalid_penalty`` (-0.1)
per invalid turn (SPEC §2.6; training only, never in success metrics).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DEFAULT_TEMPLATE = (
    "You are an agent acting in a text environment.\n"
    "Your task: {task}\n"
    "{history_block}"
    "Current step: {step} (steps left: {budget}). Current observation:\n{observation}\n"
    "Admissible actions: [{admissible}]\n"
    "Think briefly inside <think> </think>, then give exactly one admissible action inside "
    "<action> </action>."
)

HISTORY_TEMPLATE = "Your last {k} observation(s) and action(s):\n{history}\n"


@dataclass
class AgentFormat:
    """How observations become prompts and responses become actions. Config keys."""

    template: str = DEFAULT_TEMPLATE
    """Python format string with {task} {history_block} {step} {budget} {observation} {admissible}."""
    history_template: str = HISTORY_TEMPLATE
    """How the past (observation, action) pairs are shown (``{k}``, ``{history}``)."""
    history_k: int = 2
    """How many past (observation, action) pairs the prompt shows."""
    action_tag: str = "action"
    """The tag around the executable action: ``<action>...</action>``."""
    think_tag: str = "think"
    """The tag around the reasoning: ``<think>...</think>``."""
    require_think: bool = False
    """Also require a closed think tag for the action to count as well formed."""
    invalid_penalty: float = 0.1
    """Subtracted from the training reward per invalidly formatted action."""
    success_reward: float = 10.0
    """Trajectory reward on success (``10 * won``)."""
    max_action_chars: int = 200
    """Longer actions are cut to this many characters."""
    system_prompt: str | None = None
    """An optional system message before the task prompt."""
    stop: list[str] = field(default_factory=lambda: ["</action>"])
    """Stop strings for generation (the closing action tag)."""

    def __post_init__(self) -> None:
        if self.history_k < 0:
            raise ValueError(f"agent.history_k must be >= 0, got {self.history_k}")
        if self.invalid_penalty < 0:
            raise ValueError(
                f"agent.invalid_penalty must be >= 0 (it is subtracted), got {self.invalid_penalty}"
            )
        for key in ("{task}", "{observation}", "{admissible}"):
            if key not in self.template:
                raise ValueError(f"agent.template must contain {key}")
        self._action_re = re.compile(
            rf"<{re.escape(self.action_tag)}>(.*?)</{re.escape(self.action_tag)}>", re.DOTALL
        )
        self._think_re = re.compile(
            rf"<{re.escape(self.think_tag)}>.*?</{re.escape(self.think_tag)}>", re.DOTALL
        )


def parse_action(text: str, fmt: AgentFormat) -> tuple[str, bool]:
    """(action sent to the environment, well-formed?) for one model response."""
    found = fmt._action_re.findall(text)
    ok = len(found) == 1 and bool(found[0].strip())
    if ok and fmt.require_think and not fmt._think_re.search(text):
        ok = False
    if ok:
        action = found[0]
    elif found:
        action = found[-1]
    else:
        tail = text.split(f"<{fmt.action_tag}>")[-1]
        action = tail.split("\n")[-1] if tail.strip() else text
    return " ".join(action.strip().split())[: fmt.max_action_chars], ok


def render_prompt(
    fmt: AgentFormat,
    task: str,
    history: list[tuple[str, str]],
    observation: str,
    admissible: list[str],
    step: int,
    budget: int,
) -> str:
    """The student-visible prompt at one state (task + last-k history + current state)."""
    shown = history[-fmt.history_k :] if fmt.history_k else []
    if shown:
        lines = "\n".join(
            f"[step {step - len(shown) + i}] observation: {o.strip()}\n  action: {a}"
            for i, (o, a) in enumerate(shown)
        )
        block = fmt.history_template.format(k=len(shown), history=lines)
    else:
        block = ""
    return fmt.template.format(
        task=task.strip(),
        history_block=block,
        step=step,
        budget=budget,
        observation=observation.strip(),
        admissible=", ".join(admissible),
    )


def trajectory_reward(won: bool, n_invalid: int, fmt: AgentFormat) -> float:
    return fmt.success_reward * float(won) - fmt.invalid_penalty * n_invalid


def format_action(action: str, fmt: AgentFormat, thought: str = "") -> str:
    """A well-formed response for an action (used by oracle policies)."""
    return (
        f"<{fmt.think_tag}>{thought}</{fmt.think_tag}><{fmt.action_tag}>{action}</{fmt.action_tag}>"
    )
