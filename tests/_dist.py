"""Shared by the distributed tests: a free port on 127.0.0.1, and real processes spawned
on it with a bounded wait, each writing a JSON record that is read back."""
from __future__ import annotations

import json
import pathlib
import socket
from typing import Callable, Dict, Sequence

import torch.multiprocessing as mp


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (the only address the tests ever use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(target: Callable, world: int, args: Callable[[int, int], Sequence], records: Callable[[int], pathlib.Path],
          timeout: float = 180) -> Dict[int, dict]:
    """Start ``world`` processes ``target(*args(rank, port))``, wait at most ``timeout``
    seconds for them (killing any left), and return each rank's JSON record; a record with
    an ``error`` (a traceback) fails the test with it."""
    ctx = mp.get_context("spawn")
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
