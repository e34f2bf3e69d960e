"""One self-contained HTML report of a recorded run.

`write_report` takes anything with the attributes of the run contract (a ``Watch``,
a `graddbg.run.Run`) and writes a single HTML file that needs nothing else: no
network, no external assets, no script. It holds:

- the run summary (steps, parameters, anomalies by kind, global norm, run facts),
- the anomalies table (step, kind, parameter, module, op, source, value, message),
- the plots of `graddbg.plots` as inline SVG (gradient flow, norms, norm heatmap,
  update ratio, histograms),
- the per-parameter and per-module summaries (and activation gradients when recorded),
- the annotated autograd graph when one is given (a ``graddbg.graph`` result, SVG or
  DOT text, or a root tensor).

Every piece of text is HTML-escaped. Long series are reduced in the plots (each bucket's
min and max), so 1,000 steps x 100 parameters stay well under 5 MB. Large runs (more than
``MAX_PARAMS_SHOWN`` parameters, or more than ``MAX_ROWS_EXACT`` rows) are aggregated: the
flow, norm and heatmap plots and the module table show at most ``MAX_GROUPS`` module groups
(norms rolled up as the root of the sum of squares), and the parameter table, the update
ratio plot and the histograms show a chosen few parameters (every one with NaN/Inf, the
largest and the smallest gradients), so 5,000 parameters x 1,000 steps render in seconds.
The file is written atomically (`graddbg._io.replacing`).

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

from graddbg._errors import DotNotFoundError, GraddbgTypeError, GraddbgValueError
from graddbg._model import module_of
from graddbg.anomaly import MAX_KEPT_PER_KIND, not_kept_text
from graddbg._io import file_target, write_atomic
from graddbg.stats import rollup_norms

if TYPE_CHECKING:  # pragma: no cover - type names only
    import pandas
    from matplotlib.figure import Figure

__all__ = ["write_report", "render_report"]

PathLike = Union[str, "os.PathLike[str]"]
MAX_ANOMALY_ROWS = 500
MAX_SUMMARY_ROWS = 2000
MAX_PLOT_POINTS = 600
MAX_HIST_PANELS = 6
MAX_PARAMS_SHOWN = 200  # parameters shown one by one; more are aggregated
MAX_ROWS_EXACT = 1_000_000  # rows summarised exactly (run.summary()); more are aggregated
MAX_GROUPS = 48  # module groups in the aggregated plots and table
MAX_LINES = 10  # module groups drawn as lines in the aggregated norms plot

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
th,td{border:1px solid #e1e4e8;padding:3px 7px;text-align:left;vertical-align:top;
 overflow-wrap:normal;word-break:normal;hyphens:none}
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

    One self-contained file: no network, no external assets, no script. Written
    atomically (a temporary file in the same folder, then a rename).

    Args:
        run: a `Watch`, a `Run` or anything with their attributes (``stats``, ``steps``,
            ``anomalies``, ``histograms``, ``activations``, ``meta``).
        path: where to write it.
        graph: optional: a ``graddbg.graph(...)`` result (anything with ``_repr_svg_``), SVG
            text, DOT text, or a root tensor to draw the autograd graph of. For a graph whose
            parameter nodes carry the run's statistics pass ``graddbg.graph(loss,
            model=model, watch=w)`` (a bare root has no parameter names to match). When
            drawing needs graphviz's ``dot`` and it is missing, the report says so and keeps
            the DOT text.
        title: the page title (default: the model's class).

    Returns:
        pathlib.Path: ``path``.

    Raises:
        GraddbgError: the file cannot be written (the message names it and the reason);
            the previous file, if any, is left whole.

    Examples:
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
    path = file_target(path, "report.html")
    text = render_report(run, graph=graph, title=title)
    return write_atomic(path, text)


def render_report(run: Any, *, graph: Any = None, title: Optional[str] = None) -> str:
    """The HTML text that `write_report` writes.

    Args:
        run: a `Watch`, a `Run` or anything with their attributes.
        graph: as for `write_report`.
        title: the page title.

    Returns:
        str: the whole HTML document; every value from the run is escaped.

    Examples:
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
        raise GraddbgTypeError("run must have DataFrame attributes stats and steps (a Watch, a "
                               f"graddbg.Run, or graddbg.load(path)); got {type(run).__name__}")
    if title is not None and not isinstance(title, str):
        raise GraddbgTypeError(f"title must be a str or None; got {type(title).__name__}")
    anomalies = list(getattr(run, "anomalies", None) or [])
    histograms = getattr(run, "histograms", None)
    activations = getattr(run, "activations", None)
    meta = dict(getattr(run, "meta", None) or {})
    if title is None:
        title = f"graddbg report: {meta['model']}" if meta.get("model") else "graddbg report"
    view = _View.of(run, stats)
    sections: List[Tuple[str, str, str]] = [  # (id, heading, body html)
        ("summary", "Run summary", _summary_html(view, steps, anomalies, meta)),
        ("anomalies", f"Anomalies ({len(anomalies)})", _anomalies_html(anomalies, meta.get("anomalies_not_kept"),
                                                                      where=_read_as(run, "anomalies"))),
        ("hygiene", "Training hygiene", _hygiene_html(anomalies, meta)),
        ("plots", "Plots", _plots_html(view, steps, anomalies, histograms)),
        ("parameters", "Per-parameter summary", _summary_table_html(view, "param")),
        ("modules", "Per-module summary", _summary_table_html(view, "module"))]
    ledger = getattr(run, "ledger", None)
    if ledger is not None and len(ledger):
        sections.insert(3, ("ledger", "What happened in the steps of the findings", _ledger_html(
            ledger, anomalies, where=_read_as(run, "ledger"))))
    if activations is not None and len(activations):
        sections.append(("activations", "Activation gradients (per module)",
                         _activations_html(activations)))
    if graph is not None:
        sections.append(("graph", "Autograd graph", _graph_html(graph, run)))
    return _page(title, sections)


