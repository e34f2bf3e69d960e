"""The loss handed to backward() is recorded (``w.steps["loss"]``): found in the backward call,
summed on the device over the step's backward passes and read back with the step's one
read-back; compared with the values the training loop itself handed to backward()."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import graddbg


def tiny(device="cpu"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(device="cpu"):
    return torch.randn(16, 4, device=device), torch.randn(16, 1, device=device)


def train(model, opt, w, steps=4, k=1, device="cpu"):
    """``steps`` optimizer steps of ``k`` micro-batches each (``loss / k``); returns what the
    loop handed to backward() in each step, summed (read after the step: no effect on graddbg)."""
    handed = []
    for _ in range(steps):
        losses = []
        for _ in range(k):
            x, y = batch(device)
            loss = nn.functional.mse_loss(model(x), y) / k
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
        handed.append(sum(float(t) for t in losses))
    return handed


def test_the_loss_of_each_step_is_the_value_handed_to_backward(device):
    model, opt = tiny(device)
    with graddbg.watch(model, opt) as w:
        handed = train(model, opt, w, device=device)
    assert w.steps["loss"].tolist() == pytest.approx(handed, rel=1e-6)


def test_under_accumulation_the_loss_is_the_sum_of_the_k_values_handed_the_mean_of_the_losses():
    model, opt = tiny()
    with graddbg.watch(model, opt) as w:
        handed = train(model, opt, w, steps=3, k=4)
    assert len(w.steps) == 3
    assert w.steps["loss"].tolist() == pytest.approx(handed, rel=1e-6)


def test_without_an_optimizer_each_backward_pass_is_a_step_with_its_loss():
    model, _ = tiny()
    handed = []
    with graddbg.watch(model) as w:
        for _ in range(3):
            loss = model(batch()[0]).pow(2).mean()
            loss.backward()
            handed.append(loss.item())
    assert w.steps["loss"].tolist() == pytest.approx(handed, rel=1e-6)


def test_the_loss_is_nan_when_backward_gets_a_non_scalar_or_explicit_gradients():
    model, opt = tiny()
    with graddbg.watch(model, opt) as w:
        out = model(batch()[0])
        out.backward(torch.ones_like(out))  # a non-scalar with its gradient
        opt.step(), opt.zero_grad()
        model(batch()[0]).mean().backward(torch.tensor(2.0))  # a scalar, an explicit gradient
        opt.step(), opt.zero_grad()
        loss = model(batch()[0]).mean()
        loss.backward()  # known again
        opt.step(), opt.zero_grad()
    got = w.steps["loss"].tolist()
    assert math.isnan(got[0]) and math.isnan(got[1])
    assert got[2] == pytest.approx(loss.item(), rel=1e-6)


def test_under_a_grad_scaler_the_loss_is_unscaled():
    model, opt = tiny()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    handed = []
    with graddbg.watch(model, opt, scaler=scaler) as w:
        for _ in range(3):
            x, y = batch()
            loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            handed.append(loss.item())
    assert w.steps["loss"].tolist() == pytest.approx(handed, rel=1e-6)


def test_recording_the_loss_adds_no_host_synchronisation(device):
    model, opt = tiny(device)
    with graddbg.watch(model, opt, every=2) as w:
        train(model, opt, w, steps=6, k=2, device=device)
    recorded = w.steps[w.steps["recorded"]]
    assert recorded["loss"].notna().all()
    assert w.host_syncs == 6  # one read-back per step (non-finite checks run every step), none more


def test_plot_loss_draws_the_recorded_losses_next_to_the_lr():
    model, opt = tiny()
    with graddbg.watch(model, opt) as w:
        train(model, opt, w, steps=3)
    fig = w.plot("loss")
    loss_ax, lr_ax = fig.axes
    assert loss_ax.get_lines()[0].get_ydata().tolist() == pytest.approx(w.steps["loss"].tolist())
    assert lr_ax.get_lines()[0].get_ydata().tolist() == pytest.approx([0.05] * 3)


def test_the_loss_column_is_saved_and_loaded_with_the_run(tmp_path):
    model, opt = tiny()
    with graddbg.watch(model, opt) as w:
        train(model, opt, w, steps=3)
    run = graddbg.load(w.save(tmp_path / "run.parquet"))
    assert run.steps["loss"].tolist() == pytest.approx(w.steps["loss"].tolist(), rel=0)
    html = run.report(tmp_path / "report.html").read_text()
    assert 'id="fig-loss"' in html and "loss, last step with one (2)" in html
