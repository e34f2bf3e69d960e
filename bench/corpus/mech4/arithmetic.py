"""The fourth corpus's cases of the mechanism 'arithmetic' (bench/corpus/mechanisms.py): the
step's arithmetic (accumulation, averaging, zero_grad placement, clipping), from real reports,
mined by worker a."""
from __future__ import annotations

import copy

import torch
from torch.nn import functional as F

from .._common import (
    Case,
    batch,
    head,
    linear_regression,
    tail,
    trains,
)
from .._m4_a import eval_mse, reg_build, token_data, token_net


# --------------------------------------------------------------------------------------------
# ---- the loop never calls optimizer.zero_grad()

def _no_zero_loop(bug: bool):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            if not bug:
                opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses, "full": eval_mse(model, ex)}
    return loop


NO_ZERO = Case(
    name="example_loop_missing_zero_grad",
    family="arithmetic",
    source="IBM/aihwkit issue #446 ('Missing zero_grad() call': the examples 'are missing a "
           "call to opt.zero_grad() at each iteration ... the loss decrease then increase "
           "again'); wenet-e2e/wekws pull request #73 ('when optimizer.step() is called, "
           "optimizer.zero_grad() is not called')",
    description="I copied the example's loop (forward, backward, opt.step()); the loss goes "
                "down for a few iterations and then climbs back up.",
    expected_kinds=("stale_grad",),
    params=(),
    manifest=lambda b, f: trains(f, 0.5) and b["full"] >= 5.0 * f["full"],
    build_buggy=reg_build(lambda p: torch.optim.SGD(p, lr=0.1), linear_regression),
    loop_buggy=_no_zero_loop(True),
    build_fixed=reg_build(lambda p: torch.optim.SGD(p, lr=0.1), linear_regression),
    loop_fixed=_no_zero_loop(False),
    steps=60,
)


# --------------------------------------------------------------------------------------------
# ---- zero_grad() once per epoch, outside the batch loop

def _epoch_zero_loop(bug: bool, batches_per_epoch: int = 8):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            if bug:
                if i % batches_per_epoch == 0:      # the top of the epoch loop
                    opt.zero_grad()
            else:
                opt.zero_grad()
            x, y = batch(ex["x"], ex["y"], i)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses, "full": eval_mse(model, ex)}
    return loop


EPOCH_ZERO = Case(
    name="zero_grad_once_per_epoch",
    family="arithmetic",
    source="heartcored98/Standalone-DeepLearning issue #11 (the CIFAR-10 lab called "
           "zero_grad() once per epoch: 'shouldn't zero_grad() be called before every "
           "loss.backward()?'; the maintainer fixed 'the same mistake in several lab codes')",
    description="My optimizer.zero_grad() sits at the top of the epoch loop rather than the "
                "batch loop; within each epoch the updates grow and the loss ends far above "
                "where it should.",
    expected_kinds=("stale_grad",),
    params=(),
    manifest=lambda b, f: trains(f, 0.5) and b["full"] >= 5.0 * f["full"],
    build_buggy=reg_build(lambda p: torch.optim.SGD(p, lr=0.1), linear_regression),
    loop_buggy=_epoch_zero_loop(True),
    build_fixed=reg_build(lambda p: torch.optim.SGD(p, lr=0.1), linear_regression),
    loop_fixed=_epoch_zero_loop(False),
    steps=64,
)


# --------------------------------------------------------------------------------------------
# ---- max_grad_norm = -1 meant "no clipping", passed straight to clip_grad_norm_

def _neg_clip_loop(bug: bool, max_grad_norm: float = -1.0):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            if bug or max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            opt.step()
            losses.append(loss.item())
        return {"losses": losses, "full": eval_mse(model, ex)}
    return loop


