"""``find_nonfinite``: the slow forensic mode that names the op where a NaN/Inf was born.

Every operation, forward and backward, goes through a ``TorchDispatchMode`` that checks
its floating-point outputs. The first op whose output is non-finite while all of its
inputs were finite (the *producer*, not a propagator) raises `NonFiniteError`.

Forward ops are named by their aten op (``aten.log``); backward ops by the autograd node
being run (``SqrtBackward0``). The module path comes from forward pre/post hooks on the
model's submodules; the source line is the innermost frame outside torch and graddbg.
For backward, the module and source line are those of the forward op that created the
node: they are recorded at forward time in the node's own ``metadata`` dict (the place
``torch.autograd.detect_anomaly`` keeps its tracebacks), so they live exactly as long as
the graph does and nothing is kept past it.

The second half of this module localises the producer for `graddbg.watch`: from
the forward activations' non-finite flags, from the gradients at module outputs, from
parameters and buffers that hold NaN/Inf themselves, and by replaying the captured
forward and backward pass under `find_nonfinite` (`replay`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from graddbg._errors import GraddbgTypeError, GraddbgValueError, NonFiniteError
from graddbg._model import local_values, module_of, tensors_in, unwrap
from graddbg._source import user_line as _user_line, user_source_from_stack
from graddbg.anomaly import Anomaly

__all__ = ["find_nonfinite", "NonFiniteScan", "LossTape"]

_Tensor = torch.Tensor
_STRIDED = torch.strided
_current_node = torch._C._current_autograd_node
_current_task = torch._C._current_graph_task_id

# Key under which forward-time facts are stored in ``grad_fn.metadata``.
_KEY = "graddbg.find_nonfinite"

# Ops that overwrite their mutated argument entirely: its old value is not an input.
_OVERWRITES = frozenset({
    "copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_",
    "exponential_", "geometric_", "cauchy_", "log_normal_", "set_", "resize_",
    "resize_as_",
})
# Ops whose output needs no check: uninitialised memory, or no new values at all.
_NO_CHECK = frozenset({
    "detach", "alias", "_unsafe_view", "set_", "resize_", "resize_as_",
    "_local_scalar_dense", "clone", "contiguous",
})
# Ops that make a tensor from Python data (torch.tensor, as_tensor): a NaN there is a
# constant written in the code or the data, and is blamed on the line that made it.
_CONSTANTS = frozenset({"lift_fresh", "lift_fresh_copy"})
_CONSTANT_HINT = ("a NaN constant: a NaN written in the code (a fill value, a placeholder, "
                  "torch.tensor(float('nan'))) or present in the data turned into a tensor "
                  "here")
_MAX_INPUT_LINES = 6
# Memo of facts about torch itself (op schemas, which files are torch's), no user data.
_PLANS: Dict[Any, "_Plan"] = {}

# What to try, by op (forward aten name or backward node name, lower case, prefix match).
_HINTS: Tuple[Tuple[Tuple[str, ...], str], ...] = (
    (("sqrtbackward", "powbackward", "normbackward", "linalgvectornormbackward",
      "cdistbackward", "stdbackward", "std_meanbackward"),
     "the derivative of sqrt (or of a norm) is infinite at 0: add an epsilon inside the "
     "root, e.g. torch.sqrt(x + eps), or mask the zero entries (pairwise distances of a "
     "point to itself are 0)"),
    (("div", "reciprocal", "rsqrt", "true_divide", "divbackward", "reciprocalbackward",
      "rsqrtbackward"),
     "a division by zero (0/0 gives NaN, x/0 gives Inf): add an epsilon to the "
     "denominator or clamp it, e.g. x / y.clamp_min(eps)"),
    (("log", "xlogy", "logbackward"),
     "log of zero or of a negative number: clamp the argument, e.g. "
     "torch.log(x.clamp_min(eps)), or use log_softmax / logsumexp"),
    (("pow",), "a negative base to a fractional power gives NaN, and a large base "
     "overflows: clamp the base, e.g. x.clamp_min(eps) ** p"),
    (("exp", "cosh", "sinh", "expbackward"),
     "an overflow: the argument is too large for the dtype (exp overflows float32 above "
     "about 88.7); subtract the maximum first (softmax, logsumexp) or clamp it"),
    (("sqrt",), "sqrt of a negative number: clamp the argument, e.g. x.clamp_min(0)"),
    (("_to_copy", "copy"),
     "an overflow when casting to a narrower dtype: scale the values or keep this tensor "
     "in float32"),
    (("mm", "addmm", "bmm", "baddbmm", "matmul", "convolution", "linear"),
     "an overflow in a matrix product or convolution: activations or weights are too "
     "large (check the learning rate and the initialisation, or use a wider dtype)"),
)


def _hint(op: str) -> str:
    key = (op.split(".", 1)[1] if op.startswith("aten.") else op).lower().rstrip("0123456789")
    for prefixes, text in _HINTS:
        if any(key == p or key.startswith(p + "_") for p in prefixes):
            return text
    return ("look at the input statistics above: extreme values, zeros where a "
            "denominator or a log argument is, or a dtype too narrow for the range")


class _Plan:
    """What to do with one OpOverload, computed once from its schema."""

    __slots__ = ("name", "check", "record", "pre", "ignore", "constant")

    def __init__(self, func: Any) -> None:
        packet = func.overloadpacket.__name__
        self.name = str(func.overloadpacket)  # "aten.log"
        view = bool(getattr(func, "is_view", False))
        self.constant = packet in _CONSTANTS
        self.check = self.constant or not (view or packet in _NO_CHECK or "empty" in packet)
        self.record = not view
        pre: List[Tuple[int, str]] = []
        ignore: List[Tuple[int, str]] = []
        for i, arg in enumerate(func._schema.arguments):
            alias = arg.alias_info
            if alias is None or not alias.is_write:
                continue
            if getattr(arg, "is_out", False) or arg.kwarg_only or packet in _OVERWRITES:
                ignore.append((i, arg.name))  # old value overwritten: not an input
            else:
                pre.append((i, arg.name))  # mutated in place: check it before the op
        self.pre = tuple(pre)
        self.ignore = tuple(ignore)


def _float_tensor(t: Any) -> bool:
    return (type(t) is _Tensor or isinstance(t, torch.nn.Parameter)) and (
        t.dtype.is_floating_point or t.dtype.is_complex) and t.layout is _STRIDED and (
        t.device.type != "meta")


def _all_finite(t: torch.Tensor) -> bool:
    """One reduction and one host read. A finite sum means every element is finite;
    a non-finite sum may be an overflow of finite values, so it is checked exactly."""
    if t.numel() == 0:
        return True
    if t.dtype.is_complex:
        return bool(torch.isfinite(t).all())
    if t.dtype in (torch.float64, torch.float32):
        s = t.sum()
    else:
        s = t.sum(dtype=torch.float32)
    if math.isfinite(s.item()):
        return True
    return bool(torch.isfinite(t).all())


def _tensors(obj: Any) -> List[torch.Tensor]:
    if isinstance(obj, _Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        out: List[torch.Tensor] = []
        for x in obj:
            if isinstance(x, _Tensor):
                out.append(x)
            elif isinstance(x, (tuple, list)):
                out.extend(y for y in x if isinstance(y, _Tensor))
        return out
    return []


def _outputs_finite(out: Any, scan: "NonFiniteScan") -> bool:
    if type(out) is _Tensor:
        if not _float_tensor(out):
            return True
        scan.ops_checked += 1
        return _all_finite(out)
    ts = [t for t in _tensors(out) if _float_tensor(t) and t.numel()]
    if not ts:
        return True
    scan.ops_checked += 1
    return _group_finite(ts)


def _group_finite(ts: List[torch.Tensor]) -> bool:
    """Several tensors, one host read when they share a device and dtype."""
    if len(ts) <= 1:
        return not ts or _all_finite(ts[0])
    sums = [t.sum() if t.dtype in (torch.float32, torch.float64) and not t.dtype.is_complex
            else None for t in ts]
    if all(s is not None for s in sums) and len({(s.dtype, s.device) for s in sums}) == 1:
        if math.isfinite(torch.stack(sums).sum().item()):
            return True
    return all(_all_finite(t) for t in ts)


def _first_nonfinite(outs: List[torch.Tensor]) -> float:
    """NaN if an output holds a NaN, else the sign of its first Inf."""
    for t in outs:
        if bool(torch.isnan(t).any()):
            return float("nan")
    for t in outs:
        inf = torch.isinf(t)
        if bool(inf.any()):
            return float("inf") if bool((t[inf].real > 0).any()) else float("-inf")
    return float("nan")


def _arg(args: Sequence[Any], kwargs: Dict[str, Any], index: int, name: str) -> Any:
    return args[index] if index < len(args) else kwargs.get(name)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _tensor_stats(t: torch.Tensor) -> str:
    head = f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')} {t.device.type}"
    if t.numel() == 0:
        return head + " (empty)"
    if t.dtype.is_complex:
        t = t.abs()
    if not t.dtype.is_floating_point:
        if t.dtype == torch.bool:
            return head + f": {int(t.sum())} true of {t.numel()}"
        lo, hi = int(t.min()), int(t.max())
        return head + f": min {lo} max {hi} zeros {int((t == 0).sum())}"
    f = t.detach() if t.dtype == torch.float64 else t.detach().float()
    fin = torch.isfinite(f)
    nan, inf = int(torch.isnan(f).sum()), int(torch.isinf(f).sum())
    good = f[fin]
    if good.numel():
        lo, hi, amax = float(good.min()), float(good.max()), float(good.abs().max())
        rng = f"min {_fmt(lo)} max {_fmt(hi)} absmax {_fmt(amax)}"
    else:
        rng = "no finite value"
    return head + f": {rng} zeros {int((f == 0).sum())} nan {nan} inf {inf}"


def _output_stats(t: torch.Tensor) -> str:
    f = t.detach()
    bad = ~torch.isfinite(f)
    nan = int(torch.isnan(f).sum())
    pinf = int((torch.isinf(f) & (f.real > 0 if f.is_complex() else f > 0)).sum())
    ninf = int(torch.isinf(f).sum()) - pinf
    where = ""
    idx = torch.nonzero(bad.reshape(bad.shape or (1,)))
    if idx.numel():
        where = f", first at index {tuple(int(i) for i in idx[0])}"
    return (f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}: nan {nan} +inf {pinf} "
            f"-inf {ninf} of {t.numel()}{where}")


class NonFiniteScan(TorchDispatchMode):
    """The dispatch mode behind `find_nonfinite` (the object it yields).

    ``ops_checked`` counts the ops whose floating-point outputs were checked so far.
    Do not enter it directly: `find_nonfinite` does, with the hooks it needs.
    """

    def __init__(self, *, check_forward: bool, check_backward: bool, skip_ints: bool,
                 model: Optional[torch.nn.Module]) -> None:
        super().__init__()
        self.ops_checked = 0
        self._check = (check_forward, check_backward)
        self._skip_ints = skip_ints
        self._model = model
        self._stack: List[str] = []  # module paths, innermost last
        self._pending: List[Tuple[Any, tuple]] = []  # forward outputs awaiting grad_fn
        self._passes = 0  # backward passes seen (graph tasks)
        self._task = -1
        #: (file, line) every op is blamed on while set: the line of the user's loss code
        #: that a replay of the recorded loss code (`LossTape`) re-runs
        self.source_at: Optional[Tuple[str, int]] = None

    # -- module stack (fed by the hooks track_modules registers) ----------------------
    def track_modules(self, model: torch.nn.Module, hooks: contextlib.ExitStack) -> None:
        """Follow which submodule of ``model`` runs (a forward pre-hook and a forward hook
        on each), so that errors name it; each hook's removal goes on ``hooks``."""
        for path, module in model.named_modules():
            if isinstance(module, torch.jit.ScriptModule):
                continue  # scripted code takes no Python hooks (its ops are still checked)
            hooks.callback(module.register_forward_pre_hook(
                lambda m, a, _p=path: self._push(_p)).remove)
            hooks.callback(module.register_forward_hook(
                lambda m, a, o, _p=path: self._pop(_p), always_call=True).remove)

    def _push(self, name: str) -> None:
        self._stack.append(name)

    def _pop(self, name: str) -> None:
        if self._stack and self._stack[-1] == name:
            self._stack.pop()

    def finish(self) -> None:
        """After the mode was exited: tag the autograd nodes of the last ops with what
        their forward saw (outside the mode), then forget the module stack."""
        try:
            self._flush()
        finally:
            self.reset()

    def reset(self) -> None:
        """Drop the pending outputs and the module stack (the scan is over)."""
        self._pending.clear()
        self._stack.clear()

    # -- the check --------------------------------------------------------------------
    def _user_frame(self) -> Optional[Tuple[str, int]]:
        """(file, line) of the innermost frame outside torch and graddbg."""
        if self.source_at is not None:
            return self.source_at
        return _user_line(2)

    def _flush(self) -> None:
        """Store forward facts in the nodes that autograd attached after each op."""
        pending, self._pending = self._pending, []
        for out, info in pending:
            for t in _tensors(out):
                g = t.grad_fn
                if g is None:
                    continue
                md = g.metadata
                old = md.get(_KEY)
                if old is None or (old[0] is None and info[0] is not None):
                    md[_KEY] = info

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if kwargs is None:
            kwargs = {}
        plan = _PLANS.get(func)
        if plan is None:
            plan = _PLANS[func] = _Plan(func)
        if self._pending:
            self._flush()
        node = _current_node()
        if node is not None:
            task = _current_task()
            if task != self._task:
                self._task = task
                self._passes += 1
        check = plan.check and self._check[node is not None]
        pre = None
        if check and plan.pre:
            pre = [_group_finite([t for t in _tensors(_arg(args, kwargs, i, n))
                                  if _float_tensor(t) and t.numel()]) for i, n in plan.pre]
        out = func(*args, **kwargs)
        if check:
            if not _outputs_finite(out, self):
                self._nonfinite(func, plan, args, kwargs, out, pre, node)
        if node is None and plan.record:  # also under no_grad: custom Functions' forward
            module = self._stack[-1] if self._stack else None
            self._pending.append((out, (module, self._user_frame(), plan.name, self._passes)))
        return out

    def _inputs_finite(self, plan: _Plan, args: Sequence[Any], kwargs: Dict[str, Any],
                       pre: Optional[List[bool]]) -> bool:
        if pre is not None and not all(pre):
            return False
        skip = {id(_arg(args, kwargs, i, n)) for i, n in plan.pre + plan.ignore}
        for value in list(args) + list(kwargs.values()):
            if id(value) in skip:
                continue
            for x in (value if isinstance(value, (tuple, list)) else (value,)):
                if isinstance(x, (float, complex)) and math.isinf(abs(x)):
                    return False  # an Inf constant (a -inf mask) is a deliberate input
                if isinstance(x, _Tensor) and _float_tensor(x) and not _all_finite(x):
                    return False
        return True

    def _nonfinite(self, func: Any, plan: _Plan, args: Sequence[Any],
                   kwargs: Dict[str, Any], out: Any, pre: Optional[List[bool]],
                   node: Any) -> None:
        if plan.constant:
            if not any(bool(torch.isnan(t).any()) for t in _tensors(out) if _float_tensor(t)):
                return  # an Inf constant (a mask): deliberate
        elif not self._inputs_finite(plan, args, kwargs, pre):
            return  # a propagator: the producer came earlier (or from outside)
        raise self._error(func, plan, args, kwargs, out, node)

    # -- the report -------------------------------------------------------------------
    def _error(self, func: Any, plan: _Plan, args: Sequence[Any], kwargs: Dict[str, Any],
               out: Any, node: Any) -> NonFiniteError:
        where = self._where(plan, node)
        outs = [t for t in _tensors(out) if _float_tensor(t)]
        value = _first_nonfinite(outs)
        rank = None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        nan_constant = plan.constant or any(
            isinstance(x, float) and math.isnan(x) for v in list(args) + list(kwargs.values())
            for x in (v if isinstance(v, (tuple, list)) else (v,)))
        message = self._message(where, plan, args, kwargs, outs, value, rank, nan_constant)
        anomaly = Anomaly(step=where["step"], kind="nonfinite", name=where["name"], module=where["module"],
                          op=where["op"], value=value, threshold=None, source=where["source"],
                          message=message, rank=rank)
        return NonFiniteError(message, anomaly=anomaly)

    def _where(self, plan: _Plan, node: Any) -> Dict[str, Any]:
        """op, module, source line, forward op, parameter and pass of the failing op."""
        if node is None:
            frame = self._user_frame()
            return {"op": plan.name, "module": self._stack[-1] if self._stack else None,
                    "source": f"{frame[0]}:{frame[1]}" if frame else None, "fwd_op": None,
                    "name": None, "step": self._passes, "backward": False}
        md = node.metadata
        info = md.get(_KEY)
        module = fwd_op = None
        if info is not None:
            module, frame, fwd_op, _ = info
            source = f"{frame[0]}:{frame[1]}" if frame else None
        else:
            source = user_source_from_stack(md.get("traceback_"))
        name = None
        variable = getattr(node, "variable", None)
        if variable is not None and self._model is not None:
            name = next((n for n, p in self._model.named_parameters() if p is variable), None)
            if name is not None and module is None:  # AccumulateGrad: the parameter's own module
                module = module_of(name)
        return {"op": node.name(), "module": module, "source": source, "fwd_op": fwd_op, "name": name,
                "step": self._passes - 1, "backward": True}

    def _message(self, where: Dict[str, Any], plan: _Plan, args: Sequence[Any], kwargs: Dict[str, Any],
                 outs: List[torch.Tensor], value: float, rank: Optional[int], nan_constant: bool) -> str:
        op, module, source, backward = where["op"], where["module"], where["source"], where["backward"]
        kind = "NaN" if math.isnan(value) else "Inf"
        at = f"step {where['step']}" + (f", rank {rank}" if rank is not None else "")
        how = "from a NaN constant" if nan_constant else "from finite inputs"
        lines = [f"find_nonfinite: {kind} produced {how} by {'backward' if backward else 'forward'} op {op} ({at})."]
        if self._model is not None:
            mod_txt = "none (outside the model)" if module is None else (
                f"{module or '<root>'} ({self._module_type(module)})")
            lines.append(f"  module: {mod_txt}")
        lines.append(f"  source: {source or 'unknown'}"
                     + (f" (the forward line that created {op})" if backward and source else ""))
        if backward:
            lines.append(f"  forward op: {where['fwd_op'] or 'unknown (created outside find_nonfinite)'}")
            lines.append(f"  aten op in backward: {plan.name}")
        if where["name"] is not None:
            lines.append(f"  parameter: {where['name']}")
        lines.append("  inputs:")
        entries = self._input_entries(plan, args, kwargs)
        lines += [f"    {text}" for text in entries[:_MAX_INPUT_LINES]]
        if len(entries) > _MAX_INPUT_LINES:
            lines.append(f"    ... and {len(entries) - _MAX_INPUT_LINES} more")
        if not entries:
            lines.append("    (no floating-point tensor input)")
        lines += [f"  output[{i}]: {_output_stats(t)}" for i, t in enumerate(outs[:_MAX_INPUT_LINES])
                  if not _all_finite(t)]
        lines.append(f"  try: {_CONSTANT_HINT if nan_constant else _hint(op)}")
        return "\n".join(lines)

    def _module_type(self, path: str) -> str:
        try:
            return type(self._model.get_submodule(path)).__name__  # type: ignore[union-attr]
        except (AttributeError, TypeError):
            return "?"

    def _input_entries(self, plan: _Plan, args: Sequence[Any],
                       kwargs: Dict[str, Any]) -> List[str]:
        ignore = {id(_arg(args, kwargs, i, n)) for i, n in plan.ignore}
        entries: List[str] = []
        named = [(f"[{i}]", a) for i, a in enumerate(args)] + [
            (k, v) for k, v in kwargs.items()]
        for label, value in named:
            if id(value) in ignore:
                continue
            items = list(value) if isinstance(value, (tuple, list)) else [value]
            for j, x in enumerate(items):
                lab = label if len(items) == 1 and not isinstance(value, (tuple, list)) \
                    else f"{label}[{j}]"
                if isinstance(x, _Tensor):
                    if x.dtype.is_floating_point or x.dtype.is_complex or not self._skip_ints:
                        if x.layout is _STRIDED and x.device.type != "meta":
                            entries.append(f"{lab} {_tensor_stats(x)}")
                elif isinstance(x, float):
                    entries.append(f"{lab} scalar {x!r}")
        return entries


