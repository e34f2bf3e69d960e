"""Draw the autograd graph of a PyTorch computation, grouped by module, annotated with gradients.

Three steps, each usable (and tested) on its own:

1. :func:`extract` walks ``grad_fn.next_functions`` iteratively (never recursively) into a
   plain :class:`AutogradGraph` of :class:`GraphNode` and :class:`GraphEdge` records with
   deterministic ids (``n0``, ``n1``, ... in breadth-first order from the roots).
2. :func:`to_dot` turns that plain graph into DOT text; pure string building, no binary.
3. :func:`render_source` lays out and renders with Graphviz (in-process through its C
   library for small graphs, else the ``dot`` program); the only step that needs it.
   The environment variable ``GRADDBG_RENDER`` (``auto``, ``inprocess``, ``subprocess``)
   forces one way.

:func:`graph` does all three lazily and returns a :class:`Graph` (``.source``,
``.digraph``, ``.render()``, notebook display).

Module attribution. The autograd graph does not remember which ``nn.Module`` created a
node, so it has to be recorded while the forward pass runs. :func:`trace_modules` does
this with forward pre/post hooks on every submodule: each hook notes the autograd sequence
number at that instant (autograd numbers nodes in creation order, per thread), so every
node created between a module's pre-hook and post-hook belongs to that module, or to the
innermost submodule running at the time. Hooks are removed on exit; the model is unchanged.
Three ways to get clusters:

- ``graph(lambda: loss_fn(model(x)), model=model)``: ``roots`` is a callable, run under
  :func:`trace_modules` (exact attribution);
- ``with trace_modules(model) as tr: out = model(x)`` then ``graph(out, model=tr)`` (exact);
- ``graph(out, model=model)`` with ``out`` computed beforehand: the forward pass is gone,
  so only parameters (by ownership) and the ops that consume them directly are clustered.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gc
import math
import os
import re
import shutil
import subprocess
import threading
from collections import deque
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from graddbg._errors import DotNotFoundError, GraddbgError

__all__ = [
    "graph",
    "Graph",
    "AutogradGraph",
    "GraphNode",
    "GraphEdge",
    "ModuleTrace",
    "trace_modules",
    "extract",
    "collapse",
    "to_dot",
    "render_source",
    "escape",
]

_FORMATS = ("svg", "png", "pdf")
_STYLES = ("graddbg", "torchviz")
INSTALL_HINT = (
    "graddbg.graph needs Graphviz to render (the 'dot' program on PATH, and optionally its "
    "C library libgvc, which graddbg uses in-process when present), and the dot program "
    "was not found. "
    "Install it with one of: Debian/Ubuntu `apt-get install graphviz`, "
    "macOS `brew install graphviz`, conda `conda install -c conda-forge graphviz`. "
    "The DOT text works without it: use Graph.source or Graph.to_dot()."
)
RENDER_ENV = "GRADDBG_RENDER"
_RENDER_METHODS = ("auto", "inprocess", "subprocess")
INPROCESS_MAX_NODES = 500

ModulePath = Tuple[str, ...]

# the autograd sequence counter of this thread (private API; there is a fallback)
_peek_sequence_nr: Optional[Callable[[], int]] = getattr(torch._C._autograd, "_get_sequence_nr", None)


# --------------------------------------------------------------------------- plain graph


@dataclasses.dataclass
class GraphNode:
    """One node of the extracted graph.

    ``kind`` is one of ``"op"`` (an autograd node), ``"param"`` (a parameter),
    ``"input"`` (another leaf tensor that requires grad), ``"output"`` (a root),
    ``"saved"`` (a saved tensor), ``"module"`` (a collapsed module) or ``"note"``.
    ``module`` is the path of the module that created it (``()`` for none).
    ``key`` is ``id()`` of the underlying Python object at extraction time (not stable
    across runs, never written into DOT; useful to line up with other tools).
    """

    id: str
    kind: str
    name: str
    shape: Optional[Tuple[int, ...]] = None
    module: ModulePath = ()
    key: int = 0
    detail: List[str] = dataclasses.field(default_factory=list)
    grad_norm: Optional[float] = None
    nonfinite: bool = False
    nonfinite_origin: bool = False
    ops: int = 0
    attrs: Dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class GraphEdge:
    """A data-flow edge ``src -> dst`` (forward direction, as torchviz draws it)."""

    src: str
    dst: str
    style: str = ""  # "" | "dotted" | "undirected"


@dataclasses.dataclass
class AutogradGraph:
    """The plain extracted graph: nodes, edges, module names, and truncation info.

    Needs neither graphviz nor ``dot``.
    """

    nodes: List[GraphNode]
    edges: List[GraphEdge]
    module_types: Dict[ModulePath, str] = dataclasses.field(default_factory=dict)
    total_nodes: int = 0
    max_nodes: Optional[int] = None
    style: str = "graddbg"
    has_grads: bool = False
    shown_nodes: int = 0

    @property
    def truncated(self) -> bool:
        """Whether ``max_nodes`` cut the graph (``total_nodes`` counts all of it)."""
        return self.total_nodes > self.shown_nodes

    def node(self, node_id: str) -> GraphNode:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(node_id)

    def by_kind(self, kind: str) -> List[GraphNode]:
        return [n for n in self.nodes if n.kind == kind]


# --------------------------------------------------------------------------- module trace


class ModuleTrace:
    """Which module was running when each autograd node was created (see :func:`trace_modules`).

    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh())
    >>> with trace_modules(model) as tr:
    ...     y = model(torch.randn(4, 3))
    >>> tr.module_of(y.grad_fn)
    ('1',)
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.module_types: Dict[ModulePath, str] = {}
        self._bounds: List[int] = []
        self._paths: List[ModulePath] = []
        self._stack: List[Tuple[int, ModulePath]] = []
        self._thread = threading.get_ident()
        self._probe_leaf = torch.empty(0, requires_grad=True)

    def _probe(self) -> Optional[int]:
        """The sequence number the next autograd node of this thread will get."""
        if threading.get_ident() != self._thread:
            return None
        if _peek_sequence_nr is not None:
            return _peek_sequence_nr()
        with torch.enable_grad():  # fallback: make a throwaway node and read its number
            fn = self._probe_leaf.view_as(self._probe_leaf).grad_fn
        return None if fn is None else fn._sequence_nr() + 1

    def _mark(self) -> None:
        seq = self._probe()
        if seq is None:
            return
        path = self._stack[-1][1] if self._stack else ()
        self._bounds.append(seq)
        self._paths.append(path)

    def _enter(self, module: nn.Module, path: ModulePath) -> None:
        self._stack.append((id(module), path))
        self._mark()

    def _exit(self, module: nn.Module) -> None:
        # pop up to and including this module (robust to a forward that raised inside)
        while self._stack:
            mid, _ = self._stack.pop()
            if mid == id(module):
                break
        self._mark()

    def module_of(self, fn: Any) -> ModulePath:
        """The path of the innermost module that was running when ``fn`` was created."""
        seq = fn._sequence_nr()
        i = bisect.bisect_right(self._bounds, seq) - 1
        return self._paths[i] if i >= 0 else ()


