"""Which ranks graddbg exchanges what with: the layout of a distributed run, found once,
at the first step boundary, before graddbg's first collective.

graddbg issues a collective only where every rank of that group issues the same one at the
same point, with sizes agreed in advance. So before its first collective a watch:

1. checks in through the default process group's store (`CheckIn`): every rank writes a
   key when its watch starts and, at the first step boundary, waits a few seconds
   (`CHECKIN_SECONDS`) for the keys of all the others; all ranks then agree through two
   counters in the store. A peer that never checks in (a framework that starts its own,
   unwatched, worker processes) makes every watched rank go on with local statistics,
   saying so once;
2. agrees on sizes: one all-gather of a fixed-size signature of each rank's parameters
   (count, elements, a hash of names and shapes, stage);
3. finds the groups: pipeline stages from the ``PipelineStage`` objects of
   ``torch.distributed.pipelining`` that hold the watched module (their ``group`` is the
   pipeline group, their ``stage_index`` the stage), the data-parallel group from DDP's
   ``process_group`` or from FSDP2's one-dimensional mesh. Ranks whose parameters differ are
   never asked for per-parameter data.

Per step (`Layout.exchange`): per-parameter non-finite flags go over the replica group
only (ranks that hold the same parameters); a fixed-size summary (each stage's squared norm,
whether it had a non-finite gradient, whether one arrived from the next stage) goes over
the pipeline group (one rank per stage, as torchtitan's clip sums the norm), or over the
world when ranks hold different parameters without a pipeline stage. No collective inside
a backward pass of a pipeline stage (a peer stage may be waiting for that backward's result).

This module imports only `graddbg._errors`, `graddbg._model`, `graddbg._dist.collective` and `graddbg._dist.peers`.
"""
from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import os
import sys
import time
import zlib
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from graddbg._dist.collective import run_collective
from graddbg._errors import GraddbgWarning, warn_at_user
from graddbg._model import is_dtensor, unwrap
from graddbg._dist.peers import Peers, Verdict

__all__ = ["CHECKIN_SECONDS", "CheckIn", "Layout", "StageReport", "find_stages"]

#: how long a watch waits at its first step boundary for every peer to check in (seconds);
#: ``GRADDBG_CHECKIN_SECONDS`` in the environment changes it
CHECKIN_SECONDS = 10.0
#: how long a stage that a non-finite value reached waits to hear where the stage that made it
#: found it started (that stage replays its step meanwhile)
ORIGIN_SECONDS = 60.0
#: how long a closing watch, after the ranks stepped differently, waits for its peers' watches
#: to close, so that the totals it states are final (bounded by the user's timeout too)
CLOSE_SECONDS = 10.0


def checkin_seconds() -> float:
    """`CHECKIN_SECONDS`, or ``GRADDBG_CHECKIN_SECONDS`` from the environment when set."""
    try:
        return float(os.environ.get("GRADDBG_CHECKIN_SECONDS", CHECKIN_SECONDS))
    except ValueError:
        return CHECKIN_SECONDS

_GENERATION = itertools.count()  # the n-th watch of this process: its keys in the store
_WORLD = "world"                 # the default process group, as a group value


def _dist() -> Any:
    dist = torch.distributed
    return dist if dist.is_available() and dist.is_initialized() else None


def _group_arg(group: Any) -> Any:
    return None if group is _WORLD else group


