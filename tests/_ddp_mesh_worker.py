"""Worker processes for tests/test_ddp_mesh.py: ddp_verify's replica checks on sharded
models (HSDP, FSDP2, tensor parallel under data parallelism), real gloo worlds on 127.0.0.1.

Each world runs its scenarios in one set of spawned processes (spawning and importing torch
costs seconds). Every rank writes what it observed, scenario by scenario, to
``<out>/rank<r>.json``; the test process asserts on those files. A scenario that raises
records the error instead of ending the world.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
from torch import nn

import _ddp_workers


def run_world(world: str, nprocs: int, out: str, timeout_s: float = 150.0) -> Dict[int, Dict[str, Any]]:
    """Spawn ``nprocs`` ranks running ``WORLDS[world]``; return {rank: {scenario: record}}
    (the spawning and recording of tests/_ddp_workers.py)."""
    return _ddp_workers.run_world(world, nprocs, out, timeout_s, module=__name__)


# --------------------------------------------------------------------------- helpers
def _v():
    from graddbg import ddp_verify
    return ddp_verify


def _summ(report: Any) -> Dict[str, Any]:
    return {"ok": report.ok, "world_size": report.world_size, "rank": report.rank,
            "names": report.names, "ranks": report.ranks, "checked": report.checked,
            "mode": report.mode, "groups": [list(g) for g in report.replica_groups],
            "rows": [[m.name, m.rank, m.reference_rank, m.reason] for m in report.rows],
            "shards": [[m.local_shape, m.shard] for m in report.rows],
            "details": [[m.max_abs_diff, m.n_diff, m.index] for m in report.rows],
            "text": str(report)}


def _raises(fn: Callable[[], Any]) -> Dict[str, Any]:
    try:
        result = fn()
    except Exception as err:
        return {"error": type(err).__name__, "message": str(err),
                "value_error": isinstance(err, ValueError), "type_error": isinstance(err, TypeError),
                "names": list(getattr(getattr(err, "report", None), "names", []) or [])}
    return {"error": None, "result": _summ(result)}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 3))
    m.register_buffer("scale", torch.ones(3))
    return m


def _batch(seed: int):
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def _train(m: nn.Module, seed: int, steps: int = 2) -> None:
    """``steps`` forward/backward passes; an SGD step after each but the last, so the
    gradients of the last one are still there to check."""
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    for step in range(steps):
        x, y = _batch(seed + 10 * step)
        nn.functional.mse_loss(m(x), y).backward()
        if step < steps - 1:
            opt.step()
            opt.zero_grad()


def _sharded(mesh: Any) -> nn.Module:
    """The MLP with fully_shard on every Linear and on the root, over ``mesh`` (2-D: HSDP)."""
    from torch.distributed.fsdp import fully_shard

    m = _mlp()
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(m, mesh=mesh)


def _hsdp():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return mesh, _sharded(mesh)


# --------------------------------------------------------------------------- HSDP, 4 ranks
def hsdp_healthy(rank, world, dev=None):
    """After a normal step every replica agrees, whichever way the replicas are named."""
    v = _v()
    mesh, m = _hsdp()
    _train(m, rank)
    return {"auto": _summ(v.check_gradients(m)),
            "named": _summ(v.check_gradients(m, group="replicate")),
            "mesh": _summ(v.check_gradients(m, group=mesh["replicate"])),
            "pg": _summ(v.check_gradients(m, group=mesh.get_group("replicate"))),
            "tolerance": _summ(v.check_gradients(m, rtol=1e-6)),
            "params": _summ(v.check_parameters(m)),
            "buffers": _summ(v.check_buffers(m))}


def hsdp_perturbed_grad(rank, world, dev=None):
    """Rank 2 (replicate 1, shard 0) adds 1e-3 to its shard of 2.weight's gradient."""
    v = _v()
    _, m = _hsdp()
    _train(m, rank)
    if rank == 2:
        m[2].weight.grad.to_local()[1, 2] += 1e-3
    return {"auto": _summ(v.check_gradients(m, details=True)),
            "named": _summ(v.check_gradients(m, group="replicate")),
            "tolerance_catches": _summ(v.check_gradients(m, atol=1e-5)),
            "tolerance_allows": _summ(v.check_gradients(m, atol=1e-2)),
            "raised": _raises(lambda: v.check_gradients(m, raise_on_mismatch=True))}


