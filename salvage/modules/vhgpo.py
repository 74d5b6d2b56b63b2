"""VHGPOModule: GRPO plus the three VH-GPO auxiliary objectives (SPEC §2.3).

``L = L_GRPO + eta L_KL + L_aux``, ``L_aux = l_pair L_pair + l_bridge L_bridge + l_resume L_resume``.
The GRPO terms come from groups with reward contrast (the rescued zero-signal groups
keep advantage 0, so a failed trajectory is never a GRPO positive); the auxiliary terms
come from the relays a rescue callback attached to the batch
(``batch.extras["relays"]``, see ``salvage.callbacks.relay``). Each auxiliary term is
normalised on its own (mean over its items); a term with no items is omitted.
Scores use temperature 1. The pair's reference is the frozen initial student.
Ours: the auxiliary gradient joins the update once, in its last minibatch.

The GRPO part is the paper's "unchanged standard GRPO" (SPEC §1): symmetric clip 0.2 and
sequence-mean-token-mean aggregation are this module's defaults; the DAPO-style settings
(``clip_eps_high: 0.28``, ``loss_agg: token-mean``, GRPOModule's defaults) stay switches.
"""

from __future__ import annotations

from typing import Any

import torch

from salvage.core.losses import completion_loss, pair_loss, seq_mean_logprob
from salvage.distributed import gathered, lockstep
from salvage.lm import pad_right, token_logprobs
from salvage.modules.grpo import TRAIN_METRICS, GRPOModule
from salvage.types import RelayData, RolloutBatch, SeqTarget

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
                raise ValueError(f"model.{key}={val!r} must be >= 0")
        if beta <= 0:
            raise ValueError(f"model.beta={beta!r} must be > 0")
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

    def has_aux(self, batch: RolloutBatch) -> bool:
        return bool(batch.extras.get("relays"))

    # ------------------------------------------------------------------ scores
    def _scores(self, model: torch.nn.Module, items: list[SeqTarget]) -> torch.Tensor:
        """s(y|h) per item: mean log-prob of the counted response tokens (temperature 1)."""
        ids, mask = pad_right(
            [t.prompt_ids + t.response_ids for t in items],
            int(self.tokenizer.pad_token_id),
            self.device,
        )
        lp = token_logprobs(model, ids, mask, 1.0)
        count = torch.zeros_like(lp)
        for i, t in enumerate(items):
            m = t.mask if t.mask is not None else [1] * len(t.response_ids)
            a = len(t.prompt_ids) - 1
            count[i, a : a + len(m)] = torch.tensor(m, dtype=lp.dtype, device=lp.device)
        return seq_mean_logprob(lp, count)

    def aux_backward(self, batch: RolloutBatch) -> torch.Tensor | None:
        with gathered(self.ref_model):  # reference scores are local forwards under FSDP
            return self._aux_backward(batch)

    def _aux_backward(self, batch: RolloutBatch) -> torch.Tensor | None:
        hp = self.hparams
        relays: list[RelayData] = batch.extras.get("relays", [])
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
            value = 0.0
            for c in range(lockstep(-(-len(items) // mbs))):
                part = items[c * mbs : (c + 1) * mbs]
                if not part:  # keep in step with ranks holding more items
                    if not self.keep_in_step():
                        return nan
                    continue
                loss = completion_loss(self._scores(self.policy, part)).sum() / denom
                if not self.finite(loss):
                    return nan
                self.backward_loss(lam * loss)
                value += float(loss.detach())
            m.update(f"loss/{name}", value)
            total = total + lam * value
        m.update("relay/pairs", float(len(pairs)))
        denom = self.global_count(len(pairs))
        if hp.lambda_pair > 0 and denom:
            value = 0.0
            step = max(1, mbs // 2)
            for c in range(lockstep(-(-len(pairs) // step))):
                part = pairs[c * step : (c + 1) * step]
                if not part:
                    if not self.keep_in_step():
                        return nan
                    continue
                flat = [p[0] for p in part] + [p[1] for p in part]
                with torch.no_grad():
                    ref = self._scores(self.ref_model, flat)
                cur = self._scores(self.policy, flat)
                k = len(part)
                loss = pair_loss(cur[:k], cur[k:], ref[:k], ref[k:], hp.beta).sum() / denom
                if not self.finite(loss):
                    return nan
                self.backward_loss(hp.lambda_pair * loss)
                value += float(loss.detach())
            m.update("loss/pair", value)
            total = total + hp.lambda_pair * value
        m.update("loss/aux", float(total))
        return total
