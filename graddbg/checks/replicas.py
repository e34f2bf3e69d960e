"""The replica check: under distribution, the tensors that should be equal across ranks
(DDP replicas, HSDP's replicate dimension, data-parallel copies and replicated tensors of a
tensor-parallel model) compared with `graddbg.ddp_verify.check_replicas`.

On by default (``ddp_check_every="auto"``) when a process group of more than one rank is
initialised: the parameters at the first step (a model not wrapped in DDP on every rank,
initialised differently, or its parameters replaced after wrapping), then gradients and
parameters every ``AUTO_EVERY`` steps, which keeps the check under 1% of a step on the bench
models (bench/ddp_check.py --cost-only). ``ddp_check_every=None`` turns it off.
"""
from __future__ import annotations

import warnings
from typing import List, Optional

import numpy as np

from graddbg._args import AUTO, Schedule
from graddbg._errors import DDPInconsistencyError, GraddbgValueError, GraddbgWarning
from graddbg._model import in_backward, is_dtensor, module_of
from graddbg.anomaly import Anomaly
from graddbg.checks.base import Check, Finding, Step, Watched
from graddbg.checks.recorder import REPLICA_EVERY, StatsRecorder

__all__ = ["ReplicaCheck", "AUTO_EVERY"]

#: the default cadence under distribution: one check (about 8 reads of the gradients and
#: weights, and one rendezvous) every 100 steps is under 1% of a step on the bench models
AUTO_EVERY = REPLICA_EVERY


class ReplicaCheck(Check):
    """The parameters at the first step, then gradients and parameters every N steps, and at
    once at a step whose gradients differ across the replicas by the recorder's comparison
    (a hash of the reduced norms, in the all-reduce of the non-finite flags: 16 more bytes per recorded step)."""

    after = (StatsRecorder,)

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        every = ctx.options.ddp_check_every
        self.auto = every == AUTO
        if self.auto:
            every = AUTO_EVERY if ctx.world_size > 1 else None
        self.schedule = Schedule(every)
        self._differed = False
        self._said = False  # (the per-step hash stands in for ddp_verify: said once)
        self._desync_said = False
        self._held: Optional[Anomaly] = None  # (a drift ddp_verify found, told to every stage next step)
        self._stages_told = False

    def due(self, index: int) -> bool:
        return self.schedule.includes(index)

    def read(self, step: Step) -> List[Finding]:
        drift = self._out_of_step()
        return drift + self._replicas(step)

    def _out_of_step(self) -> List[Finding]:
        """The ranks stepped differently (one skipped or repeated ``optimizer.step()``), as the
        layout found while waiting for the peers: named once, as a warning whatever the
        policy (no rank can be stopped at the same step as the others once they are out of
        step; raising on one would leave the others waiting)."""
        layout = self.ctx.layout
        if layout is None or layout.desync is None or self._desync_said:
            return []
        self._desync_said = True
        at, why = layout.desync
        a = Anomaly(step=at, kind="ddp_mismatch", name=None, module=None, op=None, value=float("nan"),
                    threshold=0.0, source=None, rank=self.ctx.rank,
                    message=f"graddbg: the ranks stepped differently at step {at}: {why}. Their replicas now "
                            f"differ (a rank that skips or repeats an update trains a different model from here "
                            f"on; DDP does not notice). A per-rank guard such as 'skip this step if my loss looks "
                            f"bad' must decide alike on every rank (all-reduce the decision first). graddbg goes "
                            f"on with each rank's local statistics, without collectives of its own.")
        return [Finding(a, "warn")]

    def _replicas(self, step: Step) -> List[Finding]:
        # on its schedule, and at once when the recorder's hash of the reduced norms differs
        # across the replicas (the same on every rank: every rank runs the check alike)
        urgent = step.replicas_differ and not self._differed and self.schedule.on
        self._differed = step.replicas_differ  # (a difference that persists was reported when it began)
        if not (self.due(step.index) or urgent) or step.closure:
            return []
        layout = self.ctx.layout
        a, hashed = None, False
        if (self.due(step.index) or urgent) and not step.closure:
            if self._stage_of_shards():
                # ddp_verify compares sharded models across the whole world, and a pipeline's stages
                # hold different models: the recorder's per-step hash, within each stage, is the check
                hashed = True
                a = _hash_mismatch(step.index, layout.meta.get("stage"), layout.shard_replicas,
                                   self.ctx.rank) if urgent else None
            else:
                a = self._check(step.index)
        nf = self.ctx.options.nonfinite
        policy = nf.policy if nf is not None else "raise"
        report = step.stages
        if policy == "raise" and report is not None and report.what == "stage" and report.differ is not None:
            return self._with_every_stage(step.index, report, a, hashed, policy)
        return [] if a is None else [Finding(a, policy)]

    def _with_every_stage(self, index: int, report: object, a: Optional[Anomaly], hashed: bool,
                          policy: object) -> List[Finding]:
        """In a pipeline, under the raise policy, a replica drift stops every stage at the same
        step, not only the stage whose replicas differ (the others would go on into the next step and wait in
        the schedule's receive for ever). The per-step hash's verdict rides this step's stage
        summary; ddp_verify's, found after that summary, rides the next step's, and is
        reported then on every rank (dated the step it was found)."""
        differs = [int(s) for s in np.nonzero(report.differ)[0]]  # type: ignore[attr-defined]
        if self._stages_told:
            return []
        if not differs:
            if a is not None and not hashed:
                self._held = self._held or a
                self.ctx.layout.flag_drift(index)
                return []
            return [] if a is None else [Finding(a, policy)]
        self._stages_told = True
        mine, self._held = self._held or a, None
        if mine is None:
            where = ", ".join(report.slot_text(s) for s in differs)  # type: ignore[attr-defined]
            at = min(int(report.differ[s]) - 1 for s in differs)  # type: ignore[attr-defined]
            mine = Anomaly(step=at, kind="ddp_mismatch", name=None, module=None, op=None, value=float("nan"),
                           threshold=0.0, source=None, rank=self.ctx.rank,
                           message=f"graddbg: replicas differ in pipeline stage(s) {differs} at step {at} (found "
                                   f"by {where}; told to every stage at step {index}); this stage stops with them "
                                   f"at the same step, so that no stage is left waiting in the schedule for "
                                   f"another.")
        return [Finding(mine, policy)]

    def _stage_of_shards(self) -> bool:
        """A pipeline stage whose parameters are DTensors (FSDP2, HSDP, tensor parallel)."""
        layout = self.ctx.layout
        sharded = layout is not None and layout.world > 1 and layout.pipeline and any(
            is_dtensor(p) for p in self.ctx.params)
        if sharded and not self.auto and not self._said:
            self._said = True
            warnings.warn("graddbg.watch: ddp_check_every: the full comparison of the replicas (ddp_verify) spans "
                          "the whole world on a sharded model, and the stages of this pipeline hold different "
                          "parameters; the replicas of each stage (the ranks holding the same shards) are compared "
                          "by a per-step hash of their gradients' norms instead.", GraddbgWarning, stacklevel=2)
        return sharded

    def _check(self, index: int) -> Optional[Anomaly]:
        from graddbg import ddp_verify

        timeout = self.ctx.options.ddp_timeout
        kw = {} if timeout is None else {"timeout": timeout}
        layout = self.ctx.layout
        if layout is not None and layout.world > 1:
            # (decided once per boundary, usually by the statistics recorder: inside a pipeline
            # stage's backward pass, or a peer not at this boundary, means no collective now)
            if not layout.ready(index, in_backward()):
                if layout.local:
                    self.schedule = Schedule(None)  # peers not all watched, gone or out of step
                return None
            if layout.replica_group is None:
                self.schedule = Schedule(None)  # no replicas (pipeline stages without dp)
                return None
            kw["group"] = layout.group(layout.replica_group)
        first = index == 0
        try:
            report = ddp_verify.check_replicas(self.ctx.model, initial=first, **kw)
        except (GraddbgValueError, DDPInconsistencyError) as err:
            # (the same on every rank) nothing replicated (pure FSDP); by default also ranks
            # that hold different models (pipeline stages): no replicas to compare
            if isinstance(err, DDPInconsistencyError) and not (self.auto and "hold different models" in str(err)):
                raise
            self.schedule = Schedule(None)
            if not self.auto:
                warnings.warn(f"graddbg.watch: ddp_check_every is switched off: {err}", GraddbgWarning, stacklevel=2)
            return None
        self.ctx.host_syncs += 1
        return None if report.ok else _mismatch(index, report, self.ctx.rank)


