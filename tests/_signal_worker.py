"""A rank of tests/test_never_hang.py: DDP steps watched on ranks 0 and 1; rank 2 stops
answering before one step, so ranks 0 and 1 wait on it inside graddbg's per-step exchange.
Rank 0 has ``graddbg run``'s SIGTERM handler (graddbg.cli.Signals), rank 1 Python's default
SIGINT handler; the test signals them while they wait: each must end at once, writing its
record first."""
from __future__ import annotations

import json
import os
import pathlib
import sys
import time
from datetime import timedelta


def main(rank: int, world: int, port: int, outdir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import graddbg
    from graddbg.cli import Signals

    out = pathlib.Path(outdir)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = graddbg.watch(model, opt, ddp_check_every=None)
    status = "finished"
    try:
        with Signals():
            for step in range(3):
                opt.zero_grad()
                model(torch.randn(3, 4)).pow(2).mean().backward()
                if step == 2:
                    if rank == 2:
                        time.sleep(600)  # (killed by the test)
                    (out / f"waiting{rank}").write_text(str(time.time()))
                opt.step()
    except BaseException as err:  # KeyboardInterrupt, or graddbg run's Terminated
        status = type(err).__name__
    w.close()
    w.save(out / f"record{rank}")
    (out / f"rank{rank}.json").write_text(json.dumps({"status": status, "steps": len(w.steps), "end": time.time()}))
    sys.stdout.flush()
    os._exit(0)  # (the peer is gone: no teardown of the process group)
