"""The third corpus's cases of the mechanism 'arithmetic' (bench/corpus/mechanisms.py): the
step's arithmetic (accumulation, averaging, zero_grad placement, clipping) of real reports,
mined by worker a."""
from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from .._common import (
    Case,
    batch,
    changed,
    snapshot,
    trains,
)
from .._m3_a import (
    build_with,
    clf_build,
    eval_ce,
    eval_mse,
    linear,
    scaled_linear,
)


def _diverged_or_worse(b, f, ratio=3.0):
    return not math.isfinite(b["full"]) or b["full"] >= ratio * f["full"]


# --------------------------------------------------------------------------------------------
# ---- the accumulation test `if batches_done % gradient_accumulations:` (never true for 1)

def _modulo_loop(bug: bool, accum: int = 1):
    def loop(model, opt, ex, steps):
        before, losses, stepped = snapshot(model.parameters()), [], 0
        for batches_done in range(steps):
            x, y = batch(ex["x"], ex["y"], batches_done)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if bug:
                do_step = batches_done % accum  # "Accumulates gradient before each step"
            else:
                do_step = (batches_done + 1) % accum == 0
            if do_step:
                opt.step()
                opt.zero_grad()
                stepped += 1
            losses.append(loss.item())
        return {"losses": losses, "changed": changed(before, model.parameters()),
                "stepped": stepped, "full": eval_ce(model, ex)}
    return loop


def _adam(lr):
    return lambda params: torch.optim.Adam(params, lr=lr)


MODULO = Case(
    name="accum_modulo_test_never_steps",
    family="arithmetic",
    source="eriklindernoren/PyTorch-YOLOv3 issue #325 ('Gradient accumulations not working as "
           "expected': `if batches_done % opt.gradient_accumulations:` 'calls the optimizer "
           "every batch except the Nth ... if you set gradient_accumulations to 1 ... the "
           "optimizer never gets called because anything % 1 == 0') and pull request #313 "
           "('Fix a bug for gradient accumulation')",
    description="I set gradient_accumulations=1 so that the optimizer steps on every batch; "
                "the loss never goes down and the weights are exactly the initial ones.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (not b["changed"]) and b["stepped"] == 0 and f["changed"]
    and trains(f, 0.3) and b["full"] >= 1.5 * f["full"],
    build_buggy=clf_build(_adam(0.01)),
    loop_buggy=_modulo_loop(True),
    build_fixed=clf_build(_adam(0.01)),
    loop_fixed=_modulo_loop(False),
    steps=60,
)


# --------------------------------------------------------------------------------------------
# ---- backward() only in the `else` of the accumulation branch

def _branch_loop(bug: bool, accum: int = 4, max_grad_norm: float = 1.0):
    def loop(model, opt, ex, steps):
        before, losses = snapshot(model.parameters()), []
        for step in range(steps):
            x, y = batch(ex["x"], ex["y"], step, 16)
            loss = F.cross_entropy(model(x), y)
            if bug:
                if accum > 1:
                    loss = loss / accum
                else:
                    loss.backward()
            else:
                if accum > 1:
                    loss = loss / accum
                loss.backward()
            if (step + 1) % accum == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
                opt.step()
                model.zero_grad()
            losses.append(loss.item() * accum)
        return {"losses": losses, "changed": changed(before, model.parameters()),
                "full": eval_ce(model, ex)}
    return loop


def _adamw(lr):
    return lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


BRANCH = Case(
    name="accum_branch_skips_backward",
    family="arithmetic",
    source="thunlp/OpenBackdoor pull request #3 ('Wrong code for gradient accumulations': "
           "`if self.gradient_accumulation_steps > 1: loss = loss / ...` `else: "
           "loss.backward()` - 'Clearly, when gradient_accumulation_steps > 1, the loss would "
           "never backward')",
    description="With gradient_accumulation_steps=4 my trainer runs, steps the optimizer every "
                "4 batches and logs a loss, but the model stays at chance; with 1 it trains.",
    expected_kinds=("empty_step",),
    params=(),
    manifest=lambda b, f: (not b["changed"]) and f["changed"] and trains(f, 0.3)
    and b["full"] >= 1.5 * f["full"],
    build_buggy=clf_build(_adamw(0.01)),
    loop_buggy=_branch_loop(True),
    build_fixed=clf_build(_adamw(0.01)),
    loop_fixed=_branch_loop(False),
    steps=80,
)


# --------------------------------------------------------------------------------------------
# ---- optimizer.step() outside the accumulation condition (the clip is inside it)

