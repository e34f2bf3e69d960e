"""The update/weight ratio ``||w_old - w_new|| / ||w_old||``: a copy of the weights before
the optimizer's step on every ``update_every``-th recorded step, the ratio after it, read
back with the next read-back (never a read of its own).

The copies share the watch's memory budget (`graddbg.checks.budget.WeightBudget`,
``copy_budget=``): each measured step copies the parameters measured longest ago that fit
in it, so a large model has each parameter's ratio every ``1 / copy_budget`` measured steps
or so, and NaN for the others, as on the steps not measured."""
from __future__ import annotations

import warnings
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from graddbg._args import Schedule
from graddbg._errors import GraddbgWarning
from graddbg.checks.recorder import StatsRecorder
from graddbg.checks.base import Check, Finding, Step, Watched, record_update, wrote
from graddbg.checks.budget import nbytes, oldest_first, out_of_memory
from graddbg.stats import Slot, local_values, update_ratios

__all__ = ["UpdateRatio"]


class UpdateRatio(Check):
    """Measures how much the optimizer's step moved each weight, relative to the weight."""

    after = (StatsRecorder,)

    def __init__(self) -> None:
        self._copy: Optional[Tuple[int, List[int], List[Tensor]]] = None  # (step, indices, copies)
        self._ratios: Optional[Tuple[int, Tensor]] = None  # (step, [P] ratios on the device)
        self._last = np.zeros(0, dtype=np.int64)  # [P] the measured step each was last copied at (-1: never)
        self._measured = 0  # measured steps so far

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self.schedule = ctx.options.update_schedule if ctx.optimizer is not None else Schedule(None)
        self._last = np.full(len(ctx.params), -1, dtype=np.int64)

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
        if not step.closure and self.due(step.index):
            self._take_copy(step.index)
        if queued is not None:  # (into w.stats and the ledger entry of the step they were measured at)
            return wrote([], update=(queued[0], queued[1].value))
        return []

    def before_step(self, index: int, closure: bool) -> None:
        if closure and self.due(index):  # (step(closure): the boundary comes after the step)
            self._take_copy(index)

    def _take_copy(self, index: int) -> None:
        """Copy the weights that the budget grants. Where there is no memory for the copy (a
        model that fills its device or the host), the training step goes on: a warning says so
        and the ratio is switched off."""
        self._copy = None  # (the last step's copy, if its step never came, before the next one)
        params, budget = self.ctx.params, self.ctx.budget
        sizes = nbytes(params, self.ctx.numel)
        chosen = budget.grant(index, sizes, oldest_first(self._last))
        if not chosen:
            return
        try:
            self._copy = (index, chosen, self.copy_weights([params[i] for i in chosen]))
        except (RuntimeError, MemoryError) as err:
            if not out_of_memory(err):
                raise
            budget.release(index, sum(sizes[i] for i in chosen))
            self.schedule, self._copy = Schedule(None), None
            mb = sum(sizes[i] for i in chosen) / 2**20
            warnings.warn(
                f"graddbg.watch: no memory for the copy of the weights ({mb:.0f} MB of {len(chosen)} of "
                f"{len(params)} parameters) that the update/weight ratio needs before the optimizer's step; "
                f"it is not measured from step {index} on, and training goes on. Pass update_every=None to "
                f"skip it, or a smaller copy_budget= (now {budget.fraction:g} of the weights). "
                f"(torch said: {str(err).strip()[:200]})", GraddbgWarning, stacklevel=2)
            return
        self._last[chosen] = self._measured
        self._measured += 1

    @staticmethod
    def copy_weights(params: Sequence[Tensor]) -> List[Tensor]:
        with torch.no_grad():
            return [local_values(p).clone() for p in params]

    def after_step(self, index: int) -> None:
        copy, self._copy = self._copy, None
        if copy is None or copy[0] != index:
            return
        _, chosen, before = copy
        with torch.no_grad():
            part = update_ratios(before, [self.ctx.params[i] for i in chosen], self._group())
            del before
            ratios = torch.full((len(self.ctx.params),), float("nan"), dtype=part.dtype, device=part.device)
            ratios[torch.tensor(chosen, device=part.device)] = part
        self._ratios = (index, ratios)

    def _group(self) -> Any:
        """Where DTensor weights' norms are summed (False: nowhere, this rank's shards)."""
        layout = self.ctx.layout
        return None if layout is None else layout.shards_over()

    def params_added(self, k: int) -> None:
        self._copy, self._ratios = None, None
        self._last = np.concatenate([self._last, np.full(k, -1, dtype=np.int64)])

    def flush(self) -> None:
        """The last ratios into the history (reading the record reads them back)."""
        if self._ratios is not None:
            step, ratios = self._ratios
            self._ratios = None
            host = ratios.cpu().numpy()
            record_update(self.ctx.history, self.ctx.ledger, step, host)

    def close(self) -> None:
        self.flush()
        self._copy = None
