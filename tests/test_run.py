"""graddbg.run: Run, save/load round trip (parquet + JSON, no pickle), summary, plot and
TensorBoard export, on synthetic frames and on a real recorded run."""
from __future__ import annotations

import json
import math
import sys

import numpy as np
import pandas as pd
import pytest
import torch

import graddbg
from graddbg import GraddbgError
from graddbg._errors import CoverageWarning, GraddbgTypeError, GraddbgValueError
from graddbg.run import FORMAT_VERSION, Run, load, replacing, write_atomic
from test_plots import PARAMS, make_frames


class TinyNet(torch.nn.Module):
    """Two top-level modules used in forward, one never used (no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
        self.head = torch.nn.Linear(8, 2)
        self.unused = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def recorded_watch(n_steps: int = 6, nan_step: int = 3, **kw):
    """A real run: TinyNet trained n_steps under graddbg.watch with histograms; a NaN in
    the input at ``nan_step`` (policy "skip": the bad step leaves the weights alone)."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options = dict(histograms=True, nonfinite="skip", update_every=1)
    options.update(kw)
    with pytest.warns(CoverageWarning, match="unused.weight, unused.bias"):
        with graddbg.watch(model, opt, **options) as w:
            for i in range(n_steps):
                x = torch.randn(16, 4)
                if i == nan_step:
                    x[0, 0] = float("nan")
                (model(x) ** 2).mean().backward()
                opt.step()
                opt.zero_grad()
    return w


def make_run(**kw) -> Run:
    f = make_frames(**kw)
    return Run(f["stats"], f["steps"], f["anomalies"], histograms=f["histograms"], meta=f["meta"])


@pytest.fixture
def run():
    r = make_run(n_steps=8, nan=[(5, "layers.1.weight")], inf=[(6, "head.bias")],
                 huge=[(3, "embed.weight")], zero=["layers.0.bias"], nograd=["scale"],
                 extra_stats=True)
    r.activations = pd.DataFrame({
        "step": np.repeat(np.arange(1, 9, dtype=np.int64), 2),
        "module": ["layers.0", "head"] * 8,
        "grad_norm": [0.5, math.nan, 0.25, math.inf, 1e38, 0.1] + [0.3] * 10,
        "out_nonfinite": np.array([0, 3, 0, 1] + [0] * 12, dtype=np.int64),
    })
    return r


def assert_runs_equal(a, b):
    pd.testing.assert_frame_equal(a.stats, b.stats)
    pd.testing.assert_frame_equal(a.steps, b.steps)
    for name in ("histograms", "activations"):
        fa, fb = getattr(a, name), getattr(b, name)
        assert (fa is None) == (fb is None), name
        if fa is not None:
            pd.testing.assert_frame_equal(fa, fb)
    assert [x.to_dict() for x in a.anomalies] == [x.to_dict() for x in b.anomalies]
    assert a.meta == b.meta


# ----------------------------------------------------------------------------- save / load

def test_save_load_round_trip_with_nan_inf_and_huge(run, tmp_path):
    path = run.save(tmp_path / "run.parquet")
    assert path == tmp_path / "run.parquet" and path.is_file()
    back = graddbg.load(path)
    assert isinstance(back, Run)
    assert_runs_equal(run, back)
    # NaN / Inf / 1e38 survive exactly
    s = back.stats.set_index(["step", "name"])
    assert math.isnan(s.loc[(5, "layers.1.weight"), "norm"])
    assert s.loc[(6, "head.bias"), "norm"] == math.inf
    assert s.loc[(3, "embed.weight"), "norm"] == 1e38
    assert math.isnan(back.anomalies[0].value) and back.anomalies[1].value == math.inf
    assert back.anomalies[0].op == "LogBackward0" and back.anomalies[0].source == "train.py:12"


def test_saved_file_is_plain_parquet_with_json_metadata(run, tmp_path):
    import pyarrow.parquet as pq

    path = run.save(tmp_path / "run.parquet")
    # any parquet reader gets the statistics table directly
    pd.testing.assert_frame_equal(pd.read_parquet(path), run.stats)
    md = pq.read_schema(path).metadata
    doc = json.loads(md[b"graddbg"])
    assert doc["format"] == "graddbg.run" and doc["version"] == FORMAT_VERSION
    assert doc["meta"] == run.meta
    assert [a["kind"] for a in doc["anomalies"]] == ["nonfinite", "nonfinite"]
    assert sorted(doc["tables"]) == ["activations", "histograms", "steps"]
    assert {b"graddbg.steps", b"graddbg.histograms", b"graddbg.activations"} <= set(md)


