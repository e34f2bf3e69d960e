"""The notebooks in notebooks/: stored without outputs, and each runs end to end.

Each notebook checks its own results in ``assert`` cells, so executing it (nbclient, a
fresh ``python3`` kernel, a temporary working directory for the files it writes) is the
test: any cell error fails it.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = [
    "01_quickstart.ipynb",
    "02_hunting_a_nan.ipynb",
    "03_gradcheck_custom_function.ipynb",
    "04_graphs.ipynb",
    "05_ddp_checks.ipynb",
]
CELL_TIMEOUT_S = 120  # per cell; the slowest cell (two spawned ranks) takes 15-25 s on a busy machine
# outputs each notebook must show when executed: (mime type, at least how many)
DISPLAYS = {
    "01_quickstart.ipynb": ("image/png", 4),       # the four plots, inline
    "04_graphs.ipynb": ("image/svg+xml", 4),       # the four graphs (when dot is installed)
}
_PROBE = "import sys, graddbg; print(sys.executable); print(graddbg.__file__)"


def _load(name: str):
    import nbformat

    return nbformat.read(str(NOTEBOOK_DIR / name), as_version=4)


def test_the_notebooks_listed_are_the_notebooks_stored():
    assert sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb")) == NOTEBOOKS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_stored_without_outputs(name: str):
    import nbformat

    nb = _load(name)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{name} has no code cells"
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert dirty == [], f"{name}: cells {dirty} have stored outputs or execution counts; clear them"
    assert nb.metadata["kernelspec"]["name"] == "python3"
    # every notebook checks what it shows
    assert sum("assert " in c.source for c in code) >= 3, f"{name} checks too little"


@pytest.mark.slow  # each starts a Jupyter kernel and imports torch (5-30 s)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_end_to_end(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import nbclient
    import nbformat

    nb = _load(name)
    # the kernel must be this interpreter (the venv), importing this checkout's graddbg
    nb.cells.insert(0, nbformat.v4.new_code_cell(_PROBE))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    before = sorted(p.name for p in NOTEBOOK_DIR.iterdir())
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", allow_errors=False,
        resources={"metadata": {"path": str(tmp_path)}})  # the kernel's working directory
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as err:  # show the failing cell's traceback
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(err))  # IPython colours its tracebacks
        pytest.fail(f"{name} failed:\n{text}", pytrace=False)

    # files the notebook writes land in its working directory, not next to it
    assert sorted(p.name for p in NOTEBOOK_DIR.iterdir()) == before
    probe = "".join(o.get("text", "") for o in nb.cells[0].outputs).split()
    assert probe[0] == sys.executable, f"the kernel runs {probe[0]}, not {sys.executable}"
    import graddbg

    assert os.path.samefile(probe[1], graddbg.__file__)

    if name in DISPLAYS:
        mime, least = DISPLAYS[name]
        if mime == "image/svg+xml":
            import shutil

            if shutil.which("dot") is None:
                least = 0  # graphs then display as text; the notebook checks its DOT source
        shown = sum(mime in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
                    for o in c.outputs)
        assert shown >= least, f"{name} displayed {shown} {mime} outputs, expected >= {least}"

