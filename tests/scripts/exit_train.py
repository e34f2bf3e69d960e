"""A plain training script that trains two steps, then calls sys.exit(argv[1]): an int
when the argument is a number, else the string (Python prints it and exits 1)."""
import sys

import torch
from torch import nn

model = nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randn(4, 3)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
code = sys.argv[1] if len(sys.argv) > 1 else None
sys.exit(int(code) if code is not None and code.lstrip("-").isdigit() else code)
