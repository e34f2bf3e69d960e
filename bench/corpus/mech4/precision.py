"""The fourth corpus, mechanism "precision" (bench/corpus/mechanisms.py: autocast, fp16/bf16,
GradScaler, casts of weights). Held out: do not run these under graddbg."""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

from .._common import (
    Case,
    any_nonfinite,
    batch,
    classification,
    mlp,
    regression,
    trains,
    worse,
)

CASES = []

# ---- ema_copy_kept_in_bf16


def _ema_build(seed):
    model = mlp(seed)
    x, y = classification(seed)
    return model, torch.optim.Adam(model.parameters(), lr=0.01), {"x": x, "y": y}


def _ema_loop(ema_dtype, decay=0.999):
    def loop(model, opt, ex, steps):
        ema = copy.deepcopy(model).to(ema_dtype)  # ema_unet = EMAModel(unet.to(weight_dtype))
        ema.requires_grad_(False)
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            with torch.no_grad():  # EMAModel.step: s -= (1 - decay) * (s - p)
                for s, p in zip(ema.parameters(), model.parameters()):
                    s.sub_((1 - decay) * (s - p.to(s.dtype)))
            losses.append(loss.item())
        with torch.no_grad():
            ema_loss = F.cross_entropy(ema.float()(ex["x"]), ex["y"]).item()
            full = F.cross_entropy(model(ex["x"]), ex["y"]).item()
        return {"losses": losses, "ema_loss": ema_loss, "full": full}
    return loop


CASES.append(Case(
    name="ema_copy_kept_in_bf16",
    family="precision",
    source="d8ahazard/sd_dreambooth_extension pull requests #1415 and #1417 ('Due to lack of "
           "precision, in fp16/bf16 updates to EMA weights will almost always be rounded to 0, "
           "meaning the EMA weights never change'); AndreasBergmeister/ram issue #6 ('Small EMA "
           "increments are therefore rounded away, so these adapters track the trainable "
           "adapter in quantized jumps')",
    description="I keep my EMA copy of the model in bf16 (the weight dtype) to save memory; "
                "training goes fine, but the EMA model I evaluate and save is barely better "
                "than the untrained one.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.3) and b["ema_loss"] >= 1.5 * f["ema_loss"],
    build_buggy=_ema_build,
    loop_buggy=_ema_loop(torch.bfloat16),
    build_fixed=_ema_build,
    loop_fixed=_ema_loop(torch.float32),
    steps=500,
))

# ---- gradient_penalty_on_scaled_gradients


def _gp_build(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
    x, y = regression(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.03)
    return model, opt, {"x": x, "y": y, "scaler": torch.amp.GradScaler("cpu")}


def _gp_loop(unscale, lam=0.05):
    def loop(model, opt, ex, steps):
        scaler, losses = ex["scaler"], []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            x = x.clone().requires_grad_(True)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            out = out.float()
            mse = F.mse_loss(out, y)
            grad_x, = torch.autograd.grad(scaler.scale(out.sum()), x, create_graph=True)
            if unscale:  # the amp recipe: unscale the out-of-place gradients first
                grad_x = grad_x * (1.0 / scaler.get_scale())
            penalty = grad_x.pow(2).sum(1).mean()
            loss = mse + lam * penalty
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(mse.item())
        with torch.no_grad():
            full = F.mse_loss(model(ex["x"]), ex["y"]).item()
        return {"losses": losses, "full": full}
    return loop


CASES.append(Case(
    name="gradient_penalty_on_scaled_gradients",
    family="precision",
    source="lucidrains/stylegan2-pytorch pull requests #101 and #103 (mixed precision: 'I keep "
           "getting gradient overflows ... gradient penalty might not work, weights need to be "
           "unscaled for it') and issue #100 ('weird behavior when trying to use amp'); "
           "pytorch/pytorch pull request #44667 ('Small clarification to amp gradient penalty "
           "example', from the PyTorch forum thread 'What is the correct way of computing a grad "
           "penalty using AMP')",
    description="I added a gradient penalty on the input gradients to my mixed-precision loop "
                "with a GradScaler; the fit got far worse, as if the penalty swamped everything "
                "else.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and b["full"] >= 1.5 * f["full"],
    build_buggy=_gp_build,
    loop_buggy=_gp_loop(False),
    build_fixed=_gp_build,
    loop_fixed=_gp_loop(True),
    steps=60,
))

# ---- attention_mask_filled_with_minus_inf

PAD, VOCAB, LEN = 10, 10, 8


class _TinyCausalLM(nn.Module):
    def __init__(self, mask_value):
        super().__init__()
        self.emb = nn.Embedding(VOCAB + 1, 16)
        self.pos = nn.Embedding(LEN, 16)
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, VOCAB)
        self.mask_value = mask_value

    def forward(self, tokens):
        h = self.emb(tokens) + self.pos.weight
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / 4.0
        causal = torch.ones(LEN, LEN, dtype=torch.bool).tril()
        allowed = causal & (tokens != PAD)[:, None, :]  # left padding: keys that are real
        scores = scores.masked_fill(~allowed, self.mask_value)
        att = scores.float().softmax(-1)
        return self.out(h + att.to(v.dtype) @ v)


