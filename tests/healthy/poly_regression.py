"""pytorch/examples regression/main.py, seeded and capped: a Linear over the features
[x, x^2, x^3, x^4] of a random normal x (so batches are heavy-tailed: a batch with one
large x has a gradient many times the median), smooth-L1 loss, fc.zero_grad(), the update
by hand (param.data.add_(-0.1 * param.grad)), no optimizer object; stops when the loss is
under 1e-3 (286 batches with this seed) or after 400."""
import torch
import torch.nn.functional as F

torch.manual_seed(1)
torch.set_num_threads(1)
POLY_DEGREE = 4
W_target = torch.randn(POLY_DEGREE, 1) * 5
b_target = torch.randn(1) * 5


def make_features(x):
    x = x.unsqueeze(1)
    return torch.cat([x ** i for i in range(1, POLY_DEGREE + 1)], 1)


def f(x):
    return x.mm(W_target) + b_target.item()


def get_batch(batch_size=32):
    random = torch.randn(batch_size)
    x = make_features(random)
    return x, f(x)


fc = torch.nn.Linear(W_target.size(0), 1)
for batch_idx in range(400):
    batch_x, batch_y = get_batch()
    fc.zero_grad()
    output = F.smooth_l1_loss(fc(batch_x), batch_y)
    loss = output.item()
    output.backward()
    for param in fc.parameters():
        param.data.add_(-0.1 * param.grad)
    print(f"loss {batch_idx} {loss:.8e}")
    if loss < 1e-3:
        break
