"""VH-GPO's verified handoff with a co-trained peer as the teacher (docs/peers.md).

In a run of two (or N) students (``PeerHandoffModule`` with ``AgentPeersDataModule``), each
student's zero-signal groups are rescued through the same verified handoff search as
VH-GPO's (SPEC §2: teacher recovery from the student's failed backbone, earliest confirmed
handoff, verified relay, the three auxiliary losses), with the teacher being a peer student
at its CURRENT weights, not a frozen copy: student ``a`` is rescued by ``b``, ``b`` by ``c``
(or by ``a`` when there are two), and so on cyclically (ours). ``teacher: frozen`` is the
comparison the issue asks for: the same run with each student rescued by a FROZEN copy of
its peer's initial weights (loaded from the peer's policy spec, as VH-GPO's frozen LM
teacher is), so a study can tell what the peer's co-training adds. The peer samples through its
own engine, tokenizer and chat template; its recovery tokens count as teacher tokens
(``cost/extra_tokens_teacher``). The selection, search and accounting of each student run
on its own part of the batch with its own random streams (the stage's seed offset per
student as GRAFT's sampling streams are) and its own cumulative counters; metrics are
logged per student (``a/relay/...``, ``a/cost/...``) and the run's extra-token ratio over
all students (``cost/extra_token_ratio``). ``relays.jsonl`` names the student and its
teacher (``peer:b``, or ``frozen:b`` for the frozen copy).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from salvage.callbacks.relay import (
    RescueCallback,
    VerifiedHandoff,
    _Accounting,
    frozen_lm_policy,
)
from salvage.core.relay import RelayConfig
from salvage.core.seeds import PEER_OFFSET
from salvage.datamodules.agent_peers import AgentPeersDataModule
from salvage.datamodules.base import attached_datamodule
from salvage.errors import ConfigError
from salvage.types import PairedBatch

EXTRA = ("extra_tokens_teacher", "extra_tokens_search", "extra_tokens_confirm")


class PeerHandoff(VerifiedHandoff):
    """Verified handoff (VH-GPO) where each student's teacher is its co-trained peer.

    Args:
        relay: search settings (every knob of SPEC §2 with its default, as VerifiedHandoff).
        seed: seed of the search's random streams (offset per student).
        records: write ``relays.jsonl`` in the run directory.
        teacher: ``live`` (the peer at its current, co-trained weights) or ``frozen`` (a
            frozen copy of the peer's initial weights, loaded from its policy spec).
    """

    def __init__(
        self,
        relay: RelayConfig | None = None,
        seed: int = 0,
        records: bool = True,
        teacher: str = "live",
    ) -> None:
        if teacher not in ("live", "frozen"):
            raise ConfigError(
                f"rescue.init_args.teacher must be 'live' or 'frozen', got {teacher!r}"
            )
        RescueCallback.__init__(self, relay, seed, records)
        self.teacher = teacher
        self._frozen: dict[str, Any] = {}  # peer name -> its frozen initial copy's policy
        self._frozen_models: list[torch.nn.Module] = []
        self.teacher_spec = None  # type: ignore[assignment]  # the peer, chosen per student
        self._teacher: Any = None
        self.acc.random_handoff = self.cfg.handoff == "random"
        self._accs: dict[str, _Accounting] = {}
        self._student = ""
        self._peer = ""

    def describe(self) -> str:
        return (
            f"rescue: PeerHandoff (handoff={self.cfg.handoff}, anchor_order="
            f"{self.cfg.anchor_order}, search={self.cfg.search}), teacher: "
            + (
                "the co-trained peer student (current weights)"
                if self.teacher == "live"
                else "a frozen copy of the peer student's initial weights"
            )
        )

    def teacher_name(self) -> str:
        return f"{'peer' if self.teacher == 'live' else 'frozen'}:{self._peer}"

    @staticmethod
    def peer_of(names: tuple[str, ...], name: str) -> str:
        """The student that rescues ``name``: the next one in order, cyclically."""
        return names[(names.index(name) + 1) % len(names)]

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        RescueCallback.setup(self, trainer, pl_module, stage)
        attached_datamodule(trainer, AgentPeersDataModule)
        names = getattr(pl_module, "names", None)
        if not names or len(names) < 2:
            raise ConfigError(
                f"PeerHandoff needs a module of two or more students (PeerHandoffModule), "
                f"got {type(pl_module).__name__}"
            )
        from salvage.modules.vhgpo import VHGPOModule

        for n in names:
            if not isinstance(pl_module.learner(n), VHGPOModule):  # type: ignore[operator]
                raise ConfigError(
                    f"PeerHandoff: student {n} is not a VH-GPO learner (its relays would not "
                    "be trained on): use PeerHandoffModule"
                )
        if self.teacher == "frozen" and not self._frozen:
            dm = attached_datamodule(trainer, AgentPeersDataModule)
            for n in names:
                peer = self.peer_of(tuple(names), n)
                learner = pl_module.learner(peer)  # type: ignore[operator]
                # sampling on the rescued student's device, with the run's engine settings
                student = pl_module.learner(n)  # type: ignore[operator]
                policy, model = frozen_lm_policy(learner.spec, student, dm)
                self._frozen[peer] = policy
                self._frozen_models.append(model)

    def state_dict(self) -> dict[str, Any]:
        return {"per_student": {n: dict(a.total) for n, a in self._accs.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for n, total in state_dict.get("per_student", {}).items():
            self._account(n).total.update(total)

    def _account(self, name: str) -> _Accounting:
        if name not in self._accs:
            acc = _Accounting()
            acc.random_handoff = self.cfg.handoff == "random"
            self._accs[name] = acc
        return self._accs[name]

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not isinstance(batch, PairedBatch):
            return
        dm = attached_datamodule(trainer, AgentPeersDataModule)
        parts = batch.parts()
        names = tuple(parts)
        base = self.seed
        for i, name in enumerate(names):
            self._student, self._peer = name, self.peer_of(names, name)
            self._teacher = (
                dm.student_policy(self._peer)
                if self.teacher == "live"
                else self._frozen[self._peer]
            )
            self.acc = self._account(name)
            self.seed = base + PEER_OFFSET * i  # each student's own search streams
            try:
                super().on_train_batch_start(trainer, pl_module, parts[name], batch_idx)
            finally:
                self.seed = base
        totals = [a.total for a in self._accs.values()]
        root = sum(t["root_tokens"] for t in totals)
        extra = sum(t[k] for t in totals for k in EXTRA)
        pl_module.record({"cost/extra_token_ratio": extra / root if root else 0.0})  # type: ignore[operator]

    def _record(self, trainer: L.Trainer, s: Any) -> dict[str, Any]:
        return {**super()._record(trainer, s), "student": self._student}

    def student_policy(self, pl_module: L.LightningModule, dm: Any) -> Any:
        return dm.student_policy(self._student)

    def emit(self, pl_module: L.LightningModule, values: dict[str, float]) -> None:
        pl_module.record({f"{self._student}/{k}": v for k, v in values.items()})  # type: ignore[operator]

    def inference_models(self, pl_module: L.LightningModule) -> list[torch.nn.Module]:
        """Every student samples here (as a student or as a peer's teacher), and the frozen
        copies where ``teacher: frozen``."""
        return list(pl_module.sampling_models()) + self._frozen_models  # type: ignore[operator]
