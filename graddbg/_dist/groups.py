"""Which ranks hold what: the groups graddbg exchanges over, found once.

What a watch and the cross-rank checks of `graddbg.ddp_verify` both need: the ranks of a
group (`group_ranks`), and which ranks are replicas of a DTensor's shard (`held_coordinates`:
the ranks with the same coordinates on every mesh dimension it is not ``Replicate`` along hold
the same values). On top of them, a watch's groups (`discover`, at its first step boundary
where every peer arrived): one all-gather of a fixed-size signature of each rank's parameters
(count, elements, a hash of names and shapes, stage, the mesh it would flatten), then

- pipeline stages (``torch.distributed.pipelining``: their ``group`` is the pipeline group,
  their ``stage_index`` the stage) with the data-parallel group of a stage from DDP's
  ``process_group`` or from its DTensors' mesh;
- replicas (every rank holds the same parameters): the world, or the group given;
- different parameters on each rank without a pipeline stage: a fixed-size summary over the
  world, and replicas among the ranks of the model's DDP group when they hold the same.

Ranks whose parameters differ are never asked for per-parameter data.

This module imports only `graddbg._errors`, `graddbg._model` and `graddbg._dist.collective`.
"""
from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from graddbg._dist.collective import all_gather
from graddbg._errors import GraddbgWarning, warn_at_user
from graddbg._model import is_dtensor

__all__ = ["WORLD", "Groups", "as_group", "discover", "group_ranks", "held_coordinates", "shard_replicas"]

WORLD = "world"  #: the default process group, as a group value


def as_group(group: Any) -> Any:
    """A group value as ``torch.distributed`` takes it (None: the default group)."""
    return None if group is WORLD else group


def group_ranks(group: Any) -> List[int]:
    """The global ranks of ``group`` (None: the default group), in the group's rank order."""
    dist = torch.distributed
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def held_coordinates(mesh: Any, placements: Sequence[Any]) -> Tuple[Optional[int], ...]:
    """Which shard of a tensor placed by ``placements`` on ``mesh`` this rank holds: its
    coordinate on every dimension the tensor is not ``Replicate`` along, None on those it is
    (and everywhere when this rank is not in the mesh). Ranks with equal coordinates hold
    the same shard: they are replicas of each other."""
    coords = mesh.get_coordinate() or [None] * mesh.ndim
    return tuple(None if p.is_replicate() else c for p, c in zip(placements, coords))


# --------------------------------------------------------------------------- a stage's meshes
def _widest_mesh(model: nn.Module) -> Any:
    """The mesh of ``model``'s DTensor parameters that holds the ranks of all the others;
    None when it holds none, or when no one of them holds all."""
    meshes = {id(p.device_mesh): p.device_mesh for p in model.parameters() if is_dtensor(p)}
    if not meshes:
        return None
    widest = max(meshes.values(), key=lambda m: m.mesh.numel())
    ranks = set(widest.mesh.reshape(-1).tolist())
    if any(not set(m.mesh.reshape(-1).tolist()) <= ranks for m in meshes.values()):
        return None
    return widest


def _flat_name(model: nn.Module) -> str:
    """The name graddbg flattens the widest mesh of ``model``'s DTensor parameters under,
    when it has two or more named dimensions (``graddbg_<its dimensions>``); else ""."""
    mesh = _widest_mesh(model)
    if mesh is None or mesh.ndim < 2 or not mesh.mesh_dim_names:
        return ""
    return "graddbg_" + "_".join(mesh.mesh_dim_names)


def _dp_group(model: nn.Module, flatten: bool = False) -> Any:
    """The group of a wrapped stage's replicas and shards: DDP's ``process_group``, or the
    group of every rank of its DTensor parameters' meshes (FSDP2 over a data-parallel
    dimension, tensor parallelism over another: one stage's ranks in a 3-D mesh); None when
    there is none.

    A mesh of two or more dimensions is flattened (``DeviceMesh._flatten``, which makes
    process groups: a call every rank of the world makes in the same order, or the groups
    made after it no longer match across ranks) only with ``flatten``, which the caller sets
    when every rank said, in the signatures gathered before, that it flattens a mesh of the
    same name here."""
    pg = getattr(model, "process_group", None)
    if pg is not None and type(model).__name__ == "DistributedDataParallel":
        return pg
    mesh = _widest_mesh(model)
    if mesh is None:
        return None
    if mesh.ndim == 1:
        return mesh.get_group()
    name = _flat_name(model) if flatten else ""
    return mesh._flatten(name).get_group() if name else None