def _page(title: str, sections: Sequence[Tuple[str, str, str]]) -> str:
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

def _fmt(v: Any, blank_nan: bool = False) -> Tuple[str, bool]:
    """(text, is_bad) for a table cell: floats compactly, NaN/Inf flagged. ``blank_nan``:
    a NaN in this table means "not measured" (an update ratio never measured, a finding
    without a value): nothing is shown, never a red NaN."""
    if v is None:
        return "", False
    if isinstance(v, bool):
        return str(v), False
    if isinstance(v, float) or type(v).__name__.startswith("float"):
        f = float(v)
        if math.isnan(f):
            return ("", False) if blank_nan else ("NaN", True)
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
           bad_rows: Optional[Sequence[bool]] = None, cls: str = "", blank_nan: bool = False) -> str:
    esc = html.escape
    out = [f'<div class="scroll"><table class="{esc(cls)}"><thead><tr>'
           + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr></thead><tbody>"]
    for i, row in enumerate(rows):
        row_cls = ' class="bad"' if bad_rows is not None and bad_rows[i] else ""
        cells = []
        for v in row:
            text, bad = _fmt(v, blank_nan)
            num = isinstance(v, (int, float)) and not isinstance(v, bool) or \
                type(v).__name__.startswith(("int", "float"))
            classes = " ".join(c for c in ("num" if num else "", "bad" if bad else "") if c)
            cells.append(f'<td class="{classes}">{esc(text)}</td>' if classes
                         else f"<td>{esc(text)}</td>")
        out.append(f"<tr{row_cls}>" + "".join(cells) + "</tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


def _frame_table(frame: "pandas.DataFrame", *, max_rows: int, bad_col: Optional[str] = None,
                 cls: str = "", blank_nan: bool = False) -> str:
    n = len(frame)
    shown = frame.iloc[:max_rows]
    bad = None
    if bad_col is not None and bad_col in shown.columns:
        bad = [bool(v) for v in (shown[bad_col].fillna(0) > 0)]
    rows = [list(r) for r in shown.itertuples(index=False, name=None)]
    text = _table(rows, [str(c) for c in shown.columns], bad_rows=bad, cls=cls, blank_nan=blank_nan)
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
                         "source", "message", "rank", "reproduced")})
    return out


def _summary_html(view: "_View", steps: "pandas.DataFrame",
                  anomalies: Sequence[Any], meta: Dict[str, Any]) -> str:
    import numpy as np

    esc = html.escape
    stats = view.stats
    n_steps = len(steps)
    n_rec = int(stats["step"].nunique()) if "step" in stats.columns else 0
    names, numel = view.names, view.numel
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
    from graddbg.plots import counted

    def kpi(n: int, noun: str, shown: Any = None) -> Tuple[str, Any]:
        return counted(n, noun).split(" ", 1)[1], n if shown is None else shown  # (1 step, 2 steps)

    kpis = [kpi(n_steps, "step"), kpi(n_rec, "recorded step"), kpi(len(names), "parameter"),
            kpi(numel, "element", f"{numel:,}"), kpi(len(anomalies), "anomaly"),
            ("step with NaN/Inf" if nonfinite_steps == 1 else "steps with NaN/Inf", nonfinite_steps),
            kpi(overflow, "scaler overflow")]
    out = ['<div class="kpis">']
    for label, value in kpis:
        bad = label in ("anomaly", "anomalies", "step with NaN/Inf", "steps with NaN/Inf") and value not in (0, "0")
        out.append(f'<span class="kpi{" bad" if bad else ""}"><strong>{esc(str(value))}</strong>'
                   f"{esc(label)}</span>")
    out.append("</div>")
    facts: List[Tuple[str, Any]] = []
    if "global_norm" in steps.columns and len(steps):
        g = steps["global_norm"].to_numpy(dtype=float)
        if "recorded" in steps.columns:  # (a step between recorded ones has no norm: not a NaN)
            g = g[steps["recorded"].to_numpy(dtype=bool)]
        fin = g[np.isfinite(g)]
        if g.size:
            last = int(steps["step"].to_numpy()[steps["recorded"].to_numpy(dtype=bool)][-1]) \
                if "recorded" in steps.columns else int(steps["step"].iloc[-1])
            facts.append((f"global norm, last recorded step ({last})", float(g[-1])))
        if fin.size:
            facts += [("global norm, median", float(np.median(fin))),
                      ("global norm, max (finite)", float(fin.max()))]
    facts += _loss_facts(steps)
    if kinds:
        facts.append(("anomalies by kind", ", ".join(f"{k}: {v}" for k, v in sorted(kinds.items()))))
    for key, value in meta.items():
        if key == "uncovered":
            continue
        if key == "anomalies_not_kept" and isinstance(value, list):  # past MAX_KEPT_PER_KIND of a kind
            facts.append(("findings counted, not kept", "; ".join(not_kept_text(value))))
            continue
        facts.append((str(key), value if isinstance(value, (int, float, str, bool))
                      or value is None else json.dumps(value, default=str)))
    out.append(_table([[k, v] for k, v in facts], ["fact", "value"], cls="facts"))
    uncovered = meta.get("uncovered") or []
    if uncovered:
        out.append('<p class="bad">Parameters that never produced a gradient: '
                   + esc(", ".join(map(str, uncovered))) + "</p>")
    return "".join(out)


