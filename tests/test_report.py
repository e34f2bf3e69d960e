"""graddbg.report: the HTML report parses, holds the tables and the SVG plots, escapes
every text, links nothing outside itself, survives NaN/Inf, and stays under 5 MB."""
from __future__ import annotations

import math
import re
import time
from collections import Counter
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pytest
import torch

import graddbg
from graddbg.anomaly import Anomaly
from graddbg.report import render_report, write_report
from graddbg.run import Run
from test_plots import PARAMS, VARIANTS, make_frames
from test_run import make_run, recorded_watch


class Page(HTMLParser):
    """What a reader of the report sees: tables (header + cell texts), svgs, ids, links."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: Counter = Counter()
        self.ids: list = []
        self.links: list = []
        self.tables: list = []  # dicts: cls, header, rows
        self.sections: dict = {}  # id -> text
        self.errors: list = []
        self._table = None
        self._row = None
        self._cell = None
        self._section = None
        self._svg_depth = 0
        self._error = None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags[tag] += 1
        if "id" in a:
            self.ids.append(a["id"])
        for k in ("href", "xlink:href", "src"):
            if k in a:
                self.links.append(a[k])
        if tag == "section":
            self._section = a.get("id")
            self.sections[self._section] = ""
        if tag == "table":
            self._table = {"cls": a.get("class", ""), "header": [], "rows": []}
            self.tables.append(self._table)
        elif tag == "tr" and self._table is not None:
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = ""
        if tag == "p" and "error" in (a.get("class") or ""):
            self._error = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row.append(self._cell)
            self._cell = None
        elif tag == "tr" and self._row is not None:
            if not self._table["header"]:
                self._table["header"] = self._row
            else:
                self._table["rows"].append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None
        elif tag == "section":
            self._section = None
        elif tag == "p" and self._error is not None:
            self.errors.append(self._error)
            self._error = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data
        if self._section is not None:
            self.sections[self._section] += data
        if self._error is not None:
            self._error += data

    def table(self, cls):
        found = [t for t in self.tables if t["cls"] == cls]
        assert len(found) == 1, (cls, [t["cls"] for t in self.tables])
        return found[0]


def check_self_contained(text: str, page: Page) -> None:
    assert text.startswith("<!DOCTYPE html>")
    assert page.tags["script"] == 0
    assert all(l.startswith(("#", "data:")) for l in page.links), \
        [l for l in page.links if not l.startswith(("#", "data:"))][:5]
    assert "http://" not in text and "https://" not in text
    assert "@import" not in text and "url(http" not in text
    dup = [i for i, c in Counter(page.ids).items() if c > 1]
    assert not dup, dup[:5]  # figures share glyph/clip ids in matplotlib: they are prefixed
    # every internal reference points to an element of the document
    ids = set(page.ids)
    refs = set(re.findall(r'(?:href="#|url\(#)([^")]+)', text))
    assert refs <= ids, sorted(refs - ids)[:5]


@pytest.fixture(scope="module")
def synthetic():
    r = make_run(n_steps=12, nan=[(5, "layers.1.weight")], inf=[(6, "head.bias")],
                 huge=[(3, "embed.weight")], zero=["layers.0.bias"], nograd=["scale"])
    r.activations = pd.DataFrame({"step": np.arange(1, 13, dtype=np.int64), "module": "head",
                                  "grad_norm": [0.5, math.nan] + [0.2] * 10,
                                  "out_nonfinite": np.array([0, 4] + [0] * 10, dtype=np.int64)})
    text = render_report(r)
    return r, text, Page(text)


def test_report_holds_every_section_table_and_plot(synthetic):
    run, text, page = synthetic
    check_self_contained(text, page)
    assert page.errors == []
    assert list(page.sections) == ["summary", "anomalies", "hygiene", "plots", "parameters", "modules",
                                   "activations"]
    # anomalies: step, kind, parameter, module, op, source for each record
    t = page.table("anomalies")
    assert t["header"][:6] == ["step", "kind", "parameter", "module", "op", "source"]
    assert [r[:6] for r in t["rows"]] == [
        ["5", "nonfinite", "layers.1.weight", "layers.1", "LogBackward0", "train.py:12"],
        ["6", "nonfinite", "head.bias", "head", "LogBackward0", "train.py:12"]]
    assert t["rows"][0][6] == "NaN" and t["rows"][1][6] == "Inf"
    # per-parameter summary: one row per parameter in forward order, non-finite totals
    t = page.table("param-summary")
    assert t["header"][:4] == ["name", "module", "numel", "steps"]
    assert [r[0] for r in t["rows"]] == [p[0] for p in PARAMS]
    col = t["header"].index("nonfinite_total")
    assert {r[0]: r[col] for r in t["rows"]}["layers.1.weight"] == "64"
    t = page.table("module-summary")
    assert [r[0] for r in t["rows"]] == ["embed", "layers.0", "layers.1", "head", ""]
    t = page.table("activations")
    assert t["rows"][0][0] == "head" and t["rows"][0][t["header"].index("out_nonfinite_total")] == "4"
    # the plots: flow (last and first non-finite step), norms, heatmap, update ratio, hists
    figures = re.findall(r'<h3 id="fig-([a-z-]+)">', text)
    assert figures == ["flow", "flow-first-nonfinite", "norms", "heatmap", "loss", "update", "hist"]
    assert page.tags["svg"] == 7
    assert "Gradient flow at step 5" in text or "first step with NaN/Inf (5)" in text
    # the run facts
    facts = {r[0]: r[1] for r in page.table("facts")["rows"]}
    assert facts["model"] == "TinyNet"
    assert facts["anomalies by kind"] == "nonfinite: 2"
    assert "Parameters that never produced a gradient: scale" in page.sections["summary"]
    assert "12steps" in page.sections["summary"].replace(" ", "")


def test_report_escapes_every_text(tmp_path):
    evil = '<script>alert("x")</script>&amp;'
    params = [(f"m.{evil}", "m", 4), ("n.<b>bold</b>", "n", 2)]
    f = make_frames(3, params, nan=[(2, f"m.{evil}")])
    f["anomalies"][0] = Anomaly(step=2, kind="nonfinite", name=f"m.{evil}", module="m",
                                op="<Op>", value=math.nan, threshold=None,
                                source='a"b.py:1', message="bad <i>grad</i>")
    run = Run(f["stats"], f["steps"], f["anomalies"], f["histograms"],
              meta={"model": "<Model>", "note": "x & y <z>"})
    path = write_report(run, tmp_path / "evil.html", title="a <b> title")
    text = path.read_text()
    page = Page(text)
    check_self_contained(text, page)
    assert page.tags["b"] == 0 and page.tags["i"] == 0 and page.tags["script"] == 0
    row = page.table("anomalies")["rows"][0]
    assert row[2] == f"m.{evil}" and row[4] == "<Op>" and row[5] == 'a"b.py:1'
    assert "bad <i>grad</i>" in row
    assert [r[0] for r in page.table("param-summary")["rows"]] == [p[0] for p in params]
    facts = {r[0]: r[1] for r in page.table("facts")["rows"]}
    assert facts["note"] == "x & y <z>" and facts["model"] == "<Model>"
    assert "<title>a &lt;b&gt; title</title>" in text


# NaN, +Inf, 1e38, all-zero and gradient-less parameters side by side are in the `synthetic`
# run above; these are the degenerate runs where nothing at all is finite or present.
@pytest.mark.parametrize("variant", ["all_nan", "no_grad_at_all"])
def test_report_survives_nonfinite_data(variant, tmp_path):
    f = make_frames(4, **VARIANTS[variant])
    if variant == "all_nan":
        f["steps"]["global_norm"] = math.nan
    run = Run(f["stats"], f["steps"], f["anomalies"], f["histograms"], meta=f["meta"])
    text = write_report(run, tmp_path / "r.html").read_text()
    page = Page(text)
    check_self_contained(text, page)
    assert page.errors == []
    figures = re.findall(r'<h3 id="fig-([a-z-]+)">', text)
    assert {"flow", "norms", "heatmap", "update"} <= set(figures)
    assert page.tags["svg"] == len(figures) - 1  # no update ratio: a note instead of a plot
    assert "watch() needs the optimizer" in page.sections["plots"]
    assert len(page.table("param-summary")["rows"]) == len(PARAMS)


def test_table_cells_never_break_a_name_mid_word():
    """stale_gra|d: a table cell wraps at spaces only (a wide table scrolls), whatever page
    or notebook the report's text is shown in."""
    style = re.search(r"<style>(.*?)</style>", render_report(make_run()), re.S).group(1)
    rules: dict = {}
    for selectors, body in re.findall(r"([^{}]+)\{([^}]*)\}", style):
        for sel in selectors.split(","):
            rules[sel.strip()] = rules.get(sel.strip(), "") + ";" + body
    for cell in ("td", "th"):
        assert "overflow-wrap:normal" in rules[cell] and "word-break:normal" in rules[cell], rules[cell]
    assert "break-all" not in style and "anywhere" not in style


