"""Healthy helpers shared by the third corpus's 'arithmetic' and 'manual' cases (mined by
worker a): tiny models, data sets and evaluations with no bug in them."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ._common import classification, linear_regression, mlp


def linear(seed: int, d_in: int = 8) -> nn.Linear:
    """A linear regressor; parameters weight, bias."""
    torch.manual_seed(seed)
    return nn.Linear(d_in, 1)


def scalar_line(seed: int) -> nn.Linear:
    """y = w * x, one weight and no bias (the tutorials' f(x) = w * x)."""
    torch.manual_seed(seed)
    return nn.Linear(1, 1, bias=False)


def tanh_net(seed: int) -> nn.Sequential:
    """Linear-Tanh-Linear regressor (8 -> 32 -> 1); parameters 0.weight, 0.bias, 2.*."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def tanh_net_zero_bias(seed: int) -> nn.Sequential:
    """``tanh_net`` with its biases initialised to zero (as from-scratch code does)."""
    model = tanh_net(seed)
    with torch.no_grad():
        model[0].bias.zero_()
        model[2].bias.zero_()
    return model


def scaled_linear(scale: float):
    """Linear targets far from unit scale."""
    def data(seed):
        x, y = linear_regression(seed)
        return x, y * scale
    return data


def offset_linear(offset: float):
    """Linear targets around a constant offset (a model needs its biases to fit them)."""
    def data(seed):
        x, y = linear_regression(seed)
        return x, y + offset
    return data


def line_data(seed: int, n: int = 256, slope: float = 2.0):
    """One feature, y = slope * x + noise."""
    gen = torch.Generator().manual_seed(seed + 4000)
    x = torch.randn(n, 1, generator=gen)
    return x, slope * x + 0.05 * torch.randn(n, 1, generator=gen)


def build_with(make, data, opt_fn=None):
    """A build: ``make(seed)``, ``opt_fn(params)`` (None: a hand-written loop), ``data(seed)``."""
    def build(seed):
        model = make(seed)
        x, y = data(seed)
        opt = opt_fn(model.parameters()) if opt_fn is not None else None
        return model, opt, {"x": x, "y": y}
    return build


def clf_build(opt_fn):
    return build_with(mlp, classification, opt_fn)


def eval_mse(model, ex) -> float:
    with torch.no_grad():
        return F.mse_loss(model(ex["x"]), ex["y"]).item()


def eval_ce(model, ex) -> float:
    with torch.no_grad():
        return F.cross_entropy(model(ex["x"]), ex["y"]).item()
