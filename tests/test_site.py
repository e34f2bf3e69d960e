"""The documentation site builds strictly, and its API reference covers every public name.

One ``mkdocs build --strict`` per test session (about 10 s): any warning fails it, so a
broken link or anchor, a page missing from the navigation, a docstring that mkdocstrings
cannot parse, or a reference to a name that no longer exists fails the suite. Needs the
``docs`` extra (``bash scripts/setup.sh --dev`` installs it); without it these tests fail
and say so.
"""
from __future__ import annotations

import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import graddbg

ROOT = Path(__file__).resolve().parent.parent
_ANCHOR = re.compile(r'\bid="(graddbg(?:\.[A-Za-z_][A-Za-z0-9_]*)*)"')


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    try:
        import mkdocs  # noqa: F401
        import mkdocs_jupyter  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError as e:
        pytest.fail(f"the docs tools are missing ({e}): pip install -c constraints.txt -e '.[docs]' "
                    f"(bash scripts/setup.sh --dev installs them)", pytrace=False)
    out = tmp_path_factory.mktemp("site")
    before = _status()
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**_env(), "NO_MKDOCS_2_WARNING": "1"})
    log = proc.stdout + proc.stderr
    problems = [line for line in log.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert proc.returncode == 0 and not problems, "mkdocs build --strict failed:\n" + "\n".join(
        problems or log.splitlines()[-30:])
    assert _status() == before, "building the site changed files in the checkout"
    return out


def _env() -> dict:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                          capture_output=True, text=True).stdout


def _anchors(site: Path) -> set:
    found = set()
    for page in (site / "reference").rglob("index.html"):
        found.update(_ANCHOR.findall(page.read_text()))
    return found


def public_submodules() -> list:
    return sorted(m.name for m in pkgutil.iter_modules(graddbg.__path__)
                  if not m.name.startswith("_"))


def _entries_for(obj, *paths: str) -> set:
    """The reference ids under which ``obj`` may be documented."""
    ids = set(paths)
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        ids.add(f"{module}.{qualname}")
    return ids


def test_site_builds_strictly_with_every_page(site: Path):
    for page in ("index.html", "getting-started/index.html", "howto/nan/index.html",
                 "explain/blame/index.html", "benchmarks/index.html", "architecture/index.html",
                 "reference/hooks/index.html"):
        assert (site / page).is_file(), page
    # the benchmark tables are bench/RESULTS.md's, included as they are
    bench = (site / "benchmarks" / "index.html").read_text()
    assert "find_nonfinite vs detect_anomaly" in bench and "<table>" in bench


def test_every_top_level_name_has_a_reference_entry(site: Path):
    anchors = _anchors(site)
    missing = []
    for name in graddbg.__all__:
        if name == "__version__":
            continue  # a string, shown on the home page of the package, not an API entry
        obj = getattr(graddbg, name)
        if isinstance(obj, type(graddbg)):  # a submodule
            ids = {obj.__name__}
        else:  # (documented where it is defined, or in a public module that re-exports it)
            ids = _entries_for(obj, f"graddbg.{name}", *(f"graddbg.{m}.{name}" for m in public_submodules()
                                                          if getattr(importlib.import_module(f"graddbg.{m}"),
                                                                     name, None) is obj))
        if not ids & anchors:
            missing.append(name)
    assert missing == [], f"no API reference entry for graddbg.{missing} (docs/reference/)"


@pytest.mark.parametrize("module", public_submodules())
def test_every_public_name_of_a_submodule_has_a_reference_entry(site: Path, module: str):
    mod = importlib.import_module(f"graddbg.{module}")
    assert f"graddbg.{module}" in _anchors(site), f"graddbg.{module} has no reference page"
    names = getattr(mod, "__all__", None)
    assert names is not None, f"graddbg.{module} defines no __all__: its public names are unknown"
    anchors = _anchors(site)
    missing = [n for n in names if not _entries_for(getattr(mod, n), f"graddbg.{module}.{n}") & anchors]
    assert missing == [], f"graddbg.{module}: no API reference entry for {missing}"


