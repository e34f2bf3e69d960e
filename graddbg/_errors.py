"""Exceptions and warning categories of graddbg.

Everything graddbg raises on purpose is a `GraddbgError` (a ``RuntimeError``), so
``except graddbg.GraddbgError`` catches all of it. Mismatch errors are also
``AssertionError`` so that pytest shows them as failed assertions. Warnings have their own
categories, so they can be filtered by type rather than by text.

This module imports nothing of graddbg.
"""
from __future__ import annotations

from typing import Any

__all__ = [
    "GraddbgError",
    "GraddbgValueError",
    "GraddbgTypeError",
    "GradientAnomalyError",
    "NonFiniteError",
    "GradientMismatchError",
    "DDPInconsistencyError",
    "DDPTimeoutError",
    "DotNotFoundError",
    "GraddbgWarning",
    "PrecisionWarning",
    "CoverageWarning",
    "CompileWarning",
]


class GraddbgError(RuntimeError):
    """Base class of every error graddbg raises on purpose."""


class GraddbgValueError(GraddbgError, ValueError):
    """A bad argument value: catch it as ``ValueError`` (Python's and torch's convention)
    or as ``GraddbgError``."""


class GraddbgTypeError(GraddbgError, TypeError):
    """An argument of the wrong type: catch it as ``TypeError`` or as ``GraddbgError``."""


class GradientAnomalyError(GraddbgError):
    """A gradient anomaly under the ``"raise"`` policy.

    Args:
        message: the anomaly's message.
        anomaly: the record.

    Attributes:
        anomaly (graddbg.Anomaly): what was found, where (parameter, module, op, source line)
            and at which step.
    """

    def __init__(self, message: str, anomaly: Any = None) -> None:
        super().__init__(message)
        self.anomaly = anomaly


class NonFiniteError(GradientAnomalyError):
    """A NaN or Inf was produced (by ``watch`` or ``find_nonfinite``)."""


class GradientMismatchError(GraddbgError, AssertionError):
    """Analytic and numerical gradients disagree (raised by ``assert_gradients_close``).

    Also an ``AssertionError``, so pytest shows it as a failed assertion.

    Args:
        message: the table of the worst entries.
        result: the check's result.

    Attributes:
        result (graddbg.GradcheckResult): the full result, with ``table`` of every
            mismatching entry.
    """

    def __init__(self, message: str, result: Any = None) -> None:
        super().__init__(message)
        self.result = result


class DDPInconsistencyError(GraddbgError):
    """Ranks of a process group disagree (structure, gradients, parameters or buffers).

    Args:
        message: which tensors differ on which ranks.
        report: the check's report.

    Attributes:
        report (graddbg.ddp_verify.ConsistencyReport): the verdict, the same on every rank,
            with ``mismatches``.
    """

    def __init__(self, message: str, report: Any = None) -> None:
        super().__init__(message)
        self.report = report


class DDPTimeoutError(DDPInconsistencyError):
    """Some ranks did not join a collective check within the timeout."""


class DotNotFoundError(GraddbgError):
    """The graphviz ``dot`` program is not installed (DOT text still works without it)."""


class GraddbgWarning(UserWarning):
    """Base category of graddbg's warnings."""


class PrecisionWarning(GraddbgWarning):
    """A check runs in a precision too low to be trusted (for instance float32 gradcheck)."""


class CoverageWarning(GraddbgWarning):
    """Some watched parameters or modules produced no data."""


class CompileWarning(GraddbgWarning):
    """A requested feature does not work, or breaks graphs, on a compiled model."""


def warn_at_user(message: str, category: type = GraddbgWarning) -> None:
    """``warnings.warn`` pointing at the user's line: the first caller outside graddbg and
    torch (a warning raised inside a hook would otherwise point at graddbg's own file)."""
    import os
    import sys
    import warnings

    here = os.path.dirname(os.path.abspath(__file__))
    torch_dir = os.path.dirname(os.path.abspath(sys.modules["torch"].__file__)) if "torch" in sys.modules else here
    frame, level = sys._getframe(1), 1
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not (path.startswith(here + os.sep) or path.startswith(torch_dir + os.sep)):
            break
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1 if frame is not None else 2)
