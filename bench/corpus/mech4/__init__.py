"""The fourth corpus (issue 39, point 5): a fresh held-out half, mined by mechanism
(bench/corpus/mechanisms.py) after the third one was spent; one module per mechanism,
each with a list ``CASES``. Every module here is collected; none imports graddbg."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Dict, List

from .._common import Case

MODULES: Dict[str, List[Case]] = {}
for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if not _info.name.startswith("_"):
        MODULES[_info.name] = list(importlib.import_module(f"{__name__}.{_info.name}").CASES)

CASES: List[Case] = [c for cases in MODULES.values() for c in cases]
