"""The third corpus, mechanism "precision" (bench/corpus/mechanisms.py: autocast, fp16/bf16,
GradScaler, casts of weights). Held out: do not run these under graddbg."""
from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn
from torch.nn import functional as F

from .._common import (
    Case,
    any_nonfinite,
    batch,
    classification,
    mlp,
    trains,
    worse,
)

CASES = []

# ---- autocast_around_loop_stale_weight_cache


def _cache_build(seed):
    model = mlp(seed)
    x, y = classification(seed)
    return model, torch.optim.SGD(model.parameters(), lr=0.2), {"x": x, "y": y}


def _cache_loop(outer):
    def loop(model, opt, ex, steps):
        losses = []
        region = torch.autocast("cpu", dtype=torch.bfloat16) if outer else contextlib.nullcontext()
        with region:  # the bug: one autocast around the whole optimisation loop
            for i in range(steps):
                x, y = batch(ex["x"], ex["y"], i)
                opt.zero_grad()
                inner = contextlib.nullcontext() if outer else torch.autocast("cpu",
                                                                              dtype=torch.bfloat16)
                with inner:  # the fix: a fresh autocast region per forward
                    out = model(x)
                loss = F.cross_entropy(out.float(), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            full = F.cross_entropy(model(ex["x"]).float(), ex["y"]).item()
        return {"losses": losses, "full": full}
    return loop


CASES.append(Case(
    name="autocast_around_loop_stale_weight_cache",
    family="precision",
    source="X-GenGroup/Flow-Factory pull request #186 ('torch.autocast's weight cache ... serves "
           "stale fp32->bf16 casts after any in-place weight change. A single outer with "
           "self.autocast() around an optimize() loop masked both optimizer.step() updates ... "
           "this froze training (flat loss)')",
    description="I open one bf16 autocast context around my whole training loop (fp32 master "
                "weights); the optimizer steps, but the training loss barely moves, while the "
                "same loop with autocast around each forward trains.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.3) and worse(b, f, 1.4) and not trains(b, 0.1),
    build_buggy=_cache_build,
    loop_buggy=_cache_loop(True),
    build_fixed=_cache_build,
    loop_fixed=_cache_loop(False),
    steps=40,
))

# ---- clamp_bound_rounds_to_one_in_bf16


def _multilabel(seed, n=256, d=10, k=4):
    gen = torch.Generator().manual_seed(seed + 9100)
    x = torch.randn(n, d, generator=gen)
    w = torch.randn(d, k, generator=gen)
    return x, (x @ w > 0).float()


def _clamp_build(seed):
    model = mlp(seed)
    x, y = _multilabel(seed)
    return model, torch.optim.Adam(model.parameters(), lr=0.03), {"x": x, "y": y}


def _clamp_loop(fp32_probs):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x)
                if fp32_probs:
                    logits = logits.float()
                p = torch.sigmoid(logits)
                # a hand-written binary cross-entropy, clamped "so that the logs stay finite"
                log_p = torch.log(p.clamp(min=1e-6))
                log_survival = torch.log1p(-p.clamp(max=1.0 - 1e-6))
                loss = -(y * log_p + (1 - y) * log_survival).float().mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses}
    return loop


CASES.append(Case(
    name="clamp_bound_rounds_to_one_in_bf16",
    family="precision",
    source="fastino-ai/GLiNER2 pull request #155 ('Fix NaN gradients from "
           "marginal_pair_consistency_loss in half precision': log1p(-probabilities.clamp(max=1.0 "
           "- 1e-6)); 'That epsilon is not representable next to 1.0 in half precision ... the "
           "clamp becomes a no-op')",
    description="My multi-label loss clamps the sigmoid probabilities to 1 - 1e-6 before log1p; "
                "in fp32 it trains, under bf16 autocast the loss turns NaN after a few dozen "
                "steps and never recovers.",
    expected_kinds=("nonfinite",),
    params=(),
    manifest=lambda b, f: (any_nonfinite(b["losses"]) and not any_nonfinite(f["losses"])
                           and trains(f, 0.5)),
    build_buggy=_clamp_build,
    loop_buggy=_clamp_loop(False),
    build_fixed=_clamp_build,
    loop_fixed=_clamp_loop(True),
    steps=60,
))

