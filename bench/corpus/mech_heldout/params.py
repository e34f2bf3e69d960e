"""The held-out half of the second corpus, mechanism "params" (bench/corpus/mechanisms.py:
the model's parameters and their initial state). Do not read or run these under graddbg
until the detection code is final."""
from __future__ import annotations

import copy
import math

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from .._common import (
    Case,
    batch,
    classification,
    head,
    linear_regression,
    mlp,
    trains,
    worse,
)
from .._mech_c import ce_loop, mse_loop

CASES = []


def init_weights(module):
    """A typical user init (xavier weights, zero biases) applied with model.apply."""
    if isinstance(module, nn.Linear):
        nn.init.xavier_uniform_(module.weight)
        nn.init.zeros_(module.bias)


def pretrained_state(seed, steps=120, lr=0.5):
    """The state_dict of an MLP trained on ``classification(seed)``: a checkpoint to load."""
    model = mlp(seed + 500)
    x, y = classification(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ce_loop(model, opt, {"x": x, "y": y}, steps)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- best_state_dict_not_deepcopied


def _best_build(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(10, 128), nn.ReLU(), nn.Linear(128, 4))
    x, y = classification(seed)
    gen = torch.Generator().manual_seed(seed + 77)
    ytr = y[:32].clone()
    flip = torch.rand(32, generator=gen) < 0.4  # noisy labels: the run overfits
    ytr[flip] = torch.randint(0, 4, (int(flip.sum()),), generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    return model, opt, {"xtr": x[:32], "ytr": ytr, "xva": x[32:], "yva": y[32:]}


def _best_loop(fixed):
    def loop(model, opt, ex, steps):
        losses, best, best_state = [], math.inf, None
        for _ in range(steps):
            opt.zero_grad()
            loss = F.cross_entropy(model(ex["xtr"]), ex["ytr"])
            loss.backward()
            opt.step()
            losses.append(loss.item())
            with torch.no_grad():
                val = F.cross_entropy(model(ex["xva"]), ex["yva"]).item()
            if val < best:
                best = val
                best_state = copy.deepcopy(model.state_dict()) if fixed else model.state_dict()
        model.load_state_dict(best_state)  # early stopping: restore the best weights
        with torch.no_grad():
            restored = F.cross_entropy(model(ex["xva"]), ex["yva"]).item()
        return {"losses": losses, "best_val": best, "restored_val": restored}
    return loop


CASES.append(Case(
    name="best_state_dict_not_deepcopied",
    family="params",
    source="pytorch/tutorials pull request #188 ('Fixed deep copying model.state_dict()': "
           "'Otherwise best_model_wts changes always to last epoch's state'); thunlp/OpenKE pull "
           "request #131; WenjieDu/PyPOTS issue #667 (model.state_dict() returns references, "
           "the best model keeps getting updated)",
    description="I keep the weights of the epoch with the best validation loss and load them "
                "at the end, but the restored model is as overfitted as the last epoch.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (abs(f["restored_val"] - f["best_val"]) < 1e-6
                           and b["restored_val"] >= b["best_val"] + 0.2),
    build_buggy=_best_build,
    loop_buggy=_best_loop(False),
    build_fixed=_best_build,
    loop_fixed=_best_loop(True),
    steps=60,
))

# ---- init_applied_after_checkpoint_load


def _reinit_build(fixed):
    def build(seed):
        model = mlp(seed)
        if fixed:
            model.apply(init_weights)
            model.load_state_dict(pretrained_state(seed))
        else:
            model.load_state_dict(pretrained_state(seed))
            model.apply(init_weights)  # init after the load overwrites the checkpoint
        x, y = classification(seed)
        return model, torch.optim.SGD(model.parameters(), lr=0.05), {"x": x, "y": y}
    return build


CASES.append(Case(
    name="init_applied_after_checkpoint_load",
    family="params",
    source="huggingface/picotron issue #32 ('we call init_model_parameters after "
           "load_state_dict. It will overwrite weights from checkpoint'; 'a bug for resume "
           "training'); thulab/DeepHash issue #54 (the initializer runs after the pretrained "
           "weights are loaded)",
    description="I resume training from my checkpoint, but the loss starts again from where "
                "it started the first time.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: head(b["losses"]) >= 2 * head(f["losses"]) and worse(b, f, 1.5),
    build_buggy=_reinit_build(False),
    loop_buggy=ce_loop,
    build_fixed=_reinit_build(True),
    loop_fixed=ce_loop,
    steps=30,
))

# ---- frozen_backbone_batchnorm_stats_drift


class _BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU())
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.backbone(x))


