"""The step ledger: what happened in each step, in order, as typed facts.

For every step boundary the `LedgerKeeper` (the first check) writes one `StepEntry`: the
forward passes that fed the step (training mode, grad mode, autocast), the backward passes
and what each found in the gradients it accumulated into (kept, cleared, replaced), what
touched the gradients between the last backward pass and the step (cleared, changed in
place, replaced: from identities and version counters), the step's path and each param
group's learning rate, and which parameters the step changed (their version counters).
These are host facts, read on every step at no device cost; the device facts of a recorded
step (norms, the loss scale) are added from the one read-back by the statistics recorder.

The other checks read the entry of the step (``step.entry``) and the entries before it
(`Ledger`); a finding is an invariant of a healthy step that the entries show broken.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from graddbg._args import FUSED_WEIGHTS
from graddbg._model import unwrap
from graddbg._source import user_line
from graddbg.checks.base import BackwardEnd, Check, Step, Watched
from graddbg.stats import Retained

__all__ = ["Forward", "Backward", "StepEntry", "Ledger", "LedgerKeeper", "MODE_DEPENDENT", "versions", "param_versions",
           "describe"]

#: module types whose forward depends on ``training`` (dropout, batch statistics)
MODE_DEPENDENT: Tuple[type, ...] = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm,
                                    nn.modules.instancenorm._InstanceNorm)

#: how the gradients a backward pass accumulated into were found (the probe parameter's
#: gradient, compared with what the previous step left)
HELD = ("none", "kept", "cleared", "replaced", "first")


@dataclasses.dataclass(frozen=True)
class Forward:
    """A forward pass of the watched model that fed the step (a backward pass followed it)."""

    training: bool  #: the model's ``training`` flag
    eval_layers: int  #: mode-dependent layers (dropout, batch norm) in eval mode
    grad: bool  #: grad mode was enabled
    autocast: Optional[str]  #: the autocast dtype in force, or None


@dataclasses.dataclass
class Backward:
    """A backward pass into the model's parameters."""

    held: str  #: the gradient it accumulated into: one of `HELD`
    grads: int  #: parameters with a gradient at its end
    lrs: Tuple[float, ...] = ()  #: each param group's learning rate at its end
    #: (file, line) of the user's ``backward()`` call, when the pass ran on the thread that made
    #: it (None: another thread, as CUDA's backward passes run)
    line: Optional[Tuple[str, int]] = None


@dataclasses.dataclass
class StepEntry:
    """One step, as the ledger keeps it. Host facts are set on every step; the device facts
    (``global_norm``, ``clipped_norm``, ``scale``) only on recorded steps (NaN otherwise)."""

    index: int
    path: str = "optimizer"  #: "optimizer", "closure", "scaler", "engine", "manual", "backward"
    forwards: List[Forward] = dataclasses.field(default_factory=list)
    backwards: List[Backward] = dataclasses.field(default_factory=list)
    #: per parameter: its gradient was replaced or changed in place after the last backward pass
    changed: Optional[np.ndarray] = None
    #: per parameter: its gradient is another tensor than the last backward pass left (set by hand)
    replaced: Optional[np.ndarray] = None
    present: Optional[np.ndarray] = None  #: per parameter: a gradient at the step
    same_as_last_step: Optional[np.ndarray] = None  #: per parameter: the very gradient the previous step had
    lrs: Tuple[float, ...] = ()  #: each param group's learning rate at the step
    #: the other hyper-parameters of each param group (momentum, betas, weight decay, ...)
    hparams: Tuple[str, ...] = ()
    moved: Optional[np.ndarray] = None  #: per parameter: its version counter moved during the step
    #: per parameter: its version counter moved between the previous step and this one (not
    #: by the watched optimizer: another optimizer, a hand edit, a weight copy)
    outside: Optional[np.ndarray] = None
    skipped: bool = False  #: the GradScaler skipped the step (an overflow)
    #: the optimizer stepped on gradients a GradScaler scaled and did not unscale (not
    #: through ``scaler.step``)
    scaled: bool = False
    update: float = math.nan  #: the largest update/weight ratio ||dw|| / ||w|| of the step, when measured
    global_norm: float = math.nan
    clipped_norm: float = math.nan
    scale: float = math.nan
    kinds: List[str] = dataclasses.field(default_factory=list)  #: the findings made at this step
    #: forward passes of the model with grad disabled since the previous step (an evaluation,
    #: an RL rollout's action selection: a phase of the program between training steps)
    nograd_forwards: int = 0

    @property
    def between(self) -> str:
        """What touched the gradients after the last backward pass and before the step:
        ``cleared``; ``unscaled`` (the GradScaler's step), ``clipped`` (the norm went down:
        a clip), ``unscaled+clipped``, or ``changed`` (in place or replaced, by whom the
        recorded norms do not tell) from the version counters and, on recorded steps, the
        norms before and after; ``-``: untouched."""
        if self.present is not None and not self.present.any():
            return "cleared" if self.backwards else "none"
        if self.changed is None or not self.changed.any():
            return "-"
        unscaled = self.path == "scaler"
        clipped = not math.isnan(self.clipped_norm) and self.clipped_norm < self.global_norm * (1 - 1e-6)
        if unscaled or clipped:
            return "+".join(w for w, on in (("unscaled", unscaled), ("clipped", clipped)) if on)
        return "changed"


