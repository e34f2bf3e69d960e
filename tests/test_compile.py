"""watch() under torch.compile: no graph break added, statistics still right."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import graddbg
from graddbg._errors import CompileWarning


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _graphs(model: nn.Module, x: torch.Tensor) -> tuple:
    torch._dynamo.reset()
    e = torch._dynamo.explain(model)(x)
    return e.graph_count, e.graph_break_count


@pytest.mark.parametrize("kw", [{}, {"activations": True}], ids=["default", "activations"])
def test_watch_adds_no_graph_break(kw):
    x = torch.randn(4, 8)
    bare = _graphs(_model(), x)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with graddbg.watch(model, opt, **kw):
        watched = _graphs(model, x)
    torch._dynamo.reset()
    assert bare == (1, 0)
    assert watched == bare


def test_fullgraph_compiled_model_trains_under_watch_with_torch_norms():
    x = torch.randn(4, 8)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch._dynamo.reset()
    seen = []
    try:
        with graddbg.watch(model, opt) as w:
            compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
            for _ in range(3):
                compiled(x).pow(2).mean().backward()
                seen.append({n: p.grad.norm().item() for n, p in model.named_parameters()})
                opt.step()
                opt.zero_grad()
    finally:
        torch._dynamo.reset()
    df = w.stats
    assert sorted(df["step"].unique()) == [0, 1, 2]
    for step, ref in enumerate(seen):
        for name, norm in ref.items():
            got = df.loc[(df.step == step) & (df.name == name), "norm"].item()
            assert got == pytest.approx(norm, rel=1e-6)


def test_activations_of_a_model_called_through_compile_warn_once():
    x = torch.randn(4, 8)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch._dynamo.reset()
    try:
        with pytest.warns(CompileWarning, match="activations=True recorded nothing") as rec:
            with graddbg.watch(model, opt, activations=True) as w:
                compiled = torch.compile(model, backend="aot_eager")
                for _ in range(3):
                    compiled(x).sum().backward()
                    opt.step()
                    opt.zero_grad()
    finally:
        torch._dynamo.reset()
    assert sum("recorded nothing" in str(r.message) for r in rec) == 1
    assert len(w.stats) == 3 * 4
