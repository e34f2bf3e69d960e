"""Hand-written update loops (``watch(model)`` without an optimizer), issue 39 point 2: the
invariants of a step hold between backward passes too.

Without an optimizer each backward pass is a step, and the user's own code updates the
weights between them (``p -= lr * p.grad`` under ``no_grad``, ``p.data.add_(...)``). The
invariant checked here: the gradients an update consumed are cleared before the next
backward pass adds to them. One small parameter (the probe) is looked at just before each
backward pass accumulates into its gradient (a tensor hook): whether its gradient is the very
tensor the previous pass left, untouched (same identity and version counter), and, on the
device, whether it is all zero (``.data.zero_()`` moves no version counter) and whether the
weights moved since that pass (an update ran; ``.data`` updates move no version counter
either, so the values are compared). The two flags ride the step's read-back: no host
synchronisation of its own. Accumulating over several backward passes with no update
between them is gradient accumulation, not this. And the invariant that an update moves
every parameter with a gradient (`ManualUnmoved`, on the step audit's steps), by the
gradient's step and a decay towards zero only (`ManualRule`), and that nothing moves them
while a forward pass and its backward pass run (`ManualDuring`).
"""
from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from graddbg._args import STEP_AUDIT
from graddbg.checks.base import BackwardEnd, Finding, PolicyCheck, Step, Watched, finding, shown
from graddbg.checks.budget import nbytes
from graddbg.checks.ledger import LedgerKeeper

__all__ = ["ManualStale", "ManualUnmoved", "ManualRule", "ManualDuring"]


class ManualStale(PolicyCheck):
    """``stale_grad`` in a hand-written update loop: an update ran between two backward
    passes and the second found the gradients the first left (not cleared), so each update
    applies the sum of all earlier gradients."""

    STATE = ("_reported",)
    KIND = "stale_grad"
    NEEDS_OPTIMIZER = False

    after = (LedgerKeeper,)

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self._on = self._on and ctx.optimizer is None and bool(ctx.params)
        self._probe: Optional[int] = None
        self._left: Optional[Tuple[int, int, Tensor]] = None  # (grad id, grad version, the weights) after a pass
        self._flags: Optional[Tensor] = None  # [2] on the device: kept and non-zero, weights moved
        self._run: List[int] = []  # the steps whose backward pass found the last pass's gradient kept
        if not self._on:
            return
        i = min(range(len(ctx.params)), key=lambda k: ctx.params[k].numel())
        if ctx.params[i].numel() > 1 << 16:
            self._on = False  # (no small parameter to probe cheaply)
            return
        self._probe = i
        ctx.hooks.add(ctx.params[i].register_hook(self._before_accumulate))

    def params_added(self, k: int) -> None:
        self._left, self._flags = None, None

    def _before_accumulate(self, incoming: Tensor) -> None:
        if not self.ctx.alive() or self._left is None or self._reported:
            return None
        p = self.ctx.params[self._probe]
        g = p.grad
        gid, gver, weights = self._left
        if g is None or id(g) != gid or g._version != gver:
            self._flags = None  # (set to None, replaced, or changed in place: cleared)
            return None
        with torch.no_grad():
            self._flags = torch.stack([(g != 0).any(), (p.detach() != weights).any()])
        return None

    def on_backward_end(self, bw: BackwardEnd) -> None:
        if not self._on or self._reported:
            return
        p = self.ctx.params[self._probe]
        g = p.grad
        with torch.no_grad():
            self._left = None if g is None else (id(g), g._version, p.detach().clone())

    def queue(self, step: Step) -> Any:
        flags, self._flags = self._flags, None
        if flags is None or not step.read:
            if flags is None:
                self._run = []
            return None
        return step.readback.add("manual_stale", flags)

    def read(self, step: Step) -> List[Finding]:
        slot = step.token(self)
        if slot is None:
            return []
        kept_nonzero, moved = (bool(v) for v in slot.value)
        if not (kept_nonzero and moved):
            self._run = []
            return []
        self._run.append(step.index)
        if len(self._run) < 2:
            return []
        self._reported = True
        ctx = self.ctx
        name = ctx.names[self._probe]
        first = self._run[0]
        msg = (f"graddbg: stale gradients in a hand-written update loop (no optimizer) at steps {first}-{step.index}: "
               f"between each backward pass and the next the weights changed (an update ran: {name} differs from its "
               f"value when the previous backward pass ended), and the next backward pass found {name}'s gradient "
               f"exactly as the previous one left it - the same tensor, not set to None, not zeroed - and added to "
               f"it. So each update applies the sum of all earlier gradients. Fix: clear the gradients after each "
               f"update (p.grad = None for each parameter, or model.zero_grad()).")
        return [finding("stale_grad", step.index, list(ctx.names), list(ctx.modules), msg, self._policy, ctx.rank)]

    def close(self) -> None:
        self._left = self._flags = None



