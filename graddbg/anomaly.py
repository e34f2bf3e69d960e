"""Anomaly records, detectors and policies.

Knows nothing of hooks (nor of `graddbg.blame`, which localises producers):
`graddbg.hooks` feeds the detectors with the statistics it records, and
`apply_policy` carries out what the detector's policy says.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import warnings

from graddbg._errors import (CoverageWarning, GradientAnomalyError, GraddbgTypeError, GraddbgValueError,
                             GraddbgWarning, NonFiniteError, warn_at_user)

__all__ = [
    "Anomaly",
    "KINDS",
    "HYGIENE_KINDS",
    "Blame",
    "POLICIES",
    "NonFinite",
    "Explode",
    "Vanish",
    "anomalies_frame",
    "apply_policy",
    "nonfinite_anomaly",
    "GradientAnomalyError",
    "NonFiniteError",
    "AnomalyWarning",
]

#: the silent training mistakes (optimizer hygiene): each a kind of finding and an option of watch()
HYGIENE_KINDS = ("stale_grad", "empty_step", "double_step", "scaled_grad", "orphan_param", "no_update",
                 "foreign_update", "lr_schedule", "hidden_param", "eval_mode", "loss_pattern", "dead_grad",
                 "unused_param")
KINDS = ("nonfinite", "explode", "vanish", "ddp_mismatch") + HYGIENE_KINDS
POLICIES = ("raise", "warn", "skip", "record")


class AnomalyWarning(GraddbgWarning):
    """An anomaly under the ``"warn"`` policy."""


@dataclass(frozen=True)
class Anomaly:
    """One gradient anomaly: what was found, where, and the fix, as data.

    Attributes:
        step: the step it happened.
        kind: ``"nonfinite"``, ``"explode"``, ``"vanish"``, ``"ddp_mismatch"`` or a
            training-hygiene kind (``HYGIENE_KINDS``: ``"stale_grad"``, ``"empty_step"``,
            ``"orphan_param"``, ``"no_update"``, ``"dead_grad"``, ``"unused_param"``); a
            GradScaler's skipped step is never an anomaly (``w.steps.overflow``)
        name: the parameter (qualified name, as ``model.named_parameters()`` gives it).
        module: the module where the problem started.
        op: the autograd node (``SqrtBackward0``) or aten op (``aten.exp``) that made it,
            when known.
        value: what was measured (a norm, a count, NaN).
        threshold: what it was compared with, if anything.
        source: the ``file:line`` of the forward code that created the op, when known.
        message: one line for a person: what happened, where, and the likely fix.
        rank: the rank that found it, in a distributed run.
        params: other parameters involved (for an explosion, those that jumped most).
        reproduced: for a non-finite value localised by replaying the step: True when the
            replay made the same non-finite value again (a deterministic bug), False when it
            did not (suspect nondeterminism or hardware), None when no replay ran.

    Examples:
        >>> a = Anomaly(step=3, kind="nonfinite", name="fc.weight", module="fc", op=None,
        ...             value=float("nan"), threshold=None, source=None, message="NaN")
        >>> Anomaly.from_dict(a.to_dict()) == a or math.isnan(Anomaly.from_dict(a.to_dict()).value)
        True
    """

    step: int
    kind: str
    name: Optional[str]
    module: Optional[str]
    op: Optional[str]
    value: float
    threshold: Optional[float]
    source: Optional[str]
    message: str
    rank: Optional[int] = None
    params: tuple = ()  # other parameters involved (e.g. those that jumped most)
    #: for a non-finite value localised by replaying the step: True when the replay made
    #: the same non-finite value again (a deterministic bug), False when it did not
    #: (suspect nondeterminism or hardware), None when no replay ran
    reproduced: Optional[bool] = None

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["params"] = list(self.params)
        for k in ("value", "threshold"):
            v = d[k]
            if isinstance(v, float) and not math.isfinite(v):
                d[k] = repr(v)  # 'nan', 'inf', '-inf': JSON has no such numbers
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Anomaly":
        d = dict(d)
        for k in ("value", "threshold"):
            if isinstance(d.get(k), str):
                d[k] = float(d[k])
        d["params"] = tuple(d.get("params") or ())
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def __str__(self) -> str:
        if self.reproduced is None:
            return self.message
        verdict = ("reproduced by a replay of the step (a deterministic bug)" if self.reproduced else
                   "NOT reproduced by a replay of the step: suspect nondeterminism or faulty hardware")
        return f"{self.message} [{verdict}]"


def anomalies_frame(anomalies: Sequence[Anomaly]):
    """A DataFrame with one row per anomaly.

    Args:
        anomalies: `Anomaly` records (`Watch.anomalies`).

    Returns:
        pandas.DataFrame: one column per field of `Anomaly`, in field order.
    """
    import pandas as pd

    cols = [f.name for f in dataclasses.fields(Anomaly)]
    return pd.DataFrame([dataclasses.asdict(a) for a in anomalies], columns=cols)


PolicyArg = Union[str, Callable[[Anomaly], Any], None]


def check_policy(policy: Any, arg: str) -> Any:
    """Validate a policy: one of POLICIES, a callable, or None."""
    if policy is None or callable(policy) or policy in POLICIES:
        return policy
    raise GraddbgValueError(f"{arg}= got {policy!r}; accepted: "
                     f"{', '.join(repr(p) for p in POLICIES)}, a callable taking an Anomaly, or None")


@dataclass(frozen=True)
class NonFinite:
    """Flag NaN/Inf gradients.

    Checks every ``every`` steps; between checks the flags accumulate on the device (no host
    synchronisation), so the first bad step is still named when the check comes.

    Args:
        policy: ``"raise"``, ``"warn"``, ``"skip"``, ``"record"``, a callable receiving the
            `Anomaly`, or None.
        every: check every ``every``-th step (at least 1).

    Raises:
        GraddbgValueError: an unknown policy, or ``every`` below 1.
    """

    policy: PolicyArg = "raise"
    every: int = 1

    def __post_init__(self) -> None:
        check_policy(self.policy, "NonFinite(policy")
        _check_int(self.every, "NonFinite(every", 1)


@dataclass(frozen=True)
class Explode:
    """Flag a global gradient norm far above its running level.

    The level is robust: the median of the previous ``window`` healthy steps with
    gradients, used once ``warmup`` of them are known. A norm above ``factor`` times it is
    flagged when it stays there for ``persist`` recorded steps in a row, or at once when it
    is above ``factor**2`` times it (``factor**3`` times it while fewer than ``warmup``
    steps are known); a norm above ``absolute`` is flagged at once. One heavy
    batch of a heavy-tailed data set, and Adam's first steps, are not explosions; a
    sustained jump or a hundredfold spike is. A spike that the training loop clipped at
    that step (``clip_grad_norm_`` between backward and step) is left to the clip.
    Consecutive exploded steps are one episode and one anomaly; they do not enter the
    running level.

    Args:
        factor: flag a norm above ``factor`` times the running level (> 1; None: only
            ``absolute``).
        absolute: flag a norm above this value, whatever the history (None: only ``factor``).
        window: how many previous steps make the running level.
        policy: ``"raise"``, ``"warn"``, ``"skip"``, ``"record"``, a callable, or None.
        warmup: how many healthy steps the level needs before it is used (10).
        persist: recorded steps in a row above ``factor`` times the level before a finding (2).

    Raises:
        GraddbgValueError: ``factor`` not above 1, both ``factor`` and ``absolute`` None, a
            ``window``, ``warmup`` or ``persist`` below 1, or an unknown policy.
    """

    factor: Optional[float] = 10.0
    absolute: Optional[float] = None
    window: int = 50
    policy: PolicyArg = "warn"
    warmup: int = 10
    persist: int = 2

    def __post_init__(self) -> None:
        check_policy(self.policy, "Explode(policy")
        _check_int(self.window, "Explode(window", 1)
        _check_int(self.warmup, "Explode(warmup", 1)
        _check_int(self.persist, "Explode(persist", 1)
        if self.factor is not None and not (self.factor > 1):
            raise GraddbgValueError(f"Explode(factor=) must be > 1 or None, got {self.factor!r}")
        if self.factor is None and self.absolute is None:
            raise GraddbgValueError("Explode needs factor= or absolute= (both are None)")

    def new_state(self) -> "_ExplodeState":
        return _ExplodeState(self)


@dataclass(frozen=True)
class Vanish:
    """Flag a parameter whose gradient norm stays below ``below`` for ``patience`` recorded steps in a row.

    Reported once per parameter, until it recovers.

    Args:
        below: the norm under which a gradient counts as vanishing (> 0).
        patience: how many recorded steps in a row.
        policy: ``"raise"``, ``"warn"``, ``"skip"``, ``"record"``, a callable, or None.

    Raises:
        GraddbgValueError: ``below`` not above 0, ``patience`` below 1, or an unknown policy.
    """

    below: float = 1e-8
    patience: int = 20
    policy: PolicyArg = "warn"

    def __post_init__(self) -> None:
        check_policy(self.policy, "Vanish(policy")
        _check_int(self.patience, "Vanish(patience", 1)
        if not self.below > 0:
            raise GraddbgValueError(f"Vanish(below=) must be > 0, got {self.below!r}")

    def new_state(self, n_params: int) -> "_VanishState":
        return _VanishState(self, n_params)


def _check_int(value: Any, arg: str, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise GraddbgValueError(f"{arg}=) must be an int >= {minimum}, got {value!r}")


def as_detector(value: Any, kind: str) -> Any:
    """Turn a watch() argument (string policy, callable, detector or None) into a detector."""
    cls = {"nonfinite": NonFinite, "explode": Explode, "vanish": Vanish}[kind]
    if value is None:
        return None
    if isinstance(value, cls):
        return value
    if isinstance(value, (NonFinite, Explode, Vanish)):
        raise GraddbgTypeError(f"{kind}= got a {type(value).__name__} detector; expected a {cls.__name__}")
    check_policy(value, kind)
    return cls(policy=value)


class _ExplodeState:
    def __init__(self, det: Explode) -> None:
        self.det = det
        self.level: List[float] = []  # the window's global norms, oldest first
        self._sorted: List[float] = []  # the same, sorted (finite values only)
        self.prev_norms: Any = None
        self.in_episode = False
        self.above = 0  # recorded steps in a row above the relative threshold

    def _threshold(self) -> Tuple[float, float]:
        """(relative threshold, hard threshold): factor x and factor**2 x the median."""
        det = self.det
        if det.factor is None or not self.level:
            return math.inf, math.inf
        srt = self._sorted  # (kept sorted: no sort per step)
        half = len(srt) // 2
        med = srt[half] if len(srt) % 2 else (srt[half - 1] + srt[half]) / 2
        if len(self.level) < det.warmup:  # too little history: only a thousandfold jump
            return math.inf, det.factor ** 3 * med
        return det.factor * med, det.factor ** 2 * med

    def check(self, step: int, global_norm: float, norms: Any, names: Sequence[str],
              modules: Sequence[str], clipped: bool = False) -> Optional[Anomaly]:
        import numpy as np

        det = self.det
        prev = self.prev_norms
        self.prev_norms = norms
        if not math.isfinite(global_norm) or global_norm == 0:
            return None  # the non-finite detector's business; a step without gradients
        rel, hard = self._threshold()
        self.above = self.above + 1 if global_norm > rel else 0
        threshold = min(rel, det.absolute if det.absolute is not None else math.inf)
        exploded = (det.absolute is not None and global_norm > det.absolute) or \
            (not clipped and (global_norm > hard or self.above >= det.persist))
        if exploded or (global_norm > rel and clipped) or self.above:
            if not exploded or self.in_episode:  # one anomaly per episode of consecutive exploded steps
                return None
            self.in_episode = True
            # which parameters jumped most, relative to their previous recorded norm
            jumped: List[str] = []
            if prev is not None and norms is not None:
                with np.errstate(divide="ignore", invalid="ignore"):
                    ratio = np.where(prev > 0, norms / prev, np.inf)
                ratio = np.nan_to_num(ratio, nan=-1.0)
                order = np.argsort(-ratio)[:5]
                jumped = [names[i] for i in order if ratio[i] > 1]
            elif norms is not None:
                jumped = [names[i] for i in np.argsort(-np.nan_to_num(norms, nan=-1.0))[:5]]
            top = jumped[0] if jumped else None
            msg = (f"graddbg: gradient explosion at step {step}: global gradient norm "
                   f"{global_norm:.4g} > threshold {threshold:.4g}"
                   + (f" ({det.factor:g}x the median of the last {len(self.level)} steps)"
                      if det.factor is not None and len(self.level) >= det.warmup and threshold < (det.absolute or math.inf)
                      and global_norm <= (det.absolute or math.inf) else
                      " (absolute bound)")
                   + (f"; parameters that jumped most: {', '.join(jumped)}" if jumped else "")
                   + ". Try a lower learning rate, warm-up, or gradient clipping.")
            return Anomaly(step=step, kind="explode", name=top,
                           module=modules[names.index(top)] if top else None, op=None,
                           value=float(global_norm), threshold=float(threshold), source=None,
                           message=msg, params=tuple(jumped))
        self.in_episode = False
        self.above = 0
        self.level.append(global_norm)
        bisect.insort(self._sorted, global_norm)
        if len(self.level) > det.window:
            del self._sorted[bisect.bisect_left(self._sorted, self.level[0])]
            del self.level[0]
        return None


class _VanishState:
    def __init__(self, det: Vanish, n: int) -> None:
        import numpy as np

        self.det = det
        self.run = np.zeros(n, dtype=np.int64)
        self.flagged = np.zeros(n, dtype=bool)

    def widen(self, k: int) -> None:
        import numpy as np

        self.run = np.concatenate([self.run, np.zeros(k, dtype=np.int64)])
        self.flagged = np.concatenate([self.flagged, np.zeros(k, dtype=bool)])

    def check(self, step: int, norms: Any, has_grad: Any, names: Sequence[str],
              modules: Sequence[str]) -> Optional[Anomaly]:
        import numpy as np

        low = has_grad & np.isfinite(norms) & (norms < self.det.below)
        self.run = np.where(low, self.run + 1, 0)
        self.flagged &= low  # recovered parameters may be flagged again later
        new = (self.run >= self.det.patience) & ~self.flagged
        if not new.any():
            return None
        self.flagged |= new
        idx = np.nonzero(new)[0]  # forward order: the first are the earliest layers
        first = int(idx[0])
        shown = ", ".join(names[i] for i in idx[:8]) + (f" and {len(idx) - 8} more" if len(idx) > 8 else "")
        msg = (f"graddbg: vanishing gradients at step {step}: {len(idx)} parameter(s) have had a "
               f"gradient norm below {self.det.below:g} for {self.det.patience} recorded steps: {shown}. "
               f"The earliest is {names[first]} (module {modules[first] or '<root>'}), "
               f"norm {float(norms[first]):.3g}. Check saturating activations, initialisation, "
               f"normalisation or residual connections.")
        return Anomaly(step=step, kind="vanish", name=names[first], module=modules[first], op=None,
                       value=float(norms[first]), threshold=float(self.det.below), source=None,
                       message=msg, params=tuple(names[i] for i in idx))



def apply_policy(anomaly: Anomaly, policy: Any, skip: Callable[[], None]) -> Optional[BaseException]:
    """Carry out ``policy`` for ``anomaly``.

    Args:
        anomaly: the finding.
        policy: ``"raise"``, ``"warn"``, ``"skip"``, ``"record"``, a callable, or None.
        skip: called for ``"skip"``: the caller drops the affected gradients.

    Returns:
        BaseException | None: the error for the caller to raise (``"raise"``), else None
            (a warning was issued, ``skip()`` or the user's callable was called, or nothing
            was to be done).
    """
    if policy is None or policy == "record":
        return None
    if policy == "raise":
        cls = NonFiniteError if anomaly.kind == "nonfinite" else GradientAnomalyError
        return cls(str(anomaly), anomaly)
    if policy == "warn":
        warn_at_user(str(anomaly), CoverageWarning if anomaly.kind == "unused_param" else AnomalyWarning)
    elif policy == "skip":
        skip()
    elif callable(policy):
        policy(anomaly)
    return None


@dataclass
class Blame:
    """Where a non-finite value started, as the watch found it: the ``module`` (and the
    parameter ``name`` of it among the affected), the autograd ``op`` and the forward
    ``source`` line where known, ``how`` it was found, whether a replay ``reproduced`` it,
    and the ``ranks`` whose shards were non-finite."""

    module: Optional[str] = None
    name: Optional[str] = None
    how: str = "parameter gradients"
    op: Optional[str] = None
    source: Optional[str] = None
    reproduced: Optional[bool] = None
    ranks: Sequence[int] = ()
    #: where it started among the ranks, from each rank's evidence before the gradients were
    #: reduced (DeepSpeed ZeRO): (ranks, the evidence); no ranks when the evidence names none
    origin: Optional[Tuple[Sequence[int], str]] = None


def _origin_text(origin: Optional[Tuple[Sequence[int], str]]) -> str:
    if origin is None:
        return ""
    ranks, how = origin
    if not ranks:
        return f"The rank where it started is unknown ({how}). "
    return f"It was first seen on rank(s) {', '.join(map(str, ranks))} ({how}). "


def nonfinite_anomaly(step: int, names: Sequence[str], shapes: Sequence[tuple], total: Optional[int],
                      where: Blame, rank: Optional[int] = None) -> Anomaly:
    """The anomaly of non-finite gradients in parameters ``names``, blamed on ``where``.

    Args:
        step: the step.
        names: the parameters with non-finite gradients, nearest the input first.
        shapes: their shapes.
        total: the number of non-finite entries, when counted.
        where: what localisation found: ``module``, ``op``, ``source``, ``how`` it was found,
            ``name`` (the parameter blamed) and ``reproduced``.
        rank: the rank, in a distributed run.

    Returns:
        Anomaly: of kind ``"nonfinite"``, with its message.
    """
    module, op, source = where.module, where.op, where.source
    shown = ", ".join(f"{n} {tuple(s)}" for n, s in zip(names[:6], shapes[:6]))
    more = f" and {len(names) - 6} more" if len(names) > 6 else ""
    msg = (f"graddbg: non-finite gradient at step {step}"
           + (f" on rank {rank}" if rank is not None else "") + ": "
           + (f"{total} NaN/Inf entries in " if total else "")
           + f"{len(names)} parameter(s): {shown}{more}. "
           + (f"The non-finite shards were on rank(s) {', '.join(map(str, where.ranks))}. "
              if where.ranks else "")
           + _origin_text(where.origin)
           + f"It started in module '{module or '<root>'}'"
           + (f", op {op}" if op else "") + (f", created at {source}" if source else "")
           + f" (found from {where.how}). "
           + "Next: wrap one step in graddbg.find_nonfinite(model) to see every op's inputs, "
             "or check the loss for log(0), sqrt(0), division by zero or overflow.")
    return Anomaly(step=step, kind="nonfinite", name=where.name, module=module, op=op,
                   value=float("nan"), threshold=None, source=source, message=msg, rank=rank,
                   params=tuple(names), reproduced=where.reproduced)
