"""The dev half of the second corpus, mechanism "params" (bench/corpus/mechanisms.py: the
model's parameters and their initial state). Develop against these."""
from __future__ import annotations

import math

import torch
from torch import nn

from .._common import (
    Case,
    classification,
    trains,
    worse,
)
from .._mech_c import ce_loop, mse_loop

CASES = []


def multi_target(seed, n=256, d=8, k=4):
    """Inputs and [n, k] targets: k different linear-tanh teachers."""
    gen = torch.Generator().manual_seed(seed + 4000)
    x = torch.randn(n, d, generator=gen)
    w = torch.randn(d, k, generator=gen) / math.sqrt(d)
    return x, torch.tanh(2 * x @ w)


# ---- modulelist_of_one_repeated_head


class _Heads(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
        if shared:
            self.heads = nn.ModuleList([nn.Linear(32, 1)] * 4)  # one module, four times
        else:
            self.heads = nn.ModuleList([nn.Linear(32, 1) for _ in range(4)])

    def forward(self, x):
        h = self.trunk(x)
        return torch.cat([head_(h) for head_ in self.heads], dim=1)


def _heads_build(shared):
    def build(seed):
        torch.manual_seed(seed)
        model = _Heads(shared)
        x, y = multi_target(seed)
        return model, torch.optim.Adam(model.parameters(), lr=0.02), {"x": x, "y": y}
    return build


CASES.append(Case(
    name="modulelist_of_one_repeated_head",
    family="params",
    source="zalandoresearch/pytorch-vq-vae issue #2 (nn.ModuleList([Residual(...)] * n) "
           "'duplicates a reference to a single Residual object instance'); yaoppeng/U-Net_v2 "
           "issue #10 ([nn.Conv2d(...)] * 4: 'all four entries ... point to the same object'); "
           "acids-ircam/ddsp_pytorch issue #37 (two MLPs share weights by accident)",
    description="Each of my four targets has its own output head, built as "
                "nn.ModuleList([nn.Linear(32, 1)] * 4); the four predictions come out identical.",
    expected_kinds=("module_setup",),
    params=("heads.0.weight", "heads.0.bias"),
    manifest=lambda b, f: trains(f, 0.5) and worse(b, f, 2.0),
    build_buggy=_heads_build(True),
    loop_buggy=mse_loop,
    build_fixed=_heads_build(False),
    loop_fixed=mse_loop,
    steps=60,
))

# ---- learnable_offset_registered_as_buffer


class _Offset(nn.Module):
    def __init__(self, fixed):
        super().__init__()
        self.proj = nn.Linear(10, 4, bias=False)
        if fixed:
            self.mu = nn.Parameter(torch.zeros(4))
        else:
            self.register_buffer("mu", torch.zeros(4))  # meant to be learned

    def forward(self, x):
        return self.proj(x) + self.mu


def _offset_build(fixed):
    def build(seed):
        torch.manual_seed(seed)
        model = _Offset(fixed)
        x, y = classification(seed, prior=(4.0, 2.0, -2.0, -4.0))
        return model, torch.optim.Adam(model.parameters(), lr=0.05), {"x": x, "y": y}
    return build


def _offset_loop(model, opt, ex, steps):
    before = model.mu.detach().clone()
    out = ce_loop(model, opt, ex, steps)
    out["mu_moved"] = not torch.equal(before, model.mu.detach())
    return out


CASES.append(Case(
    name="learnable_offset_registered_as_buffer",
    family="params",
    source="imbue-ai/slot_attention issue #8 (slot_mu and slot_log_sigma defined with "
           "register_buffer: 'these two values are indeed the same throughout the training "
           "process')",
    description="My learned per-class offset is declared with register_buffer; it never "
                "changes and the rare classes are over-predicted.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (not b["mu_moved"]) and f["mu_moved"] and worse(b, f, 1.3),
    build_buggy=_offset_build(False),
    loop_buggy=_offset_loop,
    build_fixed=_offset_build(True),
    loop_fixed=_offset_loop,
    steps=60,
))
