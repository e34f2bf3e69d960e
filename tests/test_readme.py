"""The README is a front page: short, the two commands, install lines, pictures and links
that exist, and every ```python block runs alone, in a fresh namespace (a reader copies one
block, not the page).

Blocks that cannot run here are marked ``<!-- norun: reason -->`` on the line before their
fence (see tests/test_docs.py); ```bash blocks are the commands, exercised by
tests/test_cli.py, tests/test_wheel.py and CI; ```text blocks show output.
"""
from __future__ import annotations

import pathlib
import re

import matplotlib

matplotlib.use("Agg")

from test_docs import python_blocks  # noqa: E402  (tests/ is on sys.path)

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 180


def test_readme_has_the_two_commands():
    text = README.read_text()
    assert "bash scripts/setup.sh && .venv/bin/graddbg demo" in text
    ci = (README.parent / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in text


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; the front page keeps <= {MAX_LINES}"
    text = "\n".join(lines)
    assert "pip install" in text and "pip wheel" in text
    # the torch version it says is tested is the one CI pins
    pin = re.search(r"^torch==(\S+)$", (ROOT / "constraints.txt").read_text(), flags=re.M).group(1)
    assert f"torch {pin}" in text, f"README must say which torch is tested ({pin}, constraints.txt)"


def test_readme_pictures_and_links_exist():
    text = README.read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if "://" not in t]
    assert len(local) >= 10
    missing = [t for t in local if not (ROOT / t).exists()]
    assert missing == [], f"README links to missing files: {missing}"
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert {pathlib.Path(p).name for p in pictures} >= {"report.png", "graph.svg", "norms.png"}
    for p in pictures:
        assert (ROOT / p).stat().st_size > 1000, f"{p} is empty or tiny; run scripts/make_docs_assets.py"


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    """Each block on its own: its imports are its own, nothing comes from the block before."""
    from graddbg.pytest_plugin import GradcheckHelpers

    blocks = python_blocks(README)
    assert len(blocks) >= 4 and all(b.norun is None for b in blocks[:4])
    monkeypatch.chdir(tmp_path)
    import matplotlib.pyplot as plt

    ran = 0
    try:
        for b in blocks:
            code = compile(b.code, f"README.md:{b.line}", "exec")
            if b.norun is not None:
                continue
            ns = {"__name__": "readme"}  # a fresh namespace per block
            exec(code, ns)
            for name, fn in list(ns.items()):  # pytest-style examples: run them with the fixture
                if name.startswith("test_") and callable(fn):
                    fn(GradcheckHelpers(seed=0))
            ran += 1
    finally:
        plt.close("all")
    assert ran == len([b for b in blocks if b.norun is None])
    assert (tmp_path / "report.html").exists() and (tmp_path / "run.parquet").exists()


def test_readme_says_what_each_example_needs():
    """A reader copies one block: "hist" works only with histograms= recorded, and a pytest
    example needs pytest, which the README's install lines do not bring."""
    text = README.read_text()
    for line in text.splitlines():
        if '"hist"' in line:
            assert "histograms=" in line, line
    if "def test_" in text:
        assert "pip install pytest" in text
