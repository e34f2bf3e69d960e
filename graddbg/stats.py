"""Gradient statistics: batched on-device kernels, the step reader, a bounded history.

No hooks here. `StepReader` reduces a fixed list of parameters' gradients the way
``torch.nn.utils.clip_grad_norm_`` does: grouped by device and dtype, one foreach call
per group, one fallback loop for what foreach cannot take (sparse gradients, DTensor
shards), no host synchronisation. `Readback` then copies everything a step needs
to the host at once: one synchronisation per recorded step.

Examples:
    >>> import torch
    >>> model = torch.nn.Linear(4, 2)
    >>> model(torch.ones(3, 4)).sum().backward()
    >>> df = grad_stats(model)
    >>> list(df["name"])
    ['weight', 'bias']
    >>> round(float(df.loc[df.name == "bias", "norm"].iloc[0]), 4)  # sqrt(3^2 + 3^2)
    4.2426
"""
from __future__ import annotations

import functools
import math
from dataclasses import KW_ONLY, dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np  # (torch imports numpy itself)
import torch
from torch import Tensor

from graddbg._dist.collective import run_collective
from graddbg._errors import GraddbgTypeError, GraddbgValueError
from graddbg._model import clean_name, is_dtensor, local_values, module_of, named_trainable_parameters

__all__ = [
    "STAT_NAMES",
    "DEFAULT_STATS",
    "StepReader",
    "StepStats",
    "Readback",
    "Slot",
    "validate_stats",
    "absmax_of",
    "grad_stats",
    "summarize",
    "clean_name",
    "module_of",
    "named_trainable_parameters",
    "History",
    "HIST_EDGES",
    "histogram_counts",
    "STATS_COLUMNS",
    "STEPS_COLUMNS",
    "rollup_norms",
]

#: statistics that can be asked for through ``stats=``
STAT_NAMES = ("norm", "absmax", "nonfinite", "mean", "std", "zero_frac")
DEFAULT_STATS = ("norm", "absmax", "nonfinite")
#: columns of the tidy per-parameter table, in order (optional ones appended when asked)
STATS_COLUMNS = ("step", "name", "module", "numel", "norm", "absmax", "nonfinite",
                 "update_ratio", "has_grad")
STEPS_COLUMNS = ("step", "global_norm", "clipped_norm", "loss", "nonfinite", "overflow", "scale",
                 "recorded", "lr")
_EXTRAS = ("mean", "std", "zero_frac")

#: fixed log-spaced bin edges of |grad| for histograms: [0, 1e-12), [1e-12, ...), ..., [1e4, inf)
HIST_EDGES = tuple(10.0 ** (e / 2) for e in range(-24, 9))


def validate_stats(stats: Union[str, Iterable[str]]) -> Tuple[str, ...]:
    """Check a ``stats=`` argument; return it as a tuple in canonical order.

    ``norm`` and ``nonfinite`` are always computed (the detectors need them); ``absmax``
    costs a second pass over the gradients and is left out (NaN) when not asked for.

    Args:
        stats: a name or names among ``"norm"``, ``"absmax"``, ``"nonfinite"``, ``"mean"``,
            ``"std"``, ``"zero_frac"``.

    Returns:
        tuple[str, ...]: the names to compute, in canonical order.

    Raises:
        GraddbgValueError: an unknown name.
        GraddbgTypeError: not a str or an iterable of str.

    Examples:
        >>> validate_stats(["absmax", "mean"])
        ('norm', 'absmax', 'nonfinite', 'mean')
        >>> validate_stats(["norm"])
        ('norm', 'nonfinite')
    """
    if isinstance(stats, str):
        stats = (stats,)
    try:
        asked = tuple(stats)
    except TypeError:
        raise GraddbgTypeError(f"stats= must be a sequence of statistic names, got {type(stats).__name__}; "
                               f"accepted names: {', '.join(STAT_NAMES)}") from None
    unknown = [s for s in asked if s not in STAT_NAMES]
    if unknown:
        raise GraddbgValueError(f"stats= got unknown statistic(s) {unknown}; accepted: {', '.join(STAT_NAMES)}")
    return tuple(s for s in STAT_NAMES if s in asked or s in ("norm", "nonfinite"))


# --------------------------------------------------------------------------- reading back
class Slot:
    """A handle to one tensor of a `Readback`: ``value`` is its host copy (a float64 numpy
    array, flattened) once the read-back was fetched, None before."""

    __slots__ = ("name", "value")

    def __init__(self, name: str) -> None:
        self.name, self.value = name, None

    def __repr__(self) -> str:
        return f"Slot({self.name!r}, {'pending' if self.value is None else self.value.tolist()})"


class Readback:
    """Device tensors gathered for one read-back, copied to the host at once (one
    synchronisation per device). `add` returns a `Slot`, a typed handle that holds
    the tensor's host copy after `fetch`.

    Examples:
        >>> rb = Readback(); a = rb.add("a", torch.ones(2)); b = rb.add("b", torch.tensor(3.0))
        >>> _ = rb.fetch(); a.value.tolist(), b.value.tolist()
        ([1.0, 1.0], [3.0])
    """

    def __init__(self) -> None:
        self._parts: List[Tuple[Slot, Tensor]] = []

    def add(self, name: str, t: Optional[Tensor]) -> Slot:
        """Queue ``t`` (None: nothing; the slot stays empty) under ``name`` (for messages)."""
        slot = Slot(name)
        if t is not None:
            self._parts.append((slot, t.reshape(-1)))
        return slot

    def __len__(self) -> int:
        return len(self._parts)

    def fetch(self) -> Dict[str, np.ndarray]:
        """Copy everything queued to the host: fills each slot; returns ``{name: array}``
        too (for a reader whose names are its own)."""
        by_device: Dict[torch.device, List[Tuple[Slot, Tensor]]] = {}
        for slot, t in self._parts:
            by_device.setdefault(t.device, []).append((slot, t))
        out: Dict[str, np.ndarray] = {}
        for parts in by_device.values():
            ts = [t if t.dtype == torch.float64 else t.double() for _, t in parts]
            flat = (ts[0] if len(ts) == 1 else torch.cat(ts)).cpu().numpy()
            offset = 0
            for (slot, _), t in zip(parts, ts):
                slot.value = out[slot.name] = flat[offset: offset + t.numel()]
                offset += t.numel()
        self._parts = []
        return out


