"""The held-out cases of the mechanism 'optimizer' (bench/corpus/mechanisms.py) mined by worker a."""
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
    mlp,
    snapshot,
    tail,
    trains,
    worse,
)
from .._mech_a import (
    eval_ce,
)

# ---- resume: the optimizer's saved lr overrides the new one

def _pretrain(model, opt, x, y, steps, loss_fn=F.cross_entropy, sched=None, size=32):
    for i in range(steps):
        xb, yb = batch(x, y, i, size)
        opt.zero_grad()
        loss_fn(model(xb), yb).backward()
        opt.step()
        if sched is not None:
            sched.step()


def _resume_lr_build(seed):
    model = mlp(seed)
    x, y = classification(seed)
    old = torch.optim.SGD(model.parameters(), lr=0.002, momentum=0.9)
    _pretrain(model, old, x, y, 5)
    ckpt = old.state_dict()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # the new run's lr
    return model, opt, {"x": x, "y": y, "ckpt": ckpt}


def _resume_lr_loop(bug: bool):
    def loop(model, opt, ex, steps):
        wanted = [g["lr"] for g in opt.param_groups]
        opt.load_state_dict(ex["ckpt"])
        if not bug:
            for g, lr in zip(opt.param_groups, wanted):
                g["lr"] = lr
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses, "lr": opt.param_groups[0]["lr"], "full": eval_ce(model, ex)}
    return loop


RESUME_LR = Case(
    name="resume_lr_overridden_by_checkpoint",
    family="optimizer",
    source="pytorch/examples issue #816 ('If you resume from a checkpoint and want to run with "
           "a new learning rate, the saved learning rate will overwrite what you specify on "
           "the command line'); pytorch/pytorch issue #156846 ('Can't alter the learning rate "
           "though loading optimizer states')",
    description="I resume from a checkpoint with a larger --lr, building the optimizer with "
                "it and then loading the optimizer's state; training is as slow as before.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.3) and b["full"] >= 1.5 * f["full"],
    build_buggy=_resume_lr_build,
    loop_buggy=_resume_lr_loop(True),
    build_fixed=_resume_lr_build,
    loop_fixed=_resume_lr_loop(False),
    steps=40,
)


# ---- frozen parameters still decayed by AdamW

def _frozen_build(bug: bool):
    def build(seed):
        model = mlp(seed)
        x, y = classification(seed)
        pre = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(5):  # the first stage trains everything
            xb, yb = batch(x, y, i)
            pre.zero_grad(set_to_none=False)
            F.cross_entropy(model(xb), yb).backward()
            pre.step()
        pre.zero_grad(set_to_none=False)
        for p in model[0].parameters():  # the second stage freezes the body
            p.requires_grad_(False)
        params = model.parameters() if bug else [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.5)
        return model, opt, {"x": x, "y": y}
    return build


def _frozen_loop(model, opt, ex, steps):
    body = list(model[0].parameters())
    before, losses = snapshot(body), []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    shrink = model[0].weight.norm().item() / before[0].norm().item()
    return {"losses": losses, "body_changed": changed(before, body), "shrink": shrink}


FROZEN = Case(
    name="frozen_params_decayed_by_adamw",
    family="optimizer",
    source="iamwangyabin/S-Prompts pull request #2 ('if you do not use the filter function to "
           "drop those parameters that do not require updates, the weight decay in your "
           "optimizer will still change their value even though you have set them as "
           "requires_grad=False'); pytorch/pytorch issue #150610",
    description="In the second stage I freeze the body with requires_grad_(False) and build "
                "AdamW over model.parameters(); the frozen weights keep shrinking.",
    expected_kinds=(),
    params=("0.weight", "0.bias"),
    manifest=lambda b, f: b["body_changed"] and b["shrink"] <= 0.9 and not f["body_changed"]
    and trains(f, 0.2),
    build_buggy=_frozen_build(True),
    loop_buggy=_frozen_loop,
    build_fixed=_frozen_build(False),
    loop_fixed=_frozen_loop,
    steps=40,
)


# ---- the no-decay list names LayerNorm.weight, the model says layer_norm

class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(10, 32)
        self.layer_norm = nn.LayerNorm(32)
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        return self.out(F.relu(self.layer_norm(self.dense(x))))


