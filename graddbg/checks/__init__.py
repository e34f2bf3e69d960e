"""The checks a `graddbg.Watch` passes its step events to, in order.

Adding a check: write a `graddbg.checks.base.Check` subclass in its own module and
add one line to `default_checks`. The watch never changes for it.
"""
from __future__ import annotations

import warnings
from typing import Any, List

import torch

from graddbg._errors import CompileWarning
from graddbg._model import is_compiled

from graddbg.checks.activations import Activations
from graddbg.checks.base import BackwardEnd, Check, Finding, Step, Watched
from graddbg.checks.copies import CopyGuard
from graddbg.checks.detectors import ExplodeCheck, NonFiniteCheck, VanishCheck
from graddbg.checks.hygiene import DeadGrad, EmptyStep, StaleGrad, Unchanged
from graddbg.checks.recorder import StatsRecorder
from graddbg.checks.replicas import ReplicaCheck
from graddbg.checks.stages import StageCheck
from graddbg.checks.update import UpdateRatio
from graddbg.checks.zero import ZeroRecorder

__all__ = ["Check", "Watched", "Step", "BackwardEnd", "Finding", "default_checks",
           "CopyGuard", "StatsRecorder", "Activations", "NonFiniteCheck", "ExplodeCheck", "VanishCheck",
           "UpdateRatio", "ReplicaCheck", "StageCheck", "StaleGrad", "EmptyStep", "Unchanged", "DeadGrad", "ZeroRecorder"]


def _hookable(model: Any) -> bool:
    """Whether module hooks inside ``model`` run (not in a compiled or TorchScript model)."""
    script = isinstance(model, torch.jit.ScriptModule)
    if script or is_compiled(model):
        warnings.warn(
            "graddbg.watch: activations=True needs module hooks inside the model, which a "
            f"{'TorchScript' if script else 'compiled'} model ignores or breaks graphs for; "
            "activation gradients are not recorded. Watch the model before compiling it, or "
            "pass activations=False.", CompileWarning, stacklevel=5)
        return False
    return True


def default_checks(model: Any, options: Any) -> List[Check]:
    """The watch's checks in the order they see each event: the copy guard, the statistics
    recorder (it fills the step that the others read), activations (a hint for blame),
    the detectors, the update ratio, the replica check, the hygiene checks."""
    checks: List[Check] = [CopyGuard(), StatsRecorder()]
    if options.activations and _hookable(model):
        checks.append(Activations(model))
    checks += [NonFiniteCheck(), StageCheck(), ExplodeCheck(), VanishCheck(), UpdateRatio(), ReplicaCheck(),
               StaleGrad(), EmptyStep(), Unchanged(), DeadGrad()]
    return checks
