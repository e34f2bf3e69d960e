"""Healthy helpers shared by the params and precision cases of the second corpus (both
halves): plain training loops with no bug in them. Bug-specific code lives in mech_dev/ and
mech_heldout/ only."""
from __future__ import annotations

from torch.nn import functional as F

from ._common import batch


def ce_loop(model, opt, ex, steps):
    """SGD/Adam on cross-entropy over the fixed data set, in order."""
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses}


def mse_loop(model, opt, ex, steps):
    """The same with the mean squared error."""
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses}
