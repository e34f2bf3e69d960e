"""The statistics recorder: the one check that reads gradient values on the hot path.

At the end of each backward pass it launches the statistics kernels of
`graddbg.stats.StepReader` (so that a clip between backward and step does not hide
the pre-clip gradient); at the step boundary it queues their results for the one read-back
(and, under distribution, every rank's non-finite flags for the step's one small
all-reduce), publishes what it launched (``step.launched``) for the parts that queue from it,
and reads back what it measured into ``step.measured``: the statistics unscaled, the
non-finite mask, the clip, the scale, the loss. Non-finite flags of backward passes that the
optimizer never stepped on, and of steps not read, accumulate on the device until the next
read.

Where the gradients are not the parameters' ``.grad`` (DeepSpeed ZeRO's reduced
partitions) a gradient source is plugged in (`graddbg.checks.zero.ZeroSource`): the
recorder asks it for the statistics instead of launching its own kernels.
"""
from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from graddbg._dist.collective import run_collective
from graddbg._model import in_backward
from graddbg.checks.base import BackwardEnd, Check, Finding, Launched, Measured, Step, Watched, wrote
from graddbg.checks.graph import LossSum
from graddbg.checks.ledger import LedgerKeeper
from graddbg.stats import Readback, Slot, StepReader, StepRecord, StepStats, local_values

__all__ = ["StatsRecorder", "GradientSource", "device_index"]


class GradientSource(abc.ABC):
    """Where the recorder reads gradients from when they are not the parameters' ``.grad``
    (the interface `graddbg.checks.zero.ZeroSource` implements): nothing is launched at the
    end of a backward pass; at the step, `queue` queues a read of the statistics into the
    read-back and `measure` turns it into the step's `Measured` values."""

    @abc.abstractmethod
    def queue(self, rb: Readback, params: Sequence[Tensor], absmax: bool) -> Any:
        """Queue the read of the step's statistics into ``rb``; returns the token `measure` gets."""

    @abc.abstractmethod
    def measure(self, token: Any, index: int, lr: float) -> Tuple[Measured, int]:
        """(the measured values, the host synchronisations it made beyond the read-back)."""

    def done(self) -> None:
        """The step was read (or not): forget its evidence."""


def device_index(cache: Dict[Tuple[int, ...], Tensor], ix: Sequence[int], device: torch.device) -> Tensor:
    """``ix`` as an int64 tensor on ``device``, kept in ``cache``."""
    key = tuple(ix)
    t = cache.get(key)
    if t is None or t.device != device:
        t = cache[key] = torch.tensor(key, dtype=torch.int64, device=device)
    return t


@dataclasses.dataclass
class _Pending:
    """Statistics launched at the end of a backward pass, waiting for the step boundary."""

    step: int
    launch: Any
    grads: List[Optional[Tensor]]
    versions: List[int]
    scale: Optional[Tensor]  #: the loss scale in force (a device tensor: read with the read-back)


@dataclasses.dataclass
class _Queued:
    """What the recorder queued at a step boundary, handed back to its ``read``."""

    launch: Any
    scale: Optional[Slot]  #: the loss scale, read back with the statistics
    unscale: bool  #: divide the statistics by the scale (launched on scaled gradients)
    stats: Dict[str, Slot]
    grads: List[Optional[Tensor]]  #: the gradients measured
    live: Optional[List[int]] = None  #: gradients changed since the backward pass ...
    clip: Optional[Slot] = None  #: ... and their norms now
    flags: Optional[List[Tuple[Slot, Slot]]] = None
    any_rank: Optional[Slot] = None  #: every rank's non-finite flags (bits), summed over the replica group
    skipped: List[Tuple[int, Slot]] = dataclasses.field(default_factory=list)  #: scales of skipped steps
    loss: Optional[Slot] = None  #: the sum of the step's losses handed to backward()


