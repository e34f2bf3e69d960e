"""``watch()``: hooks that record gradient statistics and catch anomalies while you train.

`Watch` owns the hooks (every handle is kept in one set and removed on exit, whether
the body returned or raised) and turns them into a few step events: the
root module's forward, the end of a backward pass, the step boundary (the optimizer's step,
or the end of each backward pass without an optimizer, or ``w.step()``), after the
optimizer's step, and close. Each event goes to an ordered list of small checks
(`graddbg.checks`): the statistics recorder reads the gradients once per step; the
detectors, the update ratio, activations, the replica check and the hygiene checks read
what it measured or cheap host-side facts. The findings of a step are handled by their
policies once, by the watch.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import sys
import warnings
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from graddbg._errors import CoverageWarning, GradientAnomalyError, GraddbgTypeError, GraddbgValueError, \
    GraddbgWarning, warn_at_user
from graddbg._deepspeed import find as find_deepspeed
from graddbg._dist.layout import Layout
from graddbg._hookset import HookSet
from graddbg._model import check_model, in_backward, named_trainable_parameters, tensors_in, unwrap
from graddbg.anomaly import Anomaly, AnomalyList, Explode, NonFinite, Vanish, apply_policy
from graddbg.blame import Capture, LossTape, reap
from graddbg.checks.hygiene import fact_anomaly, unused_anomaly, unused_facts
from graddbg.checks import BackwardEnd, Check, Finding, Ledger, Step, Watched, default_checks
from graddbg.checks.base import finding, shown
from graddbg.checks.ledger import param_versions
from graddbg.options import COPY_BUDGET, UPDATE_EVERY, WatchOptions, options_in_signature
from graddbg.stats import DEFAULT_STATS, History
from graddbg.trackers import Sink

if TYPE_CHECKING:  # pragma: no cover - type names only
    import pandas
    from matplotlib.figure import Figure

PathLike = Union[str, "os.PathLike[str]"]

# (HookSet, graddbg's own hook bookkeeping, stays importable from here: not in the reference)
__all__ = ["Watch", "watch", "MAX_ROWS"]

#: the history's bound in rows (steps x parameters) beside watch(history=) in steps
MAX_ROWS = 4_000_000

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
_is_compiling = torch.compiler.is_compiling


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A hook body that never takes the training loop down by a bug of graddbg's own: an
    unexpected exception becomes one `GraddbgWarning` naming what failed, and
    recording goes on. Anomalies under the ``"raise"`` policy, and whatever a user's policy
    callable raises, still propagate."""

    @functools.wraps(fn)
    def wrapper(self: "Watch", *args: Any, **kwargs: Any) -> Any:
        step = self.clock.index
        try:
            return fn(self, *args, **kwargs)
        except Exception as err:
            if isinstance(err, GradientAnomalyError) or self._in_policy:
                raise
            # a failure inside graddbg's own hook: warn once per place, keep the step count
            # right, and go on recording
            where = fn.__name__
            if self.clock.index == step and where in ("_boundary", "_on_opt_pre", "_on_opt_post"):
                self._finish_step()
            if where not in self._errors_warned:
                self._errors_warned.add(where)
                names = ", ".join(self.ctx.names[:3]) + (" ..." if len(self.ctx.names) > 3 else "")
                warn_at_user(f"graddbg.watch: an internal error in {where} at step {step} (parameters {names}): "
                             f"{type(err).__name__}: {err}. Training goes on; this part of the record is "
                             f"missing for that step. Please report it.", GraddbgWarning)
            return None
        finally:
            self._in_policy = False

    return wrapper


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


def find_scaler(depth: int = 8) -> Any:
    """The enabled ``torch.amp.GradScaler`` among the callers of the current frame (the one
    whose ``step(optimizer)`` is running), or None. Used at an optimizer step's first
    boundary; looks at a few frames only."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if isinstance(obj, torch.amp.GradScaler) and obj.is_enabled():
            return obj
        frame = frame.f_back
    return None


def _frozen_parameters(model: nn.Module, watched: List[Tensor]) -> List[Tuple[str, nn.Parameter]]:
    """(clean name, parameter) of the model's parameters that do not require grad now."""
    ids = {id(p) for p in watched}
    out, seen = [], set()
    for name, p in unwrap(model).named_parameters():
        if id(p) not in ids and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


_EVENTS = ("due", "on_forward", "on_output_grad", "on_backward_end", "queue", "read", "before_step", "after_step",
           "params_added")


def _handlers(checks: List[Check]) -> Dict[str, List[Callable[..., Any]]]:
    """Per event, the bound methods of the checks that handle it (those that override the
    base class's no-op), in the checks' order: an event costs only the checks that need it."""
    return {e: [getattr(c, e) for c in checks if getattr(type(c), e) is not getattr(Check, e)] for e in _EVENTS}


def _world() -> Tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# --------------------------------------------------------------------------- the model's output
class _OutputTap:
    """The hooks on the model's output of each forward pass: the end of the backward pass
    seen from the output's gradient, and what a replay of the step needs (the inputs, the
    RNG state, the output's gradient). Temporary: removed at each step, and when a forward
    pass was never backpropagated (an evaluation loop with grad enabled)."""

    def __init__(self, localise: bool, on_gradient: Callable[[], None], alive: Callable[[], bool],
                 on_output_grad: Optional[Callable[[Tensor], None]] = None) -> None:
        self.localise, self._on_gradient, self._alive = localise, on_gradient, alive
        self._on_output_grad = on_output_grad  # (DeepSpeed: each rank's evidence, see _deepspeed.Origin)
        self.handles = HookSet()        # this forward pass's hooks on its output
        self._warned = False
        self.capture: Optional[Capture] = None
        self._rng: Optional[Tensor] = None
        self._backward_since = True
        self._tape: Optional[LossTape] = None  # the loss code of the last forward pass, being recorded

    def before(self, rng_state: Optional[Tensor] = None) -> None:
        self.end_tape()
        if not self._backward_since:
            self.clear()  # (the previous forward pass's output never got a gradient)
        self._backward_since = False
        if self.localise:
            self._rng = torch.get_rng_state() if rng_state is None else rng_state

    def after(self, args: Any, kwargs: Any, output: Any) -> None:
        for i, t in enumerate(tensors_in(output)):
            if t.requires_grad:
                cap = Capture(args, kwargs, self._rng, i) if self.localise else None
                fn = t.grad_fn
                if fn is not None:  # (a pre-hook on its node costs less than a tensor hook)
                    self.handles.add(fn.register_prehook(self._hook(cap, t.output_nr)))
                else:
                    self.handles.add(t.register_hook(self._hook(cap, None)))
                if cap is not None:  # (the code between the output and backward: a NaN made there is named)
                    cap.tape = self._tape = LossTape.begin(tensors_in(output))
                return

    def _hook(self, cap: Optional[Capture], output_nr: Optional[int]) -> Callable[[Any], None]:
        """A tensor hook (``output_nr`` None) or a pre-hook on the output's autograd node."""
        wself = weakref.ref(self)

        def hook(grad: Any) -> None:
            tap = wself()
            if tap is None or not tap._alive():
                return
            try:
                tap._hooked(grad, cap, output_nr)
            except Exception as err:  # (inside the user's backward pass: never raise there)
                tap.failed(err)

        return hook

    def _hooked(self, grad: Any, cap: Optional[Capture], output_nr: Optional[int]) -> None:
        self._backward_since = True
        if output_nr is not None:
            grad = grad[output_nr]
        if cap is not None and grad is not None:
            cap.grad = grad
            self.capture = cap
        if self._on_output_grad is not None and isinstance(grad, Tensor):
            self._on_output_grad(grad)
        self._on_gradient()

    def failed(self, err: Exception) -> None:
        """A failure in the hook on the output's gradient: one warning, training goes on."""
        if not self._warned:
            self._warned = True
            warn_at_user(f"graddbg.watch: an internal error in the hook on the model output's gradient: "
                         f"{type(err).__name__}: {err}. Training goes on; the end of that backward pass may be "
                         f"missed. Please report it.", GraddbgWarning)

    def clear(self) -> None:
        """The step ended (or the watch closed): its hooks and capture go."""
        self.end_tape()
        self.capture = None
        self._backward_since = True
        self.handles.remove_all()

    def end_tape(self) -> None:
        """The loss code's recording stops (at the step, at the next forward pass)."""
        tape, self._tape = self._tape, None
        if tape is not None:
            tape.end()
        else:
            reap()


