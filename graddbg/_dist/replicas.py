"""Who is compared with whom in a cross-rank check: the arguments of one check, the layout
of what each rank holds (a DTensor's shard and its placements on the mesh), and the replica
groups, the sets of ranks that should hold equal values of a tensor (see
`graddbg.ddp_verify`'s module docstring, "Sharded models").
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
from datetime import timedelta
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from graddbg._args import Options, duration, option, tolerance
from graddbg._dist.collective import all_gather
from graddbg._dist.groups import group_ranks, held_coordinates
from graddbg._errors import GraddbgValueError
from graddbg._model import clean_name, is_dtensor, local_values

__all__ = ["CheckOptions", "KINDS", "all_layouts", "collect_all", "gather_tables", "hash64", "is_mesh",
           "local_shapes", "no_replicas", "placement_text", "replica_header", "replica_sets",
           "resolve", "shard_text", "tensor_sets", "HEADER", "SHARDED_HEADER"]

#: what a check compares, in the order its tensors are laid end to end
KINDS = ("gradients", "parameters", "buffers")
_KEY, _COUNT, _SHARDS = 6, 7, 8     # sharded models' header: replica key, count, layout hash
HEADER = 6                          # header fields of every check (before the replica fields)
SHARDED_HEADER = 9                  # ... and of a check of a model holding DTensors


def _truthy(where: str, name: str, value: Any) -> bool:
    return bool(value)


def _tolerance(where: str, name: str, value: Any) -> float:
    return tolerance(where, name, value)


@dataclasses.dataclass(frozen=True)
class CheckOptions(Options):
    """One check's arguments, validated once (``graddbg.ddp_verify`` builds them with
    `graddbg._args.Options.parse`; ``fn``, ``parts`` and ``group`` are the call's context)."""

    fn: str
    parts: Tuple[str, ...]      # what is fingerprinted, in the order of KINDS
    group: Any                  # the group the fingerprints are exchanged over
    atol: float = option(0.0, _tolerance, "absolute tolerance (0: bitwise)")
    rtol: float = option(0.0, _tolerance, "relative tolerance (0: bitwise)")
    timeout: timedelta = option(timedelta(seconds=60), duration, "how long to wait for the other ranks")
    details: bool = option(False, _truthy, "per-tensor rows in the report")
    raise_on_mismatch: bool = option(False, _truthy, "raise when the ranks disagree")
    sharded: bool = False       # the model holds DTensors: compare shard by shard, within replicas
    replicas: Optional[Tuple[int, ...]] = None  # sharded, group= given: this rank's replicas
    initial: bool = False       # check_replicas(initial=True): before any optimizer step

    @property
    def kind(self) -> str:
        """The parts as the report names them: "gradients", "gradients and parameters", ..."""
        return " and ".join(self.parts)

    @property
    def mode(self) -> str:
        return "bitwise" if self.atol == 0 and self.rtol == 0 else "tolerance"

    @property
    def call(self) -> str:
        """What was asked; every rank must ask the same (its hash is in the header)."""
        what = f"{self.kind}, initial={self.initial}, " if self.fn == "check_replicas" else ""
        return (f"{self.fn}({what}mode={self.mode}, atol={self.atol!r}, rtol={self.rtol!r}, "
                f"details={self.details})")


def is_mesh(group: Any) -> bool:
    """Whether ``group`` is a DeviceMesh (recognised without importing it)."""
    return type(group).__name__ == "DeviceMesh" and hasattr(group, "mesh")


