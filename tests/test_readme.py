"""Every ```python block of the README runs, in order, in one namespace.

Blocks fenced as ```py are illustrative only (they need several processes, as the DDP
one does); ```bash blocks are the commands, exercised by tests/test_cli.py and CI.
"""
from __future__ import annotations

import pathlib
import re

import matplotlib

matplotlib.use("Agg")

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _blocks():
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_has_the_two_commands():
    text = README.read_text()
    assert "bash scripts/setup.sh && .venv/bin/graddbg demo" in text
    ci = (README.parent / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in text


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    from graddbg.pytest_plugin import GradcheckHelpers

    blocks = _blocks()
    assert len(blocks) >= 6
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": "readme"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"README.md block {i + 1}", "exec"), ns)
        for name, fn in list(ns.items()):  # pytest-style examples: run them with the fixture
            if name.startswith("test_") and callable(fn):
                fn(GradcheckHelpers(seed=0))
                del ns[name]
    assert (tmp_path / "report.html").exists() and (tmp_path / "run.parquet").exists()
