"""The third corpus, mechanism 'graph' (the autograd graph: detach, .data, in-place ops, no_grad
regions, retain_graph, hooks): cases mined from public reports by worker c."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .._common import (
    Case,
    any_nonfinite,
    batch,
    changed,
    linear_regression,
    snapshot,
    trains,
)
from .._m3_c import (
    mse_on,
    tanh_reg,
    teacher_regression,
)

_REG = ("0.weight", "0.bias", "2.weight", "2.bias")


# --- a post-accumulate-grad hook that takes its argument for the gradient
class _GradAverager:
    """Averages the gradients of an accumulation window in a hook on every parameter, once the
    last micro-batch's backward has accumulated (as a data-parallel wrapper would)."""

    def __init__(self, model, accum: int, hook_gets_param: bool):
        self.accum = accum
        self.sync = False
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(
                self._average_param if hook_gets_param else self._average_grads)

    def _average_grads(self, grad):
        if self.sync:
            grad /= self.accum
        return grad

    def _average_param(self, param):
        if self.sync and param.grad is not None:
            param.grad /= self.accum


def _hook_build(hook_gets_param: bool, accum: int = 4):
    def build(seed):
        model = tanh_reg(seed)
        x, y = teacher_regression(seed)
        averager = _GradAverager(model, accum, hook_gets_param)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, opt, {"x": x, "y": y, "avg": averager}
    return build


def _hook_loop(model, opt, ex, steps):
    avg = ex["avg"]
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for m in range(avg.accum):
            x, y = batch(ex["x"], ex["y"], step * avg.accum + m, 16)
            avg.sync = m == avg.accum - 1
            loss = F.mse_loss(model(x), y)
            loss.backward()
            total += loss.item() / avg.accum
        opt.step()
        losses.append(total)
    return {"losses": losses, "full": mse_on(model, ex["x"], ex["y"])}


POST_ACC_HOOK = Case(
    name="post_accumulate_grad_hook_divides_param",
    family="graph",
    source="pytorch/pytorch issue #187268 ('register_post_accumulate_grad_hook naming/"
           "documentation conflicts with register_hook, leading to semantic misinterpretation of "
           "hook argument and silent training bugs'; pull request #187339: the hook 'passes the "
           "leaf tensor itself ... not its gradient'); huggingface/picotron issue #39 "
           "(_allreduce_grads(self, grad) registered as a post-accumulate-grad hook does "
           "'grad /= ...world_size' on what is the parameter)",
    description="I average my accumulated gradients in a post-accumulate-grad hook, dividing its "
                "argument in place; nothing errors, but my weights shrink towards zero and the "
                "loss stays where it started.",
    expected_kinds=("foreign_update",),
    params=_REG,
    manifest=lambda b, f: trains(f, 0.4) and b["full"] >= 2.0 * f["full"],
    build_buggy=_hook_build(False), loop_buggy=_hook_loop,
    build_fixed=_hook_build(True), loop_fixed=_hook_loop,
    steps=60,
)


# --- a stochastic layer sampled with .sample() instead of .rsample()
class _StochasticNet(nn.Module):
    """An encoder proposes a Gaussian over a latent; a head reads one draw of it."""

    def __init__(self, reparam: bool, d_in=8, hidden=32, k=4):
        super().__init__()
        self.reparam = reparam
        self.encoder = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, 2 * k))
        self.head = nn.Linear(k, 1)

    def forward(self, x):
        mu, log_sigma = self.encoder(x).chunk(2, dim=1)
        dist = torch.distributions.Normal(mu, torch.exp(log_sigma - 2.0))
        z = dist.rsample() if self.reparam else dist.sample()
        return self.head(z)


def _sample_build(reparam: bool):
    def build(seed):
        torch.manual_seed(seed)
        model = _StochasticNet(reparam)
        x, y = teacher_regression(seed)
        return model, torch.optim.Adam(model.parameters(), lr=0.02), {"x": x, "y": y}
    return build


def _sample_loop(model, opt, ex, steps):
    torch.manual_seed(1234)
    enc = list(model.encoder.parameters())
    before = snapshot(enc)
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "full": mse_on(model, ex["x"], ex["y"]),
            "enc_changed": changed(before, enc)}


SAMPLE_NOT_RSAMPLE = Case(
    name="distribution_sample_instead_of_rsample",
    family="graph",
    source="jankrepl/deepdow pull request #106 ('Fix rsample bug', closes #101: 'The sample "
           "function makes it impossible to compute the gradients, used rsample instead'); "
           "AntixK/PyTorch-VAE issue #12 ('Why not use rsample() PyTorch?')",
    description="My layer draws its latent from torch.distributions.Normal(mu, sigma).sample(); "
                "the loss decreases a little, but the network that predicts mu and sigma never "
                "changes.",
    expected_kinds=("unused_param",),
    params=("encoder.0.weight", "encoder.0.bias", "encoder.2.weight", "encoder.2.bias"),
    manifest=lambda b, f: (not b["enc_changed"] and f["enc_changed"]
                           and b["full"] >= 1.5 * f["full"] and trains(f, 0.4)),
    build_buggy=_sample_build(False), loop_buggy=_sample_loop,
    build_fixed=_sample_build(True), loop_fixed=_sample_loop,
    steps=80,
)


# --- torch.normal(mean, std) used as the sampling step: its gradient is zero
class _NoisyNet(nn.Module):
    """A noise-injection layer: a body predicts a mean, the output is drawn around it."""

    def __init__(self, reparam: bool, d_in=8, hidden=32):
        super().__init__()
        self.reparam = reparam
        self.body = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden))
        self.out = nn.Linear(hidden, 1)

    def forward(self, x):
        mean = torch.tanh(self.body(x))
        std = torch.full_like(mean, 0.1)
        if self.reparam:
            h = mean + std * torch.randn_like(mean)
        else:
            h = torch.normal(mean, std)
        return self.out(h)