def _stage_mesh(model: nn.Module) -> Dict[str, int]:
    """The dimensions (name: size) of the widest mesh of a stage's DTensor parameters."""
    widest = _widest_mesh(model)
    if widest is None:
        return {}
    names = widest.mesh_dim_names or tuple(f"dim{i}" for i in range(widest.ndim))
    return {str(k): int(v) for k, v in zip(names, widest.mesh.shape)}


def shard_replicas(model: nn.Module) -> Optional[tuple]:
    """``(k, j, m)`` when every parameter of ``model`` is a DTensor on one mesh, with the
    same placements, replicated along some of its dimensions (HSDP's replicate dimension):
    the ranks with the same coordinates on the other dimensions hold the same shards
    (`held_coordinates`). k: the number of distinct shards; j: this rank's; m: the ranks
    holding each. Else None."""
    params = list(model.parameters())
    if not params or not all(is_dtensor(p) for p in params):
        return None
    mesh, placements = params[0].device_mesh, tuple(params[0].placements)
    if any(p.device_mesh is not mesh and p.device_mesh != mesh or tuple(p.placements) != placements for p in params):
        return None
    rep = [d for d, pl in enumerate(placements) if pl.is_replicate()]
    if not rep or mesh.get_coordinate() is None:
        return None
    held = held_coordinates(mesh, placements)
    other = [d for d in range(mesh.ndim) if d not in rep]
    sizes = list(mesh.mesh.shape)
    k = int(np.prod([sizes[d] for d in other])) if other else 1
    j = int(np.ravel_multi_index([held[d] for d in other], [sizes[d] for d in other])) if other else 0
    return k, j, int(np.prod([sizes[d] for d in rep]))


def _signature(names: Sequence[str], params: Sequence[Tensor], stage: int, flat: str = "") -> List[int]:
    """A fixed-size description of this rank's parameters: equal on two ranks when they
    hold the same parameters (by name and full shape); then its stage, and the name of the
    mesh it would flatten (a hash; 0: none)."""
    text = "|".join(f"{n}:{tuple(p.shape)}" for n, p in zip(names, params))
    return [len(params), int(sum(p.numel() for p in params)), zlib.crc32(text.encode()), stage,
            zlib.crc32(flat.encode()) if flat else 0]


# --------------------------------------------------------------------------- a watch's groups
@dataclasses.dataclass(frozen=True)
class Groups:
    """Which ranks a watch exchanges what with (`discover`); the defaults until found."""

    replica_group: Any = None          #: per-parameter data: ranks holding the same parameters
    shard_group: Any = WORLD           #: DTensor shard statistics (False: this rank's shards only)
    summary_group: Any = None          #: the per-step summary (a pipeline group, or the world)
    slots: List[int] = dataclasses.field(default_factory=list)          #: this rank's slots in it
    summary_ranks: List[int] = dataclasses.field(default_factory=list)  #: a global rank of each slot
    #: each watched parameter's slot (several stages on this rank), else None
    param_slot: Optional[Tensor] = None
    #: per rank, the first rank holding the same parameters (different parameters, no pipeline)
    classes: List[int] = dataclasses.field(default_factory=list)
    ddp_stages: bool = False           #: several stages here, each wrapped in DDP (replicas)
    #: a stage's DTensor parameters replicated along some mesh dimensions (HSDP), as
    #: `shard_replicas` gives them, for the replicas' per-step hash; None otherwise
    shard_replicas: Optional[tuple] = None


