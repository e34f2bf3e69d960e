"""The fourth corpus's cases of the mechanism 'manual' (bench/corpus/mechanisms.py):
hand-written update loops with no torch.optim optimizer (watched as watch(model)), from real
reports, mined by worker a."""
from __future__ import annotations

import torch
from torch.nn import functional as F

from .._common import (
    Case,
    any_nonfinite,
    batch,
    changed,
    linear_regression,
    snapshot,
    trains,
)
from .._m4_a import eval_mse, manual_build


def _manual_loop(update, size: int = 32):
    """forward, backward, then the hand-written ``update(model, state)`` (which clears .grad)."""
    def loop(model, opt, ex, steps):
        losses, state = [], {}
        before = snapshot(model.parameters())
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i, size)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            update(model, state)
            losses.append(loss.item())
        return {"losses": losses, "changed": changed(before, model.parameters()),
                "full": eval_mse(model, ex)}
    return loop


# --------------------------------------------------------------------------------------------
# ---- the update rebinds the loop variable: param = param - lr * param.grad

def _rebind_update(bug: bool, lr: float = 0.1):
    def update(model, state):
        with torch.no_grad():
            for param in model.parameters():
                if bug:
                    param = param - lr * param.grad      # a new tensor bound to the loop name
                else:
                    param -= lr * param.grad
        model.zero_grad()
    return update


REBIND = Case(
    name="manual_update_rebinds_loop_variable",
    family="manual",
    source="pytorch/pytorch issue #74158 ('torch.no_grad() removes requires_grad from weight "
           "tensor while updating it by non-compound-operation': 'If I update weight by "
           "compound operation, everything works fine ... w = w - lr * w.grad' does not "
           "update the weight)",
    description="In my own update loop I write param = param - lr * param.grad under "
                "torch.no_grad(); the loss is printed every step and never moves.",
    expected_kinds=("update_rule",),
    params=(),
    manifest=lambda b, f: (not b["changed"]) and f["changed"] and trains(f, 0.5),
    build_buggy=manual_build(linear_regression),
    loop_buggy=_manual_loop(_rebind_update(True)),
    build_fixed=manual_build(linear_regression),
    loop_fixed=_manual_loop(_rebind_update(False)),
    steps=40,
)


# --------------------------------------------------------------------------------------------
# ---- hand-written RMSprop: the running average takes the gradient, not its square

def _rmsprop_update(bug: bool, lr: float = 0.01, rho: float = 0.9, eps: float = 1e-8):
    def update(model, state):
        with torch.no_grad():
            params = list(model.parameters())
            if "avg" not in state:
                state["avg"] = [torch.zeros_like(p) for p in params]
            for p, avg in zip(params, state["avg"]):
                g = p.grad
                avg.mul_(rho).add_((1 - rho) * (g if bug else g * g))
                p -= lr * g / torch.sqrt(avg + eps)
        model.zero_grad()
    return update


RMSPROP = Case(
    name="manual_rmsprop_average_not_squared",
    family="manual",
    source="Devinterview-io/gradient-descent-interview-questions issue #1 ('wrong RMSProp "
           "implementation': 'the correct running_avg should be running_avg = running_avg * "
           "0.9 + (1 - 0.9) * gradient ** 2')",
    description="I implemented RMSprop by hand from an interview-prep guide; after the first "
                "update my weights and loss are NaN.",
    expected_kinds=("nonfinite",),
    params=(),
    manifest=lambda b, f: any_nonfinite(b["losses"]) and trains(f, 0.5),
    build_buggy=manual_build(linear_regression),
    loop_buggy=_manual_loop(_rmsprop_update(True)),
    build_fixed=manual_build(linear_regression),
    loop_fixed=_manual_loop(_rmsprop_update(False)),
    steps=40,
)


# --------------------------------------------------------------------------------------------
# ---- hand-written Adam multiplies by the second-moment root instead of dividing

def _adam_update(bug: bool, lr: float = 0.01, b1: float = 0.9, b2: float = 0.999,
                 eps: float = 1e-8):
    def update(model, state):
        with torch.no_grad():
            params = list(model.parameters())
            if "m" not in state:
                state["m"] = [torch.zeros_like(p) for p in params]
                state["v"] = [torch.zeros_like(p) for p in params]
                state["t"] = 0
            state["t"] += 1
            t = state["t"]
            for p, m, v in zip(params, state["m"], state["v"]):
                g = p.grad
                m.mul_(b1).add_((1 - b1) * g)
                v.mul_(b2).add_((1 - b2) * g * g)
                m_hat = m / (1 - b1 ** t)
                v_hat = v / (1 - b2 ** t)
                if bug:
                    p -= lr * m_hat * (torch.sqrt(v_hat) + eps)
                else:
                    p -= lr * m_hat / (torch.sqrt(v_hat) + eps)
        model.zero_grad()
    return update


