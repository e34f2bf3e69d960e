"""The second corpus, held-out half, mechanism 'graph': do not read while writing detection code."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .._common import (
    Case,
    batch,
    changed,
    classification,
    linear_regression,
    mlp,
    snapshot,
    tail,
    trains,
)


# --- generator step on a detached fake
def _gen_build(seed):
    torch.manual_seed(seed)
    gen = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
    disc = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=0.05, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=0.02, betas=(0.5, 0.999))
    g = torch.Generator().manual_seed(seed + 11)
    return gen, opt_g, {"disc": disc, "opt_d": opt_d, "g": g}


def _gen_loop(detach_in_g_step: bool):
    def loop(gen, opt_g, ex, steps):
        disc, opt_d, g = ex["disc"], ex["opt_d"], ex["g"]
        bce = F.binary_cross_entropy_with_logits
        losses, before = [], snapshot(gen.parameters())
        with torch.no_grad():
            start = abs(gen(torch.randn(256, 2, generator=g)).mean().item() - 3.0)
        for _ in range(steps):
            real = 3 + 0.5 * torch.randn(32, 1, generator=g)
            z = torch.randn(32, 2, generator=g)
            fake = gen(z)
            opt_d.zero_grad()
            d_loss = bce(disc(real), torch.ones(32, 1)) + bce(disc(fake.detach()), torch.zeros(32, 1))
            d_loss.backward()
            opt_d.step()
            opt_g.zero_grad()
            inp = fake.detach() if detach_in_g_step else fake
            g_loss = bce(disc(inp), torch.ones(32, 1))
            g_loss.backward()
            opt_g.step()
            losses.append(g_loss.item())
        with torch.no_grad():
            mean = gen(torch.randn(256, 2, generator=g)).mean().item()
        return {"losses": losses, "gap": abs(mean - 3.0), "start": start,
                "changed": changed(before, gen.parameters())}
    return loop


GEN_DETACHED = Case(
    name="generator_loss_on_detached_fake",
    family="graph",
    source="nikhilsinghmus/image2reverb issue #37 ('fake_spec.detach()' in the generator step "
           "'would cut the gradient path ... meaning G_loss1 would not propagate gradients into "
           "the Generator'; confirmed as a bug); wangle53/CSA-CDGAN issue #5 ('you detach the "
           "pred_fake, so the loss cannot update anything'); samet-akcay/skip-ganomaly issue #5",
    description="My generator never gets better while the discriminator wins easily; in the "
                "generator step I pass fake.detach() to the discriminator, as in the "
                "discriminator step.",
    expected_kinds=("unused_param", "empty_step"),
    params=(),
    manifest=lambda b, f: (not b["changed"]) and f["changed"] and f["gap"] <= 0.7 * f["start"],
    build_buggy=_gen_build, loop_buggy=_gen_loop(True),
    build_fixed=_gen_build, loop_fixed=_gen_loop(False),
    steps=60,
)


# --- TD target not detached (residual gradient through the bootstrap target)
_NS = 16


def _mdp(seed):
    gen = torch.Generator().manual_seed(seed + 4000)
    p = torch.rand(_NS, _NS, generator=gen) ** 4
    p = p / p.sum(1, keepdim=True)
    r = torch.randn(_NS, generator=gen)
    return p, r


def _td_build(seed):
    torch.manual_seed(seed)
    model = nn.Linear(_NS, 1)
    p, r = _mdp(seed)
    gamma = 0.8
    v_true = torch.linalg.solve(torch.eye(_NS) - gamma * p, r)
    g = torch.Generator().manual_seed(seed + 12)
    return model, torch.optim.SGD(model.parameters(), lr=0.5), {
        "p": p, "r": r, "gamma": gamma, "v_true": v_true, "g": g}


def _td_loop(detach: bool):
    def loop(model, opt, ex, steps):
        p, r, gamma, g = ex["p"], ex["r"], ex["gamma"], ex["g"]
        eye = torch.eye(_NS)
        losses = []
        for _ in range(steps):
            s = torch.randint(0, _NS, (256,), generator=g)
            s2 = torch.multinomial(p[s], 1, generator=g).squeeze(1)
            v = model(eye[s]).squeeze(1)
            v_next = model(eye[s2]).squeeze(1)
            if detach:
                v_next = v_next.detach()
            target = r[s] + gamma * v_next
            loss = F.mse_loss(v, target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            err = (model(eye).squeeze(1) - ex["v_true"]).pow(2).mean().item()
        return {"losses": losses, "value_error": err}
    return loop


TD_TARGET = Case(
    name="td_target_not_detached",
    family="graph",
    source="datawhalechina/easy-rl pull request #117 ('TD target does not have detach(), which "
           "is equivalent to not using semi-gradient method'; the same network computes both); "
           "philtabor/Deep-Q-Learning-Paper-To-Code issues #9, #16 (q_target needs detach / "
           "no_grad); PacktPublishing/Deep-Reinforcement-Learning-Hands-On issue #29 (does not "
           "converge until a .detach() is added)",
    description="My value network's TD loss goes down but its values are far from the returns; "
                "the bootstrap target r + gamma * V(s') is computed by the same network without "
                "detach().",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: b["value_error"] >= 3.0 * f["value_error"] and f["value_error"] < 0.5,
    build_buggy=_td_build, loop_buggy=_td_loop(False),
    build_fixed=_td_build, loop_fixed=_td_loop(True),
    steps=60,
)


# --- gradient reversal written as an nn.Module whose backward() is never called
class _GRLModule(nn.Module):
    def forward(self, x):
        return x

    def backward(self, grad):  # never called by autograd
        return -grad


class _GRLFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad


class _GRLFunction(nn.Module):
    def forward(self, x):
        return _GRLFn.apply(x)


class _DANN(nn.Module):
    def __init__(self, grl: nn.Module):
        super().__init__()
        self.feat = nn.Sequential(nn.Linear(10, 32), nn.ReLU())
        self.cls = nn.Linear(32, 4)
        self.grl = grl
        self.dom = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x):
        h = self.feat(x)
        return self.cls(h), self.dom(self.grl(h))


def _dann_build(grl_cls):
    def build(seed):
        torch.manual_seed(seed)
        model = _DANN(grl_cls())
        x, y = classification(seed)
        gen = torch.Generator().manual_seed(seed + 13)
        shift = torch.zeros(10)
        shift[:3] = 1.5
        xt = classification(seed + 1)[0] + shift  # unlabeled target domain
        xt = xt + 0.1 * torch.randn(xt.shape, generator=gen)
        return model, torch.optim.SGD(model.parameters(), lr=0.1), {"x": x, "y": y, "xt": xt}
    return build


def _dann_loop(model, opt, ex, steps):
    losses, dom_losses = [], []
    bce = F.binary_cross_entropy_with_logits
    for i in range(steps):
        xs, ys = batch(ex["x"], ex["y"], i)
        xt, _ = batch(ex["xt"], ex["y"], i)
        opt.zero_grad()
        logits, ds = model(xs)
        _, dt = model(xt)
        cls_loss = F.cross_entropy(logits, ys)
        dom_loss = bce(ds, torch.zeros_like(ds)) + bce(dt, torch.ones_like(dt))
        loss = cls_loss + dom_loss
        loss.backward()
        opt.step()
        losses.append(cls_loss.item())
        dom_losses.append(dom_loss.item())
    return {"losses": losses, "dom": tail(dom_losses, 10)}


GRL_MODULE = Case(
    name="gradient_reversal_module_backward_ignored",
    family="graph",
    source="hash2430/pitchtron issue #3 ('Does gradient reversal layer work?': the GRL written "
           "as an nn.Module with a backward() method; 'the backward function of "
           "GradientReversalLayer does not called in backward process', the gradient was not "
           "reversed); fungtion/DANN issue #3 (the autograd.Function version)",
    description="Domain-adversarial training: my features should become domain-invariant but "
                "the domain classifier's loss drops to almost zero; my gradient reversal layer "
                "is an nn.Module with its own backward().",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: b["dom"] <= 0.5 * f["dom"] and trains(f, 0.2),
    build_buggy=_dann_build(_GRLModule), loop_buggy=_dann_loop,
    build_fixed=_dann_build(_GRLFunction), loop_fixed=_dann_loop,
    steps=60,
)


# --- hand-written normalisation whose statistics are computed under no_grad
class _NormNet(nn.Module):
    def __init__(self, stats_no_grad: bool):
        super().__init__()
        self.fc1 = nn.Linear(10, 32)
        self.fc2 = nn.Linear(32, 4)
        self.stats_no_grad = stats_no_grad

    def forward(self, x):
        h = self.fc1(x)
        if self.stats_no_grad:
            with torch.no_grad():
                mu, var = h.mean(0), h.var(0, unbiased=False)
        else:
            mu, var = h.mean(0), h.var(0, unbiased=False)
        h = (h - mu) / torch.sqrt(var + 1e-5)
        return self.fc2(F.relu(h))


def _norm_build(stats_no_grad):
    def build(seed):
        torch.manual_seed(seed)
        model = _NormNet(stats_no_grad)
        x, y = classification(seed)
        return model, torch.optim.SGD(model.parameters(), lr=0.5), {
            "x": x, "y": y, "b0": model.fc1.bias.detach().clone(),
            "w0": model.fc1.weight.detach().norm().item()}
    return build


def _norm_loop(model, opt, ex, steps):
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    drift = (model.fc1.bias.detach() - ex["b0"]).norm().item()
    wgrow = model.fc1.weight.detach().norm().item() / ex["w0"]
    return {"losses": losses, "bias_drift": drift, "w_growth": wgrow}


NORM_NO_GRAD = Case(
    name="normalization_stats_under_no_grad",
    family="graph",
    source="anthonymlortiz/lcn issue #2 ('why use with torch.no_grad()? With this implementation, "
           "no back propagation occurs in the mean and variance'); abhiskk/ladder issue #2 (the "
           "variance 'is calculated after getting detached from the backprop which breaks the "
           "backprop')",
    description="My own batch normalisation computes the batch mean and variance under "
                "torch.no_grad(); the layer before it drifts (its bias keeps moving although it "
                "cannot change the output).",
    expected_kinds=(),
    params=("fc1.weight", "fc1.bias"),
    manifest=lambda b, f: b["bias_drift"] >= 10 * max(f["bias_drift"], 1e-4) and trains(f, 0.2),
    build_buggy=_norm_build(True), loop_buggy=_norm_loop,
    build_fixed=_norm_build(False), loop_fixed=_norm_loop,
    steps=60,
)


# --- ReLU(inplace=True) at the start of a residual branch overwrites the skip input
class _ResBlock(nn.Module):
    def __init__(self, inplace: bool):
        super().__init__()
        self.branch = nn.Sequential(nn.ReLU(inplace=inplace), nn.Linear(8, 32), nn.ReLU(),
                                    nn.Linear(32, 8))

    def forward(self, x):
        out = self.branch(x)
        out = out + x  # the skip is meant to carry the pre-activation input
        return out


class _ResNet(nn.Module):
    def __init__(self, inplace: bool):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.block = _ResBlock(inplace)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.block(self.inp(x)))


def _res_build(inplace):
    def build(seed):
        torch.manual_seed(seed)
        model = _ResNet(inplace)
        x, y = linear_regression(seed)
        return model, torch.optim.SGD(model.parameters(), lr=0.05), {"x": x, "y": y}
    return build


def _res_loop(model, opt, ex, steps):
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses}


INPLACE_RES = Case(
    name="inplace_relu_overwrites_residual_input",
    family="graph",
    source="rosinality/vq-vae-2-pytorch issue #60 (ResBlock starting with nn.ReLU(inplace=True): "
           "'the variable input is being modified in-place', so the skip adds the "
           "post-activation; 'Definitely it is a bug'); pytorch/pytorch issue #5687 (a model "
           "that cannot be trained with ReLU(inplace=True) in a residual block, no error)",
    description="My residual network fits worse than a plain linear model; the residual branch "
                "starts with nn.ReLU(inplace=True), which silently rewrites the tensor the skip "
                "connection adds back.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: tail(b["losses"]) >= 2.0 * tail(f["losses"]) and trains(f, 0.5),
    build_buggy=_res_build(True), loop_buggy=_res_loop,
    build_fixed=_res_build(False), loop_fixed=_res_loop,
    steps=60,
)


# --- a custom autograd.Function whose backward ignores grad_output
class _ScoreNoChain(torch.autograd.Function):
    """Per-sample log-sum-exp score; backward returns d score / d x, forgetting grad_output."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.logsumexp(x, 1)

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        return F.softmax(x, 1)


