"""Matplotlib figures of a recorded run: pure functions of the DataFrames from `graddbg.stats`.

Every function takes DataFrames (never a ``Watch``) and returns a new
`matplotlib.figure.Figure` made without pyplot, so nothing is left in pyplot's
global state: the figures work headless (Agg) and display inline in Jupyter.

Non-finite values are never dropped silently and never crash a plot: NaN/Inf
gradients are drawn as red markers on the edge of the axes (and counted in the legend),
all-zero gradients as markers at the bottom, parameters without a gradient in grey. A
value that was not measured (NaN ``absmax`` between two reads) is not a NaN gradient.
``name`` and ``module`` may be plain strings or Categoricals (as ``w.stats`` keeps them);
figures follow the rows' order, never the categories'.

- `flow`: per parameter in forward order, rms and max ``|grad|`` at one step.
- `norms`: gradient norms over steps (lines, or a parameter x step heatmap).
- `update_ratio`: ``||dw|| / ||w||`` over steps with a guide line at 1e-3.
- `hist`: histograms of ``|grad|`` per parameter at chosen steps.
- `loss`: the loss handed to ``backward()`` over steps, with the learning rate below it.
- `plot`: dispatches on ``kind`` ("flow", "norms", "heatmap", "update", "hist", "loss").

matplotlib, numpy and pandas are imported inside the functions.
"""
from __future__ import annotations

import math
import numbers
from typing import (TYPE_CHECKING, Any, Dict, Iterable, List, NamedTuple, Optional, Sequence,
                    Tuple)

from graddbg._errors import GraddbgTypeError, GraddbgValueError

if TYPE_CHECKING:  # pragma: no cover - type names only, nothing imported at run time
    import numpy
    import pandas
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["flow", "norms", "update_ratio", "hist", "loss", "plot", "KINDS"]

KINDS = ("flow", "norms", "heatmap", "update", "hist", "loss")

