"""Per-step cost of graddbg.watch under dp x pp (torch.distributed.pipelining stages, each
wrapped in DDP over its data-parallel group), against the unwatched step and against the
least such a watch can do, measured side by side.

gloo, 4 spawned ranks on 127.0.0.1 (dp = 2 x pp = 2), 1 torch thread per rank. Each rank
holds one copy of its stage per variant (same initial weights, each its own PipelineStage
and 1F1B schedule), and the variants run interleaved, in the same shuffled order on every
rank each repeat:

- bare:  schedule.step (forward and backward of every micro-batch, DDP's all-reduce),
         optimizer step, zero_grad
- floor: bare + the least a watch of the whole model's gradient can do: one read of the
         local gradients (one ``torch._foreach_norm``), their squared sum all-reduced over
         the pipeline group (torchtitan's clip), read to the host
- watch: bare under graddbg.watch(stage_module, opt) with the defaults (every step: norm,
         absmax, non-finite check with the replica-group flags, the stage summary over the
         pipeline group, explode detector)

Each timing of n steps starts after one untimed step of the same variant and a barrier, and
ends with a barrier (the wall time of the slowest rank). Rank 0 prints medians per step,
the overhead over bare, and the watch's overhead as a multiple of the floor's own time (its
read and reduction timed by themselves on rank 0: the floor's overhead over bare is within
the noise of a step on a loaded machine).

    .venv/bin/python bench/pipeline_watch.py
    .venv/bin/python bench/pipeline_watch.py --width 512 --repeats 9 --steps 5
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORLD, VARIANTS, N_MB, MB = 4, ("bare", "floor", "watch"), 4, 8


def _full(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def _variant(args, mesh):
    """One copy of this rank's stage: (module, stage, schedule, optimizer)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    pp = mesh["pp"].get_local_rank()
    full = _full(args.width, args.depth)
    half = len(full) // 2
    part = full[:half] if pp == 0 else full[half:]
    mod = nn.parallel.DistributedDataParallel(part, process_group=mesh["dp"].get_group())
    ex = torch.randn(MB, args.width, requires_grad=pp > 0)
    stage = PipelineStage(mod, pp, 2, torch.device("cpu"), input_args=(ex,),
                          output_args=torch.randn(MB, args.width, requires_grad=True), group=mesh["pp"].get_group())
    sched = Schedule1F1B(stage, n_microbatches=N_MB, loss_fn=lambda o, t: nn.functional.mse_loss(o, t))
    return mod, stage, sched, torch.optim.SGD(mod.parameters(), lr=1e-4)


def _floor(mod, pp_group) -> float:
    grads = [p.grad for p in mod.parameters() if p.grad is not None]
    sq = torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()
    dist.all_reduce(sq, group=pp_group)
    return float(sq)


def _steps(name, v, n, x, y, pp_group) -> float:
    """Run ``n`` steps; returns the seconds spent in the floor's read and reduction."""
    mod, stage, sched, opt = v
    inside = 0.0
    for _ in range(n):
        if stage.is_first:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        if name == "floor":
            t0 = time.perf_counter()
            _floor(mod, pp_group)
            inside += time.perf_counter() - t0
        opt.step()
        opt.zero_grad()
    return inside


def worker(rank: int, port: int, args, out: str) -> None:
    import graddbg
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    pp_group = mesh["pp"].get_group()
    variants = {name: _variant(args, mesh) for name in VARIANTS}
    x, y = torch.randn(MB * N_MB, args.width), torch.randn(MB * N_MB, args.width)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = graddbg.watch(variants["watch"][0], variants["watch"][3])
    times = {name: [] for name in VARIANTS}
    floor_inside = []
    order = random.Random(0)
    for _ in range(args.repeats):
        names = list(VARIANTS)
        order.shuffle(names)
        for name in names:
            _steps(name, variants[name], 1, x, y, pp_group)   # (untimed: back into the caches)
            dist.barrier()
            t0 = time.perf_counter()
            inside = _steps(name, variants[name], args.steps, x, y, pp_group)
            dist.barrier()
            times[name].append((time.perf_counter() - t0) / args.steps)
            if name == "floor":
                floor_inside.append(inside / args.steps)
    w.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "floor_inside": floor_inside,
                       "global_norm": float(w.steps["global_norm"].iloc[-1])}, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=8, help="Linear+Tanh blocks (split in two stages)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"pipeline_watch_{os.getpid()}.json")
    mp.spawn(worker, args=(port, args, out), nprocs=WORLD, join=True)
    with open(out) as f:
        got = json.load(f)
    os.remove(out)
    med = {k: statistics.median(v) for k, v in got["times"].items()}
    ratio = [w / b for w, b in zip(got["times"]["watch"], got["times"]["bare"])]
    print(f"dp 2 x pp 2, gloo, width {args.width}, {args.depth} blocks, {N_MB} micro-batches of {MB}; "
          f"{args.repeats} repeats x {args.steps} steps")
    for k in VARIANTS:
        print(f"  {k:6s} {med[k] * 1e3:8.2f} ms/step")
    over_w, over_f = med["watch"] - med["bare"], med["floor"] - med["bare"]
    inside = statistics.median(got["floor_inside"])
    print(f"  watch / bare (paired median): {statistics.median(ratio):.3f}")
    print(f"  overhead over bare: watch {over_w * 1e3:.2f} ms, floor {over_f * 1e3:.2f} ms "
          f"(the floor's read + pp all-reduce timed by itself: {inside * 1e3:.2f} ms on rank 0)")
    print(f"  watch's overhead = {over_w / inside:.1f} x the floor's own time")


if __name__ == "__main__":
    main()
