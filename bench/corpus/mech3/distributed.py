"""The third corpus, mechanism "distributed" (bench/corpus/mechanisms.py: DDP, no_sync,
samplers, rank-dependent code); each case simulates its ranks in one process (_m3_d.World).
Held out: do not run these under graddbg."""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from .._common import (
    Case,
    accuracy,
    batch,
    classification,
    mlp,
    trains,
    worse,
)
from .._m3_d import World, spread

CASES = []


def _world_build(world=2, lr=0.1, opt_cls=torch.optim.SGD, data=classification, **kw):
    def build(seed):
        model = mlp(seed)
        x, y = data(seed)
        ddp = World(model, world, lambda m: opt_cls(m.parameters(), lr=lr, **kw))
        return model, ddp.opts[0], {"x": x, "y": y, "ddp": ddp}
    return build


def _shard(x, y, i, rank, world, size=16):
    gx, gy = batch(x, y, i, world * size)
    return gx[rank * size:(rank + 1) * size], gy[rank * size:(rank + 1) * size]


# ---- no_sync_skips_the_stepping_micro_batch


def _accum_loop(fixed, accum=4):
    def loop(model, opt, ex, steps):
        ddp, losses = ex["ddp"], []
        for batch_idx in range(steps * accum):
            if fixed:
                sync_now = (batch_idx + 1) % accum == 0
            else:
                sync_now = batch_idx % accum == 0  # the old condition
            ctx = contextlib.nullcontext() if sync_now else ddp.no_sync()
            with ctx:
                rank_losses = [F.cross_entropy(m(x), y) for m, (x, y) in
                               ((m, _shard(ex["x"], ex["y"], batch_idx, r, ddp.size))
                                for r, m in enumerate(ddp.models))]
                ddp.backward([loss / accum for loss in rank_losses])
            if (batch_idx + 1) % accum == 0:
                for o in ddp.opts:
                    o.step()
                ddp.zero_grad()
            if batch_idx % accum == 0:
                losses.append(rank_losses[0].item())
        return {"losses": losses, "spread": spread(ddp.models)}
    return loop


CASES.append(Case(
    name="no_sync_skips_the_stepping_micro_batch",
    family="distributed",
    source="modelscope/FunASR pull request #3472 ('fix(train): align DDP no_sync with gradient "
           "accumulation': 'The old batch_idx % accum_grad condition synchronizes the first "
           "microbatch and suppresses synchronization on the optimizer-step microbatch, "
           "leaving rank-local accumulated gradients (4.0 vs 7.0 in the reproduction)')",
    description="I use DDP's no_sync() to skip the all-reduce on accumulation micro-batches; "
                "the replicas' weights drift apart from the first optimizer step on.",
    expected_kinds=(),  # (relabelled before any run: ddp_mismatch needs real ranks,
    # and these replicas are simulated in one process; tests/test_corpus.py refuses it as a label)
    params=(),
    manifest=lambda b, f: b["spread"] > 1e-3 and f["spread"] == 0.0 and trains(f, 0.3),
    build_buggy=_world_build(world=2, lr=0.4),
    loop_buggy=_accum_loop(False),
    build_fixed=_world_build(world=2, lr=0.4),
    loop_fixed=_accum_loop(True),
    steps=25,
))

# ---- every_rank_loads_the_same_batches


def _sampler_loop(distributed, world=4):
    def loop(model, opt, ex, steps):
        ddp, losses, seen = ex["ddp"], [], []
        ds = TensorDataset(ex["x"], ex["y"], torch.arange(len(ex["x"])))
        loaders = []
        for r in range(world):
            if distributed:
                sampler = DistributedSampler(ds, num_replicas=world, rank=r, shuffle=True, seed=0)
                loaders.append(DataLoader(ds, batch_size=16, sampler=sampler))
            else:  # every rank seeds identically (torch.manual_seed(args.seed)) and shuffles
                gen = torch.Generator().manual_seed(0)
                loaders.append(DataLoader(ds, batch_size=16, shuffle=True, generator=gen))
        its, epoch = [], 0
        for _ in range(steps):
            parts = [next(it, None) for it in its]
            if not its or parts[0] is None:  # a new epoch on every rank
                for dl in loaders:
                    if distributed:
                        dl.sampler.set_epoch(epoch)
                its, epoch = [iter(dl) for dl in loaders], epoch + 1
                parts = [next(it) for it in its]
            ddp.zero_grad()
            rank_losses = [F.cross_entropy(m(x), y) for m, (x, y, _) in zip(ddp.models, parts)]
            ddp.backward(rank_losses)
            for o in ddp.opts:
                o.step()
            seen.append(len(set(torch.cat([idx for _, _, idx in parts]).tolist())))
            losses.append(sum(v.item() for v in rank_losses) / world)
        return {"losses": losses, "distinct_per_step": sum(seen) / len(seen)}
    return loop


