"""The statistics recorder: the first check, and the only one that reads gradient values
on the hot path.

At the end of each backward pass it launches the statistics kernels of
`graddbg.stats.StepReader` (so that a clip between backward and step does not hide
the pre-clip gradient); at the step boundary it queues their results for the one read-back,
then fills the `graddbg.checks.base.Step` (statistics unscaled, the non-finite mask)
and appends the step to the history. Non-finite flags of backward passes that the optimizer
never stepped on, and of steps not read, accumulate on the device until the next read.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from graddbg._args import AUTO, Schedule
from graddbg._dist.collective import run_collective
from graddbg._model import in_backward
from graddbg.checks.base import BackwardEnd, Check, Finding, Step, Watched
from graddbg.checks.graph import LossSum
from graddbg.checks.ledger import LedgerKeeper
from graddbg.stats import HIST_EDGES, Readback, Slot, StepReader, StepRecord, StepStats, histogram_counts, \
    local_values

__all__ = ["StatsRecorder"]


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
    live: Optional[List[int]] = None  #: gradients changed since the backward pass ...
    clip: Optional[Slot] = None  #: ... and their norms now
    hist: Optional[Slot] = None
    flags: Optional[List[Tuple[Slot, Slot]]] = None
    rank_bad: Optional[Tuple[Slot, Optional[Slot]]] = None
    skipped: List[Tuple[int, Slot]] = dataclasses.field(default_factory=list)  #: scales of skipped steps
    loss: Optional[Slot] = None  #: the sum of the step's losses handed to backward()
    collect: bool = False  #: this step's read exchanges statistics with other ranks


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


#: the replica checks' default cadence under distribution (graddbg.checks.replicas.AUTO_EVERY)
REPLICA_EVERY = 100


class _RankFlags:
    """Under distribution: which ranks of the replica group (the ranks that hold the same
    parameters) hold a non-finite gradient of each parameter (after the backward pass, or
    changed since: a hand edit, a faulty clip on one rank), agreed by one small all-reduce
    per read step over that group only (with the replicas' gradient hash, under DDP), so
    that every replica knows at the same step, whichever holds it. Each rank adds its bit (``1 << its rank in the group``; a plain flag
    past 62 ranks)."""

    def __init__(self, group: Any, replicated: bool = False, shard_replicas: Optional[tuple] = None) -> None:
        import torch.distributed as dist

        self.group = group
        #: the ranks of the group hold equal gradients (DDP): a hash of the norms is compared too
        self.replicated = replicated or shard_replicas is not None
        #: (k, j, m): the group's ranks hold k distinct shards, this rank the j-th, m ranks each
        #: (HSDP): the hash of the shards' norms is compared among the m ranks of each; DDP:
        #: one "shard", held by every rank of the group
        self.slots = shard_replicas or (1, 0, dist.get_world_size(group))
        self.shards_hashed = shard_replicas is not None
        size, me = dist.get_world_size(group), dist.get_rank(group)
        self.bit = 1 << me if size <= 62 else 1
        self.ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(min(size, 63))]
        self._index: Dict[Tuple[int, ...], Tensor] = {}

    def _ix(self, ix: Sequence[int], device: torch.device) -> Tensor:
        key = tuple(ix)
        t = self._index.get(key)
        if t is None or t.device != device:
            t = self._index[key] = torch.tensor(key, dtype=torch.int64, device=device)
        return t

    def queue(self, rb: Readback, launch: Any, grads: List[Optional[Tensor]], changed: bool, P: int,
              weights: Optional[List[Tensor]] = None) -> Slot:
        import torch.distributed as dist

        if not launch.norms:
            dev = next((g.device for g in grads if g is not None), torch.device("cpu"))
        else:
            dev = launch.norms[0].device
        k, j, m = self.slots
        local = torch.zeros(P + 2 * k if self.replicated else P, dtype=torch.int64, device=dev)
        with torch.no_grad():
            for ix, norms in zip(launch.groups, launch.norms):
                local.index_copy_(0, self._ix(ix, dev), (~torch.isfinite(norms)).long().to(dev))
            # the gradients as the optimizer will use them: all when a version counter moved;
            # DTensor shards always (an edit through to_local() moves no counter that is seen)
            live = [i for i, g in enumerate(grads) if g is not None and g.numel() and (changed or type(g) is not Tensor)]
            now = None
            if live:  # as the optimizer will use them (local values: a DTensor's shard)
                now = torch.stack(torch._foreach_norm([local_values(grads[i]).to(dev) for i in live]))
                local.index_fill_(0, self._ix(live, dev)[~torch.isfinite(now)], 1)
            local[:P].mul_(self.bit)
            differ = None
            if self.replicated:
                h = self._hash(launch, dev, P, live, now, weights)
                local[P + 2 * j: P + 2 * j + 2] = torch.stack([h, h * h])
            run_collective(dist.all_reduce, local, op=dist.ReduceOp.SUM, group=self.group)
            if self.replicated:
                # per shard, m * sum(h^2) - sum(h)^2 = sum over pairs of (h_a - h_b)^2: zero exactly
                # when the hashes of the ranks holding it agree (modulo 2**64: a false "same" once
                # in ~2**64), decided from the reduced values only, so every rank decides alike
                s1, s2 = local[P::2], local[P + 1::2]
                differ = (s2 * m != s1 * s1).any().reshape(1).long()
        return rb.add("rank_bad", local[:P]), (rb.add("replica_hash", differ) if differ is not None else None)

    def _hash(self, launch: Any, dev: torch.device, P: int, live: List[int], now: Optional[Tensor],
              weights: Optional[List[Tensor]] = None) -> Tensor:
        """Replicas (DDP) hold the same reduced gradients, so the same norms, bit for bit: a
        52-bit hash of this rank's norms (of the gradients as the optimizer will use them:
        ``now`` for those changed since the backward pass), exchanged with the non-finite
        flags in the same all-reduce (as ``h`` and ``h * h``)."""
        applied = torch.zeros(P, dtype=torch.float64, device=dev)
        for k, (ix, norms) in enumerate(zip(launch.groups, launch.norms)):
            if launch.sharded is None or k != launch.sharded[0] or self.shards_hashed:
                applied.index_copy_(0, self._ix(ix, dev), norms.double().to(dev))
        if now is not None:
            applied.index_copy_(0, self._ix(live, dev), now.double())
        if weights:  # (the weights too, on the replica checks' steps: a replica whose weights drifted)
            applied = torch.cat([applied, torch.stack(torch._foreach_norm(weights)).double().to(dev)])
        # (a non-finite norm is the non-finite check's: NaN payloads may differ between ranks)
        applied = torch.nan_to_num(applied, nan=0.0, posinf=0.0, neginf=0.0)
        bits = applied.view(torch.int64)
        coef = torch.arange(1, 2 * bits.numel(), 2, dtype=torch.int64, device=bits.device) * 0x9E3779B97F4A7C1
        h = (bits * coef).sum()  # (wraps modulo 2**64)
        return ((h ^ (h >> 29)) & ((1 << 52) - 1)).to(dev)

    def read(self, slots: Tuple[Slot, Optional[Slot]]) -> Tuple[np.ndarray, Dict[int, List[int]], bool]:
        """(non-finite somewhere, per parameter; the global ranks holding each; the replicas'
        gradients differ)."""
        bad_slot, hash_slot = slots
        bits = bad_slot.value.astype(np.int64)
        ranks = {int(i): [self.ranks[r] for r in range(len(self.ranks)) if bits[i] >> r & 1]
                 for i in np.nonzero(bits)[0]}
        # (a non-finite gradient on some rank is the non-finite check's finding, not a replica's)
        differ = hash_slot is not None and hash_slot.value[0] != 0 and not bits.any()
        return bits > 0, ranks, bool(differ)


def _is_ddp(model: Any) -> bool:
    """Whether ``model`` is wrapped in DistributedDataParallel (its ranks hold equal gradients)."""
    return type(model).__name__ == "DistributedDataParallel" or \
        isinstance(model, getattr(torch.nn.parallel, "DistributedDataParallel", ()))


class StatsRecorder(Check):
    """Per-parameter statistics into the history, and the non-finite mask of each step."""

    STATE = ("ever_grad",)

    after = (LedgerKeeper,)

    def __init__(self) -> None:
        self._pending: Optional[_Pending] = None
        self._flags = _Flags()
        self._hist_edges: Optional[Tensor] = None
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
        self._ranks: Optional[_RankFlags] = None  # (made once the replica group is known)
        every = ctx.options.ddp_check_every  # (the replica checks' cadence: the weights in the replicas' hash)
        self._weigh_replicas = Schedule(REPLICA_EVERY if every == AUTO else every)

    def params_added(self, k: int) -> None:
        self._reader = StepReader(self.ctx.params, self.ctx.options.quantities)
        self.ever_grad = np.concatenate([self.ever_grad, np.zeros(k, dtype=bool)])
        P = len(self.ctx)
        self._version_idx = sorted({0, P // 3, (2 * P) // 3, P - 1})
        self._pending = None

    # ------------------------------------------------------------------ events
    def on_backward_end(self, bw: BackwardEnd) -> None:
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
        if collect and self._ranks is None and layout.replica_group is not None:
            on = self.ctx.options.ddp_check_every is not None
            self._ranks = _RankFlags(layout.group(layout.replica_group),
                                     replicated=(_is_ddp(self.ctx.model) or layout.ddp_stages) and on,
                                     shard_replicas=layout.shard_replicas if on else None)
        self._reader.shard_group(layout.shards_over() if collect else False)
        return collect

    def queue(self, step: Step) -> Optional[_Queued]:
        collect = self._exchanges(step.index)
        launch, scale, unscale, changed = self._take(step)
        loss = self._losses.take()
        if not step.read:
            # no read this step: flags stay on the device (of the gradients as the optimizer
            # will use them, when they changed since the backward pass)
            self._flags.add(self._reader.launch(step.grads) if changed else launch, step.index)
            return None
        rb = step.readback
        q = _Queued(launch, rb.add("scale", scale.reshape(1)) if scale is not None else None, unscale,
                    self._reader.add_to(rb, launch))
        q.collect, q.loss = collect, rb.add("loss", loss) if loss is not None else None
        q.skipped = [(i, rb.add("skipped_scale", t.reshape(1))) for i, t in self._skipped_scales]
        self._skipped_scales = []
        if changed:  # changed in place since the backward pass (a clip, unscale_, a hand edit)
            q.live = [i for i, g in enumerate(step.grads)
                      if g is not None and type(g) is Tensor and g.layout == torch.strided] or None
            if q.live:
                q.clip = rb.add("clip_norms", torch.stack(torch._foreach_norm([step.grads[i] for i in q.live])))
        if step.due_stats and self.ctx.options.histogram_schedule.includes(step.index):
            q.hist = rb.add("hist", self._histograms(step.grads))
        layout = self.ctx.layout
        shards = collect and layout.shard_group is not False  # (False: this rank's shards only)
        q.flags = self._flags.add_to(rb, agree=launch.sharded is not None and shards,
                                     group=layout.group(layout.shard_group) if shards else None)
        if self._ranks is not None and collect:
            weights = None
            if self._ranks.shards_hashed and self._weigh_replicas.includes(step.index):
                weights = [local_values(p.detach()) for p in self.ctx.params]
            q.rank_bad = self._ranks.queue(rb, launch, step.grads, changed, len(self.ctx), weights)
        return q

    def read(self, step: Step) -> List[Finding]:
        q: Optional[_Queued] = step.token(self)
        layout = self.ctx.layout
        if self.ctx.history.stage is None and layout is not None and layout.pipeline:
            self.ctx.history.stage = layout.param_stages()  # (a ``stage`` column in w.stats)
        if q is None:
            self.history.append(StepRecord(step.index, scale=math.nan, lr=self._lr()))
            return []
        for i, slot in q.skipped:
            self.history.set_scale(i, float(slot.value[0]))
        scale = float(q.scale.value[0]) if q.scale is not None else math.nan
        loss = float(q.loss.value[0]) if q.loss is not None else math.nan
        div = scale if q.unscale and scale == scale and scale > 0 else 1.0
        st = self._stats(q.launch, q.stats, step.grads, div, changed=q.live is not None)
        bad, first = st.bad, step.index
        prior, first_prior = self._flags.take(q.flags, len(self.ctx))
        if prior is not None:
            bad, first = bad | prior, first_prior
        clip_norm, bad = self._after_change(q, bad)
        if q.rank_bad is not None:  # what any rank found, every rank knows
            anywhere, ranks, step.replicas_differ = self._ranks.read(q.rank_bad)
            bad = bad | anywhere
            if anywhere.any():
                st.shard_ranks = {**ranks, **(st.shard_ranks or {})}
        if q.collect:  # every stage's norm and non-finite flag, over the pipeline group
            self._stages(step, st, bad)
        if bad.any() and self.ctx.optimizer is None and self.ctx.options.scaler is not None:
            # each backward pass is a step and a GradScaler is in use: scaled gradients that
            # overflowed are the scaler's to skip, an overflow step, never an anomaly
            self.history.append(StepRecord(step.index, overflow=True, scale=scale, lr=self._lr(), loss=loss))
            return []
        P = len(self.ctx)
        counts = q.hist.value.reshape(P, -1).astype(np.int64) if q.hist is not None else None
        self.history.append(StepRecord(step.index, per_param=st if step.due_stats else None, global_norm=st.global_norm,
                                       clipped_norm=clip_norm, scale=scale, lr=self._lr(), hist=counts,
                                       loss=loss))
        step.stats, step.bad, step.first_bad, step.clipped_norm, step.scale = st, bad, first, clip_norm, scale
        if step.entry is not None:
            step.entry.global_norm, step.entry.clipped_norm, step.entry.scale = st.global_norm, clip_norm, scale
        return []

    # ------------------------------------------------------------------ helpers
    def _stages(self, step: Step, st: StepStats, bad: np.ndarray) -> None:
        """The per-step summary of a pipeline (or of ranks holding different parameters):
        the whole model's global norm, and where a non-finite gradient that arrived at this
        stage from the next one came from (no replay then: it started elsewhere)."""
        layout = self.ctx.layout
        report = layout.exchange(st.norm, st.has_grad, bad, differ=step.index if step.replicas_differ else None)
        if report is None:
            return
        st.__dict__["global_norm"] = layout.global_norm(report)  # (the whole model's, on every rank)
        step.stages = report
        came = layout.arrival(report)
        if came is not None and bad.any():
            step.origin, step.capture = came, None
        elif bad.any():  # (several stages here: the last forward pass of the one that made it, if any)
            step.capture = layout.capture(report) or step.capture

    def _launch(self, index: int, grads: List[Optional[Tensor]], scale: Optional[Tensor]) -> _Pending:
        launch = self._reader.launch(grads, absmax=self._absmax_due(index, grads), extras=True)
        return _Pending(index, launch, grads, self._versions(grads), scale)

    def _take(self, step: Step) -> Tuple[Any, Optional[Tensor], bool, bool]:
        """The launched statistics of this step's gradients, the loss scale in force (a
        device tensor, or None), whether to divide the statistics by it to unscale them,
        and whether the gradients changed since: those launched at the end of the backward
        pass when there was one, else launched now."""
        pending, self._pending = self._pending, None
        layout = self.ctx.layout
        at_step = layout is not None and layout.pipeline and self.ctx.optimizer is not None
        if pending is not None and pending.step == step.index and not at_step:
            step.grads = pending.grads
            unscale = self.ctx.options.scaler is not None and pending.scale is not None
            entry = step.entry  # (the ledger's version counters of every gradient, or a few sampled)
            changed = bool(entry.changed.any()) if entry is not None and entry.changed is not None else \
                self._versions(pending.grads) != pending.versions
            return pending.launch, pending.scale, unscale, changed
        if pending is not None:
            self._flags.add(pending.launch, step.index)
        # launched now, at the step: inside GradScaler.step the gradients are unscaled
        # already (it unscales before it calls the optimizer), so the scale is recorded and
        # not divided by (see _stats)
        now = self._launch(step.index, step.grads, None)
        return now.launch, self.ctx.read_scale() if step.read else None, False, False

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
            self.ctx.host_syncs += 1  # on steps with a non-finite (or overflowed) norm only
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

    def _histograms(self, grads: Sequence[Optional[Tensor]]) -> Tensor:
        dev = next((g.device for g in grads if g is not None), torch.device("cpu"))
        if self._hist_edges is None or self._hist_edges.device != dev:
            self._hist_edges = torch.tensor(HIST_EDGES, dtype=torch.float64, device=dev)
        nb = len(HIST_EDGES) + 1
        return torch.stack([histogram_counts(g, self._hist_edges) if g is not None
                            else torch.zeros(nb, dtype=torch.int64, device=dev) for g in grads])

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
