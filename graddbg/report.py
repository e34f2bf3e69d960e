"""One self-contained HTML report of a recorded run.

:func:`write_report` takes anything with the attributes of the run contract (a ``Watch``,
a :class:`graddbg.run.Run`) and writes a single HTML file that needs nothing else: no
network, no external assets, no script. It holds:

- the run summary (steps, parameters, anomalies by kind, global norm, run facts),
- the anomalies table (step, kind, parameter, module, op, source, value, message),
- the plots of :mod:`graddbg.plots` as inline SVG (gradient flow, norms, norm heatmap,
  update ratio, histograms),
- the per-parameter and per-module summaries (and activation gradients when recorded),
- the annotated autograd graph when one is given (a ``graddbg.graph`` result, SVG or
  DOT text, or a root tensor).

Every piece of text is HTML-escaped. Long series are reduced in the plots (each bucket's
min and max), so 1,000 steps x 100 parameters stay well under 5 MB.

matplotlib and pandas are imported inside the functions.
"""
from __future__ import annotations

import dataclasses
import html
import io
import json
import math
import os
import pathlib
import re
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

from graddbg._errors import DotNotFoundError

if TYPE_CHECKING:  # pragma: no cover - type names only
    import pandas
    from matplotlib.figure import Figure

__all__ = ["write_report", "render_report"]

PathLike = Union[str, "os.PathLike[str]"]
MAX_ANOMALY_ROWS = 500
MAX_SUMMARY_ROWS = 2000
MAX_PLOT_POINTS = 600
MAX_HIST_PANELS = 6

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:0;
 color:#222;background:#fafafa}
