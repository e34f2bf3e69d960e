"""The detectors of loud failures: non-finite gradients (blamed on their producer),
explosions and vanishing gradients. Each reads what the statistics recorder measured."""
from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from graddbg._dist.collective import run_collective
from graddbg._model import is_dtensor, unwrap
from graddbg.anomaly import Anomaly, Blame, Explode, Vanish, nonfinite_anomaly
from graddbg.blame import nonfinite_state, replay, state_anomaly
from graddbg.stats import local_values
from graddbg.checks.activations import Activations
from graddbg.checks.ledger import LedgerKeeper
from graddbg.checks.recorder import StatsRecorder
from graddbg.checks.stages import StageSummary
from graddbg.checks.base import Check, Finding, Step, Watched

__all__ = ["NonFiniteCheck", "ExplodeCheck", "VanishCheck", "lr_rise_text"]


class NonFiniteCheck(Check):
    """NaN/Inf gradients, blamed on the module, op and line that made them: a non-finite
    weight or buffer is its own producer; otherwise the affected parameter nearest the
    output, refined by the activations (``step.hint``) and by a replay of the step's
    forward and backward pass under `graddbg.find_nonfinite`."""

    after = (StatsRecorder, StageSummary, Activations, LedgerKeeper)

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
        state, held = self._state_of_shards(state)
        applied = bool(state) and self._applied_here(step, state)
        self._seen = True
        if state and not applied:  # a NaN/Inf weight or buffer: it is the producer
            return state_anomaly(state, step.first_bad, ctx.rank, held.get(state[0][1]))
        where = self._localise(step, names, idx, replay_ok=not applied)
        if applied:
            where.how += (", read after step(closure) had applied them: the weights it made non-finite "
                          "are victims, and no replay could run on them")
        if where.module:  # name a parameter of the module blamed, else the affected one nearest to it
            own = [n for n in names if n.startswith(where.module + ".")]
            where.name = own[0] if own else self._nearest(where.module, idx)
        st = step.stats
        total = int(st.nonfinite[idx].sum()) or None
        if st.shard_ranks:
            where.ranks = sorted({r for i in idx for r in st.shard_ranks.get(int(i), ())})
        where.origin = step.origin
        made = self._relay(step, where)
        a = nonfinite_anomaly(step.first_bad, names, [tuple(ctx.params[i].shape) for i in idx], total, where,
                              ctx.rank)
        if made is not None:  # (blamed on the stage that made it, by every rank)
            a = dataclasses.replace(a, module=made.get("module"), op=made.get("op"), source=made.get("source"))
        return a

    def _relay(self, step: Step, where: Blame) -> Optional[Dict[str, Any]]:
        """In a pipeline, the stage that made a non-finite value names it (module, op, line)
        for the others through the store; a stage it arrived at from the next stage reads that
        (a bounded wait: every stage localises at this same step) and says where it started.
        Returns what the stage that made it found, on the others; None there and elsewhere."""
        layout = self.ctx.layout
        if layout is None or not layout.pipeline or step.stages is None:
            return None
        if step.origin is None:
            layout.tell_origin(step.first_bad, {"module": where.module, "op": where.op, "source": where.source,
                                                "rank": self.ctx.rank})
            return None
        made = layout.origin_of(step.first_bad)
        if made is not None and made.get("module") is not None:
            said = f"module '{made['module']}'" + (f", op {made['op']}" if made.get("op") else "") \
                + (f", created at {made['source']}" if made.get("source") else "")
            ranks, how = where.origin
            where.origin = (ranks, f"{how}; it started there in {said}, as rank {made.get('rank')} found")
        return made

    _seen = False  # a non-finite gradient or weight was found at an earlier step

    def _nearest(self, module: str, idx: np.ndarray) -> str:
        """The affected parameter whose module comes nearest ``module`` in the model's module
        order (the loss, ``<loss>``, comes after every module); the first of a module's."""
        order = {m: k for k, (m, _) in enumerate(unwrap(self.ctx.model).named_modules())} \
            if self.ctx.model is not None else {}
        at = order.get(module, len(order))
        mods = self.ctx.modules
        best = min(idx, key=lambda i: (abs(order.get(mods[i], -1) - at), order.get(mods[i], -1) < at))
        return self.ctx.names[best]

    def _state_of_shards(self, state: list) -> Tuple[list, Dict[str, List[int]]]:
        """With sharded parameters (FSDP2, HSDP, tensor parallel), a NaN/Inf weight lies in one
        rank's shard: the others see only the gradients it spoilt. Which ranks hold non-finite
        shards of which parameter is agreed by one small all-reduce over the shard group (every
        rank of it found the non-finite gradient at this step: the flags were agreed), so that
        every rank names the weight and the rank that holds it. ``(state, {name: ranks})``."""
        ctx, layout = self.ctx, self.ctx.layout
        sharded = [i for i, p in enumerate(ctx.params) if is_dtensor(p)]
        group = layout.shards_over() if layout is not None and sharded and layout.world > 1 else False
        if group is False:
            return state, {}
        import torch
        import torch.distributed as dist

        size, me = dist.get_world_size(group), dist.get_rank(group)
        with torch.no_grad():
            local = [local_values(ctx.params[i]) for i in sharded]
            flags = torch.stack([~torch.isfinite(t).all() if t.numel() else torch.zeros((), dtype=torch.bool,
                                 device=t.device) for t in local]).long() * (1 << me if size <= 62 else 1)
            run_collective(dist.all_reduce, flags, group=group)
        bits = flags.cpu().tolist()
        held = {ctx.names[i]: [dist.get_global_rank(group, r) if group is not None else r
                               for r in range(min(size, 62)) if (b >> r) & 1] or [-1]
                for i, b in zip(sharded, bits) if b}
        named = {n for _, n, _ in state}
        extra = [("parameter", ctx.names[i], ctx.params[i]) for i in sharded
                 if ctx.names[i] in held and ctx.names[i] not in named]
        return extra + state if extra and not state else state + extra, held

    def _applied_here(self, step: Step, state: list) -> bool:
        """Whether the non-finite weights were made by this very step's update: under
        ``step(closure)`` the gradients are read after the optimizer applied them. Said only
        on the ledger's evidence: no earlier step had a non-finite gradient or weight, this is
        not the first step, and nothing but the optimizer wrote a parameter since the previous
        step (version counters); buffers are never made by an update."""
        entry = step.entry
        if not step.closure or self._seen or step.first_bad != step.index or step.index == 0 or entry is None \
                or entry.outside is None or bool(np.asarray(entry.outside).any()):
            return False
        return all(kind == "parameter" for kind, _, _ in state)

    def _localise(self, step: Step, names: List[str], idx: np.ndarray, replay_ok: bool = True) -> Blame:
        """Where the non-finite value started: the affected parameter nearest the output
        (the first the backward pass reached), refined by the activations and by a replay."""
        modules = self.ctx.modules
        module = modules[idx[-1]]
        where = Blame(module=module, name=next(n for n, i in zip(names, idx) if modules[i] == module))
        if step.hint is not None:
            where.module, where.how = step.hint
        cap = step.capture
        if self.ctx.options.localise and cap is not None and step.first_bad == step.index and replay_ok:
            with self.ctx.replay():  # (the watch's hooks ignore the replay)
                ran, got = replay(self.ctx.model if cap.module is None else cap.module, cap, step.index)
            where.reproduced = (got is not None) if ran else None
            if got is not None and (got.module is not None or got.op is not None):
                m = got.module
                if m is not None and cap.prefix and m != "<loss>":  # (a stage's replay: names within it)
                    m = cap.prefix + ("" if m in ("", "<root>") else "." + m)
                where.module = m if m is not None else where.module
                where.op, where.source, where.how = got.op, got.source, (
                    "a replay of the forward pass and of the loss code after it" if m == "<loss>" and got.op
                    else "a replay of the forward and backward pass")
        return where


