"""A rank of tests/test_faults.py: a small DDP job, plain or watched, with a planted fault:

* ``die``: rank ``victim`` ends (``os._exit``) at step ``at``, at ``where`` ("forward": before
  the forward pass; "step": between the backward pass and ``optimizer.step()``); it writes the
  moment it died first. The survivors train on until torch (or graddbg) stops them, and write
  when they ended and what stopped them.
* ``skip`` (``repeat``): rank 1 skips (repeats) ``optimizer.step()`` (a per-rank "skip this step if my loss looks bad"
  guard, after the backward pass) at the steps in ``skips``; every rank writes its final
  weights, so a watched job can be compared with the same job unwatched.

Each rank writes ``rank<r>.json`` in ``out``."""
from __future__ import annotations

import json
import os
import pathlib
import time
import traceback
import warnings
from datetime import timedelta


def main(rank: int, world: int, port: int, out: str, watched: bool, fault: str, victim: int = 1, at: int = 0,
         where: str = "step", skips: tuple = (), steps: int = 8, pg_timeout: float = 60.0,
         ddp_timeout: float = None) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import graddbg

    path = pathlib.Path(out)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout))
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    record = {"status": "finished"}
    w = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            kw = {} if ddp_timeout is None else {"ddp_timeout": ddp_timeout}
            w = graddbg.watch(model, opt, **kw) if watched else None
            g = torch.Generator().manual_seed(100 + rank)
            for step in range(steps):
                if fault == "die" and rank == victim and step == at and where == "forward":
                    _die(path, rank)
                x = torch.randn(16, 6, generator=g)
                opt.zero_grad()
                loss = (model(x) - x[:, :2]).pow(2).mean()
                loss.backward()
                if fault == "die" and rank == victim and step == at and where == "step":
                    _die(path, rank)
                if fault == "skip" and rank == 1 and step in skips:
                    continue  # (this rank's loss "looked bad": no update)
                if fault in ("skip", "repeat") and rank == 0 and step == steps - 1:
                    time.sleep(1.0)  # (rank 0 ends last: rank 1's watch closes first)
                opt.step()
                if fault == "repeat" and rank == 1 and step in skips:
                    opt.step()  # (a second update from the same gradients)
            record["weights"] = [p.detach().flatten().tolist() for p in model.parameters()]
        except BaseException as err:
            record.update(status=type(err).__name__, error_text=str(err)[:2000],
                          where=traceback.format_exc()[-3000:])
        record["end"] = time.time()
        if w is not None:
            try:
                w.close()
                record["anomalies"] = [{"kind": a.kind, "step": a.step, "message": a.message, "rank": a.rank}
                                       for a in w.anomalies]
                record["steps"] = len(w.steps)
            except BaseException as err:
                record["close_error"] = f"{type(err).__name__}: {err}"
        record["warnings"] = [str(c.message) for c in caught if "graddbg" in str(c.message)]
    (path / f"rank{rank}.json").write_text(json.dumps(record))
    os._exit(0)  # (a peer may be gone: no teardown of the process group)


def _die(path: pathlib.Path, rank: int) -> None:
    (path / f"died{rank}").write_text(str(time.time()))
    os._exit(1)