def hash64(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


# --------------------------------------------------------------------------- layouts
def _spec(t: Any) -> Optional[Tuple[Any, Tuple[Any, ...], Tuple[int, ...]]]:
    """(mesh, placements, global shape) of a DTensor (FSDP2, HSDP, tensor parallel), or of
    a parameter that ``DistributedDataParallel(model, device_mesh=mesh["dp"])`` holds as its
    local shard of a tensor-parallel DTensor (torch keeps the spec as ``_st_info``); None
    for a plain tensor. Recognised without importing DTensor."""
    if is_dtensor(t):
        return t.device_mesh, tuple(t.placements), tuple(t.shape)
    info = getattr(t, "_st_info", None)
    if info is not None and hasattr(info, "mesh") and hasattr(info, "placements"):
        return info.mesh, tuple(info.placements), tuple(info.shape)
    return None


def _layout_entry(spec: tuple, local_shape: Tuple[int, ...]) -> tuple:
    """Which shard of a tensor this rank holds: the mesh (dimension names and sizes), the
    placements, this rank's coordinate on every dimension that is not ``Replicate`` (None
    on those that are) and the local shape. Two ranks holding equal entries hold the same
    shard, so their local tensors should be equal."""
    mesh, placements, _ = spec
    names = tuple(mesh.mesh_dim_names or range(mesh.ndim))
    held = held_coordinates(mesh, placements)
    return (names, tuple(mesh.shape), tuple(repr(p) for p in placements), held, local_shape)


def placement_text(entry: tuple) -> str:
    """Placements and mesh of a layout entry, such as ``(Replicate(), Shard(dim=0)) over
    the mesh (replicate=2, shard=2)``: the same on every rank."""
    names, sizes, placements = entry[:3]
    if all(isinstance(n, str) for n in names):
        mesh = "the mesh (" + ", ".join(f"{n}={k}" for n, k in zip(names, sizes)) + ")"
    else:
        mesh = f"a mesh of shape {tuple(sizes)}"
    return f"({', '.join(placements)}) over {mesh}"


def shard_text(entry: tuple) -> str:
    """A layout entry for a person: placements, mesh, the shard's coordinates ("*" on the
    dimensions it is replicated over) and the local shape."""
    where = ", ".join("*" if c is None else str(c) for c in entry[3])
    return f"{placement_text(entry)}, shard at ({where}), local shape {tuple(entry[4])}"


def _model_mesh(model: nn.Module, skip_parameters: bool = False) -> Any:
    """The DeviceMesh of the model's first DTensor parameter or buffer; None when it has
    none (``skip_parameters``: the parameters are known to hold none)."""
    tensors = model.buffers() if skip_parameters else itertools.chain(model.parameters(),
                                                                      model.buffers())
    for t in tensors:
        spec = _spec(t)
        if spec is not None:
            return spec[0]
    return None


def _dim_ranks(fn: str, mesh: Any, name: str) -> List[int]:
    """The global ranks along the mesh dimension ``name`` through this rank: found on the
    DTensors' mesh or, when that is a slice (``mesh["tp"]``), on the mesh it was cut from."""
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    for candidate in (mesh, root):
        names = tuple(candidate.mesh_dim_names or ())
        coords = candidate.get_coordinate()
        if name in names and coords is not None:
            at = tuple(slice(None) if d == names.index(name) else c for d, c in enumerate(coords))
            return candidate.mesh[at].flatten().tolist()
    known = sorted(set(mesh.mesh_dim_names or ()) | set(root.mesh_dim_names or ()))
    raise GraddbgValueError(f"{fn}(group={name!r}): the DeviceMesh of the model's DTensors has no "
                            f"dimension {name!r}; its dimensions: {known} (init_device_mesh(..., "
                            f"mesh_dim_names=...) names them)")


def resolve(options: CheckOptions, mesh: Any) -> CheckOptions:
    """Where the fingerprints go and who is compared with whom.

    A plain model (``mesh`` None): exchanged over ``group`` (a 1-D DeviceMesh: its process
    group), every rank compared. A model holding DTensors on ``mesh``: exchanged over the
    default group (every rank takes part and gets the same verdict), each rank compared
    with its replicas only: the ranks of ``group`` (a dimension name, a 1-D DeviceMesh or a
    ProcessGroup), or by default the ranks that hold the same shard of every tensor (see
    `replica_header`)."""
    group = options.group
    if mesh is None:
        exchange = group.get_group() if is_mesh(group) else group
        return dataclasses.replace(options, group=exchange)
    if group is None:
        return dataclasses.replace(options, group=None, sharded=True)
    if isinstance(group, str):
        ranks = _dim_ranks(options.fn, mesh, group)
    elif is_mesh(group):
        ranks = group.mesh.flatten().tolist()
    else:
        ranks = group_ranks(group)
    return dataclasses.replace(options, group=None, sharded=True, replicas=tuple(sorted(ranks)))


def _entry(name: str, t: torch.Tensor, kind: str) -> Tuple[Optional[torch.Tensor], tuple,
                                                          Optional[tuple]]:
    """What one parameter or buffer contributes to a check of ``kind``: the tensor this
    rank holds (a gradient may be None; a DTensor's local shard), its metadata (name,
    global shape, dtype, and for gradients requires_grad) and layout (see
    `_layout_entry`; None for a plain tensor)."""
    source = t.grad if kind == "gradients" else t
    spec = (_spec(source) if source is not None else None) or _spec(t)
    entry = (name, spec[2] if spec else tuple(t.shape), str(t.dtype).replace("torch.", ""))
    if kind == "gradients":
        entry += (bool(t.requires_grad),)
    held = None if source is None else local_values(source)
    return held, entry, (None if spec is None else _layout_entry(spec, tuple(local_values(t).shape)))


def collect_all(model: nn.Module, parts: Sequence[str]) -> Tuple[
        List[str], List[Optional[torch.Tensor]], List[tuple], List[Optional[tuple]], List[str], Any]:
    """Names, tensors, metadata and layouts (see `_entry`) of every kind in
    ``parts``, laid end to end, without DDP's ignored ones; the kind of each tensor (a
    gradient's metadata has one field more than a parameter's, so the two are told apart
    in the structure hash); and the DeviceMesh of the model's DTensors (None when it holds
    none). One walk over the parameters (and one over the buffers where needed)."""
    ignore = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()) or ())
    walks = [("buffers", model.named_buffers())] if "buffers" in parts else []
    wanted = [k for k in parts if k != "buffers"]
    if wanted:
        walks.insert(0, ("params", model.named_parameters()))
    found: dict = {k: ([], [], [], []) for k in parts}
    mesh = None
    partitioned = 0
    for walk, items in walks:
        for name, t in items:
            if name in ignore:
                continue
            if walk == "params" and _zero3_partitioned(t):
                partitioned += 1  # (each rank holds other bytes of it: not a replica)
                continue
            if mesh is None and _spec(t) is not None:
                mesh = _spec(t)[0]
            clean = clean_name(name)
            for kind in (["buffers"] if walk == "buffers" else wanted):
                held, entry, lay = _entry(clean, t, kind)
                for column, value in zip(found[kind], (clean, held, entry, lay)):
                    column.append(value)
    if mesh is None:
        mesh = _model_mesh(model, skip_parameters=bool(wanted))
    columns = [sum((found[k][c] for k in parts), []) for c in range(4)]
    kinds = sum(([k] * len(found[k][0]) for k in parts), [])
    if partitioned and not columns[0]:
        raise GraddbgValueError(
            f"nothing to compare: every one of the model's {partitioned} parameters is partitioned by "
            f"DeepSpeed ZeRO-3 (each rank holds different bytes of it, and no two ranks hold the same); "
            f"at ZeRO stages 0-2 every rank holds the full parameters and they are compared")
    return columns[0], columns[1], columns[2], columns[3], kinds, mesh


