"""Warm start by supervised fine-tuning on reference answers (math, before RL).

From random initialisation a small model is ~never rewarded by the verifier, so GRPO (and
GRAFT, which needs a peer with successes) has nothing to learn from. ``AnswerSFT`` trains a
policy on (prompt, rendered reference answer) pairs of its own task slice for ``steps``
AdamW steps of mean-token NLL before the first update, then resets that policy's frozen
reference to the warm-started weights. The response is ``template`` with the task's
reference answer filled in (default ``\\boxed{ANSWER}``, which the math-verify reward
reads), followed by the tokenizer's end-of-sequence token.

With GRAFT each model can be warm-started on a *different* slice (one callback per model,
``learner: a`` / ``learner: b``), so that each solves prompts the other cannot (the
heterogeneous pair of the evidence study). Runs once: a resumed run does not repeat it.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L

from salvage.callbacks.sft import OracleSFT
from salvage.datamodules.base import attached_datamodule
from salvage.datamodules.rlvr import RLVRDataModule
from salvage.errors import ConfigError
from salvage.modules.graft import GRAFTModule
from salvage.modules.grpo import GRPOModule
from salvage.tasks.math import MathData, load_math_tasks, source_labels, task_digest

log = logging.getLogger(__name__)


class AnswerSFT(OracleSFT):
    """Supervised warm start on reference answers of a math task slice.

    Args:
        data: the warm-start tasks (one source or a list; e.g. one slice of a task family).
        learner: which model to train: ``None`` for a single-policy module, ``a`` / ``b``
            for one of GRAFT's two models (``c``, ... for further peers of PeerGroupModule).
        template: the response, with ``{answer}`` replaced by the task's reference answer.
        steps: optimiser steps.
        batch_size: (prompt, response) pairs per step.
        lr: AdamW learning rate of the warm start (its own optimiser).
        seed: seed of the batch sampling.
    """

    def __init__(
        self,
        data: MathData | list[MathData] | None = None,
        learner: str | None = None,
        template: str = "\\boxed{{{answer}}}",
        steps: int = 200,
        batch_size: int = 32,
        lr: float = 3e-3,
        seed: int = 0,
    ) -> None:
        super().__init__(episodes=1, steps=steps, batch_size=batch_size, lr=lr, seed=seed)
        if "{answer}" not in template:
            raise ConfigError(
                f"AnswerSFT template {template!r} must contain '{{answer}}' "
                "(where the reference answer goes)"
            )
        self.data = data if data is not None else MathData()
        self.learner = learner
        self.template = template

    @property
    def state_key(self) -> str:
        # two instances (one per GRAFT model) keep their own 'done' flag in a checkpoint
        return self._generate_state_key(learner=self.learner)

    def _target(self, pl_module: L.LightningModule) -> GRPOModule:
        if self.learner is None:
            if not isinstance(pl_module, GRPOModule):
                raise ConfigError(
                    f"AnswerSFT learner=None: the module {type(pl_module).__name__} has two "
                    "models (use learner: a or learner: b)"
                )
            return pl_module
        if not isinstance(pl_module, GRAFTModule):
            raise ConfigError(
                f"AnswerSFT learner={self.learner!r}: the module "
                f"{type(pl_module).__name__} has a single policy (use learner: null)"
            )
        try:
            return pl_module.learner(self.learner)
        except KeyError:
            raise ConfigError(
                f"AnswerSFT learner={self.learner!r}: not a model of this module "
                f"({', '.join(pl_module.names)})"
            ) from None

    def demonstrations(self, trainer: L.Trainer, module: Any = None) -> list[tuple[list, list]]:
        """(prompt ids, response ids) in the trained model's own tokenizer and template."""
        sources = self.data if isinstance(self.data, list) else [self.data]
        tok = module.tokenizer
        dm = attached_datamodule(trainer, RLVRDataModule)
        pairs = []
        heldout = {
            d: (split, tid)
            for split in ("val", "test")
            if split in dm.tasks
            for tid, d in dm.task_digests(split).items()
        }
        for src, label in zip(sources, source_labels(sources, "AnswerSFT.data"), strict=True):
            tasks, _ = load_math_tasks(src, label)
            digests = [(t.id, task_digest(t)) for t in tasks]
            seen = [(tid, heldout[d]) for tid, d in digests if d in heldout]
            if seen and not dm.allow_overlap:
                tid, (split, held) = seen[0]
                raise ConfigError(
                    f"held-out data is not held out: {len(seen)} warm-start prompts of "
                    f"AnswerSFT.data ({src.name or label}) are {split} prompts "
                    f"({dm.split_source(split)}), e.g. {tid!r} = {split} task {held!r}; use "
                    "disjoint sources, or set data.allow_overlap: true"
                )
            for t in tasks:
                resp = list(
                    tok(self.template.format(answer=t.answer), add_special_tokens=False)[
                        "input_ids"
                    ]
                )
                if tok.eos_token_id is not None:
                    resp.append(int(tok.eos_token_id))
                pairs.append((list(dm.prompt_ids(t, tokenizer=tok)), resp))
        return pairs

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.done:
            return
        module = self._target(pl_module)
        pairs = self.demonstrations(trainer, module)
        name = f"AnswerSFT ({self.learner})" if self.learner else "AnswerSFT"
        self._warm_start(
            module, pairs, pl_module, name, f"{self.learner}/sft" if self.learner else "sft"
        )
