"""Where in the user's code something happened: the innermost frame outside torch and graddbg."""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, Optional, Tuple

import torch

# folders whose code is never the user's: torch itself and graddbg (each with its separator,
# so that torchvision, torchaudio or torch_geometric next to torch count as the user's code)
_TORCH_DIR = os.path.join(os.path.dirname(torch.__file__), "")
_GRADDBG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")
_SKIP = (_TORCH_DIR, _GRADDBG_DIR, "<frozen ")


# graddbg's own files that hold user-level code (the demo's model and training loop)
_USER_FILES = (os.path.join(_GRADDBG_DIR, "_demo_model.py"),)


def is_internal(filename: str) -> bool:
    if filename in _USER_FILES:
        return False
    return filename.startswith(_SKIP) or filename.endswith("contextlib.py")


_INTERNAL: Dict[str, bool] = {}  # (file name -> is_internal, cached)


def user_line(depth: int = 2) -> Optional[Tuple[str, int]]:
    """(file, line) of the innermost frame outside torch and graddbg, from ``depth`` frames
    up (2: the caller's caller); None when there is none (a thread with no user frame)."""
    cache = _INTERNAL
    f: Any = sys._getframe(depth)
    while f is not None:
        fn = f.f_code.co_filename
        internal = cache.get(fn)
        if internal is None:
            internal = cache[fn] = is_internal(fn)
        if not internal:
            return fn, f.f_lineno
        f = f.f_back
    return None


def user_source_from_stack(stack: "list[str] | str | None") -> Optional[str]:
    """Pick the innermost user frame from a formatted traceback (as autograd's anomaly
    mode stores in ``node.metadata["traceback_"]``)."""
    if not stack:
        return None
    if isinstance(stack, str):
        stack = [stack]
    best = None
    for entry in stack:
        for line in entry.splitlines():
            line = line.strip()
            if line.startswith('File "'):
                try:
                    filename = line.split('"')[1]
                    lineno = int(line.split("line ")[1].split(",")[0])
                except (IndexError, ValueError):
                    continue
                if not is_internal(filename):
                    best = f"{filename}:{lineno}"
    return best
