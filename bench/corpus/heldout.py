"""The held-out half of the silent-bug corpus. Do not read or run these cases while writing
detection code: they measure, once, how well it generalises (issue 31, point 5)."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from ._common import (
    MLP,
    Case,
    any_nonfinite,
    batch,
    changed,
    classification,
    linear_regression,
    mlp,
    regression,
    sgd_build,
    snapshot,
    tail,
    trains,
    worse,
)
from ._shared import (
    BACKBONE,
    Clf,
    _backbone,
    adam_build,
    build_model,
    ce_case,
    epoch_sched_build,
    evaluate,
    linear,
    looping,
    per_batch_loop,
    recreate_loop,
    reg_mlp,
    scaler_build,
)


def _ce_loop(model, opt, ex, steps, before_step=None):
    """The healthy classification loop (a hook may run just before the step)."""
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if before_step:
            before_step(i)
        opt.step()
        losses.append(loss.item())
    return {"losses": losses}


def _critic_loop(zero_each_inner: bool):
    # A critic trained K steps per outer iteration (WGAN/BigGAN style, here on a plain
    # regression so the effect is measurable); the bug zeroes the gradients once per outer
    # iteration only, so each inner step applies the sum of all earlier inner gradients.
    def loop(model, opt, ex, steps):
        losses, k = [], 5
        for outer in range(steps // k):
            opt.zero_grad()
            for inner in range(k):
                if zero_each_inner:
                    opt.zero_grad()
                x, y = batch(ex["x"], ex["y"], outer * k + inner)
                loss = F.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
        return {"losses": losses}
    return loop


D_STEPS = Case(
    name="d_steps_without_zero_grad",
    family="stale_grad",
    source="ajbrock/BigGAN-PyTorch issue #25 (D_optim.zero_grad() not called between the "
           "discriminator's steps; 'Good catch--this was a typo!')",
    description="I train my critic several steps per iteration and call zero_grad() once "
                "before that inner loop; the critic's loss is erratic and worse than it should be.",
    expected_kinds=("stale_grad",),
    params=(),
    manifest=lambda b, f: trains(f, 0.2) and worse(b, f, 1.3),
    build_buggy=sgd_build(reg_mlp, lr=0.3, data=regression),
    loop_buggy=_critic_loop(False),
    build_fixed=sgd_build(reg_mlp, lr=0.3, data=regression),
    loop_fixed=_critic_loop(True),
    steps=60,
)


def _amp_loop(mode: str):
    """mode: 'good', 'double' (scaler.step then optimizer.step), 'clip_scaled' (clip before
    unscale_), 'clip_good'."""
    def loop(model, opt, ex, steps):
        scaler, losses = ex["scaler"], []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            loss = F.mse_loss(out.float(), y)
            scaler.scale(loss).backward()
            if mode == "clip_scaled":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            elif mode == "clip_good":
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            if mode == "double":
                opt.step()
            scaler.update()
            losses.append(loss.item())
        return {"losses": losses}
    return loop


DOUBLE_SCALER = Case(
    name="scaler_step_then_optimizer_step",
    family="double_step",
    source="IAHispano/Applio pull request #860 ('optimizer step bugfix': optim_g.step() and "
           "optim_d.step() called after scaler.step(); found debugging NaNs and Infs)",
    description="With AMP I call scaler.step(optimizer) and, as before, optimizer.step(); at "
                "the learning rate that worked without AMP the loss now blows up.",
    expected_kinds=("double_step",),
    params=(),
    manifest=lambda b, f: trains(f, 0.5) and worse(b, f, 3.0),
    build_buggy=scaler_build(linear, lr=0.6, data=linear_regression),
    loop_buggy=_amp_loop("double"),
    build_fixed=scaler_build(linear, lr=0.6, data=linear_regression),
    loop_fixed=_amp_loop("good"),
    steps=40,
)


CLIP_SCALED = Case(
    name="clip_before_unscale",
    family="scaled_grad",
    source="milesial/Pytorch-UNet issue #468 ('Gradients are clipped before the unscaling', fixed "
           "in pull request #470); pytorch/examples issue #1196; victorchall/EveryDream2trainer "
           "pull request #175 ('effectively halting training'); rwth-i6/returnn issue #1590",
    description="I clip the gradient norm to 1.0 right after scaler.scale(loss).backward(); "
                "since I turned on AMP the model barely trains.",
    expected_kinds=("scaled_grad",),
    params=(),
    manifest=lambda b, f: trains(f, 0.3) and worse(b, f, 1.5),
    build_buggy=scaler_build(reg_mlp, lr=0.1),
    loop_buggy=_amp_loop("clip_scaled"),
    build_fixed=scaler_build(reg_mlp, lr=0.1),
    loop_fixed=_amp_loop("clip_good"),
    steps=40,
)


def _twice_build(twice: bool):
    def build(seed):
        model = mlp(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        if twice:
            model = mlp(seed + 1)  # the cell defining the model was run again
        x, y = classification(seed)
        return model, opt, {"x": x, "y": y}
    return build


def _trained_loop(model, opt, ex, steps):
    before = snapshot(model.parameters())
    out = _ce_loop(model, opt, ex, steps)
    out["changed"] = changed(before, model.parameters())
    return out


TWICE = Case(
    name="model_instantiated_twice",
    family="orphan_param",
    source="spro/practical-pytorch issue #9 ('I have the model instantiated twice ... move the "
           "optimizer to below the second one, so the params aren't reset')",
    description="Switching from manual updates to optimizer.step(), my loss stays where it is; "
                "the model is created again after the optimizer.",
    expected_kinds=("orphan_param",),
    params=MLP,
    manifest=lambda b, f: (not b["changed"]) and f["changed"] and trains(f, 0.3),
    build_buggy=_twice_build(True),
    loop_buggy=_trained_loop,
    build_fixed=_twice_build(False),
    loop_fixed=_trained_loop,
    steps=40,
)


def _warmup_build(lam):
    def build(seed):
        model = mlp(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        x, y = classification(seed)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
        return model, opt, {"x": x, "y": y, "sched": sched}
    return build


def _sched_loop(model, opt, ex, steps):
    before, losses = snapshot(model.parameters()), []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        ex["sched"].step()
        losses.append(loss.item())
    return {"losses": losses, "changed": changed(before, model.parameters()),
            "lr": opt.param_groups[0]["lr"]}


WARMUP = 100


WARMUP_INT = Case(
    name="warmup_integer_division_lr_zero",
    family="no_update",
    source="karpathy/nanoGPT issue #443 / pull request #578 and verl-project/verl issue #3674 "
           "(a warmup that gives lr 0); here an integer division keeps it at 0 for the whole "
           "warmup",
    description="I wrote a linear warmup as LambdaLR(opt, lambda s: s // warmup_steps); for "
                "the first epochs the loss does not move at all.",
    expected_kinds=("no_update", "lr_schedule"),
    params=(),
    manifest=lambda b, f: (not b["changed"]) and trains(f, 0.2),
    build_buggy=_warmup_build(lambda s: s // WARMUP),
    loop_buggy=_sched_loop,
    build_fixed=_warmup_build(lambda s: min(1.0, (s + 10) / WARMUP)),
    loop_fixed=_sched_loop,
    steps=60,
)


ADAM_BATCH = Case(
    name="adam_recreated_each_batch",
    family="foreign_update",
    source="Wangyixinxin/ACN issue #9 (the discriminator's Adam 'is instantiated inside the batch "
           "loop ... this resets Adam's internal state at each step')",
    description="My Adam optimizer is created inside the batch loop; the loss plateaus higher "
                "than with the optimizer created once.",
    expected_kinds=("foreign_update",),
    params=(),
    manifest=lambda b, f: trains(f, 0.5) and worse(b, f, 1.3),
    build_buggy=adam_build,
    loop_buggy=recreate_loop(1),
    build_fixed=adam_build,
    loop_fixed=recreate_loop(0),
    steps=80,
)


def _steplr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.3)


STEPLR = Case(
    name="steplr_stepped_per_batch",
    family="lr_schedule",
    source="Lornatang/SRGAN-PyTorch issue #1 ('they are called at each training step which means "
           "that learning rate is quickly becoming zero'); hazdzz/stgcn issue #18; ivadomed/ivadomed "
           "pull request #55",
    description="My StepLR (step_size in epochs) is stepped inside the batch loop; after a few "
                "dozen batches the model stops improving.",
    expected_kinds=("lr_schedule",),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and worse(b, f, 1.3) and b["lr"] < 1e-4 * 0.1,
    build_buggy=epoch_sched_build(_steplr),
    loop_buggy=per_batch_loop(True),
    build_fixed=epoch_sched_build(_steplr),
    loop_fixed=per_batch_loop(False),
    steps=80,
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
    build_buggy=build_model(lambda: DictNet(False), lr=0.5),
    loop_buggy=looping(watch_params=lambda m: [m.extra["scale"]]),
    build_fixed=build_model(lambda: DictNet(True), lr=0.5),
    loop_fixed=looping(watch_params=lambda m: [m.extra["scale"]]),
    steps=80,
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
    loop_buggy=looping(watch_params=lambda m: [m[1].running_mean, m[1].running_var]),
    build_fixed=_pretrained_build(True),
    loop_fixed=looping(watch_params=lambda m: [m[1].running_mean, m[1].running_var]),
    steps=50,
)


class Frozen(nn.Module):
    """A backbone and a head; ``mode`` says how the backbone's output reaches the head."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.backbone = nn.Sequential(nn.Linear(10, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        if self.mode == "reentrant":
            h = checkpoint(self.backbone, x, use_reentrant=True)
        elif self.mode == "non_reentrant":
            h = checkpoint(self.backbone, x, use_reentrant=False)
        elif self.mode == "numpy":
            # a NumPy post-processing step, then back to a tensor
            h = torch.from_numpy(np.clip(self.backbone(x).detach().numpy(), -0.9, 0.9))
        else:  # "numpy_fixed"
            h = torch.clamp(self.backbone(x), -0.9, 0.9)
        return self.head(h)


