"""Helpers the fourth corpus's 'arithmetic' and 'manual' cases (bench/corpus/mech4/) share:
seeded builds, whole-data-set evaluations and a tiny token-level task, with no bug in them."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ._common import classification, mlp


def tanh_reg(seed, d_in=8, hidden=32):
    """Linear-Tanh-Linear regressor; parameters 0.weight, 0.bias, 2.weight, 2.bias."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def clf_build(make_opt, make=mlp, data=classification):
    """A build: ``make(seed)``, ``make_opt(model.parameters())``, ``data(seed)``."""
    def build(seed):
        model = make(seed)
        x, y = data(seed)
        return model, make_opt(model.parameters()), {"x": x, "y": y}
    return build


def reg_build(make_opt, data, make=tanh_reg):
    return clf_build(make_opt, make, data)


def manual_build(data, make=tanh_reg):
    """A build for a hand-written update loop: the model, no optimizer, the data set."""
    def build(seed):
        model = make(seed)
        x, y = data(seed)
        return model, None, {"x": x, "y": y}
    return build


def eval_ce(model, ex):
    with torch.no_grad():
        return F.cross_entropy(model(ex["x"]), ex["y"]).item()


def eval_mse(model, ex):
    with torch.no_grad():
        return F.mse_loss(model(ex["x"]), ex["y"]).item()


def token_net(seed, d_in=6, hidden=16, classes=4):
    """A per-token classifier (Linear-Tanh-Linear over the last dimension)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, classes))


def token_data(seed, n=64, length=12, d=6, classes=4):
    """Sequences sorted by length (a length-grouped sampler): inputs [n, T, d], per-token
    labels of a fixed teacher [n, T], and the padding mask [n, T] (1.0 on real tokens)."""
    gen = torch.Generator().manual_seed(seed + 4000)
    x = torch.randn(n, length, d, generator=gen)
    w = torch.randn(d, classes, generator=gen)
    y = (x @ w).argmax(-1)
    lengths = torch.sort(torch.randint(1, length + 1, (n,), generator=gen)).values
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    return x, y, mask
