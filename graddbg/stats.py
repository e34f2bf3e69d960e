"""Gradient statistics: batched on-device kernels, a bounded history, and DataFrames.

No hooks here. The kernels take lists of gradient tensors and return one small tensor
on the gradients' device, so that the caller decides when (and whether) to read it back
to the host: one synchronisation per recorded step at most. On the CPU, float32/float64
gradients are read through the BLAS that torch ships (:mod:`graddbg._blas`) and the
answer is a numpy array at once: there is nothing to synchronise there.

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

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

__all__ = [
    "STAT_NAMES",
    "DEFAULT_STATS",
    "StatPlan",
    "validate_stats",
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
]

#: statistics that can be asked for through ``stats=``
STAT_NAMES = ("norm", "absmax", "nonfinite", "mean", "std", "zero_frac")
DEFAULT_STATS = ("norm", "absmax", "nonfinite")
#: columns of the tidy per-parameter table, in order (optional ones appended when asked)
STATS_COLUMNS = ("step", "name", "module", "numel", "norm", "absmax", "nonfinite",
                 "update_ratio", "has_grad")
STEPS_COLUMNS = ("step", "global_norm", "clipped_norm", "nonfinite", "overflow", "scale",
                 "recorded", "lr")

# tensors at least this large are reduced one by one with BLAS-fast kernels; smaller ones
# go through the foreach kernels, where the cost is the launch, not the data
_LARGE = 1 << 16
_FAST_DTYPES = (torch.float32, torch.float64)
# same-shape tensors up to this size are stacked and reduced by rows
_STACK_NUMEL = 16384
# at most this many elements of scratch space kept between steps for the stacked copies
# (16 MB of float32); groups beyond it get a fresh copy each step
_SCRATCH_NUMEL = 1 << 22
# the parameters' snapshot buffer (update ratios, CPU) is kept between snapshots up to this size
_SNAPSHOT_KEEP = 1 << 26
# squares below the dtype's smallest normal number are lost: a norm under
# sqrt(numel) * this (about sqrt(tiny / (2 eps))) may be off by more than rounding, and is
# recomputed exactly (float16 and bfloat16 are reduced in float32)
_UNDERFLOW = {torch.float32: 2.3e-16, torch.float16: 2.3e-16, torch.bfloat16: 2.3e-16, torch.float64: 7.1e-147}

#: fixed log-spaced bin edges of |grad| for histograms: [0, 1e-12), [1e-12, ...), ..., [1e4, inf)
HIST_EDGES = tuple(10.0 ** (e / 2) for e in range(-24, 9))


def validate_stats(stats: Union[str, Iterable[str]]) -> Tuple[str, ...]:
    """Check a ``stats=`` argument; return it as a tuple in canonical order. ``norm`` and
    ``nonfinite`` are always computed (the detectors need them); ``absmax`` costs a second
    pass over the gradients and is left out (NaN) when not asked for.

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
        raise TypeError(f"stats= must be a sequence of statistic names, got {type(stats).__name__}; "
                        f"accepted names: {', '.join(STAT_NAMES)}") from None
    unknown = [s for s in asked if s not in STAT_NAMES]
    if unknown:
        raise ValueError(f"stats= got unknown statistic(s) {unknown}; accepted: {', '.join(STAT_NAMES)}")
    return tuple(s for s in STAT_NAMES if s in asked or s in ("norm", "nonfinite"))


def clean_name(name: str) -> str:
    """Strip the wrappers' prefixes (DDP's ``module.``, torch.compile's ``_orig_mod.``).

    >>> clean_name("module._orig_mod.fc.weight")
    'fc.weight'
    """
    changed = True
    while changed:
        changed = False
        for prefix in ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return name.replace("._orig_mod.", ".").replace("._fsdp_wrapped_module.", ".") \
               .replace("._checkpoint_wrapped_module.", ".")


def module_of(name: str) -> str:
    """The qualified module name that owns a parameter name ("" for the root).

    >>> module_of("encoder.layers.0.linear1.weight"), module_of("bias")
    ('encoder.layers.0.linear1', '')
    """
    return name.rsplit(".", 1)[0] if "." in name else ""


def named_trainable_parameters(model_or_named_params: Any) -> List[Tuple[str, nn.Parameter]]:
    """(clean name, parameter) for every parameter that requires grad, tied ones once."""
    if isinstance(model_or_named_params, nn.Module):
        items = model_or_named_params.named_parameters()  # deduplicates tied parameters
    elif isinstance(model_or_named_params, dict):
        items = model_or_named_params.items()
    else:
        try:
            items = list(model_or_named_params)
        except TypeError:
            raise TypeError("expected an nn.Module, a dict of name -> tensor or an iterable of "
                            f"(name, tensor) pairs, got {type(model_or_named_params).__name__}") from None
    out, seen = [], set()
    for name, p in items:
        if not isinstance(p, Tensor):
            raise TypeError(f"expected tensors as parameters, got {type(p).__name__} for {name!r}")
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        out.append((clean_name(name), p))
    return out


