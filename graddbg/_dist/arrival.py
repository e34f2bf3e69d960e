"""Whether graddbg's collectives run at a step boundary: a watch's check-in, and its meeting
with every peer at each boundary where it would issue one.

graddbg issues a collective only where every rank of that group issues the same one at the
same point. So at the first step boundary a watch checks in through the default process
group's store (`CheckIn`): every rank wrote a key when its watch started and waits a few
seconds (`CHECKIN_SECONDS`) for the keys of all the others; all ranks then agree through
two counters in the store. A peer that never checks in (a framework that starts its own,
unwatched, worker processes) makes every watched rank go on with local statistics, saying
so once. Then, at each boundary, every peer must be at this same one
(`graddbg._dist.peers.Peers.arrive`); a peer that went past it without a step (or took
more), that died, or that does not come within the bound makes every rank go on with local
statistics, saying why (`Arrival`).

This module imports only `graddbg._errors` and `graddbg._dist`'s `peers` and `store`.
"""
from __future__ import annotations

import itertools
import json
import os
from typing import Any, Dict, List, Optional

from graddbg._dist.peers import Peers, Verdict
from graddbg._dist.store import RollCall, default_store, poll
from graddbg._errors import GraddbgWarning, warn_at_user

__all__ = ["CHECKIN_SECONDS", "CLOSE_SECONDS", "ORIGIN_SECONDS", "Arrival", "CheckIn", "checkin_seconds"]

#: how long a watch waits at its first step boundary for every peer to check in (seconds);
#: ``GRADDBG_CHECKIN_SECONDS`` in the environment changes it
CHECKIN_SECONDS = 10.0
#: how long a stage that a non-finite value reached waits to hear where the stage that made it
#: found it started (that stage replays its step meanwhile)
ORIGIN_SECONDS = 60.0
#: how long a closing watch, after the ranks stepped differently, waits for its peers' watches
#: to close, so that the totals it states are final (bounded by the user's timeout too)
CLOSE_SECONDS = 10.0

_GENERATION = itertools.count()  # the n-th watch of this process: its keys in the store


def checkin_seconds() -> float:
    """`CHECKIN_SECONDS`, or ``GRADDBG_CHECKIN_SECONDS`` from the environment when set."""
    try:
        return float(os.environ.get("GRADDBG_CHECKIN_SECONDS", CHECKIN_SECONDS))
    except ValueError:
        return CHECKIN_SECONDS


# --------------------------------------------------------------------------- the check-in
class CheckIn:
    """Every watched rank writes ``graddbg/<n>/in/<rank>`` in the default store when its
    watch starts (after its position and pulse: `graddbg._dist.peers.Peers`); `wait` (at the
    first step boundary) returns whether every rank of the world is watched.

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
        self.store = default_store()
        self._in = RollCall(self.store, f"{self.prefix}in/", range(world))    # watched
        self._out = RollCall(self.store, f"{self.prefix}out/", range(world))  # taking part in no exchange
        try:
            seconds = self.store.timeout.total_seconds()
            if bound is not None:
                seconds = min(seconds, bound)
            self.peers = Peers(self.store, self.prefix, rank, world, seconds)
            self._in.write(rank)
        except Exception:  # (no store to check in with: no way to be sure of the peers)
            self.store = None

    def abstain(self) -> None:
        """This rank takes part in no exchange (a pipeline stage watched without an optimizer:
        its steps end inside the schedule's backward passes): said through the store, so that
        every peer goes on with local statistics at once instead of waiting for it."""
        if self.store is not None:
            self._out.write(self.rank)
            self.store.add(self.prefix + "no", 1)
            if self.peers is not None:
                self.peers.stop(f"stopped|rank {self.rank} watches a pipeline stage without an optimizer")

    def abstained(self) -> List[int]:
        """The ranks that said they take part in no exchange."""
        if self.store is None or self.gone:
            return []
        try:
            missing = set(self._out.missing())
            return [r for r in range(self.world) if r not in missing]
        except Exception:  # (the store stopped answering)
            return []

    def _count(self, name: str) -> int:
        return int(self.store.add(self.prefix + name, 0))

    def wait(self, seconds: Optional[float] = None) -> bool:
        """Whether every rank's watch checked in (the ranks then meet at this boundary:
        `Peers.arrive`). A store that stops answering (its host died) is a no."""
        if self.store is None:
            self.missing = [-1]
            return False
        seconds = checkin_seconds() if seconds is None else seconds
        try:
            poll(lambda: self._in.all_in() or self._count("no") > 0, seconds)
            if self._count("no") > 0 or not self._in.all_in():
                self.missing = self._in.missing()
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


# --------------------------------------------------------------------------- at each boundary
class Arrival:
    """Whether graddbg's collectives run at each step boundary, the same on every rank (see
    the module's docstring), and this rank's position for its peers between boundaries.
    ``local``: no collectives at all (one rank, or the peers not all watched or in step);
    ``meta`` (the run's) says why, and a warning says it once."""

    def __init__(self, rank: int, world: int, meta: Dict[str, Any], bound: Optional[float] = None) -> None:
        self.rank, self.world, self.meta = rank, world, meta
        self.local = self.resolved = world == 1
        #: ``(step, what)`` when the ranks were found to step differently (the replica check reports it)
        self.desync: Optional[tuple] = None
        self._checkin = CheckIn(rank, world, bound) if world > 1 else None
        self._ready_at, self._ready = -1, False  # (this boundary's decision)

    @property
    def met(self) -> bool:
        """Whether every peer was at the last boundary (collectives ran there)."""
        return not self.local and self.resolved and self._ready

    def abstain(self) -> None:
        """This rank never reaches a boundary where a collective is safe (a pipeline stage
        watched without an optimizer: each backward pass, inside the schedule, is its step):
        it says so to its peers and goes on with local statistics, as they do."""
        if self._checkin is None or self.local:
            return
        self._checkin.abstain()
        self.local = self.resolved = True
        self.meta["layout"] = "local: a pipeline stage watched without an optimizer"
        warn_at_user(f"graddbg.watch on rank {self.rank}: a pipeline stage watched without an optimizer has its "
                     f"steps end inside the schedule's backward passes, where no exchange with other ranks is "
                     f"safe; this rank and its peers go on with local statistics (pass the stage's optimizer "
                     f"to watch() for the whole model's norm and the exchange of non-finite flags).",
                     GraddbgWarning)

    def at_boundary(self, steps: int) -> bool:
        """This rank is at a boundary after ``steps`` boundaries: whether collectives may still
        run (after a drift, none; this rank's position still tells its peers how it steps)."""
        if self.desync is not None and self._ready_at != steps:
            self._ready_at = steps
            self._checkin.peers.at_boundary(steps)  # (how this rank steps, for the summary at the end)
        return not self.local

    def meet(self, steps: int, comparable: bool) -> bool:
        """Whether every peer is at this boundary (``steps`` boundaries before it), decided
        once per boundary: the first time, the ranks check in; then they meet
        (`Peers.arrive`; ``comparable``: they count the same backward passes per step)."""
        if self._ready_at == steps:
            return self._ready
        self._ready_at, self._ready = steps, False
        if not self.resolved:
            self.resolved = True
            if not self._checkin.wait():
                self._not_checked_in()
                return False
        verdict = self._checkin.peers.arrive(steps, comparable=comparable)
        if not verdict.ok:
            self._go_local(verdict, steps)
            return False
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

    def close(self) -> None:
        """Stop this rank's pulse."""
        if self._checkin is not None:
            self._checkin.close()

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
