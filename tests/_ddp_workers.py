"""Worker processes for tests/test_ddp_verify.py: real gloo worlds on 127.0.0.1.

Each world runs many scenarios in one set of spawned processes (spawning and importing
torch costs seconds). Every rank writes what it observed, scenario by scenario, to
``<out>/rank<r>.json``; the test process asserts on those files. A scenario that raises
records the error instead of ending the world.
"""
from __future__ import annotations

import importlib
import json
import os
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import context, free_port  # noqa: F401 (free_port is also used by the tests through this module)




def run_world(world: str, nprocs: int, out: str, timeout_s: float = 120.0,
              device: str = "cpu", module: str = __name__) -> Dict[int, Dict[str, Any]]:
    """Spawn ``nprocs`` ranks running ``WORLDS[world]`` of the worker module ``module``
    (this one by default; its scenarios take ``(rank, world, device)``); return
    {rank: {scenario: record}}."""
    port = free_port()
    ctx = context()
    procs = [ctx.Process(target=_main, args=(world, r, nprocs, port, out, device, module), daemon=True)
             for r in range(nprocs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    results = {}
    for r in range(nprocs):
        path = os.path.join(out, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                results[r] = json.load(f)
    if hung:
        raise AssertionError(f"world {world!r}: ranks {hung} still running after {timeout_s} s; "
                             f"results so far: {results}")
    return results


def _main(world: str, rank: int, nprocs: int, port: int, out: str, device: str, module: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    # "cpu:gloo" is not plain "gloo" to torch.distributed (monitored_barrier refuses it), so
    # that world's checks go through gloo side groups, as they do under NCCL.
    backend = BACKENDS.get(world, "gloo")
    dist.init_process_group(backend, rank=rank, world_size=nprocs, timeout=timedelta(seconds=60))
    record: Dict[str, Any] = {}
    path = os.path.join(out, f"rank{rank}.json")
    dev = torch.device(device)
    for name, fn in importlib.import_module(module).WORLDS[world]:
        try:
            record[name] = fn(rank, nprocs, dev)
        except Exception as err:  # recorded, asserted on by the test
            record[name] = {"error": type(err).__name__, "message": str(err),
                            "traceback": traceback.format_exc()[-2000:]}
        with open(path + ".tmp", "w") as f:
            json.dump(record, f, default=str)
        os.replace(path + ".tmp", path)
    # Rank 0 hosts the store, which the others may still read (a check that timed out
    # reads the counters there): it leaves only when every rank is done, or after 60 s.
    store = dist.distributed_c10d._get_default_store()
    store.set(f"worker-done/{rank}", "1")
    if rank == 0:
        try:
            store.wait([f"worker-done/{r}" for r in range(nprocs)], timedelta(seconds=60))
        except Exception:
            pass
    # A world may end with a failed barrier, so the group is left without destroying it.
    os._exit(0)


# --------------------------------------------------------------------------- helpers
def _summ(report: Any) -> Dict[str, Any]:
    return {"ok": report.ok, "world_size": report.world_size, "rank": report.rank,
            "names": report.names, "ranks": report.ranks, "checked": report.checked,
            "mode": report.mode, "kind": report.kind, "max_abs_diff": report.max_abs_diff,
            "rows": [[m.name, m.rank, m.reference_rank, m.reason, m.max_abs_diff, m.n_diff]
                     for m in report.rows],
            "where": [[m.index, m.value, m.reference_value] for m in report.rows],
            "df_columns": list(report.mismatches.columns), "df_len": len(report.mismatches),
            "text": str(report)}


def _mlp(dev: torch.device, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dev)


def _batch(rank: int, dev: torch.device, n: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, 8, generator=g).to(dev)


class _Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(8, 4)
        self.unused = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _check():
    from graddbg import ddp_verify
    return ddp_verify


# --------------------------------------------------------------------------- scenarios
def healthy(rank, world, dev):
    v = _check()
    model = DDP(_mlp(dev))
    model(_batch(rank, dev)).sum().backward()
    out = {"grads": _summ(v.check_gradients(model)),
           "params": _summ(v.check_parameters(model)),
           "buffers": _summ(v.check_buffers(model)),
           "tolerance": _summ(v.check_gradients(model, rtol=1e-6, atol=1e-8)),
           "plain_module": _summ(v.check_gradients(model.module))}
    t = torch.ones(3, device=dev)
    dist.all_reduce(t)
    out["allreduce_after"] = t.tolist()
    return out


def find_unused(rank, world, dev):
    v = _check()
    torch.manual_seed(0)
    model = DDP(_Unused().to(dev), find_unused_parameters=True)
    model(_batch(rank, dev)).sum().backward()
    return {"report": _summ(v.check_gradients(model)),
            "unused_grad_none": model.module.unused.weight.grad is None}


def static_bucket_view(rank, world, dev):
    v = _check()
    model = DDP(_mlp(dev), static_graph=True, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reports = []
    for step in range(3):
        model(_batch(rank + 10 * step, dev)).sum().backward()
        reports.append(v.check_gradients(model).ok)
        opt.step()
        opt.zero_grad()
        reports.append(v.check_parameters(model).ok)
    return {"oks": reports}


def _corrupting_hook(target_rank: int, record: Dict[str, Any], names: Dict[int, str]):
    def hook(state, bucket):
        buf = bucket.buffer()
        buf.div_(dist.get_world_size())
        fut = dist.all_reduce(buf, async_op=True).get_future()

        def then(f):
            out = f.value()[0]
            if bucket.index() == 0 and not record.get("done"):
                record["done"] = True
                record["expected"] = names[id(bucket.parameters()[0])]
                if dist.get_rank() == target_rank:
                    out[0] += 1.0
            return out
        return fut.then(then)
    return hook


def comm_hook_corrupt(rank, world, dev, target=1):
    v = _check()
    model = DDP(_mlp(dev))
    names = {id(p): n for n, p in model.module.named_parameters()}
    record: Dict[str, Any] = {}
    model.register_comm_hook(None, _corrupting_hook(target, record, names))
    model(_batch(rank, dev)).sum().backward()
    report = v.check_gradients(model, details=True)
    return {"expected": record.get("expected"), "report": _summ(report),
            "raised": _raises(lambda: v.check_gradients(model, raise_on_mismatch=True))}


def comm_hook_corrupt_rank0(rank, world, dev):
    return comm_hook_corrupt(rank, world, dev, target=0)


def _raises(fn: Callable[[], Any]) -> Dict[str, Any]:
    try:
        fn()
    except Exception as err:
        report = getattr(err, "report", None)
        return {"error": type(err).__name__, "message": str(err),
                "names": None if report is None else report.names}
    return {"error": None}


def drift(rank, world, dev):
    v = _check()
    model = DDP(_mlp(dev))
    before = v.check_parameters(model)
    if rank == 1:
        with torch.no_grad():
            model.module[2].weight[1, 3] += 1e-3
    after = _summ(v.check_parameters(model, details=True))
    from graddbg import _verdict

    old, _verdict._DETAIL_BYTES = _verdict._DETAIL_BYTES, 8 * world * 16   # slices of 16 elements
    try:
        sliced = _summ(v.check_parameters(model, details=True))
    finally:
        _verdict._DETAIL_BYTES = old
    return {"before": _summ(before), "after": after, "sliced": sliced,
            "reference": model.module[2].weight[1, 3].item(),
            "after_tol": _summ(v.check_parameters(model, rtol=1e-5))}


def same_nan(rank, world, dev):
    v = _check()
    model = DDP(_mlp(dev))
    model(_batch(rank, dev)).sum().backward()
    model.module[0].weight.grad[2, 1] = float("nan")
    model.module[2].bias.grad[0] = float("inf")
    return {"bitwise": _summ(v.check_gradients(model)),
            "tolerance": _summ(v.check_gradients(model, rtol=1e-5))}


def nan_rank1(rank, world, dev):
    v = _check()
    model = DDP(_mlp(dev))
    model(_batch(rank, dev)).sum().backward()
    if rank == 1:
        model.module[0].bias.grad[3] = float("nan")
    return {"bitwise": _summ(v.check_gradients(model, details=True)),
            "tolerance": _summ(v.check_gradients(model, rtol=1e-3))}


def _accumulate(model, opt, rank, dev, accum, buggy):
    """4 micro-batches per step. The bug: the no_sync condition is off by one."""
    v = _check()
    for i in range(accum):
        x = _batch(rank * 50 + i, dev)
        skip_sync = (i % accum != 0) if buggy else ((i + 1) % accum != 0)
        if skip_sync:
            with model.no_sync():
                model(x).sum().backward()
        else:
            model(x).sum().backward()
    report = v.check_gradients(model)   # after the backward that should have synchronised
    opt.step()
    opt.zero_grad()
    return report, v.check_parameters(model)


def no_sync(rank, world, dev):
    out = {}
    for buggy in (False, True):
        model = DDP(_mlp(dev))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        grads, params = _accumulate(model, opt, rank, dev, 4, buggy)
        out["buggy" if buggy else "correct"] = {"grads": _summ(grads), "params": _summ(params)}
    return out


def missing_grad(rank, world, dev):
    v = _check()
    model = _mlp(dev)
    model(_batch(0, dev)).sum().backward()      # same data: the same gradients everywhere
    if rank == 1:
        model[2].weight.grad = None
    return {"report": _summ(v.check_gradients(model))}


def batchnorm(rank, world, dev):
    v = _check()

    def bn_model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2)).to(dev)

    out = {}
    for same_data in (True, False):
        model = DDP(bn_model(), broadcast_buffers=False)
        model(_batch(0 if same_data else rank, dev)).sum().backward()
        out["same" if same_data else "different"] = _summ(v.check_buffers(model))
    return out


def tolerance(rank, world, dev):
    v = _check()
    model = _mlp(dev)
    if rank == 1:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + 1e-7 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)).to(dev))
    out = {"bitwise": _summ(v.check_parameters(model)),
           "tolerance": _summ(v.check_parameters(model, rtol=1e-5)),
           "tight": _summ(v.check_parameters(model, rtol=1e-12))}
    if rank == 1:
        with torch.no_grad():
            model[0].weight[0, 0] += 0.05
    out["big"] = _summ(v.check_parameters(model, rtol=1e-5, atol=1e-6, details=True))
    return out


