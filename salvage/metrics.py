"""Step metrics as torchmetrics objects, so values are reduced correctly across ranks."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import cast

import torch
from torchmetrics import MeanMetric, Metric, SumMetric


class StepMetrics(torch.nn.Module):
    """A fixed set of named metrics updated during one step and read once at its end.

    Names ending in ``_per_s`` or listed in ``sums`` are summed over ranks (throughput
    of the whole job); all others are weighted means. ``compute`` syncs across
    processes (torchmetrics' ``sync_on_compute``), so every rank must call it with the
    same set of names — which is why the set is fixed at construction.
    """

    def __init__(self, names: Iterable[str], sums: Iterable[str] = ()) -> None:
        super().__init__()
        sums = set(sums)
        self.names = list(names)
        self._key = {n: n.replace("/", "__") for n in self.names}
        self.metrics = torch.nn.ModuleDict(
            {
                self._key[n]: (SumMetric() if (n in sums or n.endswith("_per_s")) else MeanMetric())
                for n in self.names
            }
        )
        self._touched: set[str] = set()

    def metric(self, name: str) -> Metric:
        """The torchmetrics metric behind ``name``."""
        return cast(Metric, self.metrics[self._key[name]])

    def update(
        self, name: str, value: float | torch.Tensor, weight: float | torch.Tensor = 1.0
    ) -> None:
        m = self.metric(name)
        v = torch.as_tensor(value, dtype=torch.float32, device=m.device)
        if isinstance(m, MeanMetric):
            m.update(v, torch.as_tensor(weight, dtype=torch.float32, device=v.device))
        else:
            m.update(v)
        self._touched.add(name)

    def compute(self) -> dict[str, float]:
        """Values of all metrics (NaN-free: untouched means are reported as absent)."""
        out: dict[str, float] = {}
        for n in self.names:
            m = self.metric(n)
            with warnings.catch_warnings():  # untouched metric: NaN / 0, dropped below
                warnings.simplefilter("ignore")
                val = m.compute()
            if n not in self._touched and isinstance(m, SumMetric):
                m.reset()
                continue
            if torch.isfinite(val):
                out[n] = float(val)
            m.reset()
        self._touched.clear()
        return out