#: a param group's lr that rose at least this many times over in one step is a host fact an
#: explosion that follows is blamed on
LR_RISE = 2.0
#: how many steps before an explosion's first step above the threshold such a rise is looked for
LR_LOOKBACK = 5


class WeightWrites:
    """Host facts: which of the model's top-level modules had weights written between two
    steps, and at which steps. Written means a version counter moved outside the watched
    optimizer's step: ``load_state_dict``, ``copy_`` or any in-place edit (``.data`` edits
    move no counter and are not seen). The watched parameters' counters are the ledger's
    (``StepEntry.outside``); frozen parameters (a teacher, a target or EMA network with
    ``requires_grad=False``) are read through one probe parameter per top-level module.

    A write closer than `LR_LOOKBACK` steps to the previous write of the same module is a
    continuous update (an EMA, a soft target update, a second optimizer): never a swap."""

    def __init__(self, ctx: Watched) -> None:
        self.ctx = ctx
        self.steps: Dict[str, List[int]] = {}  # module -> the steps its weights were written at (last 4)
        self.held: Dict[str, bool] = {}  # module -> the optimizer holds the written weights
        self._probes: Optional[List[Tuple[str, Any]]] = None
        self._versions: Optional[np.ndarray] = None

    def reset(self) -> None:
        """Parameters were unfrozen: the frozen probes are found again."""
        self._probes, self._versions = None, None

    def _frozen(self) -> List[Tuple[str, Any]]:
        if self._probes is None:
            watched = {id(p) for p in self.ctx.params}
            first: Dict[str, Any] = {}
            for name, p in unwrap(self.ctx.model).named_parameters():
                if id(p) not in watched and not is_dtensor(p):
                    first.setdefault(name.split(".")[0] if "." in name else "<root>", p)
            self._probes = list(first.items())
        return self._probes

    def note(self, step: Step) -> None:
        """This step's writes (before it: since the previous step ended)."""
        written: Dict[str, bool] = {}
        e = step.entry
        if e is not None and e.outside is not None and len(e.outside) == len(self.ctx) and e.outside.any():
            held = self.ctx.held_by_optimizer()
            for i in np.flatnonzero(e.outside):
                top = self.ctx.modules[i].split(".")[0] or "<root>"
                written[top] = written.get(top, False) or (held is not None and id(self.ctx.params[i]) in held)
        probes = self._frozen()
        if probes:
            now = np.fromiter((p._version for _, p in probes), dtype=np.int64, count=len(probes))
            if self._versions is not None and len(self._versions) == len(now):
                for k in np.flatnonzero(now != self._versions):
                    written.setdefault(probes[k][0], False)
            self._versions = now
        for top, held_now in written.items():
            at = self.steps.setdefault(top, [])
            at.append(step.index)
            del at[:-4]
            self.held[top] = held_now

    def swap(self, first: int) -> Optional[Tuple[str, int, bool]]:
        """The write an explosion whose first step above the threshold is ``first`` follows:
        ``(module, step, scheduled)``: a write at most `LR_LOOKBACK` steps before it (or at
        it), with no write of that module in the `LR_LOOKBACK` steps before; ``scheduled``
        says it is the third or later write at one regular interval (the program's own
        schedule: a target network copied every N steps). An unscheduled write first, then
        the latest; None when there is none."""
        best: Optional[Tuple[str, int, bool]] = None
        for top, at in self.steps.items():
            for k in range(len(at) - 1, -1, -1):
                s = at[k]
                if not first - LR_LOOKBACK <= s <= first:
                    continue
                if k and at[k - 1] >= s - LR_LOOKBACK:
                    break  # (a continuous update, not a swap)
                scheduled = k >= 2 and at[k] - at[k - 1] == at[k - 1] - at[k - 2]
                if best is None or (not scheduled, s) > (not best[2], best[1]):
                    best = (top, s, scheduled)
                break
        return best


