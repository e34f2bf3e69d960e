"""graddbg.plots: every figure checked for its content (axes, lines, labels, marks) on
frames built to the run contract, with NaN/Inf/1e38, all-zero and gradient-less parameters."""
from __future__ import annotations

import io
import math
import warnings

import numpy as np
import pandas as pd
import pytest

from graddbg import plots
from graddbg.anomaly import Anomaly

# (qualified name, module, numel) in named_parameters() order
PARAMS = [
    ("embed.weight", "embed", 40),
    ("layers.0.weight", "layers.0", 64),
    ("layers.0.bias", "layers.0", 8),
    ("layers.1.weight", "layers.1", 64),
    ("layers.1.bias", "layers.1", 8),
    ("head.weight", "head", 16),
    ("head.bias", "head", 2),
    ("scale", "", 1),
]
EDGES = [0.0] + [10.0 ** e for e in range(-8, 4)]  # 0, 1e-8 ... 1e3: 12 bins


def make_frames(n_steps=8, params=PARAMS, *, every=1, nan=(), inf=(), huge=(), zero=(),
                nograd=(), optimizer=True, histograms=True, seed=0, extra_stats=False,
                absmax_steps=None, categorical=False):
    """A recorded run as watch() writes it (see the run contract).

    nan / inf / huge: (step, name) pairs whose gradient holds NaN / +Inf / a 1e38 entry;
    zero: names whose gradient is all zero; nograd: names that never get a gradient;
    absmax_steps: the steps whose absmax was measured (NaN on the others; None: all);
    categorical: name and module as pandas Categoricals, as ``w.stats`` keeps them.
    Returns a dict with stats, steps, histograms, anomalies, meta.
    """
    rng = np.random.default_rng(seed)
    nan, inf, huge = set(nan), set(inf), set(huge)
    rows, hist_rows, anomalies = [], [], []
    recorded = list(range(1, n_steps + 1, every))
    for step in recorded:
        for i, (name, module, numel) in enumerate(params):
            has = name not in nograd
            norm = float(np.exp(rng.normal(-2.0 - 0.5 * i, 0.3)) * math.sqrt(numel))
            absmax = norm / math.sqrt(numel) * 2.5
            nonfinite = 0
            if name in zero:
                norm = absmax = 0.0
            if (step, name) in huge:
                norm = absmax = 1e38
            if (step, name) in inf:
                norm = absmax = math.inf
                nonfinite = 1
            if (step, name) in nan:
                norm = absmax = math.nan
                nonfinite = numel
            if not has:
                norm = absmax = math.nan
                nonfinite = 0
            if absmax_steps is not None and step not in absmax_steps:
                absmax = math.nan
            ratio = float(np.exp(rng.normal(math.log(1e-3), 0.5))) if optimizer and has else math.nan
            if nonfinite:
                ratio = math.nan
            row = dict(step=step, name=name, module=module, numel=numel, norm=norm,
                       absmax=absmax, nonfinite=nonfinite, update_ratio=ratio, has_grad=has)
            if extra_stats:
                row.update(mean=0.0 if has else math.nan, std=norm / math.sqrt(numel),
                           zero_frac=1.0 if name in zero else 0.0)
            rows.append(row)
            if histograms and has:
                finite_entries = numel - nonfinite
                if name in zero:
                    counts = [finite_entries] + [0] * (len(EDGES) - 1)
                else:
                    counts = list(rng.multinomial(finite_entries, [0.02] + [0.98 / (len(EDGES) - 1)] * (len(EDGES) - 1)))
                for lo, hi, c in zip(EDGES, EDGES[1:] + [1e4], counts):
                    hist_rows.append(dict(step=step, name=name, lo=lo, hi=hi, count=int(c)))
            if nonfinite:
                anomalies.append(Anomaly(step=step, kind="nonfinite", name=name, module=module,
                                         op="LogBackward0", value=norm, threshold=None,
                                         source="train.py:12", message=f"NaN/Inf in {name}"))
    stats = pd.DataFrame(rows)
    stats = stats.astype({"step": "int64", "numel": "int64", "nonfinite": "int64",
                          "norm": "float64", "absmax": "float64", "update_ratio": "float64",
                          "has_grad": "bool"})
    g = stats.assign(sq=np.where(stats["has_grad"], stats["norm"] ** 2, 0.0))
    gn = np.sqrt(g.groupby("step", sort=True)["sq"].sum())
    nf = stats.groupby("step", sort=True)["nonfinite"].sum()
    steps = pd.DataFrame({
        "step": np.arange(1, n_steps + 1, dtype=np.int64),
    })
    steps["global_norm"] = steps["step"].map(gn).astype("float64")
    steps["clipped_norm"] = np.nan
    steps["nonfinite"] = steps["step"].map(nf).fillna(0).astype("int64")
    steps["overflow"] = False
    steps["scale"] = np.nan
    steps["recorded"] = steps["step"].isin(recorded)
    steps["lr"] = 0.1 if optimizer else np.nan
    hists = None
    if histograms:
        hists = pd.DataFrame(hist_rows, columns=["step", "name", "lo", "hi", "count"]).astype(
            {"step": "int64", "lo": "float64", "hi": "float64", "count": "int64"})
    if categorical:
        stats, hists = as_categorical(stats), as_categorical(hists)
    meta = {"model": "TinyNet", "every": every, "stats": ["norm", "absmax", "nonfinite"],
            "torch": "2.x", "world_size": 1, "rank": 0, "uncovered": list(nograd)}
    return dict(stats=stats, steps=steps, histograms=hists, anomalies=anomalies, meta=meta)


