"""How the step applies the gradients: at the loss's own scale (``scaled_grad``), by the
watched optimizer alone (``foreign_update``), with a learning rate that follows a schedule
stepped once per optimizer step (``lr_schedule``). Host facts of the ledger only."""
from __future__ import annotations

import math
from typing import List, Optional

import numpy as np

from graddbg.checks.base import BackwardEnd, Finding, PolicyCheck, Step, Watched, finding as _finding, shown as _shown, \
    step_range as _steps
from graddbg.checks.ledger import LedgerKeeper, StepEntry, param_versions
from graddbg.checks.recorder import StatsRecorder

__all__ = ["ScaledStep", "ForeignUpdate", "LrSchedule", "COLLAPSE", "COLLAPSE_SHARE"]

#: a learning rate under this fraction of its peak has collapsed ...
COLLAPSE = 1e-3
#: ... when it stays there for this share of the steps it took to get there (a schedule that
#: ends at zero reaches it only in its last steps)
COLLAPSE_SHARE = 0.25


class ScaledStep(PolicyCheck):
    """The optimizer stepped on gradients that a GradScaler scaled and never unscaled: the
    step is the loss scale times too large (or Inf). Reported at its first occurrence."""

    STATE = ("_reported",)

    after = (LedgerKeeper, StatsRecorder)

    KIND = "scaled_grad"
    NEEDS_OPTIMIZER = False

    def read(self, step: Step) -> List[Finding]:
        e: StepEntry = step.entry
        if self._policy is None or self._reported or e is None or not e.scaled:
            return []
        self._reported = True
        scale = f" (scale {step.scale:g})" if step.scale == step.scale else ""
        msg = (f"graddbg: gradients applied at the wrong scale at step {step.index}: the loss was multiplied by "
               f"GradScaler's scale{scale} before backward(), and optimizer.step() ran on those gradients directly: "
               f"not through scaler.step(optimizer), and the scaler had not unscaled them (no scaler.unscale_() "
               f"for this optimizer). The update is the scale times too large, and Inf/NaN steps are not skipped. "
               f"Fix: scaler.step(optimizer); scaler.update() instead of optimizer.step() (call "
               f"scaler.unscale_(optimizer) first if you clip or read the gradients).")
        return [_finding("scaled_grad", step.index, list(self.ctx.names), list(self.ctx.modules), msg,
                         self._policy, self.ctx.rank, value=step.scale)]


class ForeignUpdate(PolicyCheck):
    """Parameters changed between backward passes while the watched optimizer does not step
    (their version counters moved after it last stepped): another optimizer steps them (one
    re-created every epoch or batch), or code writes the weights. Found at a backward pass:
    the watched optimizer may never step again."""

    STATE = ("_reported",)

    after = (LedgerKeeper,)

    KIND = "foreign_update"

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self._prev: Optional[np.ndarray] = None
        self._changes: List[int] = []  # backward passes (since the last watched step) after a change

    def params_added(self, k: int) -> None:
        self._prev = None

    def after_step(self, index: int) -> None:
        self._prev, self._changes = None, []

    def on_backward_end(self, bw: BackwardEnd) -> Optional[List[Finding]]:
        if not self._on or self._reported or self.ctx.ledger.after_step_versions is None:
            return None
        if len(self.ctx.ledger.current.backwards) < 2:  # (the first backward pass since the step: nothing to compare)
            self._prev = None
            return None
        now = param_versions(self.ctx.params)
        if self._prev is not None and len(self._prev) == len(now):
            changed = now != self._prev
            if changed.any():
                self._changes.append(int(changed.sum()))
        self._prev = now
        n = len(self.ctx.ledger.current.backwards)
        if len(self._changes) < 2 or n < 3:
            return None
        self._reported = True
        last = self.ctx.ledger.last(1)[0].index if len(self.ctx.ledger) else -1
        base = self.ctx.ledger.after_step_versions
        moved = np.nonzero(now != base)[0] if len(base) == len(now) else np.arange(len(now))
        names = [self.ctx.names[i] for i in moved]
        msg = (f"graddbg: parameters changed outside the watched optimizer's step: {_shown(names)} changed between "
               f"backward passes {len(self._changes)} times since the watched "
               f"{type(self.ctx.optimizer).__name__} last stepped (step {last}; {n} backward passes since, and it "
               f"has not stepped again). Likely cause: another optimizer steps them, such as one re-created inside "
               f"the loop (every epoch or batch: its state, Adam's moments, starts again each time), or code "
               f"writes the weights. Fix: build the optimizer once, before the loop, and keep using it.")
        return [_finding("foreign_update", self.ctx.ledger.current.index if self.ctx.ledger.current.index >= 0
                         else last + 1, names, [self.ctx.modules[i] for i in moved], msg, self._policy,
                         self.ctx.rank)]