def _bn_build(seed):
    torch.manual_seed(seed)
    model = _BNNet()
    x, y = classification(seed)
    gen = torch.Generator().manual_seed(seed + 9)
    with torch.no_grad():  # "pre-training": the running stats of another data set
        model.train()
        for _ in range(30):
            model.backbone(1.5 * torch.randn(64, 10, generator=gen) + 0.5)
    for p in model.backbone.parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(model.head.parameters(), lr=0.3)
    return model, opt, {"x": x, "y": y}


def _bn_loop(fixed):
    def loop(model, opt, ex, steps):
        bn = model.backbone[1]
        before = (bn.running_mean.clone(), bn.running_var.clone())
        losses = []
        for i in range(steps):
            model.train()
            if fixed:
                model.backbone.eval()  # a frozen backbone keeps its statistics too
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        drift = max((bn.running_mean - before[0]).abs().max().item(),
                    (bn.running_var - before[1]).abs().max().item())
        return {"losses": losses, "stats_drift": drift}
    return loop


CASES.append(Case(
    name="frozen_backbone_batchnorm_stats_drift",
    family="params",
    source="pytorch/pytorch issue #86590 ('after training, I end up with a model where all "
           "batchnorm params have changed' although every parameter had requires_grad=False); "
           "lightly-ai/lightly issue #1438 ('deactivate_requires_grad does not fix the model!'); "
           "pgniewko/gt-pyg issue #112",
    description="I froze the pretrained backbone (requires_grad=False) and train only the "
                "head, but the backbone's outputs on the pretraining data drift.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: b["stats_drift"] > 0.1 and f["stats_drift"] == 0.0 and trains(f, 0.2),
    build_buggy=_bn_build,
    loop_buggy=_bn_loop(False),
    build_fixed=_bn_build,
    loop_fixed=_bn_loop(True),
    steps=40,
))

# ---- parameter_cast_after_wrapping


class _Calibrated(nn.Module):
    """tanh(MLP(x)) * scale + shift, with scale and shift initialised from numpy arrays."""

    def __init__(self, fixed):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        scale, shift = np.ones(1), np.zeros(1)  # float64, as numpy makes them
        if fixed:
            self.scale = nn.Parameter(torch.from_numpy(scale).float())
            self.shift = nn.Parameter(torch.from_numpy(shift).float())
        else:  # .float() on the Parameter returns a plain tensor: nothing is registered
            self.scale = nn.Parameter(torch.from_numpy(scale)).float()
            self.shift = nn.Parameter(torch.from_numpy(shift)).float()

    def forward(self, x):
        return torch.tanh(self.body(x)) * self.scale + self.shift


def _cast_build(fixed):
    def build(seed):
        torch.manual_seed(seed)
        model = _Calibrated(fixed)
        x, y = linear_regression(seed)
        y = 3 * y / y.std() + 1.0  # the targets reach beyond tanh's range
        return model, torch.optim.Adam(model.parameters(), lr=0.03), {"x": x, "y": y}
    return build


CASES.append(Case(
    name="parameter_cast_after_wrapping",
    family="params",
    source="pytorch/pytorch issue #9303 ('If .to() is called on nn.Parameter, it returns a "
           "tensor', labelled 'topic: correctness (silent)'); pytorch/pytorch issues #17484, "
           "#39062 (nn.Parameter(...).to(...) in __init__: the parameter is not registered)",
    description="My output scale and shift come from numpy arrays, so I wrap them with "
                "nn.Parameter(...).float(); they are missing from model.parameters() and the "
                "predictions never leave [-1, 1].",
    expected_kinds=("hidden_param",),
    params=(),
    manifest=lambda b, f: trains(f, 0.5) and worse(b, f, 2.0),
    build_buggy=_cast_build(False),
    loop_buggy=mse_loop,
    build_fixed=_cast_build(True),
    loop_fixed=mse_loop,
    steps=60,
))

