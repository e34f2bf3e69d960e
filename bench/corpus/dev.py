"""The dev half of the silent-bug corpus: develop detection code against these cases only."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from ._common import (
    Case,
    any_nonfinite,
    batch,
    changed,
    classification,
    linear_regression,
    mlp,
    sgd_build,
    snapshot,
    tail,
    trains,
    worse,
)
from ._shared import (
    BACKBONE,
    _backbone,
    adam_build,
    build_model,
    ce_case,
    clf_build,
    clf_loop,
    epoch_sched_build,
    evaluate,
    looping,
    per_batch_loop,
    recreate_loop,
    reg_mlp,
    scaler_build,
    worse_true,
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
    build_buggy=sgd_build(reg_mlp, lr=0.1, data=linear_regression),
    loop_buggy=_rewrapped_loop(False),
    build_fixed=sgd_build(reg_mlp, lr=0.1, data=linear_regression),
    loop_fixed=_rewrapped_loop(True),
    steps=40,
)


def _amp_loop(mode: str):
    """mode: 'good' or 'bypass' (optimizer.step on the scaled gradients)."""
    def loop(model, opt, ex, steps):
        scaler, losses = ex["scaler"], []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            loss = F.mse_loss(out.float(), y)
            scaler.scale(loss).backward()
            if mode == "bypass":
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            losses.append(loss.item())
        return {"losses": losses}
    return loop


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
    build_buggy=scaler_build(reg_mlp, lr=0.1),
    loop_buggy=_amp_loop("bypass"),
    build_fixed=scaler_build(reg_mlp, lr=0.1),
    loop_fixed=_amp_loop("good"),
    steps=30,
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
    build_buggy=adam_build,
    loop_buggy=recreate_loop(8),
    build_fixed=adam_build,
    loop_fixed=recreate_loop(0),
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
    build_buggy=epoch_sched_build(_plateau),
    loop_buggy=per_batch_loop(True, plateau=True),
    build_fixed=epoch_sched_build(_plateau),
    loop_fixed=per_batch_loop(False, plateau=True),
    steps=80,
)


class ListNet(nn.Module):
    """Hidden layers kept in a Python list (buggy) or an nn.ModuleList (fixed)."""

    def __init__(self, registered: bool):
        super().__init__()
        self.inp = nn.Linear(10, 32)
        hidden = [nn.Linear(32, 32) for _ in range(2)]
        self.hidden = nn.ModuleList(hidden) if registered else hidden
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        for layer in self.hidden:
            h = torch.relu(layer(h))
        return self.out(h)


def _hidden_weights(model):
    return [layer.weight for layer in model.hidden]


LIST = Case(
    name="layers_in_python_list",
    family="hidden_param",
    source="pytorch/pytorch issues #666 ('nn.Module not importing parameters contained in lists') "
           "and #715, #38639 (parameters in a Python list 'get invisible and hence can't be seen "
           "by the optimizer')",
    description="I keep my hidden layers in a plain list so the depth is configurable; the "
                "network trains worse than expected and the hidden weights never change.",
    expected_kinds=("hidden_param",),
    params=(),
    manifest=lambda b, f: (not b["changed"]) and f["changed"] and trains(f, 0.3),
    build_buggy=build_model(lambda: ListNet(False), lr=0.3),
    loop_buggy=looping(watch_params=_hidden_weights),
    build_fixed=build_model(lambda: ListNet(True), lr=0.3),
    loop_fixed=looping(watch_params=_hidden_weights),
    steps=60,
)


class InForward(nn.Module):
    """The middle layer built inside forward (buggy) or in __init__ (fixed)."""

    def __init__(self, in_init: bool):
        super().__init__()
        self.inp = nn.Linear(10, 32)
        self.mid = nn.Linear(32, 32) if in_init else None
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        mid = self.mid if self.mid is not None else nn.Linear(32, 32)
        return self.out(torch.relu(mid(h)))


FORWARD_LAYER = Case(
    name="layer_created_in_forward",
    family="hidden_param",
    source="pytorch/pytorch issue #1291 (layers created in forward() are missing from "
           "list(model.parameters()))",
    description="I create a Linear inside forward(); the loss is noisy and stays high.",
    expected_kinds=("hidden_param",),
    params=(),
    manifest=lambda b, f: trains(f, 0.3) and worse(b, f, 1.5),
    build_buggy=build_model(lambda: InForward(False), lr=0.3),
    loop_buggy=looping(),
    build_fixed=build_model(lambda: InForward(True), lr=0.3),
    loop_fixed=looping(),
    steps=60,
)


def _dropout_net():
    return nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 4))


def _validate_at(step, restore):
    def hook(model, i, ex):
        if i == step:
            model.eval()
            with torch.no_grad():
                F.cross_entropy(model(ex["x"]), ex["y"])
            if restore:
                model.train()
    return hook


def _mode_manifest(b, f):
    """The buggy run trained in eval mode after validation (the fixed one never did), and
    its training loss left the fixed run's: the dropout it was meant to train with is gone."""
    start = b["modes"].index(False)
    return (all(f["modes"]) and start > 0 and not any(b["modes"][start:])
            and tail(b["losses"], 10) <= 0.9 * tail(f["losses"], 10))


