"""Draw the autograd graph of a PyTorch computation, grouped by module, annotated with gradients.

Three steps, each usable (and tested) on its own:

1. `extract` walks ``grad_fn.next_functions`` iteratively (never recursively) into a
   plain `AutogradGraph` of `GraphNode` and `GraphEdge` records with
   deterministic ids (``n0``, ``n1``, ... in breadth-first order from the roots). The walk
   stops after `WALK_LIMIT` autograd nodes, whatever ``max_nodes`` says (see there).
2. `to_dot` turns that plain graph into DOT text; pure string building, no binary.
3. `render_source` lays out and renders with Graphviz's ``dot`` program through the
   ``graphviz`` Python package; the only step that needs it.

`graph` does all three lazily and returns a `Graph` (``.source``,
``.digraph``, ``.render()``, notebook display). ``style="torchviz"`` draws what
``torchviz.make_dot`` draws (it calls it).

Module attribution. The autograd graph does not remember which ``nn.Module`` created a
node, so it has to be recorded while the forward pass runs. `trace_modules` does
this with forward pre/post hooks on every submodule: each hook notes the autograd sequence
number at that instant (autograd numbers nodes in creation order, per thread), so every
node created between a module's pre-hook and post-hook belongs to that module, or to the
innermost submodule running at the time. Hooks are removed on exit; the model is unchanged.
Three ways to get clusters:

- ``graph(lambda: loss_fn(model(x)), model=model)``: ``roots`` is a callable, run under
  `trace_modules` (exact attribution);
- ``with trace_modules(model) as tr: out = model(x)`` then ``graph(out, model=tr)`` (exact);
- ``graph(out, model=model)`` with ``out`` computed beforehand: the forward pass is gone,
  so only parameters (by ownership) and the ops that consume them directly are clustered.

Sharded models. Tensor-parallel (DTensor) parameters are the leaves of the graph and are
named as they are. FSDP2 (``fully_shard``, HSDP) runs each module's forward on gathered,
unsharded copies of its parameters, which ``named_parameters()`` never returns: a traced
forward (the first two ways above) records them as each module's forward holds them, so the
graph shows the unsharded model's names, shapes and classes (``Linear``, not
``FSDPLinear``); ``out`` computed beforehand on such a model is refused with that fix. On
FSDP2, ``grads=True`` runs a backward pass that gathers parameters again: call it on every
rank; the gradients drawn are those of this rank's batch, before any reduction.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gc
import math
import os
import re
import sys
import threading
import warnings
from collections import deque
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from graddbg._errors import DotNotFoundError, GraddbgError, GraddbgTypeError, GraddbgValueError
from graddbg._io import as_path, write_atomic
from graddbg._model import check_model, clean_name, is_dtensor, named_tensors, unwrap

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
    "mark_producer",
    "to_dot",
    "render_source",
    "escape",
    "WALK_LIMIT",
]

_FORMATS = ("svg", "png", "pdf")
_STYLES = ("graddbg", "torchviz")
INSTALL_HINT = (
    "graddbg.graph renders with Graphviz's 'dot' program (through the graphviz Python "
    "package), and dot was not found on PATH. "
    "Install it with one of: Debian/Ubuntu `apt-get install graphviz`, "
    "macOS `brew install graphviz`, conda `conda install -c conda-forge graphviz`. "
    "The DOT text works without it: use Graph.source or Graph.to_dot()."
)
# Most autograd nodes one extraction walks. Every node walked gets a Python wrapper that
# torch keeps as long as the node lives, and torch frees a chain of such nodes recursively
# (one C stack frame per node, the deep-graph crash of pytorch issue 109948): measured on
# torch 2.13, ~43,000 walked nodes of a chain crash the 8 MiB main thread when the graph is
# freed, and ~20,000 of a matmul/GELU chain a 4 MiB thread. Walking at most 10,000 keeps a
# margin of 2-4x; max_nodes above it (or None) draws what the walk reached.
WALK_LIMIT = 10_000

ModulePath = Tuple[str, ...]

# the autograd sequence counter of this thread (private API; there is a fallback)
_peek_sequence_nr: Optional[Callable[[], int]] = getattr(torch._C._autograd, "_get_sequence_nr", None)


# --------------------------------------------------------------------------- plain graph


@dataclasses.dataclass
class GraphNode:
    """One node of the extracted graph.

    ``kind`` is one of ``"op"`` (an autograd node), ``"param"`` (a parameter),
    ``"input"`` (another leaf tensor that requires grad), ``"output"`` (a root),
    ``"saved"`` (a saved tensor), ``"module"`` (a collapsed module), ``"note"``, or
    ``"tensor"`` (any tensor node of ``style="torchviz"``).
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

    ``total_nodes`` counts the nodes the walk found; when ``walk_stopped``, the walk
    reached `WALK_LIMIT` and the graph has more. Needs neither graphviz nor ``dot``.
    """

    nodes: List[GraphNode]
    edges: List[GraphEdge]
    module_types: Dict[ModulePath, str] = dataclasses.field(default_factory=dict)
    total_nodes: int = 0
    max_nodes: Optional[int] = None
    style: str = "graddbg"
    has_grads: bool = False
    shown_nodes: int = 0
    walk_stopped: bool = False
    caption: str = ""  #: a line drawn above the graph (what it shows: which step, which batch)

    @property
    def truncated(self) -> bool:
        """Whether ``max_nodes`` or `WALK_LIMIT` cut the graph."""
        return self.walk_stopped or self.total_nodes > self.shown_nodes

    def node(self, node_id: str) -> GraphNode:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(node_id)

    def by_kind(self, kind: str) -> List[GraphNode]:
        return [n for n in self.nodes if n.kind == kind]


# --------------------------------------------------------------------------- module trace


class ModuleTrace:
    """Which module was running when each autograd node was created (see `trace_modules`).

    Examples:
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
        #: qualified name -> the parameter a module held while its forward ran, where that
        #: differs from the registered one: FSDP2 swaps in gathered, unsharded copies
        self.forward_params: Dict[str, torch.Tensor] = {}

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

    def on_tracing_thread(self) -> bool:
        """Whether the caller runs on the thread being traced (forwards on other threads,
        such as a DataLoader's or DDP's, are not recorded)."""
        return threading.get_ident() == self._thread

    def enter(self, module: nn.Module, path: ModulePath) -> None:
        """``module`` (at ``path``) starts its forward: the nodes made from now on are its."""
        self._stack.append((id(module), path))
        self._mark()

    def note_params(self, module: nn.Module, prefix: str) -> None:
        """Remember ``module``'s own parameters as its forward saw them (plain tensors in
        place of the DTensor shards that ``named_parameters()`` gives outside the forward)."""
        for name, p in module._parameters.items():
            if p is not None and not is_dtensor(p):
                self.forward_params[prefix + name] = p

    def exit(self, module: nn.Module) -> None:
        """``module``'s forward ended: pop up to and including it (robust to a forward that
        raised inside)."""
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


