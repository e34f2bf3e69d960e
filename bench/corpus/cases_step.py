"""Cases where the optimizer step goes wrong: stale or missing gradients, double steps,
GradScaler misuse, parameters the optimizer does not hold, foreign optimizers, learning
rates that collapse."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from ._common import (
    MLP,
    Case,
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


# --------------------------------------------------------------------------- stale_grad

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


def _reg_mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


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
    build_buggy=sgd_build(_reg_mlp, lr=0.3, data=regression),
    loop_buggy=_critic_loop(False),
    build_fixed=sgd_build(_reg_mlp, lr=0.3, data=regression),
    loop_fixed=_critic_loop(True),
    steps=60,
)


def _gan_build(seed):
    torch.manual_seed(seed)
    disc = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
    gen = nn.Linear(2, 1)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.05)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(seed + 7)
    return disc, opt_d, {"gen": gen, "opt_g": opt_g, "g": g}


def _gan_loop(fixed: bool):
    def loop(disc, opt_d, ex, steps):
        gen, opt_g, g = ex["gen"], ex["opt_g"], ex["g"]
        losses, bce = [], F.binary_cross_entropy_with_logits
        for _ in range(steps):
            real = 3 + 0.5 * torch.randn(64, 1, generator=g)
            z = torch.randn(64, 2, generator=g)
            # generator step: its loss goes through D, so D's .grad fills up as well
            opt_g.zero_grad()
            fake = gen(z)
            g_loss = bce(disc(fake), torch.ones(64, 1))
            g_loss.backward()
            opt_g.step()
            # discriminator step
            if fixed:
                opt_d.zero_grad()
            else:
                opt_g.zero_grad()  # the bug: the other network's optimizer
            d_loss = bce(disc(real), torch.ones(64, 1)) + bce(disc(fake.detach()), torch.zeros(64, 1))
            d_loss.backward()
            opt_d.step()
            losses.append(d_loss.item())
        grad = torch.cat([p.grad.flatten() for p in disc.parameters()]).norm().item()
        return {"losses": losses, "d_grad_norm": grad}
    return loop


GAN_ZERO = Case(
    name="gan_zero_grad_other_optimizer",
    family="stale_grad",
    source="Lightning-AI/pytorch-lightning issue #591 ('GAN training ... is broken': only the "
           "stepped optimizer's gradients were cleared, D accumulated G's and its own old "
           "gradients), #557",
    description="My GAN's discriminator takes ever larger steps and its loss wanders; I clear "
                "gradients with the generator's optimizer before the discriminator's backward.",
    expected_kinds=("stale_grad",),
    params=(),
    manifest=lambda b, f: b["d_grad_norm"] >= 10 * f["d_grad_norm"] and math.isfinite(tail(f["losses"])),
    build_buggy=_gan_build,
    loop_buggy=_gan_loop(False),
    build_fixed=_gan_build,
    loop_fixed=_gan_loop(True),
    steps=80,
)


# --------------------------------------------------------------------------- empty_step

def _rewrapped_loop(fixed: bool):
    def loop(model, opt, ex, steps):
        before, losses = snapshot(model.parameters()), []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            out = model(x)
            if fixed:
                loss = F.mse_loss(out, y)
            else:
                # "element 0 of tensors does not require grad" was silenced by re-wrapping
                value = F.mse_loss(out.detach(), y)
                loss = torch.tensor(value.item(), requires_grad=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses, "changed": changed(before, model.parameters())}
    return loop


REWRAPPED = Case(
    name="loss_rewrapped_requires_grad",
    family="empty_step",
    source="roman-vygon/triplet_loss_kws issue #6 (mean_losses.requires_grad=True 'solved' the "
           "autograd error); speechbrain/speechbrain issue #735 (loss=Variable(loss, "
           "requires_grad=True))",
    description="backward() complained that the loss does not require grad, so I made a new "
                "tensor with requires_grad=True; now training runs but the loss never moves.",
    expected_kinds=("empty_step", "unused_param"),
    params=(),
    manifest=lambda b, f: (not b["changed"]) and f["changed"] and trains(f, 0.3),
    build_buggy=sgd_build(_reg_mlp, lr=0.1, data=linear_regression),
    loop_buggy=_rewrapped_loop(False),
    build_fixed=sgd_build(_reg_mlp, lr=0.1, data=linear_regression),
    loop_fixed=_rewrapped_loop(True),
    steps=40,
)


# --------------------------------------------------------------------------- GradScaler

def _linear(seed):
    torch.manual_seed(seed)
    return nn.Linear(8, 1)


def _scaler_build(make, lr, data=linear_regression):
    def build(seed):
        model = make(seed)
        x, y = data(seed)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        return model, opt, {"x": x, "y": y, "scaler": torch.amp.GradScaler("cpu")}
    return build


def _amp_loop(mode: str):
    """mode: 'good', 'double' (scaler.step then optimizer.step), 'clip_scaled' (clip before
    unscale_), 'clip_good', 'bypass' (optimizer.step on the scaled gradients)."""
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
            if mode == "bypass":
                opt.step()
            else:
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
    build_buggy=_scaler_build(_linear, lr=0.6, data=linear_regression),
    loop_buggy=_amp_loop("double"),
    build_fixed=_scaler_build(_linear, lr=0.6, data=linear_regression),
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
    build_buggy=_scaler_build(_reg_mlp, lr=0.1),
    loop_buggy=_amp_loop("clip_scaled"),
    build_fixed=_scaler_build(_reg_mlp, lr=0.1),
    loop_fixed=_amp_loop("clip_good"),
    steps=40,
)

BYPASS = Case(
    name="optimizer_step_bypasses_scaler",
    family="scaled_grad",
    source="IAHispano/Applio pull request #860 ('You should not use optim.step() directly when "
           "you're working with GradScaler ... you would bypass the necessary gradient scaling "
           "and unscaling steps'); PyTorch AMP examples, 'Typical Mixed Precision Training'",
    description="I added scaler.scale(loss).backward() but kept my optimizer.step(); the loss "
                "jumps to huge values and NaN within a few steps.",
    expected_kinds=("scaled_grad",),
    params=(),
    manifest=lambda b, f: trains(f, 0.2) and worse(b, f, 10.0),
    build_buggy=_scaler_build(_reg_mlp, lr=0.1),
    loop_buggy=_amp_loop("bypass"),
    build_fixed=_scaler_build(_reg_mlp, lr=0.1),
    loop_fixed=_amp_loop("good"),
    steps=30,
)


# --------------------------------------------------------------------------- orphan_param

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


def _unfreeze_build(seed):
    model = mlp(seed)
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.3)
    x, y = classification(seed)
    return model, opt, {"x": x, "y": y}


def _unfreeze_loop(fixed: bool):
    def loop(model, opt, ex, steps):
        body, losses, moved = list(model[0].parameters()), [], None
        for i in range(steps):
            if i == steps // 4:  # gradual unfreezing of the body
                for p in body:
                    p.requires_grad_(True)
                if fixed:
                    opt.add_param_group({"params": body})
                moved = snapshot(body)
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses, "body_changed": changed(moved, body)}
    return loop


UNFREEZE = Case(
    name="unfrozen_after_optimizer_built",
    family="orphan_param",
    source="fastai/fastai issue #2133 ('the optimizer needs to be created again because at "
           "creation, it only takes trainable parameters'); pytorch/pytorch issue #1266 "
           "(filter(lambda p: p.requires_grad, ...) when building the optimizer)",
    description="I fine-tune the head first, then unfreeze the body with requires_grad_(True); "
                "the body's weights never change after unfreezing.",
    expected_kinds=("orphan_param",),
    params=("0.weight", "0.bias"),
    manifest=lambda b, f: (not b["body_changed"]) and f["body_changed"] and trains(f, 0.3),
    build_buggy=_unfreeze_build,
    loop_buggy=_unfreeze_loop(False),
    build_fixed=_unfreeze_build,
    loop_fixed=_unfreeze_loop(True),
    steps=48,
)


class TiedLM(nn.Module):
    """A bigram language model whose output layer shares the embedding's weight."""

    def __init__(self, vocab: int = 16, dim: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.emb(tokens)))


