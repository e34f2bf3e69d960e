"""Clips between backward and step; writes each step's pre-clip norm (from torch) to argv[1]."""
import sys

import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
norms = []
for _ in range(3):
    opt.zero_grad()
    (model(torch.randn(16, 4)).pow(2).sum() * 10).backward()
    norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
    opt.step()
with open(sys.argv[1], "w") as f:
    f.write(" ".join(repr(n) for n in norms))
