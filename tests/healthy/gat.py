"""pytorch/examples gat/main.py in small: a hand-written multi-head graph attention layer
(shared W, attention vector a, LeakyReLU(0.2), masked softmax over a dense adjacency,
dropout), two layers (heads concatenated, then averaged), NLL on the training nodes,
Adam(lr=0.005, weight_decay=5e-4), zero_grad before the forward pass. A random graph."""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
torch.set_num_threads(1)
N, F_IN, HID, C, HEADS = 48, 24, 8, 4, 4


class GraphAttentionLayer(nn.Module):
    def __init__(self, in_features, out_features, n_heads, concat=False, dropout=0.4, slope=0.2):
        super().__init__()
        self.n_heads, self.concat, self.dropout = n_heads, concat, dropout
        self.n_hidden = out_features // n_heads if concat else out_features
        self.W = nn.Parameter(torch.empty(in_features, self.n_hidden * n_heads))
        self.a = nn.Parameter(torch.empty(n_heads, 2 * self.n_hidden, 1))
        self.leakyrelu = nn.LeakyReLU(slope)
        nn.init.xavier_normal_(self.W)
        nn.init.xavier_normal_(self.a)

    def forward(self, h, adj):
        n = h.shape[0]
        g = (h @ self.W).view(n, self.n_heads, self.n_hidden).permute(1, 0, 2)  # heads, n, hid
        src = g @ self.a[:, :self.n_hidden, :]
        dst = g @ self.a[:, self.n_hidden:, :]
        e = self.leakyrelu(src + dst.mT)  # heads, n, n
        e = e.masked_fill(adj[None] == 0, float("-inf"))
        att = F.dropout(F.softmax(e, dim=-1), self.dropout, training=self.training)
        out = att @ g  # heads, n, hid
        if self.concat:
            return out.permute(1, 0, 2).reshape(n, -1)
        return out.mean(dim=0)


class GAT(nn.Module):
    def __init__(self):
        super().__init__()
        self.gat1 = GraphAttentionLayer(F_IN, HID * HEADS, HEADS, concat=True)
        self.gat2 = GraphAttentionLayer(HID * HEADS, C, 1, concat=False)

    def forward(self, x, adj):
        x = F.elu(self.gat1(x, adj))
        return F.log_softmax(self.gat2(x, adj), dim=1)


labels = torch.randint(0, C, (N,))
same = (labels[:, None] == labels[None]).float()
adj = (torch.rand(N, N) < 0.03 + 0.2 * same).float()
adj = ((adj + adj.T + torch.eye(N)) > 0).float()
features = torch.randn(N, F_IN) + F.one_hot(labels, F_IN).float()
idx_train = torch.arange(0, 24)

model = GAT()
optimizer = torch.optim.Adam(model.parameters(), lr=0.005, weight_decay=5e-4)
for epoch in range(20):
    model.train()
    optimizer.zero_grad()
    out = model(features, adj)
    loss = F.nll_loss(out[idx_train], labels[idx_train])
    loss.backward()
    optimizer.step()
    print(f"loss {epoch} {loss.item():.8e}")