def hsdp_perturbed_param(rank, world, dev=None):
    """Rank 3 (replicate 1, shard 1) adds 1e-3 to its shard of 0.bias (with two replicas
    the lower rank is the reference, so the higher one is the rank named)."""
    v = _v()
    _, m = _hsdp()
    _train(m, rank)
    if rank == 3:
        with torch.no_grad():
            m[0].bias.to_local()[0] += 1e-3
    return {"params": _summ(v.check_parameters(m)), "grads": _summ(v.check_gradients(m))}


def hsdp_buffer(rank, world, dev=None):
    """A plain buffer of a sharded model is compared across every rank."""
    v = _v()
    _, m = _hsdp()
    if rank == 3:
        m.scale[1] = 2.0
    return _summ(v.check_buffers(m))


def hsdp_wrong_dimension(rank, world, dev=None):
    """group='shard' puts ranks holding different shards together: refused on every rank."""
    v = _v()
    mesh, m = _hsdp()
    _train(m, rank, steps=1)
    return {"named": _raises(lambda: v.check_gradients(m, group="shard")),
            "pg": _raises(lambda: v.check_parameters(m, group=mesh.get_group("shard")))}


def hsdp_bad_args(rank, world, dev=None):
    """Bad group= arguments raise on the calling rank, before any collective."""
    v = _v()
    mesh, m = _hsdp()
    return {"unknown": _raises(lambda: v.check_parameters(m, group="nope")),
            "two_d": _raises(lambda: v.check_parameters(m, group=mesh)),
            "int": _raises(lambda: v.check_parameters(m, group=3)),
            "after": _summ(v.check_parameters(m))}


def hsdp_groups(rank, world, dev=None):
    """A plain model with a 1-D mesh as its group (exchanged over that mesh's group), and
    ranks passing groups that do not split the world into replica groups."""
    v = _v()
    mesh, m = _hsdp()
    plain = _summ(v.check_parameters(_mlp(), group=mesh["replicate"]))
    mixed = _raises(lambda: v.check_parameters(m, group="replicate" if rank in (0, 2) else "shard"))
    return {"plain": plain, "mixed": mixed, "after": _summ(v.check_parameters(m))}


def hsdp_skip(rank, world, dev=None):
    """Rank 3 never calls the check: the others raise within the timeout, naming it."""
    v = _v()
    _, m = _hsdp()
    if rank == 3:
        time.sleep(4.0)
        return {"skipped": True}
    start = time.monotonic()
    result = _raises(lambda: v.check_parameters(m, timeout=timedelta(seconds=2)))
    result["elapsed"] = time.monotonic() - start
    return result


# --------------------------------------------------------------------------- pure FSDP, 2 ranks
def fsdp_no_replicas(rank, world, dev=None):
    """Every parameter is sharded over the whole mesh: nothing to compare, said clearly."""
    from torch.distributed.device_mesh import init_device_mesh

    v = _v()
    m = _sharded(init_device_mesh("cpu", (world,)))
    _train(m, rank)
    return {"grads": _raises(lambda: v.check_gradients(m)),
            "params": _raises(lambda: v.check_parameters(m)),
            "world": _raises(lambda: v.check_parameters(m, group=dist.group.WORLD)),
            "buffers": _summ(v.check_buffers(m)),
            "after": _summ(v.check_buffers(m))}


