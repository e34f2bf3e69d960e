"""The histograms of |grad| (``watch(histograms=...)``): on the recorded steps of their
cadence, per parameter, counts of the gradient's magnitudes in the bins of
`graddbg.stats.HIST_EDGES`, computed on the device from the gradients the recorder measured
and read back with the step's one read-back (``step.hist``, in the step's row of the history).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from graddbg.checks.base import Check, Finding, Step, wrote
from graddbg.checks.recorder import StatsRecorder
from graddbg.stats import HIST_EDGES, Slot, histogram_counts

__all__ = ["Histograms"]


class Histograms(Check):
    """Counts of |grad| per parameter on the steps of ``histograms=``'s cadence."""

    after = (StatsRecorder,)

    def __init__(self) -> None:
        self._edges: Optional[Tensor] = None

    def queue(self, step: Step) -> Optional[Slot]:
        la = step.launched
        if la is None or not step.due_stats or not self.ctx.options.histogram_schedule.includes(step.index):
            return None
        return step.readback.add("hist", self._counts(la.grads))

    def read(self, step: Step) -> List[Finding]:
        slot: Optional[Slot] = step.token(self)
        if slot is not None:
            return wrote([], hist=slot.value.reshape(len(self.ctx), -1).astype(np.int64))
        return []

    def _counts(self, grads: Sequence[Optional[Tensor]]) -> Tensor:
        dev = next((g.device for g in grads if g is not None), torch.device("cpu"))
        if self._edges is None or self._edges.device != dev:
            self._edges = torch.tensor(HIST_EDGES, dtype=torch.float64, device=dev)
        nb = len(HIST_EDGES) + 1
        return torch.stack([histogram_counts(g, self._edges) if g is not None
                            else torch.zeros(nb, dtype=torch.int64, device=dev) for g in grads])
