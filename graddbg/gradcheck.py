"""Numerical against analytic derivatives: ``gradcheck``, ``check_module``,
``assert_gradients_close`` and their result, ``GradcheckResult``.

Two modes:

- ``mode="full"`` compares every Jacobian entry against the backward pass, batched.
  Forward differences (one evaluation per input element) clear the columns that agree
  within half the tolerance; every other column is recomputed with central differences,
  which decide every reported mismatch. The perturbations of many input elements go
  through one ``torch.func.vmap`` call (chunked to bound memory), the rows of the
  analytic Jacobian through one batched vector-Jacobian product. Functions that ``vmap`` cannot run
  (``.item()``, random numbers, custom ``autograd.Function`` without a vmap rule, ...)
  fall back to a loop. Use it for functions of up to a few thousand elements (sparse
  ones, below, of tens of thousands), and always when you hunt a single wrong entry: it
  finds every one and says where.

  Sparse Jacobians are compressed (Curtis-Powell-Reid column colouring). When the
  analytic Jacobian has at least 128 columns and its nonzeros let the columns be
  coloured with at most a quarter as many colours (columns of one colour share no row
  of the analytic pattern; elementwise ops, ``sort``, ``gather``/``scatter``, pooling,
  per-sample losses, banded convolutions...), the columns of each colour are perturbed
  together along ``u_g = sum_j r_j e_j`` with seeded random weights ``r_j`` in
  [0.5, 1], so one difference serves a whole colour. Every Jacobian entry is still
  compared: in row ``i`` the analytic pattern names at most one column ``j*`` of the
  colour, ``(J_num u_g)_i / r_j*`` is compared with the analytic entry ``(i, j*)``
  under the entry tolerance (a row with no column of the colour must come out zero),
  and every other entry of the colour's columns in that row is part of the same sum, so
  a wrong entry there shows up too, unless wrong entries of one row and colour cancel
  to within the tolerance for the drawn weights (distinct random weights make that
  improbable; with at most 16 colours every colour is checked under two independent
  draws). For the rows the pattern gets right the difference is the single-column one
  with the step ``r_j* eps``; neighbouring inputs move relative to each other by at most
  ``eps / 2``, less than a single-column step, so ``sort``-like ops do not reorder. A
  colour that fails is bisected until its groups have at most 16 columns, whose columns
  are then recomputed one by one: the reported entries (input, index, output,
  analytic, numerical, abs_err, rel_err, worst first) are exact per-column central
  differences, as without compression. ``compress=False`` turns it off;
  ``forward_ad=True`` does not use it. ``result.colours`` says whether it ran and
  ``result.n_evaluations`` counts the function evaluations.
- ``mode="fast"`` compares random projections ``v^T J u`` for several probes ``u`` (per
  input) and ``v`` (over all outputs), drawn with a fixed seed. Each projection is
  compared, in float64, against its own magnitude and an estimate of the rounding noise
  of the finite difference, not against a bound summed over the whole Jacobian (which is
  why ``torch.autograd.gradcheck(fast_mode=True)`` misses a 1% error in a large input).
  It catches scaled, dropped-term and transposed gradients at any size for the cost of a
  few function evaluations; a single wrong entry of a large Jacobian only when it is large
  against the rest. On a failure it re-runs full mode on the failing input, when that
  input is small enough, to say which entries are wrong.

Floating-point inputs (and modules) are checked on float64 copies by default; nothing
passed in is modified.
"""
from __future__ import annotations

import copy
import math
import sys
import time
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch.utils import _pytree as pytree

from graddbg._errors import GraddbgError, GradientMismatchError, PrecisionWarning

__all__ = ["gradcheck", "check_module", "assert_gradients_close", "GradcheckResult",
           "TOLERANCES"]

#: (eps, atol, rtol) by the dtype the check runs in; every value can be overridden.
TOLERANCES: Dict[torch.dtype, Tuple[float, float, float]] = {
    torch.float64: (1e-6, 1e-5, 1e-3),
    torch.float32: (1e-3, 1e-3, 1e-2),
    torch.float16: (1e-2, 5e-2, 5e-2),
    torch.bfloat16: (1e-2, 1e-1, 1e-1),
}

_MODES = ("full", "fast")
_KINKS = ("allow", "fail")
_WRT = ("all", "params", "inputs")
_BUDGET = 1 << 23          # elements of a perturbation/probe chunk (64 MiB of float64)
_TABLE_ROWS = 1000         # rows kept in a result's table
_STR_ROWS = 10             # rows shown by str(result)
_RACE = 32                 # rows timed batched against looped before choosing
_VMAP_ROWS = 32            # rows per vmap call
_SMALL_BATCH = 4           # the smaller batch size timed against it
_MIN_BATCH = 12            # fewer rows than this are cheaper in a loop
_NOISE = 64.0              # rounding units assumed per function output (fast mode)

_COLUMNS = ["input", "index", "output", "output_index", "analytic", "numerical",
            "abs_err", "rel_err", "check", "note"]


# --------------------------------------------------------------------------- result


@dataclass
class GradcheckResult:
    """The outcome of a check. ``bool(result)`` is ``result.ok``.

    ``table`` (a pandas DataFrame, built on first access) lists the entries that did not
    match, worst first: ``input`` (argument or parameter name), ``index`` (a tuple into
    that input), ``output``/``output_index``, ``analytic``, ``numerical``, ``abs_err``,
    ``rel_err`` (``abs_err / max(|numerical|, atol)``), ``check`` (``"jacobian"``,
    ``"projection"`` in fast mode, ``"forward_ad"``, ``"forward_vs_reverse"``,
    ``"second_order"``) and ``note`` (``"non-differentiable point"`` when one-sided
    differences show a kink and the analytic value is one of its one-sided derivatives).
    ``max_abs_err``/``max_rel_err`` are over every compared entry (projection in fast
    mode); in full mode, entries cleared by the forward-difference screen count with
    their forward-difference error (about ``eps * |f''| / 2``), the others with their
    central-difference error. ``n_evaluations`` counts the perturbed function
    evaluations; ``colours`` is the number of colour groups when full mode compressed
    the Jacobian's columns (None when it checked them one by one).

    >>> import torch
    >>> r = gradcheck(torch.sin, torch.randn(4, dtype=torch.float64, requires_grad=True))
    >>> r.ok, len(r.table), r.max_abs_err < 1e-6
    (True, 0, True)
    """

    ok: bool
    mode: str
    eps: float
    atol: float
    rtol: float
    dtype: torch.dtype
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    n_compared: int = 0
    n_mismatched: int = 0
    n_evaluations: int = 0
    colours: Optional[int] = None
    nondeterministic: bool = False
    nondet_spread: float = 0.0
    nondet_tol: Optional[float] = None
    kinks: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    localised: Optional[str] = None
    rows: List[dict] = field(default_factory=list, repr=False)
    _table: Any = field(default=None, repr=False)

    def __bool__(self) -> bool:
        return self.ok

    @property
    def mismatch_fraction(self) -> float:
        """Fraction of compared entries (or projections) that mismatched."""
        return self.n_mismatched / self.n_compared if self.n_compared else 0.0

    @property
    def table(self) -> Any:
        """Mismatching entries, worst first (pandas DataFrame)."""
        if self._table is None:
            import pandas as pd

            self._table = pd.DataFrame(self.rows, columns=_COLUMNS)
        return self._table

    def __str__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        head = (f"gradcheck {'passed' if self.ok else 'FAILED'} (mode={self.mode}, "
                f"eps={self.eps:g}, atol={self.atol:g}, rtol={self.rtol:g}, dtype={dt})")
        what = "projections" if self.mode == "fast" and self.localised is None else "entries"
        lines = [head,
                 f"  {self.n_mismatched} of {self.n_compared} {what} mismatch "
                 f"({100 * self.mismatch_fraction:.3g}%); max abs err {self.max_abs_err:.3g}, "
                 f"max rel err {self.max_rel_err:.3g}"]
        if self.nondeterministic:
            lines.append(f"  nondeterministic backward: two runs differ by up to "
                         f"{self.nondet_spread:.3g} (allowed: "
                         f"{'atol + rtol*|grad|' if self.nondet_tol is None else self.nondet_tol});"
                         f" this is not a wrong gradient; pass nondet_tol>={self.nondet_spread:.3g}"
                         f" to accept it")
        elif self.nondet_spread > 0:
            lines.append(f"  backward varies between runs by {self.nondet_spread:.3g} (within tolerance)")
        if self.colours is not None:
            lines.append(f"  Jacobian columns compressed into {self.colours} colour group(s) "
                         f"(sparse analytic pattern); {self.n_evaluations} function evaluations")
        if self.localised:
            lines.append(f"  fast-mode projections disagreed; full mode re-run on {self.localised} "
                         f"(entries above are Jacobian entries)")
        for note in self.kinks[:3]:
            lines.append(f"  non-differentiable point: {note}")
        if len(self.kinks) > 3:
            lines.append(f"  ... {len(self.kinks) - 3} more non-differentiable points")
        lines.extend(f"  {note}" for note in self.notes)
        bad = [r for r in self.rows if r["note"] != "non-differentiable point"]
        if bad:
            lines.append(f"  worst {min(_STR_ROWS, len(bad))} of {self.n_mismatched}:")
            lines.extend("    " + line for line in _format_rows(bad[:_STR_ROWS]))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"GradcheckResult(ok={self.ok}, mode={self.mode!r}, max_abs_err="
                f"{self.max_abs_err:.3g}, max_rel_err={self.max_rel_err:.3g}, "
                f"n_mismatched={self.n_mismatched})")


