"""Helpers the fourth corpus's 'graph' and 'loss' cases mined by worker c share
(bench/corpus/mech4/graph.py, bench/corpus/mech4/loss.py): seeded data and small measures,
with no bug in them."""
from __future__ import annotations

import math

import torch
from torch.nn import functional as F


def token_sets(seed: int, n: int = 256, k: int = 6, d: int = 8, c: int = 4):
    """Sets of ``k`` tokens of ``d`` features; the label is a teacher's argmax over the
    set's mean."""
    gen = torch.Generator().manual_seed(seed + 4100)
    x = torch.randn(n, k, d, generator=gen)
    w = torch.randn(d, c, generator=gen)
    y = (x.mean(1) @ w).argmax(1)
    return x, y


def scalar_wave(seed: int, n: int = 256, noise: float = 0.02):
    """Scalar inputs on [-3, 3] and a wave target: a bank of localised filters fits it when
    their centres spread over the range."""
    gen = torch.Generator().manual_seed(seed + 4200)
    x = torch.rand(n, 1, generator=gen) * 6 - 3
    y = torch.sin(2.0 * x) + 0.3 * x + noise * torch.randn(n, 1, generator=gen)
    return x, y


def two_views(seed: int, n: int = 256, d: int = 10, noise: float = 0.3):
    """Inputs from 4 clusters and two noisy views of each (for a siamese objective)."""
    gen = torch.Generator().manual_seed(seed + 4300)
    centres = torch.randn(4, d, generator=gen) * 2
    lab = torch.randint(0, 4, (n,), generator=gen)
    x = centres[lab] + 0.5 * torch.randn(n, d, generator=gen)
    v1 = x + noise * torch.randn(n, d, generator=gen)
    v2 = x + noise * torch.randn(n, d, generator=gen)
    return x, v1, v2, lab


def spread(z: torch.Tensor) -> float:
    """Per-dimension std of the l2-normalised outputs, averaged: 0 when every input maps to
    the same direction (a collapsed representation), about 1/sqrt(dim) when spread."""
    with torch.no_grad():
        return F.normalize(z, dim=1).std(0).mean().item()


def masks(seed: int, n: int = 256, d: int = 8, pixels: int = 16, empty: float = 0.5):
    """Inputs and binary masks over ``pixels``; a fraction ``empty`` of the samples (those with
    x[:, 0] below a quantile) have an all-zero mask."""
    gen = torch.Generator().manual_seed(seed + 4400)
    x = torch.randn(n, d, generator=gen)
    w = torch.randn(d, pixels, generator=gen)
    m = (x @ w > 0.3).float()
    thr = x[:, 0].quantile(empty)
    is_empty = x[:, 0] < thr
    m[is_empty] = 0.0
    return x, m, is_empty


def imbalanced(seed: int, n: int = 400, d: int = 10, freqs=(0.6, 0.3, 0.1)):
    """A 3-class teacher problem whose classes have the given frequencies (by construction:
    the labels are the teacher's classes ranked by a score cut at the frequency quantiles)."""
    gen = torch.Generator().manual_seed(seed + 4500)
    x = torch.randn(n, d, generator=gen)
    w = torch.randn(d, generator=gen)
    s = x @ w
    q1 = s.quantile(freqs[0])
    q2 = s.quantile(freqs[0] + freqs[1])
    y = torch.zeros(n, dtype=torch.long)
    y[s > q1] = 1
    y[s > q2] = 2
    perm = torch.randperm(n, generator=gen)
    return x[perm], y[perm]


def recall_of(logits: torch.Tensor, y: torch.Tensor, cls: int) -> float:
    """The recall of class ``cls``."""
    sel = y == cls
    if sel.sum() == 0:
        return math.nan
    return (logits.argmax(1)[sel] == cls).float().mean().item()


def outlier_regression(seed: int, n: int = 256, d: int = 8, frac: float = 0.25):
    """A linear teacher's targets, a fraction ``frac`` of them corrupted by a large offset;
    per-sample weights [n, 1]: 0 on the corrupted samples, 1 elsewhere; and the clean targets."""
    gen = torch.Generator().manual_seed(seed + 4600)
    x = torch.randn(n, d, generator=gen)
    w = torch.randn(d, 1, generator=gen) / math.sqrt(d)
    clean = x @ w + 0.05 * torch.randn(n, 1, generator=gen)
    bad = torch.rand(n, generator=gen) < frac
    y = clean.clone()
    y[bad] += 6.0
    weight = (~bad).float().unsqueeze(1)
    return x, y, weight, clean
