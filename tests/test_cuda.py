"""CUDA-only checks (skipped cleanly without a GPU): host synchronisations of watch()."""
from __future__ import annotations

import pytest
import torch
from torch import nn
import torch.nn.functional as F

import graddbg
from conftest import requires_cuda


@requires_cuda
def test_steps_between_checks_make_no_host_synchronisation():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 32, device=dev), torch.randn(16, 8, device=dev)
    k = 4
    with graddbg.watch(model, opt, every=k, nonfinite=graddbg.NonFinite(every=k), explode=None,
                       update_every=None) as w:
        for step in range(3 * k):
            due = step % k == 0
            torch.cuda.set_sync_debug_mode("default" if due else "error")
            try:
                F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=False)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    assert w.host_syncs == 3
    assert w.stats["step"].unique().tolist() == [0, k, 2 * k]


@requires_cuda
def test_default_watch_makes_one_synchronisation_per_step_on_cuda():
    dev = torch.device("cuda")
    model = nn.Linear(8, 4).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with graddbg.watch(model, opt, update_every=None) as w:
        for _ in range(5):
            model(torch.randn(2, 8, device=dev)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert w.host_syncs == 5
    assert w.stats["norm"].notna().all()
    assert w.stats["absmax"].notna().all()  # read on every recorded step on a GPU (every 10th on the CPU)


@requires_cuda
def test_huge_gradients_on_cuda_give_finite_norm():
    p = nn.Parameter(torch.zeros(4096, device="cuda"))
    m = nn.Module()
    m.p = p
    with graddbg.watch(m) as w:
        p.grad = torch.full((4096,), 1e20, device="cuda")
        w.step()
    assert w.stats["norm"].iloc[0] == pytest.approx(1e20 * 64, rel=1e-6)
