"""The held-out half of the second corpus, mechanism "precision"
(bench/corpus/mechanisms.py: autocast, fp16/bf16, GradScaler, casts of weights). Do not read
or run these under graddbg until the detection code is final."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .._common import (
    MLP,
    Case,
    any_nonfinite,
    batch,
    changed,
    classification,
    linear_regression,
    mlp,
    snapshot,
    trains,
    worse,
)

CASES = []

# ---- fp16_adam_default_eps_nan


class _Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, tokens):
        return self.out(self.emb(tokens).mean(1))


def _tokens(seed):
    """Sequences of 6 tokens; the first half of the data uses tokens 0-19 only."""
    gen = torch.Generator().manual_seed(seed + 6000)
    low = torch.randint(0, 20, (128, 6), generator=gen)
    high = torch.randint(0, 40, (128, 6), generator=gen)
    tokens = torch.cat([low, high])
    y = (tokens % 4).mode(1).values
    return tokens, y


def _adam16_build(eps):
    def build(seed):
        torch.manual_seed(seed)
        model = _Bag().half()
        x, y = _tokens(seed)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2, eps=eps), {"x": x, "y": y}
    return build


def _adam16_loop(model, opt, ex, steps):
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses}


CASES.append(Case(
    name="fp16_adam_default_eps_nan",
    family="precision",
    source="afiaka87/glide-finetune issue #5 and pull request #6 (half precision: 'after just "
           "the first iteration I was running into nan values', fixed by eps=1e-4); "
           "pytorch/pytorch issue #8860; CambioML/pykoi pull request #69 ('torch.float16 will "
           "round any number smaller than 6e-8 to 0')",
    description="I converted the model with .half() and kept Adam's defaults; the loss is NaN "
                "from the second batch on, although the first step's gradients were all finite.",
    expected_kinds=("nonfinite", "update_rule"),
    params=("emb.weight",),
    manifest=lambda b, f: (any_nonfinite(b["losses"]) and not any_nonfinite(f["losses"])
                           and trains(f, 0.2)),
    build_buggy=_adam16_build(1e-8),
    loop_buggy=_adam16_loop,
    build_fixed=_adam16_build(1e-4),
    loop_fixed=_adam16_loop,
    steps=40,
))

# ---- fp16_clip_norm_overflow_zeroes_grads


def _clip16_build(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 128), nn.Tanh(), nn.Linear(128, 1)).half()
    x, y = linear_regression(seed)
    y = 1000 * y / y.std()  # prices in raw units
    return model, torch.optim.SGD(model.parameters(), lr=0.1), {"x": x.half(), "y": y.half()}


def _clip_fp32(params, max_norm):
    """Clip with the norm computed in fp32 (as the fp16 trainers' own clip does)."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.stack([g.float().norm() for g in grads]).norm()
    coef = min(1.0, max_norm / (total.item() + 1e-6))
    for g in grads:
        g.mul_(coef)


def _clip16_loop(fixed):
    def loop(model, opt, ex, steps):
        before, losses = snapshot(model.parameters()), []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = F.mse_loss(model(x).float(), y.float(), reduction="sum")
            loss.backward()
            if fixed:
                _clip_fp32(list(model.parameters()), 10.0)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            losses.append(loss.item())
        return {"losses": losses, "changed": changed(before, model.parameters())}
    return loop


CASES.append(Case(
    name="fp16_clip_norm_overflow_zeroes_grads",
    family="precision",
    source="facebookresearch/fairscale pull request #263 (grad norm ~5000 per device: 'the "
           "clip norm ... become[s] inf ... because the logic is done in fp16'); "
           "tracel-ai/burn issue #5699 ('FP16 norm clipping can zero finite gradients'); "
           "facebookresearch/pytext pull request #1514 (the clip 'ends up setting the gradients "
           "of the model to 0, thus stopping learning')",
    description="My fp16 model with gradient clipping at 10 does not learn at all: the loss "
                "stays exactly where it started, and nothing is NaN.",
    expected_kinds=("applied_grad", "empty_step"),
    params=(),
    manifest=lambda b, f: (not b["changed"]) and f["changed"] and trains(f, 0.3),
    build_buggy=_clip16_build,
    loop_buggy=_clip16_loop(False),
    build_fixed=_clip16_build,
    loop_fixed=_clip16_loop(True),
    steps=60,
))

# ---- fp16_autocast_without_scaler_small_term


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(10, 32), nn.ReLU())
        self.cls = nn.Linear(32, 4)
        self.aux = nn.Linear(32, 128)  # a dense auxiliary output

    def forward(self, x):
        h = self.trunk(x)
        return self.cls(h), self.aux(h)


