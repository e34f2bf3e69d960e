"""Worker for tests/test_sharded.py: graddbg.watch on FSDP2, HSDP and tensor-parallel models,
real gloo processes on 127.0.0.1. Each rank writes what it saw to <out>/<case>-rank<r>.json."""
from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

from _dist import run_rank


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 3))


def data(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


_DEVICE = "cpu"  # "cuda" in the NCCL run (one GPU per rank)


def _shard(case: str, m: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if case == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh(_DEVICE, (dist.get_world_size(),))
        return parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if case == "hsdp":  # replicate x shard
        mesh = init_device_mesh(_DEVICE, (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(_DEVICE, (dist.get_world_size(),))
    for layer in m:
        if isinstance(layer, nn.Linear) and not (case == "mixed" and layer is m[4]):
            fully_shard(layer, mesh=mesh)
    if case != "mixed":
        fully_shard(m, mesh=mesh)
    return m


def _full_norms(m: nn.Module) -> dict:
    out = {}
    for n, p in m.named_parameters():
        g = p.grad
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[n] = g.double().norm().item()
    return out


def _plant_nan_after_reduce_scatter(loss: torch.Tensor, param: nn.Parameter) -> None:
    """A NaN in this rank's shard of ``param``'s gradient, written at the end of the
    backward pass, after FSDP's reduce-scatter (as a faulty device would make it)."""
    queue = torch.autograd.Variable._execution_engine.queue_callback

    def plant():
        param.grad.to_local()[0, 0] = float("nan")

    loss.register_hook(lambda g: queue(lambda: queue(plant)))


def run(case: str, rank: int) -> dict:
    import graddbg

    m = _shard(case, model().to(_DEVICE))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    ref, record = [], {}
    extra = {"ddp_check_every": 1} if case == "fsdp" else {}  # pure FSDP: no replicas to compare
    with warnings.catch_warnings(record=True) as caught, graddbg.watch(m, opt, nonfinite="record", update_every=1,
                                                                       **extra) as w:
        warnings.simplefilter("always")
        for step in range(3):
            x, y = (t.to(_DEVICE) for t in data(rank if case != "tp" else 0, step))
            loss = nn.functional.mse_loss(m(x), y)
            if step == 2 and case == "fsdp" and rank == 1:
                _plant_nan_after_reduce_scatter(loss, dict(m.named_parameters())["2.weight"])
            loss.backward()
            if case != "mixed":
                ref.append(_full_norms(m))
            opt.step()
            opt.zero_grad()
    df = w.stats
    record["names"] = df[df.step == 0]["name"].astype(str).tolist()
    record["model_names"] = [n for n, _ in model().named_parameters()]
    record["norms"] = {int(s): dict(zip(g["name"].astype(str), g["norm"])) for s, g in df.groupby("step", observed=True)}
    record["absmax"] = df[df.step == 0]["absmax"].tolist()
    record["update"] = df["update_ratio"].tolist()
    record["ref"] = ref
    record["anomalies"] = [(a.kind, a.step, a.name, str(a)) for a in w.anomalies]
    record["warnings"] = [str(c.message) for c in caught]
    if case in ("fsdp", "tp"):
        record["edited"] = _hand_edited_nan(case, rank)
    if case == "fsdp":
        record["weight_edited"] = _hand_edited_nan(case, rank, weight=True)
    return record


def _hand_edited_nan(case: str, rank: int, at: int = 1, weight: bool = False) -> dict:
    """A NaN written by hand into rank 1's gradient shard between backward and step (a
    faulty clip, a hand edit): every rank must raise at the same step, naming rank 1.
    ``weight``: into rank 1's shard of the weight itself (every rank's next gradients are
    spoilt by the all-gathered weight: each must name the weight and rank 1)."""
    import graddbg

    m = _shard(case, model().to(_DEVICE))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    weight, weight_nan = dict(m.named_parameters())["2.weight"], weight
    try:
        with graddbg.watch(m, opt, localise=False):
            for step in range(3):
                x, y = (t.to(_DEVICE) for t in data(rank if case != "tp" else 0, step))
                opt.zero_grad()
                nn.functional.mse_loss(m(x), y).backward()
                if rank == 1 and step == at:
                    with torch.no_grad():
                        (weight if weight_nan else weight.grad).to_local().view(-1)[0] = float("nan")
                opt.step()
    except graddbg.NonFiniteError as e:
        dist.barrier()  # (every rank gets here: none is left waiting in a collective)
        return {"step": e.anomaly.step, "message": e.anomaly.message, "name": e.anomaly.name}
    return {"step": None}


def main(case: str, rank: int, world: int, port: int, out: str) -> None:
    run_rank(rank, world, port, os.path.join(out, f"{case}-rank{rank}.json"), lambda: run(case, rank))


def main_nccl(case: str, rank: int, world: int, port: int, out: str) -> None:
    """The same on GPUs: NCCL, one GPU per rank, the meshes on "cuda"."""
    global _DEVICE
    _DEVICE = "cuda"
    torch.cuda.set_device(rank)
    run_rank(rank, world, port, os.path.join(out, f"{case}-rank{rank}.json"), lambda: run(case, rank),
             backend="nccl")


def _check_module_record() -> dict:
    import graddbg

    m = _shard("fsdp", model())
    try:
        graddbg.check_module(m, torch.randn(2, 6))
    except ValueError as e:
        return {"raised": str(e)}
    return {"raised": None}


def check_module_refuses(rank: int, world: int, port: int, out: str) -> None:
    """check_module on a fully_shard-ed model: a ValueError saying what to pass instead."""
    run_rank(rank, world, port, os.path.join(out, f"check-rank{rank}.json"), _check_module_record)
