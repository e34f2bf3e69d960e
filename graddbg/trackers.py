"""Streaming a watch's record to the experiment tracker the user already looks at.

``watch(..., log_to=...)`` opens a `Sink` over one target or a list of them:

- a ``torch.utils.tensorboard.SummaryWriter`` (``add_scalar``; each finding with ``add_text``);
- a wandb ``Run``, or ``"wandb"`` for the active one (``wandb.run``): ``run.log`` with
  ``graddbg/step`` as the x axis of every ``graddbg/*`` metric (``define_metric``, as
  Lightning's ``WandbLogger`` does with its own step), each finding as a text value of
  ``graddbg/finding`` and a row of the table ``graddbg/findings`` (step, finding);
- ``"mlflow"`` for the active MLflow run (or an ``mlflow.ActiveRun``): ``log_batch`` of the
  metrics at the step, each finding as a run tag ``graddbg/finding/<n>``;
- a callable ``fn(metrics: dict, step: int)``, called with the scalars of each recorded step
  and, for each finding, with ``{"graddbg/finding": message}``.

On every recorded step, from the values the step's one read-back brought to the host (no
synchronisation of its own): ``graddbg/global_norm``, ``graddbg/clipped_norm`` (when the
gradients were clipped), ``graddbg/loss`` (the sum of the losses handed to ``backward()``
in the step), ``graddbg/lr``, ``graddbg/norm/<module>`` per top-level module
(``log_detail="module"``, the default; ``graddbg/norm/<parameter>`` with
``log_detail="param"``), ``graddbg/update_ratio/<module>`` (its parameters' largest
``||dw|| / ||w||``; per parameter with ``"param"``) at the step they were measured after,
and ``graddbg/anomalies``, the findings so far. Values that are unknown (NaN: a loss
handed with explicit gradients, no optimizer's lr, a ratio not measured) are left out;
a NaN or Inf global norm is logged as it is.

wandb, mlflow and tensorboard are imported only when asked for. A tracker that fails while
training runs gets one `graddbg.GraddbgWarning` and is not called again: training goes on.

Examples:
    >>> seen = []
    >>> sink = Sink([lambda metrics, step: seen.append((step, metrics))], ["0.weight", "0.bias"])
    >>> sink.emit({"graddbg/loss": 0.5}, 3); seen
    [(3, {'graddbg/loss': 0.5})]
"""
from __future__ import annotations

import math
import time
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from graddbg._args import bad_type, bad_value
from graddbg._errors import GraddbgValueError, GraddbgWarning
from graddbg._model import module_of
from graddbg.stats import rollup_norms

__all__ = ["Sink", "step_metrics", "Groups", "check_log_to", "check_detail", "kind_of", "targets",
           "FINDING_KEY", "ANOMALIES_KEY", "STEP_KEY", "DETAILS"]

PREFIX = "graddbg"
#: the text of each finding (TensorBoard's text tag, wandb's key, the callable's key)
FINDING_KEY = f"{PREFIX}/finding"
#: the number of findings so far
ANOMALIES_KEY = f"{PREFIX}/anomalies"
#: wandb: the table of the findings so far (a row each: step, message)
TABLE_KEY = f"{PREFIX}/findings"
#: wandb: the x axis of the graddbg/* metrics (the watch's step)
STEP_KEY = f"{PREFIX}/step"
#: ``log_detail=``: norms and update ratios per top-level module, or per parameter
DETAILS = ("module", "param")
ACCEPTED = ("None, a torch.utils.tensorboard.SummaryWriter, a wandb Run or 'wandb' (the active run), "
            "'mlflow' (the active MLflow run) or an mlflow ActiveRun, a callable (metrics: dict, step: int), "
            "or a list of these")
#: MLflow's limit on a tag's value (its stores take at least this many characters)
_TAG_CHARS = 5000


