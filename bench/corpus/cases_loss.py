"""Cases where the loss is computed wrongly: an activation the loss already applies, a loss
fed the wrong kind of input, a normalisation over the wrong dimension, a target that
broadcasts against the prediction, log(softmax) that overflows."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ._common import (
    Case,
    any_nonfinite,
    batch,
    classification,
    linear_regression,
    tail,
    trains,
    worse,
)


class Clf(nn.Module):
    """An MLP (``body``) with a final activation the user put in the model (``final``)."""

    def __init__(self, final: nn.Module, d_in: int = 10, d_out: int = 4):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, 32), nn.ReLU(), nn.Linear(32, d_out))
        self.final = final

    def forward(self, x):
        return self.final(self.body(x))


def _build(final, lr=0.1, data=classification):
    def build(seed):
        torch.manual_seed(seed)
        model = Clf(final())
        x, y = data(seed)
        return model, torch.optim.SGD(model.parameters(), lr=lr), {"x": x, "y": y}
    return build


def _loop(loss_fn):
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


def _worse_true(ratio=1.3, acc_gap=0.05):
    """The fix trains, and the buggy run ends with a clearly worse true loss and accuracy."""
    def manifest(b, f):
        return (trains(f, 0.3) and b["true_loss"] >= ratio * f["true_loss"]
                and b["accuracy"] <= f["accuracy"] - acc_gap)
    return manifest


def _ce_case(name, final, loss_fn, source, description, steps=60, lr=0.1, manifest=None):
    return Case(
        name=name, family="loss_pattern", source=source, description=description,
        expected_kinds=("loss_pattern",), params=(), manifest=manifest or _worse_true(),
        build_buggy=_build(final, lr), loop_buggy=_loop(loss_fn),
        build_fixed=_build(nn.Identity, lr), loop_fixed=_loop(F.cross_entropy), steps=steps,
    )


SOFTMAX_CE = _ce_case(
    "softmax_then_cross_entropy", lambda: nn.Softmax(dim=1), F.cross_entropy,
    "PyTorch forum thread 'Cross Entropy loss is not decreasing' (43814: 'Check if you pass "
    "the softmax into the CrossEntropy loss'); MicrosoftDocs/pytorchfundamentals issue #4",
    "My classifier ends with nn.Softmax and I train it with CrossEntropyLoss; the loss creeps "
    "down very slowly and stalls far above zero.")

SOFTMAX_NLL = _ce_case(
    "softmax_then_nll_loss", lambda: nn.Softmax(dim=1), F.nll_loss,
    "AnubhavGupta3377/Text-Classification-Models-Pytorch issue #9 (softmax output into "
    "nn.NLLLoss: 'the loss is always negative'); clvrai/ACGAN-PyTorch pull request #4",
    "I use NLLLoss on my model's softmax output; the loss is negative and the accuracy is "
    "poor.")

NLL_RAW = _ce_case(
    "nll_loss_on_raw_logits", nn.Identity, F.nll_loss,
    "pytorch/pytorch pull request #12703 ('Fix missing final activation in NLLLoss second "
    "example': without LogSoftmax 'the loss was sometimes negative'); keon/seq2seq pull "
    "request #5",
    "I feed my model's raw outputs to NLLLoss; the loss goes more and more negative while "
    "the predictions get no better.", steps=40, lr=0.3,
    manifest=lambda b, f: (trains(f, 0.3) and tail(b["losses"]) < -5
                           and b["accuracy"] <= f["accuracy"] - 0.05))


def _binary(seed):
    x, y = classification(seed)
    return x, (y >= 2).float().unsqueeze(1)


def _bce_build(final):
    def build(seed):
        torch.manual_seed(seed)
        model = Clf(final(), d_out=1)
        x, y = _binary(seed)
        return model, torch.optim.SGD(model.parameters(), lr=0.5), {"x": x, "y": y}
    return build


def _bce_loop(model, opt, ex, steps):
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses}


BCE_SIGMOID = Case(
    name="bce_with_logits_on_sigmoid",
    family="loss_pattern",
    source="yudi-mars/daisyRec pull request #15 ('Do not need sigmoid because there is sigmoid "
           "in BCEWithLogitsLoss. Otherwise loss does not converge'); Turoad/lanedet issue #32; "
           "itakurah/focal-loss-pytorch pull request #5",
    description="My binary classifier ends with nn.Sigmoid and I use BCEWithLogitsLoss; the "
                "loss plateaus around 0.5 however long I train.",
    expected_kinds=("loss_pattern",),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and worse(b, f, 1.5),
    build_buggy=_bce_build(nn.Sigmoid),
    loop_buggy=_bce_loop,
    build_fixed=_bce_build(nn.Identity),
    loop_fixed=_bce_loop,
    steps=60,
)

def _imbalanced(seed):
    """Classes with unequal frequencies: the per-class bias matters."""
    return classification(seed, prior=(2.0, 0.5, -0.5, -1.5))


LOG_SOFTMAX_DIM0 = Case(
    name="log_softmax_over_batch_dim",
    family="loss_pattern",
    source="fxia22/pointnet.pytorch issue #27 (F.log_softmax(x, dim=0) over the batch); "
           "ikostrikov/pytorch-meta-optimizer issue #10; ctallec/world-models issue #10",
    description="My model returns F.log_softmax(x, dim=0) and I train with NLLLoss; the "
                "accuracy stays poor.",
    expected_kinds=("loss_pattern",),
    params=(),
    manifest=_worse_true(ratio=1.2, acc_gap=0.05),
    build_buggy=_build(lambda: nn.LogSoftmax(dim=0), data=_imbalanced),
    loop_buggy=_loop(F.nll_loss),
    build_fixed=_build(lambda: nn.LogSoftmax(dim=1), data=_imbalanced),
    loop_fixed=_loop(F.nll_loss),
    steps=60,
)


def _reg_build(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    x, y = linear_regression(seed)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), {"x": x, "y": y}


def _mse_loop(squeeze_target: bool):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            target = y.squeeze(1) if squeeze_target else y  # [N] against a [N, 1] output
            opt.zero_grad()
            loss = F.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            true = F.mse_loss(model(ex["x"]), ex["y"]).item()
        return {"losses": losses, "true_loss": true}
    return loop


MSE_BROADCAST = Case(
    name="mse_target_broadcast",
    family="loss_pattern",
    source="deepset-ai/FARM issue #229 ('Using a target size (torch.Size([32, 1])) that is "
           "different to the input size (torch.Size([32]))'); jsboige/CoursIA pull request #926 "
           "('(B, 1) vs (B,) to (B, B) matrix'); mlcommons/GaNDLF issue #134",
    description="My regression model outputs [N, 1] and my targets are [N]; training runs "
                "(with a warning I ignored) but the model only learns the mean.",
    expected_kinds=("loss_pattern",),
    params=(),
    manifest=lambda b, f: trains(f, 0.3) and b["true_loss"] >= 1.5 * f["true_loss"],
    build_buggy=_reg_build,
    loop_buggy=_mse_loop(True),
    build_fixed=_reg_build,
    loop_fixed=_mse_loop(False),
    steps=60,
)


def _raw_features(seed):
    x, y = classification(seed, scale=100.0)  # unscaled sensor readings
    return x, y


def _log_softmax_loop(stable: bool):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            logits = model(x)
            logp = F.log_softmax(logits, 1) if stable else torch.log(F.softmax(logits, 1))
            loss = F.nll_loss(logp, y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses}
    return loop


LOG_OF_SOFTMAX = Case(
    name="log_of_softmax_nan",
    family="loss_pattern",
    source="pytorch/pytorch issue #1620 (torch.log(nn.Softmax(x)) instead of nn.LogSoftmax: "
           "'the gradient sometimes get nan'); summerlvsong/Aggregation-Cross-Entropy issue #2",
    description="I compute torch.log(F.softmax(logits)) and NLLLoss myself; on my raw features "
                "the loss is inf or NaN from the first steps on.",
    expected_kinds=("loss_pattern", "nonfinite"),
    params=(),
    manifest=lambda b, f: any_nonfinite(b["losses"]) and trains(f, 0.3),
    build_buggy=_build(nn.Identity, lr=0.003, data=_raw_features),
    loop_buggy=_log_softmax_loop(False),
    build_fixed=_build(nn.Identity, lr=0.003, data=_raw_features),
    loop_fixed=_log_softmax_loop(True),
    steps=40,
)

CASES = [SOFTMAX_CE, SOFTMAX_NLL, NLL_RAW, BCE_SIGMOID, LOG_SOFTMAX_DIM0, MSE_BROADCAST,
         LOG_OF_SOFTMAX]
