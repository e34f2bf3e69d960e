"""Anomaly records, detectors and policies.

Knows nothing of hooks (nor of `graddbg.blame`, which localises producers):
`graddbg.hooks` feeds the detectors with the statistics it records, and
`apply_policy` carries out what the detector's policy says.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple, Union, get_args

from graddbg._args import Schedule, bad_type, bad_value, count
from graddbg._errors import (CoverageWarning, GradientAnomalyError, GraddbgTypeError, GraddbgValueError,
                             GraddbgWarning, NonFiniteError, warn_at_user)

__all__ = [
    "Anomaly",
    "AnomalyKind",
    "AnomalyList",
    "MAX_KEPT_PER_KIND",
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

#: the kinds of finding of the detectors and of the replica check
DetectorKind = Literal["nonfinite", "explode", "vanish", "ddp_mismatch"]
#: the silent training mistakes (optimizer hygiene): each a kind of finding and an option of watch()
HygieneKind = Literal["stale_grad", "empty_step", "double_step", "scaled_grad", "orphan_param", "no_update",
                      "foreign_update", "lr_schedule", "hidden_param", "eval_mode", "loss_pattern", "dead_grad",
                      "unused_param", "update_rule", "applied_grad", "module_setup", "optimizer_setup"]
#: every kind of `Anomaly` (its ``kind`` field)
AnomalyKind = Literal[DetectorKind, HygieneKind]
HYGIENE_KINDS: Tuple[str, ...] = get_args(HygieneKind)
KINDS: Tuple[str, ...] = get_args(DetectorKind) + HYGIENE_KINDS
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
        severity: ``"bug"`` (the default), or ``"fact"``: something true of the run that is
            not a bug by itself, named once at a lower severity (parameters a library or the
            program leaves unused by design: a target network trained by copying, BERT's
            pooler under mean pooling). A fact is never raised: under ``"raise"`` it warns.

    Examples:
        >>> a = Anomaly(step=3, kind="nonfinite", name="fc.weight", module="fc", op=None,
        ...             value=float("nan"), threshold=None, source=None, message="NaN")
        >>> Anomaly.from_dict(a.to_dict()) == a or math.isnan(Anomaly.from_dict(a.to_dict()).value)
        True
    """

    step: int
    kind: AnomalyKind
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
    severity: str = "bug"

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


#: how many findings of each kind `AnomalyList` (``Watch.anomalies``) keeps: the first ones;
#: later findings of that kind are counted by kind and parameter, not kept (a NaN every
#: step of a long run would otherwise hold one record per step). Per kind, so that a flood
#: of one kind never hides the first finding of another.
MAX_KEPT_PER_KIND = 1000


