"""A recorded run as data: `Run`, saved to and loaded from one parquet file.

``Watch.to_run()`` gives a `Run`; ``graddbg.load(path)`` reads one back. A Run has
the attributes of the run contract (``stats``, ``steps``, ``anomalies``, ``histograms``,
``activations``, ``meta``) and the methods that work on them: ``summary``, ``plot``,
``report``, ``save`` and ``to_tensorboard``.

The file format is plain parquet, no pickle: the table is ``stats`` (so any parquet
reader, ``pandas.read_parquet(path)`` included, reads the statistics directly), and the
schema metadata holds the rest: a JSON document under the key ``graddbg`` (format version,
anomalies through ``Anomaly.to_dict``, ``meta``, column dtypes) and the other tables
(``steps``, ``histograms``, ``activations``) as base64-encoded parquet under
``graddbg.<table>``.

Files are written atomically (`replacing` of ``graddbg._io``, importable from here
too: a temporary file in the same folder, then ``os.replace``), so a failed write leaves
the previous file whole. `load` validates everything it reads and raises a
`graddbg.GraddbgError` naming the file and what is wrong with it.

pandas and pyarrow are imported inside the functions that need them.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import json
import math
import os
import pathlib
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Union

from graddbg._errors import GraddbgError, GraddbgTypeError, GraddbgValueError
from graddbg._io import as_path, file_target, replacing, write_atomic
from graddbg.anomaly import Anomaly

if TYPE_CHECKING:  # pragma: no cover - type names only
    import pandas
    from matplotlib.figure import Figure

__all__ = ["Run", "load", "FORMAT_VERSION"]

FORMAT_VERSION = 1
_META_KEY = b"graddbg"
_TABLES = ("steps", "histograms", "activations", "ledger")
PathLike = Union[str, "os.PathLike[str]"]

# what load() insists on: the columns every table needs, and the kind of known columns
_REQUIRED = {"stats": ("step", "name"), "steps": ("step",),
             "histograms": ("step", "name", "lo", "hi", "count"),
             "activations": ("step", "module", "grad_norm", "out_nonfinite"),
             "ledger": ("step", "path")}
_NUMBER = ("int", "float")
_KINDS = {
    "stats": {"step": ("int",), "name": ("text",), "module": ("text",), "numel": ("int",),
              "norm": _NUMBER, "absmax": _NUMBER, "nonfinite": ("int",),
              "update_ratio": _NUMBER, "has_grad": ("bool",)},
    "steps": {"step": ("int",), "global_norm": _NUMBER, "clipped_norm": _NUMBER,
              "nonfinite": ("int",), "overflow": ("bool",), "scale": _NUMBER,
              "recorded": ("bool",), "lr": _NUMBER},
    "histograms": {"step": ("int",), "name": ("text",), "lo": _NUMBER, "hi": _NUMBER,
                   "count": ("int",)},
    "activations": {"step": ("int",), "module": ("text",), "grad_norm": _NUMBER,
                    "out_nonfinite": ("int",)},
    "ledger": {"step": ("int",), "path": ("text",)},
}


# ---------------------------------------------------------------------- files

# ---------------------------------------------------------------------- Run

class Run:
    """The data of one recorded run, with plots, report and export.

    `Watch.to_run()` makes one, `load` reads one back; `Watch.save` writes one.

    Args:
        stats: the per-(step, parameter) statistics (`Watch.stats`).
        steps: the per-step frame (`Watch.steps`).
        anomalies: the `Anomaly` records.
        histograms: the gradient histograms, when recorded.
        activations: the activation statistics, when recorded.
        ledger: the step ledger (`Watch.ledger`: what happened in each step), when kept.
        meta: facts about the run (model, optimizer, options, torch version, ...).

    Examples:
        >>> import pandas as pd
        >>> stats = pd.DataFrame({"step": [1], "name": ["w"], "module": [""], "numel": [3],
        ...     "norm": [0.5], "absmax": [0.4], "nonfinite": [0], "update_ratio": [1e-3],
        ...     "has_grad": [True]})
        >>> steps = pd.DataFrame({"step": [1], "global_norm": [0.5]})
        >>> run = Run(stats, steps, meta={"model": "Linear"})
        >>> run
        Run(recorded_steps=1, steps=1, params=1, anomalies=0)
    """

    def __init__(self, stats: "pandas.DataFrame", steps: "pandas.DataFrame",
                 anomalies: Iterable[Anomaly] = (),
                 histograms: Optional["pandas.DataFrame"] = None,
                 activations: Optional["pandas.DataFrame"] = None,
                 meta: Optional[Dict[str, Any]] = None, ledger: Optional["pandas.DataFrame"] = None) -> None:
        import pandas as pd

        for arg, value, optional in (("stats", stats, False), ("steps", steps, False),
                                     ("histograms", histograms, True),
                                     ("activations", activations, True), ("ledger", ledger, True)):
            if not isinstance(value, pd.DataFrame) and not (optional and value is None):
                accepted = "a pandas DataFrame" + (" or None" if optional else "")
                raise GraddbgTypeError(f"Run({arg}=...) must be {accepted}; got {type(value).__name__}")
        anomalies = list(anomalies)
        for a in anomalies:
            if not isinstance(a, Anomaly):
                raise GraddbgTypeError(f"Run(anomalies=...) must hold graddbg.anomaly.Anomaly "
                                       f"records; got {type(a).__name__}")
        if meta is not None and not isinstance(meta, dict):
            raise GraddbgTypeError(f"Run(meta=...) must be a dict or None; got {type(meta).__name__}")
        self.stats = stats
        self.steps = steps
        self.anomalies: List[Anomaly] = anomalies
        self.histograms = histograms
        self.activations = activations
        self.ledger = ledger
        self.meta: Dict[str, Any] = dict(meta or {})

    def __repr__(self) -> str:
        n_rec = self.stats["step"].nunique() if "step" in self.stats.columns else 0
        n_par = self.stats["name"].nunique() if "name" in self.stats.columns else 0
        return (f"Run(recorded_steps={n_rec}, steps={len(self.steps)}, params={n_par}, "
                f"anomalies={len(self.anomalies)})")

    # ------------------------------------------------------------------ views
    def summary(self, by: str = "param") -> "pandas.DataFrame":
        """One row per parameter or per module, over all recorded steps (see `summarize`).

        Args:
            by: ``"param"``, or ``"module"`` (norms rolled up as the root of the sum of squares).

        Returns:
            pandas.DataFrame: the summary table.

        Raises:
            GraddbgValueError: ``by`` is neither ``"param"`` nor ``"module"``.
        """
        from graddbg.stats import summarize

        try:
            return summarize(self.stats, by=by)
        except KeyError as e:
            missing = [c for c in _KINDS["stats"] if c not in self.stats.columns] or [str(e)]
            raise GraddbgValueError(f"summary(by={by!r}): this run's stats have no column "
                                    f"{', '.join(map(repr, missing))}; its columns are "
                                    f"{[str(c) for c in self.stats.columns]}") from None

    def plot(self, kind: str = "flow", **kw: Any) -> "Figure":
        """A matplotlib figure of this run.

        Args:
            kind: ``"flow"``, ``"norms"``, ``"heatmap"``, ``"update"`` or ``"hist"``.
            **kw: passed on to the function of `graddbg.plots`.

        Returns:
            matplotlib.figure.Figure: the figure.

        Raises:
            GraddbgValueError: an unknown ``kind``, or ``"hist"`` for a run without histograms.

        Examples:
            >>> import pandas as pd
            >>> run = Run(pd.DataFrame({"step": [1], "name": ["w"], "module": [""], "numel": [3],
            ...     "norm": [0.5], "absmax": [0.4], "nonfinite": [0]}),
            ...     pd.DataFrame({"step": [1], "global_norm": [0.5]}))
            >>> run.plot("norms").axes[0].get_yscale()
            'log'
        """
        from graddbg import plots

        return plots.plot(kind, self.stats, steps=self.steps, anomalies=self.anomalies,
                          histograms=self.histograms, **kw)

    def report(self, path: PathLike, graph: Any = None, *,
               title: Optional[str] = None) -> pathlib.Path:
        """Write one self-contained HTML report (see `graddbg.report.write_report`).

        Args:
            path: where to write it.
            graph: optional graph to include (a `Graph`, SVG or DOT text, or a root tensor).
            title: the page title.

        Returns:
            pathlib.Path: ``path``.

        Raises:
            GraddbgError: the file cannot be written.
        """
        from graddbg.report import write_report

        return write_report(self, path, graph=graph, title=title)

    # ------------------------------------------------------------------ persistence
    def save(self, path: PathLike) -> pathlib.Path:
        """Write the run to one parquet file (no pickle) that `load` reads back.

        The write is atomic: on failure the previous file at ``path`` is left whole.

        Args:
            path: the file to write (conventionally ``*.parquet``).

        Returns:
            pathlib.Path: ``path``.

        Raises:
            GraddbgError: the file cannot be written; the message names the path.

        Examples:
            >>> import pandas as pd, tempfile, os
            >>> run = Run(pd.DataFrame({"step": [1], "name": ["w"], "norm": [float("nan")]}),
            ...           pd.DataFrame({"step": [1], "global_norm": [float("nan")]}))
            >>> with tempfile.TemporaryDirectory() as d:
            ...     back = load(run.save(os.path.join(d, "run.parquet")))
            >>> back.stats.equals(run.stats)
            True
        """
        import pyarrow.parquet as pq

        path = file_target(path, "run.parquet")
        table = self._table()
        with replacing(path) as tmp:
            pq.write_table(table, tmp, compression="zstd")
        return path

    def _table(self) -> Any:
        """The stats table with the rest of the run in its schema metadata."""
        import pyarrow as pa

        doc: Dict[str, Any] = {
            "format": "graddbg.run", "version": FORMAT_VERSION,
            "anomalies": [a.to_dict() for a in self.anomalies], "meta": self.meta,
            "dtypes": {"stats": _dtypes(self.stats)}, "tables": [],
            "categories": {"stats": _category_dtypes(self.stats)},
        }
        metadata: Dict[bytes, bytes] = {}
        for name in _TABLES:
            frame = getattr(self, name)
            if frame is not None:
                doc["tables"].append(name)
                doc["dtypes"][name] = _dtypes(frame)
                doc["categories"][name] = _category_dtypes(frame)
                metadata[b"graddbg." + name.encode()] = base64.b64encode(_parquet_bytes(frame))
        try:
            text = json.dumps(doc, allow_nan=True)
        except (TypeError, ValueError) as e:
            raise GraddbgTypeError(f"Run.meta must hold JSON-able values only (str, numbers, "
                                   f"bool, None, lists, dicts): {e}") from e
        table = pa.Table.from_pandas(self.stats)
        metadata = {**(table.schema.metadata or {}), _META_KEY: text.encode("utf-8"), **metadata}
        return table.replace_schema_metadata(metadata)

    def to_tensorboard(self, writer: Any, *, prefix: str = "graddbg") -> None:
        """Write the run to TensorBoard.

        Per-step scalars (global norm, non-finite count, overflow, scale, lr), per-parameter
        scalars (``norm``, ``absmax``, ``update_ratio``, ``nonfinite``), the ``|grad|``
        histograms and the anomalies as text. TensorBoard cannot show NaN/Inf, so non-finite
        values are left out of the value series and counted in the ``nonfinite`` series instead.

        Args:
            writer: a ``torch.utils.tensorboard.SummaryWriter`` (anything with ``add_scalar``)
                or a log directory.
            prefix: the tag prefix (``graddbg/global_norm``, ...).

        Raises:
            GraddbgTypeError: ``writer`` is neither, or ``prefix`` is not a str.

        Examples:
            >>> import pandas as pd, tempfile
            >>> run = Run(pd.DataFrame({"step": [1], "name": ["w"], "norm": [0.5]}),
            ...           pd.DataFrame({"step": [1], "global_norm": [0.5]}))
            >>> with tempfile.TemporaryDirectory() as d:
            ...     run.to_tensorboard(d)
        """
        if not isinstance(prefix, str):
            raise GraddbgTypeError(f"to_tensorboard(prefix=...) must be a str; got {type(prefix).__name__}")
        if isinstance(writer, (str, os.PathLike)):
            SummaryWriter = _summary_writer_class()
            with SummaryWriter(log_dir=os.fspath(writer)) as w:
                _write_tensorboard(self, w, prefix)
            return
        if not hasattr(writer, "add_scalar"):
            raise GraddbgTypeError("writer must be a tensorboard SummaryWriter (something with "
                                   f"add_scalar) or a log directory; got {type(writer).__name__}")
        _write_tensorboard(self, writer, prefix)
        writer.flush()


# ---------------------------------------------------------------------- load

def load(path: PathLike) -> Run:
    """Read a run written by `Watch.save` / `Run.save`.

    Everything read is checked: a file that is not such a run, or whose metadata or
    tables were damaged or edited (bad JSON, wrong types, bad base64, incomplete anomalies,
    an unknown format version, missing columns, wrong column types) is refused.

    Args:
        path: the parquet file.

    Returns:
        Run: the statistics, steps, anomalies, histograms and metadata.

    Raises:
        FileNotFoundError: there is no file at ``path``.
        GraddbgError: the file is unreadable or not a graddbg run, or was damaged; the
            message names the file and what is wrong with it.

    Examples:
        >>> import pandas as pd, tempfile, os
        >>> run = Run(pd.DataFrame({"step": [1], "name": ["w"]}), pd.DataFrame({"step": [1]}),
        ...           meta={"model": "Linear"})
        >>> with tempfile.TemporaryDirectory() as d:
        ...     load(run.save(os.path.join(d, "run.parquet"))).meta
        {'model': 'Linear'}
    """
    path = as_path(path, "path")
    if not path.exists():
        raise FileNotFoundError(f"path: no such file {str(path)!r}")
    if path.is_dir():
        raise GraddbgValueError(f"path: {str(path)!r} is a directory; expected a file written "
                                f"by Watch.save / Run.save")
    table = _read_parquet(path)
    metadata = table.schema.metadata or {}
    doc = _read_doc(path, metadata)
    dtypes = {"": doc.get("dtypes") or {}, "categories": doc.get("categories") or {}}
    frames = {"stats": _frame(path, "stats", table, dtypes)}
    for name in _TABLES:
        frames[name] = _subtable(path, name, metadata, dtypes) if name in (doc.get("tables") or []) else None
    steps = frames["steps"]
    if steps is None:
        import pandas as pd

        steps = pd.DataFrame({"step": pd.Series([], dtype="int64")})
    anomalies = _anomalies(path, doc.get("anomalies") or [])
    return Run(frames["stats"], steps, anomalies, histograms=frames["histograms"],
               activations=frames["activations"], meta=doc.get("meta") or {}, ledger=frames["ledger"])


def _Invalid(path: pathlib.Path, what: str) -> GraddbgError:
    """What load() raises for a damaged or edited file."""
    return GraddbgError(f"path: {str(path)!r} is not a valid graddbg run: {what}")


def _read_parquet(path: pathlib.Path) -> Any:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid for non-parquet input
        raise GraddbgError(f"path: {str(path)!r} is not a parquet file written by "
                           f"Watch.save / Run.save ({type(e).__name__}: {e})") from e
    if _META_KEY not in (table.schema.metadata or {}):
        raise GraddbgError(f"path: {str(path)!r} is a parquet file but not a graddbg run "
                           f"(it has no 'graddbg' metadata); write runs with Watch.save or "
                           f"Run.save")
    return table


def _read_doc(path: pathlib.Path, metadata: Dict[bytes, bytes]) -> Dict[str, Any]:
    """The JSON document of the metadata, its version and the types of its fields checked."""
    try:
        doc = json.loads(metadata[_META_KEY].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _Invalid(path, f"its 'graddbg' metadata is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise _Invalid(path, f"its 'graddbg' metadata is a JSON {type(doc).__name__}, expected an object")
    if doc.get("format") != "graddbg.run":
        raise _Invalid(path, f"metadata 'format' is {doc.get('format')!r}, expected 'graddbg.run'")
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise _Invalid(path, f"unknown format version {version!r} (versions are integers from 1)")
    if version > FORMAT_VERSION:
        raise GraddbgError(f"path: {str(path)!r} holds graddbg run format version {version!r}; "
                           f"this graddbg reads versions up to {FORMAT_VERSION} (upgrade graddbg)")
    for key, want, ok in (("anomalies", "a list", lambda v: isinstance(v, list)),
                          ("meta", "an object", lambda v: isinstance(v, dict)),
                          ("tables", "a list of table names", _table_names),
                          ("dtypes", "an object of table -> {column: dtype}", _dtype_doc),
                          ("categories", "an object of table -> {column: dtype}", _dtype_doc)):
        if doc.get(key) is not None and not ok(doc[key]):
            raise _Invalid(path, f"metadata {key!r} must be {want}; got {_describe(doc[key])}")
    return doc


def _table_names(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, str) and t in _TABLES for t in v)


def _dtype_doc(v: Any) -> bool:
    return isinstance(v, dict) and all(
        isinstance(cols, dict) and all(isinstance(c, str) and isinstance(t, str) for c, t in cols.items())
        for cols in v.values())


def _describe(v: Any) -> str:
    text = json.dumps(v, default=str)
    return f"{type(v).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _subtable(path: pathlib.Path, name: str, metadata: Dict[bytes, bytes],
              dtypes: Dict[str, Any]) -> "pandas.DataFrame":
    import pyarrow.parquet as pq

    raw = metadata.get(b"graddbg." + name.encode())
    if raw is None:
        raise _Invalid(path, f"table {name!r} is listed in the metadata but missing")
    try:
        data = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _Invalid(path, f"table {name!r} is not valid base64 ({e})") from None
    try:
        table = pq.read_table(io.BytesIO(data))
    except Exception as e:  # pyarrow's ArrowInvalid and friends
        raise _Invalid(path, f"table {name!r} is not parquet ({type(e).__name__}: {e})") from None
    return _frame(path, name, table, dtypes)


def _frame(path: pathlib.Path, name: str, table: Any, dtypes: Dict[str, Any]) -> "pandas.DataFrame":
    """The table as a DataFrame with its recorded dtypes, its columns checked."""
    try:
        frame = table.to_pandas()
    except Exception as e:  # damaged pandas metadata
        raise _Invalid(path, f"table {name!r} cannot be read ({type(e).__name__}: {e})") from None
    recorded = dtypes[""].get(name) or {}
    frame = _restore(frame, recorded, dtypes["categories"].get(name) or {})
    missing = [c for c in _REQUIRED[name] if c not in frame.columns]
    missing += [c for c in recorded if c not in frame.columns and c not in missing]
    if missing:
        raise _Invalid(path, f"table {name!r} has no column {', '.join(map(repr, missing))} "
                             f"(its columns: {[str(c) for c in frame.columns]})")
    for col in frame.columns:
        kind = _kind(frame[col].dtype)
        want = _KINDS[name].get(str(col))
        was = _kind_of_name(recorded.get(str(col)))
        if (want is not None and kind not in want) or (was not in (None, "other") and kind != was):
            expected = " or ".join(want) if want is not None else was
            raise _Invalid(path, f"column {str(col)!r} of table {name!r} holds {frame[col].dtype} "
                                 f"values, expected {expected}")
    return frame


def _kind(dtype: Any) -> str:
    """"int", "float", "bool", "text" or "other": what a column holds, whatever its dtype."""
    import pandas as pd
    from pandas.api import types

    if isinstance(dtype, pd.CategoricalDtype):
        return "text" if _kind(dtype.categories.dtype) == "text" else "other"
    if types.is_bool_dtype(dtype):
        return "bool"
    if types.is_integer_dtype(dtype):
        return "int"
    if types.is_float_dtype(dtype):
        return "float"
    if types.is_string_dtype(dtype) or types.is_object_dtype(dtype):
        return "text"
    return "other"


def _kind_of_name(dtype: Optional[str]) -> Optional[str]:
    if dtype is None:
        return None
    if dtype == "category":  # the categories' type is not in the name
        return "text"
    from pandas.api.types import pandas_dtype

    try:
        return _kind(pandas_dtype(dtype))
    except (TypeError, ValueError):
        return "other"


# the types of Anomaly's fields in JSON (value/threshold: numbers, or 'nan'/'inf' strings)
_ANOMALY_TYPES = {"step": (int,), "kind": (str,), "name": (str, type(None)),
                  "module": (str, type(None)), "op": (str, type(None)),
                  "value": (int, float, str, type(None)), "threshold": (int, float, str, type(None)),
                  "source": (str, type(None)), "message": (str,), "rank": (int, type(None)),
                  "params": (list, type(None)), "reproduced": (bool, type(None))}


def _anomalies(path: pathlib.Path, items: List[Any]) -> List[Anomaly]:
    fields = dataclasses.fields(Anomaly)
    required = [f.name for f in fields
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    out = []
    for i, d in enumerate(items):
        where = f"anomaly {i}"
        if not isinstance(d, dict):
            raise _Invalid(path, f"{where} is a JSON {type(d).__name__}, expected an object")
        missing = [k for k in required if k not in d]
        if missing:
            raise _Invalid(path, f"{where} has no field {', '.join(map(repr, missing))}")
        for key, value in d.items():
            bad = _bad_anomaly_field(key, value)
            if bad:
                raise _Invalid(path, f"{where}: field {key!r} {bad}")
        try:
            out.append(Anomaly.from_dict(d))
        except (TypeError, ValueError) as e:
            raise _Invalid(path, f"{where} cannot be read ({e})") from None
    return out


def _bad_anomaly_field(key: str, value: Any) -> Optional[str]:
    """What is wrong with one field of an anomaly record, or None."""
    types = _ANOMALY_TYPES.get(key)
    if types is None:
        return None  # a field of a later version: Anomaly.from_dict leaves it out
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        return f"is {_describe(value)}, expected {names}"
    if key in ("value", "threshold") and isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return f"is {value[:40]!r}, expected a number or 'nan' / 'inf' / '-inf'"
    if key == "params" and value is not None and not all(isinstance(p, str) for p in value):
        return "must be a list of parameter names"
    return None


# ---------------------------------------------------------------------- helpers

def _parquet_bytes(frame: "pandas.DataFrame") -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pandas(frame), buf, compression="zstd")
    return buf.getvalue()


def _dtypes(frame: "pandas.DataFrame") -> Dict[str, str]:
    return {str(c): str(t) for c, t in frame.dtypes.items()}


def _category_dtypes(frame: "pandas.DataFrame") -> Dict[str, str]:
    """The dtype of each categorical column's categories (parquet keeps only their values)."""
    return {str(c): str(t.categories.dtype) for c, t in frame.dtypes.items() if str(t) == "category"}


