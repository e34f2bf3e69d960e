"""The torch.amp fp16 recipe (autocast + GradScaler, as in the AMP examples and every large
training script) on the CPU: torch.autocast("cpu", dtype=torch.float16) around the forward
pass, scaler.scale(loss).backward(), scaler.step(optimizer), scaler.update(). The scaler
starts at 2**24, so its first 6 steps overflow (float16 gradients) and are skipped while the
scale backs off, and it grows again every 4 clean steps, so it overflows and skips again now
and then (steps 0-5, 8, 10, 11, 23, 28, 38), as long real AMP runs do. AdamW on a small
MLP regression."""
import torch
from torch import nn

torch.manual_seed(0)
torch.set_num_threads(1)

model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=4)
w_true = torch.randn(16, 1)
for step in range(40):
    x = torch.randn(32, 16)
    y = torch.tanh(x @ w_true)
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    loss = nn.functional.mse_loss(out.float(), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    print(f"loss {step} {loss.item():.8e}")