NO_DECAY = ["bias", "LayerNorm.weight"]


def _decay_build(bug: bool):
    def build(seed):
        torch.manual_seed(seed)
        model = NormNet()
        x, y = classification(seed)
        if bug:
            skip = lambda n: any(nd in n for nd in NO_DECAY)
        else:
            skip = lambda n: n.endswith("bias") or "layer_norm" in n
        groups = [
            {"params": [p for n, p in model.named_parameters() if not skip(n)],
             "weight_decay": 2.0},
            {"params": [p for n, p in model.named_parameters() if skip(n)],
             "weight_decay": 0.0},
        ]
        return model, torch.optim.AdamW(groups, lr=0.02), {"x": x, "y": y}
    return build


def _decay_loop(model, opt, ex, steps):
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "gain": model.layer_norm.weight.abs().mean().item(),
            "full": eval_ce(model, ex)}


DECAY_LN = Case(
    name="no_decay_list_misses_layer_norm",
    family="optimizer",
    source="huggingface/transformers issue #16908 (RobertaLMHead names its LayerNorm "
           "'layer_norm', so no_decay = ['bias', 'LayerNorm.weight'] applies weight decay to "
           "it); deepspeedai/DeepSpeedExamples pull request #755 ('LayerNorm.weight' does not "
           "match opt's 'layer_norm' or llama's 'norm')",
    description="I exclude biases and LayerNorm weights from weight decay by name, but my "
                "model calls its norm layer_norm; the norm's gain shrinks and the loss ends "
                "higher.",
    expected_kinds=(),
    params=("layer_norm.weight",),
    manifest=lambda b, f: trains(f, 0.3) and b["gain"] <= 0.7 * f["gain"]
    and b["full"] >= 1.2 * f["full"],
    build_buggy=_decay_build(True),
    loop_buggy=_decay_loop,
    build_fixed=_decay_build(False),
    loop_fixed=_decay_loop,
    steps=60,
)


# ---- EMA weights copied in for validation, never restored

def _ema_build(seed):
    model = mlp(seed)
    x, y = classification(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    shadow = [p.detach().clone() for p in model.parameters()]
    return model, opt, {"x": x, "y": y, "shadow": shadow}


def _ema_loop(bug: bool, decay: float = 0.95, every: int = 5):
    def loop(model, opt, ex, steps):
        shadow, losses, vals = ex["shadow"], [], []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            with torch.no_grad():
                for s, p in zip(shadow, model.parameters()):
                    s.mul_(decay).add_(p.detach(), alpha=1 - decay)
            if (i + 1) % every == 0:  # validate / save with the EMA weights
                with torch.no_grad():
                    stored = [p.detach().clone() for p in model.parameters()]
                    for s, p in zip(shadow, model.parameters()):
                        p.copy_(s)
                    vals.append(eval_ce(model, ex))
                    if not bug:
                        for s, p in zip(stored, model.parameters()):
                            p.copy_(s)
        return {"losses": losses, "full": eval_ce(model, ex), "vals": vals}
    return loop


EMA = Case(
    name="ema_weights_not_restored",
    family="optimizer",
    source="harubaru/waifu-diffusion pull request #31 ('whenever save_checkpoint() is called, "
           "the EMA parameters are copied to the UNet. However, the original parameters are "
           "not restored, meaning that training continues on the EMA parameters'); "
           "PKU-YuanGroup/Open-Sora-Plan issue #186 ('Missed to restore model weights in "
           "training after validation with EMA on')",
    description="Every few steps I copy the EMA weights into the model to validate and save; "
                "I forgot to restore the training weights, and training keeps falling back.",
    expected_kinds=("update_rule", "foreign_update"),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and b["full"] >= 1.3 * f["full"],
    build_buggy=_ema_build,
    loop_buggy=_ema_loop(True),
    build_fixed=_ema_build,
    loop_fixed=_ema_loop(False),
    steps=60,
)


# ---- the scheduler built after loading the optimizer resets the lr

def _decay_factor(epoch):
    return 0.85 ** epoch


def _sched_build(seed):
    model = mlp(seed)
    x, y = classification(seed)
    old = torch.optim.SGD(model.parameters(), lr=5.0)
    old_sched = torch.optim.lr_scheduler.LambdaLR(old, _decay_factor)
    _pretrain(model, old, x, y, 30, sched=old_sched)
    ckpt = {"opt": old.state_dict(), "sched": old_sched.state_dict()}
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    return model, opt, {"x": x, "y": y, "ckpt": ckpt}


def _sched_loop(bug: bool):
    def loop(model, opt, ex, steps):
        if bug:  # load the optimizer, then build the scheduler and load its state
            opt.load_state_dict(ex["ckpt"]["opt"])
            sched = torch.optim.lr_scheduler.LambdaLR(opt, _decay_factor)
            sched.load_state_dict(ex["ckpt"]["sched"])
        else:  # build the scheduler first, then load both
            sched = torch.optim.lr_scheduler.LambdaLR(opt, _decay_factor)
            opt.load_state_dict(ex["ckpt"]["opt"])
            sched.load_state_dict(ex["ckpt"]["sched"])
        lr_start = opt.param_groups[0]["lr"]
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], 30 + i)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
        return {"losses": losses, "lr_start": lr_start, "full": eval_ce(model, ex)}
    return loop


