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

from graddbg._collective import run_collective
from graddbg.checks.base import BackwardEnd, Check, Finding, Step, Watched
from graddbg.stats import HIST_EDGES, Readback, StepReader, StepRecord, StepStats, histogram_counts, local_values

__all__ = ["StatsRecorder"]


@dataclasses.dataclass
class _Pending:
    """Statistics launched at the end of a backward pass, waiting for the step boundary."""

    step: int
    launch: Any
    grads: List[Optional[Tensor]]
    versions: List[int]
    scale: Optional[float]


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

    def add_to(self, rb: Readback, agree: bool = False) -> None:
        """Into a read-back; ``agree``: first make the flags the same on every rank (a
        sharded model: each rank flagged its own shards)."""
        for k, (bad, first) in enumerate(self.groups.values()):
            if agree:
                _agree(bad, first)
            rb.add(f"acc_bad{k}", bad)
            rb.add(f"acc_first{k}", first)

    def take(self, got: Dict[str, np.ndarray], P: int) -> Tuple[Optional[np.ndarray], int]:
        """``(bad mask over the P parameters, first bad step)`` from a read-back; resets."""
        bad, first = None, -1
        for k, ix in enumerate(self.groups):
            b = got[f"acc_bad{k}"] > 0
            if b.any():
                f = int(got[f"acc_first{k}"][b].min())
                if bad is None:
                    bad = np.zeros(P, dtype=bool)
                bad[np.asarray(ix)[b]] = True
                first = f if first < 0 else min(first, f)
        self.groups.clear()
        return bad, first


def _agree(bad: Tensor, first: Tensor) -> None:
    """All-reduce non-finite flags (any rank) and their first steps (the earliest), in place."""
    import torch.distributed as dist

    never = torch.iinfo(torch.int64).max
    packed = torch.stack([bad.long(), -torch.where(first < 0, never, first).clamp(max=never - 1)])
    run_collective(dist.all_reduce, packed, op=dist.ReduceOp.MAX)
    bad.copy_(packed[0] > 0)
    first.copy_(torch.where(packed[0] > 0, -packed[1], -1))


class _RankFlags:
    """Under distribution: which ranks hold a non-finite gradient of each parameter (after
    the backward pass, or changed since: a hand edit, a faulty clip on one rank), agreed by
    one small all-reduce per read step, so that every rank knows at the same step, whichever
    rank holds it. Each rank adds its bit (``1 << rank``; a plain flag past 62 ranks)."""

    def __init__(self, rank: int, world: int) -> None:
        self.bit = 1 << rank if world <= 62 else 1
        self._index: Dict[Tuple[int, ...], Tensor] = {}

    def _ix(self, ix: Sequence[int], device: torch.device) -> Tensor:
        key = tuple(ix)
        t = self._index.get(key)
        if t is None or t.device != device:
            t = self._index[key] = torch.tensor(key, dtype=torch.int64, device=device)
        return t

    def queue(self, rb: Readback, launch: Any, grads: List[Optional[Tensor]], changed: bool, P: int) -> None:
        import torch.distributed as dist

        if not launch.norms:
            dev = next((g.device for g in grads if g is not None), torch.device("cpu"))
        else:
            dev = launch.norms[0].device
        local = torch.zeros(P, dtype=torch.int64, device=dev)
        with torch.no_grad():
            for ix, norms in zip(launch.groups, launch.norms):
                local.index_copy_(0, self._ix(ix, dev), (~torch.isfinite(norms)).long().to(dev))
            # the gradients as the optimizer will use them: all when a version counter moved;
            # DTensor shards always (an edit through to_local() moves no counter that is seen)
            live = [i for i, g in enumerate(grads) if g is not None and g.numel() and (changed or type(g) is not Tensor)]
            if live:  # as the optimizer will use them (local values: a DTensor's shard)
                now = torch.stack(torch._foreach_norm([local_values(grads[i]).to(dev) for i in live]))
                local.index_fill_(0, self._ix(live, dev)[~torch.isfinite(now)], 1)
            local.mul_(self.bit)
            run_collective(dist.all_reduce, local, op=dist.ReduceOp.SUM)
        rb.add("rank_bad", local)

    def read(self, got: Dict[str, np.ndarray]) -> Tuple[np.ndarray, Dict[int, List[int]]]:
        bits = got["rank_bad"].astype(np.int64)
        ranks = {int(i): [r for r in range(63) if bits[i] >> r & 1] for i in np.nonzero(bits)[0]}
        return bits > 0, ranks


