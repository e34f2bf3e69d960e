"""The stages check: under pipeline parallelism (or ranks that hold different parameters),
a non-finite gradient on another stage while this rank's own gradients are finite. Every
rank then applies the non-finite policy at the same step, so the job stops, or goes on,
together; the rank where it happened names its own parameters, module and op."""
from __future__ import annotations

import math
from typing import List

from graddbg.anomaly import Anomaly
from graddbg.checks.base import Check, Finding, Step

__all__ = ["StageCheck"]


class StageCheck(Check):
    """A non-finite gradient elsewhere in the pipeline (from the per-step stage summary)."""

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
