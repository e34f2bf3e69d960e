"""The demo tells its two faults (issue "Where users already look", point 4): the 0/0 NaN with
its op and line, drawn at its step with the node that made it marked, and the learning-rate
spike named as the cause of the explosion that follows it, one finding per fault. The
explosion detector's cause, on small loops with healthy twins: an lr rise to a new level is
named; a warm restart (the program's own schedule) and an lr rise the norm does not follow
give no finding."""
from __future__ import annotations

import html
import io
import re

import pytest
import torch
from torch import nn

import graddbg
from graddbg import cli
from graddbg._demo_model import RowNorm


# --------------------------------------------------------------------------- the demo
@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "out"
    stream = io.StringIO()
    res = cli.demo(str(out), stream=stream)
    res["stdout"] = stream.getvalue()
    return res


@pytest.mark.slow
def test_demo_gives_one_finding_per_fault(demo):
    w = demo["watch"]
    assert [a.kind for a in w.anomalies] == ["nonfinite", "explode"]
    nan, boom = w.anomalies

    # the 0/0: its op and its line in the demo's model, and a parameter column that agrees
    import inspect
    src, start = inspect.getsourcelines(RowNorm.forward)
    line = start + next(i for i, s in enumerate(src) if "x / x.norm" in s)
    assert (nan.step, nan.module, nan.op) == (30, "norm", "aten.div")
    assert nan.source.endswith(f"graddbg/_demo_model.py:{line}")
    assert nan.name == "hidden.weight"  # the affected parameter nearest the norm (it has none)
    assert "'norm' holds none of these parameters: hidden.weight is the one nearest it" in nan.message

    # the lr spike: named as the cause of the explosion, once, with no parameter blamed
    assert boom.step == 81 and boom.name is None and boom.module is None
    assert "the lr of group 0 rose 1000x at step 80, the step before (0.05 -> 50)" in boom.message
    assert "rose 1000x at step 80" in demo["stdout"]


@pytest.mark.slow
def test_demo_graph_is_drawn_at_the_nan_step_with_its_producer_marked(demo):
    dot = demo["graph"].source
    marked = [line for line in dot.splitlines() if 'penwidth="4"' in line]
    assert len(marked) == 1 and "DivBackward0" in marked[0] and "made the NaN at step 30" in marked[0]
    assert 'color="#ff9800"' in marked[0]
    caption = re.search(r'graph \[label="([^"]*)" labelloc=t', dot)
    assert caption and "step 30" in caption.group(1) and "aten.div in module 'norm'" in caption.group(1)
    assert "non-finite" in dot  # drawn on the NaN's batch: its gradients are NaN
    assert "(origin)" not in dot  # (made in the forward pass: the loss's backward node did not start it)

    svg = demo["files"]["graph"].read_text(encoding="utf-8")
    assert "made the NaN at step 30" in svg and 'stroke="#ff9800"' in svg and "step 30, the step of the NaN" in svg


@pytest.mark.slow
def test_demo_report_has_one_row_per_fault(demo):
    text = demo["files"]["report"].read_text(encoding="utf-8")
    table = re.search(r'<table class="anomalies">.*?</table>', text, re.S).group(0)
    rows = re.findall(r"<tr class=\"bad\">(.*?)</tr>", table, re.S)
    assert len(rows) == 2
    cells = [[html.unescape(re.sub("<[^>]+>", "", c)) for c in re.findall(r"<td[^>]*>(.*?)</td>", r, re.S)]
             for r in rows]
    assert cells[0][:5] == ["30", "nonfinite", "hidden.weight", "norm", "aten.div"]
    assert cells[1][:3] == ["81", "explode", ""] and "rose 1000x at step 80" in cells[1][8]
    assert "step 30, the step of the NaN" in text  # the graph's caption, in the embedded SVG


# --------------------------------------------------------------------------- explosion causes
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _regression(spike=None, rise=None, steps=60, at=40):
    """SGD on a small regression; ``spike``: the lr times that for one step at ``at``;
    ``rise``: the lr times that from ``at`` on."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(0)
    with graddbg.watch(model, opt, explode="record") as w:
        for i in range(steps):
            x = torch.randn(32, 8, generator=gen)
            y = torch.tanh(x.sum(1, keepdim=True))
            if spike and i in (at, at + 1):
                opt.param_groups[0]["lr"] = 0.05 * spike if i == at else 0.05
            if rise and i == at:
                opt.param_groups[0]["lr"] *= rise
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
    return [a for a in w.anomalies if a.kind == "explode"]


def test_lr_spike_is_named_once_as_the_cause_of_the_explosion():
    found = _regression(spike=1000)
    assert len(found) == 1  # the episodes after it are its aftermath, not new findings
    a = found[0]
    assert a.step == 41 and a.name is None and a.module is None
    assert "after a learning-rate change: the lr of group 0 rose 1000x at step 40, the step before" in a.message
    assert a.params and all(p in {n for n, _ in _mlp().named_parameters()} for p in a.params)
    # healthy twins: no spike; an lr that rises 10x for good while the norm does not explode
    assert _regression() == []
    assert _regression(rise=10) == []


def test_warm_restarts_give_no_explosion_finding():
    # Adam's steps grow back with each warm restart of the lr (to the level it started at):
    # the gradient norm jumps 30x over the settled end of the cycle. The program's own schedule.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=50)
    x = torch.randn(256, 8)
    y = torch.sin(x.sum(1, keepdim=True))
    with graddbg.watch(model, opt, explode="record") as w:
        for _ in range(120):
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    assert max(w.steps.global_norm[100:110]) > 20 * w.steps.global_norm[90:100].median()  # the jump is there
    assert [a for a in w.anomalies if a.kind == "explode"] == []


def test_parameters_without_gradient_never_rank_among_those_that_jumped():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 1)
            self.b = nn.Linear(4, 1)  # used on even steps only: no gradient on odd ones

        def forward(self, x, use_b):
            return self.a(x) + (self.b(x) if use_b else 0.0)

    torch.manual_seed(0)
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with graddbg.watch(model, opt, explode="record", unused_param=None) as w:
        for i in range(15):
            loss = model(torch.randn(8, 4), use_b=i % 2 == 0).pow(2).mean()
            (loss * (1e4 if i == 14 else 1.0)).backward()  # an explosion at step 14, no lr change
            opt.step()
            opt.zero_grad()
    found = [a for a in w.anomalies if a.kind == "explode"]
    assert [a.step for a in found] == [14]
    assert set(found[0].params) == {"a.weight", "a.bias"}  # b had no gradient at step 13
    assert found[0].name == "a.weight" and "b.weight" not in found[0].message