@contextlib.contextmanager
def trace_modules(model: nn.Module) -> Iterator[ModuleTrace]:
    """Record which module creates each autograd node during the forward passes in the block.

    Uses one global forward pre-hook and one global forward hook
    (``torch.nn.modules.module.register_module_forward_*``) that ignore modules outside
    ``model``: registering two hooks per submodule costs more than the forward pass of a
    deep model. Both are removed on exit, also when the block raises; the model is never
    touched.

    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    >>> with trace_modules(model) as tr:
    ...     out = model(torch.randn(1, 3))
    >>> tr.module_of(out.grad_fn), len(model[0]._forward_hooks)
    (('0',), 0)
    """
    from torch.nn.modules import module as _module

    if not isinstance(model, nn.Module):
        raise TypeError(f"trace_modules(model=...) expects a torch.nn.Module, got {type(model).__name__}")
    trace = ModuleTrace(model)
    paths: Dict[int, ModulePath] = {}
    for qualname, module in model.named_modules(remove_duplicate=True):
        if qualname:  # the root: ops directly in model.forward stay top-level
            path: ModulePath = tuple(qualname.split("."))
            paths[id(module)] = path
            trace.module_types[path] = type(module).__name__

    def pre_hook(module: nn.Module, args: Any) -> None:
        path = paths.get(id(module))
        if path is not None and threading.get_ident() == trace._thread:
            trace._enter(module, path)

    def post_hook(module: nn.Module, args: Any, output: Any) -> None:
        if id(module) in paths and threading.get_ident() == trace._thread:
            trace._exit(module)

    handles: List[Any] = []
    try:
        handles.append(_module.register_module_forward_pre_hook(pre_hook))
        handles.append(_module.register_module_forward_hook(post_hook, always_call=True))
        yield trace
    finally:
        for h in handles:
            h.remove()


# --------------------------------------------------------------------------- roots


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (and put back its state). Walking a graph makes
    a few objects per node and frees none, so the collector would rescan them over and over:
    quadratic time on graphs of 10^4 nodes."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _flatten_roots(roots: Any) -> List[Tuple[str, torch.Tensor]]:
    """Tensors inside ``roots`` (tensor, sequence, mapping, dataclass/ModelOutput), named."""
    found: List[Tuple[str, torch.Tensor]] = []
    stack: List[Tuple[str, Any]] = [("output", roots)]
    seen: set = set()
    while stack:
        name, obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            if id(obj) not in seen and (obj.grad_fn is not None or obj.requires_grad):
                seen.add(id(obj))
                found.append((name, obj))
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        children: List[Tuple[str, Any]] = []
        if isinstance(obj, Mapping):
            children = [(str(k), v) for k, v in obj.items()]
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            children = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
        elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
            children = list(zip(obj._fields, obj))
        elif isinstance(obj, (list, tuple)):
            children = [(f"[{i}]", v) for i, v in enumerate(obj)]
        prefix = "" if name == "output" else name
        for key, value in reversed(children):
            sep = "" if (not prefix or key.startswith("[")) else "."
            stack.append((f"{prefix}{sep}{key}" if prefix else key, value))
    return found


def _param_names(model: Optional[nn.Module], params: Optional[Mapping[str, torch.Tensor]]) -> Dict[int, str]:
    names: Dict[int, str] = {}
    if model is not None:
        for qualname, p in model.named_parameters():
            names.setdefault(id(p), qualname)
    if params is not None:
        for qualname, p in params.items():
            names[id(p)] = str(qualname)
    return names


def _shape(t: torch.Tensor) -> Tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


def _fmt_shape(shape: Optional[Tuple[int, ...]]) -> str:
    if shape is None:
        return ""
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


# --------------------------------------------------------------------------- extraction


def extract(
    roots: Any,
    *,
    model: Union[nn.Module, ModuleTrace, None] = None,
    params: Optional[Mapping[str, torch.Tensor]] = None,
    grads: bool = False,
    show_saved: bool = False,
    max_nodes: Optional[int] = 2000,
    style: str = "graddbg",
) -> AutogradGraph:
    """Walk the autograd graph behind ``roots`` into a plain :class:`AutogradGraph`.

    Iterative breadth-first traversal from the roots; node ids follow discovery order,
    so the same computation always gives the same ids.

    >>> x = torch.ones(3, requires_grad=True)
    >>> g = extract((x * 2).sum())
    >>> [(n.id, n.kind, n.name) for n in g.nodes]
    [('n0', 'output', 'output'), ('n1', 'op', 'SumBackward0'), ('n2', 'op', 'MulBackward0'), ('n3', 'input', 'input')]
    >>> [(e.src, e.dst) for e in g.edges]
    [('n1', 'n0'), ('n2', 'n1'), ('n3', 'n2')]
    """
    if style not in _STYLES:
        raise ValueError(f"graph(style=...) must be one of {_STYLES}, got {style!r}")
    if max_nodes is not None and (not isinstance(max_nodes, int) or max_nodes < 1):
        raise ValueError(f"graph(max_nodes=...) must be a positive int or None, got {max_nodes!r}")
    trace: Optional[ModuleTrace] = None
    module: Optional[nn.Module] = None
    if isinstance(model, ModuleTrace):
        trace, module = model, model.model
    elif isinstance(model, nn.Module):
        module = model
    elif model is not None:
        raise TypeError(
            f"graph(model=...) expects an nn.Module or a ModuleTrace from trace_modules(), "
            f"got {type(model).__name__}")
    named_roots = _flatten_roots(roots)
    if not named_roots:
        raise ValueError(
            f"graph(roots=...) found no tensor with a grad_fn (or requires_grad) in the "
            f"{type(roots).__name__} given; pass the output of a forward pass that "
            f"tracks gradients (a tensor, a tuple/list/dict of tensors, or a ModelOutput)")
    names = _param_names(module, params)
    with _gc_paused():
        if style == "torchviz":
            g = _extract_torchviz(named_roots, names, show_saved)
        else:
            g = _extract(named_roots, names, trace, module, show_saved, max_nodes)
    try:
        if grads:
            _annotate_grads(g, named_roots)
    finally:
        # the plain graph keeps no autograd nodes or tensors (they would pin activations)
        g._fns, g._leaves = {}, []  # type: ignore[attr-defined]
    return g


class _Builder:
    def __init__(self, max_nodes: Optional[int]) -> None:
        self.nodes: List[GraphNode] = []
        self.edges: List[GraphEdge] = []
        self.edge_set: set = set()
        self.max_nodes = max_nodes
        self.total = 0

    def full(self) -> bool:
        return self.max_nodes is not None and len(self.nodes) >= self.max_nodes

    def add(self, kind: str, name: str, key: int, **kw: Any) -> GraphNode:
        node = GraphNode(id=f"n{len(self.nodes)}", kind=kind, name=name, key=key, **kw)
        self.nodes.append(node)
        return node

    def edge(self, src: str, dst: str, style: str = "") -> None:
        e = (src, dst, style)
        if e not in self.edge_set:
            self.edge_set.add(e)
            self.edges.append(GraphEdge(src, dst, style))


def _saved_tensors(fn: Any) -> List[Tuple[str, torch.Tensor]]:
    out: List[Tuple[str, torch.Tensor]] = []
    for attr in dir(fn):
        if not attr.startswith("_saved_"):
            continue
        try:
            val = getattr(fn, attr)
        except RuntimeError:  # freed by a backward pass without retain_graph
            continue
        name = attr[len("_saved_"):]
        if isinstance(val, torch.Tensor):
            out.append((name, val))
        elif isinstance(val, tuple):
            out.extend((f"{name}[{i}]", t) for i, t in enumerate(val) if isinstance(t, torch.Tensor))
    try:
        custom = getattr(fn, "saved_tensors", None)
    except RuntimeError:
        custom = None
    if custom:
        out.extend((f"saved[{i}]", t) for i, t in enumerate(custom) if isinstance(t, torch.Tensor))
    return out


