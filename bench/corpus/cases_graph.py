"""Cases where the autograd graph or the model's registry is wrong: tensors that are not
parameters, parameters cut off from the loss, training in eval mode, dead layers from the
initialisation, an exploding regression."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from ._common import (
    Case,
    any_nonfinite,
    batch,
    changed,
    classification,
    regression,
    snapshot,
    tail,
    trains,
    worse,
)


def _loop(model, opt, ex, steps, watch_params=None, loss_fn=F.cross_entropy, hook=None):
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


def _build(make, lr=0.1, data=classification, opt_cls=torch.optim.SGD):
    def build(seed):
        torch.manual_seed(seed)
        model = make()
        x, y = data(seed)
        return model, opt_cls(model.parameters(), lr=lr), {"x": x, "y": y}
    return build


def _looping(**kw):
    return lambda model, opt, ex, steps: _loop(model, opt, ex, steps, **kw)


# --------------------------------------------------------------------------- hidden_param

class ListNet(nn.Module):
    """Hidden layers kept in a Python list (buggy) or an nn.ModuleList (fixed)."""

    def __init__(self, registered: bool):
        super().__init__()
        self.inp = nn.Linear(10, 32)
        hidden = [nn.Linear(32, 32) for _ in range(2)]
        self.hidden = nn.ModuleList(hidden) if registered else hidden
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        for layer in self.hidden:
            h = torch.relu(layer(h))
        return self.out(h)


def _hidden_weights(model):
    return [layer.weight for layer in model.hidden]


LIST = Case(
    name="layers_in_python_list",
    family="hidden_param",
    source="pytorch/pytorch issues #666 ('nn.Module not importing parameters contained in lists') "
           "and #715, #38639 (parameters in a Python list 'get invisible and hence can't be seen "
           "by the optimizer')",
    description="I keep my hidden layers in a plain list so the depth is configurable; the "
                "network trains worse than expected and the hidden weights never change.",
    expected_kinds=("hidden_param",),
    params=(),
    manifest=lambda b, f: (not b["changed"]) and f["changed"] and trains(f, 0.3),
    build_buggy=_build(lambda: ListNet(False), lr=0.3),
    loop_buggy=_looping(watch_params=_hidden_weights),
    build_fixed=_build(lambda: ListNet(True), lr=0.3),
    loop_fixed=_looping(watch_params=_hidden_weights),
    steps=60,
)


class DictNet(nn.Module):
    """A learnable per-feature scale kept in a plain dict (buggy) or a ParameterDict."""

    def __init__(self, registered: bool):
        super().__init__()
        scale = {"scale": nn.Parameter(torch.full((10,), 0.1))}
        self.extra = nn.ParameterDict(scale) if registered else scale
        self.body = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        return self.body(x * self.extra["scale"])


DICT = Case(
    name="parameters_in_plain_dict",
    family="hidden_param",
    source="pytorch/pytorch issue #4631 ('Only nn.Parameters defined directly within nn.Module "
           "are listed in module.parameters()': self.weights = {} holding nn.Parameter)",
    description="My learnable input scale lives in a dict of nn.Parameter; it stays at its "
                "initial value for the whole run.",
    expected_kinds=("hidden_param",),
    params=(),
    manifest=lambda b, f: (not b["changed"]) and f["changed"] and trains(f, 0.2),
    build_buggy=_build(lambda: DictNet(False), lr=0.5),
    loop_buggy=_looping(watch_params=lambda m: [m.extra["scale"]]),
    build_fixed=_build(lambda: DictNet(True), lr=0.5),
    loop_fixed=_looping(watch_params=lambda m: [m.extra["scale"]]),
    steps=80,
)


class InForward(nn.Module):
    """The middle layer built inside forward (buggy) or in __init__ (fixed)."""

    def __init__(self, in_init: bool):
        super().__init__()
        self.inp = nn.Linear(10, 32)
        self.mid = nn.Linear(32, 32) if in_init else None
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        mid = self.mid if self.mid is not None else nn.Linear(32, 32)
        return self.out(torch.relu(mid(h)))


FORWARD_LAYER = Case(
    name="layer_created_in_forward",
    family="hidden_param",
    source="pytorch/pytorch issue #1291 (layers created in forward() are missing from "
           "list(model.parameters()))",
    description="I create a Linear inside forward(); the loss is noisy and stays high.",
    expected_kinds=("hidden_param",),
    params=(),
    manifest=lambda b, f: trains(f, 0.3) and worse(b, f, 1.5),
    build_buggy=_build(lambda: InForward(False), lr=0.3),
    loop_buggy=_looping(),
    build_fixed=_build(lambda: InForward(True), lr=0.3),
    loop_fixed=_looping(),
    steps=60,
)


# --------------------------------------------------------------------------- eval_mode

def _dropout_net():
    return nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 4))


def _validate_at(step, restore):
    def hook(model, i, ex):
        if i == step:
            model.eval()
            with torch.no_grad():
                F.cross_entropy(model(ex["x"]), ex["y"])
            if restore:
                model.train()
    return hook


def _mode_manifest(b, f):
    """The buggy run trained in eval mode after validation (the fixed one never did), and
    its training loss left the fixed run's: the dropout it was meant to train with is gone."""
    start = b["modes"].index(False)
    return (all(f["modes"]) and start > 0 and not any(b["modes"][start:])
            and tail(b["losses"], 10) <= 0.9 * tail(f["losses"], 10))


