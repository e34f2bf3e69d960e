"""Tests of graddbg.graphviz: extract (plain graph), emit (DOT text), render (dot).

Golden DOT files live in tests/goldens/graph/; rewrite them with
``GRADDBG_UPDATE_GOLDENS=1 pytest tests/test_graphviz.py``.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import pathlib
import re
import shutil
import sys
import xml.etree.ElementTree as ET

import pytest
import torch
from torch import nn

import graddbg
from graddbg._errors import DotNotFoundError, GraddbgError, GraddbgTypeError, GraddbgValueError
from graddbg.graphviz import escape, extract, graph, render_source, trace_modules

GOLDENS = pathlib.Path(__file__).parent / "goldens" / "graph"
UPDATE = os.environ.get("GRADDBG_UPDATE_GOLDENS") == "1"
HAS_DOT = shutil.which("dot") is not None
needs_dot = pytest.mark.skipif(not HAS_DOT, reason="needs the graphviz dot program")


def check_golden(name: str, text: str) -> None:
    path = GOLDENS / f"{name}.dot"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing golden {path}; run with GRADDBG_UPDATE_GOLDENS=1"
    assert text == path.read_text(), f"DOT differs from golden {path.name}"


# ---------------------------------------------------------------- small problems


class TwoModules(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(3, 4)
        self.dec = nn.Sequential(nn.Linear(4, 2), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(torch.relu(self.enc(x)))


def two_modules_graph(**kw):
    torch.manual_seed(0)
    model = TwoModules()
    x = torch.randn(5, 3)
    return model, graph(lambda: model(x).pow(2).sum(), model=model, **kw)


def svg_texts(svg: str) -> list:
    root = ET.fromstring(svg)  # raises on invalid XML
    return [t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text")]


# ---------------------------------------------------------------- extract


def test_extract_restores_gc_state():
    import gc
    y = torch.ones(2, requires_grad=True).exp().sum()
    extract(y)
    assert gc.isenabled()
    gc.disable()
    try:
        extract(y)
        assert not gc.isenabled()
    finally:
        gc.enable()


class _Marker:
    pass


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, marker):
        ctx.marker = marker  # lives exactly as long as the autograd node
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, None


def test_graph_keeps_no_autograd_nodes_or_tensors():
    import gc
    import weakref
    x = torch.randn(3, requires_grad=True)
    marker = _Marker()
    ref = weakref.ref(marker)
    y = _Double.apply(x, marker).sum()
    del marker
    g = graph(y, grads=True)
    assert ref() is not None  # y still holds the graph
    del y
    gc.collect()
    assert ref() is None, "the Graph keeps the autograd graph alive"
    assert [n.name for n in g.nodes] == ["output", "SumBackward0", "_DoubleBackward", "input"]
    assert g.nodes[2].grad_norm == pytest.approx(2 * 3 ** 0.5)


def test_extract_small_graph_structure():
    x = torch.ones(3, requires_grad=True)
    w = torch.ones(3, requires_grad=True)
    y = (x * w).sum()
    g = extract(y, params={"w": w})
    assert [(n.id, n.kind, n.name) for n in g.nodes] == [
        ("n0", "output", "output"), ("n1", "op", "SumBackward0"), ("n2", "op", "MulBackward0"),
        ("n3", "input", "input"), ("n4", "param", "w")]
    assert {(e.src, e.dst) for e in g.edges} == {("n1", "n0"), ("n2", "n1"), ("n3", "n2"), ("n4", "n2")}
    assert g.node("n4").shape == (3,)


def test_extract_matches_naive_recursive_walk():
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1))
    y = model(torch.randn(2, 4)).sum()
    ops = collections.Counter()
    seen = set()

    def walk(fn):  # naive reference, small graph
        if fn is None or fn in seen:
            return
        seen.add(fn)
        if not hasattr(fn, "variable"):
            ops[type(fn).__name__] += 1
        for u, _ in fn.next_functions:
            walk(u)
    walk(y.grad_fn)
    g = extract(y, model=model)
    assert collections.Counter(n.name for n in g.by_kind("op")) == ops
    assert sorted(n.name for n in g.by_kind("param")) == sorted(n for n, _ in model.named_parameters())


def test_identical_output_on_two_runs():
    _, g1 = two_modules_graph(grads=True)
    _, g2 = two_modules_graph(grads=True)
    assert g1.source == g2.source
    assert [n.id for n in g1.nodes] == [n.id for n in g2.nodes]


def test_long_chain_has_no_recursion_error():
    x = torch.ones(2, requires_grad=True)
    y = x
    for _ in range(5000):
        y = y * 1.0001
    g = graph(y.sum(), max_nodes=None)
    assert len(g.extracted.by_kind("op")) == 5001
    assert g.source.count(" -> ") == 5002
    assert not g.extracted.truncated


def test_max_nodes_truncates_with_visible_note():
    x = torch.ones(2, requires_grad=True)
    y = x
    for _ in range(50):
        y = y + 1
    g = graph(y.sum(), max_nodes=10)
    assert len(g.nodes) == 10
    assert g.extracted.total_nodes == 53  # output + Sum + 50 Add + leaf
    assert g.extracted.truncated
    assert "graph truncated: showing 10 of 53 nodes (max_nodes=10)" in g.source


def test_walk_stops_at_walk_limit_whatever_max_nodes(monkeypatch):
    monkeypatch.setattr(graddbg.graphviz, "WALK_LIMIT", 20)
    x = torch.ones(2, requires_grad=True)
    y = x
    for _ in range(50):
        y = y + 1
    g = graph(y.sum(), max_nodes=None)
    assert g.extracted.walk_stopped and g.extracted.truncated
    assert len(g.extracted.by_kind("op")) == 20  # Sum + 19 Add: the walk's 20 autograd nodes
    assert g.extracted.total_nodes == 21  # and the output
    assert ("graph truncated: showing 21 of more than 21 nodes (max_nodes=None; "
            "the walk stops after 20 autograd nodes)") in g.source
    assert "truncated from more than 21" in repr(g)
    small = graph(y.sum(), max_nodes=5)  # max_nodes under the limit: drawn nodes as before
    assert len(small.nodes) == 5 and small.extracted.walk_stopped


DEEP_CHAIN = """
import sys, torch, graddbg
x = torch.ones(2, requires_grad=True)
y = x
for _ in range(100_000):
    y = y.sin()