CASES.append(Case(
    name="every_rank_loads_the_same_batches",
    family="distributed",
    source="yaak-ai/rbyte pull request #106 ('every rank draws the same sample sequence. The "
           "all-reduced gradient degenerates to a single rank's: N x the compute for an "
           "unchanged effective batch -- silently'); PatrickHua/SimSiam issue #16 (no "
           "DistributedSampler: 'the model run the same data twice'); Shark-NLP/DiffuSeq issue "
           "#37 ('the Multi-GPU training actually duplicates data in each GPU?')",
    description="I train with DDP on 4 GPUs using a plain shuffled DataLoader and the same seed "
                "on every rank; each rank gets exactly the same batches, so a global batch holds "
                "only a quarter of the samples I think it does.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (f["distinct_per_step"] == 64 and b["distinct_per_step"] == 16
                           and trains(f, 0.3)),
    build_buggy=_world_build(world=4, lr=0.3),
    loop_buggy=_sampler_loop(False),
    build_fixed=_world_build(world=4, lr=0.3),
    loop_fixed=_sampler_loop(True),
    steps=40,
))

# ---- lr_decayed_on_main_process_only


def _decay_loop(all_ranks, epoch_len=10, decay=0.5):
    def loop(model, opt, ex, steps):
        ddp, losses = ex["ddp"], []
        base = opt.param_groups[0]["lr"]
        for i in range(steps):
            if i % epoch_len == 0 and i > 0:
                for rank, o in enumerate(ddp.opts):
                    is_main_process = rank == 0
                    if all_ranks or is_main_process:
                        for g in o.param_groups:
                            g["lr"] = base * decay ** (i // epoch_len)
            ddp.zero_grad()
            rank_losses = [F.cross_entropy(m(x), y) for m, (x, y) in
                           ((m, _shard(ex["x"], ex["y"], i, r, ddp.size))
                            for r, m in enumerate(ddp.models))]
            ddp.backward(rank_losses)
            for o in ddp.opts:
                o.step()
            losses.append(rank_losses[0].item())
        return {"losses": losses, "spread": spread(ddp.models),
                "lrs": [o.param_groups[0]["lr"] for o in ddp.opts]}
    return loop


CASES.append(Case(
    name="lr_decayed_on_main_process_only",
    family="distributed",
    source="huggingface/accelerate issue #94 ('learning rate decay': setting group['lr'] by "
           "hand; 'You should do it in all processes, so that they all use the same learning "
           "rate, otherwise the copies of your model in each process will diverge'); "
           "karpathy/nanochat pull request #857 ('Fix LR divergence across ranks in SFT')",
    description="I decay the learning rate by hand inside my `if accelerator.is_main_process:` "
                "block; the model copies on my two GPUs no longer hold the same weights.",
    expected_kinds=(),  # (relabelled before any run: ddp_mismatch needs real ranks,
    # and these replicas are simulated in one process; tests/test_corpus.py refuses it as a label)
    params=(),
    manifest=lambda b, f: (b["spread"] > 1e-3 and f["spread"] == 0.0 and trains(f, 0.3)
                           and b["lrs"][0] != b["lrs"][1]),
    build_buggy=_world_build(world=2, lr=0.4),
    loop_buggy=_decay_loop(False),
    build_fixed=_world_build(world=2, lr=0.4),
    loop_fixed=_decay_loop(True),
    steps=40,
))

# ---- prepared_scheduler_steps_once_per_process


class _PreparedScheduler:
    """What accelerator.prepare(lr_scheduler) hands back (split_batches=False): each step()
    advances the wrapped scheduler once per process, since each process's data loader is
    num_processes times shorter than the whole data set's."""

    def __init__(self, scheduler, num_processes):
        self.scheduler, self.num_processes = scheduler, num_processes

    def step(self):
        for _ in range(self.num_processes):
            self.scheduler.step()

    def get_last_lr(self):
        return self.scheduler.get_last_lr()


def _linear_decay(opt, num_training_steps):
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: max(0.0, (num_training_steps - step) / num_training_steps))


