"""The demo's own model and training loop (``graddbg demo``), written as a user's would be.

This file plays the user's code in the demo: graddbg's blame treats it as such, so the
planted 0/0 is named at its line here (``RowNorm.forward``), as a NaN in a user's model
would be named in the user's file. Nothing else in graddbg imports it.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Dict, Optional

import torch
from torch import nn

__all__ = ["RowNorm", "demo_model", "demo_loss", "train"]


class RowNorm(nn.Module):
    """Scales each row to unit length: an all-zero row is 0/0 (the planted fault)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=1, keepdim=True)  # the demo's planted 0/0 on an all-zero row


def demo_model() -> nn.Module:
    """The demo's model: 16 inputs, a row normalisation, one hidden layer, one output."""
    return nn.Sequential(OrderedDict(
        embed=nn.Linear(16, 32, bias=False), act=nn.ReLU(), norm=RowNorm(),
        hidden=nn.Linear(32, 32), act2=nn.Tanh(), head=nn.Linear(32, 1)))


def demo_loss(model: nn.Module, x: torch.Tensor, true_w: torch.Tensor) -> torch.Tensor:
    """The regression loss of the demo: fit ``tanh(x @ true_w)``."""
    return nn.functional.mse_loss(model(x), torch.tanh(x @ true_w)[:, None])


def train(model: nn.Module, true_w: torch.Tensor, gen: torch.Generator, steps: int, nan_step: int,
          jump_step: int, on_step: Optional[Callable[[int, float, Any], None]] = None,
          kept: Optional[Dict[str, Any]] = None) -> Any:
    """Train ``model`` under `graddbg.watch` with the two planted faults; the closed Watch.

    ``on_step(i, loss, watch)`` is called after each step (the command line's progress bar).
    ``kept``, when given, receives the NaN step's batch (``"nan_x"``) and the weights it
    ran with (``"nan_state"``), to draw that step's graph afterwards.
    """
    import graddbg

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with graddbg.watch(model, opt, nonfinite="skip", explode=graddbg.Explode(factor=20, policy="record"),
                       histograms=10, update_every=5) as w:
        for i in range(steps):
            x = torch.randn(32, 16, generator=gen)
            if i == nan_step:
                x[3] = 0.0  # fault 1: an all-zero row
                if kept is not None:
                    kept["nan_x"] = x.clone()
                    kept["nan_state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            if i in (jump_step, jump_step + 1):
                for g in opt.param_groups:  # fault 2: a one-step learning-rate spike
                    g["lr"] = g["lr"] * 1000.0 if i == jump_step else g["lr"] / 1000.0
            loss = demo_loss(model, x, true_w)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if on_step is not None:
                on_step(i, loss.item(), w)
    return w