#: the ledger's columns shown for a finding's step (and the steps just before it)
LEDGER_COLUMNS = ("step", "path", "forwards", "mode", "backwards", "held_before", "between", "grads", "lr",
                  "moved", "unmoved_with_grad", "skipped", "global_norm", "clipped_norm", "scale", "findings")


def _loss_facts(steps: "pandas.DataFrame") -> List[Tuple[str, Any]]:
    """The loss of the last step that has one (the sum of the losses handed to backward()
    in that step), next to the learning rate then."""
    import numpy as np

    losses = steps["loss"].to_numpy(dtype=float) if "loss" in steps.columns else np.zeros(0)
    if not np.isfinite(losses).any():
        return []
    at = int(np.flatnonzero(np.isfinite(losses))[-1])
    facts: List[Tuple[str, Any]] = [(f"loss, last step with one ({int(steps['step'].iloc[at])})", float(losses[at]))]
    if "lr" in steps.columns and np.isfinite(float(steps["lr"].iloc[at])):
        facts.append(("learning rate at that step", float(steps["lr"].iloc[at])))
    return facts


def _read_as(run: Any, what: str) -> str:
    """How a reader gets ``what`` (``ledger``, ``anomalies``, ``summary()``) of the run: from
    its run file when it has one (a report of ``graddbg run`` or ``graddbg report``, where
    there is no ``w``: ``graddbg.load('out/stats.parquet').ledger``), else from the Watch."""
    source = getattr(run, "source", None)
    return f"graddbg.load({os.fspath(source)!r}).{what}" if isinstance(source, (str, os.PathLike)) else f"w.{what}"


def _ledger_html(ledger: Any, anomalies: Sequence[Any], most: int = 5, before: int = 2,
                 where: str = "w.ledger") -> str:
    """The ledger's rows of the first ``most`` steps with a finding, each with the ``before``
    steps before it: what fed each step and what the step did (`Watch.ledger`; ``where``:
    how the reader gets all of it)."""
    steps = sorted({int(d["step"]) for d in _anomaly_dicts(anomalies) if d.get("step") is not None})[:most]
    if not steps:
        return (f'<p class="note">No finding: the ledger kept {len(ledger)} step(s); '
                f"<code>{html.escape(where)}</code> has them all.</p>")
    cols = [c for c in LEDGER_COLUMNS if c in ledger.columns]
    parts = []
    for s in steps:
        rows = ledger[(ledger["step"] >= s - before) & (ledger["step"] <= s)]
        if not len(rows):
            continue
        body = [[r[c] for c in cols] for _, r in rows.iterrows()]
        parts.append(f"<h3>Step {s}</h3>" + _table(body, cols, bad_rows=[int(r["step"]) == s for _, r in rows.iterrows()],
                                                   cls="ledger", blank_nan=True))
    return "".join(parts) or '<p class="note">The steps of the findings are older than the ledger keeps.</p>'


