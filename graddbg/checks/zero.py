"""The statistics recorder under DeepSpeed ZeRO (stages 0-3): the gradients the optimizer
uses are not the parameters' ``.grad`` but ZeRO's reduced partitions, read at the start of
``engine.step()`` at an accumulation boundary (after DeepSpeed's reduction, before its
clipping and unscaling). Each rank measures its own pieces; one all-gather of a small table
(a norm, a largest magnitude and a presence flag per parameter) makes the full gradients'
statistics, the same on every rank; never a gather of gradients.

``source`` is a `graddbg._deepspeed.Zero` (given by the watch: the checks import
nothing of DeepSpeed).
"""
from __future__ import annotations

import math
from typing import Any, List

import numpy as np

from graddbg.checks.base import Check, Finding, Step
from graddbg.checks.recorder import StatsRecorder
from graddbg.stats import StepRecord

__all__ = ["ZeroRecorder"]


class ZeroRecorder(StatsRecorder):
    """`StatsRecorder` reading ZeRO's reduced gradient pieces instead of ``.grad``."""

    def __init__(self, source: Any) -> None:
        super().__init__()
        self.source = source

    # (a micro-batch's local, unreduced gradients: nothing to read at the end of a backward
    # pass; the base class's no-op, so that the watch does not call it)
    on_backward_end = Check.on_backward_end

    def queue(self, step: Step) -> Any:
        if not step.read:
            return None
        absmax = self._absmax_due(step.index, [])
        pieces, table = self.source.read(self.ctx.params, absmax)
        if table.device.type == "cpu":  # (already on the host: nothing to synchronise)
            host = table.numpy()
        else:
            host = step.readback.add("zero_table", table)
        return (pieces, absmax, table.shape, self.source.loss_scale(), host)

    def read(self, step: Step) -> List[Finding]:
        try:
            return self._read(step)
        finally:
            self.source.origin.clear()  # (the evidence of this step's micro-batches)

    def _read(self, step: Step) -> List[Finding]:
        state = step.token(self)
        if state is None:
            self.history.append(StepRecord(step.index, lr=self._lr()))
            return []
        pieces, absmax, shape, scale, host = state
        got = host if isinstance(host, np.ndarray) else host.value.reshape(tuple(shape))
        st = self.source.combine(got, absmax, scale)
        any_bad = False
        if st.shard_ranks:  # (a rank's piece was non-finite: exact counts, float64 norms)
            if self.source.rescue(st, pieces, scale):
                self.ctx.host_syncs += 1
            any_bad = bool(st.bad.any())
        self.ever_grad |= st.has_grad
        if any_bad and self.source.skips_overflow():
            # fp16's dynamic loss scale overflowed: DeepSpeed skips this step and lowers the
            # scale by design; an overflow step, as with GradScaler, not an anomaly
            self.history.append(StepRecord(step.index, overflow=True, scale=scale, lr=self._lr()))
            return []
        scale_rec = scale if self.source.engine.fp16_enabled() else math.nan
        self.history.append(StepRecord(step.index, per_param=st if step.due_stats else None,
                                       global_norm=st.global_norm, scale=scale_rec, lr=self._lr()))
        step.stats, step.bad, step.first_bad = st, st.bad, step.index
        if any_bad:  # (every rank holds the same table: every rank gathers the evidence)
            step.origin = self.source.find_origin()
            self.ctx.host_syncs += 1
        return []

    def close(self) -> None:
        super().close()
