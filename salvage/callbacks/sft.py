"""Warm start by supervised fine-tuning on oracle demonstrations (before RL).

A student that never emits a valid action cannot succeed alone, so VH-GPO has nothing to
hand off to. ``OracleSFT`` plays ``episodes`` oracle episodes on the training tasks
through the datamodule's runner, turns every turn into (student-visible prompt, oracle
response) in the student's tokens, and trains the policy for ``steps`` AdamW steps of
mean-token NLL before the first update. The frozen reference (KL, pair objective) is then
reset to the warm-started policy: "the student's initial checkpoint" is this one. Runs
once: a resumed run does not repeat it.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import lightning as L
import torch

from salvage.datamodules.agent import AgentDataModule
from salvage.datamodules.base import attached_datamodule
from salvage.errors import ConfigError
from salvage.lm import target_scores
from salvage.modules.grpo import GRPOModule
from salvage.progress import stage
from salvage.rollout.agent import OraclePolicy, Start
from salvage.types import SeqTarget

log = logging.getLogger(__name__)


class OracleSFT(L.Callback):
    """Supervised warm start on oracle demonstrations.

    Args:
        episodes: oracle episodes to collect (cycling over the training tasks).
        steps: optimiser steps.
        batch_size: (prompt, response) pairs per step.
        lr: AdamW learning rate of the warm start (its own optimiser).
        seed: seed of the batch sampling.
        chunk_size: oracle episodes played at once (each holds a live environment instance).
    """

    def __init__(
        self,
        episodes: int = 16,
        steps: int = 50,
        batch_size: int = 16,
        lr: float = 3e-3,
        seed: int = 0,
        chunk_size: int = 32,
    ) -> None:
        for k, v in (
            ("episodes", episodes),
            ("steps", steps),
            ("batch_size", batch_size),
            ("chunk_size", chunk_size),
        ):
            if v < 1:
                raise ValueError(f"OracleSFT {k} must be >= 1, got {v}")
        if lr <= 0:
            raise ValueError(f"OracleSFT lr must be > 0, got {lr}")
        self.episodes, self.steps, self.batch_size, self.lr, self.seed = (
            episodes,
            steps,
            batch_size,
            lr,
            seed,
        )
        self.chunk_size = chunk_size
        self.done = False
        self.history: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        return {"done": self.done, "history": self.history}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.done = bool(state_dict["done"])
        self.history = list(state_dict.get("history", []))

    def demonstrations(self, trainer: L.Trainer) -> list[tuple[list[int], list[int]]]:
        dm = attached_datamodule(trainer, AgentDataModule)
        tasks = dm.tasks["train"]
        starts = [Start(tasks[i % len(tasks)], seed=i) for i in range(self.episodes)]
        # played in chunks: the pool reuses released instances, so at most chunk_size
        # environments (a TextWorld-Express JVM and planner twin each) are alive at once
        runner, policy = dm.live_runner(), OraclePolicy(dm.fmt)
        eps = []
        for i in range(0, len(starts), self.chunk_size):
            eps += runner.run(starts[i : i + self.chunk_size], policy, seed=self.seed, train=False)
        student = dm.student()
        tok = student.tokenizer
        pairs = []
        wins = 0
        longest = (0, "")  # tokens the student must sample to reproduce a response, and it
        for e in eps:
            wins += e.won
            if not e.won:
                continue  # only demonstrations that verifiably succeed
            for t in e.turns:
                resp = list(tok(t.response_text, add_special_tokens=False)["input_ids"])
                # a response ending in a stop string ends there; otherwise it needs its EOS
                stops = any(
                    t.response_text.endswith(s) for s in [*dm.fmt.stop, *dm.engine_cfg.stop]
                )
                longest = max(longest, (len(resp) + (not stops), t.response_text))
                if tok.eos_token_id is not None:
                    resp.append(int(tok.eos_token_id))
                pairs.append((student.encode(t.prompt_text), resp))
        log.info("OracleSFT: %d/%d oracle episodes won, %d turns", wins, len(eps), len(pairs))
        limit = dm.engine_cfg.max_new_tokens
        if longest[0] > limit:
            raise ConfigError(
                f"OracleSFT: the student's tokenizer needs {longest[0]} tokens for the oracle "
                f"response {longest[1]!r}, but data.engine.max_new_tokens={limit}: the "
                "student could never finish such an action (cut off, scored invalid); raise "
                f"data.engine.max_new_tokens to >= {longest[0]}"
            )
        return pairs

    def _train(
        self,
        model: Any,
        opt: Any,
        rng: random.Random,
        pairs: list,
        pad: int,
        pl_module: Any,
        bar: Any,
    ) -> None:
        for _ in range(self.steps):
            batch = rng.sample(pairs, min(self.batch_size, len(pairs)))
            targets = [SeqTarget(p, r) for p, r in batch]
            loss = -target_scores(model, targets, pad, pl_module.device).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            self.history.append(float(loss.detach()))
            bar.advance(1)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.done:
            return
        pairs = self.demonstrations(trainer)
        if not pairs:
            raise RuntimeError(
                "OracleSFT: no winning oracle episode to learn from (check the env and tasks)"
            )
        if not isinstance(pl_module, GRPOModule):
            raise TypeError(f"OracleSFT warm-starts a GRPOModule, got {type(pl_module).__name__}")
        self._warm_start(pl_module, pairs, pl_module, "OracleSFT", "sft")

    def _warm_start(
        self,
        module: GRPOModule,
        pairs: list[tuple[list[int], list[int]]],
        pl_module: Any,
        name: str,
        prefix: str,
    ) -> None:
        """Train ``module``'s policy on ``pairs`` for ``steps`` steps (its own AdamW), make its
        reference the result, mark the warm start done and record ``<prefix>/*`` through
        ``pl_module.record_later``."""
        model = module.live_policy
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=self.lr)
        rng = random.Random(self.seed)
        pad = int(module.tokenizer.pad_token_id)
        model.train()
        with stage(f"{name} warm start", total=self.steps, unit="step") as bar:
            self._train(model, opt, rng, pairs, pad, pl_module, bar)
        opt.zero_grad(set_to_none=True)
        module.reset_reference()
        self.done = True
        pl_module.record_later(
            {
                f"{prefix}/loss_first": self.history[0],
                f"{prefix}/loss_last": self.history[-1],
                f"{prefix}/pairs": float(len(pairs)),
                f"{prefix}/steps": float(self.steps),
            }
        )
        log.info(
            "%s: %d pairs, loss %.3f -> %.3f over %d steps",
            name,
            len(pairs),
            self.history[0],
            self.history[-1],
            self.steps,
        )
