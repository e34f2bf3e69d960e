"""The dev half of the second corpus, mechanism "precision" (bench/corpus/mechanisms.py:
autocast, fp16/bf16, GradScaler, casts of weights). Develop against these."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .._common import (
    Case,
    batch,
    classification,
    trains,
    worse,
)

CASES = []


def sinusoidal(t, periods=(5.0, 50.0, 500.0)):
    """A sinusoidal embedding of a scalar time ``t`` [n, 1] (fp32 in, fp32 out)."""
    feats = []
    for p in periods:
        feats += [torch.sin(2 * math.pi * t / p), torch.cos(2 * math.pi * t / p)]
    return torch.cat(feats, dim=1)


def timed_regression(seed, n=256, d=4):
    """Features, a time t in [512, 1024) and a target with structure at a 5-unit period."""
    gen = torch.Generator().manual_seed(seed + 5000)
    x = torch.randn(n, d, generator=gen)
    t = 512 + 512 * torch.rand(n, 1, generator=gen)
    y = torch.sin(2 * math.pi * t / 5.0) + 0.5 * x[:, :1]
    return x, t, y


# ---- bf16_norm_weight_rounds_back_to_one


def _ln_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))


def _bf16_build(pure):
    def build(seed):
        model = _ln_model(seed)
        if pure:
            model = model.to(torch.bfloat16)  # weights, and so the optimizer's updates, in bf16
        x, y = classification(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1.5e-3, weight_decay=0.0)
        return model, opt, {"x": x, "y": y}
    return build


def _bf16_loop(model, opt, ex, steps):
    ln = model[1].weight
    before, losses = ln.detach().clone(), []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x.to(model[0].weight.dtype))
        loss = F.cross_entropy(out.float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "ln_moved": not torch.equal(before, ln.detach())}


CASES.append(Case(
    name="bf16_norm_weight_rounds_back_to_one",
    family="precision",
    source="vllm-project/speculators pull request #765 (training fully in bf16: every "
           "normalization weight stayed exactly 1.0, 'the gradient update delta is smaller than "
           "the step size to move away from 1.0'); NVIDIA/Model-Optimizer pull request #2322; "
           "workofart/ml-by-hand pull request #85",
    description="I train with the model cast to bf16 and a small learning rate; the loss goes "
                "down, but my LayerNorm weights are still exactly 1.0 at the end.",
    expected_kinds=("update_rule", "no_update"),
    params=("1.weight",),
    manifest=lambda b, f: (not b["ln_moved"]) and f["ln_moved"] and trains(f, 0.2),
    build_buggy=_bf16_build(True),
    loop_buggy=_bf16_loop,
    build_fixed=_bf16_build(False),
    loop_fixed=_bf16_loop,
    steps=60,
))

# ---- bf16_timestep_rounded_before_embedding


class _Timed(nn.Module):
    def __init__(self, embed_fp32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4 + 6, 64), nn.Tanh(), nn.Linear(64, 1))
        self.embed_fp32 = embed_fp32

    def forward(self, x, t):
        if self.embed_fp32:
            emb = sinusoidal(t).to(torch.bfloat16)
        else:
            emb = sinusoidal(t.to(torch.bfloat16).float()).to(torch.bfloat16)
        return self.net(torch.cat([x, emb.float()], dim=1))


def _timed_build(embed_fp32):
    def build(seed):
        torch.manual_seed(seed)
        model = _Timed(embed_fp32)
        x, t, y = timed_regression(seed)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        return model, opt, {"x": x, "t": t, "y": y}
    return build


def _timed_loop(model, opt, ex, steps):
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        t, _ = batch(ex["t"], ex["y"], i)
        opt.zero_grad()
        loss = F.mse_loss(model(x, t), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses}


CASES.append(Case(
    name="bf16_timestep_rounded_before_embedding",
    family="precision",
    source="modelscope/DiffSynth-Studio issue #562 and pull request #1025 (the timestep cast "
           "to bf16 before the sinusoidal embedding: 998.3897 becomes 1000); "
           "huggingface/diffusers issue #9405 (750 -> 752 in bf16); EleutherAI/gpt-neox pull "
           "request #1016 (bf16 cannot tell 256 from 257)",
    description="My time-conditioned model casts the timestep to the model dtype (bf16) before "
                "the sinusoidal embedding; it cannot fit the fine time structure that fp32 fits.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.5) and worse(b, f, 2.0),
    build_buggy=_timed_build(False),
    loop_buggy=_timed_loop,
    build_fixed=_timed_build(True),
    loop_fixed=_timed_loop,
    steps=60,
))
