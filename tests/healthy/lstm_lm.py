"""pytorch/examples word_language_model/main.py (--model LSTM) in small: embedding, 2-layer
LSTM with dropout, decoder, hidden state repackaged (detached) per bptt chunk,
model.zero_grad(), clip_grad_norm_(0.25), the update by hand with lr=20
(p.data.add_(p.grad, alpha=-lr)), no optimizer object. A random corpus of 50 tokens."""
import torch
from torch import nn

torch.manual_seed(0)
torch.set_num_threads(1)
NTOKEN, EMSIZE, NHID, NLAYERS, BPTT, BATCH = 50, 16, 16, 2, 8, 4


class RNNModel(nn.Module):
    def __init__(self, dropout=0.2):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(NTOKEN, EMSIZE)
        self.rnn = nn.LSTM(EMSIZE, NHID, NLAYERS, dropout=dropout)
        self.decoder = nn.Linear(NHID, NTOKEN)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, inp, hidden):
        emb = self.drop(self.encoder(inp))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output)).view(-1, NTOKEN)
        return nn.functional.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        return (torch.zeros(NLAYERS, bsz, NHID), torch.zeros(NLAYERS, bsz, NHID))


def repackage_hidden(h):
    return tuple(v.detach() for v in h)


ZIPF = 1.0 / torch.arange(1, NTOKEN + 1).float()  # word frequencies follow Zipf's law
corpus = torch.multinomial(ZIPF, (BPTT * 12 + 1) * BATCH, replacement=True).view(-1, BATCH)
model = RNNModel()
criterion = nn.NLLLoss()
lr, clip = 20.0, 0.25
model.train()
hidden = model.init_hidden(BATCH)
for batch, i in enumerate(range(0, corpus.size(0) - 1, BPTT)):
    data, targets = corpus[i:i + BPTT], corpus[i + 1:i + 1 + BPTT].reshape(-1)
    hidden = repackage_hidden(hidden)
    model.zero_grad()
    output, hidden = model(data, hidden)
    loss = criterion(output, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-lr)
    print(f"loss {batch} {loss.item():.8e}")
