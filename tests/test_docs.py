"""Every example runs: the package's docstring examples, and every ```python block of the
documentation pages in docs/.

A page's blocks run in order in one namespace (a fresh one per page), in a temporary working
directory. A block that cannot run here (it needs several processes, a GPU, a trainer and a
data set) is marked on the line before its fence, with the reason::

    <!-- norun: needs a CUDA device -->

Such a block must still compile, and the reason must be given. Functions named ``test_*``
that a block defines are called with the ``graddbg_check`` fixture's helpers, as pytest
would. tests/test_readme.py runs the README's blocks the same way.
"""
from __future__ import annotations

import doctest
import importlib
import pathlib
import re
from typing import List, NamedTuple, Optional

import pytest

import graddbg

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MODULES = sorted(p.stem for p in pathlib.Path(graddbg.__file__).parent.glob("*.py")
                 if p.stem not in ("__main__",))
_FENCE = re.compile(r"^```(\S*)[^\n]*$")
_NORUN = re.compile(r"^<!--\s*norun:\s*(.*?)\s*-->$")


class Block(NamedTuple):
    line: int                 # 1-based line of the opening fence
    code: str
    norun: Optional[str]      # the reason it does not run, or None


def python_blocks(path: pathlib.Path) -> List[Block]:
    """The ```python blocks of a Markdown file, with their norun reasons."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        i += 1
        body = []
        while i < len(lines) and lines[i] != "```":
            body.append(lines[i])
            i += 1
        i += 1
        if lang == "python":
            prev = lines[start - 1].strip() if start > 0 else ""
            reason = _NORUN.match(prev)
            blocks.append(Block(start + 1, "\n".join(body) + "\n", reason.group(1) if reason else None))
    return blocks


def run_blocks(path: pathlib.Path, ns: dict) -> int:
    """Run ``path``'s python blocks in ``ns``; returns how many ran."""
    from graddbg.pytest_plugin import GradcheckHelpers

    ran = 0
    for b in python_blocks(path):
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{b.line}"
        code = compile(b.code, where, "exec")
        if b.norun is not None:
            assert len(b.norun) >= 10, f"{where}: a norun block must say why it does not run"
            continue
        exec(code, ns)
        ran += 1
        for name, fn in list(ns.items()):  # pytest-style examples: run them with the fixture
            if name.startswith("test_") and callable(fn):
                fn(GradcheckHelpers(seed=0))
                del ns[name]
    return ran


PAGES = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples(module):
    name = "graddbg" if module == "__init__" else f"graddbg.{module}"
    mod = importlib.import_module(name)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(DOCS / p)])
def test_docs_page_python_blocks_run(page, tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.chdir(tmp_path)
    try:
        ran = run_blocks(DOCS / page, {"__name__": f"docs.{page}"})
    finally:
        plt.close("all")
    assert ran or all(b.norun for b in python_blocks(DOCS / page))


def test_the_block_parser_sees_norun_marks(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("text\n\n```python\nx = 1\n```\n\n<!-- norun: needs two processes -->\n"
                    "```python\nimport nothing_here\n```\n\n```bash\nls\n```\n")
    blocks = python_blocks(page)
    assert [(b.line, b.code, b.norun) for b in blocks] == [
        (3, "x = 1\n", None), (8, "import nothing_here\n", "needs two processes")]
    ns: dict = {}
    assert run_blocks(page, ns) == 1 and ns["x"] == 1  # the norun block's import never ran
    page.write_text("<!-- norun: -->\n```python\nx = 1\n```\n")
    with pytest.raises(AssertionError, match="must say why"):
        run_blocks(page, {})


def test_every_docs_page_with_code_has_running_blocks():
    """Marking blocks norun is the exception: most pages with Python run some of it."""
    pages = [p for p in PAGES if python_blocks(DOCS / p)]
    running = [p for p in pages if any(b.norun is None for b in python_blocks(DOCS / p))]
    assert len(pages) >= 10 and len(running) >= len(pages) - 2, (pages, running)


def test_the_reference_and_the_how_tos_link_each_other():
    """Each reference page names the how-to guides that use it ("See also"), and each how-to
    links into the reference (issue 40, point 7); every such link points to a page that exists."""
    for page in sorted((DOCS / "reference").glob("*.md")):
        if page.name == "index.md":
            continue
        links = re.findall(r"\]\((\.\./howto/[\w-]+\.md)(?:#[\w-]+)?\)", page.read_text(encoding="utf-8"))
        assert links, f"{page.name} links to no how-to guide"
        assert all((page.parent / link).is_file() for link in links), (page.name, links)
    for page in sorted((DOCS / "howto").glob("*.md")):
        text = page.read_text(encoding="utf-8")
        crossrefs = re.findall(r"\]\[(graddbg\.[\w.]+)\]", text)
        links = re.findall(r"\]\((\.\./reference/[\w-]+\.md)(?:#[\w.-]+)?\)", text)
        assert crossrefs or links, f"{page.name} links to nothing in the reference"
        assert all((page.parent / link).is_file() for link in links), (page.name, links)
        # (each [...][graddbg.x] must resolve: the strict site build, tests/test_site.py, fails otherwise)
