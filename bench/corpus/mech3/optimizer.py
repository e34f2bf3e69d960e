"""The third corpus, mechanism 'optimizer' (bench/corpus/mechanisms.py: the optimizer and its
state: param groups, state dicts, moments, weight decay, lr), mined by worker b."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .._common import (
    Case,
    batch,
    classification,
    regression,
    snapshot,
    changed,
    trains,
)
from .._m3_b import (
    HEAD,
    accuracy_of,
    backbone,
    ce_steps,
    full_ce,
    full_mse,
)

def _tanh_reg(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


# ---- lbfgs_closure_without_zero_grad


def _lbfgs_build(seed):
    model = _tanh_reg(seed)
    x, y = regression(seed)
    opt = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=20)
    return model, opt, {"x": x, "y": y}


def _lbfgs_loop(zero_in_closure):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i, 128)
            if not zero_in_closure:
                opt.zero_grad()  # once per training step, outside the closure
            def closure():
                if zero_in_closure:
                    opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                return loss
            loss = opt.step(closure)
            losses.append(loss.item())
        return {"losses": losses, "full": full_mse(model, ex["x"], ex["y"])}
    return loop


LBFGS_CLOSURE_WITHOUT_ZERO_GRAD = Case(
    name="lbfgs_closure_without_zero_grad",
    family="optimizer",
    source="Lightning-AI/pytorch-lightning issue #4083 ('using LBFGS optimizer in pytorch "
           "lightening the model is not converging as compared to native pytoch + LBFGS') and "
           "pull request #6147 ('Lightning calls closure 20 times and zero_grad only 1 time': "
           "the closure should clear the gradients, compute the loss, and return it)",
    description="I switched to LBFGS and call zero_grad() once per step, before "
                "optimizer.step(closure); the same model trains fine with LBFGS in plain "
                "PyTorch but does not converge in my loop.",
    expected_kinds=("nonfinite",),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and (not math.isfinite(b["full"])
                                               or b["full"] >= 1.5 * f["full"]),
    build_buggy=_lbfgs_build,
    loop_buggy=_lbfgs_loop(False),
    build_fixed=_lbfgs_build,
    loop_fixed=_lbfgs_loop(True),
    steps=8,
)


# ---- plateau_scheduler_min_mode_on_accuracy


def _plateau_build(mode):
    def build(seed):
        model = backbone(seed)
        x, y = classification(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        kw = {} if mode is None else {"mode": mode}
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.1, patience=2, **kw)
        return model, opt, {"x": x[:192], "y": y[:192], "xva": x[192:], "yva": y[192:],
                            "sched": sched}
    return build


def _plateau_loop(model, opt, ex, steps, per_epoch=4):
    losses, lrs = [], []
    for epoch in range(steps // per_epoch):
        losses += ce_steps(model, opt, ex["x"], ex["y"], per_epoch, start=epoch * per_epoch)
        val_acc = accuracy_of(model, ex["xva"], ex["yva"])
        ex["sched"].step(val_acc)
        lrs.append(opt.param_groups[0]["lr"])
    return {"losses": losses, "lrs": lrs, "full": full_ce(model, ex["xva"], ex["yva"])}


PLATEAU_SCHEDULER_MIN_MODE_ON_ACCURACY = Case(
    name="plateau_scheduler_min_mode_on_accuracy",
    family="optimizer",
    source="md-mohaiminul/ViS4mer issue #4 ('ReduceLROnPlateau by default assumes a \"min\" "
           "metric ... In LVU tasks it used for accuracy metric, but the mode is not "
           "changed'; 'I guess it was not intended')",
    description="I reduce the learning rate on plateau of the validation accuracy; the lr "
                "keeps halving while the accuracy is still going up and training stalls.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (trains(f, 0.3) and b["lrs"][-1] <= f["lrs"][-1] / 8
                           and b["full"] >= 1.3 * f["full"]),
    build_buggy=_plateau_build(None),
    loop_buggy=_plateau_loop,
    build_fixed=_plateau_build("max"),
    loop_fixed=_plateau_loop,
    steps=64,
)


# ---- optimizer_state_loaded_into_reordered_heads


class MultiHead(nn.Module):
    """A trunk and one regression head per name; the heads are registered in the order
    ``heads`` gives them (as a loop over a dict of heads does)."""

    def __init__(self, heads):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
        self.heads = list(heads)
        for name in self.heads:
            self.__setattr__(name, nn.Linear(32, 1))

    def forward(self, x):
        h = self.trunk(x)
        return {name: getattr(self, name)(h) for name in self.heads}


def _mean(v):
    return sum(v) / len(v)


def _heads_data(seed):
    x, y = regression(seed)
    gen = torch.Generator().manual_seed(seed + 31)
    w = torch.randn(8, 1, generator=gen) / math.sqrt(8)
    return x, {"depth": 5.0 * y, "offset": 0.05 * torch.tanh(x @ w)}


def _heads_loss(out, t):
    per = {k: F.mse_loss(out[k], t[k]) for k in out}
    return sum(per.values()), per


def _heads_build(resume_order):
    def build(seed):
        x, t = _heads_data(seed)
        # the first run: train, then save the model and the optimizer
        torch.manual_seed(seed)
        first = MultiHead(["depth", "offset"])
        opt = torch.optim.SGD(first.parameters(), lr=0.01, momentum=0.9)
        for i in range(60):
            idx = torch.arange(i * 32, i * 32 + 32) % x.shape[0]
            opt.zero_grad()
            _heads_loss(first(x[idx]), {k: v[idx] for k, v in t.items()})[0].backward()
            opt.step()
        ckpt = {"model": first.state_dict(), "optimizer": opt.state_dict()}
        # the resumed run: the heads come out of the config in another order
        torch.manual_seed(seed + 1)
        model = MultiHead(resume_order)
        model.load_state_dict(ckpt["model"])
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        opt.load_state_dict(ckpt["optimizer"])
        return model, opt, {"x": x, "t": t}
    return build


def _heads_loop(model, opt, ex, steps):
    x, t = ex["x"], ex["t"]
    losses, offset = [], []
    for i in range(steps):
        idx = torch.arange(i * 32, i * 32 + 32) % x.shape[0]
        opt.zero_grad()
        loss, per = _heads_loss(model(x[idx]), {k: v[idx] for k, v in t.items()})
        loss.backward()
        opt.step()
        losses.append(loss.item())
        offset.append(per["offset"].item())
    return {"losses": losses, "offset": offset}


OPTIMIZER_STATE_LOADED_INTO_REORDERED_HEADS = Case(
    name="optimizer_state_loaded_into_reordered_heads",
    family="optimizer",
    source="pytorch/pytorch issue #1489 ('Optimizer should track parameter names and not id': "
           "if the order of the parameters changes, 'the loaded optimizer's state for p1 will "
           "be mapped to p2 and vice-versa'); PingoLH/CenterNet-HarDNet issue #10 ('iterates "
           "self.heads which is a dict ... different parameter order would confusing the "
           "tensor id mapping')",
    description="When I resume from a checkpoint my heads are built in a different order "
                "than in the first run; the model loads fine by name, but right after the "
                "optimizer state is loaded the offset head's loss jumps.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: _mean(b["offset"][1:16]) >= 4 * _mean(f["offset"][1:16]),
    build_buggy=_heads_build(["offset", "depth"]),
    loop_buggy=_heads_loop,
    build_fixed=_heads_build(["depth", "offset"]),
    loop_fixed=_heads_loop,
    steps=30,
)


# ---- lambdalr_lambda_returns_lr_not_factor


def _lambda_build(bug):
    def build(seed):
        model = backbone(seed)
        x, y = classification(seed)
        lr, gamma, decay = 0.05, 0.001, 0.75
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        if bug:
            sched = torch.optim.lr_scheduler.LambdaLR(
                opt, lambda it: lr * (1.0 + gamma * float(it)) ** (-decay))
        else:
            sched = torch.optim.lr_scheduler.LambdaLR(
                opt, lambda it: (1.0 + gamma * float(it)) ** (-decay))
        return model, opt, {"x": x, "y": y, "sched": sched}
    return build


def _sched_loop(model, opt, ex, steps):
    losses = []
    for i in range(steps):
        xb, yb = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        ex["sched"].step()
        losses.append(loss.item())
    return {"losses": losses, "full": full_ce(model, ex["x"], ex["y"])}


LAMBDALR_LAMBDA_RETURNS_LR_NOT_FACTOR = Case(
    name="lambdalr_lambda_returns_lr_not_factor",
    family="optimizer",
    source="lhoyer/MIC issue #60 ('The lambda in LambdaLR is supposed to return the factor to "
           "multiply with the base learning rate, so it should not include a multiplication "
           "by args.lr ... it produces 0.0001 instead of 0.01'; the same bug in SDAT's "
           "cdan_mcc_sdat.py)",
    description="I decay the lr with LambdaLR(optimizer, lambda x: args.lr * (1 + gamma * x) "
                "** -decay); the loss goes down far more slowly than with the paper's lr.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and b["full"] >= 1.5 * f["full"],
    build_buggy=_lambda_build(True),
    loop_buggy=_sched_loop,
    build_fixed=_lambda_build(False),
    loop_fixed=_sched_loop,
    steps=60,
)


# ---- radam_step_size_cached_across_groups


def _radam_class(cache_lr: bool):
    """RAdam as its reference implementation was written: a 10-slot buffer caches the
    rectification term per step count. ``cache_lr``: the cached step size includes the lr of
    the group that filled the slot (the reported bug)."""

    class RAdam(torch.optim.Optimizer):
        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
            super().__init__(params, dict(lr=lr, betas=betas, eps=eps))
            self.buffer = [[None, None, None] for _ in range(10)]

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                beta1, beta2 = group["betas"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if len(state) == 0:
                        state["step"] = 0
                        state["exp_avg"] = torch.zeros_like(p)
                        state["exp_avg_sq"] = torch.zeros_like(p)
                    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                    exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                    exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                    state["step"] += 1
                    buffered = self.buffer[int(state["step"] % 10)]
                    if state["step"] == buffered[0]:
                        n_sma, step_size = buffered[1], buffered[2]
                    else:
                        buffered[0] = state["step"]
                        beta2_t = beta2 ** state["step"]
                        n_sma_max = 2 / (1 - beta2) - 1
                        n_sma = n_sma_max - 2 * state["step"] * beta2_t / (1 - beta2_t)
                        buffered[1] = n_sma
                        if n_sma >= 5:
                            step_size = math.sqrt(
                                (1 - beta2_t) * (n_sma - 4) / (n_sma_max - 4) * (n_sma - 2)
                                / n_sma * n_sma_max / (n_sma_max - 2)) / (1 - beta1 ** state["step"])
                        else:
                            step_size = 1.0 / (1 - beta1 ** state["step"])
                        if cache_lr:
                            step_size = group["lr"] * step_size
                        buffered[2] = step_size
                    scale = step_size if cache_lr else group["lr"] * step_size
                    if n_sma >= 5:
                        denom = exp_avg_sq.sqrt().add_(group["eps"])
                        p.addcdiv_(exp_avg, denom, value=-scale)
                    else:
                        p.add_(exp_avg, alpha=-scale)
            return None

    return RAdam


def _radam_build(cache_lr):
    def build(seed):
        model = backbone(seed)
        x, y = classification(seed)
        opt = _radam_class(cache_lr)([
            {"params": model.encoder.parameters(), "lr": 3e-3},  # pretrained: fine-tune gently
            {"params": model.head.parameters(), "lr": 1e-1},     # new head: a larger lr
        ])
        return model, opt, {"x": x, "y": y}
    return build


def _radam_loop(model, opt, ex, steps):
    head0 = snapshot(model.head.parameters())
    losses = ce_steps(model, opt, ex["x"], ex["y"], steps)
    move = sum((p.detach() - b).norm().item() for b, p in zip(head0, model.head.parameters()))
    return {"losses": losses, "head_move": move, "full": full_ce(model, ex["x"], ex["y"])}


RADAM_STEP_SIZE_CACHED_ACROSS_GROUPS = Case(
    name="radam_step_size_cached_across_groups",
    family="optimizer",
    source="LiyuanLucasLiu/RAdam issue #24 ('Does RAdam break training with different learning "
           "rates for different param_groups?': the buffer caches step_size by state['step'], "
           "so 'the training looks like it always uses the learning rate of the first "
           "parameter group'); lessw2020/Ranger-Deep-Learning-Optimizer pull request #9 (the "
           "same fix in Ranger)",
    description="I give my new head a 30x larger lr than the pretrained encoder in a second "
                "param group of RAdam, but the head learns as slowly as the encoder.",
    expected_kinds=("update_rule",),
    params=HEAD,
    manifest=lambda b, f: (trains(f, 0.3) and b["head_move"] * 5 <= f["head_move"]
                           and b["full"] >= 1.3 * f["full"]),
    build_buggy=_radam_build(True),
    loop_buggy=_radam_loop,
    build_fixed=_radam_build(False),
    loop_fixed=_radam_loop,
    steps=60,
)


# ---- cosine_scheduler_recreated_for_warm_restart


def _cosine_build(seed):
    model = backbone(seed)
    x, y = classification(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, {"x": x, "y": y}


def _cosine_loop(bug, cycle=20):
    def loop(model, opt, ex, steps):
        if bug:
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cycle, last_epoch=-1)
        else:
            sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=cycle)
        losses, lrs, after_first = [], [], None
        for i in range(steps):
            if i > 0 and i % cycle == 0:
                if after_first is None:
                    after_first = snapshot(model.parameters())
                if bug:  # warm restart: a fresh cosine schedule for the next cycle
                    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cycle, last_epoch=-1)
            xb, yb = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
            lrs.append(opt.param_groups[0]["lr"])
        return {"losses": losses, "lrs": lrs, "full": full_ce(model, ex["x"], ex["y"]),
                "moved_after_restart": changed(after_first, model.parameters())}
    return loop


COSINE_SCHEDULER_RECREATED_FOR_WARM_RESTART = Case(
    name="cosine_scheduler_recreated_for_warm_restart",
    family="optimizer",
    source="pytorch/pytorch issue #78003 ('CosineAnnealingLR: LR stuck at 0 after "
           "re-initializing scheduler': warm restarts made by periodically re-creating "
           "CosineAnnealingLR(..., last_epoch=-1), which behaved as expected in torch 1.8.1)",
    description="I do warm restarts by creating a new CosineAnnealingLR at the end of each "
                "cycle; after the first cycle the lr stays at 0 and the model stops learning.",
    expected_kinds=("no_update",),
    params=(),
    manifest=lambda b, f: (not b["moved_after_restart"] and f["moved_after_restart"]
                           and trains(f, 0.4) and b["full"] >= 1.3 * f["full"]),
    build_buggy=_cosine_build,
    loop_buggy=_cosine_loop(True),
    build_fixed=_cosine_build,
    loop_fixed=_cosine_loop(False),
    steps=60,
)


CASES = [
    LBFGS_CLOSURE_WITHOUT_ZERO_GRAD,
    PLATEAU_SCHEDULER_MIN_MODE_ON_ACCURACY,
    OPTIMIZER_STATE_LOADED_INTO_REORDERED_HEADS,
    LAMBDALR_LAMBDA_RETURNS_LR_NOT_FACTOR,
    RADAM_STEP_SIZE_CACHED_ACROSS_GROUPS,
    COSINE_SCHEDULER_RECREATED_FOR_WARM_RESTART,
]
