"""The norm and the largest magnitude of a CPU gradient, each in one BLAS call.

PyTorch's x86 wheels carry Intel's MKL inside ``libtorch_cpu``; its ``snrm2`` / ``dnrm2``
(a scaled L2 norm: exact from 1e-26 to 1e20 in float32, and NaN or Inf when an entry is)
and ``isamax`` / ``idamax`` (the index of the largest magnitude) each read a vector once
at memory speed. PyTorch exposes neither: its ``aminmax`` and ``vector_norm`` are 1.7-2×
slower on the same data, and each call through the dispatcher costs more than the work on
a small tensor. Calling them through ``ctypes`` reads a watched model's gradients at the
cost of one ``torch._foreach_norm``, and hands back plain floats: on the CPU there is
nothing to synchronise.

For short vectors (below ``_KEEP_GIL`` elements: the layers of a model of many small
ones) the same functions are bound a second time to keep the GIL during the call, and up
to ``_LANGE_MAX`` elements the largest magnitude comes from LAPACK's ``slange``/``dlange``
with norm 'M', which returns the value itself: inside a training step, where every call
meets cold caches, this reads 130 small gradients in about three quarters of the time of
one ``torch._foreach_norm``.

The functions are found by name (MKL's, then the Fortran BLAS names) in the libraries
that torch itself loaded, and checked against torch on known vectors (sizes, signs, the
whole float range, NaN and Inf) the first time they are asked for. Anything missing or
wrong, and the callers use torch's own kernels instead (without a working ``?lange``,
isamax serves the short vectors too). ``GRADDBG_BLAS=0`` turns this off.
"""
from __future__ import annotations

import ctypes
import glob
import math
import os
import sys
import threading
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["Blas", "Layout", "Reduced", "blas"]

# symbol names per library flavour: (snrm2, isamax, dnrm2, idamax, saxpy, daxpy), Fortran
# calling convention (every argument by pointer)
_NAMES = (
    ("mkl_blas_snrm2", "mkl_blas_isamax", "mkl_blas_dnrm2", "mkl_blas_idamax", "mkl_blas_saxpy", "mkl_blas_daxpy"),
    ("snrm2_", "isamax_", "dnrm2_", "idamax_", "saxpy_", "daxpy_"),
)
# LAPACK's largest-magnitude norm (``?lange`` with norm 'M') of each flavour: (slange,
# dlange). Optional: without it the small vectors' largest magnitude comes from iamax too.
_LANGE = {"mkl_blas_snrm2": ("mkl_lapack_slange", "mkl_lapack_dlange"),
          "snrm2_": ("slange_", "dlange_")}
# the BLAS integer may be 32 bits wide (LP64): pass lengths below 2**31 only
_CHUNK = (1 << 31) - 1
# Vectors shorter than this are read by calls that keep the GIL (bound through
# ``ctypes.PyDLL``): inside a training step, letting go of the GIL and taking it back
# costs more than the work on a small gradient. Longer ones let other threads run.
_KEEP_GIL = 1 << 16
# Up to this length the largest magnitude is ``?lange('M')``'s answer, one call that
# returns the value (reading the value at isamax's index is a ctypes object and some
# Python, which inside a step cost more than the work); longer vectors use isamax, which
# reads them twice as fast (warm, per call: 0.35 against 0.50 µs at 64 entries, 0.70
# against 0.64 at 4,096, 6.1 against 3.5 at 65,535).
_LANGE_MAX = 1 << 13

_lock = threading.Lock()
_state: List[Any] = []  # [] before the first look, then [Blas or None]


class Reduced(NamedTuple):
    """What :meth:`Blas.reduce_all` found."""

    norms: Optional[List[float]]
    maxes: Optional[List[float]]
    grads: List[Optional[Tensor]]
    #: every norm finite (then ``maxes`` came from isamax or ?lange: nothing needs a second look)
    finite: bool
    #: the sum of the squared norms, in double precision
    sumsq: float
    #: every gradient present
    complete: bool