# --------------------------------------------------------------------------- what is accepted
def kind_of(target: Any) -> Optional[str]:
    """``"tensorboard"``, ``"wandb"``, ``"mlflow"`` or ``"callable"`` for a ``log_to`` target,
    None for anything else (no package is imported to tell).

    Examples:
        >>> kind_of("wandb"), kind_of(print), kind_of(3)
        ('wandb', 'callable', None)
    """
    if isinstance(target, str):
        return target if target in ("wandb", "mlflow") else None
    if isinstance(target, type):  # (a class where an instance is expected: SummaryWriter, not SummaryWriter())
        return None
    module = type(target).__module__ or ""
    if hasattr(target, "add_scalar") and hasattr(target, "add_text"):
        return "tensorboard"
    if module.split(".")[0] == "wandb" and callable(getattr(target, "log", None)):
        return "wandb"
    if module.split(".")[0] == "mlflow" and hasattr(getattr(target, "info", None), "run_id"):
        return "mlflow"
    return "callable" if callable(target) else None


def targets(log_to: Any) -> Tuple[Any, ...]:
    """The targets of a ``log_to`` value: none for None, each of a list or tuple, else itself."""
    if log_to is None:
        return ()
    return tuple(log_to) if isinstance(log_to, (list, tuple)) else (log_to,)


def check_log_to(where: str, name: str, value: Any) -> Any:
    """``log_to=``'s validator (`graddbg.options.WatchOptions`): the value as given when
    every target is of a kind `kind_of` knows. Whether ``"wandb"`` / ``"mlflow"`` have an
    active run is asked when the watch starts (`Sink`), not here.

    Examples:
        >>> check_log_to("watch", "log_to", "tensorboard")
        Traceback (most recent call last):
        ...
        graddbg._errors.GraddbgValueError: watch(log_to=...): got 'tensorboard'; accepted: None, a torch.utils.tensorboard.SummaryWriter, ...
    """
    for target in targets(value):
        if kind_of(target) is None:
            make = bad_value if isinstance(target, str) else bad_type
            raise make(where, name, target, ACCEPTED)
    return value


def check_detail(where: str, name: str, value: Any) -> str:
    """``log_detail=``: ``"module"`` or ``"param"``."""
    accepted = "'module' (norms and update ratios per top-level module) or 'param' (per parameter)"
    if not isinstance(value, str):
        raise bad_type(where, name, value, accepted)
    if value not in DETAILS:
        raise bad_value(where, name, value, accepted)
    return value


# --------------------------------------------------------------------------- the metrics
class Groups:
    """Where each parameter's norm and update ratio go: its top-level module
    (``"module"``; parameters of the root module under ``(root)``) or itself (``"param"``).

    Examples:
        >>> g = Groups(["enc.0.weight", "enc.1.bias", "head.weight", "scale"], "module")
        >>> g.labels
        ['enc', 'head', '(root)']
        >>> g.norms(np.array([3.0, 4.0, 1.0, np.nan]), np.array([True, True, True, False]))
        {'graddbg/norm/enc': 5.0, 'graddbg/norm/head': 1.0}
    """

    def __init__(self, names: Sequence[str], detail: str = "module") -> None:
        self.detail, self.size = detail, len(names)
        if detail == "param":
            self.labels, self.key = list(names), np.arange(len(names), dtype=np.int64)
            return
        tops = [module_of(n).split(".")[0] or "(root)" for n in names]
        self.labels = list(dict.fromkeys(tops))
        index = {label: i for i, label in enumerate(self.labels)}
        self.key = np.array([index[t] for t in tops], dtype=np.int64)

    def norms(self, norm: np.ndarray, has_grad: np.ndarray) -> Dict[str, float]:
        """``graddbg/norm/<label>`` of the groups where some parameter had a gradient (NaN
        or Inf as the gradients were)."""
        n = len(self.labels)
        values = rollup_norms(self.key, norm, has_grad, n)
        seen = np.bincount(self.key, weights=np.asarray(has_grad, dtype=float), minlength=n) > 0
        return {f"{PREFIX}/norm/{self.labels[i]}": float(values[i]) for i in np.flatnonzero(seen)}

    def ratios(self, ratios: np.ndarray) -> Dict[str, float]:
        """``graddbg/update_ratio/<label>``: the largest measured ratio of each group."""
        n = len(self.labels)
        top = np.full(n, np.nan)
        np.fmax.at(top, self.key, np.where(np.isnan(ratios), np.nan, ratios))
        return {f"{PREFIX}/update_ratio/{self.labels[i]}": float(top[i]) for i in np.flatnonzero(~np.isnan(top))}


