"""pytorch/examples time_sequence_prediction in small: the optimizer (LBFGS) is made before
any forward pass and the model is first called inside the closure. Writes torch's own
gradient norms at the first closure evaluation of every step to the JSON file argv[1].
With argv[2] == "hidden", no frame that calls ``optimizer.step`` holds the model (only the
closure does)."""
import json
import sys

import torch
from torch import nn


class Sequence(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm1 = nn.LSTMCell(1, 6)
        self.linear = nn.Linear(6, 1)

    def forward(self, x):
        h = c = torch.zeros(x.size(0), 6, dtype=x.dtype)
        outputs = []
        for t in range(x.size(1)):
            h, c = self.lstm1(x[:, t:t + 1], (h, c))
            outputs.append(self.linear(h))
        return torch.cat(outputs, dim=1)


def make_closure(seq, optimizer, seen):
    torch.manual_seed(0)
    x = torch.sin(torch.arange(0, 12, dtype=torch.float64).repeat(3, 1) / 3 + torch.rand(3, 1) * 3)
    inp, target = x[:, :-1], x[:, 1:]
    criterion = nn.MSELoss()
    evaluations = []

    def closure():
        optimizer.zero_grad()
        loss = criterion(seq(inp), target)
        loss.backward()
        if len(evaluations) == len(seen):  # the first evaluation of this step
            seen.append({n: float(p.grad.norm()) for n, p in seq.named_parameters()})
        return loss

    def next_step():
        evaluations.append(len(seen))
    return closure, next_step


def train(optimizer, closure, next_step, steps=3):
    for _ in range(steps):
        optimizer.step(closure)
        next_step()


if __name__ == "__main__":
    torch.manual_seed(0)
    seen = []
    if sys.argv[2:] == ["hidden"]:
        def build():
            seq = Sequence().double()
            optimizer = torch.optim.LBFGS(seq.parameters(), lr=0.8, max_iter=4)
            return (optimizer, *make_closure(seq, optimizer, seen))
        train(*build())
    else:
        seq = Sequence().double()
        optimizer = torch.optim.LBFGS(seq.parameters(), lr=0.8, max_iter=4)
        train(optimizer, *make_closure(seq, optimizer, seen))
    with open(sys.argv[1], "w") as f:
        json.dump(seen, f)
    print("trained", len(seen))
