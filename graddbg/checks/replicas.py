"""The replica check: under distribution, gradients (and parameters) compared across the
ranks that should hold the same values, through :mod:`graddbg.ddp_verify`."""
from __future__ import annotations

import warnings
from typing import List, Optional

from graddbg._errors import GraddbgValueError, GraddbgWarning
from graddbg._model import module_of
from graddbg.anomaly import Anomaly
from graddbg.checks.base import Check, Finding, Step, Watched

__all__ = ["ReplicaCheck"]


class ReplicaCheck(Check):
    """Every ``ddp_check_every``-th step: one cross-rank fingerprint exchange."""

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        every = ctx.options.ddp_check_every
        self.every: Optional[int] = every if isinstance(every, int) else None

    def due(self, index: int) -> bool:
        return self.every is not None and index % self.every == 0

    def read(self, step: Step) -> List[Finding]:
        if not self.due(step.index):
            return []
        a = self._check(step.index)
        if a is None:
            return []
        nf = self.ctx.options.nonfinite
        return [Finding(a, nf.policy if nf is not None else "raise")]

    def _check(self, index: int) -> Optional[Anomaly]:
        from graddbg import ddp_verify

        timeout = self.ctx.options.ddp_timeout
        kw = {} if timeout is None else {"timeout": timeout}
        try:
            report = ddp_verify.check_gradients(self.ctx.model, **kw)
        except GraddbgValueError as err:  # (the same on every rank) e.g. pure FSDP: no replicas
            self.every = None
            warnings.warn(f"graddbg.watch: ddp_check_every is switched off: {err}", GraddbgWarning, stacklevel=2)
            return None
        self.ctx.host_syncs += 1
        if report.ok:
            return None
        mm = report.mismatches
        name = str(mm["name"].iloc[0]) if len(mm) else None
        return Anomaly(step=index, kind="ddp_mismatch", name=name, module=module_of(name) if name else None,
                       op=None, value=float(len(mm)), threshold=0.0, source=None,
                       message=f"graddbg: gradients differ across ranks at step {index}:\n{report}",
                       rank=self.ctx.rank,
                       params=tuple(dict.fromkeys(str(n) for n in mm["name"])) if len(mm) else ())
