"""``watch()``: hooks that record gradient statistics and catch anomalies while you train.

Every hook goes through one :class:`HookSet` and is removed on exit, whether the body
returned or raised. Nothing is stored on the user's modules or tensors: results live in
the :class:`Watch`, keyed by qualified parameter name.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np  # (torch imports numpy itself)
import torch
from torch import Tensor, nn

from graddbg._errors import CompileWarning, CoverageWarning, GradientAnomalyError, GraddbgWarning, NonFiniteError
from graddbg.anomaly import Anomaly, AnomalyWarning, Explode, NonFinite, Vanish, as_detector
from graddbg.stats import (
    DEFAULT_STATS,
    HIST_EDGES,
    History,
    StatPlan,
    StepRecord,
    histogram_counts,
    module_of,
    named_trainable_parameters,
    validate_stats,
)

__all__ = ["HookSet", "Watch", "watch"]

# The default of watch(update_every=): the update/weight ratio needs a copy of every weight,
# which is slow to reach again when taken rarely (see watch's docstring for the cost)
_UPDATE_EVERY = 200

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


class HookSet:
    """Owns hook handles: every handle added here is removed by :meth:`remove_all`.

    >>> hs = HookSet()
    >>> m = torch.nn.Linear(2, 2)
    >>> _ = hs.add(m.register_forward_hook(lambda *a: None))
    >>> len(m._forward_hooks), len(hs)
    (1, 1)
    >>> hs.remove_all(); len(m._forward_hooks)
    0
    """

    def __init__(self) -> None:
        self._handles: List[Any] = []

    def add(self, handle: Any) -> Any:
        self._handles.append(handle)
        return handle

    def remove_all(self) -> None:
        while self._handles:
            handle = self._handles.pop()
            try:
                handle.remove()
            except Exception:  # a handle whose owner is gone is already removed
                pass

    def __len__(self) -> int:
        return len(self._handles)


def _tensors_in(obj: Any, out: Optional[List[Tensor]] = None, depth: int = 0) -> List[Tensor]:
    """Floating-point tensors in a (possibly nested) output: tuples, lists, dicts,
    dataclasses and ModelOutput-like objects. Integer and bool tensors are skipped."""
    if out is None:
        out = []
    if depth > 6:
        return out
    if isinstance(obj, Tensor):
        if obj.is_floating_point() or obj.is_complex():
            out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _tensors_in(o, out, depth + 1)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors_in(o, out, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _tensors_in(getattr(obj, f.name, None), out, depth + 1)
    elif hasattr(obj, "items") and callable(obj.items):
        try:
            for _, o in obj.items():
                _tensors_in(o, out, depth + 1)
        except Exception:
            pass
    return out


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _is_compiled(model: nn.Module) -> bool:
    return hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", None) is not None


def _unwrap(model: nn.Module) -> nn.Module:
    """The module DDP / torch.compile wrap (for replays that must not talk to other ranks)."""
    inner = model
    for _ in range(4):
        if isinstance(getattr(inner, "module", None), nn.Module) and type(inner).__name__ in (
                "DistributedDataParallel", "DataParallel"):
            inner = inner.module
        elif isinstance(getattr(inner, "_orig_mod", None), nn.Module):
            inner = inner._orig_mod
        else:
            break
    return inner


@dataclasses.dataclass
class _Pending:
    """Statistics computed at the end of a backward pass, waiting for the step boundary."""

    step: int
    values: Optional[Tensor]  # [P, K] or None
    absmax: Optional[Tensor]  # [P] or None (when only the non-finite check was due)
    grads: List[Optional[Tensor]]
    versions: List[int]
    scale: Optional[float]


@dataclasses.dataclass
class _Capture:
    """What a forward pass needs to be replayed for localisation (held for one step)."""

    args: Any
    kwargs: Any
    rng: Tensor
    output_index: int
    grad: Optional[Tensor] = None


class Watch:
    """Records per-parameter gradient statistics and catches anomalies; see :func:`watch`."""

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                 every: int = 1, stats: Sequence[str] = DEFAULT_STATS,
                 nonfinite: Any = "raise", explode: Any = "warn", vanish: Any = None,
                 activations: bool = False, histograms: Union[None, bool, int] = None,
                 scaler: Any = None, history: int = 10_000, ddp_check_every: Optional[int] = None,
                 update_every: Optional[int] = _UPDATE_EVERY, localize: bool = True) -> None:
        self._closed = True  # until attached: repr() and __del__ work on a half-built watch
        self._hooks = HookSet()
        self._names: List[str] = []
        self._step = 0
        self.anomalies: List[Anomaly] = []
        # ---- validation, once, at the entry point
        if isinstance(model, type) and issubclass(model, nn.Module):
            raise TypeError(f"model= got the class {model.__name__}, expected an nn.Module instance; "
                            f"instantiate it first: graddbg.watch({model.__name__}(...))")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model= must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer= must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
        for arg, val in (("every", every), ("history", history)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{arg}= must be an int >= 1, got {val!r}")
        for arg, val in (("ddp_check_every", ddp_check_every), ("update_every", update_every)):
            if val is not None and (not isinstance(val, int) or isinstance(val, bool) or val < 1):
                raise ValueError(f"{arg}= must be None or an int >= 1, got {val!r}")
        if histograms is not None and not isinstance(histograms, (bool, int)):
            raise TypeError(f"histograms= must be None, a bool or an int (every N steps), got {type(histograms).__name__}")
        if isinstance(histograms, int) and not isinstance(histograms, bool) and histograms < 1:
            raise ValueError(f"histograms= must be >= 1 when an int, got {histograms!r}")
        if scaler is not None and not hasattr(scaler, "get_scale"):
            raise TypeError(f"scaler= must be a torch.amp.GradScaler or None, got {type(scaler).__name__}")
        self.stats_asked = validate_stats(stats)
        self.every = every
        self._nonfinite: Optional[NonFinite] = as_detector(nonfinite, "nonfinite")
        self._explode: Optional[Explode] = as_detector(explode, "explode")
        self._vanish: Optional[Vanish] = as_detector(vanish, "vanish")
        self._activations = bool(activations)
        self._hist_every = (None if histograms in (None, False) else 1 if histograms is True else int(histograms))
        self._scaler = scaler if (scaler is not None and getattr(scaler, "is_enabled", lambda: True)()) else None
        self._ddp_every = ddp_check_every
        self._update_every = update_every if optimizer is not None else None
        self._localize = bool(localize)

        named = named_trainable_parameters(model)
        self._names = [n for n, _ in named]
        self._modules = [module_of(n) for n in self._names]
        self._params: List[nn.Parameter] = [p for _, p in named]
        self._numel = [p.numel() for p in self._params]
        if optimizer is not None:
            held = {id(p) for g in optimizer.param_groups for p in g["params"]}
            if self._params and not any(id(p) in held for p in self._params):
                raise ValueError(
                    f"optimizer= ({type(optimizer).__name__}) holds none of the model's {len(self._params)} "
                    f"trainable parameters; pass the optimizer built from this model's parameters "
                    f"(e.g. {type(optimizer).__name__}(model.parameters(), ...))")
        self._model = model
        self._optimizer = optimizer
        self._plan = StatPlan(self._params, self.stats_asked)
        P = len(self._params)
        self._version_idx = sorted({0, P // 3, (2 * P) // 3, P - 1}) if P else []
        self._history = History(self._names, self._plan.columns, history)
        self._hist_edges: Optional[Tensor] = None
        self.host_syncs = 0  #: host synchronisations made by the watch (read-backs)
        self._closed = False
        self._cb_queued = False
        self._bwd_since_fwd = True
        self._pending: Optional[_Pending] = None
        self._capture: Optional[_Capture] = None
        self._replaying = False
        self._temp_handles: List[Any] = []
        self._snapshot: Any = None  # the parameters before the step (StatPlan.snapshot)
        self._update_dev: Optional[Tuple[StepRecord, Any]] = None
        # flags between non-finite checks: on the device (numpy when computed on the host)
        self._acc_bad: Any = None
        self._acc_first: Any = None
        self._ever_grad = np.zeros(len(self._params), dtype=bool)
        self._all_true = np.ones(len(self._params), dtype=bool)
        self._all_true.setflags(write=False)
        self._ever_all = False  # every parameter has had a gradient at some step
        self._no_bad = np.zeros(len(self._params), dtype=bool)
        self._no_bad.setflags(write=False)
        self._explode_state = self._explode.new_state() if self._explode else None
        self._vanish_state = self._vanish.new_state(len(self._params)) if self._vanish else None
        self._leaf_modules: List[Tuple[str, nn.Module]] = []  # all modules, with activations=True
        self._act_leaf: List[bool] = []
        self._act_fwd: List[Tuple[int, Tensor, Tensor]] = []
        self._act_bwd: List[Tuple[int, Tensor]] = []
        self._act_rows: List[Tuple[int, str, float, int]] = []
        self._act_seen: set = set()
        self._compiled = _is_compiled(model)
        self._script = isinstance(model, torch.jit.ScriptModule)
        self.meta: Dict[str, Any] = {
            "model": type(_unwrap(model)).__name__, "optimizer": type(optimizer).__name__ if optimizer else None,
            "every": every, "stats": list(self.stats_asked), "torch": torch.__version__,
            "nonfinite": _policy_name(self._nonfinite), "explode": _policy_name(self._explode),
            "vanish": _policy_name(self._vanish), "params": len(self._params),
            "numel": int(sum(self._numel)), "world_size": 1, "rank": 0, "uncovered": [],
        }
        try:
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                self.meta["world_size"], self.meta["rank"] = dist.get_world_size(), dist.get_rank()
        except Exception:
            pass

        try:
            self._attach()
        except BaseException:
            self._hooks.remove_all()
            raise

    # ------------------------------------------------------------------ attaching
    def _attach(self) -> None:
        model, opt, hooks = self._model, self._optimizer, self._hooks
        if self._compiled or self._script:
            if self._activations:
                warnings.warn(
                    "graddbg.watch: activations=True needs module hooks inside the model, which a "
                    f"{'compiled' if self._compiled else 'TorchScript'} model ignores or breaks graphs for; "
                    "activation gradients are not recorded. Watch the model before compiling it, or "
                    "pass activations=False.", CompileWarning, stacklevel=4)
                self._activations = False
        if not self._script:
            hooks.add(model.register_forward_pre_hook(self._on_root_pre, with_kwargs=True))
            hooks.add(model.register_forward_hook(self._on_root_forward, with_kwargs=True))
        if opt is not None:
            hooks.add(opt.register_step_pre_hook(self._on_opt_pre))
            hooks.add(opt.register_step_post_hook(self._on_opt_post))
        else:
            for p in self._params:
                hooks.add(p.register_post_accumulate_grad_hook(self._on_param_grad))
        if self._activations:
            # every module checks its forward output (the producer of a forward NaN may be a
            # container); leaf modules also record the gradient at their output
            for name, mod in _unwrap(model).named_modules():
                idx = len(self._leaf_modules)
                self._leaf_modules.append((name, mod))
                leaf = next(mod.children(), None) is None
                self._act_leaf.append(leaf)
                hooks.add(mod.register_forward_hook(self._make_act_hook(idx, leaf)))

    # ------------------------------------------------------------------ hook bodies
    def _on_root_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._replaying or not torch.is_grad_enabled() or _in_backward():
            return None
        if not self._bwd_since_fwd:
            # the previous forward pass was never backpropagated (an evaluation loop with
            # grad enabled, say): drop what it registered, so nothing piles up
            self._drop_forward_state()
        self._bwd_since_fwd = False
        if self._localize:
            self._rng = torch.get_rng_state()
        return None

    def _drop_forward_state(self) -> None:
        handles, self._temp_handles = self._temp_handles, []
        for h in handles:
            h.remove()
        self._act_fwd = []
        self._act_bwd = []

    def _on_root_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._replaying or not torch.is_grad_enabled() or _in_backward():
            return None
        outs = [output] if type(output) is Tensor else _tensors_in(output)  # (the common case: one call less)
        for i, t in enumerate(outs):
            if t.requires_grad:
                cap = None
                if self._localize:
                    cap = _Capture(args, kwargs, getattr(self, "_rng", None), i)
                fn = t.grad_fn
                if fn is not None:  # (a pre-hook on its node costs less than a tensor hook)
                    handle = fn.register_prehook(self._make_output_hook(cap, t.output_nr))
                else:
                    handle = t.register_hook(self._make_output_hook(cap, None))
                self._temp_handles.append(handle)
                break
        return None

    def _make_output_hook(self, cap: Optional[_Capture], output_nr: Optional[int]) -> Callable[[Any], None]:
        """The hook that sees the gradient of the model's output: a tensor hook
        (``output_nr`` None) or a pre-hook on the output's autograd node, which receives
        the gradients of all of that node's outputs."""
        wself = weakref.ref(self)

        def hook(grad: Any) -> None:
            w = wself()
            if w is None or w._closed or w._replaying:
                return
            w._bwd_since_fwd = True
            if output_nr is not None:
                grad = grad[output_nr]
            if cap is not None and grad is not None:
                cap.grad = grad
                w._capture = cap
            w._queue_end_of_backward()

        return hook

    def _on_param_grad(self, p: Tensor) -> None:
        if not self._replaying:
            self._queue_end_of_backward()

    def _queue_end_of_backward(self) -> None:
        if self._cb_queued or self._closed:
            return
        self._cb_queued = True
        # queued twice so that it runs after the callbacks queued during the backward pass
        # (DDP's reducer finalises its all-reduce in one): the statistics are then of the
        # reduced gradients
        _queue_callback(lambda: _queue_callback(self._end_of_backward))

    def _end_of_backward(self) -> None:
        self._cb_queued = False
        if self._closed:
            return
        if self._optimizer is None:
            self._boundary()
            return
        # with an optimizer the boundary is its step; compute now what the step needs,
        # so that a clip between backward and step does not hide the pre-clip gradient
        scale = None
        if self._scaler is not None:
            scale = float(self._scaler.get_scale())
            self.host_syncs += 1
            if self._pending is not None and self._pending.scale is not None and scale < self._pending.scale:
                self._record_overflow(self._pending)
        step = self._step
        due_stats, due_nf = self._due(step)
        values = absmax = None
        if due_stats:
            grads, values = self._plan.compute_params(self._params)
        elif self._nonfinite is not None:
            grads, absmax = self._plan.absmax_params(self._params)
        else:
            grads = [p.grad for p in self._params]
        self._pending = _Pending(step, values, absmax, grads,
                                 self._versions(grads), scale)

    def _versions(self, grads: Sequence[Optional[Tensor]]) -> List[int]:
        """In-place version counters of a few gradients spread over the model (the first,
        the last and two between): clipping (``clip_grad_norm_``, ``clip_grad_value_``)
        and AMP's ``unscale_`` change every gradient, and reading all the counters costs
        about a microsecond per parameter."""
        return [-1 if grads[i] is None else grads[i]._version for i in self._version_idx]

    def _on_opt_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        if not self._closed:
            self._boundary()
        return None

    def _on_opt_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self._closed or self._snapshot is None:
            return
        snap, self._snapshot = self._snapshot, None
        rec = self._history.records[-1] if self._history.records else None
        if rec is None:
            return
        ratio = self._plan.update_ratio(snap, self._params)
        self._update_dev = (rec, ratio)  # read back with the next read-back, not now

    def _make_act_hook(self, idx: int, leaf: bool) -> Callable[..., None]:
        wself = weakref.ref(self)

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            w = wself()
            if w is None or w._closed or w._replaying or _in_backward():
                return  # activation checkpointing recomputes forwards in backward: skip them
            w._act_seen.add(idx)
            outs = _tensors_in(output)
            if not outs:
                return
            ins = _tensors_in(args)
            with torch.no_grad():
                in_bad = _any_nonfinite(ins, outs[0].device)
                out_bad = _any_nonfinite(outs, outs[0].device)
            w._act_fwd.append((idx, in_bad, out_bad))
            if leaf and torch.is_grad_enabled():
                for t in outs:
                    if t.requires_grad:
                        w._temp_handles.append(t.register_hook(w._make_act_grad_hook(idx)))

        return hook

    def _make_act_grad_hook(self, idx: int) -> Callable[[Tensor], None]:
        wself = weakref.ref(self)

        def hook(grad: Tensor) -> None:
            w = wself()
            if w is None or w._closed or w._replaying:
                return
            with torch.no_grad():
                w._act_bwd.append((idx, grad.detach().double().pow(2).sum()))

        return hook

    # ------------------------------------------------------------------ step boundary
    def _due(self, step: int) -> Tuple[bool, bool]:
        due_stats = step % self.every == 0
        due_nf = self._nonfinite is not None and step % self._nonfinite.every == 0
        return due_stats, due_nf

    def _boundary(self) -> None:
        """One step boundary: read statistics (one host sync at most), detect, apply policies."""
        step = self._step
        due_stats, due_nf = self._due(step)
        pending, self._pending = self._pending, None
        scale = math.nan
        div: Optional[float] = None
        clipped = False
        values = absmax = None
        if pending is not None and pending.step == step:
            # the gradients of the last backward pass: changed in place since (a clip) or not
            grads = pending.grads
            changed = self._versions(grads) != pending.versions
            values, absmax = pending.values, pending.absmax
            if pending.scale is not None:
                scale, div = pending.scale, pending.scale  # computed on scaled gradients
            clipped = changed
        else:
            grads = [p.grad for p in self._params]
            if self._scaler is not None:
                scale = float(self._scaler.get_scale())
                self.host_syncs += 1
        if due_stats and values is None:
            values, div = self._plan.compute(grads), None
        if not due_stats and absmax is None and self._nonfinite is not None:
            absmax = self._plan.absmax(grads)
        clip_norm = None
        if clipped and due_stats:
            live = [g for g in grads if g is not None]
            if live:
                clip_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(live)).double())
        hist = None
        if due_stats and self._hist_every is not None and step % self._hist_every == 0:
            hist = self._histograms(grads)
        act_fwd, self._act_fwd = self._act_fwd, []
        act_bwd, self._act_bwd = self._act_bwd, []

        need_sync = due_stats or due_nf
        if not need_sync:
            # no read-back this step: accumulate non-finite flags on the device
            if absmax is not None:
                self._accumulate_flags(step, absmax)
            self._history.append(StepRecord(step, None, None, None, math.nan, math.nan, False,
                                            scale, self._lr()))
            self._finish_step()
            return

        # ---- the one read-back of this step
        parts: List[Tensor] = []
        layout: List[Tuple[str, Tuple[int, ...]]] = []
        on_host: Dict[str, Any] = {}

        def put(name: str, t: Optional[Tensor]) -> None:
            # (our own tensors, computed from gradients that do not require grad: no
            # detach; each launch saved counts at every step)
            if isinstance(t, np.ndarray):  # computed on the host already (CPU, BLAS)
                on_host[name] = t.reshape(-1)
            elif t is not None:
                layout.append((name, tuple(t.shape)))
                if t.dtype != torch.float64:
                    t = t.to(torch.float64)
                parts.append(t if t.dim() == 1 else t.reshape(-1))

        put("values", values)
        put("absmax", absmax)
        put("clip", clip_norm)
        put("hist", hist)
        if self._acc_bad is not None:
            put("acc_bad", self._acc_bad)
            put("acc_first", self._acc_first)
        if self._update_dev is not None:
            put("update", self._update_dev[1])
        if act_fwd:
            put("act_fwd", torch.stack([torch.stack([b_in, b_out]) for _, b_in, b_out in act_fwd]).double())
        if act_bwd:
            put("act_bwd", torch.stack([v for _, v in act_bwd]))
        got = _readback(parts, layout)
        got.update(on_host)
        self.host_syncs += 1  # (counted on the CPU too: the same code path as on a GPU)

        if self._update_dev is not None:
            self._update_dev[0].update = got["update"]
            self._update_dev = None

        P = len(self._params)
        # the statistics kernel has just looked at these gradients: reuse its answer
        complete = (self._plan.last_complete if (values is not None or absmax is not None)
                    else all(g is not None for g in grads))  # (not `None in`: Tensor.__eq__)
        if not complete:
            has_grad = np.fromiter((g is not None for g in grads), dtype=bool, count=P)
            self._ever_grad |= has_grad
        else:  # the common case: every parameter got a gradient
            has_grad = self._all_true
            if not self._ever_all:
                self._ever_grad.fill(True)
                self._ever_all = True

        vals = got.get("values")
        if vals is not None:
            vals = vals.reshape(P, -1)
            if div is not None:
                vals[:, : 2] /= div
                for j, c in enumerate(self._plan.extras):
                    if c in ("mean", "std"):
                        vals[:, 2 + j] /= div
            reads = self._plan.extra_reads
            counts = self._plan.fixup(vals, grads, div)
            self.host_syncs += self._plan.extra_reads - reads  # overflowed/underflowed norms only
            norms = vals[:, 0]
            sq = self._plan.global_sumsq()
            if sq is not None:  # summed while they were computed
                gn = math.sqrt(sq) / (div or 1.0)
            else:
                present = norms if complete else norms[has_grad]
                gn = math.sqrt(float(np.dot(present, present)))  # NaN or inf when a norm is
        else:
            counts = None
            norms = None
            gn = math.nan
        am = got.get("absmax")
        if counts is not None:
            # fixup() hands back one shared array of zeros on steps without a bad entry
            bad_now = self._no_bad if counts is self._plan.zeros else counts > 0
        elif am is not None:
            bad_now = ~np.isfinite(am) & has_grad
            counts = None
        else:
            bad_now = self._no_bad
        first_bad_step = step
        acc_bad = got.get("acc_bad")
        if acc_bad is not None and acc_bad.any():
            firsts = got["acc_first"]
            prior = acc_bad > 0
            first_bad_step = int(firsts[prior].min())
            bad_now = bad_now | prior
            self._acc_bad = self._acc_first = None
        elif acc_bad is not None:
            self._acc_bad = self._acc_first = None
        clip_val = float(got["clip"][0]) if "clip" in got else math.nan
        hist_np = got["hist"].reshape(P, -1).astype(np.int64) if "hist" in got else None
        rec = StepRecord(step, vals, counts if counts is not None else None,
                         has_grad if vals is not None else None, gn, clip_val, False, scale, self._lr(),
                         hist=hist_np)
        self._history.append(rec)
        if act_fwd or act_bwd:
            self._record_activations(step, act_fwd, got.get("act_fwd"), act_bwd, got.get("act_bwd"))

        # ---- detectors
        found: List[Tuple[Anomaly, Any]] = []
        any_bad = bad_now is not self._no_bad and bool(bad_now.any())
        if any_bad and self._nonfinite is not None:
            found.append((self._nonfinite_anomaly(first_bad_step, bad_now, counts, act_fwd, got, act_bwd,
                                                  got.get("act_bwd")), self._nonfinite.policy))
        if vals is not None and self._explode_state is not None and not any_bad:
            a = self._explode_state.check(step, gn, norms, self._names, self._modules)
            if a is not None:
                found.append((a, self._explode.policy))
        if vals is not None and self._vanish_state is not None:
            a = self._vanish_state.check(step, norms, has_grad, self._names, self._modules)
            if a is not None:
                found.append((a, self._vanish.policy))
        if self._ddp_every is not None and step % self._ddp_every == 0:
            a = self._ddp_check(step)
            if a is not None:
                found.append((a, self._nonfinite.policy if self._nonfinite else "raise"))

        # ---- update ratio snapshot (after the step's decisions, before the optimizer moves)
        if (self._update_every is not None and vals is not None and step % self._update_every == 0):
            self._snapshot = self._take_snapshot(step)

        to_raise: Optional[BaseException] = None
        for anomaly, policy in found:
            self.anomalies.append(anomaly)
            err = self._apply_policy(anomaly, policy, bad_now)
            if err is not None and to_raise is None:
                to_raise = err
        self._finish_step()
        if to_raise is not None:
            self._snapshot = None
            raise to_raise

    def _take_snapshot(self, step: int) -> Any:
        """The weights before the optimizer's step, for the update ratio. Where there is
        no memory for the copy (a model that fills its device), the training step goes on:
        a warning says so and the update ratio is switched off for the rest of the watch."""
        try:
            return self._plan.snapshot(self._params)
        except torch.cuda.OutOfMemoryError as err:  # (torch.OutOfMemoryError from torch 2.5)
            self._update_every = None
            mb = sum(p.numel() * p.element_size() for p in self._params) / 2**20
            warnings.warn(
                f"graddbg.watch: no memory for the copy of the weights ({mb:.0f} MB) that the "
                f"update/weight ratio needs before the optimizer's step; it is not measured from "
                f"step {step} on, and training goes on. Pass update_every=None to skip it. "
                f"(torch said: {str(err).strip()[:200]})", GraddbgWarning, stacklevel=2)
            return None

    def _finish_step(self) -> None:
        self._step += 1
        self._capture = None
        self._bwd_since_fwd = True
        handles, self._temp_handles = self._temp_handles, []
        for h in handles:
            h.remove()

    def _accumulate_flags(self, step: int, absmax: Any) -> None:
        if isinstance(absmax, np.ndarray) and not isinstance(self._acc_bad, Tensor):
            # computed on the host (CPU gradients through BLAS): flags in numpy, no launches
            bad = ~np.isfinite(absmax)
            if self._acc_bad is None:
                self._acc_bad = np.zeros(bad.shape, dtype=bool)
                self._acc_first = np.full(bad.shape, -1, dtype=np.int64)
            self._acc_first[bad & ~self._acc_bad] = step
            self._acc_bad |= bad
            return
        if isinstance(absmax, np.ndarray):
            absmax = torch.from_numpy(absmax)
        elif isinstance(self._acc_bad, np.ndarray):  # (the host path stopped: a gradient it cannot read)
            self._acc_bad, self._acc_first = torch.from_numpy(self._acc_bad), torch.from_numpy(self._acc_first)
        bad = ~torch.isfinite(absmax)
        if self._acc_bad is None:
            self._acc_bad = torch.zeros_like(bad)
            self._acc_first = torch.full(bad.shape, -1, dtype=torch.int64, device=bad.device)
        new = bad & ~self._acc_bad
        self._acc_first = torch.where(new, torch.full_like(self._acc_first, step), self._acc_first)
        self._acc_bad = self._acc_bad | bad

    def _histograms(self, grads: Sequence[Optional[Tensor]]) -> Tensor:
        dev = next((g.device for g in grads if g is not None), torch.device("cpu"))
        if self._hist_edges is None or self._hist_edges.device != dev:
            self._hist_edges = torch.tensor(HIST_EDGES, dtype=torch.float64, device=dev)
        nb = len(HIST_EDGES) + 1
        rows = [histogram_counts(g, self._hist_edges) if g is not None
                else torch.zeros(nb, dtype=torch.int64, device=dev) for g in grads]
        return torch.stack(rows)

    def _record_overflow(self, pending: _Pending) -> None:
        """The scaler skipped the optimizer step: record it as an overflow step."""
        self._ever_grad |= [g is not None for g in pending.grads]
        rec = StepRecord(pending.step, None, None, None, math.nan, math.nan, True,
                         float(pending.scale or math.nan), self._lr())
        self._history.append(rec)
        self._step += 1

    def _lr(self) -> float:
        if self._optimizer is None or not self._optimizer.param_groups:
            return math.nan
        lr = self._optimizer.param_groups[0].get("lr", math.nan)
        if isinstance(lr, Tensor):
            return float(lr) if lr.device.type == "cpu" else math.nan
        try:
            return float(lr)
        except (TypeError, ValueError):
            return math.nan

    # ------------------------------------------------------------------ anomalies
    def _nonfinite_anomaly(self, step: int, bad: Any, counts: Any, act_fwd: Any, got: Dict[str, Any],
                           act_bwd: Any = (), act_bwd_vals: Any = None) -> Anomaly:
        import numpy as np

        idx = np.nonzero(bad)[0]
        names = [self._names[i] for i in idx]
        # default blame: the affected parameter nearest the output (the first the backward
        # pass reached), refined below by activations and by a replay of the forward pass
        module = self._modules[idx[-1]]
        name = next(n for n, i in zip(names, idx) if self._modules[i] == module)
        op = source = None
        how = "parameter gradients"
        act = got.get("act_fwd")
        forward_found = False
        if act is not None and len(act_fwd):
            act = act.reshape(-1, 2)
            for (mi, _, _), (in_b, out_b) in zip(act_fwd, act):
                if out_b and not in_b:
                    module, how = self._leaf_modules[mi][0], "forward activations"
                    forward_found = True
                    break
        if not forward_found and act_bwd_vals is not None and len(act_bwd):
            found = self._backward_producer(act_fwd, act_bwd, act_bwd_vals, set(names))
            if found is not None:
                module, how = found, "gradients at module outputs"
        cap = self._capture
        replay = self._replay(cap) if (self._localize and cap is not None and step == self._step) else None
        if replay is not None:
            if replay.module is not None or replay.op is not None:
                module = replay.module if replay.module is not None else module
                op, source = replay.op, replay.source
                how = "a replay of the forward and backward pass"
        if module:  # name a parameter of the module blamed, when it has one among the affected
            own = [n for n in names if n.startswith(module + ".")]
            if own:
                name = own[0]
        total = int(counts[idx].sum()) if counts is not None else None
        shown = ", ".join(f"{n} {tuple(self._params[i].shape)}" for n, i in zip(names[:6], idx[:6]))
        more = f" and {len(names) - 6} more" if len(names) > 6 else ""
        rank = self.meta.get("rank", 0) if self.meta.get("world_size", 1) > 1 else None
        msg = (f"graddbg: non-finite gradient at step {step}"
               + (f" on rank {rank}" if rank is not None else "") + ": "
               + (f"{total} NaN/Inf entries in " if total else "")
               + f"{len(names)} parameter(s): {shown}{more}. "
               + f"It started in module '{module or '<root>'}'"
               + (f", op {op}" if op else "") + (f", created at {source}" if source else "")
               + f" (found from {how}). "
               + ("Next: wrap one step in graddbg.find_nonfinite(model) to see every op's inputs, "
                  "or check the loss for log(0), sqrt(0), division by zero or overflow."))
        return Anomaly(step=step, kind="nonfinite", name=name, module=module, op=op,
                       value=float("nan"), threshold=None, source=source, message=msg, rank=rank,
                       params=tuple(names))

    def _backward_producer(self, act_fwd: Any, act_bwd: Any, vals: Any, bad_names: set) -> Optional[str]:
        """The leaf module whose output gradient was finite while the gradient it passed on
        (the output gradient of the leaf before it in forward order) or its own parameter
        gradients were not. Exact for chains of modules; a good guess for other graphs."""
        import numpy as np

        finite: Dict[int, bool] = {}
        for (mi, _), v in zip(act_bwd, vals):
            finite[mi] = finite.get(mi, True) and bool(np.isfinite(v))
        order: List[int] = []
        for mi, _, _ in act_fwd:  # forward order of the leaf modules that ran
            if self._act_leaf[mi] and mi in finite and mi not in order:
                order.append(mi)
        for k in range(len(order) - 1, -1, -1):
            mi = order[k]
            if not finite[mi]:
                continue
            name = self._leaf_modules[mi][0]
            own_bad = any(n.startswith(name + ".") for n in bad_names)
            passed_bad = k > 0 and not finite[order[k - 1]]
            if own_bad or passed_bad:
                return name
        return None

    def _replay(self, cap: _Capture) -> Optional[Anomaly]:
        """Run the captured forward pass again, and backward with the captured output
        gradient, under find_nonfinite: it names the op, module and source line that made
        the first NaN/Inf. Parameters' .grad, buffers and the RNG are left as they were."""
        from graddbg._forensics import find_nonfinite

        # a non-finite gradient arriving at the output: the forward pass may have made it
        # (a NaN output gives a NaN loss), else the loss did; replay the forward only
        grad_bad = cap.grad is not None and not bool(torch.isfinite(cap.grad).all())
        model = _unwrap(self._model)
        buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self._replaying = True
        cpu_rng = torch.get_rng_state()
        try:
            if cap.rng is not None:
                torch.set_rng_state(cap.rng)
            with find_nonfinite(model):
                with torch.enable_grad():
                    out = model(*cap.args, **cap.kwargs)
                    outs = _tensors_in(out)
                    if grad_bad:
                        return Anomaly(step=self._step, kind="nonfinite", name=None, module="<loss>",
                                       op=None, value=math.nan, threshold=None, source=None,
                                       message="the model's forward pass is finite but the gradient "
                                               "arriving at its output is not: the NaN/Inf was made in "
                                               "the loss computation, outside the model")
                    if cap.grad is None or cap.output_index >= len(outs):
                        return None
                    t = outs[cap.output_index]
                    wrt = [p for p in model.parameters() if p.requires_grad]
                    wrt += [a for a in _tensors_in(cap.args) if a.requires_grad and a.is_leaf]
                    torch.autograd.grad(t, wrt, grad_outputs=cap.grad, allow_unused=True)
        except NonFiniteError as e:
            return getattr(e, "anomaly", None)
        except Exception:
            return None
        finally:
            self._replaying = False
            torch.set_rng_state(cpu_rng)
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
        return None

    def _ddp_check(self, step: int) -> Optional[Anomaly]:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        from graddbg import ddp_verify

        report = ddp_verify.check_gradients(self._model)
        self.host_syncs += 1
        if report.ok:
            return None
        mm = report.mismatches
        name = str(mm["name"].iloc[0]) if len(mm) else None
        return Anomaly(step=step, kind="ddp_mismatch", name=name, module=module_of(name) if name else None,
                       op=None, value=float(len(mm)), threshold=0.0, source=None,
                       message=f"graddbg: gradients differ across ranks at step {step}:\n{report}",
                       rank=self.meta.get("rank"), params=tuple(dict.fromkeys(str(n) for n in mm["name"])) if len(mm) else ())

    def _apply_policy(self, anomaly: Anomaly, policy: Any, bad: Any) -> Optional[BaseException]:
        if policy is None or policy == "record":
            return None
        if policy == "raise":
            cls = NonFiniteError if anomaly.kind == "nonfinite" else GradientAnomalyError
            return cls(anomaly.message, anomaly)
        if policy == "warn":
            warnings.warn(anomaly.message, AnomalyWarning, stacklevel=4)
            return None
        if policy == "skip":
            import numpy as np

            if anomaly.kind == "nonfinite":
                targets = np.nonzero(bad)[0]
            elif anomaly.kind == "vanish":
                return None
            else:
                targets = range(len(self._params))
            for i in targets:
                self._params[i].grad = None
            return None
        if callable(policy):
            policy(anomaly)
        return None

    def _record_activations(self, step: int, act_fwd: Any, fwd_vals: Any, act_bwd: Any, bwd_vals: Any) -> None:
        import numpy as np

        sq: Dict[int, float] = {}
        bad: Dict[int, int] = {}
        if fwd_vals is not None:
            for (mi, _, _), (_, out_b) in zip(act_fwd, fwd_vals.reshape(-1, 2)):
                bad[mi] = bad.get(mi, 0) | int(out_b > 0)
        if bwd_vals is not None:
            for (mi, _), v in zip(act_bwd, bwd_vals):
                sq[mi] = sq.get(mi, 0.0) + float(v)  # a module called twice adds up
        for mi in sorted(set(sq) | {m for m in bad if self._act_leaf[m]}):
            self._act_rows.append((step, self._leaf_modules[mi][0],
                                   float(np.sqrt(sq[mi])) if mi in sq else math.nan, bad.get(mi, 0)))

    # ------------------------------------------------------------------ public API
    def step(self) -> None:
        """Mark a step boundary by hand (statistics are read from the current ``.grad``)."""
        self._check_open("step")
        self._cb_queued = False
        self._boundary()

    @property
    def current_step(self) -> int:
        """The number of the next step boundary (0-based)."""
        return self._step

    @property
    def last_step_skipped(self) -> bool:
        """True when the GradScaler skipped the last step (an overflow)."""
        recs = self._history.records
        return bool(recs and recs[-1].overflow)

    def _flush(self) -> None:
        if self._update_dev is not None:
            rec, t = self._update_dev
            rec.update = t if isinstance(t, np.ndarray) else t.cpu().numpy()
            self._update_dev = None

    @property
    def stats(self):
        """Tidy DataFrame: one row per (recorded step, parameter)."""
        self._flush()
        return self._history.stats_frame(self._numel)

    @property
    def steps(self):
        """DataFrame: one row per step boundary (global norm, post-clip norm, overflow, ...)."""
        return self._history.steps_frame()

    @property
    def histograms(self):
        """Histogram counts of |grad| per (step, parameter, bin), or None when not asked for."""
        return self._history.hist_frame() if self._hist_every is not None else None

    @property
    def activations(self):
        """Gradient norm at each leaf module's output per step, or None without activations=True."""
        if not self._activations:
            return None
        import pandas as pd

        return pd.DataFrame(self._act_rows, columns=["step", "module", "grad_norm", "out_nonfinite"])

    def summary(self, by: str = "param"):
        """One row per parameter (``by="param"``) or module (``by="module"``) over all recorded steps."""
        from graddbg.stats import summarize

        return summarize(self.stats, by=by)

    def coverage(self):
        """Parameters (and, with activations=True, leaf modules) that produced no data."""
        import pandas as pd

        rows = [{"kind": "param", "name": n, "covered": bool(c)} for n, c in zip(self._names, self._ever_grad)]
        if self._activations:
            rows += [{"kind": "module", "name": n, "covered": i in self._act_seen}
                     for i, (n, _) in enumerate(self._leaf_modules) if self._act_leaf[i]]
        return pd.DataFrame(rows, columns=["kind", "name", "covered"])

    def to_run(self):
        """A snapshot of what was recorded, as a :class:`graddbg.run.Run`."""
        from graddbg.run import Run

        meta = dict(self.meta)
        meta["uncovered"] = [n for n, c in zip(self._names, self._ever_grad) if not c]
        meta["steps_dropped"] = self._history.dropped
        return Run(self.stats, self.steps, list(self.anomalies), histograms=self.histograms,
                   activations=self.activations, meta=meta)

    def save(self, path: Any) -> Any:
        """Write the run (statistics, steps, anomalies) to ``path`` (parquet + JSON, no pickle)."""
        return self.to_run().save(path)

    def plot(self, kind: str = "flow", **kwargs: Any):
        """A matplotlib Figure: ``kind`` is "flow", "norms", "hist" or "update"."""
        return self.to_run().plot(kind, **kwargs)

    def report(self, path: Any, **kwargs: Any):
        """Write a self-contained HTML report; returns its path."""
        return self.to_run().report(path, **kwargs)

    def to_tensorboard(self, writer: Any) -> None:
        """Write the recorded scalars and histograms to a tensorboard SummaryWriter."""
        self.to_run().to_tensorboard(writer)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"Watch.{what}() called after the watch was closed")

    def close(self) -> None:
        """Remove every hook. Idempotent; the recorded data stays available."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._pending is not None and self._scaler is not None and self._pending.scale is not None:
                if float(self._scaler.get_scale()) < self._pending.scale:
                    self._record_overflow(self._pending)
            self._flush()
        finally:
            self._hooks.remove_all()
            for h in self._temp_handles:
                h.remove()
            self._temp_handles = []
            self._pending = None
            self._capture = None
            self._snapshot = None
            self._plan.release()  # its scratch memory
            self._params_ref_drop()

    def _params_ref_drop(self) -> None:
        # keep only what the tables need; no tensors of the user's past the watch
        self._params = []
        self._model = None  # type: ignore[assignment]
        self._optimizer = None
        self._leaf_modules = [(n, None) for n, _ in self._leaf_modules]  # type: ignore[misc]

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        uncovered = [n for n, c in zip(self._names, self._ever_grad) if not c]
        recorded = self._step > 0
        self.close()
        if exc_type is None and recorded and uncovered:
            shown = ", ".join(uncovered[:10]) + (f" and {len(uncovered) - 10} more" if len(uncovered) > 10 else "")
            warnings.warn(f"graddbg.watch: {len(uncovered)} trainable parameter(s) never received a "
                          f"gradient while watched: {shown}. They are unused in the forward pass, or "
                          f"their gradients are computed elsewhere (w.coverage() lists them).",
                          CoverageWarning, stacklevel=2)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<graddbg.Watch {state}: {len(self._names)} parameters, {self._step} steps, {len(self.anomalies)} anomalies>"

    def __del__(self) -> None:
        try:
            if not self._closed:
                self._hooks.remove_all()
        except Exception:
            pass


def _any_nonfinite(ts: Sequence[Tensor], device: torch.device) -> Tensor:
    flags = [~torch.isfinite(t.detach()).all() for t in ts if t.numel() and t.device == device]
    if not flags:
        return torch.zeros((), dtype=torch.bool, device=device)
    return torch.stack(flags).any()


def _readback(parts: List[Tensor], layout: List[Tuple[str, Tuple[int, ...]]]) -> Dict[str, Any]:
    """Concatenate device tensors and copy them to the host at once: one synchronisation."""
    if not parts:
        return {}
    devices = {p.device for p in parts}
    if len(parts) == 1:
        flat = parts[0].cpu().numpy()
    elif len(devices) == 1:
        flat = torch.cat(parts).cpu().numpy()
    else:  # model spread over devices: one read-back per device
        flat = np.concatenate([p.cpu().numpy() for p in parts])
    out: Dict[str, Any] = {}
    offset = 0
    for (name, shape), p in zip(layout, parts):
        n = p.numel()
        out[name] = flat[offset: offset + n]
        offset += n
    return out


def _policy_name(det: Any) -> Any:
    if det is None:
        return None
    p = det.policy
    return p if isinstance(p, str) or p is None else getattr(p, "__name__", "callable")


def watch(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *, every: int = 1,
          stats: Sequence[str] = DEFAULT_STATS, nonfinite: Any = "raise", explode: Any = "warn",
          vanish: Any = None, activations: bool = False, histograms: Union[None, bool, int] = None,
          scaler: Any = None, history: int = 10_000, ddp_check_every: Optional[int] = None,
          update_every: Optional[int] = _UPDATE_EVERY, localize: bool = True) -> Watch:
    """Watch a model's gradients while it trains; use as a context manager.

    Step boundaries: the optimizer's step when ``optimizer`` is given (statistics of the
    accumulated gradient it is about to use: one record per optimizer step under gradient
    accumulation, and the pre-clip gradient if you clip between backward and step, with
    the post-clip global norm in ``w.steps.clipped_norm``); otherwise the end of each
    backward pass; ``w.step()`` marks one by hand.

    Statistics (``stats=``: "norm", "absmax", "nonfinite" always; "mean", "std",
    "zero_frac" on request) are computed on the gradients' device with batched kernels
    and read back once per recorded step (every ``every``-th). ``nonfinite``, ``explode``
    and ``vanish`` take a policy ("raise", "warn", "skip", "record", a callable, or None)
    or a detector (:class:`graddbg.NonFinite`, :class:`graddbg.Explode`,
    :class:`graddbg.Vanish`). With ``NonFinite(every=k)`` and ``every=k`` the steps between
    checks make no host synchronisation: flags accumulate on the device and the first bad
    step is still named.

    ``history`` bounds the steps kept: the newest ``history`` steps are kept and older ones
    dropped, so memory stays flat. ``update_every``: the update/weight ratio
    ||Δw||/||w|| is measured on every ``update_every``-th recorded step, the first included
    (NaN on other steps). It needs a copy of every weight taken before the optimizer's
    step: on a CPU net of 130 small layers (5-7 ms steps) that step took 2.5-5 ms more
    (memory untouched since the last copy is slow to reach), 0.2-0.5% of the training
    time at the default 200.
    ``update_every=1`` measures it on every step, at a cost of about one more read and
    write of the weights each step. Where the device has no memory left for the copy, a
    warning says so, the ratio is switched off and training goes on.
    ``localize``: on a non-finite gradient, replay the last forward and backward pass
    under :func:`graddbg.find_nonfinite` to name the op and source line that made it.

    >>> import torch, graddbg
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> with graddbg.watch(model, opt) as w:
    ...     for _ in range(4):
    ...         model(torch.randn(16, 4)).pow(2).mean().backward()
    ...         opt.step(); opt.zero_grad()
    >>> len(w.stats), list(w.summary()["name"])
    (16, ['0.weight', '0.bias', '2.weight', '2.bias'])
    """
    return Watch(model, optimizer, every=every, stats=stats, nonfinite=nonfinite, explode=explode,
                 vanish=vanish, activations=activations, histograms=histograms, scaler=scaler,
                 history=history, ddp_check_every=ddp_check_every, update_every=update_every,
                 localize=localize)
