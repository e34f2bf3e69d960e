"""Every docstring example in the package runs and gives what it shows."""
from __future__ import annotations

import doctest
import importlib
import pathlib

import pytest

import graddbg

MODULES = sorted(p.stem for p in pathlib.Path(graddbg.__file__).parent.glob("*.py")
                 if p.stem not in ("__main__",))


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples(module):
    name = "graddbg" if module == "__init__" else f"graddbg.{module}"
    mod = importlib.import_module(name)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
