"""Optimizer hygiene: the training mistakes that do not crash.

Each check looks at cheap facts (which gradients exist, one small parameter's gradient
before it accumulates, the weights' norms on a few probe steps) and reports a finding
once, with the step, the parameters and the likely fix:

- ``stale_grad``: gradients survive an optimizer step into the next one (``zero_grad()``
  missing: each step applies the sum of all previous gradients);
- ``empty_step``: a step without the gradients backward computed (``zero_grad()`` between
  ``backward()`` and ``step()``), or a step before any backward;
- ``orphan_param``: parameters that receive gradients, belong to no param group of the
  optimizer, and stay unchanged (a head replaced after the optimizer was built);
- ``no_update``: parameters in a param group whose non-zero gradient the step leaves
  unchanged, step after step (an ``lr`` of 0, a step that skips them);
- ``dead_grad``: a gradient that was non-zero and is now exactly zero, step after step
  (a layer whose ReLUs died), distinct from small ("vanishing") gradients;
- ``unused_param``: trainable parameters that never received a gradient while watched
  (found when the watch closes: `unused_anomaly`).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from graddbg.anomaly import Anomaly
from graddbg.checks.base import BackwardEnd, Check, Finding, Step, Watched
from graddbg.stats import local_values

__all__ = ["StaleGrad", "EmptyStep", "Unchanged", "DeadGrad", "unused_anomaly", "PROBE_EVERY", "PATIENCE"]

#: recorded steps between probes of the weights (besides the first three recorded steps)
PROBE_EVERY = 20
#: probes (Unchanged) or recorded steps (DeadGrad) in a row before a finding
PATIENCE = 3
DEAD_PATIENCE = 5
#: a gradient norm below this fraction of the step's global norm counts as zero (Unchanged)
RELATIVE_NOISE = 1e-6


def _shown(names: Sequence[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _finding(kind: str, step: int, names: List[str], modules: List[str], message: str, policy: Any,
             rank: Optional[int], value: float = float("nan")) -> Finding:
    a = Anomaly(step=step, kind=kind, name=names[0] if names else None, module=modules[0] if modules else None,
                op=None, value=value, threshold=None, source=None, message=message, rank=rank,
                params=tuple(names))
    return Finding(a, policy, skip=[])


class StaleGrad(Check):
    """``zero_grad()`` missing. One small parameter's gradient is looked at, on the device,
    each time a gradient is about to accumulate into it: if no backward pass between two
    optimizer steps found it cleared (None or all zero), the gradients of the earlier step
    were carried into the later one. Gradient accumulation clears before its first
    micro-batch, so it is not this."""

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self._policy = ctx.options.stale_grad
        self._steps = 0  # optimizer steps taken
        self._backwards = 0  # backward passes into the probe since the last step
        self._cleared: Any = False  # True, or a device bool: seen cleared since the last step
        self._reported = self._check = False
        self._probe: Optional[int] = None
        self._after: tuple = (0, -1)
        if self._policy is None or ctx.optimizer is None or not ctx.params:
            return
        held = {id(p) for g in ctx.optimizer.param_groups for p in g["params"]}
        mine = [k for k, p in enumerate(ctx.params) if id(p) in held]
        if not mine:
            return
        i = min(mine, key=lambda k: ctx.params[k].numel())  # (one the optimizer's zero_grad clears)
        self._probe = i
        ctx.hooks.add(ctx.params[i].register_hook(self._before_accumulate))

    def _before_accumulate(self, incoming: Tensor) -> None:
        if self._steps == 0 or self._cleared is True or not self.ctx.alive():
            return None
        self._backwards += 1
        g = self.ctx.params[self._probe].grad
        if g is None or id(g) != self._after[0] or g._version != self._after[1]:
            # set to None, replaced, or changed in place (zero_()) since the step: cleared,
            # known on the host for free
            self._cleared = True
            return None
        with torch.no_grad():  # (the same tensor, untouched by version: ``.data.zero_()`` or stale)
            zero = (local_values(g) == 0).all()
        self._cleared = zero if self._cleared is False else self._cleared | zero
        return None

    def queue(self, step: Step) -> None:
        self._check = self._probe is not None and not self._reported and self._steps > 0 \
            and self._backwards > 0 and self._cleared is not True and step.read
        if self._check:
            step.readback.add("stale_cleared", self._cleared.reshape(1))

    def read(self, step: Step) -> List[Finding]:
        if not getattr(self, "_check", False) or step.got["stale_cleared"][0] > 0:
            return []
        self._reported = True
        ctx = self.ctx
        name = ctx.names[self._probe]
        msg = (f"graddbg: stale gradients at step {step.index} in {_shown(ctx.names)}: the gradients of the "
               f"previous optimizer step were still there when the next backward pass added to them (checked "
               f"on {name}, never found cleared between the two steps), so this step applies the sum of all "
               f"earlier gradients. "
               f"Likely cause: optimizer.zero_grad() is missing. Fix: call optimizer.zero_grad() (or "
               f"model.zero_grad()) once per step, before backward() - or after step().")
        return [_finding("stale_grad", step.index, list(ctx.names), list(ctx.modules), msg, self._policy,
                         ctx.rank)]

    def after_step(self, index: int) -> None:
        self._steps += 1
        self._backwards, self._cleared = 0, False
        if self._probe is not None:
            g = self.ctx.params[self._probe].grad
            self._after = (id(g), -1 if g is None else g._version)  # (an id only compared while g lives)


class EmptyStep(Check):
    """An optimizer step that finds no gradient at all (every ``.grad`` None, or every one
    exactly zero) although backward ran since the previous step, or before any backward."""

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self._policy = ctx.options.empty_step
        self._backwards = 0
        self._ever = False
        self._reported = False
        self._on = self._policy is not None and ctx.optimizer is not None

    def on_backward_end(self, bw: BackwardEnd) -> None:
        self._backwards += 1
        self._ever = True

    def read(self, step: Step) -> List[Finding]:
        backwards, self._backwards = self._backwards, 0
        if not self._on or self._reported or step.closure:
            return []
        none = all(p.grad is None for p in self.ctx.params)  # (now: step.grads may be the backward's)
        zero = step.stats is not None and bool(step.stats.has_grad.any()) and step.stats.global_norm == 0.0
        if not (none or (zero and backwards > 0)):
            return []
        self._reported = True
        if backwards == 0 and not self._ever:
            why = ("optimizer.step() was called before any backward pass. Fix: call loss.backward() "
                   "before optimizer.step()")
        elif backwards == 0:
            why = ("optimizer.step() was called with no backward pass since the previous step, and the "
                   "gradients were cleared. Fix: call loss.backward() before optimizer.step() in every step")
        else:
            why = (f"{backwards} backward pass(es) computed gradients since the previous step, but they were "
                   f"{'set to None' if none else 'zeroed'} before the step. Likely cause: optimizer.zero_grad() "
                   f"between backward() and step(). Fix: call zero_grad() before backward() or after step()")
        msg = (f"graddbg: an optimizer step without gradients at step {step.index} "
               f"({_shown(self.ctx.names)}): {why}.")
        return [_finding("empty_step", step.index, list(self.ctx.names), list(self.ctx.modules), msg,
                         self._policy, self.ctx.rank)]


class Unchanged(Check):
    """Parameters with a non-zero gradient (above ``RELATIVE_NOISE`` of the step's global
    norm) that the optimizer's step leaves bitwise unchanged, on ``PATIENCE`` probe steps
    in a row. A probe compares the weights' norms
    before and after the step on the device (read with the next read-back), on the first
    three recorded steps and every ``PROBE_EVERY``-th. Parameters in no param group are
    ``orphan_param``; the others ``no_update``."""

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        opts = ctx.options
        self._policies = {"orphan_param": opts.orphan_param, "no_update": opts.no_update}
        self._on = ctx.optimizer is not None and any(p is not None for p in self._policies.values())
        self._before: Optional[List[Tensor]] = None
        self._pending: Optional[tuple] = None  # (step, [P] unchanged flags on the device, grad mask)
        self._queued: Optional[tuple] = None
        self._count = np.zeros(len(ctx), dtype=np.int64)
        self._reported = np.zeros(len(ctx), dtype=bool)
        self._probes = 0

    def params_added(self, k: int) -> None:
        self._count = np.concatenate([self._count, np.zeros(k, dtype=np.int64)])
        self._reported = np.concatenate([self._reported, np.zeros(k, dtype=bool)])
        self._before = self._pending = None

    def _norms(self) -> Tensor:
        with torch.no_grad():
            return torch.stack(torch._foreach_norm([local_values(p) for p in self.ctx.params])).double()

    def queue(self, step: Step) -> None:
        self._queued, pending = None, self._pending
        if pending is not None and step.read:
            step.readback.add("unchanged", pending[1])
            self._queued, self._pending = pending, None

    def read(self, step: Step) -> List[Finding]:
        found = self._conclude(step) if self._queued is not None else []
        recorded = step.index // self.ctx.options.every
        if self._on and not step.closure and step.stats is not None and step.due_stats and \
                (recorded < 3 or recorded % PROBE_EVERY == 0) and len(self.ctx):
            present = np.array([g is not None for g in self.ctx.grads()], dtype=bool)
            st = step.stats  # (a gradient below 1e-6 of the step's global norm is noise: a bias before a
            # shift-invariant op has a true gradient of 0 and a float one of 1e-9)
            moving = present & st.has_grad & (st.norm > RELATIVE_NOISE * st.global_norm)
            self._before = (step.index, self._norms(), moving)
        return found

    def after_step(self, index: int) -> None:
        before, self._before = self._before, None
        if before is not None and before[0] == index:
            self._pending = (index, (self._norms() == before[1]).double(), before[2])

    def _conclude(self, step: Step) -> List[Finding]:
        index, _, moving = self._queued
        self._queued = None
        same = step.got["unchanged"] > 0
        hit = same & moving
        self._count = np.where(hit, self._count + 1, np.where(moving, 0, self._count))
        new = (self._count >= PATIENCE) & ~self._reported
        if not new.any():
            return []
        self._reported |= new
        held = {id(p) for g in self.ctx.optimizer.param_groups for p in g["params"]}
        idx = np.nonzero(new)[0]
        orphans = [int(i) for i in idx if id(self.ctx.params[i]) not in held]
        stuck = [int(i) for i in idx if id(self.ctx.params[i]) in held]
        return [f for f in (self._orphans(index, orphans), self._stuck(index, stuck)) if f is not None]

    def _orphans(self, index: int, idx: List[int]) -> Optional[Finding]:
        policy = self._policies["orphan_param"]
        if not idx or policy is None:
            return None
        names = [self.ctx.names[i] for i in idx]
        msg = (f"graddbg: parameters outside the optimizer at step {index}: {_shown(names)} receive non-zero "
               f"gradients but belong to no param group of {type(self.ctx.optimizer).__name__}, so they never "
               f"change ({PATIENCE} checked steps in a row). Likely cause: a layer replaced or added after the "
               f"optimizer was built, or a parameter list that left them out (e.g. BatchNorm layers). Fix: build "
               f"the optimizer after the model is final, from model.parameters() (or add_param_group).")
        return _finding("orphan_param", index, names, [self.ctx.modules[i] for i in idx], msg, policy,
                        self.ctx.rank)

    def _stuck(self, index: int, idx: List[int]) -> Optional[Finding]:
        policy = self._policies["no_update"]
        if not idx or policy is None:
            return None
        names = [self.ctx.names[i] for i in idx]
        lrs = sorted({float(g.get("lr", float("nan"))) for g in self.ctx.optimizer.param_groups
                      if any(p is self.ctx.params[i] for p in g["params"] for i in idx)})
        msg = (f"graddbg: parameters not updated at step {index}: {_shown(names)} have non-zero gradients, but "
               f"the optimizer's step left them bitwise unchanged ({PATIENCE} checked steps in a row; their "
               f"param group's lr: {', '.join(f'{x:g}' for x in lrs)}). Likely cause: a learning rate of 0 (a "
               f"scheduler, a wrong param-group key), or a step that skips them (a wrapper, a compiled step). "
               f"Fix: check the optimizer's param_groups and the scheduler.")
        return _finding("no_update", index, names, [self.ctx.modules[i] for i in idx], msg, policy, self.ctx.rank)


class DeadGrad(Check):
    """A parameter whose gradient was non-zero and has been exactly zero for
    ``DEAD_PATIENCE`` recorded steps in a row (dead ReLUs, a saturated gate)."""

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self._policy = ctx.options.dead_grad
        self._alive = np.zeros(len(ctx), dtype=bool)  # had a non-zero gradient once
        self._run = np.zeros(len(ctx), dtype=np.int64)
        self._reported = np.zeros(len(ctx), dtype=bool)

    def params_added(self, k: int) -> None:
        for a in ("_alive", "_run", "_reported"):
            old = getattr(self, a)
            setattr(self, a, np.concatenate([old, np.zeros(k, dtype=old.dtype)]))

    def read(self, step: Step) -> List[Finding]:
        st = step.stats
        if self._policy is None or st is None or not step.due_stats:
            return []
        zero = st.has_grad & (st.norm == 0)
        self._alive |= st.has_grad & (st.norm > 0)
        if not zero.any() and not self._run.any():
            return []  # (the common step)
        self._run = np.where(zero & self._alive, self._run + 1, 0)
        new = (self._run >= DEAD_PATIENCE) & ~self._reported
        if not new.any():
            return []
        self._reported |= new
        idx = np.nonzero(new)[0]
        names = [self.ctx.names[i] for i in idx]
        modules = list(dict.fromkeys(self.ctx.modules[i] for i in idx))
        msg = (f"graddbg: dead gradients at step {step.index}: {_shown(names)} had non-zero gradients before "
               f"and have had exactly zero gradients for {DEAD_PATIENCE} recorded steps (layer "
               f"{', '.join(m or '<root>' for m in modules[:3])}). Likely cause: every unit after it is dead "
               f"(ReLUs that only see negative inputs after a large step) or saturated. Fix: a lower learning "
               f"rate, LeakyReLU/GELU, or a better initialisation; distinct from small (vanishing) gradients.")
        return [_finding("dead_grad", step.index, names, [self.ctx.modules[i] for i in idx], msg, self._policy,
                         self.ctx.rank, value=0.0)]


def unused_anomaly(names: List[str], ctx: Watched, step: int) -> Anomaly:
    """The ``unused_param`` finding: ``names`` never received a gradient up to ``step``."""
    shown = _shown(names, 10)
    modules = [ctx.modules[ctx.names.index(n)] for n in names]
    msg = (f"graddbg.watch: {len(names)} trainable parameter(s) never received a gradient while watched "
           f"(steps 0-{step}): {shown}. Likely cause: they are unused in the forward pass, or cut off "
           f"by a .detach() (or their gradients are computed elsewhere). Fix: remove or freeze them "
           f"(requires_grad_(False)), or remove the .detach(); w.coverage() lists them.")
    return Anomaly(step=step, kind="unused_param", name=names[0], module=modules[0], op=None,
                   value=float(len(names)), threshold=None, source=None, message=msg, rank=ctx.rank,
                   params=tuple(names))