# --------------------------------------------------------------------------- the step reader
@dataclass
class StepStats:
    """One step's statistics on the host, in parameter order."""

    norm: np.ndarray  # [P] float64; NaN without a gradient
    absmax: np.ndarray  # [P] float64; NaN when not read this step
    nonfinite: np.ndarray  # [P] int64 NaN/Inf entries
    has_grad: np.ndarray  # [P] bool
    extras: Optional[np.ndarray] = None  # [P, E] (mean, std, zero_frac as asked)
    shard_ranks: Optional[Dict[int, List[int]]] = None  # DTensor gradients: ranks whose shard was non-finite

    @property
    def bad(self) -> np.ndarray:
        return self.nonfinite > 0

    @functools.cached_property
    def global_norm(self) -> float:
        """The norm of all gradients together (NaN or Inf when one is); computed once, after
        the step's norms are final."""
        n = self.norm[self.has_grad]
        return math.sqrt(float(np.dot(n, n)))


def _special(g: Tensor) -> bool:
    """A gradient that foreach kernels cannot take: sparse, or a tensor subclass."""
    return g.layout != torch.strided or type(g) is not Tensor


def _stored_values(g: Tensor) -> Tensor:
    """The values this rank stores of a gradient: a sparse tensor's coalesced values, a
    DTensor's local values with its pending sums (Partial) reduced first; else the
    gradient itself (detached)."""
    if g.layout != torch.strided:
        return g.coalesce().values() if g.layout == torch.sparse_coo else g.values()
    return local_values(g, reduce_partial=True)


class _Launch:
    """Device results of `StepReader.launch`, waiting for the read-back."""

    def __init__(self, present: List[int], absmax: bool, extras: bool) -> None:
        self.present = present
        self.absmax = absmax
        self.extras = extras
        self.groups: List[List[int]] = []  # parameter indices of each piece below
        self.norms: List[Tensor] = []  # 1-D pieces, one per group
        self.maxes: List[Tensor] = []
        self.more: List[Tensor] = []  # [n, E] pieces of extra statistics
        self.order: List[int] = []  # the groups' indices one after the other
        self.sharded: Optional[Tuple[int, List[int], List[Tensor]]] = None  # (piece, indices, DTensor grads)