def _extract(named_roots: List[Tuple[str, torch.Tensor]], names: Dict[int, str],
             trace: Optional[ModuleTrace], module: Optional[nn.Module], show_saved: bool,
             max_nodes: Optional[int]) -> AutogradGraph:
    b = _Builder(max_nodes)
    index: Dict[int, str] = {}      # id(fn) -> node id, for fns that got a node
    overflow: set = set()           # ids of fns beyond max_nodes (counted, not drawn)
    keep: List[Any] = []            # keep wrappers alive so id() stays unique
    leaves: List[torch.Tensor] = []  # every leaf reachable (for grads=True)
    fns: Dict[str, Any] = {}        # node id -> fn (for grads=True)
    queue: deque = deque()
    module_types: Dict[ModulePath, str] = {}
    if module is not None and trace is None:
        for qualname, m in module.named_modules():
            if qualname:
                module_types[tuple(qualname.split("."))] = type(m).__name__
    if trace is not None:
        module_types.update(trace.module_types)

    def owner(qualname: str) -> ModulePath:
        return tuple(qualname.split(".")[:-1])

    def leaf_node(var: torch.Tensor, key: int) -> GraphNode:
        name = names.get(id(var))
        if name is not None:
            return b.add("param", name, key, shape=_shape(var), module=owner(name))
        return b.add("input", "input", key, shape=_shape(var))

    def visit(fn: Any) -> Optional[str]:
        k = id(fn)
        nid = index.get(k)
        if nid is not None or k in overflow:
            return nid
        keep.append(fn)
        b.total += 1
        if b.full():
            overflow.add(k)
            queue.append(fn)  # still walked, to count the nodes left out
            if hasattr(fn, "variable"):
                leaves.append(fn.variable)
            return None
        if hasattr(fn, "variable"):
            var = fn.variable
            leaves.append(var)
            node = leaf_node(var, k)
        else:
            node = b.add("op", type(fn).__name__, k,
                         module=trace.module_of(fn) if trace is not None else ())
        index[k] = node.id
        fns[node.id] = fn
        queue.append(fn)
        return node.id

    root_leaf_ids: Dict[int, str] = {}
    for name, t in named_roots:
        out = b.add("output", name, id(t), shape=_shape(t))
        b.total += 1
        if t.grad_fn is not None:
            src = visit(t.grad_fn)
        else:  # a leaf passed as a root
            src = root_leaf_ids.get(id(t))
            if src is None:
                src = leaf_node(t, id(t)).id
                root_leaf_ids[id(t)] = src
                b.total += 1
                leaves.append(t)
        if src is not None:
            b.edge(src, out.id)

    while queue:
        fn = queue.popleft()
        dst = index.get(id(fn))
        for nxt, _ in getattr(fn, "next_functions", ()):
            if nxt is None:
                continue
            src = visit(nxt)
            if src is not None and dst is not None:
                b.edge(src, dst)
        if show_saved and dst is not None:
            op_node = b.nodes[int(dst[1:])]
            for sname, t in _saved_tensors(fn):
                b.total += 1
                if b.full():
                    continue
                s = b.add("saved", sname, id(t), shape=_shape(t), module=op_node.module,
                          detail=[f"{str(t.dtype).replace('torch.', '')} "
                                  f"{_fmt_bytes(t.numel() * t.element_size())}"])
                b.edge(dst, s.id, "undirected")

    if trace is None and module is not None:
        _attribute_by_parameters(b.nodes, b.edges)

    g = AutogradGraph(nodes=b.nodes, edges=b.edges, module_types=module_types,
                      total_nodes=b.total, max_nodes=max_nodes, shown_nodes=len(b.nodes))
    g._fns = fns  # type: ignore[attr-defined]
    g._leaves = leaves  # type: ignore[attr-defined]
    return g


def _attribute_by_parameters(nodes: List[GraphNode], edges: List[GraphEdge]) -> None:
    """Without a recorded forward: an op whose inputs include parameters (directly or
    through single-input ops such as ``TBackward0``) goes to the common module of those
    parameters. Everything else stays top-level."""
    by_id = {n.id: n for n in nodes}
    inputs: Dict[str, List[str]] = {}
    for e in edges:
        if e.style == "":
            inputs.setdefault(e.dst, []).append(e.src)
    # ops fed only by one parameter (transposes, views) inherit its module first
    for n in nodes:
        if n.kind == "op":
            srcs = inputs.get(n.id, [])
            if len(srcs) == 1 and by_id[srcs[0]].kind == "param":
                n.module = by_id[srcs[0]].module
    for n in nodes:
        if n.kind != "op" or n.module:
            continue
        owners = [by_id[s].module for s in inputs.get(n.id, [])
                  if by_id[s].kind == "param" or (by_id[s].kind == "op" and by_id[s].module
                                                  and len(inputs.get(s, [])) == 1)]
        if owners:
            common = owners[0]
            for o in owners[1:]:
                i = 0
                while i < min(len(common), len(o)) and common[i] == o[i]:
                    i += 1
                common = common[:i]
            n.module = common


def _extract_torchviz(named_roots: List[Tuple[str, torch.Tensor]], names: Dict[int, str],
                      show_saved: bool) -> AutogradGraph:
    """Nodes and edges exactly as ``torchviz.make_dot`` draws them, walked iteratively.

    Like torchviz, repeated edges (``x * x``) are kept and node ids are unrelated to
    torchviz's (which are ``id()`` values); ``GraphNode.key`` holds that ``id()``.
    """
    nodes: List[GraphNode] = []
    edges: List[Tuple[int, int, str]] = []  # by key, resolved to node ids at the end
    by_key: Dict[int, GraphNode] = {}
    keep: List[Any] = []

    def tensor_node(var: torch.Tensor, color: str, name: Optional[str] = None) -> None:
        node = by_key.get(id(var))
        if node is None:
            keep.append(var)
            node = GraphNode(id=f"n{len(nodes)}", kind="tensor", key=id(var),
                             name=name if name is not None else names.get(id(var), ""),
                             shape=_shape(var))
            nodes.append(node)
            by_key[id(var)] = node
        node.attrs["fillcolor"] = color  # torchviz redraws the node: the last colour wins

    def add_nodes(start: Any) -> None:
        stack = [start]  # pre-order, next_functions in order, as torchviz's recursion
        while stack:
            fn = stack.pop()
            if id(fn) in by_key:
                continue
            keep.append(fn)
            if show_saved:
                for sname, t in _saved_tensors(fn):
                    if not sname.startswith("saved["):
                        edges.append((id(fn), id(t), "undirected"))
                        tensor_node(t, "orange", sname)
            if hasattr(fn, "variable"):
                tensor_node(fn.variable, "lightblue")
                edges.append((id(fn.variable), id(fn), ""))
            node = GraphNode(id=f"n{len(nodes)}", kind="op", name=type(fn).__name__, key=id(fn))
            nodes.append(node)
            by_key[id(fn)] = node
            nexts = [u for u, _ in getattr(fn, "next_functions", ()) if u is not None]
            for u in nexts:
                keep.append(u)
                edges.append((id(u), id(fn), ""))
            try:
                custom = getattr(fn, "saved_tensors", None)
            except RuntimeError:
                custom = None
            for t in custom or ():
                edges.append((id(t), id(fn), "undirected"))
                tensor_node(t, "orange")
            stack.extend(reversed(nexts))

    base_stack: List[Tuple[torch.Tensor, str]] = [(t, "darkolivegreen1") for _, t in reversed(named_roots)]
    while base_stack:
        var, color = base_stack.pop()
        if id(var) in by_key:
            continue
        tensor_node(var, color)
        if var.grad_fn is not None:
            add_nodes(var.grad_fn)
            edges.append((id(var.grad_fn), id(var), ""))
        if var._is_view():
            base_stack.append((var._base, "darkolivegreen3"))
            edges.append((id(var._base), id(var), "dotted"))
    out_edges = [GraphEdge(by_key[s].id, by_key[d].id, st) for s, d, st in edges]
    g = AutogradGraph(nodes=nodes, edges=out_edges, total_nodes=len(nodes), style="torchviz",
                      shown_nodes=len(nodes))
    g._fns = {}  # type: ignore[attr-defined]
    g._leaves = []  # type: ignore[attr-defined]
    return g


# --------------------------------------------------------------------------- gradients


