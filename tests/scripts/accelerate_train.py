"""An accelerate training loop (no graddbg in it), meant for ``accelerate launch`` with 2 CPU
processes: DDP through ``Accelerator.prepare``, 3 steps; at step 2 rank 1 makes a NaN in its
gradient before the reduction (so every rank's reduced gradient has it). Exits 5."""
import sys

import torch
from accelerate import Accelerator
from torch import nn

if __name__ == "__main__":
    torch.set_num_threads(1)
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(acc.process_index)
    for step in range(3):
        x = torch.randn(4, 4, generator=g)
        out = model(x)
        if step == 2 and acc.process_index == 1:
            out = out + torch.sqrt(out * 0.0)
        acc.backward(out.pow(2).mean())
        opt.step()
        opt.zero_grad()
    acc.wait_for_everyone()
    print("accelerate rank", acc.process_index, "of", acc.num_processes, "done")
    sys.exit(5)