class StepReader:
    """Reads a fixed list of parameters' gradients: norms every time, the largest
    magnitude and extra statistics when asked, with torch's own batched kernels grouped
    by device and dtype (the way ``torch.nn.utils.clip_grad_norm_`` does).

    `launch` queues the kernels (no host synchronisation); after
    `Readback.fetch`, `finish` builds the host `StepStats` and
    `rescue` recomputes, in float64 and with one more read-back, the rare norms that
    are not final: non-finite ones (to count the NaN/Inf entries exactly, or to find a
    finite gradient whose squares overflowed).
    """

    def __init__(self, params: Sequence[Tensor], stats: Sequence[str] = DEFAULT_STATS) -> None:
        self.numel = np.array([p.numel() for p in params], dtype=np.int64)
        self.extras = tuple(s for s in _EXTRAS if s in stats)
        self.want_absmax = "absmax" in stats
        self.columns = ("norm", "absmax") + self.extras
        self._groups: Dict[Tuple[int, ...], List[Tuple[List[int], str, Any, Any]]] = {}
        self._shards = _Shards()
        self._layouts: Dict[Any, Tuple[np.ndarray, np.ndarray]] = {}
        #: read-backs made by `rescue`

    def shard_group(self, group: Any) -> None:
        """The process group DTensor shard statistics are gathered over (None: the default
        group; False: none, this rank's shards only)."""
        self._shards.group = group

    def _grouping(self, present: List[int], grads: Sequence[Optional[Tensor]]) -> List[Tuple[List[int], str]]:
        """``[(indices, kind)]``: one ``"batched"`` group per device and dtype, one
        ``"sharded"`` group of DTensor gradients, then the other special gradients one by
        one (``"single"``); cached for the set of parameters that have a gradient (and
        checked against the first gradient of each group, in case the model moved)."""
        key = tuple(present)
        cached = self._groups.get(key)
        if cached is not None and all(grads[ix[0]].device == dev and grads[ix[0]].dtype == dt
                                      for ix, _, dev, dt in cached):
            return [(ix, kind) for ix, kind, _, _ in cached]
        by: Dict[Tuple[torch.device, torch.dtype], List[int]] = {}
        special, sharded = [], []
        for i in present:
            g = grads[i]
            if is_dtensor(g):
                sharded.append(i)
            elif _special(g):
                special.append(i)
            else:
                by.setdefault((g.device, g.dtype), []).append(i)
        groups = [(ix, "batched", dev, dt) for (dev, dt), ix in by.items()]
        if sharded:
            groups.append((sharded, "sharded", grads[sharded[0]].device, grads[sharded[0]].dtype))
        groups += [([i], "single", grads[i].device, grads[i].dtype) for i in special]
        if len(self._groups) > 16:
            self._groups.clear()
        self._groups[key] = groups
        return [(ix, kind) for ix, kind, _, _ in groups]

    def launch(self, grads: Sequence[Optional[Tensor]], *, absmax: bool = False,
               extras: bool = False) -> _Launch:
        """Queue the reductions of ``grads`` (one per parameter, None when absent): norms
        always, the largest magnitudes with ``absmax``, the extra statistics with
        ``extras``. No host synchronisation."""
        present = [i for i, g in enumerate(grads) if g is not None and g.numel()]
        out = _Launch(present, absmax, extras and bool(self.extras))
        with torch.no_grad():
            for ix, kind in self._grouping(present, grads):
                if kind == "sharded":
                    out.sharded = (len(out.groups), ix, [grads[i] for i in ix])
                    # (a pending sum is reduced only where graddbg may issue collectives)
                    ts = [local_values(grads[i], reduce_partial=self._shards.group is not False) for i in ix]
                else:
                    ts = [_stored_values(grads[ix[0]])] if kind == "single" else [grads[i] for i in ix]
                self._reduce(ts, out)
                out.groups.append(ix)
                out.order.extend(ix)
        return out

    def _reduce(self, ts: List[Tensor], out: _Launch) -> None:
        norms = torch._foreach_norm(ts)
        out.norms.append(torch.stack(norms) if len(norms) > 1 else norms[0].reshape(1))
        if out.absmax:
            out.maxes.append(absmax_of(ts))
        if out.extras:
            out.more.append(torch.stack([self._extra_row(t) for t in ts]))

    def _extra_row(self, g: Tensor) -> Tensor:
        g64 = g.detach().reshape(-1).double()
        n = max(g64.numel(), 1)
        cols = []
        mean = g64.sum() / n
        for name in self.extras:
            if name == "mean":
                cols.append(mean)
            elif name == "std":
                var = ((g64 * g64).sum() - n * mean * mean) / max(n - 1, 1)
                cols.append(var.clamp(min=0).sqrt())
            else:
                cols.append((g64 == 0).sum().double() / n)
        return torch.stack(cols)

    def add_to(self, rb: Readback, launch: _Launch) -> Dict[str, Slot]:
        """Put the launched results into a read-back (their slots, for `finish`); for
        DTensor gradients, first all-gather every rank's shard statistics (one small
        collective)."""
        slots: Dict[str, Slot] = {}
        if launch.sharded is not None:
            k = launch.sharded[0]
            local = [launch.norms[k]] + ([launch.maxes[k]] if launch.absmax else [])
            slots["shards"] = rb.add("shards", self._shards.gather(torch.stack([t.float() for t in local], 1)))
        for key, parts in (("norm", launch.norms), ("absmax", launch.maxes), ("extras", launch.more)):
            if parts:
                slots[key] = rb.add(key, parts[0] if len(parts) == 1 else torch.cat([p.reshape(-1) for p in parts]))
        return slots

    def _layout(self, launch: _Launch) -> Tuple[np.ndarray, np.ndarray]:
        """(order as an index array, has-gradient mask), made once per set of gradients."""
        key = (tuple(launch.present), tuple(launch.order))
        got = self._layouts.get(key)
        if got is None:
            if len(self._layouts) > 16:
                self._layouts.clear()
            has = np.zeros(len(self.numel), dtype=bool)
            has[launch.present] = True
            got = self._layouts[key] = (np.asarray(launch.order, dtype=np.int64), has)
        return got[0], got[1].copy()

    def finish(self, launch: _Launch, slots: Dict[str, Slot]) -> StepStats:
        """The host `StepStats` of a launch whose slots (`add_to`) were fetched."""
        got = {k: s.value for k, s in slots.items()}
        P = len(self.numel)
        order, has = self._layout(launch)
        norm = np.full(P, np.nan)
        norm[order] = got.get("norm", ())  # (absent when no parameter had a gradient)
        absmax = np.full(P, np.nan)
        if launch.absmax:
            absmax[order] = got.get("absmax", ())
        extras = None
        if launch.extras:
            extras = np.full((P, len(self.extras)), np.nan)
            extras[order] = got.get("extras", np.zeros(0)).reshape(len(order), -1)
        st = StepStats(norm, absmax, np.zeros(P, dtype=np.int64), has, extras)
        if launch.sharded is not None:
            _, ix, dgrads = launch.sharded
            self._shards.combine(st, ix, dgrads, got["shards"], launch.absmax)
            if st.extras is not None:
                st.extras[ix] = np.nan  # (of this rank's shard only: not reported)
        return st

    @staticmethod
    def _exact_rows(grads: Sequence[Optional[Tensor]], idx: np.ndarray, absmax: np.ndarray) -> Tensor:
        """``[count, norm, absmax]`` rows of the suspects: one by one (exact counts, float64)
        for those with a non-finite or unread largest magnitude; batched for those whose
        largest magnitude is known and finite (no NaN/Inf in them: their squares overflowed),
        divided by it in one foreach norm.""" 
        local = [_stored_values(grads[i]) for i in idx]
        known = [k for k, i in enumerate(idx) if np.isfinite(absmax[i]) and absmax[i] > 0 and not is_dtensor(grads[i])]
        rows: List[Optional[Tensor]] = [None] * len(idx)
        if known:
            scales = [float(absmax[idx[k]]) for k in known]
            scaled = torch._foreach_div([local[k] for k in known], scales)
            norms = torch.stack(torch._foreach_norm(scaled)).double() * torch.tensor(scales, dtype=torch.float64,
                                                                                      device=scaled[0].device)
            for j, k in enumerate(known):
                rows[k] = torch.stack([norms.new_zeros(()), norms[j], norms.new_tensor(scales[j])])
        for k, r in enumerate(rows):
            if r is None:
                rows[k] = _exact_row(local[k])
        return torch.stack([r.to(rows[0].device) for r in rows])

    def rescue(self, st: StepStats, grads: Sequence[Optional[Tensor]], div: float = 1.0, *,
               changed: bool = False) -> bool:
        """Recompute in float64, exactly, the norms that are not final: non-finite ones (to
        count the NaN/Inf entries, or to find a finite gradient whose squares overflowed).
        ``div`` is a loss scale that the caller divides the statistics by; ``changed``: the
        gradients were changed in place since they were launched (AMP's ``unscale_``), so
        they are read as they are now, unscaled, one by one. Returns whether a
        read-back was made (only on steps with a non-finite norm). Tiny norms are left as
        torch's float32 kernels give them: a gradient whose entries all lie below about
        1e-19 may show a norm of 0, as ``torch.linalg.vector_norm`` does."""
        if np.isfinite(st.norm[st.has_grad].sum()):
            return False  # the common step: nothing to recompute
        suspect = st.has_grad & ~np.isfinite(st.norm)
        idx = np.nonzero(suspect)[0]
        if not len(idx):
            return False
        with torch.no_grad():
            if changed:
                div = 1.0
            table = self._exact_rows(grads, idx, np.full(len(st.absmax), np.nan) if changed else st.absmax * div)
            shard_ix = [k for k, i in enumerate(idx) if is_dtensor(grads[i])]
            if shard_ix:  # every rank has the same suspects: the same collective
                got = self._shards.exact(table, [grads[idx[k]] for k in shard_ix], shard_ix)
            else:
                got = table.cpu().numpy()
        for i, (bad, norm, amax) in zip(idx, got):
            st.nonfinite[i] = int(bad)
            st.absmax[i] = amax / div
            if not bad:
                st.norm[i] = norm / div
        return True


_FOREACH_MAX = getattr(torch, "_foreach_max", None)  # (torch >= 2.6)


def absmax_of(ts: List[Tensor]) -> Tensor:
    """``[n]`` largest magnitudes (NaN if an entry is NaN). One fused launch per group on
    accelerators; on the CPU, where the infinity norm's kernel is slow, the foreach maximum
    of the foreach magnitudes (2.4x faster than one ``aminmax`` pass each on 130 tensors of
    4096 entries, and the same values), else one ``aminmax`` pass each."""
    nonempty = all(t.numel() for t in ts)
    if ts[0].device.type != "cpu" and nonempty:
        return torch.stack(torch._foreach_norm(ts, math.inf))
    if nonempty and _FOREACH_MAX is not None and all(t.dtype.is_floating_point for t in ts):
        parts = []
        for part in _chunks(ts, _ABS_CHUNK):  # (a tensor over the chunk alone: one pass, no copy)
            big = len(part) == 1 and part[0].numel() * part[0].element_size() > _ABS_CHUNK
            parts.append(_aminmax_abs(part[0]).reshape(1) if big else torch.stack(_FOREACH_MAX(torch._foreach_abs(part))))
        return torch.cat(parts)
    out = []
    for t in ts:
        if not t.numel():  # (an empty shard of an unevenly sharded parameter)
            out.append(t.new_zeros(()))
            continue
        out.append(_aminmax_abs(t))
    return torch.stack(out)


# (the magnitudes are copies: made a few MiB at a time, the temporary memory stays small)
_ABS_CHUNK = 16 << 20


