"""Adam's early growth: a deep-ish MLP initialised small (std 1e-3, the zero-ish init of
residual branches and output heads), so the first gradients are tiny products of small
weights; Adam moves every weight by about lr per step whatever the gradient's size, so the
gradient norm grows more than tenfold over the first steps, as in every fine-tuning
or warm-started run. Healthy: the loss goes down."""
import torch
from torch import nn

torch.manual_seed(0)
torch.set_num_threads(1)

model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1, bias=False))
for m in model:
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=1e-3)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
w_true = torch.randn(8, 1)
for step in range(30):
    x = torch.randn(64, 8)
    y = x @ w_true
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    print(f"loss {step} {loss.item():.8e}")