def test_report_of_an_empty_run(tmp_path):
    stats = make_frames(1)["stats"].iloc[:0]
    steps = make_frames(1)["steps"].iloc[:0]
    text = write_report(Run(stats, steps), tmp_path / "empty.html").read_text()
    page = Page(text)
    assert page.errors == [] and page.tags["svg"] == 0
    assert "No step was recorded" in page.sections["plots"]
    assert "No anomaly was detected" in page.sections["anomalies"]


def test_report_is_deterministic_and_survives_save_load(tmp_path):
    run = make_run(n_steps=5, params=PARAMS[:3], nan=[(2, "layers.0.weight")])
    again = graddbg.load(run.save(tmp_path / "run.parquet"))
    assert render_report(run) == render_report(again)


def test_each_figure_is_laid_out_once_and_drawn_once_as_savefig_draws_it(synthetic):
    """savefig draws a figure with constrained layout twice (to lay it out, then to write
    it); the report lays each figure out alone and draws it once, and the SVG is the same."""
    import io

    import matplotlib

    from graddbg import report

    run = synthetic[0]
    view = report._View.of(run, run.stats)
    jobs = [(fid, make) for fid, _, make in report._plot_jobs(view, run.steps, run.anomalies, run.histograms)]
    assert [fid for fid, _ in jobs] == ["flow", "flow-first-nonfinite", "norms", "heatmap", "loss", "update", "hist"]
    for fid, make in jobs:
        fig, draws = make(), []
        fig.canvas.mpl_connect("draw_event", draws.append)
        svg = report._figure_svg(fig, f"fig-{fid}")
        assert len(draws) == 1, fid
        before, buf = make(), io.StringIO()  # (savefig with the layout engine, as the report drew before)
        assert before.get_layout_engine() is not None
        with matplotlib.rc_context({"svg.hashsalt": "graddbg", "svg.fonttype": "path"}):
            before.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
        assert svg == report._inline_svg(buf.getvalue(), f"fig-{fid}"), fid


