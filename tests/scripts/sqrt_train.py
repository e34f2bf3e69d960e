"""A NaN made by sqrt(0) at the very first step (before graddbg run has watched any forward pass)."""
import torch
from torch import nn
torch.manual_seed(0)

class PairwiseDistance(nn.Module):
    def forward(self, x):
        return (x[:, None] - x[None]).pow(2).sum(-1).sqrt()   # sqrt(0) on the diagonal

net = nn.Sequential(nn.Linear(4, 4), PairwiseDistance(), nn.Linear(8, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for step in range(3):
    opt.zero_grad()
    net(torch.randn(8, 4)).sum().backward()
    opt.step()