# ---- master_weights_made_before_checkpoint_load


def _pretrained(seed):
    """A checkpoint of the same model, trained on the task (what the user fine-tunes from)."""
    model = mlp(seed + 50)
    x, y = classification(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for i in range(60):
        xb, yb = batch(x, y, i)
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _master_load_build(load_first):
    def build(seed):
        ckpt = _pretrained(seed)
        model = mlp(seed).to(torch.bfloat16)
        if load_first:
            model.load_state_dict(ckpt)  # load_state_dict copies (and casts) into the bf16 params
        master = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
        opt = torch.optim.SGD(master, lr=0.05)
        if not load_first:
            model.load_state_dict(ckpt)  # the bug: the fp32 master copies still hold the init
        x, y = classification(seed)
        return model, opt, {"x": x, "y": y, "master": master}
    return build


def _master_load_loop(model, opt, ex, steps):
    losses, master = [], ex["master"]
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        model.zero_grad()
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to(torch.bfloat16)).float(), y)
        loss.backward()
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(master, model.parameters()):
                p.copy_(m)  # the bf16 working copy follows the fp32 master weights
        losses.append(loss.item())
    return {"losses": losses}


CASES.append(Case(
    name="master_weights_made_before_checkpoint_load",
    family="precision",
    source="EleutherAI/DeeperSpeed pull request #56 ('an engine with a BF16 optimizer will not "
           "execute self.optimizer.refresh_fp32_params() and thus the optimizer will maintain "
           "random parameters, and after the first update step, model parameters will be "
           "updated to these random parameters': 'the loss dramatically rises after an "
           "update'); stanford-futuredata/Megatron-LM pull request #5 ('Reload optimizer params "
           "when loading bf16 ckpt')",
    description="I fine-tune a bf16 model whose optimizer keeps fp32 master weights; the "
                "checkpoint is loaded after the optimizer is set up, and after the first update "
                "the loss jumps back to that of an untrained model.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (b["losses"][1] >= 1.5 * f["losses"][1] and worse(b, f, 1.5)
                           and abs(b["losses"][0] - f["losses"][0]) < 1e-6),
    build_buggy=_master_load_build(False),
    loop_buggy=_master_load_loop,
    build_fixed=_master_load_build(True),
    loop_fixed=_master_load_loop,
    steps=20,
))

# ---- injected_gradient_ignores_loss_scale


class _SpecifyGradient(torch.autograd.Function):
    """Score distillation's trick: a dummy output whose backward injects a given gradient."""

    @staticmethod
    def forward(ctx, latents, gt_grad, honour_scale):
        ctx.save_for_backward(gt_grad)
        ctx.honour_scale = honour_scale
        return torch.ones([1], dtype=latents.dtype)

    @staticmethod
    def backward(ctx, grad_scale):
        (gt_grad,) = ctx.saved_tensors
        if ctx.honour_scale:
            gt_grad = gt_grad * grad_scale  # the fix: carry the loss scale (GradScaler's)
        return gt_grad, None, None