def _zero3_partitioned(t: Any) -> bool:
    """A parameter that DeepSpeed ZeRO-3 partitioned away: empty here, its full size kept
    as ``ds_numel`` (recognised without importing deepspeed)."""
    return hasattr(t, "ds_id") and t.numel() == 0 and getattr(t, "ds_numel", 0) > 0


def local_shapes(meta: List[tuple], layouts: Optional[List[List[Optional[tuple]]]],
                 world: int) -> List[List[Tuple[int, ...]]]:
    """``[rank][tensor]``: the shape of what each rank holds (its shard of a DTensor, from
    every rank's layouts; else the shape in ``meta``)."""
    plain = [tuple(m[1]) for m in meta]
    if layouts is None:
        return [plain] * world
    return [[tuple(e[-1]) if e is not None else plain[p] for p, e in enumerate(rank_layout)]
            for rank_layout in layouts]


# --------------------------------------------------------------------------- replica groups
def replica_header(options: CheckOptions, layout: List[Optional[tuple]]) -> List[int]:
    """On a sharded model, [replica key, replica count, layout hash] (nothing otherwise:
    every rank is compared). Ranks with the same key are compared with each other. The key
    is the hash of the layout (the ranks that hold the same shard of every tensor) unless
    ``group=`` named the replicas: then the hash of the group's ranks, and the count is
    their number."""
    if not options.sharded:
        return []
    shards = hash64(repr(layout))
    if options.replicas is None:
        return [shards, 0, shards]
    return [hash64(repr(options.replicas)), len(options.replicas), shards]