@pytest.mark.parametrize("rc", ["figure.autolayout", "figure.constrained_layout.use"])
def test_a_layout_engine_set_in_matplotlibrc_does_not_lay_a_figure_out_again(rc):
    """With an engine asked for in the user's rcParams, the figure taken off its layout engine
    would get that one back and be laid out again by savefig (tight layout: other margins)."""
    import io

    import matplotlib

    from graddbg import plots, report

    f = make_frames(4, PARAMS[:3])
    with matplotlib.rc_context({rc: True}):
        fig, draws = plots.norms(f["stats"], f["steps"]), []
        fig.canvas.mpl_connect("draw_event", draws.append)
        svg = report._figure_svg(fig, "fig-norms")
        assert len(draws) == 1
    before, buf = plots.norms(f["stats"], f["steps"]), io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": "graddbg", "svg.fonttype": "path"}):
        before.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    assert svg == report._inline_svg(buf.getvalue(), "fig-norms")


def big_frames(n_steps=1000, n_params=100, hist_every=50):
    """1,000 steps x 100 parameters, vectorised; NaN bursts, an Inf, 1e38, histograms."""
    rng = np.random.default_rng(0)
    names = [f"blocks.{i // 2}.{'weight' if i % 2 == 0 else 'bias'}" for i in range(n_params)]
    modules = [n.rsplit(".", 1)[0] for n in names]
    P, S = n_params, n_steps
    norm = np.exp(rng.normal(-3, 0.5, (S, P)))
    norm[400:410, 7] = np.nan
    norm[700, 20] = np.inf
    norm[100, 50] = 1e38
    nonfinite = np.where(np.isfinite(norm), 0, 5).astype(np.int64)
    stats = pd.DataFrame({
        "step": np.repeat(np.arange(S, dtype=np.int64), P),
        "name": np.tile(names, S), "module": np.tile(modules, S),
        "numel": np.tile(np.full(P, 256, dtype=np.int64), S),
        "norm": norm.ravel(), "absmax": norm.ravel() / 4,
        "nonfinite": nonfinite.ravel(),
        "update_ratio": np.exp(rng.normal(np.log(1e-3), 0.7, S * P)),
        "has_grad": np.ones(S * P, dtype=bool)})
    g = np.sqrt((np.where(np.isnan(norm), np.inf, norm) ** 2).sum(1))
    steps = pd.DataFrame({"step": np.arange(S, dtype=np.int64), "global_norm": g,
                          "clipped_norm": np.nan, "nonfinite": nonfinite.sum(1),
                          "overflow": False, "scale": np.nan, "recorded": True, "lr": 1e-3})
    lo = np.array([0.0] + [10.0 ** (e / 2) for e in range(-24, 8)])
    hi = np.append(lo[1:], np.inf)
    hsteps = np.arange(0, S, hist_every)
    B = len(lo)
    hist = pd.DataFrame({
        "step": np.repeat(hsteps, P * B), "name": np.tile(np.repeat(names, B), len(hsteps)),
        "lo": np.tile(lo, len(hsteps) * P), "hi": np.tile(hi, len(hsteps) * P),
        "count": rng.integers(0, 30, len(hsteps) * P * B)})
    anomalies = [Anomaly(step=s, kind="nonfinite", name=names[7], module=modules[7],
                         op="DivBackward0", value=math.nan, threshold=None,
                         source="model.py:88", message=f"NaN in {names[7]}")
                 for s in range(400, 410)]
    anomalies.append(Anomaly(step=100, kind="explode", name=None, module=None, op=None,
                             value=1e38, threshold=10.0, source=None, message="exploded"))
    return Run(stats, steps, anomalies, histograms=hist, meta={"model": "Big"})


