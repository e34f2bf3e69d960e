"""The held-out cases of the mechanism 'arithmetic' (bench/corpus/mechanisms.py) mined by worker a."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .._common import (
    Case,
    batch,
    changed,
    classification,
    linear_regression,
    mlp,
    snapshot,
    trains,
)
from .._mech_a import (
    eval_ce,
    eval_mse,
    reg_sgd_build,
)


def clf_sgd_build(lr):
    def build(seed):
        model = mlp(seed)
        x, y = classification(seed)
        return model, torch.optim.SGD(model.parameters(), lr=lr), {"x": x, "y": y}
    return build


def linear(seed, d_in=8):
    torch.manual_seed(seed)
    return nn.Linear(d_in, 1)


def scaled_linear(scale):
    """Linear targets far from unit scale."""
    def data(seed):
        x, y = linear_regression(seed)
        return x, y * scale
    return data


# ---- zero_grad inside the accumulation loop

def _accum_zero_loop(bug: bool, accum: int = 4):
    def loop(model, opt, ex, steps):
        losses = []
        for step in range(steps):
            if not bug:
                opt.zero_grad()
            total = 0.0
            for m in range(accum):
                if bug:
                    opt.zero_grad()  # the bug: cleared every micro-batch
                x, y = batch(ex["x"], ex["y"], step * accum + m, 16)
                loss = F.cross_entropy(model(x), y) / accum
                loss.backward()
                total += loss.item()
            opt.step()
            losses.append(total)
        return {"losses": losses, "full": eval_ce(model, ex)}
    return loop


ACCUM_ZERO = Case(
    name="accum_zero_grad_every_micro_batch",
    family="arithmetic",
    source="bytetriper/RAE issue #67 ('optimizer.zero_grad(set_to_none=True) is called inside "
           "the inner loop, so gradients are cleared every microbatch instead of being "
           "accumulated'); pytorch/torchtitan pull request #3575 ('zeroing grad from all "
           "micro-batches except the last one, i.e. no accumulation')",
    description="I accumulate 4 micro-batches per step (each loss divided by 4), but my "
                "zero_grad() sits inside the micro-batch loop; training is much slower than "
                "the same run without accumulation.",
    expected_kinds=("applied_grad",),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and b["full"] >= 1.5 * f["full"],
    build_buggy=clf_sgd_build(0.2),
    loop_buggy=_accum_zero_loop(True),
    build_fixed=clf_sgd_build(0.2),
    loop_fixed=_accum_zero_loop(False),
    steps=30,
)


# ---- clipping in the wrong place / on nothing

def _clip_loop(mode: str, max_norm: float = 2.0):
    """mode: 'good' (backward, clip, step), 'after_step' (clip after step), 'iterator'
    (clip ex["to_clip"], made by the build)."""
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            if mode == "iterator":
                torch.nn.utils.clip_grad_norm_(ex["to_clip"], max_norm)
                opt.step()
            elif mode == "after_step":
                opt.step()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                opt.step()
            losses.append(loss.item())
        return {"losses": losses, "full": eval_mse(model, ex)}
    return loop


def _clip_iter_build(bug: bool, lr: float = 1.0):
    def build(seed):
        model = linear(seed)
        x, y = scaled_linear(20.0)(seed)
        trainable = filter(lambda p: p.requires_grad, model.parameters())
        if not bug:
            trainable = list(trainable)
        opt = torch.optim.SGD(trainable, lr=lr)
        return model, opt, {"x": x, "y": y, "to_clip": trainable}
    return build


def _clip_manifest(b, f):
    return trains(f, 0.5) and (not math.isfinite(b["full"]) or b["full"] >= 3.0 * f["full"])


CLIP_AFTER = Case(
    name="clip_after_optimizer_step",
    family="arithmetic",
    source="VGraphRNN/VGRNN issue #4 ('clip_grad_norm() is called after opt.step() so it "
           "isn't doing anything'); awslabs/graphstorm issue #1366 and pull request #1382 "
           "('--max-grad-norm silently does nothing'); jongwook/onsets-and-frames issue #24",
    description="I clip gradients to norm 2 to keep training stable, but the clip call comes "
                "after optimizer.step(); the loss blows up as if there were no clipping.",
    expected_kinds=(),
    params=(),
    manifest=_clip_manifest,
    build_buggy=reg_sgd_build(1.0, scaled_linear(20.0), make=linear),
    loop_buggy=_clip_loop("after_step"),
    build_fixed=reg_sgd_build(1.0, scaled_linear(20.0), make=linear),
    loop_fixed=_clip_loop("good"),
    steps=40,
)

CLIP_ITER = Case(
    name="clip_exhausted_parameter_iterator",
    family="arithmetic",
    source="PixArt-alpha/PixArt-alpha pull request #160 ('since the lora_layers was "
           "initialized with filter() it would be only iteratable only once. so "
           "accelerator.clip_grad_norm_() ... would always get an empty list. so no gradient "
           "clipping would be done'); pytorch/pytorch issue #148259 (an exhausted iterable "
           "given to clip_grad_norm_: 'no gradient clipping occurs ... silently'); "
           "ShusenTang/Dive-into-DL-PyTorch issue #101",
    description="I build the optimizer from trainable = filter(lambda p: p.requires_grad, "
                "model.parameters()) and clip clip_grad_norm_(trainable, 2.0) every step; the "
                "loss diverges as if nothing were clipped.",
    expected_kinds=(),
    params=(),
    manifest=_clip_manifest,
    build_buggy=_clip_iter_build(True),
    loop_buggy=_clip_loop("iterator"),
    build_fixed=_clip_iter_build(False),
    loop_fixed=_clip_loop("iterator"),
    steps=40,
)


# ---- clip called before backward inside the accumulation loop

def _clip_accum_loop(bug: bool, accum: int = 4, max_norm: float = 2.0):
    def loop(model, opt, ex, steps):
        losses = []
        for step in range(steps):
            opt.zero_grad()
            total = 0.0
            for m in range(accum):
                x, y = batch(ex["x"], ex["y"], step * accum + m, 16)
                loss = F.mse_loss(model(x), y) / accum
                if bug:  # the clip sits in the training step, before backward
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                loss.backward()
                total += loss.item()
            if not bug:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
            losses.append(total)
        return {"losses": losses, "full": eval_mse(model, ex)}
    return loop


CLIP_ACCUM = Case(
    name="clip_before_backward_in_accumulation",
    family="arithmetic",
    source="simchowitzlabpublic/nano-world-model pull request #22 (clip_grad_norm_ inside "
           "training_step, before backward: 'clipping did nothing. With accumulation > 1, it "
           "scales down the gradient mid-accumulation before later micro-batches even get "
           "added in')",
    description="My clip_grad_norm_ call is in the training step before loss.backward(), with "
                "4 accumulated micro-batches; the loss blows up although clipping is on.",
    expected_kinds=("applied_grad",),
    params=(),
    manifest=_clip_manifest,
    build_buggy=reg_sgd_build(3.0, scaled_linear(20.0), make=linear),
    loop_buggy=_clip_accum_loop(True),
    build_fixed=reg_sgd_build(3.0, scaled_linear(20.0), make=linear),
    loop_fixed=_clip_accum_loop(False),
    steps=30,
)


# ---- the accumulation counter restarts every epoch, and an epoch is shorter than a window

def _epoch_counter_loop(bug: bool, accum: int = 6, batches_per_epoch: int = 4):
    def loop(model, opt, ex, steps):
        before, losses, stepped = snapshot(model.parameters()), [], 0
        n_epochs = steps // batches_per_epoch
        opt.zero_grad()
        for epoch in range(n_epochs):
            for b in range(batches_per_epoch):
                x, y = batch(ex["x"], ex["y"], epoch * batches_per_epoch + b, 64)
                loss = F.cross_entropy(model(x), y) / accum
                loss.backward()
                losses.append(loss.item() * accum)
                last = b == batches_per_epoch - 1
                if (b + 1) % accum == 0 or (not bug and last):
                    opt.step()
                    opt.zero_grad()
                    stepped += 1
        return {"losses": losses, "changed": changed(before, model.parameters()),
                "steps_taken": stepped, "full": eval_ce(model, ex)}
    return loop


ACCUM_EPOCH = Case(
    name="accum_window_longer_than_epoch",
    family="arithmetic",
    source="timoschick/pet pull request #25 ('step is reset across epochs ... You'll never "
           "reach step = 4, and then never do gradient updates') and issue #36; "
           "WalkingMeatAxolotl/AnimaLoraStudio pull request #305 (tail micro-batches never "
           "stepped: '3 images / grad_accum=4 -> 0 steps')",
    description="With a small data set (4 batches an epoch) and gradient_accumulation_steps=6, "
                "my per-epoch batch counter never reaches 6; the weights never change.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (not b["changed"]) and b["steps_taken"] == 0 and f["changed"]
    and f["full"] <= 0.7 * b["full"],
    build_buggy=clf_sgd_build(1.0),
    loop_buggy=_epoch_counter_loop(True),
    build_fixed=clf_sgd_build(1.0),
    loop_fixed=_epoch_counter_loop(False),
    steps=48,
)


CASES = [ACCUM_ZERO, CLIP_AFTER, CLIP_ITER, CLIP_ACCUM, ACCUM_EPOCH]
