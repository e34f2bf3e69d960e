"""The step audit (``update_rule``): on sampled steps, what the optimizer's step did to each
parameter is compared with what its own rule gives.

A training step is defined: the optimizer takes the gradients it is handed and its state
(moments, step counts) and applies its update rule. The audit checks that definition rather
than the look of a known bug. Before an audited step (`graddbg._args.STEP_AUDIT`: the first
steps, then 10, 100, 1000, ..., and the step after one where another check found something)
it copies the audited parameters, their gradients and their optimizer state. After the step
it runs a shadow step on float64 copies: the optimizer's own ``step`` (unwrapped, so no hook
runs) on a twin that holds the copies. Then it compares, per parameter, the observed change
``a = w_after - w_before`` with the rule's ``x``. The numbers (norms, the inner product, how
many elements the rule moves and the step left unchanged) ride the next step's read-back, so
the audit adds no host synchronisation. Its cost is paid on audited steps only: the copies
(bounded, see below) and one extra optimizer step in float64, one unit at a time
(bench/audit_cost.py).

A parameter is named when the observed change differs from the rule's by more than the
float64-vs-its-dtype arithmetic and the rounding of its own precision can explain (in bf16 or
fp16 only a lost update is judged: there the rule's own arithmetic and state are rounded as
well, and no other difference can be told from it):

- it did not move at all, or most of its elements did not, although the rule moves them:
  in a low precision (bf16, fp16) the update is below half the spacing of the weights'
  values and is rounded away (weights kept in bf16, no fp32 master copy); in fp32 something
  discarded the step;
- it moved a multiple of the rule's change in the rule's direction (twice: stepped twice);
- it moved in another direction;
- after the step, before the next one begins, it moved again in the direction the step moved
  it (a second optimizer that holds it steps it too).

Not audited: DeepSpeed's optimizer, DTensor (FSDP2, TP) and sparse parameters, parameters in
shared memory (Hogwild: other processes move them during the step), a step with a
closure (LBFGS evaluates it several times), a fused step handed still-scaled gradients by a
GradScaler; an optimizer whose shadow step fails switches the audit off with a warning (the
training goes on). A finding names the first step it sees; the audit then stops.
Which parameters: under torch.optim's optimizers (whose rules are per parameter) those
audited longest ago first, one at a time; under any other optimizer whole param groups (a
rule may couple a group's parameters), each reproduced exactly. Their copies (the weights,
gradients and state: about four times the weights' bytes) stay within a limit of the weight
budget's size, ``copy_budget=`` of the weights' bytes or 1 MiB, its own so that the
update/weight ratio keeps its copies; a unit over it is not audited. A large model is
audited a part at a time, in turn over the audited steps.
"""
from __future__ import annotations

import collections
import math
import warnings
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from graddbg._args import STEP_AUDIT
from graddbg._errors import GraddbgWarning
from graddbg.checks.base import Finding, PolicyCheck, Step, Watched, finding, shown
from graddbg.checks.budget import nbytes, out_of_memory
from graddbg.checks.ledger import LedgerKeeper
from graddbg.checks.recorder import StatsRecorder
from graddbg.stats import Slot

__all__ = ["StepAudit", "TOLERANCE", "LOST_SHARE"]

#: the relative difference between the observed change and the rule's that float64-vs-float32
#: arithmetic cannot reach (on top of the rounding of the weights' own precision)
TOLERANCE = 1e-2
#: the share of the elements the rule moves that stayed bitwise unchanged for the update to
#: count as lost (rounded away, or discarded)
LOST_SHARE = 0.5
#: the columns of the numbers read back per audited parameter
_COLS = ("observed", "expected", "diff", "inner", "rounded", "discarded", "moving", "spacing", "weight")