# --------------------------------------------------------------------------- the check-in
class CheckIn:
    """Every watched rank writes ``graddbg/<n>/in/<rank>`` in the default store when its
    watch starts (after its position and pulse: `graddbg._dist.peers.Peers`); `wait` (at the first
    step boundary) returns whether every rank of the world is watched.

    A rank waits up to ``seconds`` for every check-in key; one that does not see them all
    adds to the ``no`` counter, writes the stop key and goes on alone, and so does every rank
    that sees ``no`` above zero (at once: a late rank never waits again). Then the ranks that
    saw every key wait for each other at that boundary (`Peers.arrive`, which the caller
    runs), each wait bounded by ``bound`` (the process group's timeout, or ``ddp_timeout``
    when shorter). The store is polled with short sleeps, so signals are handled."""

    def __init__(self, rank: int, world: int, bound: Optional[float] = None) -> None:
        self.rank, self.world = rank, world
        self.prefix = f"graddbg/{next(_GENERATION)}/"
        self.missing: List[int] = []
        self.gone = False  #: the store stopped answering
        self.peers: Optional[Peers] = None
        try:
            self.store = torch.distributed.distributed_c10d._get_default_store()
            seconds = self.store.timeout.total_seconds()
            if bound is not None:
                seconds = min(seconds, bound)
            self.peers = Peers(self.store, self.prefix, rank, world, seconds)
            self.store.set(f"{self.prefix}in/{rank}", "1")
        except Exception:  # (no store to check in with: no way to be sure of the peers)
            self.store = None

    def abstain(self) -> None:
        """This rank takes part in no exchange (a pipeline stage watched without an optimizer:
        its steps end inside the schedule's backward passes): said through the store, so that
        every peer goes on with local statistics at once instead of waiting for it."""
        if self.store is not None:
            self.store.set(f"{self.prefix}out/{self.rank}", "1")
            self.store.add(self.prefix + "no", 1)
            if self.peers is not None:
                self.peers.stop(f"stopped|rank {self.rank} watches a pipeline stage without an optimizer")

    def abstained(self) -> List[int]:
        """The ranks that said they take part in no exchange."""
        if self.store is None or self.gone:
            return []
        try:
            return [r for r in range(self.world) if self.store.check([f"{self.prefix}out/{r}"])]
        except Exception:  # (the store stopped answering)
            return []

    def _count(self, name: str) -> int:
        return int(self.store.add(self.prefix + name, 0))

    def _poll(self, done: Any, seconds: float) -> bool:
        end, delay = time.monotonic() + seconds, 1e-3
        while not done():
            if time.monotonic() > end:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return True

    def wait(self, seconds: Optional[float] = None) -> bool:
        """Whether every rank's watch checked in (the ranks then meet at this boundary:
        `Peers.arrive`). A store that stops answering (its host died) is a no."""
        if self.store is None:
            self.missing = [-1]
            return False
        keys = [f"{self.prefix}in/{r}" for r in range(self.world)]
        seconds = checkin_seconds() if seconds is None else seconds
        try:
            self._poll(lambda: self.store.check(keys) or self._count("no") > 0, seconds)
            if self._count("no") > 0 or not self.store.check(keys):
                self.missing = [r for r in range(self.world) if not self.store.check([keys[r]])]
                self.store.add(self.prefix + "no", 1)
                if self.peers is not None:
                    self.peers.stop(f"not every rank checked in (rank(s) {', '.join(map(str, self.missing))} "
                                    f"missing at rank {self.rank})" if self.missing else "a peer did not check in")
                return False
        except Exception:  # (the store stopped answering: its host, rank 0, ended)
            self.missing, self.gone = [], True
            return False
        return True

    def close(self) -> None:
        if self.peers is not None:
            self.peers.close()


# --------------------------------------------------------------------------- discovery
def find_stages(model: nn.Module) -> List[Any]:
    """The ``torch.distributed.pipelining`` stages (``_PipelineStageBase``) that hold
    ``model`` or a part of it, by stage index: those referring to it, else any in memory
    whose module is ``model`` or one of its submodules. Empty when pipelining is not in use."""
    if "torch.distributed.pipelining" not in sys.modules:
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


def _widest_mesh(model: nn.Module) -> Any:
    """The mesh of ``model``'s DTensor parameters that holds the ranks of all the others;
    None when it holds none, or when no one of them holds all."""
    meshes = {id(p.device_mesh): p.device_mesh for p in model.parameters() if is_dtensor(p)}
    if not meshes:
        return None
    widest = max(meshes.values(), key=lambda m: m.mesh.numel())
    ranks = set(widest.mesh.reshape(-1).tolist())
    if any(not set(m.mesh.reshape(-1).tolist()) <= ranks for m in meshes.values()):
        return None
    return widest


def _flat_name(model: nn.Module) -> str:
    """The name graddbg flattens the widest mesh of ``model``'s DTensor parameters under,
    when it has two or more named dimensions (``graddbg_<its dimensions>``); else ""."""
    mesh = _widest_mesh(model)
    if mesh is None or mesh.ndim < 2 or not mesh.mesh_dim_names:
        return ""
    return "graddbg_" + "_".join(mesh.mesh_dim_names)


