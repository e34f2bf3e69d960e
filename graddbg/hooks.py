"""``watch()``: hooks that record gradient statistics and catch anomalies while you train.

Every hook goes through one :class:`HookSet` and is removed on exit, whether the body
returned or raised. Nothing is stored on the user's tensors, and nothing of graddbg
travels with a copy of the model: while watched, a module that is deep-copied, pickled
or ``torch.save``-d gives a plain, unwatched model (:class:`_CopyGuard`).

The step boundary (:meth:`Watch._boundary`) is a checklist: launch the statistics
kernels (:mod:`graddbg.stats`), read back once, record, detect (:mod:`graddbg.anomaly`),
localise non-finite producers (:mod:`graddbg.blame`), apply the policies.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import sys
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np  # (torch imports numpy itself)
import torch
from torch import Tensor, nn

from graddbg._errors import (CompileWarning, CoverageWarning, GradientAnomalyError, GraddbgTypeError,
                             GraddbgValueError, GraddbgWarning)
from graddbg._model import check_model, is_compiled, module_of, named_trainable_parameters, tensors_in, unwrap
from graddbg.anomaly import Anomaly, Explode, NonFinite, Vanish, apply_policy, as_detector, nonfinite_anomaly
from graddbg.blame import Capture, backward_producer, forward_producer, nonfinite_state, replay, state_anomaly
from graddbg.stats import (CPU_ABSMAX_EVERY, DEFAULT_STATS, HIST_EDGES, History, Readback, StepReader, StepRecord,
                           StepStats, histogram_counts, local_values, update_ratios, validate_stats)

__all__ = ["HookSet", "Watch", "watch"]

# The default of watch(update_every=): the update/weight ratio needs a copy of every weight,
# which is slow to reach again when taken rarely (see watch's docstring for the cost)
_UPDATE_EVERY = 200
#: the history's bound in rows (steps x parameters) beside watch(history=) in steps
MAX_ROWS = 4_000_000

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
_is_compiling = torch.compiler.is_compiling


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

    @property
    def ids(self) -> set:
        return {h.id for h in self._handles if hasattr(h, "id")}

    def remove_all(self) -> None:
        while self._handles:
            handle = self._handles.pop()
            try:
                handle.remove()
            except Exception:  # a handle whose owner is gone is already removed
                pass

    def __len__(self) -> int:
        return len(self._handles)


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
               "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


class _CopyGuard:
    """Copies of a watched module carry nothing of graddbg. ``copy.deepcopy``, ``pickle``
    and ``torch.save`` take a module's state from ``__getstate__``; while watched, the
    module gets one in its instance dict that hands back the state without graddbg's hook
    entries (and without itself). Removed, or the previous one put back, on close."""

    def __init__(self, hooks: HookSet) -> None:
        self._hooks = hooks
        self._saved: List[Tuple[nn.Module, Any]] = []

    def protect(self, module: nn.Module) -> None:
        prev = module.__dict__.get("__getstate__")
        hooks_ref = weakref.ref(self._hooks)
        mod_ref = weakref.ref(module)

        def __getstate__() -> Dict[str, Any]:
            mod = mod_ref()
            state = prev() if prev is not None else type(mod).__getstate__(mod)
            state.pop("__getstate__", None)
            hs = hooks_ref()
            ours = hs.ids if hs is not None else set()
            for key in _HOOK_DICTS:
                d = state.get(key)
                if d and ours & set(d):
                    state[key] = type(d)((k, v) for k, v in d.items() if k not in ours) \
                        if isinstance(d, OrderedDict) else {k: v for k, v in d.items() if k not in ours}
            return state

        module.__dict__["__getstate__"] = __getstate__
        self._saved.append((module, prev))

    def release(self) -> None:
        while self._saved:
            module, prev = self._saved.pop()
            if prev is None:
                module.__dict__.pop("__getstate__", None)
            else:
                module.__dict__["__getstate__"] = prev


def _in_backward() -> bool:
    # (a recompute of activation checkpointing runs forwards inside a backward pass; no
    # public function tells; only called outside compiled code)
    return torch._C._current_graph_task_id() != -1


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A hook body that never takes the training loop down by a bug of graddbg's own: an
    unexpected exception becomes one :class:`GraddbgWarning` naming what failed, and
    recording goes on. Anomalies under the ``"raise"`` policy, and whatever a user's policy
    callable raises, still propagate."""

    @functools.wraps(fn)
    def wrapper(self: "Watch", *args: Any, **kwargs: Any) -> Any:
        step = self._step
        try:
            return fn(self, *args, **kwargs)
        except Exception as err:
            if isinstance(err, GradientAnomalyError) or self._in_policy:
                raise
            self._internal_error(fn.__name__, step, err)
            return None
        finally:
            self._in_policy = False

    return wrapper


# --------------------------------------------------------------------------- options
@dataclasses.dataclass(frozen=True)
class _Config:
    """``watch()``'s options, validated once."""

    every: int
    stats: Tuple[str, ...]
    nonfinite: Optional[NonFinite]
    explode: Optional[Explode]
    vanish: Optional[Vanish]
    activations: bool
    hist_every: Optional[int]
    scaler: Any
    history: int
    ddp_every: Optional[int]
    ddp_timeout: Any
    update_every: Optional[int]
    localize: bool
    absmax_cpu_every: int  # recorded steps between absmax reads on the CPU (1 when asked for)


def _count(arg: str, val: Any, optional: bool = False) -> Optional[int]:
    if val is None and optional:
        return None
    if not isinstance(val, int) or isinstance(val, bool) or val < 1:
        raise GraddbgValueError(f"{arg}= must be {'None or ' if optional else ''}an int >= 1, got {val!r}")
    return val


