"""Held-out cases of the second corpus, mechanism "data" (see mechanisms.py)."""
from __future__ import annotations

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

from .._common import Case, batch, linear_regression, trains
from .._mech_d import full_eval, opt_build, reg_net


def _loader_loop(make_loader, full_loss=F.cross_entropy):
    """Train on the batches ``make_loader(ex)`` yields (re-iterated per epoch); record the
    loss on the whole data set at the end."""
    def loop(model, opt, ex, steps):
        loader = make_loader(ex)
        losses, it = [], iter(loader)
        for i in range(steps):
            try:
                x, y = next(it)
            except StopIteration:
                it = iter(loader)
                x, y = next(it)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses, "full_loss": full_eval(model, ex["x"], ex["y"], full_loss)}
    return loop


def _weighted_loader(per_sample: bool):
    def make(ex):
        y = ex["y"]
        counts = torch.bincount(y, minlength=4).clamp(min=1).double()
        class_w = 1.0 / counts
        weights = class_w[y] if per_sample else class_w  # the bug: one weight per class
        gen = torch.Generator().manual_seed(7)
        sampler = WeightedRandomSampler(weights, num_samples=len(y), replacement=True,
                                        generator=gen)
        return DataLoader(TensorDataset(ex["x"], y), batch_size=32, sampler=sampler)
    return make


DATA_WEIGHTED = Case(
    name="weighted_sampler_given_class_weights",
    family="data",
    source="deep-voice/soundbay pull request #49 ('WeightedRandomSampler ... assigns weights to "
           "each sample and so it actually will choose the same samples (The first and second "
           "with the probabilities we assigned)'); pytorch/pytorch pull request #980 (the "
           "sampler 'Samples elements from [0,..,len(weights)-1]')",
    description="To balance classes I passed the four per-class weights to "
                "WeightedRandomSampler; the training loss goes to zero but the model is poor on "
                "the data set.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.3) and b["full_loss"] >= 1.5 * f["full_loss"],
    build_buggy=opt_build(),
    loop_buggy=_loader_loop(_weighted_loader(False)),
    build_fixed=opt_build(),
    loop_fixed=_loader_loop(_weighted_loader(True)),
    steps=60,
)


def _first_batch_loop(fresh_iter_each_step: bool):
    def loop(model, opt, ex, steps):
        loader = DataLoader(TensorDataset(ex["x"], ex["y"]), batch_size=32, shuffle=False)
        losses, it = [], iter(loader)
        for i in range(steps):
            if fresh_iter_each_step:
                x, y = next(iter(loader))  # the bug: a new iterator, so always the first batch
            else:
                try:
                    x, y = next(it)
                except StopIteration:
                    it = iter(loader)
                    x, y = next(it)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses, "full_loss": full_eval(model, ex["x"], ex["y"])}
    return loop


DATA_FIRST_BATCH = Case(
    name="next_iter_loader_every_step",
    family="data",
    source="leohsuofnthu/Pytorch-IterativeFCN issue #7 ('you use next(iter(train_loader)) to "
           "fetch the patches every iteration ... next() would return the first element of the "
           "iterator every time'); skhu101/GM-NAS issue #4 ('input, target = "
           "next(iter(train_queue)) inside the batches for loop')",
    description="My loop takes each batch with next(iter(train_loader)); the training loss "
                "drops fast, but the model does badly on the rest of the data.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.3) and b["full_loss"] >= 1.4 * f["full_loss"],
    build_buggy=opt_build(lr=0.2),
    loop_buggy=_first_batch_loop(True),
    build_fixed=opt_build(lr=0.2),
    loop_fixed=_first_batch_loop(False),
    steps=60,
)


def _target_dtype_build(dtype):
    def build(seed):
        model = reg_net(seed)
        x, y = linear_regression(seed)
        y = 1.5 * y  # targets of order one
        return (model, torch.optim.SGD(model.parameters(), lr=0.05),
                {"x": x, "y_true": y, "y": torch.tensor(y.tolist(), dtype=dtype)})
    return build


def _target_dtype_loop(model, opt, ex, steps):
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y.float())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "true_mse": full_eval(model, ex["x"], ex["y_true"], F.mse_loss)}


DATA_LONG = Case(
    name="regression_targets_stored_as_long",
    family="data",
    source="deepset-ai/FARM issue #395 ('Regression label float to int conversion bug': 'Silent "
           "error, all my regression labels are being converted to longs'); amaiya/ktrain issue "
           "#129 ('The ground truth for my case lies between 0 and 1. Casting to tf.int64 makes "
           "all target zero'); srinidhiPY/SSL_CR_Histo issue #5 (target = target.long())",
    description="My dataset builds the regression labels with torch.tensor(labels, "
                "dtype=torch.long); training runs and the loss drops, but predictions are far "
                "from the real targets.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.3) and b["true_mse"] >= 2.0 * f["true_mse"],
    build_buggy=_target_dtype_build(torch.long),
    loop_buggy=_target_dtype_loop,
    build_fixed=_target_dtype_build(torch.float32),
    loop_fixed=_target_dtype_loop,
    steps=60,
)


CASES = [DATA_WEIGHTED, DATA_FIRST_BATCH, DATA_LONG]
