"""Held-out cases of the second corpus, mechanism "distributed" (see mechanisms.py); each
runs in one process."""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

from .._common import (
    Case,
    batch,
    classification,
    head,
    linear_regression,
    mlp,
    regression,
    trains,
    worse,
)
from .._mech_d import full_eval, reg_net


def _prefix_build(strip: bool):
    def build(seed):
        # the checkpoint: trained under a data-parallel wrapper, saved from the wrapper
        x, y = classification(seed)
        pre = mlp(seed)
        wrapped = nn.DataParallel(pre)  # its state_dict keys read "module.0.weight", ...
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.2)
        for i in range(60):
            xb, yb = batch(x, y, i)
            opt.zero_grad()
            F.cross_entropy(wrapped(xb), yb).backward()
            opt.step()
        state = {k: v.clone() for k, v in wrapped.state_dict().items()}
        model = mlp(seed + 100)
        if strip:
            torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state, "module.")
            model.load_state_dict(state)
        else:
            model.load_state_dict(state, strict=False)  # loads nothing, says nothing
        return model, torch.optim.SGD(model.parameters(), lr=0.01), {"x": x, "y": y}
    return build


def _finetune_loop(model, opt, ex, steps):
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "full_loss": full_eval(model, ex["x"], ex["y"])}


DIST_PREFIX = Case(
    name="ddp_checkpoint_loaded_non_strict",
    family="distributed",
    source="pytorch/examples issue #1029 ('load_state_dict strict=False can silently load a "
           "corrupted model': the keys carried a prefix, 'the model output was nonsense'); "
           "hpcaitech/ColossalAI issue #768 ('the state_dict of a DDP model contains module. "
           "as the prefix'); pytorch/pytorch pull request #53224 "
           "(consume_prefix_in_state_dict_if_present)",
    description="I resume from a checkpoint saved from the DDP-wrapped model and load it with "
                "strict=False to silence the key errors; fine-tuning starts from scratch-level "
                "loss.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (b["full_loss"] >= 1.5 * f["full_loss"]
                           and head(b["losses"]) >= 1.5 * head(f["losses"])),
    build_buggy=_prefix_build(False),
    loop_buggy=_finetune_loop,
    build_fixed=_prefix_build(True),
    loop_fixed=_finetune_loop,
    steps=20,
)


# ------------------------------------------------------------- simulated data parallelism
# A data-parallel run of ``world`` ranks simulated in one process: one replica of the model
# per rank (rank 0's replica and optimizer are what the user would watch), each rank's shard
# of the global batch, and the all-reduce written as the sum or mean over the replicas.

def replicas(model: nn.Module, world: int) -> list[nn.Module]:
    """Rank 0's model and world - 1 copies of it (what DDP's broadcast at wrap time gives)."""
    return [model] + [copy.deepcopy(model) for _ in range(world - 1)]


def shard(x: torch.Tensor, y: torch.Tensor, i: int, rank: int, world: int, size: int = 16):
    """Rank ``rank``'s part of the i-th global batch of ``world * size`` samples."""
    gx, gy = batch(x, y, i, world * size)
    return gx[rank * size:(rank + 1) * size], gy[rank * size:(rank + 1) * size]


def average_grads(models: list[nn.Module]) -> None:
    """The data-parallel all-reduce: every replica's .grad becomes the mean over ranks."""
    with torch.no_grad():
        for ps in zip(*(m.parameters() for m in models)):
            mean = torch.stack([p.grad for p in ps]).mean(0)
            for p in ps:
                p.grad.copy_(mean)


WORLD = 4


def _ranks_build(lr, make=reg_net, world=WORLD, same_init=True, data=regression):
    def build(seed):
        model = make(seed)
        x, y = data(seed)
        if same_init:
            models = replicas(model, world)
        else:
            models = [model] + [make(seed + r) for r in range(1, world)]
        opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in models]
        return model, opts[0], {"x": x, "y": y, "models": models, "opts": opts}
    return build


def _ranks_step(models, opts, ex, i, loss_fn, loss_scale=1.0):
    losses = []
    for r, (m, o) in enumerate(zip(models, opts)):
        x, y = shard(ex["x"], ex["y"], i, r, len(models))
        o.zero_grad()
        loss = loss_fn(m(x), y)
        (loss * loss_scale).backward()
        losses.append(loss.item())
    return sum(losses) / len(losses)


def _sum_grads(models):
    with torch.no_grad():
        for ps in zip(*(m.parameters() for m in models)):
            total = torch.stack([p.grad for p in ps]).sum(0)
            for p in ps:
                p.grad.copy_(total)


