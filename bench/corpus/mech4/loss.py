"""The fourth corpus, mechanism 'loss' (the loss: reduction, weighting, targets, masks, terms that
cancel or vanish): cases mined from public reports by worker c."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .._common import (
    Case,
    batch,
    trains,
)
from .._m4_c import (
    imbalanced,
    masks,
    outlier_regression,
    recall_of,
)


def _mlp(seed, d_in, hidden, d_out, act=nn.ReLU):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), act(), nn.Linear(hidden, d_out))


def _idx(n: int, i: int, size: int) -> torch.Tensor:
    start = (i * size) % n
    return torch.arange(start, start + size) % n


# --- per-sample weights of shape [N, 1] times a per-sample loss of shape [N]
def _w_build(seed):
    model = _mlp(seed, 8, 32, 1, nn.Tanh)
    x, y, w, clean = outlier_regression(seed)
    return model, torch.optim.Adam(model.parameters(), lr=0.01), {"x": x, "y": y, "w": w,
                                                                   "clean": clean}


def _w_loop(squeeze: bool):
    def loop(model, opt, ex, steps):
        losses = []
        n = ex["x"].shape[0]
        for i in range(steps):
            idx = _idx(n, i, 32)
            x, y, w = ex["x"][idx], ex["y"][idx], ex["w"][idx]
            if squeeze:
                w = w.squeeze(1)
            opt.zero_grad()
            per_sample = F.mse_loss(model(x), y, reduction="none").mean(dim=1)
            loss = (per_sample * w).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            clean = F.mse_loss(model(ex["x"]), ex["clean"]).item()
        return {"losses": losses, "clean_mse": clean}
    return loop


WEIGHTS_BROADCAST = Case(
    name="sample_weights_broadcast_to_matrix",
    family="loss",
    source="pytorch/pytorch issue #2973 ('broadcasting inconsistency?': 'when x.size()=(10,1) "
           "and y.size()=(10), (x*y).size()=(10,10) (unexpected) ... the cases (c) and (d) really "
           "easily throw off many ... when such cases happen in a loss function that reduces the "
           "output into a single scalar')",
    description="I weight each sample's loss by a per-sample weight (0 for the samples I know "
                "are corrupted); the weights come as a column [N, 1], the loss per sample as [N], "
                "and the model still fits the corrupted targets as if nothing were weighted.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: b["clean_mse"] >= 3.0 * f["clean_mse"] and trains(f, 0.3),
    build_buggy=_w_build, loop_buggy=_w_loop(False),
    build_fixed=_w_build, loop_fixed=_w_loop(True),
    steps=80,
)


# --- a dice loss smoothed in the denominator only
def _dice_build(empty: float):
    def build(seed):
        model = _mlp(seed, 8, 32, 16)
        x, m, is_empty = masks(seed, empty=empty)
        return model, torch.optim.Adam(model.parameters(), lr=0.01), {"x": x, "m": m,
                                                                       "empty": is_empty}
    return build


def _dice_numerator_smooth_loop(num_smooth: float, den_smooth: float):
    def loop(model, opt, ex, steps):
        losses = []
        n = ex["x"].shape[0]
        for i in range(steps):
            idx = _idx(n, i, 32)
            x, m = ex["x"][idx], ex["m"][idx]
            opt.zero_grad()
            p = torch.sigmoid(model(x))
            inter = (p * m).sum(1)
            union = p.sum(1) + m.sum(1)
            loss = (1.0 - (2.0 * inter + num_smooth) / (union + den_smooth)).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            p = torch.sigmoid(model(ex["x"]))
            fp = p[ex["empty"]].mean().item()
            fg = (p[~ex["empty"]] * ex["m"][~ex["empty"]]).sum() / ex["m"][~ex["empty"]].sum()
        return {"losses": losses, "empty_fg": fp, "fg_hit": fg.item()}
    return loop


DICE_DEN_ONLY = Case(
    name="dice_smoothing_in_denominator_only",
    family="loss",
    source="aim-uofa/AdelaiDet issue #610 ('Why dice smoothing only applied in denominator?': "
           "'This causes all zero-input predictions to always maximize the loss even if it's "
           "completely correct')",
    description="My per-sample dice loss adds the smoothing term to the denominator only; on "
                "images with an empty mask the model keeps predicting foreground, as if those "
                "images taught it nothing.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (b["empty_fg"] >= 3.0 * f["empty_fg"] and f["fg_hit"] >= 0.6),
    build_buggy=_dice_build(0.5), loop_buggy=_dice_numerator_smooth_loop(0.0, 1e-5),
    build_fixed=_dice_build(0.5), loop_fixed=_dice_numerator_smooth_loop(1.0, 1.0),
    steps=80,
)


# --- class weights log(max_count / count): the most frequent class weighs 0
def _cw_build(seed):
    model = _mlp(seed, 10, 32, 3)
    x, y = imbalanced(seed)
    return model, torch.optim.Adam(model.parameters(), lr=0.01), {"x": x, "y": y}


def _log_class_weights(y, plus_one: bool):
    counts = torch.bincount(y, minlength=3).float()
    ratio = counts.max() / counts
    w = torch.log(ratio)
    return w + 1.0 if plus_one else w


def _cw_loop(plus_one: bool):
    def loop(model, opt, ex, steps):
        weight = _log_class_weights(ex["y"], plus_one)
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y, weight=weight)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            logits = model(ex["x"])
        return {"losses": losses, "recall0": recall_of(logits, ex["y"], 0),
                "full": F.cross_entropy(logits, ex["y"]).item()}
    return loop


# note: the report is against a TensorFlow library; the weight formula is the same in any
# framework, written here as a PyTorch user would.
LOG_WEIGHT_ZERO = Case(
    name="log_class_weight_zero_for_majority",
    family="loss",
    source="IndicoDataSolutions/finetune issue #181 ('class_weight of type log produces 0.0 "
           "weight on most frequent class': 'This makes that training ignores the most frequent "
           "class'; fixed in pull request #183 by adding 1)",
    description="I balance my classes with log-scaled weights, log(max_count / count); the most "
                "frequent class gets weight 0 and the trained model almost never predicts it.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: b["recall0"] <= 0.5 * f["recall0"] and f["recall0"] >= 0.7,
    build_buggy=_cw_build, loop_buggy=_cw_loop(False),
    build_fixed=_cw_build, loop_fixed=_cw_loop(True),
    steps=80,
)


# --- a recall loss computed from argmax predictions: a term with no gradient
class _RecallLoss(nn.Module):
    """1 - mean per-class recall of the hard (argmax) predictions."""

    def __init__(self, classes: int = 3, smooth: float = 1e-5):
        super().__init__()
        self.classes = classes
        self.smooth = smooth

    def forward(self, logits, target):
        _, predict = torch.max(logits, 1)
        pred_1h = F.one_hot(predict, self.classes).float()
        tgt_1h = F.one_hot(target, self.classes).float()
        tp = (pred_1h * tgt_1h).sum(0)
        recall = (tp + self.smooth) / (tgt_1h.sum(0) + self.smooth)
        return 1 - recall.mean()


def _recall_weighted_ce(logits, target, classes: int = 3, smooth: float = 1e-5):
    """Cross-entropy weighted per class by 1 - that class's recall in the batch."""
    with torch.no_grad():
        pred = logits.argmax(1)
        tgt_1h = F.one_hot(target, classes).float()
        tp = (F.one_hot(pred, classes).float() * tgt_1h).sum(0)
        recall = (tp + smooth) / (tgt_1h.sum(0) + smooth)
        w = 1.0 - recall + 0.05
    ce = F.cross_entropy(logits, target, reduction="none")
    return (w[target] * ce).sum() / w[target].sum()