class StatPlan:
    """How to reduce a fixed list of parameters' gradients, decided once.

    CPU float32/float64 gradients go through BLAS ``nrm2`` and ``iamax`` (``?lange`` for
    short ones), one call each per gradient (:mod:`graddbg._blas`; exact norms over the
    whole range; numpy results).
    Otherwise (GPUs, other dtypes, no BLAS, extra statistics):
    large float32/float64 tensors are reduced one by one (``dot`` and ``aminmax``, each a
    single fast pass). Small tensors of the same shape and dtype go through one foreach
    norm, and tiny ones (biases, norms' weights) are stacked into one ``[k, n]`` matrix and
    reduced along rows, so a model of many small layers costs few launches. The results come back as one
    ``[P, K]`` float64 tensor on the gradients' device: columns ``norm``, ``absmax`` and
    then the extra statistics asked for (``mean``, ``std``, ``zero_frac``). Missing
    gradients give NaN rows. Norms are accumulated in the gradient's dtype and the rare
    ones that overflow are recomputed in float64 by :meth:`fixup` after read-back.
    """

    def __init__(self, params: Sequence[Tensor], stats: Sequence[str] = DEFAULT_STATS) -> None:
        self.numel = [p.numel() for p in params]
        self.extras = tuple(s for s in ("mean", "std", "zero_frac") if s in stats)
        self.want_absmax = "absmax" in stats
        self.columns = ("norm", "absmax") + self.extras
        groups: Dict[Tuple[int, torch.dtype, torch.device], List[int]] = {}
        self._single: List[int] = []
        for i, p in enumerate(params):
            if p.numel() >= _LARGE or p.dtype not in _FAST_DTYPES or p.numel() == 0:
                self._single.append(i)
            else:
                groups.setdefault((tuple(p.shape), p.dtype, p.device), []).append(i)
        self._groups: List[List[int]] = []
        for members in groups.values():
            if len(members) == 1:
                self._single.append(members[0])
            else:
                self._groups.append(members)
        self._perm_cache: Dict[Tuple[int, ...], Tensor] = {}
        # CPU float gradients are read through BLAS (see _reduce_host) when it is there
        self._empty = any(n == 0 for n in self.numel)
        self._snap_buf: Optional[Tensor] = None  # the snapshot buffer kept between snapshots
        self._blas = None
        if params and all(p.device.type == "cpu" and p.dtype in _FAST_DTYPES for p in params):
            from graddbg._blas import blas

            self._blas = blas()
            self._blas_layout = self._blas.layout(params) if self._blas is not None else None
            if self._blas_layout is None:
                self._blas = None
        #: whether the last reduction's norms are exact over the whole range (the BLAS
        #: path): fixup() then looks for overflow only
        self.last_exact = False
        self._last_finite = False
        self._last_sumsq = math.nan
        #: read-backs made by :meth:`fixup` (steps with overflowed or underflowed norms)
        self.extra_reads = 0
        self._scratch: Dict[int, Tensor] = {}
        #: the shared read-only zeros that :meth:`fixup` returns on steps without a bad entry
        self.zeros: Any = None
        #: whether every gradient was present at the last reduction
        self.last_complete = True
        self._scratch_numel = 0
        #: parameters whose norms come from the scaled stacked path (exact over the whole
        #: range); the others are checked for overflow and underflow by :meth:`fixup`
        self.scaled = [False] * len(self.numel)
        for members in self._groups:
            if self.numel[members[0]] <= _STACK_NUMEL:
                for i in members:
                    self.scaled[i] = True
        # below these norms an unscaled one may have lost squares to underflow (0 for the
        # scaled ones); None when every norm is scaled
        self._tiny = None
        if not all(self.scaled):
            import numpy as np

            idx = [i for i, sc in enumerate(self.scaled) if not sc]
            tiny = [_UNDERFLOW.get(params[i].dtype, 0.0) * math.sqrt(self.numel[i]) for i in idx]
            self._tiny = (np.array(idx, dtype=np.int64), np.array(tiny), idx, tiny)

    def _reduce(self, grads: Sequence[Optional[Tensor]], want_norm: bool, want_max: bool,
                missing: float = math.nan, try_host: bool = True) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """``([P] norms, [P] absmax)``, float64, in parameter order (None when not wanted);
        ``missing`` for a gradient that is absent or empty. ``try_host=False`` when the
        BLAS path has just refused these gradients."""
        order: List[int] = []
        norms: List[Tensor] = []
        maxes: List[Tensor] = []
        complete = self.last_complete = all(g is not None for g in grads)  # (not `None in`: Tensor.__eq__)
        self.last_exact = False
        if self._blas is not None and try_host:
            got = self._reduce_host(grads)
            if got is not None:
                self.last_exact = True
                return (got[0] if want_norm else None), (got[1] if want_max else None)
        for gi, members in enumerate(self._groups):
            present = members if complete else [i for i in members if grads[i] is not None]
            if not present:
                continue
            ts = [grads[i] for i in present]
            if len(ts) == 1 and ts[0].numel() > _STACK_NUMEL:
                self._reduce_one(present[0], ts[0], want_norm, want_max, order, norms, maxes)
                continue
            if ts[0].numel() <= _STACK_NUMEL:
                # small tensors (biases, norms, the layers of a narrow deep net): one
                # stacked copy and row reductions beat a launch per tensor
                m = self._stacked(gi, ts)
                amax = m.abs_().amax(1)  # (our copy: fewer launches than amax, amin, maximum)
                if want_max:
                    maxes.append(amax)
                if want_norm:
                    norms.append(_scaled_row_norms(m, amax))
            else:  # larger ones: no copy; a foreach norm and one aminmax pass each
                if want_norm:
                    norms.append(torch.stack(torch._foreach_norm(ts)))
                if want_max:
                    mm = [torch.aminmax(t) for t in ts]
                    maxes.append(torch.maximum(torch.stack([x.max for x in mm]), -torch.stack([x.min for x in mm])))
            order.extend(present)
        for i in self._single:
            g = grads[i]
            if g is not None:
                self._reduce_one(i, g, want_norm, want_max, order, norms, maxes)
        P = len(grads)
        device = next((g.device for g in grads if g is not None), torch.device("cpu"))
        if not order:
            nan = torch.full((P,), missing, dtype=torch.float64, device=device)
            return (nan if want_norm else None), (nan if want_max else None)
        perm = self._perm(tuple(order), P, device)

        def place(parts: List[Tensor]) -> Tensor:
            # (torch.cat promotes float32 parts to float64; Python checks cost less than
            # launches that change nothing)
            flat = [t if t.dim() == 1 else t.reshape(-1) for t in parts]
            flat = flat[0] if len(flat) == 1 else torch.cat(flat)
            if flat.dtype != torch.float64:
                flat = flat.to(torch.float64)
            if len(order) < P:  # missing gradients: NaN rows (or `missing`)
                flat = torch.cat([flat, torch.full((1,), missing, dtype=torch.float64, device=device)])
            return flat[perm]

        return (place(norms) if want_norm else None), (place(maxes) if want_max else None)

    def _reduce_host(self, grads: Sequence[Optional[Tensor]]) -> Optional[Tuple[Tensor, Tensor]]:
        """Norms and largest magnitudes of CPU gradients through the BLAS that torch
        carries (:mod:`graddbg._blas`): each gradient read once per statistic with no
        dispatcher in between, exact over the dtype's whole range. None (use the torch
        kernels) as soon as one gradient is not a plain contiguous float32/float64 CPU
        tensor."""
        got = self._blas.reduce_all(grads, self._blas_layout)
        if got.norms is None:
            return None
        self._last_finite, self._last_sumsq = got.finite, got.sumsq
        return (torch.tensor(got.norms, dtype=torch.float64), torch.tensor(got.maxes, dtype=torch.float64))

    def release(self) -> None:
        """Free the scratch matrices kept between steps (the plan still works after)."""
        self._scratch.clear()
        self._snap_buf = None
        self._scratch_numel = 0

    def _stacked(self, gi: int, ts: List[Tensor]) -> Tensor:
        """``[k, n]`` copy of the k same-shape tensors ``ts`` (group ``gi``), written into a
        scratch matrix kept between steps when the group is complete: a fresh megabyte
        each step costs more in page faults on CPU than the copy itself."""
        k, n = len(ts), ts[0].numel()
        buf = self._scratch.get(gi)
        if k != len(self._groups[gi]) or (buf is None and self._scratch_numel + k * n > _SCRATCH_NUMEL):
            return torch.stack(ts).reshape(k, n)
        if buf is None or buf.device != ts[0].device or buf.dtype != ts[0].dtype:
            buf = self._scratch[gi] = torch.empty((k, n), dtype=ts[0].dtype, device=ts[0].device)
            self._scratch_numel += k * n
        torch.stack(ts, out=buf.view(k, *ts[0].shape))
        return buf

    @staticmethod
    def _reduce_one(i: int, g: Tensor, want_norm: bool, want_max: bool, order: List[int],
                    norms: List[Tensor], maxes: List[Tensor]) -> None:
        if g.numel() == 0:
            return
        v = g.reshape(-1)
        if v.dtype not in _FAST_DTYPES:
            v = v.float()
        if v.numel() <= _STACK_NUMEL:  # a lone small tensor: two launches
            if want_norm:
                norms.append(torch.linalg.vector_norm(v))
            if want_max:
                maxes.append(torch.linalg.vector_norm(v, math.inf))
            order.append(i)
            return
        if want_norm:
            # BLAS dot runs on every intra-op thread (vector_norm runs on one on CPU)
            norms.append(torch.dot(v, v).sqrt() if v.device.type == "cpu" else torch.linalg.vector_norm(v))
        if want_max:
            lo, hi = torch.aminmax(v)
            maxes.append(torch.maximum(hi, -lo))
        order.append(i)

    def _perm(self, order: Tuple[int, ...], P: int, device: torch.device) -> Tensor:
        """Index that puts results computed in ``order`` back into parameter order (the
        missing ones pointing at a trailing NaN)."""
        key = order
        perm = self._perm_cache.get(key)
        if perm is None or perm.device != device:
            pos = {i: k for k, i in enumerate(order)}
            perm = torch.tensor([pos.get(i, len(order)) for i in range(P)], dtype=torch.int64, device=device)
            if len(self._perm_cache) > 64:
                self._perm_cache.clear()
            self._perm_cache[key] = perm
        return perm

    def compute(self, grads: Sequence[Optional[Tensor]]) -> "Union[Tensor, Any]":
        """``[P, K]`` float64 statistics of ``grads`` on their device (no host sync): a
        tensor, or a numpy array when they were computed on the host already (CPU
        gradients through BLAS, without extra statistics)."""
        return self._compute(grads, False)[1]

    def compute_params(self, params: Sequence[Tensor]) -> "Tuple[List[Optional[Tensor]], Union[Tensor, Any]]":
        """``(gradients, statistics)``: :meth:`compute` of the ``.grad`` of ``params``
        (the plan's parameters), read in the same loop as the statistics."""
        return self._compute(params, True)

    def _compute(self, items: Sequence[Any], of_params: bool) -> Tuple[List[Optional[Tensor]], "Union[Tensor, Any]"]:
        grads: List[Optional[Tensor]]
        if self._blas is not None and not self.extras:
            got = self._blas.reduce_all(items, self._blas_layout, of_params, want_max=self.want_absmax)
            grads = got.grads
            self.last_complete = got.complete
            if got.norms is not None:
                import numpy as np

                self.last_exact = True
                self._last_finite, self._last_sumsq = got.finite, got.sumsq
                out = np.empty((len(grads), 2))
                out[:, 0] = got.norms
                out[:, 1] = got.maxes
                return grads, out
            tried = True
        else:
            grads = [p.grad for p in items] if of_params else list(items)
            tried = False
        device = next((g.device for g in grads if g is not None), torch.device("cpu"))
        norms_t, maxes_t = self._reduce(grads, True, self.want_absmax, try_host=not tried)
        if maxes_t is None:
            maxes_t = torch.full_like(norms_t, float("nan"))
        cols = [norms_t, maxes_t]
        if self.extras:
            cols += self._extras(grads, device)
        return grads, torch.stack(cols, 1)

    def absmax(self, grads: Sequence[Optional[Tensor]]) -> "Union[Tensor, Any]":
        """``[P]`` float64 max |g| (NaN if any entry is NaN, inf if any is inf): the cheap
        exact non-finite check; 0 for a missing or empty gradient. A numpy array when
        computed on the host (CPU, BLAS)."""
        return self._absmax(grads, False)[1]

    def absmax_params(self, params: Sequence[Tensor]) -> "Tuple[List[Optional[Tensor]], Union[Tensor, Any]]":
        """``(gradients, absmax)`` of the ``.grad`` of ``params``, as :meth:`compute_params`."""
        return self._absmax(params, True)

    def _absmax(self, items: Sequence[Any], of_params: bool) -> Tuple[List[Optional[Tensor]], "Union[Tensor, Any]"]:
        grads: List[Optional[Tensor]]
        if self._blas is not None:
            got = self._blas.reduce_all(items, self._blas_layout, of_params)
            grads = got.grads
            self.last_complete = got.complete
            if got.maxes is not None:
                import numpy as np

                out = np.array(got.maxes)
                if not self.last_complete or self._empty:
                    for i, g in enumerate(grads):
                        if g is None or g.numel() == 0:
                            out[i] = 0.0
                return grads, out
        else:
            grads = [p.grad for p in items] if of_params else list(items)
        # (0, not NaN, for a parameter without a gradient: nothing in it is non-finite)
        return grads, self._reduce(grads, False, True, missing=0.0, try_host=False)[1]

    def _extras(self, grads: Sequence[Optional[Tensor]], device: torch.device) -> List[Tensor]:
        sums: List[Optional[Tensor]] = []
        sqs: List[Optional[Tensor]] = []
        zeros: List[Optional[Tensor]] = []
        for g in grads:
            if g is None or g.numel() == 0:
                sums.append(None), sqs.append(None), zeros.append(None)
                continue
            g64 = g.double() if g.dtype != torch.float64 else g
            sums.append(g64.sum())
            sqs.append((g64 * g64).sum() if "std" in self.extras else None)
            zeros.append((g == 0).sum() if "zero_frac" in self.extras else None)
        numel = torch.tensor(self.numel, dtype=torch.float64, device=device)
        s = _stack(sums, device)
        mean = s / numel
        out = []
        for name in self.extras:
            if name == "mean":
                out.append(mean)
            elif name == "std":
                sq = _stack(sqs, device)
                var = (sq - numel * mean * mean) / (numel - 1).clamp(min=1)
                out.append(var.clamp(min=0).sqrt())
            elif name == "zero_frac":
                out.append(_stack(zeros, device) / numel)
        return out

    def snapshot(self, params: Sequence[Tensor]) -> Any:
        """A copy of the parameters before an optimizer step, for :meth:`update_ratio`:
        one buffer filled by ``memmove`` on the CPU (BLAS path; kept between snapshots
        when at most 64 MB: a fresh one costs more in page faults than the copy), else
        their clones."""
        if self._blas is not None:
            lay = self._blas_layout
            keep = self._snap_buf is not None or lay.nbytes <= _SNAPSHOT_KEEP
            if keep and self._snap_buf is None:
                self._snap_buf = torch.empty(lay.nbytes, dtype=torch.uint8)
            buf = self._blas.snapshot(params, lay, self._snap_buf if keep else None)
            if buf is not None:
                return buf
        with torch.no_grad():
            return [p.clone() for p in params]

    def update_ratio(self, snap: Any, params: Sequence[Tensor]) -> "Union[Tensor, Any]":
        """``[P]`` float64 ``||w_old - w_new|| / ||w_old||`` (inf when only the old norm is
        0, 0 when both are) from a :meth:`snapshot` and the parameters after the step.
        The snapshot is used up (it becomes the difference). A numpy array when computed
        on the host (BLAS), else a tensor on the parameters' device (no host sync)."""
        if isinstance(snap, Tensor):  # the BLAS snapshot buffer
            got = self._blas.update_norms(snap, params, self._blas_layout)
            if got is not None:
                import numpy as np

                wn, dn = np.array(got[0]), np.array(got[1])
                with np.errstate(divide="ignore", invalid="ignore"):
                    return np.where(wn > 0, dn / wn, np.where(dn > 0, np.inf, 0.0))
            snap = self._blas_layout.views(snap)
        with torch.no_grad():
            wn = torch.stack(torch._foreach_norm(snap)).double()
            torch._foreach_sub_(snap, list(params))  # our copy becomes old - new: no allocation
            dn = torch.stack(torch._foreach_norm(snap)).double()
            return torch.where(wn > 0, dn / wn, torch.where(dn > 0, torch.full_like(dn, math.inf),
                                                            torch.zeros_like(dn)))

    def global_sumsq(self) -> Optional[float]:
        """The sum of the squared norms of the last :meth:`compute`, when its norms are
        final (the BLAS path, every norm finite): no pass over them needed. Else None."""
        return self._last_sumsq if (self.last_exact and self._last_finite) else None

    def _zeros(self, n: int) -> Any:
        if self.zeros is None or len(self.zeros) != n:
            import numpy as np

            self.zeros = np.zeros(n, dtype=np.int64)
            self.zeros.setflags(write=False)
        return self.zeros

    def fixup(self, values: "Any", grads: Sequence[Optional[Tensor]], div: Optional[float] = None) -> "Any":
        """After read-back: exact non-finite counts, and float64 norms where the fast norm
        of a gradient left out of the scaled path overflowed (every entry 1e20) or may
        have underflowed (entries below about 1e-19 in float32 have squares below the
        smallest normal float32). ``values`` is the numpy ``[P, K]`` array from
        :meth:`compute` (already divided by ``div``, a loss scale, when given); returns the
        ``[P]`` numpy array of non-finite counts and fixes ``values`` in place. The
        recomputation reads those gradients again, on the device, with one more read-back
        for all of them, counted in :attr:`extra_reads`; steps where nothing is suspect
        cost nothing more."""
        import numpy as np

        if self.last_exact and self._last_finite:
            # (the BLAS path saw every norm finite, and its norms need no rescue)
            return self._zeros(len(grads))
        norms = values[:, 0]
        under = None
        any_under = False
        if self._tiny is not None and not self.last_exact:
            idx, tiny, idx_l, tiny_l = self._tiny
            if div is not None:
                tiny = tiny / div
                tiny_l = [t / div for t in tiny_l]
            # a zero absmax means a zero gradient: nothing to recompute. (Right after a
            # training step numpy's fancy indexing costs tens of microseconds, cold: a few
            # scalar reads are cheaper.)
            if len(idx) <= 8:
                any_under = any(values[i, 0] < t and values[i, 1] != 0 for i, t in zip(idx_l, tiny_l))
            else:
                sub = values[idx]
                under = (sub[:, 0] < tiny) & (sub[:, 1] != 0)
                any_under = bool(under.any())
        if math.isfinite(float(norms.sum())) and not any_under:
            return self._zeros(len(grads))  # the common step: shared, read-only
        counts = np.zeros(len(grads), dtype=np.int64)
        finite = np.isfinite(norms)
        suspect = ~finite
        if any_under:
            sub = values[idx]
            suspect[idx] |= (sub[:, 0] < tiny) & (sub[:, 1] != 0)
        sus = [int(i) for i in np.nonzero(suspect)[0] if grads[i] is not None]
        if not sus:
            return counts
        with torch.no_grad():
            got = torch.stack([torch.stack([(~torch.isfinite(grads[i])).sum().to(torch.float64),
                                            torch.linalg.vector_norm(grads[i].detach().to(torch.float64))])
                               for i in sus]).cpu().numpy()
        self.extra_reads += 1
        for (bad, n64), i in zip(got, sus):
            counts[i] = int(bad)
            if not bad:  # finite entries whose norm overflowed or underflowed in the fast dtype
                values[i, 0] = n64 / (div or 1.0)
        return counts