class Ledger:
    """The step entries kept, oldest first, and the entry being written (``current``), under
    the history's retention rule (`graddbg.stats.Retained`, as ``w.steps``): at most
    ``size`` entries; when full, the first steps, the latest, the steps of findings
    (`mark`) and an evenly spaced middle stay. Written by the `LedgerKeeper` only; read by
    every check (``ctx.ledger``)."""

    def __init__(self, size: int = 10_000) -> None:
        self._kept = Retained(max(4, size), {"step": (np.int64, ()), "entry": (object, ())})
        self._pending: set = set()  # steps marked before their entries were added
        self.current = StepEntry(index=-1)
        #: the parameter whose gradient is looked at before each backward pass accumulates
        self.probe: Optional[int] = None
        #: the parameters' version counters after the watched optimizer's last step
        self.after_step_versions: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return self._kept.n

    @property
    def entries(self) -> List[StepEntry]:
        """Every entry kept, oldest first."""
        return list(self._kept.cols["entry"][: self._kept.n])

    def add(self, e: StepEntry) -> None:
        """A complete entry (by the keeper)."""
        self._kept.append({"step": e.index, "entry": e}, self._pending)
        if self._pending:
            self._pending = {s for s in self._pending if s > e.index}

    def mark(self, index: int) -> None:
        """Keep step ``index``'s entry (a finding's step), or the one it will have."""
        if not self._kept.n or index > int(self._kept.cols["step"][self._kept.n - 1]):
            self._pending.add(int(index))
        self._kept.mark(index)

    def last(self, k: int) -> List[StepEntry]:
        n = self._kept.n
        return list(self._kept.cols["entry"][max(0, n - k): n]) if k > 0 else []

    def find(self, index: int) -> Optional[StepEntry]:
        n = self._kept.n
        steps = self._kept.cols["step"][:n]
        at = int(np.searchsorted(steps, index, "right")) - 1  # (the last entry of that step)
        return self._kept.cols["entry"][at] if at >= 0 and steps[at] == index else None

    def frame(self, names: Sequence[str]):
        """One row per step (the columns of `graddbg.Watch.ledger`)."""
        import pandas as pd

        rows = [_row(e, names) for e in self.entries]
        return pd.DataFrame(rows, columns=list(_COLUMNS))


_COLUMNS = ("step", "path", "forwards", "mode", "grad_mode", "autocast", "backwards", "held_before",
            "between", "grads", "lr", "hparams", "moved", "unmoved_with_grad", "update", "skipped", "global_norm",
            "clipped_norm", "scale", "findings")


