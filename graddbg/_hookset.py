"""`HookSet`: every hook handle registered, every one removed (re-exported by `graddbg.hooks`,
where its users find it). Here, below everything that registers hooks (`graddbg.hooks`,
`graddbg._dist`), so that none of them imports another for it.

This module imports nothing of graddbg.
"""
from __future__ import annotations

from typing import Any, List

__all__ = ["HookSet"]


class HookSet:
    """Owns hook handles: every handle added here is removed by `remove_all`.

    Examples:
        >>> import torch
        >>> hs = HookSet()
        >>> m = torch.nn.Linear(2, 2)
        >>> _ = hs.add(m.register_forward_hook(lambda *a: None))
        >>> len(m._forward_hooks), len(hs)
        (1, 1)
        >>> hs.remove_all(); len(m._forward_hooks)
        0
    """

    def __init__(self) -> None:
        self._handles: List[Any] = []

    def add(self, handle: Any) -> Any:
        self._handles.append(handle)
        return handle

    @property
    def ids(self) -> set:
        return {h.id for h in self._handles if hasattr(h, "id")}

    def remove_all(self) -> None:
        while self._handles:
            handle = self._handles.pop()
            try:
                handle.remove()
            except Exception:  # a handle whose owner is gone is already removed
                pass

    def __len__(self) -> int:
        return len(self._handles)
