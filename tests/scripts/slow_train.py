"""A plain training script that runs until it is stopped: one small step every few
milliseconds, "step N" printed (and flushed) after each.

    python slow_train.py [STEPS (default 100000)] [SECONDS PER STEP (default 0.005)]
"""
import sys
import time

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
delay = float(sys.argv[2]) if len(sys.argv) > 2 else 0.005
for step in range(steps):
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    print("step", step, flush=True)
    time.sleep(delay)
print("finished", steps)
