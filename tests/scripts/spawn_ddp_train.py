"""A script that starts its own ranks with torch.multiprocessing.spawn (2 gloo ranks on
127.0.0.1, DDP), each training 3 steps; rank 1 makes a NaN at the last step. Exits 3."""
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def train(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(3):
        opt.zero_grad()
        model(torch.randn(3, 4)).pow(2).mean().backward()
        if rank == 1 and step == 2:
            model.module.weight.grad[0, 0] = float("nan")
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    mp.spawn(train, args=(2, free), nprocs=2)
    sys.exit(3)