def _hash_mismatch(index: int, stage: object, shard_replicas: Optional[tuple], rank: Optional[int]) -> Anomaly:
    """A replica drift within a pipeline stage, from the recorder's hash (no names: it
    compares norms hashed together)."""
    k, _, m = shard_replicas or (1, 0, 0)
    held = f"each of the {k} shard(s) held by {m} ranks" if m else "the ranks holding the same shards"
    return Anomaly(step=index, kind="ddp_mismatch", name=None, module=None, op=None, value=float("nan"),
                   threshold=0.0, source=None, rank=rank,
                   message=f"graddbg: replicas differ at step {index} in pipeline stage {stage}: the ranks that "
                           f"should hold the same shards ({held}, across the replicate dimension) hold different "
                           f"gradients or weights (a hash of their norms: the gradients every recorded step, the "
                           f"weights on the replica checks' steps). A rank that drifted (a weight edited on one "
                           f"rank, a missed all-reduce) trains a different model from here on.")


def _mismatch(index: int, report: object, rank: Optional[int]) -> Anomaly:
    mm = report.mismatches  # type: ignore[attr-defined]
    name = str(mm["name"].iloc[0]) if len(mm) else None
    return Anomaly(step=index, kind="ddp_mismatch", name=name, module=module_of(name) if name else None,
                   op=None, value=float(len(mm)), threshold=0.0, source=None,
                   message=f"graddbg: replicas differ across ranks at step {index}:\n{report}", rank=rank,
                   params=tuple(dict.fromkeys(str(n) for n in mm["name"])) if len(mm) else ())