#: what each training-hygiene finding means, in a reader's words: (symptom, cause and fix)
HYGIENE_TEXT = {
    "stale_grad": ("gradients survive an optimizer step", "optimizer.zero_grad() is missing"),
    "empty_step": ("a step without the gradients backward computed",
                   "zero_grad() between backward() and step(), or step() before backward()"),
    "orphan_param": ("parameters with gradients that no param group holds",
                     "a layer replaced or added after the optimizer was built"),
    "no_update": ("non-zero gradients, unchanged parameters", "a learning rate of 0, or a step that skips them"),
    "double_step": ("one set of gradients applied by two steps", "optimizer.step() called twice per iteration"),
    "scaled_grad": ("a step on gradients still scaled by GradScaler", "optimizer.step() instead of scaler.step()"),
    "foreign_update": ("parameters changed outside the watched optimizer's step",
                       "another optimizer (one re-created in the loop), or code writing the weights"),
    "update_rule": ("a step that moved a parameter otherwise than the optimizer's rule",
                    "weights kept in bf16/fp16 (updates rounded away), a parameter stepped twice, a hook editing the step"),
    "applied_grad": ("gradients changed between backward and the step by something the ledger cannot explain",
                     "a zero_grad() of another optimizer between backward and step, gradients scaled up or flipped"),
    "module_setup": ("a module whose construction does not do what it says",
                     "module.requires_grad = False (an attribute: freezes nothing); [layer] * n in a ModuleList"),
    "optimizer_setup": ("an optimizer hyperparameter that switches off its own mechanism",
                        "Adam's eps copied at 1.0 from another framework's config"),
    "lr_schedule": ("a learning rate that changes per micro-batch or collapses",
                    "a scheduler stepped per micro-batch, or per batch instead of per epoch"),
    "hidden_param": ("tensors trained through the loss that are not parameters",
                     "a tensor instead of nn.Parameter, a list instead of nn.ModuleList, a layer built in forward"),
    "eval_mode": ("training steps in eval mode", "model.eval() for validation, never undone"),
    "loss_pattern": ("a harmful pattern on the path to the loss",
                     "softmax before cross_entropy, nll_loss on probabilities, a broadcasting target, ..."),
    "dead_grad": ("gradients exactly zero step after step", "dead ReLUs, a saturated layer, dead from initialisation"),
    "unused_param": ("parameters cut off from the loss", "unused in forward, a .detach(), a no_grad region, "
                     "a reentrant checkpoint"),
}


def _hygiene_html(anomalies: Sequence[Any], meta: Dict[str, Any]) -> str:
    """The silent training mistakes found (optimizer hygiene) and the parameters that never
    had a gradient; a note saying what was checked when there is none."""
    dicts = [d for d in _anomaly_dicts(anomalies) if d.get("kind") in HYGIENE_TEXT]
    uncovered = list(meta.get("uncovered") or [])
    if uncovered and not any(d.get("kind") == "unused_param" for d in dicts):
        dicts.append({"kind": "unused_param", "step": None, "params": uncovered,
                      "message": f"{len(uncovered)} trainable parameter(s) never received a gradient"})
    if not dicts:
        return ('<p class="note">No training-hygiene finding: zero_grad placement, parameters outside '
                "the optimizer, parameters left unchanged by the step, dead gradients and unused "
                "parameters were checked.</p>")
    rows = []
    for d in dicts:
        symptom, cause = HYGIENE_TEXT[d["kind"]]
        params = list(d.get("params") or [])
        shown = ", ".join(params[:6]) + (f" and {len(params) - 6} more" if len(params) > 6 else "")
        rows.append([d.get("step"), d["kind"], symptom, cause, shown, d.get("message")])
    return _table(rows, ["step", "finding", "symptom", "likely cause", "parameters", "message"],
                  bad_rows=[True] * len(rows), cls="hygiene", blank_nan=True)


def _replay_verdict(reproduced: Any) -> str:
    """What the replay of a non-finite step said (Anomaly.reproduced)."""
    if reproduced is None:
        return ""
    return ("reproduced: a deterministic bug" if reproduced else
            "NOT reproduced: suspect nondeterminism or faulty hardware")


def _measured(d: Dict[str, Any], key: str) -> Any:
    """An anomaly's value or threshold as a cell: a NaN is a measurement only for a
    non-finite finding (the NaN norm that was found); elsewhere it means the finding has no
    such number (a stale gradient, an unused parameter) and the cell stays empty."""
    v = d.get(key)
    if d.get("kind") != "nonfinite" and isinstance(v, float) and math.isnan(v):
        return None
    return v


def _anomalies_html(anomalies: Sequence[Any], not_kept: Any = None, where: str = "w.anomalies") -> str:
    if not anomalies:
        return '<p class="note">No anomaly was detected.</p>'
    rows = []
    dicts = _anomaly_dicts(anomalies)
    with_rank = any(d.get("rank") is not None for d in dicts)
    with_replay = any(d.get("reproduced") is not None for d in dicts)
    header = ["step", "kind", "parameter", "module", "op", "source", "value", "threshold",
              "message"] + (["rank"] if with_rank else []) + (["replay"] if with_replay else [])
    for d in dicts[:MAX_ANOMALY_ROWS]:
        row = [d.get("step"), d.get("kind"), d.get("name"), d.get("module"), d.get("op"),
               d.get("source"), _measured(d, "value"), _measured(d, "threshold"), d.get("message")]
        row += [d.get("rank")] if with_rank else []
        row += [_replay_verdict(d.get("reproduced"))] if with_replay else []
        rows.append(row)
    text = _table(rows, header, bad_rows=[True] * len(rows), cls="anomalies")
    if len(dicts) > MAX_ANOMALY_ROWS:
        text += (f'<p class="note">{len(dicts) - MAX_ANOMALY_ROWS} more anomalies not shown '
                 f"(of {len(dicts)}); all of them are in <code>{html.escape(where)}</code>.</p>")
    if isinstance(not_kept, list) and not_kept:
        text += (f'<p class="note">Counted, not kept (<code>{html.escape(where)}</code> keeps the first '
                 f"{MAX_KEPT_PER_KIND:,} findings of each kind): "
                 + html.escape("; ".join(not_kept_text(not_kept))) + ".</p>")
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
        raise GraddbgValueError("not SVG text (no <svg> element)")
    svg = svg[start:]
    svg = re.sub(r'\s+xmlns(?::\w+)?="[^"]*"', "", svg)
    svg = _SCRIPT_RE.sub("", svg)
    svg = _HANDLER_RE.sub("", svg)
    svg = _EXTERNAL_RE.sub("", svg)
    svg = re.sub(r"<!DOCTYPE[^>]*>", "", svg)
    svg = _ID_RE.sub(f'id="{prefix}-', svg)
    svg = _REF_RE.sub(lambda m: m.group(1) + f"{prefix}-", svg)
    return svg


