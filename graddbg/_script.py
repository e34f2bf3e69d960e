"""Script discovery for ``graddbg run``: what an unchanged script trains, found through
PyTorch's global optimizer and module hook registries (`ScriptWatcher`), the statistics
snapshots written while it runs (`Snapshots`), and SIGTERM / SIGHUP turned into an
unwinding exception so that what was recorded is written (`Signals`).

Internal: `graddbg.cli.run_script` is the public entry point.
"""
from __future__ import annotations

import contextlib

import math
import os
import pathlib
import signal
import sys
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

import torch
from torch import nn

__all__ = ["ScriptWatcher", "Snapshots", "Signals", "Terminated", "choose_model", "outputs"]

#: torch's warning that torch.compile(module) gives while global module hooks are registered
_COMPILE_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks on modules"


class _ParamHolder(nn.Module):
    """Stands for a model graddbg never saw: the optimizer's parameters, by group (when no
    module owning them was called, as with bare tensors trained directly). ``label`` says
    what the user passed, in their names where the calling frames hold the tensors
    ("tensor w", "tensors w, b"): the run's summary and report show it, not this class."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__()
        # kept aside, not registered: an optimizer may hold plain tensors, not Parameters
        self.held = [(f"group{gi}_param{pi}", p) for gi, group in enumerate(optimizer.param_groups)
                     for pi, p in enumerate(group["params"])]
        n = len(self.held)
        names = _frame_names({id(p) for _, p in self.held})
        self.label = (f"tensor{'s' if n > 1 else ''} {', '.join(names)}" if names and len(names) == n <= 4
                      else f"{n} tensor{'s' if n > 1 else ''} of {type(optimizer).__name__} (no module)")

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        seen: Set[int] = set()
        for name, p in self.held:
            if not (remove_duplicate and id(p) in seen):
                seen.add(id(p))
                yield prefix + ("." if prefix else "") + name, p

    def parameters(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        for _, p in self.named_parameters():
            yield p


def _held(optimizer: torch.optim.Optimizer) -> Set[int]:
    return {id(p) for g in optimizer.param_groups for p in g["params"]}


def _frame_modules(limit: int = 256, kind: type = nn.Module) -> List[Any]:
    """The modules (or objects of ``kind``) the calling frames hold in their local
    variables (``self`` of a LightningModule's ``optimizer_step``, a ``model`` of a training
    function), and in the globals of the script run as ``__main__``; innermost frame first."""
    found: List[Any] = []
    frame: Any = sys._getframe(1)
    try:
        for _ in range(limit):
            if frame is None:
                break
            names = frame.f_locals
            values = list(names.values())
            if frame.f_globals is not names and frame.f_globals.get("__name__") == "__main__":
                values += list(frame.f_globals.values())
            found += [v for v in values if isinstance(v, kind)]
            frame = frame.f_back
    finally:
        del frame
    return found


def _frame_names(ids: Set[int], limit: int = 256) -> List[str]:
    """The names that the calling frames (and the script's globals) give the objects
    ``ids``, one each, innermost frame first."""
    found: Dict[int, str] = {}
    frame: Any = sys._getframe(1)
    try:
        for _ in range(limit):
            if frame is None or len(found) == len(ids):
                break
            spaces = [frame.f_locals]
            if frame.f_globals is not frame.f_locals and frame.f_globals.get("__name__") == "__main__":
                spaces.append(frame.f_globals)
            for names in spaces:
                for name, value in list(names.items()):
                    if id(value) in ids and id(value) not in found and not name.startswith("_"):
                        found[id(value)] = name
            frame = frame.f_back
    finally:
        del frame
    return list(found.values())


def choose_model(candidates: Iterable[nn.Module], held: Set[int]) -> Optional[nn.Module]:
    """The model of an optimizer holding the parameters ``held`` (by id), among
    ``candidates``: the modules owning most of them; of those, the ones with the fewest
    trainable parameters (not a container that also holds an EMA copy or a second model);
    of those, the outermost (a LightningModule rather than the submodule its
    training_step calls, a wrapper rather than what it wraps). None when none owns any."""
    scored, seen = [], set()
    for m in candidates:
        if id(m) in seen or isinstance(m, _ParamHolder):
            continue
        seen.add(id(m))
        params = list(m.parameters())
        n = sum(id(p) in held for p in params)
        if n:
            scored.append((m, n, sum(bool(p.requires_grad) for p in params)))
    if not scored:
        return None
    most = max(n for _, n, _ in scored)
    fewest = min(t for _, n, t in scored if n == most)
    kept = [m for m, n, t in scored if n == most and t == fewest]
    inner = [{id(s) for s in m.modules()} for m in kept]
    return max(zip(kept, inner), key=lambda mi: sum(id(o) in mi[1] for o in kept))[0]


def _closure(args: Any, kwargs: Any) -> Any:
    """The closure an optimizer step was called with (``args[0]`` is the optimizer), or None."""
    return args[1] if len(args) > 1 else kwargs.get("closure")


class _Deferred:
    """An optimizer whose first step began before any module owning its parameters was
    called (the step's closure makes the first forward pass): the watch of a stand-in
    (``_ParamHolder``) and the step's arguments, kept until that forward pass replaces the
    stand-in or the step ends (the stand-in stays: no module owns the parameters)."""

    def __init__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any, watch: Any) -> None:
        self.optimizer = weakref.ref(optimizer)
        self.held = _held(optimizer)
        self.args, self.kwargs, self.watch = args, kwargs, watch


def _inner(optimizer: Any) -> Any:
    """The optimizer a wrapper optimizer holds as ``.optimizer`` (accelerate's
    ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``), else ``optimizer``."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


class ScriptWatcher:
    """Watches what a script trains, through PyTorch's global optimizer and module hook
    registries (no monkeypatching):

    - every optimizer the script steps, from its first step, with its model: of the
      outermost modules called and the modules that the calling frames hold, the one that
      owns the optimizer's parameters (see `choose_model`). When the first step begins
      before any such module was called and has a closure (LBFGS in pytorch/examples'
      time_sequence_prediction: the closure makes the first forward pass), the model is
      the module owning them that the closure calls first: its watch replaces, within that
      step, the stand-in (``_ParamHolder``) watched from the step's start, which stays only
      when no module owns the parameters;
    - without any optimizer (an update by hand, as in word_language_model): the first
      outermost module called with grad enabled whose output requires grad and which has
      trainable parameters, each backward pass a step. If an optimizer stepping the same
      parameters comes later, its watch replaces that one.

    The first step is recorded as under ``watch()``: when the first outermost forward pass
    with grad enabled runs, an optimizer that the calling frames hold (a script builds it
    before its loop) and that steps that module's parameters is watched from then on, so
    the step's backward pass, and a clip between backward and step, are seen (the pre-clip
    norm of step 0). An optimizer first seen at its step is watched from there, as above.

    ``after_step`` (optional) is called after every optimizer step and, while only a watch
    without an optimizer runs, before each outermost forward pass (``graddbg run`` writes
    its snapshots there).

    ``namespace`` is the script's ``__main__`` module once its first forward pass ran:
    ``graddbg run`` keeps it, so that the script's objects (a DataLoader's worker
    processes) are freed at the interpreter's exit, as under plain python, not while the
    report is written."""

    def __init__(self, watch_kwargs: Dict[str, Any],
                 after_step: Optional[Callable[[], None]] = None) -> None:
        self.kwargs = watch_kwargs
        self.after_step = after_step
        self.watches: List[Any] = []
        self._seen: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
        self._roots: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
        self._deferred: Dict[int, _Deferred] = {}
        self._free: Optional[Tuple[Any, "weakref.ref[nn.Module]"]] = None  # (watch, model)
        self._looking = True  # for a model without an optimizer (until any watch starts)
        self._depth = 0
        self._handles = contextlib.ExitStack()  # (every handle removed by _remove)
        self._failed = False
        self.pid = os.getpid()
        self.outdir: Optional[pathlib.Path] = None  # where forked workers write their records
        self.on_watch: Optional[Callable[[Any], None]] = None  #: called with each watch started
        self._in_child = False
        self._rng: Optional[torch.Tensor] = None
        self.namespace: Any = None
        self._own_main = sys.modules.get("__main__")
        self._filter: Any = None

    def __enter__(self) -> "ScriptWatcher":
        from torch.nn.modules import module as module_mod
        from torch.optim import optimizer as optim_mod

        try:
            self._handles.callback(module_mod.register_module_forward_pre_hook(self._pre).remove)
            self._handles.callback(module_mod.register_module_forward_hook(self._post, always_call=True).remove)
            self._handles.callback(optim_mod.register_optimizer_step_pre_hook(self._on_step).remove)
            self._handles.callback(optim_mod.register_optimizer_step_post_hook(self._after).remove)
        except BaseException:
            self._remove()
            raise
        # torch.compile(module) warns on every call while global module hooks exist, that
        # they fire once more for the OptimizedModule: these are graddbg's, which take the
        # OptimizedModule as the outermost module (looked through by watch()); the warning is
        # not the script's, and is filtered while these hooks are in place
        warnings.filterwarnings("ignore", message=_COMPILE_HOOK_WARNING, category=UserWarning)
        self._filter = warnings.filters[0]
        return self

    def _pre(self, module: nn.Module, args: Any) -> None:
        if self._depth == 0:
            self._roots.add(module)
            if self.namespace is None and sys.modules.get("__main__") is not self._own_main:
                self.namespace = sys.modules.get("__main__")  # (the script's, under runpy)
            if self._looking:  # (what a replay of this forward pass needs, should it be watched)
                self._rng = torch.get_rng_state()
            if self._deferred:
                self._safely(self._resolve_deferred, module)
            if self._free is not None and self.after_step is not None:
                self.after_step()
        self._depth += 1

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0 and self._looking:
            self._safely(self._maybe_watch_early, module, args, output)
        if self._depth == 0 and self._looking:
            self._safely(self._maybe_watch_free, module, args, output)

    def _on_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer in self._seen:
            d = self._deferred.get(id(optimizer))
            if d is not None:  # the first step raised before its end: this one
                d.args, d.kwargs = args, kwargs
            return
        self._see(optimizer)
        self._safely(self._first_step, optimizer, args, kwargs)

    def _see(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` and the optimizers it wraps (``.optimizer``) are seen: watched once."""
        for _ in range(4):
            self._seen.add(optimizer)
            if _inner(optimizer) is optimizer:
                return
            optimizer = _inner(optimizer)

    def _first_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        model = choose_model([*self._roots, *_frame_modules()], _held(optimizer))
        w = self._start(model if model is not None else _ParamHolder(optimizer), optimizer)
        # this step's boundary: the watch's own step hook joins the hooks being run now
        if model is None and _closure(args, kwargs) is not None:  # the closure may call the model
            self._deferred[id(optimizer)] = _Deferred(optimizer, args, kwargs, w)

    def _resolve_deferred(self, module: nn.Module) -> None:
        """The first forward pass, inside a deferred optimizer's first step, of a module
        owning its parameters: its model's watch replaces the stand-in's (which has read
        nothing of this step yet), in the step under way."""
        for key, d in list(self._deferred.items()):
            opt = d.optimizer()
            if opt is None or not any(id(p) in d.held for p in module.parameters()):
                continue
            del self._deferred[key]
            d.watch.close()
            self.watches.remove(d.watch)
            model = choose_model([module, *self._roots, *_frame_modules()], d.held)
            w = self._start(model if model is not None else module, opt)
            w.begin_step(_closure(d.args, d.kwargs))  # the step began before this watch did

    def _maybe_watch_early(self, module: nn.Module, args: Any, output: Any) -> None:
        """Before any watch: the first outermost training forward pass, and an optimizer in
        the calling frames that steps this module's parameters: watched from now on, with its
        model (this forward pass handed to the watch), so that the first step's backward pass
        and clip are seen as under watch()."""
        from graddbg._model import in_backward, tensors_in
        if not torch.is_grad_enabled() or in_backward() or isinstance(module, torch.jit.ScriptModule):
            return
        if not any(t.requires_grad for t in tensors_in(output)):
            return
        own = {id(p) for p in module.parameters() if p.requires_grad}
        found = _frame_modules(kind=torch.optim.Optimizer)
        inner = {id(_inner(o)) for o in found if _inner(o) is not o}
        for opt in found:
            held = _held(opt)
            if opt in self._seen or id(opt) in inner or not own & held:
                continue  # (seen, or held by a wrapper found here too: accelerate's AcceleratedOptimizer)
            self._see(opt)
            model = choose_model([module, *self._roots, *_frame_modules()], held)
            w = self._start(model if model is not None else module, opt)
            w.adopt_forward(args, {}, output, rng_state=self._rng)

    def _maybe_watch_free(self, module: nn.Module, args: Any, output: Any) -> None:
        """A model trained without an optimizer: the first outermost module called with
        grad enabled, its output requiring grad, with trainable parameters. The forward pass
        that ran is handed to the new watch, so that a NaN at this very step is blamed (and
        replayed) as under watch()."""
        from graddbg._model import in_backward, tensors_in
        if not torch.is_grad_enabled() or in_backward() or isinstance(module, torch.jit.ScriptModule):
            return
        if not any(t.requires_grad for t in tensors_in(output)):
            return
        if not any(p.requires_grad for p in module.parameters()):
            return  # a loss function, a frozen encoder
        w = self._start(module, None)
        w.adopt_forward(args, {}, output, rng_state=self._rng)
        self._free = (w, weakref.ref(module))

    def _start(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Any:
        import graddbg

        if optimizer is not None:
            self._retire_free(_held(optimizer))
        kwargs = dict(self.kwargs)
        if kwargs.get("scaler") is None:  # the script's GradScaler, when it has one in its frames
            scalers = [s for s in _frame_modules(kind=torch.amp.GradScaler) if s.is_enabled()]
            kwargs["scaler"] = scalers[0] if scalers else None
        w = graddbg.watch(model, optimizer, **kwargs)
        if isinstance(model, _ParamHolder):
            w.meta["model"] = model.label  # (what the user passed, not graddbg's stand-in)
        self.watches.append(w)
        if self.on_watch is not None:
            self.on_watch(w)
        self._looking = False
        if os.getpid() != self.pid:  # a forked worker (torch.multiprocessing, Hogwild)
            self._in_worker(w)
        return w

    def _in_worker(self, w: Any) -> None:
        """A watch started in a forked worker process: the worker writes its own record,
        ``worker-<pid>/`` under the output folder, when it exits (multiprocessing runs its
        finalizers before the worker ends)."""
        import multiprocessing.util

        if not self._in_child:
            self._in_child = True
            self.watches = [w]  # (the parent's watches, copied by the fork, are the parent's)
            multiprocessing.util.Finalize(self, _save_worker, args=(self, self.outdir), exitpriority=10)

    def _retire_free(self, held: Set[int]) -> None:
        """An optimizer now steps the parameters of the model watched without one: its
        watch (from this step on) replaces that one."""
        if self._free is None:
            return
        w, ref = self._free
        model = ref()
        if model is not None and not any(id(p) in held for p in model.parameters()):
            return
        self._free = None
        w.close()
        self.watches.remove(w)

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._deferred.pop(id(optimizer), None)  # no module owning them ran: the stand-in stays
        if self.after_step is not None:
            self.after_step()

    def _safely(self, fn: Callable[..., Any], *args: Any) -> None:
        """Choosing and starting a watch never takes the script down: a failure is said
        once on stderr, and the script goes on unwatched by it."""
        try:
            fn(*args)
        except Exception as e:
            if not self._failed:
                print(f"graddbg run: could not start watching ({type(e).__name__}: {e}); "
                      f"the script goes on", file=sys.stderr)
            self._failed = True

    def _remove(self) -> None:
        self._handles.close()

    def __exit__(self, *exc: Any) -> None:
        self._remove()
        if self._filter is not None and self._filter in warnings.filters:
            warnings.filters.remove(self._filter)
            warnings._filters_mutated()  # type: ignore[attr-defined]  (as warnings.filterwarnings does)
        self._filter = None
        self._deferred.clear()
        from graddbg.run import stop_reason

        for w in self.watches:
            w.close()
            w.meta.setdefault("stopped", stop_reason(exc[1] if len(exc) > 1 else None))
        if self._free is not None and self._free[0].current_step == 0 and not self._free[0].anomalies:
            self.watches.remove(self._free[0])  # forward passes only, never a backward: nothing to show
        self._free = None


def _save_worker(watcher: "ScriptWatcher", outdir: Optional[pathlib.Path]) -> None:
    """In a forked worker at exit: its watches' records under ``outdir/worker-<pid>``."""
    watches = watcher.watches
    if outdir is None:
        return
    folder = outdir / f"worker-{os.getpid()}"
    try:
        folder.mkdir(exist_ok=True)
        for i, w in enumerate(watches):
            w.close()
            stats_path, report_path = outputs(folder, i)
            w.save(stats_path)
            w.report(report_path)
    except Exception as e:  # (a worker's exit must not fail because of its record)
        print(f"graddbg run: worker {os.getpid()} could not write its record: {e}", file=sys.stderr)


def outputs(outdir: pathlib.Path, i: int) -> Tuple[pathlib.Path, pathlib.Path]:
    """(statistics, report) of the i-th watch: stats.parquet, report.html, stats-2.parquet, ..."""
    suffix = "" if i == 0 else f"-{i + 1}"
    return outdir / f"stats{suffix}.parquet", outdir / f"report{suffix}.html"


class Snapshots:
    """Saves every watch's statistics (``stats.parquet``, atomically) every ``every``
    seconds while the script runs, so that a hard kill (``kill -9``, an out-of-memory
    kill) loses at most the last interval. Called after each optimizer step; a snapshot
    that takes long pushes the next one back (saving takes at most about a tenth of the
    run). A snapshot that cannot be written is said once on stderr; training goes on."""

    def __init__(self, outdir: pathlib.Path, every: float, watches: List[Any]) -> None:
        import pandas  # noqa: F401 - imported now, not on the clock of the first snapshot
        import pyarrow.parquet  # noqa: F401

        self.outdir, self.every, self.watches = outdir, every, watches
        self.due = time.monotonic() + every if every > 0 else math.inf
        self.saved = 0
        self.failed = False

    def __call__(self) -> None:
        if time.monotonic() < self.due:
            return
        t0 = time.monotonic()
        try:
            for i, w in enumerate(self.watches):
                w.save(outputs(self.outdir, i)[0])
            self.saved += 1
        except Exception as e:  # a full disk must not stop the training
            if not self.failed:
                print(f"graddbg run: could not write a snapshot ({e}); training goes on",
                      file=sys.stderr)
            self.failed = True
        spent = time.monotonic() - t0
        self.due = time.monotonic() + max(self.every, 10.0 * spent)


class Terminated(BaseException):
    """SIGTERM / SIGHUP under ``graddbg run``: unwinds the script like KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class Signals:
    """While entered (in the main thread), SIGTERM and SIGHUP raise ``Terminated`` in the
    script once, as Ctrl-C raises KeyboardInterrupt, so that what was recorded is written
    before the exit. From `disarm` on (the script has ended: the results are being written)
    a signal, Ctrl-C's SIGINT included, is only remembered (``received``; in order in
    ``deferred``): a second Ctrl-C never breaks the write. The previous handlers are put back
    on exit."""

    NAMES = ("SIGTERM", "SIGHUP")

    def __init__(self) -> None:
        self.previous: Dict[int, Any] = {}
        self.armed = False
        self.received: Optional[int] = None
        self.deferred: List[int] = []
        self.pid = os.getpid()
        self.main = False

    def __enter__(self) -> "Signals":
        if threading.current_thread() is threading.main_thread():
            self.main = True
            try:
                for name in self.NAMES:
                    signum = getattr(signal, name, None)
                    if signum is not None:
                        self.previous[signum] = signal.signal(signum, self._handle)
            except BaseException:
                self.__exit__()
                raise
        self.armed = True
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self.pid:  # a forked child (a DataLoader worker): die as it would have
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.received is None:
            self.received = signum
        if self.armed:
            self.armed = False
            raise Terminated(signum)
        self.deferred.append(signum)

    def disarm(self) -> None:
        """The script has ended: from now on every signal handled here, SIGINT too, waits."""
        self.armed = False
        if self.main and signal.SIGINT not in self.previous and os.getpid() == self.pid:
            with contextlib.suppress(ValueError, OSError):  # (not the main thread after all)
                self.previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._handle)

    def __exit__(self, *exc: Any) -> None:
        self.armed = False
        for signum, handler in self.previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self.previous = {}