ADAM_MUL = Case(
    name="manual_adam_multiplies_by_second_moment",
    family="manual",
    source="oracle/tribuo pull request #401 ('Fix the Adam gradient optimizer': 'The "
           "optimizer was multiplying by the squared gradient accumulator rather than "
           "dividing by it')",
    description="My hand-written Adam trains far more slowly than torch.optim.Adam with the "
                "same learning rate; the weights hardly move.",
    # note: the update still points downhill, only its size is wrong; no kind's invariant
    # is written for a hand-written rule's size, so none is expected
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.5) and b["full"] >= 3.0 * f["full"],
    build_buggy=manual_build(linear_regression),
    loop_buggy=_manual_loop(_adam_update(True)),
    build_fixed=manual_build(linear_regression),
    loop_fixed=_manual_loop(_adam_update(False)),
    steps=60,
)


# --------------------------------------------------------------------------------------------
# ---- hand-written AdaGrad: the sum of squared gradients starts at 1

def _adagrad_update(init: float, lr: float = 0.05, eps: float = 1e-8):
    def update(model, state):
        with torch.no_grad():
            params = list(model.parameters())
            if "h" not in state:
                state["h"] = [torch.full_like(p, init) for p in params]
            for p, h in zip(params, state["h"]):
                g = p.grad
                h.add_(g * g)
                p -= lr * g / torch.sqrt(h + eps)
        model.zero_grad()
    return update


ADAGRAD_ONE = Case(
    name="manual_adagrad_accumulator_starts_at_one",
    family="manual",
    source="deeplearning4j/deeplearning4j issue #953 ('AdaGrad sum of gradient squares "
           "initialized with 1': 'this 1 in the denominator will give wrong results by a "
           "significant margin in future steps (a gradient can be order of magnitude "
           "smaller)')",
    description="I start my AdaGrad accumulator at ones to avoid dividing by zero; my AdaGrad "
                "now trains like plain SGD with a tiny learning rate.",
    # note: a valid (if mis-initialised) adaptive rule; no kind's invariant covers it
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.5) and b["full"] >= 2.5 * f["full"],
    build_buggy=manual_build(linear_regression),
    loop_buggy=_manual_loop(_adagrad_update(1.0, lr=0.02)),
    build_fixed=manual_build(linear_regression),
    loop_fixed=_manual_loop(_adagrad_update(0.0, lr=0.02)),
    steps=60,
)


# --------------------------------------------------------------------------------------------
# ---- hand-written AdaGrad without epsilon: 0 / sqrt(0) for a parameter whose gradient is 0

def _zero_feature_data(seed):
    """linear_regression over 7 features plus an 8th that is never set (a one-hot column of a
    category absent from the training set)."""
    x, y = linear_regression(seed, d=7)
    return torch.cat([x, torch.zeros(x.shape[0], 1)], dim=1), y


def _adagrad_eps_update(eps: float, lr: float = 0.05):
    def update(model, state):
        with torch.no_grad():
            params = list(model.parameters())
            if "h" not in state:
                state["h"] = [torch.zeros_like(p) for p in params]
            for p, h in zip(params, state["h"]):
                g = p.grad
                h.add_(g * g)
                p -= lr * g / torch.sqrt(h + eps)
        model.zero_grad()
    return update


ADAGRAD_NAN = Case(
    name="manual_adagrad_without_epsilon",
    family="manual",
    source="lisa-lab/pylearn2 issue #1496 ('AdaGrad rule yields NaN on first iteration': "
           "'Exception: NaN in Output_Linear_W') and issue #1499 ('Use minimal value for the "
           "denominator in AdaGrad': 'a corner case where the accumulated gradient can be 0')",
    description="My hand-written AdaGrad divides by the root of the summed squared gradients; "
                "on my data the weights are NaN after the first update.",
    expected_kinds=("nonfinite",),
    params=(),
    manifest=lambda b, f: any_nonfinite(b["losses"]) and trains(f, 0.5),
    build_buggy=manual_build(_zero_feature_data),
    loop_buggy=_manual_loop(_adagrad_eps_update(0.0)),
    build_fixed=manual_build(_zero_feature_data),
    loop_fixed=_manual_loop(_adagrad_eps_update(1e-10)),
    steps=40,
)


CASES = [REBIND, RMSPROP, ADAM_MUL, ADAGRAD_ONE, ADAGRAD_NAN]
