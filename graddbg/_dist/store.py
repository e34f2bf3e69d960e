"""The default process group's store and graddbg's waits: one check-in (`RollCall`) and one
poll (`poll`), used by a watch (`graddbg._dist.arrival`, `graddbg._dist.peers`) and by the
cross-rank checks (`graddbg._dist.rendezvous`), and by graddbg's collectives
(`graddbg._dist.collective`) to wait for their works.

Every wait polls with short sleeps, never inside one blocking C++ call, so Python's signal
handlers run while graddbg waits on a peer (SIGINT and SIGTERM end the process, and the
record is written, even when a peer never comes).

This module imports nothing of graddbg.
"""
from __future__ import annotations

import time
from typing import Any, Callable, List, Optional, Sequence

import torch

__all__ = ["RollCall", "default_store", "poll"]


def default_store() -> Any:
    """The default process group's store, or None where it cannot be reached (torch's
    private function absent or failing: no process group, or one without a store)."""
    try:
        return torch.distributed.distributed_c10d._get_default_store()
    except Exception:
        return None


def poll(done: Callable[[], Any], seconds: float, first: float = 1e-3, longest: float = 0.05,
         stop: Optional[Callable[[], Any]] = None) -> bool:
    """Wait until ``done()``, at most ``seconds`` (``math.inf``: no bound) and not past a
    true ``stop()``, sleeping between polls (from ``first`` seconds, doubling up to
    ``longest``): whether it came. Signal handlers run between the polls."""
    end, delay = time.monotonic() + seconds, first
    while not done():
        if time.monotonic() > end or (stop is not None and stop()):
            return False
        time.sleep(delay)
        delay = min(delay * 2, longest)
    return True


class RollCall:
    """One key per rank of ``ranks`` under ``prefix`` in ``store`` (``prefix`` and the rank):
    each rank writes its own, holding how many times it checked in (`write`); every rank reads
    the others' (`all_in`, `missing`, `behind`), by position in ``ranks`` (a group's rank).
    A store that stops answering raises from these; the callers say what that means."""

    def __init__(self, store: Any, prefix: str, ranks: Sequence[int]) -> None:
        self.store = store
        self.keys = [f"{prefix}{r}" for r in ranks]
        self._position = {r: i for i, r in enumerate(ranks)}

    def write(self, rank: int, count: int = 1) -> None:
        """Rank ``rank`` checked in ``count`` times."""
        self.store.set(self.keys[self._position[rank]], str(count))

    def all_in(self) -> bool:
        """Whether every rank checked in."""
        return bool(self.store.check(self.keys))

    def missing(self) -> List[int]:
        """The ranks (positions) that never checked in."""
        return [i for i, key in enumerate(self.keys) if not self.store.check([key])]

    def behind(self, count: int) -> List[int]:
        """The ranks (positions) that checked in fewer than ``count`` times."""
        entered = [int(self.store.get(key)) if self.store.check([key]) else 0 for key in self.keys]
        return [i for i, n in enumerate(entered) if n < count]