def _scaled_row_norms(m: Tensor, amax: Tensor) -> Tensor:
    """L2 norms of the rows of ``m`` (a scratch copy: divided in place), exact over the
    whole range of the dtype: each row is first divided by its largest magnitude
    ``amax``, so the squares neither underflow (a vanishing gradient of 1e-26 has squares
    below float32's smallest number: its plain norm is 0, and slow to compute) nor
    overflow (1e20). Rows holding NaN or Inf keep their non-finite norm.

    >>> m = torch.full((3, 3), 1e-26); m[1] = 1e20; m[2] = 0.0
    >>> [f"{v:.4g}" for v in _scaled_row_norms(m.clone(), m.abs().amax(1)).tolist()]
    ['1.732e-26', '1.732e+20', '0']
    """
    fi = torch.finfo(m.dtype)
    s = amax.clamp(fi.tiny, fi.max)  # zero rows: 0 / tiny; Inf rows: Inf / max stays Inf
    m.div_(s.unsqueeze(1))
    # (a norm beyond the dtype's range comes out Inf: fixup() recomputes it in float64)
    return torch.linalg.vector_norm(m, dim=1).mul_(s)


def _stack(values: Sequence[Optional[Tensor]], device: torch.device) -> Tensor:
    nan = None
    out = []
    for v in values:
        if v is None:
            if nan is None:  # a fill kernel, not a host-to-device copy
                nan = torch.full((), float("nan"), dtype=torch.float64, device=device)
            out.append(nan)
        else:
            out.append(v.to(torch.float64))
    if not out:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.stack(out)


