"""Cost of graddbg.ddp_verify.check_gradients on every step of DDP training, against its floor.

gloo, 2 ranks on 127.0.0.1, the 8M-parameter MLP of bench/_models.py, 1 torch thread per
rank by default. Measured as training runs it: blocks of K DDP steps (forward, backward
with its gradient all-reduce, optimizer step), interleaved in each repeat:

- plain:     the bare step;
- bitwise:   check_gradients(model) between backward and optimizer step;
- floor:     in its place, the least any such check can do: one read of the gradients
             (one ``torch._foreach_norm`` over all of them) plus one rendezvous of the
             ranks (an all_gather of a 7-integer header, the check's own size);
- plain_tol, tolerance: the same for check_gradients(model, rtol=1e-6).

Each block starts after one untimed step of its own kind (the first step after another
kind of block starts with colder caches, a cost of the interleaving that training does not
pay). The script prints each kind's cost as a share of a plain step, and the ratio
check_overhead / floor_overhead (target <= 1.5x), three ways: from the blocks (the median
over repeats of each kind's extra time per step), from the calls timed inside the steps
(the check call against the floor call, per rank), and standalone (each right after a
plain step and a barrier). Then where a checked step's time goes on each rank (forward, backward, check,
optimizer; inside the check its fingerprints and its rendezvous, which waits for the
other rank), and the bytes the check hands to collectives against those of an all_reduce
of every gradient (target: >= 1000x fewer), counted by wrapping the process group's
allgather / allreduce in this process only.

    .venv/bin/python bench/ddp_check.py [--repeats 40] [--steps 10] [--threads 1] [--kernel compiled]

Then, for choosing how often ``watch()`` checks the replicas: the cost of one
``check_replicas`` (gradients and parameters in one exchange, as the watch makes it) as a
share of a DDP training step of the bench models (the 8.4M MLP and the launch-bound 64-layer
net), each check timed right after a step and a barrier, interleaved with plain steps; and
the smallest N such that checking every N steps costs at most 1% of a step (the proposed
default is the largest N over the models). ``--cost-only`` runs only that part.

``--fingerprints`` instead times the local fingerprint kernels (compiled and eager) on 32 MB of float32 in
this process (no distributed run), interleaved, against one read of the same data
(torch._foreach_norm), the floor for anything that reads every element once.

    .venv/bin/python bench/ddp_check.py --fingerprints [--repeats 8] [--threads 1]
    .venv/bin/python bench/ddp_check.py --cost-only [--repeats 20]
"""
from __future__ import annotations

import argparse
import math
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

HEADER_INTS = 7     # the check's header: 7 int64 per rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ByteCounter:
    """Counts the bytes of the tensors this rank hands to all-gathers and all-reduces, at
    the process group's own methods (which torch.distributed.all_gather / all_reduce call)."""

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


