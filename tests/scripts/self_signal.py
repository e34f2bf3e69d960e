"""A plain training script that sends itself a signal (argv[1], e.g. SIGTERM) after three
steps, as a job scheduler would, then would train on: the steps after it must not run."""
import os
import signal
import sys

import torch
from torch import nn

model = nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    model(torch.randn(4, 3)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    if step == 2:
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
print("trained past the signal")