EVAL_VALIDATION = Case(
    name="eval_not_undone_after_validation",
    family="eval_mode",
    source="fartashf/vsepp issue #4 ('Finish validation without running model.train()'; "
           "results changed noticeably once fixed); tk-rusch/coRNN issue #1; Na-Z/attMPTI issue #16",
    description="After the mid-epoch validation my training loss suddenly drops; validation "
                "calls model.eval() and nothing calls model.train() again.",
    expected_kinds=("eval_mode",),
    params=(),
    manifest=_mode_manifest,
    build_buggy=_build(_dropout_net),
    loop_buggy=_looping(hook=_validate_at(15, restore=False)),
    build_fixed=_build(_dropout_net),
    loop_fixed=_looping(hook=_validate_at(15, restore=True)),
    steps=60,
)


def _bn_net():
    return nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def _pretrained_build(train_mode: bool):
    def build(seed):
        torch.manual_seed(seed)
        model = _bn_net()
        # the checkpoint's BatchNorm statistics, from features of another domain
        model[1].running_mean.fill_(0.5)
        model[1].running_var.fill_(0.01)
        model.eval()  # what the loading helper hands back
        if train_mode:
            model.train()
        x, y = classification(seed)
        return model, torch.optim.SGD(model.parameters(), lr=0.1), {"x": x, "y": y}
    return build


PRETRAINED_EVAL = Case(
    name="pretrained_left_in_eval_mode",
    family="eval_mode",
    source="huggingface/transformers pull request #1703 ('The model is set in evaluation mode by "
           "default using model.eval() ... To train the model, you should first set it back in "
           "training mode with model.train()')",
    description="I fine-tune a model loaded by a checkpoint helper in my own loop; BatchNorm "
                "never normalises my batches: its running statistics stay those of the "
                "checkpoint and the run differs from the framework trainer's.",
    expected_kinds=("eval_mode",),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and not any(b["modes"]) and all(f["modes"])
    and (not b["changed"]) and f["changed"],
    build_buggy=_pretrained_build(False),
    loop_buggy=_looping(watch_params=lambda m: [m[1].running_mean, m[1].running_var]),
    build_fixed=_pretrained_build(True),
    loop_fixed=_looping(watch_params=lambda m: [m[1].running_mean, m[1].running_var]),
    steps=50,
)


# --------------------------------------------------------------------------- unused_param