def _left_padded(seed, n=256):
    gen = torch.Generator().manual_seed(seed + 9500)
    seq = torch.randint(0, VOCAB, (n, LEN), generator=gen)
    pads = torch.randint(0, 4, (n,), generator=gen)
    seq[torch.arange(LEN)[None, :] < pads[:, None]] = PAD
    # the target at each real position: the largest token seen so far (needs attention)
    real = seq.masked_fill(seq == PAD, -1)
    target = real.cummax(1).values
    return seq, target


def _mask_build(mask_value):
    def build(seed):
        torch.manual_seed(seed)
        model = _TinyCausalLM(mask_value)
        tokens, target = _left_padded(seed)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        return model, opt, {"x": tokens, "y": target, "scaler": torch.amp.GradScaler("cpu")}
    return build


def _mask_loop(model, opt, ex, steps):
    scaler, losses = ex["scaler"], []
    for i in range(steps):
        tokens, target = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(tokens)
        real = (tokens != PAD).float()
        ce = F.cross_entropy(logits.float().reshape(-1, VOCAB), target.clamp(min=0).reshape(-1),
                             reduction="none").reshape(tokens.shape)
        loss = (ce * real).sum() / real.sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return {"losses": losses}


CASES.append(Case(
    name="attention_mask_filled_with_minus_inf",
    family="precision",
    source="bentrevett/pytorch-seq2seq issue #191 (under 16-bit precision 'The -1e10 can't be "
           "converted to half', so the mask became -float('inf'); 'Upon experimentation - it "
           "seems that -float(inf) can actually cause a lot of NaN loss! So - the safe way to go "
           "about this is to use -1e4'); NVIDIA/apex issue #93 ('when training with float16 and "
           "masking with -1e15, amp loss scaling always returns NaN for gradients'); "
           "huggingface/transformers pull request #17437",
    description="To run my attention under fp16 I replaced the -1e10 mask value, which no longer "
                "fits in half precision, by float('-inf'); now the loss is NaN from the first "
                "step on and the model never trains.",
    expected_kinds=("nonfinite",),
    params=(),
    # note: the NaN comes from left-padded rows whose causal window holds padding only (a row of
    # -inf); the precision part is why the user switched from -1e10 to -inf
    manifest=lambda b, f: any_nonfinite(b["losses"]) and trains(f, 0.3),
    build_buggy=_mask_build(float("-inf")),
    loop_buggy=_mask_loop,
    build_fixed=_mask_build(-1e4),
    loop_fixed=_mask_loop,
    steps=60,
))

# ---- class_labels_cast_to_bf16


def _many_classes(seed, n=2048, d=32, c=1001):  # ImageNet's 1000 + background
    gen = torch.Generator().manual_seed(seed + 9600)
    protos = torch.randn(c, d, generator=gen)
    y = torch.randint(0, c, (n,), generator=gen)
    return protos[y] + 0.3 * torch.randn(n, d, generator=gen), y


def _labels_build(seed):
    torch.manual_seed(seed)
    model = nn.Linear(32, 1001)
    x, y = _many_classes(seed)
    return model, torch.optim.Adam(model.parameters(), lr=0.05), {"x": x, "y": y}