def _tied_build(seed):
    torch.manual_seed(seed)
    model = TiedLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(seed + 3)
    vectors = torch.randn(16, 8, generator=gen) * 0.5  # "pretrained" word vectors
    perm = torch.randperm(16, generator=gen)
    tokens = torch.randint(0, 16, (512,), generator=gen)
    return model, opt, {"vectors": vectors, "x": tokens, "y": perm[tokens]}


def _tied_loop(fixed: bool):
    def loop(model, opt, ex, steps):
        if fixed:
            with torch.no_grad():
                model.emb.weight.copy_(ex["vectors"])
        else:
            model.emb = nn.Embedding.from_pretrained(ex["vectors"], freeze=False)
        emb_before = snapshot([model.emb.weight])
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i, 64)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses, "tied": model.emb.weight is model.head.weight,
                "emb_changed": changed(emb_before, [model.emb.weight])}
    return loop


TIED = Case(
    name="tied_embedding_reassigned",
    family="orphan_param",
    source="huggingface/transformers pull request #43207 / issue #43206 (lm_head not tied to the "
           "embeddings); here the tie is broken by assigning a new nn.Embedding "
           "(from_pretrained) after the optimizer was built",
    description="I load pretrained vectors with model.emb = nn.Embedding.from_pretrained(...) "
                "after creating the optimizer; the embedding never changes and is no longer "
                "tied to the output layer.",
    expected_kinds=("orphan_param",),
    params=("emb.weight",),
    manifest=lambda b, f: (not b["tied"]) and (not b["emb_changed"]) and f["tied"]
    and f["emb_changed"] and trains(f, 0.2),
    build_buggy=_tied_build,
    loop_buggy=_tied_loop(False),
    build_fixed=_tied_build,
    loop_fixed=_tied_loop(True),
    steps=40,
)


