"""The update/weight ratio's copies of the weights stay within one memory budget
(``copy_budget=``, `graddbg.checks.budget.WeightBudget`): at most the budget plus one
parameter per step, every parameter in its turn, the measured ratios equal to a naive
reference, and no memory for the copy (on the CPU too) a warning while training goes on."""
from __future__ import annotations

import contextlib
import math
import warnings
import weakref

import numpy as np
import pytest
import torch
from torch import nn

import graddbg
from graddbg.checks import UpdateRatio
from graddbg.checks import budget as budget_module
from graddbg.checks.budget import WeightBudget

#: ten parameters of different sizes (float32 elements), 13 MB in all: the largest (4.8 MB)
#: is larger than 10% of them (1.3 MB) and is measured alone on its turn
SIZES = [1_200_000, 10, 600_000, 400_000, 50_000, 300_000, 250_000, 200_000, 150_000, 100_000]
#: the same at 1/100 (tests of the rotation: with the 1 MiB below which weights are copied
#: whole set to 0, ``small``)
SMALL = [max(n // 100, 1) for n in SIZES]


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(budget_module, "ALWAYS_BYTES", 0)
    return SMALL


class Ten(nn.Module):
    def __init__(self, sizes) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(n)) for n in sizes])

    def forward(self) -> torch.Tensor:
        return sum(((p - 1) ** 2).mean() for p in self.ps)


def train(sizes, steps: int, opt_cls=torch.optim.SGD, watched: bool = True, **watch_kw):
    """Train Ten, under watch(update_every=1, **watch_kw) or not; the watch, the losses and,
    for each step, each parameter's ||w_new - w_old|| / ||w_old|| computed here."""
    torch.manual_seed(0)
    model = Ten(sizes)
    opt = opt_cls(model.parameters(), lr=0.1)
    losses, moves = [], []
    w = graddbg.watch(model, opt, update_every=1, **watch_kw) if watched else contextlib.nullcontext()
    with w:
        for _ in range(steps):
            loss = model()
            loss.backward()
            before = [p.detach().clone() for p in model.ps]
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            moves.append([((p.detach() - b).norm() / b.norm()).item() for p, b in zip(model.ps, before)])
    return w, losses, moves


def measured(w) -> np.ndarray:
    """[steps, P] whether each parameter's update ratio was measured at each step."""
    wide = w.stats.pivot_table(index="step", columns="name", values="update_ratio", aggfunc="first", dropna=False,
                               observed=False)
    return wide[[f"ps.{i}" for i in range(len(SIZES))]].notna().to_numpy()


def test_copies_held_over_a_step_are_at_most_the_budget_plus_one_parameter(monkeypatch):
    live: list = []          # weak references to the copies the update ratio took
    copy = UpdateRatio.copy_weights

    def tracked(params):
        out = copy(params)
        live.extend(weakref.ref(t) for t in out)
        return out

    monkeypatch.setattr(UpdateRatio, "copy_weights", staticmethod(tracked))
    held = []                # bytes of the copies alive just before / after each optimizer step

    def held_now(*_):
        held.append(sum(t.nbytes for t in (r() for r in live) if t is not None))

    torch.manual_seed(0)
    model = Ten(SIZES)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with graddbg.watch(model, opt, update_every=1) as w:   # the default budget: 10%
        opt.register_step_pre_hook(held_now)              # (after the watch's own hooks)
        opt.register_step_post_hook(held_now)
        for _ in range(7):                                # (one turn of every parameter)
            model().backward()
            opt.step()
            opt.zero_grad()
    before, after = held[0::2], held[1::2]
    total, largest = 4 * sum(SIZES), 4 * max(SIZES)
    assert max(before) <= 0.1 * total + largest
    assert max(before) >= largest                         # (the largest was copied, alone, on its turn)
    assert after == [0] * len(after)                      # nothing held once the step is done
    assert measured(w).any(axis=0).all()                  # and every parameter had its turn


