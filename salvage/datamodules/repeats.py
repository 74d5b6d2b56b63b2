"""Repeated test runs of one checkpoint (GRAFT SPEC §3.4: "five independent runs").

``test_repeats = R`` makes the test dataloader run over ``R x`` the test tasks; index ``i``
is task ``i % n`` of repeat ``i // n`` (``core.evaluation.split_repeats``), so the loader
stays a plain index loader (Lightning's distributed sampler shards it as before). A
batch is sampled one repeat at a time, each with its own seed stream
(``core.evaluation.repeat_stream``), and every group carries ``task["repeat"]``; the
modules reduce per repeat (``core.evaluation.repeat_metrics``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader

from salvage.core.evaluation import repeat_stream, split_repeats
from salvage.core.seeds import step_seed
from salvage.datamodules.base import RolloutDataModule, _collate, _Indices
from salvage.types import Group, PairedBatch, RolloutBatch

if TYPE_CHECKING:  # a mixin of RolloutDataModule subclasses (type-checked as one)
    _Base = RolloutDataModule
else:
    _Base = object


class RepeatedTest(_Base):
    """Mixin for a ``RolloutDataModule`` with a ``test_repeats`` attribute."""

    test_repeats: int = 1
    _eval_repeat: int = 0

    def eval_seed(self) -> int:
        """The evaluation sampling seed at this step (repeat 0: the single-run seed)."""
        return step_seed(self.seed, self.trainer.global_step, repeat_stream(self._eval_repeat))

    def test_dataloader(self) -> DataLoader | list:
        if self.test_repeats == 1 or "test" not in self.tasks:
            return super().test_dataloader()
        return DataLoader(
            _Indices(len(self.tasks["test"]) * self.test_repeats),
            batch_size=self.val_batch_size,
            shuffle=False,
            collate_fn=_collate,
        )

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if isinstance(batch, RolloutBatch) or self.test_repeats == 1 or not self.trainer.testing:
            return super().on_after_batch_transfer(batch, dataloader_idx)
        parts = []
        for r, idx in split_repeats(batch, len(self.tasks["test"])).items():
            self._eval_repeat = r
            try:
                part = super().on_after_batch_transfer(idx, dataloader_idx)
            finally:
                self._eval_repeat = 0
            for g in _groups(part):
                g.task = {**g.task, "repeat": r}
            parts.append(part)
        return _concat(parts)


def _groups(batch: RolloutBatch) -> list[Group]:
    """The groups of a batch and of the per-model batches it carries (GRAFT: a and b)."""
    out = list(batch.groups)
    if isinstance(batch, PairedBatch):
        out += [g for part in batch.parts().values() for g in _groups(part)]
    return out


def _concat(parts: list[RolloutBatch]) -> RolloutBatch:
    """One batch of several repeats' batches (groups, per-model batches and stats joined)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    stats = first.stats
    for p in parts[1:]:
        stats = stats.plus(p.stats)
    groups = [g for p in parts for g in p.groups]
    if isinstance(first, PairedBatch):
        pairs = [p for p in parts if isinstance(p, PairedBatch)]
        a, b = _concat([p.a for p in pairs]), _concat([p.b for p in pairs])
        more = {k: _concat([p.more[k] for p in pairs]) for k in first.more}
        return PairedBatch(
            groups=groups, temperature=first.temperature, stats=stats, a=a, b=b, more=more
        )
    return RolloutBatch(groups=groups, temperature=first.temperature, stats=stats)