def all_layouts(options: CheckOptions, layout: List[Optional[tuple]], world: int,
                wanted: Optional[Iterable[int]] = None) -> List[List[Optional[tuple]]]:
    """Every rank's layout (a plain model's are all None; a sharded model's come from one
    small object gather, of the ``wanted`` tensors only when given: None for the others)."""
    if not options.sharded:
        return [layout] * world
    mine: Any = layout if wanted is None else {p: layout[p] for p in wanted}
    everything: List[Any] = [None] * world
    dist.all_gather_object(everything, mine, group=options.group)
    if wanted is None:
        return everything
    return [[held.get(p) for p in range(len(layout))] for held in everything]


def _shards_differ(options: CheckOptions, ranks: List[int], names: List[str],
                   layout: List[Optional[tuple]]) -> None:
    """Raise (on every rank alike) naming the first tensor of which two ranks that
    ``group=`` puts together hold different shards."""
    layouts = all_layouts(options, layout, dist.get_world_size(options.group))
    for p, name in enumerate(names):
        held = {r: layouts[r][p] for r in ranks}
        other = next((r for r in ranks if held[r] != held[ranks[0]]), None)
        if other is None:
            continue
        a, b = ranks[0], other
        texts = [shard_text(held[r]) if held[r] is not None else "a plain tensor" for r in (a, b)]
        raise GraddbgValueError(
            f"{options.fn}(group=...): ranks {a} and {b} are in one replica group but hold "
            f"different shards of {name!r} (rank {a}: {texts[0]}; rank {b}: {texts[1]}), so "
            f"they are not replicas. Pass the mesh dimension over which the tensors are "
            f"Replicate (such as 'replicate' for HSDP or 'dp' over tensor parallelism), or "
            f"group=None to find the replicas from the shards every rank holds")
    raise GraddbgValueError(f"{options.fn}(group=...): the ranks of a replica group hold "
                            f"different shards ({ranks})")


def no_replicas(options: CheckOptions, names: List[str], layout: List[Optional[tuple]]) -> GraddbgValueError:
    example = next(((n, e) for n, e in zip(names, layout)
                    if e is not None and any(c is not None for c in e[3])), None)
    shown = f" (such as {example[0]!r}: {placement_text(example[1])})" if example else ""
    return GraddbgValueError(
        f"{options.fn}: no replicas to compare: every parameter is sharded over the whole "
        f"mesh (pure FSDP, or tensor parallelism in which every tensor is sharded), so no two "
        f"of the {dist.get_world_size(options.group)} ranks hold the same shard of any "
        f"tensor{shown}, and shards differ by design. HSDP or DDP replicas are what these "
        f"checks compare: the replicate dimension of HSDP (fully_shard on a 2-D mesh), "
        f"data-parallel copies of a tensor-parallel model, and the plain parameters and "
        f"Replicate placements of a tensor-parallel model across its tensor-parallel group. "
        f"For the gradients of a sharded model use graddbg.watch, whose statistics are those "
        f"of the full gradients, on every rank.")


