"""The fourth corpus, mechanism "distributed" (bench/corpus/mechanisms.py: DDP, no_sync,
samplers, rank-dependent code); each case simulates its ranks in one process (_m4_d.DDPWorld).
Held out: do not run these under graddbg."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from .._common import (
    Case,
    batch,
    changed,
    classification,
    mlp,
    snapshot,
    trains,
    worse,
)
from .._m4_d import DDPWorld, all_gather, distinct_fraction, spread

CASES = []


def _shard(x, y, i, rank, world, size=16):
    gx, gy = batch(x, y, i, world * size)
    return gx[rank * size:(rank + 1) * size], gy[rank * size:(rank + 1) * size]


def _world_build(world, lr, opt_cls=torch.optim.SGD, data=classification, **kw):
    def build(seed):
        model = mlp(seed)
        x, y = data(seed)
        ddp = DDPWorld(model, world, lambda m: opt_cls(m.parameters(), lr=lr, **kw))
        return model, ddp.opts[0], {"x": x, "y": y, "ddp": ddp}
    return build


# ---- forward_bypasses_ddp_through_module


def _bypass_loop(through_wrapper):
    def loop(model, opt, ex, steps):
        ddp, losses = ex["ddp"], []
        for i in range(steps):
            ddp.zero_grad()
            rank_losses = []
            for r in range(ddp.size):
                x, y = _shard(ex["x"], ex["y"], i, r, ddp.size)
                if through_wrapper:
                    logits = ddp(r, x)
                else:  # model_unwrapped = model.module; logits = model_unwrapped(x)
                    logits = ddp.module(r)(x)
                rank_losses.append(F.cross_entropy(logits, y))
            ddp.backward(rank_losses)
            ddp.step()
            losses.append(rank_losses[0].item())
        return {"losses": losses, "spread": spread(ddp.models)}
    return loop


CASES.append(Case(
    name="forward_bypasses_ddp_through_module",
    family="distributed",
    source="jingyaogong/minimind pull request #854 and issue #853 ('wrap the policy in "
           "DistributedDataParallel, but then run the loss-bearing forward pass through "
           ".module ... backward() performs no all-reduce. Every rank then steps its optimizer "
           "on purely local gradients and the replicas silently diverge'); moojink/openvla-oft "
           "issue #160 ('Action head gradients are not synchronized in multi-GPU training "
           "because DDP forward is bypassed')",
    description="I wrap my model in DistributedDataParallel but call model.module(...) in the "
                "training step; there is no error, yet the copies on my GPUs end up with "
                "different weights, as if each trained alone on its own shard.",
    expected_kinds=(),  # ddp_mismatch needs real ranks (tests/test_corpus.py refuses it here)
    params=(),
    # note: whether a bypassed forward still all-reduces depends on the DDP version (k2-fsa/
    # icefall issue #226 saw it sync); the simulation follows the reports above: no all-reduce
    manifest=lambda b, f: b["spread"] > 1e-2 and f["spread"] == 0.0 and trains(f, 0.3),
    build_buggy=_world_build(4, 0.3),
    loop_buggy=_bypass_loop(False),
    build_fixed=_world_build(4, 0.3),
    loop_fixed=_bypass_loop(True),
    steps=30,
))

# ---- clip_norm_reduced_again_over_dp_group


def _clip_loop(reduce_over_dp, max_norm=0.25):
    def loop(model, opt, ex, steps):
        ddp, losses = ex["ddp"], []
        for i in range(steps):
            ddp.zero_grad()
            rank_losses = []
            for r in range(ddp.size):
                x, y = _shard(ex["x"], ex["y"], i, r, ddp.size, 8)
                rank_losses.append(F.cross_entropy(ddp(r, x), y))
            ddp.backward(rank_losses)  # DDP has averaged the gradients: equal on every rank
            local_sq = [sum(p.grad.pow(2).sum() for p in m.parameters()) for m in ddp.models]
            for r, m in enumerate(ddp.models):
                if reduce_over_dp:
                    # clip_grad_norm(params, max_norm, group=dp_group): all_reduce(SUM) of the
                    # squared norms, as for sharded (tensor-parallel) gradients
                    total = torch.stack(local_sq).sum().sqrt()
                else:
                    total = local_sq[r].sqrt()
                coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
                for p in m.parameters():
                    p.grad.mul_(coef)
            ddp.step()
            losses.append(sum(v.item() for v in rank_losses) / ddp.size)
        with torch.no_grad():
            full = F.cross_entropy(model(ex["x"]), ex["y"]).item()
        return {"losses": losses, "full": full}
    return loop


CASES.append(Case(
    name="clip_norm_reduced_again_over_dp_group",
    family="distributed",
    source="modelscope/twinkle pull request #290 ('fix: avoid duplicate gradient norm reduction "
           "in pure DDP': 'Pure DDP backward synchronizes complete gradients on every rank, but "
           "passing _dp_group into gradient clipping sums their squared norms again. With two "
           "ranks, a normalized gradient of 0.8 is reported as 1.131371 and incorrectly clipped "
           "to 0.707106 when max_grad_norm=1')",
    description="Under plain DDP I pass the data-parallel group to my gradient-clipping helper; "
                "the reported gradient norm grows with the number of GPUs and the run on 8 GPUs "
                "learns much more slowly than on one.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and worse(b, f, 1.5),
    build_buggy=_world_build(8, 0.5),
    loop_buggy=_clip_loop(True),
    build_fixed=_world_build(8, 0.5),
    loop_fixed=_clip_loop(False),
    steps=40,
))

# ---- all_gather_features_without_gradient


class _TwoTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.img = nn.Linear(12, 16)
        self.txt = nn.Linear(10, 16)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, xi, xt):
        return F.normalize(self.img(xi), dim=-1), F.normalize(self.txt(xt), dim=-1)


TOWERS = ("img.weight", "img.bias", "txt.weight", "txt.bias")


def _pairs(seed, n=256):
    gen = torch.Generator().manual_seed(seed + 9400)
    z = torch.randn(n, 8, generator=gen)
    xi = z @ torch.randn(8, 12, generator=gen) + 0.1 * torch.randn(n, 12, generator=gen)
    xt = z @ torch.randn(8, 10, generator=gen) + 0.1 * torch.randn(n, 10, generator=gen)
    return xi, xt


def _clip_build(seed, world=2):
    torch.manual_seed(seed)
    model = _TwoTower()
    xi, xt = _pairs(seed)
    ddp = DDPWorld(model, world, lambda m: torch.optim.Adam(m.parameters(), lr=0.01))
    return model, ddp.opts[0], {"xi": xi, "xt": xt, "ddp": ddp}


def _gather_loop(keep_local):
    def loop(model, opt, ex, steps):
        ddp, losses = ex["ddp"], []
        before = snapshot(p for n, p in model.named_parameters() if n in TOWERS)
        for i in range(steps):
            ddp.zero_grad()
            feats = []
            for r in range(ddp.size):
                xi, xt = _shard(ex["xi"], ex["xt"], i, r, ddp.size)
                feats.append(ddp(r, xi, xt))
            rank_losses = []
            for r in range(ddp.size):
                fi, ft = feats[r]
                all_i = [torch.zeros_like(fi) for _ in range(ddp.size)]
                all_t = [torch.zeros_like(ft) for _ in range(ddp.size)]
                all_gather(all_i, [f[0] for f in feats])  # dist.all_gather(all_i, fi)
                all_gather(all_t, [f[1] for f in feats])
                if keep_local:  # the gathered copies carry no gradient: put ours back
                    all_i[r], all_t[r] = fi, ft
                gi, gt = torch.cat(all_i), torch.cat(all_t)
                logits = ddp.models[r].logit_scale.exp() * gi @ gt.t()
                labels = torch.arange(logits.shape[0])
                rank_losses.append((F.cross_entropy(logits, labels)
                                    + F.cross_entropy(logits.t(), labels)) / 2)
            ddp.backward(rank_losses)
            ddp.step()
            losses.append(rank_losses[0].item())
        towers_moved = changed(before, (p for n, p in model.named_parameters() if n in TOWERS))
        return {"losses": losses, "towers_moved": towers_moved}
    return loop


CASES.append(Case(
    name="all_gather_features_without_gradient",
    family="distributed",
    source="3dlg-hcvc/DuoduoCLIP issue #10 ('when I replace dist.nn.all_gather with "
           "dist.all_gather, it shows no gradient, the all_gather operation won't keep track of "
           "gradient calculation ... when trainer.device = 4 and using dist.all_gather(), the "
           "loss won't go down'); KevinMusgrave/pytorch-metric-learning issue #10 ('gathered "
           "tensors have no gradients, so we set the position in the list equal to the current "
           "replicas embeddings'); kohjingyu/fromage issue #33",
    description="For my CLIP-style contrastive loss on several GPUs I all_gather the image and "
                "text embeddings of every rank and compute the loss on the concatenation; on one "
                "GPU it trains, on several the loss barely moves.",
    expected_kinds=("unused_param",),
    params=TOWERS,
    # note: the simulated DDP tolerates parameters without gradients (the reporter's run used
    # find_unused_parameters); only logit_scale is trained in the buggy run
    manifest=lambda b, f: (not b["towers_moved"]) and f["towers_moved"] and trains(f, 0.3)
    and worse(b, f, 1.5),
    build_buggy=_clip_build,
    loop_buggy=_gather_loop(False),
    build_fixed=_clip_build,
    loop_fixed=_gather_loop(True),
    steps=40,
))

# ---- sampler_seed_differs_per_rank / sampler_given_local_rank


def _sampler_loop(rank_of, seed_of, world=4, per_rank=16):
    def loop(model, opt, ex, steps):
        ddp, losses, cover = ex["ddp"], [], []
        ds = TensorDataset(ex["x"], ex["y"], torch.arange(len(ex["x"])))
        samplers = [DistributedSampler(ds, num_replicas=world, rank=rank_of(r), shuffle=True,
                                       seed=seed_of(r)) for r in range(world)]
        loaders = [DataLoader(ds, batch_size=per_rank, sampler=s) for s in samplers]
        its, epoch, seen = None, 0, [[] for _ in range(world)]
        for _ in range(steps):
            parts = [next(it, None) for it in its] if its else [None]
            if parts[0] is None:  # a new epoch on every rank
                if its:
                    cover.append(distinct_fraction(seen, len(ds)))
                for s in samplers:
                    s.set_epoch(epoch)
                its, epoch, seen = [iter(dl) for dl in loaders], epoch + 1, [[] for _ in
                                                                            range(world)]
                parts = [next(it) for it in its]
            ddp.zero_grad()
            rank_losses = []
            for r, (x, y, idx) in enumerate(parts):
                seen[r].extend(idx.tolist())
                rank_losses.append(F.cross_entropy(ddp(r, x), y))
            ddp.backward(rank_losses)
            ddp.step()
            losses.append(sum(v.item() for v in rank_losses) / world)
        return {"losses": losses, "coverage": sum(cover) / len(cover)}
    return loop


CASES.append(Case(
    name="sampler_seed_differs_per_rank",
    family="distributed",
    source="NVlabs/LongLive issue #71 ('DDP training ranks use divergent DistributedSampler "
           "seeds': the sampler seed is derived from the current time multiplied by the global "
           "rank; 'With different seeds, samples can overlap between ranks and other samples "
           "can be skipped'); mlcommons/training pull request #625 ('printing out the indexes "
           "read by each worker shows overlap (around 20% to 30%!)')",
    description="Each of my DDP ranks builds its DistributedSampler with its own seed; training "
                "runs, but in an epoch the ranks read overlapping samples and a third of the data "
                "set is never seen.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: b["coverage"] < 0.85 and f["coverage"] == 1.0 and trains(f, 0.3),
    build_buggy=_world_build(4, 0.2),
    loop_buggy=_sampler_loop(lambda r: r, lambda r: 1234 * r),
    build_fixed=_world_build(4, 0.2),
    loop_fixed=_sampler_loop(lambda r: r, lambda r: 1234),
    steps=40,
))

CASES.append(Case(
    name="sampler_given_local_rank",
    family="distributed",
    source="vllm-project/speculators pull request #427 ('Fix data duplication bug in "
           "multi-node distributed training caused by passing local_rank instead of global rank "
           "... processes on different nodes with the same local_rank receive identical data "
           "shards')",
    description="On two nodes with two GPUs each I pass local_rank to my distributed sampler; "
                "every node trains on the same half of the data, and the other half is never "
                "used.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: b["coverage"] <= 0.55 and f["coverage"] == 1.0 and trains(f, 0.3),
    build_buggy=_world_build(4, 0.2),
    loop_buggy=_sampler_loop(lambda r: r % 2, lambda r: 1234),  # local_rank on 2 GPUs per node
    build_fixed=_world_build(4, 0.2),
    loop_fixed=_sampler_loop(lambda r: r, lambda r: 1234),
    steps=40,
))
