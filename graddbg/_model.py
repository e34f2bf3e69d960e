"""What every part of graddbg needs to know about a user's model, written once.

- `unwrap`: the module that DDP, DataParallel, ``torch.compile``, FSDP1,
  activation-checkpoint wrappers and DeepSpeed's engine hold, so that names and replays are the user's own;
- `check_model`: the one validation of a ``model=`` argument;
- `clean_name`, `module_of`, `named_trainable_parameters`: qualified
  names as ``model.named_parameters()`` gives them, without the wrappers' prefixes;
- `tensors_in`, `named_tensors`: the tensors inside a nested output (tuples,
  lists, dicts, dataclasses, namedtuples, ``ModelOutput``), walked iteratively.

Imports torch and `graddbg._errors` only.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Iterable, List, Optional, Tuple

import torch
from torch import Tensor, nn

__all__ = [
    "unwrap",
    "is_compiled",
    "check_model",
    "clean_name",
    "module_of",
    "named_trainable_parameters",
    "tensors_in",
    "named_tensors",
    "in_backward",
    "is_dtensor",
    "local_values",
]

# prefixes that wrappers put in front of the user's parameter names
_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
# attributes under which wrappers hold the wrapped module, by wrapper class name
_INNER = {
    "DistributedDataParallel": "module",
    "DataParallel": "module",
    "OptimizedModule": "_orig_mod",
    "FullyShardedDataParallel": "_fsdp_wrapped_module",
    "CheckpointWrapper": "_checkpoint_wrapped_module",
    "OffloadWrapper": "_checkpoint_wrapped_module",
    "DeepSpeedEngine": "module",
}


def unwrap(model: nn.Module) -> nn.Module:
    """The module a chain of wrappers (DDP, DataParallel, ``torch.compile``, FSDP1,
    checkpoint wrappers) holds; the model itself when it is not wrapped. FSDP2's
    ``fully_shard`` changes the module in place, so there is nothing to unwrap.

    >>> m = torch.nn.Linear(2, 2)
    >>> unwrap(torch.nn.DataParallel(m)) is m
    True
    """
    for _ in range(8):
        attr = _INNER.get(type(model).__name__)
        # (the module's own _modules dict: Module.__getattr__ would format an error message)
        inner = model.__dict__.get("_modules", {}).get(attr) if attr else None
        if not isinstance(inner, nn.Module):
            return model
        model = inner
    return model


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (an FSDP2, HSDP or tensor-parallel parameter or gradient),
    recognised without importing ``torch.distributed.tensor``: the one definition graddbg
    uses.

    >>> is_dtensor(torch.ones(2))
    False
    """
    return hasattr(t, "device_mesh") and hasattr(t, "placements") and hasattr(t, "to_local")


def local_values(t: Any, reduce_partial: bool = False) -> Any:
    """This rank's values of ``t``, detached: a DTensor's local shard (its stored values;
    pending sums of a ``Partial`` placement not reduced, unless ``reduce_partial``: then
    reduced first, a collective over the mesh), else ``t`` itself. The one name graddbg
    uses for "what this rank holds" (see docs/architecture.md, the glossary).

    >>> local_values(torch.ones(2, requires_grad=True)).requires_grad
    False
    """
    if not is_dtensor(t):
        return t.detach()
    if reduce_partial and any(p.is_partial() for p in t.placements):
        from torch.distributed.tensor import Replicate

        t = t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in t.placements])
    return t.detach().to_local()


