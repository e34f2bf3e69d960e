"""The step audit's gradient half (``applied_grad``): on sampled steps, the gradients the
optimizer is handed are compared with the gradients the backward passes left.

A training step is defined: the optimizer applies the gradients of the losses handed to
``backward()`` since the previous step, changed only by what the ledger can explain: a
GradScaler's unscale or a clip, both a factor from 0 to 1. On the step audit's steps (`graddbg._args.STEP_AUDIT`: 0, 1, 2, 10, 100, ...,
and the step after one where another check found something) each held parameter's gradient
is copied when a backward pass ends (within the weight budget's size, those audited longest
ago first). At the step, the ledger's host facts say which gradients were touched since that
pass ended (their version counter or identity moved); only those are compared, on the
device, and the numbers ride the step's read-back: no host synchronisation of its own, and
nothing at all on a step whose gradients nobody touched.

A parameter is named when its gradient, between the end of backward and the step, was:

- cleared (set to None or zeroed) while other parameters of the optimizer kept theirs;
- multiplied by a factor above what an unscale allows (above 1, or above 1/scale under a
  GradScaler whose scale went below 1), or by a negative one (its sign flipped).

A gradient changed in any other way (mixed with other gradients: an average over replicas
or models done by hand, a projection, a clip by value or per row, an L2 term) is not named:
programs make such edits on purpose, and nothing here tells them from a bug. A parameter of
one element has no direction to keep, and is not judged.

Not audited: several processes (a data-parallel average may be done by hand after backward,
so the local gradient tells nothing), DeepSpeed, DTensor and sparse gradients, steps with a
closure; the "accumulated only over this step's passes" half is `stale_grad`'s.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from graddbg._args import STEP_AUDIT
from graddbg.checks.base import BackwardEnd, Finding, PolicyCheck, Step, Watched, finding, shown
from graddbg.checks.budget import nbytes, out_of_memory
from graddbg.checks.ledger import LedgerKeeper
from graddbg.checks.recorder import StatsRecorder

__all__ = ["GradAudit", "EXPLAINED"]

#: the relative residual under which a gradient counts as explained by a transformation (a
#: factor, a clamp, an L2 term): float32 arithmetic stays far below it
EXPLAINED = 1e-3
#: the numbers read back per compared parameter
_COLS = ("sS", "gG", "gS")


class GradAudit(PolicyCheck):
    """Compares the gradients handed to the step with those the last backward pass left
    (see the module)."""

    KIND = "applied_grad"
    STATE = ("_reported",)

    after = (LedgerKeeper, StatsRecorder)

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        opt = ctx.optimizer
        if self._on and (ctx.world_size > 1 or not isinstance(opt, torch.optim.Optimizer)
                         or type(opt).__module__.startswith("deepspeed")):
            self._on = False
        self._copy: Optional[Tuple[int, Dict[int, Tensor]]] = None  # (step, index -> the gradient at backward end)
        self._last = np.full(len(ctx.params), -1, dtype=np.int64)

    def params_added(self, k: int) -> None:
        self._copy = None
        self._last = np.concatenate([self._last, np.full(k, -1, dtype=np.int64)])

    def _due(self, index: int) -> bool:
        if STEP_AUDIT.includes(index):
            return True
        last = self.ctx.ledger.last(1) if self.ctx.ledger is not None and len(self.ctx.ledger) else []
        return bool(last) and bool(last[0].kinds) and last[0].index == index - 1

    # ------------------------------------------------------------------ the backward pass ends
    def on_backward_end(self, bw: BackwardEnd) -> None:
        if not self._on or self._reported:
            return None
        if self._copy is not None and self._copy[0] == bw.step:
            ix = list(self._copy[1])  # (a later pass of the same step: the same parameters, again)
        elif self._due(bw.step):
            ix = self._choose(bw.grads)
        else:
            self._copy = None
            return None
        try:
            with torch.no_grad():
                self._copy = (bw.step, {i: bw.grads[i].detach().clone() for i in ix if bw.grads[i] is not None})
        except (RuntimeError, MemoryError) as err:
            if not out_of_memory(err):
                raise
            self._copy, self._on = None, False
        return None

    def _choose(self, grads: List[Optional[Tensor]]) -> List[int]:
        """The parameters held by the optimizer with a plain gradient, those compared longest
        ago first, within a limit of the weight budget's size for the copies."""
        held = self.ctx.held_by_optimizer() or set()
        params = self.ctx.params
        ix = [i for i, g in enumerate(grads) if g is not None and id(params[i]) in held and _plain(params[i])
              and _plain(g)]
        if len(self._last) != len(params):
            self._last = np.concatenate([self._last, np.full(len(params) - len(self._last), -1, dtype=np.int64)])
        sizes = nbytes(params, self.ctx.numel)
        limit = self.ctx.budget.limit(int(sum(sizes)))
        chosen, used = [], 0
        for i in sorted(ix, key=lambda k: int(self._last[k])):
            if used + sizes[i] <= limit:
                chosen.append(i)
                used += sizes[i]
        self._last[chosen] = max(0, int(self._last.max()) + 1)
        return sorted(chosen)

    # ------------------------------------------------------------------ the step
    def due(self, index: int) -> bool:
        return self._touched(index) is not None

    def _touched(self, index: int) -> Optional[List[int]]:
        """The copied parameters whose gradient was touched since the last backward pass
        ended (the ledger's host facts); None when there is nothing to compare."""
        copy = self._copy
        e = self.ctx.ledger.current if self.ctx.ledger is not None else None
        if copy is None or copy[0] != index or e is None or e.index != index or e.changed is None or \
                e.present is None or len(e.changed) != len(self.ctx) or len(e.present) != len(self.ctx):
            return None
        touched = e.changed | ~e.present  # (changed in place or replaced; set to None)
        if not touched.any():
            return None
        return [i for i in copy[1] if touched[i]] or None

    def queue(self, step: Step) -> Any:
        touched = self._touched(step.index) if not step.closure else None
        copy, self._copy = self._copy, None
        if touched is None or not step.read or copy is None:
            return None
        grads = step.grads
        cleared = [i for i in touched if grads[i] is None]
        compared = [i for i in touched if grads[i] is not None and grads[i].shape == copy[1][i].shape]
        if not compared and not cleared:
            return None
        slot = None
        if compared:
            with torch.no_grad():
                rows = [_numbers(copy[1][i], grads[i]) for i in compared]
                slot = step.readback.add("applied", torch.stack([r.to(rows[0].device) for r in rows]))
        return step.index, compared, cleared, slot

    def read(self, step: Step) -> List[Finding]:
        token = step.token(self)
        if token is None or self._reported:
            return []
        at, compared, cleared, slot = token
        v = np.zeros((0, len(_COLS))) if slot is None else \
            np.asarray(slot.value, dtype=np.float64).reshape(len(compared), len(_COLS))
        zeroed, scaled, reversed_ = [], [], []
        for row, i in zip(v, compared):
            verdict = _verdict(*row, largest=_largest_factor(step.scale), single=self.ctx.numel[i] == 1)
            if verdict is None:
                continue
            what, x = verdict
            (zeroed if what == "zeroed" else scaled if what == "scaled" else reversed_).append(
                (i, x, math.sqrt(max(row[0], 0.0)), math.sqrt(max(row[1], 0.0))))
        e = step.entry
        lost = cleared + [x[0] for x in zeroed]
        others = np.array(e.present, dtype=bool) if e is not None and e.present is not None else np.zeros(0, bool)
        others[[i for i in lost if i < len(others)]] = False
        if lost and not others.any():
            lost = []  # (every gradient gone: empty_step's)
        if not (lost or scaled or reversed_):
            return []
        self._reported = True
        return [self._say(at, lost, zeroed, scaled, reversed_)]

    def _say(self, at: int, lost: List[int], zeroed: list, scaled: list, reversed_: list) -> Finding:
        names, opt = self.ctx.names, type(self.ctx.optimizer).__name__
        where = f"between the end of the last backward pass and {opt}.step()"
        if lost:
            how = "zeroed" if zeroed and len(zeroed) == len(lost) else "set to None" if not zeroed else "cleared"
            msg = (f"graddbg: the gradients applied at step {at}: {shown([names[i] for i in lost])} had gradients "
                   f"when the last backward pass ended, but they were {how} {where}, while the optimizer's other "
                   f"parameters kept theirs" + (f" (|grad| {zeroed[0][2]:.3g} after backward, 0 at the step, for "
                                                 f"{names[zeroed[0][0]]})" if zeroed else "")
                   + ". So the step applied no gradient to them (momentum and weight decay still move them). "
                   "Likely cause: a zero_grad() of another optimizer, or of a submodule, that shares them, called "
                   "between backward() and step(). Fix: clear gradients before backward() or after step().")
            return self._finding(at, lost, msg, 0.0)
        rows = reversed_ or scaled  # (read makes a finding only when one of them is not empty)
        i0, x, s, g = rows[0]
        sign = ("their sign flipped: the step climbs the loss. Likely cause: a gradient reversal or an ascent "
                "step written on the gradients. Fix: put the reversal in the graph (a custom autograd "
                "Function) where it belongs, or check the sign" if reversed_ else
                "the ledger explains only shrinking factors between backward and the step (a clip, a "
                "GradScaler's unscale). Likely cause: code that scales the gradients up after backward (an "
                "average multiplied instead of divided, a loss scale applied again instead of removed). Fix: "
                "divide where it multiplies, or scale the loss before backward()")
        msg = (f"graddbg: the gradients applied at step {at}: {shown([names[r[0]] for r in rows])} were "
               f"multiplied by {x:.4g} {where} (|grad| {s:.3g} after backward, {g:.3g} at the step, for "
               f"{names[i0]}, in the same line): {sign}.")
        return self._finding(at, [r[0] for r in rows], msg, x)

    def _finding(self, at: int, ix: List[int], msg: str, value: float) -> Finding:
        return finding(self.KIND, at, [self.ctx.names[i] for i in ix], [self.ctx.modules[i] for i in ix], msg,
                       self._policy, self.ctx.rank, value=value)

    def close(self) -> None:
        self._copy = None