def _sharded_owners(model: nn.Module) -> Dict[int, str]:
    """id(module) -> its name prefix (``"enc."``; ``""`` for the root) for every module of a
    model with DTensor parameters, whose forward may run on other tensors (FSDP2 gathers
    them); empty for any other model (nothing to record)."""
    inner = unwrap(model)
    if not any(is_dtensor(p) for p in inner.parameters()):
        return {}
    return {id(m): (clean_name(q) + "." if q else "") for q, m in inner.named_modules(remove_duplicate=True)}


def _fsdp_resharded(model: nn.Module) -> bool:
    """Whether ``model`` uses FSDP2 (``fully_shard``) and holds sharded parameters now: the
    leaves of a forward already run are gathered copies that only a traced forward names."""
    if not torch.distributed.is_available() or not any(is_dtensor(p) for p in model.parameters()):
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover (a torch without FSDP2)
        return False
    return any(isinstance(m, FSDPModule) for m in unwrap(model).modules())


def _class_name(module: nn.Module) -> str:
    """The user's class of ``module``: ``Linear`` for the ``FSDPLinear`` that FSDP2's
    ``fully_shard`` makes of a ``Linear`` (a subclass defined in torch.distributed.fsdp)."""
    for cls in type(module).__mro__:
        if not cls.__module__.startswith("torch.distributed.fsdp"):
            return cls.__name__
    return type(module).__name__


def _module_paths(model: nn.Module) -> Dict[int, Tuple[ModulePath, str]]:
    """id(submodule) -> (path, class name) for every submodule of the unwrapped model."""
    return {id(m): (tuple(clean_name(q).split(".")), _class_name(m))
            for q, m in unwrap(model).named_modules(remove_duplicate=True) if q}


@contextlib.contextmanager
def trace_modules(model: nn.Module) -> Iterator[ModuleTrace]:
    """Record which module creates each autograd node during the forward passes in the block.

    Uses one global forward pre-hook and one global forward hook
    (``torch.nn.modules.module.register_module_forward_*``) that ignore modules outside
    ``model``: registering two hooks per submodule costs more than the forward pass of a
    deep model. Both are removed on exit, also when the block raises; the model is never
    touched. Paths are those of the wrapped model (no DDP ``module.`` prefix).

    Args:
        model: the module whose submodules are traced (DDP, FSDP and compiled wrappers are
            unwrapped).

    Yields:
        ModuleTrace: maps each autograd node made in the block to the path of its module;
            pass it to `extract` or `graph` as ``model=``.

    Raises:
        GraddbgTypeError: ``model`` is not an ``nn.Module``.

    Examples:
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2))
        >>> with trace_modules(model) as tr:
        ...     out = model(torch.randn(1, 3))
        >>> tr.module_of(out.grad_fn), len(model[0]._forward_hooks)
        (('0',), 0)
    """
    from torch.nn.modules import module as _module

    trace = ModuleTrace(check_model(model, "trace_modules"))
    paths = _module_paths(model)  # the root is left out: ops of model.forward stay top-level
    trace.module_types.update(paths.values())
    owners = _sharded_owners(model)  # (global hooks run before FSDP2's own: params gathered)

    def pre_hook(module: nn.Module, args: Any) -> None:
        entry = paths.get(id(module))
        if entry is not None and trace.on_tracing_thread():
            trace.enter(module, entry[0])

    def post_hook(module: nn.Module, args: Any, output: Any) -> None:
        if not trace.on_tracing_thread():
            return
        if owners and id(module) in owners:
            trace.note_params(module, owners[id(module)])
        if id(module) in paths:
            trace.exit(module)

    with contextlib.ExitStack() as handles:  # (every handle removed, whatever happens)
        handles.callback(_module.register_module_forward_pre_hook(pre_hook).remove)
        handles.callback(_module.register_module_forward_hook(post_hook, always_call=True).remove)
        yield trace


# --------------------------------------------------------------------------- arguments


def _check_options(style: str = "graddbg", max_nodes: Optional[int] = 2000, depth: Optional[int] = None,
                   extras: Sequence[str] = ()) -> None:
    """Validate graph()'s options once, before anything runs; ``extras`` names the
    graddbg-only options given (grads=, depth=, watch=), which style='torchviz' refuses."""
    if style not in _STYLES:
        raise GraddbgValueError(f"graph(style=...): got {style!r}, expected one of {_STYLES}")
    if max_nodes is not None and (not isinstance(max_nodes, int) or isinstance(max_nodes, bool)
                                  or max_nodes < 1):
        raise GraddbgValueError(f"graph(max_nodes=...): expected a positive int or None "
                                f"(no limit), got {max_nodes!r}")
    if depth is not None and (not isinstance(depth, int) or isinstance(depth, bool) or depth < 1):
        raise GraddbgValueError(f"graph(depth=...): expected a positive int (1: the model's "
                                f"children drawn as one node each) or None, got {depth!r}")
    if style == "torchviz" and extras:
        raise GraddbgValueError(f"graph(style='torchviz') draws torchviz's graph only; got "
                                f"{', '.join(extras)}, accepted with style='graddbg' only")


def _resolve_model(model: Any) -> Tuple[Optional[ModuleTrace], Optional[nn.Module]]:
    """(trace, module) from graph()'s ``model`` argument."""
    if model is None:
        return None, None
    if isinstance(model, ModuleTrace):
        return model, model.model
    try:
        return None, check_model(model, "graph")
    except GraddbgTypeError as exc:
        raise GraddbgTypeError(f"{exc}, or a ModuleTrace from graddbg.graphviz.trace_modules()") from None


def _named_roots(roots: Any) -> List[Tuple[str, torch.Tensor]]:
    """The tensors inside ``roots`` that autograd tracks, named by their path in it."""
    found = [(path or "output", t) for path, t in named_tensors(roots)
             if t.grad_fn is not None or t.requires_grad]
    if not found:
        raise GraddbgValueError(
            f"graph(roots=...): found no tensor with a grad_fn (or requires_grad) in the "
            f"{type(roots).__name__} given; expected the output of a forward pass that "
            f"tracks gradients (a tensor, a tuple/list/dict of tensors, or a ModelOutput)")
    return found


def _named_params(module: Optional[nn.Module], params: Any,
                  trace: Optional[ModuleTrace] = None) -> Dict[str, torch.Tensor]:
    """Names for parameters: the model's (without wrapper prefixes), as its traced forward
    held them (FSDP2's gathered copies), then ``params``."""
    if module is not None and trace is None and _fsdp_resharded(module):
        raise GraddbgValueError(
            "graph(model=...): the model is sharded with FSDP2 (fully_shard) and its forward ran "
            "before graph() was called, so the parameters in the autograd graph are the gathered "
            "copies FSDP made during that forward, which only a traced forward can name; pass the "
            "forward as a callable: graph(lambda: model(x).sum(), model=model), or trace it: "
            "with graddbg.graphviz.trace_modules(model) as tr: out = model(x), then graph(out, model=tr)")
    named = {clean_name(q): p for q, p in unwrap(module).named_parameters()} if module is not None else {}
    if trace is not None:
        named.update(trace.forward_params)
    if params is None:
        return named
    if not isinstance(params, Mapping):
        raise GraddbgTypeError(f"graph(params=...): got {type(params).__name__}, expected a dict "
                               f"of name -> tensor (such as dict(model.named_parameters()))")
    for name, p in params.items():
        if not isinstance(p, torch.Tensor):
            raise GraddbgTypeError(f"graph(params=...): got {type(p).__name__} for {str(name)!r}, "
                                   f"expected a dict of name -> tensor")
        named[str(name)] = p
    return named


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