def _chunks(ts: List[Tensor], limit: int) -> List[List[Tensor]]:
    """``ts`` in runs of at most ``limit`` bytes (a tensor over it alone)."""
    out: List[List[Tensor]] = [[]]
    used = 0
    for t in ts:
        size = t.numel() * t.element_size()
        if out[-1] and used + size > limit:
            out.append([])
            used = 0
        out[-1].append(t)
        used += size
    return out


def _aminmax_abs(t: Tensor) -> Tensor:
    lo, hi = torch.aminmax(t.reshape(-1))
    return torch.maximum(hi, -lo)


def _exact_row(g: Tensor) -> Tensor:
    """``[NaN/Inf count, exact norm, absmax]`` of one gradient, in float64, scaled by its
    largest magnitude so that no square underflows or overflows."""
    g = g.detach().reshape(-1)
    bad = (~torch.isfinite(g)).sum().double()
    g64 = g.double()
    amax = g64.abs().max() if g64.numel() else g64.new_zeros(())
    scale = torch.where((amax > 0) & torch.isfinite(amax), amax, torch.ones_like(amax))
    norm = torch.linalg.vector_norm(g64 / scale) * scale
    return torch.stack([bad, norm, amax])


class _Shards:
    """Statistics of DTensor gradients from every rank's shard: one all-gather of a small
    table per recorded step (a float32 norm, and the largest magnitude when read, per
    parameter: 4-8 bytes each), never of the gradients. Shards along a mesh dimension add
    up (norms in quadrature, NaN/Inf counts); replicas (``Replicate`` placements) count
    once; the largest magnitude is the largest over all ranks."""

    def __init__(self) -> None:
        self._ranks: Dict[Any, np.ndarray] = {}
        #: the group the tables are gathered over: None, the default group; False, none (this
        #: rank's shards only: graddbg issues no collective); else a process group holding
        #: every rank of the DTensors' meshes (the data-parallel group of a pipeline stage)
        self.group: Any = None

    def gather(self, table: Tensor) -> Tensor:
        import torch.distributed as dist

        if self.group is False or not (dist.is_available() and dist.is_initialized()):
            return table.reshape(1, *table.shape)
        out = [torch.empty_like(table) for _ in range(dist.get_world_size(self.group))]
        run_collective(dist.all_gather, out, table.contiguous(), group=self.group)
        return torch.stack(out)

    def owners(self, g: Tensor) -> np.ndarray:
        """Rows of the gathered table whose shards, together, make the whole of ``g`` once:
        the ranks at coordinate 0 along every mesh dimension it is replicated over (their
        ranks in `group`; row 0 alone when nothing was gathered)."""
        if self.group is False:
            return np.zeros(1, dtype=np.int64)
        mesh, placements = g.device_mesh, tuple(g.placements)
        key = (id(mesh), placements, id(self.group))
        ranks = self._ranks.get(key)
        if ranks is None:
            grid = mesh.mesh.cpu().numpy()
            sel = tuple(0 if p.is_replicate() else slice(None) for p in placements)
            ranks = np.asarray(grid[sel]).reshape(-1)
            if self.group is not None:
                import torch.distributed as dist

                ranks = np.asarray([dist.get_group_rank(self.group, int(r)) for r in ranks])
            self._ranks[key] = ranks
        return ranks

    def global_rank(self, row: int) -> int:
        """The global rank of a row of the gathered table."""
        if self.group is None or self.group is False:
            return row
        import torch.distributed as dist

        return dist.get_global_rank(self.group, row)

    def combine(self, st: StepStats, ix: List[int], dgrads: List[Tensor], table: np.ndarray, absmax: bool) -> None:
        """Put the full gradients' norms (and largest magnitudes) of ``ix`` into ``st``."""
        t = table.reshape(-1, len(ix), 2 if absmax else 1)
        st.shard_ranks = {}
        for k, (i, g) in enumerate(zip(ix, dgrads)):
            own = t[self.owners(g), k, 0].astype(np.float64)
            st.norm[i] = math.sqrt(float(np.dot(own, own)))
            if absmax:
                col = t[:, k, 1].astype(np.float64)
                st.absmax[i] = np.nan if np.isnan(col).any() else col.max()
            bad = np.nonzero(~np.isfinite(t[:, k, 0]))[0]
            if len(bad):
                st.shard_ranks[i] = [self.global_rank(int(r)) for r in bad]

    def exact(self, table: Tensor, dgrads: List[Tensor], rows: List[int]) -> np.ndarray:
        """Exact ``[count, norm, absmax]`` rows: those of DTensor gradients (``rows``)
        combined over the ranks' shards."""
        gathered = self.gather(table[rows].double()).cpu().numpy()
        out = table.cpu().numpy()
        for k, (r, g) in enumerate(zip(rows, dgrads)):
            own = gathered[self.owners(g), k]
            out[r] = [own[:, 0].sum(), math.sqrt(float(np.dot(own[:, 1], own[:, 1]))), gathered[:, k, 2].max()]
        return out


def update_ratios(before: List[Tensor], params: Sequence[Tensor], group: Any = None) -> Tensor:
    """``[P]`` float64 ``||w_old - w_new|| / ||w_old||`` (NaN where ``||w_old||`` is 0)
    from a copy of the (local) weights taken before an optimizer step; ``before`` is used
    up. For DTensor parameters the squared norms of the shards are all-reduced (one small
    collective over ``group``: None, the default group; False, none: this rank's shards only)
    and each replica counted once."""
    wn = torch.stack(torch._foreach_norm(before)).double()
    torch._foreach_sub_(before, [local_values(p) for p in params])
    dn = torch.stack(torch._foreach_norm(before)).double()
    shard = [i for i, p in enumerate(params) if is_dtensor(p)]
    if shard and group is not False:
        import torch.distributed as dist

        sq = torch.stack([wn[shard], dn[shard]]) ** 2
        run_collective(dist.all_reduce, sq, group=group)
        copies = torch.tensor([_replicas(params[i], group) for i in shard], dtype=torch.float64, device=sq.device)
        wn[shard], dn[shard] = (sq / copies).sqrt()
    return torch.where(wn > 0, dn / wn, torch.full_like(wn, math.nan))


def _replicas(p: Tensor, group: Any = None) -> int:
    """How many ranks of the world hold the same shard of a DTensor: its Replicate mesh
    dimensions, and the copies of its mesh when the mesh spans only part of the world (a
    tensor-parallel mesh inside data parallelism, whose replicas are assumed in step)."""
    import torch.distributed as dist

    n = dist.get_world_size(group) // max(p.device_mesh.size(), 1)
    for dim, pl in enumerate(p.placements):
        if pl.is_replicate():
            n *= p.device_mesh.size(dim)
    return n