SCHED = Case(
    name="scheduler_built_after_optimizer_load",
    family="optimizer",
    source="torch-points3d/torch-points3d pull request #630 ('when resuming a training run, "
           "the optimizer learning rate would reset to the original learning rate ... we "
           "initialize the scheduler and set its state (which resets the optimizer to the "
           "scheduler's initial value)'); IntelLabs/distiller issue #145 ('resume resets "
           "learning rate')",
    description="On resume I load the optimizer's state, then create the LambdaLR scheduler "
                "and load its state; the first resumed step runs at the initial learning rate "
                "and the loss jumps.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: b["lr_start"] >= 10 * f["lr_start"] and worse(b, f, 1.3)
    and math.isfinite(tail(f["losses"])),
    build_buggy=_sched_build,
    loop_buggy=_sched_loop(True),
    build_fixed=_sched_build,
    loop_fixed=_sched_loop(False),
    steps=20,
)


# ---- a hand-written optimizer decays parameters that got no gradient

class SGDW(torch.optim.Optimizer):
    """SGD with decoupled weight decay, written by hand."""

    def __init__(self, params, lr, weight_decay, skip_none=True):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self.skip_none = skip_none

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None and self.skip_none:
                    continue
                p.mul_(1 - group["lr"] * group["weight_decay"])
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 32), nn.ReLU())
        self.head_a = nn.Linear(32, 4)  # task A: kept for later, unused in this stage
        self.head_b = nn.Linear(32, 4)

    def forward(self, x):
        return self.head_b(self.body(x))


def _sgdw_build(bug: bool):
    def build(seed):
        torch.manual_seed(seed)
        model = TwoHeads()
        x, y = classification(seed)
        opt = SGDW(model.parameters(), lr=0.2, weight_decay=0.05, skip_none=not bug)
        return model, opt, {"x": x, "y": y}
    return build


def _sgdw_loop(model, opt, ex, steps):
    head_a = list(model.head_a.parameters())
    before, losses = snapshot(head_a), []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    shrink = model.head_a.weight.norm().item() / before[0].norm().item()
    return {"losses": losses, "head_a_changed": changed(before, head_a), "shrink": shrink}


SGDW_NONE = Case(
    name="custom_optimizer_decays_params_without_grad",
    family="optimizer",
    source="KellerJordan/Muon issue #54 ('optimizer applies weight decay to parameters even "
           "when their gradient is None'); ahrefs/ocannl issue #673 (frozen parameters take "
           "optimizer steps: 'With ~weight_decay > 0 the frozen weights decay on every step')",
    description="My own SGDW optimizer applies the weight decay to every parameter, also to "
                "a head that gets no gradient in this stage; that head's weights shrink.",
    expected_kinds=(),
    params=("head_a.weight", "head_a.bias"),
    manifest=lambda b, f: b["head_a_changed"] and b["shrink"] <= 0.7
    and not f["head_a_changed"] and trains(f, 0.3),
    build_buggy=_sgdw_build(True),
    loop_buggy=_sgdw_loop,
    build_fixed=_sgdw_build(False),
    loop_fixed=_sgdw_loop,
    steps=60,
)


CASES = [RESUME_LR, FROZEN, DECAY_LN, EMA, SCHED, SGDW_NONE]