def _aux_build(seed):
    torch.manual_seed(seed)
    model = _TwoHeads()
    x, y = classification(seed)
    gen = torch.Generator().manual_seed(seed + 8000)
    target = torch.tanh(x @ torch.randn(10, 128, generator=gen) / 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt, {"x": x, "y": y, "t": target, "scaler": torch.amp.GradScaler("cpu")}


def _aux_loop(scaled):
    def loop(model, opt, ex, steps):
        before = snapshot(model.aux.parameters())
        losses, aux_losses, scaler = [], [], ex["scaler"]
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            _, t = batch(ex["x"], ex["t"], i)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                logits, recon = model(x)
            aux = F.mse_loss(recon.float(), t)
            loss = F.cross_entropy(logits.float(), y) + 1e-5 * aux
            if scaled:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            losses.append(loss.item())
            aux_losses.append(aux.item())
        return {"losses": losses, "aux": aux_losses,
                "aux_moved": changed(before, model.aux.parameters())}
    return loop


CASES.append(Case(
    name="fp16_autocast_without_scaler_small_term",
    family="precision",
    source="engichang1467/Open-Rig3R issue #35 ('autocast defaults to fp16 with no GradScaler "
           "-- gradients can silently underflow to zero': the small loss terms' gradients "
           "vanish, 'no error, no NaN, no warning'); decoderesearch/SAELens pull request #723 "
           "(GradScaler solves fp16 gradient underflow)",
    description="I train under fp16 autocast without a GradScaler; the main loss trains, but "
                "my small auxiliary reconstruction term never improves.",
    expected_kinds=("dead_grad",),
    params=("aux.weight", "aux.bias"),
    manifest=lambda b, f: ((not b["aux_moved"]) and f["aux_moved"]
                           and trains(f, 0.3, key="aux") and not trains(b, 0.05, key="aux")),
    build_buggy=_aux_build,
    loop_buggy=_aux_loop(False),
    build_fixed=_aux_build,
    loop_fixed=_aux_loop(True),
    steps=30,
))

# ---- fp16_handwritten_layernorm_overflow


class _PixelNet(nn.Module):
    def __init__(self, fp32_norm):
        super().__init__()
        self.fc = nn.Linear(10, 32)
        self.weight = nn.Parameter(torch.ones(32))
        self.bias = nn.Parameter(torch.zeros(32))
        self.out = nn.Linear(32, 4)
        self.fp32_norm = fp32_norm

    def norm(self, x):  # a hand-written LayerNorm, as in many model repositories
        dtype = x.dtype
        if self.fp32_norm:
            x = x.float()
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        x = (x - u) / torch.sqrt(s + 1e-6)
        return (self.weight * x.to(dtype) + self.bias)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.fc(x))))


def _pixel_build(fp32_norm):
    def build(seed):
        torch.manual_seed(seed)
        model = _PixelNet(fp32_norm).half()
        x, y = classification(seed)
        x = (500 + 300 * x).clamp(min=0)  # raw sensor counts, not normalised
        return model, torch.optim.SGD(model.parameters(), lr=0.1), {"x": x.half(), "y": y}
    return build


def _pixel_loop(model, opt, ex, steps):
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses}


CASES.append(Case(
    name="fp16_handwritten_layernorm_overflow",
    family="precision",
    source="facebookresearch/ConvNeXt issue #71 ('the model is not stable when convert to "
           "half': in the LayerNorm, 'the result after pow(2) would like to beyond the max num "
           "of fp16'); pytorch/pytorch issue #66707 ('layer_norm needs to be done in fp32 for "
           "fp16 inputs'); microsoft/onnxruntime issue #17692",
    description="I train the model in half precision on raw (unnormalised) sensor counts; the "
                "loss plateaus near chance although the same model trains in fp32.",
    expected_kinds=("dead_grad",),
    params=("fc.weight", "fc.bias", "weight", "bias", "out.weight"),
    manifest=lambda b, f: trains(f, 0.3) and worse(b, f, 1.3),
    build_buggy=_pixel_build(False),
    loop_buggy=_pixel_loop,
    build_fixed=_pixel_build(True),
    loop_fixed=_pixel_loop,
    steps=60,
))