class ManualUnmoved(PolicyCheck):
    """``no_update`` in a hand-written update loop: the update moves some parameters but
    leaves others with non-zero gradients unchanged, in two audited intervals in a row (an
    update loop over only some of the parameters). On the steps of `graddbg._args.STEP_AUDIT`
    the weights are copied when a backward pass ends (within the weight budget's size) and
    compared on the device when the next one ends; the flags ride its read-back. An interval
    in which nothing moved (gradient accumulation) counts neither way."""

    STATE = ("_reported",)
    KIND = "no_update"
    NEEDS_OPTIMIZER = False

    after = (LedgerKeeper,)

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self._on = self._on and ctx.optimizer is None and bool(ctx.params)
        self._snap: Optional[Tuple[int, List[Tensor], Tensor]] = None  # (step, weights, grads non-zero)
        self._flags: Optional[Tuple[int, Tensor]] = None  # (step, [2, P]: moved, grad non-zero)
        self._stuck: Optional[Tuple[int, np.ndarray]] = None  # the last interval's unmoved parameters

    def params_added(self, k: int) -> None:
        self._snap = self._flags = self._stuck = None

    def on_backward_end(self, bw: BackwardEnd) -> None:
        if not self._on or self._reported:
            return
        params = self.ctx.params
        snap, self._snap = self._snap, None
        with torch.no_grad():
            if snap is not None and snap[0] == bw.step - 1:
                moved = torch.stack([(p.detach() != c).any() for p, c in zip(params, snap[1])])
                self._flags = (snap[0], torch.stack([moved, snap[2]]))
            if not STEP_AUDIT.includes(bw.step):
                return
            sizes = nbytes(params, self.ctx.numel)
            if sum(sizes) > self.ctx.budget.limit(int(sum(sizes))):
                return  # (the weights do not fit the budget: not audited)
            nonzero = torch.stack([(g != 0).any() if g is not None else torch.zeros((), dtype=torch.bool,
                                                                                   device=p.device)
                                   for p, g in zip(params, bw.grads)])
            self._snap = (bw.step, [p.detach().clone() for p in params], nonzero)

    def queue(self, step: Step) -> Any:
        flags, self._flags = self._flags, None
        if flags is None or not step.read:
            return None
        return flags[0], step.readback.add("manual_moved", flags[1].to(torch.int8))

    def read(self, step: Step) -> List[Finding]:
        token = step.token(self)
        if token is None:
            return []
        at, slot = token
        moved, nonzero = (np.asarray(r, dtype=bool) for r in slot.value.reshape(2, -1))
        if not moved.any():
            return []  # (no update in this interval: accumulation)
        stuck = nonzero & ~moved
        last, self._stuck = self._stuck, (at, stuck)
        if not stuck.any() or last is None or last[0] != at - 1 or not (stuck & last[1]).any():
            return []
        self._reported = True
        both = np.nonzero(stuck & last[1])[0]
        names, moving = [self.ctx.names[i] for i in both], [self.ctx.names[i] for i in np.nonzero(moved)[0]]
        msg = (f"graddbg: parameters not updated in a hand-written update loop (no optimizer): after the backward "
               f"passes of steps {last[0]} and {at} an update moved {shown(moving)} but left {shown(names)} "
               f"bitwise unchanged, although their gradients were non-zero. Likely cause: the update loop goes over "
               f"only some of the parameters (one layer's .parameters(), a list made before layers were added). "
               f"Fix: update every parameter in model.parameters(), or freeze the others (requires_grad_(False)).")
        return [finding("no_update", at, names, [self.ctx.modules[i] for i in both], msg, self._policy,
                        self.ctx.rank)]

    def close(self) -> None:
        self._snap = self._flags = None


