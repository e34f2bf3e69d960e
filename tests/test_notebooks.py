"""The notebooks in notebooks/: stored with their outputs, small, and each runs end to end.

Each notebook checks its own results in ``assert`` cells, so executing it (nbclient, a
fresh ``python3`` kernel, a temporary working directory for the files it writes) is the
test: any cell error fails it. The outputs stored in the repository (so that GitHub and
the docs site show the graphs, plots and tables) must be the ones the code makes now:
a fresh run is compared with them through ``scripts/run_notebooks.py``'s ``normalise``
(addresses, temporary paths, timings and digits past the third hidden; images by size or
labels). After a change that alters what a notebook shows, run
``.venv/bin/python scripts/run_notebooks.py`` and commit the notebooks.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
_spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "scripts" / "run_notebooks.py")
run_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_notebooks)
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
def test_notebook_is_stored_with_outputs_and_small(name: str):
    import nbformat

    nb = _load(name)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{name} has no code cells"
    # executed top to bottom in one kernel: counts 1, 2, 3, ... and no error stored
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), \
        f"{name}: execution counts {counts}; run scripts/run_notebooks.py {name}"
    errors = [i for i, c in enumerate(code) if any(o.output_type == "error" for o in c.outputs)]
    assert errors == [], f"{name}: code cells {errors} store an error"
    assert sum(bool(c.outputs) for c in code) >= len(code) // 2, f"{name} shows too little"
    size = (NOTEBOOK_DIR / name).stat().st_size
    assert size <= run_notebooks.MAX_BYTES, f"{name} is {size:,} bytes (limit {run_notebooks.MAX_BYTES:,})"
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
    stored = [run_notebooks.normalise(c.outputs) for c in nb.cells if c.cell_type == "code"]
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    # the kernel must be this interpreter (the venv), importing this checkout's graddbg
    nb.cells.insert(0, nbformat.v4.new_code_cell(_PROBE))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    before = sorted(p.name for p in NOTEBOOK_DIR.iterdir())
    try:
        run_notebooks.execute(nb, tmp_path, timeout=CELL_TIMEOUT_S)  # tmp_path: the kernel's cwd
    except nbclient.exceptions.CellExecutionError as err:  # show the failing cell's traceback
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(err))  # IPython colours its tracebacks
        pytest.fail(f"{name} failed:\n{text}", pytrace=False)

    # files the notebook writes land in its working directory, not next to it
    assert sorted(p.name for p in NOTEBOOK_DIR.iterdir()) == before
    probe = "".join(o.get("text", "") for o in nb.cells[0].outputs).split()
    assert probe[0] == sys.executable, f"the kernel runs {probe[0]}, not {sys.executable}"
    import graddbg

    assert os.path.samefile(probe[1], graddbg.__file__)

    fresh = [run_notebooks.normalise(c.outputs) for c in nb.cells[1:] if c.cell_type == "code"]
    changed = [i for i, (a, b) in enumerate(zip(stored, fresh)) if a != b]
    assert changed == [], (
        f"{name}: the stored outputs of code cells {changed} are not what the code makes now "
        f"(first: stored {stored[changed[0]]!r}, now {fresh[changed[0]]!r}); "
        f"run scripts/run_notebooks.py {name} and commit it")

    if name in DISPLAYS:
        mime, least = DISPLAYS[name]
        if mime == "image/svg+xml":
            import shutil

            if shutil.which("dot") is None:
                least = 0  # graphs then display as text; the notebook checks its DOT source
        shown = sum(mime in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
                    for o in c.outputs)
        assert shown >= least, f"{name} displayed {shown} {mime} outputs, expected >= {least}"



def test_normalise_hides_volatile_bits_and_keeps_results():
    def out(text):
        return [{"output_type": "stream", "name": "stdout", "text": text}]

    same = run_notebooks.normalise
    # an address, a temporary folder, a timing, the 4th digit: not results
    assert same(out("<Graph at 0x7f3a2b1c9d80> /tmp/pytest-1/a/report.html 0.53 s 0.012345")) == \
        same(out("<Graph at 0x7f00aa11bb22> /tmp/graddbg-nb-x/report.html 1.2 s 0.012349"))
    # a different norm, a different step, a different parameter: different outputs
    assert same(out("fc.weight 0.0123")) != same(out("fc.weight 0.0456"))
    assert same(out("step 30")) != same(out("step 31"))
    assert same(out("blocks.1.norm")) != same(out("blocks.0.norm"))
    # one write or two: the same stream
    assert same(out("a\nb\n")) == same(out("a\n") + out("b\n"))
