"""pytest plugin of graddbg (registered through the ``pytest11`` entry point).

It gives one fixture, ``graddbg_check``: it seeds Python's, torch's (and numpy's, when
numpy is already imported) random number generators before the test, puts their states
back after it, and hands the test the gradcheck helpers::

    def test_my_square(graddbg_check):
        x = torch.randn(5, dtype=torch.float64, requires_grad=True)
        graddbg_check.assert_gradients_close(MySquare.apply, x)
        assert graddbg_check.gradcheck(MySquare.apply, x, mode="fast").ok

The seed is 0, or ``--graddbg-seed N`` on the command line (an int in [0, 2**32), the
range every one of those generators accepts). Importing this module (pytest does, at start-up,
through the pytest11 entry point) imports graddbg, hence torch.
"""
from __future__ import annotations

import argparse
import random
import sys
from typing import Any, Iterator

import pytest

__all__ = ["GradcheckHelpers", "graddbg_check"]

_SEEDS = 2 ** 32        # numpy.random.seed takes [0, 2**32); torch and random take more


def _check_seed(seed: Any, where: str) -> int:
    """``seed`` if it is an int in [0, 2**32); else a TypeError / ValueError naming ``where``."""
    from graddbg._errors import GraddbgTypeError, GraddbgValueError

    if isinstance(seed, bool) or not isinstance(seed, int):
        raise GraddbgTypeError(f"{where}: seed={seed!r} must be an int in [0, 2**32), got "
                               f"{type(seed).__name__}")
    if not 0 <= seed < _SEEDS:
        raise GraddbgValueError(f"{where}: seed={seed} must be an int in [0, 2**32) (the seeds "
                                f"Python's, torch's and numpy's generators all accept)")
    return seed


def _seed_option(text: str) -> int:
    """The value of ``--graddbg-seed`` (pytest reports a bad one as a usage error, after
    ``argument --graddbg-seed:``)."""
    try:
        seed = int(text)
    except ValueError:
        seed = -1
    if not 0 <= seed < _SEEDS:
        raise argparse.ArgumentTypeError(f"got {text!r}, expected an int in [0, 2**32) (the seeds "
                                         f"Python's, torch's and numpy's generators all accept)")
    return seed


class GradcheckHelpers:
    """What the ``graddbg_check`` fixture returns: the gradcheck helpers and the seed.

    Examples:
        >>> helpers = GradcheckHelpers(seed=0)
        >>> import torch
        >>> x = torch.randn(3, dtype=torch.float64, requires_grad=True)
        >>> helpers.gradcheck(torch.sin, x).ok
        True
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = _check_seed(seed, "GradcheckHelpers")

    def gradcheck(self, fn: Any, *inputs: Any, **kw: Any) -> Any:
        """``graddbg.gradcheck`` (see there)."""
        from graddbg.gradcheck import gradcheck

        return gradcheck(fn, *inputs, **kw)

    def gradgradcheck(self, fn: Any, *inputs: Any, **kw: Any) -> Any:
        """``graddbg.gradgradcheck`` (see there)."""
        from graddbg.gradcheck import gradgradcheck

        return gradgradcheck(fn, *inputs, **kw)

    def check_module(self, module: Any, *inputs: Any, **kw: Any) -> Any:
        """``graddbg.check_module`` (see there)."""
        from graddbg.gradcheck import check_module

        return check_module(module, *inputs, **kw)

    def assert_gradients_close(self, fn_or_module: Any, *inputs: Any, **kw: Any) -> None:
        """``graddbg.assert_gradients_close`` (see there)."""
        from graddbg.gradcheck import assert_gradients_close

        assert_gradients_close(fn_or_module, *inputs, **kw)

    def __repr__(self) -> str:
        return f"GradcheckHelpers(seed={self.seed})"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("graddbg")
    group.addoption("--graddbg-seed", type=_seed_option, default=0, dest="graddbg_seed",
                    help="seed of the RNGs set by the graddbg_check fixture: an int in "
                         "[0, 2**32) (default 0)")


@pytest.fixture
def graddbg_check(request: pytest.FixtureRequest) -> Iterator[GradcheckHelpers]:
    """Seed the RNGs (put back after the test) and return the gradcheck helpers."""
    import torch

    helpers = GradcheckHelpers(request.config.getoption("graddbg_seed", default=0))
    seed = helpers.seed
    py_state = random.getstate()
    numpy = sys.modules.get("numpy")
    np_state = numpy.random.get_state() if numpy is not None else None
    with torch.random.fork_rng(devices=[], enabled=True):
        cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        random.seed(seed)
        torch.manual_seed(seed)
        if numpy is not None:
            numpy.random.seed(seed)
        try:
            yield helpers
        finally:
            random.setstate(py_state)
            if numpy is not None and np_state is not None:
                numpy.random.set_state(np_state)
            if cuda_states is not None:
                torch.cuda.set_rng_state_all(cuda_states)