# --------------------------------------------------------------------------- no_update

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


# --------------------------------------------------------------------------- foreign_update

def _adam_build(seed):
    model = _linear(seed)
    x, y = linear_regression(seed)
    return model, torch.optim.Adam(model.parameters(), lr=0.05), {"x": x, "y": y}


def _recreate_loop(every: int):
    """Adam re-created every ``every`` steps (0: never) inside the loop."""
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            if every and i % every == 0:
                opt = torch.optim.Adam(model.parameters(), lr=0.05)
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses}
    return loop


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
    build_buggy=_adam_build,
    loop_buggy=_recreate_loop(1),
    build_fixed=_adam_build,
    loop_fixed=_recreate_loop(0),
    steps=80,
)

ADAM_EPOCH = Case(
    name="optimizer_recreated_each_epoch",
    family="foreign_update",
    source="alan-turing-institute/deepsensor issue #47 (train_epoch re-instantiates Adam at the "
           "start of each epoch, losing its moments); jindongwang/transferlearning issue #366",
    description="My train_epoch() function builds its own Adam at the start of every epoch; "
                "after the first epoch the loss jumps at each epoch start.",
    expected_kinds=("foreign_update",),
    params=(),
    manifest=lambda b, f: trains(f, 0.5) and worse(b, f, 1.1),
    build_buggy=_adam_build,
    loop_buggy=_recreate_loop(8),
    build_fixed=_adam_build,
    loop_fixed=_recreate_loop(0),
    steps=80,
)


# --------------------------------------------------------------------------- lr_schedule