def _cut_case(name, mode, fixed_mode, source, description, kinds=("unused_param",)):
    return Case(
        name=name, family="unused_param", source=source, description=description,
        expected_kinds=kinds, params=BACKBONE,
        manifest=lambda b, f: (not b["changed"]) and f["changed"] and trains(f, 0.3),
        build_buggy=build_model(lambda: Frozen(mode), lr=0.2),
        loop_buggy=looping(watch_params=_backbone),
        build_fixed=build_model(lambda: Frozen(fixed_mode), lr=0.2),
        loop_fixed=looping(watch_params=_backbone),
        steps=40,
    )


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


def _deep(init: str):
    def make():
        net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                            nn.Linear(32, 4))
        if init == "zeros":
            for m in net:
                if isinstance(m, nn.Linear):
                    nn.init.zeros_(m.weight)
                    nn.init.zeros_(m.bias)
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
    build_buggy=build_model(_deep("zeros"), lr=0.3),
    loop_buggy=looping(watch_params=lambda m: [m[0].weight, m[2].weight, m[4].weight]),
    build_fixed=build_model(_deep("default"), lr=0.3),
    loop_fixed=looping(watch_params=lambda m: [m[0].weight, m[2].weight, m[4].weight]),
    steps=60,
)


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
    build_buggy=build_model(_reg_net, lr=0.03, data=lambda s: _prices(s, False)),
    loop_buggy=looping(loss_fn=F.mse_loss),
    build_fixed=build_model(_reg_net, lr=0.03, data=lambda s: _prices(s, True)),
    loop_fixed=looping(loss_fn=F.mse_loss),
    steps=40,
)