def _prepared_loop(fixed):
    def loop(model, opt, ex, steps):
        ddp, losses, lrs = ex["ddp"], [], []
        num_processes = ddp.size
        max_train_steps = steps  # len(train_dataloader) * epochs, counted on one process
        total = max_train_steps * num_processes if fixed else max_train_steps
        scheds = [_PreparedScheduler(_linear_decay(o, total), num_processes) for o in ddp.opts]
        for i in range(steps):
            ddp.zero_grad()
            rank_losses = [F.cross_entropy(m(x), y) for m, (x, y) in
                           ((m, _shard(ex["x"], ex["y"], i, r, ddp.size))
                            for r, m in enumerate(ddp.models))]
            ddp.backward(rank_losses)
            lrs.append(opt.param_groups[0]["lr"])
            for o, s in zip(ddp.opts, scheds):
                o.step()
                s.step()
            losses.append(rank_losses[0].item())
        return {"losses": losses, "lrs": lrs}
    return loop


def _prepared_manifest(b, f):
    half = len(b["lrs"]) // 2
    return (b["lrs"][half] == 0.0 and min(f["lrs"]) > 0.0 and trains(f, 0.35)
            and worse(b, f, 1.15))


CASES.append(Case(
    name="prepared_scheduler_steps_once_per_process",
    family="distributed",
    source="huggingface/transformers issue #26827 ('I find that the learning rate is 0 after "
           "half of args.max_train_steps' on 2 GPUs with accelerate) and pull request #24088 "
           "('This results in the LR scheduler being stepp[ed] through num_processes too "
           "fast'); huggingface/diffusers issue #3954; jzhang38/EasyContext issue #21 ('Model "
           "stopped updating after 300-400 steps')",
    description="I build a linear-decay scheduler over max_train_steps and pass it through "
                "accelerator.prepare; on 2 GPUs the learning rate reaches 0 halfway through "
                "training and the loss stops improving.",
    expected_kinds=("lr_schedule",),
    params=(),
    manifest=_prepared_manifest,
    build_buggy=_world_build(world=2, lr=0.3),
    loop_buggy=_prepared_loop(False),
    build_fixed=_world_build(world=2, lr=0.3),
    loop_fixed=_prepared_loop(True),
    steps=40,
))

# ---- batchnorm_stats_per_rank_on_tiny_shards


def _bn_net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def _bn_build(seed):
    model = _bn_net(seed)
    x, y = classification(seed)
    ddp = World(model, 8, lambda m: torch.optim.SGD(m.parameters(), lr=0.2))
    return model, ddp.opts[0], {"x": x, "y": y, "ddp": ddp}


def _bn_loop(sync_bn, per_rank=2):
    def loop(model, opt, ex, steps):
        ddp, losses = ex["ddp"], []
        world = ddp.size
        for i in range(steps):
            shards = [_shard(ex["x"], ex["y"], i, r, world, per_rank) for r in range(world)]
            ddp.zero_grad()
            if sync_bn:
                # nn.SyncBatchNorm.convert_sync_batchnorm(model) (simulated): every rank
                # normalises with the statistics of the global batch, and with DDP's averaging
                # the gradients are those of the global batch's mean loss (the same on all ranks)
                gx = torch.cat([x for x, _ in shards])
                gy = torch.cat([y for _, y in shards])
                loss = F.cross_entropy(model(gx), gy)
                loss.backward()
                with torch.no_grad():
                    for m in ddp.models[1:]:
                        for p, p0 in zip(m.parameters(), model.parameters()):
                            p.grad = p0.grad.clone()
                losses.append(loss.item())
            else:  # plain BatchNorm1d: each rank normalises its own 2 samples
                rank_losses = [F.cross_entropy(m(x), y) for m, (x, y) in zip(ddp.models, shards)]
                ddp.backward(rank_losses)
                losses.append(sum(v.item() for v in rank_losses) / world)
            for o in ddp.opts:
                o.step()
        model.eval()  # rank 0's model (its running statistics) is the one validated and saved
        with torch.no_grad():
            logits = model(ex["x"])
        model.train()
        return {"losses": losses, "eval_loss": F.cross_entropy(logits, ex["y"]).item(),
                "eval_acc": accuracy(logits, ex["y"])}
    return loop


