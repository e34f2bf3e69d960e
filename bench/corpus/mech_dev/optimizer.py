"""The dev cases of the mechanism 'optimizer' (bench/corpus/mechanisms.py) mined by worker a."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .._common import (
    Case,
    batch,
    classification,
    mlp,
    trains,
)
from .._mech_a import (
    plain_loop,
)


class EncHead(nn.Module):
    def __init__(self, d_in=10, hidden=32, d_out=4):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.head(self.encoder(x))


ENCODER = ("encoder.0.weight", "encoder.0.bias")


# ---- the encoder is held by two optimizers

def _two_opt_build(bug: bool):
    def build(seed):
        torch.manual_seed(seed)
        model = EncHead()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        x, y = classification(seed)
        enc_opt = torch.optim.Adam(model.encoder.parameters(), lr=0.01) if bug else None
        return model, opt, {"x": x, "y": y, "enc_opt": enc_opt}
    return build


def _two_opt_loop(model, opt, ex, steps):
    enc_opt, enc = ex["enc_opt"], model.encoder[0].weight
    losses, first_move = [], None
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        before = enc.detach().clone()
        opt.zero_grad()
        if enc_opt is not None:
            enc_opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if enc_opt is not None:
            enc_opt.step()
        if first_move is None:
            first_move = (enc.detach() - before).norm().item()
        losses.append(loss.item())
    return {"losses": losses, "first_move": first_move}


TWO_OPT = Case(
    name="encoder_in_two_optimizers",
    family="optimizer",
    source="MishaLaskin/curl issues #20 and #28 ('critic.encoder is updated twice using the "
           "same gradient': it is held by both encoder_optimizer and cpc_optimizer); "
           "Lu-Feng/SuperVLAD issue #1 ('Wouldn't that mean that the crossimage_encoder is "
           "updated twice?')",
    description="Besides the optimizer over model.parameters() I keep an encoder optimizer "
                "(for its own learning rate); the encoder takes two steps per batch.",
    expected_kinds=("update_rule", "foreign_update"),
    params=ENCODER,
    manifest=lambda b, f: trains(f, 0.3) and b["first_move"] >= 1.8 * f["first_move"],
    build_buggy=_two_opt_build(True),
    loop_buggy=_two_opt_loop,
    build_fixed=_two_opt_build(False),
    loop_fixed=_two_opt_loop,
    steps=40,
)


# ---- Adam's eps copied from a config at 1.0

def _eps_build(eps):
    def build(seed):
        model = mlp(seed)
        x, y = classification(seed)
        return model, torch.optim.Adam(model.parameters(), lr=0.01, eps=eps), {"x": x, "y": y}
    return build


EPS = Case(
    name="adam_eps_one",
    family="optimizer",
    source="tensorflow/models issue #779 ('The slim training script defines a default epsilon "
           "for the optimizers as 1.0 ... My model weights were only marginally changed after "
           "10.000 steps'); mlpnlp/mlpnlp-nmt pull request #4 ('the training does not work "
           "well when using eps=0.1'); balancap/SSD-Tensorflow issue #385",
    description="I ported a training script whose --opt_epsilon defaults to 1.0 and pass it "
                "to Adam; the weights barely move.",
    expected_kinds=("optimizer_setup",),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and b["full"] >= 1.5 * f["full"],
    build_buggy=_eps_build(1.0),
    loop_buggy=plain_loop,
    build_fixed=_eps_build(1e-8),
    loop_fixed=plain_loop,
    steps=40,
)


# ---- cross-validation: the model is reset each fold, the optimizer and scheduler are not

def _folds_build(seed):
    model = mlp(seed)
    x, y = classification(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    return model, opt, {"x": x, "y": y, "sched": sched, "init": init}


def _folds_loop(bug: bool, folds: int = 2):
    def loop(model, opt, ex, steps):
        sched, per_fold, losses, finals = ex["sched"], steps // folds, [], []
        n = ex["x"].shape[0]
        for fold in range(folds):
            model.load_state_dict(ex["init"])  # a fresh model for every fold
            if not bug:
                opt.state.clear()
                for g in opt.param_groups:
                    g["lr"] = g["initial_lr"]
                sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
            held = torch.arange(n) % folds == fold
            xt, yt = ex["x"][~held], ex["y"][~held]
            for i in range(per_fold):
                x, y = batch(xt, yt, i)
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                sched.step()
                losses.append(loss.item())
            with torch.no_grad():
                finals.append(F.cross_entropy(model(ex["x"][held]), ex["y"][held]).item())
        return {"losses": losses, "finals": finals}
    return loop


FOLDS = Case(
    name="optimizer_not_reset_between_folds",
    family="optimizer",
    source="Lightning-AI/pytorch-lightning issue #12409 (KFold example: 'the optimizer and "
           "scheduler are never reset across different folds'); BaderLab/saber issue #137 "
           "('Optimizers not being reset during cross-validation')",
    description="For k-fold cross-validation I reload the initial weights at each fold but "
                "keep the optimizer and its scheduler; the second fold barely trains.",
    expected_kinds=("foreign_update",),
    params=(),
    manifest=lambda b, f: b["finals"][1] >= 1.5 * f["finals"][1]
    and f["finals"][0] == b["finals"][0] and trains(f, 0.3),
    build_buggy=_folds_build,
    loop_buggy=_folds_loop(True),
    build_fixed=_folds_build,
    loop_fixed=_folds_loop(False),
    steps=60,
)


CASES = [TWO_OPT, EPS, FOLDS]
