"""Healthy helpers of the third corpus's distributed cases (worker d): a data-parallel world
simulated in one process. No bug lives here: each case's own code does what its user did.

``World`` holds one model replica and one optimizer per rank (rank 0's are what the user
would hand to a debugger) and does what DistributedDataParallel does for them: the replicas
start equal (DDP broadcasts rank 0's state when it wraps the model) and, at the end of each
backward round, every replica's ``.grad`` becomes the mean over the ranks, unless the round
runs inside ``no_sync()`` (then each rank keeps accumulating its own gradients).
"""
from __future__ import annotations

import contextlib
import copy
from typing import Callable

import torch
from torch import nn

__all__ = ["World", "spread"]


class World:
    def __init__(self, model: nn.Module, world: int, make_opt: Callable):
        self.models: list[nn.Module] = [model] + [copy.deepcopy(model) for _ in range(world - 1)]
        self.opts = [make_opt(m) for m in self.models]
        self.require_backward_grad_sync = True

    @property
    def size(self) -> int:
        return len(self.models)

    @contextlib.contextmanager
    def no_sync(self):
        """DDP.no_sync(): backward rounds inside it skip the gradient all-reduce."""
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def backward(self, losses: list[torch.Tensor]) -> None:
        """Each rank's ``loss.backward()``; then DDP's all-reduce (mean) unless in no_sync."""
        for loss in losses:
            loss.backward()
        if self.require_backward_grad_sync:
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in self.models)):
                    if ps[0].grad is None:
                        continue
                    mean = torch.stack([p.grad for p in ps]).mean(0)
                    for p in ps:
                        p.grad.copy_(mean)

    def zero_grad(self) -> None:
        for o in self.opts:
            o.zero_grad()


def spread(models: list[nn.Module]) -> float:
    """The largest difference between any replica's parameters and rank 0's."""
    return max(((p - p0).abs().max().item() for m in models[1:]
                for p, p0 in zip(m.parameters(), models[0].parameters())), default=0.0)
