"""Which ranks a watch exchanges what with: the layout of a distributed run, found once, at
the first step boundary where every peer arrived, before graddbg's first collective.

`Layout` is what the watch and its checks hold; it puts together three parts, one concern
each:

1. `graddbg._dist.arrival.Arrival`: the check-in through the default store (every peer
   watched, or local statistics), then at each boundary whether every peer is at the same
   one (or why graddbg goes local);
2. `graddbg._dist.groups.discover`: the groups, from one all-gather of a fixed-size
   signature of each rank's parameters: pipeline stages, the data-parallel (replica) group,
   or the world;
3. `graddbg._dist.stages`: the pipeline stages on this rank, hooks on them (`StageRelay`),
   and the per-step summary between stages (`Summary`).

Per step: per-parameter non-finite flags go over the replica group only (ranks that hold the
same parameters); a fixed-size summary (each stage's squared norm, whether it had a
non-finite gradient, whether one arrived from the next stage) goes over the pipeline group
(one rank per stage), or over the world when ranks hold different parameters without a
pipeline stage. No collective inside a backward pass of a pipeline stage (a peer stage may be
waiting for that backward's result).

This module imports only `graddbg._dist`'s `arrival`, `groups` and `stages`.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from graddbg._dist.arrival import Arrival
from graddbg._dist.groups import Groups, as_group, discover
from graddbg._dist.stages import StageRelay, StageReport, Summary

__all__ = ["Layout"]


class Layout:
    """Which ranks a watch exchanges what with (see the module's docstring). Built when the
    watch starts (the check-in key is written then); `ready` runs at each step boundary
    where a collective is safe, before any other collective of graddbg's. After the first
    boundary where every peer arrived, ``groups`` holds the groups found."""

    def __init__(self, model: nn.Module, names: Sequence[str], params: Sequence[Tensor], meta: Dict[str, Any],
                 pp_group: Any = None, dp_group: Any = None, make_capture: Any = None,
                 active: Any = lambda: True, stepped: bool = True, bound: Optional[float] = None) -> None:
        dist = torch.distributed
        on = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if on else 0
        self.world = dist.get_world_size() if on else 1
        self.model, self.names, self.params, self.meta = model, names, params, meta
        self._given = (pp_group, dp_group)
        self._stepped = stepped  # (an optimizer steps the model: its boundaries are outside backward passes)
        self._stages = StageRelay(model, make_capture, active)
        stages = self._stages.stages
        if stages and self.world == 1:  # (one stage, one process: read as a stage, nothing to exchange)
            meta.update(layout="pipeline", stage=stages[0].stage_index, num_stages=stages[0].num_stages)
        self._arrival = Arrival(self.rank, self.world, meta, bound)
        self.groups = Groups()
        self._found: Optional[bool] = None  # (the groups: not looked for yet, failed, found)
        self._summary: Optional[Summary] = None
        self._abstain_if_stepless()

    # ------------------------------------------------------------------ what the checks read
    @property
    def pipeline(self) -> bool:
        return bool(self._stages.stages) or self._given[0] is not None

    @property
    def local(self) -> bool:
        """No collectives at all (one rank, or peers unsure)."""
        return self._arrival.local

    @property
    def desync(self) -> Optional[tuple]:
        """``(step, what)`` when the ranks were found to step differently."""
        return self._arrival.desync

    @property
    def replica_group(self) -> Any:
        return self.groups.replica_group

    @property
    def shard_group(self) -> Any:
        return self.groups.shard_group

    @property
    def shard_replicas(self) -> Optional[tuple]:
        return self.groups.shard_replicas

    @property
    def ddp_stages(self) -> bool:
        return self.groups.ddp_stages

    @staticmethod
    def group(g: Any) -> Any:
        """A group value as ``torch.distributed`` takes it (None: the default group)."""
        return as_group(g)

    def shards_over(self) -> Any:
        """The group DTensor statistics are combined over now, as ``torch.distributed``
        takes it; False when graddbg issues no collective now (this rank's shards only: the
        peers were not all at the last boundary)."""
        if self.world == 1:
            return None
        if not self._arrival.met or not self._found:
            return False
        return as_group(self.groups.shard_group)

    def param_stages(self) -> Optional[np.ndarray]:
        """The stage of each watched parameter (a pipeline's layout), else None."""
        stages = self._stages.stages
        if stages:
            owner = {id(p): s.stage_index for s in stages for p in s.submod.parameters()}
            return np.array([owner.get(id(p), stages[0].stage_index) for p in self.params], dtype=np.int64)
        if self.pipeline and self.groups.slots:
            return np.full(len(self.params), self.groups.slots[0], dtype=np.int64)
        return None

    # ------------------------------------------------------------------ at each boundary
    def _abstain_if_stepless(self) -> None:
        """A pipeline stage watched without an optimizer never reaches a boundary where a
        collective is safe: it says so to its peers (`Arrival.abstain`)."""
        if not self._stepped and self.pipeline:
            self._arrival.abstain()

    def _safe_now(self, in_backward: bool) -> bool:
        """Whether graddbg may issue collectives at this boundary: never inside a backward
        pass of a pipeline stage, whose peers may be waiting for its result (stages built
        after the watch are looked for until the layout is resolved)."""
        if not self._arrival.resolved and not self._stages.stages:
            self._stages.look_again()
            self._abstain_if_stepless()
        return not (in_backward and self.pipeline)

    def ready(self, steps: int, in_backward: bool) -> bool:
        """Whether graddbg's collectives run at this boundary (``steps`` boundaries before
        it): decided once per boundary, the same on every rank (`Arrival.meet`: every peer
        watched and at this same boundary, or every rank goes on with local statistics,
        saying why). The groups are found at the first boundary where all arrived."""
        if not in_backward:
            self._stages.next_step()
        if not self._arrival.at_boundary(steps) or not self._safe_now(in_backward):
            return False
        if not self._arrival.meet(steps, comparable=not self.pipeline):
            return False
        if self._found is None:
            self._found = False
            self.groups = discover(self.model, self.names, self.params, self._stages.stages, self._given, self.meta)
            if self.groups.summary_group is not None:
                self._summary = Summary(self.groups, self.pipeline)
            self._found = True
        return self._found

    def forward_began(self, steps: int) -> None:
        """A training forward pass begins, ``steps`` boundaries so far."""
        self._arrival.forward_began(steps)

    def backward_ended(self) -> None:
        """A backward pass of this rank ended (its position, for the peers)."""
        self._arrival.backward_ended()

    def drift(self) -> Optional[str]:
        """After the ranks stepped differently: how each has stepped so far, or None."""
        return self._arrival.drift()

    def tell_origin(self, step: int, found: Dict[str, Any]) -> None:
        """Where this stage found a non-finite value it made at ``step`` started."""
        self._arrival.tell_origin(step, found)

    def origin_of(self, step: int) -> Optional[Dict[str, Any]]:
        """What the stage that made the non-finite value of ``step`` found, or None."""
        return self._arrival.origin_of(step)

    def close(self) -> None:
        """Remove the hooks on the stages and their outputs; stop this rank's pulse."""
        self._stages.close()
        self._arrival.close()

    # ------------------------------------------------------------------ per step
    def output_grad(self, grad: Tensor) -> None:
        """The gradient arriving at the stage's output from the next stage (a tap on the
        output, in the backward pass): whether it was non-finite, kept on the device."""
        if self.pipeline:
            self._stages.output_grad(grad, self.groups.slots[0] if self.groups.slots else None)

    def exchange(self, norms: np.ndarray, has: np.ndarray, bad: np.ndarray,
                 differ: Optional[int] = None) -> Optional[StageReport]:
        """The per-step summary over the pipeline group (or the world): every rank learns
        each slot's squared norm and non-finite flag, and whether its replicas differ
        (``differ``: the step this rank's replicas' hash differed at, or None). None when there
        is no summary."""
        arrived = self._stages.take()
        if self.local or self._summary is None:
            return None
        device = self.params[0].device if self.params else torch.device("cpu")
        return self._summary.exchange(norms, has, bad, arrived, differ, device)

    def arrival(self, report: StageReport) -> Optional[tuple]:
        """``(ranks, how)`` when a non-finite gradient arrived at this rank's (first) stage
        from the next stage (`StageReport.arrival`)."""
        return report.arrival()

    def capture(self, report: StageReport) -> Any:
        """The last forward pass of the stage of this rank's where a non-finite gradient was
        made, for a replay; None when there is none (`StageRelay.capture`)."""
        return self._stages.capture(report)

    def flag_drift(self, step: int) -> None:
        """This stage's replicas differ (found at ``step``): said in the next step's summary."""
        if self._summary is not None:
            self._summary.flag_drift(step)

    def global_norm(self, report: StageReport) -> float:
        """The whole model's norm: every stage once (one rank of each signature class when
        ranks hold different parameters without a pipeline)."""
        return self._summary.global_norm(report)
