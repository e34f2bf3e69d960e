"""The fourth corpus, mechanism 'optimizer' (the optimizer and its state: param groups, state
dicts, moments, weight decay, lr), mined by worker b."""
from __future__ import annotations

import copy

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
    trains,
)
from .._m4_b import ce_steps, full_ce, full_mse

CASES = []

STEPS_PER_EPOCH = 8  # 256 samples, batches of 32


# ---- adjust_learning_rate writes into optimizer.state_dict()['param_groups'] (a copy)

def _sd_lr_build(seed):
    torch.manual_seed(seed)
    model = nn.Linear(8, 1)
    x, y = linear_regression(seed, noise=0.1)
    return model, torch.optim.SGD(model.parameters(), lr=0.8), {"x": x, "y": y}


def _sd_lr_loop(bug: bool):
    def adjust_learning_rate(optimizer, epoch, base_lr=0.8):
        """Sets the learning rate to the initial LR decayed by 10 every 2 epochs."""
        lr = base_lr * (0.1 ** (epoch // 2))
        groups = optimizer.state_dict()["param_groups"] if bug else optimizer.param_groups
        for param_group in groups:
            param_group["lr"] = lr

    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            if i % STEPS_PER_EPOCH == 0:
                adjust_learning_rate(opt, i // STEPS_PER_EPOCH)
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses, "full": full_mse(model, ex), "lr": opt.param_groups[0]["lr"]}
    return loop


CASES.append(Case(
    name="lr_decay_written_into_state_dict_copy",
    family="optimizer",
    source="pytorch/examples issue #64 ('Adjusting learning rate': 'I was not able to get the "
           "adjust learning rate working unless I change ... for param_group in "
           "optimizer.state_dict()['param_groups'] to for param_group in "
           "optimizer.param_groups'; apaszke: 'you're right! It got broken by a recent change')",
    description="My adjust_learning_rate loops over optimizer.state_dict()['param_groups'] and "
                "sets the decayed lr there; the learning rate never actually drops and the loss "
                "keeps bouncing at the starting lr.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.5) and b["full"] >= 1.5 * f["full"]
    and b["lr"] == 0.8 and f["lr"] < 0.01,
    build_buggy=_sd_lr_build,
    loop_buggy=_sd_lr_loop(True),
    build_fixed=_sd_lr_build,
    loop_fixed=_sd_lr_loop(False),
    steps=64,
))


# ---- OneCycleLR (a per-batch schedule) stepped once per epoch

def _onecycle_build(seed):
    model = mlp(seed)
    x, y = classification(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    epochs = 8
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, epochs=epochs,
                                                steps_per_epoch=STEPS_PER_EPOCH,
                                                cycle_momentum=False)
    return model, opt, {"x": x, "y": y, "sched": sched}


def _onecycle_loop(bug: bool):
    def loop(model, opt, ex, steps):
        sched, losses, lrs = ex["sched"], [], []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            lrs.append(opt.param_groups[0]["lr"])
            if not bug:
                sched.step()  # per batch, as OneCycleLR expects
            elif (i + 1) % STEPS_PER_EPOCH == 0:
                sched.step()  # end of epoch
            losses.append(loss.item())
        return {"losses": losses, "full": full_ce(model, ex), "peak_lr": max(lrs)}
    return loop


CASES.append(Case(
    name="onecycle_scheduler_stepped_per_epoch",
    family="optimizer",
    source="pytorch/pytorch issue #65417 ('OneCycleLR updating on epoch rather than on step': "
           "'only a fraction of the schedule is followed'); ageron/handson-mlp issue #28 "
           "('OneCycleLR scheduler should be called after every batch': the training function "
           "calls scheduler.step() at the end of every epoch)",
    description="I built OneCycleLR with epochs and steps_per_epoch but call scheduler.step() "
                "once per epoch; the learning rate crawls along the start of the warm-up and "
                "never reaches max_lr, so training is far slower than the one-cycle run should be.",
    expected_kinds=("lr_schedule",),
    params=(),
    manifest=lambda b, f: trains(f, 0.5) and b["full"] >= 1.5 * f["full"]
    and b["peak_lr"] <= 0.5 * f["peak_lr"],
    build_buggy=_onecycle_build,
    loop_buggy=_onecycle_loop(True),
    build_fixed=_onecycle_build,
    loop_fixed=_onecycle_loop(False),
    steps=64,
))


# ---- resumed from a checkpoint holding the model's weights but not Adam's moments

def _resume_build(bug: bool):
    def build(seed):
        x, y = classification(seed)
        ex = {"x": x, "y": y}
        # the first run, before the interruption
        first = mlp(seed)
        first_opt = torch.optim.Adam(first.parameters(), lr=0.05)
        pre = ce_steps(first, first_opt, ex, 100)
        ckpt = {"model": first.state_dict(), "optimizer": first_opt.state_dict()}
        # the resumed run
        model = mlp(seed + 100)
        model.load_state_dict(ckpt["model"])
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        if not bug:
            opt.load_state_dict(ckpt["optimizer"])
        ex["start"] = 100
        ex["before"] = sum(pre[-5:]) / 5
        return model, opt, ex
    return build


def _resume_loop(model, opt, ex, steps):
    losses = ce_steps(model, opt, ex, steps, start=ex["start"])
    return {"losses": losses, "before": ex["before"], "jump": max(losses[:4])}


CASES.append(Case(
    name="resume_without_adam_moments",
    family="optimizer",
    source="NVlabs/stylegan2-ada-pytorch issue #108 ('Question: restoring optimizer state during "
           "checkpoint resuming': 'If states are not restored, the first training iteration "
           "will update all weights with the same value (only differ in +/-sign)'); "
           "NM512/dreamerv3-torch issue #38 ('Resuming training resets optimizer parameters')",
    description="When I resume, I load the model's state_dict but build a fresh Adam; right "
                "after resuming the loss jumps well above where the interrupted run was.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: b["jump"] >= 3 * f["jump"] and b["jump"] >= 3 * b["before"]
    and f["jump"] <= 3 * f["before"],
    build_buggy=_resume_build(True),
    loop_buggy=_resume_loop,
    build_fixed=_resume_build(False),
    loop_fixed=_resume_loop,
    steps=20,
))


# ---- "scheduler off" implemented as StepLR(gamma=0)

def _gamma_build(use_scheduler_flag_off_bug: bool):
    def build(seed):
        model = mlp(seed)
        x, y = classification(seed)
        opt = torch.optim.Adam(model.parameters(), lr=0.003)
        optimizer_scheduler = False  # the config turns the schedule off
        if optimizer_scheduler:
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.2)
        elif use_scheduler_flag_off_bug:
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0)
        else:
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=1)
        return model, opt, {"x": x, "y": y, "sched": sched}
    return build