def step_metrics(last: Mapping[str, Any], groups: Groups, anomalies: int) -> Dict[str, float]:
    """The scalars of one recorded step from its host record (``History.last_recorded()``):
    the global norm, the post-clip norm, the loss and the lr when known, the norms per
    group, and the number of findings so far.

    Examples:
        >>> row = {"global_norm": 5.0, "clipped_norm": math.nan, "loss": 0.25, "lr": math.nan,
        ...        "norm": np.array([3.0, 4.0]), "has_grad": np.array([True, True])}
        >>> step_metrics(row, Groups(["a.w", "b.w"]), 0)
        {'graddbg/global_norm': 5.0, 'graddbg/loss': 0.25, 'graddbg/norm/a': 3.0, 'graddbg/norm/b': 4.0, 'graddbg/anomalies': 0.0}
    """
    out = {f"{PREFIX}/global_norm": float(last["global_norm"])}
    for key in ("clipped_norm", "loss", "lr"):
        value = float(last.get(key, math.nan))
        if not math.isnan(value):
            out[f"{PREFIX}/{key}"] = value
    out.update(groups.norms(last["norm"], last["has_grad"]))
    out[ANOMALIES_KEY] = float(anomalies)
    return out


# --------------------------------------------------------------------------- the adapters
class _Callable:
    def __init__(self, fn: Callable[[Dict[str, Any], int], Any]) -> None:
        self.fn = fn
        self.name = getattr(fn, "__qualname__", type(fn).__name__)

    def scalars(self, metrics: Dict[str, float], step: int) -> None:
        self.fn(dict(metrics), step)

    def text(self, message: str, step: int) -> None:
        self.fn({FINDING_KEY: message}, step)

    def flush(self) -> None:
        pass