class StepAudit(PolicyCheck):
    """Compares each audited parameter's change with the optimizer's own rule (see the module)."""

    KIND = "update_rule"
    STATE = ("_reported",)

    after = (LedgerKeeper, StatsRecorder)

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self._reported = False
        self._copy: Optional[Tuple[int, List[Tuple[Dict[str, Any], List[int]]], Dict[int, Any]]] = None
        self._attrs: Optional[Dict[str, Any]] = None  # the optimizer's attributes before the audited step
        self._pending: Optional[Tuple[int, List[int], Tensor]] = None  # (step, indices, [k, 9] on the device)
        #: after an audited step: (step, indices, the weights after it, the change it made) ...
        self._afterwards: Optional[Tuple[int, List[int], List[Tensor], List[Tensor]]] = None
        #: ... and, when the next step begins, what moved them since: (step, indices, [k, 3] on the device)
        self._outside: Optional[Tuple[int, List[int], Tensor]] = None
        self._last = np.full(len(ctx.params), -1, dtype=np.int64)  # (the step each was last audited at)
        self._suspect = -1  # (a step after which another check found something: audit the next)
        opt = ctx.optimizer
        why = None
        if self._on and not isinstance(opt, torch.optim.Optimizer):
            why = "the optimizer is not a torch.optim.Optimizer"
        elif self._on and getattr(ctx.options, "scaler", None) is None and _deepspeed(ctx):
            why = "DeepSpeed's optimizer"
        self._why_not = why
        if why is not None:
            self._on = False
        self._index = {id(p): i for i, p in enumerate(ctx.params)}

    def params_added(self, k: int) -> None:
        self._index = {id(p): i for i, p in enumerate(self.ctx.params)}
        self._copy = self._pending = self._afterwards = self._outside = None
        self._last = np.concatenate([self._last, np.full(k, -1, dtype=np.int64)])

    # ------------------------------------------------------------------ before and after the step
    def before_step(self, index: int, closure: bool) -> None:
        self._copy = None
        if not self._on or self._reported:
            self._afterwards = None
            return
        self._since_last_step(index)
        if closure:
            return
        if self.ctx.options.scaler is not None and getattr(self.ctx.optimizer, "_step_supports_amp_scaling", False):
            return  # (a GradScaler hands a fused step still-scaled gradients and their scale: not reproduced)
        last = self.ctx.ledger.last(1) if self.ctx.ledger is not None else []
        if last and last[0].kinds and last[0].index == index - 1:
            self._suspect = index
        if not (STEP_AUDIT.includes(index) or self._suspect == index):
            return
        groups = self._groups(index)
        if not groups:
            return
        opt = self.ctx.optimizer
        try:
            with torch.no_grad():
                copies = {}
                for _, _, ix in groups:
                    for i in ix:
                        p = self.ctx.params[i]
                        copies[i] = (p.detach().clone(), p.grad.detach().clone(),
                                     {k: (v.detach().clone() if isinstance(v, Tensor) else v)
                                      for k, v in opt.state.get(p, {}).items()})
        except (RuntimeError, MemoryError) as err:
            if not out_of_memory(err):
                raise
            self._off(f"no memory for its copies at step {index}")
            return
        # (the optimizer's own attributes as the step found them: a subclass may count its steps
        # there and set its lr from the count inside step())
        self._attrs = dict(opt.__dict__)
        self._copy = (index, groups, copies)

    def _groups(self, index: int) -> List[Tuple[int, Dict[str, Any], List[int]]]:
        """The units audited this step, each (its param group's position and hyperparameters, the watched
        indices of its parameters with a gradient): one parameter each under torch.optim's
        optimizers (their rules are per parameter), a whole param group under any other (a
        rule may couple a group's parameters). Those audited longest ago first, within a
        limit of the weight budget's size (``copy_budget=`` of the weights' bytes, or 1 MiB)
        for the copies (about four times the weights': them, their gradients, the state); a
        unit over the limit is not audited."""
        opt, params = self.ctx.optimizer, self.ctx.params
        per_param = type(opt).__module__.startswith("torch.optim")
        units: List[Tuple[int, Dict[str, Any], List[int]]] = []
        for gi, g in enumerate(opt.param_groups):
            ix = [self._index.get(id(p), -1) for p in g["params"] if p.grad is not None]
            if not per_param and any(i < 0 for i in ix):
                continue  # (a parameter the watch does not see: the group is not reproduced whole)
            # (weights in shared memory, Hogwild: other processes move them during the step)
            ix = [i for i in ix if i >= 0 and not (_unplain(params[i]) or _unplain(params[i].grad)
                                                   or params[i].is_shared())]
            hyper = {k: v for k, v in g.items() if k != "params"}
            units += [(gi, hyper, [i]) for i in ix] if per_param else [(gi, hyper, ix)] if ix else []
        if len(self._last) != len(params):
            self._last = np.concatenate([self._last, np.full(len(params) - len(self._last), -1, dtype=np.int64)])
        sizes = nbytes(params, self.ctx.numel)
        limit = self.ctx.budget.limit(int(sum(sizes)))  # (a limit of the budget's size, its own)
        units.sort(key=lambda u: min(int(self._last[i]) for i in u[2]))  # (stable: ties in order)
        chosen, used = [], 0
        for u in units:
            cost = 4 * sum(sizes[i] for i in u[2])
            if used + cost <= limit:
                chosen.append(u)
                used += cost
        for _, _, ix in chosen:
            self._last[ix] = index
        return chosen

    def after_step(self, index: int) -> None:
        copy, self._copy = self._copy, None
        if copy is None or copy[0] != index or not self._on:
            return
        _, groups, copies = copy
        try:
            with torch.no_grad():
                expected = self._shadow(groups, copies)  # (each audited parameter's numbers)
            self._attrs = None
        except Exception as err:  # (an optimizer the shadow cannot reproduce: off, never the job's failure)
            self._off(f"its shadow step of {type(self.ctx.optimizer).__name__} failed "
                      f"({type(err).__name__}: {str(err)[:160]})")
            return
        order = [i for _, _, ix in groups for i in ix]
        rows = [expected[i] for i in order]
        dev = rows[0].device
        self._pending = (index, order, torch.stack([r.to(dev) for r in rows]))
        with torch.no_grad():  # (what moves them before the next step begins is looked at then)
            params = [self.ctx.params[i] for i in order]
            self._afterwards = (index, order, [p.detach().clone() for p in params],
                                [p.detach() - copies[i][0] for p, i in zip(params, order)])

    def _since_last_step(self, index: int) -> None:
        """The next step begins: how the parameters audited at the step before moved since
        it ended (nothing, in a healthy loop), against the change that step made."""
        after, self._afterwards = self._afterwards, None
        if after is None or after[0] != index - 1:
            return
        at, order, weights, changes = after
        with torch.no_grad():
            rows = []
            for i, w, a in zip(order, weights, changes):
                d = (self.ctx.params[i].detach() - w).to(torch.float64)
                a = a.to(torch.float64)
                rows.append(torch.stack([d.norm(), a.norm(), (d * a).sum()]))
            self._outside = (at, order, torch.stack(rows))

    def _shadow(self, groups: List[Tuple[int, Dict[str, Any], List[int]]], copies: Dict[int, Any]) -> Dict[int, Tensor]:
        """The optimizer's own step on float64 copies of the audited parameters (a twin
        optimizer that holds one unit's copies: no hook runs, the real one is untouched),
        compared with what the real step did: each parameter's numbers (`_compare`)."""
        opt = self.ctx.optimizer
        cls = type(opt)
        step = getattr(cls.step, "__wrapped__", cls.step)  # (the hooked step's own function)
        made: Dict[int, Tensor] = {}
        per_param = cls.__module__.startswith("torch.optim")
        # (torch.optim: one parameter at a time, its float64 twin all that is held; any other
        # optimizer: its audited groups at their positions, the others empty, as a rule may
        # depend on a group's place)
        for batch in ([[u] for u in groups] if per_param else [groups]):
            twin = object.__new__(cls)
            twin.__dict__.update(self._attrs if self._attrs is not None else opt.__dict__)
            # (hooks of its own, none: a step that calls super().step() runs the hooked base step)
            twin._optimizer_step_pre_hooks, twin._optimizer_step_post_hooks = \
                collections.OrderedDict(), collections.OrderedDict()
            state: Dict[Tensor, Dict[str, Any]] = collections.defaultdict(dict)
            twin_groups = [] if per_param else \
                [dict({k: v for k, v in g.items() if k != "params"}, params=[]) for g in opt.param_groups]
            held = []
            for gi, hyper, ix in batch:
                ps = []
                for i in ix:
                    before, grad, st = copies[i]
                    q = before.to(torch.float64).clone()
                    q.grad = grad.to(torch.float64)
                    state[q] = {k: (_wide(v) if isinstance(v, Tensor) else v) for k, v in st.items()}
                    ps.append(q)
                    held.append((i, q))
                g = dict(hyper, params=ps)
                for flag in ("foreach", "fused"):
                    if flag in g:
                        g[flag] = None if flag == "fused" else False
                if per_param:
                    twin_groups.append(g)
                else:
                    twin_groups[gi] = g
            twin.param_groups, twin.state = twin_groups, state
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                step(twin)
            for i, q in held:
                made[i] = _compare(copies[i][0], self.ctx.params[i], q)
                q.grad = None
            del twin, state, held
        return made

    def _off(self, why: str) -> None:
        self._on, self._copy, self._pending, self._afterwards, self._outside = False, None, None, None, None
        self._why_not = why
        warnings.warn(f"graddbg.watch: the step audit (update_rule) is off from now on: {why}. Training goes on; "
                      f"pass update_rule=None to skip it.", GraddbgWarning, stacklevel=3)

    # ------------------------------------------------------------------ the read-back
    def queue(self, step: Step) -> Any:
        if not step.read or (self._pending is None and self._outside is None):
            return None  # (kept for the next read-back)
        pending, outside, self._pending, self._outside = self._pending, self._outside, None, None
        return (None if pending is None else (pending[0], pending[1], step.readback.add("audit", pending[2])),
                None if outside is None else (outside[0], outside[1], step.readback.add("audit_out", outside[2])))

    def read(self, step: Step) -> List[Finding]:
        token = step.token(self)
        if token is None or self._reported:
            return []
        audit, outside = token
        found = self._judge(*audit) if audit is not None else []
        return found or (self._judge_outside(*outside) if outside is not None else [])

    def _judge_outside(self, at: int, order: List[int], slot: Slot) -> List[Finding]:
        """Parameters that moved again between the audited step and the next one, in the
        direction that step moved them (cosine above 0.9, 1/4 to 4 times as far): stepped
        twice per iteration, the second time outside the watched optimizer's step."""
        v = np.asarray(slot.value, dtype=np.float64).reshape(len(order), 3)
        again = []
        for (d, a, inner), i in zip(v, order):
            if d > 0 and a > 0 and math.isfinite(inner) and inner / (d * a) > 0.9 and 0.25 <= d / a <= 4:
                again.append((i, d, a, inner / (d * a)))
        if not again:
            return []
        self._reported = True
        names = self.ctx.names
        ix = [x[0] for x in again]
        i0, d, a, cos = again[0]
        msg = (f"graddbg: the step audit: after step {at}, {shown([names[i] for i in ix])} moved again before "
               f"step {at + 1} began, outside {type(self.ctx.optimizer).__name__}'s step and in the direction "
               f"that step had moved them (|change| {d:.3g} outside it, {a:.3g} by the step, cosine {cos:.3f}, for "
               f"{names[i0]}), so they are stepped twice per iteration. Likely cause: a second optimizer that holds "
               f"them steps them too (or a hand-written update after the step). Fix: give each parameter to one "
               f"optimizer.")
        return [self._finding(at, ix, msg, d)]

    def _judge(self, at: int, order: List[int], slot: Slot) -> List[Finding]:
        v = np.asarray(slot.value, dtype=np.float64).reshape(len(order), len(_COLS))
        lost, moved_k, twice, other = [], [], [], []
        for (obs, exp, diff, inner, rounded, discarded, n_moving, spacing, weight), i in zip(v, order):
            if not (math.isfinite(obs) and math.isfinite(exp)) or exp == 0 and obs == 0:
                continue  # (a non-finite step is the non-finite check's)
            p = self.ctx.params[i] if i < len(self.ctx.params) else None
            eps = torch.finfo(p.dtype).eps if p is not None and p.is_floating_point() else 2 ** -52
            low = p is not None and p.dtype in (torch.bfloat16, torch.float16)
            # the update lost: discarded (changes the dtype can hold), or, in a low precision,
            # rounded away (in float32 and wider a change under the weights' spacing is a
            # schedule's or a vanishing gradient's, not this check's)
            if n_moving > 0 and (discarded >= LOST_SHARE * n_moving or low and rounded >= LOST_SHARE * n_moving):
                lost.append((i, obs, exp, discarded if discarded >= LOST_SHARE * n_moving else 0,
                             rounded + discarded, n_moving, spacing))
                continue
            if low:
                continue  # (the rule's arithmetic in bf16/fp16, its state rounded too, is not float64's)
            if diff <= TOLERANCE * exp + 2 * eps * weight:
                continue
            ratio = inner / (exp * exp) if exp > 0 else math.inf
            cos = inner / (obs * exp) if obs > 0 and exp > 0 else 0.0
            if cos > 0.99 and abs(ratio - 2) < 0.1:
                twice.append((i, obs, exp))
            elif cos > 0.99:
                moved_k.append((i, obs, exp, ratio))
            else:
                other.append((i, obs, exp, cos))
        if not (lost or twice or moved_k or other):
            return []
        self._reported = True
        return [self._say(at, lost, twice, moved_k, other)]

    def _say(self, at: int, lost: list, twice: list, moved_k: list, other: list) -> Finding:
        """The finding of the first kind of mismatch found (lost, twice, a multiple, another
        direction), with both numbers."""
        name = type(self.ctx.optimizer).__name__
        rule = f"{name}'s own update rule (run on the gradients and the state the step had)"
        names = self.ctx.names
        if lost:
            i0 = lost[0][0]
            dtype = str(self.ctx.params[i0].dtype).replace("torch.", "")
            ix = [x[0] for x in lost]
            share = sum(x[4] for x in lost) / max(sum(x[5] for x in lost), 1)
            cause = (f"the weights are stored in {dtype}, and the rule's changes are under the spacing of "
                     f"{dtype} values at the weights' size (a median spacing of {lost[0][6]:.2g} for {names[i0]}), "
                     f"so adding them rounds them away. Fix: keep the weights in float32 and compute in {dtype} "
                     f"under torch.autocast (or keep float32 master weights)" if not lost[0][3] else
                     f"something discarded the step's change, although {dtype} can hold it (old weights copied "
                     f"back after the step, or a step on copies of the parameters rather than the parameters)")
            msg = (f"graddbg: the step audit: at step {at}, {shown([names[i] for i in ix])} did not move, although "
                   f"{rule} moves them: {100 * share:.0f}% of the elements the rule changes are bitwise unchanged "
                   f"(|update| {lost[0][1]:.3g} observed, {lost[0][2]:.3g} by the rule, for {names[i0]}). "
                   f"Likely cause: {cause}.")
            return self._finding(at, ix, msg, lost[0][2])
        if twice:
            ix = [x[0] for x in twice]
            i0, obs, exp = twice[0]
            msg = (f"graddbg: the step audit: at step {at}, {shown([names[i] for i in ix])} moved twice the change "
                   f"{rule} gives (|update| {obs:.3g} observed, {exp:.3g} by the rule, for {names[i0]}, in the same "
                   f"direction). Likely cause: the parameters are stepped twice within the step (held by a second "
                   f"optimizer that steps them too, or a hook that applies the update again). Fix: give each "
                   f"parameter to one optimizer, and step it once.")
            return self._finding(at, ix, msg, obs)
        if moved_k:
            ix = [x[0] for x in moved_k]
            i0, obs, exp, ratio = moved_k[0]
            msg = (f"graddbg: the step audit: at step {at}, {shown([names[i] for i in ix])} moved {ratio:.3g}x the "
                   f"change {rule} gives (|update| {obs:.3g} observed, {exp:.3g} by the rule, for {names[i0]}, in "
                   f"the same direction). Likely cause: something scales the update during the step (a hook on "
                   f"the optimizer's step, a wrapper that edits the gradients or the weights as it steps).")
            return self._finding(at, ix, msg, obs)
        ix = [x[0] for x in other]
        i0, obs, exp, cos = other[0]
        msg = (f"graddbg: the step audit: at step {at}, {shown([names[i] for i in ix])} moved in another direction "
               f"than {rule} gives (|update| {obs:.3g} observed, {exp:.3g} by the rule, cosine {cos:.3f}, for "
               f"{names[i0]}). Likely cause: something other than the rule changes the weights during the step "
               f"(a hook on the optimizer's step, a wrapper that edits the weights as it steps).")
        return self._finding(at, ix, msg, obs)

    def _finding(self, at: int, ix: List[int], msg: str, value: float) -> Finding:
        return finding(self.KIND, at, [self.ctx.names[i] for i in ix], [self.ctx.modules[i] for i in ix], msg,
                       self._policy, self.ctx.rank, value=value)

    def close(self) -> None:
        self._copy = self._pending = self._afterwards = self._outside = None

    def describe(self) -> str:
        """Why the audit is off (empty: it is on)."""
        return "" if self._on else (self._why_not or "off")