def in_backward() -> bool:
    """Whether a backward pass is running on this thread (activation checkpointing
    recomputes forward passes inside one). Only to be called outside compiled code."""
    # (no public function tells: the engine's current graph task)
    return torch._C._current_graph_task_id() != -1


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` is a ``torch.compile`` wrapper (hooks on it run outside the graph)."""
    return type(model).__name__ == "OptimizedModule" or "_orig_mod" in model.__dict__.get("_modules", {})


def check_model(model: Any, fn: str, arg: str = "model") -> nn.Module:
    """``model`` if it is an ``nn.Module`` instance; else a ``TypeError`` naming ``fn``'s
    argument, what was given and the fix.

    >>> check_model(torch.nn.Linear, "watch")
    Traceback (most recent call last):
    ...
    graddbg._errors.GraddbgTypeError: watch(model=...): got the class Linear, expected an nn.Module instance; instantiate it first: Linear(...)
    """
    from graddbg._errors import GraddbgTypeError

    if isinstance(model, type) and issubclass(model, nn.Module):
        raise GraddbgTypeError(f"{fn}({arg}=...): got the class {model.__name__}, expected an nn.Module "
                               f"instance; instantiate it first: {model.__name__}(...)")
    if not isinstance(model, nn.Module):
        raise GraddbgTypeError(f"{fn}({arg}=...): got {type(model).__name__}, expected a torch.nn.Module "
                               f"(a plain module or its DDP / compiled wrapper)")
    return model


def clean_name(name: str) -> str:
    """Strip the wrappers' prefixes (DDP's ``module.``, torch.compile's ``_orig_mod.``).

    Leading prefixes are removed however they nest; a compiled submodule's ``_orig_mod.``
    inside the name is removed too.

    Args:
        name: a parameter or module name as a wrapped model's ``named_parameters()`` or
            ``named_modules()`` gives it.

    Returns:
        str: the name in the user's model.

    Raises:
        AttributeError: ``name`` is not a string (not checked: the caller passes names).

    Examples:
        >>> clean_name("module._orig_mod.fc.weight")
        'fc.weight'
    """
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    for prefix in _PREFIXES[1:]:
        name = name.replace("." + prefix, ".")
    return name


def module_of(name: str) -> str:
    """The qualified module name that owns a parameter name ("" for the root).

    A parametrized weight (``torch.nn.utils.parametrize``, ``weight_norm``) belongs to the
    layer it parametrizes.

    Args:
        name: a (clean) parameter name, dotted as ``named_parameters()`` gives it.

    Returns:
        str: the owning module's qualified name; ``""`` for a parameter of the root module.

    Raises:
        AttributeError: ``name`` is not a string (not checked: the caller passes names).

    Examples:
        >>> module_of("encoder.layers.0.linear1.weight"), module_of("bias")
        ('encoder.layers.0.linear1', '')
        >>> module_of("0.parametrizations.weight.original0")
        '0'
    """
    head, sep, _ = name.partition(".parametrizations.")
    if sep:
        return head
    if name.startswith("parametrizations."):
        return ""
    return name.rsplit(".", 1)[0] if "." in name else ""


def named_trainable_parameters(model_or_named_params: Any) -> List[Tuple[str, nn.Parameter]]:
    """(clean name, parameter) for every parameter that requires grad, tied ones once.

    Names are the model's own, without the ``module.`` / ``_orig_mod.`` prefixes of DDP,
    FSDP and compiled wrappers.

    Args:
        model_or_named_params: an ``nn.Module``, a dict of name -> tensor, or an iterable
            of (name, tensor) pairs.

    Returns:
        A list of (clean name, parameter).

    Raises:
        GraddbgTypeError: anything else, or a pair whose value is not a tensor.

    Examples:
        >>> lin = torch.nn.Linear(2, 2); _ = lin.bias.requires_grad_(False)
        >>> [n for n, _ in named_trainable_parameters(lin)]
        ['weight']
    """
    from graddbg._errors import GraddbgTypeError

    if isinstance(model_or_named_params, nn.Module):
        items: Iterable[Any] = model_or_named_params.named_parameters()  # deduplicates tied ones
    elif isinstance(model_or_named_params, Mapping):
        items = model_or_named_params.items()
    else:
        try:
            items = list(model_or_named_params)
        except TypeError:
            raise GraddbgTypeError("expected an nn.Module, a dict of name -> tensor or an iterable of "
                                   f"(name, tensor) pairs, got {type(model_or_named_params).__name__}") from None
    out, seen = [], set()
    for item in items:
        try:
            name, p = item
        except (TypeError, ValueError):
            raise GraddbgTypeError(f"expected (name, tensor) pairs, got {type(item).__name__}") from None
        if not isinstance(p, Tensor):
            raise GraddbgTypeError(f"expected tensors as parameters, got {type(p).__name__} for {name!r}")
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        out.append((clean_name(name), p))
    return out


def _children(obj: Any) -> Optional[List[Tuple[str, Any]]]:
    """The named items of a container (None for a leaf)."""
    if isinstance(obj, (str, bytes)):
        return None
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return list(zip(obj._fields, obj))
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):  # dict, transformers' ModelOutput (an OrderedDict)
        return [(str(k), v) for k, v in obj.items()]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj)]
    return None


def named_tensors(obj: Any, *, floating: bool = True, max_depth: int = 16) -> List[Tuple[str, Tensor]]:
    """``(path, tensor)`` for every tensor inside a nested output, in order, each tensor
    once; paths read like the code that would reach it (``"logits"``, ``"[0]"``,
    ``"past[1].key"``). ``floating``: skip integer and bool tensors (ids, masks), which
    carry no gradient and cannot be NaN. Iterative: no recursion limit.

    >>> out = {"logits": torch.zeros(2), "ids": torch.zeros(2, dtype=torch.long), "aux": (torch.ones(1),)}
    >>> [p for p, _ in named_tensors(out)]
    ['logits', 'aux[0]']
    """
    found: List[Tuple[str, Tensor]] = []
    seen: set = set()
    stack: List[Tuple[str, Any, int]] = [("", obj, 0)]
    while stack:
        path, item, depth = stack.pop()
        if isinstance(item, Tensor):
            if id(item) not in seen and (not floating or item.is_floating_point() or item.is_complex()):
                seen.add(id(item))
                found.append((path, item))
            continue
        if depth >= max_depth or id(item) in seen:
            continue
        kids = _children(item)
        if not kids:
            continue
        seen.add(id(item))
        for key, value in reversed(kids):
            sep = "" if (not path or key.startswith("[")) else "."
            stack.append((f"{path}{sep}{key}", value, depth + 1))
    return found


def tensors_in(obj: Any, *, floating: bool = True) -> List[Tensor]:
    """The tensors of `named_tensors`, without their paths (a plain tensor is
    returned at once: the common case of a forward hook).

    >>> len(tensors_in((torch.ones(1), [torch.ones(2)], "text")))
    2
    """
    if type(obj) is Tensor:
        return [obj] if (not floating or obj.is_floating_point() or obj.is_complex()) else []
    return [t for _, t in named_tensors(obj, floating=floating)]
