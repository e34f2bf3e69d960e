"""A tiny Lightning training script (no graddbg in it): automatic optimisation, so every
optimizer step is ``step(closure)``, with gradient accumulation 2; its training_step calls
a submodule, never the LightningModule itself. Writes torch's own gradient norms seen in
``on_before_optimizer_step`` (one entry per optimizer step) to the JSON file argv[1]; the
trainer's folder is argv[2]."""
import json
import sys

import lightning.pytorch as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def on_before_optimizer_step(self, optimizer):
        self.seen.append({n: float(p.grad.norm()) for n, p in self.named_parameters()})


if __name__ == "__main__":
    torch.manual_seed(0)
    x = torch.randn(32, 4)
    data = DataLoader(TensorDataset(x, x[:, :1] * 3), batch_size=4)
    module = Tiny()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=sys.argv[2])
    trainer.fit(module, data)
    with open(sys.argv[1], "w") as f:
        json.dump(module.seen, f)
    print("trained", len(module.seen))