class _Table(PolicyCheck):
    """A check of hand-written loops that measures, on the device, one table of rows per
    interval (a row per parameter of ``ix``) and reads it with the next step's read-back:
    `_put` keeps it, `queue` hands it over (a step that is not read drops it), `_rows` gives
    ``(step, ix, rows)`` back on the host."""

    SLOT = ""  #: the read-back slot's name
    WIDTH = 1  #: numbers per row

    _table: Optional[Tuple[int, List[int], Tensor]] = None

    def _put(self, at: int, ix: List[int], rows: List[Tensor]) -> None:
        self._table = (at, ix, torch.stack([r.to(rows[0].device) for r in rows]))

    def queue(self, step: Step) -> Any:
        table, self._table = self._table, None
        if table is None or not step.read:
            return None
        return table[0], table[1], step.readback.add(self.SLOT, table[2])

    def _rows(self, step: Step) -> Optional[Tuple[int, List[int], np.ndarray]]:
        token = step.token(self)
        if token is None or self._reported:
            return None
        at, ix, slot = token
        return at, ix, np.asarray(slot.value, dtype=np.float64).reshape(len(ix), self.WIDTH)


#: the relative residual under which an update counts as exactly ``a * grad + b * w``
FIT = 1e-3
#: the share of the update's size the growth term ``b * w`` must reach to be named
GROWTH = 1e-2