def _config(every: int, stats: Any, nonfinite: Any, explode: Any, vanish: Any, activations: bool,
            histograms: Any, scaler: Any, history: int, ddp_check_every: Optional[int], ddp_timeout: Any,
            update_every: Optional[int], localize: bool) -> _Config:
    if histograms is not None and not isinstance(histograms, (bool, int)):
        raise GraddbgTypeError(f"histograms= must be None, a bool or an int (every N steps), "
                               f"got {type(histograms).__name__}")
    hist_every = None if histograms in (None, False) else 1 if histograms is True else _count("histograms", histograms)
    if scaler is not None and not hasattr(scaler, "get_scale"):
        raise GraddbgTypeError(f"scaler= must be a torch.amp.GradScaler or None, got {type(scaler).__name__}")
    if ddp_check_every is not None:
        _count("ddp_check_every", ddp_check_every)
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise GraddbgValueError(f"ddp_check_every={ddp_check_every} needs an initialised process group: call "
                                    f"torch.distributed.init_process_group(...) first (or launch with torchrun), "
                                    f"or pass ddp_check_every=None")
    enabled = scaler is not None and getattr(scaler, "is_enabled", lambda: True)()
    return _Config(_count("every", every), validate_stats(stats), as_detector(nonfinite, "nonfinite"),
                   as_detector(explode, "explode"), as_detector(vanish, "vanish"), bool(activations),
                   hist_every, scaler if enabled else None, _count("history", history), ddp_check_every,
                   ddp_timeout, _count("update_every", update_every, optional=True), bool(localize),
                   CPU_ABSMAX_EVERY if stats is DEFAULT_STATS else 1)


def _real_optimizer(optimizer: Any) -> Optional[torch.optim.Optimizer]:
    """The torch optimizer, also inside a wrapper that holds it as ``.optimizer``
    (accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``)."""
    for _ in range(4):  # (AcceleratedOptimizer is itself an Optimizer that steps its .optimizer)
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            break
        optimizer = inner
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    raise GraddbgTypeError(f"watch(optimizer=...): got {type(optimizer).__name__}, expected a "
                           f"torch.optim.Optimizer (or a wrapper holding one as .optimizer) or None")


# --------------------------------------------------------------------------- per-step state
@dataclasses.dataclass
class _Pending:
    """Statistics launched at the end of a backward pass, waiting for the step boundary."""

    step: int
    launch: Any
    grads: List[Optional[Tensor]]
    versions: List[int]
    scale: Optional[float]


class _Flags:
    """Non-finite flags accumulated on the device between host reads: which parameters
    went non-finite, and at which step first (no host synchronisation, no copy to the
    device). Kept per group of parameters reduced together."""

    def __init__(self) -> None:
        self.groups: Dict[Tuple[int, ...], Tuple[Tensor, Tensor]] = {}

    def add(self, reader: StepReader, launch: Any, step: int) -> None:
        for ix, norms in zip(launch.groups, launch.norms):
            key = tuple(ix)
            new = ~torch.isfinite(norms)
            old = self.groups.get(key)
            if old is None:
                self.groups[key] = (new, torch.where(new, step, -1))
            else:
                bad, first = old
                self.groups[key] = (bad | new, torch.where(new & ~bad, step, first))

    def add_to(self, rb: Readback, agree: bool = False) -> None:
        """Into a read-back; ``agree``: first make the flags the same on every rank (a
        sharded model: each rank flagged its own shards)."""
        for k, (bad, first) in enumerate(self.groups.values()):
            if agree:
                _agree(bad, first)
            rb.add(f"acc_bad{k}", bad)
            rb.add(f"acc_first{k}", first)

    def take(self, got: Dict[str, np.ndarray], P: int) -> Tuple[Optional[np.ndarray], int]:
        """``(bad mask over the P parameters, first bad step)`` from a read-back; resets."""
        bad, first = None, -1
        for k, ix in enumerate(self.groups):
            b = got[f"acc_bad{k}"] > 0
            if b.any():
                f = int(got[f"acc_first{k}"][b].min())
                if bad is None:
                    bad = np.zeros(P, dtype=bool)
                bad[np.asarray(ix)[b]] = True
                first = f if first < 0 else min(first, f)
        self.groups.clear()
        return bad, first


def _agree(bad: Tensor, first: Tensor) -> None:
    """All-reduce non-finite flags (any rank) and their first steps (the earliest), in place."""
    import torch.distributed as dist

    never = torch.iinfo(torch.int64).max
    packed = torch.stack([bad.long(), -torch.where(first < 0, never, first).clamp(max=never - 1)])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    bad.copy_(packed[0] > 0)
    first.copy_(torch.where(packed[0] > 0, -packed[1], -1))