EVAL_VALIDATION = Case(
    name="eval_not_undone_after_validation",
    family="eval_mode",
    source="fartashf/vsepp issue #4 ('Finish validation without running model.train()'; "
           "results changed noticeably once fixed); tk-rusch/coRNN issue #1; Na-Z/attMPTI issue #16",
    description="After the mid-epoch validation my training loss suddenly drops; validation "
                "calls model.eval() and nothing calls model.train() again.",
    expected_kinds=("eval_mode",),
    params=(),
    manifest=_mode_manifest,
    build_buggy=build_model(_dropout_net),
    loop_buggy=looping(hook=_validate_at(15, restore=False)),
    build_fixed=build_model(_dropout_net),
    loop_fixed=looping(hook=_validate_at(15, restore=True)),
    steps=60,
)


class Frozen(nn.Module):
    """A backbone and a head; ``mode`` says how the backbone's output reaches the head."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.backbone = nn.Sequential(nn.Linear(10, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        if self.mode == "no_grad":
            with torch.no_grad():
                h = self.backbone(x)
        else:
            h = self.backbone(x)
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


NO_GRAD = _cut_case(
    "backbone_under_no_grad", "no_grad", "plain",
    "open-mmlab/OpenPCDet issue #845 (torch.no_grad around a backbone's forward freezes it, "
    "whatever the optimizer holds); the inverse mistake: a no_grad kept for speed around a "
    "backbone meant to be fine-tuned",
    "I wrapped the feature extractor's forward in torch.no_grad() to save memory; fine-tuning "
    "gives the same result as training the head alone.")


class Quantised(nn.Module):
    """An encoder whose output is rounded to quarter steps (a hard quantiser)."""

    def __init__(self, straight_through: bool):
        super().__init__()
        self.straight_through = straight_through
        self.enc = nn.Linear(10, 16)
        self.dec = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.enc(x))
        q = torch.round(h * 4) / 4
        if self.straight_through:
            q = h + (q - h).detach()
        return self.dec(q)


ROUND = Case(
    name="round_quantization_in_forward",
    family="unused_param",
    source="torch/nn issue #1174 ('The gradient is 0 everywhere; you cannot train the layers "
           "before this'); Justin-Tan/generative-compression issue #27 (encoder not updated "
           "through round())",
    description="I quantise my encoder's output with torch.round; the encoder's weights never "
                "change, its gradient is exactly zero.",
    expected_kinds=("dead_grad", "unused_param"),
    params=("enc.weight", "enc.bias"),
    manifest=lambda b, f: (not b["changed"]) and f["changed"] and trains(f, 0.2),
    build_buggy=build_model(lambda: Quantised(False), lr=0.2),
    loop_buggy=looping(watch_params=lambda m: list(m.enc.parameters())),
    build_fixed=build_model(lambda: Quantised(True), lr=0.2),
    loop_fixed=looping(watch_params=lambda m: list(m.enc.parameters())),
    steps=40,
)


def _deep(init: str):
    def make():
        net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                            nn.Linear(32, 4))
        if init == "negative_bias":
            nn.init.constant_(net[0].bias, -4.0)  # "a negative bias for sparse activations"
            with torch.no_grad():
                net[0].weight.mul_(0.5)
        return net
    return make


NEG_BIAS = Case(
    name="negative_bias_dead_relu",
    family="dead_grad",
    source="PyTorch forum thread 'Cross Entropy loss is not decreasing' (43814, post 16: "
           "'parameters ... almost all negative, and their derivatives are all zero' with ReLU)",
    description="I initialised the first layer's bias negative; the loss sits at log(classes) "
                "and the first layers' gradients are all exactly zero.",
    expected_kinds=("dead_grad",),
    params=("0.weight", "0.bias", "2.weight", "2.bias"),
    manifest=lambda b, f: (not b["changed"]) and trains(f, 0.3) and worse(b, f, 1.3),
    build_buggy=build_model(_deep("negative_bias"), lr=0.3),
    loop_buggy=looping(watch_params=lambda m: [m[0].weight, m[0].bias, m[2].weight]),
    build_fixed=build_model(_deep("default"), lr=0.3),
    loop_fixed=looping(watch_params=lambda m: [m[0].weight, m[0].bias, m[2].weight]),
    steps=60,
)


NLL_RAW = ce_case(
    "nll_loss_on_raw_logits", nn.Identity, F.nll_loss,
    "pytorch/pytorch pull request #12703 ('Fix missing final activation in NLLLoss second "
    "example': without LogSoftmax 'the loss was sometimes negative'); keon/seq2seq pull "
    "request #5",
    "I feed my model's raw outputs to NLLLoss; the loss goes more and more negative while "
    "the predictions get no better.", steps=40, lr=0.3,
    manifest=lambda b, f: (trains(f, 0.3) and tail(b["losses"]) < -5
                           and b["accuracy"] <= f["accuracy"] - 0.05))


def _imbalanced(seed):
    """Classes with unequal frequencies: the per-class bias matters."""
    return classification(seed, prior=(2.0, 0.5, -0.5, -1.5))


LOG_SOFTMAX_DIM0 = Case(
    name="log_softmax_over_batch_dim",
    family="loss_pattern",
    source="fxia22/pointnet.pytorch issue #27 (F.log_softmax(x, dim=0) over the batch); "
           "ikostrikov/pytorch-meta-optimizer issue #10; ctallec/world-models issue #10",
    description="My model returns F.log_softmax(x, dim=0) and I train with NLLLoss; the "
                "accuracy stays poor.",
    expected_kinds=("loss_pattern",),
    params=(),
    manifest=worse_true(ratio=1.2, acc_gap=0.05),
    build_buggy=clf_build(lambda: nn.LogSoftmax(dim=0), data=_imbalanced),
    loop_buggy=clf_loop(F.nll_loss),
    build_fixed=clf_build(lambda: nn.LogSoftmax(dim=1), data=_imbalanced),
    loop_fixed=clf_loop(F.nll_loss),
    steps=60,
)


def _raw_features(seed):
    x, y = classification(seed, scale=100.0)  # unscaled sensor readings
    return x, y


def _log_softmax_loop(stable: bool):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            logits = model(x)
            logp = F.log_softmax(logits, 1) if stable else torch.log(F.softmax(logits, 1))
            loss = F.nll_loss(logp, y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses}
    return loop


LOG_OF_SOFTMAX = Case(
    name="log_of_softmax_nan",
    family="loss_pattern",
    source="pytorch/pytorch issue #1620 (torch.log(nn.Softmax(x)) instead of nn.LogSoftmax: "
           "'the gradient sometimes get nan'); summerlvsong/Aggregation-Cross-Entropy issue #2",
    description="I compute torch.log(F.softmax(logits)) and NLLLoss myself; on my raw features "
                "the loss is inf or NaN from the first steps on.",
    expected_kinds=("loss_pattern", "nonfinite"),
    params=(),
    manifest=lambda b, f: any_nonfinite(b["losses"]) and trains(f, 0.3),
    build_buggy=clf_build(nn.Identity, lr=0.003, data=_raw_features),
    loop_buggy=_log_softmax_loop(False),
    build_fixed=clf_build(nn.Identity, lr=0.003, data=_raw_features),
    loop_fixed=_log_softmax_loop(True),
    steps=40,
)


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
        true, acc = evaluate(model, ex["x"], ex["y"])
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
    expected_kinds=("module_setup",),
    params=("backbone.0.weight", "backbone.0.bias"),
    manifest=lambda b, f: b["backbone_changed"] and not f["backbone_changed"] and trains(f, 0.2),
    build_buggy=_freeze_build(False),
    loop_buggy=_freeze_loop,
    build_fixed=_freeze_build(True),
    loop_fixed=_freeze_loop,
    steps=40,
)

CASES = [GAN_ZERO, REWRAPPED, BYPASS, UNFREEZE, TIED, LIST, FORWARD_LAYER, ADAM_EPOCH, EVAL_VALIDATION, NO_GRAD, ROUND, NLL_RAW, LOG_SOFTMAX_DIM0, LOG_OF_SOFTMAX, NEG_BIAS, MICRO, PLATEAU, SHUFFLED, FREEZE_NOOP]