SOFTMAX_CE = ce_case(
    "softmax_then_cross_entropy", lambda: nn.Softmax(dim=1), F.cross_entropy,
    "PyTorch forum thread 'Cross Entropy loss is not decreasing' (43814: 'Check if you pass "
    "the softmax into the CrossEntropy loss'); MicrosoftDocs/pytorchfundamentals issue #4",
    "My classifier ends with nn.Softmax and I train it with CrossEntropyLoss; the loss creeps "
    "down very slowly and stalls far above zero.")


SOFTMAX_NLL = ce_case(
    "softmax_then_nll_loss", lambda: nn.Softmax(dim=1), F.nll_loss,
    "AnubhavGupta3377/Text-Classification-Models-Pytorch issue #9 (softmax output into "
    "nn.NLLLoss: 'the loss is always negative'); clvrai/ACGAN-PyTorch pull request #4",
    "I use NLLLoss on my model's softmax output; the loss is negative and the accuracy is "
    "poor.")


def _binary(seed):
    x, y = classification(seed)
    return x, (y >= 2).float().unsqueeze(1)


def _bce_build(final):
    def build(seed):
        torch.manual_seed(seed)
        model = Clf(final(), d_out=1)
        x, y = _binary(seed)
        return model, torch.optim.SGD(model.parameters(), lr=0.5), {"x": x, "y": y}
    return build