def _shape(t: torch.Tensor) -> Tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


def _fmt_shape(shape: Optional[Tuple[int, ...]]) -> str:
    return "" if shape is None else "(" + ", ".join(str(s) for s in shape) + ")"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


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
    """Walk the autograd graph behind ``roots`` into a plain `AutogradGraph`.

    Iterative breadth-first traversal from the roots; node ids follow discovery order,
    so the same computation always gives the same ids. The walk stops after
    ``WALK_LIMIT`` autograd nodes (the graph is then marked truncated).

    Args:
        roots: a tensor, a tuple/list/dict of tensors, or an object with tensor fields
            (dataclass, ModelOutput).
        model: an ``nn.Module`` (names the parameters) or a `ModuleTrace` recorded while the
            roots were computed (also places every op in its module).
        params: extra ``{name: tensor}`` to name leaf tensors.
        grads: run a backward pass (keeping the graph, leaving ``.grad`` alone) and record
            the norm of the gradient each node produced.
        show_saved: also add the tensors each node saved for backward.
        max_nodes: truncate the graph after this many nodes (None: no limit).
        style: ``"graddbg"`` or ``"torchviz"`` (the nodes and edges ``torchviz.make_dot``
            draws).

    Returns:
        AutogradGraph: nodes and edges, no graphviz object.

    Raises:
        GraddbgTypeError: ``model`` is neither a module nor a trace.
        GraddbgValueError: ``roots`` holds no tensor with a graph, an unknown ``style`` or
            a bad ``max_nodes``.

    Examples:
        >>> x = torch.ones(3, requires_grad=True)
        >>> g = extract((x * 2).sum())
        >>> [(n.id, n.kind, n.name) for n in g.nodes]
        [('n0', 'output', 'output'), ('n1', 'op', 'SumBackward0'), ('n2', 'op', 'MulBackward0'), ('n3', 'input', 'input')]
        >>> [(e.src, e.dst) for e in g.edges]
        [('n1', 'n0'), ('n2', 'n1'), ('n3', 'n2')]
    """
    _check_options(style, max_nodes, extras=["grads=True"] if grads else [])
    trace, module = _resolve_model(model)
    named_roots = _named_roots(roots)
    named = _named_params(module, params, trace)
    if style == "torchviz":
        return _extract_torchviz(named_roots, named, show_saved)
    with _gc_paused():
        walk = _Walk({id(p): n for n, p in named.items()}, trace, max_nodes)
        walk.run(named_roots, show_saved)
    g = AutogradGraph(nodes=walk.nodes, edges=walk.edges, module_types=_module_types(trace, module),
                      total_nodes=walk.total, max_nodes=max_nodes, shown_nodes=len(walk.nodes),
                      walk_stopped=walk.stopped)
    try:
        if grads:
            _annotate_grads(g, walk, [t for _, t in named_roots])
    finally:
        walk.release()  # the plain graph keeps no autograd nodes or tensors (they pin activations)
    if trace is None and module is not None:
        _attribute_by_parameters(g.nodes, g.edges)
    return g


def _module_types(trace: Optional[ModuleTrace], module: Optional[nn.Module]) -> Dict[ModulePath, str]:
    if trace is not None:
        return dict(trace.module_types)
    return dict(_module_paths(module).values()) if module is not None else {}


class _Walk:
    """State of one breadth-first walk: nodes in discovery order (ids ``n0``, ``n1``, ...),
    edges without repeats, and, until `release`, the autograd nodes and leaves behind
    them (for ``grads=True``; also keeps each ``id()`` unique while the walk runs)."""

    def __init__(self, names: Dict[int, str], trace: Optional[ModuleTrace], max_nodes: Optional[int]) -> None:
        self.names, self.trace, self.max_nodes = names, trace, max_nodes
        self.nodes: List[GraphNode] = []
        self.edges: List[GraphEdge] = []
        self._edge_set: set = set()
        self.seen: Dict[int, Tuple[Any, Optional[str]]] = {}  # id(fn) -> (fn, node id or None)
        self.fns: Dict[str, Any] = {}  # node id -> fn
        self.leaves: List[torch.Tensor] = []  # every leaf reached (for grads=True)
        self.queue: deque = deque()
        self.total = 0
        self.stopped = False

    def add(self, kind: str, name: str, key: int, **kw: Any) -> GraphNode:
        node = GraphNode(id=f"n{len(self.nodes)}", kind=kind, name=name, key=key, **kw)
        self.nodes.append(node)
        return node

    def edge(self, src: str, dst: str, style: str = "") -> None:
        if (src, dst, style) not in self._edge_set:
            self._edge_set.add((src, dst, style))
            self.edges.append(GraphEdge(src, dst, style))

    def full(self) -> bool:
        return self.max_nodes is not None and len(self.nodes) >= self.max_nodes

    def leaf_node(self, var: torch.Tensor, key: int) -> GraphNode:
        name = self.names.get(id(var))
        if name is None:
            return self.add("input", "input", key, shape=_shape(var))
        return self.add("param", name, key, shape=_shape(var), module=tuple(name.split(".")[:-1]))

    def visit(self, fn: Any) -> Optional[str]:
        """The node id of ``fn``, discovering it first; None when it is not drawn."""
        known = self.seen.get(id(fn))
        if known is not None:
            return known[1]
        if len(self.seen) >= WALK_LIMIT:
            self.stopped = True
            return None
        self.total += 1
        self.queue.append(fn)
        var = getattr(fn, "variable", None)  # an AccumulateGrad node: its leaf tensor
        if var is not None:
            self.leaves.append(var)
        node: Optional[GraphNode] = None
        if not self.full():
            node = (self.leaf_node(var, id(fn)) if var is not None else
                    self.add("op", type(fn).__name__, id(fn),
                             module=self.trace.module_of(fn) if self.trace is not None else ()))
            self.fns[node.id] = fn
        self.seen[id(fn)] = (fn, node.id if node is not None else None)
        return node.id if node is not None else None

    def add_root(self, name: str, t: torch.Tensor) -> None:
        out = self.add("output", name, id(t), shape=_shape(t))
        self.total += 1
        if t.grad_fn is not None:
            src = self.visit(t.grad_fn)
        else:  # a leaf passed as a root
            known = self.seen.get(id(t))
            src = known[1] if known is not None else None
            if known is None:
                src = self.leaf_node(t, id(t)).id
                self.seen[id(t)] = (t, src)
                self.total += 1
                self.leaves.append(t)
        if src is not None:
            self.edge(src, out.id)

    def expand(self, fn: Any, show_saved: bool) -> None:
        dst = self.seen[id(fn)][1]
        for nxt, _ in getattr(fn, "next_functions", ()):
            if nxt is not None:
                src = self.visit(nxt)
                if src is not None and dst is not None:
                    self.edge(src, dst)
        if show_saved and dst is not None:
            module = self.nodes[int(dst[1:])].module
            for sname, t in _saved_tensors(fn):
                self.total += 1
                if not self.full():
                    size = _fmt_bytes(t.numel() * t.element_size())
                    s = self.add("saved", sname, id(t), shape=_shape(t), module=module,
                                 detail=[f"{str(t.dtype).replace('torch.', '')} {size}"])
                    self.edge(dst, s.id, "undirected")

    def run(self, named_roots: List[Tuple[str, torch.Tensor]], show_saved: bool) -> None:
        for name, t in named_roots:
            self.add_root(name, t)
        while self.queue:
            self.expand(self.queue.popleft(), show_saved)

    def release(self) -> None:
        self.seen, self.fns, self.leaves, self.queue = {}, {}, [], deque()


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
        srcs = inputs.get(n.id, [])
        if n.kind == "op" and len(srcs) == 1 and by_id[srcs[0]].kind == "param":
            n.module = by_id[srcs[0]].module
    for n in nodes:
        if n.kind != "op" or n.module:
            continue
        owners = [by_id[s].module for s in inputs.get(n.id, [])
                  if by_id[s].kind == "param" or (by_id[s].kind == "op" and by_id[s].module
                                                  and len(inputs.get(s, [])) == 1)]
        if owners:
            n.module = tuple(os.path.commonprefix(owners))  # the common leading path parts


