"""A Lightning script (no graddbg in it) with ``strategy="ddp"`` on 2 CPU processes: Lightning
starts the second process itself, running this script again. Each rank writes torch's own
global gradient norm per optimizer step (from ``on_before_optimizer_step``) to
``<argv[1]>/torch-<rank>.json``; the trainer's folder is argv[2]. At step 2 rank 1 writes a
NaN into a gradient (before DDP's reduction has ended: every rank sees it)."""
import json
import os
import sys

import lightning.pytorch as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Tiny(L.LightningModule):
    def __init__(self, nan_at):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.seen, self.nan_at = [], nan_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def on_before_optimizer_step(self, optimizer):
        if self.global_step == self.nan_at and self.global_rank == 1:
            with torch.no_grad():
                self.net[0].weight.grad[0, 0] = float("nan")
        self.seen.append(float(torch.nn.utils.get_total_norm([p.grad for p in self.parameters()])))


if __name__ == "__main__":
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x = torch.randn(32, 4)
    data = DataLoader(TensorDataset(x, x[:, :1] * 3), batch_size=4)
    module = Tiny(nan_at=int(os.environ.get("NAN_AT", "-1")))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=sys.argv[2])
    trainer.fit(module, data)
    with open(os.path.join(sys.argv[1], f"torch-{trainer.global_rank}.json"), "w") as f:
        json.dump(module.seen, f)
    print("trained", trainer.global_rank, len(module.seen))
