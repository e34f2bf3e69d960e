"""graddbg.graph on sharded models (issue 19): FSDP2 (``fully_shard``) and tensor parallel,
in real gloo processes on 127.0.0.1.

FSDP2 runs a module's forward on gathered, unsharded copies of its parameters, which
``named_parameters()`` never shows; a traced forward (a callable ``roots``) names them with
the unsharded model's names. A forward run before graph() cannot be named, and is refused
with the fix."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from _dist import run_rank, spawn

WORLD = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))


def _params(g) -> dict:
    return {n.name: list(n.shape) for n in g.nodes if n.kind == "param"}


def _fsdp_case(x: torch.Tensor) -> dict:
    import graddbg
    from torch.distributed.fsdp import fully_shard

    plain = _model()
    rec = {"plain": graddbg.graph(lambda: plain(x).sum(), model=plain).source}
    m = _model()
    fully_shard(m[0])
    fully_shard(m)  # m[0] is resharded after its forward; the root is not
    g = graddbg.graph(lambda: m(x).sum(), model=m)
    rec["source"], rec["params"] = g.source, _params(g)
    try:
        graddbg.graph(m(x).sum(), model=m)
        rec["refused"] = None
    except graddbg.GraddbgError as exc:
        rec["refused"] = [type(exc).__name__, isinstance(exc, ValueError), str(exc)]
    with graddbg.graphviz.trace_modules(m) as tr:
        out = m(x).sum()
    rec["traced"] = _params(graddbg.graph(out, model=tr))
    g = graddbg.graph(lambda: m(x).sum(), model=m, grads=True)
    rec["grad_norms"] = {n.name: n.grad_norm for n in g.nodes if n.kind == "param"}
    rec["grads_after"] = [p.grad is None for p in m.parameters()]
    m(x).sum().backward()  # FSDP still trains after the graphs
    rec["trained"] = [type(p.grad).__name__ for p in m.parameters()]
    return rec


def _tp_case(x: torch.Tensor) -> dict:
    import graddbg
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (WORLD,))
    m = parallelize_module(_model(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return {"params": _params(graddbg.graph(lambda: m(x).sum(), model=m)),
            "precomputed": _params(graddbg.graph(m(x).sum(), model=m))}


def _record() -> dict:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(7))
    return {"fsdp": _fsdp_case(x), "tp": _tp_case(x)}


def _worker(rank: int, port: int, out: str) -> None:
    run_rank(rank, WORLD, port, os.path.join(out, f"rank{rank}.json"), _record)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    """What each of 2 spawned gloo ranks saw (one launch for the whole module)."""
    out = tmp_path_factory.mktemp("graph_sharded")
    return spawn(_worker, WORLD, lambda r, port: (r, port, str(out)), lambda r: out / f"rank{r}.json")


NAMES = {"0.weight": [10, 6], "0.bias": [10], "2.weight": [3, 10], "2.bias": [3]}


@pytest.mark.timeout(300)
def test_fsdp2_forward_is_drawn_with_the_unsharded_names_and_shapes(ranks):
    for rec in ranks.values():
        assert rec["fsdp"]["params"] == NAMES


@pytest.mark.timeout(300)
def test_fsdp2_graph_is_the_unsharded_models_graph_on_every_rank(ranks):
    """Same nodes, edges, names, shapes and clusters, labelled with the user's classes
    (Linear, not fully_shard's FSDPLinear)."""
    for rec in ranks.values():
        assert rec["fsdp"]["source"] == rec["fsdp"]["plain"]


@pytest.mark.timeout(300)
def test_fsdp2_forward_run_before_graph_is_refused_with_the_fix(ranks):
    name, is_value_error, text = ranks[0]["fsdp"]["refused"]
    assert name == "GraddbgValueError" and is_value_error
    assert "fully_shard" in text and "graph(lambda: model(x).sum(), model=model)" in text
    assert "trace_modules(model)" in text


@pytest.mark.timeout(300)
def test_fsdp2_forward_traced_by_hand_is_named(ranks):
    assert ranks[1]["fsdp"]["traced"] == NAMES


@pytest.mark.timeout(300)
def test_fsdp2_grads_true_leaves_grad_alone_and_training_goes_on(ranks):
    for rec in ranks.values():
        f = rec["fsdp"]
        assert set(f["grad_norms"]) == set(NAMES) and all(v > 0 for v in f["grad_norms"].values())
        assert all(f["grads_after"])
        assert f["trained"] == ["DTensor"] * 4  # sharded gradients after a real backward


@pytest.mark.timeout(300)
def test_tensor_parallel_parameters_are_named_traced_or_not(ranks):
    for rec in ranks.values():
        assert rec["tp"]["params"] == NAMES
        assert rec["tp"]["precomputed"] == NAMES
