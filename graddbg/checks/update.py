"""The update/weight ratio ``||w_old - w_new|| / ||w_old||``: a copy of the weights before
the optimizer's step on every ``update_every``-th recorded step, the ratio after it, read
back with the next read-back (never a read of its own)."""
from __future__ import annotations

import warnings
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from graddbg._args import Schedule
from graddbg._errors import GraddbgWarning
from graddbg.checks.base import Check, Finding, Step, Watched
from graddbg.stats import Slot, local_values, update_ratios

__all__ = ["UpdateRatio"]


class UpdateRatio(Check):
    """Measures how much the optimizer's step moved each weight, relative to the weight."""

    def __init__(self) -> None:
        self._copy: Optional[List[Tensor]] = None
        self._copy_step = -1
        self._ratios: Optional[Tuple[int, Tensor]] = None  # (step, [P] ratios on the device)

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self.schedule = ctx.options.update_schedule if ctx.optimizer is not None else Schedule(None)

    def due(self, index: int) -> bool:
        return self.schedule.includes(index) and self.ctx.options.record_schedule.includes(index)

    # ------------------------------------------------------------------ events
    def queue(self, step: Step) -> Optional[Tuple[int, Slot]]:
        if step.read and self._ratios is not None:
            index, ratios = self._ratios
            self._ratios = None
            return index, step.readback.add("update", ratios)
        return None

    def read(self, step: Step) -> List[Finding]:
        queued = step.token(self)
        if queued is not None:
            self.ctx.history.set_update(queued[0], queued[1].value)
            self._to_ledger(queued[0], queued[1].value)
        if not step.closure and self.due(step.index):
            self._take_copy(step.index)
        return []

    def before_step(self, index: int, closure: bool) -> None:
        if closure and self.due(index):  # (step(closure): the boundary comes after the step)
            self._take_copy(index)

    def _to_ledger(self, index: int, ratios: np.ndarray) -> None:
        entry = self.ctx.ledger.find(index) if self.ctx.ledger is not None else None
        finite = ratios[np.isfinite(ratios)]
        if entry is not None and len(finite):
            entry.update = float(finite.max())

    def _take_copy(self, index: int) -> None:
        """Copy the weights. Where there is no memory for the copy (a model that fills its
        device), the training step goes on: a warning says so and the ratio is switched off."""
        params = self.ctx.params
        try:
            self._copy = self.copy_weights(params)
            self._copy_step = index
        except torch.cuda.OutOfMemoryError as err:  # (torch.OutOfMemoryError from torch 2.5)
            self.schedule, self._copy = Schedule(None), None
            mb = sum(p.numel() * p.element_size() for p in params) / 2**20
            warnings.warn(
                f"graddbg.watch: no memory for the copy of the weights ({mb:.0f} MB) that the "
                f"update/weight ratio needs before the optimizer's step; it is not measured from "
                f"step {index} on, and training goes on. Pass update_every=None to skip it. "
                f"(torch said: {str(err).strip()[:200]})", GraddbgWarning, stacklevel=2)

    @staticmethod
    def copy_weights(params: Sequence[Tensor]) -> List[Tensor]:
        with torch.no_grad():
            return [local_values(p).clone() for p in params]

    def after_step(self, index: int) -> None:
        copy, self._copy = self._copy, None
        if copy is not None and self._copy_step == index:
            with torch.no_grad():
                self._ratios = (self._copy_step, update_ratios(copy, self.ctx.params, self._group()))

    def _group(self) -> Any:
        """Where DTensor weights' norms are summed (False: nowhere, this rank's shards)."""
        layout = self.ctx.layout
        return None if layout is None else layout.shards_over()

    def params_added(self, k: int) -> None:
        self._copy, self._ratios = None, None

    def flush(self) -> None:
        """The last ratios into the history (reading the record reads them back)."""
        if self._ratios is not None:
            step, ratios = self._ratios
            self._ratios = None
            host = ratios.cpu().numpy()
            self.ctx.history.set_update(step, host)
            self._to_ledger(step, host)

    def close(self) -> None:
        self.flush()
        self._copy = None
