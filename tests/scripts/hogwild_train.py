"""Hogwild training as pytorch/examples' mnist_hogwild does it: a shared model, worker
processes (torch.multiprocessing, fork) each with its own optimizer; the parent trains
nothing. Also prints __file__ (absolute under python, and under graddbg run)."""
import os
import sys

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn


def train(rank, model):
    torch.manual_seed(1 + rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    for _ in range(5):
        x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


if __name__ == "__main__":
    print("file", os.path.isabs(__file__))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    model.share_memory()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=train, args=(r, model)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    sys.exit(max(p.exitcode for p in procs))
