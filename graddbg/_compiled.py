"""A tensor function with a compiled twin: ``torch.compile`` on demand, used only after it
has given the eager function's result bit for bit on a self-test, else never again.

When to compile is ski rental (`Twin.due`): the eager cost is paid until it adds up to about
what one compilation costs (``rent`` seconds), then the function is compiled, so a process
never spends much more than twice the better of the two choices. A process that never pays
that much (small models, rare checks) never compiles. `Twin.select` overrides the choice.

This module imports nothing of graddbg.
"""
from __future__ import annotations

import threading
import warnings
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch

__all__ = ["Twin", "KINDS"]

KINDS = ("auto", "compiled", "eager")


def _reason(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"torch.compile failed ({type(exc).__name__}: {first[:200]})"


class Twin:
    """``fn`` (pure tensor code) and its compiled twin, per device type.

    Args:
        fn: the function to compile; also the eager reference of the self-test.
        samples: ``samples(device)`` -> argument tuples for the self-test on ``device``.
        rent: seconds of eager work after which ``"auto"`` compiles.
    """

    def __init__(self, fn: Callable[..., torch.Tensor],
                 samples: Callable[[torch.device], Iterable[Tuple[Any, ...]]], rent: float) -> None:
        self.fn, self.samples, self.rent = fn, samples, rent
        self.kind = "auto"
        self.spent = 0.0                                  # seconds of eager work so far
        self._state: Dict[str, Any] = {}                  # device type -> compiled fn or why not
        self._lock = threading.Lock()

    def charge(self, seconds: float) -> None:
        """Count ``seconds`` of eager work (towards ``rent``)."""
        self.spent += seconds

    def due(self, device: torch.device) -> Optional[Callable[..., torch.Tensor]]:
        """The compiled function for ``device`` when it is (or now becomes) the one to use;
        None: use the eager one."""
        state = self._state.get(device.type)
        if callable(state):
            return state if self.kind != "eager" else None
        if state is not None or self.kind == "eager" or torch.compiler.is_compiling():
            return None
        if self.kind == "auto" and self.spent < self.rent:
            return None
        return self.build(device)

    def build(self, device: torch.device) -> Optional[Callable[..., torch.Tensor]]:
        """Compile for ``device`` (once) and self-test; the compiled function, or None
        (`why_not` says why)."""
        with self._lock:
            if device.type not in self._state:
                self._state[device.type] = self._compile(device)
        state = self._state[device.type]
        return state if callable(state) else None

    def _compile(self, device: torch.device) -> Any:
        compiled: Any = None

        def run(*args: Any) -> torch.Tensor:
            with torch.no_grad():       # one grad mode, whatever the caller's: no recompiles
                return compiled(*args)
        try:
            with warnings.catch_warnings():     # torch's own deprecations, met while compiling
                warnings.simplefilter("ignore", DeprecationWarning)
                compiled = torch.compile(self.fn, dynamic=True)
                for args in self.samples(device):
                    if not torch.equal(run(*args), self.fn(*args)):
                        return "the compiled kernel's result differed from the eager one's on the self-test"
        except Exception as exc:            # no C++ compiler, no triton, an unsupported platform
            return _reason(exc)
        return run

    def why_not(self, device: torch.device) -> Optional[str]:
        """Why ``device`` has no compiled twin (None: it has one, or none was tried)."""
        state = self._state.get(device.type)
        return state if isinstance(state, str) else None

    def select(self, kind: str, device: torch.device) -> str:
        """Use ``kind`` from now on (one of `KINDS`); ``"compiled"`` compiles for
        ``device`` at once. Returns the kind in use: ``"compiled"``, ``"eager"`` (with the
        reason when compiling failed) or ``"auto"``."""
        self.kind = kind
        if kind != "compiled":
            return kind
        if self.build(device) is None:
            self.kind = "eager"
            return f"eager: {self.why_not(device)}"
        return "compiled"