def histogram_counts(grad: Tensor, edges: Tensor) -> Tensor:
    """Counts of finite |grad| values in the bins ``[0, e0), [e0, e1), ..., [e_last, inf)``
    (``len(edges) + 1`` bins), on the gradient's device. NaN and Inf are not counted.

    >>> histogram_counts(torch.tensor([0.0, 1.0, -1.0, float("nan")]), torch.tensor([0.5, 2.0])).tolist()
    [1, 2, 0]
    """
    a = grad.detach().reshape(-1).abs()
    a = a[torch.isfinite(a)]
    idx = torch.bucketize(a.to(edges.dtype), edges, right=True)
    return torch.bincount(idx, minlength=edges.numel() + 1)


def grad_stats(model_or_named_params: Any, stats: Sequence[str] = STAT_NAMES):
    """One-shot statistics of the current ``.grad`` of every trainable parameter; no hooks.

    Returns a DataFrame with one row per parameter: ``name, module, numel, norm, absmax,
    nonfinite, has_grad`` and the optional statistics asked for. A parameter without a
    gradient has ``has_grad=False`` and NaN statistics.
    """
    import pandas as pd

    stats = validate_stats(stats)
    named = named_trainable_parameters(model_or_named_params)
    params = [p for _, p in named]
    grads = [p.grad for p in params]
    plan = StatPlan(params, stats)
    values = plan.compute(grads) if params else None
    if isinstance(values, Tensor):
        values = values.cpu().numpy()
    counts = plan.fixup(values, grads) if params else []  # (reads an overflowed norm again)
    rows = []
    for i, (name, p) in enumerate(named):
        row = {"name": name, "module": module_of(name), "numel": p.numel(),
               "norm": values[i, 0], "absmax": values[i, 1], "nonfinite": int(counts[i]),
               "has_grad": grads[i] is not None}
        for j, col in enumerate(plan.extras):
            row[col] = values[i, 2 + j]
        rows.append(row)
    cols = ["name", "module", "numel", "norm", "absmax", "nonfinite", "has_grad", *plan.extras]
    return pd.DataFrame(rows, columns=cols)