# --------------------------------------------------------------------------- torchviz style

_TV_NODE_RE = re.compile(r'\t(\d+) \[label=("(?:[^"\\]|\\.)*"|\S+)(?: fillcolor=(\S+))?\]\n?\Z', re.S)
_TV_EDGE_RE = re.compile(r"\t(\d+) -> (\d+)(?: \[(dir=none|style=dotted)\])?\n?\Z")
_TV_EDGE_STYLES = {None: "", "dir=none": "undirected", "style=dotted": "dotted"}


def _extract_torchviz(named_roots: List[Tuple[str, torch.Tensor]], named: Dict[str, torch.Tensor],
                      show_saved: bool) -> AutogradGraph:
    """The nodes and edges of ``torchviz.make_dot`` (it draws them; ids ``n0``, ``n1``, ...
    in the order it wrote them, ``GraphNode.key`` the ``id()`` it used as node name)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torchviz imports distutils
            import torchviz
    except ImportError as exc:
        raise GraddbgError("graph(style='torchviz') calls torchviz.make_dot, and torchviz is not "
                           "installed: pip install torchviz") from exc
    found = _count_autograd_nodes([t for _, t in named_roots], WALK_LIMIT)
    if found > WALK_LIMIT:
        raise GraddbgValueError(
            f"graph(style='torchviz'): got a graph of more than {WALK_LIMIT} autograd nodes, which "
            f"torchviz.make_dot would draw whole; use style='graddbg' (max_nodes=, depth=)")
    tensors = tuple(t for _, t in named_roots)
    try:
        dot = torchviz.make_dot(tensors if len(tensors) > 1 else tensors[0], params=named,
                                show_saved=show_saved)
    except RecursionError:
        raise GraddbgValueError(
            f"graph(style='torchviz'): got a graph deeper than Python's recursion limit "
            f"({sys.getrecursionlimit()}), which torchviz.make_dot walks recursively; use "
            f"style='graddbg' (iterative)") from None
    nodes, edges = _parse_make_dot(dot.body)
    return AutogradGraph(nodes=nodes, edges=edges, total_nodes=len(nodes), style="torchviz",
                         shown_nodes=len(nodes))


def _count_autograd_nodes(roots: List[torch.Tensor], limit: int) -> int:
    """How many autograd nodes are behind ``roots``, counting up to ``limit + 1``."""
    seen: Dict[int, Any] = {}
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack and len(seen) <= limit:
        fn = stack.pop()
        if id(fn) not in seen:
            seen[id(fn)] = fn
            stack.extend(u for u, _ in fn.next_functions if u is not None and id(u) not in seen)
    return len(seen)


def _parse_make_dot(body: List[str]) -> Tuple[List[GraphNode], List[GraphEdge]]:
    """Nodes and edges from the body lines of make_dot's ``graphviz.Digraph``. A node it
    drew twice keeps its first place and its last colour, as dot shows it."""
    nodes: Dict[str, GraphNode] = {}
    edges: List[Tuple[str, str, str]] = []

    def node(name: str) -> GraphNode:
        if name not in nodes:
            nodes[name] = GraphNode(id=f"n{len(nodes)}", kind="op", name="", key=int(name))
        return nodes[name]

    for line in body:
        m = _TV_EDGE_RE.match(line)
        if m:
            edges.append((node(m.group(1)).id, node(m.group(2)).id, _TV_EDGE_STYLES[m.group(3)]))
            continue
        m = _TV_NODE_RE.match(line)
        if m is None:
            raise GraddbgError(f"graph(style='torchviz'): cannot read this line of torchviz's "
                               f"output: {line[:200]!r}")
        n, label = node(m.group(1)), m.group(2)
        if label.startswith('"'):
            label = label[1:-1].replace('\\"', '"')
        n.name = label
        name, sep, shape = label.rpartition("\n ")
        if m.group(3) and sep:  # a tensor: "name\n (shape)"
            n.kind, n.name, n.attrs["fillcolor"] = "tensor", name, m.group(3).strip('"')
            n.shape = tuple(int(s) for s in shape.strip("()").split(",") if s.strip())
    return list(nodes.values()), [GraphEdge(*e) for e in edges]


# --------------------------------------------------------------------------- gradients


def _summarize(ts: Sequence[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    """[norm, all finite] of some gradients, on their device (no host sync here)."""
    ts = [t.detach() for t in ts if t is not None and (t.is_floating_point() or t.is_complex())]
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


def _hooked_backward(fns: Dict[str, Any], outputs: List[torch.Tensor], leaves: List[torch.Tensor]
                     ) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor], Sequence[Any]]:
    """One backward pass (graph kept, ``.grad`` untouched) with a hook on every drawn op:
    the [norm, finite] of the gradients each op produced and received, and the leaves' grads."""
    produced: Dict[str, torch.Tensor] = {}
    received: Dict[str, torch.Tensor] = {}

    def make_hook(nid: str) -> Callable:
        def hook(grad_inputs: Sequence, grad_outputs: Sequence) -> None:
            out, inp = _summarize(grad_inputs), _summarize(grad_outputs)
            if out is not None:
                produced[nid] = out
            if inp is not None:
                received[nid] = inp
        return hook

    with contextlib.ExitStack() as handles:  # (every handle removed, whatever happens)
        try:
            for nid, fn in fns.items():
                if not hasattr(fn, "variable"):
                    handles.callback(fn.register_hook(make_hook(nid)).remove)
            leaf_grads = torch.autograd.grad(outputs, leaves, grad_outputs=[torch.ones_like(t) for t in outputs],
                                             retain_graph=True, allow_unused=True)
        except RuntimeError as exc:
            if "second time" in str(exc) or "freed" in str(exc):
                raise GraddbgError(
                    "graph(grads=True) needs the autograd graph, but a backward pass already "
                    "freed it; call graddbg.graph(...) before loss.backward(), or use "
                    "loss.backward(retain_graph=True)") from exc
            raise
    return produced, received, leaf_grads