class _Score(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.logsumexp(x, 1)

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        return grad[:, None] * F.softmax(x, 1)


def _score_loop(fn):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            logits = model(x)
            # cross-entropy written as log Z - score of the label, with a custom log Z
            loss = (fn.apply(logits) - logits.gather(1, y[:, None]).squeeze(1)).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses}
    return loop


def _score_build(seed):
    model = mlp(seed)
    x, y = classification(seed)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), {"x": x, "y": y}


SCORE_NO_CHAIN = Case(
    name="custom_function_backward_ignores_grad_output",
    family="graph",
    source="k2-fsa/k2 issue #341 ('the backward of get_tot_scores needs to multiply by the "
           "gradient at the output. In our training, this is causing us to get the sign of the "
           "update wrong'); zergtant/pytorch-handbook issue #69 (a custom Function's backward "
           "that does not multiply grad_output by the constant)",
    description="I wrote log Z as a custom autograd.Function for speed; my loss (log Z minus "
                "the label's score) climbs instead of falling. The backward returns softmax(x) "
                "without multiplying by the incoming gradient.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: tail(b["losses"]) >= 2.0 * tail(f["losses"]) and trains(f, 0.3),
    build_buggy=_score_build, loop_buggy=_score_loop(_ScoreNoChain),
    build_fixed=_score_build, loop_fixed=_score_loop(_Score),
    steps=60,
)


CASES = [GEN_DETACHED, TD_TARGET, GRL_MODULE, NORM_NO_GRAD, INPLACE_RES, SCORE_NO_CHAIN]