class LrSchedule(PolicyCheck):
    """The learning rate follows a schedule stepped once per optimizer step: it does not
    change between the backward passes of one step (a scheduler stepped per micro-batch
    runs accumulation-times too fast; two steps in a row), and it does not collapse to under
    `COLLAPSE` of its peak and stay there for `COLLAPSE_SHARE` of the steps it took to
    get there (a scheduler stepped per batch instead of per epoch)."""

    STATE = ("_reported", "_peak", "_low")

    after = (LedgerKeeper,)

    KIND = "lr_schedule"

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self._micro: List[int] = []
        self._peak: List[tuple] = []  # per group: (peak lr, its step)
        self._low: List[Optional[int]] = []  # per group: the first step of the current collapse

    def read(self, step: Step) -> List[Finding]:
        e: StepEntry = step.entry
        if not self._on or self._reported or e is None or not e.lrs or step.closure:
            return []
        return self._within_step(e) or self._collapse(e)

    def _within_step(self, e: StepEntry) -> List[Finding]:
        lrs = [b.lrs for b in e.backwards if b.lrs] + [e.lrs]
        if len(lrs) < 3 or all(x == lrs[0] for x in lrs):
            self._micro = []
            return []
        self._micro.append(e.index)
        if len(self._micro) < 2:
            return []
        self._reported = True
        k = len(e.backwards)
        seq = ", ".join(f"{x[0]:.4g}" for x in lrs)
        msg = (f"graddbg: the learning rate changed between the micro-batches of one step at "
               f"{_steps(self._micro[0], e.index)}: within step {e.index} it went {seq} over its {k} backward "
               f"passes (gradient accumulation), so the scheduler is stepped per micro-batch and the schedule "
               f"runs {k}x faster than planned. Fix: call scheduler.step() once per optimizer step, after "
               f"optimizer.step().")
        return [_finding("lr_schedule", e.index, [], [], msg, self._policy, self.ctx.rank, value=e.lrs[0])]

    def _collapse(self, e: StepEntry) -> List[Finding]:
        if len(self._peak) != len(e.lrs) or len(self._low) != len(e.lrs):
            self._peak, self._low = [(x, e.index) for x in e.lrs], [None] * len(e.lrs)
        for k, lr in enumerate(e.lrs):
            if not math.isfinite(lr):
                continue
            peak, at = self._peak[k]
            if lr > peak:
                self._peak[k], self._low[k] = (lr, e.index), None
                continue
            if not (peak > 0 and lr < COLLAPSE * peak):
                self._low[k] = None
                continue
            if self._low[k] is None:
                self._low[k] = e.index
            took, stayed = self._low[k] - at, e.index - self._low[k] + 1
            if stayed >= max(3, COLLAPSE_SHARE * took):
                self._reported = True
                msg = (f"graddbg: the learning rate collapsed: param group {k}'s lr fell from {peak:.4g} (step {at}) "
                       f"to under {COLLAPSE:g} of that by step {self._low[k]} ({took} steps) and is {lr:.3g} at step "
                       f"{e.index}, so the steps barely move the weights while training goes on. Likely cause: a "
                       f"scheduler stepped per batch instead of per epoch (StepLR, ExponentialLR, or "
                       f"ReduceLROnPlateau fed each batch's loss). Fix: step it once per epoch (ReduceLROnPlateau: "
                       f"with the validation metric), or size the schedule in optimizer steps.")
                return [_finding("lr_schedule", e.index, [], [], msg, self._policy, self.ctx.rank, value=lr)]
        return []
