"""What the autograd graph of the loss shows: harmful patterns on the path from the
parameters to the loss (``loss_pattern``), tensors trained through the loss that are not
parameters of the model (``hidden_param``), and, for a trainable parameter cut off from the
loss, what cut it (``unused_param``).

The graph is read while a backward pass runs through the model's output (the loss itself
is found as the tensor handed to ``backward()``, in the frames of the thread that called it),
on the first backward passes and then on a thinning schedule (passes 10, 100, 1000, ...):
a walk of the graph's nodes, no device work.
"""
from __future__ import annotations

import contextlib
import dataclasses

import sys
import threading
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from graddbg._args import LOSS_GRAPH
from graddbg._model import in_backward, is_dtensor, tensors_in, unwrap
from graddbg._source import is_internal
from graddbg.checks.base import Check, Finding, PolicyCheck, Step, Watched, finding
from graddbg.checks.ledger import LedgerKeeper

__all__ = ["LossGraph", "ConstantLossTerm", "loss_patterns", "graph_roots", "handed_loss", "UNKNOWN_LOSS", "LossSum", "walk", "CutOff"]

#: nodes that only move values around: looked through when asking what fed a loss
_PASS = {"ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0", "PermuteBackward0", "TransposeBackward0",
         "TBackward0", "CloneBackward0", "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2",
         "SqueezeBackward3", "SqueezeBackward4", "UnsqueezeBackward0", "SliceBackward0", "SelectBackward0",
         "ToCopyBackward0", "ContiguousBackward0", "AliasBackward0", "IndexBackward0", "FlattenBackward0",
         "UnflattenBackward0"}
#: element-wise losses that compare an input with a target of the same shape
_ELEMENTWISE = {"MseLossBackward0": "mse_loss", "L1LossBackward0": "l1_loss", "SmoothL1LossBackward0": "smooth_l1_loss",
                "HuberLossBackward0": "huber_loss", "BinaryCrossEntropyBackward0": "binary_cross_entropy",
                "BinaryCrossEntropyWithLogitsBackward0": "binary_cross_entropy_with_logits"}
_LINEAR = {"AddmmBackward0", "MmBackward0", "BmmBackward0", "LinearBackward0", "ConvolutionBackward0"}
MAX_NODES = 50_000


def _name(node: Any) -> str:
    return type(node).__name__


def _inputs(node: Any) -> Iterator[Any]:
    for nxt, _ in getattr(node, "next_functions", ()):
        if nxt is not None:
            yield nxt


def _fed_by(node: Any) -> Optional[Any]:
    """The node whose output is ``node``'s first differentiable input, looking through
    nodes that only move values (views, copies, dtype casts)."""
    cur = next(_inputs(node), None)
    for _ in range(16):
        if cur is None or _name(cur) not in _PASS:
            return cur
        cur = next(_inputs(cur), None)
    return cur


def _shape(node: Any) -> Optional[Tuple[int, ...]]:
    """The shape of ``node``'s forward output (from its input metadata), when known."""
    try:
        meta = node._input_metadata
        return tuple(int(d) for d in meta[0].shape) if meta else None
    except (AttributeError, RuntimeError, TypeError, IndexError):
        return None


def walk(roots: Sequence[Any], limit: int = MAX_NODES) -> List[Any]:
    """The nodes reachable from ``roots`` (autograd nodes), each once, iteratively."""
    seen: Set[int] = set()
    order: List[Any] = []
    stack = [r for r in roots if r is not None]
    while stack and len(order) < limit:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        order.append(node)
        stack.extend(_inputs(node))
    return order


def _backward_frame(thread: int) -> Any:
    """The frame of torch's ``_engine_run_backward`` in ``thread`` (the caller of the
    backward pass), or None."""
    frame = sys._current_frames().get(thread)
    for _ in range(64):
        if frame is None or frame.f_code.co_name == "_engine_run_backward":
            return frame
        frame = frame.f_back
    return None


def graph_roots(thread: int) -> List[Any]:
    """The autograd nodes of the tensors a running ``backward()`` / ``autograd.grad`` was
    called on, from the frames of ``thread`` (the caller of the backward pass)."""
    frame = _backward_frame(thread)
    if frame is None:
        return []
    outs = frame.f_locals.get("t_outputs", ())
    return [t.grad_fn for t in outs if isinstance(t, Tensor) and t.grad_fn is not None]


@dataclasses.dataclass(frozen=True)
class StrayLoss:
    """A loss in the user's frame whose autograd graph reaches parameters, none of them
    watched: what a step without gradients was computed through instead."""

    name: str  #: the local variable that holds the loss
    where: str  #: "file:line" of the user's frame
    owner: str  #: the module holding those parameters, as the frame names it ("" when none found)
    owner_type: str  #: its class
    params: Tuple[str, ...]  #: those parameters, as the owner names them (their shapes without an owner)
    ran: bool  #: they hold gradients: a backward pass ran through them


