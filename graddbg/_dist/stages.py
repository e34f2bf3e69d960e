"""The pipeline stages of a watched model, and the per-step summary between them.

- `find_stages`: the ``torch.distributed.pipelining`` stages that hold the watched module;
- `StageRelay`: with several stages on this rank (an interleaved schedule), hooks on each
  (registered through a `graddbg._hookset.HookSet`): whether a non-finite gradient arrived
  at a stage's output from the next stage, and the stage's last forward pass for a replay;
- `Summary`: the per-step summary over the pipeline group (or the world when ranks hold
  different parameters without a pipeline stage): each stage's squared norm, whether it had
  a non-finite gradient, whether one arrived from the next stage, whether its replicas
  differ; one all-reduce of a fixed-size table (as torchtitan's clip sums the norm), never
  inside a backward pass of a pipeline stage (a peer stage may be waiting for its result);
- `StageReport`: what that summary told every rank.

This module imports only `graddbg._model`, `graddbg._hookset` and `graddbg._dist`'s
`collective` and `groups`.
"""
from __future__ import annotations

import dataclasses
import gc
import sys
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
from torch import Tensor, nn

from graddbg._dist.collective import run_collective
from graddbg._dist.groups import Groups, as_group
from graddbg._hookset import HookSet
from graddbg._model import unwrap

__all__ = ["StageRelay", "StageReport", "Summary", "find_stages"]


def find_stages(model: nn.Module) -> List[Any]:
    """The ``torch.distributed.pipelining`` stages (``_PipelineStageBase``) that hold
    ``model`` or a part of it, by stage index: those referring to it, else any in memory
    whose module is ``model`` or one of its submodules. Empty when pipelining is not in use,
    and without a process group (a stage needs one): the search walks the heap, which a
    process that only imported pipelining should not pay for at every watch."""
    if "torch.distributed.pipelining" not in sys.modules or not torch.distributed.is_available() \
            or not torch.distributed.is_initialized():
        return []
    from torch.distributed.pipelining.stage import _PipelineStageBase

    inner = unwrap(model)
    mine = {id(m) for m in inner.modules()} | {id(model)}

    def holds(obj: Any) -> bool:
        # (by type only: gc holds dead weak proxies, which raise, and deprecated objects, which warn)
        return issubclass(type(obj), _PipelineStageBase) and (id(obj.submod) in mine or id(unwrap(obj.submod)) in mine)

    found = [r for m in {id(model): model, id(inner): inner}.values() for r in gc.get_referrers(m) if holds(r)]
    if not found:
        found = [o for o in gc.get_objects() if holds(o)]
    return sorted({id(s): s for s in found}.values(), key=lambda s: s.stage_index)


@dataclasses.dataclass
class StageReport:
    """What the per-step summary exchange told every rank: per slot (a stage, or a rank
    when ranks hold different parameters without a pipeline), the squared norm, whether
    it had a non-finite gradient, whether one arrived at it from the next stage."""

    what: str                 #: "stage" or "rank"
    sq: np.ndarray
    bad: np.ndarray
    arrived: np.ndarray
    ranks: List[int]          #: a global rank holding each slot
    me: List[int]             #: this rank's slots
    #: per slot: 1 + the step its replicas were found to differ at (0: they agree), so that
    #: every stage stops with it
    differ: Optional[np.ndarray] = None

    def elsewhere(self) -> List[int]:
        """Slots other than this rank's with a non-finite gradient."""
        return [s for s in np.nonzero(self.bad)[0].tolist() if s not in self.me]

    def slot_text(self, s: int) -> str:
        return f"stage {s}, rank {self.ranks[s]}" if self.what == "stage" else f"rank {self.ranks[s]}"

    def arrival(self) -> Optional[tuple]:
        """``(ranks, how)`` when a non-finite gradient arrived at this rank's (first) stage
        from the next stage: the stage it came from and the stage where it started."""
        if self.what != "stage" or not self.me:
            return None
        mine_bad = [s for s in self.me if self.bad[s]]
        if not mine_bad or not all(self.arrived[s] for s in mine_bad):
            return None  # (it was made in a stage of this rank's: the local search names it)
        s = max(mine_bad)  # (the one nearest the loss: the others got it from there)
        n = len(self.ranks)
        if s + 1 >= n:
            return None
        start = s + 1
        while start + 1 < n and self.arrived[start] and self.bad[start + 1]:
            start += 1
        how = f"it arrived non-finite from stage {s + 1}, rank {self.ranks[s + 1]}, in the gradient of stage {s}'s output"
        if start != s + 1:
            how += f"; it started in stage {start}, rank {self.ranks[start]}"
        return (self.ranks[start],), how