def _lay_out_once(fig: "Figure") -> None:
    """Lay ``fig`` out now and fix its axes there, so that ``savefig`` draws it once.

    ``savefig`` draws a figure with a layout engine (the plots use constrained layout)
    twice: once to lay it out, measuring the text as the SVG will draw it, once to write
    it; the first draw was a third of a report's time. Here the engine runs alone with the
    same measures (an SVG renderer at the SVG's 72 dpi), then it is taken off the figure:
    ``savefig`` draws the SVG once, laid out as before."""
    engine = fig.get_layout_engine()
    if engine is None or not fig.axes:
        return
    import matplotlib
    from matplotlib.backend_bases import FigureCanvasBase
    from matplotlib.backends.backend_svg import RendererSVG

    class Measuring(FigureCanvasBase):
        def get_renderer(self) -> RendererSVG:  # what the layout engine measures text with
            return renderer

    canvas, dpi = fig.canvas, fig.dpi
    fig.set_dpi(72)  # (as savefig draws an SVG)
    width, height = fig.get_size_inches()
    renderer = RendererSVG(width * 72, height * 72, io.StringIO(), image_dpi=dpi)
    try:
        Measuring(fig)
        engine.execute(fig)
    finally:
        fig.set_canvas(canvas)
        fig.set_dpi(dpi)
    with matplotlib.rc_context({"figure.autolayout": False, "figure.constrained_layout.use": False}):
        fig.set_layout_engine(None)  # (None means the rc's engine when one is set there)