def histogram_counts(grad: Tensor, edges: Tensor) -> Tensor:
    """Counts of finite ``|grad|`` values in the bins ``[0, e0), [e0, e1), ..., [e_last, inf)``.

    Computed on the gradient's device; NaN and Inf are not counted.

    Args:
        grad: a gradient (any shape).
        edges: the ``k`` increasing bin edges.

    Returns:
        torch.Tensor: ``k + 1`` int64 counts, on ``grad``'s device.

    Examples:
        >>> histogram_counts(torch.tensor([0.0, 1.0, -1.0, float("nan")]), torch.tensor([0.5, 2.0])).tolist()
        [1, 2, 0]
    """
    a = _stored_values(grad).detach().reshape(-1).abs()
    a = a[torch.isfinite(a)]
    idx = torch.bucketize(a.to(edges.dtype), edges, right=True)
    return torch.bincount(idx, minlength=edges.numel() + 1)


def read_now(reader: StepReader, grads: Sequence[Optional[Tensor]], *, absmax: bool = True,
             extras: bool = True) -> StepStats:
    """Launch, read back and rescue at once (one-shot statistics, no hooks)."""
    launch = reader.launch(grads, absmax=absmax, extras=extras)
    rb = Readback()
    slots = reader.add_to(rb, launch)
    rb.fetch()
    st = reader.finish(launch, slots)
    reader.rescue(st, grads)
    return st


def grad_stats(model_or_named_params: Any, stats: Sequence[str] = STAT_NAMES):
    """One-shot statistics of the current ``.grad`` of every trainable parameter; no hooks.

    Args:
        model_or_named_params: an ``nn.Module``, a dict of name -> parameter, or an iterable
            of (name, parameter) pairs.
        stats: the statistics to compute (see `validate_stats`).

    Returns:
        pandas.DataFrame: one row per parameter: ``name, module, numel, norm, absmax,
            nonfinite, has_grad`` and the optional statistics asked for. A parameter without
            a gradient has ``has_grad=False`` and NaN statistics.

    Raises:
        GraddbgTypeError: ``model_or_named_params`` is none of those.
        GraddbgValueError: an unknown statistic.

    Examples:
        >>> lin = torch.nn.Linear(3, 1)
        >>> lin(torch.ones(2, 3)).sum().backward()
        >>> df = grad_stats(lin)
        >>> list(df["name"]), df["norm"].tolist()[1]
        (['weight', 'bias'], 2.0)
    """
    import pandas as pd

    stats = validate_stats(stats)
    named = named_trainable_parameters(model_or_named_params)
    reader = StepReader([p for _, p in named], stats)
    st = read_now(reader, [p.grad for _, p in named], absmax="absmax" in stats)
    data = {"name": [n for n, _ in named], "module": [module_of(n) for n, _ in named],
            "numel": reader.numel, "norm": st.norm, "absmax": st.absmax, "nonfinite": st.nonfinite,
            "has_grad": st.has_grad}
    for j, col in enumerate(reader.extras):
        data[col] = st.extras[:, j] if st.extras is not None else np.full(len(named), np.nan)
    return pd.DataFrame(data, columns=list(data))


# --------------------------------------------------------------------------- history
@dataclass
class StepRecord:
    """What one step boundary recorded (host-side, numpy; small). Built one way: the step,
    then every other field by keyword (they are keyword-only); a step that read nothing (or
    a GradScaler's skipped step) has only ``step``, ``overflow``, ``scale`` and ``lr``."""

    step: int
    _: KW_ONLY
    per_param: Optional[StepStats] = None  # None when per-parameter statistics were not due
    global_norm: float = math.nan
    clipped_norm: float = math.nan
    overflow: bool = False
    scale: float = math.nan
    lr: float = math.nan
    #: the sum of the losses handed to ``backward()`` since the previous step (NaN: unknown)
    loss: float = math.nan
    hist: Any = None  # numpy [P, bins] counts or None


