"""Held-out cases of the second corpus, mechanism "manual" (see mechanisms.py)."""
from __future__ import annotations

import copy

import torch
from torch.nn import functional as F

from .._common import (
    Case,
    batch,
    changed,
    classification,
    head,
    linear_regression,
    mlp,
    snapshot,
    tail,
    trains,
    worse,
)
from .._mech_d import manual_build, manual_train, reg_net


# --- grads never zeroed in a hand-written loop
def _no_zero_update(zero: bool, lr: float = 0.05):
    def update(model, state, i):
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
                if zero:
                    p.grad.zero_()
    return update


MANUAL_NO_ZERO = Case(
    name="manual_sgd_grads_never_zeroed",
    family="manual",
    source="greebear/pytorch-learning issue #1 ('The loss is not always decreasing, even lr is "
           "very small 1e-6 ... the code should manually add w.grad.data.zero_()'); "
           "jcjohnson/pytorch-examples issue #31 ('your gradient tensors will contain the sum "
           "of the gradients for all iterations')",
    description="I wrote gradient descent by hand (w -= lr * w.grad under no_grad) for a small "
                "regression; the loss falls at first, then climbs and oscillates whatever lr I "
                "pick.",
    expected_kinds=("stale_grad", "applied_grad"),
    params=(),
    manifest=lambda b, f: trains(f, 0.5) and worse(b, f, 2.0),
    build_buggy=manual_build(reg_net, linear_regression),
    loop_buggy=manual_train(_no_zero_update(False), F.mse_loss),
    build_fixed=manual_build(reg_net, linear_regression),
    loop_fixed=manual_train(_no_zero_update(True), F.mse_loss),
    steps=60,
)


# --- model.parameters() generator kept across steps
def _generator_loop(reuse: bool, lr: float = 0.1):
    def loop(model, opt, ex, steps):
        losses = []
        params = model.parameters()  # a generator: spent after its first pass
        after_first = None
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            model.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            with torch.no_grad():
                for p in (params if reuse else model.parameters()):
                    p -= lr * p.grad
            if i == 0:
                after_first = snapshot(model.parameters())
            losses.append(loss.item())
        return {"losses": losses, "moved_after_first": changed(after_first, model.parameters())}
    return loop


MANUAL_GENERATOR = Case(
    name="manual_update_iterates_spent_generator",
    family="manual",
    source="pytorch/pytorch issue #2954 ('parameters() should be a list, not an iterator': "
           "'Making parameters() return an iterator gives ample opportunities to shoot yourself "
           "in the foot'); pytorch/pytorch issue #37350 ('I can only iterate a single time "
           "through the parameters, then it becomes empty')",
    description="I keep params = model.parameters() and loop over it for my hand-written update "
                "each step; the loss drops a little after the first batch and then never moves.",
    expected_kinds=("update_rule",),
    params=(),
    manifest=lambda b, f: (not b["moved_after_first"]) and f["moved_after_first"]
    and trains(f, 0.3) and worse(b, f, 1.5),
    build_buggy=manual_build(),
    loop_buggy=_generator_loop(True),
    build_fixed=manual_build(),
    loop_fixed=_generator_loop(False),
    steps=60,
)


# --- update sign flipped (gradient ascent)
def _sign_update(sign: float, lr: float = 0.1):
    def update(model, state, i):
        with torch.no_grad():
            for p in model.parameters():
                p += sign * lr * p.grad
                p.grad.zero_()
    return update


MANUAL_SIGN = Case(
    name="manual_update_adds_gradient",
    family="manual",
    source="pytorch/pytorch issue #1871 (the 60 Minute Blitz tutorial read 'weight = weight + "
           "learning_rate * gradient'; 'should be weight = weight - learning_rate * gradient'); "
           "ufal/npfl122 pull request #16 ('Fix SGD update rules': the minus sign did not "
           "appear in the rule)",
    description="Following the tutorial's formula I update weight = weight + lr * grad in my own "
                "loop; the loss goes up steadily instead of down, with no error.",
    expected_kinds=("update_rule",),
    params=(),
    manifest=lambda b, f: trains(f, 0.3) and tail(b["losses"]) > 1.5 * head(b["losses"]),
    build_buggy=manual_build(),
    loop_buggy=manual_train(_sign_update(+1.0)),
    build_fixed=manual_build(),
    loop_fixed=manual_train(_sign_update(-1.0)),
    steps=60,
)


# --- gradient of a mean loss divided by the batch size again
def _batch_div_update(divide: bool, lr: float = 0.1, size: int = 32):
    def update(model, state, i):
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad / (size if divide else 1)
                p.grad.zero_()
    return update