# ---- pretrained_embedding_frozen_by_default


class _PretrainedBag(nn.Module):
    def __init__(self, vectors, freeze_default):
        super().__init__()
        if freeze_default:
            self.emb = nn.Embedding.from_pretrained(vectors)  # freeze=True is the default
        else:
            self.emb = nn.Embedding.from_pretrained(vectors, freeze=False)
        self.out = nn.Linear(vectors.shape[1], 4)

    def forward(self, tokens):
        return self.out(self.emb(tokens).mean(1))


def _bag_tokens(seed):
    gen = torch.Generator().manual_seed(seed + 6100)
    tokens = torch.randint(0, 40, (256, 6), generator=gen)
    return tokens, (tokens % 4).mode(1).values


def _pretrained_build(freeze_default):
    def build(seed):
        torch.manual_seed(seed)
        vectors = torch.randn(40, 4)  # "pretrained" word vectors, to be fine-tuned
        model = _PretrainedBag(vectors, freeze_default)
        x, y = _bag_tokens(seed)
        return model, torch.optim.Adam(model.parameters(), lr=0.05), {"x": x, "y": y}
    return build


CASES.append(Case(
    name="pretrained_embedding_frozen_by_default",
    family="params",
    source="RUCAIBox/RecBole issue #2046 ('Context-aware D not learning': 'have you tried "
           "setting freeze=False?'; with and without the pretrained embedding 'the exact same "
           "metric results'); huggingface/optimum-graphcore pull request #304 ('The default "
           "behaviour of nn.Embedding.from_pretrained is to freeze the constructed embedding "
           "weights. This may not be what the user intends')",
    description="I initialise my embedding layer from pretrained vectors with "
                "nn.Embedding.from_pretrained to fine-tune them; the vectors never change and "
                "the model underfits.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and worse(b, f, 1.3),
    build_buggy=_pretrained_build(True),
    loop_buggy=ce_loop,
    build_fixed=_pretrained_build(False),
    loop_fixed=ce_loop,
    steps=60,
))

# ---- ema_model_batchnorm_buffers_stale


def _ema_net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def _ema_build(seed):
    model = _ema_net(seed)
    x, y = classification(seed)
    x = 30 * x + 20  # features with their own scale and offset
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, {"x": x, "y": y, "ema": copy.deepcopy(model)}


def _ema_loop(with_buffers):
    def loop(model, opt, ex, steps):
        ema, losses = ex["ema"], []
        for i in range(steps):
            model.train()
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            with torch.no_grad():  # the EMA (mean-teacher) update
                for pe, p in zip(ema.parameters(), model.parameters()):
                    pe.mul_(0.9).add_(p, alpha=0.1)
                if with_buffers:
                    for be, b in zip(ema.buffers(), model.buffers()):
                        be.copy_(b)
            losses.append(loss.item())
        ema.eval()
        model.eval()
        with torch.no_grad():
            ema_loss = F.cross_entropy(ema(ex["x"]), ex["y"]).item()
            model_loss = F.cross_entropy(model(ex["x"]), ex["y"]).item()
        return {"losses": losses, "ema_loss": ema_loss, "model_loss": model_loss}
    return loop


CASES.append(Case(
    name="ema_model_batchnorm_buffers_stale",
    family="params",
    source="CuriousAI/mean-teacher issue #9 ('only parameters are updated ... batchnorm of EMA "
           "model may be using the default 0-mean and 1-var'); facebookresearch/moco issue #70 "
           "('the ema model has poor performance when the running variables in BN are not "
           "tracked'); pytorch/ignite issue #2590; YU1ut/MixMatch-pytorch issue #16",
    description="I evaluate the EMA copy of my model, averaged over model.parameters() every "
                "step; it does far worse than the model it averages.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (trains(f, 0.3) and b["ema_loss"] >= 1.5 * f["ema_loss"]
                           and b["ema_loss"] >= 1.5 * b["model_loss"]),
    build_buggy=_ema_build,
    loop_buggy=_ema_loop(False),
    build_fixed=_ema_build,
    loop_fixed=_ema_loop(True),
    steps=60,
))
