"""DeepSpeed ZeRO (stages 0-3) as a gradient source of the statistics recorder: the
gradients the optimizer uses are not the parameters' ``.grad`` but ZeRO's reduced
partitions, read at the start of ``engine.step()`` at an accumulation boundary (after
DeepSpeed's reduction, before its clipping and unscaling). Each rank measures its own pieces;
one all-gather of a small table (a norm, a largest magnitude and a presence flag per
parameter) makes the full gradients' statistics, the same on every rank; never a gather of
gradients.

``zero`` is a `graddbg._deepspeed.Zero` (given by the watch: the checks import nothing of
DeepSpeed).
"""
from __future__ import annotations

import math
from typing import Any, Sequence, Tuple

import numpy as np
from torch import Tensor

from graddbg.checks.base import Measured
from graddbg.checks.recorder import GradientSource, StatsRecorder
from graddbg.stats import Readback

__all__ = ["ZeroSource", "ZeroRecorder"]


class ZeroSource(GradientSource):
    """ZeRO's reduced gradient pieces, for `StatsRecorder` to read instead of ``.grad``
    (nothing at the end of a backward pass: a micro-batch's gradients are local and
    unreduced)."""

    def __init__(self, zero: Any) -> None:
        self.zero = zero

    def queue(self, rb: Readback, params: Sequence[Tensor], absmax: bool) -> Any:
        pieces, table = self.zero.read(params, absmax)
        if table.device.type == "cpu":  # (already on the host: nothing to synchronise)
            host: Any = table.numpy()
        else:
            host = rb.add("zero_table", table)
        return (pieces, absmax, table.shape, self.zero.loss_scale(), host)

    def measure(self, token: Any, index: int, lr: float) -> Tuple[Measured, int]:
        pieces, absmax, shape, scale, host = token
        got = host if isinstance(host, np.ndarray) else host.value.reshape(tuple(shape))
        st = self.zero.combine(got, absmax, scale)
        syncs, any_bad = 0, False
        if st.shard_ranks:  # (a rank's piece was non-finite: exact counts, float64 norms)
            if self.zero.rescue(st, pieces, scale):
                syncs += 1
            any_bad = bool(st.bad.any())
        if any_bad and self.zero.skips_overflow():
            # fp16's dynamic loss scale overflowed: DeepSpeed skips this step and lowers the
            # scale by design; an overflow step, as with GradScaler, not an anomaly
            return Measured(lr, st, st.bad, index, scale=scale, overflow=True, in_ledger=False), syncs
        origin = None
        if any_bad:  # (every rank holds the same table: every rank gathers the evidence)
            origin = self.zero.find_origin()
            syncs += 1
        scale_rec = scale if self.zero.engine.fp16_enabled() else math.nan
        return Measured(lr, st, st.bad, index, scale=scale_rec, origin=origin, in_ledger=False), syncs

    def done(self) -> None:
        self.zero.origin.clear()


def ZeroRecorder(zero: Any) -> StatsRecorder:
    """The statistics recorder reading ZeRO's reduced partitions (``zero``: a
    `graddbg._deepspeed.Zero`)."""
    return StatsRecorder(ZeroSource(zero))