def _normal_build(reparam: bool):
    def build(seed):
        torch.manual_seed(seed)
        model = _NoisyNet(reparam)
        x, y = teacher_regression(seed)
        return model, torch.optim.Adam(model.parameters(), lr=0.02), {"x": x, "y": y}
    return build


def _normal_loop(model, opt, ex, steps):
    torch.manual_seed(4321)
    losses, body_grad = [], []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        body_grad.append(sum(p.grad.abs().sum().item() for p in model.body.parameters()))
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "full": mse_on(model, ex["x"], ex["y"]),
            "body_grad": max(body_grad)}


TORCH_NORMAL = Case(
    name="torch_normal_sampling_zero_grad",
    family="graph",
    source="pytorch/pytorch issue #4620 ('torch.normal accepts Variables but does not "
           "propagate gradients'); pytorch/pytorch pull request #4137 (derivatives.yaml: "
           "normal(Tensor mean, Tensor std) gives mean and std zero gradients)",
    description="I inject noise with torch.normal(mean, std) where mean comes from my network; "
                "training runs, but only the last layer learns and the loss plateaus high.",
    expected_kinds=("dead_grad",),
    params=("body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"),
    manifest=lambda b, f: (b["body_grad"] == 0.0 and f["body_grad"] > 0.0
                           and b["full"] >= 1.5 * f["full"] and trains(f, 0.4)),
    build_buggy=_normal_build(False), loop_buggy=_normal_loop,
    build_fixed=_normal_build(True), loop_fixed=_normal_loop,
    steps=80,
)


# --- a quantised activation re-wrapped from y.clone().detach()
class _QuantAct(nn.Module):
    """Fake-quantises an activation to a fixed grid and wraps it for the next layer."""

    def __init__(self, keep_graph: bool, scale: float = 0.5):
        super().__init__()
        self.keep_graph = keep_graph
        self.scale = scale

    def forward(self, y):
        q = torch.round(y / self.scale) * self.scale
        if self.keep_graph:
            return y + (q - y).detach()          # straight-through: forward q, gradient of y
        return q.clone().detach().requires_grad_(False)


def _quant_make(keep_graph: bool):
    def make(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), _QuantAct(keep_graph),
                             nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    return make


def _quant_build(keep_graph: bool):
    def build(seed):
        model = _quant_make(keep_graph)(seed)
        x, y = teacher_regression(seed)
        return model, torch.optim.Adam(model.parameters(), lr=0.02), {"x": x, "y": y}
    return build


def _quant_loop(model, opt, ex, steps):
    first = list(model[0].parameters())
    before = snapshot(first)
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "full": mse_on(model, ex["x"], ex["y"]),
            "first_changed": changed(before, first)}


QUANT_REWRAP = Case(
    name="quantized_activation_rewrapped_detached",
    family="graph",
    source="Xilinx/brevitas issue #631 ('How can I make gradient flow through QuantTensor': "
           "the quantised activation re-wrapped from y.clone().detach(); 'the layers before "
           "y_q5 cannot be learned' ... 'I think .clone().detach() is the problem')",
    description="I re-wrap my quantised activation from y.clone().detach() so the next block "
                "gets a plain tensor; the network still trains a bit, but the layers before the "
                "quantiser never change.",
    expected_kinds=("unused_param",),
    params=("0.weight", "0.bias"),
    manifest=lambda b, f: (not b["first_changed"] and f["first_changed"]
                           and b["full"] >= 1.3 * f["full"] and trains(f, 0.4)),
    build_buggy=_quant_build(False), loop_buggy=_quant_loop,
    build_fixed=_quant_build(True), loop_fixed=_quant_loop,
    steps=80,
)


# --- gradient clipping written out of place: param.grad.data.clamp(-1, 1)
def _clip_build(seed):
    torch.manual_seed(seed)
    model = nn.Linear(8, 1)
    x, y = linear_regression(seed)
    x, y = 10 * x, 10 * y   # raw sensor units, not standardised
    return model, torch.optim.SGD(model.parameters(), lr=0.02), {"x": x, "y": y}


def _clip_loop(in_place: bool):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            for param in model.parameters():
                if in_place:
                    param.grad.data.clamp_(-1, 1)
                else:
                    param.grad.data.clamp(-1, 1)
            opt.step()
            losses.append(loss.item())
        return {"losses": losses, "full": mse_on(model, ex["x"], ex["y"])}
    return loop


CLAMP_NOT_INPLACE = Case(
    name="grad_clamp_out_of_place_no_effect",
    family="graph",
    source="pytorch/tutorials pull request #30 ('Fixed clamp not being applied to parameters': "
           "'the line param.grad.data.clamp(-1, 1) has no effect. I guess you wanted to do it "
           "in-place, which is clamp_'; 'Yeah, my bad')",
    description="My features are in raw units, so I clip every gradient element to [-1, 1] "
                "before the step; the loss still blows up to inf within a few dozen steps.",
    expected_kinds=("explode", "nonfinite"),
    params=(),
    manifest=lambda b, f: ((any_nonfinite(b["losses"]) or b["full"] >= 100 * f["full"])
                           and trains(f, 0.5)),
    build_buggy=_clip_build, loop_buggy=_clip_loop(False),
    build_fixed=_clip_build, loop_fixed=_clip_loop(True),
    steps=60,
)


CASES = [POST_ACC_HOOK, SAMPLE_NOT_RSAMPLE, TORCH_NORMAL, QUANT_REWRAP, CLAMP_NOT_INPLACE]