def _bce_loop(model, opt, ex, steps):
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses}


BCE_SIGMOID = Case(
    name="bce_with_logits_on_sigmoid",
    family="loss_pattern",
    source="yudi-mars/daisyRec pull request #15 ('Do not need sigmoid because there is sigmoid "
           "in BCEWithLogitsLoss. Otherwise loss does not converge'); Turoad/lanedet issue #32; "
           "itakurah/focal-loss-pytorch pull request #5",
    description="My binary classifier ends with nn.Sigmoid and I use BCEWithLogitsLoss; the "
                "loss plateaus around 0.5 however long I train.",
    expected_kinds=("loss_pattern",),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and worse(b, f, 1.5),
    build_buggy=_bce_build(nn.Sigmoid),
    loop_buggy=_bce_loop,
    build_fixed=_bce_build(nn.Identity),
    loop_fixed=_bce_loop,
    steps=60,
)


def _reg_build(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    x, y = linear_regression(seed)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), {"x": x, "y": y}


def _mse_loop(squeeze_target: bool):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            target = y.squeeze(1) if squeeze_target else y  # [N] against a [N, 1] output
            opt.zero_grad()
            loss = F.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            true = F.mse_loss(model(ex["x"]), ex["y"]).item()
        return {"losses": losses, "true_loss": true}
    return loop


MSE_BROADCAST = Case(
    name="mse_target_broadcast",
    family="loss_pattern",
    source="deepset-ai/FARM issue #229 ('Using a target size (torch.Size([32, 1])) that is "
           "different to the input size (torch.Size([32]))'); jsboige/CoursIA pull request #926 "
           "('(B, 1) vs (B,) to (B, B) matrix'); mlcommons/GaNDLF issue #134",
    description="My regression model outputs [N, 1] and my targets are [N]; training runs "
                "(with a warning I ignored) but the model only learns the mean.",
    expected_kinds=("loss_pattern",),
    params=(),
    manifest=lambda b, f: trains(f, 0.3) and b["true_loss"] >= 1.5 * f["true_loss"],
    build_buggy=_reg_build,
    loop_buggy=_mse_loop(True),
    build_fixed=_reg_build,
    loop_fixed=_mse_loop(False),
    steps=60,
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
        true, acc = evaluate(model, ex["x"].permute(0, 2, 1), ex["y"])
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

CASES = [D_STEPS, DOUBLE_SCALER, CLIP_SCALED, TWICE, WARMUP_INT, DICT, ADAM_BATCH, PRETRAINED_EVAL, REENTRANT, NUMPY, SOFTMAX_CE, SOFTMAX_NLL, BCE_SIGMOID, MSE_BROADCAST, ZERO, STEPLR, UNNORMALISED, VIEW]