class AnomalyList(list):
    """``Watch.anomalies``: a list of `Anomaly` that keeps the first ``limit`` findings of
    each kind (`MAX_KEPT_PER_KIND`) and counts the later ones in `not_kept`, by kind and
    parameter, so that its size is bounded however often anomalies happen.

    Examples:
        >>> found = AnomalyList(limit=2)
        >>> for step in range(5):
        ...     found.append(Anomaly(step=step, kind="nonfinite", name="fc.weight", module="fc",
        ...                          op=None, value=math.nan, threshold=None, source=None, message="NaN"))
        >>> [a.step for a in found], found.not_kept
        ([0, 1], {('nonfinite', 'fc.weight'): 3})
        >>> found.not_kept_text()
        ['3 more nonfinite findings on fc.weight not kept']
    """

    def __init__(self, items: Sequence[Anomaly] = (), limit: Optional[int] = None) -> None:
        super().__init__()
        self.limit = MAX_KEPT_PER_KIND if limit is None else limit
        #: the findings not kept: (kind, parameter name or None) -> how many
        self.not_kept: Dict[Tuple[str, Optional[str]], int] = {}
        self._kept: Dict[str, int] = {}
        self._told: set = set()  # kinds past the limit whose "warn" policy has warned once
        for a in items:
            self.append(a)

    def append(self, anomaly: Anomaly) -> None:  # type: ignore[override]
        """Keep ``anomaly`` if fewer than ``limit`` of its kind are kept, else count it."""
        self.add(anomaly)

    def add(self, anomaly: Anomaly) -> bool:
        """`append`, and whether ``anomaly`` was kept (False: only counted in `not_kept`)."""
        n = self._kept.get(anomaly.kind, 0)
        if n < self.limit:
            self._kept[anomaly.kind] = n + 1
            super().append(anomaly)
            return True
        key = (anomaly.kind, anomaly.name)
        self.not_kept[key] = self.not_kept.get(key, 0) + 1
        return False

    def policy_past_limit(self, anomaly: Anomaly, policy: Any) -> Any:
        """The policy of a finding that was not kept: ``"warn"`` warns once per kind, saying
        that later findings are only counted, then records; other policies are unchanged
        (``"skip"`` still skips, ``"raise"`` still raises)."""
        if policy != "warn":
            return policy
        if anomaly.kind not in self._told:
            self._told.add(anomaly.kind)
            warn_at_user(f"{anomaly} [graddbg keeps the first {self.limit:,} {anomaly.kind} findings; later "
                         f"ones are counted in w.anomalies.not_kept, without a warning each]",
                         CoverageWarning if anomaly.kind == "unused_param" else AnomalyWarning)
        return "record"

    def extend(self, anomalies: Any) -> None:  # type: ignore[override]
        for a in anomalies:
            self.add(a)

    def __iadd__(self, anomalies: Any) -> "AnomalyList":  # type: ignore[override]
        self.extend(anomalies)
        return self

    def __reduce__(self) -> Any:  # (copied and pickled with its counts, each finding once)
        return _anomaly_list, (list(self), self.limit, dict(self.not_kept))

    def not_kept_records(self) -> List[Dict[str, Any]]:
        """`not_kept` as JSON-able records ``{"kind", "name", "count"}``, most first (a run's
        ``meta["anomalies_not_kept"]``)."""
        return [{"kind": k, "name": n, "count": c} for (k, n), c in
                sorted(self.not_kept.items(), key=lambda kv: (-kv[1], kv[0][0], str(kv[0][1])))]

    def not_kept_text(self) -> List[str]:
        """One line per (kind, parameter) of `not_kept`, most first."""
        return not_kept_text(self.not_kept_records())


def _anomaly_list(items: Sequence[Anomaly], limit: int, not_kept: Dict[Tuple[str, Optional[str]], int]) -> AnomalyList:
    out = AnomalyList(items, limit)
    out.not_kept = dict(not_kept)
    return out


def not_kept_text(records: Sequence[Dict[str, Any]]) -> List[str]:
    """The lines of `AnomalyList.not_kept_records` (or of a loaded run's
    ``meta["anomalies_not_kept"]``): "12,345 more nonfinite findings on fc.weight not kept"."""
    out = []
    for r in records:
        if not isinstance(r, dict):
            continue
        c, kind, name = r.get("count"), r.get("kind"), r.get("name")
        n = int(c) if isinstance(c, (int, float)) and not isinstance(c, bool) else 0
        out.append(f"{n:,} more {kind} finding{'' if n == 1 else 's'}"
                   + (f" on {name}" if name else "") + " not kept")
    return out


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


def check_policy(policy: Any, name: str, where: str = "watch") -> Any:
    """Validate a policy: one of POLICIES, a callable, or None (the option ``name`` of the
    call ``where``, both named in the error)."""
    if policy is None or callable(policy) or policy in POLICIES:
        return policy
    raise bad_value(where, name, policy, f"{', '.join(repr(p) for p in POLICIES)}, a callable "
                    f"taking an Anomaly, or None")