for kw in ({}, {"max_nodes": None}):
    g = graddbg.graph(y, **kw)
    print(repr(g), g.extracted.truncated, "graph truncated" in g.source)
try:
    graddbg.graph(y, style="torchviz")
except ValueError as e:
    print("torchviz:", e)
del g, y
print("freed", flush=True)
"""


def test_deep_chain_graph_exits_cleanly():
    # torch alone frees a 100,000-node chain fine (its iterative deleter); a walk that gave
    # every node a Python wrapper made that deletion recursive: SIGSEGV at ~45,000 nodes
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", DEEP_CHAIN], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    lines = proc.stdout.splitlines()
    assert lines[0] == "<graddbg.Graph: 2000 nodes, 1999 edges, truncated from more than 10001> True True"
    assert lines[1].startswith("<graddbg.Graph: 10001 nodes") and lines[1].endswith("True True")
    assert "more than 10000 autograd nodes" in lines[2]
    assert lines[-1] == "freed"


@dataclasses.dataclass
class ModelOutput:
    loss: torch.Tensor
    logits: torch.Tensor
    hidden: object = None


@pytest.mark.parametrize("kind", ["tuple", "list", "dict", "dataclass", "namedtuple"])
def test_container_roots(kind):
    x = torch.randn(3, requires_grad=True)
    a, b = x.exp(), x.sin()
    NT = collections.namedtuple("NT", ["loss", "logits"])
    roots, names = {
        "tuple": ((a, b), ["[0]", "[1]"]),
        "list": ([a, b], ["[0]", "[1]"]),
        "dict": ({"loss": a, "logits": b, "step": 3}, ["loss", "logits"]),
        "dataclass": (ModelOutput(loss=a, logits=b, hidden=None), ["loss", "logits"]),
        "namedtuple": (NT(a, b), ["loss", "logits"]),
    }[kind]
    g = extract(roots)
    assert [n.name for n in g.by_kind("output")] == names
    assert sorted(n.name for n in g.by_kind("op")) == ["ExpBackward0", "SinBackward0"]
    assert len(g.by_kind("input")) == 1  # x shared by both ops


def test_modeloutput_mapping_roots():
    class Output(collections.OrderedDict):  # what transformers' ModelOutput is
        pass
    x = torch.randn(3, requires_grad=True)
    out = Output(loss=x.sum(), logits=x * 2)
    g = graph(out)
    assert [n.name for n in g.extracted.by_kind("output")] == ["loss", "logits"]


def test_roots_without_graph_are_rejected():
    with pytest.raises(GraddbgValueError, match=r"roots=.*no tensor with a grad_fn.*dict"):
        graph({"a": torch.ones(2)})


@pytest.mark.parametrize("kwargs,error,pattern", [
    (dict(max_nodes=0), GraddbgValueError, r"max_nodes=.*positive int.*got 0"),
    (dict(max_nodes=True), GraddbgValueError, r"max_nodes=.*positive int.*got True"),
    (dict(depth=-1), GraddbgValueError, r"depth=.*positive int.*got -1"),
    (dict(depth=0), GraddbgValueError, r"depth=.*positive int.*got 0"),
    (dict(style="dot"), GraddbgValueError, r"style=.*got 'dot'.*'graddbg', 'torchviz'"),
    (dict(style="torchviz", grads=True, depth=1), GraddbgValueError,
     r"style='torchviz'.*got grads=True, depth=1.*style='graddbg' only"),
    (dict(model="resnet"), GraddbgTypeError, r"graph\(model=.*got str.*nn.Module.*ModuleTrace"),
    (dict(model=nn.Linear), GraddbgTypeError, r"model=.*class Linear.*instantiate it first"),
    (dict(params=[("w", 1)]), GraddbgTypeError, r"params=.*got list.*dict of name -> tensor"),
    (dict(params={"w": 1.0}), GraddbgTypeError, r"params=.*got float for 'w'.*dict of name -> tensor"),
    (dict(watch=object()), GraddbgTypeError, r"watch=.*got object.*\.stats DataFrame"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_arguments_name_themselves(kwargs, error, pattern):
    y = torch.ones(2, requires_grad=True).exp().sum()
    with pytest.raises(error, match=pattern) as info:
        graph(y, **kwargs)
    assert isinstance(info.value, GraddbgError)  # and a ValueError / TypeError, as torch raises


def test_bad_render_format_names_itself():
    y = torch.ones(2, requires_grad=True).exp().sum()
    with pytest.raises(GraddbgValueError, match=r"format=.*got 'jpg'.*svg"):
        graph(y).render("x.jpg", format="jpg")
    with pytest.raises(ValueError, match=r"format=.*got 'jpg'"):
        render_source("digraph { a }", "jpg")


def test_trace_modules_rejects_a_non_module():
    with pytest.raises(GraddbgTypeError, match=r"trace_modules\(model=.*got str"):
        with trace_modules("net"):
            pass


# ---------------------------------------------------------------- modules


def test_every_node_of_two_module_model_lands_in_its_cluster():
    model, g = two_modules_graph()
    where = {n.name if n.kind != "op" else f"{n.name}@{n.id}": n.module for n in g.nodes}
    ops = {(n.name, n.module) for n in g.extracted.by_kind("op")}
    assert ops == {
        ("SumBackward0", ()), ("PowBackward0", ()), ("ReluBackward0", ()),   # model/loss level
        ("AddmmBackward0", ("enc",)), ("TBackward0", ("enc",)),
        ("AddmmBackward0", ("dec", "0")), ("TBackward0", ("dec", "0")),
        ("TanhBackward0", ("dec", "1")),
    }
    assert where["enc.weight"] == ("enc",) and where["enc.bias"] == ("enc",)
    assert where["dec.0.weight"] == ("dec", "0") and where["dec.0.bias"] == ("dec", "0")
    # nested clusters in the DOT text: dec contains dec.0 and dec.1
    src = g.source
    dec = src.index('label="dec\\n(Sequential)"')
    dec0 = src.index('label="dec.0\\n(Linear)"')
    assert src.count("subgraph cluster_") == 4
    assert dec < dec0


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1, bias=False)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = nn.Identity()

    def forward(self, x):
        out = self.conv(x)
        out += self.shortcut(x)
        return self.relu(out)


def test_inplace_ops_are_attributed_to_the_module_that_ran_them():
    model = nn.Sequential(_Block(), _Block())
    g = graph(lambda: model(torch.randn(1, 2, 4, 4)).sum(), model=model)
    ops = sorted((n.name, n.module) for n in g.extracted.by_kind("op"))
    assert ops == sorted([("SumBackward0", ())] + [
        (op, path) for b in ("0", "1") for op, path in (
            ("ConvolutionBackward0", (b, "conv")), ("AddBackward0", (b,)),
            ("ReluBackward0", (b, "relu")))])


def test_trace_modules_removes_hooks_and_leaves_model_unchanged():
    from torch.nn.modules import module as module_mod
    model = TwoModules()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    n_global = (len(module_mod._global_forward_pre_hooks), len(module_mod._global_forward_hooks))
    with pytest.raises(ZeroDivisionError):
        with trace_modules(model):
            model(torch.randn(2, 3))
            1 / 0
    assert (len(module_mod._global_forward_pre_hooks), len(module_mod._global_forward_hooks)) == n_global
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert not any(k.startswith("_graddbg") for m in model.modules() for k in vars(m))


def test_context_manager_trace_equals_callable_form():
    model = TwoModules()
    x = torch.randn(5, 3)
    with trace_modules(model) as tr:
        y = model(x).pow(2).sum()
    g1 = graph(y, model=tr)
    g2 = graph(lambda: model(x).pow(2).sum(), model=model)
    assert g1.source == g2.source


def test_trace_without_private_sequence_counter_gives_same_clusters(monkeypatch):
    _, g1 = two_modules_graph()
    monkeypatch.setattr(graddbg.graphviz, "_peek_sequence_nr", None)  # fallback: probe nodes
    _, g2 = two_modules_graph()
    assert [(n.name, n.module) for n in g1.nodes] == [(n.name, n.module) for n in g2.nodes]


def test_precomputed_roots_cluster_parameters_by_ownership():
    model = TwoModules()
    y = model(torch.randn(5, 3)).sum()
    g = graph(y, model=model)
    params = {n.name: n.module for n in g.extracted.by_kind("param")}
    assert params == {"enc.weight": ("enc",), "enc.bias": ("enc",),
                      "dec.0.weight": ("dec", "0"), "dec.0.bias": ("dec", "0")}
    addmm = [n.module for n in g.extracted.by_kind("op") if n.name == "AddmmBackward0"]
    assert sorted(addmm) == [("dec", "0"), ("enc",)]


def test_depth_collapses_deeper_modules_into_counted_nodes():
    _, full = two_modules_graph()
    _, g = two_modules_graph(depth=1)  # the root's children are depth 1
    modules = {n.name: n.ops for n in g.extracted.by_kind("module")}
    assert modules == {"enc": 2, "dec": 3}  # Addmm+T ; Addmm+T+Tanh
    assert 'label="dec\\nSequential\\n3 ops"' in g.source
    assert not g.extracted.by_kind("param")
    assert "subgraph cluster_" not in g.source
    # collapsing keeps connectivity: enc -> relu -> dec
    ids = {n.name: n.id for n in g.nodes}
    relu = [n.id for n in g.nodes if n.name == "ReluBackward0"][0]
    edges = {(e.src, e.dst) for e in g.edges}
    assert (ids["enc"], relu) in edges and (relu, ids["dec"]) in edges
    assert len(g.nodes) < len(full.nodes)


def test_depth_d_draws_every_module_at_depth_d_as_one_node_leaf_or_not():
    _, full = two_modules_graph()
    _, g = two_modules_graph(depth=2)
    # dec.0 (Linear) and dec.1 (Tanh) are at depth 2: one node each, params absorbed
    assert {n.name: n.ops for n in g.extracted.by_kind("module")} == {"dec.0": 2, "dec.1": 1}
    assert {n.name: n.module for n in g.extracted.by_kind("module")} == {
        "dec.0": ("dec",), "dec.1": ("dec",)}
    assert 'label="dec.1\\nTanh\\nTanhBackward0"' in g.source  # a single op is named
    assert 'label="dec.0\\nLinear\\n2 ops"' in g.source
    # enc is a leaf shallower than 2: still a cluster of its ops and parameters
    enc = sorted(n.name for n in g.nodes if n.module == ("enc",))
    assert enc == sorted(n.name for n in full.nodes if n.module == ("enc",))
    assert enc == ["AddmmBackward0", "TBackward0", "enc.bias", "enc.weight"]
    assert sorted(n.name for n in g.extracted.by_kind("param")) == ["enc.bias", "enc.weight"]
    assert g.source.count("subgraph cluster_") == 2  # enc and dec
    # nothing deeper than the graph's modules: same as no collapsing at all
    _, g3 = two_modules_graph(depth=3)
    assert g3.source == full.source
    # every module at depth d, leaf or not, against a naive reference on a deeper model
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.ReLU())),
                          nn.Linear(2, 1))
    g = graph(lambda: model(torch.randn(3, 2)).sum(), model=model, depth=2)
    depth2 = {name for name, _ in model.named_modules() if name.count(".") == 1}
    assert {n.name for n in g.extracted.by_kind("module")} == depth2 == {"0.0", "0.1"}
    assert {n.name: n.ops for n in g.extracted.by_kind("module")} == {"0.0": 2, "0.1": 3}
    assert sorted(n.name for n in g.extracted.by_kind("param")) == ["1.bias", "1.weight"]


# ---------------------------------------------------------------- grads


def test_sqrt_at_zero_marks_sqrt_backward_nonfinite():
    x = torch.tensor([0.0, 1.0, 4.0], requires_grad=True)
    y = (x.sqrt() * 2).sum()
    g = graph(y, grads=True)
    by_name = {n.name: n for n in g.nodes}
    sqrt = by_name["SqrtBackward0"]
    assert sqrt.nonfinite and sqrt.nonfinite_origin
    assert not by_name["MulBackward0"].nonfinite
    assert by_name["MulBackward0"].grad_norm == pytest.approx(2 * 3 ** 0.5)
    assert by_name["input"].nonfinite and not by_name["input"].nonfinite_origin
    line = [ln for ln in g.source.splitlines() if "SqrtBackward0" in ln][0]
    assert "non-finite (origin)" in line and "#e41a1c" in line
    assert 'label="non-finite"' in g.source  # legend


def test_grad_norms_match_reference_and_leave_grad_alone():
    model = TwoModules()
    x = torch.randn(5, 3)
    model.enc.weight.grad = torch.full_like(model.enc.weight, 7.0)
    before = model.enc.weight.grad
    y = model(x).pow(2).sum()
    g = graph(y, model=model, grads=True)
    assert model.enc.weight.grad is before and torch.all(before == 7.0)
    assert model.dec[0].weight.grad is None
    ref = torch.autograd.grad(y, [model.enc.weight, model.dec[0].bias], retain_graph=True)
    by_name = {n.name: n for n in g.nodes}
    assert by_name["enc.weight"].grad_norm == pytest.approx(ref[0].norm().item(), rel=1e-6)
    assert by_name["dec.0.bias"].grad_norm == pytest.approx(ref[1].norm().item(), rel=1e-6)
    y.backward()  # the graph was kept
    assert model.dec[0].weight.grad is not None


def test_collapsed_module_shows_largest_gradient_inside():
    _, full = two_modules_graph(grads=True)
    _, g = two_modules_graph(grads=True, depth=1)
    enc = [n for n in g.nodes if n.name == "enc"][0]
    inside = [n.grad_norm for n in full.nodes if n.kind == "op" and n.module == ("enc",)]
    assert len(inside) == 2 and enc.grad_norm == max(inside)
    assert f"max |g|={enc.grad_norm:.3g}" in g.source


def test_zero_gradient_is_grey():
    x = torch.randn(3, requires_grad=True)
    y = (x * 0).sum()
    g = graph(y, grads=True)
    line = [ln for ln in g.source.splitlines() if "input" in ln and "->" not in ln][0]
    assert "grad 0" in line and "#d9d9d9" in line


def test_grads_on_freed_graph_is_explained():
    x = torch.randn(3, requires_grad=True)
    y = x.exp().sum()
    y.backward()
    with pytest.raises(GraddbgError, match="already freed"):
        graph(y, grads=True)


def test_watch_stats_annotate_parameters():
    pd = pytest.importorskip("pandas")
    model = TwoModules()

    class FakeWatch:
        stats = pd.DataFrame({"step": [0, 1, 1], "name": ["enc.weight", "enc.weight", "enc.bias"],
                              "norm": [9.0, 0.5, float("nan")], "absmax": [1.0, 0.25, float("nan")],
                              "nonfinite": [0, 0, 3]})
    g = graph(model(torch.randn(2, 3)).sum(), model=model, watch=FakeWatch())
    lines = {n.name: n for n in g.nodes}
    assert lines["enc.weight"].detail == ["step 1: norm=0.5 absmax=0.25"]
    assert "non-finite: 3" in lines["enc.bias"].detail
    assert "#e41a1c" in [ln for ln in g.source.splitlines() if "enc.bias" in ln][0]


# ---------------------------------------------------------------- DOT text


def test_golden_two_modules():
    _, g = two_modules_graph()
    check_golden("two_modules", g.source)


def test_golden_two_modules_grads():
    _, g = two_modules_graph(grads=True)
    check_golden("two_modules_grads", g.source)


def test_golden_depth1():
    _, g = two_modules_graph(depth=1)
    check_golden("two_modules_depth1", g.source)


def test_golden_depth2():
    _, g = two_modules_graph(depth=2)
    check_golden("two_modules_depth2", g.source)


def test_golden_saved_tensors():
    x = torch.ones(2, 3, requires_grad=True)
    g = graph((x * x.exp()).sum(), show_saved=True, cluster=False)
    check_golden("saved", g.source)
    saved = {n.name: n.detail for n in g.extracted.by_kind("saved")}
    assert saved["result"] == ["float32 24 B"]


def test_escape():
    assert escape('a"b') == 'a\\"b'
    assert escape("a\\b") == "a\\\\b"
    assert escape("x<y>&z") == "x&lt;y&gt;&amp;z"
    assert escape("l1\nl2") == "l1\\nl2"
    assert escape("plain_name.0") == "plain_name.0"


def test_digraph_has_same_source():
    pytest.importorskip("graphviz")
    _, g = two_modules_graph()
    assert g.digraph.source == g.source


def test_import_graphviz_module_does_not_import_heavy_packages():
    import ast
    tree = ast.parse(pathlib.Path(graddbg.graphviz.__file__).read_text())
    top = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            top.add((node.module or "").split(".")[0])
    assert not top & {"graphviz", "pandas", "matplotlib", "numpy", "torchviz"}


# ---------------------------------------------------------------- torchviz compatibility


def _torchviz_structure(dot):
    nodes, edges = {}, []
    for line in dot.body:
        line = line.strip()
        m = re.match(r"^(\d+) -> (\d+)(?: \[(.*)\])?$", line)
        if m:
            style = {"dir=none": "undirected", "style=dotted": "dotted", None: ""}[m.group(3)]
            edges.append((int(m.group(1)), int(m.group(2)), style))
            continue
        m = re.match(r'^(\d+) \[label=(?:"(.*)"|(\w+))(?: fillcolor=(\S+))?\]$', line, re.S)
        if m:
            label = m.group(2) if m.group(2) is not None else m.group(3)
            nodes[int(m.group(1))] = (label.replace("\n", "\\n"), m.group(4) or "")
    return nodes, edges


def _naive_torchviz_reference(roots, params):
    """What make_dot draws, by its documented rules, walked naively (small graphs):
    op names, named leaves, and the green roots."""
    names = {id(p): n for n, p in params.items()}
    ops, leaves, seen = collections.Counter(), collections.Counter(), set()

    def walk(fn):
        if fn is None or fn in seen:
            return
        seen.add(fn)
        ops[type(fn).__name__] += 1
        if hasattr(fn, "variable"):
            leaves[names.get(id(fn.variable), "")] += 1
        for u, _ in fn.next_functions:
            walk(u)
    for r in roots:
        walk(r.grad_fn)
    return ops, leaves


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("case", ["mlp", "view_root", "shared_input", "multi_root"])
def test_torchviz_style_matches_make_dot(case):
    torchviz = pytest.importorskip("torchviz")
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(5, 3, requires_grad=True)
    if case == "mlp":
        root = model(x).sum()
    elif case == "view_root":
        root = model(x).view(-1)[:4]
    elif case == "shared_input":
        root = (x * x).sum() + x.sum()
    else:
        out = model(x)
        root = (out.sum(), out.mean())
    roots = root if isinstance(root, tuple) else (root,)
    params = dict(model.named_parameters())
    keep = []  # hold every autograd node so that id() values stay unique while both run
    stack = [t.grad_fn for t in roots]
    while stack:
        fn = stack.pop()
        if fn is not None and all(fn is not k for k in keep):
            keep.append(fn)
            stack.extend(u for u, _ in fn.next_functions)
    ref_nodes, ref_edges = _torchviz_structure(torchviz.make_dot(root, params=params))
    g = graph(root, params=params, style="torchviz")
    ours = {n.key: ((f"{escape(n.name)}\\n {'(' + ', '.join(map(str, n.shape)) + ')'}"
                     if n.kind == "tensor" else n.name), n.attrs.get("fillcolor", ""))
            for n in g.nodes}
    by_id = {n.id: n.key for n in g.nodes}
    our_edges = [(by_id[e.src], by_id[e.dst], e.style) for e in g.edges]
    assert ours == ref_nodes
    assert collections.Counter(our_edges) == collections.Counter(ref_edges)
    assert "cluster" not in g.source
    assert [n.id for n in g.nodes] == [f"n{i}" for i in range(len(g.nodes))]  # ids: ours, in order
    # against the naive reference, independent of make_dot's text
    ops, leaves = _naive_torchviz_reference(roots, params)
    assert collections.Counter(n.name for n in g.nodes if n.kind == "op") == ops
    blue = collections.Counter(n.name for n in g.nodes if n.attrs.get("fillcolor") == "lightblue")
    assert blue == leaves
    green = [n for n in g.nodes if n.attrs.get("fillcolor") == "darkolivegreen1"]
    assert [n.shape for n in green] == [tuple(r.shape) for r in roots]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_torchviz_style_calls_make_dot(monkeypatch):
    torchviz = pytest.importorskip("torchviz")
    calls = []
    real = torchviz.make_dot

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)
    monkeypatch.setattr(torchviz, "make_dot", spy)
    model = nn.Linear(3, 2)
    g = graph(model(torch.randn(4, 3)).sum(), model=model, style="torchviz", show_saved=True)
    assert len(calls) == 1 and calls[0]["show_saved"] is True
    assert sorted(calls[0]["params"]) == ["bias", "weight"]
    assert {"weight", "bias"} <= {n.name for n in g.nodes}
    assert any(n.attrs.get("fillcolor") == "orange" for n in g.nodes)  # saved tensors


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_torchviz_style_on_a_graph_deeper_than_the_recursion_limit_is_explained():
    pytest.importorskip("torchviz")
    y = torch.ones(2, requires_grad=True)
    for _ in range(3000):
        y = y * 1.0001
    with pytest.raises(GraddbgValueError, match=r"style='torchviz'.*recursion limit.*style='graddbg'"):
        graph(y.sum(), style="torchviz")


# ---------------------------------------------------------------- render


HOSTILE = ['quote"name', "a<b>&c", "{brace}|x", "line\nbreak", "back\\slash", "\\N\\G"]


@needs_dot
def test_hostile_module_names_give_valid_svg():
    model = nn.Module()
    for i, name in enumerate(HOSTILE):
        model.add_module(name, nn.Linear(2, 2))

    def run():
        h = torch.randn(1, 2)
        for name in HOSTILE:
            h = getattr(model, name)(h)
        return h.sum()
    g = graph(run, model=model)
    svg = g.svg()
    texts = svg_texts(svg)
    for name in HOSTILE:
        for part in name.split("\n"):
            assert part in texts, f"label {part!r} missing from SVG texts"
        assert (name + ".weight").split("\n")[-1] in texts


@needs_dot
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("style", ["graddbg", "torchviz"])
def test_nul_and_lone_surrogate_names_render(style):
    # dot stops scanning a label at NUL; a lone surrogate cannot be encoded as UTF-8
    if style == "torchviz":
        pytest.importorskip("torchviz")
    model = nn.Module()
    model.add_module("a\x00b", nn.Linear(2, 2))
    model.register_parameter("w\ud800", nn.Parameter(torch.ones(2)))

    def run():
        return (getattr(model, "a\x00b")(torch.randn(1, 2)) * getattr(model, "w\ud800")).sum()
    if style == "graddbg":
        g = graph(run, model=model)
    else:
        g = graph(run(), model=model, style="torchviz")
    g.source.encode("utf-8")  # no UnicodeEncodeError
    assert "\x00" not in g.source
    texts = svg_texts(g.svg())
    assert "w\\ud800" in texts and "a\\x00b.weight" in texts
    if style == "graddbg":
        assert "a\\x00b" in texts and "(Linear)" in texts  # the cluster's label


@needs_dot
@pytest.mark.parametrize("fmt,magic", [("svg", b"<?xml"), ("png", b"\x89PNG"), ("pdf", b"%PDF")])
def test_render_formats(tmp_path, fmt, magic):
    _, g = two_modules_graph(grads=True)
    out = g.render(tmp_path / f"g.{fmt}", format=fmt)
    assert out.read_bytes().startswith(magic)


_RENDER_FULL_DISK = r"""
import resource, signal, sys
import torch
from torch import nn
import graddbg

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
g = graddbg.graph(lambda: model(torch.randn(5, 3)).pow(2).sum(), model=model, grads=True)
assert len(g.svg().encode()) > 4096  # dot has run once: every import done before the limit
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.RLIM_INFINITY))
try:
    g.render(sys.argv[1])
    print("written")