def as_categorical(frame):
    """name/module as pandas Categoricals, as ``w.stats`` keeps them, with categories the
    rows do not use (a parameter thinned out of the history) and in an order that is not
    the forward order: plots must follow the rows, never the categories."""
    if frame is None:
        return None
    out = frame.copy()
    for c in ("name", "module"):
        if c in out.columns:
            cats = sorted(set(out[c]), reverse=True) + [f"unused.{c}"]
            out[c] = pd.Categorical(out[c], categories=cats)
    return out


@pytest.fixture
def frames():
    return make_frames(8, nan=[(5, "layers.1.weight")], inf=[(6, "head.bias")],
                       huge=[(3, "embed.weight")], zero=["layers.0.bias"], nograd=["scale"])


def labels_of(ax):
    return ax.get_legend_handles_labels()[1]


def lines_by_gid(ax):
    return {l.get_gid(): l for l in ax.get_lines() if l.get_gid()}


def render(fig, fmt="svg"):
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt)
    assert buf.tell() > 0
    return buf.getvalue()


# ----------------------------------------------------------------------------- flow

def test_flow_bars_follow_forward_order_and_naive_values(frames):
    stats = frames["stats"]
    fig = plots.flow(stats, step=2)
    ax = fig.axes[0]
    names = [p[0] for p in PARAMS]
    assert [t.get_text() for t in ax.get_xticklabels()] == names
    assert ax.get_yscale() == "log"
    assert ax.get_title() == "Gradient flow at step 2"
    assert ax.get_xlabel() == "parameter (forward order)" and ax.get_ylabel() == "|grad|"
    rows = stats[stats.step == 2].set_index("name").loc[names]
    ok = rows["has_grad"] & (rows["norm"] > 0)
    bars = {lbl: cont for cont, lbl in zip(ax.containers, [c.get_label() for c in ax.containers])}
    max_heights = [p.get_height() for p in bars["max |grad|"].patches]
    rms_heights = [p.get_height() for p in bars["rms |grad| (norm/√numel)"].patches]
    np.testing.assert_allclose(max_heights, rows.loc[ok, "absmax"].to_numpy())
    np.testing.assert_allclose(rms_heights, (rows["norm"] / np.sqrt(rows["numel"]))[ok].to_numpy())
    # x positions of bars are the forward-order indices of those parameters
    xs = [p.get_x() + p.get_width() / 2 for p in bars["max |grad|"].patches]
    assert xs == [float(i) for i, n in enumerate(names) if ok[n]]


def test_flow_marks_nonfinite_zero_and_nograd(frames):
    fig = plots.flow(frames["stats"], step=5)
    ax = fig.axes[0]
    marks = lines_by_gid(ax)
    names = [p[0] for p in PARAMS]
    assert list(marks["nonfinite"].get_xdata()) == [names.index("layers.1.weight")]
    assert list(marks["zero"].get_xdata()) == [names.index("layers.0.bias")]
    assert list(marks["nograd"].get_xdata()) == [names.index("scale")]
    assert {"non-finite (1)", "all zero (1)", "no gradient (1)"} <= set(labels_of(ax))
    tick = {t.get_text(): t for t in ax.get_xticklabels()}
    assert tick["layers.1.weight"].get_color() == plots.NONFINITE_COLOR
    assert tick["scale"].get_color() == plots.NOGRAD_COLOR
    # the count of non-finite entries is written on the plot
    assert any(t.get_text() == "64 NaN/Inf" for t in ax.texts)
    # default step is the last recorded one
    assert plots.flow(frames["stats"]).axes[0].get_title() == "Gradient flow at step 8"


def test_flow_inf_and_huge_values(frames):
    ax = plots.flow(frames["stats"], step=6).axes[0]
    assert list(lines_by_gid(ax)["nonfinite"].get_xdata()) == [6]  # head.bias is +Inf
    ax = plots.flow(frames["stats"], step=3).axes[0]
    heights = [p.get_height() for p in ax.containers[0].patches]
    assert max(heights) == 1e38  # embed.weight's absmax, a finite value, is drawn
    assert ax.get_ylim()[1] >= 1e38
    render(ax.figure)


def test_flow_names_subset_and_bad_arguments(frames):
    ax = plots.flow(frames["stats"], names=["head.bias", "embed.weight"]).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["head.bias", "embed.weight"]
    assert "(2 of 8 parameters)" in ax.get_title()
    with pytest.raises(ValueError, match=r"step: 99 was not recorded.*from 1 to 8"):
        plots.flow(frames["stats"], step=99)
    with pytest.raises(ValueError, match=r"names: unknown parameters \['nope'\]"):
        plots.flow(frames["stats"], names=["nope"])
    with pytest.raises(ValueError, match=r"stats lacks the columns \['absmax'\]"):
        plots.flow(frames["stats"].drop(columns="absmax"))
    with pytest.raises(TypeError, match="stats must be a pandas DataFrame.*got list"):
        plots.flow([1, 2])


def test_flow_all_nan_does_not_crash():
    names = [p[0] for p in PARAMS]
    f = make_frames(2, nan=[(s, n) for s in (1, 2) for n in names])
    ax = plots.flow(f["stats"]).axes[0]
    assert all(len(c.patches) == 0 for c in ax.containers)
    assert len(lines_by_gid(ax)["nonfinite"].get_xdata()) == len(names)
    lo, hi = ax.get_ylim()
    assert 0 < lo < hi
    render(ax.figure, "png")


