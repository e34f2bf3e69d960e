"""The benchmark models shared by bench/ scripts: each factory returns (model, make_batch, loss_fn).

- mlp8m: an MLP of about 8M parameters, batch 64
- transformer4: 4-layer transformer encoder, d=256, sequence 128, batch 8
- resnet18ish: a ResNet-18-like convnet at 32x32, batch 32
- launchbound: 64 x (Linear(64, 64) + ReLU), batch 16 (about 130 parameter tensors)
"""
from __future__ import annotations

from typing import Callable, Tuple

import torch
from torch import nn
import torch.nn.functional as F

Problem = Tuple[nn.Module, Callable[[], tuple], Callable[..., torch.Tensor]]


def mlp8m() -> Problem:
    model = nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(),
        nn.Linear(2048, 2048), nn.ReLU(),
        nn.Linear(2048, 1024), nn.ReLU(),
        nn.Linear(1024, 10),
    )
    x, y = torch.randn(64, 1024), torch.randint(0, 10, (64,))
    return model, (lambda: (x, y)), (lambda out, y: F.cross_entropy(out, y))


class Transformer(nn.Module):
    def __init__(self, layers: int = 4, d: int = 256, vocab: int = 1000) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, nhead=8, dim_feedforward=4 * d, batch_first=True,
                                           dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def transformer(layers: int = 4) -> Problem:
    model = Transformer(layers)
    x = torch.randint(0, 1000, (8, 128))
    y = torch.randint(0, 1000, (8, 128))
    return model, (lambda: (x, y)), (lambda out, y: F.cross_entropy(out.reshape(-1, 1000), y.reshape(-1)))


def transformer4() -> Problem:
    return transformer(4)


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.shortcut(x)
        return self.relu(out)


class ResNet18ish(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True))
        chans, layers, cin = [64, 128, 256, 512], [], 64
        for i, c in enumerate(chans):
            stride = 1 if i == 0 else 2
            layers.append(nn.Sequential(_Block(cin, c, stride), _Block(c, c, 1)))
            cin = c
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


def resnet18ish() -> Problem:
    model = ResNet18ish()
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    return model, (lambda: (x, y)), (lambda out, y: F.cross_entropy(out, y))


def launchbound() -> Problem:
    layers = []
    for _ in range(64):
        layers += [nn.Linear(64, 64), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(64, 10))
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    return model, (lambda: (x, y)), (lambda out, y: F.cross_entropy(out, y))


MODELS = {"mlp8m": mlp8m, "transformer4": transformer4, "resnet18ish": resnet18ish,
          "launchbound": launchbound}