def test_reference_pages_document_arguments(site: Path):
    """mkdocstrings rendered the Args/Returns/Raises sections of the Google-style docstrings."""
    page = (site / "reference" / "graphviz" / "index.html").read_text()
    for section in ("Parameters:", "Returns:", "Raises:"):
        assert section in page, section
    assert "depth" in page and "DotNotFoundError" in page


def test_notebooks_are_rendered_with_their_outputs(site: Path):
    graphs = (site / "notebooks" / "04_graphs" / "index.html").read_text()
    assert graphs.count("<svg") >= 4, "the graphs notebook shows fewer than 4 SVG graphs"
    quick = (site / "notebooks" / "01_quickstart" / "index.html").read_text()
    assert quick.count("data:image/png;base64") >= 4, "the quick start shows fewer than 4 plots"
    assert "<table" in quick  # the statistics table


def test_names_in_tables_and_notebook_outputs_are_never_broken_mid_word(site: Path):
    """The theme (overflow-wrap: break-word) and the notebook outputs' styles (word-break:
    break-all on text outputs, fixed-layout tables) broke names such as stale_gra|d."""
    page = (site / "notebooks" / "01_quickstart" / "index.html").read_text(encoding="utf-8")
    assert "stylesheets/extra.css" in page
    css = re.sub(r"\s+", " ", (site / "stylesheets" / "extra.css").read_text(encoding="utf-8"))
    rules = dict(re.findall(r"([^{}]+)\{([^}]*)\}", re.sub(r"/\*.*?\*/", "", css)))
    declared = {sel.strip(): body for selectors, body in rules.items() for sel in selectors.split(",")}
    for selector in (".md-typeset table td", ".md-typeset .jupyter-wrapper .jp-RenderedHTMLCommon td",
                     ".md-typeset .jupyter-wrapper .jp-OutputArea-output pre"):
        assert "word-break: normal" in declared[selector] and "overflow-wrap: normal" in declared[selector], selector


def test_checker_sees_a_missing_entry(tmp_path: Path):
    """The coverage check above fails for a name without an entry (it can fail)."""
    (tmp_path / "reference").mkdir()
    (tmp_path / "reference" / "index.html").write_text('<h2 id="graddbg.hooks.watch">watch</h2>')
    anchors = _anchors(tmp_path)
    assert _entries_for(graddbg.watch, "graddbg.watch") & anchors
    assert not _entries_for(graddbg.Watch, "graddbg.Watch") & anchors


def test_site_loads_nothing_from_the_network(site: Path):
    """No script, style sheet, font or image from another host: the site works offline."""
    external = re.compile(r'<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)="(https?:)?//[^"]*"')
    found = {str(p.relative_to(site)): external.findall(p.read_text())
             for p in site.rglob("*.html") if external.search(p.read_text())}
    assert found == {}, found


class _Prose(__import__("html.parser").parser.HTMLParser):
    """Text of a page that shows a doctest as prose: a ``>>>`` outside <code>/<pre>, and
    every <blockquote> (Markdown's reading of a bare ``>>>`` or of a line starting with
    ``>``: docstrings use none)."""

    def __init__(self) -> None:
        super().__init__()
        self.code, self.where, self.found = 0, "top", []

    def handle_starttag(self, tag, attrs):
        if tag in ("code", "pre"):
            self.code += 1
        if tag == "blockquote":
            self.found.append(f"a blockquote after #{self.where}")
        ident = dict(attrs).get("id")
        if ident and ident.startswith("graddbg"):
            self.where = ident

    def handle_endtag(self, tag):
        if tag in ("code", "pre"):
            self.code -= 1

    def handle_data(self, data):
        if ">>>" in data and not self.code:
            self.found.append(f"'>>>' as text after #{self.where}: {data.strip()[:60]!r}")


def prose_doctests(html_text: str) -> list:
    parser = _Prose()
    parser.feed(html_text)
    return parser.found


@pytest.mark.parametrize("page", sorted(p.stem for p in (ROOT / "docs" / "reference").glob("*.md")))
def test_no_doctest_is_shown_as_prose(site: Path, page: str):
    html_text = (site / "reference" / ("" if page == "index" else page) / "index.html").read_text()
    assert prose_doctests(html_text) == [], page


def test_docstring_examples_are_rendered_as_code(site: Path):
    page = (site / "reference" / "gradcheck" / "index.html").read_text()
    code = [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<code>(.*?)</code>", page, re.S)]  # (highlighted)
    assert any("&gt;&gt;&gt; assert graddbg.gradcheck(torch.sin, (x,), fast_mode=True)" in c for c in code)
    assert any("&gt;&gt;&gt; r = gradcheck(torch.sin" in c for c in code)  # GradcheckResult's


def test_the_prose_checker_sees_a_bare_doctest():
    assert prose_doctests("<p>a</p><blockquote><blockquote><blockquote><p>x = 1</p></blockquote>"
                          "</blockquote></blockquote>")
    assert prose_doctests("<p>&gt;&gt;&gt; x = 1</p>")
    assert prose_doctests('<pre><code>&gt;&gt;&gt; x = 1</code></pre><p id="graddbg.a">ok</p>') == []


def test_reference_pages_lead_with_the_public_api(site: Path):
    """No private base ("Bases: _Results"), no dunder or private member; the watch page
    opens with watch() and shows Watch's results (stats, summary, report ...)."""
    for page in (site / "reference").rglob("index.html"):
        text = page.read_text()
        assert "Bases:" not in text, page
        ids = _ANCHOR.findall(text)
        bad = [i for i in ids if "__" in i or ("._" in i and "callbacks" not in i)]
        assert bad == [], (page, bad)
    hooks = (site / "reference" / "hooks" / "index.html").read_text()
    ids = [i for i in _ANCHOR.findall(hooks) if i.count(".") == 2]
    assert ids[:3] == ["graddbg.hooks.watch", "graddbg.hooks.Watch", "graddbg.hooks.MAX_ROWS"], ids
    for internal in ("old_spellings", "begin_step", "adopt_forward", "StepClock", "_apply", "HookSet"):  # graddbg's own
        assert internal not in hooks, internal
    for member in ("stats", "steps", "ledger", "what_happened", "summary", "report", "plot", "save", "step", "close",
                   "history"):
        assert f'id="graddbg.hooks.Watch.{member}"' in hooks, member


def test_signatures_are_formatted(site: Path):
    """watch()'s signature is laid out one parameter a line (ruff formats it), not one
    long clipped line."""
    hooks = (site / "reference" / "hooks" / "index.html").read_text()
    sig = re.search(r'id="graddbg.hooks.watch".*?<code>(.*?)</code>', hooks, re.S).group(1)
    text = re.sub(r"<[^>]+>", "", sig)
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) > 10 and max(map(len, lines)) <= 80, lines


@pytest.mark.parametrize("page, name, file", [("hooks", "graddbg.hooks.watch", "graddbg/hooks.py"),
                                              ("gradcheck", "graddbg.gradcheck.gradcheck", "graddbg/gradcheck.py"),
                                              ("run", "graddbg.run.load", "graddbg/run.py"),
                                              ("plots", "graddbg.plots.flow", "graddbg/plots.py")])
def test_reference_entries_show_their_source(site: Path, page: str, name: str, file: str):
    """The [source] link of torch's reference, offline: an entry folds its function's source
    (issue 40, point 7)."""
    text = (site / "reference" / page / "index.html").read_text()
    start = text.index(f'id="{name}"')
    end = text.find('class="doc doc-heading"', text.index("</h", start))  # (the next entry's heading)
    assert f"Source code in <code>{file}</code>" in text[start:end if end > 0 else None], name
