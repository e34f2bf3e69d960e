"""Callbacks that watch the gradients of a Lightning or a transformers ``Trainer``.

Two thin adapters around `graddbg.watch`; everything they record is the watch's::

    import lightning.pytorch as L
    from graddbg.callbacks import LightningCallback

    cb = LightningCallback(explode="warn", report=True)     # watch()'s keyword options
    L.Trainer(callbacks=[cb], accumulate_grad_batches=2, gradient_clip_val=1.0).fit(module, data)
    cb.watch.steps          # one row per optimizer step: pre-clip global norm, clipped_norm, ...

    from transformers import Trainer
    from graddbg.callbacks import TransformersCallback

    cb = TransformersCallback(report=True)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]).train()
    cb.watch.stats          # one row per (optimizer step, parameter), the model's own names

What each callback does:

- At construction it checks the options the way ``watch()`` does, raising the same
  ``ValueError`` / ``TypeError`` (a wrong option fails at once, not after the first epoch).
  ``report=True`` writes ``report.html`` into the trainer's output folder when training
  ends (Lightning: ``trainer.log_dir``; transformers: ``args.output_dir``); a path writes
  there (a relative one inside that folder). Only the first process writes it.
- When training starts it watches the model the user wrote (the ``LightningModule``; the
  trainer's ``model``, not a DDP wrapper) with the trainer's optimizer (unwrapped from
  ``LightningOptimizer`` / accelerate's ``AcceleratedOptimizer`` by ``watch()``), and with
  the trainer's AMP ``GradScaler`` when it has one and ``scaler=`` was not given
  (Lightning's precision plugin ``.scaler``; accelerate's optimizer ``.scaler``). The watch
  is ``.watch`` from then on (``None`` before), and stays readable after training.
- The optimizer's step is the step boundary: one record per optimizer step under gradient
  accumulation; the pre-clip norm in ``steps.global_norm`` and the post-clip one in
  ``steps.clipped_norm`` when the trainer clips.
- It logs what ``watch(log_to=...)`` logs (see `graddbg.trackers`: ``graddbg/global_norm``,
  ``graddbg/loss``, ``graddbg/lr``, the norms per top-level module, or per parameter with
  ``log_detail="param"``, the update ratios when measured, ``graddbg/anomalies``: how many
  findings so far; the latest recorded step's values) through the trainer, to its own
  loggers: Lightning's ``LightningModule.log_dict`` after each optimizer step;
  transformers' ``logs`` at each logging step (``on_log``; they also go into
  ``trainer.state.log_history``). A ``log_to=`` given to the callback is fed as well
  (with the findings' text). In transformers, logging integrations
  (``report_to``) that come before this callback in the trainer's list, as they do by
  default, have already written that step's logs when ``on_log`` reaches it.
- It closes the watch when training ends, and in Lightning also when training raises
  (``on_exception``, which writes the report too when asked). transformers has no hook for
  a failed ``train()``: a watch left open is closed when the next training starts, or by
  ``cb.watch.close()``.

Importing this module imports neither Lightning nor transformers. ``LightningCallback``
and ``TransformersCallback`` are real subclasses of ``lightning.pytorch.Callback`` (or
``pytorch_lightning.Callback`` where only that is installed) and of
``transformers.TrainerCallback``: each class is built on its first use, by the module's
``__getattr__``, from the framework's base class and a plain mixin defined here
(`_LightningHooks`, `_TransformersHooks`), and is the same class afterwards.
"""
from __future__ import annotations

import importlib
import os
import pathlib
import warnings
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch

from graddbg import hooks
from graddbg._errors import GraddbgTypeError, GraddbgValueError, GraddbgWarning
from graddbg._io import write_atomic
from graddbg.options import WatchOptions
from graddbg.trackers import ANOMALIES_KEY, targets  # noqa: F401  (ANOMALIES_KEY: read as callbacks.ANOMALIES_KEY too)

__all__ = ["LightningCallback", "TransformersCallback"]

NORM_KEY = "graddbg/global_norm"
REPORT_NAME = "report.html"

ReportArg = Union[bool, str, "os.PathLike[str]"]