def _gamma_loop(model, opt, ex, steps):
    losses, late = [], None
    for i in range(steps):
        if i == steps // 2:
            late = snapshot(model.parameters())
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if (i + 1) % STEPS_PER_EPOCH == 0:
            ex["sched"].step()  # once per epoch
        losses.append(loss.item())
    return {"losses": losses, "late_moved": changed(late, model.parameters()),
            "full": full_ce(model, ex)}


CASES.append(Case(
    name="scheduler_off_as_steplr_gamma_zero",
    family="optimizer",
    source="LINCellularNeuroscience/VAME issue #26 ('Bug when scheduler turned off': 'When the "
           "scheduler parameter is turned off, the learning rate decreases to 0 after 100 "
           "epochs ... StepLR(optimizer, step_size=100, gamma=0) ... gamma should be 1, not 0')",
    description="With the scheduler switched off in my config, the code still builds "
                "StepLR(..., gamma=0); after the first step_size epochs the learning rate is 0 "
                "and the model stops learning.",
    # note: labelled no_update from its broken-by example (a param group with lr=0); the
    # StepLR itself is stepped once per epoch as intended, so lr_schedule is not expected.
    expected_kinds=("no_update",),
    params=(),
    manifest=lambda b, f: not b["late_moved"] and f["late_moved"] and trains(f, 0.4)
    and b["full"] >= 1.3 * f["full"],
    build_buggy=_gamma_build(True),
    loop_buggy=_gamma_loop,
    build_fixed=_gamma_build(False),
    loop_fixed=_gamma_loop,
    steps=64,
))


# ---- an SGD subclass passes weight_decay positionally into SGD's momentum slot

class PolyOptimizer(torch.optim.SGD):
    """SGD with a polynomial lr decay, as the report's code writes it."""

    def __init__(self, params, lr, weight_decay, max_step, momentum=0.9, bug=True):
        if bug:
            super().__init__(params, lr, weight_decay)  # SGD(params, lr, momentum, ...)
        else:
            super().__init__(params, lr, momentum=momentum, weight_decay=weight_decay)
        self.global_step = 0
        self.max_step = max_step
        self.power = 0.9
        self.initial_lr = [group["lr"] for group in self.param_groups]

    def step(self, closure=None):
        if self.global_step < self.max_step:
            lr_mult = (1 - self.global_step / self.max_step) ** self.power
            for i, group in enumerate(self.param_groups):
                group["lr"] = self.initial_lr[i] * lr_mult
        out = super().step(closure)
        self.global_step += 1
        return out