def _to_host(produced: Dict[str, torch.Tensor], received: Dict[str, torch.Tensor]
             ) -> Dict[str, Tuple[float, bool, bool]]:
    """node id -> (norm, finite out, finite in), with one host transfer per device."""
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
    return values


def _annotate_grads(g: AutogradGraph, walk: _Walk, roots: List[torch.Tensor]) -> None:
    """Colour data for every drawn node: the norm of the gradient it produced (a backward
    pass with hooks) and whether it turned finite gradients non-finite."""
    leaves = list({id(t): t for t in walk.leaves}.values())
    outputs = [t for t in roots if t.grad_fn is not None]
    g.has_grads = True
    if not outputs or not leaves:
        return
    produced, received, leaf_grads = _hooked_backward(walk.fns, outputs, leaves)
    leaf_index = {id(t): i for i, t in enumerate(leaves)}
    for nid, fn in walk.fns.items():
        if hasattr(fn, "variable"):
            summary = _summarize([leaf_grads[leaf_index[id(fn.variable)]]])
            if summary is not None:
                produced[nid] = received[nid] = summary
    values = _to_host(produced, received)
    for node in g.nodes:
        if node.id in values:
            norm, fin_out, fin_in = values[node.id]
            node.grad_norm = float(norm)
            node.nonfinite = (not fin_out) or not math.isfinite(norm)
            node.nonfinite_origin = node.nonfinite and fin_in and node.kind == "op"


def annotate_watch(g: AutogradGraph, watch: Any) -> None:
    """Add a Watch's latest measurements to the parameter nodes of ``g``: the last
    recorded step's gradient norm (and its non-finite count, in red), and the last
    measured ``absmax`` with its step when that is an earlier step (on the CPU absmax is
    read every 10th recorded step: an unmeasured value is never shown as one). A
    parameter without a gradient at that step says so.

    Reads ``watch.history`` (a `graddbg.stats.History`: the last step, without building a
    frame) when there is one, else ``watch.stats`` (a DataFrame with at least step, name
    and norm: a loaded `graddbg.Run`)."""
    latest = _history_latest(watch) if hasattr(getattr(watch, "history", None), "last_recorded") \
        else _frame_latest(watch)
    if latest is None:
        return
    step, rows = latest
    for node in g.nodes:
        r = rows.get(node.name) if node.kind == "param" else None
        if r is None:
            continue
        if not r["has_grad"]:
            node.detail.append(f"step {step}: no gradient")
            continue
        parts = [f"step {step}: norm={_fmt_num(r['norm'])}"]
        if r["absmax_step"] >= 0:
            parts.append(f"absmax={_fmt_num(r['absmax'])}" + ("" if r["absmax_step"] == step
                                                              else f" (step {r['absmax_step']})"))
        node.detail.append(" ".join(parts))
        if r["nonfinite"] > 0:
            node.detail.append(f"non-finite: {r['nonfinite']}")
            node.attrs["fillcolor"] = _RED
            node.attrs["fontcolor"] = "white"


def _history_latest(watch: Any) -> Optional[Tuple[int, Dict[str, Dict[str, Any]]]]:
    """(last recorded step, name -> its measurements) from a Watch's History."""
    h = watch.history
    last = h.last_recorded()
    if last is None:
        return None
    absmax, absmax_step = h.latest("absmax")
    return last["step"], {name: {"norm": float(last["norm"][i]), "nonfinite": int(last["nonfinite"][i]),
                                 "has_grad": bool(last["has_grad"][i]), "absmax": float(absmax[i]),
                                 "absmax_step": int(absmax_step[i])} for i, name in enumerate(h.names)}


def _frame_latest(watch: Any) -> Optional[Tuple[int, Dict[str, Dict[str, Any]]]]:
    """The same from a ``.stats`` DataFrame (a loaded run)."""
    stats = getattr(watch, "stats", None)
    if stats is None or not hasattr(stats, "columns"):
        raise GraddbgTypeError(f"graph(watch=...): got {type(watch).__name__}, expected an object "
                               f"with a .stats DataFrame (a graddbg Watch)")
    missing = {"step", "name", "norm"} - set(stats.columns)
    if missing:
        raise GraddbgValueError(f"graph(watch=...): watch.stats lacks columns {sorted(missing)}; "
                                f"expected at least step, name and norm")
    if len(stats) == 0:
        return None
    step = int(stats["step"].max())
    measured = {}
    if "absmax" in stats.columns:
        known = stats[stats["absmax"].notna()]
        for name, a, s in zip(known["name"].astype(str), known["absmax"], known["step"]):
            measured[name] = (float(a), int(s))  # (rows are in step order: the last one stays)
    rows = {}
    for _, r in stats[stats["step"] == step].iterrows():
        name = str(r["name"])
        a, s = measured.get(name, (math.nan, -1))
        rows[name] = {"norm": float(r["norm"]), "nonfinite": int(r.get("nonfinite", 0) or 0),
                      "has_grad": bool(r.get("has_grad", True)), "absmax": a, "absmax_step": s}
    return step, rows


#: the outline of the node that made a NaN/Inf (`mark_producer`)
_MARK_COLOR = "#ff9800"


def _op_key(name: str) -> str:
    """``aten.linalg_vector_norm`` and ``LinalgVectorNormBackward0`` alike: ``linalgvectornorm``."""
    if name.startswith("aten."):
        name = name[5:].split(".")[0]
    elif "Backward" in name:
        name = name[:name.index("Backward")]
    return name.replace("_", "").lower()


def mark_producer(g: AutogradGraph, finding: Any) -> List[GraphNode]:
    """Outline (orange, thick) and label the op nodes of ``g`` that ``finding`` (a
    non-finite `graddbg.Anomaly`, or anything with ``op``, ``module``, ``step`` and
    ``source``) names as the producer: the autograd node of its op (``aten.div`` is drawn as
    ``DivBackward0``) in its module's cluster (``<loss>``: outside every module). Returns the
    nodes marked (none when the graph has no such node).

    Examples:
        >>> from types import SimpleNamespace
        >>> x = torch.zeros(2, requires_grad=True)
        >>> g = extract((x / x.abs()).sum())
        >>> nan = SimpleNamespace(op="aten.div", module="<loss>", step=3, source="train.py:12", value=float("nan"))
        >>> [n.name for n in mark_producer(g, nan)]
        ['DivBackward0']
        >>> 'penwidth="4"' in to_dot(g) and "made the NaN at step 3" in to_dot(g)
        True
    """
    op = getattr(finding, "op", None)
    if not op:
        return []
    module = getattr(finding, "module", None)
    path: ModulePath = () if module in (None, "", "<loss>", "<root>") else tuple(module.split("."))
    key = _op_key(op)
    found = [n for n in g.nodes if n.kind == "op" and n.module == path and _op_key(n.name) == key]
    value = getattr(finding, "value", math.nan)
    what = "Inf" if isinstance(value, float) and math.isinf(value) else "NaN"
    source = getattr(finding, "source", None)
    where = f" ({os.path.basename(source.rsplit(':', 1)[0])}:{source.rsplit(':', 1)[1]})" \
        if source and ":" in source else ""
    for n in found:
        n.attrs["color"], n.attrs["penwidth"] = _MARK_COLOR, "4"
        n.detail.append(f"made the {what} at step {getattr(finding, 'step', '?')}{where}")
    if found and op.startswith("aten."):  # made in the forward pass: the backward nodes that first read
        for n in g.nodes:                 # it (the loss's, typically) are not where it started
            n.nonfinite_origin = False
    return found