@contextlib.contextmanager
def find_nonfinite(model: Optional[torch.nn.Module] = None, *, check_forward: bool = True,
                   check_backward: bool = True,
                   skip_ints: bool = True) -> Iterator[NonFiniteScan]:
    """Raise `graddbg.NonFiniteError` at the first op that makes a NaN or Inf
    from finite inputs, forward or backward, naming the op, the module and the line.

    This is a slow forensic mode, like ``torch.autograd.detect_anomaly``: it checks the
    output of every operation (one reduction and one host read per op), so turn it on to
    hunt a NaN, not for training. It never changes results, and on exit (normal or by
    exception) every hook and the dispatch mode are gone.

    Only the *producer* is blamed: an op whose inputs were already non-finite is a
    propagator and passes silently, so non-finite values that come from outside the
    context (inputs, parameters) are not reported. An Inf constant is taken as deliberate
    (an input): ``masked_fill(mask, -inf)``, ``torch.full(size, -inf)`` pass; a NaN
    constant is not: ``torch.tensor(float("nan"))``, ``x.fill_(nan)`` and a tensor made
    from data holding a NaN are blamed on the line that made them. A NaN later masked out by
    ``torch.where`` is still reported where it was made; use ``check_forward=False`` to
    look only at the backward pass. Under AMP, an fp16 overflow that a ``GradScaler``
    would skip is reported too (run it without the scaler, or in float32, to hunt a real
    NaN). The error's ``anomaly.step`` counts the backward passes seen in the context
    before the failing op (so it is the training step when each step has one backward).

    Args:
        model: when given, errors name the innermost submodule (its qualified name, without
            the ``module.`` of a DDP/DataParallel wrapper) that was running; backward ops
            are blamed on the module whose forward created them.
        check_forward: check the outputs of the forward ops.
        check_backward: check the outputs of the backward ops.
        skip_ints: leave integer and bool inputs out of the statistics in the message
            (they cannot be non-finite, and are never checked).

    Yields:
        NonFiniteScan: the scan; ``scan.ops_checked`` counts the ops whose floating-point
            outputs were checked.

    Raises:
        NonFiniteError: at the first op that makes a NaN/Inf from finite inputs, or on
            entry when a parameter or buffer of ``model`` already holds one; its
            ``anomaly`` names the op, the module and the source line.
        GraddbgTypeError: ``model`` is not an ``nn.Module``, or a flag is not a bool.
        GraddbgValueError: both ``check_forward`` and ``check_backward`` are False.

    Examples:
        >>> import torch, graddbg
        >>> x = torch.tensor([1.0, 100.0], requires_grad=True)
        >>> try:
        ...     with graddbg.find_nonfinite():
        ...         y = x.exp()
        ... except graddbg.NonFiniteError as e:
        ...     print(e.anomaly.op, e.anomaly.value)
        aten.exp inf
    """
    inner = _validate_scan(model, check_forward, check_backward, skip_ints)
    if inner is not None:
        check_state(inner)  # a NaN weight is the producer: nothing in the graph made it
    scan = NonFiniteScan(check_forward=check_forward, check_backward=check_backward,
                         skip_ints=skip_ints, model=inner)
    hooks = contextlib.ExitStack()   # every hook's removal, run in the finally below
    entered = False
    try:
        if model is not None:
            scan.track_modules(inner, hooks)
        scan.__enter__()
        entered = True
        yield scan
    finally:
        try:
            if entered:
                scan.__exit__(None, None, None)
                scan.finish()
        finally:
            hooks.close()
            scan.reset()


