"""The dev cases of the mechanism 'arithmetic' (bench/corpus/mechanisms.py) mined by worker a."""
from __future__ import annotations

import math

from torch.nn import functional as F

from .._common import (
    Case,
    batch,
    linear_regression,
    trains,
)
from .._mech_a import (
    eval_mse,
    reg_sgd_build,
)

# ---- the accumulated loss is not divided by the number of micro-batches

def _accum_sum_loop(divide_by: int, accum: int = 8):
    """Accumulation over ``accum`` micro-batches, each loss divided by ``divide_by``."""
    def loop(model, opt, ex, steps):
        losses = []
        for step in range(steps):
            opt.zero_grad()
            total = 0.0
            for m in range(accum):
                x, y = batch(ex["x"], ex["y"], step * accum + m, 16)
                raw = F.mse_loss(model(x), y)
                (raw / divide_by).backward()
                total += raw.item() / accum
            opt.step()
            losses.append(total)
        return {"losses": losses, "full": eval_mse(model, ex)}
    return loop


ACCUM_SUM = Case(
    name="accum_loss_not_divided",
    family="arithmetic",
    source="fastai/fastai issue #3023 ('We do not scale the loss by number of batches to "
           "accumulate, so we end up with too large of gradients'); paiml/aprender pull "
           "request #2123 (accumulation stepped on the sum, not the mean: 'a silent K-fold "
           "effective-LR inflation'); karpathy/nanoGPT issue #206",
    description="I added gradient accumulation over 8 micro-batches and kept my learning "
                "rate; the loss now jumps around and ends far above the run without "
                "accumulation.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and (not math.isfinite(b["full"])
                                             or b["full"] >= 2.0 * f["full"]),
    build_buggy=reg_sgd_build(0.3, linear_regression),
    loop_buggy=_accum_sum_loop(1),
    build_fixed=reg_sgd_build(0.3, linear_regression),
    loop_fixed=_accum_sum_loop(8),
    steps=30,
)


# ---- the loss divided by the accumulation steps twice

ACCUM_TWICE = Case(
    name="accum_loss_divided_twice",
    family="arithmetic",
    source="huggingface/accelerate issue #3533 ('double divide gradient_accumulation_steps': "
           "the backward helper divides the loss by the accumulation steps, and so did the "
           "caller); llm-random/llm-random pull request #529 ('losses are already divided by "
           "grad accumulation steps')",
    description="My backward helper already divides the loss by the accumulation steps, and "
                "I divide it again before calling it; training with accumulation crawls.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and b["full"] >= 1.5 * f["full"],
    build_buggy=reg_sgd_build(0.05, linear_regression),
    loop_buggy=_accum_sum_loop(64),
    build_fixed=reg_sgd_build(0.05, linear_regression),
    loop_fixed=_accum_sum_loop(8),
    steps=30,
)


CASES = [ACCUM_SUM, ACCUM_TWICE]
