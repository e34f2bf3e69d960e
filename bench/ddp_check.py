"""Cost of graddbg.ddp_verify.check_gradients when run on every step of DDP training.

gloo, 2 ranks on 127.0.0.1, the 8M-parameter MLP of bench/_models.py, 1 torch thread per
rank by default. The figure the target refers to (<= 5% of a step when run every step) is
measured as training runs it: blocks of K DDP steps (forward, backward with its gradient
all-reduce, optimizer step) with check_gradients between backward and optimizer step
("checked") against blocks of K plain steps ("plain"), the blocks interleaved
(plain, checked, plain, checked, ...) so that both see the same machine load, each after
one untimed step of its own kind (the first step after another kind of block starts with
colder caches, a cost of the interleaving that training does not pay); each repeat
gives a ratio (checked - plain) / plain and the script prints their median and spread.
A check taken alone right after a step also pays for waiting on the slower rank, a wait
that a training loop pays anyway at its next all-reduce; that standalone figure is printed
too, with the time of the local fingerprints alone, the same for tolerance mode, where
the time of a checked step goes on each rank (forward, backward, check, optimizer, and
inside the check its fingerprints and its header exchange, which waits for the other
rank), and the bytes the check hands to collectives against those of an all_reduce of every gradient
(target: >= 1000x fewer), counted by wrapping the process group's allgather / allreduce
in this process only.

    .venv/bin/python bench/ddp_check.py [--repeats 40] [--steps 10] [--threads 1]

``--fingerprints`` instead times the local fingerprint candidates on 32 MB of float32 in
this process (no distributed run), interleaved, against one read of the same data
(torch._foreach_norm), the floor for anything that reads every element once.

    .venv/bin/python bench/ddp_check.py --fingerprints [--repeats 8] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ByteCounter:
    """Counts the bytes of the tensors this rank hands to all-gathers and all-reduces, at
    the process group's own methods (which torch.distributed.all_gather / all_reduce call,
    and which the check calls directly)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0
        self._orig = {}

    def _count(self, tensors) -> None:
        for t in tensors if isinstance(tensors, (list, tuple)) else [tensors]:
            self.bytes += t.numel() * t.element_size()
        self.calls += 1

    def __enter__(self) -> "_ByteCounter":
        for name, arg in (("allgather", 1), ("allreduce", 0)):
            orig = getattr(dist.ProcessGroup, name)
            self._orig[name] = orig

            def wrapped(pg, *args, _orig=orig, _arg=arg, **kw):
                self._count(args[_arg])
                return _orig(pg, *args, **kw)
            setattr(dist.ProcessGroup, name, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for name, orig in self._orig.items():
            setattr(dist.ProcessGroup, name, orig)


def _spread(values: list) -> str:
    v = sorted(values)
    return f"median {statistics.median(v):.2f}, min {v[0]:.2f}, max {v[-1]:.2f}"


def _worker(rank: int, world: int, port: int, repeats: int, steps: int, threads: int,
            queue) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    from _models import mlp8m
    from torch.nn.parallel import DistributedDataParallel as DDP
    from graddbg import ddp_verify

    torch.manual_seed(0)
    net, make_batch, loss_fn = mlp8m()
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = make_batch()

    def check(**kw) -> None:
        report = ddp_verify.check_gradients(model, **kw)
        assert report.ok, str(report)

    # where a checked step's time goes, on every rank: the phases of the step, and inside
    # the bitwise check its local fingerprints and its header exchange (which waits for
    # the other ranks); recorded in the bitwise blocks and the plain blocks beside them
    phases = {"plain": {k: [] for k in ("forward", "backward", "check", "optimizer")},
              "bitwise": {k: [] for k in ("forward", "backward", "check", "optimizer",
                                          "fingerprints", "exchange")}}
    recording: list = [None]

    def timed(name, fn):
        def wrapper(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                if recording[0] == "bitwise":
                    phases["bitwise"][name].append(time.perf_counter() - t0)
        return wrapper

    ddp_verify.fingerprints = timed("fingerprints", ddp_verify.fingerprints)
    ddp_verify._exchange_header = timed("exchange", ddp_verify._exchange_header)

    def step(check_kw=None) -> None:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        out = model(x)
        t1 = time.perf_counter()
        loss_fn(out, y).backward()
        t2 = time.perf_counter()
        if check_kw is not None:
            check(**check_kw)
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        if recording[0] in phases:
            for name, dt in zip(("forward", "backward", "check", "optimizer"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                phases[recording[0]][name].append(dt)

    def block(key, check_kw=None) -> float:
        # one untimed step of the block's own kind first: after a block of another kind
        # (the tolerance check's float64 passes, say) the first step starts with colder caches
        kind, recording[0] = recording[0], None
        step(check_kw)
        recording[0] = kind
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            t1 = time.perf_counter()
            step(check_kw)
            single[key].append(time.perf_counter() - t1)
        return time.perf_counter() - t0

    for _ in range(3):
        step({})
        step({"rtol": 1e-6})
    # Every step: interleaved blocks of K plain and K checked steps.
    kinds = (("plain", None), ("bitwise", {}), ("plain_tol", None), ("tolerance", {"rtol": 1e-6}))
    blocks = {k: [] for k, _ in kinds}
    single = {k: [] for k, _ in kinds}          # every step's own time, for robust medians
    for _ in range(repeats):
        for key, kw in kinds:
            recording[0] = key
            blocks[key].append(block(key, kw))
    recording[0] = None
    queue.put({"rank": rank, "phases": {mode: {k: statistics.median(v) for k, v in ph.items()}
                                        for mode, ph in phases.items()}})

    # Standalone: one check right after a step, and its parts.
    grads = [p.grad for p in model.parameters()]
    times = {"step": [], "check": [], "check_tol": [], "fingerprints": [], "read": [],
             "barrier": [], "store": [], "gather": []}
    store = dist.distributed_c10d._get_default_store()
    header = torch.zeros(7, dtype=torch.int64)
    gathered = [torch.zeros_like(header) for _ in range(world)]
    parts = (("step", step), ("check", check), ("check_tol", lambda: check(rtol=1e-6)),
             ("fingerprints", lambda: ddp_verify.fingerprints(grads)),
             ("read", lambda: torch._foreach_norm(grads)),
             ("barrier", lambda: dist.monitored_barrier(timeout=timedelta(seconds=60))),
             ("store", lambda: store.set(f"bench/{rank}", "1")),
             ("gather", lambda: dist.all_gather(gathered, header)))
    for _ in range(max(5, 2 * repeats)):
        for key, fn in parts:
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)

    with _ByteCounter() as c:
        check()
    check_bytes, check_calls = c.bytes, c.calls
    with _ByteCounter() as a:
        for g in grads:
            dist.all_reduce(g.clone())
    grad_bytes = a.bytes
    if rank == 0:
        queue.put({"rank": "summary", "blocks": blocks, "single": single} | {k: statistics.median(v) for k, v in times.items()} | {
            f"min_{k}": min(v) for k, v in times.items()} | {
            "check_bytes": check_bytes, "check_calls": check_calls, "grad_bytes": grad_bytes,
            "params": sum(p.numel() for p in model.parameters()),
            "tensors": len(grads)})
    dist.barrier()
    dist.destroy_process_group()


def _fingerprint_candidates(repeats: int, threads: int) -> None:
    """Local fingerprint kernels on 32 MB of float32, interleaved, as multiples of one read."""
    from graddbg import ddp_verify

    torch.set_num_threads(threads)
    x = torch.randn(8 * 1024 * 1024)
    w = x.view(torch.int32)

    def old_two_sums() -> None:      # the previous fingerprint: row and column sums, blocked
        col = torch.zeros(1024, dtype=torch.int32)
        for block in w.view(-1, 1024).split(64):
            block.sum(1, dtype=torch.int32)
            col += block.sum(0, dtype=torch.int32)

    candidates = {
        "one read: torch._foreach_norm": lambda: torch._foreach_norm([x]),
        "fingerprints(bitwise), as shipped": lambda: ddp_verify.fingerprints([x]),
        "  its kernel: int32 block sums (1024 words)": lambda: w.view(-1, 1024).sum(
            1, dtype=torch.int32),
        "int32 block sums accumulated in int64": lambda: w.view(-1, 1024).sum(
            1, dtype=torch.int64),
        "previous: row + column sums, blocked": old_two_sums,
        "tolerance float64 sums, as shipped": lambda: ddp_verify._float_sums(x),
    }
    times = {k: [] for k in candidates}
    for fn in candidates.values():
        fn()
    other = torch.randn(16 * 1024 * 1024)    # read before each candidate: x starts cold,
    for _ in range(max(5, repeats)):         # as the gradients do after a training step
        for key, fn in candidates.items():
            torch._foreach_norm([other])
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    floor = statistics.median(times["one read: torch._foreach_norm"])
    print(f"local fingerprints of 32 MB float32 (cold: 64 MB read in between), {threads} "
          f"thread(s), median of {max(5, repeats)} interleaved repeats:")
    for key, v in times.items():
        med = statistics.median(v)
        print(f"  {key:46s} {med * 1e3:8.2f} ms = {med / floor:5.2f}x one read")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40, help="interleaved block pairs")
    parser.add_argument("--steps", type=int, default=10, help="DDP steps per block (K)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--fingerprints", action="store_true",
                        help="time the local fingerprint candidates only (one process)")
    args = parser.parse_args()
    if args.fingerprints:
        _fingerprint_candidates(args.repeats, args.threads)
        return
    world, port = 2, _free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(world, port, args.repeats, args.steps, args.threads, queue),
                       nprocs=world, start_method="spawn", join=True)
    got = [queue.get() for _ in range(world + 1)]
    r = next(g for g in got if g["rank"] == "summary")
    ranks = sorted((g for g in got if g["rank"] != "summary"), key=lambda g: g["rank"])
    b, k = r["blocks"], args.steps
    print(f"mlp8m: {r['params'] / 1e6:.2f}M parameters in {r['tensors']} tensors, gloo, "
          f"{world} ranks, {args.threads} thread(s) per rank")
    print(f"every step ({args.repeats} interleaved repeats of {k} plain steps vs {k} steps "
          f"each followed by check_gradients; rank 0's clock):")
    for label, plain, checked, target in (("bitwise", "plain", "bitwise", "   (target <= 5%)"),
                                          ("tolerance rtol=1e-6", "plain_tol", "tolerance", "")):
        ratios = [100 * (c - p) / p for p, c in zip(b[plain], b[checked])]
        step_ms = statistics.median(b[plain]) * 1e3 / k
        extra_ms = [(c - p) * 1e3 / k for p, c in zip(b[plain], b[checked])]
        print(f"  {label:20s} plain step {step_ms:7.2f} ms, check adds "
              f"{statistics.median(extra_ms):6.2f} ms/step = {statistics.median(ratios):5.2f}% "
              f"of a step{target}")
        print(f"  {'':20s} spread of the per-repeat ratios in %: {_spread(ratios)}")
        p_med, c_med = (statistics.median(r["single"][key]) for key in (plain, checked))
        print(f"  {'':20s} median single step: plain {p_med * 1e3:.2f} ms, checked "
              f"{c_med * 1e3:.2f} ms: {100 * (c_med - p_med) / p_med:.2f}%")
    print("inside the every-step blocks, per rank (medians, ms): plain step | bitwise-checked step; "
          "the check's fingerprints and header exchange")
    for g in ranks:
        pl, bw = g["phases"]["plain"], g["phases"]["bitwise"]
        print(f"  rank {g['rank']}: " + " ".join(f"{n} {pl[n] * 1e3:.2f} | {bw[n] * 1e3:.2f}" for n in
                                              ("forward", "backward", "check", "optimizer"))
              + f"; fingerprints {bw['fingerprints'] * 1e3:.2f}, exchange {bw['exchange'] * 1e3:.2f}")
    print(f"standalone (median of {max(5, 2 * args.repeats)}, each right after a barrier):")
    print(f"  DDP step (fwd + bwd + all-reduce + SGD):  {r['step'] * 1e3:8.2f} ms")
    print(f"  check_gradients, bitwise:                 {r['check'] * 1e3:8.2f} ms  "
          f"= {100 * r['check'] / r['step']:.2f}% of a step (includes waiting for the slower rank)")
    print(f"    of which local fingerprints (no communication) {r['fingerprints'] * 1e3:.2f} ms "
          f"= {100 * r['fingerprints'] / r['step']:.2f}%, {r['fingerprints'] / r['read']:.2f}x "
          f"one read of the gradients (torch._foreach_norm, {r['read'] * 1e3:.2f} ms)")
    print(f"    the check's communication alone: one store.set (the check-in) {r['store'] * 1e3:.2f} ms, one "
          f"all_gather of 56 B {r['gather'] * 1e3:.2f} ms (for comparison, one monitored "
          f"barrier {r['barrier'] * 1e3:.2f} ms: the check no longer runs one)")
    print(f"    least-disturbed repeats (minimum of each): step {r['min_step'] * 1e3:.2f} ms, "
          f"check {r['min_check'] * 1e3:.2f} ms = {100 * r['min_check'] / r['min_step']:.2f}%")
    print(f"  check_gradients, tolerance (rtol=1e-6):   {r['check_tol'] * 1e3:8.2f} ms  "
          f"= {100 * r['check_tol'] / r['step']:.2f}% of a step")
    print(f"bytes per rank into collectives: check {r['check_bytes']} B in {r['check_calls']} "
          f"all_gathers, all_reduce of all gradients "
          f"{r['grad_bytes']} B: {r['grad_bytes'] / r['check_bytes']:.0f}x fewer   (target >= 1000x)")


if __name__ == "__main__":
    main()
