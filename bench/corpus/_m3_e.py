"""Helpers the third corpus's 'data' cases (bench/corpus/mech3/data.py) share: seeded
synthetic data sets and tiny models, with no bug in them."""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


def eval_ce_acc(model, x, y):
    """Cross-entropy and accuracy of ``model`` on (x, y), without gradients."""
    with torch.no_grad():
        logits = model(x)
        return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def noisy_sine_series(seed: int, n: int = 400, period: float = 7.0, noise: float = 0.05):
    """A float32 series: a sine of ``period`` steps with a slowly drifting phase and noise."""
    gen = np.random.default_rng(seed + 4000)
    t = np.arange(n, dtype=np.float64)
    phase = np.cumsum(gen.normal(0.0, 0.05, n))
    return (np.sin(2 * math.pi * t / period + phase) + noise * gen.normal(size=n)).astype(np.float32)


def shift(a: np.ndarray, periods: int) -> np.ndarray:
    """``a`` moved by ``periods`` places, the vacated places NaN (as pandas' Series.shift)."""
    out = np.full_like(a, np.nan)
    if periods > 0:
        out[periods:] = a[:-periods]
    elif periods < 0:
        out[:periods] = a[-periods:]
    else:
        out[:] = a
    return out


def windows(series: np.ndarray, target: np.ndarray, k: int):
    """Rows of the last ``k`` values of ``series`` and their targets; rows with a NaN are
    dropped (dropna)."""
    xs, ys = [], []
    for t in range(k - 1, len(series)):
        row, y = series[t - k + 1:t + 1], target[t]
        if not np.isnan(y):
            xs.append(row)
            ys.append(y)
    return torch.tensor(np.stack(xs)), torch.tensor(np.array(ys, dtype=np.float32))[:, None]


def markov_tokens(seed: int, draw: int = 0, vocab: int = 16, n_seq: int = 64, length: int = 12,
                  p: float = 0.9):
    """Token sequences of a Markov chain (its transitions fixed by ``seed``; ``draw`` picks
    another sample of it): the next token is perm[token] with probability p, else uniform."""
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed + 5000))
    gen = torch.Generator().manual_seed(seed + 6000 + 100 * draw)
    seqs = torch.empty(n_seq, length, dtype=torch.long)
    seqs[:, 0] = torch.randint(vocab, (n_seq,), generator=gen)
    for t in range(1, length):
        keep = torch.rand(n_seq, generator=gen) < p
        rand = torch.randint(vocab, (n_seq,), generator=gen)
        seqs[:, t] = torch.where(keep, perm[seqs[:, t - 1]], rand)
    return seqs


class TinyCausalLM(nn.Module):
    """A bigram language model whose forward(input_ids, labels) shifts the labels itself, as
    the causal LM heads of model libraries do ('labels = input_ids' is what they expect)."""

    def __init__(self, vocab: int = 16, d: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, input_ids, labels=None):
        logits = self.lm_head(torch.tanh(self.embed(input_ids)))
        loss = None
        if labels is not None:
            # shift so that tokens < n predict n
            shift_logits = logits[:, :-1, :].contiguous()
            shift_labels = labels[:, 1:].contiguous()
            loss = F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)),
                                   shift_labels.view(-1))
        return logits, loss
