"""The fourth corpus, mechanism 'params' (the model's parameters and their initial state: init,
freezing, tying, buffers, copies), mined by worker b."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.parametrizations import weight_norm

from .._common import (
    Case,
    batch,
    changed,
    classification,
    head,
    snapshot,
    tail,
    trains,
    worse,
)
from .._m4_b import ce_steps, full_ce

CASES = []


# ---- init_weights() after weight_norm: the init lands on a recomputed tensor

class _WNBlock(nn.Module):
    def __init__(self, init_first: bool):
        super().__init__()
        conv1 = nn.Linear(10, 32)
        if init_first:
            conv1.weight.data.normal_(0, 0.01)  # init, then weight_norm
            self.conv1 = weight_norm(conv1)
        else:
            self.conv1 = weight_norm(conv1)
            self.init_weights()
        self.relu = nn.ReLU()
        self.out = nn.Linear(32, 4)

    def init_weights(self):
        self.conv1.weight.data.normal_(0, 0.01)

    def forward(self, x):
        return self.out(self.relu(self.conv1(x)))


def _wn_build(init_first: bool):
    def build(seed):
        torch.manual_seed(seed)
        model = _WNBlock(init_first)
        x, y = classification(seed)
        return model, torch.optim.Adam(model.parameters(), lr=0.01), {"x": x, "y": y}
    return build


def _wn_loop(model, opt, ex, steps):
    with torch.no_grad():
        init_std = model.conv1.weight.std().item()  # the weight the first forward uses
    losses = ce_steps(model, opt, ex, steps)
    return {"losses": losses, "init_std": init_std}


WN_PARAMS = ("conv1.parametrizations.weight.original0", "conv1.parametrizations.weight.original1")

CASES.append(Case(
    name="init_weights_after_weight_norm_ignored",
    family="params",
    source="locuslab/TCN issue #1 ('Weight initialization might be superfluous': weight_norm "
           "'registers a forward prehook that overwrites module.weight every forward pass'); "
           "jik876/hifi-gan issue #145 ('init_weights has no effect after weight_norm ... The "
           "order should be init_weights then weight_norm'); pytorch/pytorch issue #180968 "
           "('Initializing weights after parametrization silently fails')",
    description="I wrap the layer in weight_norm and then call init_weights(), which does "
                "self.conv1.weight.data.normal_(0, 0.01); the layer still starts from the "
                "default initialisation, my N(0, 0.01) init never takes effect.",
    # note: the manifest checks the init that never took effect (the effective weight's std at
    # the first forward) and that the fix trains; the default init happens to train too.
    expected_kinds=(),
    params=WN_PARAMS,
    manifest=lambda b, f: b["init_std"] >= 5 * f["init_std"] and 0.005 <= f["init_std"] <= 0.02
    and trains(f, 0.4),
    build_buggy=_wn_build(False),
    loop_buggy=_wn_loop,
    build_fixed=_wn_build(True),
    loop_fixed=_wn_loop,
    steps=40,
))


# ---- model.backbone.eval() taken for freezing the backbone

class _Finetune(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(10, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.backbone(x))


BACKBONE = ("backbone.0.weight", "backbone.0.bias")


def _eval_freeze_build(bug: bool):
    def build(seed):
        torch.manual_seed(seed)
        model = _Finetune()
        # pretraining on task A (its head is kept aside to check task A afterwards)
        xa, ya = classification(seed)
        head_a = nn.Linear(32, 4)
        pre = nn.Sequential(model.backbone, head_a)
        pre_opt = torch.optim.Adam(pre.parameters(), lr=0.02)
        ce_steps(pre, pre_opt, {"x": xa, "y": ya}, 80)
        # fine-tuning on task B with the backbone meant to stay frozen
        xb, yb = classification(seed + 500)
        if bug:
            opt = torch.optim.Adam(model.parameters(), lr=0.02)
        else:
            model.backbone.requires_grad_(False)
            opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.02)
        task_a = nn.Sequential(model.backbone, head_a)
        return model, opt, {"x": xb, "y": yb, "task_a": task_a, "xa": xa, "ya": ya}
    return build


def _eval_freeze_loop(model, opt, ex, steps):
    before = snapshot(model.backbone.parameters())
    a_before = full_ce(ex["task_a"], {"x": ex["xa"], "y": ex["ya"]})
    losses = []
    for i in range(steps):
        model.train()
        model.backbone.eval()  # "freeze" the pretrained feature extractor
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    a_after = full_ce(ex["task_a"], {"x": ex["xa"], "y": ex["ya"]})
    return {"losses": losses, "backbone_changed": changed(before, model.backbone.parameters()),
            "task_a_before": a_before, "task_a_after": a_after}


CASES.append(Case(
    name="backbone_eval_mode_taken_for_freezing",
    family="params",
    source="alexrich021/3dvnet issue #11 ('Frozen Backbone Implementation': '.eval() only fixes "
           "the running statistics in batchnorm and dropout, but does not disable the gradient "
           "computations ... with .eval(), the backbone weights are still updating'; the author "
           "confirms and passes only the head's parameters to the optimizer)",
    description="To fine-tune with a frozen pretrained backbone I call model.backbone.eval() "
                "during training; the backbone weights keep updating and what it learned for the "
                "first task is lost.",
    # note: both variants call backbone.eval() (kept from the report: there it also fixes the
    # normalisation statistics); the backbone here has no dropout or batchnorm.
    expected_kinds=(),
    params=BACKBONE,
    manifest=lambda b, f: b["backbone_changed"] and not f["backbone_changed"] and trains(f, 0.2)
    and b["task_a_after"] >= 2 * f["task_a_after"],
    build_buggy=_eval_freeze_build(True),
    loop_buggy=_eval_freeze_loop,
    build_fixed=_eval_freeze_build(False),
    loop_fixed=_eval_freeze_loop,
    steps=60,
))


# ---- padding_idx=0 on an embedding whose index 0 is a real entity

def _mf_data(seed, n_users=16, n_items=16, rank=3, noise=0.05):
    gen = torch.Generator().manual_seed(seed + 6000)
    u = torch.randn(n_users, rank, generator=gen)
    v = torch.randn(n_items, rank, generator=gen)
    pairs = torch.cartesian_prod(torch.arange(n_users), torch.arange(n_items))
    r = (u[pairs[:, 0]] * v[pairs[:, 1]]).sum(1) / math.sqrt(rank)
    r = r + noise * torch.randn(r.shape, generator=gen)
    perm = torch.randperm(pairs.shape[0], generator=gen)
    return pairs[perm], r[perm]


class _Factorization(nn.Module):
    def __init__(self, n_users, n_items, d, bug: bool):
        super().__init__()
        self.U = nn.Embedding(n_users, d)
        self.V = nn.Embedding(n_items, d, padding_idx=0 if bug else None)

    def init(self):
        nn.init.normal_(self.U.weight, std=0.5)
        nn.init.normal_(self.V.weight, std=0.5)

    def forward(self, pairs):
        return (self.U(pairs[:, 0]) * self.V(pairs[:, 1])).sum(-1)


def _pad_build(bug: bool):
    def build(seed):
        torch.manual_seed(seed)
        model = _Factorization(16, 16, 4, bug)
        model.init()
        x, y = _mf_data(seed)
        return model, torch.optim.Adam(model.parameters(), lr=0.05), {"x": x, "y": y}
    return build


def _pad_loop(model, opt, ex, steps):
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        err = (model(ex["x"]) - ex["y"]) ** 2
        item0 = err[ex["x"][:, 1] == 0].mean().item()
        rest = err[ex["x"][:, 1] != 0].mean().item()
    return {"losses": losses, "item0": item0, "rest": rest}


CASES.append(Case(
    name="padding_idx_on_a_real_entity",
    family="params",
    source="ibalazevic/TuckER issue #17 ('Why set padding_idx=0 in nn.Embedding': 'this will "
           "lead the gradient of the first entity and relation becoming zero'; the author: "
           "'This is a mistake and should be fixed')",
    description="I create the item embedding with padding_idx=0 although index 0 is a real item "
                "(there is no padding); that item's embedding never trains and its predictions "
                "stay poor while every other item fits.",
    expected_kinds=(),
    params=("V.weight",),
    manifest=lambda b, f: trains(f, 0.5) and b["item0"] >= 4 * f["item0"]
    and b["item0"] >= 4 * b["rest"],
    build_buggy=_pad_build(True),
    loop_buggy=_pad_loop,
    build_fixed=_pad_build(False),
    loop_fixed=_pad_loop,
    steps=80,
))


# ---- the log-variance read from the mean's layer

def _hetero_data(seed, n=256, d=4):
    gen = torch.Generator().manual_seed(seed + 7000)
    x = torch.randn(n, d, generator=gen)
    w = torch.randn(d, 1, generator=gen) / math.sqrt(d)
    mu = torch.sin(2 * x @ w)
    sigma = 0.05 + 0.6 * torch.sigmoid(3 * x[:, 1:2])
    return x, mu + sigma * torch.randn(n, 1, generator=gen)


class _GaussianHead(nn.Module):
    def __init__(self, bug: bool):
        super().__init__()
        self.bug = bug
        self.encoder = nn.Sequential(nn.Linear(4, 32), nn.Tanh())
        self.encoder_fcmean = nn.Linear(32, 1)
        self.encoder_fcvar = nn.Linear(32, 1)

    def forward(self, x):
        embedded = self.encoder(x)
        if self.bug:
            embedded_mean, embedded_logvar = (self.encoder_fcmean(embedded),
                                              self.encoder_fcmean(embedded))
        else:
            embedded_mean, embedded_logvar = (self.encoder_fcmean(embedded),
                                              self.encoder_fcvar(embedded))
        return embedded_mean, embedded_logvar


def _gauss_nll(mean, logvar, y):
    return 0.5 * (logvar + (y - mean) ** 2 / logvar.exp()).mean()


def _hetero_build(bug: bool):
    def build(seed):
        torch.manual_seed(seed)
        model = _GaussianHead(bug)
        x, y = _hetero_data(seed)
        return model, torch.optim.Adam(model.parameters(), lr=0.03), {"x": x, "y": y}
    return build


def _hetero_loop(model, opt, ex, steps):
    before = snapshot(model.encoder_fcvar.parameters())
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        mean, logvar = model(x)
        loss = _gauss_nll(mean, logvar, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        full = _gauss_nll(*model(ex["x"]), ex["y"]).item()
    return {"losses": losses, "full": full,
            "var_head_changed": changed(before, model.encoder_fcvar.parameters())}


CASES.append(Case(
    name="logvar_computed_by_mean_layer",
    family="params",
    source="giannifranchi/LP_BNN issue #3 ('LPBNN_layers bug?': 'embedded_mean, "
           "embedded_logvar=self.encoder_fcmean(embedded),self.encoder_fcmean(embedded) ... it "
           "appears to be enforcing that the mean and logvar are the same'; the author: 'We will "
           "correct that mistake')",
    description="My Gaussian head computes both the mean and the log-variance with "
                "encoder_fcmean, so encoder_fcvar never trains and the mean and variance are "
                "forced equal; the negative log-likelihood stays well above what it should reach.",
    expected_kinds=("unused_param",),
    params=("encoder_fcvar.weight", "encoder_fcvar.bias"),
    manifest=lambda b, f: not b["var_head_changed"] and f["var_head_changed"]
    and b["full"] - f["full"] >= 0.25 and tail(f["losses"]) <= head(f["losses"]) - 0.4,
    build_buggy=_hetero_build(True),
    loop_buggy=_hetero_loop,
    build_fixed=_hetero_build(False),
    loop_fixed=_hetero_loop,
    steps=120,
))


# ---- LayerNorm's gain and bias re-initialised like a weight matrix

class _LNNet(nn.Module):
    def __init__(self, bug: bool, initializer_range=0.02):
        super().__init__()
        self.bug = bug
        self.initializer_range = initializer_range
        self.dense = nn.Linear(10, 32)
        self.LayerNorm = nn.LayerNorm(32)
        self.out = nn.Linear(32, 4)
        self.apply(self.init_weights)

    def init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=self.initializer_range)
            module.bias.data.zero_()
        elif isinstance(module, nn.LayerNorm):
            if self.bug:
                module.bias.data.normal_(mean=0.0, std=self.initializer_range)
                module.weight.data.normal_(mean=0.0, std=self.initializer_range)
            else:
                module.bias.data.zero_()
                module.weight.data.fill_(1.0)

    def forward(self, x):
        return self.out(F.relu(self.LayerNorm(self.dense(x))))


def _ln_build(bug: bool):
    def build(seed):
        torch.manual_seed(seed)
        model = _LNNet(bug)
        x, y = classification(seed)
        return model, torch.optim.SGD(model.parameters(), lr=0.5), {"x": x, "y": y}
    return build


def _ln_loop(model, opt, ex, steps):
    losses = ce_steps(model, opt, ex, steps)
    return {"losses": losses, "full": full_ce(model, ex)}


CASES.append(Case(
    name="layernorm_gain_initialised_like_weights",
    family="params",
    source="huggingface/transformers issue #143 ('bug in init_bert_weights': the LayerNorm "
           "'gamma ... beta ... are usually 1 and 0. the second init change it' to "
           "normal_(mean=0.0, std=config.initializer_range), 'will lead to bad convergence'); "
           "huggingface/transformers pull request #171 ('LayerNorm initialization')",
    description="My init_weights re-initialises the LayerNorm gamma and beta with "
                "normal_(0, initializer_range) like the weight matrices; pretraining from scratch "
                "converges badly.",
    expected_kinds=(),
    params=("LayerNorm.weight", "LayerNorm.bias"),
    manifest=lambda b, f: trains(f, 0.5) and worse(b, f, 1.5),
    build_buggy=_ln_build(True),
    loop_buggy=_ln_loop,
    build_fixed=_ln_build(False),
    loop_fixed=_ln_loop,
    steps=60,
))


# ---- ActNorm's "initialized" flag is a plain attribute: a loaded model re-initialises itself

class ActNorm(nn.Module):
    """Data-dependent initialisation on the first training forward (as in the report)."""

    def __init__(self, features, bug: bool):
        super().__init__()
        self.bug = bug
        if bug:
            self.initialized = False
        else:
            self.register_buffer("initialized", torch.tensor(False, dtype=torch.bool))
        self.log_scale = nn.Parameter(torch.zeros(features))
        self.shift = nn.Parameter(torch.zeros(features))

    def forward(self, inputs):
        if self.training and not self.initialized:
            self._initialize(inputs)
        return inputs * torch.exp(self.log_scale) + self.shift

    def _initialize(self, inputs):
        with torch.no_grad():
            std = inputs.std(dim=0)
            mu = (inputs / std).mean(dim=0)
            self.log_scale.data = -torch.log(std)
            self.shift.data = -mu
            if self.bug:
                self.initialized = True
            else:
                self.initialized.data = torch.tensor(True, dtype=torch.bool)


class _ActNormNet(nn.Module):
    def __init__(self, bug: bool):
        super().__init__()
        self.fc1 = nn.Linear(10, 32)
        self.actnorm = ActNorm(32, bug)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.actnorm(self.fc1(x))))


def _actnorm_build(bug: bool):
    def build(seed):
        torch.manual_seed(seed)
        x, y = classification(seed)
        ex = {"x": x, "y": y}
        # the first run, saved to a checkpoint
        first = _ActNormNet(bug)
        first_opt = torch.optim.Adam(first.parameters(), lr=0.02)
        pre = ce_steps(first, first_opt, ex, 60)
        ckpt = {"model": first.state_dict(), "optimizer": first_opt.state_dict()}
        # the resumed run: a fresh model loads the checkpoint and keeps training
        model = _ActNormNet(bug)
        model.load_state_dict(ckpt["model"])
        opt = torch.optim.Adam(model.parameters(), lr=0.02)
        opt.load_state_dict(ckpt["optimizer"])
        ex["start"], ex["before"] = 60, sum(pre[-5:]) / 5
        return model, opt, ex
    return build


def _actnorm_loop(model, opt, ex, steps):
    loaded = snapshot(model.actnorm.parameters())
    losses, rewritten = [], None
    for i in range(ex["start"], ex["start"] + steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        out = model(x)
        if rewritten is None:  # after the first forward, before any step
            rewritten = changed(loaded, model.actnorm.parameters())
        loss = F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "before": ex["before"], "jump": max(losses[:3]),
            "rewritten": rewritten}


CASES.append(Case(
    name="actnorm_initialized_flag_not_persisted",
    family="params",
    source="bayesiains/nflows issue #4 ('Actnorm does not register initialized as buffer': "
           "'When you then load a model from the state dict and continue training, the scale "
           "and shift of the actnorm layers are re-initialized'; fixed in pull request #5); "
           "VincentStimper/normalizing-flows pull request #2 ('Changed ActNorm flag to buffer "
           "to allow saving')",
    description="My ActNorm keeps self.initialized as a plain attribute; after loading a "
                "checkpoint and resuming, the first forward re-runs the data-dependent init and "
                "overwrites the trained scale and shift, and the loss jumps back up.",
    # note: the symptom (loaded weights overwritten) resembles init_applied_after_checkpoint_load,
    # but the cause differs: a state flag left out of the state_dict, and the overwrite happens
    # inside the training loop (the first forward writes the parameters), not before it.
    expected_kinds=("foreign_update",),
    params=("actnorm.log_scale", "actnorm.shift"),
    manifest=lambda b, f: b["rewritten"] and not f["rewritten"]
    and b["jump"] >= 3 * f["jump"] and b["jump"] >= 3 * b["before"],
    build_buggy=_actnorm_build(True),
    loop_buggy=_actnorm_loop,
    build_fixed=_actnorm_build(False),
    loop_fixed=_actnorm_loop,
    steps=20,
))