def _validate_scan(model: Any, check_forward: Any, check_backward: Any, skip_ints: Any) -> Optional[torch.nn.Module]:
    if model is not None and not isinstance(model, torch.nn.Module):
        raise GraddbgTypeError(f"find_nonfinite(model=...): got {type(model).__name__}, expected a "
                               f"torch.nn.Module or None")
    for arg, value in (("check_forward", check_forward), ("check_backward", check_backward),
                       ("skip_ints", skip_ints)):
        if not isinstance(value, bool):
            raise GraddbgTypeError(f"find_nonfinite({arg}=...): got {value!r}; accepted: True or False")
    if not (check_forward or check_backward):
        raise GraddbgValueError("find_nonfinite: check_forward and check_backward are both False, "
                                "so nothing would be checked; set at least one to True")
    return None if model is None else unwrap(model)  # names as the user wrote them


# --------------------------------------------------------------------------- localisation
def nonfinite_state(model: torch.nn.Module) -> List[Tuple[str, str, torch.Tensor]]:
    """``(kind, name, tensor)`` of the parameters and buffers holding NaN/Inf (one host
    read per tensor: for the rare moment a non-finite value was found)."""
    found = []
    with torch.no_grad():
        for kind, items in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
            for name, t in items:
                if t.is_floating_point() and t.numel() and not bool(torch.isfinite(local_values(t)).all()):
                    found.append((kind, name, t))
    return found