def _poly_build(bug: bool):
    def build(seed):
        model = mlp(seed)
        x, y = classification(seed)
        opt = PolyOptimizer(model.parameters(), lr=0.02, weight_decay=5e-4, max_step=60,
                            bug=bug)
        return model, opt, {"x": x, "y": y}
    return build


def _poly_loop(model, opt, ex, steps):
    losses = ce_steps(model, opt, ex, steps)
    return {"losses": losses, "full": full_ce(model, ex),
            "momentum": opt.param_groups[0]["momentum"]}


CASES.append(Case(
    name="sgd_subclass_weight_decay_as_momentum",
    family="optimizer",
    source="YudeWang/SEAM issue #21 ('The paramters in optimizer': PolyOptimizer(torch.optim.SGD) "
           "calls super().__init__(params, lr, weight_decay), 'so I think the value of wd will "
           "actually be assigned to momentum'; the author: 'a small bug which invalidates the "
           "momentum', code borrowed from jiwoon-ahn/psa)",
    description="My PolyOptimizer subclasses SGD and calls super().__init__(params, lr, "
                "weight_decay); the weight decay lands in SGD's momentum argument, so I train "
                "with momentum 0.0005 and no weight decay, and it converges much more slowly.",
    # note: momentum=5e-4 (from the positional slip) leaves SGD's momentum mechanism effectively
    # switched off; labelled optimizer_setup on that reading of its invariant.
    expected_kinds=("optimizer_setup",),
    params=(),
    manifest=lambda b, f: trains(f, 0.3) and b["full"] >= 1.3 * f["full"]
    and b["momentum"] == 5e-4,
    build_buggy=_poly_build(True),
    loop_buggy=_poly_loop,
    build_fixed=_poly_build(False),
    loop_fixed=_poly_loop,
    steps=60,
))


# ---- a model forked in-process: the clone's optimizer loads the live optimizer's state_dict

def _fork_build(bug: bool):
    def build(seed):
        x, ya = classification(seed)
        yb = (ya + 1) % 4  # the forked member's own task
        model = mlp(seed)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        ce_steps(model, opt, {"x": x, "y": ya}, 40)
        before = full_ce(model, {"x": x, "y": ya})
        # fork a second member from the live one (no torch.save / torch.load round trip)
        member = mlp(seed + 1)
        member.load_state_dict(model.state_dict())
        member_opt = torch.optim.Adam(member.parameters(), lr=0.01)
        state = opt.state_dict()
        member_opt.load_state_dict(state if bug else copy.deepcopy(state))
        return model, opt, {"x": x, "y": ya, "yb": yb, "member": member,
                            "member_opt": member_opt, "before": before}
    return build


def _fork_loop(model, opt, ex, steps):
    member, member_opt = ex["member"], ex["member_opt"]
    losses = []
    for i in range(40, 40 + steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        xb, yb = batch(ex["x"], ex["yb"], i)  # the forked member trains on its own task
        member_opt.zero_grad()
        F.cross_entropy(member(xb), yb).backward()
        member_opt.step()
    return {"losses": losses, "full": full_ce(model, ex), "before": ex["before"]}


CASES.append(Case(
    name="forked_optimizer_state_aliased",
    family="optimizer",
    source="pytorch/pytorch issue #196083 ('Optimizer.state_dict()/load_state_dict() silently "
           "alias tensors instead of copying when used in-process (no torch.save/load round "
           "trip)': 'both optimizers sharing the same underlying momentum_buffer/exp_avg/step "
           "tensor objects. Subsequently stepping either optimizer silently corrupts the "
           "other's state')",
    description="I fork a second member from my live model in-process and give its Adam "
                "opt.state_dict(); the two optimizers share their moment tensors, and my "
                "original model's loss climbs as soon as the fork starts training on its task.",
    # note: the watched optimizer's own step is Adam's rule applied to moments that the other
    # optimizer rewrote between steps; labelled update_rule on that reading ("the state it had"
    # being the state its previous step left).
    expected_kinds=("update_rule",),
    params=(),
    manifest=lambda b, f: b["full"] >= 2 * f["full"] and f["full"] <= 1.1 * f["before"]
    and b["full"] >= 1.5 * b["before"],
    build_buggy=_fork_build(True),
    loop_buggy=_fork_loop,
    build_fixed=_fork_build(False),
    loop_fixed=_fork_loop,
    steps=40,
))