def _number(where: str, name: str, value: Any, above: float) -> float:
    """A real number (not a bool) above ``above``."""
    accepted = f"a number > {above:g}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise bad_type(where, name, value, accepted)
    if not value > above:
        raise bad_value(where, name, value, accepted)
    return value


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
        GraddbgTypeError: ``every`` not an int.
    """

    policy: PolicyArg = "raise"
    every: int = 1

    def __post_init__(self) -> None:
        check_policy(self.policy, "policy", "NonFinite")
        count("NonFinite", "every", self.every)

    @property
    def schedule(self) -> "Schedule":
        """The steps on which the flags are read (``every``)."""
        return Schedule(self.every)


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
    running level. An explosion that follows a one-step rise of a param group's learning
    rate to a level the group never had is blamed on that rise (one anomaly naming it, with
    no parameter; its aftermath gives no other), and one that follows a rise back to a level
    the group had before (a warm restart: the program's own schedule) gives none. In the
    same way, one that follows weights written between steps (a target or teacher network
    swapped, a checkpoint loaded: a version counter moved outside the optimizer's step)
    names that write, unless the module is written on a regular schedule (a target
    network's hard update every N steps), and one that follows newly unfrozen layers names
    them. A jump right after the model ran without grad between two steps (an evaluation, an
    RL rollout) starts a new level from that step (the gradients are of new data).

    Args:
        factor: flag a norm above ``factor`` times the running level (> 1; None: only
            ``absolute``).
        absolute: flag a norm above this value, whatever the history (None: only ``factor``).
        window: how many previous steps make the running level.
        policy: ``"raise"``, ``"warn"``, ``"skip"``, ``"record"``, a callable, or None.
        warmup: how many healthy steps the level needs before it is used (10).
        persist: recorded steps in a row above ``factor`` times the level before a finding (2).

    Raises:
        GraddbgValueError: ``factor`` not above 1, ``absolute`` not above 0, both
            ``factor`` and ``absolute`` None, a ``window``, ``warmup`` or ``persist`` below
            1, or an unknown policy.
        GraddbgTypeError: ``factor`` or ``absolute`` not a number, or ``window``,
            ``warmup`` or ``persist`` not an int.
    """

    factor: Optional[float] = 10.0
    absolute: Optional[float] = None
    window: int = 50
    policy: PolicyArg = "warn"
    warmup: int = 10
    persist: int = 2

    def __post_init__(self) -> None:
        check_policy(self.policy, "policy", "Explode")
        for name in ("window", "warmup", "persist"):
            count("Explode", name, getattr(self, name))
        if self.factor is not None:
            _number("Explode", "factor", self.factor, 1)
        if self.absolute is not None:
            _number("Explode", "absolute", self.absolute, 0)
        if self.factor is None and self.absolute is None:
            raise GraddbgValueError("Explode(factor=None, absolute=None): nothing to compare with; "
                                    "accepted: factor= (a number > 1), absolute= (a number > 0) or both")


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
        GraddbgTypeError: ``below`` not a number, or ``patience`` not an int.
    """

    below: float = 1e-8
    patience: int = 20
    policy: PolicyArg = "warn"

    def __post_init__(self) -> None:
        check_policy(self.policy, "policy", "Vanish")
        count("Vanish", "patience", self.patience)
        _number("Vanish", "below", self.below, 0)


def as_detector(value: Any, kind: str, where: str = "watch") -> Any:
    """Turn a watch() argument (string policy, callable, detector or None) into a detector."""
    cls = {"nonfinite": NonFinite, "explode": Explode, "vanish": Vanish}[kind]
    if value is None:
        return None
    if isinstance(value, cls):
        return value
    if isinstance(value, (NonFinite, Explode, Vanish)):
        raise GraddbgTypeError(f"{where}({kind}=...): got a {type(value).__name__} detector; "
                               f"accepted: a {cls.__name__}, a policy or None")
    check_policy(value, kind, where)
    return cls(policy=value)


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
    if anomaly.severity == "fact" and policy in ("raise", "skip"):
        policy = "warn"  # (a fact never stops the job)
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


def _elsewhere(origin: Optional[Tuple[Sequence[int], str]], rank: Optional[int]) -> bool:
    """Whether ``origin`` puts the start of a non-finite value on other ranks only."""
    return origin is not None and bool(origin[0]) and rank is not None and rank not in origin[0]


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
           + (f"It started in module '{module or '<root>'}'" if not _elsewhere(where.origin, rank) else
              f"On this rank it reached module '{module or '<root>'}' first")
           + (f", op {op}" if op else "") + (f", created at {source}" if source else "")
           + f" (found from {where.how}). "
           + (f"'{module}' holds none of these parameters: {where.name} is the one nearest it. "
              if where.name and module and not where.name.startswith(f"{module}.") else "")
           + "Next: wrap one step in graddbg.find_nonfinite(model) to see every op's inputs, "
             "or check the loss for log(0), sqrt(0), division by zero or overflow.")
    return Anomaly(step=step, kind="nonfinite", name=where.name, module=module, op=op,
                   value=float("nan"), threshold=None, source=source, message=msg, rank=rank,
                   params=tuple(names), reproduced=where.reproduced)
