"""How the step applies the gradients: at the loss's own scale (``scaled_grad``), by the
watched optimizer alone (``foreign_update``; and `Rewound`: weights rewound between steps to
their first step's values while the optimizer kept its state and its schedule), with a
learning rate that follows a schedule stepped once per optimizer step (``lr_schedule``), and
an Adam ``eps`` that leaves its adaptive scaling working (``optimizer_setup``, `AdamEps`).
Host facts of the ledger, except `Rewound`'s weight norms and `AdamEps`'s moments: device
numbers that ride a recorded step's read-back."""
from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from graddbg._args import STEP_AUDIT
from graddbg.checks.base import BackwardEnd, Finding, PolicyCheck, Step, Watched, finding as _finding, shown as _shown, \
    step_range as _steps
from graddbg.checks.ledger import LedgerKeeper, StepEntry, param_versions
from graddbg.checks.recorder import StatsRecorder

__all__ = ["ScaledStep", "ForeignUpdate", "Rewound", "AdamEps", "LrSchedule", "COLLAPSE", "COLLAPSE_SHARE",
           "EPS_DOMINATES"]

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


class Rewound(PolicyCheck):
    """``foreign_update``: every weight was written between two steps (the ledger's version
    counters) back to the very values it had at the first step (each parameter's norm equal,
    bitwise, to its norm then: a ``load_state_dict`` of the initial weights, as k-fold
    cross-validation does at each fold), while the optimizer kept its state (momentum, Adam's
    moments, built on the weights before) or the learning rate stayed where its schedule had
    taken it. The run restarts, its optimizer does not. The weights' norms are computed on the
    device at the first step and at a step whose weights were all written since the step
    before, and kept there until a step's read-back takes them (no read of their own). One
    process, plain tensors."""

    STATE = ("_reported",)

    after = (LedgerKeeper,)

    KIND = "foreign_update"

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self._on = self._on and ctx.world_size <= 1 and bool(ctx.params) and \
            all(type(p.data) is Tensor and p.layout == torch.strided for p in ctx.params)
        self._first: Optional[np.ndarray] = None  # each weight's norm at the first step
        self._taken = False  # the first step's norms were computed
        self._kept: List[Tuple[bool, int, Tensor]] = []  # (the first step's?, step, norms) on the device
        self._lrs0: tuple = ()  # each param group's lr at the first step
        self._trained = False  # a step with an lr above 0 moved weights since

    def params_added(self, k: int) -> None:
        self._on = False  # (another set of weights: the first step's norms no longer compare)
        self._kept = []

    def _all_written(self) -> bool:
        e = self.ctx.ledger.current
        return e.outside is not None and len(e.outside) == len(self.ctx) and bool(e.outside.all())

    def queue(self, step: Step) -> Any:
        if not self._on or self._reported or step.entry is None:
            return None
        first = not self._taken
        if first or (self._trained and self._all_written() and len(self._kept) < 4):
            self._taken = True
            if first:
                self._lrs0 = tuple(step.entry.lrs)
            with torch.no_grad():
                norms = torch._foreach_norm([p.detach() for p in self.ctx.params])
                dev = norms[0].device
                self._kept.append((first, step.index, torch.stack([n.to(dev) for n in norms])))
        if not step.read or not self._kept:
            return None  # (kept on the device for the next read-back)
        kept, self._kept = self._kept, []
        return [(first, at, step.readback.add("weight_norms", t)) for first, at, t in kept]

    def read(self, step: Step) -> List[Finding]:
        if not self._on or self._reported or step.entry is None:
            return []
        if not self._trained:
            last = self.ctx.ledger.last(1)  # (the step before: its entry is complete once it ended)
            self._trained = bool(last) and last[0].moved is not None and bool(last[0].moved.any()) and \
                any(lr > 0 for lr in last[0].lrs)
        for first, at, slot in step.token(self) or ():
            norms = np.asarray(slot.value, dtype=np.float64)
            if first:
                self._first = norms
            elif self._first is not None and len(norms) == len(self._first) and np.array_equal(norms, self._first) \
                    and np.any(norms > 0):
                e = self.ctx.ledger.find(at) if at != step.index else step.entry
                if e is not None:
                    return self._judge(e)
        return []

    def _judge(self, e: StepEntry) -> List[Finding]:
        opt = self.ctx.optimizer
        kept = [p for p in self.ctx.params if opt.state.get(p)]
        keys = sorted({k for p in kept for k, v in opt.state[p].items() if isinstance(v, Tensor) and k != "step"})
        lrs = [(k, now, then) for k, (now, then) in enumerate(zip(e.lrs, self._lrs0))
               if math.isfinite(now) and math.isfinite(then) and now != then]
        if not kept and not lrs:
            return []  # (the optimizer started again too: a fresh run)
        self._reported = True
        what = []
        if kept:
            what.append(f"the {type(opt).__name__} kept its state of {len(kept)} of {len(self.ctx)} parameters"
                        + (f" ({', '.join(keys)}), built on the weights before" if keys else ""))
        if lrs:
            what.append("the learning rate stayed where its schedule had taken it (" +
                        ", ".join(f"group {k}: {now:.4g}, {then:.4g} at the first step" for k, now, then in lrs[:3]) + ")")
        msg = (f"graddbg: the weights were rewound at step {e.index}: every parameter was written since the step "
               f"before, back to the values it had at the first step watched (each norm equal to its norm then), "
               f"but {'; and '.join(what)}. The model starts again; its optimizer does not. Likely cause: the initial "
               f"weights reloaded for a new run (a cross-validation fold, a restart) with the same optimizer and "
               f"scheduler. Fix: make a new optimizer and scheduler with the new run (or opt.state.clear() and "
               f"reset each group's lr).")
        return [_finding("foreign_update", e.index, list(self.ctx.names), list(self.ctx.modules), msg, self._policy,
                         self.ctx.rank)]


