"""Healthy helpers of the fourth corpus's precision and distributed cases (worker d).
No bug lives here: each case's own code does what its user did.

``DDPWorld`` simulates a data-parallel group in one process, the way DistributedDataParallel
behaves for its ranks: the replicas start equal (DDP broadcasts rank 0's state when it wraps
the model); a forward through the wrapper (``world(rank, x)``) arms that rank's reducer for
the next backward; after a backward round in which every rank's reducer was armed, each
replica's ``.grad`` becomes the mean over the ranks. A rank whose forward went around the
wrapper (``world.module(rank)(x)``) never arms its reducer, and its gradients stay local.
Rank 0's replica and optimizer are what a user hands to a debugger.

``all_gather`` is ``torch.distributed.all_gather`` for the simulated group: it copies every
rank's tensor into the preallocated output tensors, outside autograd (the gathered tensors
carry no gradient history), as the collective does.
"""
from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["DDPWorld", "all_gather", "distinct_fraction", "spread"]


class DDPWorld:
    def __init__(self, model: nn.Module, world: int, make_opt: Callable):
        self.models: list[nn.Module] = [model] + [copy.deepcopy(model) for _ in range(world - 1)]
        self.opts = [make_opt(m) for m in self.models]
        self._armed = [False] * world

    @property
    def size(self) -> int:
        return len(self.models)

    def __call__(self, rank: int, *args, **kwargs):
        """DDP.forward on ``rank``: prepares its reducer for the next backward."""
        self._armed[rank] = True
        return self.models[rank](*args, **kwargs)

    def module(self, rank: int) -> nn.Module:
        """``ddp_model.module`` on ``rank``: the bare replica, no reducer preparation."""
        return self.models[rank]

    def backward(self, losses: list[torch.Tensor]) -> None:
        """Each rank's ``loss.backward()``; then the gradient all-reduce (mean) of the ranks
        whose reducers were armed by a forward through the wrapper."""
        for loss in losses:
            loss.backward()
        if all(self._armed):
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in self.models)):
                    if any(p.grad is None for p in ps):
                        continue
                    mean = torch.stack([p.grad for p in ps]).mean(0)
                    for p in ps:
                        p.grad.copy_(mean)
        self._armed = [False] * self.size

    def zero_grad(self) -> None:
        for o in self.opts:
            o.zero_grad()

    def step(self) -> None:
        for o in self.opts:
            o.step()


def all_gather(outputs: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
    """``dist.all_gather(outputs, tensor)`` where rank k contributed ``tensors[k]``."""
    with torch.no_grad():
        for out, t in zip(outputs, tensors):
            out.copy_(t)


def spread(models: list[nn.Module]) -> float:
    """The largest difference between any replica's parameters and rank 0's."""
    return max(((p - p0).abs().max().item() for m in models[1:]
                for p, p0 in zip(m.parameters(), models[0].parameters())), default=0.0)


def distinct_fraction(index_lists: list[list[int]], n: int) -> float:
    """The fraction of the ``n`` samples that one epoch's shards cover together."""
    return len({i for idx in index_lists for i in idx}) / n
