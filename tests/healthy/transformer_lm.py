"""pytorch/examples word_language_model/main.py (--model Transformer) in small: embedding
scaled by sqrt(ninp), sinusoidal positional encoding, nn.TransformerEncoder with a causal
mask, decoder, model.zero_grad(), clip_grad_norm_(0.25), the update by hand with lr=20
(p.data.add_(p.grad, alpha=-lr)), no optimizer object. A random corpus of 50 tokens."""
import math

import torch
from torch import nn

torch.manual_seed(0)
torch.set_num_threads(1)
NTOKEN, NINP, NHEAD, NHID, NLAYERS, BPTT, BATCH = 50, 16, 2, 32, 2, 8, 4


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, dropout=0.1, max_len=64):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0).transpose(0, 1))

    def forward(self, x):
        return self.dropout(x + self.pe[:x.size(0), :])


class TransformerModel(nn.Module):
    def __init__(self, dropout=0.2):
        super().__init__()
        self.pos_encoder = PositionalEncoding(NINP, dropout)
        layer = nn.TransformerEncoderLayer(NINP, NHEAD, NHID, dropout)
        self.transformer_encoder = nn.TransformerEncoder(layer, NLAYERS, enable_nested_tensor=False)
        self.encoder = nn.Embedding(NTOKEN, NINP)
        self.decoder = nn.Linear(NINP, NTOKEN)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, src):
        mask = nn.Transformer.generate_square_subsequent_mask(len(src))
        src = self.pos_encoder(self.encoder(src) * math.sqrt(NINP))
        output = self.decoder(self.transformer_encoder(src, mask))
        return nn.functional.log_softmax(output, dim=-1)


ZIPF = 1.0 / torch.arange(1, NTOKEN + 1).float()  # word frequencies follow Zipf's law
corpus = torch.multinomial(ZIPF, (BPTT * 12 + 1) * BATCH, replacement=True).view(-1, BATCH)
model = TransformerModel()
criterion = nn.NLLLoss()
lr, clip = 20.0, 0.25
model.train()
for batch, i in enumerate(range(0, corpus.size(0) - 1, BPTT)):
    data, targets = corpus[i:i + BPTT], corpus[i + 1:i + 1 + BPTT].reshape(-1)
    model.zero_grad()
    output = model(data).view(-1, NTOKEN)
    loss = criterion(output, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-lr)
    print(f"loss {batch} {loss.item():.8e}")