def discover(model: nn.Module, names: Sequence[str], params: Sequence[Tensor], stages: List[Any],
             given: Tuple[Any, Any], meta: Dict[str, Any]) -> Groups:
    """The groups of a watch of ``model`` (``stages``: its pipeline stages on this rank;
    ``given``: the pipeline and data-parallel groups given, or None), from one all-gather of
    every rank's signature: a collective of the world, which every rank issues at the same
    boundary. ``meta`` (the run's) gets the layout found."""
    dist = torch.distributed
    rank, world = dist.get_rank(), dist.get_world_size()
    module = stages[0].submod if len(stages) > 1 else model  # (whose wrapper and meshes tell the groups)
    pipeline = bool(stages) or given[0] is not None
    stage = stages[0].stage_index if stages else -1
    device = params[0].device if params else torch.device("cpu")
    mine = torch.tensor(_signature(names, params, stage, _flat_name(module) if pipeline else ""),
                        dtype=torch.int64, device=device)
    sigs = all_gather(mine).cpu().numpy()
    if pipeline:
        return _pipeline_groups(module, params, stages, given, sigs, rank, meta)
    if all((sigs[r, :3] == sigs[rank, :3]).all() for r in range(world)):
        meta["layout"] = "replicas"
        return Groups(replica_group=given[1] if given[1] is not None else WORLD)
    # different parameters, no pipeline stage known: a fixed-size exchange per rank
    classes = [next(r for r in range(world) if (sigs[r, :3] == sigs[s, :3]).all()) for s in range(world)]
    meta["layout"] = "different parameters on each rank"
    # replicas among them: the ranks of the model's DDP group (or 1-D mesh), when every one
    # of them holds the same parameters as this rank (a hand-written pipeline, DDP per stage)
    dp = given[1] if given[1] is not None else _dp_group(model)
    if dp is not None and all((sigs[r, :3] == sigs[rank, :3]).all() for r in dist.get_process_group_ranks(dp)):
        meta["dp_size"] = dist.get_world_size(dp)
    else:
        dp = None
    return Groups(replica_group=dp, summary_group=WORLD, slots=[rank], summary_ranks=list(range(world)),
                  classes=classes)


def _pipeline_groups(module: nn.Module, params: Sequence[Tensor], stages: List[Any], given: Tuple[Any, Any],
                     sigs: np.ndarray, rank: int, meta: Dict[str, Any]) -> Groups:
    """A pipeline's groups: the summary over the pipeline group, per-parameter data and
    shard statistics over the stage's data-parallel group (never the world: other stages
    hold other tables)."""
    dist = torch.distributed
    pp_given, dp_given = given
    stage = stages[0] if stages else None
    summary = pp_given if pp_given is not None else (stage.group or WORLD)
    # (a mesh is flattened, a collective of the world, only when every rank flattens one alike)
    flatten = bool(sigs[rank, 4]) and bool((sigs[:, 4] == sigs[rank, 4]).all())
    dp = dp_given if dp_given is not None else _dp_group(module, flatten)
    if dp is None and sigs[rank, 4] and not flatten:
        warn_at_user(f"graddbg.watch on rank {rank}: this stage's DTensor parameters lie on a mesh of "
                     f"several dimensions, which graddbg flattens into one group to combine their shards' "
                     f"statistics only when every rank of the world holds such a mesh (making the group is "
                     f"a collective of every rank); here not every rank does, so each rank records the "
                     f"statistics of its own shards.", GraddbgWarning)
    ddp_stages = False
    if dp is None and len(stages) > 1:  # (the stages wrapped one by one)
        dp = next((g for g in (_dp_group(st.submod) for st in stages) if g is not None), None)
        ddp_stages = all(type(st.submod).__name__ == "DistributedDataParallel" for st in stages)
    size = dist.get_world_size(as_group(summary))
    n = stage.num_stages if stage is not None else size
    slots, param_slot = _slots_of_stages(stages, params, summary)
    meta.update(layout="pipeline", stage=slots[0] if len(slots) == 1 else list(slots), num_stages=n, pp_size=size,
                dp_size=1 if dp is None else dist.get_world_size(as_group(dp)))
    replicas = shard_replicas(module)
    dims = _stage_mesh(module)
    if len(dims) > 1:  # (a stage's ranks in a mesh of data and tensor/context parallelism)
        meta["stage_mesh"] = dims
        meta["dp_size"] = int(np.prod([v for k, v in dims.items() if not k.startswith(("tp", "cp"))]))
    group = as_group(summary)
    to_rank = getattr(stage, "stage_index_to_group_rank", None) or {i: i % size for i in range(n)}
    ranks = [dist.get_global_rank(group, to_rank[i]) if group is not None else to_rank[i] for i in range(n)]
    return Groups(replica_group=dp, shard_group=dp if dp is not None else False, summary_group=summary,
                  slots=slots, summary_ranks=ranks, param_slot=param_slot, ddp_stages=ddp_stages,
                  shard_replicas=replicas)


def _slots_of_stages(stages: List[Any], params: Sequence[Tensor], summary: Any) -> Tuple[List[int], Optional[Tensor]]:
    """This rank's stages, and each watched parameter's stage (several stages here)."""
    if not stages:  # (explicit pp_group: one stage per rank of it)
        return [torch.distributed.get_rank(as_group(summary))], None
    slots = [s.stage_index for s in stages]
    owner = {}
    for s in stages:
        for p in s.submod.parameters():
            owner[id(p)] = s.stage_index
    return slots, torch.tensor([owner.get(id(p), slots[0]) for p in params], dtype=torch.int64)
