"""Helpers the fourth corpus's optimizer and params cases (mined by worker b) share: loops and
evaluations with no bug in them."""
from __future__ import annotations

import torch
from torch.nn import functional as F

from ._common import batch


def full_ce(model, ex):
    """Cross-entropy on the whole data set, no gradient."""
    with torch.no_grad():
        return F.cross_entropy(model(ex["x"]), ex["y"]).item()


def full_mse(model, ex):
    """Mean squared error on the whole data set, no gradient."""
    with torch.no_grad():
        return F.mse_loss(model(ex["x"]), ex["y"]).item()


def ce_steps(model, opt, ex, steps, start=0):
    """``steps`` plain classification steps from batch ``start``; the per-step losses."""
    losses = []
    for i in range(start, start + steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
