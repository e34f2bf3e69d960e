"""What every case of the corpus shares: the Case record, tiny models, seeded synthetic data,
parameter snapshots and the manifest helpers.

A case is a buggy training loop and its fixed twin, written the way a user writes them:
``build(seed) -> (model, optimizer, extras)`` makes what the user would hand to
``graddbg.watch(model, optimizer)``; ``loop(model, optimizer, extras, steps) -> result``
trains (``result`` is a dict: ``losses`` at least, and whatever the manifest needs).
Nothing here imports graddbg.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.nn import functional as F

# the finding kinds graddbg's watch may report (issue 31); expected_kinds use these names
KINDS = ("stale_grad", "empty_step", "double_step", "scaled_grad", "orphan_param", "no_update",
         "hidden_param", "foreign_update", "eval_mode", "unused_param", "loss_pattern",
         "dead_grad", "lr_schedule", "nonfinite", "explode", "vanish", "ddp_mismatch",
         # the step audit's kinds (issue 39), named before any of its code was written:
         # - applied_grad: the gradients a step applies differ from the gradients of the losses
         #   handed to backward() since the previous step, beyond what the ledger explains
         #   (GradScaler's unscale, a clip, the data-parallel average)
         # - update_rule: a parameter's change differs from what the optimizer's own rule gives
         #   from those gradients and its state (moved twice, never, by another amount, or by
         #   something other than the step)
         "applied_grad", "update_rule",
         # added after the held-out half's single run (2026-12-03), built on two dev cases
         # (module_requires_grad_attribute_noop, modulelist_of_one_repeated_head):
         # - module_setup: a module whose construction does not do what it says (a
         #   requires_grad attribute that freezes nothing; one module object at several places)
         "module_setup",
         # - optimizer_setup: an optimizer hyperparameter that switches off its own mechanism
         #   (Adam's eps above the gradients; built on the dev case adam_eps_one)
         "optimizer_setup")

# (the optimizer is None for a hand-written update loop: the case is watched as watch(model))
Built = Tuple[nn.Module, Optional[torch.optim.Optimizer], Dict[str, Any]]
Build = Callable[[int], Built]
Loop = Callable[[nn.Module, Optional[torch.optim.Optimizer], Dict[str, Any], int], Dict[str, Any]]
Result = Dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Case:
    """One silent bug: its metadata, the buggy loop and its fixed twin.

    Attributes:
        name: the case's name (a key of ``corpus.CASES`` and of ``split.SPLIT``).
        family: the kind of mistake (the stratum of the split).
        source: the public report(s) it reproduces.
        description: the bug in a user's words.
        expected_kinds: graddbg finding kinds that would correctly name it (empty: none fits).
        params: parameter names (as ``model.named_parameters()`` gives them) a correct finding
            concerns; empty when the finding is about the whole step or loss.
        manifest: ``(buggy_result, fixed_result) -> bool``: the bug manifests and the fix trains.
        build_buggy, loop_buggy: the buggy program; build_fixed, loop_fixed: its twin.
        steps: optimizer steps (or loop iterations) both variants run.
    """

    name: str
    family: str
    source: str
    description: str
    expected_kinds: Tuple[str, ...]
    params: Tuple[str, ...]
    manifest: Callable[[Result, Result], bool]
    build_buggy: Build
    loop_buggy: Loop
    build_fixed: Build
    loop_fixed: Loop
    steps: int = 60

    def variant(self, which: str) -> Tuple[Build, Loop]:
        """The (build, loop) pair of ``which`` ("buggy" or "fixed")."""
        if which == "buggy":
            return self.build_buggy, self.loop_buggy
        if which == "fixed":
            return self.build_fixed, self.loop_fixed
        raise ValueError(f"variant: expected 'buggy' or 'fixed', got {which!r}")

    def run(self, which: str, seed: int = 0) -> Result:
        """Build and run one variant, unwatched."""
        build, loop = self.variant(which)
        model, opt, extras = build(seed)
        return loop(model, opt, extras, self.steps)


# --------------------------------------------------------------------------- data

def classification(seed: int, n: int = 256, d: int = 10, c: int = 4, scale: float = 1.0,
                   prior: Optional[Tuple[float, ...]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels of a fixed teacher: y = argmax(x @ W + prior)."""
    gen = torch.Generator().manual_seed(seed + 1000)
    x = torch.randn(n, d, generator=gen)
    w = torch.randn(d, c, generator=gen)
    logits = x @ w + (torch.tensor(prior) if prior is not None else 0.0)
    return x * scale, logits.argmax(1)


