"""One bounded memory budget for the copies of the weights taken before an optimizer step.

The checks that compare the weights after a step with the weights before it (the
update/weight ratio; the step audit) copy them first. The copies held over one step share one
budget: ``copy_budget`` of the watched weights' bytes (a fraction; 0.1 by default,
`graddbg.options.COPY_BUDGET`), or all of them while they are under `ALWAYS_BYTES` (a small
model is copied whole). A parameter larger than the whole budget is granted alone, when nothing else is held that step: never more than
the budget plus one parameter. Which parameters a check asks for first is its own affair;
`oldest_first` puts those measured longest ago first, so every parameter has its turn, about
every ``1 / copy_budget`` measured steps.

A grant depends only on the parameters' sizes (of the whole tensor, not of this rank's shard)
and on the order asked, never on this rank's free memory, so the ranks of a sharded model
grant the same parameters at the same step (their norms are summed across ranks).

Examples:
    >>> budget = WeightBudget(0.5, always=0)
    >>> budget.grant(0, [40, 30, 20, 10], order=[0, 1, 2, 3])   # 50 of 100 bytes
    [0, 3]
    >>> budget.grant(0, [40, 30, 20, 10], order=[1, 2])           # nothing left at step 0
    []
    >>> budget.grant(1, [40, 30, 20, 10], order=[1, 2]), budget.peak
    ([1, 2], 50)
    >>> WeightBudget(0.1, always=0).grant(0, [80, 20], order=[0, 1])  # larger than the budget: alone
    [0]
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import torch

__all__ = ["WeightBudget", "ALWAYS_BYTES", "oldest_first", "nbytes", "out_of_memory"]

#: weights of fewer bytes than this are copied whole, whatever the fraction (1 MiB)
ALWAYS_BYTES = 1 << 20

_OOM_TEXT = ("out of memory", "not enough memory", "can't allocate memory")


class WeightBudget:
    """The bytes of weight copies that may be held over one optimizer step."""

    def __init__(self, fraction: float, always: Optional[int] = None) -> None:
        self.fraction = float(fraction)
        self.always = ALWAYS_BYTES if always is None else int(always)
        self._step = -1
        self.granted = 0  #: bytes granted for the step `_step`
        self.peak = 0     #: the most bytes granted for one step so far

    def limit(self, total: int) -> int:
        """The bytes that may be held over a step, of weights of ``total`` bytes."""
        return max(int(self.fraction * total), self.always)

    def grant(self, step: int, sizes: Sequence[int], order: Sequence[int]) -> List[int]:
        """The indices of ``order`` (preferred first) that may be copied before ``step``'s
        optimizer step, ``sizes`` being the bytes of every parameter: each that still fits,
        or the first alone when nothing is granted yet at this step."""
        if step != self._step:
            self._step, self.granted = step, 0
        room = self.limit(int(sum(sizes))) - self.granted
        chosen: List[int] = []
        for i in order:
            if sizes[i] <= room or (self.granted == 0 and not chosen):
                chosen.append(int(i))
                room -= sizes[i]
                self.granted += int(sizes[i])
        self.peak = max(self.peak, self.granted)
        return chosen

    def release(self, step: int, nbytes: int) -> None:
        """``nbytes`` granted for ``step`` were not used (the copy failed)."""
        if step == self._step:
            self.granted = max(self.granted - int(nbytes), 0)


def oldest_first(last: np.ndarray) -> List[int]:
    """Parameter indices by the measured step each was last copied at (``-1``: never),
    oldest first, ties in parameter order."""
    return np.argsort(last, kind="stable").tolist()


def nbytes(params: Sequence[torch.Tensor], numel: Sequence[int]) -> List[int]:
    """The bytes of each whole parameter (``numel``: its elements, over all shards)."""
    return [int(n) * p.element_size() for p, n in zip(params, numel)]


def out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` says an allocation failed: an accelerator's out-of-memory error, the
    CPU allocator's ("DefaultCPUAllocator: can't allocate memory"), or Python's MemoryError."""
    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    if isinstance(err, (MemoryError, oom)):
        return True
    return isinstance(err, RuntimeError) and any(t in str(err) for t in _OOM_TEXT)