def _sds_build(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    gen = torch.Generator().manual_seed(seed + 9200)
    z = torch.randn(64, 8, generator=gen)
    target = torch.tanh(z @ torch.randn(8, 4, generator=gen))  # where the guidance pulls
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt, {"z": z, "t": target, "scaler": torch.amp.GradScaler("cpu")}


def _sds_loop(honour_scale):
    def loop(model, opt, ex, steps):
        scaler, losses = ex["scaler"], []
        for i in range(steps):
            z, t = batch(ex["z"], ex["t"], i, 16)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                latents = model(z)
            latents = latents.float()
            gt_grad = (latents - t).detach() / latents.shape[0]  # the guidance's residual
            reg = 1e-4 * latents.pow(2).mean()
            loss = _SpecifyGradient.apply(latents, gt_grad, honour_scale) + reg
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(0.5 * (latents - t).pow(2).sum(1).mean().item())  # what SDS minimises
        return {"losses": losses}
    return loop


CASES.append(Case(
    name="injected_gradient_ignores_loss_scale",
    family="precision",
    source="ashawkey/stable-dreamfusion issue #158 ('custom backward does not account for "
           "gradient scaling': 'it seems like the backward() function in SpecifyGradient does "
           "not consider gradient scaling ... the main SDS loss is not being scaled by the "
           "gradient scaler, but other losses are being scaled')",
    description="I inject the score-distillation gradient with a custom autograd Function and "
                "train with fp16 autocast and a GradScaler; the guided objective falls far "
                "slower than without the scaler, as if only my small regulariser were acting.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.5) and worse(b, f, 3.0),
    build_buggy=_sds_build,
    loop_buggy=_sds_loop(False),
    build_fixed=_sds_build,
    loop_fixed=_sds_loop(True),
    steps=40,
))

# ---- adam_second_moment_saved_in_fp16

ANCHORS = 8400  # the loss is normalised by the anchor count, as detection losses are


def _det_loss(logits, y):
    return F.cross_entropy(logits, y, reduction="sum") / ANCHORS


def _optimizer_state_to_fp16(state_dict, keep_exp_avg_sq):
    """The checkpoint saver: halves the optimizer state to save disk space."""
    state_dict = copy.deepcopy(state_dict)
    for st in state_dict["state"].values():
        for k, v in st.items():
            if k == "step" or (keep_exp_avg_sq and k == "exp_avg_sq"):
                continue
            if isinstance(v, torch.Tensor) and v.dtype == torch.float32:
                st[k] = v.half()
    return state_dict


def _resume_build(keep_exp_avg_sq, lr=0.01, pre_steps=300):
    def build(seed):
        x, y = classification(seed)
        # the first run, then its checkpoint
        model = mlp(seed)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        for i in range(pre_steps):
            xb, yb = batch(x, y, i)
            opt.zero_grad()
            _det_loss(model(xb), yb).backward()
            opt.step()
        ckpt = {"model": copy.deepcopy(model.state_dict()),
                "optimizer": _optimizer_state_to_fp16(opt.state_dict(), keep_exp_avg_sq)}
        # the resumed run
        model = mlp(seed + 1)
        model.load_state_dict(ckpt["model"])
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        opt.load_state_dict(ckpt["optimizer"])  # cast back to the params' dtype (fp32)
        return model, opt, {"x": x, "y": y, "start": pre_steps}
    return build


def _resume_loop(model, opt, ex, steps):
    losses = []
    for i in range(ex["start"], ex["start"] + steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        logits = model(x)
        _det_loss(logits, y).backward()
        opt.step()
        losses.append(F.cross_entropy(logits, y).item())  # the per-sample loss, for the log
    return {"losses": losses}


def _resume_manifest(b, f):
    spike_b, spike_f = max(b["losses"][1:4]), max(f["losses"][1:4])
    return (abs(b["losses"][0] - f["losses"][0]) < 1e-6 and spike_b >= 10.0 * b["losses"][0]
            and spike_b >= 5.0 * spike_f)


CASES.append(Case(
    name="adam_second_moment_saved_in_fp16",
    family="precision",
    source="ultralytics/ultralytics pull request #24085 ('Fix loss explosion on resume': "
           "convert_optimizer_state_dict_to_fp16 saves AdamW's exp_avg_sq in FP16, 'values "
           "below ~6e-5 are rounded to zero. On resume, Adam's update rule divides by "
           "sqrt(exp_avg_sq) + eps ... spiking cls_loss by 1000-5000x'; issue #24079)",
    description="I save checkpoints with the optimizer state converted to fp16 to keep them "
                "small; every time I resume, the loss spikes right after the first steps.",
    expected_kinds=(),
    params=(),
    manifest=_resume_manifest,
    build_buggy=_resume_build(False),
    loop_buggy=_resume_loop,
    build_fixed=_resume_build(True),
    loop_fixed=_resume_loop,
    steps=30,
))