def _check_optimizer(ctx: Watched) -> Optional[str]:
    """What an optimizer that holds none of the model's trainable parameters holds instead:
    ``"copies"`` (tensors of the same shapes and dtypes: another instance of the model, or a
    deep copy made apart from the optimizer's), ``"masters"`` (the same shapes in another
    dtype: master copies of the weights, as hand-written mixed precision keeps them), or an
    error (anything else is a usage error); None when it holds the model's parameters."""
    opt = ctx.optimizer
    if opt is None or not ctx.params or ctx.held_by_optimizer() is not None:
        return None
    held = [p for g in opt.param_groups for p in g["params"]]
    mine = sorted((tuple(p.shape), str(p.dtype)) for p in ctx.params)
    if len(held) == len(ctx.params) and sorted(tuple(p.shape) for p in held) == [s for s, _ in mine]:
        return "copies" if sorted((tuple(p.shape), str(p.dtype)) for p in held) == mine else "masters"
    raise GraddbgValueError(
        f"watch(optimizer=...): {type(opt).__name__} holds none of the model's {len(ctx.params)} "
        f"trainable parameters; pass the optimizer built from this model's parameters "
        f"(e.g. {type(opt).__name__}(model.parameters(), ...))")


class _Apart:
    """An optimizer over tensors apart from the model's (`_check_optimizer`): the watch goes on
    as ``watch(model)`` (each backward pass a step), and this hook on the optimizer's step says
    what that means. Copies of the same dtype: the model the loss is computed with is not the
    one being trained (``orphan_param``, at once). Master copies in another dtype: healthy as
    long as they are written back; ``orphan_param`` once the optimizer stepped ``PATIENCE``
    times and no weight of the model changed since the watch began (host version counters)."""

    PATIENCE = 3

    @classmethod
    def take(cls, what: Optional[str], ctx: Watched, apply: Callable[[List[Finding]], None],
             clock: Any) -> Optional["_Apart"]:
        """The optimizer `_check_optimizer` found holding copies (``what``), taken off the
        context: the watch goes on as ``watch(model)``; None when there is none."""
        if what is None:
            return None
        apart = cls(what, ctx.optimizer, ctx, apply, lambda: clock.index)
        ctx.amend(optimizer=None)
        return apart

    def __init__(self, what: str, opt: Any, ctx: Watched, apply: Callable[[List[Finding]], None],
                 index: Callable[[], int]) -> None:
        self.what, self.opt, self.ctx, self._apply, self._index = what, opt, ctx, apply, index
        self._versions = param_versions(ctx.params)
        self._steps = 0
        self._done = False

    def first(self) -> List[Finding]:
        if self.what != "copies":
            return []
        self._done = True
        held = [p for g in self.opt.param_groups for p in g["params"]]
        msg = (f"graddbg: the optimizer trains another copy of the model: {type(self.opt).__name__} holds none of the "
               f"model's {len(self.ctx.params)} trainable parameters, but {len(held)} other tensors of exactly their "
               f"shapes and dtypes. The parameters the loss reaches ({shown(list(self.ctx.names))}) get gradients "
               f"that no param group holds, and the tensors it steps are not in the model watched. Likely cause: "
               f"the model was built twice (or deep-copied apart from its optimizer: copy.deepcopy(optimizer) copies "
               f"the parameters it holds). Fix: build the optimizer from the parameters of the model you train "
               f"(SGD(model.parameters(), ...)) after the model is final. The watch goes on as watch(model).")
        return [finding("orphan_param", 0, list(self.ctx.names), list(self.ctx.modules), msg,
                        self.ctx.options.orphan_param, self.ctx.rank)]

    def stepped(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self._done or self.ctx.options.orphan_param is None:
            return
        if (param_versions(self.ctx.params) != self._versions).any():
            self._done = True  # (the copies are written back: nothing to say)
            return
        self._steps += 1
        if self._steps < self.PATIENCE:
            return
        self._done = True
        dtype = next(p for g in self.opt.param_groups for p in g["params"]).dtype
        msg = (f"graddbg: the model is not trained: {type(self.opt).__name__} steps {len(self.ctx.params)} master "
               f"copies of its weights in {dtype} (no param group holds the model's own parameters), it has stepped "
               f"{self._steps} times, and no weight of the model has changed since the watch began (their version "
               f"counters have not moved). Likely cause: the updated copies are never written back into the model. "
               f"Fix: copy them back after each step (with torch.no_grad(): p.copy_(master)).")
        self._apply([finding("orphan_param", self._index(), list(self.ctx.names),
                             list(self.ctx.modules), msg, self.ctx.options.orphan_param, self.ctx.rank)])


def _meta(opts: WatchOptions, ctx: Watched) -> Dict[str, Any]:
    """The run's facts, saved with it."""
    names = {k: None if getattr(opts, k) is None else opts.policy(k) for k in ("nonfinite", "explode", "vanish")}
    names = {k: v if isinstance(v, str) or v is None else getattr(v, "__name__", "callable")
             for k, v in names.items()}
    return {"model": type(unwrap(ctx.model)).__name__,
            "optimizer": type(ctx.optimizer).__name__ if ctx.optimizer else None,
            "every": opts.every, "stats": list(opts.quantities), "torch": torch.__version__, **names,
            "params": len(ctx.params), "numel": int(sum(ctx.numel)), "world_size": ctx.world_size,
            "rank": ctx.rank or 0, "uncovered": []}


def _drop_grads(params: List[Tensor], which: Optional[List[int]]) -> None:
    """The ``"skip"`` policy: the affected gradients (all when None) are set to None."""
    for i in range(len(params)) if which is None else which:
        params[i].grad = None


# --------------------------------------------------------------------------- when a step ends
class StepClock:
    """Where the step boundaries fall, from the order of the events alone (no tensors, no
    autograd): the optimizer's step is the boundary, except ``step(closure)`` (the backward
    pass runs inside it: the boundary comes after the step, and of several evaluations of
    the closure, as LBFGS makes, the first counts); a GradScaler that updated since the
    last backward pass of a step that never came skipped that step.

    Examples:
        >>> c = StepClock(); c.backward_ended(None), c.step_began(closure=False)
        ((True, False), True)
        >>> c.advance(); c.step_began(closure=True), c.backward_ended(None), c.backward_ended(None)
        (False, (True, False), (False, False))
        >>> c.step_ended(), c.index
        (True, 1)
    """

    def __init__(self) -> None:
        self.index = 0  #: the number of the next step boundary
        self._closure = self._closure_seen = False
        self._bw: Tuple[int, Any] = (-1, None)  # (step, the scaler's per-step state) of the last backward

    def backward_ended(self, scaler_state: Any) -> Tuple[bool, bool]:
        """A backward pass ended: (whether it counts, whether the scaler skipped the step of
        the backward pass before it)."""
        if self._closure:
            if self._closure_seen:
                return False, False  # step(closure) evaluated again (LBFGS): the first evaluation counts
            self._closure_seen = True
        last_step, last_state = self._bw
        skipped = last_step == self.index and scaler_state is not None and last_state is not None \
            and scaler_state is not last_state
        return True, skipped

    def noted(self, scaler_state: Any) -> None:
        """The backward pass that counted is recorded (after a skipped step, if any)."""
        self._bw = (self.index, scaler_state)

    def adopt(self, scaler_state: Any) -> None:
        """A scaler found during the step of the last backward pass: its state from now."""
        if self._bw[0] == self.index:
            self._bw = (self.index, scaler_state)

    def waiting(self, scaler_state: Any) -> bool:
        """At close: the last backward pass's step never came and the scaler updated since."""
        return scaler_state is not None and self._bw[1] is not None and scaler_state is not self._bw[1] \
            and self._bw[0] == self.index

    def step_began(self, closure: bool) -> bool:
        """The optimizer's step begins: whether this is the boundary (not with a closure)."""
        if closure:
            self._closure, self._closure_seen = True, False
            return False
        return True

    def step_ended(self) -> bool:
        """The optimizer's step ended: whether the boundary falls now (after a closure)."""
        closure, self._closure = self._closure, False
        return closure

    def advance(self) -> None:
        self.index += 1


def scale_of(scaler: Any) -> Optional[Tensor]:
    """A GradScaler's scale now, as a tensor on its device (a copy: the scaler updates its
    own in place), or None; no host read: it rides a step's read-back."""
    scale = None if scaler is None else scaler._scale  # (None until the scaler has scaled a loss)
    return None if scale is None else scale.detach().clone()


def scaler_state(scaler: Any) -> Any:
    """A GradScaler's per-step state object, a new one after each ``update()`` (compared by
    identity, on the host, to tell a step it skipped)."""
    return None if scaler is None else getattr(scaler, "_per_optimizer_states", None)


def _path(zero: Any, optimizer: Any, scaler: Any, closure: bool, manual: bool) -> str:
    """How the step was taken (the ledger's ``path``)."""
    if manual:
        return "manual"
    if zero is not None:
        return "engine"
    if optimizer is None:
        return "backward"
    return "closure" if closure else "scaler" if scaler is not None else "optimizer"


# --------------------------------------------------------------------------- the record
class _Results:
    """What a watch recorded, as tables, figures and files (the read side of `Watch`)."""

    @property
    def stats(self):
        """Tidy DataFrame: one row per (recorded step, parameter)."""
        for c in self._steps.checks:
            c.flush()
        return self._ctx.history.stats_frame()

    history = property(lambda self: self._ctx.history, doc="The bounded `graddbg.stats.History` behind "
                       "``stats`` and ``steps``: the latest step without building a frame (``last_recorded()``).")

    @property
    def steps(self):
        """DataFrame: one row per step boundary (global norm, post-clip norm, loss, overflow,
        lr, ...). ``loss`` is the sum of the values handed to ``backward()`` since the previous
        step (the mean of the micro-batches' losses under ``loss / k`` accumulation), read back
        with the step's statistics: NaN on steps not recorded, and where a ``backward()`` got
        a non-scalar or explicit gradients."""
        return self._ctx.history.steps_frame()

    @property
    def ledger(self):
        """DataFrame: one row per step, what happened in it (`graddbg.checks.ledger`): the
        path of the step, the forward passes that fed it (mode, grad mode, autocast), the
        backward passes and what each found in the gradients (``held_before``: none, kept,
        cleared, replaced), what changed the gradients before the step (``between``), each
        param group's lr, how many parameters the step changed (``moved``) and which with a
        gradient it left unchanged, the loss scale and norms of recorded steps, and the
        kinds of the findings made at that step."""
        return self._ctx.ledger.frame(self._ctx.names)

    def what_happened(self, step: int) -> str:
        """What the ledger holds of step ``step`` (an int), in words (also in the report)."""
        from graddbg._args import integer
        from graddbg.checks.ledger import describe

        step = integer("what_happened", "step", step)
        return describe(self._ctx.ledger.find(step), self._ctx.names, step)

    @property
    def histograms(self):
        """Histogram counts of |grad| per (step, parameter, bin), or None when not asked for."""
        return self._ctx.history.hist_frame() if self.options.histograms is not None else None

    @property
    def activations(self):
        """Gradient norm at each leaf module's output per step, or None without activations=True."""
        acts = self._steps.activations
        return acts.frame() if acts is not None else None

    def summary(self, by: str = "param") -> pandas.DataFrame:
        """The statistics rolled up over all recorded steps (`graddbg.stats.summarize`).

        Args:
            by: ``"param"`` (one row per parameter, the default) or ``"module"`` (one row
                per module).

        Returns:
            pandas.DataFrame: one row per parameter or module: its name, the steps
                recorded, the mean and largest norm, non-finite counts, ...

        Examples:
            >>> import torch, graddbg
            >>> model = torch.nn.Linear(3, 1)
            >>> with graddbg.watch(model) as w:
            ...     model(torch.ones(2, 3)).sum().backward()
            >>> list(w.summary()["name"])
            ['weight', 'bias']
        """
        from graddbg.stats import summarize

        return summarize(self.stats, by=by)

    def coverage(self):
        """Parameters (and, with activations=True, leaf modules) that produced no data."""
        import pandas as pd

        rec = self._steps.recorder
        rows = [{"kind": "param", "name": n, "covered": bool(c)} for n, c in zip(self._ctx.names, rec.ever_grad)]
        acts = self._steps.activations
        if acts is not None:
            rows += [{"kind": "module", "name": n, "covered": i in acts.seen}
                     for i, n in enumerate(acts.names) if acts.leaf[i]]
        return pd.DataFrame(rows, columns=["kind", "name", "covered"])

    def to_run(self):
        """A snapshot of what was recorded, as a `graddbg.run.Run`."""
        from graddbg.run import Run

        meta = dict(self.meta, uncovered=self._steps.recorder.uncovered(),
                    steps_dropped=self._ctx.history.dropped)
        if self.anomalies.not_kept:  # findings past MAX_KEPT_PER_KIND of a kind, counted
            meta["anomalies_not_kept"] = self.anomalies.not_kept_records()
        return Run(self.stats, self.steps, list(self.anomalies), histograms=self.histograms,
                   activations=self.activations, meta=meta, ledger=self.ledger)

    def save(self, path: PathLike) -> pathlib.Path:
        """Write what was recorded (statistics, steps, anomalies, ledger) to one parquet
        file, no pickle, that `graddbg.run.load` reads back (`graddbg.run.Run.save`).

        Args:
            path: the file to write (conventionally ``*.parquet``).

        Returns:
            pathlib.Path: ``path``.

        Examples:
            >>> import tempfile, pathlib, torch, graddbg
            >>> model = torch.nn.Linear(3, 1)
            >>> with graddbg.watch(model) as w:
            ...     model(torch.ones(2, 3)).sum().backward()
            >>> path = w.save(pathlib.Path(tempfile.mkdtemp()) / "run.parquet")
            >>> len(graddbg.load(path).stats)
            2
        """
        return self.to_run().save(path)

    def plot(self, kind: str = "flow", **kwargs: Any) -> Figure:
        """A matplotlib figure of what was recorded (`graddbg.run.Run.plot`).

        Args:
            kind: ``"flow"`` (the default), ``"norms"``, ``"heatmap"``, ``"hist"``
                (with ``histograms=``), ``"update"`` or ``"loss"``.
            **kwargs: passed on to the function of `graddbg.plots` that draws ``kind``
                (`graddbg.plots.flow`, `graddbg.plots.norms`, ...).

        Returns:
            matplotlib.figure.Figure: the figure.

        Examples:
            >>> import torch, graddbg
            >>> model = torch.nn.Linear(3, 1)
            >>> with graddbg.watch(model) as w:
            ...     model(torch.ones(2, 3)).sum().backward()
            >>> import matplotlib.figure
            >>> isinstance(w.plot("norms"), matplotlib.figure.Figure)
            True
        """
        return self.to_run().plot(kind, **kwargs)

    def report(self, path: PathLike, **kwargs: Any) -> pathlib.Path:
        """Write one self-contained HTML report: no network, no script (`graddbg.run.Run.report`).

        Args:
            path: where to write it (``*.html``).
            **kwargs: passed on to `graddbg.run.Run.report`: ``graph=`` (a graph to
                include: a `graddbg.graphviz.Graph`, SVG or DOT text, or a root tensor) and
                ``title=`` (the page title).

        Returns:
            pathlib.Path: ``path``.

        Examples:
            >>> import tempfile, pathlib, torch, graddbg
            >>> model = torch.nn.Linear(3, 1)
            >>> with graddbg.watch(model) as w:
            ...     model(torch.ones(2, 3)).sum().backward()
            >>> w.report(pathlib.Path(tempfile.mkdtemp()) / "run.html", title="run 1").suffix
            '.html'
        """
        return self.to_run().report(path, **kwargs)

    def to_tensorboard(self, writer: Any) -> None:
        """Write what was recorded to TensorBoard after the run (`graddbg.run.Run.to_tensorboard`);
        ``log_to=`` of `watch` streams it while the run goes on.

        Args:
            writer: a ``torch.utils.tensorboard.SummaryWriter`` (anything with
                ``add_scalar``) or a log directory.

        Returns:
            None: per-step and per-parameter scalars, the ``|grad|`` histograms and the
                anomalies as text are written to ``writer``.

        Examples:
            >>> import tempfile, torch, graddbg
            >>> model = torch.nn.Linear(3, 1)
            >>> with graddbg.watch(model) as w:
            ...     model(torch.ones(2, 3)).sum().backward()
            >>> with tempfile.TemporaryDirectory() as logdir:
            ...     w.to_tensorboard(logdir)
        """
        self.to_run().to_tensorboard(writer)

    @property
    def every(self) -> int:
        return self.options.every

    @property
    def host_syncs(self) -> int:
        """Host synchronisations made by the watch (read-backs)."""
        return self._ctx.host_syncs

    # ------------------------------------------------------------------ attaching
    @property
    def current_step(self) -> int:
        """The number of the next step boundary (0-based)."""
        return self._clock.index

    @property
    def last_step_skipped(self) -> bool:
        """True when the GradScaler skipped the last step (an overflow)."""
        last = self._ctx.history.last
        return bool(last is not None and last["overflow"])



class _Resumable:
    """The checkpoint side of `Watch`: its state, saved with a trainer's checkpoint and
    restored when the run resumes."""

    def state_dict(self) -> Dict[str, Any]:
        """What a resumed run needs to go on where this one stopped (JSON-able): the step
        count and each check's running state (Explode's running level, which findings were
        made, which parameters ever had a gradient). The trainer callbacks save it with
        their checkpoints; `load_state_dict` restores it."""
        return {"format": "graddbg.watch.state", "version": 1, "step": self._clock.index,
                "params": list(self._ctx.names),
                "checks": {type(c).__name__: c.state_dict() for c in self._steps.checks if c.STATE}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore `state_dict`'s state into this watch (a run resumed from a checkpoint);
        per-parameter state is restored only for the same parameters.

        Raises:
            GraddbgValueError: ``state`` is not a graddbg watch state.
        """
        if not isinstance(state, dict) or state.get("format") != "graddbg.watch.state":
            raise GraddbgValueError(f"Watch.load_state_dict(state=...): got {type(state).__name__}; accepted: "
                                    f"a dict from Watch.state_dict()")
        self._clock.index = int(state.get("step", 0))
        same = list(state.get("params") or []) == list(self._ctx.names)
        for c in self._steps.checks:
            saved = (state.get("checks") or {}).get(type(c).__name__)
            if saved:
                c.load_state_dict(saved if same else {k: v for k, v in saved.items()
                                                       if not (isinstance(v, dict) and "__array__" in v)})


# --------------------------------------------------------------------------- the step
class StepPipeline:
    """The machinery of a `Watch`: its hooks turned into step events, and each event passed
    along the step's named parts: the clock (`StepClock`: which step this is), the ledger
    keeper (the step's host facts), the statistics recorder (the one read of the gradients)
    and the ordered checks (`graddbg.checks.default_checks`), whose findings get their
    policies here, once per step. `Watch` is its public face (the read side is `_Results`)."""

    #: the findings made at close (their policy is applied by `Watch.__exit__`)
    at_close: List[Anomaly] = []

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], options: Dict[str, Any]) -> None:
        self.closed = True  # until attached: close() and detach work on a half-built pipeline
        self.clock = StepClock()
        self.checks: List[Check] = []
        self._on: Dict[str, List[Callable[..., Any]]] = _handlers([])
        # (the checks with a queue, and with a read, in order; the optimizer step hooks entered
        # and not left, nested under a super().step(); a policy being applied)
        self._queuers, self._readers, self._step_depth, self._in_policy = [], [], 0, False
        self.anomalies: AnomalyList = AnomalyList()
        self._sink: Optional[Sink] = None  # (log_to=: the trackers fed on every recorded step)
        model = check_model(model, "watch")
        self.options = opts = WatchOptions.parse("watch", options)
        self._zero = zero = find_deepspeed(model, optimizer)  # DeepSpeed: the engine's module and optimizer
        if zero is not None:
            model, optimizer, opts = zero.module, zero.optimizer, zero.adjust(opts)
        rank, world = _world()
        if isinstance(opts.ddp_check_every, int) and world == 1 and not torch.distributed.is_initialized():
            raise GraddbgValueError(f"ddp_check_every={opts.ddp_check_every} needs an initialised process group: "
                                    f"call torch.distributed.init_process_group(...) first (or launch with "
                                    f"torchrun), or pass ddp_check_every=None")
        opts = self.options = opts.replace(scaler=opts.scaler if opts.scaler is not None
                                           and getattr(opts.scaler, "is_enabled", lambda: True)() else None)
        named = named_trainable_parameters(model)
        self.ctx = ctx = Watched(model, _real_optimizer(optimizer), opts, named, HookSet(),
                                  rank if world > 1 else None, world)
        ctx.history = History(ctx.names, ctx.numel, [q for q in opts.quantities if q in ("mean", "std", "zero_frac")],
                              opts.history, MAX_ROWS)
        ctx.ledger = Ledger(opts.history)
        ctx.alive, ctx.read_scale = self._alive, lambda: scale_of(self.options.scaler)
        ctx.adopt_scaler = self._adopt_scaler
        self._frozen = _frozen_parameters(model, ctx.params)
        if not ctx.params:
            warnings.warn(f"graddbg.watch: {type(model).__name__} has no trainable parameter (none requires "
                          f"grad), so nothing will be recorded until one is unfrozen "
                          f"({len(self._frozen)} frozen).", CoverageWarning, stacklevel=3)
        # (ZeRO replaced the optimizer's param groups with its flat partitions)
        self._apart = _Apart.take(_check_optimizer(ctx) if zero is None else None, ctx, self._apply, self.clock)
        self.meta = _meta(opts, ctx)
        if opts.log_to is not None:  # ("wandb" / "mlflow" without an active run: an error now)
            self._sink = Sink(opts.log_to, ctx.names, opts.log_detail)
        if zero is not None:
            self.meta["deepspeed"] = zero.describe()
        # (pipeline stages, groups, the check-in)
        ctx.layout = Layout(model, ctx.names, ctx.params, self.meta, make_capture=Capture if opts.localise else None,
                            active=lambda: not ctx.replaying, stepped=ctx.optimizer is not None or zero is not None,
                            bound=opts.ddp_timeout.total_seconds() if opts.ddp_timeout is not None else None)
        self._tap = _OutputTap(opts.localise, self._queue_end_of_backward, self._alive, self._on_output_grad)
        self._cb_queued = self._scaler_looked = False
        self._errors_warned: set = set()
        try:
            parts = default_checks(model, opts, zero)  # (zero: ZeRO's reduced partitions, not .grad)
            self.checks, ctx.guard, self._keeper = parts.checks, parts.guard, parts.keeper
            self.recorder, self.graph, self.activations = parts.recorder, parts.graph, parts.activations
            for c in self.checks:
                c.attach(ctx)
            ctx.seal()  # (read-only to the checks from now on)
            self._on = _handlers(self.checks)
            self._queuers = [c for c in self.checks if getattr(type(c), "queue") is not Check.queue]
            self._readers = [c for c in self.checks if getattr(type(c), "read") is not Check.read]
            self._attach()
        except BaseException:
            self._detach()
            raise
        self.closed = False
        self._begin_apart()

    def _begin_apart(self) -> None:
        if self._apart is None:
            return
        self.meta["optimizer"], self.meta["optimizer_holds"] = type(self._apart.opt).__name__, self._apart.what
        try:
            self.ctx.hooks.add(self._apart.opt.register_step_post_hook(self._apart.stepped))
            self._apply(self._apart.first())
        except BaseException:  # (a policy that raises: nothing of the watch is left behind)
            self.closed = True
            self._detach()
            raise

    def _attach(self) -> None:
        ctx = self.ctx
        model, opt, hooks = ctx.model, ctx.optimizer, ctx.hooks
        if not isinstance(model, torch.jit.ScriptModule):
            hooks.add(model.register_forward_pre_hook(self._on_root_pre, with_kwargs=True))
            hooks.add(model.register_forward_hook(self._on_root_forward, with_kwargs=True))
            ctx.guard.protect(model)
        if self._zero is not None:  # engine.step() at an accumulation boundary is the step
            hooks.add(self._zero.hook_step(lambda: self._on_opt_pre(None, (None,), {}),
                                           lambda: self._on_opt_post(None, (), {})))
            hooks.add(self._zero.hook_backward())
        elif opt is not None:
            hooks.add(opt.register_step_pre_hook(self._on_opt_pre))
            hooks.add(opt.register_step_post_hook(self._on_opt_post))
        # the end of a backward pass is seen from the model's output (when its own forward
        # ran) or from parameters' gradients: every parameter without an optimizer (each
        # backward is a step), a few spread over the model with one (when the model is
        # called through another method, as a LightningModule's training_step does)
        P = len(ctx.params)
        if self._zero is not None:
            return  # (a DeepSpeedEngine always calls its module: the end of each backward pass is seen from its output)
        for i in (range(P) if opt is None else sorted({(k * P) // 8 for k in range(8)} | {P - 1})):
            if 0 <= i < P:
                hooks.add(ctx.params[i].register_post_accumulate_grad_hook(
                    lambda p: self._queue_end_of_backward() if self._alive() else None))

    def _alive(self) -> bool:
        return not self.closed and not self.ctx.replaying

    def _detach(self) -> None:
        self.ctx.hooks.remove_all() if hasattr(self, "ctx") else None
        for c in self.checks:
            c.close()
        if hasattr(self, "_tap"):
            self._tap.clear()
        layout = getattr(getattr(self, "ctx", None), "layout", None)
        if layout is not None:
            layout.close()

    def _adopt_unfrozen(self) -> None:
        """Parameters frozen when the watch began and trainable now (fine-tuning schedules
        unfreeze layers): recorded from now on."""
        if not self._frozen or not any(p.requires_grad for _, p in self._frozen):
            return
        new = [(n, p) for n, p in self._frozen if p.requires_grad]
        self._frozen = [(n, p) for n, p in self._frozen if not p.requires_grad]
        self.ctx.add(new)
        self.ctx.history.add_params([n for n, _ in new], [p.numel() for _, p in new], self.clock.index)
        self._dispatch("params_added", len(new))

    # ------------------------------------------------------------------ hook bodies
    @_guarded
    def _on_root_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if _is_compiling() or not self._alive() or in_backward():
            return None
        if not torch.is_grad_enabled():
            self._keeper.forward_without_grad()  # (an evaluation, a rollout: a host fact)
            return None
        self._tap.before()
        self.ctx.layout.forward_began(self.clock.index)
        self._dispatch("on_forward", self._keeper.forward_facts(module))
        return None

    @_guarded
    def _on_root_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not (_is_compiling() or not self._alive() or not torch.is_grad_enabled() or in_backward()):
            self._tap.after(args, kwargs, output)
        return None

    def _on_output_grad(self, grad: Tensor) -> None:
        """Inside a backward pass, at the model's output: the checks that read the loss's
        graph, and (DeepSpeed) each rank's evidence of where a NaN started."""
        if self._zero is not None:
            self._zero.origin.output_grad(grad)
        else:
            self.ctx.layout.output_grad(grad)
        self._dispatch("on_output_grad")

    def _queue_end_of_backward(self) -> None:
        if self._cb_queued or self.closed:
            return
        if not in_backward():  # (a gradient assigned outside the engine, as FSDP2 does in its own
            return             # callback: no callback can be queued there; the step reads them)
        self._cb_queued = True
        # queued twice so that it runs after the callbacks queued during the backward pass
        # (DDP's reducer finalises its all-reduce in one): the statistics are then of the
        # reduced gradients
        try:
            _queue_callback(lambda: _queue_callback(self._end_of_backward))
        except RuntimeError:  # (never raise in the user's backward pass)
            self._cb_queued = False

    @_guarded
    def _end_of_backward(self) -> None:
        self._cb_queued = False
        if self.closed:
            return
        state = scaler_state(self.options.scaler)
        counts, skipped = self.clock.backward_ended(state)
        if not counts:
            return
        if skipped:
            self._skipped()  # the GradScaler updated without stepping the optimizer: it skipped that step
        self._adopt_unfrozen()
        self.clock.noted(state)
        self.ctx.layout.backward_ended()
        scale = scale_of(self.options.scaler)
        bw = BackwardEnd(self.clock.index, self.ctx.grads(), scale)
        found: List[Finding] = [f for got in self._dispatch("on_backward_end", bw) for f in got]
        if found:
            self._apply(found)
        if self.ctx.optimizer is None:
            self._boundary()

    @_guarded
    def _on_opt_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self.closed:
            return None
        # an optimizer class whose step calls super().step() runs the step hooks again inside
        # its own step (torch hooks each class's step): that inner pair is the same step
        self._step_depth += 1
        if self._step_depth > 1:
            return None
        try:
            self.begin_step(args[1] if len(args) > 1 else kwargs.get("closure"))  # (args[0] is the optimizer)
        except BaseException:
            self._step_depth = 0  # (the step does not run: no post-hook comes)
            raise
        return None

    def begin_step(self, closure: Any = None) -> None:
        """The optimizer's step begins (`Watch.begin_step`)."""
        self._tap.end_tape()  # (the loss code is over: the checks' host reads before the step are not recorded)
        if not self._scaler_looked:
            self._scaler_looked = True
            self._adopt_scaler(find_scaler())
        self._dispatch("before_step", self.clock.index, closure is not None)
        if self.clock.step_began(closure is not None):
            self._boundary()

    @_guarded
    def _on_opt_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self.closed:
            return
        self._step_depth = max(self._step_depth - 1, 0)
        if self._step_depth > 0:
            return  # (the inner step of a super().step() call)
        try:
            if self.clock.step_ended():
                self._boundary(closure=True)
        finally:
            self._dispatch("after_step", self.clock.index - 1)

    # ------------------------------------------------------------------ the step boundary
    def _boundary(self, closure: bool = False, manual: bool = False) -> None:
        """One step boundary: the ledger's entry begins, the checks queue their reads, one
        read-back, each check reads its part and returns findings, the step ends, the
        policies are applied."""
        index, opts = self.clock.index, self.options
        self._tap.end_tape()  # (the loss code ended with the backward pass: the step's own work is not recorded)
        self._adopt_unfrozen()
        due_nf = opts.nonfinite is not None and opts.nonfinite.schedule.includes(index)
        due_stats = opts.record_schedule.includes(index)
        grads = self.ctx.grads()
        entry = self._keeper.begin(index, _path(self._zero, self.ctx.optimizer, opts.scaler, closure, manual), grads)
        step = Step(index, grads, due_stats, read=due_stats or due_nf or any(self._dispatch("due", index)),
                    tapped=self._tap.capture, closure=closure, entry=entry)
        for check in self._queuers:
            try:
                step.tokens[id(check)] = step.accept(check, check.queue(step))
            except Exception as err:
                self._isolate(check, "queue", err)
        step.reduce.run()  # (the one small all-reduce the checks packed, before the read-back)
        if step.read:
            step.readback.fetch()
            self.ctx.count_syncs()  # (counted on the CPU too: the same code path as on a GPU)
        found: List[Finding] = []
        try:
            for check in self._readers:
                try:
                    found += step.accept(check, check.read(step))
                except Exception as err:
                    self._isolate(check, "read", err)
        finally:
            step.record_into(self.ctx.history, self.ctx.ledger)  # (its row, from what the checks measured)
        step.entry.kinds = [f.anomaly.kind for f in found]
        self._finish_step()
        if self._sink is not None:  # (host values of this step's read-back: no synchronisation)
            seen = len(self.anomalies) + sum(self.anomalies.not_kept.values())  # (those past the limit too)
            self._sink.step(self.ctx.history, index, seen + len(found))
        self._apply(found)

    def _dispatch(self, event: str, *args: Any) -> List[Any]:
        """Each check's handler of ``event``, in the checks' order, and what they returned
        (None left out). A check that fails is switched off with one warning (`_isolate`) and
        the others go on."""
        out = []
        for handle in self._on[event]:
            try:
                got = handle(*args)
            except Exception as err:
                self._isolate(getattr(handle, "__self__", None), event, err)
                continue
            if got is not None:
                out.append(got)
        return out

    def _isolate(self, check: Any, where: str, err: Exception) -> None:
        """A bug in one check costs that check alone: it is switched off for the rest of the
        watch, with one `GraddbgWarning` naming it, and the step's record and the other checks'
        findings stand. Anomalies under the ``"raise"`` policy, a user's policy callable's
        errors, a failure of the record's own parts (the ledger, the recorder, the guard) and
        any failure under several processes propagate as before (to `_guarded`): a check
        switched off on one rank only would leave its collectives, and the step's packed sum,
        different on the others."""
        if isinstance(err, GradientAnomalyError) or self._in_policy or check is None or \
                check in (self._keeper, self.ctx.guard, self.recorder) or self.ctx.world_size > 1:
            raise err
        self._on = {e: [h for h in hs if getattr(h, "__self__", None) is not check] for e, hs in self._on.items()}
        self._queuers = [c for c in self._queuers if c is not check]
        self._readers = [c for c in self._readers if c is not check]
        warn_at_user(f"graddbg.watch: an internal error in {type(check).__name__}.{where} at step {self.clock.index}: "
                     f"{type(err).__name__}: {err}. That check is off for the rest of the watch; the record and "
                     f"the other checks go on. Please report it.", GraddbgWarning)

    def _apply(self, found: List[Finding]) -> None:
        """Each finding into ``anomalies`` (and its step kept in the history), then its
        policy: the first error to raise is raised after all are recorded."""
        to_raise: Optional[BaseException] = None
        self._in_policy = True  # (what a user's policy callable raises is theirs: it propagates)
        for f in found:
            kept = self.anomalies.add(f.anomaly)  # (past MAX_KEPT_PER_KIND of its kind: only counted)
            if kept:
                self.ctx.history.mark(f.anomaly.step)  # (its rows and its ledger entry stay)
                self.ctx.ledger.mark(f.anomaly.step)
                if self._sink is not None:
                    self._sink.finding(f.anomaly)
            policy = f.policy if kept else self.anomalies.policy_past_limit(f.anomaly, f.policy)
            err = apply_policy(f.anomaly, policy, functools.partial(_drop_grads, self.ctx.params, f.skip))
            if err is not None and to_raise is None:
                to_raise = err
        if to_raise is not None:
            raise to_raise

    def _finish_step(self) -> None:
        self._keeper.end()
        self.clock.advance()
        self._tap.clear()

    def _skipped(self) -> None:
        """The GradScaler skipped a step (an overflow): recorded as such, never an anomaly."""
        self.recorder.skipped(self.clock.index)
        self._keeper.skipped(self.clock.index)
        self.clock.advance()

    def _adopt_scaler(self, scaler: Any) -> None:
        """A GradScaler that steps the optimizer but was not passed as ``scaler=``: used from
        now on (the statistics are of unscaled gradients and its skipped steps are overflow
        steps)."""
        if scaler is None or self.options.scaler is not None:
            return
        self.options = self.options.replace(scaler=scaler)
        self.ctx.amend(options=self.options)
        self.meta["scaler"] = "found"
        scale = scale_of(scaler)
        if scale is not None:
            self.recorder.adopt_scale(scale)
        self.clock.adopt(scaler_state(scaler))

    # ------------------------------------------------------------------ the watch's calls
    def adopt_forward(self, args: Any, kwargs: Any, output: Any, rng_state: Optional[Tensor] = None) -> None:
        """A forward pass that ran before the watch began, tapped (`Watch.adopt_forward`)."""
        if self.closed or not torch.is_grad_enabled():
            return
        self._tap.before(rng_state)
        self._tap.after(args, kwargs, output)

    def step(self) -> None:
        """A step boundary marked by hand (`Watch.step`)."""
        if self.closed:
            raise RuntimeError("Watch.step() called after the watch was closed")
        self._cb_queued = False
        self._boundary(manual=True)

    def close(self) -> None:
        """Every hook removed, the last findings made (`Watch.close`)."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.clock.waiting(scaler_state(self.options.scaler)) and self.recorder.waiting():
                self._skipped()  # (the last step: the scaler updated without stepping the optimizer)
            for c in self.checks:
                c.flush()
            self._last_words()
            # the parameters that never had a gradient (and were not named as cut off already):
            # one unused_param finding (its policy is applied by __exit__ when the body ended normally)
            self.at_close = self._unused() if self.clock.index > 0 and self.options.unused_param is not None else []
            for a in self.at_close:
                self.anomalies.append(a)
                if self._sink is not None:
                    self._sink.finding(a)
            if self._sink is not None:
                self._sink.close(self.ctx.history)
        finally:
            self._detach()
            # keep only what the tables need; no tensors of the user's past the watch
            ctx = self.ctx
            ctx.amend(params=[], model=None, optimizer=None)

    def _unused(self) -> List[Anomaly]:
        """The parameters that never had a gradient and were not named as cut off already:
        those trained by copying (no param group holds them) and those a library leaves
        unused by design, each a fact; the others one unused_param finding."""
        named = self.graph.reported_unused()
        names = [n for n in self.recorder.uncovered() if n not in named]
        stepped = {n for n, p in zip(self.ctx.names, self.ctx.params) if id(p) in self.ctx.stepped_in_backward}
        hooked = [n for n in names if n in stepped]
        if hooked:
            warn_at_user(f"graddbg.watch: {len(hooked)} trainable parameter(s) are stepped inside the backward pass by "
                         f"post-accumulate-grad hooks of their own (an optimizer in backward): {shown(hooked)}. Their "
                         f"gradients are consumed before the pass ends, so no gradient statistics were recorded for "
                         f"them; they are not unused.", CoverageWarning)
            names = [n for n in names if n not in stepped]
        if not names:
            return []
        copied, library, rest = unused_facts(names, self.ctx) if self._zero is None else ([], [], names)
        last = self.clock.index - 1
        found = [unused_anomaly(rest, self.ctx, last, forwards=self._keeper.forwards_seen)] if rest else []
        return found + [fact_anomaly(ns, self.ctx, last, copied=ns is copied) for ns in (copied, library) if ns]

    def _last_words(self) -> None:
        """A finding whose evidence grew until the end (the ranks' steps after they went out
        of step) gets its last numbers."""
        drift = self.ctx.layout.drift() if self.ctx.layout is not None else None
        for i, a in enumerate(self.anomalies):
            if drift and a.kind == "ddp_mismatch" and "stepped differently" in a.message:
                self.anomalies[i] = dataclasses.replace(a, message=f"{a.message} {drift}")
                break

    def release(self) -> None:
        """The watch is garbage: its hooks go if it was never closed."""
        if not self.closed:
            self._detach()


# --------------------------------------------------------------------------- the watch
class Watch(_Results, _Resumable):
    """Records per-parameter gradient statistics and catches anomalies; see `watch`.

    ``Watch(model, optimizer, **options)`` takes the options of `watch`
    (`graddbg.options.WatchOptions`)."""

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                 **options: Any) -> None:
        self._steps = steps = StepPipeline(model, optimizer, options)
        self._ctx, self._clock = steps.ctx, steps.clock
        #: the findings: the first `graddbg.anomaly.MAX_KEPT_PER_KIND` of each kind; later
        #: ones are counted in ``anomalies.not_kept`` (by kind and parameter)
        self.anomalies: AnomalyList = steps.anomalies
        #: what the run was (options, parallelism, the model's layout), saved with it
        self.meta: Dict[str, Any] = steps.meta

    @property
    def options(self) -> WatchOptions:
        """The options in force (`graddbg.options.WatchOptions`): those given, with a
        GradScaler found in use."""
        return self._steps.options

    def begin_step(self, closure: Any = None) -> None:
        """The optimizer's step begins: the step boundary, or (``closure`` given, as
        ``step(closure)`` runs backward inside the step) its announcement, the boundary then
        coming after the step. Called by the watch's own optimizer hook; call it yourself
        only for a watch created inside an optimizer step that is under way."""
        self._steps.begin_step(closure)

    def adopt_forward(self, args: Any, kwargs: Any, output: Any, rng_state: Optional[Tensor] = None) -> None:
        """A forward pass of the model that ran before this watch began (``graddbg run``
        starts watching after the first one): its output is tapped as if the watch had seen
        it, so that the end of its backward pass is seen and a NaN it makes is replayed.

        Args:
            args: the positional inputs of that forward pass.
            kwargs: its keyword inputs.
            output: what it returned.
            rng_state: the CPU RNG state before it (``torch.get_rng_state()``), for the replay.
        """
        self._steps.adopt_forward(args, kwargs, output, rng_state)

    def step(self) -> None:
        """Mark a step boundary by hand (statistics are read from the current ``.grad``)."""
        self._steps.step()

    def close(self) -> None:
        """Remove every hook. Idempotent; the recorded data stays available."""
        self._steps.close()

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close()
        from graddbg.run import stop_reason

        self.meta.setdefault("stopped", stop_reason(exc))  # (why the run ended, saved with it)
        if exc_type is None:
            for a in self._steps.at_close:  # (the findings made at close: their policy now)
                apply_policy(a, self.options.unused_param, lambda: None)

    def __repr__(self) -> str:
        state = "closed" if self._steps.closed else "open"
        n = len(self._ctx.names)
        more = sum(self.anomalies.not_kept.values()) if isinstance(self.anomalies, AnomalyList) else 0
        return (f"<graddbg.Watch {state}: {n} parameters, {self._clock.index} steps, {len(self.anomalies)} anomalies"
                + (f" (and {more:,} more counted, not kept)" if more else "") + ">")

    def __del__(self) -> None:
        try:
            self._steps.release()
        except Exception:  # (a half-built watch: its pipeline raised, and removed its hooks then)
            pass


Policy = Union[str, Callable[[Anomaly], None], None]
"""A finding's policy: "raise", "warn", "skip", "record", a callable receiving the `Anomaly`, or None (off)."""


def _accepts_localize(fn: Callable[..., Watch]) -> Callable[..., Watch]:
    """``fn`` also accepts ``localize=``, the old spelling of ``localise=`` (kept out of its
    documented signature)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Watch:
        if "localize" in kwargs:
            if "localise" in kwargs:
                raise GraddbgTypeError("watch(): pass localise= or its old spelling localize=, not both")
            kwargs["localise"] = kwargs.pop("localize")
        return fn(*args, **kwargs)

    return wrapper


@_accepts_localize
def watch(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *, every: int = 1,
          stats: Sequence[str] = DEFAULT_STATS,
          nonfinite: Union[str, Callable[[Anomaly], None], NonFinite, None] = "raise",
          explode: Union[str, Callable[[Anomaly], None], Explode, None] = "warn",
          vanish: Union[str, Callable[[Anomaly], None], Vanish, None] = None,
          stale_grad: Policy = "warn", empty_step: Policy = "warn", double_step: Policy = "warn",
          scaled_grad: Policy = "warn", orphan_param: Policy = "warn", no_update: Policy = "warn",
          foreign_update: Policy = "warn", lr_schedule: Policy = "warn", hidden_param: Policy = "warn",
          eval_mode: Policy = "warn", loss_pattern: Policy = "warn", dead_grad: Policy = "warn",
          unused_param: Policy = "warn", update_rule: Policy = "warn", applied_grad: Policy = "warn",
          module_setup: Policy = "warn", optimizer_setup: Policy = "warn",
          activations: bool = False,
          histograms: Union[None, bool, int] = None, scaler: Optional[torch.amp.GradScaler] = None,
          history: int = 10_000, ddp_check_every: Union[None, str, int] = "auto",
          update_every: Union[None, str, int] = UPDATE_EVERY, copy_budget: float = COPY_BUDGET,
          localise: bool = True, ddp_timeout: Union[float, timedelta, None] = None,
          log_to: Union[str, Callable[[Dict[str, float], int], None], Sequence[Any], Any, None] = None,
          log_detail: str = "module") -> Watch:
    """Watch a model's gradients while it trains; use as a context manager.

    Step boundaries: the optimizer's step when ``optimizer`` is given (statistics of the
    accumulated gradient it is about to use: one record per optimizer step under gradient
    accumulation, and the pre-clip gradient if you clip between backward and step, with
    the post-clip global norm in ``w.steps.clipped_norm``; with ``step(closure)``, as LBFGS
    and Lightning call it, the gradients that closure computed, read after the step: for
    LBFGS, which evaluates the closure several times, its first evaluation, at the weights
    the step starts from); otherwise the end of each backward pass; ``w.step()`` marks one
    by hand. Statistics are computed on the gradients' device with torch's batched kernels
    and read back once per recorded step.

    Args:
        model: the ``nn.Module`` to watch (DDP, FSDP and ``torch.compile`` wrappers are
            looked through; parameter names are the model's own), or a DeepSpeed engine
            (ZeRO 0-3: its module, optimizer and loss scale are found from it, and
            ``engine.step()`` at an accumulation boundary is the step).
        optimizer: the optimizer that steps ``model``'s parameters (or a wrapper holding
            one as ``.optimizer``), or None: then each backward pass is a step.
        every: record per-parameter statistics on every ``every``-th step (1).
        stats: the quantities read per parameter: "norm", "absmax", "nonfinite" always
            ("norm" and "nonfinite" are needed by the detectors), "mean", "std",
            "zero_frac" on request. The largest magnitude ("absmax") costs a second pass:
            with the default ``stats=``, on the CPU it is read on every 10th recorded step
            (NaN between), on accelerators on every one; name it to have it on every step.
        nonfinite: what to do with NaN/Inf gradients: a policy ("raise", the default;
            "warn", "skip" (the affected gradients are set to None), "record", a callable
            receiving the `graddbg.Anomaly`) or a `graddbg.NonFinite`
            detector; None turns it off. With ``NonFinite(every=k)`` and ``every=k`` the
            steps between checks make no host synchronisation and the first bad step is
            still named.
        explode: a policy (default "warn") or a `graddbg.Explode` detector for a
            global norm far above its running level; None turns it off.
        vanish: a policy or a `graddbg.Vanish` detector for gradients that stay
            tiny; None (the default) leaves it off.
        stale_grad: the policy (default "warn") for gradients that survive an optimizer
            step into the next backward pass (``zero_grad()`` missing); None: off.
        empty_step: the policy for optimizer steps without the gradients their backward passes
            computed, 3 in a row (``zero_grad()`` between backward and step, or step before
            backward); one empty step (a skipped batch) is not a finding; None: off.
        double_step: the policy for one set of gradients applied by two optimizer steps
            (no backward pass between them, the same gradient tensors), twice; None: off.
        scaled_grad: the policy for an optimizer step applied to gradients that a GradScaler
            scaled and did not unscale (``optimizer.step()`` called directly instead of
            ``scaler.step(optimizer)``); None: off.
        orphan_param: the policy for trainable parameters that receive gradients but
            belong to no param group of the optimizer; None: off.
        no_update: the policy for parameters with a non-zero gradient that the step leaves
            unchanged 3 steps in a row (an ``lr`` of 0, a step that skips them); None: off.
        foreign_update: the policy for parameters changed between backward passes while the
            watched optimizer does not step (another optimizer, e.g. one re-created every
            epoch, or code writing the weights); None: off.
        update_rule: the policy for the step audit's findings: on the first steps, then steps
            10, 100, 1000, ... (and the step after a finding), each parameter's change is
            compared with what the optimizer's own rule gives from the gradients it was handed
            and its state (a shadow step on float64 copies); a parameter that did not move, or
            moved twice or otherwise, is named with both numbers; None: off.
        applied_grad: the policy for the step audit's gradient half: on the same steps, the
            gradients the optimizer is handed are compared with those the last backward pass
            left; a gradient cleared while others were kept, or multiplied by more than a
            clip or an unscale allows (or by a negative factor), is named; None: off.
        module_setup: the policy for a module whose construction does not do what it says: an
            attribute ``module.requires_grad = False`` (it freezes nothing: the method
            ``requires_grad_(False)`` does), and, as a fact (warned, never raised), a
            ``ModuleList``/``Sequential``/``ModuleDict`` holding one module object at several
            places (``[layer] * n``: they share parameters); None: off.
        optimizer_setup: the policy for an optimizer's hyperparameter that switches off its own
            mechanism: an Adam-family ``eps`` more than 10 times the gradients' RMS (the square
            root of the bias-corrected second moment) for 90% of the weights, on two audited
            steps in a row (each step is then ``lr * m / eps``); None: off.
        lr_schedule: the policy for a learning rate that changes between the micro-batches of
            one step (a scheduler stepped per micro-batch) or collapses to under 1e-3 of its
            peak and stays there (a scheduler stepped per batch instead of per epoch); None: off.
        hidden_param: the policy for tensors that the model holds and that receive gradients
            from the loss but are not registered parameters (a tensor attribute instead of an
            ``nn.Parameter``, layers in a plain list instead of ``nn.ModuleList``); None: off.
        eval_mode: the policy for training steps run in eval mode (dropout / batch norm off)
            after earlier steps trained in training mode (``model.eval()`` not undone); None: off.
        loss_pattern: the policy for a harmful pattern on the path to the loss, read from its
            autograd graph (softmax before cross-entropy, ``nll_loss`` on probabilities or raw
            scores, a sigmoid before ``BCEWithLogitsLoss``, ``log(softmax)``, ``log_softmax``
            over the wrong dim, a target that broadcasts against the input); None: off.
        dead_grad: the policy for gradients exactly zero for several recorded steps, after
            having been non-zero (dead ReLUs) or since the first step (dead from
            initialisation); None: off.
        unused_param: the policy for trainable parameters that never received a gradient
            while watched (unused in forward, a ``.detach()``), found when the watch closes
            after at least one step; "warn" gives a `graddbg.CoverageWarning`; None: off.
        activations: also record the gradient at every leaf module's output and check
            forward activations for NaN/Inf (False).
        histograms: histograms of |grad| on every recorded step (True) or every N-th
            (an int); None or False: off.
        scaler: the ``torch.amp.GradScaler`` in use: statistics are of unscaled gradients
            and its skipped steps are recorded as overflow, never as anomalies. A scaler
            that steps the optimizer is also found by itself at the first step.
        history: the steps kept (10,000); per-parameter rows are bounded by
            ``graddbg.hooks.MAX_ROWS``: when full, the middle of the run is thinned evenly
            and the first, the latest and every anomaly's step stay.
        ddp_check_every: under distribution, compare gradients across replicas every N
            steps (an int), "auto" (the default: as chosen for a process group of more
            than one rank, off otherwise) or None (off).
        update_every: measure the update/weight ratio ||Δw||/||w|| on the log cadence
            ("log", the default: recorded steps 0, 1, 2, 5, 10, 20, 50, 100, 200, then every
            200), on every N-th step, the first included (an int), or never (None). It
            copies the weights before the step; without memory for the copy it warns and
            switches itself off.
        copy_budget: the share of the weights' bytes that may be copied before one
            optimizer step (0.1; a fraction in (0, 1]; weights under 1 MiB are copied whole).
            Each measured step copies the parameters measured longest ago that fit (one
            larger than the whole budget alone), so each parameter's update ratio comes every
            ``1 / copy_budget`` measured steps or so (NaN on the others); 1 copies all.
        localise: on a non-finite gradient, replay the last forward and backward pass
            under `graddbg.find_nonfinite` to name the op and source line (True).
            The old spelling ``localize=`` is accepted.
        ddp_timeout: the timeout of the replica checks (a ``datetime.timedelta`` or a
            number of seconds > 0; None: 60 s).
        log_to: stream each recorded step, while training runs, to the tracker you already
            watch: a ``torch.utils.tensorboard.SummaryWriter``, a wandb ``Run`` or
            ``"wandb"`` (the active run), ``"mlflow"`` (the active MLflow run), a callable
            ``fn(metrics: dict, step: int)``, or a list of these (None: off). It logs
            ``graddbg/global_norm``, ``graddbg/loss``, ``graddbg/lr``, the norms per
            top-level module, the update ratios when measured and ``graddbg/anomalies`` (the
            findings so far), and each finding's message as a text event, from the values
            the step's read-back brought to the host (no synchronisation of its own); see
            `graddbg.trackers`. ``"wandb"`` / ``"mlflow"`` with no active run is an error here.
        log_detail: ``"module"`` (the default: norms and update ratios in ``log_to`` per
            top-level module) or ``"param"`` (per parameter).

    Returns:
        The `Watch`, recording until it is closed (at the end of the ``with``).

    Raises:
        GraddbgTypeError: an unknown option, or a value of the wrong type.
        GraddbgValueError: a value out of range, or an optimizer holding none of the
            model's parameters. Every option is checked here, when ``watch`` is called,
            and the error names it, what was given and what is accepted (``watch(every=...):
            got 0; accepted: an int >= 1``).

    Examples:
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
    options = {k: v for k, v in locals().items() if k not in ("model", "optimizer")}
    return Watch(model, optimizer, **options)


options_in_signature(Watch.__init__)
