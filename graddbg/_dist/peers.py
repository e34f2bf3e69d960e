"""Where the peers of a distributed watch are, and whether they are alive: graddbg's waits on
other ranks, each bounded by the user's timeout.

graddbg's collectives are issued at step boundaries (the optimizer's step). A collective is
safe only when every rank of its group issues it at the same point; a rank that skips
``optimizer.step()`` (a per-rank "skip this step if my loss looks bad" guard), or steps twice,
or died, would otherwise leave its peers inside a collective of graddbg's that it never joins,
or pair it with one of DDP's (gloo aborts: "Received data size doesn't match expected size").
So before graddbg's collectives at a boundary, every rank says where it is, and waits until
every peer is at the same boundary (`Peers.arrive`), through the default process group's store:

* a rank's *position* is ``(backward passes, boundaries, at a boundary)``: written when it
  reaches a boundary, and when a forward pass starts after a backward pass that no boundary
  followed (gradient accumulation, or a skipped step), so that a rank waiting at its boundary
  sees a peer go past it. A healthy loop without accumulation writes once per step.
* a rank's *pulse*: a counter that a small thread adds to every `BEAT_SECONDS` while the watch
  is open. A peer whose pulse has stood still for `SILENT_SECONDS` while a rank waits for it
  is gone (its process died); a store that stops answering (rank 0, which hosts it, died)
  says the same at once.
* the *stop* key: the first rank that finds the ranks out of step, a peer gone, or a wait
  past its bound writes why; every rank reads it while it waits, so all go on with local
  statistics together and none waits for the others.

Every wait ends within the bound given (the process group's timeout, or ``ddp_timeout`` when
shorter). Verdicts are data (`Verdict`); the caller says them to the user.

This module imports only `graddbg._dist.store` (its `poll`).
"""
from __future__ import annotations

import atexit
import dataclasses
import threading
import time
import weakref
from typing import Any, List, Optional, Tuple

from graddbg._dist.store import poll

__all__ = ["BEAT_SECONDS", "SILENT_SECONDS", "Peers", "Position", "Verdict"]

#: how often a watched rank's pulse moves (seconds)
BEAT_SECONDS = 0.2
#: a peer whose pulse stood still this long while a rank waits for it is taken for gone
SILENT_SECONDS = 2.0

_OPEN: "weakref.WeakSet[Peers]" = weakref.WeakSet()


@atexit.register
def _stop_pulses() -> None:  # (no pulse thread inside the store's C++ code at interpreter exit)
    for peers in list(_OPEN):
        peers.close()


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a rank is: its backward passes and step boundaries so far, and whether it is
    waiting at a boundary (``at``) or went on to a forward pass."""

    backward: int
    steps: int
    at: bool

    @classmethod
    def parse(cls, raw: bytes) -> "Position":
        b, k, at = raw.decode().split(",")
        return cls(int(b), int(k), at == "1")

    def text(self) -> str:
        return f"{self.backward},{self.steps},{int(self.at)}"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a wait at a boundary found. ``ok``: every peer is at this boundary.
    Otherwise ``kind`` is ``"desync"`` (the ranks stepped differently: ``ranks`` went past
    this boundary without a step, or took more), ``"gone"`` (``ranks`` died, or the store
    stopped answering), ``"late"`` (``ranks`` did not come within the bound) or
    ``"stopped"`` (a peer found one of these first: ``why`` is its words); in every case
    graddbg goes on without collectives."""

    ok: bool
    kind: str = ""
    why: str = ""
    ranks: Tuple[int, ...] = ()
    positions: Tuple[Optional[Position], ...] = ()