def _largest_factor(scale: Any) -> float:
    """The largest factor the ledger explains: 1 (a clip shrinks), or 1/scale under a
    GradScaler whose scale went below 1 (``scale``: the step's, when read)."""
    scale = float(scale) if isinstance(scale, (int, float)) else math.nan
    return max(1.0, 1.0 / scale if scale == scale and scale > 0 else 1.0) * (1 + EXPLAINED)


def _numbers(before: Tensor, now: Tensor) -> Tensor:
    """One parameter's numbers (`_COLS`), on its device, in float64: of the gradient at the
    end of backward ``S`` and at the step ``G``: <S,S>, <G,G>, <G,S>."""
    s, g = before.double(), now.detach().double()
    return torch.stack([(s * s).sum(), (g * g).sum(), (g * s).sum()])


def _verdict(sS: float, gG: float, gS: float, largest: float, single: bool = False) -> Optional[Tuple[str, float]]:
    """What happened to one gradient between backward and the step: None (explained, or not
    judged), or ("zeroed", 0), ("scaled", factor), ("reversed", factor)."""
    if not all(map(math.isfinite, (sS, gG, gS))) or sS == 0:
        return None  # (non-finite: the non-finite check's; nothing after backward: nothing to compare)
    if gG == 0:
        return "zeroed", 0.0
    tol = EXPLAINED ** 2 * gG
    r = gS / sS
    if gG - gS * gS / sS <= tol and not single:  # a factor (a single element has no direction to keep)
        return None if 0 <= r <= largest else ("reversed" if r < 0 else "scaled", r)
    # any other change is not named: gradients mixed with other gradients (an average over
    # replicas or models done by hand, a projection, a clip per row) are edits a program
    # makes on purpose, and nothing here tells them from a bug
    return None


def _plain(t: Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided
