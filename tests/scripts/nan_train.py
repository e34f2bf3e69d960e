"""A plain training script (no graddbg in it) whose forward pass makes a NaN at step 3."""
import sys

import torch
from torch import nn


class SafeLog(nn.Module):
    def forward(self, x):
        return torch.log(x)  # log of a negative number: NaN


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.logs = SafeLog()
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        return self.out(self.logs(self.inp(x).abs() + 1.0 - 2.0 * self.bad))


torch.manual_seed(0)
model = Net()
model.bad = 0.0
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 6
for step in range(steps):
    model.bad = 10.0 if step == 3 else 0.0
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print("trained", steps)