@pytest.mark.slow  # renders six figures of a 100,000-row run (about 5-10 s on 2 busy cores)
def test_report_of_1000_steps_by_100_params_is_under_5_mb(tmp_path):
    run = big_frames()
    t0 = time.perf_counter()
    path = write_report(run, tmp_path / "big.html")
    elapsed = time.perf_counter() - t0
    size = path.stat().st_size
    assert size < 5 * 1024 * 1024, size
    text = path.read_text()
    page = Page(text)
    check_self_contained(text, page)
    assert page.errors == []
    assert page.tags["svg"] == 7
    assert len(page.table("param-summary")["rows"]) == 100
    assert len(page.table("anomalies")["rows"]) == 11
    print(f"report of 1000 steps x 100 params: {size / 1e6:.2f} MB in {elapsed:.1f} s")


# ----------------------------------------------------------------------------- real run

def test_report_of_a_real_recorded_run(tmp_path):
    w = recorded_watch()
    path = w.report(tmp_path / "real.html")
    assert path == tmp_path / "real.html"
    text = path.read_text()
    page = Page(text)
    check_self_contained(text, page)
    assert page.errors == []
    rows = page.table("anomalies")["rows"]
    assert [r[:2] for r in rows] == [["3", "nonfinite"], ["3", "unused_param"]]  # (named with its cut after 3 steps)
    hygiene = page.table("hygiene")["rows"]  # the unused parameters, with their likely cause
    assert [r[1] for r in hygiene] == ["unused_param"] and "unused.weight, unused.bias" in hygiene[0][4]
    names = ["body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias",
             "head.weight", "head.bias", "unused.weight", "unused.bias"]
    assert [r[0] for r in page.table("param-summary")["rows"]] == names
    assert "unused.weight, unused.bias" in page.sections["summary"]
    assert page.tags["svg"] == 7  # flow x2, norms, heatmap, loss and lr, update, hist


def tiny_run(n_steps=3):
    """Two parameters, no histograms: the cheapest report, for the graph section tests."""
    return make_run(n_steps=n_steps, params=[("0.weight", "0", 12), ("0.bias", "0", 4)],
                    histograms=False)


def test_report_with_the_autograd_graph_of_a_root(tmp_path):
    run = tiny_run()
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh())
    loss = model(torch.randn(2, 3)).sum()
    text = write_report(run, tmp_path / "g.html", graph=loss).read_text()
    page = Page(text)
    check_self_contained(text, page)
    assert "graph" in page.sections and page.errors == []
    graph_part = text[text.index('<section id="graph">'):]
    assert "<svg" in graph_part and "TanhBackward0" in graph_part
    # a graph drawn with the model and the run: the run's latest statistics annotate the
    # parameter nodes (tiny_run's names are those of this Sequential)
    g = graddbg.graph(loss, model=model, watch=run)
    text = write_report(run, tmp_path / "g2.html", graph=g).read_text()
    check_self_contained(text, Page(text))
    graph_part = text[text.index('<section id="graph">'):]
    assert "AddmmBackward0" in graph_part and "step 3: norm=" in graph_part
    with pytest.raises(TypeError, match="graph must be None, a graddbg.graph.*got int"):
        write_report(run, tmp_path / "bad.html", graph=3)


