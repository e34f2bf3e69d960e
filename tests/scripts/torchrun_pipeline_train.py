"""A pipeline-parallel script for torchrun with 2 ranks (no graddbg in it): 2 stages of a
small MLP, GPipe over 4 micro-batches, 3 steps; at step 2 stage 1 makes a NaN in its
backward pass (sqrt at 0). Each rank writes torch's own global norm of the step, as
torchtitan's clip computes it (its gradients' norm squared, summed over the pipeline), to
``<argv[1]>/torch-<rank>.json``."""
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe


class Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.on = False

    def forward(self, x):
        return x + torch.sqrt(x * 0.0) if self.on else x


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), Boom(), nn.Linear(8, 2))
    part = full[:2] if rank == 0 else full[2:]
    stage = PipelineStage(part, rank, 2, torch.device("cpu"),
                          input_args=(torch.randn(2, 4 if rank == 0 else 16, requires_grad=rank > 0),),
                          output_args=torch.randn(2, 16 if rank == 0 else 2, requires_grad=True))
    sched = ScheduleGPipe(stage, n_microbatches=4, loss_fn=lambda o, t: nn.functional.mse_loss(o, t))
    opt = torch.optim.SGD(part.parameters(), lr=0.05)
    seen = []
    for step in range(3):
        full[4].on = step == 2
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        opt.zero_grad()
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        sq = torch.stack([p.grad.double().norm() for p in part.parameters()]).pow(2).sum()
        dist.all_reduce(sq)
        seen.append(float(sq.sqrt()))
        opt.step()
    with open(os.path.join(sys.argv[1], f"torch-{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()