def _row(e: StepEntry, names: Sequence[str]) -> Dict[str, Any]:
    modes = {"train" if f.training and not f.eval_layers else "eval" if not f.training else "mixed"
             for f in e.forwards}
    unmoved = ""
    if e.moved is not None and e.present is not None:
        idx = np.nonzero(e.present & ~e.moved)[0]
        unmoved = ", ".join(names[i] for i in idx[:5]) + (f" (+{len(idx) - 5})" if len(idx) > 5 else "")
    return {"step": e.index, "path": e.path, "forwards": len(e.forwards),
            "mode": "/".join(sorted(modes)) or "-",
            "grad_mode": "/".join(sorted({"on" if f.grad else "off" for f in e.forwards})) or "-",
            "autocast": "/".join(sorted({f.autocast for f in e.forwards if f.autocast})) or "-",
            "backwards": len(e.backwards), "held_before": ",".join(b.held for b in e.backwards) or "-",
            "between": e.between, "grads": int(e.present.sum()) if e.present is not None else 0,
            "lr": ",".join(f"{x:g}" for x in e.lrs) or "-", "hparams": "; ".join(e.hparams) or "-",
            "update": e.update,
            "moved": int(e.moved.sum()) if e.moved is not None else None, "unmoved_with_grad": unmoved,
            "skipped": e.skipped, "global_norm": e.global_norm, "clipped_norm": e.clipped_norm,
            "scale": e.scale, "findings": ",".join(e.kinds)}


def versions(tensors: Sequence[Optional[Tensor]]) -> np.ndarray:
    """In-place version counters (-1 for None): a host read, no device work."""
    return np.fromiter((-1 if t is None else t._version for t in tensors), dtype=np.int64, count=len(tensors))


def _ids(tensors: Sequence[Optional[Tensor]]) -> np.ndarray:
    """The tensors' identities (0 for None), as an array compared at once."""
    return np.fromiter((0 if t is None else id(t) for t in tensors), dtype=np.uint64, count=len(tensors))


def param_versions(params: Sequence[Tensor]) -> np.ndarray:
    """The parameters' version counters (a DTensor's: its local shard's), a host read."""
    return np.fromiter((getattr(p, "_local_tensor", p)._version for p in params), dtype=np.int64,
                       count=len(params))


def _lr(group: Dict[str, Any]) -> float:
    lr = group.get("lr", math.nan)
    if isinstance(lr, Tensor):
        return float(lr) if lr.device.type == "cpu" and lr.numel() == 1 else math.nan
    try:
        return float(lr)
    except (TypeError, ValueError):
        return math.nan


_HPARAMS = ("momentum", "betas", "weight_decay", "eps", "dampening", "nesterov", "alpha", "maximize")


_HP_TEXT: Dict[tuple, str] = {}


def _hparams(group: Dict[str, Any]) -> str:
    """A param group's hyper-parameters besides its lr, as short text (made once per set of
    values: a step reads the values only)."""
    key = tuple(str(group.get(k)) for k in _HPARAMS)
    text = _HP_TEXT.get(key)
    if text is None:
        if len(_HP_TEXT) > 256:
            _HP_TEXT.clear()
        text = _HP_TEXT[key] = _hparams_text(group)
    return text


def _hparams_text(group: Dict[str, Any]) -> str:
    out = []
    for k in _HPARAMS:
        v = group.get(k)
        if v is None or v is False:
            continue
        if isinstance(v, tuple):
            v = "(" + ",".join(f"{x:g}" if isinstance(x, (int, float)) else str(x) for x in v) + ")"
        elif isinstance(v, float):
            v = f"{v:g}"
        out.append(f"{k}={v}")
    return " ".join(out)


def _autocast() -> Optional[str]:
    for dev in ("cuda", "cpu"):
        try:
            if torch.is_autocast_enabled(dev):
                return str(torch.get_autocast_dtype(dev)).replace("torch.", "")
        except (RuntimeError, TypeError):  # (a device type this build does not know)
            continue
    return None