def _compare(before: Tensor, param: Tensor, expected: Tensor) -> Tensor:
    """The numbers of one parameter (`_COLS`), on its device, in float64: the norms of the
    observed change, the rule's and their difference, their inner product; of the elements
    the rule moves, how many stayed bitwise unchanged although the change is under (rounded)
    or over (discarded) the spacing of the weights' dtype at their value; the median
    spacing; the weights' norm."""
    b = before.to(torch.float64)
    a = param.detach().to(torch.float64) - b
    x = expected.to(a.device) - b
    spacing = (torch.nextafter(before, torch.full_like(before, math.inf)) - before).to(torch.float64) \
        if before.is_floating_point() else torch.zeros_like(b)
    moving = x != 0
    still = moving & (a == 0)
    small = x.abs() <= spacing
    return torch.stack([a.norm(), x.norm(), (a - x).norm(), (a * x).sum(), (still & small).sum().to(torch.float64),
                        (still & ~small).sum().to(torch.float64), moving.sum().to(torch.float64),
                        spacing.reshape(-1).median() if spacing.numel() else b.new_zeros(()), b.norm()])


def _wide(t: Tensor) -> Tensor:
    """An optimizer state tensor as the float64 twin uses it (counters kept as they are)."""
    return t.to(torch.float64).clone() if t.is_floating_point() and t.dim() > 0 else t.clone()


def _unplain(t: Optional[Tensor]) -> bool:
    return t is not None and (type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided)


def _deepspeed(ctx: Watched) -> bool:
    return type(ctx.optimizer).__module__.startswith("deepspeed")
