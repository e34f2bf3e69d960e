"""Shared by the distributed tests: a free port on 127.0.0.1, and real processes spawned
on it with a bounded wait, each writing a JSON record that is read back.

Every rank is started by one fork server (:func:`context`) that imported torch and graddbg
once: a rank is a fresh process (its own interpreter state, process group and exit) that
starts in a tenth of a second, instead of an interpreter start and ``import torch`` each
(3-4 s of CPU, 15 s and more on a loaded 2-core machine)."""
from __future__ import annotations

import json
import multiprocessing
import pathlib
import socket
from typing import Callable, Dict, Sequence

# What the fork server imports before it forks a rank: what the workers import, and what a
# watch imports on first use (torch._dynamo: 2-3 s of CPU; pandas for its tables). None of
# these starts a thread or initialises CUDA, so a rank may still fork safely and use NCCL.
PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "pandas",
           "graddbg", "graddbg.ddp_verify", "graddbg.hooks"]


def context() -> multiprocessing.context.BaseContext:
    """The start method of the tests' ranks: ``forkserver`` with torch and graddbg preloaded.

    The server starts on first use and serves the whole session. A rank forked from it sees
    ``sys.path`` and the current folder of the test process, but the environment the server
    started with (the workers set what they need, MASTER_PORT and the like, themselves)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # (no effect once the server runs: the same list)
    return ctx


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (the only address the tests ever use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(target: Callable, world: int, args: Callable[[int, int], Sequence], records: Callable[[int], pathlib.Path],
          timeout: float = 180, fresh: bool = False) -> Dict[int, dict]:
    """Start ``world`` processes ``target(*args(rank, port))``, wait at most ``timeout``
    seconds for them (killing any left), and return each rank's JSON record; a record with
    an ``error`` (a traceback) fails the test with it. ``fresh``: each rank a fresh
    interpreter ("spawn"), not a fork of :func:`context`'s server."""
    ctx = multiprocessing.get_context("spawn") if fresh else context()
    port = free_port()
    procs = [ctx.Process(target=target, args=tuple(args(r, port)), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"rank(s) {[procs.index(p) for p in alive]} hung"
    results = {r: json.loads(records(r).read_text()) for r in range(world)}
    for r, rec in results.items():
        assert "error" not in rec, f"rank {r}:\n{rec['error']}"
    return results


def run_rank(rank: int, world: int, port: int, path: str, body: Callable[[], dict], backend: str = "gloo") -> None:
    """In a spawned process: join a world (gloo by default) on 127.0.0.1, run ``body()``
    and write what it returns (or the traceback it raised, as ``error``) to ``path`` as JSON."""
    import os
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        record = body()
    except BaseException:
        record = {"error": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    with open(path, "w") as f:
        json.dump(record, f)