class ExplodeCheck(Check):
    """A global gradient norm far above its robust running level (see `graddbg.Explode`,
    its configuration): the level is the median of the last ``window`` healthy recorded
    steps, kept sorted (no sort per step); consecutive exploded steps are one episode and
    one finding, and do not enter the level.

    The cause, from the ledger's host facts: an explosion that follows a one-step rise of a
    param group's learning rate (`LR_RISE` times or more, at most `LR_LOOKBACK` steps before
    it) to a level that group never had is blamed on that rise, in one finding that names it
    (not the parameters); a rise back to a level the group had before (a warm restart, a
    cyclic schedule: the program's own schedule) makes the explosion that follows expected,
    and no finding. Later episodes with no new rise, until ``window`` healthy recorded steps
    have passed, are the same cause's aftermath: no new finding. Without an lr rise, an
    explosion that begins at most `LR_LOOKBACK` steps after a module's weights were written
    between steps (`WeightWrites`: a target or teacher network swapped, a checkpoint loaded)
    names that write, unless the module is written on a regular schedule (the third write at
    one interval: a target network's hard update), which makes the jump expected and gives no
    finding. Otherwise, an explosion that begins at most `LR_LOOKBACK` steps after parameters
    were unfrozen (watched from that step on) names them as its cause."""

    after = (StatsRecorder, StageSummary, LedgerKeeper)

    STATE = ("level", "_sorted", "in_episode", "above", "_lrs", "_peak", "_after", "_since")

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self.det: Optional[Explode] = ctx.options.explode
        self.level: List[float] = []    # the window's global norms, oldest first
        self._sorted: List[float] = []  # the same, sorted
        self.prev_norms: Any = None
        self.in_episode = False
        self.above = 0  # recorded steps in a row above the relative threshold
        self._since = -1  # the step the current run above the relative threshold began
        #: [step, each group's lr, each group's highest lr before that step] of the last steps
        self._lrs: List[list] = []
        self._peak: List[float] = []  # each group's highest lr so far
        #: healthy recorded steps since the last episode blamed on an lr rise (None: not after one)
        self._after: Optional[int] = None
        self._added = 0  # parameters unfrozen since the last step read
        self._unfrozen: Optional[Tuple[int, List[str]]] = None  # (the step they were first watched at, names)
        self.writes = WeightWrites(ctx)
        self._phases: List[int] = []  # the last steps after which the model ran without grad (a phase)

    def params_added(self, k: int) -> None:
        self._added += k
        self.writes.reset()

    def read(self, step: Step) -> List[Finding]:
        if self.det is None:
            return []
        self._note_lrs(step)
        self.writes.note(step)
        if step.entry is not None and step.entry.nograd_forwards:
            self._phases = self._phases[-3:] + [step.index]
        if self._added:  # (a host fact: parameters unfrozen, watched from this step on)
            self._unfrozen, self._added = (step.index, self.ctx.names[-self._added:]), 0
        if not step.due_stats or step.stats is None or step.any_bad:
            return []
        st = step.stats
        gn = st.global_norm
        clipped = step.clipped_norm == step.clipped_norm and step.clipped_norm < gn * (1 - 1e-6)
        a = self.judge(step.index, gn, st.norm, clipped=clipped, has_grad=st.has_grad)
        return [] if a is None else [Finding(a, self.det.policy)]

    def _note_lrs(self, step: Step) -> None:
        """Each param group's lr at this step (the ledger's host fact), and its peak before."""
        lrs = list(step.entry.lrs) if step.entry is not None else []
        if not lrs:
            return
        peak = self._peak + [0.0] * (len(lrs) - len(self._peak))
        self._lrs.append([step.index, lrs, peak[:len(lrs)]])
        del self._lrs[:-4 * LR_LOOKBACK]
        self._peak = [max(p, x) if math.isfinite(x) else p for p, x in zip(peak, lrs + peak[len(lrs):])]

    def lr_rise(self, first: int) -> Optional[Tuple[int, int, float, float, bool]]:
        """The one-step lr rise an explosion whose first step above the threshold is
        ``first`` follows: ``(group, step, lr before, lr after, scheduled)``, where
        ``scheduled`` says the lr came back to a level the group had before; a rise to a new
        level first, then the largest; None when there is none."""
        best: Optional[Tuple[int, int, float, float, bool]] = None
        for (s0, lrs0, _), (s, lrs, peaks) in zip(self._lrs, self._lrs[1:]):
            if s0 != s - 1 or not first - LR_LOOKBACK <= s < first:
                continue
            for g, (before, lr) in enumerate(zip(lrs0, lrs)):
                if not (math.isfinite(before) and math.isfinite(lr)) or before < 0 or lr < before * LR_RISE or lr <= 0:
                    continue
                cand = (g, s, before, lr, g < len(peaks) and lr <= peaks[g] * (1 + 1e-6))
                key = (not cand[4], lr / before if before > 0 else math.inf)
                if best is None or key > (not best[4], best[3] / best[2] if best[2] > 0 else math.inf):
                    best = cand
        return best

    def _threshold(self) -> Tuple[float, float]:
        """(relative threshold, hard threshold): factor x and factor**2 x the median."""
        det = self.det
        if det.factor is None or not self.level:
            return math.inf, math.inf
        srt = self._sorted
        half = len(srt) // 2
        med = srt[half] if len(srt) % 2 else (srt[half - 1] + srt[half]) / 2
        if len(self.level) < det.warmup:  # too little history: only a thousandfold jump
            return math.inf, det.factor ** 3 * med
        return det.factor * med, det.factor ** 2 * med

    def judge(self, step: int, global_norm: float, norms: Any, clipped: bool = False,
              has_grad: Any = None) -> Optional[Anomaly]:
        """The finding of one recorded step (None: healthy, inside an episode already
        reported, or after an lr rise that explains it); a healthy step enters the running
        level."""
        det = self.det
        prev, self.prev_norms = self.prev_norms, norms
        if not math.isfinite(global_norm) or global_norm == 0:
            return None  # the non-finite detector's business; a step without gradients
        rel, hard = self._threshold()
        self.above = self.above + 1 if global_norm > rel else 0
        if self.above == 1 or not self.above:
            self._since = step
        threshold = min(rel, det.absolute if det.absolute is not None else math.inf)
        exploded = (det.absolute is not None and global_norm > det.absolute) or \
            (not clipped and (global_norm > hard or self.above >= det.persist))
        if exploded or (global_norm > rel and clipped) or self.above:
            if not exploded or self.in_episode:  # one anomaly per episode of consecutive exploded steps
                return None
            self.in_episode = True
            rise = self.lr_rise(self._since)
            swap = self.writes.swap(self._since) if rise is None else None
            cause = rise or swap
            phase = next((s for s in reversed(self._phases) if self._since - LR_LOOKBACK <= s <= self._since), None) \
                if cause is None else None
            if phase is not None and self._after is None:
                return self._new_level(global_norm)
            if cause is None and self._after is not None or cause is not None and cause[-1]:
                self._after = 0  # the aftermath of a cause already named, or the program's own schedule
                return None
            self._after = None if cause is None else 0
            unfrozen = self._unfrozen if cause is None and self._unfrozen is not None and \
                self._since - LR_LOOKBACK <= self._unfrozen[0] <= self._since else None
            return self._anomaly(step, global_norm, threshold, _jumped(prev, norms, self.ctx.names, has_grad), rise,
                                 unfrozen, swap)
        self.in_episode = False
        self.above = 0
        if self._after is not None:
            self._after = None if self._after + 1 >= det.window else self._after + 1
        self.level.append(global_norm)
        bisect.insort(self._sorted, global_norm)
        if len(self.level) > det.window:
            del self._sorted[bisect.bisect_left(self._sorted, self.level[0])]
            del self.level[0]
        return None

    def _anomaly(self, step: int, global_norm: float, threshold: float, jumped: List[str],
                 rise: Optional[Tuple[int, int, float, float, bool]] = None,
                 unfrozen: Optional[Tuple[int, List[str]]] = None,
                 swap: Optional[Tuple[str, int, bool]] = None) -> Anomaly:
        det, names = self.det, self.ctx.names
        top = jumped[0] if jumped and rise is None and swap is None else None
        relative = (det.factor is not None and len(self.level) >= det.warmup
                    and threshold < (det.absolute or math.inf) and global_norm <= (det.absolute or math.inf))
        measured = (f"global gradient norm {global_norm:.4g} > threshold {threshold:.4g}"
                    + (f" ({det.factor:g}x the median of the last {len(self.level)} steps)" if relative
                       else " (absolute bound)"))
        if rise is not None:
            g, at, before, lr, _ = rise
            msg = (f"graddbg: gradient explosion at step {step}, after a learning-rate change: {lr_rise_text(rise, step)}"
                   f", and then the {measured}. That update moved the weights far from where their gradients were "
                   f"measured" + (f" (the parameters whose gradients jumped most: {', '.join(jumped)})" if jumped else "")
                   + f". Fix: find what set param group {g}'s lr at step {at} (a hand edit of "
                   f"optimizer.param_groups, a scheduler's formula or its step count) and keep it at the level "
                   f"training had, or raise it gradually (warm-up).")
        elif swap is not None:
            msg = self._swap_text(step, swap, measured, jumped)
        elif unfrozen is not None:
            at, new = unfrozen
            msg = (f"graddbg: gradient explosion at step {step}, after parameters were unfrozen: "
                   f"{_shown_names(new)} had no gradient before and are trained from step {at}"
                   f"{' (this step)' if at == step else ''}, and then the {measured}"
                   + (f" (the parameters whose gradients jumped most: {', '.join(jumped)})" if jumped else "")
                   + ". Newly unfrozen layers start far from what the rest of the model learned around them. "
                   "Fix: a lower learning rate for them (a param group of their own), a warm-up after "
                   "unfreezing, or gradient clipping.")
        else:
            msg = (f"graddbg: gradient explosion at step {step}: {measured}"
                   + (f"; parameters that jumped most: {', '.join(jumped)}" if jumped else "")
                   + ". Try a lower learning rate, warm-up, or gradient clipping.")
        return Anomaly(step=step, kind="explode", name=top,
                       module=self.ctx.modules[names.index(top)] if top else None, op=None,
                       value=float(global_norm), threshold=float(threshold), source=None,
                       message=msg, params=tuple(jumped))


    def _new_level(self, global_norm: float) -> None:
        """A jump right after a phase of the program between steps (forward passes without
        grad: an evaluation, an RL rollout that collected new data): the gradients are of a
        new regime, and the level starts again from this step (warming up as at the start:
        only a thousandfold jump counts until it has ``warmup`` steps)."""
        self.level, self._sorted = [global_norm], [global_norm]
        self.in_episode, self.above = False, 0
        return None

    def _swap_text(self, step: int, swap: Tuple[str, int, bool], measured: str, jumped: List[str]) -> str:
        top, at, _ = swap
        when = "this step" if at == step else "the step before" if at == step - 1 else f"{step - at} steps before"
        held = self.writes.held.get(top, False)
        what = ("weights the optimizer trains" if held else
                "weights the optimizer does not train (a target, teacher or EMA network)")
        earlier = self.writes.steps.get(top, [])[:-1]
        return (f"graddbg: gradient explosion at step {step}, after the weights of module {top!r} were written between "
                f"steps: {what}, changed outside the optimizer's step before step {at} ({when}"
                + (f"; written before at step {', '.join(map(str, earlier))}" if earlier else "; never before")
                + f"), and then the {measured}"
                + (f" (the parameters whose gradients jumped most: {', '.join(jumped)})" if jumped else "")
                + (". Likely cause: a checkpoint or a re-initialisation loaded into the trained model (load_state_dict, "
                   "copy_) that does not match the optimizer's state. Fix: load weights with the optimizer's state, "
                   "or lower the lr after the load" if held else
                   ". Likely cause: a target or teacher network copied or swapped (load_state_dict, copy_) to weights "
                   "far from the ones the model trained against. Fix: check what is loaded into it (the online "
                   "network's current weights, the right checkpoint), or update it softly (an EMA) or more often")
                + ".")