class _TensorBoard:
    name = "SummaryWriter"

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def scalars(self, metrics: Dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def text(self, message: str, step: int) -> None:
        self.writer.add_text(FINDING_KEY, message, step)

    def flush(self) -> None:
        flush = getattr(self.writer, "flush", None)
        if flush is not None:
            flush()


class _Wandb:
    name = "wandb"

    def __init__(self, run: Any) -> None:
        self.run = run
        self.rows: List[list] = []  # (the findings so far, the table's rows)
        run.define_metric(STEP_KEY)
        run.define_metric(f"{PREFIX}/*", step_metric=STEP_KEY)

    def scalars(self, metrics: Dict[str, float], step: int) -> None:
        self.run.log({**metrics, STEP_KEY: step})

    def text(self, message: str, step: int) -> None:
        import wandb

        self.rows.append([step, message])  # (a wandb Table is logged whole: every finding so far)
        self.run.log({FINDING_KEY: message, TABLE_KEY: wandb.Table(columns=["step", "finding"], data=list(self.rows)),
                      STEP_KEY: step})

    def flush(self) -> None:
        pass


class _MLflow:
    name = "mlflow"

    def __init__(self, run_id: str) -> None:
        from mlflow.tracking import MlflowClient

        self.client, self.run_id, self.findings = MlflowClient(), run_id, 0

    def scalars(self, metrics: Dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def text(self, message: str, step: int) -> None:
        self.findings += 1
        self.client.set_tag(self.run_id, f"{FINDING_KEY}/{self.findings}", f"step {step}: {message}"[:_TAG_CHARS])

    def flush(self) -> None:
        pass


def _import(where: str, package: str, given: Any) -> Any:
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError as err:
        raise GraddbgValueError(f"{where}(log_to=...): got {given!r}, but {package} is not installed "
                                f"(pip install {package}): {err}") from None


def _open(target: Any, where: str) -> Any:
    """The adapter of one target; ``"wandb"`` and ``"mlflow"`` need an active run now."""
    kind = kind_of(target)
    if kind == "tensorboard":
        return _TensorBoard(target)
    if kind == "callable":
        return _Callable(target)
    if kind == "wandb" and not isinstance(target, str):
        return _Wandb(target)
    if target == "wandb":
        run = _import(where, "wandb", target).run
        if run is None:
            raise GraddbgValueError(f"{where}(log_to='wandb'): no wandb run is active; call wandb.init(...) "
                                    f"before watch(), or pass the run itself (log_to=run)")
        return _Wandb(run)
    if target == "mlflow":
        run = _import(where, "mlflow", target).active_run()
        if run is None:
            raise GraddbgValueError(f"{where}(log_to='mlflow'): no MLflow run is active; call "
                                    f"mlflow.start_run() before watch() (or use it as a context manager "
                                    f"around the training loop)")
        return _MLflow(run.info.run_id)
    if kind == "mlflow":
        return _MLflow(target.info.run_id)
    check_log_to(where, "log_to", target)  # (raises: a target of no known kind)
    raise AssertionError(target)  # pragma: no cover


# --------------------------------------------------------------------------- the sink
class Sink:
    """The targets of ``log_to``, fed by the watch with host values after each recorded
    step's read-back (`step`), with each finding (`finding`) and at close (`close`).

    Args:
        log_to: a target or a list of them (see the module's docstring).
        names: the watched parameters' names, in the watch's order (the list may grow:
            parameters adopted later are grouped when they come).
        detail: ``"module"`` or ``"param"`` (``log_detail=``).
        where: the call, for messages (``watch``).

    Raises:
        GraddbgValueError: ``"wandb"`` / ``"mlflow"`` with no active run, or the package
            not installed.
        GraddbgTypeError: a target of no accepted kind.
    """

    def __init__(self, log_to: Any, names: Sequence[str], detail: str = "module", where: str = "watch") -> None:
        self._outs = [_open(t, where) for t in targets(log_to)]
        self._names, self._detail = names, detail
        self._groups = Groups(names, detail)
        self._awaited: Optional[int] = None  # the recorded step whose update ratios may come later

    def emit(self, metrics: Dict[str, float], step: int) -> None:
        """``metrics`` to every target at ``step``."""
        for out in list(self._outs):
            self._call(out, out.scalars, metrics, step)

    def step(self, history: Any, index: int, anomalies: int) -> None:
        """After step ``index``'s reads: the update ratios read back since the last recorded
        step (at the step they were measured after), then this step's scalars when it was
        recorded. ``history`` is the watch's `graddbg.stats.History`; ``anomalies`` the
        findings so far."""
        if len(self._names) != self._groups.size:
            self._groups = Groups(self._names, self._detail)
        self._ratios(history)
        last = history.last_recorded()
        if last is None or int(last["step"]) != index:
            return
        self.emit(step_metrics(last, self._groups, anomalies), index)
        self._awaited = index

    def _ratios(self, history: Any) -> None:
        if self._awaited is None:
            return
        ratios = history.update_of(self._awaited)
        if ratios is not None:
            self.emit(self._groups.ratios(ratios[: self._groups.size]), self._awaited)
            self._awaited = None

    def finding(self, anomaly: Any) -> None:
        """One finding's message as a text event at its step."""
        message = f"[{anomaly.kind}] {anomaly.message}"
        for out in list(self._outs):
            self._call(out, out.text, message, int(anomaly.step))

    def close(self, history: Any) -> None:
        """At the watch's close: the last update ratios (read back by the close), then each
        target flushed (the user's writer or run stays open: it is theirs)."""
        self._ratios(history)
        for out in list(self._outs):
            self._call(out, out.flush)

    def _call(self, out: Any, method: Callable[..., Any], *args: Any) -> None:
        try:
            method(*args)
        except Exception as err:  # (a tracker's failure must not stop the training it records)
            self._outs.remove(out)
            warnings.warn(f"graddbg.watch(log_to=...): logging to {out.name} failed, so graddbg stops logging "
                          f"to it (training goes on): {type(err).__name__}: {err}", GraddbgWarning, stacklevel=3)
