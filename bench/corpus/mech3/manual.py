"""The third corpus's cases of the mechanism 'manual' (bench/corpus/mechanisms.py):
hand-written update loops with no torch.optim optimizer (watched as watch(model)), from real
reports, mined by worker a."""
from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from .._common import (
    Case,
    any_nonfinite,
    batch,
    changed,
    head,
    linear_regression,
    snapshot,
    tail,
    trains,
)
from .._m3_a import (
    build_with,
    eval_mse,
    line_data,
    offset_linear,
    scalar_line,
    tanh_net,
    tanh_net_zero_bias,
)


def _manual_loop(update, loss_fn=F.mse_loss, size: int = 32):
    """forward, backward, then the hand-written ``update(model, state)``."""
    def loop(model, opt, ex, steps):
        losses, state = [], {}
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i, size)
            loss = loss_fn(model(x), y)
            loss.backward()
            update(model, state)
            losses.append(loss.item())
        return {"losses": losses, "full": eval_mse(model, ex)}
    return loop


def _worse_or_nonfinite(b, f, ratio=3.0):
    return not math.isfinite(b["full"]) or b["full"] >= ratio * f["full"]


# --------------------------------------------------------------------------------------------
# ---- hand-written Adam whose step counter starts at 0 (bias correction divides by zero)

def _adam_t_update(bug: bool, lr: float = 0.01, b1: float = 0.9, b2: float = 0.999,
                   eps: float = 1e-8):
    def update(model, state):
        with torch.no_grad():
            params = list(model.parameters())
            if "m" not in state:
                state["m"] = [torch.zeros_like(p) for p in params]
                state["v"] = [torch.zeros_like(p) for p in params]
                state["t"] = 0
            if not bug:
                state["t"] += 1
            t = state["t"]
            for p, m, v in zip(params, state["m"], state["v"]):
                g = p.grad
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                m_hat = m / (1 - b1 ** t)
                v_hat = v / (1 - b2 ** t)
                p -= lr * m_hat / (v_hat.sqrt() + eps)
                p.grad.zero_()
            if bug:
                state["t"] += 1
    return update


ADAM_T0 = Case(
    name="manual_adam_step_count_from_zero",
    family="manual",
    source="deeplearning4j/nd4j pull request #1227 ('t should start from 1. The first alphat "
           "will be NaN if t start from 0'); tracel-ai/burn pull request #630 ('by changing "
           "the time ... from 1 to 0 some NaN appear ... This made it impossible to learn with "
           "Adam'); keras-team/keras pull request #10129 (review: 'These changes would cause a "
           "division by zero for the first batch (t = 0)')",
    description="My from-scratch Adam step counts t from 0 and increments it after the "
                "update; after the very first batch every weight and every loss is NaN.",
    expected_kinds=("nonfinite",),
    params=(),
    manifest=lambda b, f: any_nonfinite(b["losses"]) and trains(f, 0.5),
    build_buggy=build_with(tanh_net, linear_regression),
    loop_buggy=_manual_loop(_adam_t_update(True)),
    build_fixed=build_with(tanh_net, linear_regression),
    loop_fixed=_manual_loop(_adam_t_update(False)),
    steps=60,
)


# --------------------------------------------------------------------------------------------
# ---- hand-derived gradient np.dot(2x, y_pred - y).mean(): a sum, not a mean

def _dot_mean_loop(bug: bool, lr: float = 0.05):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            with torch.no_grad():
                y_pred = model(x)
                loss = ((y_pred - y) ** 2).mean()
                # gradient by hand: dJ/dw = 1/N * 2x * (w*x - y)
                if bug:
                    dw = torch.dot(2 * x[:, 0], (y_pred - y)[:, 0]).mean()
                else:
                    dw = (2 * x * (y_pred - y)).mean()
                model.weight -= lr * dw
            losses.append(loss.item())
        return {"losses": losses, "full": eval_mse(model, ex)}
    return loop


DOT_MEAN = Case(
    name="manual_gradient_dot_then_mean",
    family="manual",
    source="patrickloeber/pytorchTutorial pull request #11 ('correct the manual gradient "
           "calculation': 'np.dot() gives a scalar, so np.dot().mean() does not give the "
           "correct gradient') and pull request #10 ('bug fix in gradient calculation' in "
           "05_1_gradientdescent_manually.py); pull request #5 ('np.dot() sum items')",
    description="I fit y = w * x by gradient descent with the gradient written by hand as "
                "dot(2x, y_pred - y).mean(); on batches of 32 the weight swings wider every "
                "step and the loss goes to inf.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.5) and _worse_or_nonfinite(b, f),
    build_buggy=build_with(scalar_line, line_data),
    loop_buggy=_dot_mean_loop(True),
    build_fixed=build_with(scalar_line, line_data),
    loop_fixed=_dot_mean_loop(False),
    steps=60,
)


# --------------------------------------------------------------------------------------------
# ---- the hand-written step updates the weights and never the biases

def _weights_only_update(bug: bool, lr: float = 0.05):
    def update(model, state):
        with torch.no_grad():
            for layer in (model[0], model[2]):
                layer.weight -= lr * layer.weight.grad
                if not bug:
                    layer.bias -= lr * layer.bias.grad
        model.zero_grad()
    return update