# --------------------------------------------------------------------------- collapse


def collapse(g: AutogradGraph, depth: int) -> AutogradGraph:
    """Draw every module at depth ``depth`` as one node (the root's children are depth 1).

    A module at depth ``depth`` becomes one ``"module"`` node, leaf or not: its ops, its
    parameters, its saved tensors and everything of its submodules are absorbed into it,
    and the node counts its ops (``GraphNode.ops``; with a single op, ``attrs["op"]``
    names it). Modules shallower than ``depth`` keep their own nodes (they become
    clusters), leaf modules included. Edges between absorbed nodes vanish; edges across
    are redirected to the module node (parallel edges merged).

    Args:
        g: an extracted graph whose nodes know their modules (extracted with a `ModuleTrace`).
        depth: the module depth drawn as single nodes, at least 1.

    Returns:
        AutogradGraph: a new graph; ``g`` is unchanged.

    Raises:
        GraddbgValueError: ``depth`` is not a positive int.

    Examples:
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh())
        >>> with trace_modules(model) as tr:
        ...     y = model(torch.randn(1, 3)).sum()
        >>> [(n.name, n.ops, n.attrs.get("op")) for n in collapse(extract(y, model=tr), 1).by_kind("module")]
        [('1', 1, 'TanhBackward0'), ('0', 2, None)]
    """
    _check_options(depth=depth)
    rep: Dict[str, str] = {}  # node id -> the id that stands for it
    groups: Dict[ModulePath, GraphNode] = {}
    nodes: List[GraphNode] = []
    for n in g.nodes:
        if len(n.module) < depth or n.kind == "output":
            rep[n.id] = n.id
            nodes.append(n)
            continue
        path = n.module[:depth]
        if path not in groups:
            groups[path] = GraphNode(id=f"m{len(groups)}", kind="module", name=".".join(path),
                                     module=path[:-1], key=0)
            if path in g.module_types:
                groups[path].attrs["type"] = g.module_types[path]
            nodes.append(groups[path])
        _absorb(groups[path], n)
        rep[n.id] = groups[path].id
    edges: Dict[Tuple[str, str, str], GraphEdge] = {}
    for e in g.edges:
        s, d = rep[e.src], rep[e.dst]
        if s != d:
            edges.setdefault((s, d, e.style), GraphEdge(s, d, e.style))
    return dataclasses.replace(g, nodes=nodes, edges=list(edges.values()))


def _absorb(m: GraphNode, n: GraphNode) -> None:
    """Fold node ``n`` into module node ``m``: op count, and the largest finite gradient."""
    if n.kind != "op":
        return
    m.ops += 1
    if m.ops == 1:
        m.attrs["op"] = n.name
    else:
        m.attrs.pop("op", None)
    if n.grad_norm is not None:
        m.nonfinite = m.nonfinite or n.nonfinite
        m.nonfinite_origin = m.nonfinite_origin or n.nonfinite_origin
        if not n.nonfinite:  # a module node shows the largest gradient inside it
            m.grad_norm = max(m.grad_norm or 0.0, n.grad_norm)


# --------------------------------------------------------------------------- DOT text

# characters that need care in a double-quoted DOT label: DOT's own, the entities graphviz
# reads, and those dot cannot take at all (control characters such as NUL end its scanner;
# lone surrogates cannot be encoded as UTF-8)
_ESCAPE_RE = re.compile('[\\\\"&<>\n\r\t\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]')
_ESCAPES = {"\\": "\\\\", '"': '\\"', "&": "&amp;", "<": "&lt;", ">": "&gt;",
            "\n": "\\n", "\r": "", "\t": " "}


def _escape_char(c: str) -> str:
    known = _ESCAPES.get(c)
    if known is not None:
        return known
    return f"\\\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\\\u{ord(c):04x}"  # shown as \x00, \ud800


def escape(text: str) -> str:
    r"""Escape ``text`` for a double-quoted DOT label.

    Backslashes, quotes, newlines, and ``& < >`` as entities (graphviz reads entities in
    labels); control characters (NUL included) and lone surrogates are shown as Python
    escapes (``\x00``, ``\ud800``). Braces and ``|`` need no escaping in the (non-record)
    shapes graddbg uses.

    Args:
        text: any string.

    Returns:
        str: the label text, safe inside ``"..."``.

    Examples:
        >>> print(escape('a"b<c>&d\\e'))
        a\"b&lt;c&gt;&amp;d\\e
        >>> print(escape("nul\x00 half\ud800"))
        nul\\x00 half\\ud800
    """
    text = str(text)
    if not _ESCAPE_RE.search(text):
        return text
    return _ESCAPE_RE.sub(lambda m: _escape_char(m.group(0)), text)


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
_HEADER = {
    "graddbg": ['\tgraph [fontname="Helvetica" newrank=true]\n',
                '\tnode [fontname=monospace fontsize=10 height=0.2 shape=box style="filled,rounded"]\n',
                '\tedge [arrowsize=0.6]\n'],
    "torchviz": ['\tnode [align=left fontname=monospace fontsize=10 height=0.2 ranksep=0.1 '
                 'shape=box style=filled]\n'],
}


def _grad_scale(g: AutogradGraph) -> Optional[Tuple[float, float]]:
    vals = [math.log10(n.grad_norm) for n in g.nodes
            if n.grad_norm is not None and not n.nonfinite and n.grad_norm > 0]
    if not vals:
        return None
    lo, hi = math.floor(min(vals)), math.ceil(max(vals))
    return float(lo), float(max(hi, lo + 1))


def _bins(scale: Tuple[float, float]) -> List[Tuple[float, float, str]]:
    """Log-scale bins (in log10 units) with their colours: one per decade, at most
    len(_PALETTE), the colours spread over the palette light to dark."""
    lo, hi = scale
    k, n = min(len(_PALETTE), int(hi - lo)), len(_PALETTE)
    step = (hi - lo) / k
    return [(lo + i * step, lo + (i + 1) * step, _PALETTE[round(i * (n - 1) / max(k - 1, 1))])
            for i in range(k)]


def _grad_color(v: float, scale: Tuple[float, float]) -> str:
    bins = _bins(scale)
    x = math.log10(v)
    return next((c for _, b, c in bins if x < b), bins[-1][2])


