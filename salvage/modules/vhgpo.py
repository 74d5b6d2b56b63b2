"""VHGPOModule: GRPO plus the three VH-GPO auxiliary objectives (SPEC §2.3).

``L = L_GRPO + eta L_KL + L_aux``, ``L_aux = l_pair L_pair + l_bridge L_bridge + l_resume L_resume``.
The GRPO terms come from groups with reward contrast (the rescued zero-signal groups
keep advantage 0, so a failed trajectory is never a GRPO positive); the auxiliary terms
come from the relays a rescue callback attached to the batch
(``batch.relays``, see ``salvage.callbacks.relay``). Each auxiliary term is
normalised on its own (mean over its items); a term with no items is omitted.
Scores use temperature 1. The pair's reference is the frozen initial student.
Ours: the auxiliary gradient joins the update once, in its last minibatch.

The GRPO part is the paper's "unchanged standard GRPO" (SPEC §1): symmetric clip 0.2 and
sequence-mean-token-mean aggregation are this module's defaults; the DAPO-style settings
(``clip_eps_high: 0.28``, ``loss_agg: token-mean``, GRPOModule's defaults) stay switches.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from salvage.core.losses import completion_loss, pair_loss
from salvage.distributed import gathered
from salvage.errors import ConfigError
from salvage.lm import target_scores
from salvage.modules.grpo import TRAIN_METRICS, Auxiliary, GRPOModule
from salvage.types import RolloutBatch, SeqTarget

AUX_METRICS = (
    "loss/pair",
    "loss/bridge",
    "loss/resume",
    "loss/aux",
    "relay/pairs",
    "relay/bridge_turns",
    "relay/resume_turns",
)


class VHGPOModule(GRPOModule):
    """GRPOModule + VH-GPO objectives. Ablate an objective by setting its lambda to 0.

    Args:
        beta: preference strength of the pair objective.
        lambda_pair: weight of the action-preference (pair) objective (ours: 1.0; 0 ablates it).
        lambda_bridge: weight of the teacher-bridge objective (ours: 1.0; 0 ablates it).
        lambda_resume: weight of the student-resume objective (ours: 1.0; 0 ablates it).
        clip_eps_high: upper clip (standard GRPO: 0.2, symmetric; DAPO-style: 0.28).
        loss_agg: ``seq-mean-token-mean`` (standard GRPO, default) or ``token-mean`` (DAPO).
        **kwargs: every other GRPOModule argument.
    """

    METRICS = TRAIN_METRICS + AUX_METRICS

    def __init__(
        self,
        beta: float = 0.1,
        lambda_pair: float = 1.0,
        lambda_bridge: float = 1.0,
        lambda_resume: float = 1.0,
        clip_eps_high: float = 0.2,
        loss_agg: str = "seq-mean-token-mean",
        **kwargs: Any,
    ) -> None:
        for key, val in (
            ("lambda_pair", lambda_pair),
            ("lambda_bridge", lambda_bridge),
            ("lambda_resume", lambda_resume),
        ):
            if val < 0:
                raise ConfigError(f"model.{key}={val!r} must be >= 0")
        if beta <= 0:
            raise ConfigError(f"model.beta={beta!r} must be > 0")
        super().__init__(clip_eps_high=clip_eps_high, loss_agg=loss_agg, **kwargs)
        self.save_hyperparameters(
            {
                **self.hparams,
                "beta": beta,
                "lambda_pair": lambda_pair,
                "lambda_bridge": lambda_bridge,
                "lambda_resume": lambda_resume,
            }
        )

    def needs_reference(self) -> bool:
        return super().needs_reference() or self.hparams.lambda_pair > 0

    def auxiliary(self, batch: RolloutBatch) -> Auxiliary:
        """The pair / bridge / resume terms on the batch's relays."""
        return Auxiliary(present=bool(batch.relays), backward=lambda: self.aux_backward(batch))

    # ------------------------------------------------------------------ scores
    def scores(self, model: torch.nn.Module, items: Sequence[SeqTarget]) -> torch.Tensor:
        """s(y|h) per item: mean log-prob of the counted response tokens (temperature 1);
        items that share a history h (a pair's two actions) are packed (``pack_prompts``)."""
        pad = int(self.tokenizer.pad_token_id)
        return target_scores(model, items, pad, self.device, packed=self.hparams.pack_prompts)

    def aux_backward(self, batch: RolloutBatch) -> torch.Tensor | None:
        """Backpropagate the auxiliary terms of ``batch.relays``; their detached total. Logs
        its wall time as ``cost/time_aux`` (seconds, the reference forwards included)."""
        t0 = time.perf_counter()
        with gathered(self.ref_model):  # reference scores are local forwards under FSDP
            out = self._aux_backward(batch)
        self.record_later({"cost/time_aux": time.perf_counter() - t0})
        return out

    def _aux_backward(self, batch: RolloutBatch) -> torch.Tensor | None:
        hp = self.hparams
        relays = batch.relays
        bridge = [t for r in relays for t in r.bridge]
        resume = [t for r in relays for t in r.resume]
        pairs = [r.pair for r in relays if r.pair is not None]
        mbs = hp.micro_batch_size
        total = torch.zeros((), device=self.device)
        m = self.step_metrics
        nan = torch.tensor(float("nan"))
        for name, lam, items in (
            ("bridge", hp.lambda_bridge, bridge),
            ("resume", hp.lambda_resume, resume),
        ):
            m.update(f"relay/{name}_turns", float(len(items)))
            denom = self.global_count(len(items))  # len(items) on one process
            if lam <= 0 or not denom:
                continue  # no data (or ablated): the term is omitted
            value = self._completion_term(items, lam, denom)
            if value is None:
                return nan
            m.update(f"loss/{name}", value)
            total = total + lam * value
        m.update("relay/pairs", float(len(pairs)))
        denom = self.global_count(len(pairs))
        if hp.lambda_pair > 0 and denom:
            pair_value = 0.0

            def preference(_: int, part: Sequence[tuple[SeqTarget, SeqTarget]]) -> torch.Tensor:
                nonlocal pair_value
                flat = [p[0] for p in part] + [p[1] for p in part]
                with torch.no_grad():
                    ref = self.scores(self.reference, flat)
                cur = self.scores(self.live_policy, flat)
                k = len(part)
                loss = pair_loss(cur[:k], cur[k:], ref[:k], ref[k:], hp.beta).sum() / denom
                pair_value += float(loss.detach())
                return hp.lambda_pair * loss

            if not self.micro_steps(pairs, max(1, mbs // 2), preference):
                return nan
            m.update("loss/pair", pair_value)
            total = total + hp.lambda_pair * pair_value
        m.update("loss/aux", float(total))
        return total

    def _completion_term(self, items: list[SeqTarget], lam: float, denom: float) -> float | None:
        """Backward ``lam * mean over items of -s(y|h)`` (bridge, resume); its value, or None
        when some rank's loss was not finite."""
        value = 0.0

        def completion(_: int, part: Sequence[SeqTarget]) -> torch.Tensor:
            nonlocal value
            loss = completion_loss(self.scores(self.live_policy, part)).sum() / denom
            value += float(loss.detach())
            return lam * loss

        if not self.micro_steps(items, self.hparams.micro_batch_size, completion):
            return None
        return value