def _bias_loop(bug: bool):
    inner = _manual_loop(_weights_only_update(bug))

    def loop(model, opt, ex, steps):
        biases = [model[0].bias, model[2].bias]
        before = snapshot(biases)
        out = inner(model, opt, ex, steps)
        out["bias_moved"] = changed(before, biases)
        return out
    return loop


BIAS = Case(
    name="manual_step_never_updates_biases",
    family="manual",
    source="vlfeat/matconvnet issue #197 ('the bias is not learned as it always remain zero "
           "during training'); mattm/simple-neural-network pull request #10 ('the bias values "
           "now get updated while training'); nntrainer/nntrainer pull request #219 ('[bias] "
           "Bias updation missing for sgd')",
    description="My own update loop subtracts lr * grad from each layer's weight; the biases "
                "never move from their initial values and the loss stalls far above zero.",
    expected_kinds=("update_rule",),
    params=("0.bias", "2.bias"),
    manifest=lambda b, f: (not b["bias_moved"]) and f["bias_moved"] and trains(f, 0.5)
    and b["full"] >= 3.0 * f["full"],
    build_buggy=build_with(tanh_net_zero_bias, offset_linear(3.0)),
    loop_buggy=_bias_loop(True),
    build_fixed=build_with(tanh_net_zero_bias, offset_linear(3.0)),
    loop_fixed=_bias_loop(False),
    steps=60,
)


# --------------------------------------------------------------------------------------------
# ---- momentum: velocity = past_velocity * momentum + lr * gradient (added back to w)

def _velocity_sign_update(bug: bool, lr: float = 0.05, momentum: float = 0.9):
    def update(model, state):
        with torch.no_grad():
            params = list(model.parameters())
            if "past" not in state:
                state["past"] = [torch.zeros_like(p) for p in params]
            for k, (w, past_velocity) in enumerate(zip(params, state["past"])):
                gradient = w.grad
                if bug:
                    velocity = past_velocity * momentum + lr * gradient
                else:
                    velocity = past_velocity * momentum - lr * gradient
                w += momentum * velocity - lr * gradient
                state["past"][k] = velocity
                w.grad.zero_()
    return update


VELOCITY = Case(
    name="manual_momentum_velocity_sign",
    family="manual",
    source="fchollet/deep-learning-with-python-notebooks issue #19 ('chapter2.4.3 momentum "
           "issue': 'velocity = past_velocity * momentum + learning_rate * gradient, but i "
           "think it should be velocity = past_velocity * momentum - learning_rate * "
           "gradient', with w = w + momentum * velocity - learning_rate * gradient)",
    description="I wrote SGD with momentum 0.9 by hand following the book's update; the loss "
                "drops for a couple of batches and then climbs steadily above where it started.",
    expected_kinds=("update_rule",),
    params=(),
    manifest=lambda b, f: trains(f, 0.5) and (not math.isfinite(tail(b["losses"]))
                                             or tail(b["losses"]) > 1.5 * head(b["losses"]))
    and _worse_or_nonfinite(b, f),
    build_buggy=build_with(tanh_net, linear_regression),
    loop_buggy=_manual_loop(_velocity_sign_update(True)),
    build_fixed=build_with(tanh_net, linear_regression),
    loop_fixed=_manual_loop(_velocity_sign_update(False)),
    steps=60,
)


# --------------------------------------------------------------------------------------------
# ---- hand-written Adam with the bias corrections' "1 -" applied twice

def _adam_bc_update(bug: bool, lr: float = 0.01, b1: float = 0.9, b2: float = 0.999,
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
            bias_correction1 = 1 - b1 ** t
            bias_correction2 = 1 - b2 ** t
            if bug:
                step_size = lr * math.sqrt(1 - bias_correction2) / (1 - bias_correction1)
            else:
                step_size = lr * math.sqrt(bias_correction2) / bias_correction1
            for p, m, v in zip(params, state["m"], state["v"]):
                g = p.grad
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                p -= step_size * m / (v.sqrt() + eps)
                p.grad.zero_()
    return update


ADAM_BC = Case(
    name="manual_adam_bias_correction_inverted",
    family="manual",
    source="kozistr/pytorch_optimizer issue #305 ('AdamG has serious numerical "
           "instabilities': 'training went well in the early phase, but the gradient started "
           "to explode after some steps') and pull request #308 ('We had accidentally "
           "duplicated the minus-one operation in the bias correction steps'); "
           "kozistr/AdaBound-tensorflow issue #3 ('step_size = (lr * tf.sqrt(1. - "
           "bias_correction2) / bias_correction1)' should use sqrt(bias_correction2))",
    description="My hand-written Adam step trains nicely for the first batches, then the "
                "updates grow every step and the loss explodes.",
    expected_kinds=("update_rule",),
    params=(),
    manifest=lambda b, f: trains(f, 0.5) and _worse_or_nonfinite(b, f, 5.0),
    build_buggy=build_with(tanh_net, linear_regression),
    loop_buggy=_manual_loop(_adam_bc_update(True)),
    build_fixed=build_with(tanh_net, linear_regression),
    loop_fixed=_manual_loop(_adam_bc_update(False)),
    steps=60,
)


CASES = [ADAM_T0, DOT_MEAN, BIAS, VELOCITY, ADAM_BC]
