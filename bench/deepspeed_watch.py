"""Step-time overhead of graddbg.watch on a 2-rank DeepSpeed ZeRO-2 engine (CPU, gloo,
``DS_ACCELERATOR=cpu``), against the unwatched step and against the least such a watch can
do, measured side by side in one run.

Each rank holds one engine per variant (same initial weights), run interleaved in the same
shuffled order on both ranks each repeat:

- bare:       engine(x), engine.backward(loss) (ZeRO-2's reduce into partitions), engine.step()
- floor:      bare + one read of this rank's reduced gradient partitions (one
              ``torch._foreach_norm`` over ZeRO's averaged gradients) and one all_gather of a
              12-byte-per-parameter table read to the host, before ``engine.step()``
- watch:      bare under graddbg.watch(engine) with the defaults
- watch:norm: graddbg.watch(engine, stats=("norm",))

Each timing of n steps starts after one untimed step of the same variant and a barrier and
ends with a barrier (the slower rank's wall time). Rank 0 prints the median time per step,
the paired ratio to bare (the median over repeats of each repeat's ratio), the watch's
overhead as a multiple of the floor's (target: <= 1.5x), and each variant's paired added
time per step with its quartiles over the repeats (on a shared machine the ratio of two
small overheads moves a lot between runs: the quartiles show by how much).

    .venv/bin/python bench/deepspeed_watch.py
    .venv/bin/python bench/deepspeed_watch.py --repeats 9 --steps 5 --width 512
    .venv/bin/python bench/deepspeed_watch.py --world 1 --repeats 25 --steps 20   # the fixed cost, one rank
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = ("bare", "floor", "watch", "watch:norm")


def _model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 8))


def _engine(width: int, depth: int):
    import deepspeed

    model = _model(width, depth)
    config = {"train_micro_batch_size_per_gpu": 16, "steps_per_print": 10 ** 9, "zero_optimization": {"stage": 2},
              "gradient_clipping": 1.0}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                      config=config)
    return engine


def _floor(engine) -> list:
    """One read of this rank's reduced partitions, one all_gather of 12 bytes per parameter."""
    grads = [g for group in engine.optimizer.averaged_gradients.values() for g in group if g is not None]
    P = sum(1 for _ in engine.module.parameters())
    local = torch.zeros(P, 3)
    norms = torch.stack(torch._foreach_norm(grads))
    local[: len(norms), 0] = norms[:P]
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return torch.stack(out).tolist()


class Variant:
    def __init__(self, name: str, width: int, depth: int) -> None:
        import graddbg

        self.name, self.engine = name, _engine(width, depth)
        self.ctx = None
        if name == "watch":
            self.ctx = graddbg.watch(self.engine)
        elif name == "watch:norm":
            self.ctx = graddbg.watch(self.engine, stats=("norm",))
        g = torch.Generator().manual_seed(dist.get_rank())
        self.x = torch.randn(16, width, generator=g)
        self.times: list = []
        self.cpu: list = []

    def step(self) -> None:
        self.engine.backward(self.engine(self.x).pow(2).mean())
        if self.name == "floor":
            _floor(self.engine)
        self.engine.step()


def _time(v: Variant, n: int) -> None:
    """Wall time per step (between barriers: the slower rank's) and the CPU time of both
    ranks together per step (steadier on a shared machine)."""
    v.step()
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        v.step()
    cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
    dist.barrier()
    v.times.append((time.perf_counter() - t0) / n)
    dist.all_reduce(cpu)
    v.cpu.append(float(cpu) / n)


def _worker(rank: int, port: int, args: dict, out: str) -> None:
    world = args["world"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world), DS_ACCELERATOR="cpu")
    torch.set_num_threads(args["threads"])
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=120))
    variants = {n: Variant(n, args["width"], args["depth"]) for n in VARIANTS}
    order = list(VARIANTS)
    rng = random.Random(0)
    for _ in range(args["repeats"]):
        rng.shuffle(order)  # the same order on both ranks (same seed)
        for n in order:
            _time(variants[n], args["steps"])
    if rank == 0:
        params = sum(p.numel() for p in variants["bare"].engine.module.parameters())
        with open(out, "w") as f:
            json.dump({"times": {n: v.times for n, v in variants.items()},
                       "cpu": {n: v.cpu for n, v in variants.items()}, "params": params}, f)
    for v in variants.values():
        if v.ctx is not None:
            v.ctx.close()
    dist.destroy_process_group()


def _report(res: dict, args: dict) -> None:
    print(f"ZeRO-2, {args['world']} rank(s) (gloo, CPU), MLP width {args['width']} x {args['depth']} "
          f"({res['params'] / 1e6:.2f}M parameters), {args['repeats']} repeats x {args['steps']} steps")
    for clock, t in (("cpu time of all ranks", res["cpu"]), ("wall time", res["times"])):
        paired = {n: statistics.median(a / b for a, b in zip(t[n], t["bare"])) for n in VARIANTS}
        print(f"-- {clock}\n{'variant':<12}{'ms/step':>10}{'x bare':>9}{'overhead / floor overhead':>28}"
              f"{'+ms/step (quartiles)':>28}")
        floor_over = paired["floor"] - 1
        for n in VARIANTS:
            rel = (paired[n] - 1) / floor_over if floor_over > 0 else float("nan")
            shown = "" if n in ("bare", "floor") else f"{rel:.2f}x"
            q = statistics.quantiles([(a - b) * 1e3 for a, b in zip(t[n], t["bare"])], n=4) if len(t[n]) > 1 \
                else [math.nan] * 3
            spread = "" if n == "bare" else f"{q[1]:+.2f} ({q[0]:+.2f} .. {q[2]:+.2f})"
            print(f"{n:<12}{statistics.median(t[n]) * 1e3:>10.2f}{paired[n]:>9.3f}{shown:>28}{spread:>28}")
    print("target: watch overhead <= 1.5x the floor's")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--world", type=int, default=2, help="ranks (1: the watch's fixed cost without the other "
                                                          "rank's noise)")
    args = vars(ap.parse_args())
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"deepspeed_watch_{os.getpid()}.json")
    mp.start_processes(_worker, args=(port, args, out), nprocs=args["world"], start_method="spawn")
    with open(out) as f:
        _report(json.load(f), args)
    os.remove(out)


if __name__ == "__main__":
    main()