def test_flow_unmeasured_absmax_is_not_nonfinite():
    # absmax never measured (watch(stats=("norm",)), or a step between two CPU reads)
    f = make_frames(4, absmax_steps=(), zero=["layers.0.bias"], nograd=["scale"])
    assert f["stats"].absmax.isna().all() and (f["stats"].nonfinite == 0).all()
    ax = plots.flow(f["stats"]).axes[0]
    marks = lines_by_gid(ax)
    assert "nonfinite" not in marks
    assert not any("non-finite" in lbl for lbl in labels_of(ax))
    assert not any("NaN/Inf" in t.get_text() for t in ax.texts)
    assert all(t.get_color() != plots.NONFINITE_COLOR for t in ax.get_xticklabels())
    # the rms bars are all there; no max bar, since nothing was measured
    bars = dict(zip([c.get_label() for c in ax.containers], ax.containers))
    assert len(bars["_max |grad|"].patches) == 0  # (and no legend entry for it)
    assert "max |grad|" not in [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(bars["rms |grad| (norm/√numel)"].patches) == len(PARAMS) - 2
    names = [p[0] for p in PARAMS]
    assert list(marks["zero"].get_xdata()) == [names.index("layers.0.bias")]
    assert list(marks["nograd"].get_xdata()) == [names.index("scale")]


def test_flow_nonfinite_count_marks_even_without_absmax():
    f = make_frames(4, absmax_steps=(), nan=[(4, "head.weight")])
    ax = plots.flow(f["stats"], step=4).axes[0]
    names = [p[0] for p in PARAMS]
    assert list(lines_by_gid(ax)["nonfinite"].get_xdata()) == [names.index("head.weight")]
    assert "non-finite (1)" in labels_of(ax)
    assert any(t.get_text() == "16 NaN/Inf" for t in ax.texts)
    # the count decides, even where the norm itself came out finite
    stats = f["stats"].copy()
    stats.loc[(stats.step == 3) & (stats.name == "embed.weight"), "nonfinite"] = 2
    ax = plots.flow(stats, step=3).axes[0]
    assert list(lines_by_gid(ax)["nonfinite"].get_xdata()) == [names.index("embed.weight")]
    assert any(t.get_text() == "2 NaN/Inf" for t in ax.texts)


def test_flow_draws_one_step_only():
    """rms and max |grad| come from the same step: where absmax was not measured at it, no
    max bar is drawn (never one of another step) and the title says where it was last."""
    f = make_frames(8, absmax_steps=(1, 5))
    stats = f["stats"]
    names = [p[0] for p in PARAMS]

    def drawn(step):
        ax = plots.flow(stats, step=step).axes[0]
        return ax.get_title(), [p.get_height() for p in ax.containers[0].patches]

    at5 = stats[stats.step == 5].set_index("name").absmax.loc[names]
    title, heights = drawn(8)
    assert heights == [] and title.endswith("\nmax |grad| not measured at step 8 (last at step 5)"), title
    assert drawn(3)[0].endswith("max |grad| not measured at step 3 (last at step 1)")
    title, heights = drawn(5)
    assert title == "Gradient flow at step 5" and heights == list(at5)
    # one parameter measured at a step the others were not: only its bar, and the note says so
    late = stats.copy()
    late.loc[(late.step == 7) & (late.name == "head.bias"), "absmax"] = 0.5
    ax = plots.flow(late, step=7).axes[0]
    assert [p.get_height() for p in ax.containers[0].patches] == [0.5]
    assert ax.get_title().endswith(f"max |grad| not measured at step 7 for {len(names) - 1} of {len(names)} "
                                   f"parameters (last at step 5)")


def test_flow_legend_is_outside_the_axes():
    """The legend covers no marker: it lies right of the axes, whose markers sit inside."""
    f = make_frames(4, nan=[(4, "head.weight")])
    fig = plots.flow(f["stats"], step=4)
    ax = fig.axes[0]
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    axes = ax.get_window_extent(renderer)
    assert legend.x0 >= axes.x1 - 1, (legend, axes)
    assert "non-finite (1)" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_flow_of_a_peft_model_shows_the_distinguishing_part_of_each_name_without_warnings():
    """PEFT names (base_model.model.layers.0.q_proj.lora_A.default.weight) were cut to
    'weight' and collapsed the layout, which matplotlib warned about."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    names = [f"base_model.model.model.layers.{i}.self_attn.{p}_proj.lora_{ab}.default.weight"
             for i in range(4) for p in "qv" for ab in "AB"] + ["base_model.model.lm_head.weight"]
    stats = pd.DataFrame({"step": 1, "name": names, "module": [n.rsplit(".", 1)[0] for n in names], "numel": 64,
                          "norm": np.linspace(0.1, 1.0, len(names)), "absmax": 0.5, "nonfinite": 0, "has_grad": True})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = plots.flow(stats)
        render(fig)
        FigureCanvasAgg(fig).draw()  # (last: the boxes below are of this layout)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels[:3] == ["model.layers.0.….q_proj.lora_A.default", "model.layers.0.….q_proj.lora_B.default",
                          "model.layers.0.….v_proj.lora_A.default"]
    assert labels[-1] == "lm_head" and len(set(labels)) == len(names)
    assert "names without 'base_model.model.' and '.weight'" in ax.get_xlabel()
    renderer = fig.canvas.get_renderer()
    inside = fig.bbox
    for text in ax.get_xticklabels() + [ax.xaxis.label]:
        box = text.get_window_extent(renderer)
        assert box.x0 >= inside.x0 - 1 and box.x1 <= inside.x1 + 1 and box.y0 >= inside.y0 - 1, text.get_text()


def test_flow_without_nonfinite_column_reads_norm_and_infinite_absmax():
    f = make_frames(2)
    stats = f["stats"].drop(columns="nonfinite")
    names = [p[0] for p in PARAMS]
    last = stats.step == 2
    stats.loc[last & (stats.name == "embed.weight"), "norm"] = math.inf
    stats.loc[last & (stats.name == "head.weight"), "absmax"] = -math.inf
    stats.loc[last & (stats.name == "layers.0.bias"), "absmax"] = math.nan  # not measured
    ax = plots.flow(stats).axes[0]
    assert list(lines_by_gid(ax)["nonfinite"].get_xdata()) == \
        [names.index("embed.weight"), names.index("head.weight")]
    assert sum(t.get_text() == "NaN/Inf" for t in ax.texts) == 2
    # the unmeasured one keeps its rms bar and has no max bar (none of another step)
    assert ax.containers[0].get_label() == "max |grad|"
    max_x = [p.get_x() + p.get_width() / 2 for p in ax.containers[0].patches]
    assert names.index("layers.0.bias") not in max_x
    rms_x = [p.get_x() + p.get_width() / 2 for p in ax.containers[1].patches]
    assert names.index("layers.0.bias") in rms_x


# ----------------------------------------------------------------------------- norms

def test_norms_lines_global_and_top_level_modules(frames):
    stats, steps = frames["stats"], frames["steps"]
    fig = plots.norms(stats, steps, anomalies=frames["anomalies"])
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and ax.get_xlabel() == "step"
    assert ax.get_ylabel() == "gradient L2 norm"
    by_gid = lines_by_gid(ax)
    # one line per top-level module (+ the root parameter 'scale'), plus the global norm
    assert [l.get_label() for l in ax.get_lines() if l.get_gid().startswith("series:")] == \
        ["embed", "layers", "head", "scale"]
    g = by_gid["global"]
    want = steps["global_norm"].to_numpy()
    shown = np.where(np.isfinite(want), want, np.nan)
    np.testing.assert_allclose(np.asarray(g.get_ydata(), float), shown)
    # module 'layers' = root of the sum of squares of its four parameters (naive reference)
    sub = stats[stats.name.str.startswith("layers.") & (stats.step == 2)]
    np.testing.assert_allclose(by_gid["series:layers"].get_ydata()[1],
                               math.sqrt((sub.norm ** 2).sum()))
    # a NaN in one parameter makes its module's norm non-finite (a gap), never a smaller number
    assert np.isnan(by_gid["series:layers"].get_ydata()[4])
    assert np.isfinite(by_gid["series:layers"].get_ydata()[[0, 1, 2, 3, 5, 6, 7]]).all()
    # a module without any gradient has no norm at all (not zero)
    assert np.isnan(np.asarray(by_gid["series:scale"].get_ydata(), float)).all()
    # NaN at step 5 and Inf at step 6 are marked; the anomalies are vertical lines
    assert list(by_gid["nonfinite"].get_xdata()) == [5, 6]
    assert "non-finite (2 steps)" in labels_of(ax)
    colls = {c.get_gid(): c for c in ax.collections}
    segs = colls["anomaly-nonfinite"].get_segments()
    assert sorted(s[0][0] for s in segs) == [5, 6]
    assert colls["anomaly-nonfinite"].get_label() == "anomaly: nonfinite (2)"


def test_norms_named_parameters_and_computed_global(frames):
    stats = frames["stats"]
    ax = plots.norms(stats, names=["head.weight", "embed.weight"]).axes[0]
    series = [l for l in ax.get_lines() if (l.get_gid() or "").startswith("series:")]
    assert [l.get_label() for l in series] == ["head.weight", "embed.weight"]
    np.testing.assert_allclose(series[0].get_ydata(),
                               stats[stats.name == "head.weight"].norm.where(
                                   np.isfinite(stats[stats.name == "head.weight"].norm)).to_numpy())
    # without the steps frame the global norm is computed from stats (no-grad rows ignored)
    g = lines_by_gid(ax)["global"]
    s2 = stats[(stats.step == 2) & stats.has_grad]
    assert g.get_ydata()[1] == pytest.approx(math.sqrt((s2.norm ** 2).sum()))
    assert np.isnan(g.get_ydata()[4])  # the NaN of step 5 is not skipped by the sum
    assert "parameters (2 of 8 parameters)" in ax.get_title()


def test_norms_overflow_steps_and_anomaly_frame(frames):
    steps = frames["steps"].copy()
    steps.loc[steps.step == 4, "overflow"] = True
    anom = pd.DataFrame({"step": [7], "kind": ["explode"]})
    ax = plots.norms(frames["stats"], steps, anomalies=anom).axes[0]
    colls = {c.get_gid(): c for c in ax.collections}
    assert [s[0][0] for s in colls["anomaly-overflow"].get_segments()] == [4]
    assert colls["anomaly-overflow"].get_label() == "scaler overflow (skipped) (1)"
    assert [s[0][0] for s in colls["anomaly-explode"].get_segments()] == [7]


def test_norms_downsampling_keeps_spikes():
    n = 3000
    rng = np.random.default_rng(1)
    norm = np.exp(rng.normal(0, 0.1, n))
    norm[1234] = 1e6
    norm[2000] = np.nan
    stats = pd.DataFrame({"step": np.arange(n), "name": "w", "module": "", "numel": 10,
                          "norm": norm, "absmax": norm, "nonfinite": (np.arange(n) == 2000).astype(int)})
    ax = plots.norms(stats, max_points=100).axes[0]
    g = lines_by_gid(ax)["global"]
    assert len(g.get_xdata()) <= 200
    assert np.nanmax(g.get_ydata()) == pytest.approx(1e6)
    assert 1234 in list(g.get_xdata())
    assert list(lines_by_gid(ax)["nonfinite"].get_xdata()) == [2000]
    with pytest.raises(ValueError, match="max_points must be at least 2"):
        plots.norms(stats, max_points=1)


def test_norms_heatmap_cells(frames):
    stats = frames["stats"]
    fig = plots.norms(stats, frames["steps"], anomalies=frames["anomalies"], heatmap=True)
    ax = fig.axes[0]
    from matplotlib.colors import LogNorm
    meshes = {c.get_gid(): c for c in ax.collections}
    mesh, special = meshes["heatmap"], meshes["heatmap-special"]
    assert isinstance(mesh.norm, LogNorm)
    names = [p[0] for p in PARAMS]
    values = np.ma.asarray(mesh.get_array()).reshape(len(names), 8)
    want = stats.pivot(index="name", columns="step", values="norm").loc[names].to_numpy()
    finite = np.isfinite(want) & (want > 0)
    np.testing.assert_allclose(values.filled(np.nan)[finite], want[finite])
    assert values.mask[~finite].all()
    cats = np.ma.asarray(special.get_array()).reshape(len(names), 8)
    assert cats[names.index("layers.1.weight"), 4] == 1  # NaN at step 5
    assert cats[names.index("head.bias"), 5] == 1        # Inf at step 6
    assert (cats[names.index("layers.0.bias")] == 2).all()
    assert (cats[names.index("scale")] == 3).all()
    leg = labels_of(ax) + [t.get_text() for t in fig.legends[0].get_texts()]
    assert "non-finite (2 cells)" in leg and "all zero (8 cells)" in leg
    assert fig.axes[1].get_ylabel() == "gradient L2 norm (log scale)"  # the colour bar
    assert [t.get_text() for t in ax.get_yticklabels()] == names
    render(fig)


@pytest.mark.parametrize("n_params", [2, len(PARAMS)])
def test_norms_heatmap_legend_and_colour_bar_leave_the_x_label_and_ticks_clear(n_params):
    """A short heatmap (two parameters) had its legend across the x label."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    f = make_frames(8, PARAMS[:n_params], nan=[(3, PARAMS[0][0])])
    fig = plots.norms(f["stats"], f["steps"], anomalies=f["anomalies"], heatmap=True)
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    ax, colour_bar = fig.axes[0], fig.axes[1]
    label = ax.xaxis.label.get_window_extent(renderer)
    ticks = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
    legends = [leg.get_window_extent(renderer) for leg in fig.legends + [ax.get_legend()] if leg is not None]
    assert len(legends) == 1
    for other in legends + [colour_bar.get_tightbbox(renderer)]:
        assert not other.overlaps(label), (other, label)
        assert not any(other.overlaps(t) for t in ticks), other


@pytest.mark.parametrize("kind", ["flow", "norms", "heatmap", "update"])
def test_a_title_placed_once_sits_on_top_of_an_axis_without_offset_text(kind):
    """These plots put their title at the top of the axes once (matplotlib would search for
    its place above the x ticks and the y axis' offset text at every draw): their y axes
    never show an offset text, whatever the values (1e-30 to 1e38 here), and the title clears
    every tick label."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    f = make_frames(6, huge=[(3, "embed.weight")], zero=["layers.0.bias"])
    f["stats"].loc[f["stats"].name == "head.bias", ["norm", "absmax", "update_ratio"]] = 1e-30
    fig = plots.plot(kind, f["stats"], f["steps"], f["anomalies"])
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    assert ax.yaxis.offsetText.get_text() == "" and ax.xaxis.get_ticks_position() == "bottom"
    title = ax.title.get_window_extent(renderer)
    assert ax.title.get_position()[1] == 1.0 and title.y0 >= ax.get_window_extent(renderer).y1
    labels = [t.get_window_extent(renderer) for t in ax.get_xticklabels() + ax.get_yticklabels() if t.get_text()]
    assert labels and not any(title.overlaps(b) for b in labels)


def test_norms_heatmap_buckets_long_runs():
    f = make_frames(60, nan=[(33, "head.weight")], histograms=False)
    ax = plots.norms(f["stats"], heatmap=True, max_points=10).axes[0]
    meshes = {c.get_gid(): c for c in ax.collections}
    cats = np.ma.asarray(meshes["heatmap-special"].get_array()).reshape(len(PARAMS), 10)
    assert cats[[p[0] for p in PARAMS].index("head.weight")].tolist().count(1) == 1
    assert "max over 60 steps in 10 columns" in ax.get_title()
    x0, x1 = ax.get_xlim()
    assert x0 <= 1 and x1 >= 60


# ----------------------------------------------------------------------------- update ratio

def test_update_ratio_lines_and_guide(frames):
    stats = frames["stats"]
    ax = plots.update_ratio(stats).axes[0]
    assert ax.get_yscale() == "log"
    by_gid = lines_by_gid(ax)
    guide = by_gid["guide"]
    assert set(guide.get_ydata()) == {1e-3} and guide.get_label() == "guide 0.001"
    series = [l for l in ax.get_lines() if (l.get_gid() or "").startswith("series:")]
    assert [l.get_label() for l in series] == [p[0] for p in PARAMS]
    w = stats[stats.name == "head.weight"]
    np.testing.assert_allclose(by_gid["series:head.weight"].get_ydata(), w.update_ratio.to_numpy())
    # NaN gradient (step 5) and Inf gradient (step 6) have unknown ratios: marked
    assert list(by_gid["nonfinite"].get_xdata()) == [5, 6]
    # ratios measured on some steps only (NaN between) still join up into a line
    sparse = stats.assign(update_ratio=np.where(stats.step.isin([1, 4, 7]), stats.update_ratio, np.nan))
    line = lines_by_gid(plots.update_ratio(sparse).axes[0])["series:head.weight"]
    assert list(line.get_xdata()) == [1, 4, 7]
    # a skipped step (ratio 0, weights untouched) is marked at the bottom, not dropped
    skipped = stats.assign(update_ratio=np.where(stats.step == 3, 0.0, stats.update_ratio))
    ax3 = plots.update_ratio(skipped).axes[0]
    assert list(lines_by_gid(ax3)["zero"].get_xdata()) == [3]
    assert "no update (1 step)" in labels_of(ax3)  # (one step, in words)
    render(ax3.figure)
    assert "0.001" in [t.get_text() for t in ax3.get_yticklabels()]  # plain-text log labels
    ax2 = plots.update_ratio(stats, guide=1e-2).axes[0]
    assert set(lines_by_gid(ax2)["guide"].get_ydata()) == {1e-2}
    assert "guide" not in lines_by_gid(plots.update_ratio(stats, guide=None).axes[0])
    with pytest.raises(ValueError, match="guide must be a positive finite number"):
        plots.update_ratio(stats, guide=-1)


def test_update_ratio_band_for_many_parameters():
    params = [(f"blocks.{i}.weight", f"blocks.{i}", 10) for i in range(30)]
    f = make_frames(5, params, histograms=False)
    stats = f["stats"]
    stats.loc[(stats.step == 3) & (stats.name == "blocks.7.weight"), "update_ratio"] = math.inf
    ax = plots.update_ratio(stats).axes[0]
    by_gid = lines_by_gid(ax)
    assert {"median", "max", "guide", "nonfinite"} <= set(by_gid)
    ok = stats.update_ratio.where(np.isfinite(stats.update_ratio))
    want = ok.groupby(stats.step).median().to_numpy()
    np.testing.assert_allclose(by_gid["median"].get_ydata(), want)
    assert list(by_gid["nonfinite"].get_xdata()) == [3]
    assert "10–90 % of 30 parameters" in labels_of(ax)


def test_update_ratio_without_optimizer_says_so():
    f = make_frames(4, optimizer=False, histograms=False)
    ax = plots.update_ratio(f["stats"]).axes[0]
    assert any("needs the optimizer" in t.get_text() for t in ax.texts)
    assert ax.get_lines()[0].get_gid() == "guide"
    render(ax.figure)


# ----------------------------------------------------------------------------- histograms

def test_hist_panels_counts_and_nonfinite_notes(frames):
    h, stats = frames["histograms"], frames["stats"]
    fig = plots.hist(h, at=[1, 5], stats=stats)
    axes = [a for a in fig.axes if a.get_visible()]
    with_hist = list(dict.fromkeys(h.name))
    assert [a.get_title() for a in axes] == with_hist  # 'scale' has no gradient: no panel
    for a in axes:
        assert a.get_xscale() == "log" and a.get_xlabel() == "|grad|"
        assert a.get_ylabel() == "count"
    ax = axes[with_hist.index("layers.1.weight")]
    from matplotlib.patches import StepPatch
    stairs = [p for p in ax.patches if isinstance(p, StepPatch)]
    assert [s.get_label() for s in stairs] == ["step 1", "step 5"]
    want = h[(h.name == "layers.1.weight") & (h.step == 1)].sort_values("lo")["count"].to_numpy()
    np.testing.assert_array_equal(stairs[0].get_data().values, want)
    edges = stairs[0].get_data().edges
    assert edges[0] > 0 and edges[0] == pytest.approx(1e-9)  # the zero bin drawn one decade wide
    np.testing.assert_allclose(edges[1:-1], EDGES[1:])
    # NaN entries are not in the bins, they are counted apart
    assert any(t.get_text() == "step 5: 64 NaN/Inf" for t in ax.texts)
    assert any(lbl.startswith("0 and < 1e-08") for lbl in labels_of(ax))


def test_hist_default_steps_names_and_errors(frames):
    h = frames["histograms"]
    fig = plots.hist(h, names=["head.weight"])
    ax = fig.axes[0]
    from matplotlib.patches import StepPatch
    assert [p.get_label() for p in ax.patches if isinstance(p, StepPatch)] == \
        ["step 1", "step 3", "step 6", "step 8"]
    assert len(fig.axes) == 1
    one = plots.hist(h, at=np.int64(3), names="head.weight").axes[0]
    assert [p.get_label() for p in one.patches if isinstance(p, StepPatch)] == ["step 3"]
    fig = plots.hist(h, max_panels=2)
    assert len([a for a in fig.axes if a.get_visible()]) == 2
    assert "(2 of 7 parameters)" in fig.get_suptitle()
    with pytest.raises(ValueError, match="histograms: none were recorded.*histograms="):
        plots.hist(None)
    with pytest.raises(ValueError, match=r"at: steps \[42\] have no histogram"):
        plots.hist(h, at=[42])
    with pytest.raises(ValueError, match=r"names: no histogram for \['scale'\]"):
        plots.hist(h, names=["scale"])


# ----------------------------------------------------------------------------- all plots

VARIANTS = {
    "all_nan": dict(nan=[(s, p[0]) for s in range(1, 5) for p in PARAMS]),
    "pos_neg_inf": dict(inf=[(2, "embed.weight"), (3, "head.bias")]),
    "huge_1e38": dict(huge=[(s, "layers.0.weight") for s in range(1, 5)]),
    "all_zero": dict(zero=[p[0] for p in PARAMS]),
    "no_grad_at_all": dict(nograd=[p[0] for p in PARAMS], histograms=False),
    "neg_inf_1e308": dict(inf=[(2, "layers.0.weight")]),  # and more below
    "absmax_unmeasured": dict(absmax_steps=(1,), nan=[(4, "head.bias")]),
    "categorical_all_nan": dict(nan=[(s, p[0]) for s in range(1, 5) for p in PARAMS],
                                categorical=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kind", ["flow", "norms", "heatmap", "update", "hist"])
def test_every_plot_survives_nonfinite_data(kind, variant):
    f = make_frames(4, **VARIANTS[variant])
    stats = f["stats"]
    if variant == "pos_neg_inf":
        stats.loc[stats.step == 4, "update_ratio"] = -math.inf
        stats.loc[stats.step == 4, "absmax"] = math.inf
    if variant == "neg_inf_1e308":
        first = (stats.step == 2) & (stats.name == "layers.0.weight")
        stats.loc[first, ["norm", "absmax"]] = -math.inf
        stats.loc[stats.step == 3, "update_ratio"] = 1e38
        stats.loc[stats.step == 3, "absmax"] = -math.inf
        stats.loc[stats.step == 4, ["norm", "absmax"]] = 1e308  # squares overflow to +Inf
        f["steps"].loc[f["steps"].step == 4, "global_norm"] = math.inf
        f["histograms"].loc[f["histograms"].lo == EDGES[-1], "hi"] = math.inf  # as watch records
    if kind == "hist" and f["histograms"] is None:
        with pytest.raises(ValueError, match="none were recorded"):
            plots.plot(kind, stats, f["steps"], f["anomalies"], f["histograms"])
        return
    kw = {"max_panels": 3} if kind == "hist" else {}  # three panels show it; seven cost 2 s
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no numpy overflow/invalid noise either
        fig = plots.plot(kind, stats, f["steps"], f["anomalies"], f["histograms"], **kw)
        render(fig, "svg" if variant != "huge_1e38" else "png")  # the report's and Agg's path
    if variant == "all_nan" and kind in ("flow", "norms"):
        assert "nonfinite" in lines_by_gid(fig.axes[0])


def test_plot_dispatcher_and_no_pyplot_state(frames):
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    titles = {k: plots.plot(k, frames["stats"], frames["steps"], frames["anomalies"],
                            frames["histograms"]).axes[0].get_title()
              for k in ("flow", "norms", "heatmap", "update")}
    assert titles["flow"].startswith("Gradient flow")
    assert titles["norms"].startswith("Gradient norms")
    assert titles["heatmap"].startswith("Gradient norm per parameter")
    assert titles["update"] == "Update / weight ratio"
    assert plt.get_fignums() == before
    with pytest.raises(ValueError, match=r"kind must be one of \['flow', 'norms', 'heatmap', 'update', 'hist', 'loss'\]; got 'pie'"):
        plots.plot("pie", frames["stats"])


def shown(fig):
    """What a figure shows, as text: titles, tick labels, legend entries, texts, lines,
    bars, heatmap cells and histogram stairs, axes by axes."""
    from matplotlib.patches import StepPatch

    out = [fig.get_suptitle()]
    for ax in fig.axes:
        out.append([
            ax.get_title(), [t.get_text() for t in ax.get_xticklabels()],
            [t.get_text() for t in ax.get_yticklabels()], labels_of(ax),
            [t.get_text() for t in ax.texts],
            [(l.get_gid(), l.get_label(), list(l.get_xdata()), list(l.get_ydata()))
             for l in ax.get_lines()],
            [(c.get_label(), [(p.get_x(), p.get_height()) for p in c.patches])
             for c in ax.containers],
            [np.ma.asarray(c.get_array()).astype(float).filled(np.nan).tolist()
             for c in ax.collections if (c.get_gid() or "").startswith("heatmap")],
            [(p.get_label(), list(p.get_data().values)) for p in ax.patches
             if isinstance(p, StepPatch)],
        ])
    return repr(out)


@pytest.mark.parametrize("kind", ["flow", "norms", "heatmap", "update", "hist"])
def test_every_plot_takes_categorical_names_without_warnings(frames, kind):
    cat_stats, cat_hist = as_categorical(frames["stats"]), as_categorical(frames["histograms"])
    assert isinstance(cat_stats["name"].dtype, pd.CategoricalDtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pandas' FutureWarning about observed= included
        fig = plots.plot(kind, cat_stats, frames["steps"], frames["anomalies"], cat_hist)
        render(fig)
    # the same figure as from plain strings: forward order, no unused category drawn
    plain = plots.plot(kind, frames["stats"], frames["steps"], frames["anomalies"],
                       frames["histograms"])
    assert shown(fig) == shown(plain)
    assert "unused" not in shown(fig)


def test_every_plot_takes_categorical_names_with_names_and_steps(frames):
    cat_stats, cat_hist = as_categorical(frames["stats"]), as_categorical(frames["histograms"])
    pick = ["head.weight", "embed.weight"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        figs = [plots.flow(cat_stats, step=5, names=pick),
                plots.norms(cat_stats, names=pick),
                plots.norms(cat_stats, names=pick, heatmap=True),
                plots.update_ratio(cat_stats, names=pick),
                plots.hist(cat_hist, at=[1, 5], names=pick, stats=cat_stats)]
    plain = [plots.flow(frames["stats"], step=5, names=pick),
             plots.norms(frames["stats"], names=pick),
             plots.norms(frames["stats"], names=pick, heatmap=True),
             plots.update_ratio(frames["stats"], names=pick),
             plots.hist(frames["histograms"], at=[1, 5], names=pick, stats=frames["stats"])]
    assert [shown(f) for f in figs] == [shown(f) for f in plain]
    with pytest.raises(ValueError, match=r"names: unknown parameters \['unused.name'\]"):
        plots.flow(cat_stats, names=["unused.name"])


@pytest.mark.slow  # a real watch() of a tiny model: about 4 s, most of it watch's first set-up
def test_frames_of_a_real_watch_plot_without_warnings():
    import torch

    import graddbg

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with graddbg.watch(model, opt, histograms=True) as w:
        for _ in range(12):
            opt.zero_grad()
            model(torch.randn(5, 4)).pow(2).sum().backward()
            opt.step()
    stats, steps, hists = w.stats, w.steps, w.histograms
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for kind in ("flow", "norms", "heatmap", "update", "hist"):
            render(plots.plot(kind, stats, steps, [], hists))
        ax = plots.flow(stats).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == \
        [n for n, _ in model.named_parameters()]
    assert "nonfinite" not in lines_by_gid(ax)  # unmeasured absmax is not a NaN gradient
    last = int(stats.step.max())
    measured = stats.loc[stats.absmax.notna() & (stats.step <= last), "step"]
    if len(measured) and int(measured.max()) != last:  # absmax read every few steps only
        assert ax.get_title().endswith(f"max |grad| not measured at step {last} (last at step "
                                       f"{int(measured.max())})")
    assert len(ax.containers[0].patches) == (4 if last in set(measured) else 0)


def test_norms_groups_one_level_deeper_inside_a_single_container():
    params = [(f"blocks.{i}.{k}", f"blocks.{i}", 8) for i in range(12) for k in ("weight", "bias")]
    f = make_frames(4, params, histograms=False)
    ax = plots.norms(f["stats"], f["steps"]).axes[0]
    series = {l.get_label(): l for l in ax.get_lines() if (l.get_gid() or "").startswith("series:")}
    assert len(series) == 10 and set(series) <= {f"blocks.{i}" for i in range(12)}
    assert ax.get_title() == "Gradient norms: global and per module (depth 2) (10 of 12 modules)"
    # the ten kept are the largest (naive reference: peak of the root sum of squares)
    st = f["stats"].assign(group=f["stats"].name.str.rsplit(".", n=1).str[0])
    peak = st.assign(sq=st.norm ** 2).groupby(["step", "group"]).sq.sum().pow(0.5).groupby("group").max()
    assert set(series) == set(peak.sort_values(ascending=False).index[:10])
    for group, line in series.items():
        sub = st[(st.group == group) & (st.step == 2)]
        assert line.get_ydata()[1] == pytest.approx(math.sqrt((sub.norm ** 2).sum()))


def test_figures_show_png_and_pickle_without_pyplot(frames):
    import pickle

    from matplotlib.figure import Figure

    for kind in ("flow", "norms", "heatmap", "update", "hist"):
        fig = plots.plot(kind, frames["stats"], frames["steps"], frames["anomalies"],
                         frames["histograms"])
        assert isinstance(fig, Figure)
        if kind == "flow":
            assert fig._repr_png_().startswith(b"\x89PNG\r\n\x1a\n")
        back = pickle.loads(pickle.dumps(fig))
        assert type(back) is type(fig) and back.axes[0].get_title() == fig.axes[0].get_title()


@pytest.mark.slow  # starts a Jupyter kernel (about 5 s)
def test_figures_display_inline_in_jupyter_without_pyplot():
    import nbclient
    import nbformat

    code = ("import pandas as pd, sys\n"
            "from graddbg import plots\n"
            "stats = pd.DataFrame({'step': [1, 1], 'name': ['w', 'b'], 'module': ['', ''],\n"
            "    'numel': [3, 1], 'norm': [0.5, float('nan')], 'absmax': [0.4, float('nan')],\n"
            "    'nonfinite': [0, 1]})\n"
            "fig = plots.flow(stats)\n"
            "print('pyplot' in ' '.join(sys.modules))\n"
            "fig")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    outputs = nb.cells[0].outputs
    assert outputs[0]["text"].strip() == "False"  # pyplot never imported
    result = [o for o in outputs if o["output_type"] == "execute_result"][0]
    assert "image/png" in result["data"]
