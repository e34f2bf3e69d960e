"""pytorch/examples word_language_model's default loop in small: no torch.optim optimizer,
the update by hand (``p.data.add_(p.grad, alpha=-lr)``) after clipping. Writes torch's own
gradient norms (before clipping) of every backward pass to the JSON file argv[1]."""
import json
import sys

import torch
from torch import nn


class RNNModel(nn.Module):
    def __init__(self, ntoken=20, ninp=8, nhid=8):
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid)
        self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, x, hidden):
        out, hidden = self.rnn(self.encoder(x), hidden)
        return nn.functional.log_softmax(self.decoder(out), dim=-1), hidden


torch.manual_seed(0)
model = RNNModel()
criterion = nn.NLLLoss()
lr, seen = 0.5, []
hidden = (torch.zeros(1, 4, 8), torch.zeros(1, 4, 8))
for batch in range(5):
    data, target = torch.randint(0, 20, (6, 4)), torch.randint(0, 20, (6 * 4,))
    hidden = tuple(h.detach() for h in hidden)
    model.zero_grad()
    output, hidden = model(data, hidden)
    loss = criterion(output.view(-1, 20), target)
    loss.backward()
    seen.append({n: float(p.grad.norm()) for n, p in model.named_parameters()})
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-lr)
with torch.no_grad():  # an evaluation pass: no step
    model(data, hidden)
with open(sys.argv[1], "w") as f:
    json.dump(seen, f)
print("trained", len(seen))
