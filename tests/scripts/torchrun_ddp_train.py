"""A script for torchrun (2 gloo ranks on 127.0.0.1, DDP, 3 steps); exits 4."""
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(3):
    opt.zero_grad()
    model(torch.randn(3, 4)).pow(2).mean().backward()
    opt.step()
dist.destroy_process_group()
sys.exit(4)