def _annotate_grads(g: AutogradGraph, named_roots: List[Tuple[str, torch.Tensor]]) -> None:
    """Run a backward pass (the graph is kept) with hooks on every autograd node and record
    the norm of the gradient each node produced. ``.grad`` of leaves is not touched: the
    pass uses ``torch.autograd.grad`` with the leaves as ``inputs``."""
    if g.style != "graddbg":
        raise ValueError("graph(grads=True) is not available with style='torchviz'")
    fns: Dict[str, Any] = g._fns  # type: ignore[attr-defined]
    leaves: List[torch.Tensor] = list({id(t): t for t in g._leaves}.values())  # type: ignore[attr-defined]
    outputs = [t for _, t in named_roots if t.grad_fn is not None]
    if not outputs or not leaves:
        g.has_grads = True
        return
    produced: Dict[str, torch.Tensor] = {}  # node id -> [norm, finite] of grads it produced
    received: Dict[str, torch.Tensor] = {}  # node id -> [norm, finite] of grads it received

    def summarize(ts: Sequence[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
        """[norm, all finite] of some gradients, on their device (no host sync here)."""
        ts = [t.detach() for t in ts
              if t is not None and (t.is_floating_point() or t.is_complex())]
        if not ts:
            return None
        rows = []
        for t in ts:
            acc = torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else None
            n = torch.linalg.vector_norm(t, dtype=acc)
            if n.device.type != "mps":
                n = n.double()
            rows.append(torch.stack([n * n, torch.isfinite(t).all().to(n.dtype)]).to(ts[0].device))
        r = torch.stack(rows)
        return torch.stack([r[:, 0].sum().sqrt(), r[:, 1].min()])

    def make_hook(nid: str) -> Callable:
        def hook(grad_inputs: Sequence, grad_outputs: Sequence) -> None:
            out, inp = summarize(grad_inputs), summarize(grad_outputs)
            if out is not None:
                produced[nid] = out
            if inp is not None:
                received[nid] = inp
        return hook

    handles: List[Any] = []
    try:
        for nid, fn in fns.items():
            if not hasattr(fn, "variable"):
                handles.append(fn.register_hook(make_hook(nid)))
        try:
            leaf_grads = torch.autograd.grad(
                outputs, leaves, grad_outputs=[torch.ones_like(t) for t in outputs],
                retain_graph=True, allow_unused=True)
        except RuntimeError as exc:
            if "second time" in str(exc) or "freed" in str(exc):
                raise GraddbgError(
                    "graph(grads=True) needs the autograd graph, but a backward pass already "
                    "freed it; call graddbg.graph(...) before loss.backward(), or use "
                    "loss.backward(retain_graph=True)") from exc
            raise
    finally:
        for h in handles:
            h.remove()
    leaf_ids = {id(t): i for i, t in enumerate(leaves)}
    for node in g.nodes:
        fn = fns.get(node.id)
        if node.kind in ("param", "input") and fn is not None:
            grad = leaf_grads[leaf_ids[id(fn.variable)]]
            summary = summarize([grad])
            if summary is not None:
                produced[node.id] = received[node.id] = summary
    # one host transfer per device
    by_device: Dict[Any, List[str]] = {}
    for nid, t in produced.items():
        by_device.setdefault(t.device, []).append(nid)
    values: Dict[str, Tuple[float, bool, bool]] = {}
    for ids in by_device.values():
        rows = torch.stack([torch.stack([produced[i][0], produced[i][1],
                                         received[i][1] if i in received else produced[i][1] * 0 + 1])
                            for i in ids]).tolist()
        for nid, (norm, fin_out, fin_in) in zip(ids, rows):
            values[nid] = (norm, bool(fin_out), bool(fin_in))
    for node in g.nodes:
        if node.id in values:
            norm, fin_out, fin_in = values[node.id]
            node.grad_norm = float(norm)
            node.nonfinite = (not fin_out) or not math.isfinite(norm)
            node.nonfinite_origin = node.nonfinite and fin_in and node.kind == "op"
    g.has_grads = True


def annotate_watch(g: AutogradGraph, watch: Any) -> None:
    """Add a Watch's latest statistics (``watch.stats``: step, name, norm, absmax,
    nonfinite) to the parameter nodes of ``g``. Duck-typed: anything with such a
    ``.stats`` DataFrame works."""
    stats = getattr(watch, "stats", None)
    if stats is None or not hasattr(stats, "columns"):
        raise TypeError(f"graph(watch=...) expects an object with a .stats DataFrame "
                        f"(a graddbg Watch), got {type(watch).__name__}")
    missing = {"step", "name", "norm"} - set(stats.columns)
    if missing:
        raise ValueError(f"graph(watch=...): watch.stats lacks columns {sorted(missing)}")
    if len(stats) == 0:
        return
    last = stats[stats["step"] == stats["step"].max()]
    rows = {str(r["name"]): r for _, r in last.iterrows()}
    for node in g.nodes:
        if node.kind != "param" or node.name not in rows:
            continue
        r = rows[node.name]
        parts = [f"step {int(r['step'])}: norm={_fmt_num(float(r['norm']))}"]
        if "absmax" in r:
            parts.append(f"absmax={_fmt_num(float(r['absmax']))}")
        node.detail.append(" ".join(parts))
        if "nonfinite" in r and float(r["nonfinite"]) > 0:
            node.detail.append(f"non-finite: {int(r['nonfinite'])}")
            node.attrs["fillcolor"] = _RED
            node.attrs["fontcolor"] = "white"


# --------------------------------------------------------------------------- collapse


def collapse(g: AutogradGraph, depth: int) -> AutogradGraph:
    """Draw every module at depth ``depth`` as one node (the root's children are depth 1).

    A module at depth ``depth`` becomes one ``"module"`` node, leaf or not: its ops, its
    parameters, its saved tensors and everything of its submodules are absorbed into it,
    and the node counts its ops (``GraphNode.ops``; with a single op, ``attrs["op"]``
    names it). Modules shallower than ``depth`` keep their own nodes (they become
    clusters), leaf modules included. Edges between absorbed nodes vanish; edges across
    are redirected to the module node (parallel edges merged).

    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh())
    >>> with trace_modules(model) as tr:
    ...     y = model(torch.randn(1, 3)).sum()
    >>> [(n.name, n.ops, n.attrs.get("op")) for n in collapse(extract(y, model=tr), 1).by_kind("module")]
    [('1', 1, 'TanhBackward0'), ('0', 2, None)]
    """
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
        raise ValueError(f"graph(depth=...) must be a positive int (1: the model's children "
                         f"drawn as one node each) or None, got {depth!r}")
    rep: Dict[str, str] = {}
    groups: Dict[ModulePath, GraphNode] = {}
    nodes: List[GraphNode] = []
    for n in g.nodes:
        if len(n.module) >= depth and n.kind != "output":
            path = n.module[:depth]
            m = groups.get(path)
            if m is None:
                m = GraphNode(id=f"m{len(groups)}", kind="module", name=".".join(path),
                              module=path[:-1], key=0)
                if path in g.module_types:
                    m.attrs["type"] = g.module_types[path]
                groups[path] = m
                nodes.append(m)
            if n.kind == "op":
                m.ops += 1
                if m.ops == 1:
                    m.attrs["op"] = n.name
                else:
                    m.attrs.pop("op", None)
            if n.grad_norm is not None and n.kind == "op":
                m.nonfinite = m.nonfinite or n.nonfinite
                m.nonfinite_origin = m.nonfinite_origin or n.nonfinite_origin
                if not n.nonfinite:  # a module node shows the largest gradient inside it
                    m.grad_norm = max(m.grad_norm or 0.0, n.grad_norm)
            rep[n.id] = m.id
        else:
            rep[n.id] = n.id
            nodes.append(n)
    edges: List[GraphEdge] = []
    seen: set = set()
    for e in g.edges:
        s, d = rep[e.src], rep[e.dst]
        if s == d:
            continue
        key = (s, d, e.style)
        if key not in seen:
            seen.add(key)
            edges.append(GraphEdge(s, d, e.style))
    out = dataclasses.replace(g, nodes=nodes, edges=edges)
    return out


# --------------------------------------------------------------------------- DOT text

_ESCAPE_RE = re.compile(r'[\\"&<>\n\r\t]')
_ESCAPES = {"\\": "\\\\", '"': '\\"', "&": "&amp;", "<": "&lt;", ">": "&gt;",
            "\n": "\\n", "\r": "", "\t": " "}


def escape(text: str) -> str:
    r"""Escape ``text`` for a double-quoted DOT label: backslashes, quotes, newlines, and
    ``& < >`` as entities (graphviz reads entities in labels). Braces and ``|`` need no
    escaping in the (non-record) shapes graddbg uses.

    >>> print(escape('a"b<c>&d\\e'))
    a\"b&lt;c&gt;&amp;d\\e
    """
    text = str(text)
    if not _ESCAPE_RE.search(text):
        return text
    return _ESCAPE_RE.sub(lambda m: _ESCAPES[m.group(0)], text)


def _label(lines: Sequence[str]) -> str:
    return "\\n".join(escape(line) for line in lines)


def _fmt_num(v: float) -> str:
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.3g}" if v == 0 or 1e-3 <= abs(v) < 1e4 else f"{v:.2e}"


_RED = "#e41a1c"
_GREY = "#d9d9d9"
_NOGRAD = "white"
_PALETTE = ["#eff5fb", "#deebf7", "#c6dbef", "#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#08519c"]
_KIND_COLOR = {"param": "lightblue", "input": "lightblue", "output": "darkolivegreen1",
               "saved": "orange", "module": "#fff2cc", "op": "lightgrey", "note": "#ffffcc"}
_CLUSTER_STYLE = ('style="rounded,filled"', 'color="#9e9e9e"', 'fillcolor="#f8f8f8"',
                  'fontname="Helvetica"', 'fontsize=10', 'labeljust=l')


def _grad_scale(g: AutogradGraph) -> Optional[Tuple[float, float]]:
    vals = [math.log10(n.grad_norm) for n in g.nodes
            if n.grad_norm is not None and not n.nonfinite and n.grad_norm > 0]
    if not vals:
        return None
    lo, hi = math.floor(min(vals)), math.ceil(max(vals))
    if hi <= lo:
        hi = lo + 1
    return float(lo), float(hi)


def _bins(scale: Tuple[float, float]) -> List[Tuple[float, float]]:
    """Log-scale bins (in log10 units): one per decade, at most len(_PALETTE)."""
    lo, hi = scale
    k = min(len(_PALETTE), int(hi - lo))
    step = (hi - lo) / k
    return [(lo + i * step, lo + (i + 1) * step) for i in range(k)]


def _bin_colors(k: int) -> List[str]:
    # spread k colours over the palette, light to dark
    n = len(_PALETTE)
    return [_PALETTE[round(i * (n - 1) / max(k - 1, 1))] for i in range(k)]


def _grad_color(v: float, scale: Tuple[float, float]) -> str:
    bins = _bins(scale)
    colors = _bin_colors(len(bins))
    x = math.log10(v)
    for (a, b), c in zip(bins, colors):
        if x < b:
            return c
    return colors[-1]


def _node_line(n: GraphNode, style: str, scale: Optional[Tuple[float, float]], has_grads: bool) -> str:
    if style == "torchviz":
        if n.kind == "op":
            return f'\t{n.id} [label="{escape(n.name)}"]\n'
        lbl = f"{escape(n.name)}\\n {escape(_fmt_shape(n.shape))}"
        return f'\t{n.id} [label="{lbl}" fillcolor={n.attrs.get("fillcolor", "lightblue")}]\n'
    lines = [n.name]
    attrs: Dict[str, str] = {}
    if n.kind in ("param", "input", "output", "saved") and n.shape is not None:
        lines.append(_fmt_shape(n.shape))
    if n.kind == "module":
        mtype = n.attrs.get("type")
        if mtype:
            lines.append(mtype)
        if n.ops == 1 and "op" in n.attrs:
            lines.append(n.attrs["op"])
        else:
            lines.append(f"{n.ops} op" + ("" if n.ops == 1 else "s"))
        attrs["shape"] = "box3d"
    if n.kind == "note":
        attrs["shape"] = "note"
    lines.extend(n.detail)
    fill = _KIND_COLOR.get(n.kind, "lightgrey")
    if has_grads and n.kind in ("op", "param", "input"):
        if n.nonfinite:
            fill = _RED
            attrs["fontcolor"] = "white"
            lines.append("non-finite (origin)" if n.nonfinite_origin else "non-finite")
            if n.nonfinite_origin:
                attrs["penwidth"] = "3"
        elif n.grad_norm is None:
            fill = _NOGRAD
            lines.append("no gradient")
        elif n.grad_norm == 0:
            fill = _GREY
            lines.append("grad 0")
        else:
            fill = _grad_color(n.grad_norm, scale) if scale else _PALETTE[0]
            if fill in _PALETTE[-2:]:
                attrs["fontcolor"] = "white"
            lines.append(f"|g|={_fmt_num(n.grad_norm)}")
    elif n.kind == "module" and n.nonfinite:
        fill = _RED
        attrs["fontcolor"] = "white"
        lines.append("non-finite inside")
    elif n.kind == "module" and n.grad_norm is not None:
        fill = _grad_color(n.grad_norm, scale) if scale and n.grad_norm > 0 else _GREY
        if fill in _PALETTE[-2:]:
            attrs["fontcolor"] = "white"
        lines.append(f"max |g|={_fmt_num(n.grad_norm)}")
    attrs["fillcolor"] = n.attrs.get("fillcolor", fill)
    if "fontcolor" in n.attrs:
        attrs["fontcolor"] = n.attrs["fontcolor"]
    rest = "".join(f' {k}="{v}"' for k, v in attrs.items())
    return f'\t{n.id} [label="{_label(lines)}"{rest}]\n'


def _edge_line(e: GraphEdge) -> str:
    if e.style == "dotted":
        return f"\t{e.src} -> {e.dst} [style=dotted]\n"
    if e.style == "undirected":
        return f"\t{e.src} -> {e.dst} [dir=none]\n"
    return f"\t{e.src} -> {e.dst}\n"


def _body(g: AutogradGraph, cluster: bool) -> List[str]:
    style = g.style
    body: List[str] = []
    if style == "torchviz":
        body.append('\tnode [align=left fontname=monospace fontsize=10 height=0.2 ranksep=0.1 '
                    'shape=box style=filled]\n')
        body.extend(_node_line(n, style, None, False) for n in g.nodes)
        body.extend(_edge_line(e) for e in g.edges)
        return body
    body.append('\tgraph [fontname="Helvetica" newrank=true]\n')
    body.append('\tnode [fontname=monospace fontsize=10 height=0.2 shape=box style="filled,rounded"]\n')
    body.append('\tedge [arrowsize=0.6]\n')
    scale = _grad_scale(g) if g.has_grads else None
    lines = {n.id: _node_line(n, style, scale, g.has_grads) for n in g.nodes}
    if not cluster:
        body.extend(lines[n.id] for n in g.nodes)
    else:
        # module tree: path -> list of node ids; emitted with an explicit stack
        members: Dict[ModulePath, List[str]] = {}
        for n in g.nodes:
            members.setdefault(n.module, []).append(n.id)
        paths = set()
        for p in members:
            for i in range(1, len(p) + 1):
                paths.add(p[:i])
        children: Dict[ModulePath, List[ModulePath]] = {}
        for p in paths:
            children.setdefault(p[:-1], []).append(p)
        first: Dict[ModulePath, int] = {}  # first appearance of a module or its children
        for i, p in enumerate(members):
            for j in range(1, len(p) + 1):
                first.setdefault(p[:j], i)
        for kids in children.values():
            kids.sort(key=lambda p: (first[p], p))
        body.extend(lines[i] for i in members.get((), []))
        counter = 0
        stack: List[Tuple[str, Any]] = [("open", p) for p in reversed(children.get((), []))]
        while stack:
            action, p = stack.pop()
            indent = "\t" * len(p)
            if action == "close":
                body.append(indent + "}\n")
                continue
            mtype = g.module_types.get(p)
            label = _label([".".join(p)] + ([f"({mtype})"] if mtype else []))
            body.append(f"{indent}subgraph cluster_{counter} {{\n")
            counter += 1
            body.append(f'{indent}\tlabel="{label}" ' + " ".join(_CLUSTER_STYLE) + "\n")
            body.extend(indent + lines[i] for i in members.get(p, []))
            stack.append(("close", p))
            stack.extend(("open", c) for c in reversed(children.get(p, [])))
    body.extend(_edge_line(e) for e in g.edges)
    if g.truncated:
        note = (f"graph truncated: showing {g.shown_nodes} of {g.total_nodes} nodes "
                f"(max_nodes={g.max_nodes})")
        body.append(f'\ttruncated [label="{escape(note)}" '
                    f'shape=note fillcolor="{_KIND_COLOR["note"]}" fontcolor="#b30000"]\n')
    if scale is not None or (g.has_grads and any(n.nonfinite for n in g.nodes)):
        body.extend(_legend(scale))
    return body


def _legend(scale: Optional[Tuple[float, float]]) -> List[str]:
    out = ["\tsubgraph cluster_legend {\n",
           '\t\tlabel="gradient norm" style=rounded color="#9e9e9e" fontsize=10 '
           'fontname="Helvetica"\n']
    items: List[Tuple[str, str, str]] = []
    if scale is not None:
        bins = _bins(scale)
        for (a, b), color in zip(bins, _bin_colors(len(bins))):
            font = "white" if color in _PALETTE[-2:] else "black"
            items.append((f"{10 ** a:.0e} .. {10 ** b:.0e}", color, font))
    items += [("zero", _GREY, "black"), ("non-finite", _RED, "white"), ("no gradient", _NOGRAD, "black")]
    prev = None
    for i, (text, color, font) in enumerate(items):
        out.append(f'\t\tlegend{i} [label="{escape(text)}" fillcolor="{color}" fontcolor="{font}"]\n')
        if prev is not None:
            out.append(f"\t\t{prev} -> legend{i} [style=invis]\n")
        prev = f"legend{i}"
    out.append("\t}\n")
    return out


def to_dot(g: AutogradGraph, *, cluster: bool = True) -> str:
    """DOT text for an extracted graph. Needs neither graphviz nor ``dot``.

    >>> x = torch.ones(2, requires_grad=True)
    >>> print(to_dot(extract(x.exp())))  # doctest: +NORMALIZE_WHITESPACE
    digraph {
        graph [fontname="Helvetica" newrank=true]
        node [fontname=monospace fontsize=10 height=0.2 shape=box style="filled,rounded"]
        edge [arrowsize=0.6]
        n0 [label="output\\n(2)" fillcolor="darkolivegreen1"]
        n1 [label="ExpBackward0" fillcolor="lightgrey"]
        n2 [label="input\\n(2)" fillcolor="lightblue"]
        n1 -> n0
        n2 -> n1
    }
    <BLANKLINE>
    """
    with _gc_paused():
        return "digraph {\n" + "".join(_body(g, cluster)) + "}\n"


# --------------------------------------------------------------------------- render


def find_dot() -> str:
    """Path of the ``dot`` program, or :class:`DotNotFoundError` with install hints."""
    path = shutil.which("dot")
    if path is None:
        raise DotNotFoundError(INSTALL_HINT)
    return path


class _Gvc:
    """ctypes bindings to Graphviz's C library (libgvc, libcgraph) and one ``GVC_t``
    context, created on first use and kept for the life of the process (loading the
    plugins costs ~20 ms; a small render then costs well under a millisecond, against
    ~20 ms to start a ``dot`` process). Graphviz is not thread-safe: every call into it
    holds ``_GVC_LOCK``."""

    def __init__(self) -> None:
        import ctypes
        import ctypes.util
        import sys

        if sys.byteorder != "little":  # see the length argument of gvRenderData below
            raise OSError("in-process rendering assumes a little-endian machine")
        self.ctypes = ctypes
        self.gvc = self._load(ctypes, "gvc")
        self.cgraph = self._load(ctypes, "cgraph")
        vp, cp = ctypes.c_void_p, ctypes.c_char_p
        self.errf_type = ctypes.CFUNCTYPE(ctypes.c_int, cp)
        self.gvc.gvContext.restype = vp
        self.gvc.gvContext.argtypes = []
        self.cgraph.agread.restype = vp
        self.cgraph.agread.argtypes = [vp, vp]
        self.cgraph.agnnodes.restype = ctypes.c_int
        self.cgraph.agnnodes.argtypes = [vp]
        self.cgraph.agclose.restype = ctypes.c_int
        self.cgraph.agclose.argtypes = [vp]
        self.cgraph.agseterrf.restype = vp
        self.cgraph.agseterrf.argtypes = [vp]
        self.gvc.gvLayout.restype = ctypes.c_int
        self.gvc.gvLayout.argtypes = [vp, vp, cp]
        self.gvc.gvFreeLayout.restype = ctypes.c_int
        self.gvc.gvFreeLayout.argtypes = [vp, vp]
        # the length is `unsigned int *` in Graphviz 2.x and `size_t *` in later versions:
        # passing a zeroed 8-byte integer reads right either way on little-endian machines
        self.gvc.gvRenderData.restype = ctypes.c_int
        self.gvc.gvRenderData.argtypes = [vp, vp, cp, ctypes.POINTER(vp), ctypes.POINTER(ctypes.c_uint64)]
        self.gvc.gvFreeRenderData.restype = None
        self.gvc.gvFreeRenderData.argtypes = [vp]
        self.messages: List[str] = []

        def on_message(msg: bytes) -> int:  # Graphviz's errors and warnings, while we render
            try:
                self.messages.append(msg.decode("utf-8", "replace"))
            except Exception:  # never let an exception cross into C
                pass
            return 0

        self.on_message = self.errf_type(on_message)  # kept alive as long as self
        self._disc = self._discipline()
        self.ctx = self.gvc.gvContext()
        if not self.ctx:
            raise OSError("gvContext() returned NULL")
        # the discipline structures above follow Graphviz 2.x's headers (later versions
        # dropped the memory discipline and changed the id discipline): anything else is
        # left to the dot program rather than risk a crash in this process
        self.gvc.gvcVersion.restype = cp
        self.gvc.gvcVersion.argtypes = [vp]
        version = (self.gvc.gvcVersion(self.ctx) or b"?").decode("ascii", "replace")
        if not _supported_version(version):
            self.gvc.gvFreeContext.argtypes = [vp]
            self.gvc.gvFreeContext(self.ctx)
            raise OSError(f"in-process rendering supports Graphviz 2.x; this library is {version}")
        self.version = version

    def _discipline(self) -> Any:
        """An ``Agdisc_t`` for ``agread``: Graphviz's memory discipline; its id discipline
        except ``map``, which numbers objects 1, 3, 5, ... in creation order (names go to
        cgraph's internal name map); and an input discipline reading ``self._input``.

        Why: Graphviz 2.43's default ids of named objects are the addresses of their name
        strings, and subgraphs are laid out in id order, so in a long-lived process (where
        the heap is never in the same state twice) clusters would come in a different
        order, and the layout would change, from one render to the next. Sequential ids
        give one layout, byte for byte that of a fresh ``dot`` process on the graphs
        tested (a fresh process allocates the names in creation order).
        Odd ids, like cgraph's anonymous ones, are never freed as strings."""
        ctypes = self.ctypes
        vp = ctypes.c_void_p
        lib = self.cgraph

        class IdDisc(ctypes.Structure):
            _fields_ = [(f, vp) for f in ("open", "map", "alloc", "free", "print", "close", "idregister")]

        class IoDisc(ctypes.Structure):
            _fields_ = [("afread", vp), ("putstr", vp), ("flush", vp)]

        class Disc(ctypes.Structure):
            _fields_ = [("mem", vp), ("id", vp), ("io", vp)]

        map_type = ctypes.CFUNCTYPE(ctypes.c_long, vp, ctypes.c_int, ctypes.c_char_p,
                                    ctypes.POINTER(ctypes.c_uint64), ctypes.c_int)  # IDTYPE: uint64
        read_type = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, ctypes.c_int)
        self._next_id = 1
        self._input = b""
        self._pos = 0

        def map_id(state: Any, objtype: int, name: Optional[bytes], out: Any, create: int) -> int:
            if name is not None:
                return 0  # "cannot map names": cgraph keeps them in its internal map
            out[0] = self._next_id
            self._next_id += 2
            return 1

        def read(chan: Any, buf: int, size: int) -> int:
            chunk = self._input[self._pos:self._pos + max(size, 0)]
            ctypes.memmove(buf, chunk, len(chunk))
            self._pos += len(chunk)
            return len(chunk)

        self._filename = ctypes.c_char_p(b"<graddbg>")  # kept alive: cgraph keeps the pointer
        lib.agsetfile.restype = None
        lib.agsetfile.argtypes = [ctypes.c_char_p]
        self._map_cb = map_type(map_id)
        self._read_cb = read_type(read)
        default_id = IdDisc.in_dll(lib, "AgIdDisc")
        default_io = IoDisc.in_dll(lib, "AgIoDisc")
        self._id_disc = IdDisc(*(getattr(default_id, f) for f, _ in IdDisc._fields_))
        self._id_disc.map = ctypes.cast(self._map_cb, vp)
        self._io_disc = IoDisc(ctypes.cast(self._read_cb, vp), default_io.putstr, default_io.flush)
        return Disc(ctypes.addressof(ctypes.c_char.in_dll(lib, "AgMemDisc")),
                    ctypes.addressof(self._id_disc), ctypes.addressof(self._io_disc))

    def _parse(self, source: bytes) -> Optional[int]:
        self._next_id, self._input, self._pos = 1, source, 0
        self.cgraph.agsetfile(self._filename)  # line numbers of errors count from 1 again
        try:
            return self.cgraph.agread(None, self.ctypes.addressof(self._disc))
        finally:
            self._input = b""

    @staticmethod
    def _load(ctypes: Any, name: str) -> Any:
        candidates = [ctypes.util.find_library(name), f"lib{name}.so.6", f"lib{name}.dylib"]
        errors = []
        for c in candidates:
            if c:
                try:
                    return ctypes.CDLL(c)
                except OSError as exc:
                    errors.append(str(exc))
        raise OSError(f"cannot load Graphviz's lib{name}: " + "; ".join(errors or ["not found"]))

    def render(self, source: bytes, format: str, max_nodes: Optional[int]) -> Optional[bytes]:
        """The rendered bytes; None when the graph has more than ``max_nodes`` nodes.
        Raises :class:`GraddbgError` with Graphviz's messages when it fails."""
        ctypes = self.ctypes
        with _GVC_LOCK:
            self.messages = []
            old = self.cgraph.agseterrf(ctypes.cast(self.on_message, ctypes.c_void_p))
            try:
                g = self._parse(source)
                if not g:
                    raise GraddbgError("graphviz could not parse the DOT text: "
                                       + self._said("syntax error"))
                try:
                    if max_nodes is not None and self.cgraph.agnnodes(g) > max_nodes:
                        return None
                    if self.gvc.gvLayout(self.ctx, g, b"dot") != 0:
                        raise GraddbgError("graphviz could not lay out the graph: "
                                           + self._said("gvLayout failed"))
                    try:
                        buf = ctypes.c_void_p()
                        length = ctypes.c_uint64(0)
                        rc = self.gvc.gvRenderData(self.ctx, g, format.encode("ascii"),
                                                   ctypes.byref(buf), ctypes.byref(length))
                        try:
                            if rc != 0 or not buf:
                                raise GraddbgError(f"graphviz could not render {format}: "
                                                   + self._said("gvRenderData failed"))
                            return ctypes.string_at(buf, length.value)
                        finally:
                            if buf:
                                self.gvc.gvFreeRenderData(buf)
                    finally:
                        self.gvc.gvFreeLayout(self.ctx, g)
                finally:
                    self.cgraph.agclose(g)
            finally:
                self.cgraph.agseterrf(old)  # put back whatever handler was there

    def _said(self, default: str) -> str:
        text = "".join(self.messages).strip()
        return text[:2000] if text else default