# colours and markers shared by every plot (and by the report's legend)
NONFINITE_COLOR = "#d62728"
ZERO_COLOR = "#222222"
NOGRAD_COLOR = "#9e9e9e"
ANOMALY_COLORS = {
    "nonfinite": "#d62728",
    "explode": "#ff7f0e",
    "vanish": "#1f77b4",
    "overflow": "#7f7f7f",
    "ddp_mismatch": "#9467bd",
}
_STATS_COLUMNS = ("step", "name", "norm")
_MAX_LINES = 10
_MAX_TICKLABELS = 60
_LABEL_CHARS = 40  # longer parameter names are shortened on the axes (`_short_labels`)
_STEP_COLORS = ("#08519c", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2")


# --------------------------------------------------------------------------- helpers

def _frame(obj: Any, arg: str, columns: Sequence[str]) -> "pandas.DataFrame":
    """``obj`` checked to be a DataFrame with ``columns``, its categorical ``name`` and
    ``module`` columns (as ``w.stats`` keeps them) turned into plain strings: grouping,
    pivoting and reindexing by name then see only the names present, never an unused
    category."""
    import pandas as pd

    if not isinstance(obj, pd.DataFrame):
        raise GraddbgTypeError(f"{arg} must be a pandas DataFrame with columns {list(columns)}; "
                        f"got {type(obj).__name__}")
    missing = [c for c in columns if c not in obj.columns]
    if missing:
        raise GraddbgValueError(f"{arg} lacks the columns {missing}; it has {list(obj.columns)} "
                         f"(expected the frames recorded by graddbg.watch)")
    plain = {c: obj[c].astype(object) for c in ("name", "module")
             if c in obj.columns and isinstance(obj[c].dtype, pd.CategoricalDtype)}
    return obj.assign(**plain) if plain else obj


def _new_figure(width: float, height: float) -> "Figure":
    return _lazy_class("GraddbgFigure")(figsize=(width, height), layout="constrained")


def _lazy_class(name: str) -> type:
    return globals().get(name) or __getattr__(name)


def _make_figure_class() -> type:
    from matplotlib.figure import Figure

    class GraddbgFigure(Figure):
        """A matplotlib Figure made without pyplot that still shows itself in Jupyter.

        Notebooks display figures through a formatter that matplotlib's inline backend
        registers when pyplot is imported; without pyplot a bare Figure shows as text.
        ``_repr_png_`` (used only when no such formatter is registered) renders with Agg.
        """

        def _repr_png_(self) -> bytes:
            import io

            buf = io.BytesIO()
            self.savefig(buf, format="png")
            return buf.getvalue()

    return GraddbgFigure


def _make_locator_class() -> type:
    from matplotlib.ticker import LogLocator

    class DecadeLocator(LogLocator):
        """Powers of ten; 1-2-5 steps as well when the axis spans under three decades."""

        def tick_values(self, vmin: float, vmax: float) -> Any:
            import numpy as np

            lo, hi = float(min(vmin, vmax)), float(max(vmin, vmax))
            narrow = lo > 0 and math.isfinite(hi) and math.log10(hi) - math.log10(lo) < 3
            self.set_params(subs=(1.0, 2.0, 5.0) if narrow else (1.0,))
            with np.errstate(over="ignore"):  # a decade past 1e308 (values near the top)
                return super().tick_values(vmin, vmax)

    return DecadeLocator


_LAZY_CLASSES = {"GraddbgFigure": _make_figure_class, "DecadeLocator": _make_locator_class}


def __getattr__(name: str) -> Any:
    # These classes subclass matplotlib's, so they are made on first use (importing
    # graddbg.plots must not import matplotlib); as module attributes they stay picklable.
    if name in _LAZY_CLASSES:
        cls = _LAZY_CLASSES[name]()
        cls.__module__ = __name__
        cls.__qualname__ = name
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _order(names: Iterable[str]) -> List[str]:
    """Unique names in order of first appearance (forward / named_parameters order)."""
    return list(dict.fromkeys(names))


def _select_names(stats: "pandas.DataFrame", names: Optional[Sequence[str]]) -> List[str]:
    known = _order(stats["name"])
    if names is None:
        return known
    if isinstance(names, str):
        names = [names]
    unknown = [n for n in names if n not in set(known)]
    if unknown:
        shown = known[:10] + (["..."] if len(known) > 10 else [])
        raise GraddbgValueError(f"names: unknown parameters {unknown}; recorded parameters are {shown}")
    return list(names)


def _has_grad(frame: "pandas.DataFrame") -> "numpy.ndarray":
    import numpy as np

    if "has_grad" in frame.columns:
        return frame["has_grad"].to_numpy(dtype=bool)
    return np.ones(len(frame), dtype=bool)


def _edge_markers(ax: "Axes", xs: Sequence[float], where: str, *, color: str, marker: str,
                  label: str, gid: str) -> None:
    """Markers at the top (``where="top"``) or bottom of the axes, at data x positions:
    values that a log axis cannot show (NaN, Inf, 0) stay visible."""
    if len(xs) == 0:
        return
    y = 0.97 if where == "top" else 0.03
    line, = ax.plot(list(xs), [y] * len(xs), linestyle="none", marker=marker, color=color,
                    markersize=7, transform=ax.get_xaxis_transform(), clip_on=False,
                    label=label, zorder=5)
    line.set_gid(gid)


def _anomaly_table(anomalies: Any) -> List[Tuple[int, str]]:
    """(step, kind) pairs from a list of Anomaly records, dicts, or a DataFrame."""
    if anomalies is None:
        return []
    try:
        import pandas as pd

        if isinstance(anomalies, pd.DataFrame):
            if len(anomalies) == 0:
                return []
            _frame(anomalies, "anomalies", ("step", "kind"))
            return [(int(s), str(k)) for s, k in zip(anomalies["step"], anomalies["kind"])]
    except ImportError:  # pragma: no cover - pandas is a dependency
        pass
    out = []
    for a in anomalies:
        if isinstance(a, dict):
            out.append((int(a["step"]), str(a["kind"])))
        else:
            out.append((int(a.step), str(a.kind)))
    return out


def _mark_anomalies(ax: "Axes", anomalies: Any, steps_frame: Optional["pandas.DataFrame"],
                    x_of: Any = None) -> None:
    """Vertical lines on the time axis: one LineCollection per anomaly kind, plus scaler
    overflow (skipped) steps from the steps frame. ``x_of`` maps steps to x positions."""
    rows = _anomaly_table(anomalies)
    by_kind: Dict[str, List[int]] = {}
    for step, kind in rows:
        by_kind.setdefault(kind, []).append(step)
    if steps_frame is not None and "overflow" in steps_frame.columns and len(steps_frame):
        over = steps_frame.loc[steps_frame["overflow"].astype(bool), "step"].tolist()
        if over:
            by_kind.setdefault("overflow", []).extend(int(s) for s in over)
    for kind, xs in by_kind.items():
        xs = sorted(set(xs))
        pos = [x_of(x) for x in xs] if x_of is not None else xs
        label = ("scaler overflow (skipped)" if kind == "overflow" else f"anomaly: {kind}")
        coll = ax.vlines(pos, 0, 1, transform=ax.get_xaxis_transform(),
                         colors=ANOMALY_COLORS.get(kind, "#8c564b"),
                         linestyles=":" if kind == "overflow" else "--", linewidth=1.0,
                         label=f"{label} ({len(xs)})", zorder=1)
        coll.set_gid(f"anomaly-{kind}")


def _downsample(x: "numpy.ndarray", y: "numpy.ndarray", max_points: int) -> Tuple[Any, Any]:
    """At most ``2 * max_points`` points keeping each bucket's min and max (spikes survive)."""
    import numpy as np

    n = len(x)
    if max_points is None or n <= max_points:
        return x, y
    finite = np.isfinite(y)
    hi = np.where(finite, y, -np.inf)
    lo = np.where(finite, y, np.inf)
    keep = set()
    for idx in np.array_split(np.arange(n), max_points):
        if len(idx) == 0:
            continue
        keep.add(int(idx[np.argmax(hi[idx])]))
        keep.add(int(idx[np.argmin(lo[idx])]))
    sel = np.array(sorted(keep))
    return x[sel], y[sel]


def _log_line(ax: "Axes", x: Any, y: Any, *, label: str, max_points: int,
              connect: bool = False, **kw: Any) -> Any:
    """A line of the positive finite values of y. Others leave gaps (marked elsewhere),
    or with ``connect=True`` are left out so the measured points join up (for sparse
    series such as update ratios, measured every few steps)."""
    import numpy as np

    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    ok = np.isfinite(y) & (y > 0)
    if connect:
        x, y, ok = x[ok], y[ok], ok[ok]
    shown = np.where(ok, y, np.nan)
    xs, ys = _downsample(x, shown, max_points)
    line, = ax.plot(xs, ys, label=label, **kw)
    return line


def _pow10(value: float, _pos: Any = None) -> str:
    """Tick label of a log axis as plain text ("1e-3"): mathtext labels cost most of the
    drawing time of these figures."""
    if not (value > 0 and math.isfinite(value)):
        return ""
    e = math.log10(value)
    if abs(e - round(e)) < 1e-9:
        e = int(round(e))
        return f"{10.0 ** e:g}" if -3 <= e <= 3 else f"1e{e}"
    return f"{value:.3g}".replace("e-0", "e-").replace("e+0", "e").replace("e+", "e")


def _log_axis(axis: Any) -> None:
    """Plain-text major labels, at most ten, and no minor ticks on a log axis
    (``ax.xaxis``/``ax.yaxis``): each tick is an artist to lay out, and gradient values
    span tens of decades."""
    from matplotlib.ticker import FuncFormatter, NullFormatter, NullLocator

    axis.set_major_locator(_lazy_class("DecadeLocator")(base=10.0, numticks=10))
    axis.set_major_formatter(FuncFormatter(_pow10))
    axis.set_minor_locator(NullLocator())
    axis.set_minor_formatter(NullFormatter())


def _set_log_limits(ax: "Axes", values: Any) -> None:
    """Log y axis; explicit limits when nothing positive and finite can set them."""
    import numpy as np

    ax.set_yscale("log")
    _log_axis(ax.yaxis)
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    if v.size == 0:
        ax.set_ylim(1e-12, 1.0)
    else:
        lo, hi = float(v.min()), float(v.max())
        ax.set_ylim(lo / 3.0, min(hi * 10.0, 1e308))


def _nonfinite_rows(frame: "pandas.DataFrame") -> "numpy.ndarray":
    """Rows whose norm is NaN/Inf although the parameter had a gradient, or whose
    gradient had non-finite entries."""
    import numpy as np

    has = _has_grad(frame)
    bad = has & ~np.isfinite(frame["norm"].to_numpy(dtype=float))
    if "nonfinite" in frame.columns:
        bad |= has & (frame["nonfinite"].to_numpy(dtype=float) > 0)
    return bad


def _legend(ax: "Axes", **kw: Any) -> None:
    """A legend when something on the axes has a label (matplotlib warns otherwise)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kw)


def _title(ax: "Axes", text: str) -> None:
    """The title of an axes whose y axis never shows an offset text (a log axis with plain
    labels, or named ticks) and whose x ticks are at the bottom: matplotlib would search
    for its place above them at every layout pass and draw (a tenth of a report's time)
    and find the top of the axes; it is put there once."""
    import matplotlib

    y = matplotlib.rcParams["axes.titley"]
    ax.set_title(text, y=1.0 if y is None else y)


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: ``counted(1, "step")`` is "1 step".

    Examples:
        >>> counted(1, "anomaly"), counted(3, "step"), counted(0, "anomaly")
        ('1 anomaly', '3 steps', '0 anomalies')
    """
    if n == 1:
        return f"{n} {noun}"
    return f"{n} {noun[:-1]}ies" if noun.endswith("y") and noun[-2:-1] not in "aeiou" else f"{n} {noun}s"


def _short_labels(names: Sequence[str], most: int = _LABEL_CHARS) -> Tuple[List[str], str]:
    """Axis labels for parameter names, and a note of what they leave out ("" for none).

    Names longer than ``most`` characters (a PEFT model's
    ``base_model.model.layers.0.q_proj.lora_A.default.weight``) keep their distinguishing
    part: the dotted prefix that all of them share and a trailing ``.weight`` are dropped,
    then, while a label is still too long, its longest part other than its last and its
    numbers (layer indices) becomes "…". Short names are kept whole.

    Examples:
        >>> _short_labels(["base_model.model.layers.0.q_proj.lora_A.default.weight",
        ...                "base_model.model.layers.1.q_proj.lora_B.default.weight"])
        (['0.q_proj.lora_A.default', '1.q_proj.lora_B.default'], "names without 'base_model.model.layers.' and '.weight'")
    """
    labels = [str(n) for n in names]
    if not labels or max(map(len, labels)) <= most:
        return labels, ""
    parts = [n.split(".") for n in labels]
    head = 0
    if len(parts) > 1:  # (never the whole of a name: its last part stays)
        while all(len(p) > head + 1 for p in parts) and len({p[head] for p in parts}) == 1:
            head += 1
    cut = [p[head:] for p in parts]
    weight = any(len(p) > 1 and p[-1] == "weight" for p in cut)
    cut = [p[:-1] if len(p) > 1 and p[-1] == "weight" else p for p in cut]
    short = [_elide(p, most) for p in cut]
    prefix = _elide(parts[0][:head], most) + "."
    dropped = ([f"'{prefix}'"] if head else []) + (["'.weight'"] if weight else [])
    return short, "names without " + " and ".join(dropped) if dropped else "long names shortened (…)"


def _elide(parts: Sequence[str], most: int) -> str:
    """Dotted ``parts`` in at most ``most`` characters: the longest part other than the last
    and the numbers made "…" until it fits, then the middle characters if it must."""
    parts = list(parts)
    while len(".".join(parts)) > most:
        candidates = [i for i, p in enumerate(parts[:-1]) if p != "…" and not p.isdigit()]
        if not candidates:
            break
        parts[max(candidates, key=lambda i: len(parts[i]))] = "…"
        parts = [p for j, p in enumerate(parts) if not (p == "…" and j and parts[j - 1] == "…")]
    text = ".".join(parts)
    keep = most // 3
    return text if len(text) <= most else text[:keep] + "…" + text[len(text) - (most - keep - 1):]


def _title_count(shown: int, total: int, what: str) -> str:
    return "" if shown == total else f" ({shown} of {total} {what})"


# --------------------------------------------------------------------------- flow

class _FlowRows(NamedTuple):
    """One recorded step, one entry per parameter shown (forward order)."""

    labels: List[str]
    has: "numpy.ndarray"       # the parameter had a gradient
    rms: "numpy.ndarray"       # norm / sqrt(numel)
    absmax: "numpy.ndarray"    # max |grad| at the step (NaN where it was not measured)
    note: str                  # what the plot does not show ("max |grad| not measured at step 8 ...")
    bad: "numpy.ndarray"       # non-finite entries
    counts: "numpy.ndarray"    # how many (0 where the frame does not say)
    zero: "numpy.ndarray"      # an all-zero gradient


def flow(stats: "pandas.DataFrame", step: Optional[int] = None, *,
         names: Optional[Sequence[str]] = None) -> "Figure":
    """Gradient flow at one recorded step, per parameter in forward order.

    Draws the rms ``|grad|`` (norm / sqrt(numel)) and the max ``|grad|`` on a log scale.
    Parameters whose gradient holds NaN/Inf (``nonfinite > 0``; in frames without that
    column a non-finite norm or an infinite ``absmax``) get a red ``X`` at the top,
    all-zero gradients a black triangle at the bottom, parameters without a gradient a
    grey circle; their tick labels take the same colour. Everything drawn is of ``step``:
    the max ``|grad|`` is measured on some steps only (``absmax`` is NaN on the others; on
    the CPU every 10th recorded step), and where it was not measured at ``step`` no max
    bar is drawn and the title says so, naming the last step where it was ("max |grad|
    not measured at step 119 (last at step 110)"). The legend sits outside the axes, so
    it covers no marker.

    Args:
        stats: a statistics frame (`Watch.stats`, `Run.stats`): at least ``step``, ``name``,
            ``numel`` and ``norm``.
        step: the recorded step to draw; None: the last one.
        names: only these parameters, in this order.

    Returns:
        matplotlib.figure.Figure: the figure (not shown; call ``fig.savefig`` or display it).

    Raises:
        GraddbgValueError: a missing column, an empty frame, or a ``step`` that was not
            recorded.

    Examples:
        >>> import pandas as pd
        >>> stats = pd.DataFrame({"step": [1, 1], "name": ["fc.weight", "fc.bias"],
        ...     "module": ["fc", "fc"], "numel": [6, 2], "norm": [0.5, float("nan")],
        ...     "absmax": [0.4, float("nan")], "nonfinite": [0, 2], "has_grad": [True, True]})
        >>> fig = flow(stats)
        >>> [t.get_text() for t in fig.axes[0].get_xticklabels()]
        ['fc.weight', 'fc.bias']
    """
    stats = _frame(stats, "stats", ("step", "name", "numel", "norm", "absmax"))
    step = _flow_step(stats, step)
    rows = _flow_rows(stats, step, _select_names(stats, names))
    fig = _new_figure(min(max(6.0, 0.22 * len(rows.labels) + 2.0), 24.0), 4.2)
    ax = fig.add_subplot()
    _flow_bars(ax, rows)
    _flow_marks(ax, rows)
    _flow_axes(ax, rows, f"Gradient flow at step {step}"
               + _title_count(len(rows.labels), len(_order(stats["name"])), "parameters")
               + (f"\n{rows.note}" if rows.note else ""))
    return fig


def _flow_step(stats: "pandas.DataFrame", step: Optional[int]) -> int:
    """The step to draw: ``step`` when it was recorded, else the last recorded one."""
    import numpy as np

    if len(stats) == 0:
        raise GraddbgValueError("stats: the run recorded no statistics (no step was recorded)")
    recorded = np.unique(stats["step"].to_numpy(dtype=np.int64))
    if step is None:
        return int(recorded[-1])
    if int(step) not in recorded:
        raise GraddbgValueError(f"step: {step!r} was not recorded; recorded steps run from "
                         f"{recorded[0]} to {recorded[-1]} ({len(recorded)} steps)")
    return int(step)


def _flow_rows(stats: "pandas.DataFrame", step: int, chosen: Sequence[str]) -> _FlowRows:
    """The rows of ``step`` for the ``chosen`` parameters, in their order, as arrays."""
    import numpy as np

    at = stats[stats["step"] == step].drop_duplicates("name").set_index("name")
    at = at.reindex([n for n in chosen if n in at.index])
    has = _has_grad(at)
    norm = at["norm"].to_numpy(dtype=float)
    with np.errstate(invalid="ignore", over="ignore"):
        rms = norm / np.sqrt(np.maximum(at["numel"].to_numpy(dtype=float), 1.0))
    if "nonfinite" in at.columns:  # the count decides; an unmeasured (NaN) absmax never does
        counts = np.nan_to_num(at["nonfinite"].to_numpy(dtype=float)).astype(np.int64)
        bad = has & (counts > 0)
    else:
        counts = np.zeros(len(at), dtype=np.int64)
        bad = has & (~np.isfinite(norm) | np.isinf(at["absmax"].to_numpy(dtype=float)))
    absmax = at["absmax"].to_numpy(dtype=float)
    return _FlowRows(list(at.index), has, rms, absmax, _absmax_note(stats, absmax, step, has & ~bad),
                     bad, counts, has & ~bad & (norm == 0))


def _absmax_note(stats: "pandas.DataFrame", absmax: "numpy.ndarray", step: int,
                 wanted: "numpy.ndarray") -> str:
    """"" when ``step``'s max |grad| was measured for the parameters drawn; else what the
    plot leaves out and where it was last measured (never a value of another step)."""
    import numpy as np

    missing = wanted & np.isnan(absmax)
    if not missing.any():
        return ""
    earlier = stats.loc[(stats["step"] < step) & stats["absmax"].notna(), "step"]
    last = f" (last at step {int(earlier.max())})" if len(earlier) else ""
    some = "" if missing.all() or not wanted.any() else f" for {int(missing.sum())} of {int(wanted.sum())} parameters"
    return f"max |grad| not measured at step {step}{some}{last}"


def _flow_bars(ax: "Axes", r: _FlowRows) -> None:
    """Max and rms bars of the parameters with a finite, positive value; log y axis."""
    import numpy as np

    x = np.arange(len(r.labels))
    drawable = r.has & ~r.bad
    ok_max = drawable & np.isfinite(r.absmax) & (r.absmax > 0)
    ok_rms = drawable & np.isfinite(r.rms) & (r.rms > 0)
    ax.bar(x[ok_max], r.absmax[ok_max], width=0.8, color="#9ecae1",
           label="max |grad|" if ok_max.any() else "_max |grad|")  # (no legend entry for no bar)
    ax.bar(x[ok_rms], r.rms[ok_rms], width=0.5, color="#08519c",
           label="rms |grad| (norm/√numel)")
    _set_log_limits(ax, np.concatenate([r.absmax[ok_max], r.rms[ok_rms]]))


def _flow_marks(ax: "Axes", r: _FlowRows) -> None:
    """Edge markers for non-finite, all-zero and gradient-less parameters; the count of
    NaN/Inf entries written over each non-finite one (up to 30 of them)."""
    import numpy as np

    x = np.arange(len(r.labels))
    _edge_markers(ax, x[r.bad], "top", color=NONFINITE_COLOR, marker="X",
                  label=f"non-finite ({int(r.bad.sum())})", gid="nonfinite")
    _edge_markers(ax, x[r.zero], "bottom", color=ZERO_COLOR, marker="v",
                  label=f"all zero ({int(r.zero.sum())})", gid="zero")
    _edge_markers(ax, x[~r.has], "bottom", color=NOGRAD_COLOR, marker="o",
                  label=f"no gradient ({int((~r.has).sum())})", gid="nograd")
    if r.bad.sum() <= 30:
        for i in x[r.bad]:
            c = int(r.counts[i])
            ax.annotate(f"{c} NaN/Inf" if c else "NaN/Inf", (i, 0.93),
                        xycoords=ax.get_xaxis_transform(), ha="center", va="top",
                        fontsize=7, color=NONFINITE_COLOR, rotation=90)


def _flow_axes(ax: "Axes", r: _FlowRows, title: str) -> None:
    """Parameter names as tick labels (coloured like their markers), labels, legend."""
    import numpy as np

    n = len(r.labels)
    ax.set_xlim(-0.6, n - 0.4)
    shown = np.arange(n)[::max(1, math.ceil(n / _MAX_TICKLABELS))]
    ax.set_xticks(shown)
    labels, dropped = _short_labels([r.labels[i] for i in shown])
    ax.set_xticklabels(labels, rotation=90, fontsize=7)
    for tick, i in zip(ax.get_xticklabels(), shown):
        if r.bad[i]:
            tick.set_color(NONFINITE_COLOR)
        elif not r.has[i]:
            tick.set_color(NOGRAD_COLOR)
    ax.set_xlabel("parameter (forward order)" + (f"\n{dropped}" if dropped else ""), fontsize=8 if dropped else None)
    ax.set_ylabel("|grad|")
    _title(ax, title)
    ax.grid(True, axis="y", which="major", alpha=0.3)
    _legend(ax, loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0, fontsize=7)  # outside: no marker hidden


# --------------------------------------------------------------------------- norms

def _module_key(name: str, depth: int) -> str:
    """The module path of a parameter cut to ``depth`` parts ("blocks.3" for
    "blocks.3.attn.weight" at depth 2); a parameter of the root module keeps its name."""
    parts = name.split(".")[:-1]
    return ".".join(parts[:depth]) if parts else name


def _group_depth(names: Sequence[str]) -> int:
    """Depth 1 (top-level modules), or deeper while that gives a single group (a model
    that is one container such as ``blocks``)."""
    unique = _order(names)
    deepest = max((len(n.split(".")) - 1 for n in unique), default=1)
    depth = 1
    while depth < deepest and len(set(_module_key(n, depth) for n in unique)) == 1:
        depth += 1
    return depth


#: norms above this are drawn as Inf (the log axis needs room above the largest value)
_LARGEST_DRAWN = 1e300


def _series_groups(stats: "pandas.DataFrame", names: Optional[Sequence[str]]
                   ) -> Tuple[List[str], Any, str, int]:
    """(labels, frame indexed by step with one column per label, what, total) for the
    lines: the named parameters, or the modules at the depth of `_group_depth`
    (root of the sum of squares), the ten largest."""
    import numpy as np
    import pandas as pd

    frame = stats.copy()
    has = _has_grad(frame)
    if names is not None:
        chosen = _select_names(stats, names)
        frame = frame[frame["name"].isin(chosen)]
        wide = frame.pivot_table(index="step", columns="name", values="norm",
                                 aggfunc="first", dropna=False)
        return chosen, wide.reindex(columns=chosen), "parameters", len(_order(stats["name"]))
    depth = _group_depth(frame["name"])
    top = [_module_key(n, depth) for n in frame["name"]]
    from graddbg.stats import rollup_norms  # (the one roll-up rule of tables, plots and report)

    frame["_group"] = top
    keys = frame.groupby(["step", "_group"], sort=False)
    index = keys.size().index
    norms = rollup_norms(keys.ngroup().to_numpy(), frame["norm"].to_numpy(dtype=float), np.asarray(has, bool),
                         len(index))
    # (a finite norm at the edge of float64's range cannot take an axis margin on a log
    # scale: it is drawn like an Inf one, at the top with its marker)
    norms = np.where(norms > _LARGEST_DRAWN, np.inf, norms)
    wide = pd.Series(norms, index=index).unstack("_group")
    groups = _order(top)
    total = len(groups)
    wide = wide.reindex(columns=groups).sort_index()
    if len(groups) > _MAX_LINES:  # keep the largest
        peak = wide.where(np.isfinite(wide)).max(axis=0).fillna(-np.inf)
        keep = set(peak.sort_values(ascending=False).index[:_MAX_LINES])
        groups = [g for g in groups if g in keep]
        wide = wide[groups]
    return groups, wide, ("top-level modules" if depth == 1 else f"modules (depth {depth})"), total


def _global_series(stats: "pandas.DataFrame", steps: Optional["pandas.DataFrame"]) -> Any:
    """Global norm per step: from the steps frame when given, else computed from stats."""
    import numpy as np
    import pandas as pd

    if steps is not None and len(steps) and "global_norm" in steps.columns:
        s = steps.set_index("step")["global_norm"].astype(float)
        return s[~s.index.duplicated()].sort_index()
    s = pd.Series(_squares(stats), index=stats["step"].to_numpy()).groupby(level=0).sum()
    return np.sqrt(s).sort_index()


def _squares(frame: "pandas.DataFrame") -> "numpy.ndarray":
    """Squared norms for root-of-sum-of-squares roll-ups: 0 without a gradient, +Inf for
    a non-finite norm (pandas sums skip NaN; Inf propagates, so the sum stays non-finite)."""
    import numpy as np

    with np.errstate(over="ignore"):
        sq = frame["norm"].to_numpy(dtype=float) ** 2
    sq = np.where(np.isnan(sq), np.inf, sq)
    return np.where(_has_grad(frame), sq, 0.0)


def norms(stats: "pandas.DataFrame", steps: Optional["pandas.DataFrame"] = None,
          anomalies: Any = None, names: Optional[Sequence[str]] = None,
          heatmap: bool = False, *, max_points: int = 1000) -> "Figure":
    """Gradient norms over steps.

    Lines (default): the global norm (``steps.global_norm`` when the steps frame is
    given, else the root of the sum of squares of ``stats.norm``) and one line per
    parameter in ``names``, or per top-level module (root of the sum of squares, the
    ten largest; one level deeper while the model is a single container) when ``names``
    is None. Non-finite norms are red markers at the top (red cells in the heatmap),
    anomalies and scaler overflow steps vertical lines. Series longer than ``max_points``
    are reduced to each bucket's min and max, so spikes survive; the markers use every
    step.

    Args:
        stats: a statistics frame (`Watch.stats`, `Run.stats`).
        steps: the per-step frame (`Watch.steps`), for the global norm and the overflows.
        anomalies: a list of `Anomaly` or an anomalies DataFrame, drawn as vertical lines.
        names: one line per parameter named here, instead of one per module.
        heatmap: draw parameter x step on a log colour scale instead of lines.
        max_points: the most points drawn per line.

    Returns:
        matplotlib.figure.Figure: the figure (an empty frame gives an empty plot).

    Raises:
        GraddbgValueError: a missing column, or ``max_points`` below 2.

    Examples:
        >>> import pandas as pd
        >>> stats = pd.DataFrame({"step": [1, 2, 3], "name": ["w"] * 3, "module": [""] * 3,
        ...     "numel": [4] * 3, "norm": [1.0, float("inf"), 0.5], "absmax": [1.0] * 3,
        ...     "nonfinite": [0, 1, 0]})
        >>> fig = norms(stats)
        >>> fig.axes[0].get_yscale(), fig.axes[0].get_xlabel()
        ('log', 'step')
    """
    import numpy as np

    stats = _frame(stats, "stats", _STATS_COLUMNS)
    if steps is not None:
        steps = _frame(steps, "steps", ("step",))
    if max_points is not None and int(max_points) < 2:
        raise GraddbgValueError(f"max_points must be at least 2 (or None for all points); got {max_points!r}")
    if heatmap:
        return _norm_heatmap(stats, steps, anomalies, names, max_points)

    fig = _new_figure(9.0, 4.5)
    ax = fig.add_subplot()
    all_values = []
    g = _global_series(stats, steps)
    gl = _log_line(ax, g.index, g.to_numpy(), label="global norm", max_points=max_points,
                   color="black", linewidth=1.6, zorder=4)
    gl.set_gid("global")
    all_values.append(g.to_numpy(dtype=float))
    bad_steps = set(int(s) for s in g.index[~np.isfinite(g.to_numpy(dtype=float))])
    zero_steps: set = set(int(s) for s in g.index[g.to_numpy(dtype=float) == 0])

    labels, wide, what, n_total = _series_groups(stats, names)
    # non-finite per step from the raw rows (a NaN norm, or non-finite entries)
    bad_rows = _nonfinite_rows(stats)
    bad_steps |= set(int(s) for s in stats.loc[bad_rows, "step"])
    for label in labels:
        col = wide[label]
        line = _log_line(ax, col.index, col.to_numpy(), label=label or "(root)",
                         max_points=max_points, linewidth=1.0, alpha=0.85)
        line.set_gid(f"series:{label}")
        all_values.append(col.to_numpy(dtype=float))
    _set_log_limits(ax, np.concatenate(all_values) if all_values else [])
    _edge_markers(ax, sorted(bad_steps), "top", color=NONFINITE_COLOR, marker="X",
                  label=f"non-finite ({counted(len(bad_steps), 'step')})", gid="nonfinite")
    _edge_markers(ax, sorted(zero_steps), "bottom", color=ZERO_COLOR, marker="v",
                  label=f"zero global norm ({counted(len(zero_steps), 'step')})", gid="zero")
    _mark_anomalies(ax, anomalies, steps)
    ax.set_xlabel("step")
    ax.set_ylabel("gradient L2 norm")
    _title(ax, "Gradient norms: global and "
              + (what if what == "parameters" else f"per {what.replace('modules', 'module')}")
              + _title_count(len(labels), n_total, what.split(" (")[0]))
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, borderaxespad=0)
    return fig


def _norm_heatmap(stats: "pandas.DataFrame", steps: Optional["pandas.DataFrame"],
                  anomalies: Any, names: Optional[Sequence[str]],
                  max_points: Optional[int]) -> "Figure":
    """`norms` with ``heatmap=True``: parameter x step cells, long runs in buckets."""
    chosen = _select_names(stats, names)
    step_values, value, cat = _heatmap_cells(stats, chosen)
    value, cat, starts, ends = _bucket_steps(step_values, value, cat, max_points)
    fig = _new_figure(10.0, min(max(3.0, 0.16 * len(chosen) + 1.5), 16.0))
    ax = fig.add_subplot()
    mesh = _draw_cells(ax, _column_edges(starts, ends), value, cat)
    cbar = fig.colorbar(mesh, ax=ax, pad=0.01)
    cbar.set_label("gradient L2 norm (log scale)")
    _log_axis(cbar.ax.yaxis)
    _heatmap_axes(ax, chosen, cat, anomalies, steps)
    S, columns = len(step_values), value.shape[1]
    _title(ax, "Gradient norm per parameter and step"
              + _title_count(len(chosen), len(_order(stats["name"])), "parameters")
              + ("" if columns == S else f" (max over {S} steps in {columns} columns)"))
    return fig


def _heatmap_cells(stats: "pandas.DataFrame", chosen: Sequence[str]
                   ) -> Tuple["numpy.ndarray", "numpy.ndarray", "numpy.ndarray"]:
    """(recorded steps, norm per parameter x step, category per cell: 0 finite and
    positive, 1 non-finite, 2 zero, 3 no gradient or not recorded)."""
    import numpy as np

    frame = stats[stats["name"].isin(chosen)]
    step_values = np.unique(frame["step"].to_numpy(dtype=np.int64))
    value = np.full((len(chosen), len(step_values)), np.nan)
    cat = np.full(value.shape, 3, dtype=np.int8)
    rows = frame["name"].map({n: i for i, n in enumerate(chosen)}).to_numpy(dtype=np.int64)
    cols = np.searchsorted(step_values, frame["step"].to_numpy(dtype=np.int64))
    v = frame["norm"].to_numpy(dtype=float)
    c = np.where(~_has_grad(frame), 3, np.where(_nonfinite_rows(frame), 1,
                                                 np.where(v == 0, 2, 0))).astype(np.int8)
    value[rows, cols] = np.where(c == 0, v, np.nan)
    cat[rows, cols] = c
    return step_values, value, cat


def _bucket_steps(step_values: "numpy.ndarray", value: "numpy.ndarray", cat: "numpy.ndarray",
                  max_cols: Optional[int]) -> Tuple[Any, Any, Any, Any]:
    """At most ``max_cols`` columns, each the max over a bucket of steps (a non-finite
    cell wins over any value); returns (value, cat, first step, last step of each)."""
    import numpy as np

    S = len(step_values)
    if max_cols is None or S <= max_cols:
        x = step_values.astype(float)
        return value, cat, x, x
    buckets = [b for b in np.array_split(np.arange(S), max_cols) if len(b)]
    vb = np.full((value.shape[0], len(buckets)), np.nan)
    cb = np.full(vb.shape, 3, dtype=np.int8)
    for j, b in enumerate(buckets):
        block, cblock = value[:, b], cat[:, b]
        any_ok = np.isfinite(block).any(axis=1)
        vb[any_ok, j] = np.nanmax(block[any_ok], axis=1)
        cb[:, j] = np.where((cblock == 1).any(axis=1), 1,
                            np.where(any_ok, 0, np.where((cblock == 2).any(axis=1), 2, 3)))
    starts = step_values[[b[0] for b in buckets]].astype(float)
    ends = step_values[[b[-1] for b in buckets]].astype(float)
    return vb, cb, starts, ends


def _column_edges(starts: "numpy.ndarray", ends: "numpy.ndarray") -> "numpy.ndarray":
    """x edges between columns, half way between one column's last step and the next
    one's first (steps need not be evenly spaced)."""
    import numpy as np

    if len(starts) == 0:
        return np.array([0.0, 1.0])
    if len(starts) == 1:
        return np.array([starts[0] - 0.5, ends[0] + 0.5])
    mids = (ends[:-1] + starts[1:]) / 2.0
    return np.concatenate([[starts[0] - (mids[0] - ends[0])], mids,
                           [ends[-1] + (starts[-1] - mids[-1])]])


def _draw_cells(ax: "Axes", edges: "numpy.ndarray", value: "numpy.ndarray",
                cat: "numpy.ndarray") -> Any:
    """The norms on a log colour scale, and over them the non-finite, zero and
    gradient-less cells in their colours; returns the norms' mesh (for the colour bar)."""
    import numpy as np
    from matplotlib.colors import ListedColormap, LogNorm

    y_edges = np.arange(value.shape[0] + 1) - 0.5
    finite = value[np.isfinite(value)]
    vmin = float(finite.min()) if finite.size else 1e-12
    vmax = float(finite.max()) if finite.size else 1.0
    if vmax <= vmin:
        vmin, vmax = vmin / 10.0, vmax * 10.0
    mesh = ax.pcolormesh(edges, y_edges, np.ma.masked_invalid(value),
                         norm=LogNorm(vmin=vmin, vmax=vmax), cmap="viridis",
                         rasterized=True, shading="flat")
    mesh.set_gid("heatmap")
    special = ax.pcolormesh(edges, y_edges, np.ma.masked_where(cat == 0, cat),
                            cmap=ListedColormap([NONFINITE_COLOR, ZERO_COLOR, "#e6e6e6"]),
                            vmin=0.5, vmax=3.5, rasterized=True, shading="flat")
    special.set_gid("heatmap-special")
    return mesh


def _heatmap_axes(ax: "Axes", chosen: Sequence[str], cat: "numpy.ndarray", anomalies: Any,
                  steps: Optional["pandas.DataFrame"]) -> None:
    """Parameter names down the side (first at the top), anomaly lines, the legend."""
    import numpy as np
    from matplotlib.patches import Patch

    P = len(chosen)
    ax.set_ylim(P - 0.5, -0.5)
    stride = max(1, math.ceil(P / _MAX_TICKLABELS))
    ax.set_yticks(np.arange(P)[::stride])
    ax.set_yticklabels(list(chosen)[::stride], fontsize=6)
    handles = [Patch(color=NONFINITE_COLOR, label=f"non-finite ({int((cat == 1).sum())} cells)"),
               Patch(color=ZERO_COLOR, label=f"all zero ({int((cat == 2).sum())} cells)"),
               Patch(color="#e6e6e6", label=f"no gradient ({int((cat == 3).sum())} cells)")]
    _mark_anomalies(ax, anomalies, steps)
    # below everything, in the figure's own margin (constrained layout makes room for it):
    # under the axes it would cover the x label, whose distance depends on the figure's height
    ax.figure.legend(handles=handles + ax.get_legend_handles_labels()[0], fontsize=7,
                     loc="outside lower left", ncol=3)
    ax.set_xlabel("step")
    ax.set_ylabel("parameter (forward order)")


# --------------------------------------------------------------------------- update ratio

def update_ratio(stats: "pandas.DataFrame", guide: Optional[float] = 1e-3, *,
                 names: Optional[Sequence[str]] = None, anomalies: Any = None,
                 max_points: int = 1000) -> "Figure":
    """Update/weight ratio ``||dw|| / ||w||`` over steps, on a log scale.

    One line per parameter when ``names`` is given or there are at most ten; otherwise
    the median over parameters, a 10-90 % band and the maximum. Non-finite ratios are red
    markers at the top. Without an optimizer the ratios are unknown (NaN) and the figure
    says so.

    Args:
        stats: a statistics frame with an ``update_ratio`` column.
        guide: draw a dashed guide line at this ratio (1e-3, the usual healthy order of
            magnitude); None for none.
        names: one line per parameter named here.
        anomalies: a list of `Anomaly` or an anomalies DataFrame, drawn as vertical lines.
        max_points: the most points drawn per line.

    Returns:
        matplotlib.figure.Figure: the figure; without ratios (no ``update_ratio`` column,
            no optimizer, an empty frame) it says that they are unknown.

    Examples:
        >>> import pandas as pd
        >>> stats = pd.DataFrame({"step": [1, 2], "name": ["w", "w"], "norm": [1.0, 1.0],
        ...                       "update_ratio": [1e-3, 2e-3]})
        >>> fig = update_ratio(stats)
        >>> [l.get_label() for l in fig.axes[0].get_lines() if l.get_gid() == "guide"] == ["guide 0.001"]
        True
    """
    import numpy as np

    stats = _frame(stats, "stats", ("step", "name"))
    if guide is not None and not (isinstance(guide, (int, float)) and math.isfinite(guide)
                                  and guide > 0):
        raise GraddbgValueError(f"guide must be a positive finite number or None; got {guide!r}")
    ratios = (stats["update_ratio"].to_numpy(dtype=float) if "update_ratio" in stats.columns
              else np.full(len(stats), np.nan))
    fig = _new_figure(9.0, 4.5)
    ax = fig.add_subplot()
    ax.set_xlabel("step")
    ax.set_ylabel("||Δw|| / ||w||")
    _title(ax, "Update / weight ratio")
    if guide is not None:
        ax.axhline(guide, color="black", linestyle="--", linewidth=1.0,
                   label=f"guide {guide:g}").set_gid("guide")
    if np.isnan(ratios).all():
        _no_ratios(ax, stats)
        return fig
    frame = stats.assign(update_ratio=ratios)
    chosen = _select_names(stats, names)
    if names is not None or len(chosen) <= _MAX_LINES:
        _ratio_lines(ax, frame, chosen, max_points)
    else:
        _ratio_band(ax, frame, len(chosen), max_points)
    _set_log_limits(ax, np.concatenate([ratios[np.isfinite(ratios)],
                                        [] if guide is None else [guide]]))
    _ratio_marks(ax, frame, chosen)
    _mark_anomalies(ax, anomalies, None)
    ax.grid(True, which="major", alpha=0.3)
    _legend(ax, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, borderaxespad=0)
    return fig


def _no_ratios(ax: "Axes", stats: "pandas.DataFrame") -> None:
    """An empty log axis over the recorded steps that says why it is empty."""
    ax.set_yscale("log")
    _log_axis(ax.yaxis)
    ax.set_ylim(1e-6, 1.0)
    ax.text(0.5, 0.5, "no update ratios recorded\n(watch() needs the optimizer)",
            transform=ax.transAxes, ha="center", va="center", color="#555555")
    if len(stats):
        steps_seen = stats["step"].to_numpy(dtype=float)
        ax.set_xlim(steps_seen.min() - 0.5, steps_seen.max() + 0.5)
    _legend(ax, loc="upper right", fontsize=7)


def _ratio_lines(ax: "Axes", frame: "pandas.DataFrame", chosen: Sequence[str],
                 max_points: int) -> None:
    """One line per parameter, joining the steps where its ratio was measured."""
    wide = frame[frame["name"].isin(chosen)].pivot_table(
        index="step", columns="name", values="update_ratio", aggfunc="first",
        dropna=False).reindex(columns=chosen).sort_index()
    for name in chosen:
        line = _log_line(ax, wide.index, wide[name].to_numpy(), label=name,
                         max_points=max_points, connect=True, linewidth=1.0,
                         marker="o", markersize=2)
        line.set_gid(f"series:{name}")


def _ratio_band(ax: "Axes", frame: "pandas.DataFrame", n: int, max_points: int) -> None:
    """The median over ``n`` parameters, their 10-90 % band and their maximum per step."""
    import numpy as np

    wide = frame.pivot_table(index="step", columns="name", values="update_ratio",
                             aggfunc="first", dropna=False).sort_index()
    vals = wide.to_numpy(dtype=float)
    vals = np.where(np.isfinite(vals) & (vals > 0), vals, np.nan)
    ok = np.isfinite(vals).any(axis=1)
    x, v = wide.index.to_numpy(dtype=float)[ok], vals[ok]
    q10, med, q90 = np.nanpercentile(v, [10, 50, 90], axis=1) if len(v) else ([], [], [])
    mx = np.nanmax(v, axis=1) if len(v) else []
    xd, q10d = _downsample(x, np.asarray(q10), max_points)
    _, q90d = _downsample(x, np.asarray(q90), max_points)
    if len(xd) == len(q90d):
        ax.fill_between(xd, q10d, q90d, color="#9ecae1", alpha=0.6,
                        label=f"10–90 % of {n} parameters").set_gid("band")
    _log_line(ax, x, med, label="median", max_points=max_points, connect=True,
              color="#08519c", marker="o", markersize=2).set_gid("median")
    _log_line(ax, x, mx, label="max", max_points=max_points, connect=True,
              color="#08519c", linestyle=":").set_gid("max")


def _ratio_marks(ax: "Axes", frame: "pandas.DataFrame", chosen: Sequence[str]) -> None:
    """Red markers at the top of steps with an infinite ratio, or an unknown one where
    the gradient had NaN/Inf entries; black ones at the bottom of steps where a ratio
    is zero (the optimizer left the weights alone: a skipped step)."""
    import numpy as np

    ratios = frame["update_ratio"].to_numpy(dtype=float)
    step = frame["step"].to_numpy()
    bad = np.isinf(ratios)
    if "nonfinite" in frame.columns:
        bad |= np.isnan(ratios) & (frame["nonfinite"].to_numpy(dtype=float) > 0)
    still = (ratios == 0) & _has_grad(frame) & frame["name"].isin(chosen).to_numpy()
    bad_steps, still_steps = np.unique(step[bad]).tolist(), np.unique(step[still]).tolist()
    _edge_markers(ax, bad_steps, "top", color=NONFINITE_COLOR, marker="X",
                  label=f"non-finite ({counted(len(bad_steps), 'step')})", gid="nonfinite")
    _edge_markers(ax, still_steps, "bottom", color=ZERO_COLOR, marker="v",
                  label=f"no update ({counted(len(still_steps), 'step')})", gid="zero")


# --------------------------------------------------------------------------- loss and lr

def loss(steps: "pandas.DataFrame", anomalies: Any = None, *, max_points: int = 1000) -> "Figure":
    """The loss over steps, with the learning rate below it on the same step axis.

    The loss of a step is what ``w.steps`` records: the sum of the values handed to
    ``backward()`` since the previous step (the mean of the micro-batches' losses under
    ``loss / k`` gradient accumulation). Steps without one (not recorded, or unknown: NaN)
    leave gaps; an infinite loss is a red marker at the top. The learning rate is the first
    param group's, NaN (not drawn) without an optimizer.

    Args:
        steps: the per-step frame (``w.steps``): ``step`` and ``loss``, and ``lr`` when known.
        anomalies: a list of `Anomaly` or an anomalies DataFrame, drawn as vertical lines.
        max_points: the most points drawn per line.

    Returns:
        matplotlib.figure.Figure: two axes, the loss (``axes[0]``) and the learning rate
            (``axes[1]``); an axis without data says so.

    Examples:
        >>> import pandas as pd
        >>> steps = pd.DataFrame({"step": [0, 1, 2], "loss": [2.0, 1.5, 1.2], "lr": [0.1, 0.1, 0.05]})
        >>> fig = loss(steps)
        >>> [ax.get_title() for ax in fig.axes], fig.axes[0].get_lines()[0].get_ydata().tolist()
        (['Loss', 'Learning rate'], [2.0, 1.5, 1.2])
    """
    import numpy as np

    steps = _frame(steps, "steps", ("step",)).sort_values("step")
    x = steps["step"].to_numpy(dtype=float)
    fig = _new_figure(9.0, 5.0)
    ax_loss, ax_lr = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    for ax, col, title in ((ax_loss, "loss", "Loss"), (ax_lr, "lr", "Learning rate")):
        ax.set_title(title)
        ax.set_ylabel(col)
        y = steps[col].to_numpy(dtype=float) if col in steps.columns else np.full(len(x), np.nan)
        if not np.isfinite(y).any():
            ax.text(0.5, 0.5, f"no {title.lower()} recorded" + ("\n(backward() called on a non-scalar or "
                                                                 "with explicit gradients: see w.steps)"
                                                                 if col == "loss" else "\n(watch() needs the optimizer)"),
                    transform=ax.transAxes, ha="center", va="center", color="#555555")
            continue
        shown = np.where(np.isfinite(y), y, np.nan)
        xs, ys = _downsample(x, shown, max_points)
        ax.plot(xs, ys, color="#08519c" if col == "loss" else "#2ca02c", linewidth=1.2,
                marker="o" if len(xs) <= 50 else None, markersize=2,
                drawstyle="default" if col == "loss" else "steps-post", label=col)[0].set_gid(f"series:{col}")
        ax.grid(True, alpha=0.3)
    inf = x[np.isinf(steps["loss"].to_numpy(dtype=float))] if "loss" in steps.columns else []
    _edge_markers(ax_loss, inf, "top", color=NONFINITE_COLOR, marker="X",
                  label=f"infinite loss ({counted(len(inf), 'step')})", gid="nonfinite")
    _mark_anomalies(ax_loss, anomalies, steps)
    _legend(ax_loss, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, borderaxespad=0)
    ax_lr.set_xlabel("step")
    return fig


# --------------------------------------------------------------------------- histograms

def _hist_edges(lo: "numpy.ndarray", hi: "numpy.ndarray") -> "numpy.ndarray":
    """Bin edges drawable on a log axis: the first bin (from 0.0) gets the log width of
    its neighbour; a non-finite last edge too."""
    import numpy as np

    edges = np.concatenate([lo, hi[-1:]]).astype(float)
    positive = edges[np.isfinite(edges) & (edges > 0)]
    if positive.size == 0:
        return np.logspace(-12, 0, len(edges))
    ratio = 10.0
    if positive.size >= 2:
        ratio = float(positive[1] / positive[0]) if positive[1] > positive[0] else 10.0
    if not (edges[0] > 0):
        edges[0] = edges[1] / ratio if edges[1] > 0 else positive[0] / ratio
    if not math.isfinite(edges[-1]):
        edges[-1] = edges[-2] * ratio
    return edges


def hist(histograms: "pandas.DataFrame", at: Optional[Sequence[int]] = None,
         names: Optional[Sequence[str]] = None, *, stats: Optional["pandas.DataFrame"] = None,
         max_panels: int = 12) -> "Figure":
    """Histograms of ``|grad|`` per parameter (one panel each, forward order).

    The bins are the fixed log-spaced bins recorded by ``watch(histograms=...)``; the
    first, which starts at 0.0, is drawn with its neighbour's log width and shaded
    (exact zeros and tiny values). NaN/Inf are not in the bins: when ``stats`` is given
    each panel states their count (from ``stats.nonfinite``) in red.

    Args:
        histograms: the histogram frame (`Watch.histograms`): ``step``, ``name``, ``lo``,
            ``hi``, ``count``.
        at: the steps to draw; None: up to four recorded steps, first and last included.
        names: only these parameters.
        stats: the statistics frame, to state NaN/Inf counts.
        max_panels: the most panels (parameters) drawn.

    Returns:
        matplotlib.figure.Figure: the figure.

    Raises:
        GraddbgValueError: a missing column, an empty frame, or steps in ``at`` that were
            not recorded.

    Examples:
        >>> import pandas as pd
        >>> h = pd.DataFrame({"step": [1, 1, 1], "name": ["w"] * 3, "lo": [0.0, 1e-3, 1e-2],
        ...                   "hi": [1e-3, 1e-2, 1e-1], "count": [2, 5, 1]})
        >>> fig = hist(h)
        >>> fig.axes[0].get_title(), fig.axes[0].get_xscale()
        ('w', 'log')
    """
    if histograms is None:
        raise GraddbgValueError("histograms: none were recorded; pass watch(..., histograms=...) "
                         "to record them")
    histograms = _frame(histograms, "histograms", ("step", "name", "lo", "hi", "count"))
    if len(histograms) == 0:
        raise GraddbgValueError("histograms: the frame is empty (no recorded step had histograms)")
    if int(max_panels) < 1:
        raise GraddbgValueError(f"max_panels must be at least 1; got {max_panels!r}")
    chosen_steps = _hist_steps(histograms, at)
    all_names = _order(histograms["name"])
    chosen = _hist_names(all_names, names, int(max_panels))
    nonfinite = _nonfinite_counts(stats, chosen_steps, chosen)
    wanted = histograms[histograms["name"].isin(chosen) & histograms["step"].isin(chosen_steps)]
    grouped = dict(iter(wanted.groupby(["name", "step"], sort=False)))
    ncols = min(3, len(chosen))
    nrows = math.ceil(len(chosen) / ncols)
    fig = _new_figure(4.0 * ncols + 0.5, 2.8 * nrows + 0.6)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, name in zip(axes, chosen):
        _hist_panel(ax, name, [(s, grouped.get((name, s))) for s in chosen_steps], nonfinite)
    _legend(axes[0], fontsize=6, loc="upper left")
    for ax in axes[len(chosen):]:
        ax.set_visible(False)
    fig.suptitle("Histograms of |grad|" + _title_count(len(chosen), len(all_names),
                                                       "parameters"), fontsize=10)
    return fig


def _hist_steps(histograms: "pandas.DataFrame", at: Any) -> List[int]:
    """The steps ``at`` (one or several), checked; by default up to four recorded
    steps evenly spread, the first and the last included."""
    import numpy as np

    recorded = np.unique(histograms["step"].to_numpy(dtype=np.int64)).tolist()
    if at is None:
        if len(recorded) <= 4:
            return recorded
        idx = sorted(set(np.linspace(0, len(recorded) - 1, 4).round().astype(int)))
        return [recorded[i] for i in idx]
    chosen = [int(s) for s in ([at] if isinstance(at, numbers.Integral) else at)]
    missing = [s for s in chosen if s not in set(recorded)]
    if missing:
        raise GraddbgValueError(f"at: steps {missing} have no histogram; recorded histogram "
                         f"steps are {recorded[:10]}{' ...' if len(recorded) > 10 else ''}")
    return chosen


def _hist_names(all_names: List[str], names: Any, max_panels: int) -> List[str]:
    """The parameters to draw: ``names`` (checked), else the first ``max_panels``."""
    if names is None:
        return all_names[:max_panels]
    chosen = [names] if isinstance(names, str) else list(names)
    unknown = [n for n in chosen if n not in set(all_names)]
    if unknown:
        raise GraddbgValueError(f"names: no histogram for {unknown}; parameters with histograms "
                         f"are {all_names[:10]}{' ...' if len(all_names) > 10 else ''}")
    return chosen


def _nonfinite_counts(stats: Optional["pandas.DataFrame"], steps: Sequence[int],
                      names: Sequence[str]) -> Dict[Tuple[int, str], int]:
    """{(step, name): number of NaN/Inf entries} from ``stats.nonfinite``, where known."""
    if stats is None:
        return {}
    stats = _frame(stats, "stats", ("step", "name"))
    if "nonfinite" not in stats.columns:
        return {}
    sub = stats[stats["step"].isin(steps) & stats["name"].isin(names)]
    counts = sub["nonfinite"].fillna(0).to_numpy(dtype=float)
    return {(int(s), n): int(c) for s, n, c in zip(sub["step"], sub["name"], counts)}


def _hist_panel(ax: "Axes", name: str, series: Sequence[Tuple[int, Any]],
                nonfinite: Dict[Tuple[int, str], int]) -> None:
    """One parameter's panel: a stairs line per step (its rows of the histograms frame,
    or None), the zero bin shaded, the NaN/Inf counts written in red."""
    notes, zero_edge = [], None
    for k, (s, g) in enumerate(series):
        if g is None:
            continue
        g = g.sort_values("lo")
        lo, hi = g["lo"].to_numpy(dtype=float), g["hi"].to_numpy(dtype=float)
        edges = _hist_edges(lo, hi)
        ax.stairs(g["count"].to_numpy(dtype=float), edges, label=f"step {s}",
                  color=_STEP_COLORS[k % len(_STEP_COLORS)], linewidth=1.2)
        if lo[0] == 0.0:
            zero_edge = (edges[0], edges[1])
        if nonfinite.get((s, name)):
            notes.append(f"step {s}: {nonfinite[(s, name)]} NaN/Inf")
    if zero_edge is not None:
        ax.axvspan(zero_edge[0], zero_edge[1], color="#eeeeee", zorder=0,
                   label=f"0 and < {zero_edge[1]:.0e}")
    if notes:
        ax.text(0.98, 0.95, "\n".join(notes[:4]), transform=ax.transAxes, ha="right",
                va="top", fontsize=7, color=NONFINITE_COLOR)
    ax.set_xscale("log")
    _log_axis(ax.xaxis)
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("|grad|", fontsize=8)
    ax.set_ylabel("count", fontsize=8)
    ax.tick_params(labelsize=7)


# --------------------------------------------------------------------------- dispatcher

def plot(kind: str, stats: "pandas.DataFrame", steps: Optional["pandas.DataFrame"] = None,
         anomalies: Any = None, histograms: Optional["pandas.DataFrame"] = None,
         **kw: Any) -> "Figure":
    """One figure of a run by ``kind``.

    Args:
        kind: ``"flow"`` (`flow`), ``"norms"`` (`norms`), ``"heatmap"`` (`norms` with
            ``heatmap=True``), ``"update"`` (`update_ratio`), ``"hist"`` (`hist`) or
            ``"loss"`` (`loss`, from ``steps``).
        stats: the statistics frame.
        steps: the per-step frame.
        anomalies: a list of `Anomaly` or an anomalies DataFrame.
        histograms: the histogram frame (needed by ``"hist"``).
        **kw: passed on to that function.

    Returns:
        matplotlib.figure.Figure: the figure.

    Raises:
        GraddbgValueError: an unknown ``kind``, ``"hist"`` without histograms, or
            ``"loss"`` without the steps frame.

    Examples:
        >>> import pandas as pd
        >>> stats = pd.DataFrame({"step": [1], "name": ["w"], "module": [""], "numel": [3],
        ...     "norm": [0.1], "absmax": [0.1], "nonfinite": [0], "update_ratio": [1e-3]})
        >>> plot("flow", stats).axes[0].get_title()
        'Gradient flow at step 1'
    """
    if kind == "flow":
        return flow(stats, **kw)
    if kind == "norms":
        return norms(stats, steps=steps, anomalies=anomalies, **kw)
    if kind == "heatmap":
        return norms(stats, steps=steps, anomalies=anomalies, heatmap=True, **kw)
    if kind == "update":
        return update_ratio(stats, anomalies=anomalies, **kw)
    if kind == "hist":
        return hist(histograms, stats=stats, **kw)
    if kind == "loss":
        if steps is None:
            raise GraddbgValueError("plot('loss') needs the steps frame (steps=w.steps): the loss is a column of it")
        return loss(steps, anomalies=anomalies, **kw)
    raise GraddbgValueError(f"kind must be one of {list(KINDS)}; got {kind!r}")
