"""``activations=True``: every module checks its forward output for NaN/Inf (the producer
of a forward NaN may be a container); leaf modules also record the gradient norm at their
output. Module hooks under torch.compile are skipped (no graph break); the check warns
when activations were asked for and none came."""
from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from graddbg._errors import CompileWarning
from graddbg._model import in_backward, tensors_in, unwrap
from graddbg.blame import backward_producer, forward_producer
from graddbg.checks.recorder import StatsRecorder
from graddbg.checks.base import Check, Finding, Step, Watched, wrote

__all__ = ["Activations"]

_is_compiling = torch.compiler.is_compiling


def _any_nonfinite(ts: Sequence[Tensor], device: torch.device) -> Tensor:
    flags = [~torch.isfinite(t.detach()).all() for t in ts if t.numel() and t.device == device]
    if not flags:
        return torch.zeros((), dtype=torch.bool, device=device)
    return torch.stack(flags).any()


class Activations(Check):
    """Forward non-finite flags of every module and gradient norms at leaf outputs."""

    after = (StatsRecorder,)

    def __init__(self, model: nn.Module) -> None:
        self.modules = list(unwrap(model).named_modules())
        self.names = [n for n, _ in self.modules]
        self.leaf = [next(m.children(), None) is None for _, m in self.modules]
        self.fwd: List[Tuple[int, Tensor, Tensor]] = []
        self.bwd: List[Tuple[int, Tensor]] = []
        self.rows: List[Tuple[int, str, float, int]] = []
        self.seen: set = set()
        self.handles = contextlib.ExitStack()  # the tensor hooks of the forward pass since the last step
        self.n_handles = 0
        self.warned = False
        self._backward_since = True

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        for idx, (_, mod) in enumerate(self.modules):
            ctx.hooks.add(mod.register_forward_hook(self._make_hook(idx, ctx.alive)))
            ctx.guard.protect(mod)

    def _make_hook(self, idx: int, alive: Callable[[], bool]) -> Callable[..., None]:
        leaf = self.leaf[idx]

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if _is_compiling() or not alive() or in_backward():
                return  # (activation checkpointing recomputes forwards in backward: skipped)
            self.seen.add(idx)
            outs = tensors_in(output)
            if not outs:
                return
            with torch.no_grad():
                dev = outs[0].device
                self.fwd.append((idx, _any_nonfinite(tensors_in(args), dev), _any_nonfinite(outs, dev)))
            if leaf and torch.is_grad_enabled():
                for t in outs:
                    if t.requires_grad:
                        self.handles.callback(t.register_hook(self._make_grad_hook(idx, alive)).remove)
                        self.n_handles += 1

        return hook

    def _make_grad_hook(self, idx: int, alive: Callable[[], bool]) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            if alive():
                with torch.no_grad():
                    self.bwd.append((idx, grad.detach().double().pow(2).sum()))

        return hook

    def on_forward(self, fwd: Any = None) -> None:
        """A new forward pass: what the previous one registered is dropped when its
        backward never came (an evaluation loop with grad enabled)."""
        if not self._backward_since:
            self._drop()
        self._backward_since = False

    def on_backward_end(self, bw: Any) -> None:
        self._backward_since = True

    def _drop(self) -> None:
        handles, self.handles, self.n_handles = self.handles, contextlib.ExitStack(), 0
        handles.close()
        self.fwd, self.bwd = [], []

    def queue(self, step: Step) -> Any:
        if not step.read:
            return None
        fwd, bwd, self.fwd, self.bwd = self.fwd, self.bwd, [], []
        got = {}
        if fwd:
            got["act_fwd"] = step.readback.add("act_fwd", torch.stack([torch.stack([i, o]) for _, i, o in fwd]).double())
        if bwd:
            got["act_bwd"] = step.readback.add("act_bwd", torch.stack([v for _, v in bwd]))
        return fwd, bwd, got

    def read(self, step: Step) -> List[Finding]:
        taken = step.token(self)
        if taken is None:
            return []
        fwd, bwd, slots = taken
        got = {k: s.value for k, s in slots.items()}
        self._record(step.index, fwd, bwd, got)
        if step.stats is not None:
            self._warn_if_blind(bool(step.stats.has_grad.any()))
        if step.any_bad:
            return wrote([], hint=self._producer(fwd, bwd, got, [self.ctx.names[i] for i in np.nonzero(step.bad)[0]]))
        return []

    def _record(self, index: int, fwd: list, bwd: list, got: Dict[str, np.ndarray]) -> None:
        sq: Dict[int, float] = {}
        bad: Dict[int, int] = {}
        for (mi, _, _), (_, out_b) in zip(fwd, got.get("act_fwd", np.zeros(0)).reshape(-1, 2)):
            bad[mi] = bad.get(mi, 0) | int(out_b > 0)
        for (mi, _), v in zip(bwd, got.get("act_bwd", ())):
            sq[mi] = sq.get(mi, 0.0) + float(v)  # a module called twice adds up
        for mi in sorted(set(sq) | {m for m in bad if self.leaf[m]}):
            self.rows.append((index, self.names[mi], math.sqrt(sq[mi]) if mi in sq else math.nan, bad.get(mi, 0)))

    def _producer(self, fwd: list, bwd: list, got: Dict[str, np.ndarray],
                  bad_names: Sequence[str]) -> Optional[Tuple[str, str]]:
        """(module, how it was found) from the activations, when they tell."""
        if fwd:
            mi = forward_producer(fwd, got["act_fwd"])
            if mi is not None:
                return self.names[mi], "forward activations"
        if bwd:
            finite: Dict[int, bool] = {}
            for (mi, _), v in zip(bwd, got["act_bwd"]):
                finite[mi] = finite.get(mi, True) and bool(np.isfinite(v))
            calls = [mi for mi, _, _ in fwd if self.leaf[mi]]
            name = backward_producer(calls, finite, self.names, bad_names)
            if name is not None:
                return name, "gradients at module outputs"
        return None

    def _warn_if_blind(self, had_gradients: bool) -> None:
        """Gradients came, yet no module hook ever ran: the model was called through a
        compiled wrapper (or its submodules' forward() directly). Warn once."""
        if had_gradients and not self.seen and not self.warned:
            self.warned = True
            warnings.warn("graddbg.watch: activations=True recorded nothing: gradients arrived but no "
                          "module's forward hook ran. The watched model is probably called through "
                          "torch.compile (hooks are skipped inside compiled code, so that they break no "
                          "graph), or its modules' .forward() is called directly. Watch the model you call, "
                          "uncompiled, to record activations.", CompileWarning, stacklevel=2)

    def pending(self) -> int:
        """Forward records and tensor hooks waiting for a step (bounded by one forward pass)."""
        return max(self.n_handles, len(self.fwd))

    def frame(self):
        """Gradient norm at each leaf module's output per step."""
        import pandas as pd

        return pd.DataFrame(self.rows, columns=["step", "module", "grad_norm", "out_nonfinite"])

    def close(self) -> None:
        self._drop()
        self.modules = []