def _rl_build(seed):
    model = _mlp(seed, 10, 32, 3)
    x, y = imbalanced(seed, freqs=(0.85, 0.12, 0.03))
    return model, torch.optim.Adam(model.parameters(), lr=0.01), {"x": x, "y": y}


def _rl_loop(recall_weighted: bool):
    def loop(model, opt, ex, steps):
        recall_loss = _RecallLoss()
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i, 64)
            opt.zero_grad()
            logits = model(x)
            if recall_weighted:
                loss = _recall_weighted_ce(logits, y)
            else:
                loss = F.cross_entropy(logits, y) + recall_loss(logits, y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            logits = model(ex["x"])
        return {"losses": losses, "recall2": recall_of(logits, ex["y"], 2),
                "full": F.cross_entropy(logits, ex["y"]).item()}
    return loop


RECALL_NO_GRAD = Case(
    name="recall_loss_from_argmax_has_no_gradient",
    family="loss",
    source="shuaizzZ/Recall-Loss-PyTorch issue #2 ('where is the log?': 'it seems you directly "
           "optimize the recall, instead of using it with the CE loss ... Your code has no effect "
           "since there is no gradient to pass')",
    description="I add a recall loss to my cross-entropy to help the rare classes; the recall "
                "is computed from the argmax predictions, and the rare class is recalled no "
                "better than with cross-entropy alone.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: f["recall2"] >= b["recall2"] + 0.3,
    build_buggy=_rl_build, loop_buggy=_rl_loop(False),
    build_fixed=_rl_build, loop_fixed=_rl_loop(True),
    steps=80,
)


# --- a dice loss summed over the batch instead of averaged
def _sum_dice_build(seed):
    model = _mlp(seed, 8, 32, 16)
    x, m, _ = masks(seed, empty=0.0)
    return model, torch.optim.SGD(model.parameters(), lr=10.0), {"x": x, "m": m}


def _sum_dice_loop(mean: bool):
    def loop(model, opt, ex, steps):
        losses = []
        n = ex["x"].shape[0]
        for i in range(steps):
            idx = _idx(n, i, 32)
            x, m = ex["x"][idx], ex["m"][idx]
            opt.zero_grad()
            p = torch.sigmoid(model(x))
            dice = (2.0 * (p * m).sum(1) + 1.0) / (p.sum(1) + m.sum(1) + 1.0)
            per_volume = 1.0 - dice
            loss = per_volume.mean() if mean else per_volume.sum()
            loss.backward()
            opt.step()
            losses.append(per_volume.mean().item())
        with torch.no_grad():
            p = torch.sigmoid(model(ex["x"]))
            dice = (2.0 * (p * ex["m"]).sum(1) + 1.0) / (p.sum(1) + ex["m"].sum(1) + 1.0)
        return {"losses": losses, "full": (1.0 - dice).mean().item()}
    return loop


# note: a loss-reduction bug whose effect is a batch-size-times larger step (close to the
# arithmetic mechanism); the report is against a Caffe python layer.
DICE_SUMMED = Case(
    name="dice_loss_summed_over_batch",
    family="loss",
    source="faustomilletari/VNet issue #13 ('Dice greater than 1': 'this happens if you have "
           "batch_size more than 1. because it just sums the dices of all the volumes together "
           "instead of taking their average')",
    description="My dice loss adds up the dice of every volume in the batch instead of "
                "averaging them; the training loss goes above 1 and the model ends worse than "
                "with batch size 1.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (not math.isfinite(b["full"]) or b["full"] >= 1.5 * f["full"])
    and trains(f, 0.3),
    build_buggy=_sum_dice_build, loop_buggy=_sum_dice_loop(False),
    build_fixed=_sum_dice_build, loop_fixed=_sum_dice_loop(True),
    steps=60,
)


CASES = [WEIGHTS_BROADCAST, DICE_DEN_ONLY, LOG_WEIGHT_ZERO, RECALL_NO_GRAD, DICE_SUMMED]
