"""Problems as data: small (model, batch, loss) factories shared by the tests."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict

import torch
from torch import nn
import torch.nn.functional as F


@dataclass
class Problem:
    name: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.device], tuple]
    loss: Callable[..., torch.Tensor]


class Residual(nn.Module):
    """``x += shortcut`` and an in-place ReLU: the patterns full backward hooks break."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = nn.ReLU(inplace=True)
        self.skip = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        out += self.skip(x)
        return self.act(out)


class ResNetLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.Sequential(Residual(), Residual())
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


class TupleDictOut(nn.Module):
    """Returns a dict holding a tuple: outputs graddbg must walk."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> Dict[str, object]:
        h = torch.tanh(self.a(x))
        return {"logits": self.b(h), "aux": (h, torch.zeros(1, dtype=torch.long))}


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(device: torch.device, n: int = 8) -> tuple:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, 4, generator=g).to(device), torch.randint(0, 3, (n,), generator=g).to(device))


PROBLEMS = {
    "mlp": Problem("mlp", _mlp, _batch, lambda out, y: F.cross_entropy(out, y)),
    "resnetlike": Problem("resnetlike", ResNetLike, _batch, lambda out, y: F.cross_entropy(out, y)),
    "dictout": Problem("dictout", TupleDictOut, _batch,
                       lambda out, y: F.cross_entropy(out["logits"], y[:].clamp(max=1))),
}


def hook_counts(model: nn.Module) -> Dict[str, int]:
    """Every hook dict on every module and parameter, counted."""
    counts: Dict[str, int] = {}
    for name, m in model.named_modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                     "_state_dict_hooks", "_load_state_dict_pre_hooks"):
            counts[f"{name}:{attr}"] = len(getattr(m, attr, {}) or {})
    for name, p in model.named_parameters():
        counts[f"{name}:_backward_hooks"] = len(p._backward_hooks or {})
        counts[f"{name}:_post_accumulate_grad_hooks"] = len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
    return counts


def optimizer_hook_counts(opt: torch.optim.Optimizer) -> tuple:
    return len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)