def _format_rows(rows: List[dict]) -> List[str]:
    def cell(key: str, value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.6g}"
        if isinstance(value, tuple):
            return "(" + ", ".join(str(v) for v in value) + ("," if len(value) == 1 else "") + ")"
        return str(value)

    keys = [k for k in _COLUMNS if any(r.get(k) not in ("", None) for r in rows)]
    cells = [[cell(k, r[k]) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    out = ["  ".join(k.ljust(w) for k, w in zip(keys, widths))]
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return out


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class _Options:
    mode: str
    eps: float
    atol: float
    rtol: float
    nondet_tol: Optional[float]
    forward_ad: bool
    second_order: bool
    kinks: str
    seed: int
    probes: int
    max_entries: int
    localise_entries: int
    compress: bool = True


def _options(dtype: torch.dtype, mode: str, eps: Optional[float], atol: Optional[float],
             rtol: Optional[float], nondet_tol: Optional[float], forward_ad: bool,
             second_order: bool, kinks: str, seed: int, probes: int, max_entries: int,
             localise_entries: int, compress: bool = True) -> _Options:
    if mode not in _MODES:
        raise GraddbgError(f"gradcheck: mode={mode!r} is not supported; use one of {_MODES}")
    if kinks not in _KINKS:
        raise GraddbgError(f"gradcheck: kinks={kinks!r} is not supported; use one of {_KINKS}")
    for name, value in (("eps", eps), ("atol", atol), ("rtol", rtol), ("nondet_tol", nondet_tol)):
        if value is not None and not (isinstance(value, (int, float)) and value >= 0
                                      and math.isfinite(value)):
            raise GraddbgError(f"gradcheck: {name}={value!r} must be a finite number >= 0 (or None)")
    if eps is not None and eps <= 0:
        raise GraddbgError(f"gradcheck: eps={eps!r} must be > 0")
    if not isinstance(probes, int) or probes < 1:
        raise GraddbgError(f"gradcheck: probes={probes!r} must be an int >= 1")
    d_eps, d_atol, d_rtol = TOLERANCES.get(dtype, TOLERANCES[torch.float64])
    return _Options(mode, float(d_eps if eps is None else eps),
                    float(d_atol if atol is None else atol),
                    float(d_rtol if rtol is None else rtol),
                    None if nondet_tol is None else float(nondet_tol),
                    bool(forward_ad), bool(second_order), kinks, int(seed), probes,
                    int(max_entries), int(localise_entries), bool(compress))


# --------------------------------------------------------------------------- target


class _Target:
    """A function of a flat list of differentiable tensors returning a flat list of
    floating-point output tensors (integer outputs are dropped)."""

    def __init__(self, fn: Callable[[Sequence[torch.Tensor]], Any], xs: List[torch.Tensor],
                 names: List[str], seed: int) -> None:
        self.fn = fn
        self.xs = xs
        self.names = names
        self.seed = seed
        self.sizes = [x.numel() for x in xs]
        self.offsets = [0]
        for s in self.sizes:
            self.offsets.append(self.offsets[-1] + s)
        self.n = self.offsets[-1]
        self.keep: Optional[List[int]] = None
        self.complex_out: set = set()
        self.skipped: List[str] = []
        self.single_out = False
        self.out_names: List[str] = []
        self.out_shapes: List[torch.Size] = []
        self.vmap_ok: Optional[bool] = None
        self.vjp_batch_ok: Optional[bool] = None
        self.jvp_batch_ok: Optional[bool] = None
        self.batch_rows: Dict[str, int] = {}
        self.evaluations = 0
        self.colours: Optional[int] = None
        self.cuda_gens = [torch.cuda.default_generators[i] for i in _devices(xs)]

    # The RNG is reseeded before every evaluation, so dropout and friends draw the same
    # numbers in every perturbed call as in the analytic one (states are restored by
    # fork_rng around the whole check).
    def call(self, xs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        torch.default_generator.manual_seed(self.seed)
        for gen in self.cuda_gens:
            gen.manual_seed(self.seed)
        out = self.fn(xs)
        if self.keep is not None and self.single_out and isinstance(out, torch.Tensor):
            return [torch.stack((out.real, out.imag), -1) if self.complex_out else out]
        leaves, spec = pytree.tree_flatten(out)
        if self.keep is None:
            self._learn_outputs(leaves, spec)
            self.single_out = isinstance(out, torch.Tensor)
        return [torch.stack((leaves[i].real, leaves[i].imag), -1) if i in self.complex_out
                else leaves[i] for i in self.keep]

    def _learn_outputs(self, leaves: List[Any], spec: Any) -> None:
        keep = []
        paths = _leaf_names(spec, "output")
        if not leaves:
            raise GraddbgError("gradcheck: the function returned no tensor; it must return a "
                               "tensor or a tuple/list/dict of tensors")
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                raise GraddbgError(
                    f"gradcheck: the function's output {paths[i]} is a {type(leaf).__name__}, "
                    f"not a tensor; return tensors (or tuples/lists/dicts of tensors) only")
            if leaf.is_complex():
                # checked as its real and imaginary parts (a trailing dimension of 2)
                self.complex_out.add(i)
            if leaf.is_floating_point() or leaf.is_complex():
                keep.append(i)
        if not keep:
            raise GraddbgError("gradcheck: the function has no floating-point output to "
                               "differentiate (outputs: " +
                               ", ".join(f"{paths[i]}: {leaves[i].dtype}" for i in range(len(leaves))) + ")")
        # like torch.autograd.gradcheck, outputs that do not require grad (returned
        # statistics, masks) are not checked, unless no output requires grad
        if torch.is_grad_enabled():
            diff = [i for i in keep if leaves[i].requires_grad]
            if diff and len(diff) < len(keep):
                self.skipped = [paths[i] for i in keep if i not in diff]
                keep = diff
        self.keep = keep
        self.out_names = [paths[i] for i in keep]
        self.out_shapes = [leaves[i].shape + ((2,) if i in self.complex_out else ())
                           for i in keep]
        self.out_sizes = [math.prod(s) for s in self.out_shapes]
        self.out_offsets = [0]
        for s in self.out_sizes:
            self.out_offsets.append(self.out_offsets[-1] + s)
        self.m = self.out_offsets[-1]

    def split(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """(k, N) -> per input (k, *shape)."""
        k = flat.shape[0]
        return [flat[:, a:b].reshape(k, *x.shape)
                for a, b, x in zip(self.offsets[:-1], self.offsets[1:], self.xs)]

    def locate_input(self, j: int) -> Tuple[int, Tuple[int, ...]]:
        b = _bucket(self.offsets, j)
        return b, _unravel(j - self.offsets[b], self.xs[b].shape)

    def locate_output(self, i: int) -> Tuple[int, Tuple[int, ...]]:
        o = _bucket(self.out_offsets, i)
        return o, _unravel(i - self.out_offsets[o], self.out_shapes[o])


def _bucket(offsets: List[int], j: int) -> int:
    lo, hi = 0, len(offsets) - 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if offsets[mid] <= j:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _unravel(j: int, shape: Sequence[int]) -> Tuple[int, ...]:
    idx = []
    for s in reversed(list(shape)):
        idx.append(j % s)
        j //= s
    return tuple(reversed(idx))


def _leaf_names(spec: Any, root: str) -> List[str]:
    """Readable names of the leaves of a pytree: root, root[0], root['a'][1], ..."""
    names: List[str] = []

    def walk(s: Any, prefix: str) -> None:
        if s.is_leaf():
            names.append(prefix)
            return
        ctx = s.context
        kids = s.children() if hasattr(s, "children") else s.children_specs
        if isinstance(ctx, (list, tuple)) and len(ctx) == len(kids) and s.type is dict:
            keys = [f"[{k!r}]" for k in ctx]
        else:
            keys = [f"[{i}]" for i in range(len(kids))]
        for key, kid in zip(keys, kids):
            walk(kid, prefix + key)

    walk(spec, root)
    return names


def _flat(tensors: Sequence[torch.Tensor], k: int) -> torch.Tensor:
    if len(tensors) == 1:
        return tensors[0].reshape(k, -1)
    return torch.cat([t.reshape(k, -1) for t in tensors], dim=1)


# --------------------------------------------------------------------------- evaluation


def _rows(t: _Target, attr: str, k: int, batched: Callable[[int, int], torch.Tensor],
          single: Callable[[int], torch.Tensor],
          out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows 0..k-1 of some result (written into ``out`` when given): batched (vmap, at
    most ``_VMAP_ROWS`` rows a call) when that works and pays off, else one at a time.
    The first large request times one looped row against (warm) batches of ``_RACE`` and
    of ``_SMALL_BATCH`` rows and keeps the cheapest per row: vmap falls back to slow
    per-sample loops for ops without batching rules, and some batching rules cost more
    than linearly in the batch size (``slice_scatter``'s backward: several times more
    per row at 32 rows than at 4)."""
    blocks: List[torch.Tensor] = []

    def emit(r0: int, block: torch.Tensor) -> None:
        if out is None:
            blocks.append(block)
        else:
            out[r0:r0 + block.shape[0]] = block

    def loop(r0: int) -> None:
        for r in range(r0, k):
            emit(r, single(r)[None])

    def done() -> torch.Tensor:
        return out if out is not None else torch.cat(blocks) if len(blocks) > 1 else blocks[0]

    state = getattr(t, attr)
    if state is False or k < _MIN_BATCH:
        loop(0)
        return done()
    size = t.batch_rows.get(attr, _VMAP_ROWS)

    def chunks(r0: int) -> None:
        # every call gets the same batch size (a short last chunk overlaps the one before):
        # some batching rules are traced anew for each new batch size
        for c in range(r0, k, size):
            c1 = min(k, c + size)
            lo = max(0, c1 - size) if k >= size else c
            emit(c, batched(lo, c1)[c - lo:])

    if state is None and k > 3 * _RACE + 2 * _SMALL_BATCH:
        t0 = time.perf_counter()
        emit(0, single(0)[None])
        t1 = time.perf_counter()
        try:
            emit(1, batched(1, 1 + _RACE))
        except Exception:  # noqa: BLE001 - vmap cannot run this function: loop
            setattr(t, attr, False)
            loop(1)
            return done()
        t2 = time.perf_counter()
        emit(1 + _RACE, batched(1 + _RACE, 1 + 2 * _RACE))
        t3 = time.perf_counter()
        r0 = 1 + 2 * _RACE
        emit(r0, batched(r0, r0 + _SMALL_BATCH))
        t4 = time.perf_counter()
        emit(r0 + _SMALL_BATCH, batched(r0 + _SMALL_BATCH, r0 + 2 * _SMALL_BATCH))
        t5 = time.perf_counter()
        per_row = {_RACE: (t3 - t2) / _RACE, _SMALL_BATCH: (t5 - t4) / _SMALL_BATCH}
        size = min(per_row, key=per_row.__getitem__)
        fast = per_row[size] < t1 - t0
        setattr(t, attr, fast)
        t.batch_rows[attr] = size
        r0 += 2 * _SMALL_BATCH
        if fast:
            chunks(r0)
        else:
            loop(r0)
        return done()
    try:
        chunks(0)
    except Exception:  # noqa: BLE001 - vmap cannot run this function: loop
        if state:
            raise
        setattr(t, attr, False)
        blocks.clear()
        loop(0)
        return done()
    if state is None:
        setattr(t, attr, True)
    return done()


def _eval_directions(t: _Target, d: torch.Tensor) -> torch.Tensor:
    """f(x + d_r) for every row r of d (k, N), flattened: (k, M). No autograd."""
    def batched(r0: int, r1: int) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.func.vmap(
                lambda row: _flat(t.call([x + r for x, r in zip(t.xs, _split1(t, row))]), 1)[0]
            )(d[r0:r1].clone())

    def single(r: int) -> torch.Tensor:
        return _flat(t.call([x + p for x, p in zip(t.xs, _split1(t, d[r]))]), 1)[0]

    t.evaluations += d.shape[0]
    with torch.no_grad():
        return _rows(t, "vmap_ok", d.shape[0], batched, single)


def _split1(t: _Target, row: torch.Tensor) -> List[torch.Tensor]:
    return [row[a:b].view(x.shape) for a, b, x in zip(t.offsets[:-1], t.offsets[1:], t.xs)]


def _vjp_rows(t: _Target, xs: List[torch.Tensor], ys: List[torch.Tensor],
              v: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows v (k, M) times the Jacobian: (k, N) (written into ``out`` when given)."""
    k = v.shape[0]
    pairs = [(y, v[:, a:b].reshape(k, *y.shape))
             for y, a, b in zip(ys, t.out_offsets[:-1], t.out_offsets[1:]) if y.requires_grad]
    if not pairs:
        return v.new_zeros(k, t.n) if out is None else out.zero_()
    outs = [p[0] for p in pairs]

    def assemble(grads: Sequence[Optional[torch.Tensor]], kk: int) -> torch.Tensor:
        return _flat([g if g is not None else x.new_zeros(kk, *x.shape)
                      for g, x in zip(grads, xs)], kk)

    def batched(r0: int, r1: int) -> torch.Tensor:
        # clone: a batch that is a view into a large tensor makes vmapped backwards slow
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            grads = torch.autograd.grad(outs, xs, [p[1][r0:r1].clone() for p in pairs],
                                        retain_graph=True, allow_unused=True,
                                        is_grads_batched=True)
        return assemble(grads, r1 - r0)

    def single(r: int) -> torch.Tensor:
        grads = torch.autograd.grad(outs, xs, [p[1][r] for p in pairs], retain_graph=True,
                                    allow_unused=True)
        return assemble([g if g is None else g.unsqueeze(0) for g in grads], 1)[0]

    return _rows(t, "vjp_batch_ok", k, batched, single, out)


def _jvp_cols(t: _Target, u: torch.Tensor) -> torch.Tensor:
    """The Jacobian times the directions u (k, N), by forward-mode AD: (k, M)."""
    k = u.shape[0]
    xs = [x.detach() for x in t.xs]
    if t.jvp_batch_ok is not False and k > 1:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = torch.func.vmap(
                    lambda row: _flat(torch.func.jvp(lambda *a: tuple(t.call(list(a))), tuple(xs),
                                                     tuple(_split1(t, row)))[1], 1)[0])(u)
            t.jvp_batch_ok = True
            return out.detach()           # a module's parameters make the tangents require grad
        except Exception:  # noqa: BLE001 - fall back to dual numbers in a loop
            if t.jvp_batch_ok:
                raise
            t.jvp_batch_ok = False
    import torch.autograd.forward_ad as fwAD

    cols = []
    for r in range(k):
        with fwAD.dual_level():
            duals = [fwAD.make_dual(x, p) for x, p in zip(xs, _split1(t, u[r]))]
            outs = t.call(duals)
            tans = []
            for y in outs:
                tan = fwAD.unpack_dual(y).tangent
                tans.append(torch.zeros_like(y) if tan is None else tan)
            cols.append(_flat([tt.detach().unsqueeze(0) for tt in tans], 1)[0])
    return torch.stack(cols)


def _chunk(total: int, width: int) -> int:
    return max(1, min(total, _BUDGET // max(width, 1)))


# --------------------------------------------------------------------------- full mode


def _screened_columns(t: _Target, opts: _Options, ana: torch.Tensor, c0: int, c1: int,
                      f0: torch.Tensor, widen: Optional[float], col: "_Collector"
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Numerical Jacobian columns c0..c1 (M, k) and the columns still to compare.

    Forward differences (one evaluation per column) clear the columns whose every entry
    is within half the tolerance of the analytic value (their errors enter the
    statistics here); every other column is recomputed with central differences, which
    decide every reported mismatch. This halves the function evaluations of full mode,
    at no cost in what is reported."""
    x0 = t.xs[0]
    k = c1 - c0
    idx = torch.arange(k, device=x0.device)
    d = x0.new_zeros(k, t.n)
    d[idx, idx + c0] = opts.eps
    fp = _eval_directions(t, d)                           # (k, M)
    num = torch.sub(fp, f0).div_(opts.eps).T
    err = torch.sub(ana, num).abs_()
    n_abs = num.abs()
    half = n_abs * (0.5 * opts.rtol) + (0.5 * opts.atol + (0.5 * widen if widen else 0.0))
    cleared = (err <= half).all(0)
    suspect = (~cleared).nonzero().flatten()
    if err.numel() and bool(cleared.any()):
        e, n = err[:, cleared], n_abs[:, cleared]
        col.max_abs = max(col.max_abs, float(e.max()))
        col.max_rel = max(col.max_rel, float((e / n.clamp_min_(max(opts.atol, 1e-300))).max()))
        col.n_compared += e.numel()
    if suspect.numel():
        d = x0.new_zeros(suspect.numel(), t.n)
        d[torch.arange(suspect.numel(), device=x0.device), suspect + c0] = -opts.eps
        fm = _eval_directions(t, d)
        num[:, suspect] = ((fp[suspect] - fm) / (2 * opts.eps)).T
    return num, suspect


def _analytic_jacobian(t: _Target, xs: List[torch.Tensor], ys: List[torch.Tensor]) -> torch.Tensor:
    x0 = t.xs[0]
    out = x0.new_empty(t.m, t.n)
    step = _chunk(t.m, t.m + t.n)
    for r0 in range(0, t.m, step):
        r1 = min(t.m, r0 + step)
        v = x0.new_zeros(r1 - r0, t.m)
        v[torch.arange(r1 - r0, device=x0.device), torch.arange(r0, r1, device=x0.device)] = 1
        _vjp_rows(t, xs, ys, v, out[r0:r1])
    return out


class _Collector:
    """Accumulates comparison statistics and mismatch rows of one check."""

    def __init__(self, opts: _Options) -> None:
        self.opts = opts
        self.rows: List[dict] = []
        self.kink_rows: List[dict] = []
        self.kinks: List[str] = []
        self.notes: List[str] = []
        self.per_input: Dict[int, Tuple[float, float]] = {}
        self.max_abs = 0.0
        self.max_rel = 0.0
        self.n_compared = 0
        self.n_mismatched = 0
        self.nondet = False
        self.spread = 0.0

    def stats(self, abs_err: torch.Tensor, numerical: torch.Tensor) -> None:
        if abs_err.numel():
            self.max_abs = max(self.max_abs, float(abs_err.max()))
            rel = abs_err / numerical.abs().clamp_min(max(self.opts.atol, 1e-300))
            self.max_rel = max(self.max_rel, float(rel.max()))
        self.n_compared += abs_err.numel()


def _compare_full(t: _Target, a: torch.Tensor, n: torch.Tensor, col: _Collector,
                  check: str, spread: Optional[float] = None,
                  kink_fn: Optional[Callable] = None,
                  c0: Union[int, torch.Tensor] = 0) -> None:
    """Compare Jacobian columns entry by entry: a block starting at column ``c0``, or the
    columns whose global indices ``c0`` (a tensor) lists."""
    opts = col.opts
    abs_err = (a - n).abs_()
    n_abs = n.abs()
    tol = n_abs * opts.rtol + opts.atol
    if spread is not None:
        tol = tol + spread
    if abs_err.numel():
        col.max_abs = max(col.max_abs, float(abs_err.max()))
        col.max_rel = max(col.max_rel, float((abs_err / n_abs.clamp_min_(max(opts.atol, 1e-300))).max()))
    col.n_compared += abs_err.numel()
    bad = ~(abs_err <= tol)                      # NaN counts as bad ...
    nbad = int(bad.sum())
    if not nbad:
        return
    idx = bad.nonzero()
    same = a[bad] == n[bad]                      # ... unless both sides agree (inf == inf)
    if bool(same.any()):
        idx = idx[~same]
        nbad = idx.shape[0]
        if not nbad:
            return
    errs = abs_err[idx[:, 0], idx[:, 1]]
    order = torch.argsort(errs.nan_to_num(float("inf")), descending=True)[:_TABLE_ROWS]
    glob = c0.tolist() if isinstance(c0, torch.Tensor) else None
    idx = [(i, glob[j] if glob is not None else j + c0, j) for i, j in idx[order].tolist()]
    kink_info = kink_fn([j for _, j, _ in idx]) if kink_fn is not None else {}
    allowed = 0
    for i, j, jj in idx:
        b, in_idx = t.locate_input(j)
        o, out_idx = t.locate_output(i)
        av, nv = float(a[i, jj]), float(n[i, jj])
        err = abs(av - nv) if math.isfinite(av - nv) else float("inf")
        row = dict(input=t.names[b], index=in_idx, output=t.out_names[o], output_index=out_idx,
                   analytic=av, numerical=nv, abs_err=err,
                   rel_err=err / max(abs(nv), opts.atol, 1e-300), check=check, note="")
        lr = kink_info.get(j)
        if lr is not None:
            left, right = float(lr[0][i]), float(lr[1][i])
            ktol = opts.atol + opts.rtol * max(abs(left), abs(right))
            if abs(left - right) > ktol and min(left, right) - ktol <= av <= max(left, right) + ktol:
                row["note"] = "non-differentiable point"
                row["left"], row["right"] = left, right
                if opts.kinks == "allow":
                    allowed += 1
                    col.kink_rows.append(row)
                    col.kinks.append(f"{t.names[b]}{list(in_idx)} -> {t.out_names[o]}"
                                     f"{list(out_idx)}: left {left:.4g}, right {right:.4g}, "
                                     f"analytic {av:.4g}")
                    continue
        col.rows.append(row)
    col.n_mismatched += nbad - allowed


def _kink_fn(t: _Target, eps: float, f0: torch.Tensor) -> Callable:
    def one_sided(cols: List[int]) -> Dict[int, Tuple[torch.Tensor, torch.Tensor]]:
        cols = sorted(set(cols))[:256]
        x0 = t.xs[0]
        k = len(cols)
        d = x0.new_zeros(2 * k, t.n)
        idx = torch.arange(k, device=x0.device)
        col = torch.as_tensor(cols, device=x0.device)
        d[idx, col] = eps
        d[idx + k, col] = -eps
        f = _eval_directions(t, d)
        return {c: ((f0 - f[k + r]) / eps, (f[r] - f0) / eps) for r, c in enumerate(cols)}
    return one_sided


def _run_full(t: _Target, opts: _Options, col: _Collector) -> None:
    xs = [x.detach().requires_grad_(True) for x in t.xs]
    with torch.enable_grad():
        ys = t.call(xs)
    if t.n * t.m > opts.max_entries:
        raise GraddbgError(
            f"gradcheck: the Jacobian has {t.m} x {t.n} = {t.m * t.n} entries, more than "
            f"max_entries={opts.max_entries}; use mode='fast' (random projections) or raise "
            f"max_entries")
    f0 = _flat([y.detach().unsqueeze(0) for y in ys], 1)[0]
    # the analytic Jacobian is the only full-size matrix kept; the second backward pass
    # and the numerical columns are compared chunk by chunk against it
    ana = _analytic_jacobian(t, xs, ys)
    widen = _second_backward(t, xs, ys, ana, col)
    kink = _kink_fn(t, opts.eps, f0)
    cp = _compression(t, ana, opts)
    if cp is not None:
        t.colours = cp.n_colours
        _run_compressed(cp, opts, f0, widen, kink, col)
        return
    step = _chunk(t.n, 2 * (t.n + t.m))
    for c0 in range(0, t.n, step):
        c1 = min(t.n, c0 + step)
        num, suspect = _screened_columns(t, opts, ana[:, c0:c1], c0, c1, f0, widen, col)
        if suspect.numel():
            _compare_full(t, ana[:, c0:c1][:, suspect], num[:, suspect], col, "jacobian",
                          widen, kink, suspect + c0)
        if opts.forward_ad:
            x0 = t.xs[0]
            u = x0.new_zeros(c1 - c0, t.n)
            u[torch.arange(c1 - c0, device=x0.device), torch.arange(c0, c1, device=x0.device)] = 1
            fwd = _jvp_cols(t, u).T
            _compare_full(t, fwd, num, col, "forward_ad", None, kink, c0)
            _compare_full(t, fwd, ana[:, c0:c1], col, "forward_vs_reverse", widen, None, c0)
        if len(col.rows) > _TABLE_ROWS:
            col.rows.sort(key=_row_key)
            del col.rows[_TABLE_ROWS:]


def _row_key(r: dict) -> float:
    return -r["abs_err"] if math.isfinite(r["abs_err"]) else -math.inf


def _second_backward(t: _Target, xs: List[torch.Tensor], ys: List[torch.Tensor],
                     ana: torch.Tensor, col: _Collector) -> Optional[float]:
    """Run the backward pass again and compare; on a difference ``ana`` becomes the mean
    of the two runs and the returned widening (twice the largest spread) keeps a
    nondeterministic but right backward from being reported as a wrong gradient."""
    x0 = t.xs[0]
    opts = col.opts
    # one random vector-Jacobian product first: a backward that repeats itself gives
    # v^T J up to the rounding of the product; only a difference beyond that costs a
    # second full pass, which measures the spread entry by entry
    v = _probe(torch.Generator().manual_seed(opts.seed + 2), (1, t.m), x0)
    g2 = _vjp_rows(t, xs, ys, v)
    g1 = v @ ana
    if torch.equal(g1, g2):                  # e.g. one nonzero per column: no rounding at all
        return None
    rounding = torch.zeros_like(g1)
    step = max(1, (_BUDGET // 8) // max(t.n, 1))         # |v| |J| without a full-size |J|
    for r0 in range(0, t.m, step):
        rounding.addmm_(v[:, r0:r0 + step].abs(), ana[r0:r0 + step].abs())
    rounding.mul_(1e3 * torch.finfo(ana.dtype).eps)
    if bool((((g1 - g2).abs() <= rounding) | (g1 == g2)).all()):
        return None
    step = _chunk(t.m, t.m + t.n)
    for r0 in range(0, t.m, step):
        r1 = min(t.m, r0 + step)
        v = x0.new_zeros(r1 - r0, t.m)
        v[torch.arange(r1 - r0, device=x0.device), torch.arange(r0, r1, device=x0.device)] = 1
        a2 = _vjp_rows(t, xs, ys, v)
        a1 = ana[r0:r1]
        if torch.equal(a1, a2):
            continue
        spread = (a1 - a2).abs()
        _nondet(col, spread, opts.atol + opts.rtol * a1.abs())
        a1.add_(a2).mul_(0.5)
    return 2 * col.spread if col.spread > 0 else None


def _nondet(col: _Collector, spread: torch.Tensor, tol: Any) -> None:
    if not spread.numel():
        return
    col.spread = max(col.spread, float(spread.max()))
    limit = tol if col.opts.nondet_tol is None else col.opts.nondet_tol
    if bool((spread > limit).any()):
        col.nondet = True


# --------------------------------------------------------------------------- compression
#
# A sparse Jacobian is checked with fewer evaluations by Curtis-Powell-Reid column
# compression: columns that share no row in the analytic Jacobian's sparsity pattern get
# one colour and are perturbed together, ``u_g = sum_j r_j e_j`` over the colour's
# columns with seeded random weights ``r_j`` in [0.5, 1]. In every row the analytic
# pattern names at most one column ``j*`` of the colour, so ``(J_num u_g)_i / r_j*`` is the
# numerical entry ``(i, j*)``, compared with the analytic one under the same tolerance as
# a single column; a row with no column of the colour must come out zero. Every other
# entry of the colour's columns in that row enters the same sum: a wrong entry anywhere
# shows up unless wrong entries of one row and colour cancel, to within the tolerance,
# for the drawn weights. A colour that does not clear is split in halves until the
# groups are small, and those columns are recomputed one by one, so every reported
# entry is an exact per-column central difference.

_COMPRESS_MIN = 128        # columns below which compression is not tried
_COMPRESS_GAIN = 4         # compress only with at most n / _COMPRESS_GAIN colours
_COLOUR_NNZ = 1 << 22      # nonzeros above which a general pattern is not coloured
_LEAF = 16                 # groups of at most this many columns are refined column by column
_REDRAW = 16               # with at most this many colours, a second weight draw


def _colour_columns(rows: torch.Tensor, cols: torch.Tensor, m: int, n: int,
                    limit: int) -> Optional[Tuple[torch.Tensor, int]]:
    """Colour the columns so that columns of one colour share no row of the pattern given
    by its nonzeros ``(rows, cols)`` (row-major order); None when more than ``limit``
    colours would be needed (or the pattern has more than ``_COLOUR_NNZ`` nonzeros and
    columns in several rows). Columns without nonzeros get colour 0."""
    dev = rows.device
    colour = torch.zeros(n, dtype=torch.long, device=dev)
    if not rows.numel():
        return colour, 1
    row_deg = torch.bincount(rows, minlength=m)
    col_deg = torch.bincount(cols, minlength=n)
    if int(row_deg.max()) > limit:
        return None
    if int(col_deg.max()) <= 1:
        # every column in at most one row: its rank within that row is an optimal colouring
        starts = torch.cumsum(row_deg, 0) - row_deg
        colour[cols] = torch.arange(rows.numel(), device=dev) - starts[rows]
        return colour, int(row_deg.max())
    if rows.numel() > _COLOUR_NNZ:
        return None
    # general pattern: sequential greedy (each column takes the lowest colour that no
    # column sharing one of its rows has), with one Python int bit mask of used colours
    # per row: about two cheap Python operations per nonzero
    order = torch.argsort(cols, stable=True)
    in_rows = rows[order].tolist()
    counts = col_deg.tolist()
    masks = [0] * m
    out = [0] * n
    pos = 0
    for j, c in enumerate(counts):
        if not c:
            continue
        rs = in_rows[pos:pos + c]
        pos += c
        used = 0
        for r in rs:
            used |= masks[r]
        colour_j = (~used & (used + 1)).bit_length() - 1
        if colour_j >= limit:
            return None
        bit = 1 << colour_j
        for r in rs:
            masks[r] |= bit
        out[j] = colour_j
    colour = torch.tensor(out, dtype=torch.long, device=dev)
    return colour, int(colour.max()) + 1


class _Compressed:
    """The sparsity pattern of the analytic Jacobian and a column colouring of it."""

    def __init__(self, t: _Target, ana: torch.Tensor, colour: torch.Tensor, n_colours: int,
                 rows: torch.Tensor, cols: torch.Tensor) -> None:
        self.t = t
        self.ana = ana
        self.colour = colour
        self.n_colours = n_colours
        self.rows = rows
        self.cols = cols

    def members(self) -> List[torch.Tensor]:
        order = torch.argsort(self.colour, stable=True)
        counts = torch.bincount(self.colour, minlength=self.n_colours).tolist()
        return [g for g in torch.split(order, counts) if g.numel()]

    def check(self, groups: List[torch.Tensor], weights: torch.Tensor, opts: _Options,
              f0: Optional[torch.Tensor], widen: Optional[float], col: "_Collector",
              central: bool) -> List[bool]:
        """Perturb each group's columns together (weights ``weights``); compare every row
        with the analytic entry of the group's column in that row. Returns, per group,
        whether it failed; the error statistics of the groups that passed are recorded.
        With ``central=False`` it is the forward-difference screen at half the tolerance."""
        t, ana = self.t, self.ana
        x0 = t.xs[0]
        failed: List[bool] = []
        step = _chunk(len(groups), t.n + 4 * t.m)
        for g0 in range(0, len(groups), step):
            chunk = groups[g0:g0 + step]
            k = len(chunk)
            gid = torch.full((t.n,), -1, dtype=torch.long, device=x0.device)
            for g, cols in enumerate(chunk):
                gid[cols] = g
            d = x0.new_zeros(k, t.n)
            member = gid >= 0
            idx = member.nonzero().flatten()
            d[gid[idx], idx] = opts.eps * weights[idx]
            fp = _eval_directions(t, d)
            if central:
                nd = (fp - _eval_directions(t, -d)).div_(2 * opts.eps)
            else:
                nd = (fp - f0).div_(opts.eps)
            # the one column of each group in each row (if any), by the analytic pattern
            sel = gid[self.cols] >= 0
            owner = torch.full((k * t.m,), -1, dtype=torch.long, device=x0.device)
            owner[gid[self.cols[sel]] * t.m + self.rows[sel]] = self.cols[sel]
            owner = owner.view(k, t.m)
            has = owner >= 0
            own = owner.clamp_min(0)
            a_est = torch.where(has, ana[torch.arange(t.m, device=x0.device)[None, :], own], 0.0)
            n_est = nd / torch.where(has, weights[own], 1.0)
            err = (a_est - n_est).abs_()
            n_abs = n_est.abs()
            scale = 1.0 if central else 0.5
            tol = n_abs * (scale * opts.rtol) + scale * (opts.atol + (widen or 0.0))
            bad = (~(err <= tol) & ~(a_est == n_est)).any(1)
            good = ~bad
            if bool(good.any()):
                e, na = err[good], n_abs[good]
                if e.numel():
                    col.max_abs = max(col.max_abs, float(e.max()))
                    col.max_rel = max(col.max_rel, float((e / na.clamp_min(max(opts.atol, 1e-300))).max()))
            failed.extend(bad.tolist())
        return failed


def _compression(t: _Target, ana: torch.Tensor, opts: _Options) -> Optional[_Compressed]:
    """A colouring of the analytic Jacobian's columns when it cuts the evaluations
    enough (at least ``_COMPRESS_MIN`` columns, at most n / ``_COMPRESS_GAIN`` colours);
    else None (and the columns are checked one by one)."""
    if not opts.compress or opts.forward_ad or t.n < _COMPRESS_MIN or not t.m:
        return None
    limit = t.n // _COMPRESS_GAIN
    # a sample of rows first, so that a dense Jacobian costs no index list
    sample = ana[torch.linspace(0, t.m - 1, min(t.m, 64), device=ana.device).long()]
    if int(torch.count_nonzero(sample, dim=1).max()) > limit:
        return None
    rows, cols = ana.nonzero().unbind(1)                 # NaN counts as a nonzero
    coloured = _colour_columns(rows, cols, t.m, t.n, limit)
    if coloured is None or coloured[1] * t.m > (1 << 25):
        return None
    return _Compressed(t, ana, coloured[0], coloured[1], rows, cols)


def _run_compressed(cp: _Compressed, opts: _Options, f0: torch.Tensor, widen: Optional[float],
                    kink: Callable, col: "_Collector") -> None:
    """Full mode on a compressed Jacobian: every colour is screened with a forward
    difference (half the tolerance), a colour that does not clear is recomputed with
    central differences, and one that still fails is bisected and its small groups
    compared column by column. With few colours every colour is checked under two
    independent weight draws."""
    t = cp.t
    x0 = t.xs[0]
    gen = torch.Generator().manual_seed(opts.seed + 4)

    def draw() -> torch.Tensor:
        r = 0.5 + 0.5 * torch.rand(t.n, generator=gen, dtype=torch.float64)
        return r.to(x0.device, x0.dtype)

    pending = cp.members()
    refine: List[torch.Tensor] = []
    for _ in range(2 if len(pending) <= _REDRAW else 1):
        weights = draw()
        screened = cp.check(pending, weights, opts, f0, widen, col, central=False)
        suspect = [g for g, bad in zip(pending, screened) if bad]
        failed = cp.check(suspect, weights, opts, f0, widen, col, central=True) if suspect else []
        refine += [g for g, bad in zip(suspect, failed) if bad]
        pending = [g for g, bad in zip(pending, screened) if not bad] + \
                  [g for g, bad in zip(suspect, failed) if not bad]
    # bisect the failing colours down to small groups, then compare column by column
    leaves: List[torch.Tensor] = []
    while refine:
        halves: List[torch.Tensor] = []
        for g in refine:
            if g.numel() <= _LEAF:
                leaves.append(g)
            else:
                h = g.numel() // 2
                halves += [g[:h], g[h:]]
        if not halves:
            break
        failed = cp.check(halves, draw(), opts, f0, widen, col, central=True)
        refine = [g for g, bad in zip(halves, failed) if bad]
    n_leaf = sum(int(g.numel()) for g in leaves)
    col.n_compared += t.m * (t.n - n_leaf)   # the leaves are counted entry by entry below
    if leaves:
        cols = torch.sort(torch.cat(leaves)).values
        step = _chunk(cols.numel(), 2 * (t.n + t.m))
        for s in range(0, cols.numel(), step):
            cc = cols[s:s + step]
            num = _central_columns(t, opts, cc)
            _compare_full(t, cp.ana[:, cc], num, col, "jacobian", widen, kink, cc)
            if len(col.rows) > _TABLE_ROWS:
                col.rows.sort(key=_row_key)
                del col.rows[_TABLE_ROWS:]


def _central_columns(t: _Target, opts: _Options, cols: torch.Tensor) -> torch.Tensor:
    """Central differences of the columns ``cols``: (M, k)."""
    x0 = t.xs[0]
    k = cols.numel()
    d = x0.new_zeros(k, t.n)
    d[torch.arange(k, device=x0.device), cols] = opts.eps
    f = _eval_directions(t, torch.cat([d, -d]))
    return ((f[:k] - f[k:]) / (2 * opts.eps)).T


# --------------------------------------------------------------------------- fast mode


def _gauss(gen: torch.Generator, shape: Tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """Gaussian draws (for the second-order grad_outputs)."""
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(like.device, like.dtype)


def _probe(gen: torch.Generator, shape: Tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """Zero-mean probe entries, uniform on [-1, 1) (cheaper to draw than Gaussians), drawn
    on the CPU so that a seed gives the same probes on every device."""
    return (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1).to(like.device, like.dtype)


def _run_fast(t: _Target, opts: _Options, col: _Collector) -> Dict[int, int]:
    """Projection check; returns {input: number of failed projections}."""
    k = opts.probes
    gen = torch.Generator().manual_seed(opts.seed)
    x0 = t.xs[0]
    nb = len(t.xs)
    xs = [x.detach().requires_grad_(True) for x in t.xs]
    with torch.enable_grad():
        ys = t.call(xs)
    # probes u: k per input, supported on that input only; v: k over all outputs
    u = x0.new_zeros(k * nb, t.n)
    for b in range(nb):
        u[b * k:(b + 1) * k, t.offsets[b]:t.offsets[b + 1]] = _probe(gen, (k, t.sizes[b]), x0)
    v = _probe(gen, (k, t.m), x0)
    f = _eval_directions(t, torch.cat([opts.eps * u, -opts.eps * u]))
    fp, fm = f[:k * nb], f[k * nb:]
    d = (fp - fm) / (2 * opts.eps)                       # (k*nb, M) numerical J u
    noise_el = (fp.abs() + fm.abs()) * (_NOISE * torch.finfo(x0.dtype).eps / (2 * opts.eps))
    # v^T J for every probe v, and the first once more (backward again: nondeterminism)
    g12 = _vjp_rows(t, xs, ys, torch.cat([v, v[:1]]))
    g1 = g12[:k]                                          # (k, N) analytic v^T J
    failing: Dict[int, int] = {}
    vv = v * v
    # every (probe v_l, probe u_c) pair at once; column c = b * k + kk belongs to input b
    a1 = g1 @ u.T                                        # (k, k*nb) analytic v^T J u
    num = v @ d.T                                        # numerical v^T (J u)
    u2 = u * u
    m_a = ((g1 * g1) @ u2.T).sqrt_()                     # typical size of the sum a1
    # typical size of the numerical sum, and the rounding in f(x +- eps u): one product
    m_n, noise = (vv @ torch.cat([d * d, noise_el * noise_el]).T).sqrt_().split(k * nb, 1)
    scale = torch.maximum(m_a, m_n)
    tol = torch.outer(vv.sum(1), u2.sum(1)).sqrt_().mul_(opts.atol)
    tol += opts.rtol * scale + noise
    ana = a1
    if not torch.equal(g1[:1], g12[k:]):
        g2 = g1.clone()
        g2[:1] = g12[k:]
        a2 = g2 @ u.T
        sp = (a1 - a2).abs()
        _nondet(col, sp, tol)
        ana = (a1 + a2) / 2
        tol = tol + 2 * sp.max()
    abs_err = (ana - num).abs()
    col.n_compared += abs_err.numel()
    bad_all = ~(abs_err <= tol)
    # per input: max abs err, max rel err, any projection over tolerance (one readback)
    per = torch.stack([abs_err, abs_err / scale.clamp_min(1e-300), bad_all.to(abs_err.dtype)])
    per_abs, per_rel, per_bad = per.view(3, k, nb, k).amax((1, 3)).tolist()
    for b in range(nb):
        col.per_input[b] = (per_abs[b], per_rel[b])
    if not any(per_bad):
        bad_inputs: List[int] = []
    else:
        bad_inputs = sorted({int(c) // k for c in bad_all.nonzero()[:, 1]})
    for b in bad_inputs:
        cols = slice(b * k, (b + 1) * k)
        bad = bad_all[:, cols] & ~(ana[:, cols] == num[:, cols])
        if not bool(bad.any()):
            continue
        ana_b, num_b, tol_b, err_b, scale_b = (ana[:, cols], num[:, cols], tol[:, cols],
                                                abs_err[:, cols], scale[:, cols])
        # confirm against a second step size: a real mismatch does not move with eps
        ks = sorted({int(kk) for kk in bad.nonzero()[:, 1]})
        uu = u[[b * k + kk for kk in ks]]
        f2 = _eval_directions(t, torch.cat([2 * opts.eps * uu, -2 * opts.eps * uu]))
        d2 = (f2[:len(ks)] - f2[len(ks):]) / (4 * opts.eps)
        num2 = v @ d2.T
        fd_err = (num2 - num_b[:, ks]).abs()
        confirmed = ~(err_b[:, ks] <= tol_b[:, ks] + 2 * fd_err) & ~(ana_b[:, ks] == num_b[:, ks])
        nconf = int(confirmed.sum())
        if not nconf:
            col.notes.append(f"fast-mode projections of {t.names[b]} disagreed by up to "
                             f"{float(err_b[bad].max()):.3g} but moved with eps (finite-"
                             f"difference error, not a wrong gradient); mode='full' checks entries")
            continue
        failing[b] = failing.get(b, 0) + nconf
        for (l, kk) in confirmed.nonzero().tolist():
            c = ks[kk]
            av, nv = float(ana_b[l, c]), float(num_b[l, c])
            err = abs(av - nv)
            col.rows.append(dict(input=t.names[b], index=(l, c), output="v^T J u",
                                 output_index=(), analytic=av, numerical=nv, abs_err=err,
                                 rel_err=err / max(float(scale_b[l, c]), 1e-300),
                                 check="projection", note=f"probe v{l}, u{c}"))
    if opts.forward_ad:
        jf = _jvp_cols(t, u)                             # (k*nb, M)
        for b in range(nb):
            sl = slice(t.offsets[b], t.offsets[b + 1])
            ub = u[b * k:(b + 1) * k, sl]
            fw = v @ jf[b * k:(b + 1) * k].T
            num = v @ d[b * k:(b + 1) * k].T
            m = (vv @ (jf[b * k:(b + 1) * k] ** 2).T).sqrt()
            noise = (vv @ (noise_el[b * k:(b + 1) * k] ** 2).T).sqrt()
            tol = opts.atol * ub.norm(dim=1)[None, :] * v.norm(dim=1)[:, None] + opts.rtol * m + noise
            for other, name in ((num, "forward_ad"), (g1[:, sl] @ ub.T, "forward_vs_reverse")):
                err = (fw - other).abs()
                bad = (err > tol) | (~torch.isfinite(err) & (fw != other))
                col.n_compared += err.numel()
                if bool(bad.any()):
                    failing[b] = failing.get(b, 0) + int(bad.sum())
                    for (l, c) in bad.nonzero().tolist():
                        col.rows.append(dict(input=t.names[b], index=(l, c), output="v^T J u",
                                             output_index=(), analytic=float(fw[l, c]),
                                             numerical=float(other[l, c]),
                                             abs_err=float(err[l, c]),
                                             rel_err=float(err[l, c] / m[l, c].clamp_min(1e-300)),
                                             check=name, note=f"probe v{l}, u{c}"))
    return failing


# --------------------------------------------------------------------------- driver


def _check_target(t: _Target, opts: _Options, dtype: torch.dtype) -> GradcheckResult:
    col = _Collector(opts)
    localised = None
    evaluations = 0
    if opts.mode == "full":
        _run_full(t, opts, col)
    else:
        failing = _run_fast(t, opts, col)
        col.n_mismatched = sum(failing.values())
        small = [b for b in failing if t.sizes[b] * t.m <= opts.localise_entries]
        for b, (mx_abs, mx_rel) in col.per_input.items():
            if b not in small:
                col.max_abs, col.max_rel = max(col.max_abs, mx_abs), max(col.max_rel, mx_rel)
        if small:
            # say where: full mode on each failing input, the others held fixed
            col2 = _Collector(opts)
            for b in small:
                sub = _sub_target(t, b)
                _run_full(sub, opts, col2)
                evaluations += sub.evaluations
            localised = ", ".join(t.names[b] for b in small)
            col.rows = [r for r in col.rows if r["input"] not in {t.names[b] for b in small}]
            col.n_mismatched = sum(c for b, c in failing.items() if b not in small) + col2.n_mismatched
            col.rows = col2.rows + col.rows
            col.kink_rows += col2.kink_rows
            col.kinks += col2.kinks
            col.nondet |= col2.nondet
            col.spread = max(col.spread, col2.spread)
            col.max_abs = max(col.max_abs, col2.max_abs)
            col.max_rel = max(col.max_rel, col2.max_rel)
            col.n_compared += col2.n_compared
            if not col2.rows and col2.n_mismatched == 0:
                col.notes.append(f"fast-mode projections of {localised} disagreed, but full mode "
                                 f"found every Jacobian entry within tolerance")
    if t.skipped:
        col.notes.append(f"not checked (outputs that do not require grad): {', '.join(t.skipped)}")
    rows = sorted(col.rows, key=_row_key)
    rows += col.kink_rows
    ok = not col.rows and not col.nondet and col.n_mismatched == 0
    return GradcheckResult(
        ok=ok, mode=opts.mode, eps=opts.eps, atol=opts.atol, rtol=opts.rtol, dtype=dtype,
        max_abs_err=col.max_abs, max_rel_err=col.max_rel, n_compared=col.n_compared,
        n_mismatched=col.n_mismatched, nondeterministic=col.nondet,
        nondet_spread=col.spread, nondet_tol=opts.nondet_tol, kinks=col.kinks,
        notes=col.notes, localised=localised, rows=rows[:_TABLE_ROWS],
        n_evaluations=t.evaluations + evaluations, colours=t.colours)


def _sub_target(t: _Target, b: int) -> _Target:
    """The same function as a function of input b only."""
    def fn(xs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        full = list(t.xs)
        full[b] = xs[0]
        return t.call(full)

    sub = _Target(fn, [t.xs[b]], [t.names[b]], t.seed)
    with torch.no_grad():
        sub.call([t.xs[b].detach()])
    sub.out_names, sub.out_shapes = t.out_names, t.out_shapes
    return sub


def _second_order_target(t: _Target, seed: int) -> _Target:
    """(x..., v...) -> v^T dJ/dx: gradients of the outputs, as a function to check."""
    gen = torch.Generator().manual_seed(seed + 1)
    x0 = t.xs[0]
    vs = [_gauss(gen, tuple(s), x0) for s in t.out_shapes]
    nb = len(t.xs)

    def fn(args: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        xs, gos = list(args[:nb]), list(args[nb:])
        with torch.enable_grad():
            # clone(), not detach(): a forward-mode tangent on x must survive
            xs = [x if x.requires_grad else x.clone().requires_grad_(True) for x in xs]
            ys = t.call(xs)
            pairs = [(y, g) for y, g in zip(ys, gos) if y.requires_grad]
            if not pairs:
                return [torch.zeros_like(x) for x in xs]
            grads = torch.autograd.grad([p[0] for p in pairs], xs, [p[1] for p in pairs],
                                        create_graph=True, allow_unused=True)
        return [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, xs)]

    names = t.names + [f"grad_{name}" for name in t.out_names]
    return _Target(fn, list(t.xs) + vs, names, t.seed)


def _merge_second(first: GradcheckResult, second: GradcheckResult) -> GradcheckResult:
    for row in second.rows:
        row["check"] = "second_order" + ("" if row["check"] == "jacobian" else f"_{row['check']}")
    first.rows = sorted([r for r in first.rows if r["note"] != "non-differentiable point"]
                        + [r for r in second.rows if r["note"] != "non-differentiable point"],
                        key=lambda r: -r["abs_err"] if math.isfinite(r["abs_err"]) else -math.inf) \
        + [r for r in first.rows + second.rows if r["note"] == "non-differentiable point"]
    first.rows = first.rows[:_TABLE_ROWS]
    first._table = None
    first.ok = first.ok and second.ok
    first.n_compared += second.n_compared
    first.n_mismatched += second.n_mismatched
    first.n_evaluations += second.n_evaluations
    first.max_abs_err = max(first.max_abs_err, second.max_abs_err)
    first.max_rel_err = max(first.max_rel_err, second.max_rel_err)
    first.nondeterministic |= second.nondeterministic
    first.nondet_spread = max(first.nondet_spread, second.nondet_spread)
    first.kinks += [f"(second order) {k}" for k in second.kinks]
    if second.localised:
        first.localised = ", ".join(filter(None, [first.localised,
                                                   f"second order: {second.localised}"]))
    first.notes += [f"second order: {n}" for n in second.notes]
    if not second.ok:
        first.notes.append(f"second-order check (gradients of gradients) FAILED: "
                           f"{second.n_mismatched} mismatches, max abs err {second.max_abs_err:.3g}")
    return first


# --------------------------------------------------------------------------- inputs


def _prepare(inputs: Tuple[Any, ...], dtype: Optional[torch.dtype],
             select: Callable[[str, torch.Tensor], bool]) -> Tuple[List[Any], Any, List[int], List[str], List[torch.Tensor]]:
    """Copy the leaves of the inputs (floating tensors to ``dtype``); pick differentiable ones."""
    leaves, spec = pytree.tree_flatten(inputs)
    names = _leaf_names(spec, "input")
    names = [n.replace("input[", "input", 1).replace("]", "", 1) if n.startswith("input[") else n
             for n in names]
    new_leaves: List[Any] = []
    diff_pos: List[int] = []
    diff_names: List[str] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if leaf.is_complex() and (leaf.requires_grad or select(names[i], leaf)):
                raise NotImplementedError(
                    f"gradcheck: {names[i]} is complex ({leaf.dtype}); complex inputs are not "
                    f"supported yet: pass torch.view_as_real(x) and rebuild it inside the "
                    f"function with torch.view_as_complex")
            if leaf.layout != torch.strided:
                raise NotImplementedError(f"gradcheck: {names[i]} has layout {leaf.layout}; only "
                                          f"dense (strided) tensors are supported")
            if leaf.is_floating_point():
                copy_ = leaf.detach().to(dtype=dtype or leaf.dtype, copy=True)
                if select(names[i], leaf):
                    diff_pos.append(i)
                    diff_names.append(names[i])
                new_leaves.append(copy_)
                continue
        new_leaves.append(leaf)
    return new_leaves, spec, diff_pos, diff_names, [new_leaves[i] for i in diff_pos]


def _warn_precision(xs: Sequence[torch.Tensor], names: Sequence[str]) -> None:
    low = sorted({str(x.dtype).replace("torch.", "") for x in xs if x.dtype != torch.float64})
    if low:
        warnings.warn(
            f"gradcheck runs in {', '.join(low)}: finite differences in less than float64 "
            f"are too noisy to trust small errors; leave dtype=torch.float64 (the default)",
            PrecisionWarning, stacklevel=3)


def _check_dtype(dtype: Optional[torch.dtype]) -> None:
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise GraddbgError(f"gradcheck: dtype={dtype!r} must be a floating-point torch.dtype "
                           f"(default torch.float64) or None (check in the dtypes given)")


def _devices(xs: Sequence[torch.Tensor]) -> List[int]:
    return sorted({x.device.index or 0 for x in xs if x.device.type == "cuda"})


def _run(t: _Target, opts: _Options, dtype: torch.dtype) -> GradcheckResult:
    with torch.random.fork_rng(devices=_devices(t.xs)):
        result = _check_target(t, opts, dtype)
        if opts.second_order:
            t2 = _second_order_target(t, opts.seed)
            result = _merge_second(result, _check_target(t2, opts, dtype))
    return result


def gradcheck(fn: Callable[..., Any], *inputs: Any, mode: str = "full",
              eps: Optional[float] = None, atol: Optional[float] = None,
              rtol: Optional[float] = None, forward_ad: bool = False,
              second_order: bool = False, nondet_tol: Optional[float] = None,
              dtype: Optional[torch.dtype] = torch.float64, kinks: str = "allow",
              seed: int = 0, probes: int = 2, max_entries: int = 2 ** 27,
              localise_entries: int = 1_000_000, compress: bool = True) -> GradcheckResult:
    """Compare the derivatives of ``fn`` at ``inputs`` with central finite differences.

    Differentiable inputs are the floating-point tensors with ``requires_grad=True``,
    anywhere in ``inputs`` (nested tuples, lists, dicts); every other argument passes
    through. ``fn`` may return a tensor or tuples/lists/dicts of tensors (integer outputs
    are ignored). Inputs are checked on float64 copies (``dtype=None`` keeps their dtype;
    anything below float64 emits a ``PrecisionWarning``); ``eps``/``atol``/``rtol`` default
    from ``TOLERANCES``. ``mode="full"`` checks every Jacobian entry (``max_entries``
    bounds its size; a sparse one is checked colour group by colour group, see below);
    ``mode="fast"`` checks ``probes`` random projections per input
    and, on a failure, re-runs full mode on inputs with at most ``localise_entries``
    Jacobian entries. Use full mode for functions up to a few thousand elements and to
    find single wrong entries; fast mode for anything larger (it finds scaled, dropped
    and transposed gradients at any size). ``forward_ad=True`` also checks forward mode
    (jvp); ``second_order=True`` checks gradients of gradients. The backward pass runs
    twice: a difference beyond ``nondet_tol`` (default: the comparison tolerance) is
    reported as nondeterminism. Entries whose one-sided differences disagree, with the
    analytic value being one of them, are listed as non-differentiable points and do not
    fail the check unless ``kinks="fail"``. An ``nn.Module`` as ``fn`` is checked by
    :func:`check_module` (parameters and floating-point inputs).

    Compression (full mode, ``compress=True``, not with ``forward_ad``): when the
    analytic Jacobian has at least 128 columns and a column colouring of its nonzero
    pattern needs at most a quarter as many colours as columns, columns that share no
    row are perturbed together with random weights in [0.5, 1] and each row of the
    difference is compared, under the entry tolerance, with the analytic entry of the
    colour's one column in that row (or with zero). Each entry of the Jacobian is in
    exactly one such comparison, so a wrong entry (also a wrong zero, as from a wrong
    permutation or a forgotten term) fails its colour; a failing colour is bisected and
    its columns are recomputed one by one, so the table holds the exact entries, worst
    first, as without compression. It cuts the evaluations from one or two per input
    element to one or two per colour (forward-difference screen, central differences
    where it does not clear): 2 in all for ``sort``, ``slice_scatter`` or elementwise
    ops (one colour, two weight draws).
    ``result.colours`` is the number of colours (None when not used).

    >>> import torch
    >>> x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    >>> bool(gradcheck(lambda t: t.exp().sum(), x))
    True
    >>> gradcheck(torch.sin, x, mode="fast").ok
    True
    >>> s = torch.randperm(500, dtype=torch.float64).requires_grad_()   # no near-ties
    >>> r = gradcheck(lambda t: t.sort().values, s)      # 500 columns in 1 colour group
    >>> r.ok, r.colours, r.n_evaluations, r.n_compared
    (True, 1, 2, 250000)
    """
    if isinstance(fn, torch.nn.Module):
        return check_module(fn, *inputs, mode=mode, eps=eps, atol=atol, rtol=rtol,
                            forward_ad=forward_ad, second_order=second_order,
                            nondet_tol=nondet_tol, dtype=dtype, kinks=kinks, seed=seed,
                            probes=probes, max_entries=max_entries,
                            localise_entries=localise_entries, compress=compress)
    if not callable(fn):
        raise GraddbgError(f"gradcheck: fn must be callable, got {type(fn).__name__}")
    _check_dtype(dtype)
    leaves, spec, pos, names, xs = _prepare(inputs, dtype, lambda n, x: x.requires_grad)
    if not xs:
        raise GraddbgError(
            "gradcheck: no input requires grad; give at least one floating-point tensor "
            "with requires_grad=True (got " +
            (", ".join(type(v).__name__ if not isinstance(v, torch.Tensor) else
                       f"Tensor({v.dtype}, requires_grad={v.requires_grad})"
                       for v in pytree.tree_leaves(inputs)) or "no inputs") + ")")
    run_dtype = xs[0].dtype
    opts = _options(run_dtype, mode, eps, atol, rtol, nondet_tol, forward_ad, second_order,
                    kinks, seed, probes, max_entries, localise_entries, compress)
    _warn_precision(xs, names)

    flat_args = len(leaves) == len(inputs)          # no nesting: skip the pytree round trip

    def call(diff: Sequence[torch.Tensor]) -> Any:
        args = list(leaves)
        for p, x in zip(pos, diff):
            args[p] = x
        return fn(*args) if flat_args else fn(*pytree.tree_unflatten(args, spec))

    return _run(_Target(call, xs, names, seed), opts, run_dtype)


def check_module(module: torch.nn.Module, *inputs: Any,
                 wrt: Union[str, Sequence[str]] = "all", **kw: Any) -> GradcheckResult:
    """Check a module's gradients w.r.t. its parameters and/or inputs, on a copy.

    ``wrt``: ``"params"`` (parameters with ``requires_grad``), ``"inputs"`` (every
    floating-point tensor in ``inputs``), ``"all"`` (both), or a list of names
    (parameter names as ``named_parameters()`` gives them, inputs as ``input0``,
    ``input1['key']``...). The module is deep-copied and converted to float64 (``dtype``
    keyword, as in :func:`gradcheck`) and called through ``torch.func.functional_call``:
    the module and tensors passed in are never changed. Other keywords as
    :func:`gradcheck`.

    >>> import torch
    >>> lin = torch.nn.Linear(3, 2)
    >>> r = check_module(lin, torch.randn(4, 3))
    >>> r.ok, lin.weight.dtype
    (True, torch.float32)
    """
    if isinstance(module, type):
        raise GraddbgError(f"check_module: module must be an nn.Module instance, got the class "
                           f"{module.__name__}; instantiate it first ({module.__name__}(...))")
    if not isinstance(module, torch.nn.Module):
        raise GraddbgError(f"check_module: module must be a torch.nn.Module, got "
                           f"{type(module).__name__}; use gradcheck() for functions")
    dtype = kw.pop("dtype", torch.float64)
    _check_dtype(dtype)
    params = [n for n, p in module.named_parameters() if p.requires_grad]
    if isinstance(wrt, str):
        if wrt not in _WRT:
            raise GraddbgError(f"check_module: wrt={wrt!r} is not supported; use one of {_WRT} "
                               f"or a list of parameter/input names")
        want_params = set(params) if wrt in ("all", "params") else set()
        want_inputs: Optional[set] = None if wrt in ("all", "inputs") else set()
    else:
        wanted = list(wrt)
        if not all(isinstance(w, str) for w in wanted):
            raise GraddbgError(f"check_module: wrt must be 'all', 'params', 'inputs' or a list "
                               f"of names (str), got {wrt!r}")
        want_params = {w for w in wanted if w in params}
        want_inputs = {w for w in wanted if w not in params}
    leaves, spec, pos, in_names, xs_in = _prepare(
        inputs, dtype, lambda n, x: want_inputs is None or n in want_inputs)
    if want_inputs:
        unknown = sorted(want_inputs - set(in_names))
        if unknown:
            raise GraddbgError(
                f"check_module: wrt names {unknown} are neither trainable parameters nor "
                f"floating-point inputs; parameters: {params[:20]}"
                f"{' ...' if len(params) > 20 else ''}; inputs: {in_names}")
    mod = copy.deepcopy(module)
    if dtype is not None:
        mod = mod.to(dtype)
    own = dict(mod.named_parameters())
    p_names = [n for n in params if n in want_params]
    xs = [own[n].detach().clone() for n in p_names] + xs_in
    names = p_names + in_names
    if not xs:
        raise GraddbgError(
            f"check_module: nothing to check for wrt={wrt!r}: the module has no trainable "
            f"parameters selected and no floating-point input was selected")
    run_dtype = xs[0].dtype
    opts = _options(run_dtype, **_kw_options(kw))
    _warn_precision(xs, names)
    n_p = len(p_names)

    def call(diff: Sequence[torch.Tensor]) -> Any:
        args = list(leaves)
        for p, x in zip(pos, diff[n_p:]):
            args[p] = x
        return torch.func.functional_call(mod, dict(zip(p_names, diff[:n_p])),
                                          tuple(pytree.tree_unflatten(args, spec)))

    return _run(_Target(call, xs, names, opts.seed), opts, run_dtype)


def _kw_options(kw: Dict[str, Any]) -> Dict[str, Any]:
    known = dict(mode="full", eps=None, atol=None, rtol=None, nondet_tol=None, forward_ad=False,
                 second_order=False, kinks="allow", seed=0, probes=2, max_entries=2 ** 27,
                 localise_entries=1_000_000, compress=True)
    unknown = sorted(set(kw) - set(known))
    if unknown:
        raise GraddbgError(f"check_module: unknown keyword(s) {unknown}; accepted: "
                           f"{sorted(known) + ['dtype', 'wrt']}")
    known.update(kw)
    return known


def assert_gradients_close(fn_or_module: Union[Callable[..., Any], torch.nn.Module],
                           *inputs: Any, **kw: Any) -> None:
    """Run :func:`gradcheck` (or :func:`check_module` for a module) and raise
    ``GradientMismatchError`` (an AssertionError) with the result's text on failure.

    >>> import torch
    >>> x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    >>> assert_gradients_close(torch.tanh, x)
    >>> class Bad(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, t): return t * 2
    ...     @staticmethod
    ...     def backward(ctx, g): return g * 3
    >>> assert_gradients_close(Bad.apply, x)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    graddbg._errors.GradientMismatchError: gradcheck FAILED (mode=full, ...
    """
    if isinstance(fn_or_module, torch.nn.Module):
        result = check_module(fn_or_module, *inputs, **kw)
    else:
        result = gradcheck(fn_or_module, *inputs, **kw)
    if not result.ok:
        raise GradientMismatchError(str(result), result)


class _CallableModule(types.ModuleType):
    """``graddbg.gradcheck`` names both this module and its main function: importing the
    submodule rebinds the package attribute to the module, so the module is callable and
    ``graddbg.gradcheck(fn, *inputs)`` works either way."""

    def __call__(self, fn: Callable[..., Any], *inputs: Any, **kw: Any) -> GradcheckResult:
        return gradcheck(fn, *inputs, **kw)


sys.modules[__name__].__class__ = _CallableModule