def _grad_look(n: GraphNode, scale: Optional[Tuple[float, float]], attrs: Dict[str, str]) -> Tuple[str, str]:
    """(fill colour, extra label line) of a node of an annotated graph; may set attrs."""
    if n.kind == "module":
        if n.nonfinite:
            fill, line = _RED, "non-finite inside"
        elif n.grad_norm is None:
            return _KIND_COLOR["module"], ""
        else:
            fill = _grad_color(n.grad_norm, scale) if scale and n.grad_norm > 0 else _GREY
            line = f"max |g|={_fmt_num(n.grad_norm)}"
    elif n.nonfinite:
        fill, line = _RED, "non-finite (origin)" if n.nonfinite_origin else "non-finite"
        if n.nonfinite_origin:
            attrs["penwidth"] = "3"
    elif n.grad_norm is None:
        return _NOGRAD, "no gradient"
    elif n.grad_norm == 0:
        return _GREY, "grad 0"
    else:
        fill = _grad_color(n.grad_norm, scale) if scale else _PALETTE[0]
        line = f"|g|={_fmt_num(n.grad_norm)}"
    if fill == _RED or fill in _PALETTE[-2:]:
        attrs["fontcolor"] = "white"
    return fill, line


def _node_line(n: GraphNode, style: str, scale: Optional[Tuple[float, float]], has_grads: bool) -> str:
    if style == "torchviz":
        if n.kind == "op":
            return f'\t{n.id} [label="{escape(n.name)}"]\n'
        lbl = f"{escape(n.name)}\\n {escape(_fmt_shape(n.shape))}"
        return f'\t{n.id} [label="{lbl}" fillcolor="{escape(n.attrs.get("fillcolor", "lightblue"))}"]\n'
    lines = [n.name]
    attrs: Dict[str, str] = {}
    if n.kind in ("param", "input", "output", "saved") and n.shape is not None:
        lines.append(_fmt_shape(n.shape))
    if n.kind == "module":
        lines += [n.attrs["type"]] if n.attrs.get("type") else []
        lines.append(n.attrs["op"] if n.ops == 1 and "op" in n.attrs else f"{n.ops} op" + "s" * (n.ops != 1))
        attrs["shape"] = "box3d"
    if n.kind == "note":
        attrs["shape"] = "note"
    lines.extend(n.detail)
    fill = _KIND_COLOR.get(n.kind, "lightgrey")
    if (has_grads and n.kind in ("op", "param", "input")) or n.kind == "module":
        fill, extra = _grad_look(n, scale, attrs)
        lines += [extra] if extra else []
    attrs["fillcolor"] = n.attrs.get("fillcolor", fill)
    if "fontcolor" in n.attrs:
        attrs["fontcolor"] = n.attrs["fontcolor"]
    for key in ("color", "penwidth"):  # (the outline of a marked node: see `mark_producer`)
        if key in n.attrs:
            attrs[key] = n.attrs[key]
    rest = "".join(f' {k}="{v}"' for k, v in attrs.items())
    return f'\t{n.id} [label="{_label(lines)}"{rest}]\n'


def _edge_line(e: GraphEdge) -> str:
    extra = {"dotted": " [style=dotted]", "undirected": " [dir=none]"}.get(e.style, "")
    return f"\t{e.src} -> {e.dst}{extra}\n"


def _cluster_lines(g: AutogradGraph, lines: Dict[str, str]) -> List[str]:
    """Node lines nested in one cluster per module, emitted with an explicit stack."""
    members: Dict[ModulePath, List[str]] = {}
    for n in g.nodes:
        members.setdefault(n.module, []).append(n.id)
    first: Dict[ModulePath, int] = {}  # first appearance of a module or its children
    for i, p in enumerate(members):
        for j in range(1, len(p) + 1):
            first.setdefault(p[:j], i)
    children: Dict[ModulePath, List[ModulePath]] = {}
    for p in sorted(first, key=lambda p: (first[p], p)):
        children.setdefault(p[:-1], []).append(p)
    body = [lines[i] for i in members.get((), [])]
    counter = 0
    stack: List[Tuple[bool, ModulePath]] = [(True, p) for p in reversed(children.get((), []))]
    while stack:
        opening, p = stack.pop()
        indent = "\t" * len(p)
        if not opening:
            body.append(indent + "}\n")
            continue
        mtype = g.module_types.get(p)
        label = _label([".".join(p)] + ([f"({mtype})"] if mtype else []))
        body.append(f"{indent}subgraph cluster_{counter} {{\n")
        body.append(f'{indent}\tlabel="{label}" ' + " ".join(_CLUSTER_STYLE) + "\n")
        counter += 1
        body.extend(indent + lines[i] for i in members.get(p, []))
        stack.append((False, p))
        stack.extend((True, c) for c in reversed(children.get(p, [])))
    return body


def _truncation_note(g: AutogradGraph) -> str:
    if g.walk_stopped:
        text = (f"graph truncated: showing {g.shown_nodes} of more than {g.total_nodes} nodes "
                f"(max_nodes={g.max_nodes}; the walk stops after {WALK_LIMIT} autograd nodes)")
    else:
        text = f"graph truncated: showing {g.shown_nodes} of {g.total_nodes} nodes (max_nodes={g.max_nodes})"
    return f'\ttruncated [label="{escape(text)}" shape=note fillcolor="{_KIND_COLOR["note"]}" fontcolor="#b30000"]\n'


def _legend(scale: Optional[Tuple[float, float]]) -> List[str]:
    out = ["\tsubgraph cluster_legend {\n",
           '\t\tlabel="gradient norm" style=rounded color="#9e9e9e" fontsize=10 fontname="Helvetica"\n']
    items = [(f"{10 ** a:.0e} .. {10 ** b:.0e}", color, "white" if color in _PALETTE[-2:] else "black")
             for a, b, color in (_bins(scale) if scale is not None else [])]
    items += [("zero", _GREY, "black"), ("non-finite", _RED, "white"), ("no gradient", _NOGRAD, "black")]
    for i, (text, color, font) in enumerate(items):
        out.append(f'\t\tlegend{i} [label="{escape(text)}" fillcolor="{color}" fontcolor="{font}"]\n')
        if i:
            out.append(f"\t\tlegend{i - 1} -> legend{i} [style=invis]\n")
    out.append("\t}\n")
    return out