class _Bench:
    """One rank's model, its training step and the calls that go between backward and step."""

    KINDS = ("plain", "bitwise", "floor", "plain_tol", "tolerance")
    PHASES = ("forward", "backward", "check", "optimizer")

    def __init__(self, rank: int, world: int) -> None:
        from _models import mlp8m
        from torch.nn.parallel import DistributedDataParallel as DDP
        from graddbg import ddp_verify
        from graddbg._dist import rendezvous as _rendezvous

        self.v, self.rank, self.world = ddp_verify, rank, world
        torch.manual_seed(0)
        net, make_batch, self.loss_fn = mlp8m()
        self.model = DDP(net)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x, self.y = make_batch()
        self.header = torch.zeros(HEADER_INTS, dtype=torch.int64)
        self.gathered = [torch.zeros_like(self.header) for _ in range(world)]
        # per kind: the phases of every timed step; for bitwise also inside the check
        self.phases = {k: {p: [] for p in self.PHASES + ("fingerprints", "rendezvous")}
                       for k in self.KINDS}
        self.recording = None
        ddp_verify.fingerprints = self._timed("fingerprints", ddp_verify.fingerprints)
        _rendezvous.exchange = self._timed("rendezvous", _rendezvous.exchange)

    def _timed(self, name, fn):
        def wrapper(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                if self.recording is not None:
                    self.phases[self.recording][name].append(time.perf_counter() - t0)
        return wrapper

    def grads(self) -> list:
        return [p.grad for p in self.model.parameters()]

    def floor(self) -> None:
        """One read of every gradient and one rendezvous of the ranks."""
        torch._foreach_norm(self.grads())
        dist.all_gather(self.gathered, self.header)

    def between(self, kind: str) -> None:
        if kind in ("bitwise", "tolerance"):
            report = self.v.check_gradients(self.model, **({"rtol": 1e-6} if kind == "tolerance" else {}))
            assert report.ok, str(report)
        elif kind == "floor":
            self.floor()

    def step(self, kind: str) -> None:
        t = [time.perf_counter()]
        self.opt.zero_grad(set_to_none=False)
        out = self.model(self.x)
        t.append(time.perf_counter())
        self.loss_fn(out, self.y).backward()
        t.append(time.perf_counter())
        self.between(kind)
        t.append(time.perf_counter())
        self.opt.step()
        t.append(time.perf_counter())
        if self.recording is not None:
            for name, a, b in zip(self.PHASES, t, t[1:]):
                self.phases[kind][name].append(b - a)

    def block(self, kind: str, steps: int) -> float:
        self.recording = None
        self.step(kind)                        # untimed: caches warm for this kind
        dist.barrier()
        self.recording = kind
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step(kind)
        elapsed = time.perf_counter() - t0
        self.recording = None
        return elapsed


def _standalone(b: _Bench, repeats: int) -> dict:
    """Medians (and minima) of each part alone, each right after a plain step of its own
    (the gradients just written, as in training) and a barrier."""
    grads = b.grads()
    parts = {"check": lambda: b.between("bitwise"), "floor": b.floor,
             "check_tol": lambda: b.between("tolerance"),
             "fingerprints": lambda: b.v.fingerprints(grads),
             "read": lambda: torch._foreach_norm(grads),
             "gather": lambda: dist.all_gather(b.gathered, b.header)}
    times = {k: [] for k in ("step", *parts)}
    for _ in range(repeats):
        for key, fn in parts.items():
            for name, call in (("step", lambda: b.step("plain")), (key, fn)):
                dist.barrier()
                t0 = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()} | {
        f"min_{k}": min(v) for k, v in times.items()}


COST_MODELS = ("mlp8m", "launchbound")
BUDGET = 0.01       # the replica check may cost at most this share of a step


def _step_cost(name: str, repeats: int) -> dict:
    """Median DDP step and median check_replicas(model) (gradients and parameters, one
    exchange), each check right after a plain step and a barrier, as the watch makes it."""
    import _models
    from torch.nn.parallel import DistributedDataParallel as DDP
    from graddbg import ddp_verify

    torch.manual_seed(0)
    net, make_batch, loss_fn = _models.MODELS[name]()
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = make_batch()

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        loss_fn(model(x), y).backward()
        opt.step()
    times = {"step": [], "check": []}
    for i in range(3 + repeats):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        dist.barrier()
        t2 = time.perf_counter()
        assert ddp_verify.check_replicas(model).ok
        t3 = time.perf_counter()
        if i >= 3:
            times["step"].append(t1 - t0)
            times["check"].append(t3 - t2)
    return {"step": statistics.median(times["step"]), "check": statistics.median(times["check"]),
            "tensors": 2 * len(list(model.parameters())),
            "params": sum(p.numel() for p in model.parameters())}


