"""A DataLoader with worker processes (argv[1]: how many), an iterator left half-read in a
global and a helper function (so the script's namespace is a reference cycle); prints
"script done" on stderr when its last line ran."""
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
loader = DataLoader(data, batch_size=32, num_workers=int(sys.argv[1]))
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def train_step(x, y):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


batches = iter(loader)
for _ in range(3):
    train_step(*next(batches))
print("script done", file=sys.stderr, flush=True)