def _supported_version(version: str) -> bool:
    """Whether in-process rendering may bind this Graphviz library version.

    >>> _supported_version("2.43.0"), _supported_version("12.2.1"), _supported_version("?")
    (True, False, False)
    """
    return version.startswith("2.")


_GVC_LOCK = threading.Lock()
_gvc_cache: List[Optional[_Gvc]] = []  # [] untried, [None] unavailable, [_Gvc] loaded


def _gvc() -> Optional[_Gvc]:
    """The cached in-process renderer, or None when Graphviz's library cannot be loaded."""
    if not _gvc_cache:
        with _GVC_LOCK:
            if not _gvc_cache:
                try:
                    _gvc_cache.append(_Gvc())
                except Exception:  # no library, one without these symbols (ValueError), ...
                    _gvc_cache.append(None)  # ... the dot program it is
    return _gvc_cache[0]


def _reset_after_fork() -> None:
    global _GVC_LOCK
    _GVC_LOCK = threading.Lock()  # a lock held by another thread at fork would never be freed


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)

_ANONYMOUS_RE = re.compile(r"\A(\s*(?:strict\s+)?digraph)\s*\{")


def _named(source: str) -> str:
    """Name an anonymous graph: Graphviz titles it with an internal counter (``%3`` in a
    fresh ``dot``, another number each time in a long-lived process), which would make
    in-process output differ from run to run."""
    return _ANONYMOUS_RE.sub(r'\1 "graddbg" {', source, count=1)


