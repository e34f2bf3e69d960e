"""Copies of a watched module carry nothing of graddbg.

``copy.deepcopy``, ``pickle`` and ``torch.save`` take a module's state from
``__getstate__``; while watched, each module that holds a hook of the watch gets one in its
instance dict that hands back the state without graddbg's hook entries (and without
itself). Removed, or the previous one put back, on close."""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any, Dict, List, Tuple

from torch import nn

from graddbg.checks.base import Check, Watched

__all__ = ["CopyGuard"]

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
               "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


class CopyGuard(Check):
    """Keeps the watch's hooks out of copies of the modules it hooks."""

    def __init__(self) -> None:
        self._saved: List[Tuple[nn.Module, Any]] = []

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self._hooks = weakref.ref(ctx.hooks)

    def protect(self, module: nn.Module) -> None:
        prev = module.__dict__.get("__getstate__")
        hooks_ref = self._hooks
        mod_ref = weakref.ref(module)

        def __getstate__() -> Dict[str, Any]:
            mod = mod_ref()
            state = prev() if prev is not None else type(mod).__getstate__(mod)
            state.pop("__getstate__", None)
            hs = hooks_ref()
            ours = hs.ids if hs is not None else set()
            for key in _HOOK_DICTS:
                d = state.get(key)
                if d and ours & set(d):
                    state[key] = type(d)((k, v) for k, v in d.items() if k not in ours) \
                        if isinstance(d, OrderedDict) else {k: v for k, v in d.items() if k not in ours}
            return state

        module.__dict__["__getstate__"] = __getstate__
        self._saved.append((module, prev))

    def close(self) -> None:
        while self._saved:
            module, prev = self._saved.pop()
            if prev is None:
                module.__dict__.pop("__getstate__", None)
            else:
                module.__dict__["__getstate__"] = prev