class Peers:
    """This rank's position, pulse and waits, in the store under ``prefix``."""

    def __init__(self, store: Any, prefix: str, rank: int, world: int, seconds: float) -> None:
        self.store, self.prefix, self.rank, self.world = store, prefix, rank, world
        self.seconds = seconds                 #: the bound of every wait (the user's timeout)
        self.backward = 0                      #: this rank's backward passes so far
        self._at_boundary = -1                 # (the backward passes at this rank's last boundary)
        self._published = Position(0, 0, False)
        self._pos = [f"{prefix}pos/{r}" for r in range(world)]
        self._beat = [f"{prefix}beat/{r}" for r in range(world)]
        self._stop_key = f"{prefix}stop"
        store.compare_set(self._stop_key, "", "")  # (exists from now on: read with the positions)
        store.set(self._pos[rank], self._published.text())
        store.add(self._beat[rank], 1)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._pulse, name="graddbg-pulse", daemon=True)
        self._thread.start()
        _OPEN.add(self)

    # ------------------------------------------------------------------ this rank
    def _pulse(self) -> None:
        key, store = self._beat[self.rank], self._own_connection()
        while not self._closed.wait(BEAT_SECONDS):
            try:
                store.add(key, 1)
            except Exception:  # (the store is gone: so is the job; nothing to say from here)
                return

    def _own_connection(self) -> Any:
        """A connection of the pulse's own to the store (a client's requests are not to be
        interleaved across threads: the training thread uses the store too)."""
        try:
            return self.store.clone()
        except Exception:
            return self.store

    def backward_ended(self) -> None:
        self.backward += 1

    def forward_began(self, steps: int) -> None:
        """A forward pass begins, ``steps`` boundaries so far: say so when that moved (a peer
        waiting at a boundary that this rank went past, without a step or without a backward
        pass, sees it). One write to the store per step, none per forward pass beyond."""
        if self.backward != self._published.backward or steps != self._published.steps or self._published.at:
            self._publish(Position(self.backward, steps, False))

    def _publish(self, pos: Position) -> None:
        self._published = pos
        try:
            self.store.set(self._pos[self.rank], pos.text())
        except Exception:
            pass  # (the store is gone: the next wait says so)

    def at_boundary(self, steps: int) -> None:
        """This rank is at a boundary after ``steps`` boundaries (without waiting: the ranks
        went on without collectives; its position still tells its peers how it steps)."""
        self._at_boundary = self.backward
        self._publish(Position(self.backward, steps + 1, False))

    def positions(self) -> Optional[Tuple[Position, ...]]:
        """Every rank's position as last written (None if the store stopped answering)."""
        try:
            return tuple(Position.parse(v) for v in self.store.multi_get(self._pos))
        except Exception:
            return None

    def tell(self, key: str, value: str) -> None:
        """A fact for the peers under ``key`` (`hear`)."""
        try:
            self.store.set(self.prefix + key, value)
        except Exception:
            pass

    def hear(self, key: str, seconds: float) -> Optional[str]:
        """The fact a peer told under ``key``, waited for at most ``seconds`` (and not past
        the stop key, or a dead store): None when it did not come."""
        try:
            if not poll(lambda: self.store.check([self.prefix + key]), seconds, 1e-4, 0.02,
                        stop=lambda: self.store.get(self._stop_key)):
                return None
            return self.store.get(self.prefix + key).decode()
        except Exception:
            return None

    def closing(self, seconds: float) -> Optional[Tuple[Position, ...]]:
        """This rank's watch closes: say so, then wait (at most ``seconds``, and not for a
        peer whose pulse stood still) until every peer's watch closed too, so that the
        positions read are final ones; then until every peer has read them (a few seconds
        at most), so that the rank hosting the store does not end first. Returns every
        rank's position as last written (None if the store stopped answering first)."""
        if not self._published.at and self._published.backward != self.backward:
            self._publish(Position(self.backward, self._published.steps, False))
        pos = None
        try:
            self.store.set(f"{self.prefix}closed/{self.rank}", "1")
            self._all_say("closed", seconds)
            pos = self.positions()
            self.store.set(f"{self.prefix}read/{self.rank}", "1")
            self._all_say("read", min(seconds, 5.0))
        except Exception:
            pass
        return pos

    def _all_say(self, what: str, seconds: float) -> None:
        """Wait until every rank wrote ``<what>/<rank>``, at most ``seconds``, and not for
        ranks whose pulse stood still."""
        keys = [f"{self.prefix}{what}/{r}" for r in range(self.world)]
        start = time.monotonic()
        beats, moved, next_beat = self._beats(), [start] * self.world, start + BEAT_SECONDS
        delay = 1e-3
        while time.monotonic() - start < seconds:
            waiting = [r for r, k in enumerate(keys) if not self.store.check([k])]
            if not waiting:
                return
            now = time.monotonic()
            if now >= next_beat:
                now_beats = self._beats()
                moved = [now if a != b else t for a, b, t in zip(beats, now_beats, moved)]
                beats, next_beat = now_beats, now + BEAT_SECONDS
                if all(now - moved[r] >= SILENT_SECONDS for r in waiting):
                    return
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def stop(self, why: str) -> str:
        """Tell every peer to go on without collectives (the first reason written wins);
        returns the reason in force."""
        try:
            self.store.compare_set(self._stop_key, "", why)
            return self.store.get(self._stop_key).decode() or why
        except Exception:
            return why

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * BEAT_SECONDS + 1)
        _OPEN.discard(self)

    # ------------------------------------------------------------------ waits
    def arrive(self, steps: int, comparable: bool) -> Verdict:
        """This rank is at its boundary after ``steps`` boundaries: wait until every peer is
        at the same one (``ok``), or find why it will not come. ``comparable``: the ranks
        count the same backward passes per step (replicas of one model, as under DDP), so a
        peer that went past this rank's backward count without a boundary skipped a step."""
        me = Position(self.backward, steps, True)
        repeat = steps > 0 and self.backward == self._at_boundary  # (no backward pass since the last step)
        self._publish(me)
        self._at_boundary = self.backward
        start = time.monotonic()
        delay, next_beat = 5e-5, start + BEAT_SECONDS
        try:
            beats = self._beats()
        except Exception as err:
            return self._gone_store(err)
        moved = [start] * self.world  # (when each peer's pulse was last seen moving)
        while True:
            try:
                raw = self.store.multi_get(self._pos + [self._stop_key])
            except Exception as err:
                return self._gone_store(err)
            stop = raw[-1].decode()
            if stop:
                return Verdict(False, "stopped", stop)
            pos = tuple(Position.parse(v) for v in raw[:-1])
            if all(p.at and p.steps == steps for p in pos):
                return Verdict(True, positions=pos)
            out = [r for r, p in enumerate(pos) if _out_of_step(p, me, comparable)]
            if out:
                if repeat and comparable:  # (the step is this rank's own second one)
                    return Verdict(False, "desync", f"rank {self.rank} called optimizer.step() again (its step "
                                   f"{steps}) with no backward pass since its step {steps - 1}, where rank(s) "
                                   f"{_join(out)} went on to the next forward pass", (self.rank,), pos)
                return Verdict(False, "desync", _desync_text(out, pos, me, self.rank), tuple(out), pos)
            now = time.monotonic()
            if now >= next_beat:
                try:
                    now_beats = self._beats()
                except Exception as err:
                    return self._gone_store(err)
                moved = [now if a != b else t for a, b, t in zip(beats, now_beats, moved)]
                beats, next_beat = now_beats, now + BEAT_SECONDS
                waiting = [r for r, p in enumerate(pos) if not (p.at and p.steps == steps)]
                dead = [r for r in waiting if now - moved[r] >= min(SILENT_SECONDS, self.seconds)]
                if dead:
                    return Verdict(False, "gone", f"rank(s) {_join(dead)} stopped answering (no sign of life for "
                                   f"{SILENT_SECONDS:g} s; the process ended?) while rank {self.rank} waited for them at "
                                   f"step {steps}", tuple(dead), pos)
            if now - start > self.seconds:
                late = [r for r, p in enumerate(pos) if not (p.at and p.steps == steps)]
                return Verdict(False, "late", f"rank(s) {_join(late)} did not reach step {steps} within "
                               f"{self.seconds:g} s (the process group's timeout, or ddp_timeout)", tuple(late), pos)
            time.sleep(delay)
            delay = min(delay * 2, 2e-3)

    def _beats(self) -> List[int]:
        return [int(v) for v in self.store.multi_get(self._beat)]

    def _gone_store(self, err: Exception) -> Verdict:
        return Verdict(False, "gone", f"the process group's store stopped answering ({type(err).__name__}: "
                       f"{str(err).splitlines()[0][:160] if str(err) else ''}): rank 0, which hosts it, ended?",
                       (0,))