def _dp_group(model: nn.Module, flatten: bool = False) -> Any:
    """The group of a wrapped stage's replicas and shards: DDP's ``process_group``, or the
    group of every rank of its DTensor parameters' meshes (FSDP2 over a data-parallel
    dimension, tensor parallelism over another: one stage's ranks in a 3-D mesh); None when
    there is none.

    A mesh of two or more dimensions is flattened (``DeviceMesh._flatten``, which makes
    process groups: a call every rank of the world makes in the same order, or the groups
    made after it no longer match across ranks) only with ``flatten``, which the caller sets
    when every rank said, in the signatures gathered before, that it flattens a mesh of the
    same name here."""
    pg = getattr(model, "process_group", None)
    if pg is not None and type(model).__name__ == "DistributedDataParallel":
        return pg
    mesh = _widest_mesh(model)
    if mesh is None:
        return None
    if mesh.ndim == 1:
        return mesh.get_group()
    name = _flat_name(model) if flatten else ""
    return mesh._flatten(name).get_group() if name else None


def _stage_mesh(model: nn.Module) -> Dict[str, int]:
    """The dimensions (name: size) of the widest mesh of a stage's DTensor parameters."""
    widest = _widest_mesh(model)
    if widest is None:
        return {}
    names = widest.mesh_dim_names or tuple(f"dim{i}" for i in range(widest.ndim))
    return {str(k): int(v) for k, v in zip(names, widest.mesh.shape)}


def _shard_replicas(model: nn.Module) -> Optional[tuple]:
    """``(k, j, m)`` when every parameter of ``model`` is a DTensor on one mesh, with the
    same placements, replicated along some of its dimensions (HSDP's replicate dimension):
    the ranks with the same coordinates on the other dimensions hold the same shards. k: the
    number of distinct shards; j: this rank's; m: the ranks holding each. Else None."""
    params = list(model.parameters())
    if not params or not all(is_dtensor(p) for p in params):
        return None
    mesh, placements = params[0].device_mesh, tuple(params[0].placements)
    if any(p.device_mesh is not mesh and p.device_mesh != mesh or tuple(p.placements) != placements for p in params):
        return None
    rep = [d for d, pl in enumerate(placements) if pl.is_replicate()]
    coord = mesh.get_coordinate()
    if not rep or coord is None:
        return None
    other = [d for d in range(mesh.ndim) if d not in rep]
    sizes = list(mesh.mesh.shape)
    k = int(np.prod([sizes[d] for d in other])) if other else 1
    j = int(np.ravel_multi_index([coord[d] for d in other], [sizes[d] for d in other])) if other else 0
    return k, j, int(np.prod([sizes[d] for d in rep]))


def _signature(names: Sequence[str], params: Sequence[Tensor], stage: int, flat: str = "") -> List[int]:
    """A fixed-size description of this rank's parameters: equal on two ranks when they
    hold the same parameters (by name and full shape); then its stage, and the name of the
    mesh it would flatten (a hash; 0: none)."""
    text = "|".join(f"{n}:{tuple(p.shape)}" for n, p in zip(names, params))
    return [len(params), int(sum(p.numel() for p in params)), zlib.crc32(text.encode()), stage,
            zlib.crc32(flat.encode()) if flat else 0]


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


