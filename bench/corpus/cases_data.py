"""Cases whose bug is in the data or in the user's intent, not in the gradients: inputs and
labels shuffled apart, a reshape that scrambles the samples, a freeze that freezes nothing.
No graddbg finding kind names them (expected_kinds is empty): they measure honestly what a
gradient tool cannot see."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ._common import Case, batch, changed, classification, mlp, snapshot, trains


def _eval(model, x, y):
    with torch.no_grad():
        logits = model(x)
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def _shuffle_build(seed):
    model = mlp(seed)
    x, y = classification(seed)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), {
        "x": x, "y": y, "g": torch.Generator().manual_seed(seed + 11)}


def _shuffle_loop(together: bool, epoch: int = 8):
    def loop(model, opt, ex, steps):
        x, y, losses = ex["x"], ex["y"], []
        for i in range(steps):
            if i % epoch == 0:  # reshuffle the data set each epoch
                px = torch.randperm(len(x), generator=ex["g"])
                py = px if together else torch.randperm(len(y), generator=ex["g"])
                x, y = x[px], y[py]
            xb, yb = batch(x, y, i)
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        true, acc = _eval(model, ex["x"], ex["y"])
        return {"losses": losses, "true_loss": true, "accuracy": acc}
    return loop


SHUFFLED = Case(
    name="labels_shuffled_separately",
    family="data",
    source="DrexelChatbotGroup/DrexelChatbot issue #15 ('randomizes the order of the x data, but "
           "not the y data'); udacity/sdc-issue-reports issue #1326 (features and labels "
           "shuffled with different orders); dennybritz/cnn-text-classification-tf issue #136",
    description="I shuffle my features and my labels each epoch, each with its own "
                "permutation; the loss stays at chance level.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.3) and b["true_loss"] >= 1.3 * f["true_loss"]
    and b["accuracy"] <= f["accuracy"] - 0.2,
    build_buggy=_shuffle_build,
    loop_buggy=_shuffle_loop(False),
    build_fixed=_shuffle_build,
    loop_fixed=_shuffle_loop(True),
    steps=64,
)


class Temporal(nn.Module):
    """A per-time-step encoder over channels, mean-pooled over time, then a classifier."""

    def __init__(self, channels: int = 3):
        super().__init__()
        self.step = nn.Linear(channels, 16)
        self.cls = nn.Linear(16, 2)

    def forward(self, x):  # x: [N, T, C]
        return self.cls(torch.relu(self.step(x)).mean(1))


def _series(seed, n=256, t=8, c=3):
    """Series stored channels-first, [N, C, T]; the label is the sign of channel 0's mean
    minus channel 2's mean."""
    gen = torch.Generator().manual_seed(seed + 4000)
    x = torch.randn(n, c, t, generator=gen)
    y = (x[:, 0].mean(1) - x[:, 2].mean(1) > 0).long()
    return x, y


def _series_build(seed):
    torch.manual_seed(seed)
    model = Temporal()
    x, y = _series(seed)
    return model, torch.optim.SGD(model.parameters(), lr=0.3), {"x": x, "y": y}


def _series_loop(permute: bool):
    def loop(model, opt, ex, steps):
        n, c, t = ex["x"].shape
        x = ex["x"].permute(0, 2, 1) if permute else ex["x"].view(n, t, c)
        losses = []
        for i in range(steps):
            xb, yb = batch(x, ex["y"], i)
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        true, acc = _eval(model, ex["x"].permute(0, 2, 1), ex["y"])
        return {"losses": losses, "true_loss": true, "accuracy": acc}
    return loop


VIEW = Case(
    name="view_instead_of_permute",
    family="data",
    source="zhouhaoyi/Informer2020 issue #59 ('In order to change the order of dimensions, why "
           "is torch.tensor.view used??', fixed by the authors); pytorch/pytorch issue #16560 "
           "('High scope of error in how view() may be used'); zamanzadeh/CARLA issue #16",
    description="My series come channels-first and I reshape them to [N, T, C] with .view(); "
                "the model learns far less than it should.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.3) and b["accuracy"] <= f["accuracy"] - 0.1,
    build_buggy=_series_build,
    loop_buggy=_series_loop(False),
    build_fixed=_series_build,
    loop_fixed=_series_loop(True),
    steps=60,
)


class Pretrained(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(10, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.backbone(x))


def _freeze_build(proper: bool):
    def build(seed):
        torch.manual_seed(seed)
        model = Pretrained()
        if proper:
            model.backbone.requires_grad_(False)
        else:
            model.backbone.requires_grad = False  # sets an attribute, freezes nothing
        x, y = classification(seed)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.2)
        return model, opt, {"x": x, "y": y}
    return build


def _freeze_loop(model, opt, ex, steps):
    before, losses = snapshot(model.backbone.parameters()), []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "backbone_changed": changed(before, model.backbone.parameters())}


FREEZE_NOOP = Case(
    name="module_requires_grad_attribute_noop",
    family="data",
    source="CSCYQJ/MICCAI23-ProtoContra-SFDA issue #18 ('self.model.outc.requires_grad = False' "
           "does not freeze the layer; PyTorch forum thread 'requires_grad doesn't propagate to "
           "the parameters of the module', 9979)",
    description="I freeze the pretrained backbone with model.backbone.requires_grad = False; "
                "its weights still change during fine-tuning.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: b["backbone_changed"] and not f["backbone_changed"] and trains(f, 0.2),
    build_buggy=_freeze_build(False),
    loop_buggy=_freeze_loop,
    build_fixed=_freeze_build(True),
    loop_fixed=_freeze_loop,
    steps=40,
)

CASES = [SHUFFLED, VIEW, FREEZE_NOOP]