# ---- grad_scaler_skips_every_nan_step


class _Protos(nn.Module):
    def __init__(self, eps):
        super().__init__()
        self.embed = nn.Linear(10, 16)
        self.protos = nn.Parameter(torch.randn(4, 16))
        self.eps = eps

    def forward(self, x):
        e = self.embed(x)
        logits = -((e[:, None] - self.protos[None]) ** 2).sum(-1)
        # a spread term: the mean pairwise distance inside the batch (diagonal included)
        d = ((e[:, None] - e[None]) ** 2).sum(-1)
        spread = torch.sqrt(d + self.eps).mean()
        return logits, spread


def _protos_build(eps):
    def build(seed):
        torch.manual_seed(seed)
        model = _Protos(eps)
        x, y = classification(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.02)
        return model, opt, {"x": x, "y": y, "scaler": torch.amp.GradScaler("cpu")}
    return build


def _protos_loop(model, opt, ex, steps):
    before, losses, scaler = snapshot(model.parameters()), [], ex["scaler"]
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits, spread = model(x)
        loss = F.cross_entropy(logits.float(), y) - 0.01 * spread.float()
        scaler.scale(loss).backward()
        scaler.step(opt)  # skips the step when a gradient is inf/NaN
        scaler.update()
        losses.append(loss.item())
    return {"losses": losses, "changed": changed(before, model.parameters())}


CASES.append(Case(
    name="grad_scaler_skips_every_nan_step",
    family="precision",
    source="Lightning-AI/pytorch-lightning issue #20215 ('Model does not update its weights': "
           "with AMP's GradScaler, steps whose gradients hold inf/NaN are skipped 'by design'); "
           "pytorch/pytorch issue #152279 (scaler.step gives no sign that it skipped)",
    description="With mixed precision my weights never change and the loss is flat; without "
                "the GradScaler the same code gives NaN at once.",
    expected_kinds=("nonfinite",),
    params=(),
    manifest=lambda b, f: (not b["changed"]) and f["changed"] and trains(f, 0.3),
    build_buggy=_protos_build(0.0),
    loop_buggy=_protos_loop,
    build_fixed=_protos_build(1e-6),
    loop_fixed=_protos_loop,
    steps=40,
))

# ---- fp32_master_weights_not_copied_back


def _master_build(seed):
    model = mlp(seed).half()
    master = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    x, y = classification(seed)
    opt = torch.optim.SGD(master, lr=0.3)
    return model, opt, {"x": x.half(), "y": y, "master": master}


def _master_loop(fixed):
    def loop(model, opt, ex, steps):
        before, losses, master = snapshot(model.parameters()), [], ex["master"]
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            model.zero_grad()
            opt.zero_grad()
            loss = F.cross_entropy(model(x).float(), y)
            loss.backward()
            for m, p in zip(master, model.parameters()):
                m.grad = p.grad.float()
            opt.step()
            if fixed:
                with torch.no_grad():
                    for m, p in zip(master, model.parameters()):
                        p.copy_(m)
            losses.append(loss.item())
        return {"losses": losses, "changed": changed(before, model.parameters())}
    return loop


CASES.append(Case(
    name="fp32_master_weights_not_copied_back",
    family="precision",
    source="tinygrad/tinygrad pull request #4144 (fp16 training with an fp32 master copy: a bug "
           "made 'the .cast(...) happen only once and ignore all weight updates'); NVIDIA/apex "
           "issue #507 (the master weights must be cast back into the fp16 model weights "
           "after the step)",
    description="I keep fp32 master copies of my fp16 model's weights for the optimizer; the "
                "master weights change every step but the loss does not move.",
    expected_kinds=("orphan_param",),
    params=MLP,
    manifest=lambda b, f: (not b["changed"]) and f["changed"] and trains(f, 0.3),
    build_buggy=_master_build,
    loop_buggy=_master_loop(False),
    build_fixed=_master_build,
    loop_fixed=_master_loop(True),
    steps=60,
))