class Blas:
    """Bound ``nrm2`` and ``iamax`` for float32 and float64 (see the module docstring)."""

    def __init__(self, snrm2: Any, isamax: Any, dnrm2: Any, idamax: Any, saxpy: Any, daxpy: Any,
                 where: str, small: Optional[Sequence[Any]] = None,
                 lange: Optional[Sequence[Any]] = None) -> None:
        """The functions of one library; ``small``: its (snrm2, isamax, dnrm2, idamax) bound
        to keep the GIL, for vectors shorter than ``_KEEP_GIL``; ``lange``: its (slange,
        dlange), bound to keep the GIL, or None."""
        small = tuple(small) if small is not None else (snrm2, isamax, dnrm2, idamax)
        for f32, f64 in ((snrm2, dnrm2), small[0::2]) + ((tuple(lange),) if lange is not None else ()):
            f32.restype, f64.restype = ctypes.c_float, ctypes.c_double
        for fn in (isamax, idamax) + small[1::2]:
            fn.restype = ctypes.c_int64
        saxpy.restype = daxpy.restype = None
        # dtype -> (nrm2, iamax, element ctype, element size): for any length
        self._fns = {torch.float32: (snrm2, isamax, ctypes.c_float, 4),
                     torch.float64: (dnrm2, idamax, ctypes.c_double, 8)}
        # dtype -> (nrm2, iamax, element ctype, element size, lange or None): short vectors
        self._small = {torch.float32: (small[0], small[1], ctypes.c_float, 4, lange[0] if lange else None),
                       torch.float64: (small[2], small[3], ctypes.c_double, 8, lange[1] if lange else None)}
        self._norm_m = ctypes.byref(ctypes.c_char(b"M"))
        self._work = ctypes.byref((ctypes.c_double * 2)())  # (?lange reads no work space for 'M')
        self._char_len = ctypes.c_size_t(1)  # (the hidden length of a Fortran character argument)
        # dtype -> (axpy, a pointer to -1 in the dtype): y <- y - x
        self._axpy = {torch.float32: (saxpy, ctypes.byref(ctypes.c_float(-1.0))),
                      torch.float64: (daxpy, ctypes.byref(ctypes.c_double(-1.0)))}
        self._one = ctypes.byref(ctypes.c_int64(1))
        self.where = where

    def __reduce__(self) -> Any:
        # (a watched model deep-copies and pickles with whatever its hooks reach: the
        # ctypes functions do not, the process's one binding does)
        return blas, ()

    def entry(self, dtype: torch.dtype, n: int) -> tuple:
        """What :meth:`reduce_all` needs for a vector of ``n`` elements of ``dtype``:
        ``(dtype, n, pointer to n or None beyond a 32-bit length, nrm2, iamax, element
        ctype, element size, lange or None)``."""
        if n < _KEEP_GIL:
            fns = self._small[dtype] if n <= _LANGE_MAX else self._small[dtype][:4] + (None,)
        else:
            fns = self._fns[dtype] + (None,)
        return (dtype, n, ctypes.byref(ctypes.c_int64(n)) if n <= _CHUNK else None) + fns

    def layout(self, params: Sequence[Tensor]) -> Optional["Layout"]:
        """What :meth:`reduce_all` needs per parameter, worked out once; None unless every
        parameter is a float32/float64 CPU tensor."""
        if any(p.dtype not in self._fns or p.device.type != "cpu" for p in params):
            return None
        # (a gradient has its parameter's size, dtype and device: torch checks that)
        return Layout([(p.dtype, tuple(p.shape)) for p in params])

    def reduce_all(self, grads: Sequence[Any], layout: "Layout", of_params: bool = False,
                   want_max: bool = True) -> "Reduced":
        """Norms and largest magnitudes (NaN for a missing or empty gradient) of the
        gradients of the parameters that :meth:`layout` described, with the gradients
        themselves, whether every norm is finite and the sum of their squares; see
        :class:`Reduced`. ``grads`` are the gradients, or the parameters themselves with
        ``of_params=True`` (their ``.grad`` is read in the same loop). ``norms`` and
        ``maxes`` are None when one gradient is not :meth:`eligible` (the caller then
        uses torch); ``want_max=False`` leaves the largest magnitudes NaN (no ``iamax``
        or ``?lange``). The loop of :meth:`norm_absmax`, written out: on a model of many
        small layers the Python around each call is most of the cost. (Stacking tiny
        tensors of one shape for a few torch kernels instead was measured slower inside
        a training step, where each launch is cold.)"""
        nan, inf = math.nan, math.inf
        P = len(layout)
        norms: List[float] = [nan] * P
        maxes: List[float] = [nan] * P
        # every gradient first, in one tight loop: inside a training step each is a cache
        # miss, and a short loop overlaps them (measured: 30-70 µs less over 130 gradients)
        seen: List[Optional[Tensor]] = [x.grad for x in grads] if of_params else list(grads)
        finite = complete = True
        sq = 0.0
        one, voidp, norm_m, work, char_len = self._one, ctypes.c_void_p, self._norm_m, self._work, self._char_len
        try:
            for k, (g, (dtype, n, pn, nrm2, iamax, ctype, size, lange)) in enumerate(zip(seen, layout)):
                if g is None or n == 0:
                    complete = complete and g is not None
                    continue
                # (no layout check: data_ptr() raises for every layout but strided)
                if type(g) is not Tensor or g.dtype is not dtype or not g.is_contiguous():
                    return _refused(seen)
                if pn is None:  # beyond a 32-bit BLAS length
                    a, b = self.norm_absmax(g)
                    norms[k], maxes[k] = a, b
                    finite = finite and math.isfinite(a)
                    sq += a * a
                    continue
                ptr = g.data_ptr()
                vp = voidp(ptr)  # (one object per call: the long calls let other threads run)
                norm = nrm2(pn, vp, one)
                if not want_max:
                    finite = finite and norm == norm and norm != inf
                elif norm == norm and norm != inf:  # every entry finite
                    if lange is not None:
                        maxes[k] = lange(norm_m, pn, one, vp, pn, work, char_len)
                    else:
                        i = (iamax(pn, vp, one) & 0xFFFFFFFF) - 1
                        if not 0 <= i < n:  # (never, for a BLAS that passed the self-test)
                            return _refused(seen)
                        amax = ctype.from_address(ptr + size * i).value
                        maxes[k] = amax if amax >= 0 else -amax
                else:  # isamax may step over a NaN; only torch's max is sure to see it (rare)
                    maxes[k] = float(g.detach().abs().max())
                    finite = False
                norms[k] = norm
                sq += norm * norm
        except RuntimeError:  # a sparse, mkldnn, ... gradient: no data pointer
            return _refused(seen)
        return Reduced(norms, maxes, seen, finite, sq, complete)

    def snapshot(self, params: Sequence[Tensor], layout: "Layout",
                 buf: Optional[Tensor] = None) -> Optional[Tensor]:
        """A copy of ``params`` (the parameters :meth:`layout` described) in one byte
        buffer (``buf`` when given, of ``layout.nbytes``), each copied with one
        ``memmove``; None when one is not a dense contiguous tensor of its described size
        and dtype (the caller then clones)."""
        if buf is None:
            buf = torch.empty(layout.nbytes, dtype=torch.uint8)
        base = buf.data_ptr()
        for p, (dtype, n, *_), off in zip(params, layout, layout.offsets):
            if not self._readable(p, dtype, n):
                return None
            if n:
                ctypes.memmove(base + off, p.data_ptr(), n * p.element_size())
        return buf

    def update_norms(self, snap: Tensor, params: Sequence[Tensor],
                     layout: "Layout") -> Optional[Tuple[List[float], List[float]]]:
        """``(||w_old||, ||w_old - w_new||)`` per parameter, from a :meth:`snapshot` taken
        before the optimizer's step and the parameters now; the snapshot becomes the
        difference. None when a parameter can no longer be read here (the caller then
        uses torch on :meth:`Layout.views` of the snapshot)."""
        base = snap.data_ptr()
        one, voidp = self._one, ctypes.c_void_p
        old_norms: List[float] = []
        diff_norms: List[float] = []
        for p, (dtype, n, pn, nrm2, *_), off in zip(params, layout, layout.offsets):
            if not self._readable(p, dtype, n) or (n and pn is None):
                return None
            if not n:
                old_norms.append(0.0)
                diff_norms.append(0.0)
                continue
            axpy, minus_one = self._axpy[dtype]
            old = voidp(base + off)
            old_norms.append(nrm2(pn, old, one))
            axpy(pn, minus_one, voidp(p.data_ptr()), one, old, one)
            diff_norms.append(nrm2(pn, old, one))
        return old_norms, diff_norms

    @staticmethod
    def _readable(t: Tensor, dtype: torch.dtype, n: int) -> bool:
        return (isinstance(t, Tensor) and t.is_cpu and t.layout is torch.strided and t.dtype is dtype
                and t.numel() == n and t.is_contiguous())

    def eligible(self, t: Tensor) -> bool:
        """Whether ``t`` can be read here: a plain dense contiguous CPU float32/float64
        tensor (not a subclass such as a fake or distributed tensor)."""
        return (type(t) is Tensor and t.is_cpu and t.dtype in self._fns and t.layout == torch.strided
                and t.is_contiguous())

    def norm_absmax(self, t: Tensor) -> Tuple[float, float]:
        """``(L2 norm, max |t|)`` of an :meth:`eligible` tensor with at least one element.
        NaN norm when an entry is NaN, Inf when an entry is Inf (or the norm is beyond the
        dtype's range); the largest magnitude is then torch's (NaN-propagating) one."""
        nrm2, iamax, ctype, size = self._fns[t.dtype]
        n = t.numel()
        ptr = t.data_ptr()
        norm = amax = 0.0
        for start in range(0, n, _CHUNK):  # (one piece, unless beyond a 32-bit BLAS length)
            k = min(_CHUNK, n - start)
            p = ptr + size * start
            pk = ctypes.byref(ctypes.c_int64(k))
            part = nrm2(pk, ctypes.c_void_p(p), self._one)
            norm = part if start == 0 else math.hypot(norm, part)
            i = (iamax(pk, ctypes.c_void_p(p), self._one) & 0xFFFFFFFF) - 1
            if not 0 <= i < k:
                raise RuntimeError(f"graddbg: {self.where} returned index {i} for a vector of {k}")
            amax = max(amax, abs(ctype.from_address(p + size * i).value))
        if not math.isfinite(norm):
            # isamax may step over a NaN; only torch's max is sure to see it (rare steps)
            amax = float(t.detach().abs().max())
        return norm, amax