def stray_loss(watched: Sequence[Tensor]) -> Optional[StrayLoss]:
    """When a step finds no watched gradient: a tensor with an autograd graph in the frame of
    the user's code (the first frame outside torch and graddbg) that reaches parameters of
    which none is watched (the graph's structure outlives backward), and the module of that
    frame's locals (or of ``self``'s attributes) that holds them. A host walk of one graph,
    made only then; None when there is no such tensor."""
    ids = {id(p) for p in watched}
    frame = sys._getframe(1)
    while frame is not None and is_internal(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return None
    local = dict(frame.f_locals)
    for name, t in local.items():
        if not isinstance(t, Tensor) or t.grad_fn is None:
            continue
        leaves = [n.variable for n in walk([t.grad_fn]) if _name(n) == "AccumulateGrad"]
        if not leaves or any(id(v) in ids for v in leaves):
            continue
        owner, owner_type, names = _owner(local, {id(v): v for v in leaves})
        params = tuple(names) if names else tuple(str(list(v.shape)) for v in leaves)
        return StrayLoss(name, f"{frame.f_code.co_filename}:{frame.f_lineno}", owner, owner_type, params,
                         any(v.grad is not None for v in leaves))
    return None


def _owner(local: Dict[str, Any], leaves: Dict[int, Tensor]) -> Tuple[str, str, List[str]]:
    """The module in ``local`` (or among ``self``'s attributes) holding most of ``leaves``."""
    candidates = [(k, v) for k, v in local.items() if isinstance(v, nn.Module)]
    me = local.get("self")
    if me is not None and not isinstance(me, nn.Module):
        candidates += [(f"self.{k}", v) for k, v in vars(me).items() if isinstance(v, nn.Module)]
    best: Tuple[str, str, List[str]] = ("", "", [])
    for k, m in candidates:
        names = [n for n, p in m.named_parameters() if id(p) in leaves]
        if len(names) > len(best[2]):
            best = (k, type(m).__name__, names)
    return best


def library_owner(root: nn.Module, module: str) -> Optional[Tuple[str, str, str]]:
    """The innermost module on ``module``'s path (from ``root``) whose class is not torch's:
    ``(its path, its class, its package)`` when a third-party library defines that class (a
    file under site-packages or dist-packages), so that the library decides whether the
    module's output is used (BERT's pooler); None when the class is the user's, or there is
    none but torch's."""
    parts = module.split(".") if module else []
    for k in range(len(parts), -1, -1):
        path = ".".join(parts[:k])
        try:
            m = root.get_submodule(path) if path else root
        except AttributeError:
            continue
        name = type(m).__module__
        if name.split(".")[0] == "torch":
            continue
        file = getattr(sys.modules.get(name), "__file__", None) or ""
        if ("site-packages" in file or "dist-packages" in file) and name.split(".")[0] != "graddbg":
            return path, type(m).__name__, name.split(".")[0]
        return None
    return None


#: what `handed_loss` returns for a backward pass whose loss cannot be summed
UNKNOWN_LOSS = object()


def handed_loss(threads: Sequence[int]) -> Any:
    """The loss handed to the running ``backward()`` call, found in the frames of the first of
    ``threads`` that runs one (the caller of the backward pass): that scalar tensor, detached
    (a DTensor's local value), no device work; None when the running pass accumulates no
    gradient (``torch.autograd.grad``: nothing to sum); `UNKNOWN_LOSS` when it cannot be
    summed: a non-scalar, several tensors, an explicit ``gradient=`` / ``grad_tensors=``, a
    call that did not come through ``torch.autograd.backward``, or no such call found.

    Examples:
        >>> handed_loss([threading.get_ident()]) is UNKNOWN_LOSS   # (outside a backward pass)
        True
    """
    frame = next((f for f in map(_backward_frame, threads) if f is not None), None)
    if frame is None:
        return UNKNOWN_LOSS
    local = frame.f_locals
    if not (local.get("kwargs") or {}).get("accumulate_grad", True):
        return None
    caller = frame.f_back
    outs = local.get("t_outputs", ())
    if caller is None or caller.f_code.co_name != "backward" or "grad_tensors" not in caller.f_locals \
            or caller.f_locals["grad_tensors"] is not None or len(outs) != 1:
        return UNKNOWN_LOSS
    t = outs[0]
    if not isinstance(t, Tensor) or t.numel() != 1:
        return UNKNOWN_LOSS
    return t.detach().to_local() if is_dtensor(t) else t.detach()


class LossSum:
    """The sum of the losses handed to ``backward()`` in one step, kept on their device (no
    host synchronisation; it rides the step's read-back), unscaled by the GradScaler's scale
    in force; unknown for the whole step when one of its passes' loss is (see `handed_loss`).

    Examples:
        >>> s = LossSum(); s.take() is None       # (no backward pass: no loss)
        True
    """

    def __init__(self) -> None:
        self._sum: Optional[Tensor] = None  # the unscaled losses
        self._raw: Optional[Tensor] = None  # losses handed while no loss scale was known
        self._unknown = False

    def add(self, scale: Optional[Tensor]) -> None:
        """At the end of a backward pass: its loss, divided by ``scale`` (the GradScaler's
        scale in force, a device tensor) when there is one."""
        t = handed_loss((threading.get_ident(), threading.main_thread().ident))
        if t is None:
            return
        if t is UNKNOWN_LOSS:
            self._unknown = True
            return
        v = t.reshape(()).to(torch.float32 if t.device.type == "mps" else torch.float64)
        if scale is not None:
            self._sum = _plus(self._sum, v / scale.to(v.device, v.dtype))
        else:
            self._raw = _plus(self._raw, v)

    def adopt_scale(self, scale: Tensor) -> None:
        """A GradScaler found after this step's first passes: their losses were scaled by it."""
        if self._raw is not None:
            self._sum, self._raw = _plus(self._sum, self._raw / scale.to(self._raw.device, self._raw.dtype)), None

    def take(self) -> Optional[Tensor]:
        """This step's sum (a device scalar; None when unknown or without a loss), and a new
        sum begins for the next step."""
        total = None if self._unknown else _plus(self._sum, self._raw)
        self._sum = self._raw = None
        self._unknown = False
        return total


def _plus(a: Optional[Tensor], b: Optional[Tensor]) -> Optional[Tensor]:
    if a is None or b is None:
        return b if a is None else a
    return a + b.to(a.device, non_blocking=True)


def scaler_of_backward(thread: int) -> Any:
    """An enabled ``torch.amp.GradScaler`` held by a caller of the running backward pass (the
    user's loop, whose ``scaler.scale(loss).backward()`` this is), or None."""
    frame = _backward_frame(thread)
    for _ in range(10):  # (torch's backward calls, graddbg.blame.LossTape's if it saw the call, the user's)
        if frame is None:
            return None
        for v in list(frame.f_locals.values()):
            # (by type only: an isinstance check would touch every local, a dead weak proxy raises
            # and a deprecated torch object warns)
            if issubclass(type(v), torch.amp.GradScaler) and v.is_enabled() and getattr(v, "_scale", None) is not None:
                return v
        frame = frame.f_back
    return None


def loss_patterns(nodes: Sequence[Any]) -> List[Tuple[str, str, str]]:
    """``[(pattern, evidence, fix)]`` for the harmful patterns among ``nodes``."""
    found = []
    for node in nodes:
        name = _name(node)
        if name in ("NllLossBackward0", "NllLoss2DBackward0"):
            found += _nll(node)
        elif name == "KlDivBackward0":
            src = _fed_by(node)
            if src is not None and _name(src) == "SoftmaxBackward0":
                found.append(("kl_div on probabilities", "kl_div's input comes straight from softmax (probabilities), "
                              "but kl_div expects log-probabilities as its input",
                              "pass F.log_softmax(x, dim) as kl_div's input"))
        if name in _ELEMENTWISE:
            found += _elementwise(node, _ELEMENTWISE[name])
    return list(dict.fromkeys(found))


def _nll(node: Any) -> List[Tuple[str, str, str]]:
    src = _fed_by(node)
    if src is None:
        return []
    kind = _name(src)
    if kind == "SoftmaxBackward0":
        return [("nll_loss on probabilities", "nll_loss's input comes straight from softmax: probabilities, "
                 "not the log-probabilities nll_loss expects", "use F.log_softmax instead of softmax (or "
                 "cross_entropy on the logits)")]
    if kind == "LogBackward0" and (_fed_by(src) is not None and _name(_fed_by(src)) == "SoftmaxBackward0"):
        return [("log(softmax(x))", "the loss takes log(softmax(x)): a probability that underflows to 0 gives "
                 "-inf and a NaN gradient", "use F.log_softmax(x, dim) (or cross_entropy on the logits)")]
    if kind in _LINEAR:
        return [("nll_loss on raw scores", f"nll_loss's input is a layer's raw output ({kind}), with no "
                 f"log_softmax: the loss is unbounded below and drives those scores to infinity",
                 "use F.cross_entropy on the logits, or F.log_softmax before nll_loss")]
    if kind != "LogSoftmaxBackward0":
        return []
    out = []
    dim, shape = getattr(src, "_saved_dim", None), _shape(src)
    fed = next(_inputs(node), None)  # (what nll_loss reads: the classes along dim 1, or dim 0 unbatched)
    classes = _shape(fed) if fed is not None else None
    if dim is not None and shape and classes:
        dim = dim - 2 ** 64 if dim >= 2 ** 63 else dim  # (an unsigned read of a negative dim)
        n_classes = classes[1] if len(classes) >= 2 else classes[0]
        if -len(shape) <= dim < len(shape) and shape[dim] != n_classes:
            out.append(("log_softmax over the wrong dim", f"log_softmax normalises over dim {dim} (of size "
                        f"{shape[dim]}) of a tensor of shape {shape}, but nll_loss reads {n_classes} classes along "
                        f"dim {1 if len(classes) >= 2 else 0} of its input {classes}",
                        "normalise over the class dimension, or pass the logits to cross_entropy"))
    inner = _fed_by(src)
    if inner is not None and _name(inner) == "SoftmaxBackward0":
        out.append(("softmax before cross_entropy", "cross_entropy (log_softmax + nll_loss) is applied to the "
                    "output of a softmax: a double softmax, whose gradients are squashed and whose loss cannot go "
                    "below a floor", "pass the logits (remove the softmax; apply it only for predictions)"))
    return out


def _elementwise(node: Any, loss: str) -> List[Tuple[str, str, str]]:
    out = []
    src = next(_inputs(node), None)
    if src is not None and _name(src) == "ExpandBackward0":
        before = tuple(int(d) for d in getattr(src, "_saved_self_sym_sizes", ()) or ())
        after = _shape(src)
        if before and after and before != after:
            out.append(("a target that broadcasts", f"{loss}'s input of shape {before} was broadcast to {after} "
                        f"against the target: every output is compared with every target", "make the input and "
                        "the target the same shape (e.g. output.squeeze(-1), or target.unsqueeze(-1))"))
    fed = _fed_by(node)
    if loss == "binary_cross_entropy_with_logits" and fed is not None and _name(fed) == "SigmoidBackward0":
        out.append(("sigmoid before BCEWithLogitsLoss", "binary_cross_entropy_with_logits is applied to the output "
                    "of a sigmoid: a double sigmoid (it applies its own), so the loss cannot reach 0 and its "
                    "gradients shrink", "pass the logits (remove the sigmoid), or use binary_cross_entropy"))
    return out


class LossGraph(Check):
    """Reads the loss's autograd graph on scheduled backward passes; its findings are made
    at the next step boundary."""

    STATE = ("_reported",)

    after = (LedgerKeeper,)

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        opts = ctx.options
        self._policies = {"loss_pattern": opts.loss_pattern, "hidden_param": opts.hidden_param}
        self._on = any(p is not None for p in self._policies.values())
        self._passes = 0
        self._thread = threading.get_ident()
        self._found: List[Tuple[str, Any]] = []
        self._reported: Set[str] = set()
        self._cut = CutOff(ctx) if opts.unused_param is not None and ctx.optimizer is not None else None
        #: the loose parameter leaves (neither the model's nor held by it) of the last walk that had any
        self._strays: Optional[Dict[int, Any]] = None

    def on_forward(self, fwd: Any) -> None:
        self._thread = threading.get_ident()  # (the thread that runs the loop calls backward)
        if self._cut is not None:
            self._cut.forward_began()

    def on_output_grad(self) -> None:
        """A backward pass reached the model's output (inside the backward pass)."""
        n, self._passes = self._passes, self._passes + 1
        waiting = self._cut is not None and self._cut.waiting()
        if not (self._on or waiting) or not (LOSS_GRAPH.includes(n) or waiting) or self.ctx.replaying:
            return
        roots = graph_roots(self._thread)
        if not roots:
            return
        if self.ctx.options.scaler is None and n < 3:
            scaler = scaler_of_backward(self._thread)
            if scaler is not None:
                self.ctx.adopt_scaler(scaler)
        nodes = walk(roots)
        if waiting:
            self._cut.conclude(nodes)
        if not self._on:
            return
        if self._policies["loss_pattern"] is not None:
            self._found += [("loss_pattern", p) for p in loss_patterns(nodes) if p[0] not in self._reported]
        if self._policies["hidden_param"] is not None or self.ctx.options.orphan_param is not None:
            self._found += [("hidden_param", h) for h in self._hidden(nodes)]

    def _hidden(self, nodes: Sequence[Any]) -> List[Tuple[str, Tuple[int, ...]]]:
        """Leaves of the graph that are not the watched parameters: a tensor attribute with
        requires_grad or a module kept in a plain list (held by the model, not registered),
        parameters made anew in each forward pass, and parameters of the model that replaced
        watched ones (``orphan_param`` when no param group holds them)."""
        if any(is_dtensor(p) for p in self.ctx.params):
            return []  # (sharded: the graph's leaves are the unsharded copies FSDP makes, not the watched tensors)
        watched = {id(p) for p in self.ctx.params}
        leaves = [n.variable for n in nodes if _name(n) == "AccumulateGrad"]
        strays = {id(v): v for v in leaves if id(v) not in watched}
        if not strays:
            return []
        root = unwrap(self.ctx.model)
        now = {id(p): n for n, p in root.named_parameters()}
        self._replaced(strays, now)
        held = _held_tensors(root)
        out = [(where, tuple(strays[i].shape)) for i, where in held.items()
               if i in strays and where not in self._reported]
        casts = _held_casts(root, strays)
        self._found += [("hidden_cast", c) for c in casts.values() if c[0] not in self._reported]
        loose = [v for i, v in strays.items() if isinstance(v, nn.Parameter) and i not in now and i not in held
                 and i not in casts]
        # parameters that are neither the model's nor held by it: another model's (a GAN's other
        # network: the same tensors at every pass that has them), or made anew in each forward pass
        if loose:
            before, self._strays = self._strays, {id(v): weakref.ref(v) for v in loose}
            if before and not any(id(v) in before and before[id(v)]() is v for v in loose):
                self._found.append(("made_in_forward", tuple(tuple(v.shape) for v in loose)))
        return out

    def _replaced(self, strays: Dict[int, Tensor], now: Dict[int, str]) -> None:
        """Parameters of the model now that the watch did not start with and that no param
        group holds: a layer replaced after the optimizer (and the watch) began."""
        opt = self.ctx.optimizer
        if opt is None or self.ctx.options.orphan_param is None:
            return
        held = {id(p) for g in opt.param_groups for p in g["params"]}
        names = [now[i] for i in strays if i in now and i not in held and now[i] not in self._reported]
        if names:
            self._found.append(("orphan_param", tuple(names)))

    def read(self, step: Step) -> List[Finding]:
        found, self._found = self._found, []
        out: List[Finding] = []
        if self._cut is not None:
            out += self._cut.read(step)
        patterns = [p for kind, p in found if kind == "loss_pattern" and p[0] not in self._reported]
        if self._policies["loss_pattern"] is not None:
            patterns += self._called(step)
        if patterns:
            self._reported.update(p[0] for p in patterns)
            out.append(self._pattern_finding(step.index, list(dict.fromkeys(patterns))))
        hidden = list(dict.fromkeys(h for kind, h in found if kind == "hidden_param" and h[0] not in self._reported))
        made = [shapes for kind, shapes in found if kind == "made_in_forward"]
        casts = list(dict.fromkeys(c for kind, c in found if kind == "hidden_cast" and c[0] not in self._reported))
        if casts and self._policies["hidden_param"] is not None:
            self._reported.update(c[0] for c in casts)
            out.append(self._cast_finding(step.index, casts))
        if made and "<made in forward>" not in self._reported and self._policies["hidden_param"] is not None:
            self._reported.add("<made in forward>")
            out.append(self._made_finding(step.index, made[0]))
        if hidden and self._policies["hidden_param"] is not None:
            self._reported.update(h[0] for h in hidden)
            out.append(self._hidden_finding(step.index, hidden))
        replaced = list(dict.fromkeys(n for kind, ns in found if kind == "orphan_param" for n in ns
                                      if n not in self._reported))
        if replaced:
            self._reported.update(replaced)
            out.append(self._replaced_finding(step.index, replaced))
        return out

    def _called(self, step: Step) -> List[Tuple[str, str, str]]:
        """Patterns the loss tape saw at a call (kl_div given probabilities), with its line."""
        tape = getattr(step.tapped, "tape", None)
        out = []
        for what, line in getattr(tape, "patterns", ()):
            if what == "kl_div on probabilities" and what not in self._reported:
                out.append((what, f"kl_div's input at {_at(line)} comes straight from softmax (probabilities), but "
                            f"kl_div expects log-probabilities as its input, so the loss can go below 0 and does "
                            f"not measure the divergence", "pass F.log_softmax(x, dim) as kl_div's input"))
        return out[:1]

    def _cast_finding(self, index: int, casts: List[Tuple[str, str, Tuple[int, ...]]]) -> Finding:
        shown_ = ", ".join(f"{w} (shape {tuple(sh)}, made by {op})" for w, op, sh in casts[:6])
        msg = (f"graddbg: parameters registered nowhere, at step {index}: the model holds {shown_}, the result of an "
               f"op on an nn.Parameter, not the Parameter: the loss's gradients reach that Parameter, but it belongs "
               f"to no module (model.parameters() does not list it), so the optimizer never updates it. Likely "
               f"cause: a cast after wrapping, as in nn.Parameter(t).float() or nn.Parameter(t).to(device), which "
               f"return a plain tensor. Fix: cast before wrapping: nn.Parameter(t.float()).")
        return finding("hidden_param", index, [c[0] for c in casts], [], msg, self._policies["hidden_param"],
                       self.ctx.rank)

    def _made_finding(self, index: int, shapes: Tuple[Tuple[int, ...], ...]) -> Finding:
        shown = ", ".join(str(x) for x in shapes[:6])
        msg = (f"graddbg: parameters made anew in every forward pass, at step {index}: {len(shapes)} nn.Parameter(s) "
               f"(shapes {shown}) reach the loss and receive gradients, but they belong to no module of the model "
               f"and are new tensors at each backward pass (not the ones of the pass before): a layer built inside "
               f"forward() is initialised again at every step, is not in model.parameters(), and is never trained. "
               f"Fix: build the layer in __init__ (self.layer = nn.Linear(...)) and call it in forward().")
        return finding("hidden_param", index, [], [], msg, self._policies["hidden_param"], self.ctx.rank,
                       value=float(len(shapes)))

    def _replaced_finding(self, index: int, names: List[str]) -> Finding:
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        msg = (f"graddbg: parameters outside the optimizer at step {index}: {shown} reach the loss and receive "
               f"gradients, but they are not the tensors the watch and the optimizer started with: the model's "
               f"attribute now holds a new parameter (a layer or an embedding assigned after the optimizer was "
               f"built), and no param group of {type(self.ctx.optimizer).__name__} holds it, so it never trains "
               f"(and a weight tied to the old one is tied no more). Fix: replace or load layers before building "
               f"the optimizer (or copy the new values in place: with torch.no_grad(): layer.weight.copy_(...)).")
        return finding("orphan_param", index, names, [n.rpartition(".")[0] for n in names], msg,
                       self.ctx.options.orphan_param, self.ctx.rank, value=float(len(names)))

    def _pattern_finding(self, index: int, patterns: List[Tuple[str, str, str]]) -> Finding:
        parts = "; ".join(f"{what}: {evidence}. Fix: {fix}" for what, evidence, fix in patterns)
        msg = (f"graddbg: a harmful pattern on the path to the loss at step {index} (read from the loss's autograd "
               f"graph and its code): {parts}.")
        return finding("loss_pattern", index, [], [], msg, self._policies["loss_pattern"], self.ctx.rank,
                       value=float(len(patterns)))

    def _hidden_finding(self, index: int, hidden: List[Tuple[str, Tuple[int, ...]]]) -> Finding:
        names = [h[0] for h in hidden]
        shown = ", ".join(f"{n} (shape {tuple(s)})" for n, s in hidden[:6])
        msg = (f"graddbg: tensors trained through the loss that are not parameters, at step {index}: {shown} "
               f"require grad and receive gradients from the loss, and the model holds them, but they are not "
               f"registered parameters: model.parameters() does not list them, so the optimizer never updates "
               f"them (nor does .to(), state_dict() or DDP see them). Likely cause: a tensor attribute made with "
               f"requires_grad=True instead of nn.Parameter, or layers kept in a plain Python list or dict instead "
               f"of nn.ModuleList / nn.ModuleDict. Fix: wrap it in nn.Parameter(...), or use nn.ModuleList.")
        return finding("hidden_param", index, names, [n.rpartition(".")[0] for n in names], msg,
                       self._policies["hidden_param"], self.ctx.rank, value=float(len(names)))

    def params_added(self, k: int) -> None:
        if self._cut is not None:
            self._cut.widen(k)

    def reported_unused(self) -> Set[str]:
        """The parameters already named as cut off from the loss (``unused_param``)."""
        return set() if self._cut is None else set(self._cut.reported)

    def close(self) -> None:
        self._found = []
        if self._cut is not None:
            self._cut.close()


def _held_tensors(root: nn.Module) -> Dict[int, str]:
    """``{id(tensor): where}`` for the tensors a model holds outside its registered
    parameters: tensor attributes of its modules, and the parameters and tensors of modules
    or tensors kept in plain lists, tuples and dicts."""
    out: Dict[int, str] = {}
    for mname, m in root.named_modules():
        prefix = f"{mname}." if mname else ""
        for attr, v in vars(m).items():
            if attr.startswith("_"):
                continue
            for where, t in _tensors_in(v, prefix + attr):
                out.setdefault(id(t), where)
    return out


def _held_casts(root: nn.Module, strays: Dict[int, Tensor]) -> Dict[int, Tuple[str, str, Tuple[int, ...]]]:
    """``{id(parameter): (where, op, shape)}`` for the tensor attributes of the model's modules
    computed from a parameter that is among ``strays`` (registered nowhere) by one or two ops
    (``nn.Parameter(t).float()``: the module holds the cast, the Parameter is lost)."""
    out: Dict[int, Tuple[str, str, Tuple[int, ...]]] = {}
    for mname, m in root.named_modules():
        for attr, v in vars(m).items():
            fn = getattr(v, "grad_fn", None) if isinstance(v, Tensor) and not attr.startswith("_") else None
            if fn is None:
                continue
            op = _name(fn).replace("Backward0", "").replace("Backward1", "")
            for node in (fn, *(n for n, _ in fn.next_functions if n is not None)):
                for leaf, _ in node.next_functions:
                    var = getattr(leaf, "variable", None) if leaf is not None else None
                    if var is not None and id(var) in strays and isinstance(var, nn.Parameter):
                        out.setdefault(id(var), (f"{mname}.{attr}" if mname else attr, op, tuple(v.shape)))
    return out


def _tensors_in(v: Any, where: str) -> Iterator[Tuple[str, Tensor]]:
    if isinstance(v, Tensor) and not isinstance(v, nn.Parameter):
        yield where, v
    elif isinstance(v, (list, tuple)):
        for k, x in enumerate(v[:256]):
            yield from _container_item(x, f"{where}[{k}]")
    elif isinstance(v, dict):
        for k, x in list(v.items())[:256]:
            yield from _container_item(x, f"{where}[{k!r}]")


def _container_item(x: Any, where: str) -> Iterator[Tuple[str, Tensor]]:
    if isinstance(x, nn.Module):
        for n, p in x.named_parameters():
            yield f"{where}.{n}", p
    elif isinstance(x, Tensor):
        yield where, x


class CutOff:
    """Trainable parameters that have had no gradient in the first ``AFTER`` steps: what
    cut them off from the loss, found on the next forward and backward pass. A one-shot
    forward hook on each of their modules notes whether it ran, under which grad mode,
    inside a checkpoint or not, and the autograd node of its output; the next walk of the
    loss's graph tells whether that node reaches the loss."""

    AFTER = 3

    def __init__(self, ctx: Watched) -> None:
        self.ctx = ctx
        self._ever = np.zeros(len(ctx), dtype=bool)
        self._handles = contextlib.ExitStack()  # (the one-shot hooks, removed by conclude or close)
        self._seen: Dict[str, Dict[str, Any]] = {}
        self._state = "idle"  # idle -> armed (hooks on) -> waiting (forward seen) -> done(-ish) -> idle
        self._missing: List[int] = []
        self._verdicts: Optional[Dict[str, str]] = None
        self.reported: List[str] = []

    def widen(self, k: int) -> None:
        self._ever = np.concatenate([self._ever, np.zeros(k, dtype=bool)])

    def waiting(self) -> bool:
        return self._state == "waiting"

    def forward_began(self) -> None:
        """The model's forward pass begins: the armed hooks note it; its backward pass
        concludes."""
        if self._state == "armed":
            self._state = "waiting"

    def read(self, step: Step) -> List[Finding]:
        e = step.entry
        if e is not None and e.present is not None and len(e.present) == len(self._ever):
            self._ever |= e.present
        if self._verdicts is not None:
            return self._finding(step.index)
        if self._state == "idle" and step.index >= self.AFTER - 1 and not step.closure:
            # (one that no param group holds never trains by design: a target network, an EMA or
            # teacher copy; not cut off from the loss)
            held = self.ctx.held_by_optimizer()
            # (a library's module whose output its library leaves unused, BERT's pooler: a
            # fact named at close, not a parameter cut off)
            root = unwrap(self.ctx.model)
            self._missing = [i for i in np.nonzero(~self._ever)[0] if self.ctx.names[i] not in self.reported
                             and (held is None or id(self.ctx.params[i]) in held)
                             and library_owner(root, self.ctx.modules[i]) is None]
            if self._missing:
                self._arm()
        return []

    def _arm(self) -> None:
        root = unwrap(self.ctx.model)
        modules = dict.fromkeys(self.ctx.modules[i] for i in self._missing)
        for name in modules:
            try:
                m = root.get_submodule(name) if name else root
            except AttributeError:
                continue
            self._handles.callback(m.register_forward_hook(self._noter(name)).remove)
        self._seen = {}
        self._state = "armed"

    def _noter(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if in_backward() or name in self._seen or not self.ctx.alive():
                return None
            outs = [t for t in tensors_in(output) if t.is_floating_point() or t.is_complex()]
            self._seen[name] = {"grad": torch.is_grad_enabled(), "checkpoint": _in_checkpoint(),
                                "float": bool(outs) or not tensors_in(output),
                                "requires_grad": any(t.requires_grad for t in outs),
                                "nodes": [t.grad_fn for t in outs if t.grad_fn is not None]}
            return None
        return hook

    def conclude(self, nodes: Sequence[Any]) -> None:
        """The walk of the loss's graph after the noted forward pass: each module's verdict."""
        self._handles.close()
        reached = {id(n) for n in nodes}
        leaves = {id(n.variable) for n in nodes if _name(n) == "AccumulateGrad"}
        verdicts: Dict[str, str] = {}
        for i in self._missing:
            if id(self.ctx.params[i]) in leaves:
                continue  # (it reaches the loss now)
            verdicts[self.ctx.names[i]] = self._why(self.ctx.modules[i], reached)
        self._verdicts, self._state = verdicts, "idle"

    def _why(self, module: str, reached: Set[int]) -> str:
        seen = self._seen.get(module)
        where = f"module {module!r}" if module else "the model itself"
        if seen is None:
            return f"{where} never ran in the forward pass: the layer is not used (defined but not called)"
        if not seen["grad"] and seen["checkpoint"]:
            return (f"{where} ran inside a reentrant activation checkpoint (torch.utils.checkpoint with "
                    f"use_reentrant=True) whose inputs do not require grad, so it ran without autograd; fix: "
                    f"use_reentrant=False, or make the checkpoint's input require grad")
        if not seen["grad"]:
            return f"{where} ran with grad disabled (inside torch.no_grad() or inference_mode); fix: move it out"
        if not seen["float"]:
            return f"{where} returns integer values (argmax, round, a comparison): not differentiable"
        if not seen["requires_grad"]:
            return (f"{where} ran with grad enabled, but its output does not depend on its parameters through "
                    f"autograd: they are used through .detach() or .data inside its forward")
        if not any(id(n) in reached for n in seen["nodes"]):
            return (f"{where} ran and its output required grad, but that output does not reach the loss: a "
                    f".detach(), .data, .item() / numpy round trip or an integer op (argmax, round, a comparison) "
                    f"after it cuts the graph, or the output is not used in the loss")
        return f"{where} ran and feeds the loss, but these parameters of it were not used in its forward"

    def _finding(self, index: int) -> List[Finding]:
        verdicts, self._verdicts = self._verdicts, None
        if not verdicts:
            return []
        names = list(verdicts)
        self.reported += names
        by_cause: Dict[str, List[str]] = {}
        for n, why in verdicts.items():
            by_cause.setdefault(why, []).append(n)
        parts = "; ".join(f"{', '.join(ns[:6])}{' ...' if len(ns) > 6 else ''}: {why}" for why, ns in by_cause.items())
        msg = (f"graddbg: trainable parameters cut off from the loss at step {index}: {len(names)} parameter(s) have "
               f"had no gradient in any step so far (steps 0-{index}), read from the forward pass and the loss's "
               f"autograd graph: {parts}. Fix as said, or freeze them (requires_grad_(False)).")
        modules = [self.ctx.modules[self.ctx.names.index(n)] for n in names]
        return [finding("unused_param", index, names, modules, msg, self.ctx.options.unused_param, self.ctx.rank,
                        value=float(len(names)))]

    def close(self) -> None:
        self._handles.close()


def _in_checkpoint() -> bool:
    """Whether the calling frames include torch's activation checkpointing."""
    f = sys._getframe(2)
    for _ in range(40):
        if f is None:
            return False
        if "torch/utils/checkpoint" in f.f_code.co_filename.replace("\\", "/"):
            return True
        f = f.f_back
    return False


def _at(line: Any) -> str:
    return f"{line[0]}:{line[1]}" if line else "an unknown line"


class ConstantLossTerm(PolicyCheck):
    """``loss_pattern``: a term added to the loss that is built on gradients computed by
    ``torch.autograd.grad`` without ``create_graph=True`` (a gradient penalty): a constant,
    whose contribution to the loss's gradient is exactly zero. The loss tape follows it as
    the loss code runs (`graddbg.blame.ConstantTerms`); read at the step, no device work.
    Not looked at with ``localise=False`` (no tape)."""

    STATE = ("_reported",)
    KIND = "loss_pattern"
    NEEDS_OPTIMIZER = False

    after = (LedgerKeeper,)

    def read(self, step: Step) -> List[Finding]:
        if not self._on or self._reported:
            return []
        tape = getattr(step.tapped, "tape", None)
        found = tape.terms.found if tape is not None else None
        if found is None:
            return []
        self._reported = True
        grad_line, add_line = found
        msg = (f"graddbg: a term of the loss at step {step.index} carries no gradient: it is built on gradients that "
               f"torch.autograd.grad computed without create_graph=True (at {_at(grad_line)}), which have no graph, "
               f"and it is added to the loss (at {_at(add_line)}), so it changes the loss's value and adds exactly "
               f"nothing to its gradient: the penalty does not train. Fix: torch.autograd.grad(..., "
               f"create_graph=True) for a term meant to train (a gradient penalty).")
        return [finding("loss_pattern", step.index, [], [], msg, self._policy, self.ctx.rank)]