def to_dot(g: AutogradGraph, *, cluster: bool = True) -> str:
    """DOT text for an extracted graph. Needs neither graphviz nor ``dot``.

    Args:
        g: the graph from `extract` (or `collapse`).
        cluster: group the nodes of each module into a ``subgraph cluster_...``.

    Returns:
        str: the DOT source, deterministic for a given graph.

    Examples:
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
    scale = _grad_scale(g) if g.has_grads else None
    with _gc_paused():
        lines = {n.id: _node_line(n, g.style, scale, g.has_grads) for n in g.nodes}
        body = list(_HEADER[g.style])
        if cluster and g.style == "graddbg":
            body += _cluster_lines(g, lines)
        else:
            body += [lines[n.id] for n in g.nodes]
        body += [_edge_line(e) for e in g.edges]
        if g.truncated:
            body.append(_truncation_note(g))
        if scale is not None or (g.has_grads and any(n.nonfinite for n in g.nodes)):
            body += _legend(scale)
        if g.caption:  # (after the clusters, which would otherwise inherit it as their label)
            body.append(f'\tgraph [label="{escape(g.caption)}" labelloc=t labeljust=l fontsize=12]\n')
        return "digraph {\n" + "".join(body) + "}\n"


# --------------------------------------------------------------------------- render


def render_source(source: str, format: str = "svg") -> bytes:
    """Lay out and render DOT text with Graphviz's ``dot`` program, through the ``graphviz`` package.

    Args:
        source: DOT text (`to_dot`, `Graph.source`).
        format: any output format ``dot`` knows: ``"svg"``, ``"png"``, ``"pdf"``, ...

    Returns:
        bytes: the rendered file's content.

    Raises:
        DotNotFoundError: ``dot`` is not on PATH; the message says how to install it.

    Examples:
        >>> render_source('digraph { a -> b }', "svg")[:5]  # doctest: +SKIP
        b'<?xml'
    """
    if format not in _FORMATS:
        raise GraddbgValueError(f"render(format=...): got {format!r}, expected one of {_FORMATS}")
    try:
        import graphviz
    except ImportError as exc:
        raise DotNotFoundError("graddbg renders through the graphviz Python package, which is not "
                               "installed: pip install graphviz. " + INSTALL_HINT) from exc
    data = source.encode("utf-8", "backslashreplace")  # escape() leaves no lone surrogate in labels
    try:
        return graphviz.pipe("dot", format, data, quiet=True)
    except graphviz.ExecutableNotFound as exc:
        raise DotNotFoundError(INSTALL_HINT) from exc
    except graphviz.CalledProcessError as exc:
        said = (exc.stderr or b"").decode("utf-8", "replace")[:2000]
        raise GraddbgError(f"dot -T{format} failed (exit {exc.returncode}): {said}") from exc


_SVG_SIZE_RE = re.compile(r'<svg width="([0-9.]+)pt" height="([0-9.]+)pt"')


def _fit_svg(svg: str) -> str:
    """Make the SVG scale down to the notebook's width (it keeps its viewBox)."""
    return _SVG_SIZE_RE.sub(
        lambda m: f'<svg width="{m.group(1)}pt" height="{m.group(2)}pt" '
                  f'style="max-width: 100%; height: auto;"', svg, count=1)


# --------------------------------------------------------------------------- Graph


class Graph:
    """An autograd graph ready to display: ``.source`` (DOT), ``.digraph``, ``.render()``.

    ``.extracted`` is the plain `AutogradGraph` (``.nodes``, ``.edges``).
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

        body = self.to_dot()[len("digraph {\n"):-len("}\n")]
        return graphviz.Digraph(body=body.splitlines(keepends=True))

    def render(self, path: Union[str, "os.PathLike[str]"], format: str = "svg") -> "os.PathLike[str]":
        """Render with ``dot`` (see `render_source`) into ``path`` (``format``: svg,
        png or pdf); returns the path. The file is written atomically (a temporary file in
        the same folder, then a rename): a failed write leaves the previous file whole and
        raises a `GraddbgError` naming the path."""
        out = as_path(path, "path")  # checked before dot runs
        return write_atomic(out, render_source(self.to_dot(), format))

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
        more = "more than " if g.walk_stopped else ""
        return (f"<graddbg.Graph: {len(g.nodes)} nodes, {len(g.edges)} edges"
                + (f", truncated from {more}{g.total_nodes}" if g.truncated else "") + ">")


def _run_roots(roots: Any, model: Any) -> Tuple[Any, Any]:
    """(roots, model) with a callable ``roots`` run, under `trace_modules` of
    ``model`` when it is a module (the trace then replaces it)."""
    if not callable(roots) or isinstance(roots, (torch.Tensor, nn.Module)):
        return roots, model
    if model is None or isinstance(model, ModuleTrace):
        return roots(), model
    with trace_modules(model) as tr:
        out = roots()
    return out, tr


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
    mark: Any = None,
    caption: Optional[str] = None,
) -> Graph:
    """Draw the autograd graph behind ``roots``, grouped by the modules that created it.

    Args:
        roots: a tensor, a tuple/list/dict of tensors, an object with tensor fields
            (dataclass, ModelOutput), or a callable returning one of those; a callable is run
            under `trace_modules` of ``model`` so that every op lands in its module's cluster.
        model: an ``nn.Module`` (names parameters; with precomputed roots only parameters and
            the ops that use them are clustered) or a `ModuleTrace`.
        params: extra ``{name: tensor}`` to name leaf tensors.
        grads: run a backward pass (keeping the graph, leaving ``.grad`` alone; roots that
            are not scalars get a gradient of ones) and colour each node by the norm of the
            gradient it produced, on a log scale with a legend; non-finite ones are red (the
            node that turned finite gradients non-finite is marked "origin"), zero ones grey.
        cluster: draw each module's nodes in a box of their own.
        depth: modules at depth ``depth`` (the root's children are depth 1, their children
            depth 2, ...) are drawn as one node each, leaf or not, holding everything inside
            them (submodules, ops, parameters), labelled with the qualified name, the class
            and the number of ops (the op's own name when it holds exactly one, e.g.
            ``stem.0 / Conv2d / ConvolutionBackward0``); modules shallower than ``depth`` are
            clusters; ops of the root module or outside the model stay top-level. None
            (default): every module is a cluster.
        show_saved: also draw the tensors each node saved for backward.
        max_nodes: truncate big graphs with a note (None: no limit); the walk itself stops
            after ``WALK_LIMIT`` autograd nodes, whatever ``max_nodes``.
        watch: a `Watch` whose latest statistics are added to the parameter nodes.
        style: ``"graddbg"`` (default) or ``"torchviz"``, which draws what
            ``torchviz.make_dot`` draws (it calls it).
        mark: a non-finite `graddbg.Anomaly` (from ``w.anomalies``): the node of its op in
            its module is outlined and labelled as the one that made the NaN/Inf (see
            `mark_producer`); draw the graph of that step's batch to see it.
        caption: a line drawn above the graph (say which step it shows).

    Returns:
        Graph: ``.source`` (DOT text), ``.digraph`` (a ``graphviz.Digraph``),
            ``.render(path, format="svg")``, and an SVG display in notebooks.

    Raises:
        GraddbgTypeError: ``model`` is neither a module nor a trace.
        GraddbgValueError: ``roots`` gives no tensor with a graph, an unknown ``style``, a
            bad ``depth`` or ``max_nodes``, or options ``style="torchviz"`` does not take.

    Examples:
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
    extras = [a for a, given in (("grads=True", grads), (f"depth={depth!r}", depth is not None),
                                 ("watch=", watch is not None), ("mark=", mark is not None)) if given]
    _check_options(style, max_nodes, depth, extras)
    _resolve_model(model)  # before running a callable roots
    roots, model = _run_roots(roots, model)
    g = extract(roots, model=model, params=params, grads=grads, show_saved=show_saved,
                max_nodes=max_nodes, style=style)
    if watch is not None:
        annotate_watch(g, watch)
    if mark is not None:
        mark_producer(g, mark)
    g.caption = caption or ""
    if depth is not None:
        g = collapse(g, depth)
        g.caption = caption or ""
    return Graph(g, cluster=cluster and style == "graddbg")