def check_state(model: torch.nn.Module, step: int = 0) -> None:
    """Raise `NonFiniteError` naming the first parameter or buffer of ``model``
    that holds NaN/Inf: such a value enters from outside the graph (a bad checkpoint, an
    optimizer step that wrote it, a hand-made tensor), so it is its own producer."""
    found = nonfinite_state(model)
    if found:
        a = state_anomaly(found, step)
        raise NonFiniteError(a.message, anomaly=a)


def state_anomaly(found: List[Tuple[str, str, torch.Tensor]], step: int, rank: Optional[int] = None,
                  shard_ranks: Optional[Sequence[int]] = None) -> Anomaly:
    """The finding for non-finite weights or buffers ``found``; ``shard_ranks``: the ranks
    whose shards of the first one hold the NaN/Inf (a sharded parameter, as every rank of
    its group learned)."""
    kind, name, t = found[0]
    bad = int((~torch.isfinite(local_values(t))).sum())
    others = ", ".join(n for _, n, _ in found[1:6]) + (" and more" if len(found) > 6 else "")
    held = (f"its shard(s) on rank(s) {', '.join(map(str, shard_ranks))} hold NaN/Inf"
            + (f" ({bad} entries here)" if bad else "") if shard_ranks else f"{bad} NaN/Inf entries")
    msg = (f"graddbg: non-finite {kind} {name} {tuple(t.shape)} {t.dtype} at step {step}"
           + (f" on rank {rank}" if rank is not None else "") + f": {held}. "
           f"It entered from outside the autograd graph (a checkpoint, an optimizer step, an in-place write), "
           f"so every gradient computed from it is a victim, not a producer."
           + (f" Also non-finite: {others}." if others else ""))
    return Anomaly(step=step, kind="nonfinite", name=name, module=module_of(name), op=None,
                   value=float("nan"), threshold=None, source=None, message=msg, rank=rank,
                   params=tuple(n for _, n, _ in found))