NEG_CLIP = Case(
    name="clip_grad_norm_negative_meant_off",
    family="arithmetic",
    source="pytorch/pytorch issue #31367 ('clip_grad_norm allows negative max_norm values': "
           "'it will fail silently and even worse, reverse all the gradients'); "
           "pytorch/torchtitan pull request #4295 ('[Bug] Reject negative training.max_norm': "
           "'A negative value does not disable clipping ... can reverse every gradient "
           "direction before the optimizer step')",
    description="I set max_norm to -1 in the config to switch gradient clipping off; the run "
                "finishes without an error but the loss rises instead of falling.",
    expected_kinds=("applied_grad",),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and tail(b["losses"]) > head(b["losses"])
    and b["full"] >= 2.0 * f["full"],
    build_buggy=reg_build(lambda p: torch.optim.SGD(p, lr=0.05), linear_regression),
    loop_buggy=_neg_clip_loop(True),
    build_fixed=reg_build(lambda p: torch.optim.SGD(p, lr=0.05), linear_regression),
    loop_fixed=_neg_clip_loop(False),
    steps=40,
)


# --------------------------------------------------------------------------------------------
# ---- accumulation averages per-micro-batch token means (length-grouped micro-batches)

def _window_grads(model, xs, ys, ms):
    """The gradient of the token-mean loss over the whole accumulation window (reference)."""
    ref = copy.deepcopy(model)
    total, count = 0.0, 0.0
    for x, y, m in zip(xs, ys, ms):
        per_tok = F.cross_entropy(ref(x).flatten(0, 1), y.flatten(), reduction="none")
        total = total + (per_tok * m.flatten()).sum()
        count += m.sum().item()
    grads = torch.autograd.grad(total / count, list(ref.parameters()))
    return torch.cat([g.flatten() for g in grads])


def _token_accum_loop(bug: bool, accum: int = 4, size: int = 8):
    def loop(model, opt, ex, steps):
        losses, grad_err = [], None
        X, Y, M = ex["x"], ex["y"], ex["mask"]
        n = X.shape[0]
        for step in range(steps):
            idx = [torch.arange(((step * accum + k) * size) % n, ((step * accum + k) * size) % n
                                + size) % n for k in range(accum)]
            xs, ys, ms = [X[i] for i in idx], [Y[i] for i in idx], [M[i] for i in idx]
            if step == 0:
                reference = _window_grads(model, xs, ys, ms)
            opt.zero_grad()
            n_tokens = sum(m.sum() for m in ms)
            logged = 0.0
            for x, y, m in zip(xs, ys, ms):
                per_tok = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none")
                if bug:       # the model's own loss: the mean over this micro-batch's tokens
                    loss = (per_tok * m.flatten()).sum() / m.sum() / accum
                else:         # normalised by the tokens of the whole accumulation window
                    loss = (per_tok * m.flatten()).sum() / n_tokens
                loss.backward()
                logged += loss.item()
            if step == 0:
                applied = torch.cat([p.grad.flatten() for p in model.parameters()])
                grad_err = ((applied - reference).norm() / reference.norm()).item()
            opt.step()
            losses.append(logged)
        return {"losses": losses, "grad_err": grad_err}
    return loop


def _token_build(seed):
    model = token_net(seed)
    x, y, mask = token_data(seed)
    return model, torch.optim.SGD(model.parameters(), lr=0.5), {"x": x, "y": y, "mask": mask}


TOKEN_ACCUM = Case(
    name="accum_mean_of_micro_batch_token_means",
    family="arithmetic",
    source="huggingface/transformers issue #24725 ('Sum loss instead of mean loss should be "
           "used if gradient accumulation step is larger than 1': 'the gradient accumulation "
           "macro-averages the loss scores, but they should be micro-averaged') and pull "
           "request #34191 ('Fix Gradient Accumulation issue'); karpathy/nanochat pull request "
           "#59 ('gradients were scaled by grad_accum_steps assuming equal tokens per batch')",
    description="With length-grouped batches and 4 accumulation steps I divide each "
                "micro-batch's mean token loss by 4; the accumulated gradient is not the one "
                "the same tokens give as a single batch.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.2) and b["grad_err"] >= 0.15 and f["grad_err"] <= 1e-4,
    build_buggy=_token_build,
    loop_buggy=_token_accum_loop(True),
    build_fixed=_token_build,
    loop_fixed=_token_accum_loop(False),
    steps=30,
)


CASES = [NO_ZERO, EPOCH_ZERO, NEG_CLIP, TOKEN_ACCUM]