class LedgerKeeper(Check):
    """Writes the ledger: one `StepEntry` per step boundary, from host facts only.

    The probe: one small parameter held by the optimizer, whose gradient is looked at just
    before each backward pass accumulates into it (a tensor hook on the parameter): None,
    the same tensor as the previous step left (kept), changed in place since (cleared by
    ``zero_grad(set_to_none=False)``) or another tensor (replaced)."""

    def __init__(self) -> None:
        self._forward: Optional[Forward] = None
        self._held = "first"
        self._after: Tuple[int, int] = (0, -1)  # (id, version) of the probe's gradient after the last step
        self._bw_ids = np.zeros(0, dtype=np.uint64)
        self._bw_versions: Optional[np.ndarray] = None
        self._step_ids: Optional[np.ndarray] = None
        self._step_versions: Optional[np.ndarray] = None
        self._before: Optional[np.ndarray] = None
        self._last: Optional[np.ndarray] = None  # the parameters' versions after the last step
        #: the optimizer moves no version counter (fused kernels): weights compared on the device
        self._blind = False
        self._norms_before: Optional[Tuple[int, Tensor]] = None
        self._moved_dev: Optional[Tuple[int, Tensor]] = None  # (step, [P] moved flags on the device)
        self._layers: List[nn.Module] = []
        self.thread = threading.get_ident()
        self.forwards_seen = 0  #: forward passes of the model seen (its own forward hooks ran)

    # ------------------------------------------------------------------ attaching
    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self.ledger: Ledger = ctx.ledger
        opt = ctx.optimizer
        self._blind = opt is not None and any(g.get("fused") for g in opt.param_groups)
        root = unwrap(ctx.model)
        self._layers = [m for m in root.modules() if isinstance(m, MODE_DEPENDENT)]
        self._held_ids = self._held_by_optimizer()
        self._pick_probe()

    def _blind_check(self, e: StepEntry) -> None:
        """After a step: an optimizer whose step moved no version counter although it had
        gradients and a learning rate (fused kernels do not count their writes) makes the
        counters blind for this run; then the weights' norms tell (on the steps of `graddbg._args.FUSED_WEIGHTS`), and
        steps not weighed have ``moved`` unknown (None)."""
        if not self._blind and not e.moved.any() and e.present is not None and e.present.any() and \
                any(lr != 0 for lr in e.lrs):
            self._blind = True
        if not self._blind:
            return
        e.moved, e.outside = None, None
        before, self._norms_before = self._norms_before, None
        if before is not None and before[0] == e.index:
            with torch.no_grad():
                after = torch.stack(torch._foreach_norm(
                    [getattr(p, "_local_tensor", p).detach() for p in self.ctx.params])).double()
                self._moved_dev = (e.index, (after != before[1]).double())

    def _scaled_step(self) -> bool:
        """Whether the optimizer's step, beginning now, is not called by the GradScaler in
        use although the scaler scaled its gradients and has not unscaled them (host facts:
        the calling frames, the scaler's state for this optimizer)."""
        scaler, opt = self.ctx.options.scaler, self.ctx.optimizer
        states = getattr(scaler, "_per_optimizer_states", None)
        if scaler is None or opt is None or not isinstance(states, dict):
            return False
        state = states.get(id(opt))  # (no entry: the scaler never unscaled nor stepped this optimizer)
        stage = "READY" if state is None else getattr(state.get("stage"), "name", "")
        if stage != "READY" or not self.entry.backwards:
            return False
        frame = sys._getframe(1)
        for _ in range(12):
            if frame is None:
                return True
            if frame.f_locals.get("self") is scaler:
                return False  # (GradScaler.step: it unscales first)
            frame = frame.f_back
        return True

    def _held_by_optimizer(self) -> set:
        return self.ctx.held_by_optimizer() or set()

    def _pick_probe(self) -> None:
        ctx = self.ctx
        mine = [k for k, p in enumerate(ctx.params) if id(p) in self._held_ids] if ctx.optimizer else []
        if not mine:
            return
        i = min(mine, key=lambda k: ctx.params[k].numel())  # (one the optimizer's zero_grad clears)
        self.ledger.probe = i
        ctx.hooks.add(ctx.params[i].register_hook(self._before_accumulate))

    def params_added(self, k: int) -> None:
        self._bw_versions = self._step_versions = self._before = self._last = None
        self._bw_ids, self._step_ids = np.zeros(0, dtype=np.uint64), None

    # ------------------------------------------------------------------ events
    @property
    def entry(self) -> StepEntry:
        """The entry being written (the step under way)."""
        return self.ledger.current

    def on_forward(self, fwd: Forward) -> None:
        self._forward = fwd
        self.forwards_seen += 1

    def _before_accumulate(self, incoming: Tensor) -> None:
        if not self.ctx.alive():
            return None
        g = self.ctx.params[self.ledger.probe].grad
        if self._held == "first":
            self._held = "none" if g is None else "kept"  # (before the first step: whatever was there)
        elif g is None:
            self._held = "none"
        elif id(g) != self._after[0]:
            self._held = "replaced"
        elif g._version != self._after[1]:
            self._held = "cleared"
        else:
            self._held = "kept"
        return None

    def on_backward_end(self, bw: BackwardEnd) -> None:
        e = self.entry
        if self._forward is not None:
            e.forwards.append(self._forward)
            self._forward = None
        grads = bw.grads
        opt = self.ctx.optimizer
        e.backwards.append(Backward(self._held if self.ledger.probe is not None else "-",
                                    sum(g is not None for g in grads),
                                    tuple(_lr(g) for g in opt.param_groups) if opt is not None else (),
                                    user_line(2)))
        # (accumulation: the next backward pass of this step finds the gradient kept)
        self._after = self._probe_state()
        self._bw_ids = _ids(grads)
        self._bw_versions = versions(grads)

    def _probe_state(self) -> Tuple[int, int]:
        if self.ledger.probe is None:
            return (0, -1)
        g = self.ctx.params[self.ledger.probe].grad
        return (id(g), -1 if g is None else g._version)

    def begin(self, index: int, path: str, grads: List[Optional[Tensor]]) -> StepEntry:
        """The step boundary: the entry's host facts of the gradients and param groups."""
        e = self.entry
        e.index, e.path = index, path
        e.present = np.fromiter((g is not None for g in grads), dtype=bool, count=len(grads))
        ids = _ids(grads)
        now = versions(grads)
        if self._bw_versions is not None and len(self._bw_versions) == len(grads) and e.backwards:
            e.replaced = e.present & (ids != self._bw_ids)
            e.changed = e.replaced | (e.present & (now != self._bw_versions))
        if self._step_versions is not None and len(self._step_versions) == len(grads):
            e.same_as_last_step = e.present & (now == self._step_versions) & (ids == self._step_ids)
        self._step_ids, self._step_versions = ids, now
        opt = self.ctx.optimizer
        if opt is not None:
            e.lrs = tuple(_lr(g) for g in opt.param_groups)
            e.hparams = tuple(_hparams(g) for g in opt.param_groups)
            if self._before is not None and self._last is not None and len(self._last) == len(self._before):
                e.outside = self._before != self._last
        return e

    def before_step(self, index: int, closure: bool) -> None:
        """The optimizer's step begins: the parameters' version counters (and, for an
        optimizer that moves none, their norms on the device on the steps of `graddbg._args.FUSED_WEIGHTS`)."""
        self._before = param_versions(self.ctx.params)
        self._norms_before = None
        self.entry.scaled = self._scaled_step()
        if self._blind and FUSED_WEIGHTS.includes(index):
            with torch.no_grad():
                self._norms_before = (index, torch.stack(torch._foreach_norm(
                    [getattr(p, "_local_tensor", p).detach() for p in self.ctx.params])).double())

    def queue(self, step: Step) -> Any:
        moved, self._moved_dev = self._moved_dev, None
        if moved is None or not step.read:
            return None
        return moved[0], step.readback.add("moved", moved[1])

    def read(self, step: Step) -> list:
        token = step.token(self)
        if token is not None:
            e = self.ledger.find(token[0])
            if e is not None and len(token[1].value) == len(self.ctx):
                e.moved = token[1].value > 0
        return []

    def after_step(self, index: int) -> None:
        e = self.entry if self.entry.index == index else self.ledger.find(index)
        if e is None or self._before is None or len(self._before) != len(self.ctx):
            return
        self._last = self.ledger.after_step_versions = param_versions(self.ctx.params)
        e.moved = self._last != self._before
        self._blind_check(e)
        self._before = None
        self._after = self._probe_state()
        self._held = "-" if self.ledger.probe is None else self._held
        # the gradients the step left, as the next step would find them again unchanged
        grads = self.ctx.grads()
        self._step_ids, self._step_versions = _ids(grads), versions(grads)

    def end(self) -> StepEntry:
        """The step's entry is complete: into the ledger; the next step's entry starts."""
        e = self.entry
        self.ledger.current = StepEntry(index=-1)
        self.ledger.add(e)
        return e

    def skipped(self, index: int) -> None:
        """The GradScaler skipped the step of the backward passes so far."""
        e = self.entry
        e.index, e.path, e.skipped = index, "scaler", True
        self.end()

    def forward_without_grad(self) -> None:
        """A forward pass of the model with grad disabled (not part of a step)."""
        self.entry.nograd_forwards += 1

    def forward_facts(self, model: nn.Module) -> Forward:
        """The host facts of a forward pass starting now."""
        eval_layers = sum(not m.training for m in self._layers)
        return Forward(bool(model.training), eval_layers, torch.is_grad_enabled(), _autocast())

    def mode_layers(self) -> int:
        return len(self._layers)