class _Flags:
    """Non-finite flags accumulated on the device between host reads: which parameters
    went non-finite, and at which step first (no host synchronisation). Kept per group of
    parameters reduced together."""

    def __init__(self) -> None:
        self.groups: Dict[Tuple[int, ...], Tuple[Tensor, Tensor]] = {}

    def add(self, launch: Any, step: int) -> None:
        for ix, norms in zip(launch.groups, launch.norms):
            key = tuple(ix)
            new = ~torch.isfinite(norms)
            old = self.groups.get(key)
            if old is None:
                self.groups[key] = (new, torch.where(new, step, -1))
            else:
                bad, first = old
                self.groups[key] = (bad | new, torch.where(new & ~bad, step, first))

    def add_to(self, rb: Readback, agree: bool = False, group: Any = None) -> List[Tuple[Slot, Slot]]:
        """Into a read-back (their slots, for `take`); ``agree``: first make the flags the
        same on every rank of ``group`` (a sharded model: each rank flagged its own shards)."""
        slots = []
        for bad, first in self.groups.values():
            if agree:
                _agree(bad, first, group)
            slots.append((rb.add("acc_bad", bad), rb.add("acc_first", first)))
        return slots

    def take(self, slots: List[Tuple[Slot, Slot]], P: int) -> Tuple[Optional[np.ndarray], int]:
        """``(bad mask over the P parameters, first bad step)`` from a read-back; resets."""
        bad, first = None, -1
        for (bad_slot, first_slot), ix in zip(slots, self.groups):
            b = bad_slot.value > 0
            if b.any():
                f = int(first_slot.value[b].min())
                if bad is None:
                    bad = np.zeros(P, dtype=bool)
                bad[np.asarray(ix)[b]] = True
                first = f if first < 0 else min(first, f)
        self.groups.clear()
        return bad, first


def _agree(bad: Tensor, first: Tensor, group: Any = None) -> None:
    """All-reduce non-finite flags (any rank of ``group``) and their first steps (the
    earliest), in place."""
    import torch.distributed as dist

    never = torch.iinfo(torch.int64).max
    packed = torch.stack([bad.long(), -torch.where(first < 0, never, first).clamp(max=never - 1)])
    run_collective(dist.all_reduce, packed, op=dist.ReduceOp.MAX, group=group)
    bad.copy_(packed[0] > 0)
    first.copy_(torch.where(packed[0] > 0, -packed[1], -1))


