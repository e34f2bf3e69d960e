"""The second corpus, dev half, mechanism 'graph' (the autograd graph: detach, in-place ops, no_grad
regions, custom Functions, hooks): cases mined from public reports."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .._common import (
    Case,
    any_nonfinite,
    batch,
    classification,
    regression,
    trains,
)


def _reg_mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


# --- gradient penalty computed with autograd.grad without create_graph
def _gp_build(seed):
    model = _reg_mlp(seed)
    x, y = regression(seed)
    return model, torch.optim.Adam(model.parameters(), lr=0.01), {"x": x, "y": y}


def _input_grad_norm(model, x):
    x = x.clone().requires_grad_(True)
    g, = torch.autograd.grad(model(x).sum(), x)
    return g.pow(2).sum(1).mean().item()


def _gp_loop(create_graph: bool, lam: float = 1.0):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            x = x.clone().requires_grad_(True)
            opt.zero_grad()
            out = model(x)
            fit = F.mse_loss(out, y)
            g, = torch.autograd.grad(out.sum(), x, retain_graph=True, create_graph=create_graph)
            penalty = g.pow(2).sum(1).mean()
            loss = fit + lam * penalty
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses, "jac": _input_grad_norm(model, ex["x"])}
    return loop


GP_NO_CREATE_GRAPH = Case(
    name="input_grad_penalty_without_create_graph",
    family="graph",
    source="facebookresearch/DomainBed issue #50 ('a \"create_graph\" is missing when calling "
           "autograd.grad ... with the current implementation the penalty_value is useless in "
           "the training'; 'the lack of impact of the hyper-parameter'); "
           "igul222/improved_wgan_training issue #18 (the gradients w.r.t. the inputs not "
           "connected to the net's graph, so the penalty 'won't backward error to net')",
    description="I add a penalty on the gradient of the output w.r.t. the inputs, computed with "
                "torch.autograd.grad; its weight changes nothing and the model stays as steep "
                "as without it.",
    expected_kinds=("loss_pattern",),
    params=(),
    manifest=lambda b, f: b["jac"] >= 2.0 * f["jac"] and trains(f, 0.2),
    build_buggy=_gp_build, loop_buggy=_gp_loop(False),
    build_fixed=_gp_build, loop_fixed=_gp_loop(True),
    steps=60,
)


# --- torch.where with a NaN-gradient unselected branch
def _where_build(seed):
    model = _reg_mlp(seed)
    x, y = regression(seed)
    return model, torch.optim.SGD(model.parameters(), lr=0.05), {"x": x, "y": y}


def _signed_sqrt_where(t):
    return torch.where(t >= 0, torch.sqrt(t), -torch.sqrt(-t))


def _signed_sqrt_safe(t):
    return torch.sign(t) * torch.sqrt(t.abs() + 1e-6)


def _where_loop(transform):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            # compare in a compressed (signed square root) space, robust to large errors
            loss = F.mse_loss(transform(model(x)), transform(y))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses}
    return loop


WHERE_NAN = Case(
    name="where_unselected_branch_nan_grad",
    family="graph",
    source="pytorch/pytorch issue #36923 ('backprop through torch.where backprops nans through "
           "path that was not taken'), #52248, #23395; Ciela-Institute/caustics pull request #83 "
           "('torch.where does not protect from nans in the off branch')",
    description="I compare predictions in a signed-square-root space written with torch.where "
                "so that sqrt never sees a negative number; the forward is finite but after the "
                "first step every weight is NaN.",
    expected_kinds=("nonfinite",),
    params=(),
    manifest=lambda b, f: any_nonfinite(b["losses"]) and trains(f, 0.2),
    build_buggy=_where_build, loop_buggy=_where_loop(_signed_sqrt_where),
    build_fixed=_where_build, loop_fixed=_where_loop(_signed_sqrt_safe),
    steps=40,
)


# --- critic not detached in the policy-gradient loss
class _AC(nn.Module):
    def __init__(self):
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
        self.critic = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))


def _ac_build(seed):
    torch.manual_seed(seed)
    model = _AC()
    x, y = classification(seed)
    g = torch.Generator().manual_seed(seed + 14)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), {"x": x, "y": y, "g": g}


def _ac_loop(detach: bool):
    def loop(model, opt, ex, steps):
        g, losses = ex["g"], []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i, size=64)
            logits = model.actor(x)
            probs = F.softmax(logits, 1)
            a = torch.multinomial(probs.detach(), 1, generator=g).squeeze(1)
            r = (a == y).float()
            v = model.critic(x).squeeze(1)
            adv = r - (v.detach() if detach else v)
            logp = F.log_softmax(logits, 1).gather(1, a[:, None]).squeeze(1)
            policy_loss = -(adv * logp).mean()
            value_loss = F.mse_loss(v, r)
            opt.zero_grad()
            (policy_loss + value_loss).backward()
            opt.step()
            losses.append(value_loss.item())
        with torch.no_grad():
            p = F.softmax(model.actor(ex["x"]), 1)
            exp_r = p.gather(1, ex["y"][:, None]).squeeze(1)
            v = model.critic(ex["x"]).squeeze(1)
            verr = (v - exp_r).pow(2).mean().item()
        return {"losses": losses, "value_error": verr, "mean_v": v.mean().item(),
                "mean_r": exp_r.mean().item()}
    return loop


AC_CRITIC = Case(
    name="critic_not_detached_in_policy_loss",
    family="graph",
    source="astariul/encode-attend-navigate-pytorch issue #2 / pull request #3 ('Critic not "
           "detached from policy loss': 'the critic network was backpropagated from both the "
           "policy loss and critic loss, leading to unstable training'); coreylynch/async-rl "
           "issue #8; keras-team/keras-io issue #194 (diff = ret - value without stop_gradient)",
    description="Actor-critic on a bandit: the critic's estimates drift far from the rewards; "
                "the advantage r - V(s) in the policy loss is not detached, so the policy loss "
                "trains the critic too.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: b["value_error"] >= 3.0 * f["value_error"],
    build_buggy=_ac_build, loop_buggy=_ac_loop(False),
    build_fixed=_ac_build, loop_fixed=_ac_loop(True),
    steps=60,
)


CASES = [GP_NO_CREATE_GRAPH, WHERE_NAN, AC_CRITIC]
