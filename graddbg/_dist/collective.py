"""graddbg's own collectives (`run_collective`), made safe to end a process right after.

A gloo collective runs on one of the process group's worker threads. When it is done, that
thread drops its reference to the work, and if that reference is the last one, it frees
the work's tensors; graddbg's tensors are Python objects, so freeing them needs the GIL.
If the main thread reaches interpreter shutdown first (a script that ends right after a
watched step or a replica check), CPython ends the worker thread while it waits for the
GIL, inside a C++ destructor, and the process aborts ("terminate called without an active
exception", SIGABRT: torchrun counts the rank as failed). To avoid this, `run_collective`
keeps each CPU work alive for at least `KEEP_SECONDS` after it was issued (up to `KEEP_MOST`
of them), so the worker thread, which lets go of a work microseconds after finishing it,
never holds the last reference; the main thread frees it, holding the GIL. (Keeping only
the last work is not enough: the previous one, freed by the next collective, may still be
held by a worker thread when the process ends right after; a test saw that once.)
tests/test_collective.py ends processes right after graddbg's collectives; without this
(graddbg 9e4295f) a watched run ended that way aborted in 3 of 8 runs.

This module imports only `graddbg._dist.store` (its `poll`).
"""
from __future__ import annotations

import collections
import math
import time
from typing import Any, Callable, Deque, Tuple

import torch

from graddbg._dist.store import poll

__all__ = ["all_gather", "run_collective", "keep_work", "wait_interruptibly"]

KEEP_SECONDS = 1.0     # a work is freed by the main thread no sooner than this after it was issued
KEEP_MOST = 1024       # ... unless more works than this were issued since (bounds the memory)
_HELD: Deque[Tuple[float, Any]] = collections.deque()     # (when issued, work), oldest first


def keep_work(work: Any, tensor: Any) -> None:
    """Keep ``work`` (a collective's handle; None: nothing ran) alive for `KEEP_SECONDS`
    when ``tensor`` (a tensor, or a list of them: what it wrote) is in CPU memory, and let
    go of the works kept longer than that. CUDA works (NCCL's) are left as torch manages
    them; only CPU works are kept."""
    now = time.monotonic()
    while _HELD and (now - _HELD[0][0] > KEEP_SECONDS or len(_HELD) >= KEEP_MOST):
        _HELD.popleft()
    first = tensor[0] if isinstance(tensor, (list, tuple)) else tensor
    if work is not None and isinstance(first, torch.Tensor) and first.device.type == "cpu":
        _HELD.append((now, work))


def run_collective(collective: Callable[..., Any], out: Any, *args: Any, **kwargs: Any) -> None:
    """``collective(out, *args, **kwargs)`` (a ``torch.distributed`` function that takes
    ``async_op``), waited for as a synchronous call is, its work kept by `keep_work`.

    A CPU work (gloo) is waited for by polling it with short sleeps, never inside one
    blocking C++ call: Python's signal handlers run while graddbg waits on a peer, so
    SIGINT and SIGTERM (``graddbg run`` turns it into an exception) end the process and
    the record is written even when a peer never comes."""
    work = collective(out, *args, async_op=True, **kwargs)
    keep_work(work, out)
    if work is None:        # (None: this rank is not in the group)
        return
    first = out[0] if isinstance(out, (list, tuple)) else out
    if isinstance(first, torch.Tensor) and first.device.type == "cpu":
        wait_interruptibly(work)
    work.wait()             # (returns at once when done; raises what the work raised)


def wait_interruptibly(work: Any, first_sleep: float = 2e-5, longest_sleep: float = 1e-3) -> None:
    """Wait until ``work.is_completed()``, sleeping between polls (from ``first_sleep``
    seconds, doubling up to ``longest_sleep``): signal handlers run between the polls."""
    poll(work.is_completed, math.inf, first_sleep, longest_sleep)


def all_gather(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Every rank's ``tensor`` (the same shape on every rank of ``group``; None: the default
    group), stacked in rank order."""
    out = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size(group))]
    run_collective(torch.distributed.all_gather, out, tensor.contiguous(), group=group)
    return torch.stack(out)
