"""Healthy helpers shared by the second corpus's manual, data and distributed cases (both
sides): builds and plain loops with no bug in them. Bug-specific code lives in mech_dev/ and
mech_heldout/ only."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from ._common import batch, classification, mlp

__all__ = ["full_eval", "manual_build", "manual_train", "opt_build", "reg_net"]


def reg_net(seed: int) -> nn.Sequential:
    """Linear-Tanh-Linear regressor (8 -> 32 -> 1); parameters 0.weight, 0.bias, 2.*."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def manual_build(make: Callable[[int], nn.Module] = mlp, data=classification):
    """A build for a hand-written update loop: the model, no optimizer, the data set."""
    def build(seed):
        model = make(seed)
        x, y = data(seed)
        return model, None, {"x": x, "y": y}
    return build


def manual_train(update: Callable, loss_fn=F.cross_entropy, size: int = 32):
    """A hand-written loop: forward, backward, then ``update(model, state, i)`` does the step
    (and whatever clearing of .grad it does). ``state`` is a dict kept across iterations."""
    def loop(model, opt, ex, steps):
        losses, state = [], {}
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i, size)
            loss = loss_fn(model(x), y)
            loss.backward()
            update(model, state, i)
            losses.append(loss.item())
        return {"losses": losses}
    return loop


def full_eval(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn=F.cross_entropy):
    """The loss on the whole data set (what the user wanted to minimise), without grad."""
    with torch.no_grad():
        return loss_fn(model(x), y).item()


def opt_build(make=mlp, lr=0.1, data=classification):
    def build(seed):
        model = make(seed)
        x, y = data(seed)
        return model, torch.optim.SGD(model.parameters(), lr=lr), {"x": x, "y": y}
    return build