def regression(seed: int, n: int = 256, d: int = 8,
               noise: float = 0.05) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inputs and [n, 1] targets of a smooth teacher."""
    gen = torch.Generator().manual_seed(seed + 2000)
    x = torch.randn(n, d, generator=gen)
    w = torch.randn(d, 1, generator=gen) / math.sqrt(d)
    y = torch.sin(2 * x @ w) + x[:, :1] * 0.5 + noise * torch.randn(n, 1, generator=gen)
    return x, y


def linear_regression(seed: int, n: int = 256, d: int = 8,
                      noise: float = 0.05) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inputs and [n, 1] targets of a linear teacher (a linear model can reach the noise)."""
    gen = torch.Generator().manual_seed(seed + 3000)
    x = torch.randn(n, d, generator=gen)
    w = torch.randn(d, 1, generator=gen) / math.sqrt(d)
    return x, x @ w + noise * torch.randn(n, 1, generator=gen)


def batch(x: torch.Tensor, y: torch.Tensor, i: int, size: int = 32):
    """The i-th mini-batch, walking the fixed data set in order (wraps around)."""
    n = x.shape[0]
    start = (i * size) % n
    idx = torch.arange(start, start + size) % n
    return x[idx], y[idx]


# --------------------------------------------------------------------------- models

def mlp(seed: int, d_in: int = 10, hidden: int = 32, d_out: int = 4) -> nn.Sequential:
    """Linear-ReLU-Linear; parameters 0.weight, 0.bias, 2.weight, 2.bias."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))


MLP = ("0.weight", "0.bias", "2.weight", "2.bias")


# --------------------------------------------------------------------------- results

def snapshot(params: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    """Detached copies, to tell later whether the tensors changed."""
    return [p.detach().clone() for p in params]


def changed(before: List[torch.Tensor], params: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``params`` differs from its snapshot."""
    return any(not torch.equal(b, p.detach()) for b, p in zip(before, params))


def tail(losses: List[float], k: int = 5) -> float:
    """Mean of the last k losses (inf when any is not finite)."""
    last = losses[-k:]
    return sum(last) / len(last) if all(math.isfinite(v) for v in last) else math.inf


def head(losses: List[float], k: int = 3) -> float:
    """Mean of the first k losses."""
    return sum(losses[:k]) / k


def trains(result: Result, drop: float = 0.3, key: str = "losses") -> bool:
    """The run's loss fell by at least ``drop`` (a fraction of its start)."""
    losses = result[key]
    return math.isfinite(tail(losses)) and tail(losses) <= (1 - drop) * head(losses)


def worse(buggy: Result, fixed: Result, ratio: float = 1.5, key: str = "losses") -> bool:
    """The buggy run ends at least ``ratio`` times above the fixed run (or not finite)."""
    return tail(buggy[key]) >= ratio * tail(fixed[key])


def any_nonfinite(values: List[float]) -> bool:
    return any(not math.isfinite(v) for v in values)


def accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return (logits.argmax(1) == y).float().mean().item()


def true_ce(logits: torch.Tensor, y: torch.Tensor) -> float:
    return F.cross_entropy(logits, y).item()


def sgd_build(make: Callable[[int], nn.Module], lr: float = 0.1,
              data: Optional[Callable[[int], Tuple[torch.Tensor, torch.Tensor]]] = None,
              **opt_kwargs: Any) -> Build:
    """A build that makes the model, SGD over all its parameters, and the data set."""
    def build(seed: int) -> Built:
        model = make(seed)
        x, y = (data or classification)(seed)
        return model, torch.optim.SGD(model.parameters(), lr=lr, **opt_kwargs), {"x": x, "y": y}
    return build