def _shown_names(names: Sequence[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def lr_rise_text(rise: Tuple[int, int, float, float, bool], step: int) -> str:
    """"the lr of group 0 rose 1000x at step 80, the step before (0.05 -> 50)"."""
    g, at, before, lr, _ = rise
    ratio = lr / before if before > 0 else math.inf
    times = "from 0" if not math.isfinite(ratio) else f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.2g}x"
    when = "the step before" if at == step - 1 else f"{step - at} steps before"
    return f"the lr of group {g} rose {times} at step {at}, {when} ({before:.4g} -> {lr:.4g})"


def _jumped(prev: Any, norms: Any, names: Sequence[str], has_grad: Any = None) -> List[str]:
    """The parameters whose norm jumped most relative to their previous recorded norm (at
    most 5; without a previous record, the largest norms); a parameter without a gradient
    now or then (a NaN norm) never ranks."""
    if norms is None:
        return []
    ok = np.isfinite(norms) & (norms > 0)
    if has_grad is not None and len(has_grad) == len(norms):
        ok &= np.asarray(has_grad, dtype=bool)
    if prev is not None and len(prev) == len(norms):
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(prev > 0, norms / prev, np.inf)
        ratio = np.where(ok & ~np.isnan(prev), np.nan_to_num(ratio, nan=-1.0), -1.0)
        return [names[i] for i in np.argsort(-ratio, kind="stable")[:5] if ratio[i] > 1]
    size = np.where(ok, norms, -1.0)
    return [names[i] for i in np.argsort(-size, kind="stable")[:5] if size[i] > 0]


class VanishCheck(Check):
    """Parameters whose gradient norm stays under ``below`` for ``patience`` recorded steps
    in a row (see `graddbg.Vanish`, its configuration); reported once per parameter, until
    it recovers."""

    after = (StatsRecorder, StageSummary)

    STATE = ("run", "flagged")

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self.det: Optional[Vanish] = ctx.options.vanish
        self.run = np.zeros(len(ctx), dtype=np.int64)   # recorded steps in a row below
        self.flagged = np.zeros(len(ctx), dtype=bool)

    def params_added(self, k: int) -> None:
        self.run = np.concatenate([self.run, np.zeros(k, dtype=np.int64)])
        self.flagged = np.concatenate([self.flagged, np.zeros(k, dtype=bool)])

    def read(self, step: Step) -> List[Finding]:
        if self.det is None or not step.due_stats or step.stats is None:
            return []
        st = step.stats
        a = self.judge(step.index, st.norm, st.has_grad)
        return [] if a is None else [Finding(a, self.det.policy, skip=[])]

    def judge(self, step: int, norms: Any, has_grad: Any) -> Optional[Anomaly]:
        """The finding of one recorded step: the parameters newly below for long enough."""
        det, names, modules = self.det, self.ctx.names, self.ctx.modules
        low = has_grad & np.isfinite(norms) & (norms < det.below)
        self.run = np.where(low, self.run + 1, 0)
        self.flagged &= low  # recovered parameters may be flagged again later
        new = (self.run >= det.patience) & ~self.flagged
        if not new.any():
            return None
        self.flagged |= new
        idx = np.nonzero(new)[0]  # forward order: the first are the earliest layers
        first = int(idx[0])
        shown = ", ".join(names[i] for i in idx[:8]) + (f" and {len(idx) - 8} more" if len(idx) > 8 else "")
        msg = (f"graddbg: vanishing gradients at step {step}: {len(idx)} parameter(s) have had a "
               f"gradient norm below {det.below:g} for {det.patience} recorded steps: {shown}. "
               f"The earliest is {names[first]} (module {modules[first] or '<root>'}), "
               f"norm {float(norms[first]):.3g}. Check saturating activations, initialisation, "
               f"normalisation or residual connections.")
        return Anomaly(step=step, kind="vanish", name=names[first], module=modules[first], op=None,
                       value=float(norms[first]), threshold=float(det.below), source=None,
                       message=msg, params=tuple(names[i] for i in idx))
