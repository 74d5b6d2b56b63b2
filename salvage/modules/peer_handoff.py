"""PeerHandoffModule: two (or N) co-trained VH-GPO students, each the other's handoff teacher.

Each student is a ``VHGPOModule`` (its own policy, tokenizer, optimiser, reference and
VH-GPO auxiliary losses on the relays of its own groups). The ``PeerHandoff`` rescue stage
rescues each student's zero-signal groups with its peer as the teacher (docs/peers.md);
with ``exchange: true`` GRAFT's trajectory exchange runs as well (both methods in one run).
Data: ``AgentPeersDataModule`` (every student on the same agent tasks).
"""

from __future__ import annotations

from typing import Any

from salvage.modules.graft import GRAFTModule
from salvage.modules.vhgpo import VHGPOModule


class PeerHandoffModule(GRAFTModule):
    """Two co-trained VH-GPO students (rescued by each other through ``PeerHandoff``).

    Args:
        beta: VH-GPO preference temperature of the pair loss (as VHGPOModule).
        lambda_pair: weight of the action-preference (pair) term, each student.
        lambda_bridge: weight of the teacher-bridge term, each student.
        lambda_resume: weight of the student-resume term, each student.
        exchange: also run GRAFT's exchange of whole groups between the students (False:
            the peer acts only as the handoff teacher).
        clip_eps_high: upper clip of the token ratio (VH-GPO's 0.2).
        loss_agg: VH-GPO's ``seq-mean-token-mean`` (or ``token-mean``).
        **kwargs: GRAFTModule's arguments (``policy_a``, ``policy_b``, ``lr``, ``lr_b``,
            ``num_minibatches``, ``micro_batch_size``, ``kl_coef``, GRAFT's exchange switches).
    """

    def __init__(
        self,
        beta: float = 0.1,
        lambda_pair: float = 1.0,
        lambda_bridge: float = 1.0,
        lambda_resume: float = 1.0,
        exchange: bool = False,
        clip_eps_high: float = 0.2,
        loss_agg: str = "seq-mean-token-mean",
        **kwargs: Any,
    ) -> None:
        super().__init__(
            exchange=exchange, clip_eps_high=clip_eps_high, loss_agg=loss_agg, **kwargs
        )
        vh: dict[str, Any] = dict(
            beta=beta,
            lambda_pair=lambda_pair,
            lambda_bridge=lambda_bridge,
            lambda_resume=lambda_resume,
        )
        for name in self.names:  # the same settings, as VH-GPO learners
            old = self.learner(name)
            setattr(
                self, name, VHGPOModule(policy=old.spec, lr=old.hparams.lr, **self._common, **vh)
            )
