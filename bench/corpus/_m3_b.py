"""Healthy helpers shared by the third corpus's 'optimizer' and 'params' cases mined by
worker b (bench/corpus/mech3/optimizer.py, params.py): small models and loops with no bug
in them."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ._common import batch


class Backbone(nn.Module):
    """An encoder and a head: parameters encoder.0.weight, encoder.0.bias, head.weight,
    head.bias."""

    def __init__(self, d_in=10, hidden=32, d_out=4):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.head(self.encoder(x))


ENCODER = ("encoder.0.weight", "encoder.0.bias")
HEAD = ("head.weight", "head.bias")


def backbone(seed, **kw):
    torch.manual_seed(seed)
    return Backbone(**kw)


def full_ce(model, x, y):
    """Cross-entropy on the whole data set, without gradients."""
    with torch.no_grad():
        return F.cross_entropy(model(x), y).item()


def full_mse(model, x, y):
    with torch.no_grad():
        return F.mse_loss(model(x), y).item()


def accuracy_of(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def ce_steps(model, opt, x, y, steps, start=0, size=32):
    """Plain cross-entropy steps over the data in order; returns the losses."""
    losses = []
    for i in range(start, start + steps):
        xb, yb = batch(x, y, i, size)
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
