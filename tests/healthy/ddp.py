"""A 2-rank DistributedDataParallel loop (pytorch/examples distributed/ddp and the DDP
tutorial series): gloo on 127.0.0.1, each rank its own shard of the data, an MLP wrapped in
DDP, SGD(lr=0.05, momentum=0.9), zero_grad / backward (gradients all-reduced) / step.
Rank 0 prints the mean loss over the ranks.

Launched by torchrun (``torchrun --nproc-per-node=2 ddp.py``; under graddbg:
``torchrun --nproc-per-node=2 -m graddbg run ddp.py``) it uses torchrun's environment;
run as ``python ddp.py`` it spawns its 2 ranks itself (torch.multiprocessing)."""
import datetime
import os
import socket

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORLD = 2


def train(rank, world):
    torch.manual_seed(0)  # the same initial weights on every rank
    torch.set_num_threads(1)
    model = DDP(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard
    w_true = torch.linspace(-1, 1, 10)[:, None]
    for step in range(12):
        x = torch.randn(16, 10, generator=gen)
        y = x @ w_true
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"loss {step} {mean.item() / world:.8e}", flush=True)


def _spawned(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        train(rank, world)
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        try:
            train(dist.get_rank(), dist.get_world_size())
        finally:
            dist.destroy_process_group()
    else:
        torch.multiprocessing.spawn(_spawned, args=(WORLD, _free_port()), nprocs=WORLD, join=True)
