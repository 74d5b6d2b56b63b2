"""Scripted agent policies for the scripted environment: real tokens, chosen actions.

The scripted env puts its expert (oracle) action in every info while the path is alive;
a policy here picks, for each live episode, that action or a wrong one ("x"), and answers
with the tokens of a real tokenizer (so relays, bridges and updates see real token ids).
Shared by the VH-GPO, peer-handoff and dynamic-sampling tests.
"""

from __future__ import annotations

from salvage.core.agent import format_action
from salvage.rollout.agent import Response


def depth_of(prompt: str) -> int:
    """The depth the rendered prompt states ("Current step: d ...")."""
    return int(prompt.split("Current step: ")[1].split(" ")[0])


class ScriptedPolicy:
    """Plays ``expert(prompt, info, row)``: True for the expert's action, False for "x"."""

    needs_oracle = False  # the scripted env puts its oracle action in every info

    def __init__(self, tok, fmt, logprob=0.0):
        self.tok, self.fmt, self.logprob = tok, fmt, logprob

    @property
    def tokenizer(self):
        return self.tok

    def encode(self, prompt):
        return list(self.tok(prompt, add_special_tokens=False)["input_ids"])[-200:]

    def expert(self, prompt, info, row):
        raise NotImplementedError

    def respond(self, prompts, infos, seed):
        out = []
        for row, (p, info) in enumerate(zip(prompts, infos, strict=True)):
            a = info.get("oracle_action") if self.expert(p, info, row) else None
            text = format_action(a or "x", self.fmt)
            ids = self.encode(text)
            out.append(Response(text, self.encode(p), ids, [self.logprob] * len(ids)))
        return out


class RightFromDepth(ScriptedPolicy):
    """The expert's action from depth ``k`` on (while the path is alive), "x" before."""

    def __init__(self, tok, fmt, k, logprob=0.0):
        super().__init__(tok, fmt, logprob)
        self.k = k

    def expert(self, prompt, info, row):
        return depth_of(prompt) >= self.k