class Frozen(nn.Module):
    """A backbone and a head; ``mode`` says how the backbone's output reaches the head."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.backbone = nn.Sequential(nn.Linear(10, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        if self.mode == "no_grad":
            with torch.no_grad():
                h = self.backbone(x)
        elif self.mode == "reentrant":
            h = checkpoint(self.backbone, x, use_reentrant=True)
        elif self.mode == "non_reentrant":
            h = checkpoint(self.backbone, x, use_reentrant=False)
        elif self.mode == "numpy":
            # a NumPy post-processing step, then back to a tensor
            h = torch.from_numpy(np.clip(self.backbone(x).detach().numpy(), -0.9, 0.9))
        elif self.mode == "numpy_fixed":
            h = torch.clamp(self.backbone(x), -0.9, 0.9)
        else:
            h = self.backbone(x)
        return self.head(h)


BACKBONE = ("backbone.0.weight", "backbone.0.bias")


def _backbone(model):
    return list(model.backbone.parameters())


def _cut_case(name, mode, fixed_mode, source, description, kinds=("unused_param",)):
    return Case(
        name=name, family="unused_param", source=source, description=description,
        expected_kinds=kinds, params=BACKBONE,
        manifest=lambda b, f: (not b["changed"]) and f["changed"] and trains(f, 0.3),
        build_buggy=_build(lambda: Frozen(mode), lr=0.2),
        loop_buggy=_looping(watch_params=_backbone),
        build_fixed=_build(lambda: Frozen(fixed_mode), lr=0.2),
        loop_fixed=_looping(watch_params=_backbone),
        steps=40,
    )


NO_GRAD = _cut_case(
    "backbone_under_no_grad", "no_grad", "plain",
    "open-mmlab/OpenPCDet issue #845 (torch.no_grad around a backbone's forward freezes it, "
    "whatever the optimizer holds); the inverse mistake: a no_grad kept for speed around a "
    "backbone meant to be fine-tuned",
    "I wrapped the feature extractor's forward in torch.no_grad() to save memory; fine-tuning "
    "gives the same result as training the head alone.")

REENTRANT = _cut_case(
    "reentrant_checkpoint_no_input_grad", "reentrant", "non_reentrant",
    "mlfoundations/open_clip issue #573 ('None of the inputs have requires_grad=True. Gradients "
    "will be None'; use_reentrant=False also improved the loss); pytorch/pytorch issue #7617",
    "With gradient checkpointing on the first block (use_reentrant=True) that block's weights "
    "never change; torch warns once about inputs without requires_grad.")

NUMPY = _cut_case(
    "numpy_roundtrip_in_forward", "numpy", "numpy_fixed",
    "pytorch/pytorch issue #1760 (Variable(torch.Tensor(x.data.numpy())) makes a new leaf: "
    "nothing before it gets a gradient)",
    "My forward clips the features with NumPy and converts back with torch.from_numpy; the "
    "layers before that point never learn.")


class Quantised(nn.Module):
    """An encoder whose output is rounded to quarter steps (a hard quantiser)."""

    def __init__(self, straight_through: bool):
        super().__init__()
        self.straight_through = straight_through
        self.enc = nn.Linear(10, 16)
        self.dec = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.enc(x))
        q = torch.round(h * 4) / 4
        if self.straight_through:
            q = h + (q - h).detach()
        return self.dec(q)


ROUND = Case(
    name="round_quantization_in_forward",
    family="unused_param",
    source="torch/nn issue #1174 ('The gradient is 0 everywhere; you cannot train the layers "
           "before this'); Justin-Tan/generative-compression issue #27 (encoder not updated "
           "through round())",
    description="I quantise my encoder's output with torch.round; the encoder's weights never "
                "change, its gradient is exactly zero.",
    expected_kinds=("dead_grad", "unused_param"),
    params=("enc.weight", "enc.bias"),
    manifest=lambda b, f: (not b["changed"]) and f["changed"] and trains(f, 0.2),
    build_buggy=_build(lambda: Quantised(False), lr=0.2),
    loop_buggy=_looping(watch_params=lambda m: list(m.enc.parameters())),
    build_fixed=_build(lambda: Quantised(True), lr=0.2),
    loop_fixed=_looping(watch_params=lambda m: list(m.enc.parameters())),
    steps=40,
)


# --------------------------------------------------------------------------- dead_grad

def _deep(init: str):
    def make():
        net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                            nn.Linear(32, 4))
        if init == "zeros":
            for m in net:
                if isinstance(m, nn.Linear):
                    nn.init.zeros_(m.weight)
                    nn.init.zeros_(m.bias)
        elif init == "negative_bias":
            nn.init.constant_(net[0].bias, -4.0)  # "a negative bias for sparse activations"
            with torch.no_grad():
                net[0].weight.mul_(0.5)
        return net
    return make


ZERO = Case(
    name="zero_init_weights",
    family="dead_grad",
    source="wagonhelm/NaNmnist issue #2 ('Pitfall: all zero initialization'); davharris/mistnet "
           "issue #87 ('Otherwise there are no gradients for any networks with a hidden layer!')",
    description="I initialise every Linear with zeros to start from a neutral model; only the "
                "output bias learns, the accuracy stays at the majority class.",
    expected_kinds=("dead_grad",),
    params=("0.weight", "0.bias", "2.weight", "2.bias", "4.weight"),
    manifest=lambda b, f: (not b["changed"]) and trains(f, 0.3) and worse(b, f, 1.3),
    build_buggy=_build(_deep("zeros"), lr=0.3),
    loop_buggy=_looping(watch_params=lambda m: [m[0].weight, m[2].weight, m[4].weight]),
    build_fixed=_build(_deep("default"), lr=0.3),
    loop_fixed=_looping(watch_params=lambda m: [m[0].weight, m[2].weight, m[4].weight]),
    steps=60,
)

NEG_BIAS = Case(
    name="negative_bias_dead_relu",
    family="dead_grad",
    source="PyTorch forum thread 'Cross Entropy loss is not decreasing' (43814, post 16: "
           "'parameters ... almost all negative, and their derivatives are all zero' with ReLU)",
    description="I initialised the first layer's bias negative; the loss sits at log(classes) "
                "and the first layers' gradients are all exactly zero.",
    expected_kinds=("dead_grad",),
    params=("0.weight", "0.bias", "2.weight", "2.bias"),
    manifest=lambda b, f: (not b["changed"]) and trains(f, 0.3) and worse(b, f, 1.3),
    build_buggy=_build(_deep("negative_bias"), lr=0.3),
    loop_buggy=_looping(watch_params=lambda m: [m[0].weight, m[0].bias, m[2].weight]),
    build_fixed=_build(_deep("default"), lr=0.3),
    loop_fixed=_looping(watch_params=lambda m: [m[0].weight, m[0].bias, m[2].weight]),
    steps=60,
)


# --------------------------------------------------------------------------- explode

def _prices(seed, normalise: bool):
    x, y = regression(seed)
    y = 200 * y + 500  # house prices in thousands
    if normalise:
        y = (y - y.mean()) / y.std()
    return x, y


def _reg_net():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


def _scaled_trains(b, f):
    """The fixed run trains; the buggy one blows up (its loss ends non-finite or above its start)."""
    return trains(f, 0.2) and (any_nonfinite(b["losses"]) or tail(b["losses"]) > b["losses"][0])


UNNORMALISED = Case(
    name="unnormalised_regression_targets",
    family="explode",
    source="rstudio-conf-2020/dl-keras-tf issue #9 ('loss = NAN when loss = mean_squared_error "
           "due to exploding values': unscaled sale prices as targets)",
    description="I regress house prices directly (hundreds of thousands) with SGD; after a few "
                "steps the loss is NaN.",
    expected_kinds=("explode", "nonfinite"),
    params=(),
    manifest=_scaled_trains,
    build_buggy=_build(_reg_net, lr=0.03, data=lambda s: _prices(s, False)),
    loop_buggy=_looping(loss_fn=F.mse_loss),
    build_fixed=_build(_reg_net, lr=0.03, data=lambda s: _prices(s, True)),
    loop_fixed=_looping(loss_fn=F.mse_loss),
    steps=40,
)

CASES = [LIST, DICT, FORWARD_LAYER, EVAL_VALIDATION, PRETRAINED_EVAL, NO_GRAD, REENTRANT,
         NUMPY, ROUND, ZERO, NEG_BIAS, UNNORMALISED]
