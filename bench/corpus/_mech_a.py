"""Helpers the arithmetic and optimizer cases of both halves of the second corpus use
(issue 39): small models, builds and loops with no bug in them."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ._common import batch


def tanh_mlp(seed, d_in=8, hidden=32, d_out=1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out))


def reg_sgd_build(lr, data, make=tanh_mlp):
    """A build: ``make(seed)``, SGD over all its parameters, ``data(seed)``."""
    def build(seed):
        model = make(seed)
        x, y = data(seed)
        return model, torch.optim.SGD(model.parameters(), lr=lr), {"x": x, "y": y}
    return build


def eval_ce(model, ex):
    """Cross-entropy on the whole data set."""
    with torch.no_grad():
        return F.cross_entropy(model(ex["x"]), ex["y"]).item()


def eval_mse(model, ex):
    """Mean squared error on the whole data set."""
    with torch.no_grad():
        return F.mse_loss(model(ex["x"]), ex["y"]).item()


def plain_loop(model, opt, ex, steps):
    """The healthy classification loop; ends with the whole data set's cross-entropy."""
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "full": eval_ce(model, ex)}