@dataclasses.dataclass
class Capture:
    """What a forward pass needs to be replayed (held for one step only)."""

    args: Any
    kwargs: Any
    rng: Optional[torch.Tensor]
    output_index: int
    grad: Optional[torch.Tensor] = None
    #: the module the forward pass ran, when not the watched model (a pipeline stage of
    #: several on one rank), and its name in the watched model
    module: Optional[torch.nn.Module] = None
    prefix: str = ""
    #: the loss code that ran on the output before the backward pass (`LossTape`), or None
    tape: Optional["LossTape"] = None


# --------------------------------------------------------------------------- the loss code
# A NaN made between the model's output and the backward pass (``-torch.log(p)`` written
# after ``model(x)``) is in no module: the replay of the model alone cannot name it, and by
# the time the gradient reaches the output its autograd nodes have freed what they saved.
# The loss tape records that code as it runs: a torch-function mode, on the watching thread
# from the end of the model's forward pass until the step, notes each torch call that made a
# tensor requiring grad (the function, its arguments with tensors as references, the user's
# line) and the tensors handed to backward. A replay runs those calls again on the replayed
# output under `find_nonfinite`, each blamed on its recorded line, then their backward pass
# down to the output: the op and the line that made the NaN/Inf.

class _Made:
    """A tensor that an earlier recorded call made (``op``: its index, ``pos``: the position
    in its output when that was a tuple)."""

    __slots__ = ("op", "pos")

    def __init__(self, op: int, pos: Optional[int]) -> None:
        self.op, self.pos = op, pos


