"""What every check shares: the watched parameters, the step being read, the base class.

A check is a small class with its own state. `graddbg.hooks.Watch` calls its
methods in order at each step event; a check returns its findings (``Anomaly`` records)
and never reaches into another check or into the watch. The events:

- ``attach(ctx)``: once, when the watch starts (register extra hooks through ``ctx.hooks``);
- ``on_forward(fwd)``: the root module's forward began with grad enabled (``fwd``: its host
  facts, a `graddbg.checks.ledger.Forward`);
- ``on_output_grad()``: inside a backward pass, at the model's output (the loss's graph
  can be read then);
- ``on_backward_end(bw)``: a backward pass through the model ended (after DDP's reducer);
- ``queue(step)`` then ``read(step)``: the step boundary (the optimizer's step, or the end of
  a backward pass without an optimizer, or ``w.step()``): each check queues what it needs
  read from the device into ``step.readback`` (``Readback.add`` returns a `Slot`) and
  returns what it wants handed back (a token: its slots, the facts it took); a check that
  exchanges a few numbers with other ranks adds them to ``step.reduce`` (`PackedSum`: one
  small all-reduce for all of them); the watch runs that collective, reads everything back
  at once, then each check reads its part (``step.token(self)``: what its ``queue``
  returned) and the step's ledger entry (``step.entry``) and returns findings; the step's
  row goes into the history when every check has read (`Step.record_into`). The step is
  read-only (a frozen dataclass): a part that measures something for the others returns it
  (``wrote(result, field=value)``) and the watch writes it into the step's field, which
  names that part as its one writer (`Step.WRITERS`); the context (`Watched`) is read-only
  to the checks too;
- ``before_step(index, closure)``: the optimizer's step begins (``closure``: it was given
  one, so the boundary comes after it);
- ``after_step(index)``: the optimizer's step ran;
- ``flush()``: the record is about to be read (``w.stats``);
- ``params_added(k)``: ``k`` parameters were unfrozen and are watched from now on;
- ``close()``: the watch ends.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from graddbg._model import module_of
from graddbg.anomaly import Anomaly
from graddbg.checks.budget import WeightBudget
from graddbg.stats import Readback, StepRecord, StepStats

__all__ = ["Check", "PolicyCheck", "Watched", "Step", "Launched", "Measured", "PackedSum", "BackwardEnd", "Finding",
           "Wrote", "finding", "record_update", "shown", "step_range", "wrote"]


class Watched:
    """The parameters a watch records, in a fixed order, and what every check may know
    of the run: the model, the optimizer, the options, the rank. Grows when parameters
    are unfrozen; never shrinks.

    Read-only once the checks are attached (`seal`): a check that assigns to it gets an
    AttributeError. What a check may change goes through a method: `count_syncs` (the
    host synchronisations it made) and `replay` (the watch's hooks ignore what runs inside).
    The watch itself changes it with `amend`."""

    _sealed = False

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], options: Any,
                 named: Sequence[tuple], hooks: Any, rank: Optional[int], world_size: int) -> None:
        self.model, self.optimizer, self.options, self.hooks = model, optimizer, options, hooks
        self.rank, self.world_size = rank, world_size
        self.names: List[str] = []
        self.modules: List[str] = []
        self.params: List[nn.Parameter] = []
        self.host_syncs = 0  #: host synchronisations made by the watch (read-backs)
        self.replaying = False  #: a check is replaying the step: the watch's hooks ignore it
        self.history: Any = None  #: the record (`graddbg.stats.History`), written by the checks
        self.ledger: Any = None  #: the step ledger (`graddbg.checks.ledger.Ledger`), written by its keeper
        self.guard: Any = None  #: the `graddbg.checks.copies.CopyGuard` of every hooked module
        self.alive: Callable[[], bool] = lambda: True  #: whether the watch's hooks should act now
        #: the GradScaler's scale now, as a device tensor (None without one): no host read
        self.read_scale: Callable[[], Optional[Tensor]] = lambda: None
        #: a GradScaler found scaling the loss (in the frames of a backward pass's caller): used from now on
        self.adopt_scaler: Callable[[Any], None] = lambda scaler: None
        self.layout: Any = None  #: which ranks graddbg exchanges what with (`graddbg._dist.layout.Layout`)
        #: the one memory budget of the weights copied before a step, shared by the checks that copy them
        self.budget = WeightBudget(options.copy_budget)
        #: ids of the parameters that had post-accumulate-grad hooks of the user's when they were
        #: added (before graddbg's own): an optimizer stepped in the backward pass, one at a time
        self.stepped_in_backward: set = set()
        self.add(named)

    def __setattr__(self, name: str, value: Any) -> None:
        if self._sealed:
            raise AttributeError(f"the watch's context is read-only to its checks: cannot set {name!r} "
                                 f"(a check returns what it measured; see graddbg.checks.base)")
        object.__setattr__(self, name, value)

    def seal(self) -> None:
        """From now on read-only (the checks are attached)."""
        object.__setattr__(self, "_sealed", True)

    def amend(self, **fields: Any) -> None:
        """The watch changes its context (a GradScaler found late, the close)."""
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def count_syncs(self, n: int = 1) -> None:
        """``n`` host synchronisations made (read-backs), counted in `Watch.host_syncs`."""
        object.__setattr__(self, "host_syncs", self.host_syncs + n)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """A replay of the step runs inside: the watch's hooks ignore it."""
        object.__setattr__(self, "replaying", True)
        try:
            yield
        finally:
            object.__setattr__(self, "replaying", False)

    def add(self, named: Sequence[tuple]) -> None:
        self.names.extend(n for n, _ in named)  # (in place: the context is read-only once sealed)
        self.modules.extend(module_of(n) for n, _ in named)
        self.params.extend(p for _, p in named)
        self.stepped_in_backward.update(id(p) for _, p in named if getattr(p, "_post_accumulate_grad_hooks", None))

    @property
    def numel(self) -> List[int]:
        return [int(getattr(p, "ds_numel", p.numel())) for p in self.params]  # (ZeRO-3 empties its parameters)

    def grads(self) -> List[Optional[Tensor]]:
        return [p.grad for p in self.params]

    def held_by_optimizer(self) -> Optional[set]:
        """The identities of the parameters the optimizer's param groups hold; None without an
        optimizer, or when its groups hold none of the watched parameters (DeepSpeed ZeRO's
        flat partitions): then "held" tells nothing."""
        opt = self.optimizer
        if opt is None:
            return None
        held = {id(p) for g in opt.param_groups for p in g["params"]}
        return held if any(id(p) in held for p in self.params) else None

    def __len__(self) -> int:
        return len(self.params)


@dataclasses.dataclass
class BackwardEnd:
    """A backward pass ended: its index among the backward passes since the watch began,
    the step it belongs to, and the gradients as they are now (parameter order)."""

    step: int
    grads: List[Optional[Tensor]]
    scale: Optional[Tensor] = None  #: the GradScaler's scale when this backward ran (a device tensor)


class PackedSum:
    """The step's one small all-reduce: the int64 vectors the checks add in ``queue`` are
    summed over their group in one collective per group (in practice one: the replica
    group), which the watch runs after every check queued and before the read-back. Each
    part is summed in place; ``then`` runs after, on the summed part (a check's verdict
    computed on the device, for the read-back)."""

    def __init__(self) -> None:
        self._parts: List[Tuple[Tensor, Any, Optional[Callable[[Tensor], None]]]] = []

    def add(self, t: Tensor, group: Any, then: Optional[Callable[[Tensor], None]] = None) -> None:
        """Sum ``t`` (int64, 1-D) over ``group`` (as ``torch.distributed`` takes it) in place."""
        self._parts.append((t, group, then))

    def __len__(self) -> int:
        return len(self._parts)

    def run(self) -> None:
        """One all-reduce per group, then each part's ``then``."""
        if not self._parts:
            return
        import torch.distributed as dist

        from graddbg._dist.collective import run_collective

        groups: List[Any] = []
        for _, g, _ in self._parts:
            if not any(g is h for h in groups):
                groups.append(g)
        for g in groups:
            ts = [t for t, h, _ in self._parts if h is g]
            flat = ts[0] if len(ts) == 1 else torch.cat(ts)  # (one part: summed in place)
            run_collective(dist.all_reduce, flat, op=dist.ReduceOp.SUM, group=g)
            if len(ts) > 1:
                at = 0
                for t in ts:
                    t.copy_(flat[at: at + t.numel()])
                    at += t.numel()
        parts, self._parts = self._parts, []
        for t, _, then in parts:
            if then is not None:
                then(t)


@dataclasses.dataclass
class Launched:
    """What the statistics recorder measures this step, on the device (its ``queue`` on a
    read step; none under a gradient source such as ZeRO's): other parts queue from it
    without reading the gradients again."""

    grads: List[Optional[Tensor]]  #: the gradients measured (the backward pass's, else the step's)
    launch: Any  #: the launched statistics (`graddbg.stats.StepReader.launch`): ``groups``, ``norms``, ``sharded``
    collect: bool  #: this step exchanges statistics with other ranks (the layout is ready)
    #: the non-finite flags of every rank of the replica group (a bit per rank, summed in
    #: ``step.reduce`` over ``group``); None: no exchange of flags this step
    any_rank: Optional[Tensor] = None
    group: Any = None  #: the replica group (as ``torch.distributed`` takes it)
    current: List[int] = dataclasses.field(default_factory=list)  #: gradients changed since the backward pass ...
    current_norms: Optional[Tensor] = None  #: ... and their norms now (local values)


@dataclasses.dataclass(frozen=True)
class Measured:
    """What the statistics recorder read back this step (its ``read``), on the host."""

    lr: float = float("nan")  #: the first param group's learning rate (NaN: unknown)
    #: the statistics, unscaled (None: not read this step); also on an overflow step
    stats: Optional[StepStats] = None
    bad: Optional[np.ndarray] = None  #: [P] non-finite gradients (also from skipped steps, and any rank's)
    first_bad: int = -1  #: the first step with a non-finite gradient among those read
    clipped_norm: float = float("nan")  #: the global norm after a clip between backward and step
    scale: float = float("nan")  #: the loss scale recorded (NaN: none)
    loss: float = float("nan")  #: the sum of the losses handed to backward() since the last step
    #: an overflow step (scaled gradients the scaler or DeepSpeed skips by design): recorded
    #: as such; the checks see no statistics
    overflow: bool = False
    #: under DeepSpeed ZeRO, where a non-finite gradient started: (global ranks, the evidence)
    origin: Optional[Tuple[Tuple[int, ...], str]] = None
    in_ledger: bool = True  #: the ledger entry shows the norms and the scale (not under ZeRO)


@dataclasses.dataclass(frozen=True)
class Wrote:
    """What a part's ``queue`` or ``read`` returns when it also measured fields of the step
    for the parts after it: ``result`` (the token, or the findings) and the fields, which
    the watch writes into the step (`Step.accept`)."""

    result: Any
    fields: Mapping[str, Any]


def wrote(result: Any = None, **fields: Any) -> Wrote:
    """``result`` (what ``queue`` or ``read`` returns) and the step's ``fields`` this part
    measured (each a field of `Step` whose writer it is)."""
    return Wrote(result, fields)


@dataclasses.dataclass(frozen=True)
class Step:
    """One step boundary as it is read: a frozen record. The watch makes it with what the
    step is; each later field is measured by one part, named in `WRITERS`, which returns it
    (`wrote`) and the watch writes it (`accept`), once. The checks only read it. The
    properties below (``stats``, ``bad``, ``origin``, ``capture``, ...) are views of the
    fields. ``readback`` and ``reduce`` are the step's two channels: a check adds what it
    needs read back, or summed over the ranks, in ``queue``. Host-side, except the
    gradients and the device handles."""

    #: each measured field and the class of its one writer (a subclass writes as its base)
    WRITERS = {"launched": "StatsRecorder", "measured": "StatsRecorder", "replica_hash": "ReplicaCheck",
               "stages": "StageSummary", "whole": "StageSummary", "arrival": "StageSummary",
               "stage_capture": "StageSummary", "hist": "Histograms", "hint": "Activations",
               "update": "UpdateRatio"}

    # -- the watch, when it makes the step
    index: int
    grads: List[Optional[Tensor]]  #: the gradients at the boundary
    due_stats: bool  #: per-parameter statistics are recorded this step
    read: bool = True  #: whether the statistics are read back this step
    tapped: Any = None  #: the last forward's inputs, from the watch's output tap (``graddbg.blame.Capture``)
    closure: bool = False  #: inside ``optimizer.step(closure)``
    #: this step's ledger entry (`graddbg.checks.ledger.StepEntry`): its host facts (the keeper's)
    entry: Any = None
    readback: Readback = dataclasses.field(default_factory=Readback)  #: the one read-back (checks add slots)
    reduce: PackedSum = dataclasses.field(default_factory=PackedSum)  #: the one small all-reduce (checks add parts)
    tokens: Dict[int, Any] = dataclasses.field(default_factory=dict)  #: what each check's queue() returned (the watch's)
    # -- the statistics recorder (`graddbg.checks.recorder.StatsRecorder`)
    launched: Optional[Launched] = None  #: its ``queue``: what it measures, on the device
    measured: Optional[Measured] = None  #: its ``read``: what it read back
    # -- the replica check (`graddbg.checks.replicas.ReplicaCheck`), its ``queue``: its
    #: verdict's slot (the replicas' hash of their norms differs; see ``replicas_differ``)
    replica_hash: Any = None
    # -- the stage summary (`graddbg.checks.stages.StageSummary`), its ``read``
    #: under pipeline parallelism (or ranks holding different parameters): every stage's
    #: squared norm and non-finite flag this step (`graddbg._dist.stages.StageReport`)
    stages: Any = None
    #: the recorder's statistics with the whole model's global norm (every stage's)
    whole: Optional[StepStats] = None
    #: a non-finite gradient arrived at this rank's stage from the next one: (ranks, how)
    arrival: Optional[Tuple[Tuple[int, ...], str]] = None
    stage_capture: Any = None  #: the last forward pass of this rank's stage that made it (several stages here)
    # -- the histograms (`graddbg.checks.histograms.Histograms`), its ``read``
    hist: Optional[np.ndarray] = None  #: [P, bins] counts of |grad|
    # -- the activations (`graddbg.checks.activations.Activations`), its ``read``
    hint: Optional[tuple] = None  #: (module, how it was found) of a non-finite producer
    # -- the update/weight ratio (`graddbg.checks.update.UpdateRatio`), its ``read``: the
    #: ratios it read back of the step they were measured at (an earlier one): (index, [P])
    update: Optional[Tuple[int, np.ndarray]] = None

    def accept(self, part: Any, out: Any) -> Any:
        """(The watch's.) What ``part``'s ``queue`` or ``read`` returned: its fields written
        into the step, where ``part`` is their writer and they were not written yet; the
        result handed on."""
        if type(out) is not Wrote:
            return out
        mine = {k.__name__ for k in type(part).__mro__}
        for name, value in out.fields.items():
            writer = self.WRITERS.get(name)
            if writer is None or writer not in mine:
                raise AttributeError(f"{type(part).__name__} may not write Step.{name} "
                                     f"(its writer: {writer or 'the watch, when it makes the step'})")
            if getattr(self, name) is not None:
                raise AttributeError(f"Step.{name} was written twice at step {self.index}")
            object.__setattr__(self, name, value)
        return out.result

    def token(self, check: "Check") -> Any:
        """What ``check.queue(step)`` returned for this step (None when it queued nothing)."""
        return self.tokens.get(id(check))

    @property
    def stats(self) -> Optional[StepStats]:
        """This step's statistics (unscaled; the whole model's global norm under a stage
        summary); None when not read, or on an overflow step."""
        m = self.measured
        if m is None or m.overflow:
            return None
        return self.whole if self.whole is not None else m.stats

    @property
    def bad(self) -> Optional[np.ndarray]:
        """[P] non-finite gradients (also from skipped steps); None when not read."""
        m = self.measured
        return None if m is None or m.overflow else m.bad

    @property
    def first_bad(self) -> int:
        """The first step with a non-finite gradient among those read (-1: none read)."""
        m = self.measured
        return -1 if m is None or m.overflow or m.stats is None else m.first_bad

    @property
    def clipped_norm(self) -> float:
        """The global norm after a clip between backward and step (NaN: none)."""
        m = self.measured
        return float("nan") if m is None or m.overflow else m.clipped_norm

    @property
    def scale(self) -> Optional[float]:
        """The loss scale recorded this step (NaN: none; None: not read)."""
        m = self.measured
        return None if m is None or m.overflow or m.stats is None else m.scale

    @property
    def origin(self) -> Optional[Tuple[Tuple[int, ...], str]]:
        """Where a non-finite gradient started, when it started on another rank: (global
        ranks, the evidence); no ranks when the evidence names none."""
        if self.arrival is not None:
            return self.arrival
        return None if self.measured is None else self.measured.origin

    @property
    def capture(self) -> Any:
        """The forward pass a replay of this step runs (None: none; a non-finite gradient
        that arrived from another stage is not replayed here)."""
        if self.arrival is not None:
            return None
        return self.stage_capture or self.tapped

    @property
    def replicas_differ(self) -> bool:
        """The replicas' gradients differ this step (the replica check's hash of their
        norms, summed in ``reduce``; False when a rank holds a non-finite gradient: that is
        the non-finite check's finding)."""
        slot = self.replica_hash
        return slot is not None and slot.value is not None and bool(slot.value[0] != 0)

    @property
    def any_bad(self) -> bool:
        bad = self.bad
        return bad is not None and bool(bad.any())

    def record_into(self, history: Any, ledger: Any = None) -> None:
        """The step's row of ``w.steps`` (and of ``w.stats`` when due) into ``history``
        (`graddbg.stats.History`), and the measured values into its ledger entry (and the
        update ratios into the entry of the step they were measured at, in ``ledger``): by
        the watch, once every check has read."""
        if self.update is not None:
            record_update(history, ledger, *self.update)
        m = self.measured
        if m is None:
            return
        if m.stats is None:
            history.append(StepRecord(self.index, scale=float("nan"), lr=m.lr))
            return
        if m.overflow:
            history.append(StepRecord(self.index, overflow=True, scale=m.scale, lr=m.lr, loss=m.loss))
            return
        st = self.stats
        assert st is not None
        history.append(StepRecord(self.index, per_param=st if self.due_stats else None, global_norm=st.global_norm,
                                  clipped_norm=m.clipped_norm, scale=m.scale, lr=m.lr, hist=self.hist,
                                  loss=m.loss))
        if self.entry is not None and m.in_ledger:
            self.entry.global_norm, self.entry.clipped_norm, self.entry.scale = st.global_norm, m.clipped_norm, m.scale


def record_update(history: Any, ledger: Any, at: int, ratios: np.ndarray) -> None:
    """The update/weight ratios of step ``at`` into ``w.stats`` and (their largest) into the
    step's ledger entry, when it is kept."""
    history.set_update(at, ratios)
    entry = ledger.find(at) if ledger is not None else None
    finite = ratios[np.isfinite(ratios)]
    if entry is not None and len(finite):
        entry.update = float(finite.max())


@dataclasses.dataclass(frozen=True)
class Finding:
    """An anomaly and the policy it is handled with (applied once per step, by the watch);
    ``skip``: the parameters the ``"skip"`` policy drops (all when None)."""

    anomaly: Anomaly
    policy: Any
    skip: Optional[Sequence[int]] = None


class Check:
    """The base class: every event a no-op. Subclasses handle the events they need.

    ``after``: the check classes whose ``read`` must run before this one's (the order of
    `graddbg.checks.default_checks` is derived from it, not from list position)."""

    after: Tuple[type, ...] = ()
    #: the attributes that make this check's running state (saved with a checkpoint by
    #: `state_dict`, restored by `load_state_dict` when a run resumes)
    STATE: Tuple[str, ...] = ()

    def state_dict(self) -> Dict[str, Any]:
        """This check's running state (the `STATE` attributes), JSON-able."""
        return {name: _to_json(getattr(self, name)) for name in self.STATE if hasattr(self, name)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what `state_dict` gave; an array of another length (a model with other
        parameters) is left as it is."""
        for name in self.STATE:
            if name not in state or not hasattr(self, name):
                continue
            value, now = _from_json(state[name]), getattr(self, name)
            if isinstance(now, np.ndarray) and (not isinstance(value, np.ndarray) or value.shape != now.shape):
                continue
            setattr(self, name, value)

    def attach(self, ctx: Watched) -> None:
        self.ctx = ctx

    def due(self, index: int) -> bool:
        """Whether this check needs the statistics of step ``index`` read back."""
        return False

    def on_forward(self, fwd: Any) -> None:
        pass

    def on_output_grad(self) -> None:
        """Inside a backward pass: it reached the model's output."""

    def on_backward_end(self, bw: BackwardEnd) -> Optional[List["Finding"]]:
        """A backward pass ended; findings may be returned (a check that cannot wait for a
        step boundary that may never come)."""
        return None

    def queue(self, step: Step) -> Any:
        """Queue device reads into ``step.readback``; what is returned is handed back as
        ``step.token(self)`` in `read`."""
        return None

    def read(self, step: Step) -> List[Finding]:
        return []

    def before_step(self, index: int, closure: bool) -> None:
        pass

    def after_step(self, index: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def params_added(self, k: int) -> None:
        pass

    def close(self) -> None:
        pass


class PolicyCheck(Check):
    """A check of one kind of finding with its own policy (``watch(<KIND>=...)``). After
    `attach`: ``_policy`` (None: off), ``_on`` (the policy is set, and an optimizer is
    watched where the check needs one: ``NEEDS_OPTIMIZER``) and ``_reported`` (False: a
    check reports its finding once)."""

    KIND: str = ""
    NEEDS_OPTIMIZER = True

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self._policy = getattr(ctx.options, self.KIND)
        self._on = self._policy is not None and (ctx.optimizer is not None or not self.NEEDS_OPTIMIZER)
        self._reported: Any = False


def shown(names: Sequence[str], limit: int = 6) -> str:
    """A few names, and how many more."""
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def finding(kind: str, step: int, names: List[str], modules: List[str], message: str, policy: Any,
            rank: Optional[int], value: float = float("nan")) -> Finding:
    """A finding of ``kind`` about ``names`` (none: the step), handled by ``policy``."""
    a = Anomaly(step=step, kind=kind, name=names[0] if names else None, module=modules[0] if modules else None,
                op=None, value=value, threshold=None, source=None, message=message, rank=rank,
                params=tuple(names))
    return Finding(a, policy, skip=[])


def step_range(first: int, last: int) -> str:
    """The text "step N" or "steps A-B"."""
    return f"step {last}" if first == last else f"steps {first}-{last}"


def _to_json(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return {"__array__": v.tolist(), "dtype": str(v.dtype)}
    if isinstance(v, set):
        return {"__set__": sorted(v, key=str)}
    if isinstance(v, (list, tuple)):
        return [_to_json(x) for x in v]
    if isinstance(v, (np.integer, np.floating, np.bool_)):
        return v.item()
    return v


def _from_json(v: Any) -> Any:
    if isinstance(v, dict) and "__array__" in v:
        return np.array(v["__array__"], dtype=v.get("dtype"))
    if isinstance(v, dict) and "__set__" in v:
        return set(v["__set__"])
    if isinstance(v, list):
        return [_from_json(x) for x in v]
    return v