def _out_of_step(p: Position, me: Position, comparable: bool) -> bool:
    """Whether peer position ``p`` shows the ranks stepped differently, seen from ``me`` (at
    its boundary): the peer took more steps, or (``comparable``) it went on to a forward pass
    past this rank's backward passes without the step this rank takes now. (A peer still at
    its previous boundary is waited for: it may be about to take this step too.)"""
    if p.steps > me.steps:
        return True
    return comparable and not p.at and p.backward >= max(me.backward, 1)  # (0: it has not begun)


def _desync_text(out: List[int], pos: Tuple[Position, ...], me: Position, rank: int) -> str:
    parts = []
    for r in out:
        p = pos[r]
        if p.steps > me.steps:
            parts.append(f"rank {r} called optimizer.step() more often: {p.steps} step(s) where rank {rank} took "
                         f"{me.steps}, after {me.backward} backward pass(es)")
        else:
            parts.append(f"rank {r} went on past backward pass {me.backward} without the optimizer.step() that "
                         f"rank {rank} takes there (rank {r}: {p.steps} step(s) over {p.backward} backward "
                         f"pass(es); rank {rank}: {me.steps + 1} over {me.backward}): rank {r} skipped step "
                         f"{me.steps}")
    return "; ".join(parts)


def _join(ranks: List[int]) -> str:
    return ", ".join(map(str, ranks))
