"""The rendezvous of a cross-rank check: which group and device its collectives use, and
the exchange of the ranks' headers, bounded by a timeout, that names the ranks that never
came instead of hanging (step 3 of `graddbg.ddp_verify`'s module docstring). Its check-in
and waits are a watch's too (`graddbg._dist.store`).
"""
from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from graddbg._dist.collective import keep_work
from graddbg._dist.groups import group_ranks
from graddbg._dist.store import RollCall, poll
from graddbg._dist.store import default_store as _store  # (a test makes the store unreachable here)
from graddbg._errors import DDPTimeoutError

__all__ = ["comm_device", "exchange", "raise_if_late", "side_group"]


# --------------------------------------------------------------------------- groups
def _backend(group: Any) -> str:
    return str(dist.get_backend(group)).lower()


def comm_device(group: Any, tensors: Sequence[Optional[torch.Tensor]],
                model: nn.Module) -> torch.device:
    """The device the group's collectives take tensors on."""
    backend = _backend(group)
    if backend in ("gloo", "mpi"):
        return torch.device("cpu")
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    first = next((t.device for t in tensors if t is not None),
                 next((p.device for p in model.parameters()), torch.device("cpu")))
    if first.type == "cuda" and first.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return first


# Barrier groups by group: creating a group is collective, so it happens once per group
# (in prepare() or in the first check) and is cached for the life of the process. The
# entry keeps the group itself alive, so that its id is not reused.
_SIDE_GROUPS: dict = {}


def side_group(group: Any, timeout: timedelta, force_side: bool = False) -> Any:
    """The gloo group the header goes over: ``group`` itself when it is a gloo group, else
    a gloo side group of the same ranks (``monitored_barrier`` and timed waits need gloo)."""
    if not force_side and _backend(group) == "gloo":
        return group
    key = id(group if group is not None else dist.group.WORLD)
    if key not in _SIDE_GROUPS:
        ranks = group_ranks(group)
        try:
            side = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout,
                                  use_local_synchronization=True)
        except RuntimeError as err:
            raise DDPTimeoutError(
                f"graddbg.ddp_verify: could not create the gloo side group used to detect "
                f"missing ranks (ranks {ranks}); some rank did not arrive within {timeout}. "
                f"Call graddbg.ddp_verify.prepare() on every rank right after "
                f"init_process_group. Cause: {err}") from err
        _SIDE_GROUPS[key] = (group, side)
    return _SIDE_GROUPS[key][1]


# --------------------------------------------------------------------------- the rendezvous
def _timeout_error(fn: str, group: Any, timeout: timedelta, missing: List[int], what: str,
                   said: str) -> DDPTimeoutError:
    """A DDPTimeoutError naming the ranks that did not enter the check (``missing``; when
    they are not known, ``what`` did not complete), carrying them as ``missing_ranks``."""
    rank, world, secs = dist.get_rank(group), dist.get_world_size(group), timeout.total_seconds()
    if missing:
        message = (f"{fn}: rank(s) {missing} of the group (world size {world}) did not enter "
                   f"the check within {secs:g} s (seen from rank {rank}).")
    else:
        message = f"{fn}: {what} did not complete within {secs:g} s (seen from rank {rank})."
    error = DDPTimeoutError(f"{message} Every rank must call {fn} at the same point of the "
                            f"program. After this error the process group may not be usable. "
                            f"(torch.distributed said: {said.strip()[:300]})")
    error.missing_ranks = missing  # type: ignore[attr-defined]
    return error


def _barrier(fn: str, group: Any, timeout: timedelta) -> None:
    """A monitored barrier on the gloo group, naming the ranks that do not arrive (the
    rendezvous where the process group's store cannot be reached)."""
    try:
        dist.monitored_barrier(side_group(group, timeout), timeout=timeout, wait_all_ranks=True)
    except RuntimeError as err:
        found = re.search(r"Ranks? ([\d,\s]+) failed to pass monitoredBarrier", str(err))
        missing = [int(r) for r in re.findall(r"\d+", found.group(1))] if found else []
        raise _timeout_error(fn, group, timeout, missing, "the group's barrier (rank 0, or a "
                             "rank that rank 0 names in its own error, did not enter it)",
                             str(err)) from err


def _prefix(group: Any) -> str:
    return f"graddbg/ddp_verify/checks/{','.join(map(str, group_ranks(group)))}/"