class ManualRule(_Table):
    """``update_rule`` in a hand-written update loop: what moves the weights between two
    backward passes is the gradient's step, perhaps with a weight decay that pulls them
    towards zero; a term that pushes them away from zero is not part of any update rule (a
    weight decay written with the wrong sign). On the steps of `graddbg._args.STEP_AUDIT`
    the weights and the gradients are copied when a backward pass ends (within the weight
    budget's size); when the next one ends, each parameter's change ``d`` is fitted on the
    device as ``a * grad + b * w``. Named when the fit is exact (a residual under `FIT`) and
    ``b > 0`` moves the weights by at least `GROWTH` of the step, in two audited intervals in
    a row; an update that the fit does not explain (momentum, Adam) is not judged. A step up
    the gradient (``a > 0``) is a rule too (REINFORCE written by hand). Also named: the update
    stopped, no weight changed at all in two audited intervals in a row after one in which
    they moved, though each backward pass made gradients (`_stopped`)."""

    STATE = ("_reported",)
    KIND = "update_rule"
    NEEDS_OPTIMIZER = False
    SLOT, WIDTH = "manual_fit", 6  # (the table: <d,d>, <d,g>, <g,g>, <d,w>, <g,w>, <w,w> per parameter)

    after = (LedgerKeeper,)

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self._on = self._on and ctx.optimizer is None and bool(ctx.params)
        self._snap: Optional[Tuple[int, List[int], List[Tensor], List[Tensor]]] = None  # (step, ix, weights, grads)
        self._grew: Optional[Tuple[int, set]] = None  # the last judged interval's growing parameters
        self._moved_at: Optional[int] = None  # the last audited interval in which weights moved
        self._still: List[int] = []  # the audited intervals since, in a row, in which none moved

    def params_added(self, k: int) -> None:
        self._snap = self._table = self._grew = None

    def on_backward_end(self, bw: BackwardEnd) -> None:
        if not self._on or self._reported:
            return
        params = self.ctx.params
        snap, self._snap = self._snap, None
        with torch.no_grad():
            if snap is not None and snap[0] == bw.step - 1:
                self._put(snap[0], snap[1], [_fit_numbers(params[i].detach() - w, g, w) for i, w, g in zip(*snap[1:])])
            if not STEP_AUDIT.includes(bw.step):
                return
            sizes = nbytes(params, self.ctx.numel)
            ix = [i for i, g in enumerate(bw.grads) if g is not None and type(g) is Tensor and g.layout == torch.strided
                  and not params[i].is_shared()]  # (shared memory, Hogwild: other processes move them)
            if not ix or 2 * sum(sizes[i] for i in ix) > self.ctx.budget.limit(int(sum(sizes))):
                return  # (nothing to fit, or the copies do not fit the budget: not audited)
            self._snap = (bw.step, ix, [params[i].detach().clone() for i in ix],
                          [bw.grads[i].detach().clone() for i in ix])

    def read(self, step: Step) -> List[Finding]:
        got = self._rows(step)
        if got is None:
            return []
        at, ix, v = got
        grew = {}
        moved = False
        for (dd, dg, gg, dw, gw, ww), i in zip(v, ix):
            moved = moved or dd > 0
            ab = _growth(dd, dg, gg, dw, gw, ww)
            if ab is not None:
                grew[i] = ab
        found = self._stopped(at, moved, ix)
        if found:
            return found
        last, self._grew = self._grew, ((at, set(grew)) if moved else self._grew)
        both = sorted(set(grew) & last[1]) if last is not None and last[0] == at - 1 else []
        if not both:
            return []
        self._reported = True
        names = [self.ctx.names[i] for i in both]
        a, b = grew[both[0]]
        msg = (f"graddbg: the update of a hand-written loop (no optimizer) pushes the weights away from zero: after the "
               f"backward passes of steps {at - 1} and {at}, the change of {shown(names)} is exactly a * grad + b * w "
               f"with b > 0 (a = {a:.3g}, b = {b:.3g} for {names[0]}): besides the gradient's step, each update "
               f"multiplies the weights by {1 + b:.6g}, so they grow without bound. Likely cause: a weight decay "
               f"written with the wrong sign (w -= lr * (grad - wd * w), or w += lr * wd * w). Fix: "
               f"w -= lr * (grad + wd * w).")
        return [finding("update_rule", at, names, [self.ctx.modules[i] for i in both], msg, self._policy,
                        self.ctx.rank, value=b)]

    def _stopped(self, at: int, moved: bool, ix: List[int]) -> List[Finding]:
        """The update stopped: no weight changed in two audited intervals in a row, after an
        earlier one in which they moved, while each backward pass made gradients."""
        if moved:
            self._moved_at, self._still = at, []
            return []
        if self._moved_at is None:
            return []
        self._still = [x for x in self._still if x == at - 1] + [at]
        if len(self._still) < 2:
            return []
        self._reported = True
        names = [self.ctx.names[i] for i in ix]
        msg = (f"graddbg: the update of a hand-written loop (no optimizer) stopped: the weights moved in the interval "
               f"after step {self._moved_at}, and in the intervals after steps {self._still[0]} and {at} none of "
               f"{shown(names)} changed at all, though each backward pass made gradients for them. Likely cause: the "
               f"update loops over something that is empty after its first use (params = model.parameters() kept "
               f"across steps: a generator, spent after one pass), or the update is skipped. Fix: loop over "
               f"model.parameters() anew at each step (or keep list(model.parameters())).")
        return [finding("update_rule", at, names, [self.ctx.modules[i] for i in ix], msg, self._policy,
                        self.ctx.rank)]

    def close(self) -> None:
        self._snap = self._table = None


