"""Dev cases of the second corpus, mechanism "data" (see mechanisms.py)."""
from __future__ import annotations

import math

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from .._common import Case, classification, mlp
from .._mech_d import full_eval


def _sorted_build(seed):
    model = mlp(seed)
    x, y = classification(seed)
    order = torch.argsort(y, stable=True)  # the files come grouped by class
    return model, torch.optim.SGD(model.parameters(), lr=1.0), {"x": x[order], "y": y[order]}


def _sorted_loop(shuffle: bool):
    def loop(model, opt, ex, steps):
        gen = torch.Generator().manual_seed(11)
        loader = DataLoader(TensorDataset(ex["x"], ex["y"]), batch_size=32, shuffle=shuffle,
                            generator=gen if shuffle else None)
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
        with torch.no_grad():
            acc = (model(ex["x"]).argmax(1) == ex["y"]).float().mean().item()
        return {"losses": losses, "full_loss": full_eval(model, ex["x"], ex["y"]),
                "accuracy": acc}
    return loop


DATA_SORTED = Case(
    name="class_sorted_data_not_shuffled",
    family="data",
    source="Deci-AI/super-gradients issue #416 ('Default dataloader params have shuffle=False': "
           "'it makes NN see only examples of a single class which quickly throws it out of "
           "the minima'); zalandoresearch/fashion-mnist pull request #5 (the files were sorted "
           "by label: 'if people forget to shuffle ... learning algorithms may fail')",
    description="My data set is stored class by class and the DataLoader has shuffle=False; "
                "the loss jumps at every class boundary and the final model mostly predicts "
                "one class.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (f["full_loss"] < 0.5 * math.log(4) and b["full_loss"] >= 1.8 * f["full_loss"]
                           and b["accuracy"] <= f["accuracy"] - 0.04),
    build_buggy=_sorted_build,
    loop_buggy=_sorted_loop(False),
    build_fixed=_sorted_build,
    loop_fixed=_sorted_loop(True),
    steps=60,
)


CASES = [DATA_SORTED]
