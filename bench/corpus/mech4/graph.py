"""The fourth corpus, mechanism 'graph' (the autograd graph: detach, .data, in-place ops, no_grad
regions, retain_graph, hooks): cases mined from public reports by worker c."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .._common import (
    Case,
    batch,
    changed,
    classification,
    snapshot,
    tail,
    trains,
)
from .._m4_c import (
    scalar_wave,
    spread,
    token_sets,
    two_views,
)


def _ce_all(model, x, y):
    with torch.no_grad():
        return F.cross_entropy(model(x), y).item()


# --- a learned adjacency detached before it is used
class _AdjGCN(nn.Module):
    """A graph layer over a set of tokens whose adjacency is learned from two projections."""

    def __init__(self, detach_adj: bool, d: int = 8, h: int = 16, c: int = 4):
        super().__init__()
        self.detach_adj = detach_adj
        self.phi = nn.Linear(d, h, bias=False)
        self.theta = nn.Linear(d, h, bias=False)
        self.gc = nn.Linear(d, 32)
        self.head = nn.Linear(32, c)

    def forward(self, x):
        adj = torch.softmax(self.phi(x) @ self.theta(x).transpose(1, 2) / 4.0, dim=-1)
        if self.detach_adj:
            adj = adj.detach()
        out = F.relu(self.gc(adj @ x))
        return self.head(out.mean(1))


def _adj_build(detach_adj: bool):
    def build(seed):
        torch.manual_seed(seed)
        model = _AdjGCN(detach_adj)
        x, y = token_sets(seed)
        return model, torch.optim.SGD(model.parameters(), lr=0.3), {"x": x, "y": y}
    return build


def _adj_loop(model, opt, ex, steps):
    before = snapshot([model.phi.weight, model.theta.weight])
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses,
            "adj_trained": changed(before, [model.phi.weight, model.theta.weight])}


ADJ_DETACHED = Case(
    name="learned_adjacency_detached",
    family="graph",
    source="queenie88/A-GCN issue #4 ('Question about gradient flow': 'If adj is detached from "
           "the computation graph, how could the two weight matrices be updated (i.e. W_phi, "
           "W_theta)?'; the authors: 'You are right, the .detech() should be removed')",
    description="My graph layer builds its adjacency from two learned projections of the "
                "nodes, but I detach the adjacency before using it; the two projection matrices "
                "keep their initial values for the whole run.",
    expected_kinds=("unused_param",),
    params=("phi.weight", "theta.weight"),
    manifest=lambda b, f: (not b["adj_trained"]) and f["adj_trained"] and trains(f, 0.3),
    build_buggy=_adj_build(True), loop_buggy=_adj_loop,
    build_fixed=_adj_build(False), loop_fixed=_adj_loop,
    steps=60,
)


# --- a custom layer that computes its output from weight.data
class _MyLinear(nn.Module):
    """The custom fully connected layer of a tutorial, ReLU included."""

    def __init__(self, in_units: int, units: int, use_data: bool):
        super().__init__()
        self.use_data = use_data
        self.weight = nn.Parameter(torch.randn(in_units, units) / math.sqrt(in_units))
        self.bias = nn.Parameter(torch.randn(units) * 0.1)

    def forward(self, x):
        if self.use_data:
            linear = torch.matmul(x, self.weight.data) + self.bias.data
        else:
            linear = torch.matmul(x, self.weight) + self.bias
        return F.relu(linear)


def _mylinear_build(use_data: bool):
    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(_MyLinear(10, 16, use_data), nn.Linear(16, 4))
        x, y = classification(seed)
        return model, torch.optim.SGD(model.parameters(), lr=0.2), {"x": x, "y": y}
    return build


def _mylinear_loop(model, opt, ex, steps):
    first = [model[0].weight, model[0].bias]
    before = snapshot(first)
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "first_trained": changed(before, first),
            "full": _ce_all(model, ex["x"], ex["y"])}


WEIGHT_DATA_IN_FORWARD = Case(
    name="custom_layer_forward_uses_weight_data",
    family="graph",
    source="d2l-ai/d2l-en pull request #2600 ('Fix pytorch version of custom-layer to allow auto "
           "grad': \"'self.weight' and 'self.bias' should be used instead of 'self.weight.data' "
           "and 'self.bias.data' to make sure that BP works for weight and bias\")",
    description="I wrote my own linear layer following the tutorial, computing X @ "
                "self.weight.data + self.bias.data; the network trains a little, but my layer's "
                "weight and bias never change.",
    expected_kinds=("unused_param",),
    params=("0.weight", "0.bias"),
    manifest=lambda b, f: ((not b["first_trained"]) and f["first_trained"] and trains(f, 0.3)
                           and b["full"] >= 1.2 * f["full"]),
    build_buggy=_mylinear_build(True), loop_buggy=_mylinear_loop,
    build_fixed=_mylinear_build(False), loop_fixed=_mylinear_loop,
    steps=60,
)


# --- a parameter constraint applied under torch.no_grad() inside forward
class _FilterConstraint(nn.Module):
    """Keeps each filter's centre and width in range (the clamp of a learnable filterbank)."""

    def __init__(self, no_grad: bool):
        super().__init__()
        self.no_grad = no_grad

    def _clip(self, kernel):
        mu = torch.clamp(kernel[:, 0], -3.0, 3.0)
        sigma = torch.clamp(kernel[:, 1], 0.1, 2.0)
        return torch.stack([mu, sigma], dim=1)

    def forward(self, kernel):
        if self.no_grad:
            with torch.no_grad():
                return self._clip(kernel)
        return self._clip(kernel)


