"""The stages: under pipeline parallelism (or ranks that hold different parameters), the
per-step summary every rank exchanges (`StageSummary`: each stage's squared norm and
non-finite flag, so the whole model's global norm, and where a non-finite gradient came
from), and the finding it allows (`StageCheck`): a non-finite gradient on another stage while
this rank's own gradients are finite. Every rank then applies the non-finite policy at the
same step, so the job stops, or goes on, together; the rank where it happened names its own
parameters, module and op."""
from __future__ import annotations

import dataclasses
import math
from typing import List

from graddbg.anomaly import Anomaly
from graddbg.checks.base import Check, Finding, Step, wrote
from graddbg.checks.recorder import StatsRecorder

__all__ = ["StageSummary", "StageCheck"]


class StageSummary(Check):
    """The per-step summary of a pipeline (or of ranks holding different parameters), on
    the steps whose statistics are exchanged: the whole model's global norm (``step.whole``),
    every stage's norm and non-finite flag (``step.stages``), and where a non-finite gradient
    that arrived at this stage from the next one came from (``step.arrival``: no replay then,
    it started elsewhere), or which of this rank's stages made it (``step.stage_capture``).
    The replicas' verdict (``step.replicas_differ``) rides it, so every stage learns it at
    the same step. Also the ``stage`` column of ``w.stats``."""

    after = (StatsRecorder,)

    def read(self, step: Step) -> List[Finding]:
        layout, history = self.ctx.layout, self.ctx.history
        if history.stage is None and layout is not None and layout.pipeline:
            history.stage = layout.param_stages()  # (a ``stage`` column in w.stats)
        la, m = step.launched, step.measured
        if la is None or not la.collect or m is None or m.stats is None:
            return []
        st, bad = m.stats, m.bad
        report = layout.exchange(st.norm, st.has_grad, bad, differ=step.index if step.replicas_differ else None)
        if report is None:
            return []
        whole = dataclasses.replace(st)
        whole.__dict__["global_norm"] = layout.global_norm(report)  # (the whole model's, on every rank)
        came = layout.arrival(report)
        if came is not None and bad.any():
            return wrote([], stages=report, whole=whole, arrival=came)
        if bad.any():  # (several stages here: the last forward pass of the one that made it, if any)
            return wrote([], stages=report, whole=whole, stage_capture=layout.capture(report))
        return wrote([], stages=report, whole=whole)


class StageCheck(Check):
    """A non-finite gradient elsewhere in the pipeline (from the per-step stage summary)."""

    after = (StageSummary,)

    def read(self, step: Step) -> List[Finding]:
        det, report = self.ctx.options.nonfinite, step.stages
        if det is None or report is None or step.any_bad:
            return []
        where = report.elsewhere()
        if not where:
            return []
        places = "; ".join(report.slot_text(s) for s in where)
        mine = f"rank {self.ctx.rank}" + "".join(f", stage {s}" for s in report.me if report.what == "stage")
        msg = (f"graddbg: non-finite gradient at step {step.index} on {places} (this is {mine}, whose own "
               f"gradients are finite). Every rank applies the non-finite policy at the same "
               f"step, so the job stops, or goes on, together; the record of {places} names the parameters, "
               f"module and op where it started.")
        a = Anomaly(step=step.index, kind="nonfinite", name=None, module=None, op=None, value=math.nan,
                    threshold=None, source=None, message=msg, rank=self.ctx.rank)
        return [Finding(a, det.policy, skip=[])]