def test_every_parameter_is_measured_within_k_measured_steps(small):
    w, _, _ = train(small, 20, copy_budget=0.1)
    seen = measured(w)
    k = 11                                                # 1 / copy_budget, and one for the largest alone
    for j in range(len(SIZES)):
        steps = np.flatnonzero(seen[:, j])
        gaps = np.diff(np.concatenate([[-1], steps, [len(seen)]]))
        assert gaps.max() <= k, (SIZES[j], steps)
    bytes_per_step = seen.astype(float) @ (4 * np.array(small, dtype=float))
    total, largest = 4 * sum(small), 4 * max(small)
    assert (bytes_per_step <= 0.1 * total + largest).all() and (bytes_per_step < total).all()


def test_measured_ratios_equal_a_naive_reference_and_the_others_are_nan(small):
    with warnings.catch_warnings():
        warnings.simplefilter("error", graddbg.GraddbgWarning)    # healthy: nothing to say
        w, _, moves = train(small, 6, torch.optim.Adam, copy_budget=0.2)
    assert not w.anomalies
    ratios = w.stats.pivot_table(index="step", columns="name", values="update_ratio", aggfunc="first",
                                 dropna=False, observed=False)[[f"ps.{i}" for i in range(len(SIZES))]].to_numpy()
    got = ~np.isnan(ratios)
    assert got.any(axis=1).all() and not got.all(axis=1).any()   # some measured each step, never all
    np.testing.assert_allclose(ratios[got], np.array(moves)[got], rtol=1e-5)
    means = w.summary().set_index("name")["update_ratio_mean"]
    assert means.notna().all()                            # each parameter has had its turn


def test_a_budget_of_one_copies_every_weight_every_measured_step(small):
    w, _, _ = train(small, 2, copy_budget=1.0)
    assert measured(w).all()


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                 "tried to allocate 4800000 bytes. Error code 12 (Cannot allocate memory)"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:83] . DefaultCPUAllocator: not enough memory: you tried to "
                 "allocate 4800000 bytes."),
    MemoryError(),
], ids=["cpu-allocator", "cpu-not-enough", "MemoryError"])
def test_no_memory_on_the_cpu_for_the_copy_warns_once_and_training_goes_on(monkeypatch, small, error):
    _, reference, _ = train(small, 4, watched=False)
    calls = []

    def no_memory(params):
        calls.append(len(params))
        raise error

    monkeypatch.setattr(UpdateRatio, "copy_weights", staticmethod(no_memory))
    with pytest.warns(graddbg.GraddbgWarning) as rec:
        w, losses, _ = train(small, 4)
    messages = [str(r.message) for r in rec]
    assert sum("no memory for the copy" in m and "training goes on" in m for m in messages) == 1, messages
    assert not any("internal error" in m for m in messages)
    assert len(calls) == 1                                # asked once, then switched off
    assert losses == reference                            # the same training as unwatched
    assert w.stats["update_ratio"].isna().all() and w.stats["norm"].notna().all()


@pytest.mark.parametrize("value", [0, -0.1, 1.5, math.nan, "0.1", True])
def test_copy_budget_must_be_a_fraction(value):
    with pytest.raises((ValueError, TypeError), match=r"^watch\(copy_budget=\.\.\.\): got .*accepted: a fraction "
                                                      r"in \(0, 1\]"):
        graddbg.watch(nn.Linear(2, 2), copy_budget=value)


def test_the_budget_is_shared_by_the_copies_of_one_step():
    budget = WeightBudget(0.25, always=0)
    sizes = [10, 60, 20, 5, 5]                            # 100 bytes: 25 per step
    assert budget.grant(3, sizes, [0, 2, 3]) == [0, 3]    # 15 of 25
    assert budget.grant(3, sizes, [4, 2]) == [4]          # a second check: what is left, 10
    assert budget.grant(4, sizes, [1, 0]) == [1]          # larger than the budget: alone
    assert budget.peak == 60