class _Filterbank(nn.Module):
    def __init__(self, no_grad: bool, filters: int = 8):
        super().__init__()
        init = torch.stack([torch.linspace(-0.3, 0.3, filters), torch.full((filters,), 0.3)], 1)
        self.kernel = nn.Parameter(init)
        self.constraint = _FilterConstraint(no_grad)

    def forward(self, x):
        k = self.constraint(self.kernel)
        return torch.exp(-(x - k[:, 0]) ** 2 / (2 * k[:, 1] ** 2))


def _fb_build(no_grad: bool):
    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(_Filterbank(no_grad), nn.Linear(8, 1))
        x, y = scalar_wave(seed)
        return model, torch.optim.Adam(model.parameters(), lr=0.05), {"x": x, "y": y}
    return build


def _fb_loop(model, opt, ex, steps):
    before = snapshot([model[0].kernel])
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        full = F.mse_loss(model(ex["x"]), ex["y"]).item()
    return {"losses": losses, "kernel_trained": changed(before, [model[0].kernel]), "full": full}


CONSTRAINT_NO_GRAD = Case(
    name="filter_constraint_under_no_grad",
    family="graph",
    source="denfed/leaf-audio-pytorch issue #3 ('Backpropagation doesn't change weights of the "
           "convolutional layer': 'why does forward call of GaborConstraint class has \"with "
           "torch.no_grad()\"? It appears the convolutional layers weight doesn't change while "
           "backpropagation because of this')",
    description="My learnable filterbank clamps its filters' centres and widths in a constraint "
                "module whose forward runs under torch.no_grad(); the filter parameters are the "
                "same after training as before it.",
    expected_kinds=("unused_param",),
    params=("0.kernel",),
    manifest=lambda b, f: ((not b["kernel_trained"]) and f["kernel_trained"] and trains(f, 0.3)
                           and b["full"] >= 1.5 * f["full"]),
    build_buggy=_fb_build(True), loop_buggy=_fb_loop,
    build_fixed=_fb_build(False), loop_fixed=_fb_loop,
    steps=80,
)


# --- an evolved weight re-wrapped in nn.Parameter inside forward
class _EvolveLayer(nn.Module):
    """A layer whose weight is evolved by a recurrent cell at every call (EvolveGCN-O style)."""

    def __init__(self, rewrap: bool, d: int = 10):
        super().__init__()
        self.rewrap = rewrap
        self.conv = nn.Linear(d, d, bias=False)
        self.recurrent = nn.GRU(d, d)

    def forward(self, x):
        w = self.conv.weight[None, :, :]
        w, _ = self.recurrent(w, w)
        w = w.squeeze(0)
        if self.rewrap:
            self.conv.weight = nn.Parameter(w)
            return self.conv(x)
        return F.linear(x, w)


