"""``watch()``'s options, declared once.

Each option is one field of `WatchOptions`: its name, its default and the check
that validates (and normalises) a value given for it. ``watch``, ``Watch``, the trainer
callbacks and ``graddbg run`` all build their options through `WatchOptions.parse`,
so a bad value raises the same error everywhere, at the moment it is given.

Examples:
    >>> opts = WatchOptions.parse("watch", {"every": 2, "explode": None})
    >>> opts.every, opts.explode
    (2, None)
    >>> WatchOptions.parse("watch", {"every": 0})
    Traceback (most recent call last):
    ...
    graddbg._errors.GraddbgValueError: watch(every=...): got 0; accepted: an int >= 1
    >>> WatchOptions.parse("watch", {"evry": 2})
    Traceback (most recent call last):
    ...
    graddbg._errors.GraddbgTypeError: watch(): unknown keyword(s) ['evry'] (did you mean 'every'?); accepted: [...]
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, Optional, Tuple

from graddbg._args import (AUTO, CPU_ABSMAX, UPDATE_RATIOS, Options, Schedule, bad_type, bad_value, count, duration,
                           flag, integer, optional)
from graddbg._args import option as _option
from graddbg._errors import GraddbgTypeError, GraddbgValueError
from graddbg.anomaly import HYGIENE_KINDS, Explode, NonFinite, Vanish, as_detector, check_policy
from graddbg.stats import DEFAULT_STATS, validate_stats
from graddbg.trackers import check_detail, check_log_to

__all__ = ["WatchOptions", "UPDATE_EVERY", "COPY_BUDGET", "AUTO"]

#: the default of ``update_every=``: the log cadence, recorded steps 0, 1, 2, 5, 10, 20, 50,
#: 100, 200, then every 200 (`graddbg._args.UPDATE_RATIOS`), so a short run has its early
#: ratios and a long one pays for the copy of the weights it needs rarely
UPDATE_EVERY = "log"
#: the default of ``copy_budget=``: the share of the weights' bytes that may be copied before
#: one optimizer step (`graddbg.checks.budget.WeightBudget`)
COPY_BUDGET = 0.1


# --------------------------------------------------------------------------- validators
# Each takes (where, name, value): the call (``watch``, ``LightningCallback``, ``graddbg
# run``), the option and the value given; it returns the value normalised or raises the
# error of `graddbg._args`, naming the option, what was given and what is accepted.
def _stats(where: str, name: str, value: Any) -> Any:
    try:
        validate_stats(value)       # (kept as given; its canonical form is `quantities`)
    except (GraddbgTypeError, GraddbgValueError) as err:
        raise type(err)(f"{where}({name}=...): {str(err).removeprefix('stats= ')}") from None
    return value


def _detector(where: str, name: str, value: Any) -> Any:
    return as_detector(value, name, where)


def _policy(where: str, name: str, value: Any) -> Any:
    return check_policy(value, name, where)


def _histograms(where: str, name: str, value: Any) -> Optional[int]:
    """``histograms=``: None/False (off), True (every recorded step) or every N steps."""
    if value is not None and not isinstance(value, (bool, int)):
        raise bad_type(where, name, value, "None, a bool or an int >= 1 (every N steps)")
    return None if value in (None, False) else 1 if value is True else count(where, name, value)


def _scaler(where: str, name: str, value: Any) -> Any:
    if value is not None and not hasattr(value, "get_scale"):
        raise bad_type(where, name, value, "a torch.amp.GradScaler or None")
    return value


def _replica_every(where: str, name: str, value: Any) -> Any:
    accepted = f"None, {AUTO!r} or an int >= 1"
    if value is None or value == AUTO:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_type(where, name, value, accepted)
    if value < 1:
        raise bad_value(where, name, value, accepted)
    return value


def _update_every(where: str, name: str, value: Any) -> Any:
    """``update_every=``: None (off), "log" (the log cadence) or every N steps."""
    if value is None or value == "log":
        return value
    if isinstance(value, str):
        raise bad_value(where, name, value, "None, 'log' or an int >= 1")
    return integer(where, name, value, minimum=1)


def _fraction(where: str, name: str, value: Any) -> float:
    """A fraction in (0, 1], as a float."""
    accepted = "a fraction in (0, 1] of the weights' bytes"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise bad_type(where, name, value, accepted)
    if not 0 < float(value) <= 1:
        raise bad_value(where, name, value, accepted)
    return float(value)


# --------------------------------------------------------------------------- the options
@dataclass(frozen=True)
class WatchOptions(Options):
    """The keyword options of `graddbg.watch`, validated once; see its docstring
    for what each means. ``stats`` is kept as given (its canonical form is
    `quantities`). The cadences are read as `graddbg._args.Schedule` objects
    (`record_schedule`, `histogram_schedule`, ...), each counting the watch's steps."""

    every: int = _option(1, count, "record statistics on every every-th step")
    stats: Tuple[str, ...] = _option(DEFAULT_STATS, _stats, "the per-parameter quantities read")
    nonfinite: Any = _option("raise", _detector, "policy or NonFinite detector")
    explode: Any = _option("warn", _detector, "policy or Explode detector")
    vanish: Any = _option(None, _detector, "policy or Vanish detector")
    stale_grad: Any = _option("warn", _policy, "gradients that survive an optimizer step")
    empty_step: Any = _option("warn", _policy, "an optimizer step without the gradients backward made")
    double_step: Any = _option("warn", _policy, "one set of gradients applied by two optimizer steps")
    scaled_grad: Any = _option("warn", _policy, "gradients applied while still scaled by a GradScaler")
    orphan_param: Any = _option("warn", _policy, "parameters with gradients that no param group holds")
    no_update: Any = _option("warn", _policy, "parameters with gradients that the step leaves unchanged")
    foreign_update: Any = _option("warn", _policy, "parameters changed outside the watched optimizer's step")
    lr_schedule: Any = _option("warn", _policy, "a learning rate schedule stepped too often")
    hidden_param: Any = _option("warn", _policy, "tensors trained through the loss that are not parameters")
    eval_mode: Any = _option("warn", _policy, "training steps run in eval mode after training mode")
    loss_pattern: Any = _option("warn", _policy, "a harmful pattern on the path to the loss")
    dead_grad: Any = _option("warn", _policy, "gradients exactly zero step after step")
    unused_param: Any = _option("warn", _policy, "trainable parameters that never received a gradient")
    update_rule: Any = _option("warn", _policy, "the step audit: a parameter's change differs from the "
                               "optimizer's own rule")
    applied_grad: Any = _option("warn", _policy, "the step audit: the gradients handed to the step differ from "
                                "those backward left")
    module_setup: Any = _option("warn", _policy, "a module's construction that does not do what it says")
    optimizer_setup: Any = _option("warn", _policy, "an optimizer's hyperparameter that switches off its own "
                                   "mechanism (Adam's eps above the gradients)")
    activations: bool = _option(False, flag, "record gradients at leaf modules' outputs")
    histograms: Optional[int] = _option(None, _histograms, "histograms of |grad| every N recorded steps")
    scaler: Any = _option(None, _scaler, "the torch.amp.GradScaler in use")
    history: int = _option(10_000, count, "steps kept in the history")
    ddp_check_every: Any = _option(AUTO, _replica_every, "replica check cadence under distribution")
    update_every: Any = _option(UPDATE_EVERY, _update_every, "update/weight ratio cadence ('log', N or None)")
    copy_budget: float = _option(COPY_BUDGET, _fraction, "weights copied before a step, a fraction of their bytes")
    localise: bool = _option(True, flag, "replay a non-finite step to name its op and line")
    ddp_timeout: Any = _option(None, optional(duration), "timeout of the replica checks (None: 60 s)")
    log_to: Any = _option(None, check_log_to, "trackers fed on every recorded step (graddbg.trackers)")
    log_detail: str = _option("module", check_detail, "log_to's norms per top-level module or per parameter")

    ALIASES = {"localize": "localise"}

    @classmethod
    def translate(cls, where: str, kw: Dict[str, Any]) -> Dict[str, Any]:
        """The old spelling ``localize=`` is accepted for ``localise=``."""
        if "localize" in kw:
            if "localise" in kw:
                raise GraddbgTypeError(f"{where}(): pass localise= or its old spelling localize=, not both")
            kw["localise"] = kw.pop("localize")
        return kw

    def __post_init__(self) -> None:
        for f in fields(self):  # defaults go through the same checks (detectors from strings)
            if f.name in ("nonfinite", "explode", "vanish") and isinstance(getattr(self, f.name), str):
                object.__setattr__(self, f.name, as_detector(getattr(self, f.name), f.name))
        object.__setattr__(self, "quantities", validate_stats(self.stats))

    # derived, read by the checks -------------------------------------------------------
    quantities: Tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    @property
    def record_schedule(self) -> Schedule:
        """The steps whose statistics are recorded (``every=``)."""
        return Schedule(self.every)

    @property
    def histogram_schedule(self) -> Schedule:
        """The steps with histograms (``histograms=``; only recorded steps have them)."""
        return Schedule(self.histograms)

    @property
    def update_schedule(self) -> Schedule:
        """The steps whose update/weight ratio is measured (``update_every=``; only
        recorded steps have it): N, every N-th step; "log", the log cadence counted in
        recorded steps."""
        if self.update_every == "log":
            return UPDATE_RATIOS.within(self.record_schedule)
        return Schedule(self.update_every)

    @property
    def absmax_cpu_schedule(self) -> Schedule:
        """The recorded steps whose largest magnitudes are read on the CPU: every 10th
        recorded step with the default ``stats=``, every one when it is asked for by name."""
        return (CPU_ABSMAX if tuple(self.stats) == DEFAULT_STATS else Schedule(1)).within(self.record_schedule)

    def policy(self, kind: str) -> Any:
        """The policy of findings of ``kind`` (None: the check is off)."""
        value = getattr(self, kind)
        return value.policy if isinstance(value, (NonFinite, Explode, Vanish)) else value

    def replace(self, **changes: Any) -> "WatchOptions":
        return dataclasses.replace(self, **changes)


def options_in_signature(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Show the options as keyword-only parameters in ``fn``'s signature in place of its
    ``**options`` (`graddbg._args.Options.in_signature`)."""
    return WatchOptions.in_signature(fn)


assert set(HYGIENE_KINDS) <= {f.name for f in fields(WatchOptions)}