def _figure_svg(fig: "Figure", prefix: str) -> str:
    import matplotlib

    _lay_out_once(fig)
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": "graddbg", "svg.fonttype": "path"}):
        fig.savefig(buf, format="svg",
                    metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    return _inline_svg(buf.getvalue(), prefix)


def _plot_jobs(view: "_View", steps: "pandas.DataFrame", anomalies: Sequence[Any],
               histograms: Optional["pandas.DataFrame"]) -> List[Tuple[str, str, Any]]:
    """(figure id, caption, a function making the figure or None) for every plot."""
    import numpy as np

    from graddbg import plots

    stats = view.plot_stats
    per = " per module group" if view.compact else ""
    last = int(stats["step"].max())
    jobs: List[Tuple[str, str, Any]] = [
        ("flow", f"Gradient flow{per} at the last recorded step ({last})",
         lambda: plots.flow(stats, step=last))]
    if "nonfinite" in stats.columns:
        bad = stats.loc[stats["nonfinite"] > 0, "step"]
        if len(bad) and int(bad.min()) != last:
            first_bad = int(bad.min())
            jobs.append(("flow-first-nonfinite",
                         f"Gradient flow{per} at the first step with NaN/Inf ({first_bad})",
                         lambda: plots.flow(stats, step=first_bad)))
    jobs.append(("norms", "Gradient norms over steps" + (", global and the module groups "
                                                          "with NaN/Inf or the largest norms" if per else ""),
                 lambda: plots.norms(stats, steps, anomalies=anomalies, names=view.lines,
                                     max_points=MAX_PLOT_POINTS)))
    jobs.append(("heatmap", f"Gradient norm per {'module group' if per else 'parameter'} and step",
                 lambda: plots.norms(stats, steps, anomalies=anomalies, heatmap=True,
                                     max_points=MAX_PLOT_POINTS)))
    if any(c in steps.columns and np.isfinite(steps[c].to_numpy(float)).any() for c in ("loss", "lr")):
        jobs.append(("loss", "Loss handed to backward() and learning rate over steps",
                     lambda: plots.loss(steps, anomalies=anomalies, max_points=MAX_PLOT_POINTS)))
    ratios = view.stats["update_ratio"] if "update_ratio" in view.stats.columns else None
    caption = "Update / weight ratio" + (f" ({view.sample_note})" if per else "")
    if ratios is not None and np.isfinite(ratios.to_numpy(float)).any():
        frame = view.rows(view.sample) if per else view.stats
        jobs.append(("update", caption, lambda: plots.update_ratio(
            frame, anomalies=anomalies, max_points=MAX_PLOT_POINTS)))
    else:
        jobs.append(("update", caption, None))
    if histograms is not None and len(histograms):
        jobs.append(("hist", "Histograms of |grad|" + (" of the parameters with NaN/Inf or the "
                                                       "largest norms" if per else ""),
                     lambda: _hist_figure(view, histograms)))
    return jobs


def _hist_figure(view: "_View", histograms: "pandas.DataFrame") -> "Figure":
    from graddbg import plots

    if not view.compact:
        return plots.hist(histograms, stats=view.stats, max_panels=MAX_HIST_PANELS)
    have = set(str(n) for n in histograms["name"].unique())
    codes = [i for i in view.ranked if view.names[i] in have][:MAX_HIST_PANELS]
    names = [view.names[i] for i in sorted(codes)]
    wanted = histograms[histograms["name"].isin(names)]
    return plots.hist(wanted, names=names, stats=view.rows(sorted(codes)),
                      max_panels=MAX_HIST_PANELS)


def _plots_html(view: "_View", steps: "pandas.DataFrame", anomalies: Sequence[Any],
                histograms: Optional["pandas.DataFrame"]) -> str:
    if len(view.stats) == 0:
        return '<p class="note">No step was recorded, so there is nothing to plot.</p>'
    out = [f'<p class="note">{html.escape(view.plot_note)}</p>'] if view.compact else []
    for fid, caption, make in _plot_jobs(view, steps, anomalies, histograms):
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


def _summary_table_html(view: "_View", by: str) -> str:
    """The per-parameter (``by="param"``) or per-module summary table."""
    if len(view.stats) == 0:
        return '<p class="note">No step was recorded.</p>'
    what = "per-parameter" if by == "param" else "per-module"
    try:
        frame = view.table(by)
    except Exception as e:
        return _error(f"the {what} summary", e)
    note = ""
    if view.compact:
        note = f'<p class="note">{html.escape(view.table_note(by))}</p>'
    return note + _frame_table(frame, max_rows=MAX_SUMMARY_ROWS, bad_col="nonfinite_total",
                               cls=f"{by}-summary", blank_nan=True)  # (NaN/Inf counted in their own columns)


def _call_summary(run: Any, stats: "pandas.DataFrame", by: str) -> "pandas.DataFrame":
    fn = getattr(run, "summary", None)
    if callable(fn):
        return fn(by=by)
    from graddbg.stats import summarize

    return summarize(stats, by=by)


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
    raise GraddbgTypeError("graph must be None, a graddbg.graph(...) result, SVG or DOT text, or a "
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


# --------------------------------------------------------------------------- large runs

@dataclasses.dataclass
class _View:
    """What the report shows of a run's statistics: every row (a small run), or module
    groups and a few chosen parameters (a large run: ``compact``)."""

    run: Any
    stats: "pandas.DataFrame"
    names: List[str]  # parameters in forward order (first appearance)
    codes: Any  # each row's index into names (numpy, -1 for a missing name)
    numel: int  # elements of all parameters
    compact: bool = False
    groups: Any = None  # compact: per (step, module group) rows with the columns of stats
    group_sizes: Dict[str, int] = dataclasses.field(default_factory=dict)
    n_modules: int = 0
    lines: Optional[List[str]] = None  # compact: the module groups drawn as lines
    ranked: List[int] = dataclasses.field(default_factory=list)  # notable parameters, first first
    shown: List[int] = dataclasses.field(default_factory=list)  # ranked, in forward order
    sample: List[int] = dataclasses.field(default_factory=list)  # in the update-ratio plot
    sample_note: str = ""

    @classmethod
    def of(cls, run: Any, stats: "pandas.DataFrame") -> "_View":
        import numpy as np
        import pandas as pd

        if "name" not in stats.columns or len(stats) == 0:
            return cls(run, stats, [], np.zeros(len(stats), dtype=np.int64), 0)
        codes, uniques = pd.factorize(stats["name"], sort=False)
        names = [str(n) for n in uniques]
        # factorize numbers names in order of appearance: a new one raises the running max
        first = np.flatnonzero(np.diff(np.maximum.accumulate(codes), prepend=-1) > 0)
        try:
            numel = int(np.nansum(stats["numel"].to_numpy(dtype=float)[first]))
        except (KeyError, TypeError, ValueError):
            numel = 0
        view = cls(run, stats, names, codes, numel)
        if (len(names) > MAX_PARAMS_SHOWN or len(stats) > MAX_ROWS_EXACT) \
                and {"step", "norm"} <= set(stats.columns):
            _aggregate(view, first)
        return view

    @property
    def plot_stats(self) -> "pandas.DataFrame":
        return self.groups if self.compact else self.stats

    @property
    def plot_note(self) -> str:
        return (f"This run has {len(self.names):,} parameters in {self.n_modules:,} modules, "
                f"too many to draw one by one: the flow, norm and heatmap plots show "
                f"{len(self.group_sizes)} module groups, each group's norm being the root of "
                f"the sum of its parameters' squared norms, its max |grad| the largest of "
                f"theirs. The per-parameter table below lists the parameters worth a look.")

    def table_note(self, by: str) -> str:
        if by == "param":
            return (f"{len(self.shown)} of {len(self.names):,} parameters: every one with "
                    f"NaN/Inf, then the largest and the smallest gradient norms, in forward "
                    f"order. {_read_as(self.run, 'summary()')} has all of them.")
        return (f"{len(self.group_sizes)} groups of the {self.n_modules:,} modules, in forward "
                f"order (a run of consecutive modules is labelled 'first … last'); "
                f"{_read_as(self.run, 'summary(by=' + repr('module') + ')')} has every module.")

    def rows(self, codes: Sequence[int]) -> "pandas.DataFrame":
        """The rows of the parameters ``codes``, unused categories dropped."""
        import numpy as np

        sub = self.stats[np.isin(self.codes, np.asarray(list(codes), dtype=np.int64))]
        for col in ("name", "module"):
            if col in sub.columns and str(sub[col].dtype) == "category":
                sub = sub.assign(**{col: sub[col].cat.remove_unused_categories()})
        return sub

    def table(self, by: str) -> "pandas.DataFrame":
        from graddbg.stats import summarize

        if not self.compact:
            return _call_summary(self.run, self.stats, by)
        if by == "param":
            return summarize(self.rows(self.shown), by="param")
        frame = summarize(self.groups, by="param").drop(columns=["module"]).rename(columns={"name": "module"})
        frame["params"] = [self.group_sizes[m] for m in frame["module"]]
        return frame[["module", "params", "numel", "steps", "norm_mean", "norm_max",
                      "norm_last", "nonfinite_total"]]


def _aggregate(view: _View, first: Any) -> None:
    """Fill the compact parts of ``view``: module groups, notable parameters, a sample."""
    import numpy as np

    modules = _param_modules(view.stats, view.names, first)
    labels = _group_labels(modules)
    view.groups, view.group_sizes = _group_frame(view.stats, view.codes, labels)
    view.n_modules = len(set(modules))
    view.lines = _group_lines(view.groups)
    figures = _param_figures(view.stats, view.codes, len(view.names))
    view.ranked = _notable(figures, MAX_PARAMS_SHOWN)
    view.shown = sorted(view.ranked)
    P, top = len(view.names), min(10, MAX_PARAMS_SHOWN // 2)
    even = np.unique(np.linspace(0, P - 1, min(P, MAX_PARAMS_SHOWN - top)).round().astype(np.int64))
    upd = figures["update"]
    largest = [int(i) for i in np.argsort(-np.where(np.isfinite(upd), upd, -np.inf))[:top]
               if np.isfinite(upd[i])]
    view.sample = sorted(set(even.tolist()) | set(largest))
    view.sample_note = (f"{len(view.sample)} of {P:,} parameters: evenly spaced in forward "
                        f"order, and the {len(largest)} largest ratios")
    view.compact = True


def _param_modules(stats: "pandas.DataFrame", names: List[str], first: Any) -> List[str]:
    """Each parameter's module ("" for the root), from the module column or its name."""
    if "module" not in stats.columns:
        return [module_of(n) for n in names]
    values = stats["module"].iloc[first].to_numpy(dtype=object)
    return [m if isinstance(m, str) else "" for m in values]


def _group_labels(modules: Sequence[str]) -> List[str]:
    """One label per parameter: its module while there are at most MAX_GROUPS modules;
    else its module path cut at the deepest depth that gives at most MAX_GROUPS groups,
    or, when that gives only a few (a model that is one long list of blocks), runs of
    consecutive modules one level deeper, labelled "first … last"."""
    order = list(dict.fromkeys(modules))
    if len(order) <= MAX_GROUPS:
        return [m or "(root)" for m in modules]

    def cut(m: str, d: int) -> str:
        return ".".join(m.split(".")[:d]) or "(root)"

    depth = 0
    while len({cut(m, depth + 1) for m in order}) <= MAX_GROUPS:
        depth += 1
    label = {m: cut(m, depth) for m in order}
    if len(set(label.values())) < MAX_GROUPS // 4:
        label = _runs({m: cut(m, depth + 1) for m in order})
    return [label[m] for m in modules]


def _runs(prefix: Dict[str, str]) -> Dict[str, str]:
    """Module -> label of the run of consecutive prefixes (at most MAX_GROUPS runs) it is in."""
    import numpy as np

    seq = list(dict.fromkeys(prefix.values()))
    label: Dict[str, str] = {}
    for chunk in np.array_split(np.arange(len(seq)), MAX_GROUPS):
        if len(chunk):
            a, b = seq[chunk[0]], seq[chunk[-1]]
            for i in chunk:
                label[seq[i]] = a if a == b else f"{a} … {b}"
    return {m: label[p] for m, p in prefix.items()}


def _group_frame(stats: "pandas.DataFrame", codes: Any, labels: List[str]) -> Tuple[Any, Dict[str, int]]:
    """Per (step, group) rows with the columns of stats: norm = root of the sum of squares
    (NaN/Inf when a parameter's is), absmax = max, nonfinite and numel = sums."""
    import numpy as np
    import pandas as pd

    groups = list(dict.fromkeys(labels))
    index = {g: i for i, g in enumerate(groups)}
    G, ok = len(groups), codes >= 0
    gcode = np.array([index[l] for l in labels], dtype=np.int64)[codes[ok]]
    steps, scode = _sorted_codes(stats["step"].to_numpy()[ok])
    key = scode.astype(np.int64) * G + gcode
    n = len(steps) * G

    def total(w: Any) -> Any:
        return np.bincount(key, weights=np.asarray(w, dtype=float), minlength=n)

    has = stats["has_grad"].to_numpy(dtype=bool)[ok] if "has_grad" in stats.columns else np.ones(len(key), bool)
    norm = rollup_norms(key, stats["norm"].to_numpy(dtype=float)[ok], has, n)  # (the one roll-up rule)
    anyhas = total(has) > 0
    data = {"step": np.repeat(steps, G), "name": np.tile(np.array(groups, dtype=object), len(steps))}
    data["module"] = data["name"]
    data["numel"] = total(stats["numel"].to_numpy(dtype=float)[ok]).astype(np.int64) \
        if "numel" in stats.columns else np.zeros(n, np.int64)
    data["norm"] = norm
    if "absmax" in stats.columns:
        absmax = np.where(has, stats["absmax"].to_numpy(dtype=float)[ok], np.nan)
        data["absmax"] = _group_max(key, absmax, n)
    nonfinite = stats["nonfinite"].to_numpy(dtype=float)[ok] if "nonfinite" in stats.columns else 0.0
    data["nonfinite"] = total(np.broadcast_to(nonfinite, key.shape)).astype(np.int64)
    data["update_ratio"] = np.full(n, np.nan)
    data["has_grad"] = anyhas
    present = np.bincount(key, minlength=n) > 0
    frame = pd.DataFrame(data)[present].reset_index(drop=True)
    from collections import Counter

    return frame, dict(Counter(labels))


def _sorted_codes(values: Any) -> Tuple[Any, Any]:
    """(sorted unique values, each value's index among them): np.unique's answer, by hashing."""
    import numpy as np
    import pandas as pd

    codes, uniques = pd.factorize(values, sort=False)
    order = np.argsort(uniques, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return np.asarray(uniques)[order], rank[codes]


def _group_max(key: Any, values: Any, n: int) -> Any:
    """The largest of ``values`` per key in range(n), NaN skipped (NaN where none)."""
    import numpy as np

    out = np.full(n, np.nan)
    np.fmax.at(out, key, values)
    return out


def _group_lines(groups: "pandas.DataFrame") -> List[str]:
    """The module groups drawn as lines: those with NaN/Inf first, then the largest peaks."""
    import numpy as np

    norm = groups["norm"].to_numpy(dtype=float)
    bad = groups.loc[~np.isfinite(norm) & groups["has_grad"].to_numpy(), "name"]
    peak = groups.assign(_n=np.where(np.isfinite(norm), norm, np.nan)).groupby("name", sort=False)["_n"].max()
    order = list(dict.fromkeys(list(bad) + list(peak.sort_values(ascending=False, na_position="last").index)))
    chosen = set(order[:MAX_LINES])
    return [g for g in dict.fromkeys(groups["name"]) if g in chosen]


def _param_figures(stats: "pandas.DataFrame", codes: Any, P: int) -> Dict[str, Any]:
    """Per parameter: bad (any NaN/Inf), peak and mean of the finite norms, largest update ratio."""
    import numpy as np

    ok = codes >= 0
    c = codes[ok]
    has = stats["has_grad"].to_numpy(dtype=bool)[ok] if "has_grad" in stats.columns else np.ones(len(c), bool)
    norm = stats["norm"].to_numpy(dtype=float)[ok]
    fin = has & np.isfinite(norm)
    bad = has & ~np.isfinite(norm)
    if "nonfinite" in stats.columns:
        bad |= stats["nonfinite"].to_numpy(dtype=float)[ok] > 0

    def largest(values: Any) -> Any:
        return _group_max(c, values, P)

    n_fin = np.bincount(c, weights=fin.astype(float), minlength=P)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.bincount(c, weights=np.where(fin, norm, 0.0), minlength=P) / n_fin
    upd = np.full(P, np.nan)
    if "update_ratio" in stats.columns:
        u = stats["update_ratio"].to_numpy(dtype=float)[ok]
        upd = largest(np.where(np.isfinite(u), u, np.nan))
    return {"bad": np.bincount(c, weights=bad.astype(float), minlength=P) > 0,
            "peak": largest(np.where(fin, norm, np.nan)), "mean": mean, "update": upd}


def _notable(figures: Dict[str, Any], k: int) -> List[int]:
    """Up to ``k`` parameters, most notable first: every one with NaN/Inf, then by turns
    the largest peak norm and the smallest mean norm."""
    import numpy as np

    chosen = [int(i) for i in np.flatnonzero(figures["bad"])][:k]
    seen = set(chosen)
    peak, mean = figures["peak"], figures["mean"]
    big = np.argsort(-np.where(np.isfinite(peak), peak, -np.inf), kind="stable")
    small = np.argsort(np.where(np.isfinite(mean), mean, np.inf), kind="stable")
    for a, b in zip(big, small):
        for i in (int(a), int(b)):
            if len(chosen) < k and i not in seen and (np.isfinite(peak[i]) or np.isfinite(mean[i])):
                seen.add(i)
                chosen.append(i)
        if len(chosen) >= k:
            break
    return chosen