except graddbg.GraddbgError as e:
    print(e)
"""


@needs_dot
@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_render_that_runs_out_of_space_leaves_the_previous_svg_whole(tmp_path):
    import subprocess

    _, g = two_modules_graph()
    path = g.render(tmp_path / "graph.svg")
    before = path.read_bytes()
    res = subprocess.run([sys.executable, "-c", _RENDER_FULL_DISK, str(path)], capture_output=True,
                         text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"could not write {str(path)!r}: File too large; the previous file is " \
                                 "left as it was", res.stdout + res.stderr
    assert path.read_bytes() == before  # byte-identical
    assert [p.name for p in tmp_path.iterdir()] == ["graph.svg"]  # no temporary file left


def test_render_to_a_bad_path_names_the_argument(tmp_path):
    _, g = two_modules_graph()
    with pytest.raises(GraddbgTypeError, match="path: expected a file name .*; got int"):
        g.render(3)


def svg_titles(svg: bytes) -> list:
    """(class, title) of every node, edge and cluster group of an SVG from dot."""
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    return [(el.get("class"), el.find(ns + "title").text) for el in root.iter(ns + "g")
            if el.get("class") in ("node", "edge", "cluster")]


@needs_dot
def test_svg_has_every_node_edge_and_cluster():
    _, g = two_modules_graph(grads=True, depth=2)
    titles = svg_titles(g.svg().encode())
    legend = re.findall(r"^\s*legend\d+ \[", g.source, re.M)
    assert len([t for t in titles if t[0] == "node"]) == len(g.nodes) + len(legend) > len(g.nodes)
    assert len([t for t in titles if t[0] == "edge"]) == len(g.edges)  # the legend's are invisible
    assert ("node", "m1") in titles and ("edge", "m1->m0") in titles and ("cluster", "cluster_1") in titles


@needs_dot
def test_notebook_display_is_svg_that_fits_the_width():
    _, g = two_modules_graph()
    bundle = g._repr_mimebundle_()
    assert list(bundle) == ["image/svg+xml"]
    assert 'style="max-width: 100%; height: auto;"' in bundle["image/svg+xml"]
    assert svg_titles(bundle["image/svg+xml"].encode())[0] == ("cluster", "cluster_0")


@needs_dot
def test_dot_failure_is_a_graddbg_error_with_dots_message():
    with pytest.raises(GraddbgError, match=r"dot -Tsvg failed \(exit 1\): .*syntax error"):
        render_source("digraph { a -> ")


def test_rendering_binds_no_c_library():
    import ast
    tree = ast.parse(pathlib.Path(graddbg.graphviz.__file__).read_text())
    imported = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "ctypes" not in imported and "graphviz" in imported  # dot through the graphviz package


def _no_dot_on_path(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no dot anywhere


INSTALL_RE = r"apt-get install graphviz.*brew install graphviz.*conda install -c conda-forge graphviz"


def test_missing_dot_gives_install_hint_and_source_still_works(monkeypatch, tmp_path):
    _no_dot_on_path(monkeypatch, tmp_path)
    _, g = two_modules_graph()
    assert g.source.startswith("digraph {") and g.to_dot() == g.source
    with pytest.raises(DotNotFoundError, match=INSTALL_RE):
        g.render(tmp_path / "g.svg")
    assert not (tmp_path / "g.svg").exists()
    assert isinstance(DotNotFoundError("x"), GraddbgError)
    bundle = g._repr_mimebundle_()
    assert "image/svg+xml" not in bundle and "apt-get install graphviz" in bundle["text/plain"]


def test_watch_labels_never_show_an_unmeasured_absmax_as_nan():
    """On the CPU absmax is read every 10th recorded step (NaN in between): the label shows
    the last reading with its step, never 'absmax=nan'; the norm is the last step's."""
    import graddbg

    torch.manual_seed(0)
    model = TwoModules()
    with graddbg.watch(model) as w:
        for _ in range(13):
            model(torch.randn(2, 3)).sum().backward()
    stats = w.stats
    last = int(stats["step"].max())
    absmax_steps = sorted(stats.loc[stats["absmax"].notna(), "step"].unique())
    assert absmax_steps[-1] < last, "absmax was read on the last step: nothing to test"
    g = graph(model(torch.randn(2, 3)).sum(), model=model, watch=w)
    for node in [n for n in g.nodes if n.kind == "param"]:
        (label,) = node.detail
        assert "nan" not in label, label
        row = stats[(stats["step"] == last) & (stats["name"] == node.name)].iloc[0]
        assert label.startswith(f"step {last}: norm={float(row['norm']):.3g} absmax="), label
        assert label.endswith(f" (step {absmax_steps[-1]})"), label
    # the same from a loaded run (no History: its .stats frame), and a parameter never measured
    run = w.to_run()
    g2 = graph(model(torch.randn(2, 3)).sum(), model=model, watch=run)
    assert [n.detail for n in g2.nodes if n.kind == "param"] == [n.detail for n in g.nodes if n.kind == "param"]


def test_history_latest_and_last_recorded_read_the_last_rows():
    from graddbg.stats import History

    import graddbg

    model = torch.nn.Linear(3, 2)
    with graddbg.watch(model, every=2) as w:
        for _ in range(5):
            model(torch.randn(4, 3)).sum().backward()
    h = w.history
    last = h.last_recorded()
    steps = w.steps
    rec = steps[steps["recorded"].astype(bool)].iloc[-1]
    assert last["step"] == int(rec["step"]) == 4 and last["global_norm"] == pytest.approx(float(rec["global_norm"]))
    stats = w.stats
    at = stats[stats["step"] == 4].set_index("name")
    assert list(last["norm"]) == pytest.approx([float(at.loc[n, "norm"]) for n in h.names])
    values, where = h.latest("absmax")
    assert list(where) == [0, 0]  # read at the first recorded step only (every 10th on the CPU)
    with pytest.raises(ValueError, match=r"History.latest\(column=...\): got 'nope'"):
        h.latest("nope")
    assert History(["a"], [1], (), 10, 100).last_recorded() is None
