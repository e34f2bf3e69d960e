"""The torch.amp recipe with gradient clipping (torch's AMP notes, "working with unscaled
gradients"; what transformers' Trainer and timm do): autocast(bfloat16) forward, a summed
MSE loss,
scaler.scale(loss).backward(), scaler.unscale_(optimizer), clip_grad_norm_(1.0),
scaler.step(optimizer), scaler.update(). The scaler starts at 2**127, so its first steps
overflow and are skipped while the scale backs off, and it grows again every 4 clean steps,
so it skips again now and then (steps 0, 1, 3, 8, 10, 15, 23, 28, 38). AdamW on a small MLP regression."""
import torch
from torch import nn

torch.manual_seed(0)
torch.set_num_threads(1)

model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127, growth_interval=4)
w_true = torch.randn(16, 1)
for step in range(40):
    x = torch.randn(32, 16)
    y = torch.tanh(x @ w_true)
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    loss = nn.functional.mse_loss(out.float(), y, reduction="sum")
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    print(f"loss {step} {loss.item():.8e}")