class _Activations:
    """``activations=True``: every module checks its forward output for NaN/Inf (the
    producer of a forward NaN may be a container); leaf modules also record the gradient
    norm at their output. Module hooks under torch.compile are skipped (no graph break);
    the watch warns when activations were asked for and none came."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = list(unwrap(model).named_modules())
        self.names = [n for n, _ in self.modules]
        self.leaf = [next(m.children(), None) is None for _, m in self.modules]
        self.fwd: List[Tuple[int, Tensor, Tensor]] = []
        self.bwd: List[Tuple[int, Tensor]] = []
        self.rows: List[Tuple[int, str, float, int]] = []
        self.seen: set = set()
        self.handles: List[Any] = []
        self.warned = False

    def attach(self, hooks: HookSet, guard: _CopyGuard, alive: Callable[[], bool]) -> None:
        for idx, (_, mod) in enumerate(self.modules):
            hooks.add(mod.register_forward_hook(self._make_hook(idx, alive)))
            guard.protect(mod)

    def _make_hook(self, idx: int, alive: Callable[[], bool]) -> Callable[..., None]:
        leaf = self.leaf[idx]

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if _is_compiling() or not alive() or _in_backward():
                return  # (activation checkpointing recomputes forwards in backward: skipped)
            self.seen.add(idx)
            outs = tensors_in(output)
            if not outs:
                return
            with torch.no_grad():
                dev = outs[0].device
                self.fwd.append((idx, _any_nonfinite(tensors_in(args), dev), _any_nonfinite(outs, dev)))
            if leaf and torch.is_grad_enabled():
                for t in outs:
                    if t.requires_grad:
                        self.handles.append(t.register_hook(self._make_grad_hook(idx, alive)))

        return hook

    def _make_grad_hook(self, idx: int, alive: Callable[[], bool]) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            if alive():
                with torch.no_grad():
                    self.bwd.append((idx, grad.detach().double().pow(2).sum()))

        return hook

    def warn_if_blind(self, had_gradients: bool) -> None:
        """Gradients came, yet no module hook ever ran: the model was called through a
        compiled wrapper (or its submodules' forward() directly). Warn once."""
        if had_gradients and not self.seen and not self.warned:
            self.warned = True
            warnings.warn("graddbg.watch: activations=True recorded nothing: gradients arrived but no "
                          "module's forward hook ran. The watched model is probably called through "
                          "torch.compile (hooks are skipped inside compiled code, so that they break no "
                          "graph), or its modules' .forward() is called directly. Watch the model you call, "
                          "uncompiled, to record activations.", CompileWarning, stacklevel=5)

    def drop(self) -> None:
        """Forget what the last forward registered (its backward never came)."""
        handles, self.handles = self.handles, []
        for h in handles:
            h.remove()
        self.fwd, self.bwd = [], []

    def take(self, rb: Readback) -> Tuple[list, list]:
        fwd, bwd, self.fwd, self.bwd = self.fwd, self.bwd, [], []
        if fwd:
            rb.add("act_fwd", torch.stack([torch.stack([i, o]) for _, i, o in fwd]).double())
        if bwd:
            rb.add("act_bwd", torch.stack([v for _, v in bwd]))
        return fwd, bwd

    def record(self, step: int, fwd: list, bwd: list, got: Dict[str, np.ndarray]) -> None:
        sq: Dict[int, float] = {}
        bad: Dict[int, int] = {}
        for (mi, _, _), (_, out_b) in zip(fwd, got.get("act_fwd", np.zeros(0)).reshape(-1, 2)):
            bad[mi] = bad.get(mi, 0) | int(out_b > 0)
        for (mi, _), v in zip(bwd, got.get("act_bwd", ())):
            sq[mi] = sq.get(mi, 0.0) + float(v)  # a module called twice adds up
        for mi in sorted(set(sq) | {m for m in bad if self.leaf[m]}):
            self.rows.append((step, self.names[mi], math.sqrt(sq[mi]) if mi in sq else math.nan, bad.get(mi, 0)))

    def producer(self, fwd: list, bwd: list, got: Dict[str, np.ndarray], bad_names: Sequence[str]) -> Optional[Tuple[str, str]]:
        """(module, how it was found) from the activations, when they tell."""
        if fwd:
            mi = forward_producer(fwd, got["act_fwd"])
            if mi is not None:
                return self.names[mi], "forward activations"
        if bwd:
            finite: Dict[int, bool] = {}
            for (mi, _), v in zip(bwd, got["act_bwd"]):
                finite[mi] = finite.get(mi, True) and bool(np.isfinite(v))
            calls = [mi for mi, _, _ in fwd if self.leaf[mi]]
            name = backward_producer(calls, finite, self.names, bad_names)
            if name is not None:
                return name, "gradients at module outputs"
        return None

    def frame(self):
        import pandas as pd

        return pd.DataFrame(self.rows, columns=["step", "module", "grad_norm", "out_nonfinite"])


def _warn_if_unseen_scaler(passed: Any) -> None:
    """At the first optimizer step: a GradScaler that steps the optimizer (it is one of the
    callers, ``scaler.step(opt)``) but was not given as ``scaler=`` means the recorded
    statistics are of scaled gradients. Looked for once, in the few frames above the hook."""
    if passed is not None:
        return
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return
        obj = frame.f_locals.get("self")
        if isinstance(obj, torch.amp.GradScaler) and obj.is_enabled():
            warnings.warn("graddbg.watch: a torch.amp.GradScaler steps this optimizer but was not passed "
                          "as scaler=: the statistics are of scaled gradients (multiplied by the loss "
                          "scale) and the scaler's skipped steps look like non-finite gradients. Pass "
                          "graddbg.watch(model, opt, scaler=scaler).", GraddbgWarning, stacklevel=2)
            return
        frame = frame.f_back


def _frozen_parameters(model: nn.Module, watched: Sequence[Tensor]) -> List[Tuple[str, nn.Parameter]]:
    """(clean name, parameter) of the model's parameters that do not require grad now."""
    ids = {id(p) for p in watched}
    out, seen = [], set()
    for name, p in unwrap(model).named_parameters():
        if id(p) not in ids and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


class _UpdateRatio:
    """The update/weight ratio ``||w_old - w_new|| / ||w_old||``: a copy of the weights
    before the optimizer's step on every ``every``-th step, the ratio after it, read back
    with the next read-back (not at once)."""

    def __init__(self, every: Optional[int]) -> None:
        self.every = every
        self._copy: Optional[List[Tensor]] = None
        self._copy_step = -1
        self.pending: Optional[Tuple[int, Tensor]] = None  # (step, [P] ratios on the device)

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def before_step(self, step: int, params: Sequence[Tensor]) -> None:
        """Copy the weights. Where there is no memory for the copy (a model that fills its
        device), the training step goes on: a warning says so and the ratio is switched off."""
        try:
            self._copy = self.copy_weights(params)
            self._copy_step = step
        except torch.cuda.OutOfMemoryError as err:  # (torch.OutOfMemoryError from torch 2.5)
            self.every, self._copy = None, None
            mb = sum(p.numel() * p.element_size() for p in params) / 2**20
            warnings.warn(
                f"graddbg.watch: no memory for the copy of the weights ({mb:.0f} MB) that the "
                f"update/weight ratio needs before the optimizer's step; it is not measured from "
                f"step {step} on, and training goes on. Pass update_every=None to skip it. "
                f"(torch said: {str(err).strip()[:200]})", GraddbgWarning, stacklevel=4)

    @staticmethod
    def copy_weights(params: Sequence[Tensor]) -> List[Tensor]:
        with torch.no_grad():
            return [local_values(p).clone() for p in params]

    def after_step(self, params: Sequence[Tensor]) -> None:
        copy, self._copy = self._copy, None
        if copy is not None:
            with torch.no_grad():
                self.pending = (self._copy_step, update_ratios(copy, params))

    def cancel(self) -> None:
        self._copy = None

    def take(self) -> Optional[Tuple[int, Tensor]]:
        pending, self.pending = self.pending, None
        return pending


def _any_nonfinite(ts: Sequence[Tensor], device: torch.device) -> Tensor:
    flags = [~torch.isfinite(t.detach()).all() for t in ts if t.numel() and t.device == device]
    if not flags:
        return torch.zeros((), dtype=torch.bool, device=device)
    return torch.stack(flags).any()


# --------------------------------------------------------------------------- the watch
class Watch:
    """Records per-parameter gradient statistics and catches anomalies; see :func:`watch`."""

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                 every: int = 1, stats: Sequence[str] = DEFAULT_STATS,
                 nonfinite: Any = "raise", explode: Any = "warn", vanish: Any = None,
                 activations: bool = False, histograms: Union[None, bool, int] = None,
                 scaler: Any = None, history: int = 10_000, ddp_check_every: Optional[int] = None,
                 update_every: Optional[int] = _UPDATE_EVERY, localize: bool = True,
                 ddp_timeout: Any = None) -> None:
        self._closed = True  # until attached: repr() and __del__ work on a half-built watch
        self._hooks = HookSet()
        self._guard = _CopyGuard(self._hooks)
        self._names: List[str] = []
        self._step = 0
        self.anomalies: List[Anomaly] = []
        self._model = check_model(model, "watch")
        self._optimizer = _real_optimizer(optimizer)
        self._cfg = _config(every, stats, nonfinite, explode, vanish, activations, histograms, scaler,
                            history, ddp_check_every, ddp_timeout, update_every, localize)
        self.every = self._cfg.every
        self.stats_asked = self._cfg.stats
        self._set_params(named_trainable_parameters(model))
        self._frozen = _frozen_parameters(model, self._params)
        if not self._params:
            warnings.warn(f"graddbg.watch: {type(model).__name__} has no trainable parameter (none requires "
                          f"grad), so nothing will be recorded until one is unfrozen "
                          f"({len(self._frozen)} frozen).", CoverageWarning, stacklevel=3)
        self._check_optimizer_holds_params()
        self._init_state()
        self.meta = self._meta()
        try:
            self._attach()
        except BaseException:
            self._detach()
            raise
        self._closed = False

    def _set_params(self, named: List[Tuple[str, nn.Parameter]]) -> None:
        self._names = [n for n, _ in named]
        self._modules = [module_of(n) for n in self._names]
        self._params: List[nn.Parameter] = [p for _, p in named]
        self._numel = [p.numel() for p in self._params]
        self._reader = StepReader(self._params, self._cfg.stats)
        P = len(self._params)
        self._version_idx = sorted({0, P // 3, (2 * P) // 3, P - 1}) if P else []

    def _adopt_unfrozen(self) -> None:
        """Parameters frozen when the watch began and trainable now (fine-tuning schedules
        unfreeze layers): recorded from now on."""
        if not self._frozen or not any(p.requires_grad for _, p in self._frozen):
            return
        new = [(n, p) for n, p in self._frozen if p.requires_grad]
        self._frozen = [(n, p) for n, p in self._frozen if not p.requires_grad]
        self._set_params(list(zip(self._names, self._params)) + new)
        self._history.add_params([n for n, _ in new], [p.numel() for _, p in new], self._step)
        self._ever_grad = np.concatenate([self._ever_grad, np.zeros(len(new), dtype=bool)])
        if self._vanish_state is not None:
            self._vanish_state.widen(len(new))

    def _check_optimizer_holds_params(self) -> None:
        opt = self._optimizer
        if opt is None or not self._params:
            return
        held = {id(p) for g in opt.param_groups for p in g["params"]}
        if not any(id(p) in held for p in self._params):
            raise GraddbgValueError(
                f"watch(optimizer=...): {type(opt).__name__} holds none of the model's {len(self._params)} "
                f"trainable parameters; pass the optimizer built from this model's parameters "
                f"(e.g. {type(opt).__name__}(model.parameters(), ...))")

    def _init_state(self) -> None:
        cfg = self._cfg
        self._history = History(self._names, self._numel, self._reader.extras, cfg.history, MAX_ROWS)
        self._update = _UpdateRatio(cfg.update_every if self._optimizer is not None else None)
        self._ddp_every = cfg.ddp_every
        self._explode_state = cfg.explode.new_state() if cfg.explode else None
        self._vanish_state = cfg.vanish.new_state(len(self._params)) if cfg.vanish else None
        self._acts = _Activations(self._model) if cfg.activations else None
        self._flags = _Flags()
        self._ever_grad = np.zeros(len(self._params), dtype=bool)
        self._hist_edges: Optional[Tensor] = None
        self.host_syncs = 0  #: host synchronisations made by the watch (read-backs)
        self._cb_queued = False
        self._bwd_since_fwd = True
        self._pending: Optional[_Pending] = None
        self._capture: Optional[Capture] = None
        self._rng: Optional[Tensor] = None
        self._replaying = False
        self._temp_handles: List[Any] = []
        self._closure_step = self._closure_seen = False
        self._scaler_looked = False
        self._in_policy = False
        self._errors_warned: set = set()

    def _internal_error(self, where: str, step: int, err: Exception) -> None:
        """A failure inside graddbg's own hook: warn once per place, keep the step count
        right, and go on recording."""
        if self._step == step and where in ("_boundary", "_on_opt_pre", "_on_opt_post", "_end_of_backward"):
            self._pending = None
            if where != "_end_of_backward":
                self._finish_step()
        if where in self._errors_warned:
            return
        self._errors_warned.add(where)
        names = ", ".join(self._names[:3]) + (" ..." if len(self._names) > 3 else "")
        warnings.warn(f"graddbg.watch: an internal error in {where} at step {step} (parameters {names}): "
                      f"{type(err).__name__}: {err}. Training goes on; this part of the record is "
                      f"missing for that step. Please report it.", GraddbgWarning, stacklevel=3)

    def _meta(self) -> Dict[str, Any]:
        cfg, opt = self._cfg, self._optimizer
        meta = {"model": type(unwrap(self._model)).__name__, "optimizer": type(opt).__name__ if opt else None,
                "every": cfg.every, "stats": list(cfg.stats), "torch": torch.__version__,
                "nonfinite": _policy_name(cfg.nonfinite), "explode": _policy_name(cfg.explode),
                "vanish": _policy_name(cfg.vanish), "params": len(self._params),
                "numel": int(sum(self._numel)), "world_size": 1, "rank": 0, "uncovered": []}
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            meta["world_size"], meta["rank"] = dist.get_world_size(), dist.get_rank()
        return meta

    # ------------------------------------------------------------------ attaching
    def _attach(self) -> None:
        model, opt, hooks = self._model, self._optimizer, self._hooks
        script = isinstance(model, torch.jit.ScriptModule)
        if self._acts is not None and (is_compiled(model) or script):
            warnings.warn(
                "graddbg.watch: activations=True needs module hooks inside the model, which a "
                f"{'TorchScript' if script else 'compiled'} model ignores or breaks graphs for; "
                "activation gradients are not recorded. Watch the model before compiling it, or "
                "pass activations=False.", CompileWarning, stacklevel=4)
            self._acts = None
        if not script:
            hooks.add(model.register_forward_pre_hook(self._on_root_pre, with_kwargs=True))
            hooks.add(model.register_forward_hook(self._on_root_forward, with_kwargs=True))
            self._guard.protect(model)
        if opt is not None:
            hooks.add(opt.register_step_pre_hook(self._on_opt_pre))
            hooks.add(opt.register_step_post_hook(self._on_opt_post))
        # the end of a backward pass is seen from the model's output (when its own forward
        # ran) or from parameters' gradients: every parameter without an optimizer (each
        # backward is a step), a few spread over the model with one (when the model is
        # called through another method, as a LightningModule's training_step does)
        P = len(self._params)
        for i in (range(P) if opt is None else sorted({(k * P) // 8 for k in range(8)} | {P - 1})):
            if 0 <= i < P:
                hooks.add(self._params[i].register_post_accumulate_grad_hook(self._on_param_grad))
        if self._acts is not None:
            self._acts.attach(hooks, self._guard, self._alive)

    def _alive(self) -> bool:
        return not self._closed and not self._replaying

    def _detach(self) -> None:
        self._hooks.remove_all()
        self._guard.release()
        for h in self._temp_handles:
            h.remove()
        self._temp_handles = []
        if self._acts is not None:
            self._acts.drop()

    # ------------------------------------------------------------------ hook bodies
    @_guarded
    def _on_root_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if _is_compiling() or self._replaying or not torch.is_grad_enabled() or _in_backward():
            return None
        if not self._bwd_since_fwd:
            # the previous forward pass was never backpropagated (an evaluation loop with
            # grad enabled, say): drop what it registered, so nothing piles up
            self._drop_forward_state()
        self._bwd_since_fwd = False
        if self._cfg.localize:
            self._rng = torch.get_rng_state()
        return None

    def _drop_forward_state(self) -> None:
        handles, self._temp_handles = self._temp_handles, []
        for h in handles:
            h.remove()
        if self._acts is not None:
            self._acts.drop()

    @_guarded
    def _on_root_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if _is_compiling() or self._replaying or not torch.is_grad_enabled() or _in_backward():
            return None
        for i, t in enumerate(tensors_in(output)):
            if t.requires_grad:
                cap = Capture(args, kwargs, self._rng, i) if self._cfg.localize else None
                fn = t.grad_fn
                if fn is not None:  # (a pre-hook on its node costs less than a tensor hook)
                    handle = fn.register_prehook(self._make_output_hook(cap, t.output_nr))
                else:
                    handle = t.register_hook(self._make_output_hook(cap, None))
                self._temp_handles.append(handle)
                break
        return None

    def _make_output_hook(self, cap: Optional[Capture], output_nr: Optional[int]) -> Callable[[Any], None]:
        """The hook that sees the gradient of the model's output: a tensor hook
        (``output_nr`` None) or a pre-hook on the output's autograd node."""
        wself = weakref.ref(self)

        def hook(grad: Any) -> None:
            w = wself()
            if w is None or not w._alive():
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

    @_guarded
    def _end_of_backward(self) -> None:
        self._cb_queued = False
        if self._closed:
            return
        if self._optimizer is None:
            self._boundary()
            return
        # with an optimizer the boundary is its step; launch now what the step needs, so
        # that a clip between backward and step does not hide the pre-clip gradient
        prev = self._pending
        if self._closure_step:
            if self._closure_seen:
                return  # step(closure) evaluated again (LBFGS): the first evaluation's gradients count
            self._closure_seen = True
        scale = self._scale()
        if prev is not None and prev.step == self._step and scale is not None and prev.scale is not None \
                and scale < prev.scale:
            self._record_overflow(prev)
        elif prev is not None:
            # gradients of a backward pass the optimizer never stepped on (zeroed, or
            # accumulated on): their non-finite flags are kept until the next read
            self._flags.add(self._reader, prev.launch, self._step)
        self._adopt_unfrozen()
        grads = [p.grad for p in self._params]
        launch = self._reader.launch(grads, absmax=self._absmax_due(grads), extras=True)
        self._pending = _Pending(self._step, launch, grads, self._versions(grads), scale)

    def _scale(self) -> Optional[float]:
        if self._cfg.scaler is None:
            return None
        self.host_syncs += 1
        return float(self._cfg.scaler.get_scale())

    def _versions(self, grads: Sequence[Optional[Tensor]]) -> List[int]:
        """In-place version counters of a few gradients spread over the model (the first,
        the last and two between): clipping and AMP's ``unscale_`` change every gradient,
        and reading all the counters costs about a microsecond per parameter."""
        return [-1 if grads[i] is None else grads[i]._version for i in self._version_idx]

    @_guarded
    def _on_opt_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self._closed:
            return None
        if not self._scaler_looked:
            self._scaler_looked = True
            _warn_if_unseen_scaler(self._cfg.scaler)
        closure = args[1] if len(args) > 1 else kwargs.get("closure")  # (args[0] is the optimizer)
        if closure is not None:
            # step(closure): the closure runs backward inside the step; the gradients it
            # computes are read after the step (the first evaluation's, for LBFGS)
            self._closure_step, self._closure_seen = True, False
            if self._step % self._cfg.every == 0 and self._update.due(self._step):
                self._update.before_step(self._step, self._params)
            return None
        self._boundary()
        return None

    @_guarded
    def _on_opt_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self._closed:
            return
        if self._closure_step:
            self._closure_step = False
            try:
                self._boundary()
            finally:
                self._update.after_step(self._params)
            return
        self._update.after_step(self._params)

    # ------------------------------------------------------------------ step boundary
    def _absmax_due(self, grads: Sequence[Optional[Tensor]]) -> bool:
        if "absmax" not in self._cfg.stats:
            return False
        g = next((g for g in grads if g is not None), None)
        on_cpu = g is None or g.device.type == "cpu"
        return self._step % (self._cfg.every * (self._cfg.absmax_cpu_every if on_cpu else 1)) == 0

    def _boundary(self) -> None:
        """One step boundary: launch, read back once, record, detect, apply the policies."""
        step, cfg = self._step, self._cfg
        due_stats = step % cfg.every == 0
        due_nf = cfg.nonfinite is not None and step % cfg.nonfinite.every == 0
        grads, launch, scale, clipped = self._launch()
        if not (due_stats or due_nf or (self._ddp_every and step % self._ddp_every == 0)):
            # no read this step: flags stay on the device (of the gradients as the optimizer
            # will use them, when they changed since the backward pass)
            self._flags.add(self._reader, self._reader.launch(grads) if clipped else launch, step)
            self._history.append(StepRecord(step, None, math.nan, math.nan, False, scale, self._lr()))
            self._finish_step()
            return
        rb = Readback()
        parts = self._queue_reads(rb, launch, grads, clipped, due_stats)
        got = rb.fetch()
        self.host_syncs += 1  # (counted on the CPU too: the same code path as on a GPU)
        st, bad, first_bad = self._read_stats(launch, got, grads, scale)
        clip_norm, bad = self._after_change(got, parts["clip_live"], bad)
        rec = StepRecord(step, st if due_stats else None, st.global_norm, clip_norm, False, scale, self._lr(),
                         hist=parts["hist"](got))
        self._history.append(rec)
        if self._acts is not None:
            self._acts.record(step, parts["fwd"], parts["bwd"], got)
            self._acts.warn_if_blind(bool(st.has_grad.any()))
        found = self._detect(step, st, bad, first_bad, due_stats, parts, got)
        if due_stats and self._update.due(step) and not self._closure_step:
            self._update.before_step(step, self._params)
        self._finish_step()
        self._apply(found, bad)

    def _launch(self) -> Tuple[List[Optional[Tensor]], Any, float, bool]:
        """The gradients of this step and their launched statistics: those launched at the
        end of the backward pass when there was one (and whether a clip changed the
        gradients since), else launched now."""
        pending, self._pending = self._pending, None
        if pending is not None and pending.step == self._step:
            scale = pending.scale if pending.scale is not None else math.nan
            return pending.grads, pending.launch, scale, self._versions(pending.grads) != pending.versions
        if pending is not None:
            self._flags.add(self._reader, pending.launch, self._step)
        self._adopt_unfrozen()
        grads = [p.grad for p in self._params]
        scale = self._scale()
        launch = self._reader.launch(grads, absmax=self._absmax_due(grads), extras=True)
        return grads, launch, math.nan if scale is None else scale, False

    def _queue_reads(self, rb: Readback, launch: Any, grads: List[Optional[Tensor]], clipped: bool,
                     due_stats: bool) -> Dict[str, Any]:
        """Everything this step reads back, into ``rb``: the statistics, the norms of the
        gradients as the optimizer will use them when they changed since the backward pass
        (a clip), histograms, the accumulated flags, the last update ratio, activations."""
        parts: Dict[str, Any] = {"clip_live": None}
        self._reader.add_to(rb, launch)
        if clipped:  # changed in place since the backward pass (a clip, unscale_, a hand edit)
            live = [i for i, g in enumerate(grads) if g is not None and type(g) is Tensor and g.layout == torch.strided]
            if live:
                rb.add("clip_norms", torch.stack(torch._foreach_norm([grads[i] for i in live])))
                parts["clip_live"] = live
        hist_due = due_stats and self._cfg.hist_every is not None and self._step % self._cfg.hist_every == 0
        if hist_due:
            rb.add("hist", self._histograms(grads))
        self._flags.add_to(rb, agree=launch.sharded is not None and torch.distributed.is_initialized())
        if self._update.pending is not None:
            rb.add("update", self._update.pending[1])
        fwd, bwd = self._acts.take(rb) if self._acts is not None else ([], [])
        P = len(self._params)
        parts.update(fwd=fwd, bwd=bwd,
                     hist=(lambda got: got["hist"].reshape(P, -1).astype(np.int64)) if hist_due else (lambda got: None))
        return parts

    def _read_stats(self, launch: Any, got: Dict[str, np.ndarray], grads: List[Optional[Tensor]],
                    scale: float) -> Tuple[StepStats, np.ndarray, int]:
        """The host statistics (unscaled), the non-finite mask and its first step."""
        if "update" in got:
            self._history.set_update(self._update.take()[0], got["update"])
        st = self._reader.finish(launch, got)
        div = scale if (self._cfg.scaler is not None and scale == scale and scale > 0) else 1.0
        if div != 1.0:
            st.norm /= div
            st.absmax /= div
            if st.extras is not None:
                for j, c in enumerate(self._reader.extras):
                    if c in ("mean", "std"):
                        st.extras[:, j] /= div
        if self._reader.rescue(st, grads, div):
            self.host_syncs += 1  # on steps with a non-finite (or overflowed) norm only
        self._ever_grad |= st.has_grad
        bad, first = st.bad, self._step
        prior, first_prior = self._flags.take(got, len(self._params))
        if prior is not None:
            bad, first = bad | prior, first_prior
        return st, bad, first

    def _after_change(self, got: Dict[str, np.ndarray], live: Optional[List[int]],
                      bad: np.ndarray) -> Tuple[float, np.ndarray]:
        """The post-clip global norm, and the non-finite mask widened by gradients that went
        non-finite after the backward pass (a clip of an Inf makes NaN; so does a hand edit)."""
        if live is None:
            return math.nan, bad
        norms = got["clip_norms"]
        post = np.zeros(len(bad), dtype=bool)
        post[np.asarray(live)[~np.isfinite(norms)]] = True
        return math.sqrt(float(np.dot(norms, norms))), bad | post

    def _detect(self, step: int, st: StepStats, bad: np.ndarray, first_bad: int, due_stats: bool,
                parts: Dict[str, Any], got: Dict[str, np.ndarray]) -> List[Tuple[Anomaly, Any]]:
        cfg = self._cfg
        found: List[Tuple[Anomaly, Any]] = []
        any_bad = bool(bad.any())
        if any_bad and cfg.nonfinite is not None:
            found.append((self._nonfinite_anomaly(first_bad, bad, st, parts, got), cfg.nonfinite.policy))
        gn = st.global_norm
        if due_stats and self._explode_state is not None and not any_bad:
            a = self._explode_state.check(step, gn, st.norm, self._names, self._modules)
            if a is not None:
                found.append((a, cfg.explode.policy))
        if due_stats and self._vanish_state is not None:
            a = self._vanish_state.check(step, st.norm, st.has_grad, self._names, self._modules)
            if a is not None:
                found.append((a, cfg.vanish.policy))
        if self._ddp_every is not None and step % self._ddp_every == 0:
            a = self._ddp_check(step)
            if a is not None:
                found.append((a, cfg.nonfinite.policy if cfg.nonfinite else "raise"))
        return found

    def _apply(self, found: List[Tuple[Anomaly, Any]], bad: np.ndarray) -> None:
        to_raise: Optional[BaseException] = None
        self._in_policy = True  # (what a user's policy callable raises is theirs: it propagates)
        for anomaly, policy in found:
            self.anomalies.append(anomaly)
            self._history.keep.add(anomaly.step)
            err = apply_policy(anomaly, policy, lambda a=anomaly: self._skip(a, bad))
            if err is not None and to_raise is None:
                to_raise = err
        if to_raise is not None:
            self._update.cancel()
            raise to_raise

    def _skip(self, anomaly: Anomaly, bad: np.ndarray) -> None:
        """The ``"skip"`` policy: the affected gradients are dropped (set to None)."""
        if anomaly.kind == "vanish":
            return
        targets = np.nonzero(bad)[0] if anomaly.kind == "nonfinite" else range(len(self._params))
        for i in targets:
            self._params[i].grad = None

    def _finish_step(self) -> None:
        self._step += 1
        self._capture = None
        self._bwd_since_fwd = True
        handles, self._temp_handles = self._temp_handles, []
        for h in handles:
            h.remove()

    # ------------------------------------------------------------------ helpers
    def _histograms(self, grads: Sequence[Optional[Tensor]]) -> Tensor:
        dev = next((g.device for g in grads if g is not None), torch.device("cpu"))
        if self._hist_edges is None or self._hist_edges.device != dev:
            self._hist_edges = torch.tensor(HIST_EDGES, dtype=torch.float64, device=dev)
        nb = len(HIST_EDGES) + 1
        return torch.stack([histogram_counts(g, self._hist_edges) if g is not None
                            else torch.zeros(nb, dtype=torch.int64, device=dev) for g in grads])

    def _record_overflow(self, pending: _Pending) -> None:
        """The scaler skipped the optimizer step: record it as an overflow step."""
        self._ever_grad |= np.array([g is not None for g in pending.grads], dtype=bool)
        self._history.append(StepRecord(pending.step, None, math.nan, math.nan, True,
                                        float(pending.scale or math.nan), self._lr()))
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

    def _rank(self) -> Optional[int]:
        return self.meta.get("rank", 0) if self.meta.get("world_size", 1) > 1 else None

    # ------------------------------------------------------------------ anomalies
    def _nonfinite_anomaly(self, step: int, bad: np.ndarray, st: StepStats, parts: Dict[str, Any],
                           got: Dict[str, np.ndarray]) -> Anomaly:
        idx = np.nonzero(bad)[0]
        names = [self._names[i] for i in idx]
        state = nonfinite_state(unwrap(self._model)) if self._model is not None else []
        if state:  # a NaN/Inf weight or buffer: it is the producer
            return state_anomaly(state, step, self._rank())
        where = self._localize(step, names, idx, parts, got)
        if where.get("module"):  # name a parameter of the module blamed, when it has one among the affected
            own = [n for n in names if n.startswith(where["module"] + ".")]
            where["name"] = own[0] if own else where.get("name")
        total = int(st.nonfinite[idx].sum()) or None
        if st.shard_ranks:
            where["ranks"] = sorted({r for i in idx for r in st.shard_ranks.get(int(i), ())})
        return nonfinite_anomaly(step, names, [tuple(self._params[i].shape) for i in idx], total, where,
                                 self._rank())

    def _localize(self, step: int, names: List[str], idx: np.ndarray, parts: Dict[str, Any],
                  got: Dict[str, np.ndarray]) -> Dict[str, Any]:
        """Where the non-finite value started: the affected parameter nearest the output
        (the first the backward pass reached), refined by the activations and by a replay
        of the step's forward and backward pass."""
        module = self._modules[idx[-1]]
        where: Dict[str, Any] = {"module": module, "how": "parameter gradients",
                                 "name": next(n for n, i in zip(names, idx) if self._modules[i] == module)}
        if self._acts is not None:
            found = self._acts.producer(parts["fwd"], parts["bwd"], got, names)
            if found is not None:
                where["module"], where["how"] = found
        cap = self._capture
        if self._cfg.localize and cap is not None and step == self._step:
            self._replaying = True
            try:
                ran, got_replay = replay(self._model, cap, step)
            finally:
                self._replaying = False
            where["reproduced"] = (got_replay is not None) if ran else None
            if got_replay is not None and (got_replay.module is not None or got_replay.op is not None):
                where.update(module=got_replay.module if got_replay.module is not None else where["module"],
                             op=got_replay.op, source=got_replay.source,
                             how="a replay of the forward and backward pass")
        return where

    def _ddp_check(self, step: int) -> Optional[Anomaly]:
        from graddbg import ddp_verify

        kw = {} if self._cfg.ddp_timeout is None else {"timeout": self._cfg.ddp_timeout}
        try:
            report = ddp_verify.check_gradients(self._model, **kw)
        except GraddbgValueError as err:  # (the same on every rank) e.g. pure FSDP: no replicas
            self._ddp_every = None
            warnings.warn(f"graddbg.watch: ddp_check_every is switched off: {err}", GraddbgWarning, stacklevel=2)
            return None
        self.host_syncs += 1
        if report.ok:
            return None
        mm = report.mismatches
        name = str(mm["name"].iloc[0]) if len(mm) else None
        return Anomaly(step=step, kind="ddp_mismatch", name=name, module=module_of(name) if name else None,
                       op=None, value=float(len(mm)), threshold=0.0, source=None,
                       message=f"graddbg: gradients differ across ranks at step {step}:\n{report}",
                       rank=self.meta.get("rank"),
                       params=tuple(dict.fromkeys(str(n) for n in mm["name"])) if len(mm) else ())

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
        last = self._history.last
        return bool(last is not None and last["overflow"])

    def _flush(self) -> None:
        pending = self._update.take()
        if pending is not None:
            self._history.set_update(pending[0], pending[1].cpu().numpy())

    @property
    def stats(self):
        """Tidy DataFrame: one row per (recorded step, parameter)."""
        self._flush()
        return self._history.stats_frame()

    @property
    def steps(self):
        """DataFrame: one row per step boundary (global norm, post-clip norm, overflow, ...)."""
        return self._history.steps_frame()

    @property
    def histograms(self):
        """Histogram counts of |grad| per (step, parameter, bin), or None when not asked for."""
        return self._history.hist_frame() if self._cfg.hist_every is not None else None

    @property
    def activations(self):
        """Gradient norm at each leaf module's output per step, or None without activations=True."""
        return self._acts.frame() if self._acts is not None else None

    def summary(self, by: str = "param"):
        """One row per parameter (``by="param"``) or module (``by="module"``) over all recorded steps."""
        from graddbg.stats import summarize

        return summarize(self.stats, by=by)

    def coverage(self):
        """Parameters (and, with activations=True, leaf modules) that produced no data."""
        import pandas as pd

        rows = [{"kind": "param", "name": n, "covered": bool(c)} for n, c in zip(self._names, self._ever_grad)]
        if self._acts is not None:
            rows += [{"kind": "module", "name": n, "covered": i in self._acts.seen}
                     for i, n in enumerate(self._acts.names) if self._acts.leaf[i]]
        return pd.DataFrame(rows, columns=["kind", "name", "covered"])

    def _uncovered(self) -> List[str]:
        return [n for n, c in zip(self._names, self._ever_grad) if not c]

    def to_run(self):
        """A snapshot of what was recorded, as a :class:`graddbg.run.Run`."""
        from graddbg.run import Run

        meta = dict(self.meta, uncovered=self._uncovered(), steps_dropped=self._history.dropped)
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
            pending = self._pending
            if pending is not None and self._cfg.scaler is not None and pending.scale is not None:
                if float(self._cfg.scaler.get_scale()) < pending.scale:
                    self._record_overflow(pending)
            self._flush()
        finally:
            self._detach()
            self._pending = self._capture = None
            self._update.cancel()
            # keep only what the tables need; no tensors of the user's past the watch
            self._params = []
            self._model = None  # type: ignore[assignment]
            self._optimizer = None
            if self._acts is not None:
                self._acts.modules = []

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        uncovered = self._uncovered()
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
                self._detach()
        except Exception:
            pass


def _policy_name(det: Any) -> Any:
    if det is None:
        return None
    p = det.policy
    return p if isinstance(p, str) or p is None else getattr(p, "__name__", "callable")


def watch(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *, every: int = 1,
          stats: Sequence[str] = DEFAULT_STATS, nonfinite: Any = "raise", explode: Any = "warn",
          vanish: Any = None, activations: bool = False, histograms: Union[None, bool, int] = None,
          scaler: Any = None, history: int = 10_000, ddp_check_every: Optional[int] = None,
          update_every: Optional[int] = _UPDATE_EVERY, localize: bool = True, ddp_timeout: Any = None) -> Watch:
    """Watch a model's gradients while it trains; use as a context manager.

    Step boundaries: the optimizer's step when ``optimizer`` is given (statistics of the
    accumulated gradient it is about to use: one record per optimizer step under gradient
    accumulation, and the pre-clip gradient if you clip between backward and step, with
    the post-clip global norm in ``w.steps.clipped_norm``; with ``step(closure)``, as LBFGS
    and Lightning call it, the gradients that closure computed, read after the step: for
    LBFGS, which evaluates the closure several times, its first evaluation, at the weights
    the step starts from); otherwise the end of each backward pass; ``w.step()`` marks one
    by hand.

    Statistics (``stats=``: "norm", "absmax", "nonfinite" always; "mean", "std",
    "zero_frac" on request) are computed on the gradients' device with torch's batched
    kernels and read back once per recorded step (every ``every``-th). The largest
    magnitude ("absmax") costs a second pass over the gradients: with the default
    ``stats=``, on the CPU it is read on every 10th recorded step (NaN between), on
    accelerators on every one; name it in ``stats=`` to have it on every recorded step. ``nonfinite``,
    ``explode`` and ``vanish`` take a policy ("raise", "warn", "skip", "record", a callable,
    or None) or a detector (:class:`graddbg.NonFinite`, :class:`graddbg.Explode`,
    :class:`graddbg.Vanish`). With ``NonFinite(every=k)`` and ``every=k`` the steps between
    checks make no host synchronisation: flags accumulate on the device and the first bad
    step is still named.

    ``history`` bounds the steps kept, and the per-parameter rows are bounded by
    ``graddbg.hooks.MAX_ROWS`` (4 million rows of steps x parameters): when full, the middle
    of the run is thinned evenly, and the first steps, the latest steps and every anomaly's
    step stay. ``update_every``: the update/weight ratio ||Δw||/||w|| is measured on every
    ``update_every``-th recorded step, the first included (NaN on other steps, and where
    ||w|| is 0); it needs a copy of every weight before the optimizer's step. Where the
    device has no memory left for the copy, a warning says so, the ratio is switched off
    and training goes on. ``localize``: on a non-finite gradient, replay the last forward
    and backward pass under :func:`graddbg.find_nonfinite` to name the op and source line
    that made it. ``ddp_timeout``: the timeout of ``ddp_check_every``'s checks.

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
                 localize=localize, ddp_timeout=ddp_timeout)