def _restore(frame: "pandas.DataFrame", dtypes: Dict[str, str],
             categories: Dict[str, str]) -> "pandas.DataFrame":
    """Put back dtypes that parquet does not keep (object columns, and the categories of
    categorical ones, read back as strings)."""
    import pandas as pd

    for col, dtype in dtypes.items():
        if col in frame.columns and dtype == "object" and str(frame[col].dtype) != "object":
            frame[col] = frame[col].astype(object)
    for col, dtype in categories.items():
        if col in frame.columns and dtype == "object" and str(frame[col].dtype) == "category" \
                and str(frame[col].cat.categories.dtype) != "object":
            cats = pd.Index(frame[col].cat.categories.to_numpy(dtype=object), dtype=object)
            frame[col] = pd.Categorical.from_codes(frame[col].cat.codes, categories=cats)
    return frame


def _summary_writer_class() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError("Run.to_tensorboard needs the optional dependency tensorboard: "
                          "pip install tensorboard") from e
    return SummaryWriter


def _finite(x: Any) -> bool:
    try:
        return x is not None and math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def _write_tensorboard(run: Run, writer: Any, prefix: str) -> None:
    import numpy as np

    steps = run.steps
    for col in ("global_norm", "clipped_norm", "scale", "lr"):
        if col in steps.columns:
            for s, v in zip(steps["step"], steps[col]):
                if _finite(v):
                    writer.add_scalar(f"{prefix}/{col}", float(v), int(s))
    for col in ("nonfinite", "overflow"):
        if col in steps.columns:
            for s, v in zip(steps["step"], steps[col]):
                writer.add_scalar(f"{prefix}/{col}", int(v), int(s))
    stats = run.stats
    for col in ("norm", "absmax", "update_ratio", "nonfinite"):
        if col not in stats.columns:
            continue
        for s, name, v in zip(stats["step"], stats["name"], stats[col]):
            if col == "nonfinite":
                writer.add_scalar(f"{prefix}/nonfinite/{name}", int(v), int(s))
            elif _finite(v):
                writer.add_scalar(f"{prefix}/{col}/{name}", float(v), int(s))
    if run.histograms is not None and len(run.histograms):
        for (name, s), g in run.histograms.groupby(["name", "step"], sort=False):
            g = g.sort_values("lo")
            counts = g["count"].to_numpy(dtype=float)
            num = float(counts.sum())
            if num <= 0:
                continue
            lo = g["lo"].to_numpy(dtype=float)
            hi = g["hi"].to_numpy(dtype=float)
            hi = np.where(np.isfinite(hi), hi, np.maximum(lo * 10.0, 1.0))
            mids = np.where(lo > 0, np.sqrt(np.maximum(lo, 1e-300) * hi), hi / 2.0)
            used = np.nonzero(counts)[0]
            writer.add_histogram_raw(
                f"{prefix}/grad_abs/{name}", min=float(lo[used[0]]), max=float(hi[used[-1]]),
                num=num, sum=float((counts * mids).sum()),
                sum_squares=float((counts * mids ** 2).sum()),
                bucket_limits=hi.tolist(), bucket_counts=counts.tolist(), global_step=int(s))
    if run.anomalies:
        lines = ["| step | kind | parameter | module | op | source | message |",
                 "|---|---|---|---|---|---|---|"]
        for a in run.anomalies[:500]:
            cells = [a.step, a.kind, a.name, a.module, a.op, a.source, a.message]
            lines.append("| " + " | ".join(str(c if c is not None else "").replace("|", "\\|")
                                           .replace("\n", " ") for c in cells) + " |")
        if len(run.anomalies) > 500:
            lines.append(f"\n{len(run.anomalies) - 500} more anomalies not shown")
        writer.add_text(f"{prefix}/anomalies", "\n".join(lines), 0)
