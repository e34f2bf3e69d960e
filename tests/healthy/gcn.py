"""pytorch/examples gcn/main.py in small: two hand-written graph convolutions over a dense,
symmetrically normalised adjacency (D^-1/2 (A + I) D^-1/2), dropout, log_softmax + NLL on the
training nodes, Adam(lr=0.01, weight_decay=5e-4), zero_grad before the forward pass. A random
graph of 64 nodes with planted classes instead of Cora."""
import math

import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
torch.set_num_threads(1)
N, F_IN, HID, C = 64, 32, 16, 4


class GraphConv(nn.Module):
    def __init__(self, input_dim, output_dim, use_bias=True):
        super().__init__()
        self.kernel = nn.Parameter(torch.empty(input_dim, output_dim))
        nn.init.kaiming_normal_(self.kernel)
        self.bias = nn.Parameter(torch.zeros(output_dim)) if use_bias else None

    def forward(self, x, adj):
        out = adj @ (x @ self.kernel)
        return out + self.bias if self.bias is not None else out


class GCN(nn.Module):
    def __init__(self, dropout=0.5):
        super().__init__()
        self.gc1 = GraphConv(F_IN, HID)
        self.gc2 = GraphConv(HID, C)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, adj):
        x = self.dropout(x)
        x = F.relu(self.gc1(x, adj))
        x = self.dropout(x)
        return F.log_softmax(self.gc2(x, adj), dim=1)


labels = torch.randint(0, C, (N,))
same = (labels[:, None] == labels[None]).float()
adj = (torch.rand(N, N) < 0.02 + 0.15 * same).float()
adj = ((adj + adj.T) > 0).float() + torch.eye(N)
d = adj.sum(1).pow(-0.5)
adj = d[:, None] * adj * d[None]
features = torch.randn(N, F_IN) + F.one_hot(labels, F_IN).float() * 2
features = features / features.sum(1, keepdim=True).abs().clamp_min(1.0)
idx_train = torch.arange(0, 32)

model = GCN()
optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
for epoch in range(30):
    model.train()
    optimizer.zero_grad()
    output = model(features, adj)
    loss = F.nll_loss(output[idx_train], labels[idx_train])
    loss.backward()
    optimizer.step()
    print(f"loss {epoch} {loss.item():.8e}")