def test_report_graph_without_dot_keeps_the_dot_text(tmp_path, monkeypatch):
    run = tiny_run()
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot program on PATH
    dot = 'digraph { a [label="<evil>"]; a -> b }'
    text = write_report(run, tmp_path / "nodot.html", graph=dot).read_text()
    page = Page(text)
    section = page.sections["graph"]
    assert "apt-get install graphviz" in section
    assert dot in section  # shown as text, escaped
    assert "<evil>" not in text.split('<section id="graph">')[1].replace("&lt;evil&gt;", "")
    svg = '<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" onload="x()"><script>x()</script><a xlink:href="http://127.0.0.1/x"><text id="t">hi</text></a></svg>'
    text = write_report(run, tmp_path / "svg.html", graph=svg).read_text()
    page = Page(text)
    check_self_contained(text, page)
    assert "onload" not in text and "graph-t" in page.ids


# ----------------------------------------------------------------------------- large runs

def test_a_large_run_is_shown_as_module_groups_and_notable_parameters(monkeypatch, tmp_path):
    from graddbg import report

    monkeypatch.setattr(report, "MAX_PARAMS_SHOWN", 3)  # PARAMS has 8: aggregated
    monkeypatch.setattr(report, "MAX_GROUPS", 4)  # 5 modules: top-level modules instead
    run = make_run(n_steps=6, nan=[(3, "layers.1.weight")], huge=[(2, "embed.weight")],
                   zero=["head.bias"], categorical=True)
    text = write_report(run, tmp_path / "big.html").read_text()
    page = Page(text)
    check_self_contained(text, page)
    assert page.errors == [] and page.tags["svg"] == 7
    assert "This run has 8 parameters in 5 modules" in page.sections["plots"]
    # the parameters worth a look: the NaN one, then the largest and the smallest norms
    rows = page.table("param-summary")["rows"]
    assert [r[0] for r in rows] == ["embed.weight", "layers.1.weight", "head.bias"]
    assert "3 of 8 parameters" in page.sections["parameters"]
    # module groups: root of the sum of the squared norms, compared with a naive reference
    t = page.table("module-summary")
    assert [r[0] for r in t["rows"]] == ["embed", "layers", "head", "(root)"]
    assert [r[1] for r in t["rows"]] == ["1", "4", "2", "1"]
    st = run.stats.assign(name=run.stats["name"].astype(str))
    last = st[st.step == 6]
    want = math.sqrt(sum(last[last.name.str.startswith("layers.")].norm ** 2))
    got = float(t["rows"][1][t["header"].index("norm_last")])
    assert got == pytest.approx(want, rel=1e-3)
    assert t["rows"][1][t["header"].index("nonfinite_total")] == "64"  # the NaN step of layers.1.weight
    assert re.findall(r'<h3 id="fig-([a-z-]+)">', text) == \
        ["flow", "flow-first-nonfinite", "norms", "heatmap", "loss", "update", "hist"]


def test_module_groups_keep_huge_norms_finite_and_nonfinite_ones_marked():
    from graddbg.report import _group_frame

    stats = pd.DataFrame({"step": [1, 1, 1, 2, 2, 2], "name": ["a.w", "a.b", "c.w"] * 2,
                          "module": ["a", "a", "c"] * 2, "numel": [4, 2, 3] * 2,
                          "norm": [1e38, 1e37, 0.5, math.nan, 2.0, math.inf],
                          "absmax": [1e38, 1e37, 0.4, math.nan, 1.5, math.inf],
                          "nonfinite": [0, 0, 0, 4, 0, 1], "has_grad": [True] * 6})
    frame, sizes = _group_frame(stats, np.array([0, 1, 2] * 2), ["a", "a", "c"])
    assert sizes == {"a": 2, "c": 1}
    g = frame.set_index(["step", "name"])
    assert g.loc[(1, "a"), "norm"] == pytest.approx(math.sqrt(1e76 + 1e74) * 1.0, rel=1e-12)  # no overflow
    assert g.loc[(1, "a"), "absmax"] == 1e38 and g.loc[(1, "a"), "numel"] == 6
    assert math.isnan(g.loc[(2, "a"), "norm"]) and g.loc[(2, "a"), "nonfinite"] == 4
    assert g.loc[(2, "c"), "norm"] == math.inf