def _counter_key(group: Any, global_rank: int) -> str:
    return f"{_prefix(group)}{global_rank}"


# Checks this process has entered, by default group and counter key (group and rank); the
# store gets a copy when an exchange is slow (`_settle`)
_ENTERED: dict = {}
_QUIET = 0.25       # seconds an exchange may take before this rank's count goes to the store


def _check_in(group: Any) -> Tuple[str, int]:
    """Count this rank into a check on ``group``: its store key and how many checks it has
    entered so far (kept here; `_settle` writes it to the store when the exchange is slow)."""
    key = _counter_key(group, dist.get_rank())
    entry = (id(dist.group.WORLD), key)
    count = _ENTERED[entry] = _ENTERED.get(entry, 0) + 1
    return key, count


def _settle(work: Any, store: Any, key: str, count: int, timeout: timedelta) -> None:
    """Wait for the exchange ``work``, at most ``timeout``. A healthy exchange ends within
    milliseconds and costs no store operation (a ``set`` waits for a round trip to rank 0's
    host). One still running after ``_QUIET`` s writes this rank's check count to the store
    first, so that ranks whose exchange times out (after at least seconds more) can name
    the ranks that never entered the check (`_behind`); a failed write is let go."""
    quiet = min(_QUIET, timeout.total_seconds() / 4)
    start = time.perf_counter()
    poll(work.is_completed, quiet, 1e-5, 1e-4)     # ends at most 0.1 ms after the exchange
    if not work.is_completed() and store is not None:
        try:
            store.set(key, str(count))
        except Exception:
            pass
    work.wait(timeout=max(timeout - timedelta(seconds=time.perf_counter() - start),
                          timedelta(milliseconds=1)))


def _behind(group: Any, arrived: int) -> Optional[List[int]]:
    """The ranks of ``group`` whose counters in the store say they entered fewer than
    ``arrived`` checks; None when the store cannot be read (who is missing is unknown)."""
    roll = RollCall(_store(), _prefix(group), group_ranks(group))  # (a counter per rank of the group)
    try:
        return roll.behind(arrived)
    except Exception:   # no store, or its host is gone
        return None


def exchange(fn: str, group: Any, timeout: timedelta, header: List[int]) -> List[List[int]]:
    """Check in, then all-gather the headers over the gloo group, waiting at most
    ``timeout`` (see `graddbg.ddp_verify`'s module docstring, step 3): every rank's header,
    in rank order, with the time it started waiting (µs) last. ``fn`` names the check in
    the errors."""
    side = side_group(group, timeout)
    store = _store()
    if store is None:
        _barrier(fn, group, timeout)
    key, arrived = _check_in(group)
    wire = torch.tensor(header + [int(time.time() * 1e6)], dtype=torch.int64)
    out = [torch.empty_like(wire) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(out, wire, group=side, async_op=True)
    keep_work(work, out)
    try:
        _settle(work, store, key, arrived, timeout)
    except RuntimeError as err:
        behind = _behind(group, arrived)
        what = ("every rank entered the check, but the exchange" if behind == [] else
                "the exchange (the process group's store could not be read to name the ranks "
                "that did not enter it)")
        raise _timeout_error(fn, group, timeout, behind or [], what, str(err)) from err
    return [row.tolist() for row in out]


def raise_if_late(fn: str, starts: Sequence[int], timeout: timedelta, rank: int) -> None:
    """Raise on every rank when some rank started the exchange so late that the ranks that
    were waiting may have given up (their pending exchange then completes for the late
    rank, which must not carry on as if the check had passed). ``starts``: every rank's
    wall-clock time (µs) when it started waiting; clocks are assumed to agree to within
    the margin, min(1 s, timeout / 10)."""
    secs = timeout.total_seconds()
    limit = (secs - min(1.0, secs / 10)) * 1e6
    late = [r for r, t in enumerate(starts) if t - min(starts) > limit]
    if late:
        error = DDPTimeoutError(
            f"{fn}: rank(s) {late} entered the check more than {secs:g} s after the first rank "
            f"(seen from rank {rank}); the ranks that were waiting have given up (raised "
            f"DDPTimeoutError). Every rank must call {fn} at the same point of the program.")
        error.missing_ranks = late  # type: ignore[attr-defined]
        raise error