def hand_allreduce(rank, world, dev):
    v = _check()
    model = _mlp(dev)
    model(_batch(rank, dev)).sum().backward()
    before = v.check_gradients(model)
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    return {"before": _summ(before), "after": _summ(v.check_gradients(model))}


def architecture(rank, world, dev):
    v = _check()
    torch.manual_seed(0)
    width = 12 if rank == 1 else 16
    model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 4)).to(dev)
    deeper = nn.Sequential(*([nn.Linear(4, 4)] * 1 + ([nn.Linear(4, 4)] if rank == 1 else []))).to(dev)
    return {"width": _raises(lambda: v.check_parameters(model)),
            "depth": _raises(lambda: v.check_parameters(deeper)),
            "calls": _raises(lambda: (v.check_gradients if rank == 0 else v.check_parameters)(_mlp(dev))),
            "after": _summ(v.check_parameters(_mlp(dev)))}


def side_group(rank, world, dev):
    from graddbg._dist import rendezvous as _rendezvous
    from graddbg import ddp_verify
    side = _rendezvous.side_group(None, timedelta(seconds=20), force_side=True)
    again = _rendezvous.side_group(None, timedelta(seconds=20), force_side=True)
    dist.monitored_barrier(side, timeout=timedelta(seconds=20))
    out = {"cached": side is again, "side_world": dist.get_world_size(side),
           "check": _summ(ddp_verify.check_parameters(_mlp(dev)))}
    out["backend"] = str(dist.get_backend())
    out["side_groups"] = len(_rendezvous._SIDE_GROUPS)
    return out


