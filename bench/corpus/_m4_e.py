"""Helpers the fourth corpus's 'data' cases (bench/corpus/mech4/data.py) share: seeded
synthetic data sets, a plain epoch loop and evaluations, with no bug in them."""
from __future__ import annotations

import numpy as np
import torch
from torch.nn import functional as F


def local_sum(x: torch.Tensor) -> torch.Tensor:
    """x[j-1] + x[j] + x[j+1] along the last dim (zero padded): a rule symmetric under flips."""
    pad = F.pad(x, (1, 1))
    return pad[..., :-2] + pad[..., 1:-1] + pad[..., 2:]


def strips(seed: int, n: int = 256, length: int = 16):
    """1-D 'images' (float, [n, length]) of a seeded generator."""
    gen = torch.Generator().manual_seed(seed + 8000)
    return torch.randn(n, length, generator=gen)


def to_pixels(x: torch.Tensor, scale: float, dtype=np.uint8) -> np.ndarray:
    """Float features stored as 8-bit pixels around 128 (saturating at 0 and 255)."""
    return (x * scale + 128).round().clamp(0, 255).numpy().astype(dtype)


def epoch_loop(step_fn, loader, steps):
    """Walk ``loader`` epoch after epoch, calling ``step_fn(batch) -> loss float`` ``steps`` times."""
    losses = []
    while len(losses) < steps:
        for b in loader:
            losses.append(step_fn(b))
            if len(losses) == steps:
                break
    return losses


def sgd_step(model, opt, loss_fn):
    """One zero_grad / backward / step; returns the loss as a float."""
    def step(b):
        opt.zero_grad()
        loss = loss_fn(model, b)
        loss.backward()
        opt.step()
        return loss.item()
    return step


def accuracy_of(model, x: torch.Tensor, y: torch.Tensor, shape=None) -> float:
    """Accuracy of ``model`` on (x, y); ``shape`` reshapes the logits first ([B, C, L] masks)."""
    with torch.no_grad():
        logits = model(x)
        if shape is not None:
            logits = logits.view(x.shape[0], *shape)
        return (logits.argmax(1) == y).float().mean().item()