class ManualDuring(_Table):
    """``update_rule`` in a hand-written update loop (``foreign_update`` with an optimizer):
    nothing moves the weights between the start of a forward pass of the watched model and
    the end of the backward pass that follows it; the update belongs after ``backward()``.
    With an optimizer, only the backward pass is looked at (from when it reaches the model's
    output), and a parameter written there is named when its gradient is still there at the
    step (the optimizer then moves it a second time, with a gradient of the weights before).
    A weight written in that window (in
    place, through ``.data`` or under ``no_grad``, which autograd does not see) makes the
    backward pass compute gradients for weights that are no longer there. When the next
    step is one of `graddbg._args.STEP_AUDIT`'s, the weights are copied as each forward pass
    of the model begins (within the weight budget's size) and compared on the device when
    the backward pass ends; the flags and the sizes ride its read-back. One such interval
    is evidence enough (the values differ). Not looked at: an ``nn.Embedding`` with
    ``max_norm`` (it renormalises its rows in place in forward, by design), parameters with
    post-accumulate-grad hooks of the user's (an optimizer stepped in backward), parameters
    in shared memory (Hogwild), several processes."""

    STATE = ("_reported",)
    KIND = "update_rule"
    NEEDS_OPTIMIZER = False
    SLOT, WIDTH = "manual_during", 3  # (the table: changed, |change|, |weight| per parameter)

    after = (LedgerKeeper,)

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        # (with an optimizer: foreign_update, "the watched optimizer is what changes the parameters")
        self._kind = "update_rule" if ctx.optimizer is None else "foreign_update"
        self._policy = getattr(ctx.options, self._kind)
        self._on = self._policy is not None and bool(ctx.params) and ctx.world_size <= 1 and \
            not type(ctx.optimizer).__module__.startswith("deepspeed")  # (ZeRO-3 gathers the weights in forward)
        self._next = 0  # the step of the next forward pass (without an optimizer, each backward pass is one)
        self._snap: Optional[Tuple[int, List[int], List[Tensor]]] = None  # (step, ix, weights)
        self._skip = self._skipped() if self._on else set()
        self._split = False

    def _skipped(self) -> set:
        # (an optimizer stepped in backward writes its parameters there by design; with a watched
        # optimizer, such a parameter's gradient is gone at the step, which `read` asks for)
        return _renormed(self.ctx) | (_hooked(self.ctx) if self.ctx.optimizer is None else set())

    def params_added(self, k: int) -> None:
        self._snap = self._table = None
        self._skip = self._skipped()

    def after_step(self, index: int) -> None:
        self._next = index + 1

    def on_forward(self, fwd: Any) -> None:
        if not self._on or self._reported or not STEP_AUDIT.includes(self._next):
            return
        params = self.ctx.params
        ix = [i for i, p in enumerate(params) if i not in self._skip and type(p.data) is Tensor
              and p.layout == torch.strided and not p.is_shared()]
        sizes = nbytes(params, self.ctx.numel)
        if not ix or sum(sizes[i] for i in ix) > self.ctx.budget.limit(int(sum(sizes))):
            self._snap = None
            return  # (nothing to copy, or the copies do not fit the budget: not looked at)
        with torch.no_grad():
            self._snap = (self._next, ix, [params[i].detach().clone() for i in ix])
        self._split = False  # (with an optimizer: the copies brought up to the start of the backward pass)

    def on_output_grad(self) -> None:
        """The backward pass reached the model's output. With an optimizer only what happens
        from here on is looked at: a write in forward() before the weights are used (a
        constraint, as nn.Embedding's max_norm makes) leaves the gradient true to the weights;
        the copies are brought up to now."""
        if self.ctx.optimizer is None or self._snap is None:
            return
        params = self.ctx.params
        with torch.no_grad():
            for i, w in zip(self._snap[1], self._snap[2]):
                if params[i].shape != w.shape:  # (a weight replaced or gathered since: not looked at)
                    self._snap = None
                    return
                w.copy_(params[i].detach())
        self._split = True

    def on_backward_end(self, bw: BackwardEnd) -> None:
        if self.ctx.optimizer is None:
            self._next = bw.step + 1
        snap, self._snap = self._snap, None
        if not self._on or self._reported or snap is None or snap[0] != bw.step or \
                (self.ctx.optimizer is not None and not self._split):
            return
        params = self.ctx.params
        with torch.no_grad():
            rows = []
            for i, w in zip(snap[1], snap[2]):
                now = params[i].detach()
                d = (now - w).double() if now.shape == w.shape else None
                rows.append(torch.stack([_differs(now, w).double(), d.norm(), w.double().norm()])
                            if d is not None else torch.ones(3, dtype=torch.float64, device=w.device))
            self._put(bw.step, snap[1], rows)

    def read(self, step: Step) -> List[Finding]:
        got = self._rows(step)
        if got is None:
            return []
        at, ix, v = got
        moved = [(i, d, w) for (changed, d, w), i in zip(v, ix) if changed > 0]
        if self.ctx.optimizer is not None:  # (and the watched optimizer then steps them with that pass's gradient)
            present = step.entry.present if step.entry is not None else None
            moved = [m for m in moved if present is not None and m[0] < len(present) and present[m[0]]]
        if not moved:
            return []
        self._reported = True
        names = [self.ctx.names[i] for i, _, _ in moved]
        _, d, w = moved[0]
        change = f"(|change| {d:.3g}, |weight| {w:.3g} for {names[0]})"
        if self.ctx.optimizer is None:
            msg = (f"graddbg: weights changed during a forward and backward pass of a hand-written loop (no "
                   f"optimizer): between the start of the forward pass of step {at} and the end of its backward pass, "
                   f"{shown(names)} changed {change}, so the gradients of that pass are of weights that are no longer "
                   f"there. Likely cause: code that writes the weights in place (through .data, or under no_grad) "
                   f"inside forward() or between the forward pass and backward(): a weight clamp or normalisation in "
                   f"forward, or the update placed before loss.backward(). Fix: change the weights only after "
                   f"backward(), with the update; for a constraint in forward, compute a new tensor from the weight "
                   f"(torch.nn.utils.parametrize) instead of writing it.")
        else:
            opt = type(self.ctx.optimizer).__name__
            msg = (f"graddbg: weights changed outside the optimizer's step, inside a backward pass: during the backward "
                   f"pass of step {at}, {shown(names)} changed {change}, and {opt} then stepped them with that pass's "
                   f"gradient, computed for the weights before the change: each step moves them twice, once by "
                   f"something else. Likely cause: a hook that writes the parameter (register_post_accumulate_grad_hook "
                   f"hands the hook the parameter, not its gradient: p.div_() there divides the weights). Fix: in such "
                   f"a hook change p.grad, not p.")
        return [finding(self._kind, at, names, [self.ctx.modules[i] for i, _, _ in moved], msg, self._policy,
                        self.ctx.rank, value=d)]

    def close(self) -> None:
        self._snap = self._table = None