def _allreduce_loop(average: bool):
    def loop(model, opt, ex, steps):
        models, opts, losses = ex["models"], ex["opts"], []
        for i in range(steps):
            losses.append(_ranks_step(models, opts, ex, i, F.mse_loss))
            if average:
                average_grads(models)
            else:
                _sum_grads(models)  # the hand-written all-reduce: SUM, never divided by world
            for o in opts:
                o.step()
        return {"losses": losses}
    return loop


DIST_SUM = Case(
    name="allreduce_sum_without_world_average",
    family="distributed",
    source="TianhongDai/hindsight-experience-replay issue #4 ('Why MPI.sum in sync_grad': "
           "'Won't this result in different learning rates when you run different number of "
           "processes?'); spellml/deeplab-voc-2012 issue #3 (gradients summed rather than "
           "averaged across workers); facebookresearch/fairseq issue #494",
    description="I synchronise gradients myself with all_reduce (SUM) before each step; with 4 "
                "workers the same learning rate that trained on one makes the loss blow up.",
    expected_kinds=("applied_grad",),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and worse(b, f, 3.0),
    build_buggy=_ranks_build(0.2, data=linear_regression),
    loop_buggy=_allreduce_loop(False),
    build_fixed=_ranks_build(0.2, data=linear_regression),
    loop_fixed=_allreduce_loop(True),
    steps=30,
)


def _loss_over_world_loop(divide: bool):
    def loop(model, opt, ex, steps):
        models, opts, losses = ex["models"], ex["opts"], []
        for i in range(steps):
            scale = 1.0 / len(models) if divide else 1.0  # the bug: DDP averages already
            losses.append(_ranks_step(models, opts, ex, i, F.cross_entropy, scale))
            average_grads(models)  # what DDP's backward does
            for o in opts:
                o.step()
        return {"losses": losses}
    return loop


DIST_DIVIDE = Case(
    name="loss_divided_by_world_size_under_ddp",
    family="distributed",
    source="sanderwood/bgpt issue #5 ('loss = loss / world_size ... the gradients will "
           "automatically be divided by world_size ... the gradient would be world_size times "
           "smaller'); verl-project/verl-SpeCo pull request #29 ('a W-rank run silently trains "
           "with an effective learning rate of lr / W'); lightly-ai/lightly issue #1977",
    description="Each rank divides its loss by the world size before backward, on top of "
                "DDP's gradient averaging; with 4 GPUs the model learns far slower than on one.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and worse(b, f, 1.5),
    build_buggy=_ranks_build(0.2, make=mlp, data=classification),
    loop_buggy=_loss_over_world_loop(True),
    build_fixed=_ranks_build(0.2, make=mlp, data=classification),
    loop_fixed=_loss_over_world_loop(False),
    steps=30,
)


def _seed_loop(broadcast: bool):
    def loop(model, opt, ex, steps):
        models, opts, losses = ex["models"], ex["opts"], []
        if broadcast:  # what DDP's constructor (or hvd.broadcast_parameters) does
            with torch.no_grad():
                for m in models[1:]:
                    for p, p0 in zip(m.parameters(), models[0].parameters()):
                        p.copy_(p0)
        for i in range(steps):
            losses.append(_ranks_step(models, opts, ex, i, F.cross_entropy))
            average_grads(models)
            for o in opts:
                o.step()
        spread = max((p - p0).abs().max().item() for m in models[1:]
                     for p, p0 in zip(m.parameters(), models[0].parameters()))
        return {"losses": losses, "spread": spread,
                "rank0_full": full_eval(models[0], ex["x"], ex["y"])}
    return loop


DIST_SEED = Case(
    name="replicas_seeded_by_rank_never_synced",
    family="distributed",
    source="facebookresearch/detr issue #544 and antoyang/TubeDETR issue #15 ('seed = args.seed "
           "+ dist.get_rank()' before building the model: 'different parameter initialization "
           "for different duplicate on each rank'); sparticlesteve/pytorch-benchmarks pull "
           "request #1 ('different workers will initialize to a different set of weights ... "
           "the model will not converge'); mila-iqia/platoon issue #76",
    description="My workers average gradients with a hand-written all-reduce (no DDP wrapper); "
                "each seeds with base_seed + rank, so the replicas start different and never "
                "agree.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: b["spread"] > 0.1 and f["spread"] == 0.0 and trains(f, 0.3),
    build_buggy=_ranks_build(0.1, make=mlp, world=2, same_init=False, data=classification),
    loop_buggy=_seed_loop(False),
    build_fixed=_ranks_build(0.1, make=mlp, world=2, same_init=False, data=classification),
    loop_fixed=_seed_loop(True),
    steps=60,
)


CASES = [DIST_PREFIX, DIST_SUM, DIST_DIVIDE, DIST_SEED]