class _Out:
    """The ``i``-th tensor of the model's output."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


class _Const:
    """Any other tensor (a target, a mask, a weight): its value, copied before a replay
    uses it."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _TapeFull(Exception):
    pass


#: the calls that start a backward pass
_BACKWARD_CALLS = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)


#: bounds of one tape: calls recorded, bytes of the constants it holds
MAX_TAPE_OPS = 1_000
MAX_TAPE_BYTES = 256 << 20


def _pass_through(func: Any, args: Sequence[Any], kwargs: Optional[Dict[str, Any]]) -> Any:
    return func(*args, **(kwargs or {}))


#: calls through which a constant term stays a term added to the loss (its gradient is 0):
#: additions, subtractions and reductions by sum or mean ...
_ADDITIVE = frozenset({"add", "add_", "__add__", "__radd__", "__iadd__", "sub", "sub_", "__sub__", "__rsub__",
                       "__isub__", "neg", "__neg__", "sum", "mean"})
#: ... and products or quotients with factors that carry no gradient
_SCALING = frozenset({"mul", "mul_", "__mul__", "__rmul__", "__imul__", "div", "div_", "__truediv__",
                      "__itruediv__", "true_divide"})


def _arg_tensors(args: Sequence[Any], kwargs: Dict[str, Any]) -> List[torch.Tensor]:
    """The tensors among a call's arguments (and in lists or tuples of them)."""
    out: List[torch.Tensor] = []
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif type(a) in (list, tuple):
            out += [t for t in a if isinstance(t, torch.Tensor)]
    return out


class ConstantTerms:
    """Terms of the loss built on gradients that ``torch.autograd.grad`` computed without
    ``create_graph=True`` (a gradient penalty written so): such a gradient has no graph, so
    the term is a constant and, added to the loss, contributes exactly nothing to its
    gradient. Followed by the loss tape as its code runs: the gradients are marked, and so
    is what is computed from them without a graph; a differentiable result that adds one of
    them (or scales such a sum by factors without gradient, or sums or averages it) is marked
    as holding a constant term; ``found`` is set when a tensor handed to ``backward()`` is
    one: (the line of the ``autograd.grad`` call, the line that added the term). A constant
    used any other way (a target inside a nonlinear function: gradient matching) is not
    followed. Costs nothing until ``autograd.grad`` runs in the loss code."""

    def __init__(self) -> None:
        self._constant: Dict[int, Tuple[Any, Any]] = {}  # id -> (weakref, line of the grad call)
        self._holding: Dict[int, Tuple[Any, Any, Any]] = {}  # id -> (weakref, grad line, line that added it)
        self.found: Optional[Tuple[Any, Any]] = None

    def active(self) -> bool:
        return bool(self._constant or self._holding)

    def grads(self, args: Sequence[Any], kwargs: Dict[str, Any], out: Any, line: Any) -> None:
        """An ``autograd.grad`` call returned ``out``: marked when made without a graph."""
        create = kwargs.get("create_graph", args[4] if len(args) > 4 else False)
        if create:
            return
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not t.requires_grad:
                self._constant[id(t)] = (weakref.ref(t), line)

    def _get(self, table: Dict[int, Any], t: torch.Tensor) -> Any:
        got = table.get(id(t))
        return got if got is not None and got[0]() is t else None

    def call(self, func: Any, args: Sequence[Any], kwargs: Dict[str, Any], out: Any, line: Any) -> None:
        """A call of the loss code returned ``out``: the marks follow it."""
        ins = _arg_tensors(args, kwargs)
        const = next((c for c in (self._get(self._constant, t) for t in ins) if c is not None), None)
        held = next((h for h in (self._get(self._holding, t) for t in ins) if h is not None), None)
        if const is None and held is None:
            return
        name = getattr(func, "__name__", "")
        additive = name in _ADDITIVE or name in _SCALING and not any(
            t.requires_grad for t in ins if self._get(self._holding, t) is None)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            if not t.requires_grad:
                if const is not None and held is None:
                    self._constant[id(t)] = (weakref.ref(t), const[1])  # (still a constant)
            elif additive:
                self._holding[id(t)] = (weakref.ref(t), *(held[1:] if held is not None else (const[1], line)))

    def backward(self, roots: Sequence[Any]) -> None:
        for r in roots:
            held = self._get(self._holding, r) if isinstance(r, torch.Tensor) else None
            if held is not None:
                self.found = (held[1], held[2])


#: kl_div's functional forms: autograd records no node of its own for them (its graph is the
#: ops it is made of), so its input is judged at the call
_KL_DIV = (torch.nn.functional.kl_div, torch.kl_div)


def _softmax_output(t: Any) -> bool:
    """Whether ``t`` is the output of a softmax (probabilities), as its autograd node says."""
    fn = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
    return fn is not None and type(fn).__name__ == "SoftmaxBackward0"