@dataclass
class StepRecord:
    """What one step boundary recorded (host-side, numpy; small)."""

    step: int
    values: Any  # numpy [P, K] float64 or None when per-parameter stats were not due
    nonfinite: Any  # numpy [P] int64 or None
    has_grad: Any  # numpy [P] bool or None
    global_norm: float
    clipped_norm: float
    overflow: bool
    scale: float
    lr: float
    update: Any = None  # numpy [P] update ratios, filled after the optimizer step
    hist: Any = None  # numpy [P, bins] counts or None


class History:
    """A bounded history of step records: the newest ``maxlen`` steps are kept and the
    oldest dropped (a deque), so memory stays flat however long training runs."""

    def __init__(self, names: Sequence[str], columns: Sequence[str], maxlen: int) -> None:
        self.names = list(names)
        self.modules = [module_of(n) for n in names]
        self.columns = tuple(columns)
        self.records: Deque[StepRecord] = deque(maxlen=maxlen)
        self.dropped = 0

    def append(self, rec: StepRecord) -> None:
        if len(self.records) == self.records.maxlen:
            self.dropped += 1
        self.records.append(rec)

    def stats_frame(self, numel: Sequence[int]):
        import numpy as np
        import pandas as pd

        recs = [r for r in self.records if r.values is not None]
        P = len(self.names)
        extras = list(self.columns[2:])
        cols = list(STATS_COLUMNS) + extras
        if not recs or P == 0:
            return _typed_empty(cols)
        n = len(recs)
        vals = np.concatenate([r.values for r in recs], 0)
        upd = np.concatenate([r.update if r.update is not None else np.full(P, np.nan) for r in recs])
        data = {
            "step": np.repeat(np.array([r.step for r in recs], dtype=np.int64), P),
            "name": np.tile(np.array(self.names, dtype=object), n),
            "module": np.tile(np.array(self.modules, dtype=object), n),
            "numel": np.tile(np.asarray(numel, dtype=np.int64), n),
            "norm": vals[:, 0],
            "absmax": vals[:, 1],
            "nonfinite": np.concatenate([r.nonfinite for r in recs]).astype(np.int64),
            "update_ratio": upd.astype(np.float64),
            "has_grad": np.concatenate([r.has_grad for r in recs]).astype(bool),
        }
        for j, c in enumerate(extras):
            data[c] = vals[:, 2 + j]
        return pd.DataFrame(data, columns=cols)

    def steps_frame(self):
        import numpy as np
        import pandas as pd

        recs = list(self.records)
        data = {
            "step": np.array([r.step for r in recs], dtype=np.int64),
            "global_norm": np.array([r.global_norm for r in recs], dtype=np.float64),
            "clipped_norm": np.array([r.clipped_norm for r in recs], dtype=np.float64),
            "nonfinite": np.array([0 if r.nonfinite is None else int(r.nonfinite.sum()) for r in recs],
                                  dtype=np.int64),
            "overflow": np.array([r.overflow for r in recs], dtype=bool),
            "scale": np.array([r.scale for r in recs], dtype=np.float64),
            "recorded": np.array([r.values is not None for r in recs], dtype=bool),
            "lr": np.array([r.lr for r in recs], dtype=np.float64),
        }
        return pd.DataFrame(data, columns=list(STEPS_COLUMNS))

    def hist_frame(self):
        import numpy as np
        import pandas as pd

        recs = [r for r in self.records if r.hist is not None]
        lo = np.array((0.0,) + HIST_EDGES)
        hi = np.array(HIST_EDGES + (math.inf,))
        B, P = len(lo), len(self.names)
        if not recs:
            return pd.DataFrame({"step": np.zeros(0, np.int64), "name": np.zeros(0, object),
                                 "lo": np.zeros(0), "hi": np.zeros(0), "count": np.zeros(0, np.int64)})
        n = len(recs)
        return pd.DataFrame({
            "step": np.repeat(np.array([r.step for r in recs], dtype=np.int64), P * B),
            "name": np.tile(np.repeat(np.array(self.names, dtype=object), B), n),
            "lo": np.tile(lo, n * P),
            "hi": np.tile(hi, n * P),
            "count": np.concatenate([r.hist.reshape(-1) for r in recs]).astype(np.int64),
        })