def _cost_worker(rank: int, world: int, port: int, repeats: int, threads: int, queue,
                 kernel: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(threads)
    _use_kernel(kernel)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    costs = {name: _step_cost(name, repeats) for name in COST_MODELS}
    if rank == 0:
        queue.put(costs)
    dist.barrier()
    dist.destroy_process_group()


def _print_costs(costs: dict, repeats: int) -> int:
    """Print each model's check cost as a share of its step and the N it needs; return the
    proposed default N (the largest)."""
    print(f"one check_replicas (gradients + parameters, one exchange) against a DDP step, "
          f"gloo, 2 ranks, median of {repeats} (each check right after a step and a barrier):")
    needed = {}
    for name, c in costs.items():
        share = c["check"] / c["step"]
        needed[name] = max(1, math.ceil(share / BUDGET))
        print(f"  {name:12s} {c['params'] / 1e6:6.2f}M parameters in {c['tensors'] // 2:3d} tensors: "
              f"step {c['step'] * 1e3:7.2f} ms, check {c['check'] * 1e3:6.2f} ms = "
              f"{100 * share:6.2f}% of a step; every N >= {needed[name]} steps costs <= "
              f"{100 * BUDGET:g}%")
    n = max(needed.values())
    print(f"proposed default: check every N = {n} steps (the largest over the models; "
          f"costs <= {100 * BUDGET:g}% of a step on each)")
    return n


def _use_kernel(kernel: str) -> str:
    from graddbg import ddp_verify

    return ddp_verify.set_fingerprint_kernel(kernel)


_KEPT: list = []     # the last collectives' works (see the end of _worker)


def _worker(rank: int, world: int, port: int, repeats: int, steps: int, threads: int,
            queue, kernel: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(threads)
    in_use = _use_kernel(kernel)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    b = _Bench(rank, world)
    for _ in range(3):
        for kind in _Bench.KINDS:
            b.step(kind)
    blocks = {k: [] for k in _Bench.KINDS}
    for _ in range(repeats):
        for kind in _Bench.KINDS:
            blocks[kind].append(b.block(kind, steps))
    queue.put({"rank": rank, "phases": {k: {p: statistics.median(v) if v else float("nan")
                                            for p, v in ph.items()} for k, ph in b.phases.items()}})
    alone = _standalone(b, max(5, 2 * repeats))
    with _ByteCounter() as c:
        b.between("bitwise")
    with _ByteCounter() as a:
        # kept past the process's end, as graddbg/_dist/collective.py explains: a gloo worker
        # thread left to free these tensors at interpreter shutdown aborts the process
        _KEPT.extend(dist.all_reduce(g.clone(), async_op=True) for g in b.grads())
        for work in _KEPT:
            work.wait()
    if rank == 0:
        queue.put({"rank": "summary", "blocks": blocks, "alone": alone, "kernel": in_use,
                   "check_bytes": c.bytes, "check_calls": c.calls, "grad_bytes": a.bytes,
                   "params": sum(p.numel() for p in b.model.parameters()),
                   "tensors": len(b.grads())})
    dist.barrier()
    dist.destroy_process_group()


def _print_blocks(r: dict, repeats: int, k: int) -> None:
    b = r["blocks"]
    print(f"every step ({repeats} interleaved repeats of blocks of {k} steps; rank 0's clock):")
    extra = {}
    for label, plain, kind, note in (
            ("bitwise check", "plain", "bitwise", "   (target <= 5%)"),
            ("floor: read + gather", "plain", "floor", ""),
            ("tolerance rtol=1e-6", "plain_tol", "tolerance", "")):
        ratios = [100 * (c - p) / p for p, c in zip(b[plain], b[kind])]
        extra[kind] = statistics.median([(c - p) * 1e3 / k for p, c in zip(b[plain], b[kind])])
        step_ms = statistics.median(b[plain]) * 1e3 / k
        print(f"  {label:22s} plain step {step_ms:7.2f} ms, adds {extra[kind]:6.2f} ms/step = "
              f"{statistics.median(ratios):5.2f}% of a step{note}")
        print(f"  {'':22s} spread of the per-repeat ratios in %: {_spread(ratios)}")
    ratio = (f"{extra['bitwise'] / extra['floor']:.2f}x" if extra["floor"] > 0 else
             "undefined (the floor's overhead was not above the noise)")
    print(f"  check overhead / floor overhead (blocks): {ratio}   (target <= 1.5x)")


def _print_phases(ranks: list) -> None:
    print("inside the every-step blocks, per rank (medians, ms): plain | floor | bitwise-checked step")
    for g in ranks:
        pl, fl, bw = (g["phases"][k] for k in ("plain", "floor", "bitwise"))
        print(f"  rank {g['rank']}: " + " ".join(
            f"{n} {pl[n] * 1e3:.2f} | {fl[n] * 1e3:.2f} | {bw[n] * 1e3:.2f}" for n in _Bench.PHASES)
            + f"; in the check: fingerprints {bw['fingerprints'] * 1e3:.2f}, rendezvous "
              f"{bw['rendezvous'] * 1e3:.2f}")
        print(f"  rank {g['rank']}: check overhead / floor overhead (calls inside the step): "
              f"{bw['check'] / fl['check']:.2f}x   (target <= 1.5x)")


def _print_standalone(r: dict, repeats: int) -> None:
    a = r["alone"]
    print(f"standalone (median of {max(5, 2 * repeats)}, each right after a plain step and a barrier):")
    print(f"  DDP step (fwd + bwd + all-reduce + SGD):  {a['step'] * 1e3:8.2f} ms")
    print(f"  check_gradients, bitwise:                 {a['check'] * 1e3:8.2f} ms  "
          f"= {100 * a['check'] / a['step']:.2f}% of a step (includes waiting for the slower rank)")
    print(f"  floor (one read + one all_gather):        {a['floor'] * 1e3:8.2f} ms  "
          f"= {100 * a['floor'] / a['step']:.2f}% of a step; check / floor = "
          f"{a['check'] / a['floor']:.2f}x")
    print(f"    the check's local fingerprints {a['fingerprints'] * 1e3:.2f} ms = "
          f"{a['fingerprints'] / a['read']:.2f}x one read of the gradients (torch._foreach_norm, "
          f"{a['read'] * 1e3:.2f} ms); one all_gather of {8 * HEADER_INTS} B {a['gather'] * 1e3:.2f} ms")
    print(f"    least-disturbed repeats (minimum of each): step {a['min_step'] * 1e3:.2f} ms, "
          f"check {a['min_check'] * 1e3:.2f} ms, floor {a['min_floor'] * 1e3:.2f} ms")
    print(f"  check_gradients, tolerance (rtol=1e-6):   {a['check_tol'] * 1e3:8.2f} ms  "
          f"= {100 * a['check_tol'] / a['step']:.2f}% of a step")


def _fingerprint_kernels(repeats: int, threads: int) -> None:
    """Local fingerprint kernels on 32 MB of float32, interleaved, as multiples of one read."""
    from graddbg import ddp_verify

    torch.set_num_threads(threads)
    x = torch.randn(8 * 1024 * 1024)
    w = x.view(torch.int32)
    candidates = {
        "one read: torch._foreach_norm": lambda: torch._foreach_norm([x]),
        "fingerprints(bitwise), compiled kernel": lambda: (
            ddp_verify.set_fingerprint_kernel("compiled"), ddp_verify.fingerprints([x])),
        "fingerprints(bitwise), eager kernels": lambda: (
            ddp_verify.set_fingerprint_kernel("eager"), ddp_verify.fingerprints([x])),
        "  the block sums it replaced (blind to reordering)": lambda: w.view(-1, 1024).sum(
            1, dtype=torch.int32),
        "fingerprints(tolerance)": lambda: ddp_verify.fingerprints([x], mode="tolerance"),
    }
    times = {k: [] for k in candidates}
    print("fingerprint kernel:", ddp_verify.set_fingerprint_kernel("compiled"))
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
    parser.add_argument("--repeats", type=int, default=40, help="interleaved repeats of the blocks")
    parser.add_argument("--steps", type=int, default=10, help="DDP steps per block (K)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--fingerprints", action="store_true",
                        help="time the local fingerprint kernels only (one process)")
    parser.add_argument("--kernel", choices=("compiled", "eager", "auto"), default="compiled",
                        help="the fingerprint kernel (ddp_verify.set_fingerprint_kernel); default: "
                             "compiled, set before training starts")
    parser.add_argument("--cost-only", action="store_true",
                        help="only the check's cost as a share of a step, and the proposed N")
    args = parser.parse_args()
    if args.fingerprints:
        _fingerprint_kernels(args.repeats, args.threads)
        return
    world = 2
    queue = mp.get_context("spawn").SimpleQueue()
    if not args.cost_only:
        _check_against_floor(args, world, queue)
    mp.start_processes(_cost_worker, args=(world, _free_port(), args.repeats, args.threads, queue,
                                           args.kernel),
                       nprocs=world, start_method="spawn", join=True)
    _print_costs(queue.get(), args.repeats)


def _check_against_floor(args: argparse.Namespace, world: int, queue) -> None:
    port = _free_port()
    mp.start_processes(_worker, args=(world, port, args.repeats, args.steps, args.threads, queue,
                                      args.kernel),
                       nprocs=world, start_method="spawn", join=True)
    got = [queue.get() for _ in range(world + 1)]
    r = next(g for g in got if g["rank"] == "summary")
    ranks = sorted((g for g in got if g["rank"] != "summary"), key=lambda g: g["rank"])
    print(f"mlp8m: {r['params'] / 1e6:.2f}M parameters in {r['tensors']} tensors, gloo, "
          f"{world} ranks, {args.threads} thread(s) per rank; fingerprint kernel: {r['kernel']}")
    _print_blocks(r, args.repeats, args.steps)
    _print_phases(ranks)
    _print_standalone(r, args.repeats)
    print(f"bytes per rank into collectives: check {r['check_bytes']} B in {r['check_calls']} "
          f"all_gathers, all_reduce of all gradients "
          f"{r['grad_bytes']} B: {r['grad_bytes'] / r['check_bytes']:.0f}x fewer   (target >= 1000x)")


if __name__ == "__main__":
    main()
