"""Cross-rank consistency checks: do gradients, parameters and buffers agree on every rank?

Every check is *collective*: every rank of the group calls it at the same point of the
program, and every rank gets the same `ConsistencyReport`. A check is a short
list of steps (see ``_check``):

1. the arguments, validated once (bad ones raise ``GraddbgValueError`` /
   ``GraddbgTypeError`` on the calling rank, before any collective);
2. local fingerprints of every tensor (`fingerprints`), computed with torch's own
   kernels on the tensors' device, the same code on CPU and GPU: every word of every
   tensor mixed with its position, in one fused kernel where ``torch.compile`` made one
   (`set_fingerprint_kernel`), else in chunks that stay near the cache, then a few kernels
   over the small table of block values, no host synchronisation; the result is an int64
   ``[tensors x k]`` table
   and its digest (two hashes modulo primes near 2**31), one host synchronisation;
3. the rendezvous: one all-gather of a 7-integer header
   on a gloo group (the group itself when it is a gloo group, a gloo side group
   otherwise, created once per group and cached, see `prepare`), waited for at
   most ``timeout``: a hash of the names, shapes and dtypes of the tensors, their count,
   a hash of what was asked, the world size, the digest, and the time the rank started
   waiting. When the exchange has not ended within a quarter of a second, this rank
   writes its count of checks entered to the process group's store (healthy checks make
   no store round trip). When some rank never arrives, the others' wait times out and
   every rank that did arrive raises `DDPTimeoutError` naming the ranks whose counters
   are behind its own, instead of hanging; a rank that arrives after the others gave up sees from
   their times that it is late, and raises too. (Where the store cannot be reached, a
   monitored barrier on that gloo group names the missing ranks first.)
4. the structure, before any value: a rank whose fingerprinting failed says so in its
   header, so that every rank raises; ranks whose models differ raise
   `DDPInconsistencyError` naming the first difference (only then are the names
   themselves exchanged). When every digest is equal the check is over: consistent.
5. only when the digests differ, one all-gather of the fingerprint tables, to find which
   tensors differ on which ranks; with ``details=True``, then, the differing tensors
   themselves (and only those) to report the largest difference per rank. Whole tensors
   never travel otherwise.

Two modes. With ``atol == rtol == 0`` (the default) the comparison is *bitwise*: a
fingerprint is two 64-bit lanes in which every element's bits are mixed with its
position, exact integer arithmetic (see `fingerprints` for what is guaranteed): any
change of a single element is always caught, and every other change (a permutation, a
transpose, swapped rows, a uniform offset, sign flips, any number of one-ulp changes)
escapes with a probability of about 2**-62 to 2**-64 when it was not built against the
fixed weights; the same NaN on every rank is consistent. Weakened against the word sums
this replaced: a change of several elements in one block that altered the block's word
sum was always caught, and is now caught with that probability; and the fingerprint
reads every word several times from the cache (several times the cost of one read of the
tensors on a CPU; bench/ddp_check.py measures it).

With a tolerance, the fingerprint is the float64 sum, sum of squares and sum of absolute
values of the finite elements and the counts of NaN, +Inf and -Inf; two ranks disagree when a count differs or a sum differs by more than elementwise
``|a - b| <= atol + rtol * |b|`` allows. A tolerance mismatch is therefore certain; a
pass means the sums agree within those bounds. Tolerance mode exchanges the sums first
and the counts only for tensors whose sums are not finite on some rank. It casts every
element to float64 (in slices of bounded size): prefer the bitwise mode for checks on
every step.

When several ranks disagree, the reference is the largest group of ranks that agree
(ties go to the group holding the lowest rank), and every other rank is reported.

Usage with DDP (``torchrun --nproc-per-node=4 train.py`` on one machine, or
``torchrun --nnodes=2 --node-rank=$NODE_RANK --nproc-per-node=8 --rdzv-endpoint=$MASTER_ADDR:29500 train.py``
on several)::

    model = DDP(net)
    ddp_verify.prepare()        # once, on every rank: creates the gloo side group under NCCL
    for step, (x, y) in enumerate(loader):
        loss_fn(model(x), y).backward()
        if step % 100 == 0:
            report = ddp_verify.check_gradients(model)     # before optimizer.step()
            if not report.ok:
                print(report)
        opt.step(); opt.zero_grad()

Gradient accumulation with ``no_sync``: check right before ``optimizer.step()``, that is
after the backward that should have synchronised. If a loop got its ``no_sync`` logic
wrong (the last micro-batch inside ``no_sync``, an off-by-one), the gradients the
optimizer is about to use differ across ranks and the check names them;
`check_parameters` after the step catches weights that have already drifted apart.

Sharded models (FSDP2's ``fully_shard``, HSDP, DTensor tensor parallelism). The checks
compare replicas, tensor by tensor and shard by shard. Each rank fingerprints what it
holds of every tensor (a DTensor's ``to_local()`` shard) and each tensor is compared with
exactly the ranks that should hold the same values: by default the ranks holding the
same shard of it (the same coordinates on every mesh dimension over which it is not
``Replicate``), found from a hash of each rank's shard gathered with the fingerprints;
the exchange runs over the default group: every rank calls the check, gets the same
verdict, and ranks are named by their global rank. On HSDP (a ``(replicate, shard)``
mesh) a parameter's replicas lie along ``replicate``; under tensor parallelism over ``tp``
with data parallelism over ``dp`` (``replicate``, ``DistributedDataParallel(...,
device_mesh=mesh["dp"])`` or gradients averaged by hand), a shard's along ``dp``; a
``Replicate`` placement and a plain (non-DTensor) tensor of a sharded model, such as a
LayerNorm weight left out of a tensor-parallel plan or a buffer, are compared across
every rank (the TP group included). ``group=`` may name the replicas instead, for every
tensor: a mesh dimension name (``group="replicate"``, looked up on the DTensors' mesh, or
on the mesh it was sliced from), a 1-D ``DeviceMesh`` or a ProcessGroup (each rank passes
its own). A group that puts ranks holding different shards together is refused
(GraddbgValueError, naming the tensor and both shards). Only when no tensor is replicated
anywhere (pure FSDP, every parameter sharded over the whole mesh) do the checks say that
there is nothing to compare (GraddbgValueError) rather than compare shards that differ by
design; ``graddbg.watch`` gives the statistics of the full gradients there. A sharded model's
check gathers every rank's fingerprint table (24 bytes per tensor) besides the header.
``report.replica_groups`` lists the groups compared; a differing shard's row carries its
``local_shape`` and ``shard`` (placements, mesh, coordinates)::

    mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("replicate", "shard"))
    model = fully_shard(model, mesh=mesh)                      # HSDP
    ...
    loss.backward()
    report = ddp_verify.check_gradients(model)                 # or group="replicate"
"""
from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