def _render_method(method: Optional[str]) -> str:
    if method is None:
        method = os.environ.get(RENDER_ENV) or "auto"
        if method not in _RENDER_METHODS:
            raise GraddbgError(f"environment variable {RENDER_ENV} must be one of "
                               f"{_RENDER_METHODS}, got {method!r}")
    elif method not in _RENDER_METHODS:
        raise ValueError(f"render_source(method=...) must be one of {_RENDER_METHODS}, got {method!r}")
    return method


def render_source(source: str, format: str = "svg", *, timeout: Optional[float] = None,
                  method: Optional[str] = None) -> bytes:
    """Render DOT text with Graphviz's ``dot`` layout and return the output bytes.

    ``method`` (default: the environment variable ``GRADDBG_RENDER``, else ``"auto"``):

    - ``"auto"``: when Graphviz is installed (``dot`` on PATH) and its C library loads,
      graphs of at most :data:`INPROCESS_MAX_NODES` nodes are rendered in this process
      through ctypes (no ``dot`` start-up: ~0.3 ms instead of ~20 ms for a small graph);
      bigger graphs (their layout dwarfs the start-up, and a crash, gigabytes of memory
      or the memory that Graphviz 2.43's layout leaks on graphs with clusters, measured
      at ~0.5 MiB per render of a 228-node clustered graph, are better left in a child
      process), calls with a ``timeout``, and failures in the library (to report
      ``dot``'s own message) go to a ``dot`` subprocess. Without
      ``dot`` on PATH: :class:`DotNotFoundError` with install hints.
    - ``"inprocess"``: always the library, any size (DotNotFoundError if it cannot load).
    - ``"subprocess"``: always ``dot -T<format>``.

    Both give the same bytes for the same text (an anonymous ``digraph {`` is named
    ``graddbg`` first, so that its SVG title does not depend on the process).

    >>> render_source('digraph { a -> b }', "svg")[:5]  # doctest: +SKIP
    b'<?xml'
    """
    if format not in _FORMATS:
        raise ValueError(f"render(format=...) must be one of {_FORMATS}, got {format!r}")
    method = _render_method(method)
    data = _named(source).encode("utf-8")
    if method == "inprocess":
        lib = _gvc()
        if lib is None:
            raise DotNotFoundError("GRADDBG_RENDER/method='inprocess' needs Graphviz's C "
                                   "library (libgvc), which could not be loaded. " + INSTALL_HINT)
        out = lib.render(data, format, None)
        assert out is not None
        return out
    dot = find_dot()
    if method == "auto" and timeout is None:
        lib = _gvc()
        if lib is not None:
            try:
                out = lib.render(data, format, INPROCESS_MAX_NODES)
            except GraddbgError:
                out = None  # let dot say what is wrong (or succeed where the library failed)
            if out is not None:
                return out
    try:
        proc = subprocess.run([dot, f"-T{format}"], input=data,
                              capture_output=True, timeout=timeout, check=False)
    except FileNotFoundError as exc:  # vanished between which() and run()
        raise DotNotFoundError(INSTALL_HINT) from exc
    if proc.returncode != 0:
        raise GraddbgError(f"dot -T{format} failed (exit {proc.returncode}): "
                           f"{proc.stderr.decode('utf-8', 'replace')[:2000]}")
    return proc.stdout


