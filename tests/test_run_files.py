"""Run files at the edges: a run stopped in its first step, a run file from someone else
(untrusted: reading it never runs code), and a report never written over its input."""
from __future__ import annotations

import base64
import io
import json
import os
import pickle

import numpy as np
import pandas as pd
import pytest
import torch

import graddbg
from graddbg import GraddbgError, cli
from graddbg._errors import GraddbgValueError
from graddbg.run import Run, stop_reason


def _model():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _trained(steps: int = 3):
    model, opt = _model()
    with graddbg.watch(model, opt) as w:
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(4, 3)).sum().backward()
            opt.step()
    return w


def _report_page(path, capsys):
    assert cli.main(["report", str(path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out == f"graddbg report: wrote {path.with_suffix('.html')}\n"
    return path.with_suffix(".html").read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- stopped runs

def test_a_run_that_raises_in_its_first_step_loads_and_reports_why_it_stopped(tmp_path, capsys):
    model, opt = _model()
    try:
        with graddbg.watch(model, opt) as w:
            model(torch.randn(4, 3)).sum().backward()
            raise RuntimeError("the data loader died in step 0")  # before any optimizer step
    except RuntimeError:
        path = w.save(tmp_path / "run.parquet")
    assert len(w.ledger) == 0 and len(w.steps) == 0
    run = graddbg.load(path)
    # (the with block saw the exception leave it: the watch's own record, before the save's guess)
    assert run.stopped == {"how": "exception", "type": "RuntimeError", "message": "the data loader died in step 0"}
    for name in ("stats", "steps", "ledger"):
        assert len(getattr(run, name)) == 0 and getattr(run, name)["step"].dtype == np.int64, name
    assert run.ledger["skipped"].dtype == bool and run.steps["global_norm"].dtype == np.float64
    assert "the data loader died in step 0" in _report_page(path, capsys)


def test_a_run_with_steps_stopped_by_ctrl_c_keeps_its_steps_and_why(tmp_path, capsys):
    model, opt = _model()
    try:
        with graddbg.watch(model, opt) as w:
            for i in range(3):
                opt.zero_grad()
                model(torch.randn(4, 3)).sum().backward()
                opt.step()
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        path = w.save(tmp_path / "run.parquet")
    run = graddbg.load(path)
    assert run.stopped["how"] == "signal" and run.stopped["signal"] == "SIGINT"
    assert run.steps["step"].tolist() == [0, 1, 2] and run.ledger["step"].tolist() == [0, 1, 2]
    pd.testing.assert_frame_equal(run.stats, w.stats)
    assert "SIGINT" in _report_page(path, capsys)


def test_a_run_saved_outside_any_exception_says_nothing_of_how_it_stopped(tmp_path):
    model, opt = _model()
    w = graddbg.watch(model, opt)  # (no with block: nothing saw how it ended)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    w.close()
    run = graddbg.load(w.save(tmp_path / "run.parquet"))
    assert run.stopped is None and "stopped" not in run.meta
    assert graddbg.load(_trained(2).save(tmp_path / "done.parquet")).stopped == {"how": "completed"}


@pytest.mark.parametrize("exc,expected", [
    (None, {"how": "completed"}),
    (SystemExit(3), {"how": "exit", "type": "SystemExit", "code": 3}),
    (type("Terminated", (BaseException,), {"signum": 15})(), {"signal": "SIGTERM"}),
    (ValueError("x" * 3000), {"how": "exception", "message": "x" * 2000 + "..."}),
])
def test_stop_reason_says_how_a_run_ended(exc, expected):
    reason = stop_reason(exc)
    assert expected.items() <= reason.items(), reason
    json.dumps(reason)  # plain data


def test_every_empty_table_is_saved_with_its_dtypes_and_an_older_files_object_columns_load(tmp_path, monkeypatch):
    """An older graddbg saved empty tables with object columns; load reads them whatever their dtype."""
    def empty(*cols):
        return pd.DataFrame({c: pd.Series([], dtype=object) for c in cols})

    run = Run(empty("step", "name", "module", "numel", "norm", "has_grad"), empty("step", "global_norm"),
              histograms=empty("step", "name", "lo", "hi", "count"),
              activations=empty("step", "module", "grad_norm", "out_nonfinite"),
              ledger=empty("step", "path", "forwards", "update", "skipped"))
    monkeypatch.setattr("graddbg.run._typed_if_empty", lambda name, frame: frame, raising=False)
    old = run.save(tmp_path / "old.parquet")  # as the older graddbg wrote it
    monkeypatch.undo()
    new = run.save(tmp_path / "new.parquet")
    for path in (old, new):
        back = graddbg.load(path)
        for name in ("stats", "steps", "histograms", "activations", "ledger"):
            assert getattr(back, name)["step"].dtype == np.int64, (path.name, name)
        assert back.stats["norm"].dtype == np.float64 and back.stats["has_grad"].dtype == bool
        assert back.histograms["count"].dtype == np.int64 and back.ledger["forwards"].dtype == np.int64
        assert back.ledger["update"].dtype == np.float64 and back.ledger["skipped"].dtype == bool
    import pyarrow as pa
    import pyarrow.parquet as pq

    assert pq.read_schema(new).field("step").type == pa.int64()


# ----------------------------------------------------------------------------- untrusted files

def _payload(marker) -> bytes:
    """Pickled bytes whose unpickling creates ``marker``."""
    class Payload:
        def __reduce__(self):
            return open, (str(marker), "w")
    return pickle.dumps(Payload())


def _with_column(path, name, edit):
    """Rewrite the run at ``path`` with the stats column ``name`` (or the steps table's, for
    ``steps.<name>``) replaced by ``edit(array)``, its metadata kept."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def swap(table):
        i = table.schema.get_field_index(name.split(".")[-1])
        field, array = edit(table.column(i).combine_chunks())
        return table.set_column(i, field, array)

    table = pq.read_table(path)
    md = dict(table.schema.metadata)
    if name.startswith("steps."):
        buf = io.BytesIO()
        pq.write_table(swap(pq.read_table(io.BytesIO(base64.b64decode(md[b"graddbg.steps"])))), buf)
        md[b"graddbg.steps"] = base64.b64encode(buf.getvalue())
    else:
        table = swap(table)
    pq.write_table(table.replace_schema_metadata(md), path)
    return path


def _evil_type():
    """An extension type whose deserialisation, once ``marker`` is set (after the file is
    written: pyarrow's writer deserialises too), makes that file: reading a column of this
    type, registered in this process, runs its code."""
    import pyarrow as pa

    class EvilType(pa.ExtensionType):
        marker = None

        def __init__(self):
            super().__init__(pa.float64(), "graddbg.test.evil")

        def __arrow_ext_serialize__(self):
            return b""

        @classmethod
        def __arrow_ext_deserialize__(cls, storage_type, serialized):
            if cls.marker is not None:
                open(cls.marker, "w").close()
            return cls()
    return EvilType


@pytest.mark.parametrize("where", ["norm", "steps.global_norm"])
def test_a_run_file_with_an_extension_type_is_refused_before_its_code_runs(where, tmp_path, capsys):
    import pyarrow as pa

    EvilType = _evil_type()
    path = _with_column(_trained().save(tmp_path / "evil.parquet"), where,
                        lambda a: (pa.field(where.split(".")[-1], EvilType()),
                                   pa.ExtensionArray.from_storage(EvilType(), a)))
    marker = EvilType.marker = tmp_path / "pwned"
    pa.register_extension_type(EvilType())
    try:
        with pytest.raises(GraddbgError, match="declares an extension type .* refused unread") as info:
            graddbg.load(path)
        assert repr(str(path)) in str(info.value)
        assert cli.main(["report", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"graddbg report: error: path: {str(path)!r}") and "extension type" in err
        assert not marker.exists() and not path.with_suffix(".html").exists()
        import pyarrow.parquet as pq

        pq.read_table(path)  # (the control: pyarrow itself does run it)
        assert where != "norm" or marker.exists()
    finally:
        pa.unregister_extension_type("graddbg.test.evil")


def test_a_pickled_py_extension_type_is_refused_and_never_unpickled(tmp_path, capsys):
    import pyarrow as pa

    proof = tmp_path / "proof"
    pickle.loads(_payload(proof))  # the payload is live
    assert proof.exists()
    marker = tmp_path / "pwned"
    meta = {b"ARROW:extension:name": b"arrow.py_extension_type", b"ARROW:extension:metadata": _payload(marker)}
    path = _with_column(_trained().save(tmp_path / "evil.parquet"), "norm",
                        lambda a: (pa.field("norm", a.type, metadata=meta), a))
    with pytest.raises(GraddbgError, match="declares an extension type"):
        graddbg.load(path)
    assert cli.main(["report", str(path), "--out", str(tmp_path / "r.html")]) == 2
    assert "extension type" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "r.html").exists()


def test_the_pandas_metadata_of_a_run_file_is_ignored(tmp_path):
    import pyarrow.parquet as pq

    w = _trained()
    path = w.save(tmp_path / "run.parquet")
    table = pq.read_table(path)
    forged = {"index_columns": ["no_such_column"], "column_indexes": [], "pandas_version": "9",
              "columns": [{"name": "step", "field_name": "step", "pandas_type": "datetimetz",
                           "numpy_type": "object", "metadata": {"timezone": "Mars/Olympus"}}]}
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, b"pandas": json.dumps(forged).encode()}),
                   path)
    run = graddbg.load(path)
    assert run.stats["step"].dtype == np.int64
    pd.testing.assert_frame_equal(run.stats, w.stats)


def test_a_column_that_is_not_plain_data_is_refused(tmp_path):
    import pyarrow as pa

    path = _with_column(_trained().save(tmp_path / "run.parquet"), "steps.global_norm",
                        lambda a: (pa.field("global_norm", pa.list_(pa.float64())),
                                   pa.array([[v] for v in a.to_pylist()], pa.list_(pa.float64()))))
    with pytest.raises(GraddbgError, match=r"column 'global_norm' of table 'steps' has Arrow type list<"):
        graddbg.load(path)


# ----------------------------------------------------------------------------- never over the input

def _unchanged(path, before: bytes):
    assert path.read_bytes() == before
    graddbg.load(path)


@pytest.mark.parametrize("out", ["same", "hard link", "symbolic link"])
def test_report_refuses_an_out_that_is_its_input(out, tmp_path, capsys):
    path = _trained().save(tmp_path / "r.parquet")
    before = path.read_bytes()
    target = tmp_path / "r.parquet"
    if out == "hard link":
        os.link(path, target := tmp_path / "alias.html")
    elif out == "symbolic link":
        os.symlink(path, target := tmp_path / "alias.html")
    assert cli.main(["report", str(path), "--out", str(target)]) == 2
    assert capsys.readouterr().err == (f"graddbg report: error: --out: {str(target)!r} is the run being read; the "
                                       f"report would overwrite it. --out accepts a new or HTML file that is not an "
                                       f"input, such as {str(tmp_path / 'r.html')!r}\n")
    _unchanged(path, before)


def test_report_of_a_run_named_html_refuses_its_default_output(tmp_path, capsys):
    path = _trained().save(tmp_path / "run.html")
    before = path.read_bytes()
    assert cli.main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"graddbg report: error: --out: not given, and the default {str(path)!r} is the run "
                          f"being read") and repr(str(tmp_path / "run-report.html")) in err
    _unchanged(path, before)
    assert cli.main(["report", str(path), "--out", str(tmp_path / "run-report.html")]) == 0


def test_report_of_a_folder_reads_its_run_and_never_writes_over_one(tmp_path, capsys):
    folder = tmp_path / "graddbg-out"
    folder.mkdir()
    path, other = _trained().save(folder / "stats.parquet"), _trained(2).save(folder / "stats-2.parquet")
    before = {p: p.read_bytes() for p in (path, other)}
    for target, what in ((path, "the run being read"), (other, "a run in the folder being read")):
        assert cli.main(["report", str(folder), "--out", str(target)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"graddbg report: error: --out: {str(target)!r} is {what}"), err
    for p, data in before.items():
        _unchanged(p, data)
    assert cli.main(["report", str(folder)]) == 0
    assert capsys.readouterr().out == f"graddbg report: wrote {folder / 'stats.html'}\n"


def test_report_refuses_to_overwrite_another_parquet_file(tmp_path, capsys):
    path, other = _trained().save(tmp_path / "a.parquet"), _trained(2).save(tmp_path / "b.parquet")
    before = other.read_bytes()
    assert cli.main(["report", str(path), "--out", str(other)]) == 2
    assert f"--out: {str(other)!r} is a parquet file" in capsys.readouterr().err
    _unchanged(other, before)


def test_run_report_refuses_the_file_it_was_loaded_from(tmp_path):
    path = _trained().save(tmp_path / "run.parquet")
    before = path.read_bytes()
    run = graddbg.load(path)
    with pytest.raises(GraddbgValueError, match=r"path: '.*run.parquet' is the run file this Run was loaded from"):
        run.report(path)
    _unchanged(path, before)


def test_a_with_block_records_why_the_run_ended_and_the_file_says_it(tmp_path):
    import torch
    from torch import nn

    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with graddbg.watch(model, opt) as ok:
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
    assert ok.meta["stopped"] == {"how": "completed"}
    with pytest.raises(ValueError, match="bad batch"):
        with graddbg.watch(model, opt) as w:
            model(torch.randn(2, 3)).sum().backward()
            raise ValueError("bad batch")
    path = w.save(tmp_path / "run.parquet")
    assert graddbg.load(path).stopped == {"how": "exception", "type": "ValueError", "message": "bad batch"}