def _between_text(e: StepEntry) -> str:
    n = int(e.changed.sum()) if e.changed is not None else 0
    return {"cleared": " (all cleared after the backward pass)",
            "unscaled": f" ({n} unscaled by the GradScaler after the backward pass)",
            "clipped": f" ({n} clipped after the backward pass: the norm went down)",
            "unscaled+clipped": f" ({n} unscaled by the GradScaler and clipped after the backward pass)",
            "changed": f" ({n} changed in place or replaced after the backward pass)"}.get(e.between, "")


def describe(e: Optional[StepEntry], names: Sequence[str], index: int) -> str:
    """Step ``index``'s entry in words: what happened in that step, in order."""
    if e is None:
        return f"step {index}: not in the ledger (not reached yet, or older than the ledger keeps)"
    lines = [f"step {e.index} ({e.path}" + (", skipped by the GradScaler: an overflow)" if e.skipped else ")")]
    for k, f in enumerate(e.forwards):
        mode = "training mode" if f.training else "eval mode"
        extra = f", {f.eval_layers} dropout/batch-norm layer(s) in eval mode" if f.eval_layers else ""
        lines.append(f"  forward {k}: {mode}{extra}, grad {'enabled' if f.grad else 'disabled'}"
                     + (f", autocast {f.autocast}" if f.autocast else ""))
    for k, b in enumerate(e.backwards):
        held = {"none": "no gradient held before it (cleared to None)", "kept": "the gradient held before it kept "
                "(accumulated into)", "cleared": "the gradient held before it zeroed in place",
                "replaced": "the gradient held before it replaced by another tensor", "first": "the first pass",
                "-": "not probed"}.get(b.held, b.held)
        lines.append(f"  backward {k}: {held}; {b.grads} parameter(s) with a gradient after it")
    if not e.backwards:
        lines.append("  no backward pass since the previous step")
    if e.present is not None:
        lines.append(f"  at the step: {int(e.present.sum())} of {len(e.present)} parameter(s) with a gradient"
                     + _between_text(e))
    if e.lrs:
        lines.append("  learning rates: " + ", ".join(f"group {k}: {x:g}" for k, x in enumerate(e.lrs))
                     + (f" ({'; '.join(h for h in e.hparams if h)})" if any(e.hparams) else ""))
    if e.moved is not None and e.present is not None:
        still = [names[i] for i in np.nonzero(e.present & ~e.moved)[0]]
        lines.append(f"  the step changed {int(e.moved.sum())} parameter(s)"
                     + (f"; left unchanged with a gradient: {', '.join(still[:6])}" if still else ""))
    if not math.isnan(e.global_norm):
        lines.append(f"  gradient norm {e.global_norm:.4g}" + (f", after a clip {e.clipped_norm:.4g}"
                                                               if not math.isnan(e.clipped_norm) else "")
                     + (f", largest update/weight ratio {e.update:.3g}" if not math.isnan(e.update) else "")
                     + (f", loss scale {e.scale:g}" if not math.isnan(e.scale) else ""))
    if e.kinds:
        lines.append("  findings: " + ", ".join(e.kinds))
    return "\n".join(lines)
