"""Argument validation shared by every options object (`graddbg.options.WatchOptions`,
gradcheck's options, the cross-rank checks' arguments), the ``"auto"`` sentinel and
`Schedule`, the one type of a cadence.

Every validator takes ``(where, name, value)``: ``where`` is the public call
(``"watch"``, ``"gradcheck"``, ``"check_gradients"``), ``name`` the option. A bad value
raises one message, naming the option, what was given and what is accepted::

    watch(every=...): got 0; accepted: an int >= 1

(`GraddbgTypeError` for a value of the wrong type, `GraddbgValueError` for one out of
range), and a good value comes back normalised (an ``int``, a ``float``, a ``timedelta``).

Examples:
    >>> count("watch", "every", 3)
    3
    >>> Schedule(3).includes(6), Schedule(3).includes(7)
    (True, False)
    >>> duration("watch", "ddp_timeout", 2.5)
    datetime.timedelta(seconds=2, microseconds=500000)
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import numbers
from datetime import timedelta
from typing import Any, Callable, ClassVar, Dict, Mapping, Optional, Sequence, Tuple, TypeVar

from graddbg._errors import GraddbgTypeError, GraddbgValueError

__all__ = ["AUTO", "LOG_EVERY", "Options", "Schedule", "bad_type", "bad_value", "choice", "count", "did_you_mean",
           "duration", "flag", "integer", "option", "optional", "tolerance"]

#: the sentinel of options whose default depends on the run (``ddp_check_every="auto"``,
#: ``set_fingerprint_kernel("auto")``)
AUTO = "auto"


def _message(where: str, name: str, shown: str, accepted: str) -> str:
    return f"{where}({name}=...): got {shown}; accepted: {accepted}"


def bad_type(where: str, name: str, value: Any, accepted: str) -> GraddbgTypeError:
    """The error for ``value`` of a type ``name`` does not take (its type is named)."""
    return GraddbgTypeError(_message(where, name, f"{value!r} ({type(value).__name__})", accepted))


def bad_value(where: str, name: str, value: Any, accepted: str) -> GraddbgValueError:
    """The error for ``value`` of the right type but out of what ``name`` takes."""
    return GraddbgValueError(_message(where, name, repr(value), accepted))


def integer(where: str, name: str, value: Any, minimum: Optional[int] = None) -> int:
    """An int (not a bool), at least ``minimum`` when given."""
    accepted = "an int" + ("" if minimum is None else f" >= {minimum}")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise bad_type(where, name, value, accepted)
    if minimum is not None and value < minimum:
        raise bad_value(where, name, value, accepted)
    return int(value)


def count(where: str, name: str, value: Any) -> int:
    """An int >= 1 (a number of steps, of rows, of entries)."""
    return integer(where, name, value, minimum=1)


def flag(where: str, name: str, value: Any) -> bool:
    """True or False (1 and 0 are taken as such)."""
    if not isinstance(value, (bool, int)) or value not in (0, 1):
        raise bad_type(where, name, value, "True or False")
    return bool(value)


def choice(where: str, name: str, value: Any, choices: Sequence[str]) -> str:
    """One of the strings ``choices``."""
    accepted = ", ".join(map(repr, choices))
    if not isinstance(value, str):
        raise bad_type(where, name, value, accepted)
    if value not in choices:
        raise bad_value(where, name, value, accepted)
    return value


def tolerance(where: str, name: str, value: Any, positive: bool = False, default: str = "") -> float:
    """A finite real number >= 0 (> 0 with ``positive``), as a float; ``default``: what
    None means, where None is taken (said in the error)."""
    accepted = f"a finite number {'> 0' if positive else '>= 0'}"
    if default:
        accepted += f" (or None for the default: {default})"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise bad_type(where, name, value, accepted)
    try:
        number = float(value)
    except OverflowError:           # an int too large for a float
        number = math.inf
    if not (math.isfinite(number) and (number > 0 if positive else number >= 0)):
        raise bad_value(where, name, value, accepted)
    return number


def duration(where: str, name: str, value: Any) -> timedelta:
    """A positive, finite duration: a ``datetime.timedelta`` or a number of seconds."""
    if isinstance(value, bool) or not isinstance(value, (timedelta, numbers.Real)):
        raise bad_type(where, name, value, "a datetime.timedelta or a number of seconds > 0")
    try:
        seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
        if seconds > 0 and math.isfinite(seconds):
            return value if isinstance(value, timedelta) else timedelta(seconds=seconds)
    except OverflowError:
        pass
    shown = str(value) if isinstance(value, timedelta) else repr(value)
    raise GraddbgValueError(_message(where, name, shown, "a positive duration (a datetime.timedelta "
                                     "or a finite number of seconds > 0)"))


def did_you_mean(given: str, accepted: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` naming the accepted spelling closest to ``given``, or ""
    where none is close: the one hint of every unknown keyword, option and subcommand.

    Examples:
        >>> did_you_mean("evry", ["every", "stats"]), did_you_mean("zzz", ["every"])
        (" (did you mean 'every'?)", '')
    """
    close = difflib.get_close_matches(given, list(accepted), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def optional(check: Callable[..., Any]) -> Callable[..., Any]:
    """``check`` that also lets None through (the option is off, or left to its default)."""
    def check_or_none(where: str, name: str, value: Any, *args: Any, **kw: Any) -> Any:
        return None if value is None else check(where, name, value, *args, **kw)
    check_or_none.__name__ = f"optional_{getattr(check, '__name__', 'check')}"
    return check_or_none


#: the period of the log cadence (`Schedule.log`): after its early steps, every 200th
LOG_EVERY = 200


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A cadence: every ``every``-th step of a count that starts at 0, the first included
    (``includes(0)`` is True), and the steps in ``first`` too, unless it is off (``every``
    None: no step). `Schedule.log` is the log cadence (0, 1, 2, 5, 10, 20, 50, 100, 200,
    then every 200), so a short run has early measurements and a long one costs no more.

    What is counted is the caller's: the watch's step index for ``every=`` and
    ``NonFinite(every=)``, recorded steps for ``histograms=`` and the CPU's absmax reads.
    A schedule says when a step is on the cadence; whether a check runs (reads the
    statistics back) at a step is the check's own decision (``Check.due``).

    Examples:
        >>> [i for i in range(500) if Schedule.log().includes(i)]
        [0, 1, 2, 5, 10, 20, 50, 100, 200, 400]
    """

    every: Optional[int] = 1
    first: Tuple[int, ...] = ()  # steps on the cadence besides every every-th (the log cadence's early steps)
    tens: bool = False  # the powers of ten (10, 100, 1000, ...) besides ``first`` (`Schedule.decades`)

    @classmethod
    def log(cls, every: int = LOG_EVERY) -> "Schedule":
        """The log cadence: steps 1, 2, 5, 10, 20, 50, ... below ``every``, then every
        ``every``-th (0 included)."""
        first = tuple(m * 10 ** e for e in range(len(str(every))) for m in (1, 2, 5) if m * 10 ** e < every)
        return cls(every, first)

    @classmethod
    def decades(cls, first: int = 3) -> "Schedule":
        """The first ``first`` steps, then 10, 100, 1000, ...: a cadence whose cost over a
        run grows with the log of its length."""
        return cls(None, tuple(range(first)), tens=True)

    def includes(self, index: int) -> bool:
        """Whether step ``index`` (0-based) is on the cadence."""
        if self.tens:
            if index in self.first:
                return True
            if index < 10:
                return False
            while index % 10 == 0:
                index //= 10
            return index == 1
        return self.every is not None and (index % self.every == 0 or index in self.first)

    @property
    def on(self) -> bool:
        """Whether any step is on it."""
        return self.every is not None or self.tens

    def within(self, outer: "Schedule") -> "Schedule":
        """This cadence counted in the steps of ``outer`` (the steps that ``outer``
        includes, counted 0, 1, 2, ...), as a schedule of the steps themselves. ``outer``
        is a plain cadence (no ``first``); this one is not `decades`."""
        if self.tens:
            raise ValueError("Schedule.within: a decades cadence cannot be counted within another")
        if self.every is None or outer.every is None:
            return Schedule(None)
        return Schedule(self.every * outer.every, tuple(f * outer.every for f in self.first))


# --------------------------------------------------------------------------- the default cadences
# Every cadence graddbg sets by itself, in one place. Each counts what its user counts.
#: update/weight ratios (``update_every="log"``), in recorded steps
UPDATE_RATIOS = Schedule.log()
#: the largest gradient magnitudes read on the CPU with the default ``stats=``, in recorded
#: steps (a CPU reduction costs about as much as the norm's)
CPU_ABSMAX = Schedule(10)
#: the full replica fingerprint under distribution (``ddp_check_every="auto"``), in steps
REPLICA_CHECK = Schedule(100)
#: the weights' norms compared on the device around a fused optimizer's step (whose kernels
#: move no version counter): the first 5 steps, then every 10th
FUSED_WEIGHTS = Schedule(10, (1, 2, 3, 4))
#: the backward passes whose loss graph is read (0, 1, 2, then 10, 100, 1000, ...)
LOSS_GRAPH = Schedule.decades(3)
#: the optimizer steps the step audit checks against the optimizer's rule (0, 1, 2, then 10,
#: 100, 1000, ...; also the step after one with a finding), in steps
STEP_AUDIT = Schedule.decades(3)


# --------------------------------------------------------------------------- options
_O = TypeVar("_O", bound="Options")


def option(default: Any, check: Callable[[str, str, Any], Any], doc: str = "") -> Any:
    """A field of an `Options` class: its default (the public signature's), the validator
    a value given for it goes through, and a line saying what it is."""
    return dataclasses.field(default=default, metadata={"check": check, "doc": doc})


class Options:
    """The base of every options object (``watch()``'s `graddbg.options.WatchOptions`,
    gradcheck's, the cross-rank checks'): a frozen dataclass whose fields are declared
    once with `option`, parsed from a call's keywords by `parse` (each value validated,
    an unknown keyword named with the closest accepted one) and shown in the public
    functions' signatures by `in_signature`.

    A subclass may set ``ALIASES`` (another spelling -> the option; `translate` turns
    them into the option's words) and override `validate` for rules across options.

    Examples:
        >>> @dataclasses.dataclass(frozen=True)
        ... class Demo(Options):
        ...     every: int = option(1, count)
        >>> Demo.parse("demo", {"every": 3}).every
        3
        >>> Demo.parse("demo", {"evry": 3})
        Traceback (most recent call last):
        ...
        graddbg._errors.GraddbgTypeError: demo(): unknown keyword(s) ['evry'] (did you mean 'every'?); accepted: ['every']
    """

    #: other spellings accepted for an option (``{"fast_mode": "mode"}``), read by `translate`
    ALIASES: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def declared(cls) -> Tuple[dataclasses.Field, ...]:
        """The options (the fields declared with `option`), in declaration order; other
        fields are the call's context, given to `parse` as they are."""
        return tuple(f for f in dataclasses.fields(cls) if f.init and "check" in f.metadata)  # type: ignore[arg-type]

    @classmethod
    def translate(cls, where: str, kw: Dict[str, Any]) -> Dict[str, Any]:
        """``kw`` with the `ALIASES` spelled as the options they stand for (a subclass
        converts their values)."""
        return kw

    @classmethod
    def parse(cls: "type[_O]", where: str, kw: Mapping[str, Any], extra: Sequence[str] = (), **context: Any) -> _O:
        """The options of a call to ``where`` from its keywords ``kw``, each validated;
        ``extra``: the call's own other keywords, listed in the error for an unknown one;
        ``context``: the fields that are not options (taken as given)."""
        checks = {f.name: f.metadata["check"] for f in cls.declared()}
        kw = cls.translate(where, dict(kw))
        unknown = sorted(set(kw) - set(checks))
        if unknown:
            accepted = sorted([*checks, *cls.ALIASES, *extra])
            raise GraddbgTypeError(f"{where}(): unknown keyword(s) {unknown}" + did_you_mean(unknown[0], accepted)
                                   + f"; accepted: {accepted}")
        opts = cls(**context, **{name: checks[name](where, name, value) for name, value in kw.items()})
        opts.validate(where)
        return opts

    def validate(self, where: str) -> None:
        """Rules across options, checked after each was validated (none by default)."""

    @classmethod
    def in_signature(cls, fn: Callable[..., Any], skip: Sequence[str] = (),
                     extra: Sequence[inspect.Parameter] = ()) -> Callable[..., Any]:
        """Show the options (but ``skip``), then ``extra``, as keyword-only parameters in
        ``fn``'s signature (``help()``, ``inspect.signature``, IDEs, notebooks) in place of
        its ``**options``."""
        sig = inspect.signature(fn)
        own = [p for p in sig.parameters.values() if p.kind != p.VAR_KEYWORD]
        taken = {p.name for p in own} | set(skip)
        opts = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
                for f in cls.declared() if f.name not in taken]
        fn.__signature__ = sig.replace(parameters=own + opts + list(extra))  # type: ignore[attr-defined]
        return fn
