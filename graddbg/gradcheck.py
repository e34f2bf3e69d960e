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

Migrating from ``torch.autograd.gradcheck``: a one-line change. ``graddbg.gradcheck``
and ``graddbg.gradgradcheck`` take torch's calling convention (a tuple of inputs) and every
keyword of torch's (2.3 to 2.13) with its meaning; they raise on failure as torch does
(``raise_exception=False``: a result that is truthy like torch's bool), with a table of
the wrong entries instead of two Jacobians. Complex inputs and outputs (Wirtinger, as
torch) and sparse COO/CSR inputs (``masked=``) are checked too.

Examples:
    >>> import torch
    >>> class MySquare(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         ctx.save_for_backward(x)
    ...         return x * x
    ...     @staticmethod
    ...     def backward(ctx, g):
    ...         (x,) = ctx.saved_tensors
    ...         return 2 * x * g
    >>> x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    >>> # before: assert torch.autograd.gradcheck(MySquare.apply, (x,), eps=1e-6, atol=1e-4)
    >>> assert gradcheck(MySquare.apply, (x,), eps=1e-6, atol=1e-4)
    >>> assert gradgradcheck(MySquare.apply, (x,), fast_mode=True)
"""
from __future__ import annotations

import bisect
import copy
import inspect
import itertools
import math
import numbers
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch.utils import _pytree as pytree

from graddbg._args import Options, bad_type, bad_value, choice, flag, integer, tolerance
from graddbg._args import option as _option
from graddbg._errors import (GraddbgTypeError, GraddbgValueError, GradientMismatchError,
                             PrecisionWarning)
from graddbg._model import check_model, is_dtensor, named_tensors, unwrap


__all__ = ["gradcheck", "gradgradcheck", "check_module", "assert_gradients_close", "GradcheckResult",
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

_COLUMNS = ["input", "index", "input_part", "output", "output_index", "output_part",
            "analytic", "numerical", "abs_err", "rel_err", "check", "note"]


# --------------------------------------------------------------------------- result


@dataclass
class GradcheckResult:
    """The outcome of a check. ``bool(result)`` is ``result.ok``.

    ``table`` (a pandas DataFrame, built on first access) lists the entries that did not
    match, worst first: ``input`` (argument or parameter name), ``index`` (a tuple into
    that input), ``input_part`` (``"real"``/``"imag"`` for a complex input, else empty),
    ``output``/``output_index``/``output_part``, ``analytic``, ``numerical``, ``abs_err``,
    ``rel_err`` (``abs_err / max(|numerical|, atol)``), ``check`` (``"jacobian"``,
    ``"projection"`` in fast mode, ``"forward_ad"``, ``"forward_vs_reverse"``,
    ``"second_order"``) and ``note`` (``"non-differentiable point"`` when one-sided
    differences show a kink and the analytic value is one of its one-sided derivatives).
    ``max_abs_err``/``max_rel_err`` are over every compared entry (projection in fast
    mode); in full mode, entries cleared by the forward-difference screen count with
    their forward-difference error (about ``eps * |f''| / 2``), the others with their
    central-difference error. ``n_evaluations`` counts the perturbed function
    evaluations; ``colours`` is the number of colour groups when full mode compressed
    the Jacobian's columns (None when it checked them one by one). ``failed_checks``
    lists the further checks that failed (named by torch's option: ``check_undefined_grad``,
    ``check_batched_grad``, ``backward not multiplied by grad_output``, ...).

    Examples:
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
    failed_checks: List[str] = field(default_factory=list)
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
        lines.extend(f"  FAILED {what}" for what in self.failed_checks)
        lines.extend(f"  {note}" for note in self.notes)
        bad = [r for r in self.rows if not r.get("allowed")]     # allowed kinks: listed above
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
#
# Each option is one field of _Options: its name, its default (the public signatures'
# default) and the check that validates (and normalises) a value given for it.


def _choice(choices: Tuple[str, ...]) -> Callable[[str, str, Any], str]:
    return lambda where, name, value: choice(where, name, value, choices)


def _tolerance(where: str, name: str, value: Any) -> Optional[float]:
    """A tolerance, or None for the default (``TOLERANCES`` by dtype); ``eps`` > 0."""
    default = "the comparison tolerance" if name == "nondet_tol" else "TOLERANCES by dtype"
    return None if value is None else tolerance(where, name, value, positive=name == "eps", default=default)


def _optional_flag(where: str, name: str, value: Any) -> Optional[bool]:
    return None if value is None else flag(where, name, value)


def _integer(minimum: Optional[int]) -> Callable[[str, str, Any], int]:
    return lambda where, name, value: integer(where, name, value, minimum)


def _dtype(where: str, name: str, value: Any) -> Optional[torch.dtype]:
    accepted = "a floating-point torch.dtype (default torch.float64) or None (check in the dtypes given)"
    if value is not None and not isinstance(value, torch.dtype):
        raise bad_type(where, name, value, accepted)
    if value is not None and not value.is_floating_point:
        raise bad_value(where, name, value, accepted)
    return value


@dataclass(frozen=True)
class _Options(Options):
    """The options of ``gradcheck``, ``check_module`` and ``assert_gradients_close``,
    written once. `parse` builds them from a call's keywords, validating each;
    ``eps``/``atol``/``rtol`` left None are filled from ``TOLERANCES`` by `resolve`
    once the dtype of the check is known."""

    mode: str = _option("full", _choice(_MODES))
    eps: Optional[float] = _option(None, _tolerance)
    atol: Optional[float] = _option(None, _tolerance)
    rtol: Optional[float] = _option(None, _tolerance)
    forward_ad: bool = _option(False, flag)
    second_order: bool = _option(False, flag)
    nondet_tol: Optional[float] = _option(None, _tolerance)
    dtype: Optional[torch.dtype] = _option(torch.float64, _dtype)
    kinks: str = _option("allow", _choice(_KINKS))
    seed: int = _option(0, _integer(None))
    probes: int = _option(2, _integer(1))
    max_entries: int = _option(2 ** 27, _integer(1))
    localise_entries: int = _option(1_000_000, _integer(0))
    compress: bool = _option(True, flag)
    # torch.autograd.gradcheck's further checks, under torch's names and defaults
    check_backward_ad: bool = _option(True, flag)
    check_undefined_grad: bool = _option(True, flag)
    check_grad_dtypes: bool = _option(False, flag)
    check_batched_grad: bool = _option(False, flag)
    check_batched_forward_grad: bool = _option(False, flag)
    masked: Optional[bool] = _option(None, _optional_flag)

    #: torch.autograd.gradcheck's keywords spelled differently here -> graddbg's option
    ALIASES = {"fast_mode": "mode", "check_forward_ad": "forward_ad", "check_sparse_nnz": "masked"}

    @classmethod
    def translate(cls, where: str, kw: Dict[str, Any]) -> Dict[str, Any]:
        """torch's spellings (``fast_mode=True`` -> ``mode="fast"``, ``check_forward_ad`` ->
        ``forward_ad``, torch < 2.1's ``check_sparse_nnz`` -> ``masked``) in graddbg's words; a
        torch keyword that contradicts graddbg's own given alongside is an error."""
        for old, new in cls.ALIASES.items():
            if old not in kw:
                continue
            value = flag(where, old, kw.pop(old))
            if old == "fast_mode":
                value = "fast" if value else "full"
            if new in kw and kw[new] != value:
                raise GraddbgValueError(f"{where}: {old}= and {new}={kw[new]!r} disagree; pass one of them")
            kw[new] = value
        return kw

    def validate(self, where: str) -> None:
        if not self.check_backward_ad and not self.forward_ad:
            raise GraddbgValueError(f"{where}: check_backward_ad=False needs check_forward_ad=True "
                                    f"(forward_ad=True): at least one kind of AD must be checked")
        if self.check_batched_grad and not self.check_backward_ad:
            raise GraddbgValueError(f"{where}: check_batched_grad=True needs check_backward_ad=True")
        if self.check_batched_forward_grad and not self.forward_ad:
            raise GraddbgValueError(f"{where}: check_batched_forward_grad=True needs "
                                    f"check_forward_ad=True (forward_ad=True)")

    def resolve(self, dtype: torch.dtype) -> "_Options":
        """These options with the tolerances left None taken from ``TOLERANCES[dtype]``."""
        eps, atol, rtol = TOLERANCES.get(dtype, TOLERANCES[torch.float64])
        return replace(self, eps=eps if self.eps is None else self.eps,
                       atol=atol if self.atol is None else self.atol,
                       rtol=rtol if self.rtol is None else self.rtol)


def _options_in_signature(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Show the options as keyword-only parameters in ``fn``'s signature in place of its
    ``**options`` (gradgradcheck: without the first-order AD switches it replaces by its
    own; gradcheck and gradgradcheck: with torch's ``raise_exception``)."""
    skip = ("forward_ad", "second_order", "check_backward_ad") if fn.__name__ == "gradgradcheck" else ()
    extra = [inspect.Parameter("raise_exception", inspect.Parameter.KEYWORD_ONLY, default=None,
                               annotation=Optional[bool])] if fn.__name__ in ("gradcheck", "gradgradcheck") else []
    return _Options.in_signature(fn, skip=skip, extra=extra)


# --------------------------------------------------------------------------- target


class _Target:
    """A function of a flat list of differentiable tensors returning a flat list of
    floating-point output tensors: the outputs are found with `graddbg._model.named_tensors`
    (tensors in tuples, lists, dicts, dataclasses...), integer ones are dropped and complex
    ones are checked as their real and imaginary parts (a trailing dimension of 2), as the
    carriers of complex inputs are (``in_complex``).
    ``where`` names the public function in error messages."""

    def __init__(self, fn: Callable[[Sequence[torch.Tensor]], Any], xs: List[torch.Tensor],
                 names: List[str], seed: int, where: str) -> None:
        self.fn = fn
        self.xs = xs
        self.names = names
        self.seed = seed
        self.where = where
        self.sizes = [x.numel() for x in xs]
        self.offsets = [0, *itertools.accumulate(self.sizes)]
        self.n = self.offsets[-1]
        self.paths: Optional[List[str]] = None      # of the checked outputs, set by the first call
        self.skipped: List[str] = []
        self.out_names: List[str] = []
        self.out_shapes: List[torch.Size] = []
        self.vmap_ok: Optional[bool] = None
        self.vjp_batch_ok: Optional[bool] = None
        self.jvp_batch_ok: Optional[bool] = None
        self.batch_rows: Dict[str, int] = {}
        self.evaluations = 0
        self.colours: Optional[int] = None
        self.cuda_gens = [torch.cuda.default_generators[i] for i in _devices(xs)]
        self.in_complex: List[bool] = [False] * len(xs)   # carriers of complex inputs
        self.graph: Optional[Tuple[List[torch.Tensor], List[torch.Tensor]]] = None
        self.out_complex: List[bool] = []

    # The RNG is reseeded before every evaluation, so dropout and friends draw the same
    # numbers in every perturbed call as in the analytic one (states are restored by
    # fork_rng around the whole check).
    def call(self, xs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        torch.default_generator.manual_seed(self.seed)
        for gen in self.cuda_gens:
            gen.manual_seed(self.seed)
        out = self.fn(xs)
        if self.paths is None:
            self._learn_outputs(out)
        if self.paths == [""] and isinstance(out, torch.Tensor):   # one tensor: no walk
            ys = [out]
        else:
            found = dict(named_tensors(out))
            try:
                ys = [found[p] for p in self.paths]
            except KeyError:
                raise GraddbgValueError(
                    f"{self.where}: the function returned outputs {sorted(found)} on one call and "
                    f"{self.paths} on the first; its outputs must keep their structure") from None
        return [torch.stack((y.real, y.imag), -1) if y.is_complex() else y for y in ys]

    def _learn_outputs(self, out: Any) -> None:
        tensors = named_tensors(out, floating=False)
        _check_output_types(self.where, out, tensors)
        floats = [(p, y) for p, y in tensors if y.is_floating_point() or y.is_complex()]
        if not floats:
            raise GraddbgValueError(
                f"{self.where}: the function has no floating-point output to differentiate "
                f"(outputs: {', '.join(f'{_output_name(p)}: {y.dtype}' for p, y in tensors)})")
        # like torch.autograd.gradcheck, outputs that do not require grad (returned
        # statistics, masks) are not checked, unless no output requires grad
        if torch.is_grad_enabled():
            diff = [(p, y) for p, y in floats if y.requires_grad]
            if diff and len(diff) < len(floats):
                self.skipped = [_output_name(p) for p, y in floats if not y.requires_grad]
                floats = diff
        self.paths = [p for p, _ in floats]
        self.out_names = [_output_name(p) for p in self.paths]
        self.out_shapes = [y.shape + ((2,) if y.is_complex() else ()) for _, y in floats]
        self.out_complex = [y.is_complex() for _, y in floats]
        self.out_offsets = [0, *itertools.accumulate(math.prod(s) for s in self.out_shapes)]
        self.m = self.out_offsets[-1]

    def locate_input(self, j: int) -> Tuple[int, Tuple[int, ...]]:
        """(input, index in it) of the flat input element ``j``."""
        b = bisect.bisect_right(self.offsets, j) - 1
        return b, _unravel(j - self.offsets[b], self.xs[b].shape)

    def locate_output(self, i: int) -> Tuple[int, Tuple[int, ...]]:
        """(output, index in it) of the flat output element ``i``."""
        o = bisect.bisect_right(self.out_offsets, i) - 1
        return o, _unravel(i - self.out_offsets[o], self.out_shapes[o])


def _check_output_types(where: str, out: Any, tensors: List[Tuple[str, torch.Tensor]]) -> None:
    """A function's output holds tensors only (in containers): a number or a string in it,
    or no tensor at all, is an error. (``named_tensors`` skips what is not a tensor, so
    torch's pytree walk names the stray leaf.)"""
    for path, leaf in pytree.tree_flatten_with_path(out)[0]:
        if isinstance(leaf, (numbers.Number, str, bytes)):
            raise GraddbgTypeError(
                f"{where}: the function's output{pytree.keystr(path)} is a {type(leaf).__name__}, "
                f"not a tensor; return tensors (or tuples/lists/dicts of tensors) only")
    if not tensors:
        raise GraddbgTypeError(f"{where}: the function returned {type(out).__name__} with no "
                               f"tensor in it; it must return a tensor or a tuple/list/dict of tensors")


def _output_name(path: str) -> str:
    """``output``, ``output[0]``, ``output.logits`` from a `named_tensors` path."""
    return "output" + (path if not path or path.startswith("[") else "." + path)


def _unravel(j: int, shape: Sequence[int]) -> Tuple[int, ...]:
    idx = []
    for s in reversed(list(shape)):
        idx.append(j % s)
        j //= s
    return tuple(reversed(idx))


def _flat(tensors: Sequence[torch.Tensor], k: int) -> torch.Tensor:
    if len(tensors) == 1:
        return tensors[0].reshape(k, -1)
    return torch.cat([t.reshape(k, -1) for t in tensors], dim=1)


def _unit_rows(like: torch.Tensor, n: int, cols: Union[range, torch.Tensor],
               value: float = 1.0) -> torch.Tensor:
    """``value * e_c`` for every column index ``c`` in ``cols``: (len(cols), n), on
    ``like``'s device and dtype."""
    if isinstance(cols, range):
        cols = torch.arange(cols.start, cols.stop, device=like.device)
    rows = like.new_zeros(cols.numel(), n)
    rows[torch.arange(cols.numel(), device=like.device), cols] = value
    return rows


# --------------------------------------------------------------------------- evaluation


class _Sink:
    """Where `_rows` puts the rows it computes: into ``out`` when given, else into
    blocks concatenated at the end."""

    def __init__(self, out: Optional[torch.Tensor]) -> None:
        self.out = out
        self.blocks: List[torch.Tensor] = []

    def put(self, r0: int, block: torch.Tensor) -> None:
        if self.out is None:
            self.blocks.append(block)
        else:
            self.out[r0:r0 + block.shape[0]] = block

    def result(self) -> torch.Tensor:
        if self.out is not None:
            return self.out
        return torch.cat(self.blocks) if len(self.blocks) > 1 else self.blocks[0]


def _rows(t: _Target, attr: str, k: int, batched: Callable[[int, int], torch.Tensor],
          single: Callable[[int], torch.Tensor],
          out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows 0..k-1 of some result (written into ``out`` when given): batched (vmap, at
    most ``_VMAP_ROWS`` rows a call) when that works and pays off, else one at a time.
    ``t.<attr>`` remembers the choice: None (not tried yet), True (batched), False (loop).
    The first large request races the two (`_race`)."""
    sink = _Sink(out)
    state = getattr(t, attr)
    if state is False or k < _MIN_BATCH:
        _loop(sink, single, 0, k)
    elif state is None and k > 3 * _RACE + 2 * _SMALL_BATCH:
        _race(t, attr, sink, k, batched, single)
    else:
        try:
            _chunks(sink, batched, 0, k, t.batch_rows.get(attr, _VMAP_ROWS))
        except Exception:  # noqa: BLE001 - vmap cannot run this function: loop
            if state:
                raise
            setattr(t, attr, False)
            sink.blocks.clear()
            _loop(sink, single, 0, k)
        else:
            setattr(t, attr, True)
    return sink.result()


def _loop(sink: _Sink, single: Callable[[int], torch.Tensor], r0: int, k: int) -> None:
    for r in range(r0, k):
        sink.put(r, single(r)[None])


def _chunks(sink: _Sink, batched: Callable[[int, int], torch.Tensor], r0: int, k: int,
            size: int) -> None:
    # every call gets the same batch size (a short last chunk overlaps the one before):
    # some batching rules are traced anew for each new batch size
    for c in range(r0, k, size):
        c1 = min(k, c + size)
        lo = max(0, c1 - size) if k >= size else c
        sink.put(c, batched(lo, c1)[c - lo:])


def _race(t: _Target, attr: str, sink: _Sink, k: int,
          batched: Callable[[int, int], torch.Tensor], single: Callable[[int], torch.Tensor]) -> None:
    """Time one looped row against (warm) batches of ``_RACE`` and of ``_SMALL_BATCH``
    rows, keep the cheapest per row for the rest and remember it in ``t``: vmap falls
    back to slow per-sample loops for ops without batching rules, and some batching
    rules cost more than linearly in the batch size (``slice_scatter``'s backward:
    several times more per row at 32 rows than at 4)."""
    t0 = time.perf_counter()
    sink.put(0, single(0)[None])
    t1 = time.perf_counter()
    try:
        sink.put(1, batched(1, 1 + _RACE))
    except Exception:  # noqa: BLE001 - vmap cannot run this function: loop
        setattr(t, attr, False)
        _loop(sink, single, 1, k)
        return
    t2 = time.perf_counter()
    sink.put(1 + _RACE, batched(1 + _RACE, 1 + 2 * _RACE))
    t3 = time.perf_counter()
    r0 = 1 + 2 * _RACE
    sink.put(r0, batched(r0, r0 + _SMALL_BATCH))
    t4 = time.perf_counter()
    sink.put(r0 + _SMALL_BATCH, batched(r0 + _SMALL_BATCH, r0 + 2 * _SMALL_BATCH))
    t5 = time.perf_counter()
    per_row = {_RACE: (t3 - t2) / _RACE, _SMALL_BATCH: (t5 - t4) / _SMALL_BATCH}
    size = min(per_row, key=per_row.__getitem__)
    fast = per_row[size] < t1 - t0
    setattr(t, attr, fast)
    t.batch_rows[attr] = size
    r0 += 2 * _SMALL_BATCH
    if fast:
        _chunks(sink, batched, r0, k, size)
    else:
        _loop(sink, single, r0, k)


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
        self.failed: List[str] = []

    def fail(self, check: str, message: str) -> None:
        """A further check (named as torch names its option) failed."""
        self.failed.append(f"{check}: {message}")

    def errors(self, abs_err: torch.Tensor, n_abs: torch.Tensor) -> None:
        """Record the largest absolute and relative errors of compared entries (``n_abs``:
        the magnitudes of the numerical values, the scale of the relative error)."""
        if abs_err.numel():
            self.max_abs = max(self.max_abs, float(abs_err.max()))
            rel = abs_err / n_abs.clamp_min(max(self.opts.atol, 1e-300))
            self.max_rel = max(self.max_rel, float(rel.max()))

    def backward_spread(self, spread: torch.Tensor, tol: Any) -> None:
        """Record how far two runs of the backward pass differ; beyond ``nondet_tol``
        (default: ``tol``, the comparison tolerance) the backward is nondeterministic."""
        if not spread.numel():
            return
        self.spread = max(self.spread, float(spread.max()))
        limit = tol if self.opts.nondet_tol is None else self.opts.nondet_tol
        if bool((spread > limit).any()):
            self.nondet = True

    def trim(self) -> None:
        """Keep the ``_TABLE_ROWS`` worst rows."""
        if len(self.rows) > _TABLE_ROWS:
            self.rows.sort(key=_row_key)
            del self.rows[_TABLE_ROWS:]


def _row_key(r: dict) -> float:
    return -r["abs_err"] if math.isfinite(r["abs_err"]) else -math.inf


def _forward(t: _Target) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """The inputs as fresh leaves that require grad, and the outputs with their graph."""
    xs = [x.detach().requires_grad_(True) for x in t.xs]
    with torch.enable_grad():
        ys = t.call(xs)
    return xs, ys


def _run_full(t: _Target, opts: _Options, col: _Collector) -> None:
    """Every Jacobian entry: analytic (backward passes, twice), numerical (forward
    differences, then central ones where they do not clear), compressed when sparse."""
    xs, ys = t.graph = _forward(t)            # kept for the further checks
    if t.n * t.m > opts.max_entries:
        raise GraddbgValueError(
            f"{t.where}: the Jacobian has {t.m} x {t.n} = {t.m * t.n} entries, more than "
            f"max_entries={opts.max_entries}; use mode='fast' (random projections) or raise "
            f"max_entries")
    f0 = _flat([y.detach().unsqueeze(0) for y in ys], 1)[0]
    # the analytic Jacobian is the only full-size matrix kept; the second backward pass
    # and the numerical columns are compared chunk by chunk against it
    if opts.check_backward_ad:
        ana = _analytic_jacobian(t, xs, ys)
        widen = _second_backward(t, xs, ys, ana, col)
    else:                                   # check_backward_ad=False: forward mode only
        ana, widen = _forward_jacobian(t), None
    kink = _kink_fn(t, opts.eps, f0)
    cp = _compression(t, ana, opts)
    if cp is not None:
        t.colours = cp.n_colours
        _run_compressed(cp, opts, f0, widen, kink, col)
        return
    x0 = t.xs[0]
    step = _chunk(t.n, 2 * (t.n + t.m))
    for c0 in range(0, t.n, step):
        c1 = min(t.n, c0 + step)
        num, suspect = _screened_columns(t, opts, ana[:, c0:c1], c0, c1, f0, widen, col)
        if suspect.numel():
            _compare_full(t, ana[:, c0:c1][:, suspect], num[:, suspect], col,
                          "jacobian" if opts.check_backward_ad else "forward_ad",
                          widen, kink, suspect + c0)
        if opts.forward_ad and opts.check_backward_ad:
            fwd = _jvp_cols(t, _unit_rows(x0, t.n, range(c0, c1))).T
            _compare_full(t, fwd, num, col, "forward_ad", None, kink, c0)
            _compare_full(t, fwd, ana[:, c0:c1], col, "forward_vs_reverse", widen, None, c0)
        col.trim()


def _analytic_jacobian(t: _Target, xs: List[torch.Tensor], ys: List[torch.Tensor]) -> torch.Tensor:
    """The Jacobian (M, N) by backward passes, one row per output element."""
    x0 = t.xs[0]
    out = x0.new_empty(t.m, t.n)
    step = _chunk(t.m, t.m + t.n)
    for r0 in range(0, t.m, step):
        r1 = min(t.m, r0 + step)
        _vjp_rows(t, xs, ys, _unit_rows(x0, t.m, range(r0, r1)), out[r0:r1])
    return out


def _forward_jacobian(t: _Target) -> torch.Tensor:
    """The Jacobian (M, N) by forward mode, one column per input element."""
    x0 = t.xs[0]
    out = x0.new_empty(t.m, t.n)
    step = _chunk(t.n, t.m + t.n)
    for c0 in range(0, t.n, step):
        c1 = min(t.n, c0 + step)
        out[:, c0:c1] = _jvp_cols(t, _unit_rows(x0, t.n, range(c0, c1))).T
    return out


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
    if torch.equal(g1, g2) or _within_rounding(v, ana, g1, g2):
        return None                  # (equal: e.g. one nonzero per column, no rounding)
    step = _chunk(t.m, t.m + t.n)
    for r0 in range(0, t.m, step):
        r1 = min(t.m, r0 + step)
        a2 = _vjp_rows(t, xs, ys, _unit_rows(x0, t.m, range(r0, r1)))
        a1 = ana[r0:r1]
        if torch.equal(a1, a2):
            continue
        col.backward_spread((a1 - a2).abs(), opts.atol + opts.rtol * a1.abs())
        a1.add_(a2).mul_(0.5)
    return 2 * col.spread if col.spread > 0 else None


def _within_rounding(v: torch.Tensor, ana: torch.Tensor, g1: torch.Tensor, g2: torch.Tensor) -> bool:
    """Whether two products ``v^T J`` differ by no more than their rounding, about
    ``1e3 * eps * |v|^T |J|`` (computed without a full-size ``|J|``)."""
    rounding = torch.zeros_like(g1)
    step = max(1, (_BUDGET // 8) // max(ana.shape[1], 1))
    for r0 in range(0, ana.shape[0], step):
        rounding.addmm_(v[:, r0:r0 + step].abs(), ana[r0:r0 + step].abs())
    rounding.mul_(1e3 * torch.finfo(ana.dtype).eps)
    return bool((((g1 - g2).abs() <= rounding) | (g1 == g2)).all())


def _screened_columns(t: _Target, opts: _Options, ana: torch.Tensor, c0: int, c1: int,
                      f0: torch.Tensor, widen: Optional[float], col: _Collector
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Numerical Jacobian columns c0..c1 (M, k) and the columns still to compare.

    Forward differences (one evaluation per column) clear the columns whose every entry
    is within half the tolerance of the analytic value (their errors enter the
    statistics here); every other column is recomputed with central differences, which
    decide every reported mismatch. This halves the function evaluations of full mode,
    at no cost in what is reported. A column the screen clears has the analytic value
    as its right-hand derivative, which ``kinks="allow"`` accepts anyway; with
    ``kinks="fail"`` (torch's form) every column takes central differences, as torch's."""
    x0 = t.xs[0]
    fp = _eval_directions(t, _unit_rows(x0, t.n, range(c0, c1), opts.eps))    # (k, M)
    num = torch.sub(fp, f0).div_(opts.eps).T
    err = torch.sub(ana, num).abs_()
    n_abs = num.abs()
    half = n_abs * (0.5 * opts.rtol) + (0.5 * opts.atol + (0.5 * widen if widen else 0.0))
    cleared = (err <= half).all(0) & (opts.kinks == "allow")
    suspect = (~cleared).nonzero().flatten()
    if err.numel() and bool(cleared.any()):
        e = err[:, cleared]
        col.errors(e, n_abs[:, cleared])
        col.n_compared += e.numel()
    if suspect.numel():
        fm = _eval_directions(t, _unit_rows(x0, t.n, suspect + c0, -opts.eps))
        num[:, suspect] = ((fp[suspect] - fm) / (2 * opts.eps)).T
    return num, suspect


def _compare_full(t: _Target, a: torch.Tensor, n: torch.Tensor, col: _Collector,
                  check: str, spread: Optional[float] = None,
                  kink_fn: Optional[Callable] = None,
                  c0: Union[int, torch.Tensor] = 0) -> None:
    """Compare Jacobian columns entry by entry: a block starting at column ``c0``, or the
    columns whose global indices ``c0`` (a tensor) lists. Mismatches, worst first, become
    rows of the table, except at allowed kinks (`_at_kink`)."""
    opts = col.opts
    abs_err = (a - n).abs_()
    n_abs = n.abs()
    tol = n_abs * opts.rtol + opts.atol
    if spread is not None:
        tol = tol + spread
    col.errors(abs_err, n_abs)
    col.n_compared += abs_err.numel()
    bad = ~(abs_err <= tol)                      # NaN counts as bad ...
    if not bool(bad.any()):
        return
    idx = bad.nonzero()[~(a[bad] == n[bad])]     # ... unless both sides agree (inf == inf)
    nbad = idx.shape[0]
    if not nbad:
        return
    errs = abs_err[idx[:, 0], idx[:, 1]]
    order = torch.argsort(errs.nan_to_num(float("inf")), descending=True)[:_TABLE_ROWS]
    glob = c0.tolist() if isinstance(c0, torch.Tensor) else None
    entries = [(i, glob[j] if glob is not None else j + c0, j) for i, j in idx[order].tolist()]
    kink_info = kink_fn([j for _, j, _ in entries]) if kink_fn is not None else {}
    allowed = 0
    for i, j, jj in entries:
        row = _entry_row(t, opts, i, j, float(a[i, jj]), float(n[i, jj]), check)
        if _at_kink(col, row, kink_info.get(j), i):
            allowed += 1
        else:
            col.rows.append(row)
    col.n_mismatched += nbad - allowed


def _entry_row(t: _Target, opts: _Options, i: int, j: int, av: float, nv: float,
               check: str) -> dict:
    """The table row of Jacobian entry (output element i, input element j)."""
    b, in_idx = t.locate_input(j)
    o, out_idx = t.locate_output(i)
    in_idx, in_part = _part(in_idx, t.in_complex[b] if b < len(t.in_complex) else False)
    out_idx, out_part = _part(out_idx, t.out_complex[o] if o < len(t.out_complex) else False)
    err = abs(av - nv) if math.isfinite(av - nv) else float("inf")
    return dict(input=t.names[b], index=in_idx, input_part=in_part, output=t.out_names[o],
                output_index=out_idx, output_part=out_part, analytic=av, numerical=nv,
                abs_err=err, rel_err=err / max(abs(nv), opts.atol, 1e-300), check=check, note="")


def _part(index: Tuple[int, ...], is_complex: bool) -> Tuple[Tuple[int, ...], str]:
    """A complex tensor's element index and part ("real"/"imag") from the index into its
    real view (whose last dimension holds the two parts); ("", index) for a real one."""
    if not is_complex:
        return index, ""
    return index[:-1], ("real", "imag")[index[-1]]


def _at_kink(col: _Collector, row: dict, one_sided: Any, i: int) -> bool:
    """Mark ``row`` as a non-differentiable point when the one-sided differences of its
    column disagree and the analytic value is one of them. Returns True when that is
    allowed (``kinks="allow"``): the row is then a kink, not a mismatch."""
    if one_sided is None:
        return False
    opts = col.opts
    left, right, av = float(one_sided[0][i]), float(one_sided[1][i]), row["analytic"]
    ktol = opts.atol + opts.rtol * max(abs(left), abs(right))
    if not (abs(left - right) > ktol and min(left, right) - ktol <= av <= max(left, right) + ktol):
        return False
    row["note"] = "non-differentiable point"
    row["left"], row["right"] = left, right
    if opts.kinks != "allow":
        return False
    row["allowed"] = True
    col.kink_rows.append(row)
    col.kinks.append(f"{row['input']}{list(row['index'])} -> {row['output']}"
                     f"{list(row['output_index'])}: left {left:.4g}, right {right:.4g}, "
                     f"analytic {av:.4g}")
    return True


def _kink_fn(t: _Target, eps: float, f0: torch.Tensor) -> Callable:
    """One-sided differences of the columns asked for (at most 256): {column: (left,
    right)}, to tell a kink from a wrong derivative."""
    def one_sided(cols: List[int]) -> Dict[int, Tuple[torch.Tensor, torch.Tensor]]:
        cols = sorted(set(cols))[:256]
        x0 = t.xs[0]
        k = len(cols)
        at = torch.as_tensor(cols, device=x0.device)
        f = _eval_directions(t, torch.cat([_unit_rows(x0, t.n, at, eps),
                                           _unit_rows(x0, t.n, at, -eps)]))
        return {c: ((f0 - f[k + r]) / eps, (f[r] - f0) / eps) for r, c in enumerate(cols)}
    return one_sided
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
              f0: Optional[torch.Tensor], widen: Optional[float], col: _Collector,
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
                col.errors(err[good], n_abs[good])
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
                    kink: Callable, col: _Collector) -> None:
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
        # the forward-difference screen only where kinks are allowed (_screened_columns)
        screened = cp.check(pending, weights, opts, f0, widen, col, central=False) \
            if opts.kinks == "allow" else [True] * len(pending)
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
            col.trim()


def _central_columns(t: _Target, opts: _Options, cols: torch.Tensor) -> torch.Tensor:
    """Central differences of the columns ``cols``: (M, k)."""
    k = cols.numel()
    d = _unit_rows(t.xs[0], t.n, cols, opts.eps)
    f = _eval_directions(t, torch.cat([d, -d]))
    return ((f[:k] - f[k:]) / (2 * opts.eps)).T


# --------------------------------------------------------------------------- fast mode


def _probe(gen: torch.Generator, shape: Tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """Zero-mean probe entries, uniform on [-1, 1) (cheaper to draw than Gaussians), drawn
    on the CPU so that a seed gives the same probes on every device."""
    return (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1).to(like.device, like.dtype)


@dataclass
class _Projections:
    """Fast mode's probes and what was measured along them. The (k, k * nb) matrices
    hold every pair (output probe v_l, input probe u_c); column ``c = b * k + kk``
    belongs to input ``b``."""

    k: int                      # probes per input (and output probes)
    nb: int                     # inputs
    u: torch.Tensor             # (k * nb, N) input probes, each on one input only
    v: torch.Tensor             # (k, M) output probes
    d: torch.Tensor             # (k * nb, M) numerical J u, central differences
    noise_el: torch.Tensor      # (k * nb, M) rounding in f(x +- eps u)
    g1: torch.Tensor            # (k, N) analytic v^T J
    g_again: torch.Tensor       # (1, N) v_0^T J from a second backward pass
    ana: Any = None             # (k, k * nb) analytic v^T J u (set by _fast_compare)
    num: Any = None             # numerical v^T (J u)
    tol: Any = None
    scale: Any = None           # typical size of the sums, the scale of rel_err
    abs_err: Any = None
    bad: Any = None


def _run_fast(t: _Target, opts: _Options, col: _Collector) -> Dict[int, int]:
    """Projection check; returns {input: number of failed projections}."""
    xs, ys = t.graph = _forward(t)            # kept for the further checks
    p = _fast_measure(t, opts, xs, ys)
    failing: Dict[int, int] = {}
    if p.g1 is None:
        _fast_forward_ad(t, opts, col, p, failing)
        return failing
    for b in _fast_compare(opts, col, p):
        confirmed = _fast_confirm(t, opts, col, p, b)
        if confirmed:
            failing[b] = failing.get(b, 0) + confirmed
    if opts.forward_ad:
        _fast_forward_ad(t, opts, col, p, failing)
    return failing


def _fast_measure(t: _Target, opts: _Options, xs: List[torch.Tensor],
                  ys: List[torch.Tensor]) -> _Projections:
    """Draw the probes (seeded), difference along each input probe, and run the
    backward pass for each output probe (and for the first one again)."""
    k = opts.probes
    gen = torch.Generator().manual_seed(opts.seed)
    x0 = t.xs[0]
    nb = len(t.xs)
    # probes u: k per input, supported on that input only; v: k over all outputs
    u = x0.new_zeros(k * nb, t.n)
    for b in range(nb):
        u[b * k:(b + 1) * k, t.offsets[b]:t.offsets[b + 1]] = _probe(gen, (k, t.sizes[b]), x0)
    v = _probe(gen, (k, t.m), x0)
    f = _eval_directions(t, torch.cat([opts.eps * u, -opts.eps * u]))
    fp, fm = f[:k * nb], f[k * nb:]
    d = (fp - fm) / (2 * opts.eps)
    noise_el = (fp.abs() + fm.abs()) * (_NOISE * torch.finfo(x0.dtype).eps / (2 * opts.eps))
    if not opts.check_backward_ad:          # forward mode only: no backward pass
        return _Projections(k, nb, u, v, d, noise_el, None, None)   # type: ignore[arg-type]
    g12 = _vjp_rows(t, xs, ys, torch.cat([v, v[:1]]))
    return _Projections(k, nb, u, v, d, noise_el, g12[:k], g12[k:])


def _fast_compare(opts: _Options, col: _Collector, p: _Projections) -> List[int]:
    """Compare every projection, in float64, against its own magnitude and the rounding
    noise of its finite difference; record the statistics; return the inputs with a
    projection over tolerance."""
    k, nb, u, v, d, g1 = p.k, p.nb, p.u, p.v, p.d, p.g1
    vv = v * v
    a1 = g1 @ u.T                                        # analytic v^T J u
    num = v @ d.T                                        # numerical v^T (J u)
    u2 = u * u
    m_a = ((g1 * g1) @ u2.T).sqrt_()                     # typical size of the sum a1
    # typical size of the numerical sum, and the rounding in f(x +- eps u): one product
    m_n, noise = (vv @ torch.cat([d * d, p.noise_el * p.noise_el]).T).sqrt_().split(k * nb, 1)
    scale = torch.maximum(m_a, m_n)
    tol = torch.outer(vv.sum(1), u2.sum(1)).sqrt_().mul_(opts.atol)
    tol += opts.rtol * scale + noise
    ana = a1
    if not torch.equal(g1[:1], p.g_again):               # the backward is nondeterministic
        g2 = g1.clone()
        g2[:1] = p.g_again
        a2 = g2 @ u.T
        sp = (a1 - a2).abs()
        col.backward_spread(sp, tol)
        ana = (a1 + a2) / 2
        tol = tol + 2 * sp.max()
    abs_err = (ana - num).abs()
    col.n_compared += abs_err.numel()
    bad = ~(abs_err <= tol)
    # per input: max abs err, max rel err, any projection over tolerance (one readback)
    per = torch.stack([abs_err, abs_err / scale.clamp_min(1e-300), bad.to(abs_err.dtype)])
    per_abs, per_rel, per_bad = per.view(3, k, nb, k).amax((1, 3)).tolist()
    for b in range(nb):
        col.per_input[b] = (per_abs[b], per_rel[b])
    p.ana, p.num, p.tol, p.scale, p.abs_err, p.bad = ana, num, tol, scale, abs_err, bad
    if not any(per_bad):
        return []
    return sorted({int(c) // k for c in bad.nonzero()[:, 1]})


def _fast_confirm(t: _Target, opts: _Options, col: _Collector, p: _Projections, b: int) -> int:
    """Re-measure the failing projections of input ``b`` with twice the step: a real
    mismatch does not move with eps. Records the confirmed ones; returns their number."""
    cols = slice(b * p.k, (b + 1) * p.k)
    ana, num, tol, err, scale = (x[:, cols] for x in (p.ana, p.num, p.tol, p.abs_err, p.scale))
    bad = p.bad[:, cols] & ~(ana == num)
    if not bool(bad.any()):
        return 0
    ks = sorted({int(kk) for kk in bad.nonzero()[:, 1]})
    uu = p.u[[b * p.k + kk for kk in ks]]
    f2 = _eval_directions(t, torch.cat([2 * opts.eps * uu, -2 * opts.eps * uu]))
    d2 = (f2[:len(ks)] - f2[len(ks):]) / (4 * opts.eps)
    fd_err = (p.v @ d2.T - num[:, ks]).abs()
    confirmed = ~(err[:, ks] <= tol[:, ks] + 2 * fd_err) & ~(ana[:, ks] == num[:, ks])
    if not bool(confirmed.any()):
        if opts.kinks != "allow" and t.sizes[b] * t.m <= min(opts.localise_entries, opts.max_entries):
            return int(bad.sum())     # a jump also moves with eps: full mode decides (torch's form)
        col.notes.append(f"fast-mode projections of {t.names[b]} disagreed by up to "
                         f"{float(err[bad].max()):.3g} but moved with eps (finite-"
                         f"difference error, not a wrong gradient); mode='full' checks entries")
        return 0
    for (l, kk) in confirmed.nonzero().tolist():
        c = ks[kk]
        av, nv = float(ana[l, c]), float(num[l, c])
        col.rows.append(_projection_row(t.names[b], l, c, av, nv, abs(av - nv),
                                        float(scale[l, c]), "projection"))
    return int(confirmed.sum())


def _fast_forward_ad(t: _Target, opts: _Options, col: _Collector, p: _Projections,
                     failing: Dict[int, int]) -> None:
    """Forward mode along the same probes: v^T (J u) by jvp against the numerical one
    and against the backward pass's (v^T J) u."""
    k, v = p.k, p.v
    vv = v * v
    jf = _jvp_cols(t, p.u)                               # (k*nb, M)
    for b in range(p.nb):
        sl, rows = slice(t.offsets[b], t.offsets[b + 1]), slice(b * k, (b + 1) * k)
        ub = p.u[rows, sl]
        fw = v @ jf[rows].T
        m = (vv @ (jf[rows] ** 2).T).sqrt()
        noise = (vv @ (p.noise_el[rows] ** 2).T).sqrt()
        tol = opts.atol * ub.norm(dim=1)[None, :] * v.norm(dim=1)[:, None] + opts.rtol * m + noise
        pairs = [(v @ p.d[rows].T, "forward_ad")]
        if p.g1 is not None:
            pairs.append((p.g1[:, sl] @ ub.T, "forward_vs_reverse"))
        for other, name in pairs:
            err = (fw - other).abs()
            bad = (err > tol) | (~torch.isfinite(err) & (fw != other))
            col.n_compared += err.numel()
            col.errors(err, m)
            if not bool(bad.any()):
                continue
            failing[b] = failing.get(b, 0) + int(bad.sum())
            for (l, c) in bad.nonzero().tolist():
                col.rows.append(_projection_row(t.names[b], l, c, float(fw[l, c]), float(other[l, c]),
                                                float(err[l, c]), float(m[l, c]), name))


def _projection_row(name: str, l: int, c: int, av: float, nv: float, err: float, scale: float,
                    check: str) -> dict:
    """The table row of projection (v_l, u_c) of input ``name``."""
    return dict(input=name, index=(l, c), input_part="", output="v^T J u", output_index=(),
                output_part="", analytic=av,
                numerical=nv, abs_err=err, rel_err=err / max(scale, 1e-300), check=check,
                note=f"probe v{l}, u{c}")


# --------------------------------------------------------------------------- further checks
#
# torch.autograd.gradcheck checks more than the Jacobian; each of these is on where torch's
# is by default, and a failure names torch's option (and what to fix).


class _Undefined(torch.autograd.Function):
    """The identity, whose backward hands an undefined (None) gradient on: what torch's
    gradcheck feeds a backward for ``check_undefined_grad``."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return y.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> None:  # type: ignore[override]
        return None


def _further_checks(t: _Target, opts: _Options, col: _Collector) -> None:
    """The checks beyond the Jacobian, as ``torch.autograd.gradcheck`` runs them."""
    if opts.check_backward_ad:
        xs, ys = t.graph or _forward(t)      # the main check's forward pass, its graph retained
        t.graph = None
        _check_zero_grad_outputs(t, xs, ys, col, opts.nondet_tol or 0.0)
        if opts.check_grad_dtypes:
            _check_grad_dtypes(t, xs, ys, col)
        if opts.check_batched_grad:
            _check_batched_grad(t, opts, xs, ys, col)
        if opts.check_undefined_grad:
            _check_undefined_backward(t, xs, ys, col, opts.nondet_tol or 0.0)
    if opts.forward_ad and opts.check_undefined_grad:
        _check_undefined_forward(t, opts, col)
    if opts.forward_ad and opts.check_batched_forward_grad:
        _check_batched_forward_grad(t, opts, col)


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"


def _check_zero_grad_outputs(t: _Target, xs: List[torch.Tensor], ys: List[torch.Tensor],
                             col: _Collector, noise: float) -> None:
    """Zero output gradients must give zero input gradients (backward multiplies by the
    output gradient) of the input's dtype and shape (torch runs this one always). A
    backward declared noisy (``nondet_tol``) may give gradients up to that noise."""
    diff = [y for y in ys if y.requires_grad]
    if not diff:
        return
    try:
        grads = torch.autograd.grad(diff, xs, [torch.zeros_like(y) for y in diff],
                                    retain_graph=True, allow_unused=True)
    except Exception as e:  # noqa: BLE001 - the user's backward raised: the check fails
        col.fail("backward", f"backward raised with zero output gradients ({_first_line(e)})")
        return
    for g, x, name in zip(grads, xs, t.names):
        if g is None:
            continue
        if g.dtype != x.dtype or g.shape != x.shape:
            col.fail("grad dtype/shape", f"the gradient of {name} is {g.dtype} {tuple(g.shape)}, the "
                     f"input {x.dtype} {tuple(x.shape)}; backward must return one of the input's")
        elif not bool((g.abs() <= noise).all()):
            col.fail("backward not multiplied by grad_output",
                     f"zero output gradients give a gradient of {name} with "
                     f"{int(g.ne(0).sum())} nonzero entries (largest {float(g.abs().max()):.3g}); "
                     f"backward must scale by the incoming gradient")


def _check_grad_dtypes(t: _Target, xs: List[torch.Tensor], ys: List[torch.Tensor],
                       col: _Collector) -> None:
    """``check_grad_dtypes``: a random vector-Jacobian product has the inputs' dtypes."""
    diff = [y for y in ys if y.requires_grad]
    if not diff:
        return
    grads = torch.autograd.grad(diff, xs, [torch.ones_like(y) for y in diff],
                                retain_graph=True, allow_unused=True)
    for g, x, name in zip(grads, xs, t.names):
        if g is not None and g.dtype != x.dtype:
            col.fail("check_grad_dtypes", f"the gradient of {name} is {g.dtype}, the input {x.dtype}")


def _check_undefined_backward(t: _Target, xs: List[torch.Tensor], ys: List[torch.Tensor],
                              col: _Collector, noise: float) -> None:
    """``check_undefined_grad``: with undefined (None) gradients for every output, then
    for one output at a time, backward runs and gives undefined or zero input gradients
    (up to ``noise``, the ``nondet_tol`` of a backward declared noisy)."""
    n_diff = sum(y.requires_grad for y in ys)
    for which in [None] + (list(range(n_diff)) if n_diff > 1 else []):
        diff = [(k, y) for k, y in enumerate(y for y in ys if y.requires_grad)]
        outs = [_Undefined.apply(y) if which in (None, k) else y for k, y in diff]
        label = "every output" if which is None else t.out_names[[i for i, y in enumerate(ys)
                                                                  if y.requires_grad][which]]
        hint = ("a backward must treat an undefined (None) output gradient as zero; pass "
                "check_undefined_grad=False to skip this check")
        try:
            grads = torch.autograd.grad(outs, xs, [torch.zeros_like(o) for o in outs],
                                        retain_graph=True, allow_unused=True)
        except Exception as e:  # noqa: BLE001 - the user's backward raised: the check fails
            col.fail("check_undefined_grad", f"backward raised with undefined gradients for "
                     f"{label} ({_first_line(e)}); {hint}")
            return
        bad = [n for g, n in zip(grads, t.names) if g is not None and not bool((g.abs() <= noise).all())]
        if bad:
            col.fail("check_undefined_grad", f"with undefined gradients for {label}, the "
                     f"gradients of {', '.join(bad)} are neither undefined nor zero; {hint}")
            return


def _check_undefined_forward(t: _Target, opts: _Options, col: _Collector) -> None:
    """``check_undefined_grad`` in forward mode: an input with a zero tangent and the same
    input without one give the same output tangents."""
    import torch.autograd.forward_ad as fwAD

    gen = torch.Generator().manual_seed(opts.seed + 6)
    xs = [x.detach() for x in t.xs]
    tangents = [_probe(gen, tuple(x.shape), x) for x in xs]
    for b in range(len(xs)):
        outs = []
        for zero_dual in (True, False):
            with fwAD.dual_level():
                duals = [fwAD.make_dual(x, torch.zeros_like(x) if i == b else u) if
                         (i != b or zero_dual) else x for i, (x, u) in enumerate(zip(xs, tangents))]
                ys = t.call(duals)
                outs.append([fwAD.unpack_dual(y).tangent for y in ys])
        for o, (a, c) in enumerate(zip(*outs)):
            if a is not None and c is not None and not torch.allclose(a, c):
                col.fail("check_undefined_grad", f"forward mode: output {t.out_names[o]}'s tangent "
                         f"differs between a zero tangent and no tangent on {t.names[b]}")
                return


def _batched_mismatch(name: str, batched: torch.Tensor, looped: torch.Tensor) -> Optional[str]:
    if torch.allclose(batched, looped):
        return None
    return (f"batched through vmap, the result for {name} differs from one at a time by up to "
            f"{float((batched - looped).abs().max()):.3g}")


def _batched_vjp(y: torch.Tensor, xs: List[torch.Tensor], v: torch.Tensor) -> Tuple[Any, ...]:
    """Vector-Jacobian products for the rows of ``v`` in one batched call: through
    ``torch.func.vmap`` (which runs custom ops' and autograd.Functions' own vmap rules),
    else through ``is_grads_batched`` (torch's legacy batching, as torch's gradcheck);
    raises when neither can run the backward."""
    def vjp(g: torch.Tensor) -> Tuple[Any, ...]:
        grads = torch.autograd.grad(y, xs, g, retain_graph=True, allow_unused=True)
        return tuple(gr if gr is not None else torch.zeros_like(x) for gr, x in zip(grads, xs))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return torch.func.vmap(vjp)(v)
        except Exception:  # noqa: BLE001 - e.g. an autograd.Function without setup_context
            return torch.autograd.grad(y, xs, v, retain_graph=True, allow_unused=True,
                                       is_grads_batched=True)


def _check_batched_grad(t: _Target, opts: _Options, xs: List[torch.Tensor],
                        ys: List[torch.Tensor], col: _Collector) -> None:
    """``check_batched_grad``: vector-Jacobian products batched through vmap equal the
    same products one at a time, output by output."""
    gen = torch.Generator().manual_seed(opts.seed + 5)
    for o, y in enumerate(ys):
        if not y.requires_grad:
            continue
        v = _probe(gen, (2, *y.shape), y)
        looped = [torch.autograd.grad(y, xs, v[r], retain_graph=True, allow_unused=True) for r in (0, 1)]
        try:
            batched = _batched_vjp(y, xs, v)
        except Exception as e:  # noqa: BLE001 - vmap cannot run this backward: say so
            col.notes.append(f"check_batched_grad skipped for {t.out_names[o]}: vmap cannot run this "
                             f"backward ({_first_line(e)}); torch's gradcheck fails here")
            return
        for b, name in enumerate(t.names):
            exp = torch.stack([g[b] if g[b] is not None else torch.zeros_like(xs[b]) for g in looped])
            got = batched[b] if batched[b] is not None else torch.zeros_like(exp)
            bad = _batched_mismatch(f"{name} (output {t.out_names[o]})", got, exp)
            if bad:
                col.fail("check_batched_grad", bad)
                return


def _check_batched_forward_grad(t: _Target, opts: _Options, col: _Collector) -> None:
    """``check_batched_forward_grad``: Jacobian-vector products batched through vmap equal
    the same products one at a time (dual numbers), input by input."""
    import torch.autograd.forward_ad as fwAD

    gen = torch.Generator().manual_seed(opts.seed + 7)
    xs = [x.detach() for x in t.xs]
    for b, name in enumerate(t.names):
        def jvp(tan: torch.Tensor, b: int = b) -> Tuple[torch.Tensor, ...]:
            with fwAD.dual_level():
                duals = [fwAD.make_dual(x, tan) if i == b else x for i, x in enumerate(xs)]
                outs = [fwAD.unpack_dual(y) for y in t.call(duals)]
                return tuple(o.tangent if o.tangent is not None else torch.zeros_like(o.primal)
                             for o in outs)

        tans = _probe(gen, (2, *xs[b].shape), xs[b])
        looped = [torch.stack(shards) for shards in zip(*(jvp(tans[r]) for r in (0, 1)))]
        def functorch_jvp(tan: torch.Tensor, b: int = b) -> Tuple[torch.Tensor, ...]:
            return torch.func.jvp(lambda x: tuple(t.call([x if i == b else xi for i, xi in enumerate(xs)])),
                                  (xs[b],), (tan,))[1]

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                batched = torch.func.vmap(functorch_jvp)(tans)
        except Exception as e:  # noqa: BLE001 - vmap cannot run this function: say so
            col.notes.append(f"check_batched_forward_grad skipped: vmap cannot run this forward "
                             f"mode ({_first_line(e)}); torch's gradcheck fails here")
            return
        for o, (got, exp) in enumerate(zip(batched, looped)):
            bad = _batched_mismatch(f"output {t.out_names[o]} along {name}", got, exp)
            if bad:
                col.fail("check_batched_forward_grad", bad)
                return


# --------------------------------------------------------------------------- driver


def _run(t: _Target, opts: _Options) -> GradcheckResult:
    """The check of ``t`` (and of its gradients with ``second_order``), with the RNG
    states put back afterwards."""
    with torch.random.fork_rng(devices=_devices(t.xs)):
        result = _check_target(t, opts)
        if opts.second_order:
            result = _merge_second(result, _check_target(_second_order_target(t, opts.seed), opts))
    return result


def _devices(xs: Sequence[torch.Tensor]) -> List[int]:
    return sorted({x.device.index or 0 for x in xs if x.device.type == "cuda"})


def _check_target(t: _Target, opts: _Options) -> GradcheckResult:
    col = _Collector(opts)
    localised, evaluations = None, 0
    if opts.mode == "full":
        _run_full(t, opts, col)
    else:
        localised, evaluations = _run_fast_and_localise(t, opts, col)
    if t.skipped:
        col.notes.append(f"not checked (outputs that do not require grad): {', '.join(t.skipped)}")
    _further_checks(t, opts, col)
    rows = sorted(col.rows, key=_row_key) + col.kink_rows
    ok = not col.rows and not col.nondet and col.n_mismatched == 0 and not col.failed
    return GradcheckResult(
        ok=ok, mode=opts.mode, eps=opts.eps, atol=opts.atol, rtol=opts.rtol, dtype=t.xs[0].dtype,
        max_abs_err=col.max_abs, max_rel_err=col.max_rel, n_compared=col.n_compared,
        n_mismatched=col.n_mismatched, nondeterministic=col.nondet,
        nondet_spread=col.spread, nondet_tol=opts.nondet_tol, kinks=col.kinks,
        notes=col.notes, localised=localised, failed_checks=col.failed, rows=rows[:_TABLE_ROWS],
        n_evaluations=t.evaluations + evaluations, colours=t.colours)


def _run_fast_and_localise(t: _Target, opts: _Options, col: _Collector) -> Tuple[Optional[str], int]:
    """Fast mode; when projections of an input fail and its Jacobian is small enough,
    full mode on that input (the others held fixed) says which entries are wrong.
    Returns the inputs re-run that way (None: none) and their function evaluations."""
    failing = _run_fast(t, opts, col)
    col.n_mismatched = sum(failing.values())
    limit = min(opts.localise_entries, opts.max_entries)
    small = [b for b in failing if t.sizes[b] * t.m <= limit]
    for b, (mx_abs, mx_rel) in col.per_input.items():
        if b not in small:
            col.max_abs, col.max_rel = max(col.max_abs, mx_abs), max(col.max_rel, mx_rel)
    if not small:
        return None, 0
    sub_col, evaluations = _Collector(opts), 0
    for b in small:
        sub = _sub_target(t, b)
        _run_full(sub, opts, sub_col)
        evaluations += sub.evaluations
    localised = ", ".join(t.names[b] for b in small)
    names = {t.names[b] for b in small}
    col.rows = sub_col.rows + [r for r in col.rows if r["input"] not in names]
    col.n_mismatched = sum(c for b, c in failing.items() if b not in small) + sub_col.n_mismatched
    col.kink_rows += sub_col.kink_rows
    col.kinks += sub_col.kinks
    col.nondet |= sub_col.nondet
    col.spread = max(col.spread, sub_col.spread)
    col.max_abs = max(col.max_abs, sub_col.max_abs)
    col.max_rel = max(col.max_rel, sub_col.max_rel)
    col.n_compared += sub_col.n_compared
    if not sub_col.rows and sub_col.n_mismatched == 0:
        col.notes.append(f"fast-mode projections of {localised} disagreed, but full mode "
                         f"found every Jacobian entry within tolerance")
    return localised, evaluations


def _sub_target(t: _Target, b: int) -> _Target:
    """The same function as a function of input b only."""
    def fn(xs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        full = list(t.xs)
        full[b] = xs[0]
        return t.call(full)

    sub = _Target(fn, [t.xs[b]], [t.names[b]], t.seed, t.where)
    with torch.no_grad():
        sub.call([t.xs[b].detach()])
    sub.out_names, sub.out_shapes = t.out_names, t.out_shapes
    sub.in_complex, sub.out_complex = [t.in_complex[b]], t.out_complex
    return sub


def _second_order_target(t: _Target, seed: int,
                         grad_outputs: Optional[Sequence[torch.Tensor]] = None) -> _Target:
    """(x..., v...) -> v^T dJ/dx: gradients of the outputs, as a function to check; the
    output gradients v are ``grad_outputs`` (copies, complex ones as real views) or drawn
    from ``seed``. The gradients of complex inputs come out complex again."""
    gen = torch.Generator().manual_seed(seed + 1)
    x0 = t.xs[0]
    if grad_outputs is None:
        vs = [torch.randn(tuple(s), generator=gen, dtype=torch.float64).to(x0.device, x0.dtype)
              for s in t.out_shapes]
    else:
        vs = [(torch.view_as_real(g.detach()) if g.is_complex() else g.detach())
              .to(x0.device, x0.dtype).reshape(s).clone() for g, s in zip(grad_outputs, t.out_shapes)]
    nb = len(t.xs)
    flags = t.in_complex

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
        grads = [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, xs)]
        return [torch.view_as_complex(g.contiguous()) if c else g for g, c in zip(grads, flags)]

    names = t.names + [f"grad_{name}" for name in t.out_names]
    second = _Target(fn, list(t.xs) + vs, names, t.seed, t.where)
    second.in_complex = list(t.in_complex) + list(t.out_complex)
    return second


def _merge_second(first: GradcheckResult, second: GradcheckResult) -> GradcheckResult:
    for row in second.rows:
        row["check"] = "second_order" + ("" if row["check"] == "jacobian" else f"_{row['check']}")
    kink = "non-differentiable point"
    first.rows = sorted([r for r in first.rows + second.rows if r["note"] != kink], key=_row_key) \
        + [r for r in first.rows + second.rows if r["note"] == kink]
    first.rows = first.rows[:_TABLE_ROWS]
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
    first.failed_checks += [f"second order {c}" for c in second.failed_checks]
    if not second.ok:
        first.notes.append(f"second-order check (gradients of gradients) FAILED: "
                           f"{second.n_mismatched} mismatches, max abs err {second.max_abs_err:.3g}")
    return replace(first, _table=None)   # (a new result: its table is built from the merged rows)


# --------------------------------------------------------------------------- inputs


@dataclass
class _Arguments:
    """Copies of a call's arguments as pytree leaves (floating-point tensors converted to
    the check's dtype) and which leaves are checked. Names read like the code that reaches
    a leaf: ``input0``, ``input1['key']``, ``input2[0]``."""

    leaves: List[Any]
    spec: Any
    names: List[str]            # of every leaf
    positions: List[int]        # of the checked leaves
    flat: bool                  # every argument is a leaf (no pytree round trip)
    carriers: List["_Carrier"] = field(default_factory=list)   # of the checked leaves

    @property
    def checked(self) -> List[torch.Tensor]:
        """What the check perturbs: real dense tensors (`_Carrier.real`)."""
        return [c.real for c in self.carriers]

    @property
    def complex_flags(self) -> List[bool]:
        return [c.complex for c in self.carriers]

    @property
    def checked_names(self) -> List[str]:
        return [self.names[i] for i in self.positions]

    @property
    def floating_names(self) -> List[str]:
        return [n for n, x in zip(self.names, self.leaves)
                if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())]

    def rebuild(self, checked: Sequence[torch.Tensor]) -> Tuple[Any, ...]:
        """The arguments, with ``checked`` in place of the checked leaves."""
        args = list(self.leaves)
        for p, x, c in zip(self.positions, checked, self.carriers):
            args[p] = c.rebuild(x)
        return tuple(args) if self.flat else pytree.tree_unflatten(args, self.spec)


def _prepare(where: str, inputs: Tuple[Any, ...], dtype: Optional[torch.dtype],
             select: Callable[[str, torch.Tensor], bool], masked: bool = False) -> _Arguments:
    """Copy the leaves of the inputs (floating and complex tensors to ``dtype`` or its
    complex twin); pick those to check. A checked complex or sparse tensor is checked
    through a real dense carrier (`_Carrier`), rebuilt inside every call."""
    with_paths, spec = pytree.tree_flatten_with_path(inputs)
    names = [f"input{path[0].idx}{pytree.keystr(path[1:])}" for path, _ in with_paths]
    leaves: List[Any] = []
    positions: List[int] = []
    carriers: List[_Carrier] = []
    for i, (_, leaf) in enumerate(with_paths):
        if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex()):
            if select(names[i], leaf):
                positions.append(i)
                carrier = _Carrier.of(where, names[i], leaf, dtype, masked)
                carriers.append(carrier)
                leaf = carrier.dense
            elif leaf.layout == torch.strided:
                leaf = leaf.detach().to(dtype=_dtype_like(leaf, dtype), copy=True)
        leaves.append(leaf)
    flat = len(with_paths) == len(inputs) and all(len(path) == 1 for path, _ in with_paths)
    return _Arguments(leaves, spec, names, positions, flat, carriers)


def _dtype_like(x: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.dtype:
    """``dtype`` for a real ``x``, its complex twin for a complex one (None: x's own)."""
    if dtype is None:
        return x.dtype
    if x.is_complex():
        return {torch.float64: torch.complex128, torch.float32: torch.complex64,
                torch.float16: torch.complex32}.get(dtype, torch.complex128)
    return dtype


class _SparseLeaf(torch.autograd.Function):
    """A sparse tensor of the input's own pattern made from a dense carrier; backward hands
    the carrier the whole gradient (densified), as torch's gradcheck reads it."""

    @staticmethod
    def forward(ctx: Any, dense: torch.Tensor, carrier: "_Carrier") -> torch.Tensor:  # type: ignore[override]
        return carrier.with_pattern(dense)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:  # type: ignore[override]
        return (grad.to_dense() if grad.layout != torch.strided else grad), None


@dataclass
class _Carrier:
    """How a checked input travels: ``dense`` (the input as a dense tensor, the copy the
    function sees rebuilt) and ``real`` (what the check perturbs: ``dense`` itself, or
    ``view_as_real(dense)`` for a complex input, whose trailing dimension of 2 holds the
    real and imaginary parts). A sparse (COO or CSR) input is rebuilt in its layout: with
    its own pattern in the backward pass; for the finite differences with every element
    specified (``masked=False``: unspecified elements are zeros that count) or with its own
    pattern (``masked=True``: unspecified elements are not inputs), as torch does."""

    dense: torch.Tensor
    real: torch.Tensor
    complex: bool
    layout: Any = torch.strided
    index: Optional[Tuple[torch.Tensor, ...]] = None
    crow: Optional[torch.Tensor] = None
    masked: bool = False

    @classmethod
    def of(cls, where: str, name: str, leaf: torch.Tensor, dtype: Optional[torch.dtype],
           masked: bool) -> "_Carrier":
        layout, index, crow = leaf.layout, None, None
        x = leaf.detach()
        if layout == torch.sparse_coo:
            x = x.coalesce()
            index = tuple(x.indices())
        elif layout == torch.sparse_csr and x.dim() == 2:
            crow, col = x.crow_indices(), x.col_indices()
            rows = torch.repeat_interleave(torch.arange(x.shape[0], device=x.device), crow.diff())
            index = (rows, col)
        elif layout != torch.strided:
            raise NotImplementedError(
                f"{where}: {name} has layout {layout}{'' if layout != torch.sparse_csr else ' with batch dimensions'}; "
                f"supported: strided, sparse_coo and 2-D sparse_csr tensors")
        dense = (x.to_dense() if layout != torch.strided else x).to(_dtype_like(x, dtype), copy=True)
        real = torch.view_as_real(dense).clone() if dense.is_complex() else dense
        return cls(dense, real, dense.is_complex(), layout, index, crow, bool(masked))

    def rebuild(self, r: torch.Tensor) -> torch.Tensor:
        x = torch.view_as_complex(r) if self.complex else r
        if self.layout == torch.strided:
            return x
        if torch.is_grad_enabled() and x.requires_grad:
            return _SparseLeaf.apply(x, self)
        return self.with_pattern(x) if self.masked else self.fully_specified(x)

    def with_pattern(self, x: torch.Tensor) -> torch.Tensor:
        values = x[self.index]
        if self.layout == torch.sparse_coo:
            return torch.sparse_coo_tensor(torch.stack(self.index), values, x.shape,
                                           is_coalesced=True, check_invariants=False)
        return torch.sparse_csr_tensor(self.crow, self.index[1], values, x.shape,
                                       check_invariants=False)

    def fully_specified(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == torch.sparse_coo:
            sd = len(self.index)
            idx = torch.ones(x.shape[:sd], dtype=torch.int8, device=x.device).nonzero().T
            return torch.sparse_coo_tensor(idx, x.reshape(-1, *x.shape[sd:]), x.shape,
                                           is_coalesced=True, check_invariants=False)
        n_rows, n_cols = x.shape
        crow = torch.arange(n_rows + 1, device=x.device) * n_cols
        col = torch.arange(n_cols, device=x.device).repeat(n_rows)
        return torch.sparse_csr_tensor(crow, col, x.reshape(-1), x.shape, check_invariants=False)


def _warn_precision(xs: Sequence[torch.Tensor]) -> None:
    low = sorted({str(x.dtype).replace("torch.", "") for x in xs if x.dtype != torch.float64})
    if low:
        warnings.warn(
            f"gradcheck runs in {', '.join(low)}: finite differences in less than float64 "
            f"are too noisy to trust small errors; leave dtype=torch.float64 (the default)",
            PrecisionWarning, stacklevel=4)     # user -> public function -> _check_* -> here


def _check_function(where: str, fn: Any, inputs: Tuple[Any, ...], opts: _Options) -> GradcheckResult:
    """gradcheck of a callable: its inputs that require grad, on copies."""
    target, opts = _function_target(where, fn, inputs, opts)
    return _run(target, opts)


def _function_target(where: str, fn: Any, inputs: Tuple[Any, ...],
                     opts: _Options) -> Tuple["_Target", _Options]:
    """The target of a callable (its inputs that require grad, on copies) and the options
    resolved for its dtype."""
    if isinstance(fn, type) and issubclass(fn, torch.nn.Module):
        check_model(fn, where, "fn")                     # raises: instantiate it first
    if isinstance(fn, type) and issubclass(fn, torch.autograd.Function):
        raise GraddbgTypeError(f"{where}(fn=...): got the autograd.Function class {fn.__name__}; "
                               f"pass {fn.__name__}.apply")
    if not callable(fn):
        raise GraddbgTypeError(f"{where}(fn=...): got {type(fn).__name__}, expected a callable (a "
                               f"function, an autograd.Function's .apply or an nn.Module)")
    args = _prepare(where, inputs, opts.dtype, lambda name, x: x.requires_grad, bool(opts.masked))
    xs = args.checked
    if not xs:
        given = ", ".join(f"Tensor({v.dtype}, requires_grad={v.requires_grad})"
                          if isinstance(v, torch.Tensor) else type(v).__name__
                          for v in pytree.tree_leaves(inputs)) or "no inputs"
        raise GraddbgValueError(f"{where}: no input requires grad; give at least one "
                                f"floating-point tensor with requires_grad=True (got {given})")
    opts = opts.resolve(xs[0].dtype)
    _warn_precision(xs)
    target = _Target(lambda diff: fn(*args.rebuild(diff)), xs, args.checked_names, opts.seed, where)
    target.in_complex = args.complex_flags
    return target, opts


def _check_module(where: str, module: Any, inputs: Tuple[Any, ...], wrt: Any,
                  opts: _Options) -> GradcheckResult:
    """check_module: the parameters and inputs that ``wrt`` selects, on a copy."""
    if callable(module) and not isinstance(module, (type, torch.nn.Module)):
        raise GraddbgTypeError(f"{where}(module=...): must be a torch.nn.Module, got "
                               f"{type(module).__name__}; use gradcheck() for functions")
    module = unwrap(check_model(module, where, "module"))      # DDP, compiled: the user's module
    _refuse_sharded(where, module)
    params = [n for n, p in module.named_parameters() if p.requires_grad]
    want_params, want_inputs = _wrt(where, wrt, params)
    args = _prepare(where, inputs, opts.dtype, lambda n, x: want_inputs is None or n in want_inputs,
                    bool(opts.masked))
    unknown = sorted((want_inputs or set()) - set(args.checked_names))
    if unknown:
        raise GraddbgValueError(
            f"{where}: wrt names {unknown} are neither trainable parameters nor floating-point "
            f"inputs; parameters: {params[:20]}{' ...' if len(params) > 20 else ''}; inputs: "
            f"{args.floating_names}")
    mod = copy.deepcopy(module)
    if opts.dtype is not None:
        mod = mod.to(opts.dtype)
    own = dict(mod.named_parameters())
    p_names = [n for n in params if n in want_params]
    xs = [own[n].detach().clone() for n in p_names] + args.checked
    if not xs:
        raise GraddbgValueError(
            f"{where}: nothing to check for wrt={wrt!r}: the module has no trainable "
            f"parameters selected and no floating-point input was selected")
    opts = opts.resolve(xs[0].dtype)
    _warn_precision(xs)
    n_p = len(p_names)

    def call(diff: Sequence[torch.Tensor]) -> Any:
        return torch.func.functional_call(mod, dict(zip(p_names, diff[:n_p])),
                                          args.rebuild(diff[n_p:]))

    target = _Target(call, xs, p_names + args.checked_names, opts.seed, where)
    target.in_complex = [False] * n_p + args.complex_flags
    return _run(target, opts)


def _wrt(where: str, wrt: Any, params: List[str]) -> Tuple[set, Optional[set]]:
    """(parameter names, input names; None: every floating-point input) that ``wrt`` selects."""
    if isinstance(wrt, str):
        if wrt not in _WRT:
            raise GraddbgValueError(f"{where}: wrt={wrt!r} is not supported; use one of {_WRT} "
                                    f"or a list of parameter/input names")
        return (set(params) if wrt in ("all", "params") else set(),
                None if wrt in ("all", "inputs") else set())
    if not isinstance(wrt, (list, tuple, set, frozenset)) or not all(isinstance(w, str) for w in wrt):
        raise GraddbgTypeError(f"{where}: wrt must be 'all', 'params', 'inputs' or a list of "
                               f"names (str), got {wrt!r}")
    return {w for w in wrt if w in params}, {w for w in wrt if w not in params}


# --------------------------------------------------------------------------- public API


#: keywords only torch's gradcheck has: any of them makes a call torch-style (raising)
_TORCH_ONLY = ("fast_mode", "check_forward_ad", "check_sparse_nnz", "check_backward_ad",
               "check_undefined_grad", "check_grad_dtypes", "check_batched_grad",
               "check_batched_forward_grad", "masked", "raise_exception")


def _calling_convention(where: str, inputs: Tuple[Any, ...], options: Dict[str, Any],
                        n_tuples: int = 1) -> Tuple[Tuple[Any, ...], Tuple[Any, ...], bool]:
    """(inputs, the positional arguments after them, torch-style?) of a call. torch's
    convention, ``fn, inputs`` with ``inputs`` a tuple of arguments (or ``inputs=``), is
    recognised by a tuple as the only positional argument (gradgradcheck: followed by at
    most ``n_tuples - 1`` more, its ``grad_outputs``); a call with a keyword that only
    torch's gradcheck has is torch-style too. Otherwise the positional arguments are the
    inputs (graddbg's varargs form)."""
    if "inputs" in options:
        if inputs:
            raise GraddbgTypeError(f"{where}: got inputs both as positional arguments and as "
                                   f"inputs=; pass one of them")
        given = options.pop("inputs")
        return _as_tuple(given), (), True
    if 1 <= len(inputs) <= n_tuples and isinstance(inputs[0], tuple):
        return inputs[0], inputs[1:], True
    return inputs, (), any(k in options for k in _TORCH_ONLY)


def _as_tuple(x: Any) -> Tuple[Any, ...]:
    return x if isinstance(x, tuple) else tuple(x) if isinstance(x, list) else (x,)


def _verdict(where: str, result: GradcheckResult, raise_exception: Any) -> GradcheckResult:
    """``result``, or GradientMismatchError with its text when it failed and
    ``raise_exception`` is set."""
    if flag(where, "raise_exception", raise_exception) and not result.ok:
        raise GradientMismatchError(str(result), result)
    return result


@_options_in_signature
def gradcheck(fn: Callable[..., Any], *inputs: Any, **options: Any) -> GradcheckResult:
    """Compare the derivatives of ``fn`` at ``inputs`` with central finite differences.

    Two calling conventions. graddbg's: ``gradcheck(fn, x, y, mode="fast")`` returns a
    `GradcheckResult` (truthy when the check passed). torch's:
    ``gradcheck(fn, (x, y), fast_mode=True)`` (a tuple of inputs as the only positional
    argument, or ``inputs=``, or any keyword only torch's gradcheck has) takes every
    keyword of ``torch.autograd.gradcheck`` (torch 2.3 to 2.13) with its meaning and
    raises, as torch does, unless ``raise_exception=False`` (then the truthy result comes
    back). A function that takes one tuple argument is given it as ``((pair,),)``. In
    torch's form non-differentiable points fail the check, as in torch (``kinks="fail"``;
    the text still names them as such); pass ``kinks="allow"`` to let them pass.

    Differentiable inputs are the floating-point and complex tensors with
    ``requires_grad=True`` (dense, sparse COO or 2-D CSR), anywhere in ``inputs``
    (nested tuples, lists, dicts); every other argument passes through. ``fn`` may return
    a tensor or tuples/lists/dicts/dataclasses of tensors (integer outputs are ignored).
    Inputs are checked on float64 copies (complex128 for complex ones); ``dtype=None``
    keeps their dtype (below float64 it emits a ``PrecisionWarning``). Complex inputs and
    outputs are checked through their real and imaginary parts, the real-linear map torch
    checks as conjugate Wirtinger derivatives; the table names each entry's part. Sparse
    inputs: ``masked=False`` (default) perturbs every element, ``masked=True`` only the
    specified ones, against the densified gradient of the input's own pattern.

    ``mode="full"`` (``fast_mode=False``) checks every Jacobian entry (``max_entries``
    bounds its size; a sparse one is checked colour group by colour group,
    ``compress=True``; ``result.colours`` says whether it was); ``mode="fast"`` checks
    ``probes`` random projections per input and, on a failure, re-runs full mode on inputs
    with at most ``localise_entries`` Jacobian entries. ``forward_ad=True``
    (``check_forward_ad``) also checks forward mode; ``check_backward_ad=False`` checks
    forward mode only; ``second_order=True`` checks gradients of gradients (see also
    `gradgradcheck`). The backward pass runs twice: a difference beyond
    ``nondet_tol`` (default: the comparison tolerance) is reported as nondeterminism.
    Entries whose one-sided differences disagree, the analytic value being one of them,
    are non-differentiable points that pass unless ``kinks="fail"``. ``seed`` seeds the
    probes and the RNG the function sees. An ``nn.Module`` is checked as by
    `check_module`.

    As torch does, every check also runs backward with zero output gradients (the
    input gradients must be zero, of the input's dtype and shape) and, by default
    (``check_undefined_grad=True``), with undefined output gradients;
    ``check_grad_dtypes``, ``check_batched_grad`` and ``check_batched_forward_grad``
    (vmap against one at a time; skipped with a note where vmap cannot run the function)
    are off by default. A failed check is named in the text by torch's option name.

    Examples:
        Migrating from torch is a one-line change:

        >>> import torch, graddbg
        >>> x = torch.randn(3, dtype=torch.float64, requires_grad=True)
        >>> assert torch.autograd.gradcheck(torch.sin, (x,), fast_mode=True)
        >>> assert graddbg.gradcheck(torch.sin, (x,), fast_mode=True)

        graddbg's own form (inputs as arguments), a complex input, and a sort whose 500
        Jacobian columns are checked as one colour group:

        >>> bool(gradcheck(lambda t: t.exp().sum(), x))
        True
        >>> z = torch.randn(2, dtype=torch.complex128, requires_grad=True)
        >>> gradcheck(torch.exp, z, mode="fast").ok
        True
        >>> s = torch.randperm(500, dtype=torch.float64).requires_grad_()   # no near-ties
        >>> r = gradcheck(lambda t: t.sort().values, s)      # 500 columns in 1 colour group
        >>> r.ok, r.colours, r.n_evaluations, r.n_compared
        (True, 1, 2, 250000)

    Args:
        fn: the function (or ``nn.Module``) to check.
        *inputs: its arguments (graddbg's form), or one tuple of them (torch's form).
        **options: the keyword options below, graddbg's and torch's.

    Keyword Args:
        mode (str): ``"full"`` (the default: every Jacobian entry) or ``"fast"``
            (``probes`` random projections per input).
        eps (Optional[float]): the finite-difference step; None: from ``TOLERANCES`` for
            the dtype of the check.
        atol (Optional[float]): the absolute tolerance; None: from ``TOLERANCES``.
        rtol (Optional[float]): the relative tolerance; None: from ``TOLERANCES``.
        dtype (Optional[torch.dtype]): the dtype inputs are checked in (float64); None
            keeps theirs (below float64: a ``PrecisionWarning``).
        forward_ad (bool): also check forward-mode AD (False; torch: ``check_forward_ad``).
        second_order (bool): also check gradients of gradients (False).
        nondet_tol (Optional[float]): the difference between two backward passes reported
            as nondeterminism; None: the comparison tolerance.
        kinks (str): ``"allow"`` (graddbg's default) lets non-differentiable points pass;
            ``"fail"`` (torch's form) fails them.
        seed (int): seeds the probes and the RNG the function sees (0).
        probes (int): random projections per input in fast mode (2).
        max_entries (int): the largest Jacobian full mode checks (2**27 entries).
        localise_entries (int): on a fast-mode failure, re-run full mode on inputs with at
            most this many Jacobian entries (1,000,000).
        compress (bool): check a sparse Jacobian colour group by colour group (True).
        check_backward_ad (bool): check backward mode (True); False checks forward mode only.
        check_undefined_grad (bool): also run backward with undefined output gradients (True).
        check_grad_dtypes (bool): check the gradients' dtypes (False).
        check_batched_grad (bool): check vmap over backward against one at a time (False).
        check_batched_forward_grad (bool): the same for forward mode (False).
        masked (Optional[bool]): sparse inputs: perturb only the specified elements (True)
            or every element (False, the default; torch < 2.1: ``check_sparse_nnz``).
        fast_mode (bool): torch's spelling of ``mode="fast"``.
        raise_exception (Optional[bool]): raise `GradientMismatchError` when the check
            fails; None: raise in torch's form, return the result in graddbg's.

    Returns:
        GradcheckResult: ``ok``, a table of the mismatching entries, the errors; truthy
        when the check passed.

    Raises:
        GradientMismatchError: the check failed and ``raise_exception`` is set (torch's
            form by default); an AssertionError and a RuntimeError, like torch's
            GradcheckError.
        TypeError, ValueError: bad arguments (an unknown keyword, a bad value, no input
            that requires grad, an output that is not a tensor).

    """
    inputs, rest, torch_style = _calling_convention("gradcheck", inputs, options)
    raise_exception = options.pop("raise_exception", torch_style)
    if torch_style:
        options.setdefault("kinks", "fail")            # torch fails at kinks
    opts = _Options.parse("gradcheck", options, extra=("raise_exception", "inputs"))
    if isinstance(fn, torch.nn.Module):
        result = _check_module("gradcheck", fn, inputs, "all", opts)
    else:
        result = _check_function("gradcheck", fn, inputs, opts)
    return _verdict("gradcheck", result, raise_exception)


@_options_in_signature
def gradgradcheck(fn: Callable[..., Any], *inputs: Any, grad_outputs: Any = None,
                  gen_non_contig_grad_outputs: bool = False, check_fwd_over_rev: bool = False,
                  check_rev_over_rev: bool = True, **options: Any) -> GradcheckResult:
    """Check the second derivatives of ``fn``: `gradcheck` of ``(x..., v...) ->
    v^T J(x)``, a drop-in for ``torch.autograd.gradcheck.gradgradcheck``.

    The output gradients ``v`` are ``grad_outputs`` (torch's third positional argument) or
    drawn from ``seed``, and are checked as inputs too, as torch does. Reverse over
    reverse (``check_rev_over_rev``, on) differentiates the gradients by backward; forward
    over reverse (``check_fwd_over_rev``) by forward mode. Complex and sparse inputs,
    ``fast_mode``/``mode``, ``raise_exception`` and the other options as in
    `gradcheck`; ``gen_non_contig_grad_outputs`` is accepted (the drawn output
    gradients are copies whatever their layout).

    Examples:
        >>> import torch, graddbg
        >>> x = torch.randn(3, dtype=torch.float64, requires_grad=True)
        >>> assert graddbg.gradgradcheck(torch.tanh, (x,), check_fwd_over_rev=True)

    Args:
        fn: the function to check (an ``nn.Module`` is called as a function).
        *inputs: its arguments, or torch's ``inputs`` tuple (then optionally
            ``grad_outputs`` positionally after it).
        grad_outputs: a tensor or tuple of tensors, one per differentiable output.
        gen_non_contig_grad_outputs: accepted for torch's sake.
        check_fwd_over_rev: also check forward-over-reverse second derivatives.
        check_rev_over_rev: check reverse-over-reverse second derivatives.
        **options: as `gradcheck` (not ``forward_ad``/``check_forward_ad``/
            ``check_backward_ad``/``second_order``: use the two above).

    Returns:
        GradcheckResult: of the second-order check (rows name ``grad_<output>`` for the
        output gradients), truthy when it passed.

    Raises:
        GradientMismatchError: the check failed and ``raise_exception`` is set.
        TypeError, ValueError: bad arguments.
    """
    where = "gradgradcheck"
    inputs, rest, torch_style = _calling_convention(where, inputs, options, n_tuples=2)
    if rest:
        if grad_outputs is not None:
            raise GraddbgTypeError(f"{where}: grad_outputs given twice (positionally and by name)")
        grad_outputs = rest[0]
    raise_exception = options.pop("raise_exception", torch_style)
    if torch_style:
        options.setdefault("kinks", "fail")            # torch fails at kinks
    clash = sorted({"forward_ad", "check_forward_ad", "check_backward_ad", "second_order"} & set(options))
    if clash:
        raise GraddbgTypeError(f"{where}: {clash} do not apply; use check_fwd_over_rev= and "
                               f"check_rev_over_rev=")
    flag(where, "gen_non_contig_grad_outputs", gen_non_contig_grad_outputs)
    opts = _Options.parse(where, {**options, "forward_ad": flag(where, "check_fwd_over_rev", check_fwd_over_rev),
                                  "check_backward_ad": flag(where, "check_rev_over_rev", check_rev_over_rev)},
                          extra=("raise_exception", "inputs", "grad_outputs",
                                 "gen_non_contig_grad_outputs", "check_fwd_over_rev", "check_rev_over_rev"))
    t, opts = _function_target(where, fn, inputs, opts)
    gos = None if grad_outputs is None else _as_tuple(grad_outputs)
    with torch.random.fork_rng(devices=_devices(t.xs)):
        _forward(t)
        if gos is not None and len(gos) != len(t.out_shapes):
            raise GraddbgValueError(f"{where}: {len(gos)} grad_outputs for {len(t.out_shapes)} "
                                    f"differentiable outputs ({', '.join(t.out_names)})")
        result = _check_target(_second_order_target(t, opts.seed, gos), opts)
    return _verdict(where, result, raise_exception)


def _refuse_sharded(where: str, module: torch.nn.Module) -> None:
    """Finite differences need the whole module in one process: a module whose parameters
    are DTensors (FSDP2's fully_shard, HSDP, tensor parallel) is refused with what to pass."""
    sharded = [n for n, p in module.named_parameters() if is_dtensor(p)]
    if sharded:
        raise GraddbgValueError(
            f"{where}(module=...): {type(module).__name__} holds sharded (DTensor) parameters, e.g. "
            f"{sharded[0]!r} ({len(sharded)} in all), from fully_shard / HSDP / tensor parallelism; finite "
            f"differences need the whole module in one process. Check the module before sharding it (the "
            f"same class built on one process), or one of its layers built unsharded with the same "
            f"weights (parameters' .full_tensor()).")


@_options_in_signature
def check_module(module: torch.nn.Module, *inputs: Any,
                 wrt: Union[str, Sequence[str]] = "all", **options: Any) -> GradcheckResult:
    """Check a module's gradients w.r.t. its parameters and/or inputs, on a copy.

    A DDP, DataParallel or ``torch.compile`` wrapper is checked as the module it wraps.
    The module is deep-copied and converted to float64 (the ``dtype`` keyword, as in
    `gradcheck`) and called through ``torch.func.functional_call``: the module and tensors
    passed in are never changed. A failed check is a falsy result, not an exception.

    Args:
        module: the ``nn.Module`` to check (not sharded: its parameters must not be
            DTensors).
        *inputs: the module's positional arguments; floating-point tensors among them
            (nested in tuples, lists, dicts) are checked when ``wrt`` selects inputs,
            whether or not they require grad.
        wrt: ``"params"`` (parameters with ``requires_grad``), ``"inputs"`` (every
            floating-point tensor in ``inputs``), ``"all"`` (both), or a list of names
            (parameter names as ``named_parameters()`` gives them, inputs as ``input0``,
            ``input1['key']``...).
        **options: the keyword options of `gradcheck`, each with its type and default in
            its Keyword Args (the tolerances ``eps``/``atol``/``rtol``, ``mode``, ``dtype``,
            ``forward_ad``, ``second_order``, ``kinks``, torch's ``check_*`` switches, ...),
            except ``raise_exception`` and ``fast_mode``.

    Returns:
        GradcheckResult: ``ok``, a table of the mismatching entries (parameters by name),
            the errors; truthy when the check passed.

    Raises:
        GraddbgTypeError: ``module`` is not an ``nn.Module`` instance (a function: use
            `gradcheck`), ``wrt`` is neither a string nor a list of strings, or an unknown
            keyword or a value of the wrong type.
        GraddbgValueError: an unsupported ``wrt`` string, ``wrt`` names that are neither
            trainable parameters nor floating-point inputs, nothing selected to check, a
            module holding sharded (DTensor) parameters, or a bad option value (such as
            an unknown ``mode``).

    Examples:
        >>> import torch
        >>> lin = torch.nn.Linear(3, 2)
        >>> r = check_module(lin, torch.randn(4, 3))
        >>> r.ok, lin.weight.dtype
        (True, torch.float32)
    """
    opts = _Options.parse("check_module", options, extra=("wrt",))
    return _check_module("check_module", module, inputs, wrt, opts)


@_options_in_signature
def assert_gradients_close(fn_or_module: Union[Callable[..., Any], torch.nn.Module],
                           *inputs: Any, wrt: Union[str, Sequence[str], None] = None,
                           **options: Any) -> None:
    """Check gradients as a test assertion: raise with the result's text on failure.

    Runs `gradcheck` on a function (graddbg's calling form: the inputs are its arguments),
    or `check_module` on an ``nn.Module``.

    Args:
        fn_or_module: the function, or the ``nn.Module`` (checked on a copy).
        *inputs: the arguments of the function or the module; a function is checked
            w.r.t. every input that requires grad.
        wrt: for a module, what to check as in `check_module` (None: ``"all"``); must be
            None for a function.
        **options: the keyword options of `gradcheck`, each with its type and default in
            its Keyword Args (the tolerances ``eps``/``atol``/``rtol``, ``mode``, ``dtype``,
            ``forward_ad``, ``second_order``, ``kinks``, torch's ``check_*`` switches, ...),
            except ``raise_exception`` and ``fast_mode``.

    Returns:
        None: the check passed.

    Raises:
        GradientMismatchError: the check failed (an ``AssertionError``; the message is the
            result's text, the result is its ``.result``).
        GraddbgTypeError: ``fn_or_module`` is not callable, ``wrt`` is given with a
            function or is neither a string nor a list of strings, or an unknown keyword
            or a value of the wrong type.
        GraddbgValueError: a bad option value, nothing to check (no input requires grad,
            or nothing that ``wrt`` selects), or a module holding sharded parameters.

    Examples:
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
    where = "assert_gradients_close"
    opts = _Options.parse(where, options, extra=("wrt",))
    if isinstance(fn_or_module, torch.nn.Module):
        result = _check_module(where, fn_or_module, inputs, "all" if wrt is None else wrt, opts)
    elif wrt is not None:
        raise GraddbgTypeError(f"{where}: wrt={wrt!r} selects parameters or inputs of an "
                               f"nn.Module, but fn_or_module is a {type(fn_or_module).__name__}; "
                               f"a function is checked w.r.t. every input that requires grad")
    else:
        result = _check_function(where, fn_or_module, inputs, opts)
    if not result.ok:
        raise GradientMismatchError(str(result), result)


# ``graddbg.gradcheck`` is the function above, as ``torch.autograd.gradcheck`` is a function
# that shadows its module: ``graddbg/__init__.py`` imports this module while the package
# itself is imported, so its ``gradcheck`` attribute is bound to the function before any
# ``import graddbg.gradcheck`` could bind it to this module (the import system does that
# only on a module's first import, after its code has run: code here could not undo it).
# The module stays reachable as ``sys.modules["graddbg.gradcheck"]`` and through
# ``from graddbg.gradcheck import check_module``.