class StatsRecorder(Check):
    """Per-parameter statistics into the history, and the non-finite mask of each step."""

    def __init__(self) -> None:
        self._pending: Optional[_Pending] = None
        self._flags = _Flags()
        self._hist_edges: Optional[Tensor] = None
        self.ever_grad = np.zeros(0, dtype=bool)  #: parameters that ever had a gradient

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self.history = ctx.history
        self._reader = StepReader(ctx.params, ctx.options.quantities)
        self.ever_grad = np.zeros(len(ctx), dtype=bool)
        P = len(ctx)
        self._version_idx = sorted({0, P // 3, (2 * P) // 3, P - 1}) if P else []
        self._ranks = _RankFlags(ctx.rank or 0, ctx.world_size) if ctx.world_size > 1 else None

    def params_added(self, k: int) -> None:
        self._reader = StepReader(self.ctx.params, self.ctx.options.quantities)
        self.ever_grad = np.concatenate([self.ever_grad, np.zeros(k, dtype=bool)])
        P = len(self.ctx)
        self._version_idx = sorted({0, P // 3, (2 * P) // 3, P - 1})
        self._pending = None

    # ------------------------------------------------------------------ events
    def on_backward_end(self, bw: BackwardEnd) -> None:
        if self._pending is not None:
            # gradients of a backward pass the optimizer never stepped on (zeroed, or
            # accumulated on): their non-finite flags are kept until the next read
            self._flags.add(self._pending.launch, bw.step)
        self._pending = self._launch(bw.step, bw.grads, bw.scale)

    def skipped(self, index: int) -> None:
        """The GradScaler skipped this step (its scale went down): an overflow step, whose
        scaled, non-finite gradients were thrown away by design."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.ever_grad |= np.array([g is not None for g in pending.grads], dtype=bool)
        scale = pending.scale if pending is not None and pending.scale is not None else math.nan
        self.history.append(StepRecord(index, overflow=True, scale=float(scale), lr=self._lr()))

    def queue(self, step: Step) -> None:
        launch, scale, div, changed = self._take(step)
        if not step.read:
            # no read this step: flags stay on the device (of the gradients as the optimizer
            # will use them, when they changed since the backward pass)
            self._flags.add(self._reader.launch(step.grads) if changed else launch, step.index)
            self._step_state = (None, scale, 1.0, None, None)
            return
        rb = step.readback
        self._reader.add_to(rb, launch)
        live = None
        if changed:  # changed in place since the backward pass (a clip, unscale_, a hand edit)
            live = [i for i, g in enumerate(step.grads)
                    if g is not None and type(g) is Tensor and g.layout == torch.strided]
            if live:
                rb.add("clip_norms", torch.stack(torch._foreach_norm([step.grads[i] for i in live])))
        hist = step.due_stats and self.ctx.options.histogram_schedule.includes(step.index)
        if hist:
            rb.add("hist", self._histograms(step.grads))
        self._flags.add_to(rb, agree=launch.sharded is not None and torch.distributed.is_initialized())
        if self._ranks is not None and torch.distributed.is_initialized():
            self._ranks.queue(rb, launch, step.grads, changed, len(self.ctx))
        self._step_state = (launch, scale, div, live or None, hist)

    def read(self, step: Step) -> List[Finding]:
        launch, scale, div, live, hist = self._step_state
        self._step_state = None
        if launch is None:
            self.history.append(StepRecord(step.index, scale=scale, lr=self._lr()))
            return []
        st = self._stats(launch, step.got, step.grads, div, changed=live is not None)
        bad, first = st.bad, step.index
        prior, first_prior = self._flags.take(step.got, len(self.ctx))
        if prior is not None:
            bad, first = bad | prior, first_prior
        clip_norm, bad = self._after_change(step.got, live, bad)
        if "rank_bad" in step.got:  # what any rank found, every rank knows
            anywhere, ranks = self._ranks.read(step.got)
            bad = bad | anywhere
            if anywhere.any():
                st.shard_ranks = {**ranks, **(st.shard_ranks or {})}
        if bad.any() and self.ctx.optimizer is None and self.ctx.options.scaler is not None:
            # each backward pass is a step and a GradScaler is in use: scaled gradients that
            # overflowed are the scaler's to skip, an overflow step, never an anomaly
            self.history.append(StepRecord(step.index, overflow=True, scale=scale, lr=self._lr()))
            return []
        P = len(self.ctx)
        counts = step.got["hist"].reshape(P, -1).astype(np.int64) if hist else None
        self.history.append(StepRecord(step.index, per_param=st if step.due_stats else None, global_norm=st.global_norm,
                                       clipped_norm=clip_norm, scale=scale, lr=self._lr(), hist=counts))
        step.stats, step.bad, step.first_bad, step.clipped_norm = st, bad, first, clip_norm
        return []

    # ------------------------------------------------------------------ helpers
    def _launch(self, index: int, grads: List[Optional[Tensor]], scale: Optional[float]) -> _Pending:
        launch = self._reader.launch(grads, absmax=self._absmax_due(index, grads), extras=True)
        return _Pending(index, launch, grads, self._versions(grads), scale)

    def _take(self, step: Step) -> Tuple[Any, float, float, bool]:
        """The launched statistics of this step's gradients, the loss scale in force, what
        to divide them by to unscale them, and whether the gradients changed since: those
        launched at the end of the backward pass when there was one, else launched now."""
        pending, self._pending = self._pending, None
        if pending is not None and pending.step == step.index:
            step.grads = pending.grads
            scale = pending.scale if pending.scale is not None else math.nan
            div = scale if self.ctx.options.scaler is not None and scale == scale and scale > 0 else 1.0
            return pending.launch, scale, div, self._versions(pending.grads) != pending.versions
        if pending is not None:
            self._flags.add(pending.launch, step.index)
        # launched now, at the step: inside GradScaler.step the gradients are unscaled
        # already (it unscales before it calls the optimizer), so the scale is recorded and
        # not divided by (see _stats)
        scale = self.ctx.read_scale()
        now = self._launch(step.index, step.grads, None)
        return now.launch, math.nan if scale is None else scale, 1.0, False

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

    def _stats(self, launch: Any, got: Dict[str, np.ndarray], grads: List[Optional[Tensor]],
               div: float, changed: bool = False) -> StepStats:
        """The host statistics, unscaled (divided by ``div``)."""
        st = self._reader.finish(launch, got)
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
    def _after_change(got: Dict[str, np.ndarray], live: Optional[List[int]],
                      bad: np.ndarray) -> Tuple[float, np.ndarray]:
        """The post-clip global norm, and the non-finite mask widened by gradients that went
        non-finite after the backward pass (a clip of an Inf makes NaN; so does a hand edit)."""
        if live is None:
            return math.nan, bad
        norms = got["clip_norms"]
        post = np.zeros(len(bad), dtype=bool)
        post[np.asarray(live)[~np.isfinite(norms)]] = True
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

    def adopt_scale(self, scale: float) -> None:
        """A GradScaler found at the first optimizer step: the gradients waiting for this
        step are scaled by ``scale``; the non-finite flags kept from before are of steps it
        skipped (it never calls the optimizer on those), not of the run."""
        if self._pending is not None and self._pending.scale is None:
            self._pending.scale = scale
        self._flags.groups.clear()

    def pending_scale(self) -> Optional[float]:
        """The loss scale of the backward pass waiting for its step, if any."""
        return None if self._pending is None else self._pending.scale

    def uncovered(self) -> List[str]:
        """Parameters that never had a gradient while watched."""
        return [n for n, c in zip(self.ctx.names, self.ever_grad) if not c]

    def close(self) -> None:
        self._pending = None