def test_module_group_labels():
    from graddbg.report import MAX_GROUPS, _group_labels

    chain = [f"blocks.{i}" for i in range(2500)]  # one long list of blocks: runs of them
    labels = _group_labels(chain)
    assert len(set(labels)) == MAX_GROUPS
    assert labels[0] == "blocks.0 … blocks.52" and labels[-1] == "blocks.2448 … blocks.2499"
    assert labels == sorted(labels, key=labels.index)  # contiguous, in forward order
    llm = ["model.embed"] + [f"model.layers.{i}.{m}" for i in range(30) for m in ("attn", "mlp")] + ["lm_head", ""]
    labels = _group_labels(llm)
    assert list(dict.fromkeys(labels))[:3] == ["model.embed", "model.layers.0", "model.layers.1"]
    assert labels[-2:] == ["lm_head", "(root)"] and len(set(labels)) == 33
    assert _group_labels(["a", "b", ""]) == ["a", "b", "(root)"]


@pytest.mark.slow  # 5,000,000 rows: about 5 s of CPU
def test_report_of_5000_params_by_1000_steps_renders_in_seconds(tmp_path):
    run = big_frames(n_steps=1000, n_params=5000)
    t0, c0 = time.perf_counter(), time.process_time()
    path = write_report(run, tmp_path / "huge.html")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    text = path.read_text()
    page = Page(text)
    check_self_contained(text, page)
    assert page.errors == [] and page.tags["svg"] == 7
    names = [r[0] for r in page.table("param-summary")["rows"]]
    assert len(names) == 200 and {"blocks.3.bias", "blocks.10.weight", "blocks.25.weight"} <= set(names)
    assert len(page.table("module-summary")["rows"]) == 48
    assert path.stat().st_size < 5 * 1024 * 1024
    print(f"report of 5000 params x 1000 steps: {wall:.1f} s wall, {cpu:.1f} s CPU, "
          f"{path.stat().st_size / 1e6:.2f} MB")
    assert cpu < 30, cpu  # was 210 s before aggregation


def test_report_arguments_are_checked(tmp_path):
    from graddbg import GraddbgError

    run = tiny_run()
    with pytest.raises(TypeError, match="run must have DataFrame attributes stats and steps .*; got int"):
        render_report(3)
    with pytest.raises(TypeError, match="title must be a str or None; got int") as info:
        render_report(run, title=3)
    assert isinstance(info.value, GraddbgError)
    with pytest.raises(ValueError, match="is a directory; give a file name such as .*report.html"):
        write_report(run, tmp_path)


def test_an_unmeasured_value_is_never_shown_as_a_measured_nan(tmp_path):
    """A stale-gradient finding has no value (NaN in the record): its cells stay empty, not
    a red NaN; parameters without an update ratio show nothing; with every=2 the facts give
    the last *recorded* step's global norm (the last step has none); a non-finite finding's
    NaN is a measurement and stays shown."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with graddbg.watch(model, opt, every=2, update_every=None, nonfinite="record", stale_grad="record") as w:
        for i in range(5):
            if i != 1:  # zero_grad forgotten once: a stale gradient at step 1
                opt.zero_grad()
            x = torch.randn(4, 3)
            if i == 2:
                x[0, 0] = float("nan")
            model(x).sum().backward()
            opt.step()
    kinds = {a.kind for a in w.anomalies}
    assert {"stale_grad", "nonfinite"} <= kinds, kinds
    stale = next(a for a in w.anomalies if a.kind == "stale_grad")
    assert stale.value is None or math.isnan(stale.value)  # (what the finding records)
    page = Page(w.report(tmp_path / "r.html").read_text())
    table = page.table("anomalies")
    col = table["header"].index("value")
    for row in table["rows"]:
        if row[1] == "stale_grad":
            assert row[col] == "" and row[table["header"].index("threshold")] == "", row
    assert all("NaN" not in " ".join(r) for r in page.table("param-summary")["rows"]), \
        page.table("param-summary")
    facts = dict(page.table("facts")["rows"])
    assert "global norm, last recorded step (4)" in facts and facts["global norm, last recorded step (4)"] != "NaN"
    assert "global norm, last step" not in facts