# --------------------------------------------------------------------------- the stages' hooks
class StageRelay:
    """This rank's pipeline stages (found when the watch starts, or later, `look_again`) and,
    with several of them, hooks on each: its output's gradient, arriving from the next stage
    (`arrive`), and with ``make_capture`` (a ``graddbg.blame.Capture``) its last forward pass,
    for a replay of the stage where a non-finite gradient was made. One stage: the watch's
    own tap on the model's output does both (`output_grad`). ``active()``: False while the
    watch replays a step."""

    def __init__(self, model: nn.Module, make_capture: Any = None, active: Callable[[], bool] = lambda: True) -> None:
        self.model = model
        self.stages: List[Any] = find_stages(model)
        self.hooks = HookSet()  # the hooks on the stages' modules, until `close`
        self.taps = HookSet()   # the hooks on this step's outputs, until the next step
        self._make_capture, self._active = make_capture, active
        self._arrived: Dict[int, Tensor] = {}    # stage -> whether a non-finite gradient reached its output
        self._rngs: Dict[int, Tensor] = {}       # stage -> the RNG state before its last forward pass
        self._captures: Dict[int, Any] = {}      # stage -> its last forward pass (a replay's inputs)
        self._last_captures: Dict[int, Any] = {}  # (those of the step last exchanged)
        self._tap()

    def look_again(self) -> None:
        """Look for stages built after the watch started (until the layout is resolved)."""
        self.stages = find_stages(self.model)
        self._tap()

    def _tap(self) -> None:
        if len(self.stages) < 2 or len(self.hooks):
            return
        names = {id(m): n for n, m in unwrap(self.model).named_modules()}
        for st in self.stages:
            mod = st.submod
            prefix = names.get(id(unwrap(mod)), names.get(id(mod), ""))  # (replays name modules within unwrap(mod))
            if self._make_capture is not None:
                self.hooks.add(mod.register_forward_pre_hook(self._rng_hook(st.stage_index)))
            self.hooks.add(mod.register_forward_hook(
                self._output_hook(st.stage_index, st.stage_index == st.num_stages - 1, mod, prefix), with_kwargs=True))

    def _rng_hook(self, index: int) -> Any:
        def pre_hook(module: nn.Module, args: Any) -> None:
            if self._active():
                self._rngs[index] = torch.get_rng_state()

        return pre_hook

    def _output_hook(self, index: int, last: bool, mod: nn.Module, prefix: str) -> Any:
        def forward_hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if not self._active():
                return
            outs = [o for o in (output if isinstance(output, (tuple, list)) else (output,)) if isinstance(o, Tensor)]
            i = next((k for k, o in enumerate(outs) if o.requires_grad), None)
            if i is None:
                return
            cap = None
            if self._make_capture is not None:
                cap = self._make_capture(args, kwargs, self._rngs.get(index), i, module=mod, prefix=prefix)
                self._captures[index] = cap
            self.taps.add(outs[i].register_hook(lambda grad: self.arrive(index, grad, last, cap)))

        return forward_hook

    def arrive(self, index: int, grad: Tensor, last: bool = False, cap: Any = None) -> None:
        """The gradient ``grad`` arrived at stage ``index``'s output (``last``: the last
        stage's, from the loss): whether it was non-finite, kept on the device."""
        try:  # (inside the user's backward pass: never raise there)
            if cap is not None:
                cap.grad = grad
            if last or not self._active():
                return
            with torch.no_grad():
                flag = ~torch.isfinite(grad.detach()).all()
                held = self._arrived.get(index)
                self._arrived[index] = flag if held is None else held | flag
        except Exception:
            pass

    def output_grad(self, grad: Tensor, slot: Optional[int]) -> None:
        """The gradient arriving at the output of this rank's one stage (``slot``, or its
        index when not known yet) from the next stage, seen by the watch's tap on the output."""
        if not isinstance(grad, Tensor) or self.last_stage() or len(self.stages) > 1:
            return
        self.arrive(slot if slot is not None else self.stages[0].stage_index if self.stages else 0, grad)

    def last_stage(self) -> bool:
        return bool(self.stages) and self.stages[-1].stage_index == self.stages[-1].num_stages - 1

    def next_step(self) -> None:
        """A step boundary outside a backward pass: every output of the step got its
        gradient, so their hooks go."""
        self.taps.remove_all()

    def take(self) -> Dict[int, Tensor]:
        """The step's arrival flags (stage -> flag on the device); its forward passes become
        the last step's (`capture`)."""
        arrived, self._arrived = self._arrived, {}
        self._last_captures, self._captures = self._captures, {}
        return arrived

    def capture(self, report: StageReport) -> Any:
        """The last forward pass of the stage of this rank's where a non-finite gradient was
        made (bad, and none arrived at its output), for a replay; None when there is none
        (one stage on this rank: the watch's own capture)."""
        made = [s for s in report.me if report.bad[s] and not report.arrived[s]]
        cap = self._last_captures.get(max(made)) if made else None
        return cap if cap is not None and cap.grad is not None else None

    def close(self) -> None:
        """Remove the hooks on the stages and their outputs."""
        self.hooks.remove_all()
        self.taps.remove_all()