import graddbg._dist.rendezvous as _rendezvous
import graddbg._dist.replicas as _replicas
import graddbg._verdict as _verdict
from graddbg._args import bad_type, duration
from graddbg._errors import DDPInconsistencyError, GraddbgError, GraddbgTypeError, GraddbgValueError
from graddbg._fingerprint import digest, fingerprints, set_fingerprint_kernel, tolerance_quick_table
from graddbg._dist.replicas import KINDS, CheckOptions, is_mesh
from graddbg._model import check_model, unwrap

__all__ = [
    "ConsistencyReport",
    "Mismatch",
    "check_gradients",
    "check_parameters",
    "check_buffers",
    "check_replicas",
    "fingerprints",
    "prepare",
    "set_fingerprint_kernel",
]

_MAX_STR_ROWS = 10              # str(report) shows at most this many rows

Timeout = Union[timedelta, float, int]


# --------------------------------------------------------------------------- the report
@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One tensor on one rank that disagrees with the reference rank."""

    name: str
    rank: int
    reference_rank: int
    reason: str
    shape: Tuple[int, ...]
    dtype: str
    fingerprint: str
    reference_fingerprint: str
    max_abs_diff: float = float("nan")     # details=True only
    n_diff: Optional[int] = None           # details=True: elements that differ
    index: Optional[Tuple[int, ...]] = None  # details=True: where the largest difference is
    value: Optional[float] = None          # details=True: this rank's value there
    reference_value: Optional[float] = None
    local_shape: Optional[Tuple[int, ...]] = None  # a DTensor: the shape of this rank's shard
    shard: Optional[str] = None            # a DTensor: its placements and this rank's coordinates
    kind: str = ""                         # "gradients", "parameters" or "buffers"
    cause: str = ""                        # what probably happened, in plain words


@dataclasses.dataclass(frozen=True)
class ConsistencyReport:
    """The verdict of a collective check; the same on every rank.

    ``ok`` (also ``bool(report)``), ``world_size``, ``rank`` (this process's rank in the
    group), ``kind`` ("gradients", "parameters" or "buffers"), ``mode`` ("bitwise" or
    "tolerance"), ``checked`` (number of tensors compared), ``rows`` (the
    `Mismatch` records) and ``mismatches``, the same as a DataFrame. On a sharded
    model, ``replica_groups`` holds the groups of (global) ranks that were compared with
    each other, shard by shard; it is empty otherwise (every rank of the group compared).
    """

    ok: bool
    world_size: int
    rank: int
    kind: str
    mode: str
    checked: int
    rows: Tuple[Mismatch, ...] = ()
    atol: float = 0.0
    rtol: float = 0.0
    replica_groups: Tuple[Tuple[int, ...], ...] = ()

    def __bool__(self) -> bool:
        return self.ok

    @property
    def names(self) -> List[str]:
        """Names of the tensors that differ somewhere, in model order, without repeats."""
        return list(dict.fromkeys(m.name for m in self.rows))

    @property
    def ranks(self) -> List[int]:
        """Ranks that differ from the reference on some tensor, sorted."""
        return sorted({m.rank for m in self.rows})

    @property
    def max_abs_diff(self) -> float:
        """The largest difference measured (``details=True``); NaN when none was measured."""
        values = [m.max_abs_diff for m in self.rows if m.max_abs_diff == m.max_abs_diff]
        return max(values) if values else float("nan")

    @property
    def mismatches(self) -> Any:
        """A pandas DataFrame, one row per (tensor, rank) that differs from the reference."""
        import pandas as pd

        columns = [f.name for f in dataclasses.fields(Mismatch)]
        return pd.DataFrame([dataclasses.astuple(m) for m in self.rows], columns=columns)

    def summary(self) -> str:
        """One line: the verdict, the first differing tensor and the ranks."""
        head = f"{self.kind} ({self.mode}) across {self.world_size} ranks"
        if len(self.replica_groups) > 1:
            head += (", shard by shard within the replica groups "
                     + " ".join(str(list(g)) for g in self.replica_groups))
        if self.ok:
            return f"{head}: consistent ({self.checked} tensors)"
        first = self.rows[0]
        return (f"{head}: {len(self.names)} of {self.checked} tensors differ, first "
                f"{first.name!r} on rank(s) {sorted({m.rank for m in self.rows if m.name == first.name})} "
                f"({first.reason}); ranks that differ: {self.ranks}")

    def __str__(self) -> str:
        lines = [f"ConsistencyReport[rank {self.rank}]: {self.summary()}"]
        if not self.ok:
            mixed = len({m.kind for m in self.rows}) > 1 or self.kind not in KINDS
            header = ("name",) + (("of",) if mixed else ()) + ("rank", "ref", "reason", "max_abs_diff")
            table = [header] + [
                (m.name,) + ((m.kind,) if mixed else ()) + (str(m.rank), str(m.reference_rank), m.reason,
                 "" if m.max_abs_diff != m.max_abs_diff else f"{m.max_abs_diff:.4g}")
                for m in self.rows[:_MAX_STR_ROWS]]
            widths = [max(len(r[i]) for r in table) for i in range(len(header))]
            lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
            if len(self.rows) > _MAX_STR_ROWS:
                lines.append(f"  ... and {len(self.rows) - _MAX_STR_ROWS} more rows "
                             "(report.mismatches has them all)")
            causes = list(dict.fromkeys((m.cause, m.kind) for m in self.rows if m.cause))
            for cause, kind in causes[:_MAX_STR_ROWS]:
                first = next(m for m in self.rows if m.cause == cause)
                lines.append(f"  probably ({first.name!r} {kind}, rank {first.rank}): {cause}")
        return "\n".join(lines)


def _group_type(fn: str, group: Any, sharded: Optional[bool]) -> None:
    """``group``'s type: None or a ProcessGroup; with a model (``sharded`` not None), a
    DeviceMesh too, and a mesh dimension name when the model holds DTensors."""
    if group is None or isinstance(group, dist.ProcessGroup) or (
            sharded is not None and (is_mesh(group) or (sharded and isinstance(group, str)))):
        return
    accepted = "None (the default group) or a torch.distributed.ProcessGroup"
    if sharded is not None:
        accepted += (", a 1-D DeviceMesh, or the name of a DeviceMesh dimension of the model's "
                     "DTensors (such as 'replicate')")
    if isinstance(group, str) and sharded is not None:
        accepted += ("; a dimension name needs a model holding DTensors (fully_shard, "
                     "parallelize_module), and this model holds none")
    raise GraddbgTypeError(f"{fn}(group=...): got {type(group).__name__}; accepted: {accepted}")


def _group_arg(fn: str, group: Any, sharded: Optional[bool] = None) -> None:
    """A bad ``group`` is an argument error; no process group at all is a state error.
    ``sharded``: whether the model holds DTensors (None: there is no model)."""
    if not dist.is_available():
        raise GraddbgError(f"{fn}: this build of torch has no torch.distributed")
    _group_type(fn, group, sharded)
    if is_mesh(group) and group.ndim != 1:
        raise GraddbgValueError(f"{fn}(group=...): got a {group.ndim}-D DeviceMesh "
                                f"{tuple(group.mesh_dim_names or ())}; accepted: a 1-D mesh, such "
                                f"as mesh['replicate'], or a dimension name, such as 'replicate'")
    if not dist.is_initialized():
        raise GraddbgError(f"{fn}: torch.distributed is not initialized; call "
                           f"torch.distributed.init_process_group(...) on every rank first "
                           f"(or launch with torchrun)")
    if (isinstance(group, dist.ProcessGroup) and dist.get_rank(group) < 0) or \
            (is_mesh(group) and group.get_coordinate() is None):
        raise GraddbgValueError(f"{fn}(group=...): this process (global rank {dist.get_rank()}) is "
                                f"not a member of the group; call the check only on its members")


def _options(fn: str, parts: Tuple[str, ...], group: Any, atol: Any, rtol: Any, timeout: Any,
             details: bool, raise_on_mismatch: bool, mesh: Any) -> CheckOptions:
    """The arguments, validated; ``mesh``: the DeviceMesh of the model's DTensors (None
    when it holds none, see `graddbg._dist.replicas.collect_all`)."""
    options = CheckOptions.parse(fn, dict(atol=atol, rtol=rtol, timeout=timeout, details=details,
                                          raise_on_mismatch=raise_on_mismatch), fn=fn, parts=parts, group=group)
    _group_arg(fn, group, sharded=mesh is not None)
    return _replicas.resolve(options, mesh)

def prepare(group: Any = None, *, timeout: Timeout = timedelta(seconds=300)) -> None:
    """Create (once, cached) the gloo group the checks exchange on (and detect missing ranks with).

    Needed only for groups of another backend than gloo (NCCL, for instance), and even then
    optional: the first check creates it. Creating a group is collective, so call this
    on every rank of ``group`` at the same point, right after ``init_process_group``,
    when a later check may be reached by some ranks only. Checks of a model holding
    DTensors exchange over the default group, whatever their ``group=``: ``prepare()``.
    For a gloo group there is nothing to create.

    Args:
        group: the process group the checks will be given (None: the default group).
        timeout: how long creating the group may wait for the other ranks (a
            ``datetime.timedelta`` or a number of seconds > 0; 300 s).

    Returns:
        None.

    Raises:
        GraddbgTypeError: ``group`` is not None or a ``ProcessGroup``, or ``timeout`` has a
            wrong type.
        GraddbgValueError: a timeout <= 0 or not finite, or a ``group`` this rank is not a
            member of.
        GraddbgError: ``torch.distributed`` is unavailable or not initialized.
        DDPTimeoutError: the gloo group could not be created (some rank did not arrive
            within ``timeout``).

    Examples:
        >>> prepare()  # doctest: +SKIP
    """
    timeout = duration("prepare", "timeout", timeout)
    _group_arg("prepare", group)
    _rendezvous.side_group(group, timeout)

# --------------------------------------------------------------------------- the check
def _local_table(options: CheckOptions, tensors: List[Optional[torch.Tensor]], meta: List[tuple],
                 layout: List[Optional[tuple]],
                 device: torch.device) -> Tuple[Optional[torch.Tensor], List[int], Optional[BaseException]]:
    """This rank's fingerprint table (round one in tolerance mode) on ``device`` and its
    header: [metadata hash, tensor count, call hash, world size, digest a, digest b], then
    on a sharded model the replica fields (`graddbg._dist.replicas.replica_header`). A failure is told to
    the other ranks (a header of -1s), so that every rank raises."""
    try:
        if options.mode == "bitwise":
            local = fingerprints(tensors, device=device)
        else:
            local = tolerance_quick_table(tensors, device)
        header = [_replicas.hash64(repr(meta)), len(meta), _replicas.hash64(options.call),
                  dist.get_world_size(options.group)] + digest(local).tolist()
        return local, header + _replicas.replica_header(options, layout), None
    except Exception as err:
        return None, [-1] * (_replicas.SHARDED_HEADER if options.sharded else _replicas.HEADER), err


_CAUSES = {
    "absent": "rank {rank} and rank {ref} disagree on whether it has a gradient: a branch of "
              "the model that some ranks skip (DDP needs the same graph on every rank, or "
              "find_unused_parameters=True), or a parameter frozen on some ranks only",
    "gradients": "the gradient all-reduce did not make them equal: communication that lost or "
                 "corrupted data (a DDP communication hook, a faulty link), a parameter that "
                 "DDP no longer reduces (replaced after DDP wrapped the model, so DDP reduces "
                 "the old tensor), a rank that skipped the all-reduce (no_sync on its last "
                 "micro-batch, a rank-dependent branch), or a model not wrapped in DDP on every "
                 "rank",
    "initial": "the replicas differ before training: the model is not wrapped in DDP on every "
               "rank, was initialised differently on some rank (seed), or its parameters were "
               "replaced after DDP wrapped them (DDP copies rank 0's parameters only when it "
               "wraps the model)",
    "both": "its gradient differs too, so the updates diverged with the gradients (see the "
            "gradient's row)",
    "updated": "the gradients agree but the parameters do not: a replica was updated "
               "differently (an optimizer step that depends on the rank, clipping by a norm "
               "computed on some ranks only, a learning rate that differs, or a change of the "
               "parameter outside the optimizer on some ranks)",
    "parameters": "the replicas drifted apart: gradients that differed at an earlier step "
                  "(check_gradients before optimizer.step() tells), or a replica updated "
                  "differently (an optimizer step, clipping or learning rate that depends on "
                  "the rank)",
    "buffers": "buffers differ: DDP(broadcast_buffers=False), a training forward on other "
               "data since the last broadcast, or a buffer changed on some ranks only",
    "tp": " (a tensor replicated across the tensor-parallel group, such as a LayerNorm weight "
          "left out of the parallelize plan: its gradient must be all-reduced over that group "
          "and clipping must use the norm of the whole model)",
}


def _cause(options: CheckOptions, found: List[Tuple[int, int, int, str]], names: List[str],
           kinds: List[str], layout: List[Optional[tuple]], row: Tuple[int, int, int, str]) -> str:
    """What probably happened to one mismatch, from what else differs (see ``_CAUSES``)."""
    p, r, ref, reason = row
    kind = kinds[p]
    if reason in _verdict.ABSENCE:
        key = "absent"
    elif kind == "parameters":
        grads = {(names[q], rr) for q, rr, _, _ in found if kinds[q] == "gradients"}
        key = ("initial" if options.initial else "both" if (names[p], r) in grads
               else "updated" if "gradients" in options.parts else "parameters")
    else:
        key = kind
    replicated = options.sharded and (layout[p] is None or all(c is None for c in layout[p][3]))
    tp = _CAUSES["tp"] if replicated and key in ("gradients", "updated", "parameters") else ""
    return _CAUSES[key].format(rank=r, ref=ref) + tp


def _report(options: CheckOptions, names: List[str], meta: List[tuple], table: Optional[torch.Tensor],
            found: List[Tuple[int, int, int, str]], measured: dict,
            per_tensor: List[List[List[int]]],
            layouts: Optional[List[List[Optional[tuple]]]], kinds: List[str],
            layout: List[Optional[tuple]]) -> ConsistencyReport:
    rows = []
    for p, r, ref, reason in found:
        extra = measured.get((p, r))
        held = layouts[r][p] if layouts is not None else None
        rows.append(Mismatch(
            name=names[p], rank=r, reference_rank=ref, reason=reason, shape=meta[p][1],
            dtype=meta[p][2], fingerprint=_verdict.fingerprint_text(table[r, p], options.mode),
            reference_fingerprint=_verdict.fingerprint_text(table[ref, p], options.mode),
            local_shape=None if held is None else tuple(held[-1]),
            shard=None if held is None else _replicas.shard_text(held), kind=kinds[p],
            cause=_cause(options, found, names, kinds, layout, (p, r, ref, reason)),
            **({} if extra is None else dict(zip(
                ("max_abs_diff", "n_diff", "index", "value", "reference_value"), extra)))))
    return ConsistencyReport(ok=not rows, world_size=dist.get_world_size(options.group),
                             rank=dist.get_rank(options.group), kind=options.kind,
                             mode=options.mode, checked=len(names), rows=tuple(rows),
                             atol=options.atol, rtol=options.rtol,
                             replica_groups=_groups_compared(per_tensor) if options.sharded else ())


def _groups_compared(per_tensor: List[List[List[int]]]) -> Tuple[Tuple[int, ...], ...]:
    """The distinct sets of two or more ranks that some tensor was compared within, sorted."""
    return tuple(sorted({tuple(s) for groups in per_tensor for s in groups if len(s) > 1}))


def _check(fn: str, parts: Tuple[str, ...], model: Any, group: Any, atol: Any, rtol: Any,
           timeout: Any, details: bool, raise_on_mismatch: bool,
           initial: bool = False) -> ConsistencyReport:
    """One check, the steps of the module docstring in order; ``parts``: what it compares
    (of `graddbg._dist.replicas.KINDS`)."""
    check_model(model, fn)
    names, tensors, meta, layout, kinds, mesh = _replicas.collect_all(unwrap(model), parts)
    options = dataclasses.replace(_options(fn, parts, group, atol, rtol, timeout, details,
                                           raise_on_mismatch, mesh), initial=bool(initial))
    device = _rendezvous.comm_device(options.group, tensors, model)
    local, header, error = _local_table(options, tensors, meta, layout, device)
    rows = _rendezvous.exchange(options.fn, options.group, options.timeout, header)
    _verdict.raise_unless_comparable(options, rows, meta, error)
    sets = _replicas.replica_sets(options, rows, names, layout)
    table, found, per_tensor = _verdict.compare(options, rows, sets, local, tensors, meta, layout,
                                                device, names)
    layouts = _replicas.all_layouts(options, layout, len(rows), {p for p, *_ in found}) if found else None
    measured = {} if not (details and found) else _verdict.details(
        found, tensors, meta, _replicas.local_shapes(meta, layouts, len(rows)), options.group, device)
    report = _report(options, names, meta, table, found, measured, per_tensor, layouts, kinds,
                     layout)
    if not report.ok and options.raise_on_mismatch:
        raise DDPInconsistencyError(f"{fn}: the ranks disagree (raise_on_mismatch=True)\n{report}",
                                    report=report)
    return report


_DEFAULT_TIMEOUT = timedelta(seconds=60)


def check_gradients(model: nn.Module, *, group: Any = None, atol: float = 0.0, rtol: float = 0.0,
                    timeout: Timeout = _DEFAULT_TIMEOUT, details: bool = False,
                    raise_on_mismatch: bool = False) -> ConsistencyReport:
    """Check that every parameter's ``.grad`` is the same on every rank of ``group``.

    Collective: call it on every rank at the same point (after the synchronising backward,
    before ``optimizer.step()``). A parameter whose gradient is ``None`` on some ranks only
    is reported by name and rank.

    On a model holding DTensors (FSDP2, HSDP, tensor parallel) every rank of the default
    group calls it, and each rank's shards are compared with its replicas' (see the module
    docstring); ``group`` may then also be a mesh dimension name (``"replicate"``) or a 1-D
    ``DeviceMesh``. Pure FSDP has no replicas: ``GraddbgValueError``.

    Args:
        model: a ``DistributedDataParallel`` or a plain module (names never carry DDP's
            ``module.`` prefix).
        group: the process group (None: the default group). On a model holding DTensors
            also a 1-D ``DeviceMesh`` or the name of a mesh dimension of the model's
            DTensors (such as ``"replicate"``).
        atol: the absolute tolerance (a finite number >= 0); ``atol`` or ``rtol`` > 0
            switches from the bitwise comparison to tolerance mode.
        rtol: the relative tolerance (a finite number >= 0).
        timeout: how long to wait for the other ranks (a ``datetime.timedelta`` or a
            number of seconds > 0; 60 s).
        details: gather the differing tensors (only those) to report the largest
            difference per rank.
        raise_on_mismatch: raise `DDPInconsistencyError` on every rank, after all of them
            have reached the same verdict, when the ranks disagree.

    Returns:
        ConsistencyReport: the same verdict on every rank, truthy when consistent, with
            one `Mismatch` row per differing tensor and rank.

    Raises:
        GraddbgTypeError: ``model`` is not an ``nn.Module`` instance, or ``atol``,
            ``rtol``, ``timeout`` or ``group`` has a wrong type (on the calling rank,
            before any collective).
        GraddbgValueError: a negative or non-finite tolerance, a timeout <= 0, a ``group``
            this rank is not a member of or a mesh that is not 1-D, or a sharded model with
            no replicas to compare (pure FSDP).
        GraddbgError: ``torch.distributed`` is unavailable or not initialized.
        DDPTimeoutError: some rank did not enter the check within ``timeout`` (naming the
            ranks whose counters are behind).
        DDPInconsistencyError: the ranks hold different models or called different checks
            (naming the first difference), a rank could not compute its fingerprints, or
            the ranks disagree and ``raise_on_mismatch`` is set.

    Examples:
        >>> import os, tempfile, torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = torch.nn.Linear(3, 2)
        >>> model(torch.randn(4, 3)).sum().backward()
        >>> report = check_gradients(model)
        >>> report.ok, report.world_size, report.checked
        (True, 1, 2)
        >>> dist.destroy_process_group()
    """
    return _check("check_gradients", ("gradients",), model, group, atol, rtol, timeout, details,
                  raise_on_mismatch)


def check_parameters(model: nn.Module, *, group: Any = None, atol: float = 0.0,
                     rtol: float = 0.0, timeout: Timeout = _DEFAULT_TIMEOUT,
                     details: bool = False, raise_on_mismatch: bool = False) -> ConsistencyReport:
    """Check that every parameter's value is the same on every rank.

    Collective, like `check_gradients`; takes its arguments, with the same meaning, and
    returns and raises as it does (see its Args, Returns and Raises). Run it after
    ``optimizer.step()`` to catch weights that drifted apart.

    Examples:
        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> print(check_parameters(torch.nn.Linear(3, 2)))
        ConsistencyReport[rank 0]: parameters (bitwise) across 1 ranks: consistent (2 tensors)
        >>> dist.destroy_process_group()
    """
    return _check("check_parameters", ("parameters",), model, group, atol, rtol, timeout, details,
                  raise_on_mismatch)


def check_buffers(model: nn.Module, *, group: Any = None, atol: float = 0.0, rtol: float = 0.0,
                  timeout: Timeout = _DEFAULT_TIMEOUT, details: bool = False,
                  raise_on_mismatch: bool = False) -> ConsistencyReport:
    """Check that every buffer (BatchNorm statistics, for instance) is the same on every rank.

    Collective, like `check_gradients`; takes its arguments, with the same meaning, and
    returns and raises as it does (see its Args, Returns and Raises). Buffers drift apart under
    ``DistributedDataParallel(..., broadcast_buffers=False)``. With
    ``broadcast_buffers=True`` DDP copies rank 0's buffers at the start of every forward,
    so a training forward on different data leaves them different until the next one:
    check before the forward (or after an eval-mode forward) to test the broadcast.

    Examples:
        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> check_buffers(torch.nn.BatchNorm1d(4)).names
        []
        >>> dist.destroy_process_group()
    """
    return _check("check_buffers", ("buffers",), model, group, atol, rtol, timeout, details,
                  raise_on_mismatch)


def _replica_parts(gradients: Any, parameters: Any) -> Tuple[str, ...]:
    """check_replicas' ``gradients``/``parameters`` flags as what the check compares."""
    for arg, value in (("gradients", gradients), ("parameters", parameters)):
        if not isinstance(value, bool):
            raise bad_type("check_replicas", arg, value, "True or False")
    if not (gradients or parameters):
        raise GraddbgValueError("check_replicas(gradients=False, parameters=False): nothing to "
                                "check; accepted: gradients=True, parameters=True or both")
    return tuple(k for k, on in (("gradients", gradients), ("parameters", parameters)) if on)