def _differs(now: Tensor, was: Tensor) -> Tensor:
    """Whether any element changed, a NaN that stayed NaN counting as unchanged (a device
    bool)."""
    changed = now != was
    if now.is_floating_point():
        changed &= ~(now.isnan() & was.isnan())
    return changed.any()


def _hooked(ctx: Watched) -> set:
    """The watched indices of parameters with post-accumulate-grad hooks of the user's
    (`Watched.stepped_in_backward`): an optimizer stepped in the backward pass writes them
    there, by design."""
    return {i for i, p in enumerate(ctx.params) if id(p) in ctx.stepped_in_backward}


def _renormed(ctx: Watched) -> set:
    """The watched indices of the weights of ``nn.Embedding`` modules with ``max_norm``: their
    forward renormalises rows in place, by design."""
    if ctx.model is None:
        return set()
    mine = {id(m.weight) for m in ctx.model.modules()
            if isinstance(m, torch.nn.Embedding) and m.max_norm is not None}
    return {i for i, p in enumerate(ctx.params) if id(p) in mine}


def _fit_numbers(d: Tensor, g: Tensor, w: Tensor) -> Tensor:
    """<d,d>, <d,g>, <g,g>, <d,w>, <g,w>, <w,w> in float64, on the device."""
    d, g, w = d.double(), g.double(), w.double()
    return torch.stack([(d * d).sum(), (d * g).sum(), (g * g).sum(), (d * w).sum(), (g * w).sum(), (w * w).sum()])


def _fit(dd: float, dg: float, gg: float, dw: float, gw: float, ww: float) -> Optional[Tuple[float, float]]:
    """(a, b) when the change ``d`` is exactly ``a * grad + b * w`` (a residual under `FIT`);
    None otherwise, or when the gradient lies along the weights (a and b not told apart)."""
    if not all(map(math.isfinite, (dd, dg, gg, dw, gw, ww))) or dd == 0 or gg == 0 or ww == 0:
        return None
    det = gg * ww - gw * gw
    if det <= 1e-12 * gg * ww:
        return None
    a, b = (dg * ww - dw * gw) / det, (dw * gg - dg * gw) / det
    return None if dd - (a * dg + b * dw) > FIT ** 2 * dd else (a, b)


def _growth(dd: float, dg: float, gg: float, dw: float, gw: float, ww: float) -> Optional[Tuple[float, float]]:
    """(a, b) when the change ``d`` is exactly ``a * grad + b * w`` with a growth term
    ``b * w`` over `GROWTH` of the change; None otherwise."""
    ab = _fit(dd, dg, gg, dw, gw, ww)
    if ab is None or ab[1] <= 0 or ab[1] * math.sqrt(ww) < GROWTH * math.sqrt(dd):
        return None
    return ab