# --------------------------------------------------------------------------- the summary
class Summary:
    """The per-step summary over ``groups.summary_group`` (see the module's docstring):
    one slot per stage (``pipeline``), or per rank."""

    def __init__(self, groups: Groups, pipeline: bool) -> None:
        self.groups, self.pipeline = groups, pipeline
        self._drift_next: Optional[int] = None  # (a drift of this stage's replicas, for the next summary)

    def flag_drift(self, step: int) -> None:
        """This stage's replicas differ (found at ``step``, after its summary): said in the
        next step's summary, so that every stage learns it at the same step."""
        self._drift_next = step

    def exchange(self, norms: np.ndarray, has: np.ndarray, bad: np.ndarray, arrived: Dict[int, Tensor],
                 differ: Optional[int], device: torch.device) -> StageReport:
        """Every rank learns each slot's squared norm and non-finite flag, whether one
        ``arrived`` from the next stage, and whether its replicas differ (``differ``: the step
        this rank's replicas' hash differed at, or None)."""
        g = self.groups
        n = len(g.summary_ranks)
        table = torch.zeros(n, 4, dtype=torch.float64, device=device)
        sq = np.where(has & np.isfinite(norms), norms, 0.0) ** 2
        if g.param_slot is not None and len(g.slots) > 1:
            slot_sq = np.bincount(g.param_slot.numpy(), weights=sq, minlength=n)
            slot_bad = np.bincount(g.param_slot.numpy(), weights=bad.astype(float), minlength=n) > 0
        else:
            slot_sq = np.zeros(n)
            slot_sq[g.slots[0]] = sq.sum()
            slot_bad = np.zeros(n, dtype=bool)
            slot_bad[g.slots[0]] = bool(bad.any())
        for s in g.slots:
            table[s, 0] = float(slot_sq[s])
            table[s, 1] = float(slot_bad[s])
            found = differ if differ is not None else self._drift_next
            table[s, 3] = 0.0 if found is None else float(found + 1)
        self._drift_next = None
        for s, flag in arrived.items():
            if s < n:
                table[s, 2] = flag.to(device).double()
        run_collective(torch.distributed.all_reduce, table, group=as_group(g.summary_group))
        got = table.cpu().numpy()
        return StageReport("stage" if self.pipeline else "rank", got[:, 0], got[:, 1] > 0, got[:, 2] > 0,
                           g.summary_ranks, list(g.slots), got[:, 3])

    def global_norm(self, report: StageReport) -> float:
        """The whole model's norm: every stage once (one rank of each signature class when
        ranks hold different parameters without a pipeline)."""
        sq = report.sq if self.pipeline else report.sq[sorted(set(self.groups.classes))]
        return float(np.sqrt(sq.sum()))