def replica_sets(options: CheckOptions, rows: List[List[int]], names: List[str],
                 layout: List[Optional[tuple]]) -> Optional[List[List[int]]]:
    """The sets of ranks compared with each other (see `replica_header`), the same
    on every rank; None on a sharded model without ``group=``: its replicas are found
    tensor by tensor (`tensor_sets`). Raises on every rank alike when the groups
    passed do not split the ranks into replica groups, when a group holds different
    shards, or when no two ranks of such a group hold the same shards."""
    if not options.sharded:
        return [list(range(len(rows)))]
    if options.replicas is None:
        return None
    by_key: dict = {}
    for r, row in enumerate(rows):
        by_key.setdefault(row[_KEY], []).append(r)
    sets = list(by_key.values())
    odd = [s for s in sets if options.replicas is not None and len(s) != rows[s[0]][_COUNT]]
    if odd:
        raise GraddbgValueError(
            f"{options.fn}(group=...): the groups passed do not split the {len(rows)} ranks "
            f"into replica groups: " + "; ".join(
                f"rank(s) {s} passed a group of {rows[s[0]][_COUNT]} ranks, but only they "
                f"passed it" for s in odd)
            + ". Every rank must pass its own replica group (the same dimension name on every rank)")
    for s in sets:
        if any(rows[r][_SHARDS] != rows[s[0]][_SHARDS] for r in s):
            _shards_differ(options, s, names, layout)
    if len(rows) > 1 and all(len(s) == 1 for s in sets):
        raise no_replicas(options, names, layout)
    return sets


def gather_tables(options: CheckOptions, local: torch.Tensor, meta: List[tuple],
                  layout: List[Optional[tuple]]) -> Tuple[torch.Tensor, List[List[int]], Any]:
    """Every rank's table ``[W, P, k]``, ``[rank][tensor]`` how many elements it holds and,
    on a sharded model, ``[rank][tensor]`` a hash of which shard it holds (0 for a plain
    tensor): columns of the same gather (shards may differ in size); None otherwise."""
    world = dist.get_world_size(options.group)
    if not options.sharded:
        return (all_gather(local, options.group).cpu(), [[math.prod(m[1]) for m in meta]] * world,
                None)
    held = local_shapes(meta, [layout], 1)[0]
    extra = torch.tensor([[math.prod(shape) for shape in held],
                          [0 if e is None else hash64(repr(e)) for e in layout]],
                         dtype=torch.int64).reshape(2, len(layout)).t()
    both = all_gather(torch.cat([local, extra.to(local.device)], dim=1), options.group).cpu()
    return both[:, :, :-2], both[:, :, -2].tolist(), both[:, :, -1].tolist()


def tensor_sets(shards: List[List[int]], sets: Optional[List[List[int]]]) -> List[List[List[int]]]:
    """Per tensor, the sets of ranks compared: within each of ``sets`` (every rank when
    None), the ranks that hold the same shard of it (``shards[r][p]``, see
    `gather_tables`): a plain tensor or a ``Replicate`` placement on every rank, a
    sharded one along the dimensions it is replicated over."""
    outer = sets if sets is not None else [list(range(len(shards)))]
    count = len(shards[0]) if shards else 0
    result = []
    for p in range(count):
        groups: dict = {}
        for k, ranks in enumerate(outer):
            for r in ranks:
                groups.setdefault((k, shards[r][p]), []).append(r)
        result.append(sorted(groups.values()))
    return result
