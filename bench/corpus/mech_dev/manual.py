"""Dev cases of the second corpus, mechanism "manual": hand-written update loops with no
torch.optim optimizer (watched as watch(model))."""
from __future__ import annotations

import torch
from torch.nn import functional as F

from .._common import Case, linear_regression, tail, trains, worse
from .._mech_d import manual_build, manual_train, reg_net


# --- momentum velocity re-created every step
def _velocity_update(persistent: bool, lr: float = 0.01, mu: float = 0.9):
    def update(model, state, i):
        with torch.no_grad():
            params = list(model.parameters())
            if not persistent or "v" not in state:
                state["v"] = [torch.zeros_like(p) for p in params]
            for p, v in zip(params, state["v"]):
                v.mul_(mu).add_(p.grad)
                p -= lr * v
                p.grad.zero_()
    return update


MANUAL_VELOCITY = Case(
    name="manual_momentum_buffer_recreated",
    family="manual",
    source="keras-team/keras issue #7502 ('moments = [K.zeros(shape) ...]' run on every call: "
           "'the momentum for each iteration is never used by the subsequent iteration'); "
           "fast.ai forum thread 'Lesson - 05: Implementing Momentum in the Update Function' "
           "('my update function does not seem to perform better than regular SGD')",
    description="My hand-written SGD with momentum 0.9 trains exactly as slowly as plain SGD; "
                "the velocity buffers are made inside the step function.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.35) and worse(b, f, 1.3),
    build_buggy=manual_build(),
    loop_buggy=manual_train(_velocity_update(False)),
    build_fixed=manual_build(),
    loop_fixed=manual_train(_velocity_update(True)),
    steps=60,
)


# --- weight decay term with the wrong sign
def _decay_update(sign: float, lr: float = 0.1, wd: float = 0.3):
    def update(model, state, i):
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * (p.grad + sign * wd * p)
                p.grad.zero_()
    return update


def _decay_loop(sign):
    inner = manual_train(_decay_update(sign), F.mse_loss)

    def loop(model, opt, ex, steps):
        out = inner(model, opt, ex, steps)
        out["weight_norm"] = sum(p.detach().norm().item() for p in model.parameters())
        return out
    return loop


def _decay_manifest(b, f):
    return (trains(f, 0.3) and b["weight_norm"] >= 3 * f["weight_norm"]
            and tail(b["losses"]) >= 1.5 * tail(f["losses"]))


MANUAL_DECAY = Case(
    name="manual_weight_decay_sign_flipped",
    family="manual",
    source="andersbll/deeppy issue #17 ('Penalty calculation': 'step -= penalty' where it should "
           "add; 'If I set weight_decay to a large value > 0 then the weights explode'; "
           "'Wow, this is a huge mistake')",
    description="I added L2 weight decay to my own update as grad - wd * w; the weights grow "
                "every step and the loss gets worse the longer I train.",
    expected_kinds=("update_rule",),
    params=(),
    manifest=_decay_manifest,
    build_buggy=manual_build(reg_net, linear_regression),
    loop_buggy=_decay_loop(-1.0),
    build_fixed=manual_build(reg_net, linear_regression),
    loop_fixed=_decay_loop(+1.0),
    steps=60,
)


CASES = [MANUAL_VELOCITY, MANUAL_DECAY]