class LossTape(TorchFunctionMode):
    """The loss code of one forward pass, recorded for a replay (see above): ``ops`` are
    ``(func, args, kwargs, (file, line), in place)`` with tensors as references (in place:
    the call returned nothing and changed its first argument), ``loss`` the
    references of the last backward's roots and gradients. Bounded (`MAX_TAPE_OPS`,
    `MAX_TAPE_BYTES`: past them the tape is dropped); it never raises in the user's code.

    Made by `LossTape.begin` on the watching thread, and taken off it by `end` (or, when it
    is not on top of the mode stack then, by a later `reap`).

    Examples:
        >>> x = torch.ones(2, requires_grad=True)
        >>> out = x * 2
        >>> tape = LossTape.begin([out])
        >>> loss = -torch.log(out - 2).sum()   # log(0): -inf in the loss code
        >>> tape.end()
        >>> [getattr(f, "__name__", "?") for f, _, _, _, _ in tape.ops]
        ['sub', 'log', 'sum', 'neg']
    """

    def __init__(self, outputs: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.ops: List[Tuple[Any, Any, Any, Optional[Tuple[str, int]], bool]] = []
        self.loss: Optional[Tuple[Any, Any]] = None
        self.recording = True
        self.ended = False
        self._made: Dict[int, Tuple[Any, int, Optional[int]]] = {}
        self._outs = {id(t): (weakref.ref(t), i) for i, t in enumerate(outputs)}
        self._bytes = 0
        self._thread = threading.get_ident()
        self.terms = ConstantTerms()
        #: patterns of the loss code seen in its calls, not in the autograd graph: ``(pattern, (file, line))``
        self.patterns: List[Tuple[str, Optional[Tuple[str, int]]]] = []

    # -- on and off the mode stack -------------------------------------------------------
    @classmethod
    def begin(cls, outputs: Sequence[torch.Tensor]) -> Optional["LossTape"]:
        """A tape of the code that runs on ``outputs`` from now on (None when a tape cannot
        be started: inside a compiled region)."""
        if torch.compiler.is_compiling():
            return None
        reap()
        tape = cls(outputs)
        torch._C._push_on_torch_function_stack(tape)
        return tape

    def end(self) -> None:
        """Stop recording and leave the mode stack (now, when on top of it on this thread;
        otherwise at a later `reap`)."""
        self.recording = False
        self.ended = True
        reap()

    def ended_here(self) -> bool:
        """Whether it ended and was begun on this thread (whose mode stack holds it)."""
        return self.ended and self._thread == threading.get_ident()

    def stop(self) -> None:
        """Stop recording (a replay is about to run the recorded calls)."""
        self.recording = False

    def _drop(self) -> None:
        """Over a bound, or a call it could not record: nothing is replayed."""
        self.recording = False
        self.ops.clear()
        self._made.clear()
        self.loss = None

    # -- recording ------------------------------------------------------------------------
    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        if not self.recording or torch.compiler.is_compiling():
            return _pass_through(func, args, kwargs)
        if any(func is b for b in _BACKWARD_CALLS):
            try:
                self._note_backward(func, args, kwargs or {})
            except Exception:  # (never raise in the user's code)
                self.loss = None
            # what runs inside the backward pass (graddbg's hooks, the user's) is not loss
            # code: not recorded, and not paid for op by op
            self.recording = False
            try:
                out = _pass_through(func, args, kwargs)
            finally:
                self.recording = not self.ended  # (a step boundary inside it ended the tape)
            if func is torch.autograd.grad:
                self._follow(self.terms.grads, args, kwargs, out)
            return out
        out = _pass_through(func, args, kwargs)
        if self.terms.active():
            self._follow(functools.partial(self.terms.call, func), args, kwargs, out)
        if func in _KL_DIV and _softmax_output((kwargs or {}).get("input", args[0] if args else None)):
            self.patterns.append(("kl_div on probabilities", _user_line()))
        try:
            self._record(func, args, kwargs or {}, out)
        except Exception:
            self._drop()
        return out

    def _follow(self, note: Any, args: Sequence[Any], kwargs: Optional[Dict[str, Any]], out: Any) -> None:
        try:
            note(args, kwargs or {}, out, _user_line(3))
        except Exception:  # (never raise in the user's code)
            self.terms = ConstantTerms()

    def _record(self, func: Any, args: Sequence[Any], kwargs: Dict[str, Any], out: Any) -> None:
        inplace = out is None and bool(args) and isinstance(args[0], torch.Tensor)  # (t[i] = v: it changed t)
        if inplace:
            out = args[0]
        single = isinstance(out, torch.Tensor)
        outs = (out,) if single else out if isinstance(out, (tuple, list)) else ()
        made = [(j, t) for j, t in enumerate(outs) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not made:
            return
        if len(self.ops) >= MAX_TAPE_OPS:
            raise _TapeFull
        refs = (self._refs(args), self._refs(kwargs))
        index = len(self.ops)
        self.ops.append((func, refs[0], refs[1], _user_line(), inplace))
        for j, t in made:
            self._made[id(t)] = (weakref.ref(t), index, None if single else j)

    def _note_backward(self, func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> None:
        if func is torch.Tensor.backward:
            roots: Any = args[0]
            grads = kwargs.get("gradient", args[1] if len(args) > 1 else None)
        elif func is torch.autograd.backward:
            roots = kwargs.get("tensors", args[0] if args else None)
            grads = kwargs.get("grad_tensors", args[1] if len(args) > 1 else None)
        else:  # torch.autograd.grad(outputs, inputs, grad_outputs)
            roots = kwargs.get("outputs", args[0] if args else None)
            grads = kwargs.get("grad_outputs", args[2] if len(args) > 2 else None)
        roots = [roots] if isinstance(roots, torch.Tensor) else list(roots or ())
        if func is not torch.autograd.grad:
            self.terms.backward(roots)
        if grads is not None:
            grads = [grads] if isinstance(grads, torch.Tensor) else list(grads)
        self.loss = (self._refs(roots), None if grads is None else self._refs(grads))

    def _refs(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._ref(obj)
        if type(obj) in (list, tuple):
            return type(obj)(self._refs(x) for x in obj)
        if type(obj) is dict:
            return {k: self._refs(v) for k, v in obj.items()}
        return obj

    def _ref(self, t: torch.Tensor) -> Any:
        made = self._made.get(id(t))
        if made is not None and made[0]() is t:
            return _Made(made[1], made[2])
        out = self._outs.get(id(t))
        if out is not None and out[0]() is t:
            return _Out(out[1])
        if t.layout is _STRIDED:
            self._bytes += t.numel() * t.element_size()
        if self._bytes > MAX_TAPE_BYTES:
            raise _TapeFull
        return _Const(t.detach())


def reap() -> None:
    """Take the ended tapes off the top of this thread's torch-function mode stack (a tape
    that ended while it was not on top, as inside the backward pass it saw start)."""
    while True:
        n = torch._C._len_torch_function_stack()
        if not n:
            return
        top = torch._C._get_function_stack_at(n - 1)
        if not (isinstance(top, LossTape) and top.ended_here()):
            return
        torch._C._pop_torch_function_stack()


def _replay_loss(tape: LossTape, outs: List[torch.Tensor], scan: NonFiniteScan) -> None:
    """Run the recorded loss code again on the replayed output ``outs``, each call blamed on
    its own line, then its backward pass down to the output, all under ``scan``: raises
    `NonFiniteError` at the op that makes the NaN/Inf (nothing when none is made)."""
    tape.stop()
    if tape.loss is None or not tape.ops:
        return
    values: Dict[int, Any] = {}

    def value(ref: Any) -> Any:
        if isinstance(ref, _Made):
            v = values[ref.op]
            return v if ref.pos is None else v[ref.pos]
        if isinstance(ref, _Out):
            return outs[ref.i]
        if isinstance(ref, _Const):
            return ref.t.clone()
        if type(ref) in (list, tuple):
            return type(ref)(value(x) for x in ref)
        if type(ref) is dict:
            return {k: value(v) for k, v in ref.items()}
        return ref

    for i, (func, args, kwargs, line, inplace) in enumerate(tape.ops):
        scan.source_at = line
        try:
            args = value(args)
            out = func(*args, **value(kwargs))
            values[i] = args[0] if inplace else out
        finally:
            scan.source_at = None
    roots, grads = value(tape.loss[0]), None if tape.loss[1] is None else value(tape.loss[1])
    keep = [i for i, r in enumerate(roots) if isinstance(r, torch.Tensor) and r.requires_grad]
    wrt = [o for o in outs if o.requires_grad]
    if not keep or not wrt:
        return
    torch.autograd.grad([roots[i] for i in keep], wrt, allow_unused=True,
                        grad_outputs=None if grads is None else [grads[i] for i in keep])


def replay(model: torch.nn.Module, cap: Capture, step: int) -> Tuple[bool, Optional[Anomaly]]:
    """Run the captured forward pass again, and backward with the captured output
    gradient, under `find_nonfinite`: the op, module and source line that made the
    first NaN/Inf. Parameters' ``.grad``, buffers and the RNG are left as they were.
    Returns ``(ran, anomaly)``: ``anomaly`` is None when the replay made no non-finite
    value; ``ran`` is False when the replay could not run at all."""
    model = unwrap(model)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    grads = [(p, p.grad) for p in model.parameters()]
    cpu_rng = torch.get_rng_state()
    try:
        if cap.rng is not None:
            torch.set_rng_state(cap.rng)
        with find_nonfinite(model) as scan, torch.enable_grad():
            return True, _replay_passes(model, cap, step, scan)
    except NonFiniteError as e:
        return True, getattr(e, "anomaly", None)
    except Exception:  # a replay that cannot run (a model with side effects) blames nothing
        return False, None
    finally:
        torch.set_rng_state(cpu_rng)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in grads:
            p.grad = g


def _replay_passes(model: torch.nn.Module, cap: Capture, step: int, scan: NonFiniteScan) -> Optional[Anomaly]:
    outs = tensors_in(model(*cap.args, **cap.kwargs))
    if cap.grad is not None and not bool(torch.isfinite(cap.grad).all()):
        # the forward pass is finite (find_nonfinite would have raised), its output gradient is
        # not: the loss code made it; its tape, replayed, names the op and the line
        if cap.tape is not None:
            try:
                _replay_loss(cap.tape, outs, scan)
            except NonFiniteError as e:
                a = e.anomaly
                if a is not None and a.module is None:  # (outside every module: the loss code)
                    a = dataclasses.replace(a, module="<loss>")
                raise NonFiniteError(str(e), anomaly=a) from None
        return Anomaly(step=step, kind="nonfinite", name=None, module="<loss>", op=None, value=math.nan,
                       threshold=None, source=None,
                       message="the model's forward pass is finite but the gradient arriving at its "
                               "output is not: the NaN/Inf was made in the loss computation, outside the model")
    if cap.grad is None or cap.output_index >= len(outs):
        return None
    wrt = [p for p in model.parameters() if p.requires_grad]
    wrt += [a for a in tensors_in(cap.args) if a.requires_grad and a.is_leaf]
    torch.autograd.grad(outs[cap.output_index], wrt, grad_outputs=cap.grad, allow_unused=True)
    return None


def forward_producer(act_fwd: Sequence[Tuple[int, Any, Any]], flags: Any) -> Optional[int]:
    """The first module (index) whose forward output was non-finite while its inputs were
    finite, from the activation flags ``[n, 2]`` (input bad, output bad) in call order."""
    for (mi, _, _), (in_bad, out_bad) in zip(act_fwd, flags.reshape(-1, 2)):
        if out_bad and not in_bad:
            return mi
    return None


def backward_producer(call_order: Sequence[int], finite: Dict[int, bool], names: Sequence[str],
                      bad_names: Sequence[str]) -> Optional[str]:
    """The leaf module whose output gradient was finite while the gradient it passed on
    (the output gradient of the leaf before it in forward order) or its own parameter
    gradients were not. Exact for chains of modules; a good guess for other graphs."""
    order = [mi for mi in dict.fromkeys(call_order) if mi in finite]
    for k in range(len(order) - 1, -1, -1):
        mi = order[k]
        if not finite[mi]:
            continue
        own_bad = any(n.startswith(names[mi] + ".") for n in bad_names)
        if own_bad or (k > 0 and not finite[order[k - 1]]):
            return names[mi]
    return None