_SVG_SIZE_RE = re.compile(r'<svg width="([0-9.]+)pt" height="([0-9.]+)pt"')


def _fit_svg(svg: str) -> str:
    """Make the SVG scale down to the notebook's width (it keeps its viewBox)."""
    return _SVG_SIZE_RE.sub(
        lambda m: f'<svg width="{m.group(1)}pt" height="{m.group(2)}pt" '
                  f'style="max-width: 100%; height: auto;"', svg, count=1)


# --------------------------------------------------------------------------- Graph


class Graph:
    """An autograd graph ready to display: ``.source`` (DOT), ``.digraph``, ``.render()``.

    ``.extracted`` is the plain :class:`AutogradGraph` (``.nodes``, ``.edges``).
    """

    def __init__(self, extracted: AutogradGraph, *, cluster: bool = True) -> None:
        self.extracted = extracted
        self.cluster = cluster
        self._source: Optional[str] = None
        self._svg: Optional[str] = None

    @property
    def nodes(self) -> List[GraphNode]:
        return self.extracted.nodes

    @property
    def edges(self) -> List[GraphEdge]:
        return self.extracted.edges

    def to_dot(self) -> str:
        """The DOT text (no ``dot`` program needed)."""
        if self._source is None:
            self._source = to_dot(self.extracted, cluster=self.cluster)
        return self._source

    @property
    def source(self) -> str:
        return self.to_dot()

    @property
    def digraph(self) -> Any:
        """A ``graphviz.Digraph`` with the same source."""
        import graphviz

        text = self.to_dot()
        body = text[len("digraph {\n"):-len("}\n")]
        return graphviz.Digraph(body=body.splitlines(keepends=True))

    def render(self, path: Union[str, os.PathLike], format: str = "svg") -> "os.PathLike":
        """Render with Graphviz (see :func:`render_source`) into ``path`` (``format``: svg,
        png or pdf); returns the path."""
        import pathlib

        data = render_source(self.to_dot(), format)
        out = pathlib.Path(path)
        out.write_bytes(data)
        return out

    def svg(self) -> str:
        if self._svg is None:
            self._svg = render_source(self.to_dot(), "svg").decode("utf-8")
        return self._svg

    def _repr_svg_(self) -> str:
        return _fit_svg(self.svg())

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> Dict[str, str]:
        try:
            return {"image/svg+xml": self._repr_svg_()}
        except DotNotFoundError as exc:
            return {"text/plain": f"{self!r}\n{exc}"}

    def __repr__(self) -> str:
        g = self.extracted
        return (f"<graddbg.Graph: {len(g.nodes)} nodes, {len(g.edges)} edges"
                + (f", truncated from {g.total_nodes}" if g.truncated else "") + ">")


