"""A rank that ends its process right after graddbg's last collective (tests/test_collective.py).

``ctypes.pythonapi.Py_Exit`` starts the interpreter's shutdown at once, holding the GIL, as a
script whose last line is a watched step or a replica check does, only sooner: a gloo worker
thread that still has to free the collective's tensors then meets the shutdown (SIGABRT)."""
from __future__ import annotations

import ctypes
import os
import sys
from datetime import timedelta


def main(rank: int, world: int, port: int, mode: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import graddbg
    from graddbg import ddp_verify

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    if mode == "run":           # the helper itself, three times in a row
        from graddbg._dist import collective as _collective

        for _ in range(3):
            _collective.run_collective(dist.all_reduce, torch.ones(10))
    elif mode == "watch":       # watched DDP steps: the per-step all-reduce of non-finite flags last
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        w = graddbg.watch(model, opt, ddp_check_every=None)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
        assert w is not None     # (not closed: the process ends right after the step)
    elif mode == "check":       # a replica check last (rendezvous, then the gathers of a mismatch)
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        if rank == 1:
            with torch.no_grad():
                model.bias.add_(1.0)
        report = ddp_verify.check_parameters(model, details=True)
        assert not report.ok
    elif mode == "torch":       # the control: torch's own all-reduce (may abort)
        for _ in range(3):
            dist.all_reduce(torch.ones(10))
    else:
        raise ValueError(mode)
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.pythonapi.Py_Exit(0)