def subgroup(rank, world, dev):
    v = _check()
    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        result = _summ(v.check_parameters(_mlp(dev), group=sub))
        from graddbg._dist import rendezvous as _rendezvous

        result["side_groups"] = len(_rendezvous._SIDE_GROUPS)
    else:
        result = {"skipped": True}
    dist.barrier()
    return result


def bad_args(rank, world, dev):
    v = _check()
    model = _mlp(dev)
    return {"atol": _raises(lambda: v.check_gradients(model, atol=-1.0)),
            "timeout": _raises(lambda: v.check_gradients(model, timeout="soon")),
            "model": _raises(lambda: v.check_gradients(nn.Linear)),
            "after": _summ(v.check_parameters(model))}


def local_failure(rank, world, dev):
    """Fingerprinting raises on rank 1 (out of memory, say): every rank raises, none hangs."""
    v = _check()
    model = _mlp(dev)
    original = v.fingerprints

    def broken(*args, **kw):
        raise RuntimeError("simulated failure while fingerprinting")
    if rank == 1:
        v.fingerprints = broken
    try:
        result = _raises(lambda: v.check_parameters(model, timeout=timedelta(seconds=20)))
    finally:
        v.fingerprints = original
    result["after"] = _summ(v.check_parameters(model))
    return result