def graph(
    roots: Any,
    *,
    model: Union[nn.Module, ModuleTrace, None] = None,
    params: Optional[Mapping[str, torch.Tensor]] = None,
    grads: bool = False,
    cluster: bool = True,
    depth: Optional[int] = None,
    show_saved: bool = False,
    max_nodes: Optional[int] = 2000,
    watch: Any = None,
    style: str = "graddbg",
) -> Graph:
    """Draw the autograd graph behind ``roots``, grouped by the modules that created it.

    ``roots``: a tensor, a tuple/list/dict of tensors, an object with tensor fields
    (dataclass, ModelOutput), or a callable returning one of those; a callable is run under
    :func:`trace_modules` of ``model`` so that every op lands in its module's cluster.
    ``model``: an ``nn.Module`` (names parameters; with precomputed roots only parameters
    and the ops that use them are clustered) or a :class:`ModuleTrace`.
    ``grads=True`` runs a backward pass (keeping the graph, leaving ``.grad`` alone; roots
    that are not scalars get a gradient of ones) and colours each node by the norm of the
    gradient it produced, on a log scale with a legend; non-finite ones are red (the node
    that turned finite gradients non-finite is marked "origin"), zero ones grey.
    ``depth=d``: modules at depth ``d`` (the root's children are depth 1, their children
    depth 2, ...) are drawn as one node each, leaf or not, holding everything inside them
    (submodules, ops, parameters), labelled with the qualified name, the class and the
    number of ops (the op's own name when it holds exactly one, e.g.
    ``stem.0 / Conv2d / ConvolutionBackward0``); modules shallower than ``d`` are clusters
    (a leaf module shallower than ``d`` is a cluster of its ops and parameters); ops of the
    root module or outside the model stay top-level. ``depth=None`` (default): every
    module is a cluster. ``max_nodes`` (None: no limit) truncates big graphs with a note.
    ``watch`` adds the latest statistics of a Watch to parameter nodes. ``style="torchviz"`` gives torchviz.make_dot's nodes and edges.

    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU())
    >>> g = graph(lambda: model(torch.randn(4, 3)).sum(), model=model)
    >>> sorted({".".join(n.module) for n in g.nodes})
    ['', '0', '1']
    >>> g.source.startswith("digraph {")
    True
    >>> g1 = graph(lambda: model(torch.randn(4, 3)).sum(), model=model, depth=1)
    >>> [(n.name, n.ops) for n in g1.nodes if n.kind == "module"]
    [('1', 1), ('0', 2)]
    >>> g.render("graph.svg")  # doctest: +SKIP
    """
    if style not in _STYLES:
        raise ValueError(f"graph(style=...) must be one of {_STYLES}, got {style!r}")
    if depth is not None and (not isinstance(depth, int) or isinstance(depth, bool) or depth < 1):
        raise ValueError(f"graph(depth=...) must be a positive int (1: the model's children "
                         f"drawn as one node each) or None, got {depth!r}")
    if style == "torchviz" and (grads or depth is not None or watch is not None):
        raise ValueError("graph(style='torchviz') draws torchviz's graph only; it takes no "
                         "grads=, depth= or watch=")
    if callable(roots) and not isinstance(roots, (torch.Tensor, nn.Module)):
        if isinstance(model, nn.Module):
            with trace_modules(model) as tr:
                roots = roots()
            model = tr
        else:
            roots = roots()
    g = extract(roots, model=model, params=params, grads=grads, show_saved=show_saved,
                max_nodes=max_nodes, style=style)
    if watch is not None:
        annotate_watch(g, watch)
    if depth is not None:
        g = collapse(g, depth)
    return Graph(g, cluster=cluster and style == "graddbg")