MANUAL_BATCH_DIV = Case(
    name="manual_sgd_divides_mean_grad_by_batch",
    family="manual",
    source="ShusenTang/Dive-into-DL-PyTorch issue #75 (the hand-written sgd(params, lr, "
           "batch_size) divides by batch_size although nn.CrossEntropyLoss already averages: "
           "'training becomes slower'); d2l-ai/d2l-en pull request #1000 (l.mean() with the "
           "custom SGD that already divides by batch_size)",
    description="My from-scratch sgd() divides each gradient by the batch size, as the book "
                "does, but my loss is already a mean; training crawls.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and worse(b, f, 1.5),
    build_buggy=manual_build(),
    loop_buggy=manual_train(_batch_div_update(True)),
    build_fixed=manual_build(),
    loop_fixed=manual_train(_batch_div_update(False)),
    steps=60,
)


# --- EMA / Polyak target update mixes the target with itself
def _ema_build(seed):
    online = mlp(seed)
    target = copy.deepcopy(online)
    for p in target.parameters():
        p.requires_grad_(False)
    x, y = classification(seed)
    opt_online = torch.optim.SGD(online.parameters(), lr=0.1)
    return target, None, {"x": x, "y": y, "online": online, "opt_online": opt_online}


def _ema_loop(fixed: bool, tau: float = 0.1):
    def loop(target, opt, ex, steps):
        online, opt_online = ex["online"], ex["opt_online"]
        before, losses = snapshot(target.parameters()), []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt_online.zero_grad()
            F.cross_entropy(online(x), y).backward()
            opt_online.step()
            with torch.no_grad():  # the hand-written soft update of the target network
                for t, o in zip(target.parameters(), online.parameters()):
                    if fixed:
                        t.copy_((1 - tau) * t + tau * o)
                    else:
                        t.copy_((1 - tau) * t + tau * t)
                losses.append(F.cross_entropy(target(x), y).item())
        drift = max((t - t0).abs().max().item() for t, t0 in zip(target.parameters(), before))
        return {"losses": losses, "drift": drift}
    return loop


MANUAL_EMA = Case(
    name="manual_soft_update_mixes_target_with_itself",
    family="manual",
    source="ageron/handson-ml2 issue #89 (the soft update computed 0.99 * target_weights + "
           "0.01 * target_weights: 'It says actually that we don't change weights at all'); "
           "mimoralea/gdrl pull request #14 (the soft update of the target networks used the "
           "wrong mixing weights)",
    description="The target network of my teacher-student setup is updated by hand as an "
                "exponential moving average; its loss never changes from the initial one.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: b["drift"] < 1e-4 and f["drift"] > 0.05 and trains(f, 0.3)
    and worse(b, f, 1.5),
    build_buggy=_ema_build,
    loop_buggy=_ema_loop(False),
    build_fixed=_ema_build,
    loop_fixed=_ema_loop(True),
    steps=60,
)


# --- momentum coefficient on the gradient term: the velocity never decays
def _heavy_ball_update(fixed: bool, lr: float = 0.05, mu: float = 0.9):
    def update(model, state, i):
        with torch.no_grad():
            params = list(model.parameters())
            if "v" not in state:
                state["v"] = [torch.zeros_like(p) for p in params]
            for p, v in zip(params, state["v"]):
                if fixed:
                    v.mul_(mu).add_(p.grad)
                else:
                    v.add_(mu * p.grad)
                p -= lr * v
                p.grad.zero_()
    return update


MANUAL_NO_DECAY = Case(
    name="manual_momentum_velocity_never_decays",
    family="manual",
    source="ooples/AiDotNet issue #2008 ('ApplyMomentum applies the coefficient to the wrong "
           "term: velocity never decays': v <- v + mu*g instead of v <- mu*v + g, 'the "
           "effective step size therefore grows linearly with iteration count'); "
           "fastai/fastbook pull request #482 ('Corrected momentum equation in SGD')",
    description="My hand-written momentum step trains well for a few batches, then the loss "
                "starts swinging and ends higher than where it started.",
    expected_kinds=("update_rule",),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and worse(b, f, 2.0),
    build_buggy=manual_build(reg_net, linear_regression),
    loop_buggy=manual_train(_heavy_ball_update(False), F.mse_loss),
    build_fixed=manual_build(reg_net, linear_regression),
    loop_fixed=manual_train(_heavy_ball_update(True), F.mse_loss),
    steps=60,
)


CASES = [MANUAL_NO_ZERO, MANUAL_GENERATOR, MANUAL_SIGN, MANUAL_BATCH_DIV, MANUAL_EMA,
         MANUAL_NO_DECAY]
