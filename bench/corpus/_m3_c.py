"""Helpers shared by the third corpus' 'graph' and 'loss' cases mined by worker c: tiny models,
seeded data and evaluations, with no bug in them."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def tanh_reg(seed, d_in=8, hidden=32, d_out=1):
    """Linear-Tanh-Linear; parameters 0.weight, 0.bias, 2.weight, 2.bias."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out))


def mse_on(model, x, y):
    with torch.no_grad():
        return F.mse_loss(model(x), y).item()


def binary_data(seed, n=512, d=10, pos_rate=0.15):
    """Inputs and {0, 1} labels of a linear teacher, thresholded so ~pos_rate are positive."""
    gen = torch.Generator().manual_seed(seed + 4000)
    x = torch.randn(n, d, generator=gen)
    w = torch.randn(d, generator=gen)
    s = x @ w
    thr = torch.quantile(s, 1 - pos_rate)
    return x, (s > thr).long()


def recall(pred, y, cls):
    sel = y == cls
    return (pred[sel] == cls).float().mean().item()


def teacher_regression(seed, n=256, d=8, hidden=16, noise=0.05):
    """Inputs and [n, 1] targets of a random tanh teacher network (a student MLP can fit it)."""
    gen = torch.Generator().manual_seed(seed + 9000)
    x = torch.randn(n, d, generator=gen)
    w1 = torch.randn(d, hidden, generator=gen) / d ** 0.5
    w2 = torch.randn(hidden, 1, generator=gen) * (2.0 / hidden ** 0.5)
    y = torch.tanh(2 * x @ w1) @ w2 + noise * torch.randn(n, 1, generator=gen)
    return x, y