def _labels_loop(cast_labels):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i, 128)
            # the collate step moves the whole batch to the compute dtype
            x = x.to(torch.bfloat16)
            if cast_labels:
                y = y.to(torch.bfloat16)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float(), y.long())
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            pred = model(ex["x"].to(torch.bfloat16)).float().argmax(1)
        return {"losses": losses, "acc": (pred == ex["y"]).float().mean().item()}
    return loop


CASES.append(Case(
    name="class_labels_cast_to_bf16",
    family="precision",
    source="keras-team/keras issue #15012 and tensorflow/tensorflow issue #50964 "
           "('SparseCategoricalCrossentropy and Mixed Precision Training': the integer labels "
           "are cast to the prediction dtype; 'the loss in precision causes incorrect encodings "
           "or labels outside the domain ... With float16, issues start with a couple thousand "
           "labels and a couple hundred labels with bfloat16'); tensorflow/tensorflow pull "
           "request #51053",
    description="With 1001 classes and bf16 training, my batches (labels included) are moved to "
                "bfloat16 and turned back into integers for the loss; the model trains, but "
                "accuracy stalls around half, with most classes above 256 never predicted.",
    expected_kinds=(),
    params=(),
    # note: written in PyTorch after a Keras/TF report: the label cast rounds class ids above 256
    manifest=lambda b, f: trains(f, 0.3) and b["acc"] <= 0.75 * f["acc"],
    build_buggy=_labels_build,
    loop_buggy=_labels_loop(True),
    build_fixed=_labels_build,
    loop_fixed=_labels_loop(False),
    steps=40,
))

# ---- fp16_branch_warmup_given_progress_fraction


class _WarmupLinearSchedule:
    """pytorch_pretrained_bert's schedule: ``get_lr(step)`` takes the optimizer step."""

    def __init__(self, warmup, t_total):
        self.warmup, self.t_total = warmup, t_total

    def get_lr(self, step):
        progress = step / self.t_total
        if progress < self.warmup:
            return progress / self.warmup
        return max((progress - 1.0) / (self.warmup - 1.0), 0.0)


def _warm_build(seed):
    model = mlp(seed)
    x, y = classification(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)  # FusedAdam: no built-in schedule
    return model, opt, {"x": x, "y": y, "scaler": torch.amp.GradScaler("cpu")}


def _warm_loop(pass_fraction, base_lr=0.02, warmup=0.1):
    def loop(model, opt, ex, steps):
        scaler, losses = ex["scaler"], []
        warmup_linear = _WarmupLinearSchedule(warmup=warmup, t_total=steps)
        for global_step in range(steps):
            x, y = batch(ex["x"], ex["y"], global_step)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(x)
            loss = F.cross_entropy(logits.float(), y)
            scaler.scale(loss).backward()
            # args.fp16: modify learning rate with special warm up BERT uses
            arg = global_step / steps if pass_fraction else global_step
            lr_this_step = base_lr * warmup_linear.get_lr(arg)
            for group in opt.param_groups:
                group["lr"] = lr_this_step
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
        return {"losses": losses}
    return loop


CASES.append(Case(
    name="fp16_branch_warmup_given_progress_fraction",
    family="precision",
    source="huggingface/transformers issue #566 ('Bug in run_classifier.py fp16 learning rate': "
           "'low and decreasing accuracy when I use fp16') and pull request #598 ('removing "
           "division to num_train_optimization_steps for new WarmupLinearSchedule')",
    description="Fine-tuning with --fp16, where the script sets the warmup learning rate by hand "
                "because the fp16 optimizer has no schedule, my loss hardly moves, while the "
                "fp32 run trains fine.",
    expected_kinds=(),
    params=(),
    # note: the bug lives only in the fp16 code path (FusedAdam + loss scaling, lr set by hand);
    # its mechanism is the warmup schedule fed a progress fraction instead of the step
    manifest=lambda b, f: trains(f, 0.4) and worse(b, f, 1.5),
    build_buggy=_warm_build,
    loop_buggy=_warm_loop(True),
    build_fixed=_warm_build,
    loop_fixed=_warm_loop(False),
    steps=60,
))
