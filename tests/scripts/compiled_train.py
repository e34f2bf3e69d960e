"""Trains a torch.compile'd module (the eager backend: compiling is quick)."""
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
compiled = torch.compile(model, backend="eager")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    compiled(torch.randn(16, 4)).pow(2).sum().backward()
    opt.step()