#: eps above this many times a weight's gradient RMS (sqrt of Adam's bias-corrected second
#: moment) makes the denominator eps: the adaptive scaling is gone ...
EPS_DOMINATES = 10.0
#: ... named when that holds for this share of the weights (by entries) with a gradient
EPS_SHARE = 0.9


class AdamEps(PolicyCheck):
    """``optimizer_setup``: an Adam-family optimizer (a state with ``exp_avg_sq``, groups with
    ``betas`` and ``eps``) whose ``eps`` exceeds `EPS_DOMINATES` times the gradients' RMS
    (the square root of the bias-corrected second moment) for `EPS_SHARE` of the weights
    with a gradient, after two audited steps in a row (`graddbg._args.STEP_AUDIT`): its
    denominator is eps, so each step is about ``lr * m / eps`` rather than ``lr * m / sqrt(v)``,
    scaled down by eps / RMS, the adaptive scaling off. The RMS per parameter is computed on
    the device after an audited step and rides the next read-back."""

    STATE = ("_reported",)

    after = (LedgerKeeper,)

    KIND = "optimizer_setup"

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        groups = ctx.optimizer.param_groups if self._on else []
        self._on = bool(groups) and all("eps" in g and "betas" in g for g in groups)
        self._pending: List[tuple] = []  # (step, watched indices, eps of each, [k, 2] on the device), to read
        self._last: Optional[int] = None  # the last audited step at which eps dominated

    def after_step(self, index: int) -> None:
        if not self._on or self._reported or not STEP_AUDIT.includes(index):
            return
        opt, where = self.ctx.optimizer, {id(p): i for i, p in enumerate(self.ctx.params)}
        ix, eps, rows = [], [], []
        with torch.no_grad():
            for g in opt.param_groups:
                for p in g["params"]:
                    st = opt.state.get(p) or {}
                    v, n = st.get("exp_avg_sq"), st.get("step")
                    if id(p) not in where or type(v) is not Tensor or n is None or not v.numel():
                        continue  # (a DTensor's moments, FSDP's: summing them would be a collective)
                    beta2 = torch.as_tensor(g["betas"][1], dtype=torch.float64, device=v.device)
                    corr = 1 - beta2 ** torch.as_tensor(n, dtype=torch.float64, device=v.device)
                    rows.append(torch.stack([(v.sum(dtype=torch.float64) / v.numel() / corr).clamp(min=0).sqrt(),
                                             corr.new_tensor(float(v.numel()))]))
                    ix.append(where[id(p)])
                    eps.append(float(g["eps"]))
        if rows and len(self._pending) < 4:  # (kept on the device until a step's read-back)
            dev = rows[0].device
            self._pending.append((index, ix, np.asarray(eps), torch.stack([r.to(dev) for r in rows])))

    def queue(self, step: Step) -> Any:
        if not self._pending or not step.read:
            return None
        pending, self._pending = self._pending, []
        return [p[:3] + (step.readback.add("adam_rms", p[3]),) for p in pending]

    def read(self, step: Step) -> List[Finding]:
        found: List[Finding] = []
        for at, ix, eps, slot in step.token(self) or ():
            if not self._reported:
                found += self._judge(at, ix, eps, np.asarray(slot.value, dtype=np.float64).reshape(len(ix), 2))
        return found

    def _judge(self, at: int, ix: List[int], eps: np.ndarray, v: np.ndarray) -> List[Finding]:
        rms, n = v.T
        live = rms > 0
        small = live & (eps > EPS_DOMINATES * rms)
        if not live.any() or n[small].sum() < EPS_SHARE * n[live].sum():
            self._last = None
            return []
        last, self._last = self._last, at
        if last is None:
            return []
        self._reported = True
        typical = float(np.median(rms[live]))
        names = [self.ctx.names[i] for i in np.asarray(ix)[small]]
        e = float(np.median(eps[small]))
        msg = (f"graddbg: {type(self.ctx.optimizer).__name__}'s eps ({e:g}) is larger than the gradients it divides at "
               f"steps {last} and {at}: for {n[small].sum() / n[live].sum():.0%} of the weights (median gradient RMS "
               f"sqrt(v) {typical:.3g}) eps is over {EPS_DOMINATES:g} times sqrt(v), so the denominator sqrt(v) + eps "
               f"is about eps: each step is lr * m / eps, about {e / typical:.3g} times smaller than Adam's "
               f"lr * m / sqrt(v), and the per-weight scaling is gone. Likely cause: an epsilon copied from a config "
               f"or another framework (TensorFlow slim's opt_epsilon defaults to 1.0). Fix: eps=1e-8 (the default), "
               f"or 1e-6 in fp16.")
        return [_finding("optimizer_setup", at, names, [self.ctx.modules[i] for i in np.asarray(ix)[small]], msg,
                         self._policy, self.ctx.rank, value=e)]


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