def _outside_loop(bug: bool, accum: int = 4, max_norm: float = 2.0):
    def loop(model, opt, ex, steps):
        losses = []
        for actual_step in range(1, steps + 1):
            x, y = batch(ex["x"], ex["y"], actual_step - 1, 16)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            if actual_step % accum == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if not bug:
                    opt.step()
                    opt.zero_grad()
            if bug:
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
        return {"losses": losses, "full": eval_mse(model, ex)}
    return loop


def _sgd(lr):
    return lambda params: torch.optim.SGD(params, lr=lr)


OUTSIDE = Case(
    name="step_outside_accumulation_condition",
    family="arithmetic",
    source="thunlp/OpenPrompt issue #106 ('Optimizer step outside gradient_accumulation "
           "condition in tutorial 4.1?': clip_grad_norm_ inside `if actual_step % "
           "gradient_accumulation_steps == 0`, optimizer1.step() and zero_grad() after it; "
           "'thanks for discovering the ridiculous bug'); lucidrains/reformer-pytorch issue #97 "
           "('optimizer.step() is called at every step and not after every "
           "gradient_accumulate steps')",
    description="I accumulate 4 batches and clip the gradient norm to 2 before each update, "
                "but training blows up as if there were neither accumulation nor clipping.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.5) and _diverged_or_worse(b, f),
    build_buggy=build_with(linear, scaled_linear(20.0), _sgd(1.0)),
    loop_buggy=_outside_loop(True),
    build_fixed=build_with(linear, scaled_linear(20.0), _sgd(1.0)),
    loop_fixed=_outside_loop(False),
    steps=120,
)


# --------------------------------------------------------------------------------------------
# ---- loss.backward(loss): the gradient weighted by the loss value

def _backward_arg_loop(bug: bool):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            if bug:
                loss.backward(loss)
            else:
                loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses, "full": eval_mse(model, ex)}
    return loop


BACKWARD_ARG = Case(
    name="backward_called_with_loss_as_gradient",
    family="arithmetic",
    source="sotte/pytorch_tutorial issue #5 ('Why `loss.backward(loss)` in the Linear "
           "Regression example training'; 'Ups, that should not be there!')",
    description="My linear regression, copied from a tutorial that calls loss.backward(loss), "
                "blows up to inf and then NaN within a few steps at a learning rate that works "
                "elsewhere.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.5) and _diverged_or_worse(b, f),
    build_buggy=build_with(linear, scaled_linear(10.0), _sgd(0.05)),
    loop_buggy=_backward_arg_loop(True),
    build_fixed=build_with(linear, scaled_linear(10.0), _sgd(0.05)),
    loop_fixed=_backward_arg_loop(False),
    steps=60,
)


# --------------------------------------------------------------------------------------------
# ---- max_grad_norm = 0 ("no clipping") handed to clip_grad_norm_ as is

def _clip_zero_loop(bug: bool, max_grad_norm: float = 0.0):
    def loop(model, opt, ex, steps):
        before, losses = snapshot(model.parameters()), []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if bug or max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            opt.step()
            losses.append(loss.item())
        return {"losses": losses, "changed": changed(before, model.parameters()),
                "full": eval_ce(model, ex)}
    return loop


def _sgd_momentum(lr):
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)


CLIP_ZERO = Case(
    name="clip_grad_norm_zero_meant_off",
    family="arithmetic",
    source="microsoft/Cream pull request #133 ('[TinyViT] fix issue when clip_grad is 0'); "
           "InternLM/xtuner pull request #262 ('[Bug] Fix bugs when grad clip == 0'); "
           "OpenNMT/OpenNMT-py issue #1140 ('the grads of parameters will be zero when set the "
           "-max_grad_norm 0 ??'); strands-labs/robots pull request #2028 (max_grad_norm 0: "
           "'0 of 34,701 parameters moved')",
    description="I set clip_grad=0 in the config to turn gradient clipping off; the run "
                "finishes without an error but the loss is flat from the first step.",
    expected_kinds=("empty_step",),
    params=(),
    manifest=lambda b, f: (not b["changed"]) and f["changed"] and trains(f, 0.3)
    and b["full"] >= 1.5 * f["full"],
    build_buggy=clf_build(_sgd_momentum(0.05)),
    loop_buggy=_clip_zero_loop(True),
    build_fixed=clf_build(_sgd_momentum(0.05)),
    loop_fixed=_clip_zero_loop(False),
    steps=60,
)


CASES = [MODULO, BRANCH, OUTSIDE, BACKWARD_ARG, CLIP_ZERO]
