"""Optimizer hygiene: the training mistakes that do not crash, as broken invariants of a
healthy step read from the step ledger (`graddbg.checks.ledger`).

Each check reads the host facts of every step (which gradients exist, what the backward
passes found in them, their identities and version counters, the param groups' learning
rates, which parameters the step changed) and the statistics of recorded steps, and reports
a finding once, with the step, the parameters, the evidence and the likely fix:

- ``stale_grad``: gradients survive an optimizer step into the next one (``zero_grad()``
  missing: each step applies the sum of all previous gradients);
- ``empty_step``: steps without the gradients backward computed, ``PATIENCE`` in a row
  (``zero_grad()`` between ``backward()`` and ``step()``, or ``step()`` before backward);
  one empty step (a skipped batch) is not a finding;
- ``double_step``: one set of gradients applied by two optimizer steps (no backward pass
  between them and the very same gradient tensors, untouched), twice;
- ``orphan_param``: parameters that receive gradients, belong to no param group of the
  optimizer, and that nothing changes (a head replaced after the optimizer was built);
- ``no_update``: parameters in a param group whose non-zero gradient the step leaves
  unchanged (their version counters do not move) or whose group's ``lr`` is 0, ``PATIENCE``
  steps in a row;
- ``dead_grad``: a gradient exactly zero step after step, after having been non-zero (a
  layer whose ReLUs died) or since its first step (dead from initialisation), distinct
  from small ("vanishing") gradients;
- ``unused_param``: trainable parameters that never received a gradient while watched
  (found when the watch closes: `unused_anomaly`);
- ``applied_grad``, also: each step applies only its last backward pass's gradients, the
  passes before it (from the same ``backward()`` line) cleared by the next (`Discarded`:
  ``zero_grad()`` inside a gradient-accumulation loop);
- ``nonfinite``, also: a GradScaler that skips every step, its loss scale fallen below 1
  (`ScalerSkips`): the gradients are not finite at any scale, so no overflow explains it.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np
import torch

from graddbg.anomaly import Anomaly
from graddbg.checks.base import BackwardEnd, Check, Finding, PolicyCheck, Step, Watched, finding as _finding, shown as _shown, \
    step_range as _steps
from graddbg._model import unwrap
from graddbg.checks.graph import StrayLoss, library_owner, stray_loss
from graddbg.checks.ledger import LedgerKeeper, StepEntry
from graddbg.checks.recorder import StatsRecorder
from graddbg.stats import local_values

__all__ = ["StaleGrad", "EmptyStep", "ScalerSkips", "Discarded", "DoubleStep", "EvalMode", "Unchanged", "DeadGrad", "unused_anomaly", "PATIENCE"]

#: steps in a row (EmptyStep, Unchanged) or recorded steps (DeadGrad) before a finding
PATIENCE = 3
DEAD_PATIENCE = 5
#: a gradient norm below this fraction of the step's global norm counts as zero (Unchanged)
RELATIVE_NOISE = 1e-6


class StaleGrad(PolicyCheck):
    """``zero_grad()`` missing: no backward pass between two optimizer steps found the
    gradients cleared. The ledger's probe tells, per backward pass, whether the gradient it
    accumulated into was None, replaced, changed in place (``zero_()``) or kept; a kept one
    is looked at on the device (``.data.zero_()`` moves no version counter), read with the
    step's read-back. Gradient accumulation clears before its first micro-batch, so it is
    not this."""

    STATE = ("_reported",)

    after = (LedgerKeeper,)

    KIND = "stale_grad"

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self._zero: Any = None  # a device bool: the kept gradient was all zero at some backward pass
        self._probe: Optional[int] = None

    def on_backward_end(self, bw: BackwardEnd) -> None:
        if not self._on or self._reported:
            return
        ledger = self.ctx.ledger
        if ledger.current.backwards and ledger.current.backwards[-1].held == "kept" and ledger.probe is not None:
            g = self.ctx.params[ledger.probe].grad
            if g is not None:
                with torch.no_grad():
                    zero = (local_values(g) == 0).all()  # (as it is now: after this pass accumulated)
                self._zero = zero if self._zero is None else self._zero | zero

    def queue(self, step: Step) -> Any:
        zero, self._zero = self._zero, None
        e: StepEntry = step.entry
        if not self._on or self._reported or not step.read or e is None or not e.backwards:
            return None
        if len(self.ctx.ledger) == 0 or any(b.held in ("none", "cleared", "replaced", "first", "-")
                                                 for b in e.backwards):
            return None
        return step.readback.add("stale_zero", zero.reshape(1)) if zero is not None else True

    def read(self, step: Step) -> List[Finding]:
        token = step.token(self)
        if token is None or (token is not True and token.value[0] > 0):
            return []
        self._reported = True
        ctx = self.ctx
        name = ctx.names[ctx.ledger.probe]
        n = len(step.entry.backwards)
        msg = (f"graddbg: stale gradients at step {step.index} in {_shown(ctx.names)}: the gradients of the "
               f"previous optimizer step were still there when the next backward pass added to them (the "
               f"ledger: {n} backward pass(es) since step {step.index - 1}, each found {name}'s gradient as that "
               f"step left it - not set to None, not zeroed, not replaced), so this step applies the sum of all "
               f"earlier gradients. Likely cause: optimizer.zero_grad() is missing (or called on another "
               f"model or optimizer). Fix: call optimizer.zero_grad() once per step, before backward() - or "
               f"after step().")
        return [_finding("stale_grad", step.index, list(ctx.names), list(ctx.modules), msg, self._policy,
                         ctx.rank)]


class EmptyStep(PolicyCheck):
    """Optimizer steps that find no gradient (every ``.grad`` None, or every one exactly
    zero), ``PATIENCE`` in a row: one such step (a skipped batch) is harmless."""

    STATE = ("_reported", "_ever")

    after = (LedgerKeeper, StatsRecorder)

    KIND = "empty_step"

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self._run: List[StepEntry] = []
        self._ever = False

    def read(self, step: Step) -> List[Finding]:
        e: StepEntry = step.entry
        if not self._on or self._reported or step.closure or e is None:
            return []
        none = e.present is not None and not e.present.any()
        zero = step.stats is not None and bool(step.stats.has_grad.any()) and step.stats.global_norm == 0.0
        # (non-zero where backward ended, exactly zero at the step: made zero in between, a clip to 0)
        cut = step.stats is not None and step.stats.global_norm > 0.0 and step.clipped_norm == 0.0
        if not (none or ((zero or cut) and e.backwards)):
            self._run = []
            self._ever = self._ever or bool(e.backwards)
            return []
        self._run.append(e)
        if len(self._run) < PATIENCE:
            return []
        self._reported = True
        run, first = self._run, self._run[0].index
        backwards = [len(x.backwards) for x in run]
        stray = stray_loss(self.ctx.params) if not any(backwards) else None
        if stray is not None:
            why = _stray_text(stray, type(self.ctx.optimizer).__name__)
        elif first == 0 and not backwards[0] and not self._ever:
            why = ("the first step came before any backward pass, and each step since found the gradients of "
                   "the backward pass before it cleared. Likely cause: optimizer.step() is called before "
                   "loss.backward() in the loop (the zero_grad() at its top then clears them). Fix: call "
                   "loss.backward() before optimizer.step()")
        elif not any(backwards):
            why = ("no backward pass ran between these steps, and the gradients had been cleared. Likely cause: "
                   "step() before backward() (or backward() skipped). Fix: call loss.backward() before "
                   "optimizer.step() in every step")
        elif cut:
            why = (f"the backward pass before each of them made non-zero gradients (global norm "
                   f"{step.stats.global_norm:.4g} when it ended), and they were multiplied to exactly 0 before the "
                   f"step (global norm 0 at the step). Likely cause: clip_grad_norm_ (or clip_grad_value_) with a "
                   f"max of 0, meant as 'no clipping', which scales every gradient by 0. Fix: skip the clip when "
                   f"the max is 0 (or pass float('inf'))")
        else:
            why = (f"backward passes computed gradients before each of them ({', '.join(map(str, backwards))}), "
                   f"but they were {'set to None' if none else 'zeroed'} before the step. Likely cause: "
                   f"optimizer.zero_grad() between backward() and step(). Fix: call zero_grad() before backward() "
                   f"or after step()")
        msg = (f"graddbg: optimizer steps without gradients at {_steps(first, step.index)} "
               f"({_shown(self.ctx.names)}, {len(run)} in a row): {why}.")
        return [_finding("empty_step", step.index, list(self.ctx.names), list(self.ctx.modules), msg,
                         self._policy, self.ctx.rank)]


def _stray_text(stray: StrayLoss, opt: str) -> str:
    """Why the steps found no gradient, when the loss in the user's frame went through
    parameters none of which is watched."""
    owner = (f"module {stray.owner!r} ({stray.owner_type}: {_shown(list(stray.params))})" if stray.owner else
             f"{len(stray.params)} parameter(s) of shapes {', '.join(stray.params[:4])}, held by no module the loop names")
    ran = ("; those have gradients, so a backward pass ran through them" if stray.ran else "")
    held = f", which the {opt} holds" if opt else ""
    return (f"the loss {stray.name!r} ({stray.where}) went through {owner}, none of them a parameter of the "
            f"watched model{held}{ran}. Likely cause: the loss is computed with another copy of the model "
            f"(copy.deepcopy, a model re-created or re-wrapped after the optimizer or the watch was built). Fix: compute "
            f"the loss with the watched model, or watch (and optimize) the model the loss uses")


class ScalerSkips(Check):
    """``nonfinite``: the GradScaler skipped every one of the last steps (``SKIPS`` and
    more in a row) and its loss scale has fallen below 1. A skipped step is an overflow by
    design, and each halves the scale until the scaled gradients fit; once the scale is
    below 1 the loss is shrunk, not magnified, and the gradients are still inf or NaN: no
    scale makes them finite, so a NaN or Inf made by the model or the loss (a sqrt or log at
    0, a division by 0) is what every step throws away, and the weights no longer train.
    Host facts (the ledger's skipped steps) on every step; the scale is read (one host
    synchronisation) only after ``SKIPS`` skipped steps in a row, and again every ``SKIPS``."""

    STATE = ("_reported",)
    SKIPS = 8

    after = (LedgerKeeper,)

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self._det = ctx.options.nonfinite
        self._reported = False
        self._checked = -1  # (the step whose scale was read last)

    def on_backward_end(self, bw: BackwardEnd) -> Optional[List[Finding]]:
        if self._det is None or self._reported or bw.scale is None or self.ctx.ledger is None \
                or bw.step - self._checked < self.SKIPS:
            return None
        run = self.ctx.ledger.last(self.SKIPS)
        if len(run) < self.SKIPS or not all(e.skipped for e in run):
            return None
        self._checked = bw.step
        self.ctx.count_syncs()
        scale = float(bw.scale.reshape(()).item())
        if not scale < 1.0:
            return None
        self._reported = True
        entries = self.ctx.ledger.entries
        last = next((e.index for e in reversed(entries) if not e.skipped), None)  # (the last step applied)
        start = last + 1 if last is not None else entries[0].index
        since = (f"no step has changed the weights since step {last}" if last is not None else
                 "no step has changed the weights since the watch began")
        msg = (f"graddbg: the GradScaler skipped every step from step {start} to step {run[-1].index} "
               f"({run[-1].index - start + 1} in a row): each found inf or NaN gradients, and its loss scale has "
               f"fallen to {scale:.3g}, below 1, so the gradients are not finite at any scale. That is not an "
               f"overflow (which a lower scale cures) but a NaN or Inf made by the model or the loss, and {since}. "
               f"Likely cause: an op whose gradient is infinite where it is evaluated (sqrt or log at 0, pow with "
               f"a negative base, a division by 0). Fix: find it with graddbg.find_nonfinite(model) around one "
               f"step, and guard it (sqrt(x + eps), clamp).")
        return [_finding("nonfinite", bw.step, [], [], msg, self._det.policy, self.ctx.rank, value=scale)]


class Discarded(PolicyCheck):
    """``applied_grad``: steps that apply the gradients of their last backward pass only.
    Several backward passes ran from one ``backward()`` line between two steps (the
    micro-batches of an accumulation loop), each pass after the first found the gradient
    the pass before had left set to None (``zero_grad()``'s default), and nothing replaced
    the gradients before the step (a projection or a sum set by hand, as PCGrad or
    per-sample clipping do, replaces them; a clip or an unscale changes them in place): the
    first passes' gradients were thrown away. ``PATIENCE`` such steps in a row. Not judged:
    steps with a closure (L-BFGS evaluates it several times, clearing each time), steps
    after weights were written since the previous step (SAM's perturbed second pass). Host
    facts of the ledger only."""

    STATE = ("_reported",)
    KIND = "applied_grad"

    after = (LedgerKeeper,)

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self._run: List[StepEntry] = []

    def read(self, step: Step) -> List[Finding]:
        e: Optional[StepEntry] = step.entry
        if not self._on or self._reported or e is None:
            return []
        if step.closure or not _discarded(e):
            self._run = []
            return []
        self._run.append(e)
        if len(self._run) < PATIENCE:
            return []
        self._reported = True
        first, passes = self._run[0].index, len(e.backwards)
        line = e.backwards[0].line
        msg = (f"graddbg: each step applied the gradients of its last backward pass only, at "
               f"{_steps(first, step.index)}: {passes} backward passes ran from the same line ({line[0]}:{line[1]}) "
               f"between one step and the next, and each pass after the first found the gradients the pass before "
               f"had left set to None, so the first {passes - 1} passes' gradients were thrown away before the step "
               f"(nothing replaced the gradients after the last pass). Likely cause: optimizer.zero_grad() inside "
               f"the gradient-accumulation loop. Fix: call zero_grad() once per optimizer step, after step() or "
               f"before the first micro-batch.")
        return [_finding("applied_grad", step.index, [], [], msg, self._policy, self.ctx.rank,
                         value=float(passes))]


def _discarded(e: StepEntry) -> bool:
    """Whether the step's passes came from one line and each cleared the one before, and
    the gradients reached the step as the last pass left them, or changed in place (a clip,
    an unscale), not replaced; no weight was written since the previous step."""
    passes = e.backwards
    if len(passes) < 2 or e.path not in ("optimizer", "scaler") or e.present is None or not e.present.any():
        return False
    if (e.replaced is not None and e.replaced.any()) or (e.outside is not None and e.outside.any()):
        return False
    line = passes[0].line
    # (only None is evidence of a discarded gradient: one changed in place may have been scaled, by
    # a clip inside the loop, as well as zeroed)
    return line is not None and all(b.line == line for b in passes) and all(b.held == "none" for b in passes[1:])


class DoubleStep(PolicyCheck):
    """One set of gradients applied twice: a step with no backward pass since the previous
    one finds the very gradient tensors that step applied, untouched (same identities and
    version counters). Reported on its second occurrence."""

    STATE = ("_reported",)

    after = (LedgerKeeper,)

    KIND = "double_step"

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self._seen: List[int] = []

    def read(self, step: Step) -> List[Finding]:
        e: StepEntry = step.entry
        if not self._on or self._reported or step.closure or e is None or e.backwards:
            return []
        if e.same_as_last_step is None or not e.same_as_last_step.any():
            return []
        self._seen.append(step.index)
        if len(self._seen) < 2:
            return []
        self._reported = True
        idx = np.nonzero(e.same_as_last_step)[0]
        names = [self.ctx.names[i] for i in idx]
        msg = (f"graddbg: the same gradients applied twice at steps {', '.join(map(str, self._seen))}: each of these "
               f"optimizer steps came with no backward pass since the step before it and found the very gradient "
               f"tensors that step had applied, untouched ({_shown(names)}), so they moved the weights a second "
               f"time. Likely cause: optimizer.step() called twice per iteration (e.g. once in the loop and once "
               f"in a helper or callback). Fix: one optimizer.step() per backward pass (or per accumulation cycle).")
        return [_finding("double_step", step.index, names, [self.ctx.modules[i] for i in idx], msg, self._policy,
                         self.ctx.rank)]


class EvalMode(PolicyCheck):
    """Training steps whose forward passes ran in eval mode (``model.training`` False, its
    dropout and batch-norm layers in eval mode) after earlier steps trained in training mode,
    two steps in a row: ``model.eval()`` (for a validation pass) not undone. A model without
    such layers behaves the same in both modes: not a finding. A run that is in eval mode
    from its first step (a deliberate choice: frozen batch statistics) is not either."""

    STATE = ("_reported", "_trained")

    after = (LedgerKeeper,)

    KIND = "eval_mode"
    NEEDS_OPTIMIZER = False

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self._trained: Optional[int] = None  # the last step whose forward passes ran in training mode
        self._run: List[int] = []

    def read(self, step: Step) -> List[Finding]:
        e: StepEntry = step.entry
        if self._policy is None or self._reported or e is None or not e.forwards:
            return []
        if all(f.training for f in e.forwards):
            self._trained, self._run = step.index, []
            return []
        evals = [f for f in e.forwards if not f.training and f.eval_layers]
        if self._trained is None or not evals:
            return []
        self._run.append(step.index)
        if len(self._run) < 2:
            return []
        self._reported = True
        layers = max(f.eval_layers for f in evals)
        msg = (f"graddbg: training steps in eval mode at {_steps(self._run[0], step.index)}: the forward passes "
               f"that fed these steps ran with model.training False ({layers} dropout / batch-norm layer(s) in eval "
               f"mode: no dropout, batch norm using its running statistics), while step {self._trained} and "
               f"those before it trained in training mode. Likely cause: model.eval() for a validation pass, not "
               f"undone. Fix: call model.train() before the training steps resume.")
        return [_finding("eval_mode", step.index, [], [], msg, self._policy, self.ctx.rank)]


class Unchanged(Check):
    """Parameters with a non-zero gradient (above ``RELATIVE_NOISE`` of the step's global
    norm) that the optimizer's step leaves unchanged, ``PATIENCE`` steps in a row, read on
    every step from the ledger: a version counter that did not move during the step means
    the weight is bitwise unchanged, and a param group's lr of 0 means the step cannot move
    it. Parameters in no param group (and changed by nothing else) are ``orphan_param``; the
    others ``no_update``. A step's entry is complete after the step, so it is judged at the
    next boundary."""

    STATE = ("_reported",)

    after = (LedgerKeeper, StatsRecorder)

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        opts = ctx.options
        self._policies = {"orphan_param": opts.orphan_param, "no_update": opts.no_update}
        self._on = ctx.optimizer is not None and any(p is not None for p in self._policies.values())
        self._count = np.zeros(len(ctx), dtype=np.int64)
        self._first = np.zeros(len(ctx), dtype=np.int64)
        self._reported = np.zeros(len(ctx), dtype=bool)
        self._moving: Optional[Tuple[int, np.ndarray]] = None
        self._groups: Tuple[Any, np.ndarray] = (None, np.zeros(0, dtype=np.int64))
        self._peak = np.zeros(0)  # each param group's highest lr so far
        self._last = np.zeros(0)  # each param group's last positive lr

    def params_added(self, k: int) -> None:
        for a in ("_count", "_first", "_reported"):
            old = getattr(self, a)
            setattr(self, a, np.concatenate([old, np.zeros(k, dtype=old.dtype)]))
        self._moving, self._groups = None, (None, np.zeros(0, dtype=np.int64))

    def read(self, step: Step) -> List[Finding]:
        if not self._on or not len(self.ctx):
            return []
        found = self._judge(self._moving)
        self._moving = None
        st = step.stats
        if st is not None and step.due_stats and not step.closure:
            present = np.fromiter((g is not None for g in step.grads), dtype=bool, count=len(step.grads))
            # (a gradient below 1e-6 of the step's global norm is noise: a bias before a
            # shift-invariant op has a true gradient of 0 and a float one of 1e-9)
            self._moving = (step.index, present & st.has_grad & (st.norm > RELATIVE_NOISE * st.global_norm))
        return found

    def close(self) -> None:
        self._moving = None

    def _group_of(self) -> np.ndarray:
        """Per parameter: the index of the param group holding it, -1 for none (cached
        while the param groups keep their shape)."""
        groups = self.ctx.optimizer.param_groups
        key = (len(groups), tuple(len(g["params"]) for g in groups), id(groups[-1]["params"]) if groups else 0)
        if self._groups[0] != key or len(self._groups[1]) != len(self.ctx):
            where = {id(p): k for k, g in enumerate(groups) for p in g["params"]}
            self._groups = (key, np.array([where.get(id(p), -1) for p in self.ctx.params], dtype=np.int64))
        return self._groups[1]

    def _judge(self, moving: Optional[Tuple[int, np.ndarray]]) -> List[Finding]:
        if moving is None:
            return []
        e = self.ctx.ledger.find(moving[0])
        if e is None or e.moved is None or len(e.moved) != len(self.ctx) or e.skipped:
            return []
        group = self._group_of()
        lrs = np.append(np.asarray(e.lrs, dtype=np.float64), np.nan)  # (index -1: held by no group)
        # (an lr of 0 that a schedule brought down gradually is the schedule's, judged by
        # lr_schedule; one the group always had, or dropped to from near its peak in one step
        # (a hand edit), means the step cannot move it)
        n = len(e.lrs)
        peak = np.append(self._peak, np.zeros(max(0, n - len(self._peak))))[:n]
        last = np.append(self._last, np.zeros(max(0, n - len(self._last))))[:n]
        now = np.nan_to_num(lrs[:-1], nan=0.0)
        self._peak, self._last = np.fmax(peak, now), np.where(now > 0, now, last)
        frozen = np.append((peak == 0.0) | (last >= 0.5 * peak), False)
        at = np.where(group < n, group, -1)
        lr0 = (lrs[at] == 0.0) & frozen[at]
        outside = e.outside if e.outside is not None and len(e.outside) == len(e.moved) else np.zeros_like(e.moved)
        # (held: not moved by the step, or an lr of 0; held by none: changed by nothing at all)
        stuck = moving[1] & np.where(group >= 0, ~e.moved | lr0, ~e.moved & ~outside)
        self._first = np.where(stuck & (self._count == 0), e.index, self._first)
        self._count = np.where(stuck, self._count + 1, np.where(moving[1], 0, self._count))
        new = (self._count >= PATIENCE) & ~self._reported
        if not new.any():
            return []
        self._reported |= new
        idx = np.nonzero(new)[0]
        orphans = [int(i) for i in idx if group[i] < 0]
        stuck_ix = [int(i) for i in idx if group[i] >= 0]
        return [f for f in (self._orphans(e.index, orphans), self._stuck(e, stuck_ix, group, lr0))
                if f is not None]

    def _orphans(self, index: int, idx: List[int]) -> Optional[Finding]:
        policy = self._policies["orphan_param"]
        if not idx or policy is None:
            return None
        names = [self.ctx.names[i] for i in idx]
        first = int(self._first[idx].min())
        msg = (f"graddbg: parameters outside the optimizer at {_steps(first, index)}: {_shown(names)} received "
               f"non-zero gradients at each of these steps, belong to no param group of "
               f"{type(self.ctx.optimizer).__name__}, and nothing changed them (their version counters did not "
               f"move). Likely cause: a layer replaced or added after the optimizer was built, or a parameter "
               f"list that left them out (e.g. BatchNorm layers). Fix: build the optimizer after the model is "
               f"final, from model.parameters() (or add_param_group).")
        return _finding("orphan_param", index, names, [self.ctx.modules[i] for i in idx], msg, policy,
                        self.ctx.rank)

    def _stuck(self, e: StepEntry, idx: List[int], group: np.ndarray, lr0: np.ndarray) -> Optional[Finding]:
        policy = self._policies["no_update"]
        if not idx or policy is None:
            return None
        names = [self.ctx.names[i] for i in idx]
        first = int(self._first[idx].min())
        groups = sorted({int(group[i]) for i in idx})
        lrs = ", ".join(f"group {k}: {e.lrs[k]:g}" for k in groups if k < len(e.lrs))
        if lr0[idx].all():
            why = (f"their param group's learning rate is 0 ({lrs}). Likely cause: a scheduler that reached 0, "
                   f"or a per-group lr (a name-keyed dict) that missed them. Fix: check the optimizer's "
                   f"param_groups and the scheduler")
        else:
            why = (f"the optimizer's step did not touch them (their version counters did not move; {lrs}). "
                   f"Likely cause: an optimizer (a wrapper, a compiled or custom step) that skips them. Fix: check "
                   f"which parameters the step updates")
        msg = (f"graddbg: parameters not updated at {_steps(first, e.index)}: {_shown(names)} had non-zero "
               f"gradients at each of these steps, and {why}.")
        return _finding("no_update", e.index, names, [self.ctx.modules[i] for i in idx], msg, policy, self.ctx.rank)


def _relu_kinds(model: Any) -> str:
    """The ReLU-family modules the model holds, by class name ("" when none): a host fact
    the dead-unit cause must agree with."""
    kinds = (torch.nn.ReLU, torch.nn.ReLU6, torch.nn.Hardtanh, torch.nn.Threshold)
    found = sorted({type(m).__name__ for m in model.modules() if isinstance(m, kinds)}) if model is not None else []
    return "/".join(found)


class DeadGrad(PolicyCheck):
    """A parameter whose gradient has been exactly zero for ``DEAD_PATIENCE`` recorded steps
    in a row: after having been non-zero (dead ReLUs, a saturated gate), or since its
    first gradient (dead from initialisation)."""

    STATE = ("_reported", "_alive")

    after = (StatsRecorder,)

    KIND = "dead_grad"
    NEEDS_OPTIMIZER = False

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self._alive = np.zeros(len(ctx), dtype=bool)  # had a non-zero gradient once
        self._run = np.zeros(len(ctx), dtype=np.int64)
        self._since = np.zeros(len(ctx), dtype=np.int64)
        self._reported = np.zeros(len(ctx), dtype=bool)

    def params_added(self, k: int) -> None:
        for a in ("_alive", "_run", "_since", "_reported"):
            old = getattr(self, a)
            setattr(self, a, np.concatenate([old, np.zeros(k, dtype=old.dtype)]))

    def read(self, step: Step) -> List[Finding]:
        st = step.stats
        if self._policy is None or st is None or not step.due_stats:
            return []
        zero = st.has_grad & (st.norm == 0)
        if not zero.any() and not self._run.any():
            self._alive |= st.has_grad
            return []  # (the common step)
        self._since = np.where(zero & (self._run == 0), step.index, self._since)
        self._run = np.where(zero, self._run + 1, np.where(st.has_grad, 0, self._run))
        new = (self._run >= DEAD_PATIENCE) & ~self._reported
        was_alive = self._alive.copy()
        self._alive |= st.has_grad & (st.norm > 0)
        if not new.any():
            return []
        self._reported |= new
        idx = np.nonzero(new)[0]
        names = [self.ctx.names[i] for i in idx]
        modules = list(dict.fromkeys(self.ctx.modules[i] for i in idx))
        layers = ", ".join(m or "<root>" for m in modules[:3])
        since = int(self._since[idx].min())
        if was_alive[idx].any():
            relus = _relu_kinds(self.ctx.model)
            cause = (f"every unit after it is dead (the model's {relus} units only see negative inputs after a "
                     f"large step) or saturated. Fix: a lower learning rate, LeakyReLU/GELU, or a better "
                     f"initialisation" if relus else
                     "every path from it to the loss is saturated or gated off (the model has no ReLU module; "
                     "a functional relu, a clamp, a hard gate or a mask can do it). Fix: a lower learning rate, "
                     "or check the ops after this layer")
            msg = (f"graddbg: dead gradients at step {step.index}: {_shown(names)} had non-zero gradients before "
                   f"and have had exactly zero gradients since step {since} ({DEAD_PATIENCE} recorded steps in a "
                   f"row; layer {layers}). Likely cause: {cause}; distinct from small (vanishing) gradients.")
        else:
            msg = (f"graddbg: gradients exactly zero since the first step: {_shown(names)} (layer {layers}) have "
                   f"received exactly zero gradients at every recorded step from step {since} on ({DEAD_PATIENCE} "
                   f"in a row), so they have never trained. Likely cause: dead from initialisation (weights "
                   f"initialised to zero or a constant, so that the units after them are dead or identical), or a "
                   f"loss term multiplied by 0. Fix: a standard initialisation (nn.init.kaiming_uniform_ / the "
                   f"layer's default), and check the loss weights.")
        return [_finding("dead_grad", step.index, names, [self.ctx.modules[i] for i in idx], msg, self._policy,
                         self.ctx.rank, value=0.0)]


def unused_facts(names: List[str], ctx: Watched) -> Tuple[List[str], List[str], List[str]]:
    """``names`` (parameters that never had a gradient) split into those no param group
    holds (trained by copying: a target network, an EMA or teacher copy), those a library's
    module holds (BERT's pooler: unused by the library's design), and the others."""
    held = ctx.held_by_optimizer() if ctx.optimizer is not None else None
    ids = dict(zip(ctx.names, map(id, ctx.params)))
    root = unwrap(ctx.model) if ctx.model is not None else None
    copied, library, rest = [], [], []
    for n in names:
        if held is not None and n in ids and ids[n] not in held:
            copied.append(n)
        elif root is not None and n in ids and library_owner(root, ctx.modules[ctx.names.index(n)]) is not None:
            library.append(n)
        else:
            rest.append(n)
    return copied, library, rest


def fact_anomaly(names: List[str], ctx: Watched, step: int, copied: bool) -> Anomaly:
    """The ``unused_param`` fact: ``names`` never had a gradient, by design (``copied``: no
    param group holds them; else a library's module holds them)."""
    modules = [ctx.modules[ctx.names.index(n)] for n in names]
    if copied:
        why = (f"no param group of the {type(ctx.optimizer).__name__} holds them, so the optimizer never trains "
               f"them (a target network, an EMA or teacher copy is trained by copying)")
    else:
        root = unwrap(ctx.model)
        owners = dict.fromkeys(library_owner(root, m) for m in modules)
        why = "they belong to " + ", ".join(f"{path or '<root>'} ({cls}, from {pkg})" for path, cls, pkg in owners) + \
              (", a layer the library builds whether or not the loss uses its output (as BERT's pooler under "
               "mean pooling)")
    msg = (f"graddbg.watch: a fact, not a bug: {len(names)} trainable parameter(s) never received a gradient while "
           f"watched (steps 0-{step}): {_shown(names, 10)}: {why}. Nothing to fix if that is intended; to silence "
           f"it, freeze them (requires_grad_(False)) or pass unused_param=None.")
    return Anomaly(step=step, kind="unused_param", name=names[0], module=modules[0], op=None,
                   value=float(len(names)), threshold=None, source=None, message=msg, rank=ctx.rank,
                   params=tuple(names), severity="fact")


def unused_anomaly(names: List[str], ctx: Watched, step: int, forwards: int = -1) -> Anomaly:
    """The ``unused_param`` finding: ``names`` never received a gradient up to ``step``
    (``forwards``: the model's forward passes the watch saw; 0: none, so no cause that the
    forward pass would show is claimed)."""
    shown = _shown(names, 10)
    modules = [ctx.modules[ctx.names.index(n)] for n in names]
    stray = stray_loss(ctx.params) if forwards == 0 else None
    if stray is not None:
        why = _stray_text(stray, type(ctx.optimizer).__name__ if ctx.optimizer is not None else "")
    elif forwards == 0:
        why = ("the watch never saw the model's forward pass run (it is called another way: model.forward(...) "
               "or another method, not model(...)), so it cannot tell where they were cut off. Check that they "
               "take part in the loss; w.coverage() lists them")
    else:
        why = ("they are unused in the forward pass, or cut off by a .detach() (or their gradients are "
               "computed elsewhere). Fix: remove or freeze them (requires_grad_(False)), or remove the "
               ".detach(); w.coverage() lists them")
    msg = (f"graddbg.watch: {len(names)} trainable parameter(s) never received a gradient while watched "
           f"(steps 0-{step}): {shown}{': ' if stray is not None else '. Likely cause: '}{why}.")
    return Anomaly(step=step, kind="unused_param", name=names[0], module=modules[0], op=None,
                   value=float(len(names)), threshold=None, source=None, message=msg, rank=ctx.rank,
                   params=tuple(names))