def test_round_trip_keeps_object_dtypes_and_missing_tables(tmp_path):
    stats = pd.DataFrame({"step": np.array([1, 1], dtype=np.int64),
                          "name": pd.Series(["a.w", "b"], dtype=object),
                          "module": pd.Series(["a", ""], dtype=object),
                          "norm": [1.0, math.nan]})
    steps = pd.DataFrame({"step": np.array([1], dtype=np.int64), "global_norm": [math.nan]})
    assert stats["name"].dtype == object
    r = Run(stats, steps)
    back = load(r.save(tmp_path / "r.parquet"))
    assert back.stats["name"].dtype == object
    assert_runs_equal(r, back)
    assert back.histograms is None and back.activations is None and back.anomalies == []


def test_round_trip_keeps_categorical_names_as_watch_stores_them(tmp_path):
    f = make_frames(3, categorical=True)
    r = Run(f["stats"], f["steps"], f["anomalies"], histograms=f["histograms"], meta=f["meta"])
    assert str(r.stats["name"].dtype) == "category"
    back = load(r.save(tmp_path / "r.parquet"))
    assert_runs_equal(r, back)  # categories keep their dtype (object), not parquet's strings
    assert back.stats["name"].cat.categories.dtype == r.stats["name"].cat.categories.dtype


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="path: no such file"):
        load(tmp_path / "missing.parquet")
    plain = tmp_path / "plain.parquet"
    pd.DataFrame({"x": [1]}).to_parquet(plain)
    with pytest.raises(GraddbgError, match="is a parquet file but not a graddbg run"):
        load(plain)
    text = tmp_path / "notes.parquet"
    text.write_text("hello")
    with pytest.raises(GraddbgError, match="is not a parquet file written by"):
        load(text)
    with pytest.raises(GraddbgValueError, match="is a directory; expected a file"):
        load(tmp_path)
    with pytest.raises(GraddbgValueError, match="is a directory; give a file name such as"):
        make_run(n_steps=2, histograms=False).save(tmp_path)
    with pytest.raises(GraddbgTypeError, match="expected a file name .str or os.PathLike.; got int"):
        make_run(n_steps=2, histograms=False).save(3)


def test_run_constructor_checks_its_arguments():
    f = make_frames(2, histograms=False)
    with pytest.raises(TypeError, match=r"Run\(stats=...\) must be a pandas DataFrame; got dict"):
        Run({"step": [1]}, f["steps"])
    with pytest.raises(TypeError, match=r"Run\(histograms=...\) must be a pandas DataFrame or None"):
        Run(f["stats"], f["steps"], histograms=[1])
    with pytest.raises(TypeError, match="must hold graddbg.anomaly.Anomaly records; got dict"):
        Run(f["stats"], f["steps"], anomalies=[{"step": 1}])
    with pytest.raises(GraddbgTypeError, match="JSON-able"):
        Run(f["stats"], f["steps"], meta={"x": object()}).save("unused.parquet")
    with pytest.raises(GraddbgTypeError, match=r"Run\(meta=...\) must be a dict or None; got list"):
        Run(f["stats"], f["steps"], meta=[1])
    r = Run(f["stats"], f["steps"])
    assert repr(r) == "Run(recorded_steps=2, steps=2, params=8, anomalies=0)"


# ----------------------------------------------------------------------------- views

def test_summary_by_param_and_module_match_naive_reference(run):
    p = run.summary("param")
    assert list(p["name"]) == [n for n, _, _ in PARAMS]
    st = run.stats
    w = st[st.name == "head.weight"]
    row = p.set_index("name").loc["head.weight"]
    assert row["norm_max"] == pytest.approx(w.norm.max())
    assert row["norm_last"] == pytest.approx(w.norm.iloc[-1])
    assert row["nonfinite_total"] == 0
    assert p.set_index("name").loc["layers.1.weight", "nonfinite_total"] == 64
    m = run.summary(by="module").set_index("module")
    last = st[(st.step == 8) & (st.module == "layers.0")]
    assert m.loc["layers.0", "norm_last"] == pytest.approx(math.sqrt((last.norm ** 2).sum()))
    assert m.loc["layers.0", "params"] == 2
    with pytest.raises(ValueError, match="by"):
        run.summary(by="layer")