def _epoch_sched_build(make_sched, lr=0.1):
    def build(seed):
        model = mlp(seed)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        x, y = classification(seed)
        return model, opt, {"x": x, "y": y, "sched": make_sched(opt)}
    return build


def _per_batch_loop(per_batch: bool, epoch_len: int = 16, plateau: bool = False):
    def loop(model, opt, ex, steps):
        losses, sched = [], ex["sched"]
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            end_of_epoch = (i + 1) % epoch_len == 0
            if per_batch or end_of_epoch:
                if plateau:
                    metric = loss.item() if per_batch else sum(losses[-epoch_len:]) / epoch_len
                    sched.step(metric)
                else:
                    sched.step()
        return {"losses": losses, "lr": opt.param_groups[0]["lr"]}
    return loop


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
    build_buggy=_epoch_sched_build(_steplr),
    loop_buggy=_per_batch_loop(True),
    build_fixed=_epoch_sched_build(_steplr),
    loop_fixed=_per_batch_loop(False),
    steps=80,
)


def _accum_build(seed):
    model = mlp(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = classification(seed)
    return model, opt, {"x": x, "y": y,
                        "sched": torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.95)}


def _accum_loop(per_micro: bool, accum: int = 4):
    def loop(model, opt, ex, steps):
        losses, sched = [], ex["sched"]
        for step in range(steps):
            opt.zero_grad()
            total = 0.0
            for m in range(accum):
                x, y = batch(ex["x"], ex["y"], step * accum + m, 16)
                loss = F.cross_entropy(model(x), y) / accum
                loss.backward()
                total += loss.item()
                if per_micro:
                    sched.step()
            opt.step()
            if not per_micro:
                sched.step()
            losses.append(total)
        return {"losses": losses, "lr": opt.param_groups[0]["lr"]}
    return loop


MICRO = Case(
    name="scheduler_stepped_per_micro_batch",
    family="lr_schedule",
    source="meta-llama/llama-cookbook issue #27 (lr_scheduler.step called every micro-batch: "
           "'a rapid decrease of the learning rate'); Lightning-AI/pytorch-lightning issue #1476",
    description="With gradient accumulation my scheduler steps on every micro-batch; the "
                "learning rate decays accumulation-times faster than planned.",
    expected_kinds=("lr_schedule",),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and worse(b, f, 1.2) and b["lr"] < 1e-2 * f["lr"],
    build_buggy=_accum_build,
    loop_buggy=_accum_loop(True),
    build_fixed=_accum_build,
    loop_fixed=_accum_loop(False),
    steps=40,
)


def _plateau(opt):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.3, patience=1)


PLATEAU = Case(
    name="plateau_stepped_per_batch",
    family="lr_schedule",
    source="Lightning-AI/pytorch-lightning issue #673 ('Correctly using ReduceLROnPlateau': the lr "
           "reduced every few steps); pytorch/pytorch issues #2849, #2850 (step(metric) belongs "
           "after validation, once per epoch)",
    description="I call ReduceLROnPlateau.step(loss) with each batch's loss; the noisy batch "
                "loss 'plateaus' constantly and the learning rate collapses.",
    expected_kinds=("lr_schedule",),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and worse(b, f, 1.2) and b["lr"] < 1e-2 * f["lr"],
    build_buggy=_epoch_sched_build(_plateau),
    loop_buggy=_per_batch_loop(True, plateau=True),
    build_fixed=_epoch_sched_build(_plateau),
    loop_fixed=_per_batch_loop(False, plateau=True),
    steps=80,
)

CASES = [D_STEPS, GAN_ZERO, REWRAPPED, DOUBLE_SCALER, CLIP_SCALED, BYPASS, TWICE, UNFREEZE,
         TIED, WARMUP_INT, ADAM_BATCH, ADAM_EPOCH, STEPLR, MICRO, PLATEAU]
