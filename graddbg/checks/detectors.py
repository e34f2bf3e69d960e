"""The detectors of loud failures: non-finite gradients (blamed on their producer),
explosions and vanishing gradients. Each reads what the statistics recorder measured."""
from __future__ import annotations

import contextlib
from typing import Iterator, List

import numpy as np

from graddbg._model import unwrap
from graddbg.anomaly import Anomaly, Blame, nonfinite_anomaly
from graddbg.blame import nonfinite_state, replay, state_anomaly
from graddbg.checks.base import Check, Finding, Step, Watched

__all__ = ["NonFiniteCheck", "ExplodeCheck", "VanishCheck"]


class NonFiniteCheck(Check):
    """NaN/Inf gradients, blamed on the module, op and line that made them: a non-finite
    weight or buffer is its own producer; otherwise the affected parameter nearest the
    output, refined by the activations (``step.hint``) and by a replay of the step's
    forward and backward pass under `graddbg.find_nonfinite`."""

    def read(self, step: Step) -> List[Finding]:
        det = self.ctx.options.nonfinite
        if det is None or not step.any_bad:
            return []
        idx = np.nonzero(step.bad)[0]
        return [Finding(self._anomaly(step, idx), det.policy, skip=[int(i) for i in idx])]

    def _anomaly(self, step: Step, idx: np.ndarray) -> Anomaly:
        ctx = self.ctx
        names = [ctx.names[i] for i in idx]
        state = nonfinite_state(unwrap(ctx.model)) if ctx.model is not None else []
        if state:  # a NaN/Inf weight or buffer: it is the producer
            return state_anomaly(state, step.first_bad, ctx.rank)
        where = self._localise(step, names, idx)
        if where.module:  # name a parameter of the module blamed, when it has one among the affected
            own = [n for n in names if n.startswith(where.module + ".")]
            where.name = own[0] if own else where.name
        st = step.stats
        total = int(st.nonfinite[idx].sum()) or None
        if st.shard_ranks:
            where.ranks = sorted({r for i in idx for r in st.shard_ranks.get(int(i), ())})
        where.origin = step.origin
        return nonfinite_anomaly(step.first_bad, names, [tuple(ctx.params[i].shape) for i in idx], total,
                                 where, ctx.rank)

    def _localise(self, step: Step, names: List[str], idx: np.ndarray) -> Blame:
        """Where the non-finite value started: the affected parameter nearest the output
        (the first the backward pass reached), refined by the activations and by a replay."""
        modules = self.ctx.modules
        module = modules[idx[-1]]
        where = Blame(module=module, name=next(n for n, i in zip(names, idx) if modules[i] == module))
        if step.hint is not None:
            where.module, where.how = step.hint
        cap = step.capture
        if self.ctx.options.localise and cap is not None and step.first_bad == step.index:
            with self._replaying():
                ran, got = replay(self.ctx.model, cap, step.index)
            where.reproduced = (got is not None) if ran else None
            if got is not None and (got.module is not None or got.op is not None):
                where.module = got.module if got.module is not None else where.module
                where.op, where.source, where.how = got.op, got.source, "a replay of the forward and backward pass"
        return where

    @contextlib.contextmanager
    def _replaying(self) -> Iterator[None]:
        self.ctx.replaying = True  # (the watch's hooks ignore the replay)
        try:
            yield
        finally:
            self.ctx.replaying = False


class ExplodeCheck(Check):
    """A global gradient norm far above its robust running level (see `graddbg.Explode`)."""

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        det = ctx.options.explode
        self._state = det.new_state() if det is not None else None

    def read(self, step: Step) -> List[Finding]:
        if self._state is None or not step.due_stats or step.stats is None or step.any_bad:
            return []
        st = step.stats
        gn = st.global_norm
        clipped = step.clipped_norm == step.clipped_norm and step.clipped_norm < gn * (1 - 1e-6)
        a = self._state.check(step.index, gn, st.norm, self.ctx.names, self.ctx.modules, clipped=clipped)
        return [] if a is None else [Finding(a, self.ctx.options.explode.policy)]


class VanishCheck(Check):
    """Parameters whose gradient norm stays tiny (see `graddbg.Vanish`)."""

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        det = ctx.options.vanish
        self._state = det.new_state(len(ctx)) if det is not None else None

    def params_added(self, k: int) -> None:
        if self._state is not None:
            self._state.widen(k)

    def read(self, step: Step) -> List[Finding]:
        if self._state is None or not step.due_stats or step.stats is None:
            return []
        st = step.stats
        a = self._state.check(step.index, st.norm, st.has_grad, self.ctx.names, self.ctx.modules)
        return [] if a is None else [Finding(a, self.ctx.options.vanish.policy, skip=[])]