CASES.append(Case(
    name="batchnorm_stats_per_rank_on_tiny_shards",
    family="distributed",
    source="LibreYOLO/libreyolo pull request #531 ('with SyncBatchNorm off each rank's "
           "BatchNorm tracked only its own shard and only rank 0's buffers were validated and "
           "saved, degrading the converged model versus single-GPU (issue #484)'); "
           "ultralytics/yolov5 pull request #401 (SyncBatchNorm 'more noticeable ... when the "
           "individual GPUs has small batchsizes <= 8'); fundamentalvision/BEVFormer issue #136",
    description="I train with DDP on 8 GPUs, 2 samples per GPU, keeping plain BatchNorm; the "
                "training loss looks fine but the saved model evaluates far worse than the same "
                "global batch on one GPU.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (b["eval_loss"] >= 2.0 * f["eval_loss"]
                           and f["eval_acc"] >= b["eval_acc"] + 0.1 and trains(f, 0.3)),
    build_buggy=_bn_build,
    loop_buggy=_bn_loop(False),
    build_fixed=_bn_build,
    loop_fixed=_bn_loop(True),
    steps=60,
))

# ---- plateau_scheduler_fed_rank_local_val_loss


def _plateau_build(seed):
    model = mlp(seed)
    x, y = classification(seed, n=384)
    ddp = World(model, 2, lambda m: torch.optim.SGD(m.parameters(), lr=0.5))
    return model, ddp.opts[0], {"x": x[:256], "y": y[:256], "vx": x[256:], "vy": y[256:],
                                "ddp": ddp}


def _plateau_loop(global_metric, epoch_len=2):
    def loop(model, opt, ex, steps):
        ddp, losses = ex["ddp"], []
        scheds = [torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0, threshold=0.02)
                  for o in ddp.opts]
        for i in range(steps):
            ddp.zero_grad()
            rank_losses = [F.cross_entropy(m(x), y) for m, (x, y) in
                           ((m, _shard(ex["x"], ex["y"], i, r, ddp.size))
                            for r, m in enumerate(ddp.models))]
            ddp.backward(rank_losses)
            for o in ddp.opts:
                o.step()
            losses.append(rank_losses[0].item())
            if (i + 1) % epoch_len == 0:  # end of epoch: each rank validates its own shard
                with torch.no_grad():
                    val = [F.cross_entropy(m(ex["vx"][r::ddp.size]), ex["vy"][r::ddp.size])
                           for r, m in enumerate(ddp.models)]
                if global_metric:  # dist.all_reduce(val_loss); val_loss /= world_size
                    val = [torch.stack(val).mean()] * ddp.size
                for s, v in zip(scheds, val):
                    s.step(v.item())
        return {"losses": losses, "spread": spread(ddp.models),
                "lrs": [o.param_groups[0]["lr"] for o in ddp.opts]}
    return loop


CASES.append(Case(
    name="plateau_scheduler_fed_rank_local_val_loss",
    family="distributed",
    source="rmchurch/disruptcnn issue #3 ('ReduceLROnPlateau not reducing in certain "
           "scenarios': 'In distributed settings ... the global total_loss is only created in "
           "the logging, and the local total_loss does not meet the criteria for "
           "ReduceLROnPlateau')",
    description="Each DDP rank steps its ReduceLROnPlateau with the validation loss of its own "
                "shard; the ranks cut their learning rates at different epochs and the model "
                "copies drift apart.",
    expected_kinds=(),  # (relabelled before any run: ddp_mismatch needs real ranks,
    # and these replicas are simulated in one process; tests/test_corpus.py refuses it as a label)
    params=(),
    manifest=lambda b, f: (b["spread"] > 1e-3 and f["spread"] == 0.0 and trains(f, 0.3)
                           and f["lrs"][0] == f["lrs"][1]),
    build_buggy=_plateau_build,
    loop_buggy=_plateau_loop(False),
    build_fixed=_plateau_build,
    loop_fixed=_plateau_loop(True),
    steps=60,
))