# --------------------------------------------------------------------------- dp x tp, 4 ranks
def _tp(mesh_tp: Any) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    return parallelize_module(m, mesh_tp, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _dp_tp_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _tp_step(m: nn.Module, dp: int) -> None:
    x, y = _batch(dp)      # the same batch across a tensor-parallel group, another per dp rank
    nn.functional.mse_loss(m(x), y).backward()


def dp_tp_replicate(rank, world, dev=None):
    """Tensor parallel over 'tp', replicate() (FSDP2's data parallelism) over 'dp'."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    v = _v()
    mesh = _dp_tp_mesh()
    m = replicate(_tp(mesh["tp"]), mesh=mesh["dp"])
    _tp_step(m, mesh.get_coordinate()[0])
    out = {"placements": [str(tuple(p.placements)) for p in m.parameters()],
           "auto": _summ(v.check_gradients(m)), "named": _summ(v.check_gradients(m, group="dp"))}
    if rank == 3:
        m[0].weight.grad.to_local()[0, 0] += 1e-3
    out["perturbed"] = _summ(v.check_gradients(m))
    return out


def dp_tp_manual(rank, world, dev=None):
    """Tensor parallel over 'tp' (DTensors on the 1-D tp mesh), gradients averaged over
    'dp' by hand, as DDP does: the replicas lie outside the DTensors' own mesh."""
    v = _v()
    mesh = _dp_tp_mesh()
    m = _tp(mesh["tp"])
    _tp_step(m, mesh.get_coordinate()[0])
    for p in m.parameters():
        g = p.grad.to_local()
        dist.all_reduce(g, group=mesh.get_group("dp"))
        g /= 2
    out = {"auto": _summ(v.check_gradients(m)), "named": _summ(v.check_gradients(m, group="dp")),
           "wrong": _raises(lambda: v.check_gradients(m, group="tp"))}
    if rank == 2:
        m[2].bias.grad.to_local()[1] += 1e-3
    out["perturbed"] = _summ(v.check_gradients(m, group="dp"))
    return out


def dp_tp_ddp(rank, world, dev=None):
    """DistributedDataParallel(model, device_mesh=mesh['dp']) over a tensor-parallel model
    holds each DTensor parameter as its local shard (spec in ``_st_info``); checked before
    the first forward (in torch 2.13 the module's parameters are gone after one)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    v = _v()
    mesh = _dp_tp_mesh()
    m = DDP(_tp(mesh["tp"]), device_mesh=mesh["dp"])
    out = {"auto": _summ(v.check_parameters(m))}
    if rank == 3:
        with torch.no_grad():
            m.module[0].weight[2, 1] += 1e-3
    out["perturbed"] = _summ(v.check_parameters(m))
    return out



# --------------------------------------------------------------------------- replicas (issue 24)
def _why(report: Any) -> Dict[str, Any]:
    out = _summ(report)
    out["why"] = [[m.name, m.kind, m.rank, m.cause] for m in report.rows]
    return out


def hsdp_offset(rank, world, dev=None):
    """HSDP: rank 2's shard of 0.weight drifts by a uniform offset of 1e-3 (mixed-sign
    values: a sum of their words would not move); the twin moves both replicas of that
    shard (ranks 0 and 2) alike."""
    v = _v()
    out = {}
    for case, movers in (("one", (2,)), ("twin", (0, 2))):
        _, m = _hsdp()
        _train(m, 0)
        if rank in movers:
            with torch.no_grad():
                m[0].weight.to_local().add_(1e-3)
        out[case] = _why(v.check_replicas(m))
    return out


def _tp_ln(mesh: Any) -> nn.Module:
    """Tensor parallel: Colwise then Rowwise Linear (its bias a Replicate DTensor), then a
    LayerNorm left out of the plan (plain parameters, replicated across the TP group)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3), nn.LayerNorm(3))
    return parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _local_norm_clip(m: nn.Module, max_norm: float) -> None:
    """The BLOOM bug (DeepSpeed PR 1801): a clipping coefficient from this rank's shards
    only, so it differs across the TP group and the replicated LayerNorm drifts."""
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in m.parameters()]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    for g in grads:
        g.mul_(min(1.0, max_norm / float(norm)))


def tp_layernorm(rank, world, dev=None):
    """2-rank tensor parallelism on a cpu DeviceMesh: the replicated tensors (LayerNorm
    weights, the Replicate bias) are compared across the TP group, the shards are not."""
    from torch.distributed.device_mesh import init_device_mesh

    v = _v()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for case in ("clipped", "healthy"):
        m = _tp_ln(mesh)
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        out[case] = {"initial": _why(v.check_replicas(m, gradients=False, initial=True))}
        for step in range(2):
            x, y = _batch(step)                  # the same batch on every TP rank
            nn.functional.mse_loss(m(x), y).backward()
            if case == "clipped":
                _local_norm_clip(m, 1e-2)
            out[case][f"step{step}"] = _why(v.check_replicas(m))
            opt.step()
            opt.zero_grad()
        out[case]["after"] = _why(v.check_parameters(m))
    m = _tp_ln(mesh)
    if rank == 1:
        with torch.no_grad():
            m[3].weight.add_(1e-3)              # drifts on one rank
    out["drift"] = _why(v.check_parameters(m))
    return out

WORLDS: Dict[str, List] = {
    "hsdp": [("healthy", hsdp_healthy), ("perturbed_grad", hsdp_perturbed_grad),
             ("perturbed_param", hsdp_perturbed_param), ("buffer", hsdp_buffer),
             ("wrong_dimension", hsdp_wrong_dimension), ("bad_args", hsdp_bad_args),
             ("groups", hsdp_groups), ("offset", hsdp_offset), ("skip", hsdp_skip)],
    "fsdp": [("no_replicas", fsdp_no_replicas), ("tp_layernorm", tp_layernorm)],
    "dp_tp": [("replicate", dp_tp_replicate), ("manual", dp_tp_manual), ("ddp", dp_tp_ddp)],
}