def test_summary_of_a_run_without_the_columns_it_needs_names_them():
    r = Run(pd.DataFrame({"step": [1], "name": ["w"]}), pd.DataFrame({"step": [1]}))
    with pytest.raises(GraddbgValueError, match=r"summary\(by='param'\): this run's stats have no "
                                                r"column 'module', 'numel', 'norm', .*; its columns are \['step', 'name'\]"):
        r.summary()


def test_plot_delegates_to_plots(run):
    assert run.plot().axes[0].get_title() == "Gradient flow at step 8"
    assert run.plot("flow", step=5).axes[0].get_title() == "Gradient flow at step 5"
    ax = run.plot("norms").axes[0]
    # the steps frame and the anomalies reach the plot
    assert {c.get_gid() for c in ax.collections} >= {"anomaly-nonfinite"}
    assert [l for l in ax.get_lines() if l.get_gid() == "global"]
    fig = run.plot("hist", at=[1, 5], names=["layers.1.weight"])
    assert any(t.get_text() == "step 5: 64 NaN/Inf" for t in fig.axes[0].texts)
    assert run.plot("update").axes[0].get_title() == "Update / weight ratio"
    with pytest.raises(ValueError, match="kind must be one of"):
        run.plot("pie")


# ----------------------------------------------------------------------------- tensorboard