def check_replicas(model: nn.Module, *, gradients: bool = True, parameters: bool = True,
                   initial: bool = False, group: Any = None, atol: float = 0.0,
                   rtol: float = 0.0, timeout: Timeout = _DEFAULT_TIMEOUT, details: bool = False,
                   raise_on_mismatch: bool = False) -> ConsistencyReport:
    """Check gradients and parameters across the replicas in one exchange (what ``watch`` needs).

    Every tensor that should be equal across some ranks is compared with exactly those
    ranks (DDP, HSDP's replicate dimension, data-parallel copies and the replicated tensors
    of a tensor-parallel model). Collective, like `check_gradients`. Call it after backward
    and before ``optimizer.step()``: then the gradients are those the step will use and the
    parameters those of the previous step. Each mismatch has a ``kind`` ("gradients" or
    "parameters") and a ``cause``: what probably happened, judged from what else differs
    (parameters that differ while their gradients agree: a replica updated differently).

    Besides its own three arguments below, it takes `check_gradients`'s (``group``,
    ``atol``, ``rtol``, ``timeout``, ``details``, ``raise_on_mismatch``) with the same
    meaning, and returns and raises as it does (see its Args, Returns and Raises); also
    ``GraddbgTypeError`` when ``gradients`` or ``parameters`` is not a bool and
    ``GraddbgValueError`` when both are False.

    Args:
        model: a ``DistributedDataParallel``, a plain module or a model holding DTensors.
        gradients: compare the parameters' gradients (True or False).
        parameters: compare the parameters' values (True or False; at least one of the two).
        initial: no optimizer step has run yet (differing parameters then mean a model not
            wrapped in DDP on every rank, initialised differently, or parameters replaced
            after wrapping).

    Examples:
        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = torch.nn.Linear(3, 2)
        >>> model(torch.randn(4, 3)).sum().backward()
        >>> print(check_replicas(model))
        ConsistencyReport[rank 0]: gradients and parameters (bitwise) across 1 ranks: consistent (4 tensors)
        >>> dist.destroy_process_group()
    """
    parts = _replica_parts(gradients, parameters)
    return _check("check_replicas", parts, model, group, atol, rtol, timeout, details,
                  raise_on_mismatch, initial=initial)