def _evolve_build(rewrap: bool):
    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(_EvolveLayer(rewrap), nn.ReLU(), nn.Linear(10, 4))
        x, y = classification(seed)
        return model, torch.optim.Adam(model.parameters(), lr=0.01), {"x": x, "y": y}
    return build


def _evolve_loop(model, opt, ex, steps):
    rec = list(model[0].recurrent.parameters())
    before = snapshot(rec)
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "rec_trained": changed(before, rec)}


_GRU = ("0.recurrent.weight_ih_l0", "0.recurrent.weight_hh_l0", "0.recurrent.bias_ih_l0",
        "0.recurrent.bias_hh_l0")

# note: labelled both unused_param (the recurrent cell no longer reaches the loss) and
# orphan_param (the re-wrapped weight has a gradient but is not in the optimizer).
EVOLVED_WEIGHT_REWRAPPED = Case(
    name="evolved_weight_rewrapped_as_parameter",
    family="graph",
    source="benedekrozemberczki/pytorch_geometric_temporal issue #80 ('[Bug?] the way to set "
           "GCN.weight in EvolveGCN': 'the gradient function may be lost' where the evolved "
           "weight is assigned with self.conv_layer.weight = torch.nn.Parameter(W))",
    description="My layer evolves its weight with a recurrent cell at every forward and stores "
                "the result back with self.conv.weight = nn.Parameter(W); the recurrent cell "
                "never learns and the loss ends well above the version that uses W directly.",
    expected_kinds=("unused_param", "orphan_param"),
    params=_GRU + ("0.conv.weight",),
    manifest=lambda b, f: ((not b["rec_trained"]) and f["rec_trained"] and trains(f, 0.3)
                           and tail(b["losses"], 10) >= 1.3 * tail(f["losses"], 10)),
    build_buggy=_evolve_build(True), loop_buggy=_evolve_loop,
    build_fixed=_evolve_build(False), loop_fixed=_evolve_loop,
    steps=80,
)


# --- a siamese objective without the stop-gradient on the target branch
class _Siam(nn.Module):
    def __init__(self, d: int = 10, h: int = 32, z: int = 16):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, z))
        self.predictor = nn.Sequential(nn.Linear(z, 8), nn.ReLU(), nn.Linear(8, z))

    def forward(self, x0, x1):
        z0, z1 = self.encoder(x0), self.encoder(x1)
        return z0, z1, self.predictor(z0), self.predictor(z1)


def _siam_build(seed):
    torch.manual_seed(seed)
    model = _Siam()
    x, v1, v2, lab = two_views(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, {"x": x, "v1": v1, "v2": v2}


def _siam_loop(detach: bool):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x0, x1 = batch(ex["v1"], ex["v2"], i, 64)
            opt.zero_grad()
            z0, z1, p0, p1 = model(x0, x1)
            if detach:
                z0, z1 = z0.detach(), z1.detach()
            loss = -0.5 * (F.cosine_similarity(p0, z1).mean() + F.cosine_similarity(p1, z0).mean())
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            z = model.encoder(ex["x"])
        return {"losses": losses, "spread": spread(z)}
    return loop


# note: no kind fits a missing stop-gradient (every parameter still gets a gradient).
SIAM_NO_STOPGRAD = Case(
    name="siamese_target_branch_not_detached",
    family="graph",
    source="lightly-ai/lightly issue #559 ('The gradient of projection haven't been detached in "
           "this implementation of SimSiam': 'The projection z0 and z1 of raw output of backbone "
           "in SimSiam should be detached')",
    description="My SimSiam loss compares each view's prediction with the other view's "
                "projection without detaching the projection; the loss drops to -1 at once and "
                "every input ends up with the same embedding.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: b["spread"] <= 0.3 * f["spread"],
    build_buggy=_siam_build, loop_buggy=_siam_loop(False),
    build_fixed=_siam_build, loop_fixed=_siam_loop(True),
    steps=60,
)


CASES = [ADJ_DETACHED, WEIGHT_DATA_IN_FORWARD, CONSTRAINT_NO_GRAD, EVOLVED_WEIGHT_REWRAPPED,
         SIAM_NO_STOPGRAD]
