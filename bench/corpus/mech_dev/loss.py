"""The second corpus, dev half, mechanism 'loss' (reduction, weighting, targets, masks, terms that
vanish): cases mined from public reports."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .._common import (
    Case,
    batch,
    classification,
    mlp,
    trains,
)


# --- padding label 0 not ignored (ignore_index left at its default -100)
def _padded(seed):
    """Token-level data: 1 real token in 4, the rest padding (id 0, input all zeros)."""
    x, y = classification(seed, c=4)
    y = y + 1  # real tokens are ids 1..4; 0 is the pad id
    pad = (torch.arange(x.shape[0]) % 4) != 0
    x = x.clone()
    x[pad] = 0.0
    y = y.clone()
    y[pad] = 0
    return x, y


def _pad_build(seed):
    model = mlp(seed, d_out=5)
    x, y = _padded(seed)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), {"x": x, "y": y}


def _pad_loop(ignore_index: int):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y, ignore_index=ignore_index)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        real = ex["y"] != 0
        with torch.no_grad():
            logits = model(ex["x"][real])
        yr = ex["y"][real]
        return {"losses": losses, "real_ce": F.cross_entropy(logits, yr).item(),
                "real_acc": (logits.argmax(1) == yr).float().mean().item()}
    return loop


PAD_NOT_IGNORED = Case(
    name="pad_label_not_ignored_in_loss",
    family="loss",
    source="mlfoundations/open_clip pull request #316 ('captioning loss is ignoring the wrong "
           "pad tokens, open_clip tokenizer uses 0 and not -100'); huggingface/transformers "
           "issue #11616 (CrossEntropyLoss() ignores -100, 'usually pad_id != -100'); "
           "FlagAI-Open/FlagAI issue #522 (the padding token 'will contribute to the final loss')",
    description="My token classifier's loss looks low but it learns the real tokens slowly; the "
                "padded positions carry label 0 (the pad id) and the loss is CrossEntropyLoss() "
                "with its default ignore_index=-100.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (b["real_ce"] >= 1.3 * f["real_ce"]
                           and b["real_acc"] <= f["real_acc"] - 0.05 and trains(f, 0.3)),
    build_buggy=_pad_build, loop_buggy=_pad_loop(-100),
    build_fixed=_pad_build, loop_fixed=_pad_loop(0),
    steps=60,
)


# --- the VAE's KL term left out of the loss
class _VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
        self.mu = nn.Linear(32, 2)
        self.logvar = nn.Linear(32, 2)
        self.dec = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 8))


def _vae_build(seed):
    torch.manual_seed(seed)
    model = _VAE()
    g = torch.Generator().manual_seed(seed + 15)
    z = torch.randn(256, 2, generator=g)
    x = z @ torch.randn(2, 8, generator=g) + 0.1 * torch.randn(256, 8, generator=g)
    return model, torch.optim.Adam(model.parameters(), lr=0.01), {"x": x, "y": x, "g": g}


def _vae_loop(with_kl: bool):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, _ = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            h = model.enc(x)
            mu, logvar = model.mu(h), model.logvar(h)
            z = mu + torch.exp(0.5 * logvar) * torch.randn(mu.shape, generator=ex["g"])
            rec = F.mse_loss(model.dec(z), x, reduction="none").sum(1).mean()
            kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(1).mean()
            loss = rec + kl if with_kl else rec
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            h = model.enc(ex["x"])
            mu, logvar = model.mu(h), model.logvar(h)
            kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(1).mean().item()
            mu2 = mu.pow(2).sum(1).mean().item()  # the prior's value: 2 (two latent dims)
        return {"losses": losses, "kl": kl, "mu2": mu2}
    return loop


VAE_NO_KL = Case(
    name="vae_kl_term_missing",
    family="loss",
    source="facebookresearch/irmae issue #1 (no KL term in the reference VAE's loss: 'It's a "
           "mistake in our last update', the fix adds the beta-weighted KL back)",
    description="My VAE reconstructs well but sampling from the prior gives garbage; the "
                "posterior drifts far from N(0, I) because the KL term is missing from the loss.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: b["mu2"] >= 2.0 * f["mu2"] and b["kl"] >= 1.5 * f["kl"] and trains(f, 0.3),
    build_buggy=_vae_build, loop_buggy=_vae_loop(False),
    build_fixed=_vae_build, loop_fixed=_vae_loop(True),
    steps=60,
)


CASES = [PAD_NOT_IGNORED, VAE_NO_KL]