def _refused(grads: List[Optional[Tensor]]) -> Reduced:
    """reduce_all's answer when it stops at a gradient it cannot read: every gradient
    (``grads``, read already), no statistics."""
    return Reduced(None, None, grads, False, math.nan, all(g is not None for g in grads))


class Layout(list):
    """Per parameter: dtype, numel, a pointer to the numel for BLAS, and the functions.
    Pickles and deep-copies as the (dtype, shape) pairs it was built from (the ctypes
    objects do neither, and a watched model's hooks reach it)."""

    def __init__(self, specs: List[Tuple[torch.dtype, Tuple[int, ...]]]) -> None:
        self.specs = [(dtype, tuple(shape)) for dtype, shape in specs]
        #: where each parameter lies in a snapshot buffer (bytes, 64-aligned), and its size
        self.offsets: List[int] = []
        self.nbytes = 0
        for dtype, shape in self.specs:
            self.offsets.append(self.nbytes)
            self.nbytes += -(-math.prod(shape) * dtype.itemsize // 64) * 64
        b = blas()
        # (unpickled where no BLAS could be bound: empty, and unused, since the plan's
        # binding unpickles as None there too)
        super().__init__([] if b is None else [
            b.entry(dtype, n) for dtype, n in ((d, math.prod(shape)) for d, shape in self.specs)])

    def views(self, snap: Tensor) -> List[Tensor]:
        """The parameters' copies in a snapshot buffer, as tensors of their shapes."""
        return [snap[off: off + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                for (dtype, shape), off in zip(self.specs, self.offsets)]

    def __reduce__(self) -> Any:
        return Layout, (self.specs,)


def _libraries() -> List[str]:
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    found = sorted(glob.glob(os.path.join(lib, "libtorch_cpu.*")))
    for d in (lib, os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "torch.libs")):
        found += sorted(glob.glob(os.path.join(d, "lib*blas*.so*")))
    return found


def _bind() -> Optional[Blas]:
    if os.environ.get("GRADDBG_BLAS", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if sys.byteorder != "little":  # lengths are passed as 64-bit integers to a maybe-32-bit BLAS
        return None
    for path in _libraries():
        try:
            lib, keeps_gil = ctypes.CDLL(path), ctypes.PyDLL(path)
        except OSError:
            continue
        for names in _NAMES:
            try:
                fns = [getattr(lib, n) for n in names]
                small = [getattr(keeps_gil, n) for n in names[:4]]
            except AttributeError:
                continue
            try:
                lange: Optional[List[Any]] = [getattr(keeps_gil, n) for n in _LANGE[names[0]]]
            except (AttributeError, KeyError):  # (not exported, or no name known for this flavour)
                lange = None
            for with_lange in ((lange, None) if lange is not None else (None,)):
                cand = Blas(*fns, where=f"{os.path.basename(path)}:{names[0]}", small=small, lange=with_lange)
                try:
                    ok = _self_test(cand)
                except Exception:
                    ok = False
                if ok:
                    return cand
    return None


def _padded(x: Tensor) -> Tensor:
    """``x`` at the start of a buffer 4x its size plus a page: a binding that reads or
    writes wider elements than it was given (a wrong calling convention) stays inside
    memory we own during the self-test."""
    buf = torch.zeros(4 * x.numel() + 4096, dtype=x.dtype)
    buf[: x.numel()] = x
    return buf[: x.numel()]


def _self_test(b: Blas) -> bool:
    """Compare with torch on vectors that catch a wrong calling convention or width, an
    unscaled norm, a sign error, an off-by-one index and a NaN stepped over."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        for n in (1, 5, 1000, 70001):
            x = torch.randn(n, generator=g, dtype=dtype)
            k = (n * 2) // 3
            x[k] = -7.5 if n > 1 else x[k]
            norm, amax = b.norm_absmax(_padded(x))
            ref = torch.linalg.vector_norm(x.double()).item()
            if abs(norm - ref) > 1e-5 * ref or amax != float(x.abs().max()):
                return False
        for v in (1e-26, 1e20):
            x = _padded(torch.full((1000,), v, dtype=dtype))
            norm, amax = b.norm_absmax(x)
            if abs(norm - v * math.sqrt(1000)) > 1e-5 * v * math.sqrt(1000) or amax != float(x[0]):
                return False
        x = _padded(torch.randn(1000, generator=g, dtype=dtype))
        y = _padded(torch.randn(1000, generator=g, dtype=dtype))
        ref = y - x
        axpy, minus_one = b._axpy[dtype]
        axpy(ctypes.byref(ctypes.c_int64(1000)), minus_one, ctypes.c_void_p(x.data_ptr()), b._one,
             ctypes.c_void_p(y.data_ptr()), b._one)
        if not torch.equal(y, ref):
            return False
        for bad in (math.nan, math.inf, -math.inf):
            for pos in (0, 500, 999):
                x = torch.ones(1000, dtype=dtype)
                x[pos] = bad
                norm, amax = b.norm_absmax(_padded(x))
                if math.isfinite(norm) or math.isnan(norm) != math.isnan(bad) or not (
                        math.isnan(amax) if math.isnan(bad) else amax == math.inf):
                    return False
        # the short vectors' functions (the GIL kept, ?lange's largest magnitude), through
        # reduce_all: sizes, the largest magnitude first, inside and last, negative,
        # subnormal and near the top of the range; NaN and Inf
        tiny, huge = (3e-39, 3e38) if dtype == torch.float32 else (1e-310, 1e308)
        xs = []
        for n in (1, 5, 1000, 4099, _LANGE_MAX + 7):
            for k in sorted({0, (2 * n) // 3, n - 1}):
                x = torch.randn(n, generator=g, dtype=dtype)
                x[k] = -9.25 if k % 2 else 9.25
                xs.append(x)
        xs += [torch.full((333,), tiny, dtype=dtype), torch.full((7,), -huge, dtype=dtype)]
        xs[-2][100] = -2 * tiny
        xs += [torch.ones(64, dtype=dtype) * bad for bad in (math.nan, math.inf)]
        padded = [_padded(x) for x in xs]
        got = b.reduce_all(padded, [b.entry(dtype, x.numel()) for x in xs])
        if got.norms is None or got.finite:
            return False
        for x, norm, amax in zip(xs, got.norms, got.maxes):
            ref_max = float(x.abs().max())
            scale = ref_max if 0 < ref_max < math.inf else 1.0  # (no underflow in the reference)
            ref_norm = torch.linalg.vector_norm(x.double() / scale).item() * scale
            if ref_norm > torch.finfo(dtype).max:
                if norm != math.inf:  # (beyond the dtype: the caller recomputes it)
                    return False
            elif math.isfinite(ref_norm) and not abs(norm - ref_norm) <= 1e-5 * ref_norm:
                return False
            if not (amax == ref_max or (math.isnan(amax) and math.isnan(ref_max))):
                return False
    return True


def blas() -> Optional[Blas]:
    """The checked BLAS functions, or None where there are none (looked up once)."""
    if not _state:
        with _lock:
            if not _state:
                _state.append(_bind())
    return _state[0]
