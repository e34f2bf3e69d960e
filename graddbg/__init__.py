"""graddbg: find out what is wrong with the gradients of a PyTorch program, and where.

>>> import torch, graddbg
>>> model = torch.nn.Linear(3, 2)
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> with graddbg.watch(model, opt) as w:
...     for _ in range(3):
...         model(torch.randn(4, 3)).sum().backward()
...         opt.step()
...         opt.zero_grad()
>>> sorted(w.stats["name"].unique())
['bias', 'weight']

``import graddbg`` imports torch and nothing heavier: the public names below are
resolved on first use, and pandas, matplotlib and graphviz are imported only by the
functions that need them.
"""
from __future__ import annotations

import importlib
from typing import Any

from graddbg._errors import __all__ as _errors_all
from graddbg._errors import (  # noqa: F401 (re-exported)
    CompileWarning,
    CoverageWarning,
    DDPInconsistencyError,
    DDPTimeoutError,
    DotNotFoundError,
    GraddbgError,
    GraddbgTypeError,
    GraddbgValueError,
    GraddbgWarning,
    GradientAnomalyError,
    GradientMismatchError,
    NonFiniteError,
    PrecisionWarning,
)

__version__ = "0.1.0"

# ``graddbg.gradcheck`` is the function, as ``torch.autograd.gradcheck`` is: importing a
# submodule binds the package attribute to the module (once, after the submodule's code has
# run) unless the package imported it first. So the package imports it here (it costs
# torch's import); ``from graddbg.gradcheck import check_module`` still reaches the module.
from graddbg.gradcheck import gradcheck  # noqa: E402  (after the errors it uses)

# public name -> module that defines it (resolved lazily, see __getattr__)
_LAZY = {
    "watch": "graddbg.hooks",
    "Watch": "graddbg.hooks",
    "load": "graddbg.run",
    "Run": "graddbg.run",
    "Anomaly": "graddbg.anomaly",
    "NonFinite": "graddbg.anomaly",
    "Explode": "graddbg.anomaly",
    "Vanish": "graddbg.anomaly",
    "find_nonfinite": "graddbg.blame",
    "check_module": "graddbg.gradcheck",
    "assert_gradients_close": "graddbg.gradcheck",
    "GradcheckResult": "graddbg.gradcheck",
    "gradgradcheck": "graddbg.gradcheck",
    "graph": "graddbg.graphviz",
    "Graph": "graddbg.graphviz",
    "grad_stats": "graddbg.stats",
}
# (graddbg.gradcheck is the function, imported above; the module is graddbg.gradcheck's
# __module__, reached by ``from graddbg.gradcheck import ...``)
_SUBMODULES = ("stats", "anomaly", "blame", "hooks", "graphviz", "plots", "report",
               "ddp_verify", "cli", "run", "pytest_plugin")

__all__ = ["gradcheck", *_LAZY, *_SUBMODULES, *_errors_all, "__version__"]

# names kept importable from earlier versions that are not in the public reference (graddbg's
# own machinery)
_KEPT = {"HookSet": "graddbg.hooks"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY and name not in _SUBMODULES and name not in _KEPT:
        raise AttributeError(f"module 'graddbg' has no attribute {name!r}")
    target = _LAZY.get(name) or _KEPT.get(name) or f"graddbg.{name}"
    try:
        module = importlib.import_module(target)
    except AttributeError as e:  # would be reported as a missing attribute of graddbg
        raise ImportError(f"importing {target} failed: {e!r}") from e
    value = getattr(module, name) if name in _LAZY or name in _KEPT else module
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
