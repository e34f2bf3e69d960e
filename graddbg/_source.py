"""Where in the user's code something happened: the innermost frame outside torch and graddbg."""
from __future__ import annotations

import os
from typing import Optional

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