# --------------------------------------------------------------------------- the layout
class Layout:
    """Which ranks a watch exchanges what with (see the module's docstring). Built when the
    watch starts (the check-in key is written then); `ready` runs at each step
    boundary where a collective is safe, before any other collective of graddbg's."""

    def __init__(self, model: nn.Module, names: Sequence[str], params: Sequence[Tensor], meta: Dict[str, Any],
                 pp_group: Any = None, dp_group: Any = None, make_capture: Any = None,
                 active: Any = lambda: True, stepped: bool = True, bound: Optional[float] = None) -> None:
        dist = _dist()
        self.rank = dist.get_rank() if dist is not None else 0
        self.world = dist.get_world_size() if dist is not None else 1
        self.model, self.names, self.params, self.meta = model, names, params, meta
        self._given = (pp_group, dp_group)
        self.resolved = self.world == 1
        self.local = self.world == 1          #: no collectives at all (one rank, or peers unsure)
        self.replica_group: Any = None        #: per-parameter data: ranks holding the same parameters
        self.shard_group: Any = _WORLD        #: DTensor shard statistics
        self.summary_group: Any = None        #: the per-step summary (a pipeline group, or the world)
        self.stages: List[Any] = find_stages(model)
        if self.stages and self.world == 1:  # (one stage, one process: read as a stage, nothing to exchange)
            meta.update(layout="pipeline", stage=self.stages[0].stage_index, num_stages=self.stages[0].num_stages)
        self.slots: List[int] = []            #: this rank's slots in the summary
        self.ddp_stages = False               #: several stages here, each wrapped in DDP (replicas)
        #: a stage's DTensor parameters replicated along some mesh dimensions (HSDP): the ranks
        #: that hold the same shards, as (the number of distinct shards k, this rank's shard
        #: j, the ranks holding each m), for the replicas' per-step hash; None otherwise
        self.shard_replicas: Optional[tuple] = None
        self.param_slot: Optional[Tensor] = None
        self._arrived: Dict[int, Tensor] = {}  # stage -> whether a non-finite gradient reached its output
        self._taps: List[Any] = []
        #: with several stages here: ``graddbg.blame.Capture`` to keep each stage's last forward pass
        #: (a replay's inputs), or None
        self._make_capture, self._active = make_capture, active
        self._rngs: Dict[int, Tensor] = {}     # stage -> the RNG state before its last forward pass
        self._captures: Dict[int, Any] = {}    # stage -> its last forward pass (a replay's inputs)
        self._last_captures: Dict[int, Any] = {}  # (those of the step last exchanged)
        self._tap_stages()
        self._checkin = CheckIn(self.rank, self.world, bound) if self.world > 1 else None
        self._ready_at, self._ready, self._found = -1, False, False  # (this boundary's decision; groups found)
        self._drift_next: Optional[int] = None  # (a drift of this stage's replicas, for the next summary)
        #: ``(step, what)`` when the ranks were found to step differently (the replica check reports it)
        self.desync: Optional[tuple] = None
        self._stepped = stepped  # (an optimizer steps the model: its boundaries are outside backward passes)
        self._abstain_if_stepless()

    def _abstain_if_stepless(self) -> None:
        """A pipeline stage watched without an optimizer never reaches a boundary where a
        collective is safe (each backward pass, inside the schedule, is its step): it says
        so to its peers and goes on with local statistics, as they do."""
        if self._checkin is None or self._stepped or not self.pipeline or self.local:
            return
        self._checkin.abstain()
        self.local = self.resolved = True
        self.meta["layout"] = "local: a pipeline stage watched without an optimizer"
        warn_at_user(f"graddbg.watch on rank {self.rank}: a pipeline stage watched without an optimizer has its "
                     f"steps end inside the schedule's backward passes, where no exchange with other ranks is "
                     f"safe; this rank and its peers go on with local statistics (pass the stage's optimizer "
                     f"to watch() for the whole model's norm and the exchange of non-finite flags).",
                     GraddbgWarning)

    def _tap_stages(self) -> None:
        """With several stages on this rank (an interleaved schedule), hooks on each stage:
        its output's gradient, arriving from the next stage, and (with ``localise``) its
        last forward pass, for a replay of the stage where a non-finite gradient was made.
        One stage: the watch's own tap on the model's output does both (`output_grad`)."""
        if len(self.stages) < 2 or self._taps:
            return
        names = {id(m): n for n, m in unwrap(self.model).named_modules()}
        for st in self.stages:
            mod = st.submod
            prefix = names.get(id(unwrap(mod)), names.get(id(mod), ""))  # (replays name modules within unwrap(mod))
            if self._make_capture is not None:
                self._taps.append(mod.register_forward_pre_hook(self._stage_rng(st.stage_index)))
            self._taps.append(mod.register_forward_hook(
                self._stage_output_hook(st.stage_index, st.stage_index == st.num_stages - 1, mod, prefix),
                with_kwargs=True))

    def _stage_rng(self, index: int) -> Any:
        def pre_hook(module: nn.Module, args: Any) -> None:
            if self._active():
                self._rngs[index] = torch.get_rng_state()

        return pre_hook

    def _stage_output_hook(self, index: int, last: bool, mod: nn.Module, prefix: str) -> Any:
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
            outs[i].register_hook(lambda grad: self._arrive(index, grad, last, cap))

        return forward_hook

    def _arrive(self, index: int, grad: Tensor, last: bool = False, cap: Any = None) -> None:
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

    def capture(self, report: "StageReport") -> Any:
        """The last forward pass of the stage of this rank's where a non-finite gradient was
        made (bad, and none arrived at its output), for a replay; None when there is none
        (one stage on this rank: the watch's own capture)."""
        made = [s for s in self.slots if report.bad[s] and not report.arrived[s]]
        cap = self._last_captures.get(max(made)) if made else None
        return cap if cap is not None and cap.grad is not None else None

    def close(self) -> None:
        """Remove the hooks on the stages' outputs; stop this rank's pulse."""
        for handle in self._taps:
            handle.remove()
        self._taps = []
        if self._checkin is not None:
            self._checkin.close()

    def param_stages(self) -> Optional[np.ndarray]:
        """The stage of each watched parameter (a pipeline's layout), else None."""
        if self.stages:
            owner = {id(p): s.stage_index for s in self.stages for p in s.submod.parameters()}
            return np.array([owner.get(id(p), self.stages[0].stage_index) for p in self.params], dtype=np.int64)
        if self.pipeline and self.slots:
            return np.full(len(self.params), self.slots[0], dtype=np.int64)
        return None

    @property
    def pipeline(self) -> bool:
        return bool(self.stages) or self._given[0] is not None

    # ------------------------------------------------------------------ resolving
    def safe_now(self, in_backward: bool) -> bool:
        """Whether graddbg may issue collectives at this boundary: never inside a backward
        pass of a pipeline stage, whose peers may be waiting for its result (stages built
        after the watch are looked for until the layout is resolved)."""
        if not self.resolved and not self.stages:
            self.stages = find_stages(self.model)
            self._tap_stages()
            self._abstain_if_stepless()
        return not (in_backward and self.pipeline)

    def ready(self, steps: int, in_backward: bool) -> bool:
        """Whether graddbg's collectives run at this boundary (``steps`` boundaries before
        it): decided once per boundary, the same on every rank. The first time, the ranks
        check in; then every peer must be watched and at this same boundary (`Peers.arrive`):
        a peer that went past it without a step (or took more), that died, or that does not
        come within the bound makes every rank go on with local statistics, saying why. The
        groups are found at the first boundary where all arrived."""
        if self.desync is not None and self._ready_at != steps:
            self._ready_at = steps
            self._checkin.peers.at_boundary(steps)  # (how this rank steps, for the summary at the end)
        if self.local or not self.safe_now(in_backward):
            return False
        if self._ready_at == steps:
            return self._ready
        self._ready_at, self._ready = steps, False
        if not self.resolved:
            self.resolved = True
            if not self._checkin.wait():
                self._not_checked_in()
                return False
        verdict = self._checkin.peers.arrive(steps, comparable=not self.pipeline)
        if not verdict.ok:
            self._go_local(verdict, steps)
            return False
        if not self._found:
            self._found = True
            self._groups(self._gather_signatures())
        self._ready = True
        return True

    def backward_ended(self) -> None:
        """A backward pass of this rank ended (its position, for the peers)."""
        if self._checkin is not None and self._checkin.peers is not None:
            self._checkin.peers.backward_ended()

    def forward_began(self, steps: int) -> None:
        """A training forward pass begins, ``steps`` boundaries so far."""
        if self._checkin is not None and self._checkin.peers is not None and (not self.local or self.desync):
            self._checkin.peers.forward_began(steps)

    def drift(self) -> Optional[str]:
        """After the ranks stepped differently: how each has stepped so far (for the
        finding's last words when the watch closes), or None."""
        if self.desync is None:
            return None
        pos = self._checkin.peers.closing(min(self._checkin.peers.seconds, CLOSE_SECONDS))
        if pos is None:
            return None
        most = max(p.steps for p in pos)
        each = "; ".join(f"rank {r}: {p.steps} step(s) over {p.backward} backward pass(es)"
                         + (f" ({most - p.steps} fewer)" if p.steps < most else "") for r, p in enumerate(pos))
        return f"When rank {self.rank}'s watch closed: {each}."

    def _go_local(self, verdict: Verdict, steps: int) -> None:
        """No more collectives of graddbg's on this rank: say why, once; tell the peers."""
        self.local = True
        why = verdict.why
        kind = verdict.kind
        if kind != "stopped":
            self._checkin.peers.stop(f"{kind}|{why}")
        else:
            kind, _, why = why.partition("|") if "|" in why else ("stopped", "", why)
        self.meta["layout"] = f"local: {kind}"
        if kind == "desync":
            # a finding (the replicas now differ), made by the replica check from this record
            self.desync = (steps, why)
            return
        what = {"gone": "a peer is gone", "late": "a peer is late"}.get(kind, "a peer stopped waiting")
        warn_at_user(f"graddbg.watch on rank {self.rank}, step {steps}: {what}: {why}. graddbg goes on with this "
                     f"rank's local statistics and issues no collective of its own from here on (what torch "
                     f"does with the job is torch's: a collective of the job's own with a dead peer fails).",
                     GraddbgWarning)

    def _not_checked_in(self) -> None:
        self.local = True
        missing, out = self._checkin.missing, self._checkin.abstained()
        if out:
            self.meta["layout"] = "local: a peer takes part in no exchange"
            warn_at_user(f"graddbg.watch on rank {self.rank}: rank(s) {', '.join(map(str, out))} of "
                         f"{self.world} watch a pipeline stage without an optimizer, so they take part in no "
                         f"exchange; graddbg goes on with this rank's local statistics and issues no "
                         f"collective of its own.", GraddbgWarning)
            return
        if self._checkin.gone:
            self.meta["layout"] = "local: the store stopped answering"
            warn_at_user(f"graddbg.watch on rank {self.rank}: the process group's store stopped answering at the "
                         f"first step (rank 0, which hosts it, ended?); graddbg goes on with this rank's local "
                         f"statistics and issues no collective of its own.", GraddbgWarning)
            return
        who = (f"rank(s) {', '.join(map(str, missing))} of {self.world} did not check in within "
               f"{checkin_seconds():g} s" if missing and missing != [-1] else
               "the process group has no store to check in with" if missing else
               f"a peer gave up waiting {checkin_seconds():g} s for every rank to check in")
        self.meta["layout"] = "local: not every peer is watched"
        warn_at_user(f"graddbg.watch on rank {self.rank}: {who}, so not every "
                     f"process of this job is watched (a framework that starts its own worker processes, such "
                     f"as Lightning's strategy='ddp' under `graddbg run`?). graddbg goes on with this rank's "
                     f"local statistics and issues no collective of its own (no replica check, no exchange "
                     f"of non-finite flags).", GraddbgWarning)

    def _gather_signatures(self) -> np.ndarray:
        dist = _dist()
        stage = self.stages[0].stage_index if self.stages else -1
        flat = _flat_name(self._stage_module()) if self.pipeline else ""
        mine = torch.tensor(_signature(self.names, self.params, stage, flat), dtype=torch.int64,
                            device=self._device())
        out = [torch.empty_like(mine) for _ in range(self.world)]
        run_collective(dist.all_gather, out, mine)
        return torch.stack(out).cpu().numpy()

    def _groups(self, sigs: np.ndarray) -> None:
        dist = _dist()
        same = [r for r in range(self.world) if (sigs[r, :3] == sigs[self.rank, :3]).all()]
        pp_given, dp_given = self._given
        if self.pipeline:
            stage = self.stages[0] if self.stages else None
            self.summary_group = pp_given if pp_given is not None else (stage.group or _WORLD)
            # (a mesh is flattened, a collective of the world, only when every rank flattens one alike)
            flatten = bool(sigs[self.rank, 4]) and bool((sigs[:, 4] == sigs[self.rank, 4]).all())
            dp = dp_given if dp_given is not None else _dp_group(self._stage_module(), flatten)
            if dp is None and sigs[self.rank, 4] and not flatten:
                warn_at_user(f"graddbg.watch on rank {self.rank}: this stage's DTensor parameters lie on a mesh of "
                             f"several dimensions, which graddbg flattens into one group to combine their shards' "
                             f"statistics only when every rank of the world holds such a mesh (making the group is "
                             f"a collective of every rank); here not every rank does, so each rank records the "
                             f"statistics of its own shards.", GraddbgWarning)
            if dp is None and len(self.stages) > 1:  # (the stages wrapped one by one)
                dp = next((g for g in (_dp_group(st.submod) for st in self.stages) if g is not None), None)
                self.ddp_stages = all(type(st.submod).__name__ == "DistributedDataParallel" for st in self.stages)
            self.replica_group = dp
            self.shard_group = dp if dp is not None else False  # (never the world: other stages hold other tables)
            n = stage.num_stages if stage is not None else dist.get_world_size(_group_arg(self.summary_group))
            self._slots_of_stages(n)
            self.meta.update(layout="pipeline", stage=self.slots[0] if len(self.slots) == 1 else list(self.slots),
                             num_stages=n, pp_size=dist.get_world_size(_group_arg(self.summary_group)),
                             dp_size=1 if dp is None else dist.get_world_size(_group_arg(dp)))
            self.shard_replicas = _shard_replicas(self._stage_module())
            dims = _stage_mesh(self._stage_module())
            if len(dims) > 1:  # (a stage's ranks in a mesh of data and tensor/context parallelism)
                self.meta["stage_mesh"] = dims
                self.meta["dp_size"] = int(np.prod([v for k, v in dims.items() if not k.startswith(("tp", "cp"))]))
        elif len(same) == self.world:
            self.replica_group = dp_given if dp_given is not None else _WORLD
            self.meta["layout"] = "replicas"
        else:  # different parameters, no pipeline stage known: a fixed-size exchange per rank
            self.summary_group = _WORLD
            self.slots = [self.rank]
            self._classes = [next(r for r in range(self.world) if (sigs[r, :3] == sigs[s, :3]).all())
                             for s in range(self.world)]
            self.meta["layout"] = "different parameters on each rank"
            # replicas among them: the ranks of the model's DDP group (or 1-D mesh), when every one
            # of them holds the same parameters as this rank (a hand-written pipeline, DDP per stage)
            dp = dp_given if dp_given is not None else _dp_group(self.model)
            if dp is not None and all((sigs[r, :3] == sigs[self.rank, :3]).all()
                                      for r in dist.get_process_group_ranks(dp)):
                self.replica_group = dp
                self.meta["dp_size"] = dist.get_world_size(dp)
        self._summary_ranks = self._slot_ranks()

    def _stage_module(self) -> nn.Module:
        """The module whose wrapper and meshes tell the groups: the watched model, or with
        several stages on this rank the first stage's module."""
        return self.stages[0].submod if len(self.stages) > 1 else self.model

    def _slots_of_stages(self, n: int) -> None:
        """This rank's stages, and each watched parameter's stage."""
        if not self.stages:  # (explicit pp_group: one stage per rank of it)
            self.slots = [torch.distributed.get_rank(_group_arg(self.summary_group))]
            return
        self.slots = [s.stage_index for s in self.stages]
        owner = {}
        for s in self.stages:
            for p in s.submod.parameters():
                owner[id(p)] = s.stage_index
        self.param_slot = torch.tensor([owner.get(id(p), self.slots[0]) for p in self.params], dtype=torch.int64)

    def _slot_ranks(self) -> List[int]:
        """A global rank holding each slot of the summary (for messages)."""
        dist = _dist()
        if self.summary_group is None:
            return []
        group = _group_arg(self.summary_group)
        size = dist.get_world_size(group)
        if not self.pipeline:
            return list(range(self.world))
        stage = self.stages[0] if self.stages else None
        n = stage.num_stages if stage is not None else size
        to_rank = getattr(stage, "stage_index_to_group_rank", None) or {i: i % size for i in range(n)}
        return [dist.get_global_rank(group, to_rank[i]) if group is not None else to_rank[i] for i in range(n)]

    def shards_over(self) -> Any:
        """The group DTensor statistics are combined over now, as ``torch.distributed``
        takes it; False when graddbg issues no collective now (this rank's shards only: the
        peers were not all at the last boundary)."""
        if self.world == 1:
            return None
        if self.local or not self.resolved or not self._ready:
            return False
        return _group_arg(self.shard_group)

    @staticmethod
    def group(g: Any) -> Any:
        """A group value as ``torch.distributed`` takes it (None: the default group)."""
        return _group_arg(g)

    def arrival(self, report: StageReport) -> Optional[tuple]:
        """``(ranks, how)`` when a non-finite gradient arrived at this rank's (first) stage
        from the next stage: the stage it came from and the stage where it started."""
        if report.what != "stage" or not self.slots:
            return None
        mine_bad = [s for s in self.slots if report.bad[s]]
        if not mine_bad or not all(report.arrived[s] for s in mine_bad):
            return None  # (it was made in a stage of this rank's: the local search names it)
        s = max(mine_bad)  # (the one nearest the loss: the others got it from there)
        n = len(report.ranks)
        if s + 1 >= n:
            return None
        start = s + 1
        while start + 1 < n and report.arrived[start] and report.bad[start + 1]:
            start += 1
        how = (f"it arrived non-finite from stage {s + 1}, rank {report.ranks[s + 1]}, in the gradient of stage "
               f"{s}'s output")
        if start != s + 1:
            how += f"; it started in stage {start}, rank {report.ranks[start]}"
        return (report.ranks[start],), how

    def _device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    # ------------------------------------------------------------------ per step
    def output_grad(self, grad: Tensor) -> None:
        """The gradient arriving at the stage's output from the next stage (a tap on the
        output, in the backward pass): whether it was non-finite, kept on the device."""
        if not self.pipeline or not isinstance(grad, Tensor) or self._last_stage() or len(self.stages) > 1:
            return
        self._arrive(self.slots[0] if self.slots else self.stages[0].stage_index if self.stages else 0, grad)

    def _last_stage(self) -> bool:
        return bool(self.stages) and self.stages[-1].stage_index == self.stages[-1].num_stages - 1

    def exchange(self, norms: np.ndarray, has: np.ndarray, bad: np.ndarray,
                 differ: Optional[int] = None) -> Optional[StageReport]:
        """The per-step summary over the pipeline group (or the world): every rank learns
        each slot's squared norm and non-finite flag, and whether its replicas differ
        (``differ``: the step this rank's replicas' hash differed at, or None). None when there
        is no summary."""
        arrived, self._arrived = self._arrived, {}
        self._last_captures, self._captures = self._captures, {}
        if self.local or self.summary_group is None:
            return None
        dist = _dist()
        n = len(self._summary_ranks)
        dev = self._device()
        table = torch.zeros(n, 4, dtype=torch.float64, device=dev)
        sq = np.where(has & np.isfinite(norms), norms, 0.0) ** 2
        if self.param_slot is not None and len(self.slots) > 1:
            slot_sq = np.bincount(self.param_slot.numpy(), weights=sq, minlength=n)
            slot_bad = np.bincount(self.param_slot.numpy(), weights=bad.astype(float), minlength=n) > 0
        else:
            slot_sq = np.zeros(n)
            slot_sq[self.slots[0]] = sq.sum()
            slot_bad = np.zeros(n, dtype=bool)
            slot_bad[self.slots[0]] = bool(bad.any())
        for s in self.slots:
            table[s, 0] = float(slot_sq[s])
            table[s, 1] = float(slot_bad[s])
            found = differ if differ is not None else self._drift_next
            table[s, 3] = 0.0 if found is None else float(found + 1)
        self._drift_next = None
        for s, flag in arrived.items():
            if s < n:
                table[s, 2] = flag.to(dev).double()
        run_collective(dist.all_reduce, table, group=_group_arg(self.summary_group))
        got = table.cpu().numpy()
        return StageReport("stage" if self.pipeline else "rank", got[:, 0], got[:, 1] > 0, got[:, 2] > 0,
                           self._summary_ranks, list(self.slots), got[:, 3])

    def tell_origin(self, step: int, found: Dict[str, Any]) -> None:
        """Where this stage found a non-finite value it made at ``step`` started, for the
        stages it reached (`origin_of`), through the store."""
        peers = self._checkin.peers if self._checkin is not None else None
        if peers is not None and not self.local:
            peers.tell(f"origin/{step}", json.dumps(found))

    def origin_of(self, step: int) -> Optional[Dict[str, Any]]:
        """What the stage that made the non-finite value of ``step`` found (`tell_origin`):
        waited for at most the bound (it localises at this same step), None if not told."""
        peers = self._checkin.peers if self._checkin is not None else None
        if peers is None or self.local:
            return None
        got = peers.hear(f"origin/{step}", min(peers.seconds, ORIGIN_SECONDS))
        return json.loads(got) if got else None

    def flag_drift(self, step: int) -> None:
        """This stage's replicas differ (found at ``step``, after its summary): said in the
        next step's summary, so that every stage learns it at the same step."""
        self._drift_next = step

    def global_norm(self, report: StageReport) -> float:
        """The whole model's norm: every stage once (one rank of each signature class when
        ranks hold different parameters without a pipeline)."""
        sq = report.sq if self.pipeline else report.sq[sorted(set(self._classes))]
        return float(np.sqrt(sq.sum()))