def no_store(rank, world, dev):
    """Without a store to count check-ins in, the checks fall back to a monitored barrier."""
    from graddbg._dist import rendezvous as _rendezvous

    v = _check()
    original = _rendezvous._store
    _rendezvous._store = lambda: None
    try:
        model = DDP(_mlp(dev))
        model(_batch(rank, dev)).sum().backward()
        healthy = _summ(v.check_gradients(model))
        if rank == 1:
            model.module[0].bias.grad[3] = float("nan")
        bad = _summ(v.check_gradients(model))
    finally:
        _rendezvous._store = original
    return {"healthy": healthy, "bad": bad, "after": _summ(v.check_gradients(model))}


def late(rank, world, dev):
    """Rank 1 enters the check 3 s late, the others wait 2 s: every rank raises, and the
    group still works afterwards (the waiting ranks' exchange completed when rank 1 came)."""
    v = _check()
    model = _mlp(dev)
    if rank == 1:
        time.sleep(3.0)
    start = time.monotonic()
    result = _raises(lambda: v.check_parameters(model, timeout=timedelta(seconds=2)))
    result["elapsed"] = time.monotonic() - start
    result["after"] = _summ(v.check_parameters(model))
    return result


def _skipper(skip_rank: int):
    def scenario(rank, world, dev):
        v = _check()
        model = _mlp(dev)
        if rank == skip_rank:
            time.sleep(4.0)
            return {"skipped": True}
        start = time.monotonic()
        result = _raises(lambda: v.check_gradients(model, timeout=timedelta(seconds=2)))
        result["elapsed"] = time.monotonic() - start
        return result
    return scenario


def cuda_gloo(rank, world, dev):
    v = _check()
    model = DDP(_mlp(dev))
    model(_batch(rank, dev)).sum().backward()
    ok = _summ(v.check_gradients(model))
    if rank == 1:
        model.module[0].bias.grad[3] = float("nan")
    return {"healthy": ok, "nan": _summ(v.check_gradients(model, details=True)),
            "tolerance": _summ(v.check_gradients(model, rtol=1e-4))}



# --------------------------------------------------------------------------- replicas (issue 24)
def _rsumm(report: Any) -> Dict[str, Any]:
    """A check_replicas report: the verdict and, per row, name, kind, rank and cause."""
    out = _summ(report)
    out["why"] = [[m.name, m.kind, m.rank, m.cause] for m in report.rows]
    return out


def _steps(model, opt, rank, dev, steps=2):
    """What watch() does with ddp_check_every=1: the parameters before the first step
    (initial=True), then after each backward, before the optimizer step, both at once."""
    v = _check()
    out = {"initial": _rsumm(v.check_replicas(model, gradients=False, initial=True))}
    for step in range(steps):
        model(_batch(rank + 10 * step, dev)).sum().backward()
        out[f"step{step}"] = _rsumm(v.check_replicas(model))
        opt.step()
        opt.zero_grad()
    return out


def unwrapped(rank, world, dev):
    """DDP forgotten: on one rank (rank 0 wraps its model in DDP over a group of its own,
    so nothing is averaged with rank 1, which has a plain model) and on every rank; the
    healthy twin wraps it on every rank."""
    own = [dist.new_group([r]) for r in range(world)]
    out = {}
    for case in ("one", "every", "healthy"):
        net = _mlp(dev)
        if case == "healthy" or (case == "one" and rank == 0):
            model = DDP(net, process_group=None if case == "healthy" else own[rank])
        else:
            model = net
        out[case] = _steps(model, torch.optim.SGD(model.parameters(), lr=0.1), rank, dev)
    return out