class History:
    """Bounded, columnar history: per-parameter statistics in preallocated numpy blocks
    of at most ``max_rows`` rows (steps x parameters) and at most ``max_steps`` step rows.
    When full, the middle of the run is thinned evenly, a share of it at once (amortised
    O(1) per step): the first steps, the latest steps and every step marked by `mark` (the
    steps of the kept anomalies) stay; when the marked steps alone would fill a quarter of
    the history, the first of them stay and the later ones are thinned with the middle, so
    the protected steps are bounded too."""

    def __init__(self, names: Sequence[str], numel: Sequence[int], extras: Sequence[str],
                 max_steps: int, max_rows: int) -> None:
        self.names = list(names)
        self.modules = [module_of(n) for n in names]
        self.numel = np.asarray(numel, dtype=np.int64)
        self.extras = tuple(extras)
        P = max(len(self.names), 1)
        self.cap = max(4, min(max_steps, max_rows // P))  # recorded steps with statistics
        self.step_cap = max(4, max_steps)
        self._rows = Retained(self.cap, {"step": (np.int64, ()), "norm": (np.float64, (P,)),
                                         "absmax": (np.float64, (P,)), "update": (np.float64, (P,)),
                                         "nonfinite": (np.int32, (P,)), "has_grad": (np.bool_, (P,)),
                                         "extras": (np.float64, (P, len(self.extras)))})
        self._steps = Retained(self.step_cap, {c: (t, ()) for c, t in _STEP_TYPES.items()})
        self._hist: List[Tuple[int, np.ndarray]] = []
        self._pending: set = set()  # steps marked before their rows were appended
        self._since = np.zeros(len(self.names), dtype=np.int64)  # first step of each parameter
        self.dropped = 0  # step rows thinned away
        #: each parameter's pipeline stage (a ``stage`` column in `stats_frame`), or None
        self.stage: Optional[np.ndarray] = None

    def add_params(self, names: Sequence[str], numel: Sequence[int], since: int) -> None:
        """Parameters that start receiving gradients late (unfrozen): they have rows from
        step ``since`` on."""
        self._since = np.concatenate([self._since, np.full(len(names), since, dtype=np.int64)])
        self.names += list(names)
        self.modules += [module_of(n) for n in names]
        self.numel = np.concatenate([self.numel, np.asarray(numel, dtype=np.int64)])
        if self.stage is not None:
            self.stage = np.concatenate([self.stage, np.full(len(names), -1, dtype=np.int64)])
        self._rows.widen(len(names))
        self._hist = [(s, np.concatenate([h, np.zeros((len(names), h.shape[1]), h.dtype)])) for s, h in self._hist]

    def append(self, rec: StepRecord) -> None:
        self._steps.append({"step": rec.step, "global_norm": rec.global_norm, "clipped_norm": rec.clipped_norm,
                            "nonfinite": 0 if rec.per_param is None else int(rec.per_param.nonfinite.sum()),
                            "overflow": rec.overflow, "scale": rec.scale, "recorded": rec.per_param is not None,
                            "lr": rec.lr, "loss": rec.loss}, self._pending)
        if rec.per_param is not None:
            st = rec.per_param
            self._rows.append({"step": rec.step, "norm": st.norm, "absmax": st.absmax, "update": np.nan,
                               "nonfinite": st.nonfinite, "has_grad": st.has_grad,
                               "extras": st.extras if st.extras is not None else np.nan}, self._pending)
        if self._pending:  # (a marked step that never gets a row is forgotten once passed)
            self._pending = {s for s in self._pending if s > rec.step}
        if rec.hist is not None:
            self._hist.append((rec.step, rec.hist))
            if len(self._hist) > self.cap:
                del self._hist[1: len(self._hist) - self.cap + 1]
        self.dropped = self._steps.dropped

    def mark(self, step: int) -> None:
        """Keep ``step`` (an anomaly's) from thinning: its rows, or the rows it will have."""
        last = self._steps.last_row()
        if last is None or step > int(last["step"]):
            self._pending.add(int(step))
        self._steps.mark(step)
        self._rows.mark(step)

    @property
    def marked(self) -> int:
        """How many step rows are marked by `mark` (kept rows of anomalies' steps)."""
        return self._steps.marked

    def sizes(self) -> Dict[str, int]:
        """What the history holds now, each bounded: ``rows`` (recorded steps with
        per-parameter statistics, at most ``cap``), ``step_rows`` (at most ``step_cap``),
        ``marked`` (step rows of marked steps), ``pending`` (steps marked ahead of their rows),
        and ``thinnings``, how many times its tables were thinned (each thinning drops a share
        of the rows at once: at most a few per ``cap`` steps).

        Examples:
            >>> History(["w"], [4], (), max_steps=100, max_rows=1000).sizes()
            {'rows': 0, 'step_rows': 0, 'marked': 0, 'pending': 0, 'thinnings': 0}
        """
        return {"rows": self._rows.n, "step_rows": self._steps.n, "marked": self.marked,
                "pending": len(self._pending), "thinnings": self._rows.thinnings + self._steps.thinnings}

    def set_scale(self, step: int, scale: float) -> None:
        """The loss scale of a step the GradScaler skipped, read back with a later step."""
        self._steps.set_last("scale", step, scale, depth=256)

    def set_update(self, step: int, ratios: np.ndarray) -> None:
        """The update ratios measured after ``step``'s optimizer step."""
        self._rows.set_last("update", step, ratios)

    def update_of(self, step: int) -> Optional[np.ndarray]:
        """The update ratios of recorded step ``step`` (a copy, NaN where not measured) when
        it is among the last few recorded steps and has any, else None (what a tracker logs
        once the ratios measured after that step were read back)."""
        rows = self._rows
        for i in range(rows.n - 1, max(rows.n - 5, -1), -1):
            if int(rows.cols["step"][i]) == step:
                ratios = rows.cols["update"][i]
                return ratios.copy() if np.isfinite(ratios).any() else None
        return None

    @property
    def last(self) -> Optional[Dict[str, Any]]:
        return self._steps.last_row()

    def last_recorded(self) -> Optional[Dict[str, Any]]:
        """The last recorded step without building a frame: its step row (``step``,
        ``global_norm``, ``clipped_norm``, ``overflow``, ``scale``, ``lr``, ...) and its
        per-parameter row block (``norm``, ``absmax``, ``update``, ``nonfinite``,
        ``has_grad``: numpy arrays in ``names`` order, copies), or None before the first
        recorded step. Reads the last per-parameter row and looks back over the step rows
        since it (fewer than ``every``), so its cost does not grow with the run.

        Examples:
            >>> h = History(["w", "b"], [4, 2], (), max_steps=100, max_rows=1000)
            >>> h.last_recorded() is None
            True
        """
        rows = self._rows
        if rows.n == 0:
            return None
        i = rows.n - 1
        out = {k: c[i].copy() for k, c in rows.cols.items() if k not in ("_seq", "_mark", "extras", "step")}
        step = int(rows.cols["step"][i])
        steps = self._steps
        for j in range(steps.n - 1, -1, -1):
            if int(steps.cols["step"][j]) == step:
                out.update({k: c[j].item() for k, c in steps.cols.items() if k not in ("_seq", "_mark", "nonfinite")})
                break
        out["step"] = step
        return out

    def latest(self, column: str) -> Tuple[np.ndarray, np.ndarray]:
        """Each parameter's latest measured value of a per-parameter column and the step
        it was measured at: ``(values, steps)``, NaN and -1 for a parameter never measured
        among the kept rows. A statistic read on a cadence (``absmax`` on the CPU is read
        every 10th recorded step, NaN between) gives its last reading, not the NaN of the
        steps in between. Looks back from the last recorded step only until every
        parameter has a value.

        Args:
            column: ``"norm"``, ``"absmax"``, ``"update"`` or one of ``extras``.

        Raises:
            GraddbgValueError: ``column`` is not a per-parameter column of this history.
        """
        rows = self._rows
        if column in self.extras:
            col, j = rows.cols["extras"], self.extras.index(column)
            get = lambda i: col[i, :, j]  # noqa: E731
        elif column in ("norm", "absmax", "update"):
            get = lambda i: rows.cols[column][i]  # noqa: E731
        else:
            raise GraddbgValueError(f"History.latest(column=...): got {column!r}; accepted: norm, absmax, "
                                    f"update{''.join(', ' + e for e in self.extras)}")
        P = len(self.names)
        values, steps = np.full(P, np.nan), np.full(P, -1, dtype=np.int64)
        missing = np.ones(P, dtype=bool)
        for i in range(rows.n - 1, -1, -1):
            row = get(i)
            found = missing & ~np.isnan(row)
            values[found], steps[found] = row[found], rows.cols["step"][i]
            missing &= ~found
            if not missing.any():
                break
        return values, steps

    def stats_frame(self):
        import pandas as pd

        cols = list(STATS_COLUMNS) + list(self.extras) + (["stage"] if self.stage is not None else [])
        P, n = len(self.names), self._rows.n
        if n == 0 or P == 0:
            return _typed_empty(cols, self.names)
        r = self._rows.view()
        data = {
            "step": np.repeat(r["step"], P),
            "name": pd.Categorical.from_codes(np.tile(np.arange(P, dtype=np.int32), n),
                                              categories=pd.Index(self.names, dtype=object)),
            "module": _categorical(self.modules, n),
            "numel": np.tile(self.numel, n),
            "norm": r["norm"].reshape(-1),
            "absmax": r["absmax"].reshape(-1),
            "nonfinite": r["nonfinite"].reshape(-1).astype(np.int64),
            "update_ratio": r["update"].reshape(-1),
            "has_grad": r["has_grad"].reshape(-1),
        }
        for j, c in enumerate(self.extras):
            data[c] = r["extras"][:, :, j].reshape(-1)
        if self.stage is not None:
            data["stage"] = np.tile(self.stage, n)
        df = pd.DataFrame(data, columns=cols)
        if self._since.any():  # parameters adopted late: no rows before they were
            df = df[data["step"] >= np.tile(self._since, n)].reset_index(drop=True)
        return df

    def steps_frame(self):
        import pandas as pd

        v = self._steps.view()
        return pd.DataFrame({c: v[c] for c in STEPS_COLUMNS}, columns=list(STEPS_COLUMNS))

    def hist_frame(self):
        import pandas as pd

        lo = np.array((0.0,) + HIST_EDGES)
        hi = np.array(HIST_EDGES + (math.inf,))
        B, P, n = len(lo), len(self.names), len(self._hist)
        if not n:
            return pd.DataFrame({"step": np.zeros(0, np.int64), "name": np.zeros(0, object),
                                 "lo": np.zeros(0), "hi": np.zeros(0), "count": np.zeros(0, np.int64)})
        return pd.DataFrame({
            "step": np.repeat(np.array([s for s, _ in self._hist], dtype=np.int64), P * B),
            "name": np.tile(np.repeat(np.array(self.names, dtype=object), B), n),
            "lo": np.tile(lo, n * P),
            "hi": np.tile(hi, n * P),
            "count": np.concatenate([h.reshape(-1) for _, h in self._hist]).astype(np.int64),
        })


_STEP_TYPES = {"step": np.int64, "global_norm": np.float64, "clipped_norm": np.float64, "nonfinite": np.int64,
               "overflow": np.bool_, "scale": np.float64, "recorded": np.bool_, "lr": np.float64,
               "loss": np.float64}


class Retained:
    """The one retention rule of what a watch keeps per step (``w.stats``, ``w.steps`` and
    the ledger, ``w.ledger``): named numpy columns of ``cap`` rows, filled in order and thinned when full: the
    first ``cap // 8`` rows, the latest ``cap // 4`` and the marked rows (`mark`, or a step
    in ``keep`` when appended) stay (the first ``cap // 4`` of those; later ones are thinned
    with the middle), and the middle of the run keeps the rows whose sequence number is a
    multiple of ``stride``, so what stays is evenly spaced. Each thinning drops at least a
    quarter of the thinnable rows at once (the stride doubles when the middle at the current
    stride would not give that many), so its cost, O(``cap``), is paid once per O(``cap``)
    appends: amortised O(1) rows per append, however many steps are marked."""

    def __init__(self, cap: int, spec: Dict[str, Tuple[Any, Tuple[int, ...]]]) -> None:
        self.cap = cap
        self.n = 0
        self.dropped = 0
        self.thinnings = 0  # how many times it was thinned (each drops a share of the rows at once)
        self.stride = 1
        self._seq = 0
        spec = dict(spec, _seq=(np.int64, ()), _mark=(np.bool_, ()))
        size = min(cap, 64)  # grown by doubling up to cap: memory follows what is recorded
        self.cols = {k: np.full((size,) + shape, _fill(dtype), dtype=dtype) for k, (dtype, shape) in spec.items()}

    def _grow(self) -> None:
        size = min(self.cap, 2 * len(self.cols["_seq"]))
        for k, col in self.cols.items():
            more = np.full((size - len(col),) + col.shape[1:], _fill(col.dtype), dtype=col.dtype)
            self.cols[k] = np.concatenate([col, more])

    def append(self, row: Dict[str, Any], keep: set) -> None:
        if self.n == self.cap:
            self._thin()
        elif self.n == len(self.cols["_seq"]):
            self._grow()
        for k, v in row.items():
            self.cols[k][self.n] = v
        self.cols["_seq"][self.n] = self._seq
        self.cols["_mark"][self.n] = bool(keep) and row["step"] in keep
        self._seq += 1
        self.n += 1

    def _thin(self) -> None:
        n, cap = self.n, self.cap
        seq = self.cols["_seq"][:n]
        protect = (seq < cap // 8) | (np.arange(n) >= n - cap // 4)
        marked = self.cols["_mark"][:n] & ~protect
        at = np.flatnonzero(marked)
        marked[at[cap // 4:]] = False  # at most cap // 4 marked rows protected: the first ones
        protect |= marked
        free = int(n - protect.sum())
        need = max(1, free // 4)  # drop at least a quarter of the thinnable rows at once
        mask = protect | (seq % self.stride == 0)
        while n - int(mask.sum()) < need and self.stride < (1 << 40):
            self.stride *= 2
            mask = protect | (seq % self.stride == 0)
        if mask.all():  # everything is protected: drop the oldest unprotected-by-age row
            mask[cap // 8] = False
        for col in self.cols.values():
            kept = col[:n][mask]
            col[: len(kept)] = kept
        self.n = int(mask.sum())
        self.dropped += n - self.n
        self.thinnings += 1

    def mark(self, step: int) -> None:
        """Mark the rows of ``step`` (kept from thinning). The rows are in step order: a
        binary search, O(log cap)."""
        steps = self.cols["step"][: self.n]
        lo, hi = np.searchsorted(steps, step, "left"), np.searchsorted(steps, step, "right")
        self.cols["_mark"][lo:hi] |= steps[lo:hi] == step

    @property
    def marked(self) -> int:
        return int(self.cols["_mark"][: self.n].sum())

    def widen(self, k: int) -> None:
        """``k`` more parameters in every per-parameter column (filled as missing)."""
        for key, col in self.cols.items():
            if col.ndim >= 2:
                pad = np.full((col.shape[0], k) + col.shape[2:], _fill(col.dtype), dtype=col.dtype)
                self.cols[key] = np.concatenate([col, pad], axis=1)

    def set_last(self, key: str, step: int, value: Any, depth: int = 2) -> None:
        """Set ``key`` in the row of ``step`` among the last ``depth`` rows (a value measured
        after its step, read back with a later one)."""
        for i in range(self.n - 1, max(self.n - 1 - depth, -1), -1):
            if self.cols["step"][i] == step:
                self.cols[key][i] = value
                return

    def last_row(self) -> Optional[Dict[str, Any]]:
        return {k: c[self.n - 1] for k, c in self.cols.items() if k not in ("_seq", "_mark")} if self.n else None

    def view(self) -> Dict[str, np.ndarray]:
        return {k: c[: self.n].copy() for k, c in self.cols.items() if k not in ("_seq", "_mark")}


def _fill(dtype: Any) -> Any:
    return np.nan if np.issubdtype(dtype, np.floating) else 0


def _categorical(values: Sequence[str], repeat: int):
    import pandas as pd

    cats, codes = np.unique(np.array(values, dtype=object), return_inverse=True)
    return pd.Categorical.from_codes(np.tile(codes.astype(np.int32), repeat),
                                     categories=pd.Index(cats, dtype=object))


def _typed_empty(cols: Sequence[str], names: Sequence[str] = ()):
    import pandas as pd

    dtypes = {"step": np.int64, "numel": np.int64, "nonfinite": np.int64, "has_grad": bool, "stage": np.int64}
    data = {c: np.zeros(0, dtype=dtypes.get(c, np.float64)) for c in cols}
    data["name"] = pd.Categorical([], categories=pd.Index(list(names), dtype=object))
    data["module"] = pd.Categorical([], categories=pd.Index(sorted(set(module_of(n) for n in names)), dtype=object))
    return pd.DataFrame(data, columns=list(cols))


# --------------------------------------------------------------------------- roll-ups
def rollup_norms(key: np.ndarray, norm: np.ndarray, has: np.ndarray, n: int) -> np.ndarray:
    """The norms of groups of parameters (a module, a module at some depth, per step).

    A group's norm is the root of the sum of its rows' squared norms, the one rule of
    graddbg's tables, plots and report. Scaled by each group's largest finite norm, so
    finite norms never overflow (1e38 squared is no Inf); a group with an Inf norm is Inf,
    one with a NaN norm is NaN (NaN before Inf: it is never quietly smaller), and a group
    where no parameter had a gradient (or with no row at all) is NaN. Rows without a
    gradient (``has[i]`` False) are left out whatever their norm.

    Args:
        key: row i's group, an integer array (cast to int64) with values in ``range(n)``.
        norm: row i's norm (float64), of ``key``'s length.
        has: whether row i had a gradient (bool), of ``key``'s length.
        n: the number of groups.

    Returns:
        numpy.ndarray: the ``n`` group norms (float64).

    Raises:
        IndexError: a key >= ``n``.
        ValueError: a negative key, or arrays of different lengths (numpy's errors: the
            arguments are not checked).

    Examples:
        >>> rollup_norms(np.array([0, 0, 1, 2]), np.array([3.0, 4.0, np.nan, 1e38]),
        ...              np.array([True, True, True, True]), 4).tolist()
        [5.0, nan, 1e+38, nan]
    """
    key = np.asarray(key, dtype=np.int64)
    v = np.asarray(norm, dtype=np.float64)
    has = np.asarray(has, dtype=bool)
    fin = has & np.isfinite(v)
    top = np.full(n, np.nan)
    np.fmax.at(top, key, np.where(fin, v, np.nan))
    top = np.nan_to_num(top)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # (past float64's range: Inf)
        ratio = np.where(fin & (top[key] > 0), v / top[key], 0.0)
        out = top * np.sqrt(np.bincount(key, weights=ratio * ratio, minlength=n))
    out[np.bincount(key, weights=(has & np.isinf(v)).astype(float), minlength=n) > 0] = np.inf
    out[np.bincount(key, weights=(has & np.isnan(v)).astype(float), minlength=n) > 0] = np.nan
    out[np.bincount(key, weights=has.astype(float), minlength=n) == 0] = np.nan
    return out


# --------------------------------------------------------------------------- summaries
def summarize(stats, by: str = "param"):
    """Roll a tidy statistics table up, over all recorded steps.

    NaN and Inf norms are kept (max of a column with inf is inf), and NaN-aware means skip
    NaN. Vectorised: millions of rows take seconds.

    Args:
        stats (pandas.DataFrame): a statistics frame (`Watch.stats`).
        by: ``"param"`` (one row per parameter) or ``"module"`` (one row per module; a
            module's norm is the root of the sum of its parameters' squared norms).

    Returns:
        pandas.DataFrame: parameter rows: ``name, module, numel, steps, norm_mean, norm_max,
            norm_last, absmax_max, nonfinite_steps, nonfinite_total, update_ratio_mean,
            has_grad_frac``. Module rows: ``module, params, numel, steps, norm_mean,
            norm_max, norm_last, nonfinite_total``.

    Raises:
        GraddbgValueError: ``by`` is neither ``"param"`` nor ``"module"``.
    """
    if by not in ("param", "module"):
        raise GraddbgValueError(f"by= must be 'param' or 'module', got {by!r}")
    df = _plain_names(stats)
    if by == "module":
        return _summarize_modules(df)
    g = df.groupby("name", sort=False)
    out = g.agg(module=("module", "first"), numel=("numel", "first"), steps=("step", "nunique"),
                norm_mean=("norm", "mean"), norm_max=("norm", "max"), absmax_max=("absmax", "max"),
                nonfinite_total=("nonfinite", "sum"), update_ratio_mean=("update_ratio", "mean"),
                has_grad_frac=("has_grad", "mean")).reset_index()
    out["norm_last"] = g["norm"].nth(-1).to_numpy()  # (the last value as recorded, NaN included)
    out["nonfinite_steps"] = (df["nonfinite"] > 0).groupby(df["name"], sort=False).sum().to_numpy()
    return out[["name", "module", "numel", "steps", "norm_mean", "norm_max", "norm_last", "absmax_max",
                "nonfinite_steps", "nonfinite_total", "update_ratio_mean", "has_grad_frac"]]


def _plain_names(df):
    """Categorical name/module columns as plain strings, in order of first appearance."""
    out = df
    for c in ("name", "module"):
        if c in df and str(df[c].dtype) == "category":
            out = out.assign(**{c: df[c].astype(object)})
    return out


def _summarize_modules(df):
    # a module's norm per step: rollup_norms (a parameter without a gradient adds nothing;
    # a NaN/Inf norm makes the module's norm non-finite too, never quietly smaller)
    import pandas as pd

    has = df["has_grad"].to_numpy(dtype=bool) if "has_grad" in df else np.ones(len(df), bool)
    key = df.groupby(["step", "module"], sort=False).ngroup().to_numpy()
    g = df.assign(_has=has).groupby(["step", "module"], sort=False)
    per = g.agg(_has=("_has", "any"), numel=("numel", "sum"), params=("name", "nunique"),
                nonfinite=("nonfinite", "sum")).reset_index()
    per["norm"] = rollup_norms(key, df["norm"].to_numpy(dtype=np.float64), has, len(per))
    gm = per.groupby("module", sort=False)
    out = gm.agg(params=("params", "max"), numel=("numel", "max"), steps=("step", "nunique"),
                 norm_mean=("norm", "mean"), norm_max=("norm", "max"),
                 nonfinite_total=("nonfinite", "sum")).reset_index()
    out["norm_last"] = gm["norm"].nth(-1).to_numpy()
    return pd.DataFrame(out[["module", "params", "numel", "steps", "norm_mean", "norm_max", "norm_last",
                             "nonfinite_total"]])