def _typed_empty(cols: Sequence[str]):
    import numpy as np
    import pandas as pd

    dtypes = {"step": np.int64, "name": object, "module": object, "numel": np.int64,
              "nonfinite": np.int64, "has_grad": bool}
    return pd.DataFrame({c: np.zeros(0, dtype=dtypes.get(c, np.float64)) for c in cols})


def summarize(stats, by: str = "param"):
    """Roll a tidy statistics table up: one row per parameter (``by="param"``) or per
    module (``by="module"``; a module's norm is the root of the sum of its parameters'
    squared norms) over all recorded steps.

    Parameter rows: ``name, module, numel, steps, norm_mean, norm_max, norm_last,
    absmax_max, nonfinite_steps, nonfinite_total, update_ratio_mean, has_grad_frac``.
    Module rows: ``module, params, numel, steps, norm_mean, norm_max, norm_last,
    nonfinite_total``. NaN and Inf norms are kept (max of a column with inf is inf), and
    NaN-aware means skip NaN.
    """
    import numpy as np

    if by not in ("param", "module"):
        raise ValueError(f"by= must be 'param' or 'module', got {by!r}")
    df = stats
    if by == "module":
        # a parameter without a gradient adds nothing; a NaN/Inf norm makes the module's
        # norm non-finite too (never quietly smaller)
        has = df["has_grad"].to_numpy(dtype=bool) if "has_grad" in df else np.ones(len(df), bool)
        sq = df.assign(_sq=np.where(has, df["norm"].to_numpy(dtype=np.float64) ** 2, 0.0), _has=has)
        g = sq.groupby(["step", "module"], sort=False)
        per = g.agg(_sq=("_sq", lambda s: s.sum(skipna=False)), _has=("_has", "any"),
                    numel=("numel", "sum"), params=("name", "nunique"),
                    nonfinite=("nonfinite", "sum")).reset_index()
        per["norm"] = np.where(per["_has"], np.sqrt(per["_sq"]), np.nan)
        out = per.groupby("module", sort=False).agg(
            params=("params", "max"), numel=("numel", "max"), steps=("step", "nunique"),
            norm_mean=("norm", "mean"), norm_max=("norm", _nanmax), norm_last=("norm", _last),
            nonfinite_total=("nonfinite", "sum")).reset_index()
        return out[["module", "params", "numel", "steps", "norm_mean", "norm_max", "norm_last",
                    "nonfinite_total"]]
    g = df.groupby("name", sort=False)
    out = g.agg(module=("module", "first"), numel=("numel", "first"), steps=("step", "nunique"),
                norm_mean=("norm", "mean"), norm_max=("norm", _nanmax), norm_last=("norm", _last),
                absmax_max=("absmax", _nanmax), nonfinite_steps=("nonfinite", lambda s: int((s > 0).sum())),
                nonfinite_total=("nonfinite", "sum"), update_ratio_mean=("update_ratio", "mean"),
                has_grad_frac=("has_grad", "mean")).reset_index()
    return out[["name", "module", "numel", "steps", "norm_mean", "norm_max", "norm_last", "absmax_max",
                "nonfinite_steps", "nonfinite_total", "update_ratio_mean", "has_grad_frac"]]


def _nanmax(s):
    import numpy as np

    v = s.to_numpy(dtype=np.float64)
    if np.isposinf(v).any():
        return np.inf
    v = v[~np.isnan(v)]
    return float(v.max()) if v.size else np.nan


def _last(s):
    """The last value as recorded (NaN included, unlike pandas' "last")."""
    return s.iloc[-1] if len(s) else float("nan")
