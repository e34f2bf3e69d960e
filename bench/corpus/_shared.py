"""Helpers the cases of both halves use: generic builds and loops, with no bug in them.
Bug-specific code lives in dev.py and heldout.py only, so that reading one half's cases
shows nothing of the other's."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ._common import (
    Case,
    batch,
    changed,
    classification,
    linear_regression,
    mlp,
    snapshot,
    trains,
)


def reg_mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def linear(seed):
    torch.manual_seed(seed)
    return nn.Linear(8, 1)


def scaler_build(make, lr, data=linear_regression):
    def build(seed):
        model = make(seed)
        x, y = data(seed)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        return model, opt, {"x": x, "y": y, "scaler": torch.amp.GradScaler("cpu")}
    return build


def adam_build(seed):
    model = linear(seed)
    x, y = linear_regression(seed)
    return model, torch.optim.Adam(model.parameters(), lr=0.05), {"x": x, "y": y}


def recreate_loop(every: int):
    """Adam re-created every ``every`` steps (0: never) inside the loop; the first period
    uses the optimizer the user built (and watches) before the loop."""
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            if every and i > 0 and i % every == 0:
                opt = torch.optim.Adam(model.parameters(), lr=0.05)
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses}
    return loop


def epoch_sched_build(make_sched, lr=0.1):
    def build(seed):
        model = mlp(seed)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        x, y = classification(seed)
        return model, opt, {"x": x, "y": y, "sched": make_sched(opt)}
    return build


def per_batch_loop(per_batch: bool, epoch_len: int = 16, plateau: bool = False):
    def loop(model, opt, ex, steps):
        losses, sched = [], ex["sched"]
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            end_of_epoch = (i + 1) % epoch_len == 0
            if per_batch or end_of_epoch:
                if plateau:
                    metric = loss.item() if per_batch else sum(losses[-epoch_len:]) / epoch_len
                    sched.step(metric)
                else:
                    sched.step()
        return {"losses": losses, "lr": opt.param_groups[0]["lr"]}
    return loop


def train_loop(model, opt, ex, steps, watch_params=None, loss_fn=F.cross_entropy, hook=None):
    """The healthy loop; records whether ``watch_params`` (a list of tensors) changed."""
    tensors = watch_params(model) if watch_params else []
    before, losses, modes = snapshot(tensors), [], []
    for i in range(steps):
        if hook:
            hook(model, i, ex)
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        modes.append(model.training)
    return {"losses": losses, "changed": changed(before, tensors), "modes": modes}


def build_model(make, lr=0.1, data=classification, opt_cls=torch.optim.SGD):
    def build(seed):
        torch.manual_seed(seed)
        model = make()
        x, y = data(seed)
        return model, opt_cls(model.parameters(), lr=lr), {"x": x, "y": y}
    return build


def looping(**kw):
    return lambda model, opt, ex, steps: train_loop(model, opt, ex, steps, **kw)


BACKBONE = ("backbone.0.weight", "backbone.0.bias")


def _backbone(model):
    return list(model.backbone.parameters())


class Clf(nn.Module):
    """An MLP (``body``) with a final activation the user put in the model (``final``)."""

    def __init__(self, final: nn.Module, d_in: int = 10, d_out: int = 4):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, 32), nn.ReLU(), nn.Linear(32, d_out))
        self.final = final

    def forward(self, x):
        return self.final(self.body(x))


def clf_build(final, lr=0.1, data=classification):
    def build(seed):
        torch.manual_seed(seed)
        model = Clf(final())
        x, y = data(seed)
        return model, torch.optim.SGD(model.parameters(), lr=lr), {"x": x, "y": y}
    return build


def clf_loop(loss_fn):
    """Train with ``loss_fn(output, y)``; at the end, the cross-entropy and accuracy of the
    model's raw logits (``body``) on the whole data set: what the user wanted to minimise."""
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            logits = model.body(ex["x"])
            true = F.cross_entropy(logits, ex["y"]).item()
            acc = (logits.argmax(1) == ex["y"]).float().mean().item()
        return {"losses": losses, "true_loss": true, "accuracy": acc}
    return loop


def worse_true(ratio=1.3, acc_gap=0.05):
    """The fix trains, and the buggy run ends with a clearly worse true loss and accuracy."""
    def manifest(b, f):
        return (trains(f, 0.3) and b["true_loss"] >= ratio * f["true_loss"]
                and b["accuracy"] <= f["accuracy"] - acc_gap)
    return manifest


def ce_case(name, final, loss_fn, source, description, steps=60, lr=0.1, manifest=None):
    return Case(
        name=name, family="loss_pattern", source=source, description=description,
        expected_kinds=("loss_pattern",), params=(), manifest=manifest or worse_true(),
        build_buggy=clf_build(final, lr), loop_buggy=clf_loop(loss_fn),
        build_fixed=clf_build(nn.Identity, lr), loop_fixed=clf_loop(F.cross_entropy), steps=steps,
    )


def evaluate(model, x, y):
    with torch.no_grad():
        logits = model(x)
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()