# --------------------------------------------------------------------------- validation
def _check_report(owner: str, report: Any) -> ReportArg:
    if isinstance(report, (bool, str, os.PathLike)):
        return report
    raise GraddbgTypeError(f"{owner}(report=...): expected a bool or a path to write the HTML report to, "
                           f"got {type(report).__name__}")


def _check_watch_kwargs(owner: str, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``watch()``'s keyword options, validated now through the one options object, so a
    bad option raises the same error at construction as ``watch()`` would.

    >>> _check_watch_kwargs("LightningCallback", {"every": 2})
    {'every': 2}
    >>> _check_watch_kwargs("LightningCallback", {"every": 0})
    Traceback (most recent call last):
    ...
    graddbg._errors.GraddbgValueError: LightningCallback(every=...): got 0; accepted: an int >= 1
    """
    for taken in ("model", "optimizer"):
        if taken in kwargs:
            raise GraddbgTypeError(f"{owner}({taken}=...): the model and optimizer are the trainer's, taken "
                                   f"when training starts; pass only watch()'s keyword options")
    WatchOptions.parse(owner, kwargs)
    return dict(kwargs)


def _enabled(scaler: Any) -> bool:
    return scaler is not None and hasattr(scaler, "get_scale") and bool(getattr(scaler, "is_enabled", lambda: True)())


# --------------------------------------------------------------------------- shared core
class _Collected:
    """``log_to``'s callable for the trainer's own loggers: the scalars of the recorded steps
    since the last `take` (a later step's value of a key wins; the findings' text is left to
    the trackers given as ``log_to=``)."""

    def __init__(self) -> None:
        self.values: Dict[str, float] = {}

    def __call__(self, metrics: Dict[str, Any], step: int) -> None:
        self.values.update({k: float(v) for k, v in metrics.items() if not isinstance(v, str)})

    def take(self) -> Dict[str, float]:
        values, self.values = self.values, {}
        return values


class _Adapter:
    """What both callbacks share: options checked at construction; starting, logging
    from and closing the watch; writing the report."""

    def __init__(self, *, report: ReportArg = False, **watch_kwargs: Any) -> None:
        owner = type(self).__name__
        self._report = _check_report(owner, report)
        self._watch_kwargs = _check_watch_kwargs(owner, watch_kwargs)
        self.watch: Optional[hooks.Watch] = None
        self._folder = pathlib.Path.cwd()
        self._collected = _Collected()
        self._running = False
        self._resumed: Optional[Dict[str, Any]] = None  # a watch state to restore when training starts
        super().__init__()

    def _start(self, model: Any, optimizer: Any, scaler: Any, folder: Any) -> None:
        """Watch ``model`` with the trainer's optimizer (and scaler, unless one was given)."""
        self._finish(write=False)  # a watch left open by a run that raised
        kwargs = dict(self._watch_kwargs)
        if kwargs.get("scaler") is None and _enabled(scaler):
            kwargs["scaler"] = scaler
        self._folder = pathlib.Path(folder) if folder else pathlib.Path.cwd()
        self._collected = _Collected()
        kwargs["log_to"] = (*targets(kwargs.get("log_to")), self._collected)  # (and the trackers given)
        self.watch = hooks.watch(model, optimizer, **kwargs)
        self._running = True
        if self._resumed is not None:  # (a run resumed from a checkpoint: graddbg goes on where it stopped)
            self.watch.load_state_dict(self._resumed)
            self._resumed = None

    def _watch_state(self) -> Optional[Dict[str, Any]]:
        return self.watch.state_dict() if self.watch is not None else self._resumed

    def _new_values(self) -> Dict[str, float]:
        """The values to log when a step was recorded since the last call, else ``{}``: what
        ``log_to`` logs (`graddbg.trackers.step_metrics`), the latest recorded step's values:
        the global norm (NaN or inf when the gradients were), the loss, the lr, the norms,
        the update ratios read back since, and ``graddbg/anomalies``, the findings so far."""
        return self._collected.take()

    def report_path(self) -> Optional[pathlib.Path]:
        """Where the report is written at the end (``None`` when not asked for)."""
        if self._report is False:
            return None
        if self._report is True:
            return self._folder / REPORT_NAME
        path = pathlib.Path(self._report)
        return path if path.is_absolute() else self._folder / path

    def _finish(self, write: bool) -> Optional[pathlib.Path]:
        """Close the watch (once) and write the report when asked and ``write``."""
        if not self._running or self.watch is None:
            return None
        self._running = False
        self.watch.close()
        path = self.report_path()
        if not write or path is None:
            return None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            return self.watch.report(path)
        except Exception as err:  # the run is over and recorded: a failed report must not hide that
            warnings.warn(f"{type(self).__name__}: could not write the report to {str(path)!r}: "
                          f"{type(err).__name__}: {err}", GraddbgWarning, stacklevel=2)
            return None


# --------------------------------------------------------------------------- Lightning
class _LightningHooks(_Adapter):
    """A Lightning callback that watches the ``LightningModule``'s gradients during ``fit``.

    ``LightningCallback(report=False, **watch_kwargs)`` (see `graddbg.callbacks`). With one
    optimizer, its step is the step boundary; with several (manual optimisation), each
    backward pass is one. It logs what ``watch(log_to=...)`` logs (``graddbg/global_norm``,
    ``graddbg/loss``, ``graddbg/lr``, the norms per module, ``graddbg/anomalies``, ...) through
    ``LightningModule.log_dict`` to the trainer's loggers, and closes the watch when training
    ends or raises.

    Reading ``graddbg.callbacks.LightningCallback`` raises ``ImportError`` when Lightning
    (``lightning`` or ``pytorch-lightning``) is not installed. The watch is the callback's ``.watch`` once training has started (None
    before); ``report_path()`` says where the report goes.

    Args:
        report: write the HTML report when training ends: False (the default), True
            (``report.html`` in ``trainer.log_dir``, else ``trainer.default_root_dir``)
            or a path (a relative one inside that folder). Only the first process writes it; a report that cannot be
            written is a `GraddbgWarning`, not an error.
        **watch_kwargs: `graddbg.watch`'s keyword options (``every``, ``nonfinite``,
            ``explode``, ``scaler``, ...), checked here; not ``model`` or ``optimizer``,
            which are the trainer's.

    Raises:
        GraddbgTypeError: ``report`` is not a bool or a path, ``model=`` or ``optimizer=``
            is given, a keyword that `graddbg.watch` does not take, or an option of the
            wrong type (as `graddbg.watch` raises it).
        GraddbgValueError: an option's value is not accepted (``every=0``, an unknown
            policy, ...), as `graddbg.watch` raises it.
    """

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = list(getattr(trainer, "optimizers", None) or [])
        plugin = getattr(trainer.strategy, "precision_plugin", None)
        folder = trainer.log_dir or trainer.default_root_dir  # (a collective under DDP: every rank asks)
        self._start(pl_module, optimizers[0] if len(optimizers) == 1 else None,
                    getattr(plugin, "scaler", None), folder)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        values = self._new_values()
        if values:
            pl_module.log_dict(values, on_step=True, on_epoch=False, batch_size=1)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._finish(write=trainer.is_global_zero)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._finish(write=trainer.is_global_zero)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._finish(write=False)

    def state_dict(self) -> Dict[str, Any]:
        """Saved in Lightning's checkpoints: the watch's state (`graddbg.Watch.state_dict`)."""
        state = self._watch_state()
        return {"watch": state} if state is not None else {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restored by Lightning when ``fit(ckpt_path=...)`` resumes: applied when training starts."""
        self._resumed = state_dict.get("watch")


def _lightning_base() -> type:
    """``lightning.pytorch.Callback``, or ``pytorch_lightning.Callback`` where only that is installed."""
    for package in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return importlib.import_module(package).Callback
        except ModuleNotFoundError as err:
            if err.name is None or not package.startswith(err.name):
                raise  # installed but broken: say so
    raise ImportError("graddbg.callbacks.LightningCallback needs Lightning: pip install lightning "
                      "(or pytorch-lightning)")


#: the watch's state in a transformers checkpoint folder
STATE_NAME = "graddbg_state.json"


def _checkpoint_state(args: Any, state: Any) -> Optional[Dict[str, Any]]:
    """The watch state saved in the checkpoint a transformers run resumes from (the
    trainer's state is loaded before ``on_train_begin``), or None."""
    step = int(getattr(state, "global_step", 0) or 0)
    path = pathlib.Path(getattr(args, "output_dir", None) or ".") / f"checkpoint-{step}" / STATE_NAME
    if step <= 0 or not path.is_file():
        return None
    import json

    return json.loads(path.read_text())


# --------------------------------------------------------------------------- transformers
class _TransformersHooks(_Adapter):
    """A ``transformers.TrainerCallback`` that watches the trainer's model during ``train()``.

    ``TransformersCallback(report=False, **watch_kwargs)`` (see `graddbg.callbacks`). The
    optimizer's step is the step boundary. It adds what ``watch(log_to=...)`` logs
    (``graddbg/global_norm``, ``graddbg/loss``, ``graddbg/lr``, the norms per module,
    ``graddbg/anomalies``, ...) to the trainer's logs at each logging step and closes the
    watch when training ends.

    Reading ``graddbg.callbacks.TransformersCallback`` raises ``ImportError`` when
    transformers is not installed. The watch is the callback's ``.watch`` once training has started (None
    before); ``report_path()`` says where the report goes.

    Args:
        report: write the HTML report when training ends: False (the default), True
            (``report.html`` in ``args.output_dir``, else the current folder) or a path
            (a relative one inside that folder). Only the first process writes it; a report that cannot be
            written is a `GraddbgWarning`, not an error.
        **watch_kwargs: `graddbg.watch`'s keyword options (``every``, ``nonfinite``,
            ``explode``, ``scaler``, ...), checked here; not ``model`` or ``optimizer``,
            which are the trainer's.

    Raises:
        GraddbgTypeError: ``report`` is not a bool or a path, ``model=`` or ``optimizer=``
            is given, a keyword that `graddbg.watch` does not take, or an option of the
            wrong type (as `graddbg.watch` raises it).
        GraddbgValueError: an option's value is not accepted (``every=0``, an unknown
            policy, ...), as `graddbg.watch` raises it.
    """

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        saved = _checkpoint_state(args, state)  # (resuming from a checkpoint this callback saved)
        if saved is not None:
            self._resumed = saved
        self._start(model, optimizer, getattr(optimizer, "scaler", None), getattr(args, "output_dir", None))

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The watch's state into the checkpoint just saved (``graddbg_state.json``), read
        back when training resumes from it."""
        folder = pathlib.Path(args.output_dir or ".") / f"checkpoint-{state.global_step}"
        if self.watch is not None and folder.is_dir() and bool(getattr(state, "is_world_process_zero", True)):
            import json

            write_atomic(folder / STATE_NAME, json.dumps(self.watch.state_dict()).encode())

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[Dict[str, Any]] = None,
               **kwargs: Any) -> None:
        values = self._new_values()
        if not values or logs is None:
            return
        logs.update(values)
        history = state.log_history
        if history and history[-1].get("step") == state.global_step and all(k in history[-1] for k in logs
                                                                            if k not in values):
            history[-1].update(values)  # the trainer stored a copy of these logs just before on_log

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._finish(write=bool(state.is_world_process_zero))


def _transformers_base() -> type:
    try:
        return importlib.import_module("transformers").TrainerCallback
    except ModuleNotFoundError as err:
        if err.name != "transformers":
            raise
    raise ImportError("graddbg.callbacks.TransformersCallback needs transformers: pip install transformers")


# --------------------------------------------------------------------------- lazy classes
_BUILD: Dict[str, Tuple[type, Callable[[], type]]] = {
    "LightningCallback": (_LightningHooks, _lightning_base),
    "TransformersCallback": (_TransformersHooks, _transformers_base),
}
_BUILT: Dict[str, type] = {}


def __getattr__(name: str) -> Any:
    """``LightningCallback`` / ``TransformersCallback``: the mixin over the framework's real
    base class, built (importing the framework) on first use and cached."""
    if name not in _BUILD:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _BUILT:
        mixin, base = _BUILD[name]
        _BUILT[name] = type(name, (mixin, base()), {"__module__": __name__, "__qualname__": name,
                                                     "__doc__": mixin.__doc__})
    return _BUILT[name]


def __dir__() -> list:
    return sorted(set(globals()) | set(_BUILD))