class _AnyRank:
    """Under distribution: which ranks of the replica group (the ranks that hold the same
    parameters) hold a non-finite gradient of each parameter (after the backward pass, or
    changed since: a hand edit, a faulty clip on one rank), summed in the step's one small
    all-reduce over that group (``step.reduce``; the replica check's hash rides it), so that
    every replica knows at the same step, whichever holds it. Each rank adds its bit
    (``1 << its rank in the group``; a plain flag past 62 ranks)."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self.group = group
        size, me = dist.get_world_size(group), dist.get_rank(group)
        self.bit = 1 << me if size <= 62 else 1
        self.ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(min(size, 63))]
        self._index: Dict[Tuple[int, ...], Tensor] = {}

    def queue(self, step: Step, launch: Any, grads: List[Optional[Tensor]], changed: bool,
              P: int) -> Tuple[Slot, Tensor, List[int], Optional[Tensor]]:
        """(the slot of the summed flags, the flags on the device, the gradients as the
        optimizer will use them and their norms now)."""
        if not launch.norms:
            dev = next((g.device for g in grads if g is not None), torch.device("cpu"))
        else:
            dev = launch.norms[0].device
        local = torch.zeros(P, dtype=torch.int64, device=dev)
        with torch.no_grad():
            for ix, norms in zip(launch.groups, launch.norms):
                local.index_copy_(0, device_index(self._index, ix, dev), (~torch.isfinite(norms)).long().to(dev))
            # the gradients as the optimizer will use them: all when a version counter moved;
            # DTensor shards always (an edit through to_local() moves no counter that is seen)
            live = [i for i, g in enumerate(grads)
                    if g is not None and g.numel() and (changed or type(g) is not Tensor)]
            now = None
            if live:  # as the optimizer will use them (local values: a DTensor's shard)
                now = torch.stack(torch._foreach_norm([local_values(grads[i]).to(dev) for i in live]))
                local.index_fill_(0, device_index(self._index, live, dev)[~torch.isfinite(now)], 1)
            local.mul_(self.bit)
        step.reduce.add(local, self.group)
        return step.readback.add("rank_bad", local), local, live, now

    def read(self, slot: Slot) -> Tuple[np.ndarray, Dict[int, List[int]]]:
        """(non-finite somewhere, per parameter; the global ranks holding each)."""
        bits = slot.value.astype(np.int64)
        ranks = {int(i): [self.ranks[r] for r in range(len(self.ranks)) if bits[i] >> r & 1]
                 for i in np.nonzero(bits)[0]}
        return bits > 0, ranks


class StatsRecorder(Check):
    """Per-parameter statistics of the gradients, read once per step: ``step.launched`` (its
    ``queue``: what it measures, on the device) and ``step.measured`` (its ``read``); the
    rows of the steps the GradScaler skipped. ``source``: a `GradientSource` to ask for the
    statistics instead of reading ``.grad`` (DeepSpeed ZeRO)."""

    STATE = ("ever_grad",)

    after = (LedgerKeeper,)

    def __init__(self, source: Optional[GradientSource] = None) -> None:
        self.source = source
        self._pending: Optional[_Pending] = None
        self._flags = _Flags()
        self.ever_grad = np.zeros(0, dtype=bool)  #: parameters that ever had a gradient
        self._skipped_scales: List[Tuple[int, Tensor]] = []  # (step, scale) of skipped steps, read later
        self._losses = LossSum()  # the losses handed to backward() since the last step, on their device

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self.history = ctx.history
        self._reader = StepReader(ctx.params, ctx.options.quantities)
        self.ever_grad = np.zeros(len(ctx), dtype=bool)
        P = len(ctx)
        self._version_idx = sorted({0, P // 3, (2 * P) // 3, P - 1}) if P else []
        self._any_rank: Optional[_AnyRank] = None  # (made once the replica group is known)

    def params_added(self, k: int) -> None:
        self._reader = StepReader(self.ctx.params, self.ctx.options.quantities)
        self.ever_grad = np.concatenate([self.ever_grad, np.zeros(k, dtype=bool)])
        P = len(self.ctx)
        self._version_idx = sorted({0, P // 3, (2 * P) // 3, P - 1})
        self._pending = None

    # ------------------------------------------------------------------ events
    def on_backward_end(self, bw: BackwardEnd) -> None:
        if self.source is not None:  # (a micro-batch's local, unreduced gradients: nothing to read)
            return
        self._losses.add(bw.scale)
        layout = self.ctx.layout
        if layout is not None and layout.pipeline and self.ctx.optimizer is not None:
            # a pipeline stage: read at the step, after the schedule divided the gradients by
            # the number of micro-batches (the gradient the optimizer applies); no kernels per
            # micro-batch
            return
        if self._pending is not None:
            # gradients of a backward pass the optimizer never stepped on (zeroed, or
            # accumulated on): their non-finite flags are kept until the next read
            self._flags.add(self._pending.launch, bw.step)
        self._pending = self._launch(bw.step, bw.grads, bw.scale)

    def skipped(self, index: int) -> None:
        """The GradScaler skipped this step (it did not call the optimizer): an overflow
        step, whose scaled, non-finite gradients were thrown away by design. Its scale is
        not read (no host read of the scale on a step that is not recorded)."""
        pending, self._pending = self._pending, None
        self._losses.take()  # (not read: a skipped step's loss is not recorded)
        if pending is not None:
            self.ever_grad |= np.array([g is not None for g in pending.grads], dtype=bool)
            if pending.scale is not None:
                self._skipped_scales.append((index, pending.scale))
        self.history.append(StepRecord(index, overflow=True, scale=math.nan, lr=self._lr()))

    def _exchanges(self, index: int) -> bool:
        """Whether this step exchanges statistics with other ranks: the layout is known (or
        found now: the first such step), every peer is watched and at this same boundary,
        and this boundary is not inside a pipeline stage's backward pass. Sets the groups of
        the reader's gathers."""
        layout = self.ctx.layout
        if layout is None:
            self._reader.shard_group(None)
            return False
        collect = layout.ready(index, in_backward())
        if collect and self._any_rank is None and layout.replica_group is not None:
            self._any_rank = _AnyRank(layout.group(layout.replica_group))
        self._reader.shard_group(layout.shards_over() if collect else False)
        return collect

    def queue(self, step: Step) -> Any:
        if self.source is not None:
            return self.source.queue(step.readback, self.ctx.params, self._absmax_due(step.index, [])) \
                if step.read else None
        collect = self._exchanges(step.index)
        launch, grads, scale, unscale, changed = self._take(step)
        loss = self._losses.take()
        if not step.read:
            # no read this step: flags stay on the device (of the gradients as the optimizer
            # will use them, when they changed since the backward pass)
            self._flags.add(self._reader.launch(grads) if changed else launch, step.index)
            return None
        rb = step.readback
        q = _Queued(launch, rb.add("scale", scale.reshape(1)) if scale is not None else None, unscale,
                    self._reader.add_to(rb, launch), grads)
        q.loss = rb.add("loss", loss) if loss is not None else None
        q.skipped = [(i, rb.add("skipped_scale", t.reshape(1))) for i, t in self._skipped_scales]
        self._skipped_scales = []
        if changed:  # changed in place since the backward pass (a clip, unscale_, a hand edit)
            q.live = [i for i, g in enumerate(grads)
                      if g is not None and type(g) is Tensor and g.layout == torch.strided] or None
            if q.live:
                q.clip = rb.add("clip_norms", torch.stack(torch._foreach_norm([grads[i] for i in q.live])))
        layout = self.ctx.layout
        shards = collect and layout.shard_group is not False  # (False: this rank's shards only)
        q.flags = self._flags.add_to(rb, agree=launch.sharded is not None and shards,
                                     group=layout.group(layout.shard_group) if shards else None)
        launched = Launched(grads, launch, collect)
        if self._any_rank is not None and collect:
            q.any_rank, launched.any_rank, launched.current, launched.current_norms = \
                self._any_rank.queue(step, launch, grads, changed, len(self.ctx))
            launched.group = self._any_rank.group
        return wrote(q, launched=launched)

    def read(self, step: Step) -> List[Finding]:
        if self.source is not None:
            try:
                return wrote([], measured=self._read_source(step))
            finally:
                self.source.done()  # (the evidence of this step's micro-batches)
        q: Optional[_Queued] = step.token(self)
        if q is None:
            return wrote([], measured=Measured(lr=self._lr()))
        for i, slot in q.skipped:
            self.history.set_scale(i, float(slot.value[0]))
        scale = float(q.scale.value[0]) if q.scale is not None else math.nan
        loss = float(q.loss.value[0]) if q.loss is not None else math.nan
        div = scale if q.unscale and scale == scale and scale > 0 else 1.0
        st = self._stats(q.launch, q.stats, q.grads, div, changed=q.live is not None)
        bad, first = st.bad, step.index
        prior, first_prior = self._flags.take(q.flags, len(self.ctx))
        if prior is not None:
            bad, first = bad | prior, first_prior
        clip_norm, bad = self._after_change(q, bad)
        if q.any_rank is not None and self._any_rank is not None:  # what any rank found, every rank knows
            anywhere, ranks = self._any_rank.read(q.any_rank)
            bad = bad | anywhere
            if anywhere.any():
                st.shard_ranks = {**ranks, **(st.shard_ranks or {})}
        # each backward pass is a step and a GradScaler is in use: scaled gradients that
        # overflowed are the scaler's to skip, an overflow step, never an anomaly
        overflow = bool(bad.any()) and self.ctx.optimizer is None and self.ctx.options.scaler is not None
        return wrote([], measured=Measured(self._lr(), st, bad, first, clip_norm, scale, loss, overflow))

    def _read_source(self, step: Step) -> Measured:
        token = step.token(self)
        if token is None:
            return Measured(lr=self._lr())
        assert self.source is not None
        measured, syncs = self.source.measure(token, step.index, self._lr())
        self.ctx.count_syncs(syncs)
        if measured.stats is not None:
            self.ever_grad |= measured.stats.has_grad
        return measured

    # ------------------------------------------------------------------ helpers
    def _launch(self, index: int, grads: List[Optional[Tensor]], scale: Optional[Tensor]) -> _Pending:
        launch = self._reader.launch(grads, absmax=self._absmax_due(index, grads), extras=True)
        return _Pending(index, launch, grads, self._versions(grads), scale)

    def _take(self, step: Step) -> Tuple[Any, List[Optional[Tensor]], Optional[Tensor], bool, bool]:
        """The launched statistics of this step's gradients, those gradients, the loss scale
        in force (a device tensor, or None), whether to divide the statistics by it to
        unscale them, and whether the gradients changed since: those launched at the end of
        the backward pass when there was one, else launched now."""
        pending, self._pending = self._pending, None
        layout = self.ctx.layout
        at_step = layout is not None and layout.pipeline and self.ctx.optimizer is not None
        if pending is not None and pending.step == step.index and not at_step:
            unscale = self.ctx.options.scaler is not None and pending.scale is not None
            entry = step.entry  # (the ledger's version counters of every gradient, or a few sampled)
            changed = bool(entry.changed.any()) if entry is not None and entry.changed is not None else \
                self._versions(pending.grads) != pending.versions
            return pending.launch, pending.grads, pending.scale, unscale, changed
        if pending is not None:
            self._flags.add(pending.launch, step.index)
        # launched now, at the step: inside GradScaler.step the gradients are unscaled
        # already (it unscales before it calls the optimizer), so the scale is recorded and
        # not divided by (see _stats)
        now = self._launch(step.index, step.grads, None)
        return now.launch, step.grads, self.ctx.read_scale() if step.read else None, False, False

    def _versions(self, grads: Sequence[Optional[Tensor]]) -> List[int]:
        """In-place version counters of a few gradients spread over the model (the first,
        the last and two between): clipping and AMP's ``unscale_`` change every gradient,
        and reading all the counters costs about a microsecond per parameter."""
        return [-1 if grads[i] is None else grads[i]._version for i in self._version_idx]

    def _absmax_due(self, index: int, grads: Sequence[Optional[Tensor]]) -> bool:
        opts = self.ctx.options
        if "absmax" not in opts.quantities:
            return False
        g = next((g for g in grads if g is not None), None)
        on_cpu = g is None or g.device.type == "cpu"
        return (opts.absmax_cpu_schedule if on_cpu else opts.record_schedule).includes(index)

    def _stats(self, launch: Any, slots: Dict[str, Slot], grads: List[Optional[Tensor]],
               div: float, changed: bool = False) -> StepStats:
        """The host statistics, unscaled (divided by ``div``)."""
        st = self._reader.finish(launch, slots)
        if div != 1.0:
            st.norm /= div
            st.absmax /= div
            if st.extras is not None:
                for j, c in enumerate(self._reader.extras):
                    if c in ("mean", "std"):
                        st.extras[:, j] /= div
        if self._reader.rescue(st, grads, div, changed=changed):
            self.ctx.count_syncs()  # on steps with a non-finite (or overflowed) norm only
        self.ever_grad |= st.has_grad
        return st

    @staticmethod
    def _after_change(q: _Queued, bad: np.ndarray) -> Tuple[float, np.ndarray]:
        """The post-clip global norm, and the non-finite mask widened by gradients that went
        non-finite after the backward pass (a clip of an Inf makes NaN; so does a hand edit)."""
        if q.clip is None:
            return math.nan, bad
        norms = q.clip.value
        post = np.zeros(len(bad), dtype=bool)
        post[np.asarray(q.live)[~np.isfinite(norms)]] = True
        return math.sqrt(float(np.dot(norms, norms))), bad | post

    def _lr(self) -> float:
        opt = self.ctx.optimizer
        if opt is None or not opt.param_groups:
            return math.nan
        lr = opt.param_groups[0].get("lr", math.nan)
        if isinstance(lr, Tensor):
            return float(lr) if lr.device.type == "cpu" else math.nan
        try:
            return float(lr)
        except (TypeError, ValueError):
            return math.nan

    def adopt_scale(self, scale: Tensor) -> None:
        """A GradScaler found at the first optimizer step: the gradients waiting for this
        step are scaled by ``scale``; the non-finite flags kept from before are of steps it
        skipped (it never calls the optimizer on those), not of the run."""
        if self._pending is not None and self._pending.scale is None:
            self._pending.scale = scale
        self._losses.adopt_scale(scale)
        self._flags.groups.clear()

    def waiting(self) -> bool:
        """Whether a backward pass's statistics wait for their step."""
        return self._pending is not None

    def uncovered(self) -> List[str]:
        """Parameters that never had a gradient while watched."""
        return [n for n, c in zip(self.ctx.names, self.ever_grad) if not c]

    def flush(self) -> None:
        """The scales of skipped steps not read back yet (one host read, when the record is
        read)."""
        skipped, self._skipped_scales = self._skipped_scales, []
        for i, t in skipped:
            self.history.set_scale(i, float(t))

    def close(self) -> None:
        self.flush()
        self._pending = None