def _events(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    ea.Reload()
    return ea


def test_to_tensorboard_writes_scalars_histograms_and_text(run, tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir=str(tmp_path)) as writer:
        run.to_tensorboard(writer)
    ea = _events(tmp_path)
    scalars = set(ea.Tags()["scalars"])
    assert {"graddbg/global_norm", "graddbg/nonfinite", "graddbg/lr",
            "graddbg/norm/head.weight", "graddbg/nonfinite/layers.1.weight"} <= scalars
    g = {e.step: e.value for e in ea.Scalars("graddbg/global_norm")}
    want = run.steps.set_index("step")["global_norm"]
    assert sorted(g) == [s for s in want.index if math.isfinite(want[s])]  # NaN/Inf left out
    for s, v in g.items():
        assert v == pytest.approx(want[s], rel=1e-6)
    # the non-finite value is left out of the norm series and counted in the nonfinite one
    assert 5 not in {e.step for e in ea.Scalars("graddbg/norm/layers.1.weight")}
    nf = {e.step: e.value for e in ea.Scalars("graddbg/nonfinite/layers.1.weight")}
    assert nf[5] == 64 and nf[4] == 0
    huge = {e.step: e.value for e in ea.Scalars("graddbg/norm/embed.weight")}
    assert huge[3] == pytest.approx(1e38, rel=1e-6)
    hist_tags = ea.Tags()["histograms"]
    assert "graddbg/grad_abs/head.weight" in hist_tags and "graddbg/grad_abs/scale" not in hist_tags
    h = {e.step: e.histogram_value for e in ea.Histograms("graddbg/grad_abs/head.weight")}
    want_counts = run.histograms[(run.histograms.name == "head.weight") & (run.histograms.step == 2)]
    assert list(h[2].bucket) == [float(c) for c in want_counts.sort_values("lo")["count"]]
    assert h[2].num == want_counts["count"].sum()
    texts = ea.Tags()["tensors"]
    assert "graddbg/anomalies/text_summary" in texts


def test_to_tensorboard_all_nan_and_negative_inf(tmp_path):
    names = [p[0] for p in PARAMS]
    r = make_run(n_steps=3, nan=[(s, n) for s in (1, 2, 3) for n in names])
    r.steps["global_norm"] = math.nan
    r.steps.loc[r.steps.step == 2, "lr"] = -math.inf
    r.to_tensorboard(tmp_path)
    ea = _events(tmp_path)
    scalars = set(ea.Tags()["scalars"])
    assert not any(t.startswith(("graddbg/norm/", "graddbg/absmax/")) for t in scalars)
    assert "graddbg/global_norm" not in scalars
    assert [e.step for e in ea.Scalars("graddbg/lr")] == [1, 3]
    assert [e.value for e in ea.Scalars("graddbg/nonfinite/head.weight")] == [16, 16, 16]
    # every entry was NaN: the bins are empty, so no histogram is written for them
    assert ea.Tags()["histograms"] == []


def test_to_tensorboard_accepts_a_log_directory(run, tmp_path):
    run.to_tensorboard(tmp_path / "logs")
    ea = _events(tmp_path / "logs")
    assert "graddbg/global_norm" in ea.Tags()["scalars"]


def test_to_tensorboard_without_tensorboard_says_how_to_install(run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        run.to_tensorboard(tmp_path / "logs")
    with pytest.raises(TypeError, match="writer must be a tensorboard SummaryWriter"):
        run.to_tensorboard(42)


# ----------------------------------------------------------------------------- real run

def test_real_run_round_trips_through_save_and_load(tmp_path):
    w = recorded_watch()
    path = w.save(tmp_path / "real.parquet")
    back = graddbg.load(path)
    assert_runs_equal(w.to_run(), back)
    assert back.histograms is not None and len(back.histograms) > 0
    assert back.meta["uncovered"] == ["unused.weight", "unused.bias"]
    assert [a.kind for a in back.anomalies] == ["nonfinite", "unused_param"]
    assert back.anomalies[0].step == 3


def test_real_run_plots_show_what_happened():
    w = recorded_watch()
    run = w.to_run()
    names = list(dict.fromkeys(run.stats["name"]))
    bad_step = run.anomalies[0].step
    ax = run.plot("flow", step=bad_step).axes[0]
    marks = {l.get_gid(): l for l in ax.get_lines() if l.get_gid()}
    bad = set(run.stats[(run.stats.step == bad_step) & (run.stats.nonfinite > 0)].name)
    assert bad  # the NaN input poisons every used parameter's gradient
    assert [names[int(i)] for i in marks["nonfinite"].get_xdata()] == [n for n in names if n in bad]
    assert [names[int(i)] for i in marks["nograd"].get_xdata()] == ["unused.weight", "unused.bias"]
    ax = w.plot("norms").axes[0]
    assert bad_step in list({l.get_gid(): l for l in ax.get_lines() if l.get_gid()}["nonfinite"].get_xdata())
    assert [l.get_label() for l in ax.get_lines() if (l.get_gid() or "").startswith("series:")] == \
        ["body", "head", "unused"]
    seg = {c.get_gid(): c for c in ax.collections}["anomaly-nonfinite"].get_segments()
    assert [s[0][0] for s in seg] == [bad_step]
    fig = w.plot("hist", at=[0, bad_step], names=["head.weight"])
    assert fig.axes[0].get_title() == "head.weight"
    assert any("NaN/Inf" in t.get_text() for t in fig.axes[0].texts)
    ax = w.plot("update").axes[0]
    assert {"guide", "series:head.weight"} <= {l.get_gid() for l in ax.get_lines()}


# ----------------------------------------------------------------------------- tampered files

def _rewrite(path, *, doc=None, meta=None, stats=None):
    """Rewrite a saved run in place: ``doc(d)`` edits the JSON document, ``meta(md)`` the
    raw metadata dict, ``stats(df)`` returns the stats table to store instead."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    md = dict(table.schema.metadata)
    if doc is not None:
        d = json.loads(md[b"graddbg"])
        doc(d)
        md[b"graddbg"] = json.dumps(d).encode()
    if meta is not None:
        meta(md)
    if stats is not None:
        new = pa.Table.from_pandas(stats(table.to_pandas()))
        md = {**{k: v for k, v in md.items() if k != b"pandas"}, b"pandas": new.schema.metadata[b"pandas"]}
        table = new
    pq.write_table(table.replace_schema_metadata(md), path)


def _nested(name, frame_edit):
    """A meta edit that replaces the base64 table ``name`` by ``frame_edit(frame)``."""
    import base64
    import io

    def edit(md):
        key = b"graddbg." + name.encode()
        frame = pd.read_parquet(io.BytesIO(base64.b64decode(md[key])))
        buf = io.BytesIO()
        frame_edit(frame).to_parquet(buf)
        md[key] = base64.b64encode(buf.getvalue())
    return edit


def _set(key, value):
    return lambda d: d.__setitem__(key, value)


def _anomaly(**change):
    def edit(d):
        d["anomalies"][0].update(change)
        for k, v in list(change.items()):
            if v is _DROP:
                del d["anomalies"][0][k]
    return edit


_DROP = object()

TAMPERED = {
    # the JSON document
    "bad-json": (dict(meta=lambda md: md.__setitem__(b"graddbg", b"{not json")), "metadata is not valid JSON"),
    "not-utf8": (dict(meta=lambda md: md.__setitem__(b"graddbg", b"\xff\xfe{}")), "metadata is not valid JSON"),
    "document-is-a-list": (dict(meta=lambda md: md.__setitem__(b"graddbg", b"[1, 2]")),
                           "metadata is a JSON list, expected an object"),
    "wrong-format": (dict(doc=_set("format", "other.run")), "metadata 'format' is 'other.run'"),
    "anomalies-not-a-list": (dict(doc=_set("anomalies", {"a": 1})), "metadata 'anomalies' must be a list; got dict"),
    "meta-is-a-list": (dict(doc=_set("meta", [1, 2])), "metadata 'meta' must be an object; got list"),
    "unknown-table": (dict(doc=_set("tables", ["steps", "secrets"])), "metadata 'tables' must be a list of table names"),
    "dtypes-not-a-mapping": (dict(doc=_set("dtypes", {"stats": ["int64"]})), "metadata 'dtypes' must be an object"),
    # the version
    "version-negative": (dict(doc=_set("version", -7)), "unknown format version -7"),
    "version-zero": (dict(doc=_set("version", 0)), "unknown format version 0"),
    "version-string": (dict(doc=_set("version", "1")), "unknown format version '1'"),
    "version-bool": (dict(doc=_set("version", True)), "unknown format version True"),
    "version-missing": (dict(doc=lambda d: d.pop("version")), "unknown format version None"),
    "version-future": (dict(doc=_set("version", FORMAT_VERSION + 1)),
                       f"format version {FORMAT_VERSION + 1}; this graddbg reads versions up to {FORMAT_VERSION}"),
    # the anomalies
    "anomaly-not-an-object": (dict(doc=_set("anomalies", [3])), "anomaly 0 is a JSON int, expected an object"),
    "anomaly-missing-fields": (dict(doc=_set("anomalies", [{"step": 1}])), "anomaly 0 has no field 'kind', 'name'"),
    "anomaly-missing-message": (dict(doc=_anomaly(message=_DROP)), "anomaly 0 has no field 'message'"),
    "anomaly-step-a-string": (dict(doc=_anomaly(step="five")), "anomaly 0: field 'step' is str \"five\", expected int"),
    "anomaly-step-a-bool": (dict(doc=_anomaly(step=True)), "field 'step' is bool true, expected int"),
    "anomaly-value-not-a-number": (dict(doc=_anomaly(value="lots")), "field 'value' is 'lots', expected a number"),
    "anomaly-kind-a-list": (dict(doc=_anomaly(kind=["nonfinite"])), "field 'kind' is list"),
    "anomaly-params-not-names": (dict(doc=_anomaly(params=[1, 2])), "field 'params' must be a list of parameter names"),
    # the other tables
    "bad-base64": (dict(meta=lambda md: md.__setitem__(b"graddbg.steps", b"!!not base64!!")),
                   "table 'steps' is not valid base64"),
    "base64-not-parquet": (dict(meta=lambda md: md.__setitem__(b"graddbg.steps", b"aGVsbG8=")),
                           "table 'steps' is not parquet"),
    "listed-table-missing": (dict(meta=lambda md: md.pop(b"graddbg.histograms")),
                             "table 'histograms' is listed in the metadata but missing"),
    "steps-without-step": (dict(meta=_nested("steps", lambda f: f.drop(columns=["step"]))),
                           "table 'steps' has no column 'step'"),
    "histogram-counts-as-text": (dict(meta=_nested("histograms", lambda f: f.assign(count=f["count"].astype(str)))),
                                 "column 'count' of table 'histograms' holds"),
    # the statistics table
    "stats-without-name": (dict(stats=lambda f: f.drop(columns=["name"])), "table 'stats' has no column 'name'"),
    "stats-without-norm": (dict(stats=lambda f: f.drop(columns=["norm"])), "table 'stats' has no column 'norm'"),
    "stats-step-as-text": (dict(stats=lambda f: f.assign(step=f["step"].astype(str))),
                           "column 'step' of table 'stats' holds"),
    "stats-norm-as-text": (dict(stats=lambda f: f.assign(norm=f["norm"].astype(str))),
                           "column 'norm' of table 'stats' holds"),
    "stats-has-grad-as-float": (dict(stats=lambda f: f.assign(has_grad=f["has_grad"].astype(float))),
                                "column 'has_grad' of table 'stats' holds float64 values, expected bool"),
}


@pytest.mark.parametrize("case", list(TAMPERED))
def test_load_of_a_tampered_file_names_the_file_and_the_fault(case, tmp_path):
    edits, message = TAMPERED[case]
    path = make_run(n_steps=3, nan=[(2, "head.bias")]).save(tmp_path / "run.parquet")
    load(path)  # whole before the edit
    _rewrite(path, **edits)
    with pytest.raises(GraddbgError) as info:
        load(path)
    text = str(info.value)
    assert repr(str(path)) in text and message in text, text
    assert type(info.value).__module__ == "graddbg._errors"  # not JSONDecodeError, KeyError, ...


def test_load_accepts_fields_and_keys_of_a_later_minor_version(tmp_path):
    path = make_run(n_steps=2, nan=[(2, "head.bias")]).save(tmp_path / "run.parquet")
    _rewrite(path, doc=lambda d: (d.__setitem__("future", {"x": 1}), d["anomalies"][0].__setitem__("hint", "x")))
    assert load(path).anomalies[0].step == 2


# ----------------------------------------------------------------------------- atomic writes

def test_replacing_leaves_the_previous_file_when_the_writer_fails(tmp_path):
    target = tmp_path / "a.txt"
    write_atomic(target, "first")
    with pytest.raises(ZeroDivisionError):
        with replacing(target) as tmp:
            tmp.write_text("half written")
            1 / 0
    assert target.read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]
    with pytest.raises(GraddbgError, match=r"could not write '.*nowhere/a.txt': No such file or directory; "
                                           r"nothing was written"):
        write_atomic(tmp_path / "nowhere" / "a.txt", b"x")
    with pytest.raises(GraddbgTypeError, match="must be str or bytes; got int"):
        write_atomic(target, 3)


_FULL_DISK = r"""
import json, math, resource, signal, sys
import numpy as np, pandas as pd, torch
import graddbg
from graddbg.report import render_report, write_report
from graddbg.run import Run

out = sys.argv[1]
rng = np.random.default_rng(1)
n = 20_000
big = Run(pd.DataFrame({"step": np.arange(n), "name": ["w"] * n, "module": [""] * n, "numel": [4] * n,
                        "norm": rng.random(n), "absmax": rng.random(n), "nonfinite": [0] * n}),
          pd.DataFrame({"step": np.arange(n), "global_norm": rng.random(n)}))
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with graddbg.watch(model, opt) as w:
    for _ in range(30):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
render_report(w)  # every import done, every cache written before the limit
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.RLIM_INFINITY))
results = {}
for what, write in (("run", lambda: big.save(out + "/run.parquet")),
                    ("watch", lambda: w.save(out + "/watch.parquet")),
                    ("report", lambda: write_report(big, out + "/report.html"))):
    try:
        write()
        results[what] = "written"
    except graddbg.GraddbgError as e:
        results[what] = str(e)
print(json.dumps(results))
"""


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_a_save_that_runs_out_of_space_leaves_the_previous_file_whole(tmp_path):
    import subprocess

    small = make_run(n_steps=2, histograms=False)
    before = {"run": small.save(tmp_path / "run.parquet"), "watch": small.save(tmp_path / "watch.parquet"),
              "report": small.report(tmp_path / "report.html")}
    content = {k: p.read_bytes() for k, p in before.items()}
    res = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path)], capture_output=True,
                         text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    results = json.loads(res.stdout.strip().splitlines()[-1])
    for what, path in before.items():
        assert results[what].startswith(f"could not write {str(path)!r}: File too large; the previous "
                                        f"file is left as it was"), results[what]
        assert path.read_bytes() == content[what], what  # byte-identical
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html", "run.parquet", "watch.parquet"]
    assert_runs_equal(load(before["run"]), load(tmp_path / "run.parquet"))