header{background:#1f2d3d;color:#fff;padding:14px 24px}
header h1{margin:0;font-size:22px} header p{margin:4px 0 0;color:#c8d3de;font-size:13px}
nav{padding:8px 24px;background:#eef1f4;font-size:13px} nav a{margin-right:14px;color:#1f4e79}
main{padding:8px 24px 40px}
section{background:#fff;border:1px solid #e1e4e8;border-radius:6px;margin:16px 0;padding:8px 16px}
h2{font-size:17px;margin:8px 0} h3{font-size:14px;margin:14px 0 6px}
table{border-collapse:collapse;font-size:12px;margin:6px 0}
th,td{border:1px solid #e1e4e8;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f3f5f7;position:sticky;top:0} td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.bad td{background:#fff1f0} .bad{color:#c62828;font-weight:600} .muted{color:#777}
.note{color:#555;font-size:13px} .error{color:#c62828;font-size:13px}
.figure{margin:10px 0;overflow-x:auto} .figure svg{max-width:100%;height:auto}
.scroll{max-height:480px;overflow:auto}
.kpi{display:inline-block;margin:4px 18px 8px 0} .kpi strong{display:block;font-size:18px}
pre{background:#f6f8fa;padding:8px;overflow:auto;font-size:11px;max-height:400px}
"""


# --------------------------------------------------------------------------- public

def write_report(run: Any, path: PathLike, *, graph: Any = None,
                 title: Optional[str] = None) -> pathlib.Path:
    """Write the HTML report of ``run`` to ``path`` and return the path.

    ``run`` is a ``Watch``, a :class:`graddbg.run.Run` or anything with their attributes
    (``stats``, ``steps``, ``anomalies``, ``histograms``, ``activations``, ``meta``).
    ``graph`` is optional: a ``graddbg.graph(...)`` result (anything with ``_repr_svg_``),
    SVG text, DOT text, or a root tensor to draw the autograd graph of. For a graph whose
    parameter nodes carry the run's statistics pass ``graddbg.graph(loss, model=model,
    watch=w)`` (a bare root has no parameter names to match). When drawing needs
    graphviz's ``dot`` and it is missing, the report says so and keeps the DOT text.

    >>> import pandas as pd, tempfile, os
    >>> from graddbg.run import Run
    >>> stats = pd.DataFrame({"step": [1, 2], "name": ["w", "w"], "module": ["", ""],
    ...     "numel": [3, 3], "norm": [0.5, float("nan")], "absmax": [0.4, float("nan")],
    ...     "nonfinite": [0, 3], "update_ratio": [1e-3, float("nan")],
    ...     "has_grad": [True, True]})
    >>> steps = pd.DataFrame({"step": [1, 2], "global_norm": [0.5, float("nan")]})
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = write_report(Run(stats, steps), os.path.join(d, "report.html"))
    ...     "<svg" in p.read_text()
    True
    """
    path = pathlib.Path(os.fspath(path))
    if path.is_dir():
        raise IsADirectoryError(f"path: {str(path)!r} is a directory; give a file name "
                                f"such as {str(path / 'report.html')!r}")
    text = render_report(run, graph=graph, title=title)
    path.write_text(text, encoding="utf-8")
    return path


def render_report(run: Any, *, graph: Any = None, title: Optional[str] = None) -> str:
    """The HTML text that :func:`write_report` writes.

    >>> import pandas as pd
    >>> from graddbg.run import Run
    >>> run = Run(pd.DataFrame({"step": [1], "name": ["<w>"], "module": [""], "numel": [1],
    ...     "norm": [1.0], "absmax": [1.0], "nonfinite": [0]}),
    ...     pd.DataFrame({"step": [1], "global_norm": [1.0]}))
    >>> text = render_report(run, title="a <b> run")
    >>> "a &lt;b&gt; run" in text and "<w>" not in text
    True
    """
    import pandas as pd

    _check_graph(graph)
    stats = getattr(run, "stats", None)
    steps = getattr(run, "steps", None)
    if not isinstance(stats, pd.DataFrame) or not isinstance(steps, pd.DataFrame):
        raise TypeError("run must have DataFrame attributes stats and steps (a Watch, a "
                        f"graddbg.Run, or graddbg.load(path)); got {type(run).__name__}")
    anomalies = list(getattr(run, "anomalies", None) or [])
    histograms = getattr(run, "histograms", None)
    activations = getattr(run, "activations", None)
    meta = dict(getattr(run, "meta", None) or {})
    if title is None:
        title = f"graddbg report: {meta['model']}" if meta.get("model") else "graddbg report"

    sections: List[Tuple[str, str, str]] = []  # (id, heading, body html)
    sections.append(("summary", "Run summary", _summary_html(stats, steps, anomalies, meta)))
    sections.append(("anomalies", f"Anomalies ({len(anomalies)})", _anomalies_html(anomalies)))
    sections.append(("plots", "Plots", _plots_html(stats, steps, anomalies, histograms)))
    sections.append(("parameters", "Per-parameter summary", _summary_table_html(run, stats, "param")))
    sections.append(("modules", "Per-module summary", _summary_table_html(run, stats, "module")))
    if activations is not None and len(activations):
        sections.append(("activations", "Activation gradients (per module)",
                         _activations_html(activations)))
    if graph is not None:
        sections.append(("graph", "Autograd graph", _graph_html(graph, run)))

    from graddbg import __version__

    esc = html.escape
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           '<link rel="icon" href="data:,">',
           f"<title>{esc(title)}</title>", f"<style>{_CSS}</style></head><body>",
           f"<header><h1>{esc(title)}</h1><p>written by graddbg {esc(__version__)}</p></header>",
           "<nav>" + "".join(f'<a href="#{sid}">{esc(head)}</a>' for sid, head, _ in sections)
           + "</nav>", "<main>"]
    for sid, head, body in sections:
        out.append(f'<section id="{sid}"><h2>{esc(head)}</h2>{body}</section>')
    out.append("</main></body></html>")
    return "\n".join(out)


# --------------------------------------------------------------------------- formatting

def _fmt(v: Any) -> Tuple[str, bool]:
    """(text, is_bad) for a table cell: floats compactly, NaN/Inf flagged."""
    if v is None:
        return "", False
    if isinstance(v, bool):
        return str(v), False
    if isinstance(v, float) or type(v).__name__.startswith("float"):
        f = float(v)
        if math.isnan(f):
            return "NaN", True
        if math.isinf(f):
            return ("Inf" if f > 0 else "-Inf"), True
        if f == 0:
            return "0", False
        if abs(f) >= 1e5 or abs(f) < 1e-3:
            return f"{f:.3e}", False
        return f"{f:.4g}", False
    try:
        if v != v:  # pandas NA-like
            return "", False
    except (TypeError, ValueError):
        return str(v), False
    return str(v), False


def _table(rows: Sequence[Sequence[Any]], header: Sequence[str], *,
           bad_rows: Optional[Sequence[bool]] = None, cls: str = "") -> str:
    esc = html.escape
    out = [f'<div class="scroll"><table class="{esc(cls)}"><thead><tr>'
           + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr></thead><tbody>"]
    for i, row in enumerate(rows):
        row_cls = ' class="bad"' if bad_rows is not None and bad_rows[i] else ""
        cells = []
        for v in row:
            text, bad = _fmt(v)
            num = isinstance(v, (int, float)) and not isinstance(v, bool) or \
                type(v).__name__.startswith(("int", "float"))
            classes = " ".join(c for c in ("num" if num else "", "bad" if bad else "") if c)
            cells.append(f'<td class="{classes}">{esc(text)}</td>' if classes
                         else f"<td>{esc(text)}</td>")
        out.append(f"<tr{row_cls}>" + "".join(cells) + "</tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


def _frame_table(frame: "pandas.DataFrame", *, max_rows: int, bad_col: Optional[str] = None,
                 cls: str = "") -> str:
    n = len(frame)
    shown = frame.iloc[:max_rows]
    bad = None
    if bad_col is not None and bad_col in shown.columns:
        bad = [bool(v) for v in (shown[bad_col].fillna(0) > 0)]
    rows = [list(r) for r in shown.itertuples(index=False, name=None)]
    text = _table(rows, [str(c) for c in shown.columns], bad_rows=bad, cls=cls)
    if n > max_rows:
        text += f'<p class="note">{n - max_rows} more rows not shown (of {n}).</p>'
    return text


def _error(what: str, e: BaseException) -> str:
    return (f'<p class="error">{html.escape(what)} failed: '
            f"{html.escape(type(e).__name__)}: {html.escape(str(e))}</p>")


# --------------------------------------------------------------------------- sections

def _anomaly_dicts(anomalies: Sequence[Any]) -> List[Dict[str, Any]]:
    out = []
    for a in anomalies:
        if isinstance(a, dict):
            out.append(dict(a))
        elif dataclasses.is_dataclass(a):
            out.append(dataclasses.asdict(a))
        else:
            out.append({k: getattr(a, k, None) for k in
                        ("step", "kind", "name", "module", "op", "value", "threshold",
                         "source", "message", "rank")})
    return out


def _summary_html(stats: "pandas.DataFrame", steps: "pandas.DataFrame",
                  anomalies: Sequence[Any], meta: Dict[str, Any]) -> str:
    import numpy as np

    esc = html.escape
    n_steps = len(steps)
    n_rec = int(stats["step"].nunique()) if "step" in stats.columns else 0
    names = list(dict.fromkeys(stats["name"])) if "name" in stats.columns else []
    numel = 0
    if "numel" in stats.columns and len(stats):
        numel = int(stats.drop_duplicates("name")["numel"].sum())
    kinds: Dict[str, int] = {}
    for a in _anomaly_dicts(anomalies):
        kinds[str(a.get("kind"))] = kinds.get(str(a.get("kind")), 0) + 1
    if "nonfinite" in steps.columns:
        nonfinite_steps = int((steps["nonfinite"] > 0).sum())
    elif "nonfinite" in stats.columns:
        nonfinite_steps = int(stats.loc[stats["nonfinite"] > 0, "step"].nunique())
    else:
        nonfinite_steps = 0
    overflow = int(steps["overflow"].astype(bool).sum()) if "overflow" in steps.columns else 0
    kpis = [("steps", n_steps), ("recorded steps", n_rec), ("parameters", len(names)),
            ("elements", f"{numel:,}"), ("anomalies", len(anomalies)),
            ("steps with NaN/Inf", nonfinite_steps), ("scaler overflows", overflow)]
    out = ['<div class="kpis">']
    for label, value in kpis:
        bad = label in ("anomalies", "steps with NaN/Inf") and value not in (0, "0")
        out.append(f'<span class="kpi{" bad" if bad else ""}"><strong>{esc(str(value))}</strong>'
                   f"{esc(label)}</span>")
    out.append("</div>")
    facts: List[Tuple[str, Any]] = []
    if "global_norm" in steps.columns and len(steps):
        g = steps["global_norm"].to_numpy(dtype=float)
        fin = g[np.isfinite(g)]
        facts.append(("global norm, last step", float(g[-1])))
        if fin.size:
            facts += [("global norm, median", float(np.median(fin))),
                      ("global norm, max (finite)", float(fin.max()))]
    if kinds:
        facts.append(("anomalies by kind", ", ".join(f"{k}: {v}" for k, v in sorted(kinds.items()))))
    for key, value in meta.items():
        if key == "uncovered":
            continue
        facts.append((str(key), value if isinstance(value, (int, float, str, bool))
                      or value is None else json.dumps(value, default=str)))
    out.append(_table([[k, v] for k, v in facts], ["fact", "value"], cls="facts"))
    uncovered = meta.get("uncovered") or []
    if uncovered:
        out.append('<p class="bad">Parameters that never produced a gradient: '
                   + esc(", ".join(map(str, uncovered))) + "</p>")
    return "".join(out)


def _anomalies_html(anomalies: Sequence[Any]) -> str:
    if not anomalies:
        return '<p class="note">No anomaly was detected.</p>'
    rows = []
    dicts = _anomaly_dicts(anomalies)
    with_rank = any(d.get("rank") is not None for d in dicts)
    header = ["step", "kind", "parameter", "module", "op", "source", "value", "threshold",
              "message"] + (["rank"] if with_rank else [])
    for d in dicts[:MAX_ANOMALY_ROWS]:
        row = [d.get("step"), d.get("kind"), d.get("name"), d.get("module"), d.get("op"),
               d.get("source"), d.get("value"), d.get("threshold"), d.get("message")]
        rows.append(row + ([d.get("rank")] if with_rank else []))
    text = _table(rows, header, bad_rows=[True] * len(rows), cls="anomalies")
    if len(dicts) > MAX_ANOMALY_ROWS:
        text += (f'<p class="note">{len(dicts) - MAX_ANOMALY_ROWS} more anomalies not shown '
                 f"(of {len(dicts)}); all of them are in w.anomalies.</p>")
    return text


_ID_RE = re.compile(r'\bid="')
_REF_RE = re.compile(r'(href="#|url\(#)')
_EXTERNAL_RE = re.compile(r'\s(?:xlink:)?href="(?!#|data:)[^"]*"')
_HANDLER_RE = re.compile(r'\son[a-zA-Z]+="[^"]*"')
_SCRIPT_RE = re.compile(r"<script\b.*?</script\s*>", re.S | re.I)


def _inline_svg(svg: str, prefix: str) -> str:
    """SVG text made safe to inline in the HTML document: no prologue or namespace URLs,
    ids prefixed (several figures share glyph and clip-path ids), no scripts, event
    handlers or external links."""
    start = svg.find("<svg")
    if start < 0:
        raise ValueError("not SVG text (no <svg> element)")
    svg = svg[start:]
    svg = re.sub(r'\s+xmlns(?::\w+)?="[^"]*"', "", svg)
    svg = _SCRIPT_RE.sub("", svg)
    svg = _HANDLER_RE.sub("", svg)
    svg = _EXTERNAL_RE.sub("", svg)
    svg = re.sub(r"<!DOCTYPE[^>]*>", "", svg)
    svg = _ID_RE.sub(f'id="{prefix}-', svg)
    svg = _REF_RE.sub(lambda m: m.group(1) + f"{prefix}-", svg)
    return svg


def _figure_svg(fig: "Figure", prefix: str) -> str:
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": "graddbg", "svg.fonttype": "path"}):
        fig.savefig(buf, format="svg",
                    metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    return _inline_svg(buf.getvalue(), prefix)


def _plots_html(stats: "pandas.DataFrame", steps: "pandas.DataFrame", anomalies: Sequence[Any],
                histograms: Optional["pandas.DataFrame"]) -> str:
    import numpy as np

    from graddbg import plots

    if len(stats) == 0:
        return '<p class="note">No step was recorded, so there is nothing to plot.</p>'
    jobs: List[Tuple[str, str, Any]] = []
    last = int(stats["step"].max())
    jobs.append(("flow", f"Gradient flow at the last recorded step ({last})",
                 lambda: plots.flow(stats, step=last)))
    if "nonfinite" in stats.columns:
        bad = stats.loc[stats["nonfinite"] > 0, "step"]
        if len(bad) and int(bad.min()) != last:
            first_bad = int(bad.min())
            jobs.append(("flow-first-nonfinite",
                         f"Gradient flow at the first step with NaN/Inf ({first_bad})",
                         lambda: plots.flow(stats, step=first_bad)))
    jobs.append(("norms", "Gradient norms over steps",
                 lambda: plots.norms(stats, steps, anomalies=anomalies,
                                     max_points=MAX_PLOT_POINTS)))
    jobs.append(("heatmap", "Gradient norm per parameter and step",
                 lambda: plots.norms(stats, steps, anomalies=anomalies, heatmap=True,
                                     max_points=MAX_PLOT_POINTS)))
    if "update_ratio" in stats.columns and np.isfinite(stats["update_ratio"].to_numpy(float)).any():
        jobs.append(("update", "Update / weight ratio",
                     lambda: plots.update_ratio(stats, anomalies=anomalies,
                                                max_points=MAX_PLOT_POINTS)))
    else:
        jobs.append(("update", "Update / weight ratio", None))
    if histograms is not None and len(histograms):
        jobs.append(("hist", "Histograms of |grad|", lambda: plots.hist(histograms, stats=stats, max_panels=MAX_HIST_PANELS)))
    out = []
    for fid, caption, make in jobs:
        out.append(f'<h3 id="fig-{fid}">{html.escape(caption)}</h3>')
        if make is None:
            out.append('<p class="note">No update ratios were recorded (watch() needs the '
                       "optimizer to measure them).</p>")
            continue
        try:
            svg = _figure_svg(make(), f"fig-{fid}")
        except Exception as e:  # one broken figure must not cost the rest of the report
            out.append(_error(f"the {fid} plot", e))
            continue
        out.append(f'<div class="figure">{svg}</div>')
    if histograms is None:
        out.append('<p class="note">No histograms were recorded (pass '
                   "watch(..., histograms=...) to record them).</p>")
    return "".join(out)


def _call_summary(run: Any, stats: "pandas.DataFrame", by: str) -> "pandas.DataFrame":
    fn = getattr(run, "summary", None)
    if callable(fn):
        return fn(by=by)
    from graddbg.stats import summarize

    return summarize(stats, by=by)


def _summary_table_html(run: Any, stats: "pandas.DataFrame", by: str) -> str:
    """The per-parameter (``by="param"``) or per-module summary table."""
    if len(stats) == 0:
        return '<p class="note">No step was recorded.</p>'
    what = "per-parameter" if by == "param" else "per-module"
    try:
        frame = _call_summary(run, stats, by)
    except Exception as e:
        return _error(f"the {what} summary", e)
    return _frame_table(frame, max_rows=MAX_SUMMARY_ROWS, bad_col="nonfinite_total",
                        cls=f"{by}-summary")


def _activations_html(activations: "pandas.DataFrame") -> str:
    import numpy as np

    try:
        a = activations.copy()
        a["grad_norm"] = a["grad_norm"].astype(float)
        a["_finite"] = a["grad_norm"].where(np.isfinite(a["grad_norm"]))
        g = a.groupby("module", sort=False)
        frame = g.agg(steps=("step", "nunique"), grad_norm_last=("grad_norm", "last"),
                      grad_norm_max=("_finite", "max"),
                      out_nonfinite_total=("out_nonfinite", "sum")).reset_index()
    except Exception as e:
        return _error("the activation summary", e)
    return _frame_table(frame, max_rows=MAX_SUMMARY_ROWS, bad_col="out_nonfinite_total",
                        cls="activations")


def _is_root(graph: Any) -> bool:
    import torch

    return isinstance(graph, torch.Tensor) or (
        isinstance(graph, (tuple, list)) and len(graph) > 0
        and all(isinstance(t, torch.Tensor) for t in graph))


def _check_graph(graph: Any) -> None:
    if graph is None or hasattr(graph, "_repr_svg_") or isinstance(graph, (str, bytes)) \
            or _is_root(graph):
        return
    raise TypeError("graph must be None, a graddbg.graph(...) result, SVG or DOT text, or a "
                    f"root tensor (such as the loss); got {type(graph).__name__}")


def _graph_html(graph: Any, run: Any) -> str:
    esc = html.escape
    dot: Optional[str] = None
    svg: Optional[str] = None
    note: Optional[str] = None
    if _is_root(graph):
        try:
            from graddbg.graphviz import graph as make_graph

            graph = make_graph(graph, watch=run)  # parameter nodes get the latest statistics
        except Exception as e:  # the rest of the report is still worth writing
            return _error("drawing the autograd graph", e)
    if hasattr(graph, "_repr_svg_"):
        dot = getattr(graph, "source", None)
        try:
            svg = graph._repr_svg_()
        except DotNotFoundError as e:
            note = f"The graph could not be drawn: {e} The DOT text is below."
        except (RuntimeError, OSError) as e:
            note = f"The graph could not be drawn ({type(e).__name__}: {e})."
    elif isinstance(graph, (str, bytes)):
        text = graph.decode("utf-8") if isinstance(graph, bytes) else graph
        if "<svg" in text[:2000]:
            svg = text
        else:
            dot = text
            try:
                from graddbg.graphviz import render_source

                svg = render_source(text, "svg").decode("utf-8")
            except DotNotFoundError as e:
                note = f"The graph could not be drawn: {e} The DOT text is below."
            except (RuntimeError, OSError) as e:
                note = f"The graph could not be drawn ({type(e).__name__}: {e})."
    out = []
    if svg is not None:
        try:
            out.append(f'<div class="figure graph">{_inline_svg(svg, "graph")}</div>')
        except ValueError as e:
            note = f"The graph SVG could not be embedded ({e})."
            svg = None
    if note is not None:
        out.append(f'<p class="note">{esc(note)}</p>')
    if dot is not None and svg is None:
        out.append(f"<pre>{esc(dot)}</pre>")
    return "".join(out)
