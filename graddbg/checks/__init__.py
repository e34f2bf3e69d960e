"""The checks a `graddbg.Watch` passes its step events to, in order.

Adding a check: write a `graddbg.checks.base.Check` subclass in its own module and
add one line to `default_checks`. The watch never changes for it.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, List, Optional

import torch

from graddbg._errors import CompileWarning
from graddbg._model import is_compiled

from graddbg.checks.activations import Activations
from graddbg.checks.base import BackwardEnd, Check, Finding, Launched, Measured, PackedSum, Step, Watched
from graddbg.checks.copies import CopyGuard
from graddbg.checks.detectors import ExplodeCheck, NonFiniteCheck, VanishCheck
from graddbg.checks.applied import AdamEps, ForeignUpdate, LrSchedule, Rewound, ScaledStep
from graddbg.checks.audit import StepAudit
from graddbg.checks.gradaudit import GradAudit
from graddbg.checks.graph import ConstantLossTerm, LossGraph
from graddbg.checks.histograms import Histograms
from graddbg.checks.hygiene import DeadGrad, Discarded, DoubleStep, EmptyStep, EvalMode, ScalerSkips, StaleGrad, Unchanged
from graddbg.checks.ledger import Ledger, LedgerKeeper, StepEntry
from graddbg.checks.construction import ModuleSetup
from graddbg.checks.manual import ManualDuring, ManualRule, ManualStale, ManualUnmoved
from graddbg.checks.recorder import GradientSource, StatsRecorder
from graddbg.checks.replicas import ReplicaCheck
from graddbg.checks.stages import StageCheck, StageSummary
from graddbg.checks.update import UpdateRatio
from graddbg.checks.zero import ZeroRecorder, ZeroSource

__all__ = ["Check", "Watched", "Step", "BackwardEnd", "Finding", "default_checks", "Parts",
           "CopyGuard", "StatsRecorder", "Activations", "NonFiniteCheck", "ExplodeCheck", "VanishCheck",
           "UpdateRatio", "ReplicaCheck", "StageCheck", "StaleGrad", "EmptyStep", "ScalerSkips", "Discarded", "DoubleStep", "EvalMode",
           "Unchanged", "DeadGrad", "LossGraph", "ScaledStep", "ForeignUpdate", "LrSchedule", "Ledger", "LedgerKeeper",
           "StepEntry", "ZeroRecorder", "ordered", "Launched", "Measured", "PackedSum", "GradientSource", "ZeroSource",
           "StageSummary", "Histograms", "StepAudit", "GradAudit"]


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


def ordered(checks: List[Check]) -> List[Check]:
    """``checks`` in the order their ``after`` declarations give (each after the classes
    it names; otherwise as listed)."""
    out: List[Check] = []
    todo = list(checks)
    while todo:
        for c in todo:
            waits = [d for d in todo if d is not c and any(isinstance(d, t) for t in c.after)]
            if not waits:
                out.append(c)
                todo.remove(c)
                break
        else:  # (a cycle: keep the listed order)
            out += todo
            break
    return out


@dataclasses.dataclass
class Parts:
    """The watch's checks (``checks``, in order) and the ones the watch's step calls by name:
    the ledger keeper (the step's host facts), the copy guard, the statistics recorder, the
    loss graph and, with ``activations=True``, the activations."""

    keeper: LedgerKeeper
    guard: CopyGuard
    recorder: StatsRecorder
    graph: LossGraph
    activations: Optional[Activations]
    checks: List[Check]


def default_checks(model: Any, options: Any, zero: Any = None) -> Parts:
    """The watch's checks, ordered by what each declares it reads after (`ordered`): the
    ledger keeper and the copy guard, the statistics recorder (it measures the step that the
    others read; ``zero``: a `graddbg._deepspeed.Zero` whose reduced partitions it reads
    instead of ``.grad``), the histograms, activations (a hint for blame), the stage summary,
    the detectors, the update ratio, the replica check, the hygiene checks and the loss
    graph."""
    keeper, guard, graph = LedgerKeeper(), CopyGuard(), LossGraph()
    recorder = StatsRecorder(ZeroSource(zero) if zero is not None else None)
    checks: List[Check] = [keeper, guard, recorder]
    if zero is None and options.histogram_schedule.on:  # (ZeRO's flat partitions: no histograms)
        checks.append(Histograms())
    activations = Activations(model) if options.activations and _hookable(model) else None
    if activations is not None:
        checks.append(activations)
    # (the stage summary before the detectors: they read the whole model's norm and where a
    # non-finite gradient came from; those that do not declare it keep their place after it)
    checks += [StageSummary(), NonFiniteCheck(), StageCheck(), ExplodeCheck(), VanishCheck(), UpdateRatio(),
               ReplicaCheck(),
               StaleGrad(), ManualStale(), EmptyStep(), ScalerSkips(), Discarded(), DoubleStep(), ScaledStep(), EvalMode(), Unchanged(), ForeignUpdate(), Rewound(), AdamEps(),
               LrSchedule(), DeadGrad(), StepAudit(), GradAudit(), ManualUnmoved(), ManualRule(), ManualDuring(),
               ModuleSetup(), ConstantLossTerm(), graph]
    return Parts(keeper, guard, recorder, graph, activations, ordered(checks))
