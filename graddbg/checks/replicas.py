"""The replica check: under distribution, the tensors that should be equal across ranks
(DDP replicas, HSDP's replicate dimension, data-parallel copies and replicated tensors of a
tensor-parallel model) compared with `graddbg.ddp_verify.check_replicas`, and on every
recorded step a hash of the replicas' already-reduced norms.

On by default (``ddp_check_every="auto"``) when a process group of more than one rank is
initialised: the parameters at the first step (a model not wrapped in DDP on every rank,
initialised differently, or its parameters replaced after wrapping), then gradients and
parameters every ``AUTO_EVERY`` steps, which keeps the check under 1% of a step on the bench
models (bench/ddp_check.py --cost-only). ``ddp_check_every=None`` turns it off.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from graddbg._args import AUTO, REPLICA_CHECK, Schedule
from graddbg._errors import DDPInconsistencyError, GraddbgValueError, GraddbgWarning
from graddbg._model import in_backward, is_dtensor, module_of
from graddbg.anomaly import Anomaly
from graddbg.checks.base import Check, Finding, Launched, Step, Watched, wrote
from graddbg.checks.recorder import StatsRecorder, device_index
from graddbg.checks.stages import StageSummary
from graddbg.stats import local_values

__all__ = ["ReplicaCheck", "AUTO_EVERY"]

#: the default cadence under distribution: one check (about 8 reads of the gradients and
#: weights, and one rendezvous) every 100 steps is under 1% of a step on the bench models
AUTO_EVERY = REPLICA_CHECK.every


@dataclasses.dataclass(frozen=True)
class _Cadence:
    """What ``ddp_check_every`` says (read here only): the full comparison's schedule, the
    steps whose weights ride the per-step hash, and whether the hash runs at all."""

    auto: bool
    check: Schedule  #: the full comparison (ddp_verify)
    weights: Schedule  #: the steps whose hash includes the weights' norms (sharded replicas)
    hashed: bool  #: the per-step hash of the reduced norms is on

    @classmethod
    def of(cls, every: Any, world_size: int) -> "_Cadence":
        auto = every == AUTO
        full = (AUTO_EVERY if world_size > 1 else None) if auto else every
        return cls(auto, Schedule(full), Schedule(AUTO_EVERY if auto else every), every is not None)


def _is_ddp(model: Any) -> bool:
    """Whether ``model`` is wrapped in DistributedDataParallel (its ranks hold equal gradients)."""
    return type(model).__name__ == "DistributedDataParallel" or \
        isinstance(model, getattr(torch.nn.parallel, "DistributedDataParallel", ()))


class _Hash:
    """Replicas (DDP) hold the same reduced gradients, so the same norms, bit for bit: a
    52-bit hash of this rank's norms (of the gradients as the optimizer will use them),
    summed with the recorder's non-finite flags in the step's one small all-reduce (as ``h``
    and ``h * h``: 16 more bytes per recorded step)."""

    def __init__(self, group: Any, shard_replicas: Optional[tuple]) -> None:
        import torch.distributed as dist

        #: (k, j, m): the group's ranks hold k distinct shards, this rank the j-th, m ranks each
        #: (HSDP): the hash of the shards' norms is compared among the m ranks of each; DDP:
        #: one "shard", held by every rank of the group
        self.slots = shard_replicas or (1, 0, dist.get_world_size(group))
        self.shards_hashed = shard_replicas is not None
        self._index: Dict[Tuple[int, ...], Tensor] = {}

    def queue(self, step: Step, la: Launched, P: int, weights: Optional[List[Tensor]]) -> Any:
        """Its part of ``step.reduce``; returns the slot of the verdict (1: the replicas differ)."""
        assert la.any_rank is not None
        dev, (k, j, m) = la.any_rank.device, self.slots
        part = torch.zeros(2 * k, dtype=torch.int64, device=dev)
        differ = torch.zeros(1, dtype=torch.int64, device=dev)
        bits = la.any_rank
        with torch.no_grad():
            h = self._hash(la, dev, P, weights)
            part[2 * j: 2 * j + 2] = torch.stack([h, h * h])

        def verdict(summed: Tensor) -> None:
            # per shard, m * sum(h^2) - sum(h)^2 = sum over pairs of (h_a - h_b)^2: zero exactly
            # when the hashes of the ranks holding it agree (modulo 2**64: a false "same" once
            # in ~2**64), decided from the reduced values only, so every rank decides alike; a
            # non-finite gradient on some rank is the non-finite check's finding, not a replica's
            s1, s2 = summed[0::2], summed[1::2]
            differ.copy_(((s2 * m != s1 * s1).any() & ~bits.any()).reshape(1).long())

        step.reduce.add(part, la.group, then=verdict)
        return step.readback.add("replica_hash", differ)

    def _hash(self, la: Launched, dev: torch.device, P: int, weights: Optional[List[Tensor]]) -> Tensor:
        launch = la.launch
        applied = torch.zeros(P, dtype=torch.float64, device=dev)
        for k, (ix, norms) in enumerate(zip(launch.groups, launch.norms)):
            if launch.sharded is None or k != launch.sharded[0] or self.shards_hashed:
                applied.index_copy_(0, device_index(self._index, ix, dev), norms.double().to(dev))
        if la.current_norms is not None:  # (changed since the backward pass: their norms now)
            applied.index_copy_(0, device_index(self._index, la.current, dev), la.current_norms.double())
        if weights:  # (the weights too, on the replica checks' steps: a replica whose weights drifted)
            applied = torch.cat([applied, torch.stack(torch._foreach_norm(weights)).double().to(dev)])
        # (a non-finite norm is the non-finite check's: NaN payloads may differ between ranks)
        applied = torch.nan_to_num(applied, nan=0.0, posinf=0.0, neginf=0.0)
        bits = applied.view(torch.int64)
        coef = torch.arange(1, 2 * bits.numel(), 2, dtype=torch.int64, device=bits.device) * 0x9E3779B97F4A7C1
        h = (bits * coef).sum()  # (wraps modulo 2**64)
        return ((h ^ (h >> 29)) & ((1 << 52) - 1)).to(dev)


class ReplicaCheck(Check):
    """The parameters at the first step, then gradients and parameters every N steps, and at
    once at a step whose gradients differ across the replicas by the per-step hash of their
    reduced norms (queued here, in the recorder's all-reduce of the non-finite flags: one
    collective; its verdict, ``step.replicas_differ``, rides the stage summary)."""

    after = (StatsRecorder, StageSummary)

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        cadence = _Cadence.of(ctx.options.ddp_check_every, ctx.world_size)
        self.auto, self.schedule, self._weights, self._hashing = \
            cadence.auto, cadence.check, cadence.weights, cadence.hashed
        self._hash: Optional[_Hash] = None  # (made at the first step whose flags are exchanged)
        self._differed = False
        self._said = False  # (the per-step hash stands in for ddp_verify: said once)
        self._desync_said = False
        self._held: Optional[Anomaly] = None  # (a drift ddp_verify found, told to every stage next step)
        self._stages_told = False

    def due(self, index: int) -> bool:
        return self.schedule.includes(index)

    def queue(self, step: Step) -> None:
        la = step.launched
        if la is None or la.any_rank is None or not self._hashing:
            return
        if self._hash is None:
            layout = self.ctx.layout
            if not (_is_ddp(self.ctx.model) or layout.ddp_stages or layout.shard_replicas is not None):
                self._hashing = False  # (ranks that hold equal gradients only)
                return
            self._hash = _Hash(la.group, layout.shard_replicas)
        weights = None
        if self._hash.shards_hashed and self._weights.includes(step.index):
            weights = [local_values(p.detach()) for p in self.ctx.params]
        return wrote(None, replica_hash=self._hash.queue(step, la, len(self.ctx), weights))

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
        # on its schedule, and at once when the hash of the reduced norms differs
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
                # hold different models: the per-step hash, within each stage, is the check
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
        self.ctx.count_syncs()
        return None if report.ok else _mismatch(index, report, self.ctx.rank)


def _hash_mismatch(index: int, stage: object, shard_replicas: Optional[tuple], rank: Optional[int]) -> Anomaly:
    """A replica drift within a pipeline stage, from the per-step hash (no names: it
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