def replaced(rank, world, dev):
    """pytorch issue 104336: a layer replaced after DDP wrapped the model (DDP keeps
    reducing the old parameters), here with a new layer initialised per rank; the twin
    replaces it before wrapping."""
    out = {}
    for case in ("after", "before"):
        net = _mlp(dev)
        model = DDP(net) if case == "after" else None
        torch.manual_seed(1000 + rank)
        net[2] = nn.Linear(16, 4).to(dev)
        if case == "before":
            torch.manual_seed(7)
            net[2] = nn.Linear(16, 4).to(dev)
            model = DDP(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out[case] = _steps(model, opt, rank, dev, steps=1)
    return out


def _zeroing_hook(target_rank: Optional[int], seen: Dict[int, List[str]], names: Dict[int, str]):
    """A comm hook that all-reduces every bucket and, from the second step on (DDP rebuilds
    its buckets after the first, by size), zeroes bucket 0 on ``target_rank`` (pytorch
    issues 84803, 96600: a link that silently zeroes some all-reduces). ``seen``: the
    parameters of each bucket, by index, as last seen."""
    calls = {"bucket0": 0}

    def hook(state, bucket):
        seen[bucket.index()] = [names[id(p)] for p in bucket.parameters()]
        if bucket.index() == 0:
            calls["bucket0"] += 1
        zero = calls["bucket0"] > 1 and bucket.index() == 0 and dist.get_rank() == target_rank
        buf = bucket.buffer()
        buf.div_(dist.get_world_size())
        fut = dist.all_reduce(buf, async_op=True).get_future()

        def then(f):
            out = f.value()[0]
            return out.zero_() if zero else out
        return fut.then(then)
    return hook


def zeroed_bucket(rank, world, dev):
    out = {}
    for case, target in (("zeroed", 1), ("healthy", None)):
        model = DDP(_mlp(dev), bucket_cap_mb=1e-5)      # rebuilt: a bucket per parameter
        seen: Dict[int, List[str]] = {}
        names = {id(p): n for n, p in model.module.named_parameters()}
        model.register_comm_hook(None, _zeroing_hook(target, seen, names))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out[case] = _steps(model, opt, rank, dev, steps=2)
        out[case]["buckets"] = {str(k): v for k, v in seen.items()}
    return out


def transposed(rank, world, dev):
    """A square weight transposed on one rank (every element still there, in other places),
    and parameters drifted by a uniform offset of mixed-sign values: the bitwise check sees
    both, and the twins (the same on both ranks) report nothing."""
    v = _check()
    out = {}
    for case in ("one", "both"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)).to(dev)
        with torch.no_grad():
            if case == "both" or rank == 1:
                model[2].weight.copy_(model[2].weight.t().clone())
        out[case] = _rsumm(v.check_replicas(model, gradients=False))
        with torch.no_grad():
            if case == "both" or rank == 1:
                model[0].bias.add_(1e-3)         # values in [-0.25, 0.25] moved by +1e-3
        out[f"{case}_drift"] = _rsumm(v.check_replicas(model, gradients=False))
    return out

BACKENDS = {"three": "cpu:gloo"}

WORLDS: Dict[str, List] = {
    "two": [("healthy", healthy), ("find_unused", find_unused),
            ("static_bucket_view", static_bucket_view), ("comm_hook", comm_hook_corrupt),
            ("drift", drift), ("same_nan", same_nan), ("nan_rank1", nan_rank1),
            ("no_sync", no_sync), ("missing_grad", missing_grad), ("batchnorm", batchnorm),
            ("tolerance", tolerance), ("hand_allreduce", hand_allreduce),
            ("architecture", architecture), ("bad_args", bad_args),
            ("local_failure", local_failure), ("no_store", no_store),
            ("unwrapped", unwrapped), ("replaced", replaced), ("zeroed_bucket", zeroed_bucket),
            ("transposed", transposed), ("late", late), ("skip", _skipper(1))],
    "three": [("healthy", healthy), ("comm_hook", comm_hook_corrupt),
              ("comm_hook_rank0", comm_hook_corrupt_rank0), ("side_group", side_group),
              ("subgroup", subgroup), ("skip", _skipper(2))],
    "cuda": [("cuda_gloo", cuda_gloo)],
}
