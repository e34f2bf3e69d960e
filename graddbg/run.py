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

A run file is untrusted input (runs are shared between people): `load` reads each parquet
footer's metadata itself (``graddbg._io.parquet_key_values``) and refuses an Arrow schema
that declares an extension type before pyarrow reads anything, refuses columns that are
not plain numbers, booleans, times or text, and builds the DataFrames from the columns
alone (the ``pandas`` metadata key is ignored). Empty tables (a run stopped in its first
step) are written with their columns' proper dtypes, and read back whatever dtypes an older
file gave them. Why the run stopped, when graddbg knows it, is ``meta["stopped"]`` (see
`stop_reason`; `Run.stopped`).

pandas and pyarrow are imported inside the functions that need them.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import inspect
import io
import json
import math
import os
import pathlib
import signal
import sys
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Tuple, Union

from graddbg._errors import GraddbgError, GraddbgTypeError, GraddbgValueError
from graddbg._io import (arrow_schema_extensions, as_path, file_target, parquet_key_values, replacing,
                         same_file, write_atomic)
from graddbg.anomaly import Anomaly

if TYPE_CHECKING:  # pragma: no cover - type names only
    import pandas
    from matplotlib.figure import Figure

__all__ = ["Run", "load", "stop_reason", "FORMAT_VERSION"]

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
              "recorded": ("bool",), "lr": _NUMBER, "loss": _NUMBER},
    "histograms": {"step": ("int",), "name": ("text",), "lo": _NUMBER, "hi": _NUMBER,
                   "count": ("int",)},
    "activations": {"step": ("int",), "module": ("text",), "grad_norm": _NUMBER,
                    "out_nonfinite": ("int",)},
    "ledger": {"step": ("int",), "path": ("text",)},
}
# the dtype an empty column is given (an empty table holds no values to tell it), by kind; and
# the kinds of the ledger's other columns, used for an empty ledger only
_EMPTY_DTYPE = {"int": "int64", "float": "float64", "bool": "bool", "text": "object"}
_EMPTY_LEDGER = {**{c: ("int",) for c in ("forwards", "backwards", "grads", "moved")},
                 **{c: ("float",) for c in ("update", "global_norm", "clipped_norm", "scale")},
                 "skipped": ("bool",)}


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
        #: the file this run was read from by `load` (None for a run made in memory): its
        #: report is never written over it
        self.source: Optional[pathlib.Path] = None

    def __repr__(self) -> str:
        n_rec = self.stats["step"].nunique() if "step" in self.stats.columns else 0
        n_par = self.stats["name"].nunique() if "name" in self.stats.columns else 0
        return (f"Run(recorded_steps={n_rec}, steps={len(self.steps)}, params={n_par}, "
                f"anomalies={len(self.anomalies)})")

    @property
    def stopped(self) -> Optional[Dict[str, Any]]:
        """Why the run stopped, when graddbg knew it (``meta["stopped"]``, see
        `stop_reason`): ``{"how": "completed"}``, an exception's type and message, a signal,
        ...; None when it was not recorded.

        Examples:
            >>> import pandas as pd
            >>> Run(pd.DataFrame({"step": [], "name": []}), pd.DataFrame({"step": []}),
            ...     meta={"stopped": stop_reason(KeyboardInterrupt())}).stopped["signal"]
            'SIGINT'
        """
        stopped = self.meta.get("stopped")
        return stopped if isinstance(stopped, dict) else None

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
            kind: ``"flow"``, ``"norms"``, ``"heatmap"``, ``"update"``, ``"hist"`` or
                ``"loss"`` (the loss and the learning rate over steps).
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
            GraddbgValueError: ``path`` is the file this run was loaded from (`source`).
            GraddbgError: the file cannot be written.
        """
        from graddbg.report import write_report

        if self.source is not None and isinstance(path, (str, os.PathLike)) and same_file(path, self.source):
            raise GraddbgValueError(f"path: {os.fspath(path)!r} is the run file this Run was loaded from; "
                                    f"the report would overwrite it: give another file name, such as "
                                    f"{str(_report_name(self.source))!r}")
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

        stats = _typed_if_empty("stats", self.stats)
        doc: Dict[str, Any] = {
            "format": "graddbg.run", "version": FORMAT_VERSION,
            "anomalies": [a.to_dict() for a in self.anomalies], "meta": self._meta_to_save(),
            "dtypes": {"stats": _dtypes(stats)}, "tables": [],
            "categories": {"stats": _category_dtypes(stats)},
        }
        metadata: Dict[bytes, bytes] = {}
        for name in _TABLES:
            frame = getattr(self, name)
            if frame is not None:
                frame = _typed_if_empty(name, frame)
                doc["tables"].append(name)
                doc["dtypes"][name] = _dtypes(frame)
                doc["categories"][name] = _category_dtypes(frame)
                metadata[b"graddbg." + name.encode()] = base64.b64encode(_parquet_bytes(frame))
        try:
            text = json.dumps(doc, allow_nan=True)
        except (TypeError, ValueError) as e:
            raise GraddbgTypeError(f"Run.meta must hold JSON-able values only (str, numbers, "
                                   f"bool, None, lists, dicts): {e}") from e
        table = pa.Table.from_pandas(stats, preserve_index=False)
        metadata = {**(table.schema.metadata or {}), _META_KEY: text.encode("utf-8"), **metadata}
        return table.replace_schema_metadata(metadata)

    def _meta_to_save(self) -> Dict[str, Any]:
        """``meta``, with why the run stopped when it does not say and an exception is being
        handled as the run is saved (``except ...: w.save(path)``)."""
        exc = sys.exc_info()[1]
        if "stopped" in self.meta or exc is None:
            return self.meta
        return {**self.meta, "stopped": {**stop_reason(exc),
                                         "evidence": "the exception being handled when the run was saved"}}

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
    an unknown format version, missing columns, wrong column types) is refused. A run file
    is untrusted input: a file whose Arrow schema declares an extension type is refused
    before pyarrow reads it, a column that is not plain numbers, booleans, times or text is
    refused, and the ``pandas`` metadata is ignored, so reading a file never runs code from
    it. A run stopped at any point loads, its first step included (empty tables).

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
    table, metadata = _read_parquet(path)
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
    run = Run(frames["stats"], steps, anomalies, histograms=frames["histograms"],
              activations=frames["activations"], meta=doc.get("meta") or {}, ledger=frames["ledger"])
    run.source = path
    return run


def stop_reason(exc: Optional[BaseException] = None) -> Dict[str, Any]:
    """Why a run stopped, as JSON-able data for ``Run.meta["stopped"]``: None (no exception)
    is ``{"how": "completed"}``; Ctrl-C and SIGTERM / SIGHUP under ``graddbg run`` are
    ``"signal"``; ``sys.exit`` is ``"exit"`` with its code; a `GradientAnomalyError` is
    ``"anomaly"`` (graddbg's own policy stopped it); any other exception is
    ``"exception"``, with its type and message.

    Examples:
        >>> stop_reason()
        {'how': 'completed'}
        >>> stop_reason(ValueError("bad batch"))
        {'how': 'exception', 'type': 'ValueError', 'message': 'bad batch'}
        >>> stop_reason(KeyboardInterrupt())
        {'how': 'signal', 'type': 'KeyboardInterrupt', 'signal': 'SIGINT'}
    """
    if exc is None:
        return {"how": "completed"}
    kind = type(exc)
    module = "graddbg" if kind.__module__.startswith("graddbg.") else kind.__module__
    name = kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"
    signum = signal.SIGINT if isinstance(exc, KeyboardInterrupt) else getattr(exc, "signum", None)
    if isinstance(signum, int) and not isinstance(signum, bool):
        try:
            return {"how": "signal", "type": name, "signal": signal.Signals(signum).name}
        except ValueError:
            return {"how": "signal", "type": name, "signal": int(signum)}
    if isinstance(exc, SystemExit):
        code = exc.code
        return {"how": "exit", "type": name, "code": code if isinstance(code, (int, type(None))) else str(code)}
    try:
        message = str(exc)
    except Exception:  # (a broken __str__ of the user's exception)
        message = f"<{name} whose str() failed>"
    out = {"how": "anomaly" if hasattr(exc, "anomaly") and module == "graddbg" else "exception",
           "type": name, "message": message if len(message) <= 2000 else message[:2000] + "..."}
    step = getattr(getattr(exc, "anomaly", None), "step", None)
    if out["how"] == "anomaly" and isinstance(step, int):
        out["step"] = step
    return out


def _report_name(run_file: pathlib.Path) -> pathlib.Path:
    """A report's file name next to ``run_file`` that is not ``run_file`` itself."""
    html = run_file.with_suffix(".html")
    return html if html != run_file else run_file.with_name(run_file.stem + "-report.html")


def _Invalid(path: pathlib.Path, what: str) -> GraddbgError:
    """What load() raises for a damaged or edited file."""
    return GraddbgError(f"path: {str(path)!r} is not a valid graddbg run: {what}")


def _read_parquet(path: pathlib.Path) -> Tuple[Any, Dict[bytes, bytes]]:
    """The stats table of the run file and its key/value metadata, as read from its footer
    (checked before pyarrow reads anything: see `_safe_table`)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise GraddbgError(f"path: cannot read {str(path)!r}: {e.strerror or e}") from None

    def refuse(why: str) -> GraddbgError:
        return GraddbgError(f"path: {str(path)!r} is not a parquet file written by Watch.save / Run.save ({why})")

    try:
        pairs = parquet_key_values(data)
    except GraddbgValueError as e:
        raise refuse(str(e)) from None
    if _META_KEY not in dict(pairs):
        raise GraddbgError(f"path: {str(path)!r} is a parquet file but not a graddbg run "
                           f"(it has no 'graddbg' metadata); write runs with Watch.save or "
                           f"Run.save")
    return _safe_table(data, pairs, refuse, lambda why: _Invalid(path, why)), dict(pairs)


def _safe_table(data: bytes, pairs: List[Tuple[bytes, bytes]], refuse: Any, invalid: Any) -> Any:
    """The parquet file ``data`` as a pyarrow Table, read only when its Arrow schema
    declares no extension type (whose deserialisation could run code from the file:
    CVE-2023-47248), and with pyarrow's own extension types for parquet types off."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    problems = arrow_schema_extensions(pairs)
    if problems:
        raise invalid(f"{problems[0]}; graddbg run files hold plain columns only, and reading an "
                      f"extension type could run code from the file: refused unread")
    options = {"arrow_extensions_enabled": False} \
        if "arrow_extensions_enabled" in inspect.signature(pq.ParquetFile).parameters else {}
    try:
        return pq.ParquetFile(pa.BufferReader(data), **options).read()
    except Exception as e:  # pyarrow's ArrowInvalid and friends
        raise refuse(f"{type(e).__name__}: {e}") from None


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
    stopped = (doc.get("meta") or {}).get("stopped")
    if not _stopped_doc(stopped):
        raise _Invalid(path, f"metadata meta['stopped'] must be an object of plain values with a 'how' "
                             f"string (see graddbg.run.stop_reason); got {_describe(stopped)}")
    return doc


def _stopped_doc(v: Any) -> bool:
    """``meta["stopped"]``: absent, or an object of plain values with a 'how' string."""
    return v is None or isinstance(v, dict) and isinstance(v.get("how"), str) and all(
        isinstance(x, (str, int, float, bool, type(None))) for x in v.values())


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
    raw = metadata.get(b"graddbg." + name.encode())
    if raw is None:
        raise _Invalid(path, f"table {name!r} is listed in the metadata but missing")
    try:
        data = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _Invalid(path, f"table {name!r} is not valid base64 ({e})") from None
    try:
        pairs = parquet_key_values(data)
    except GraddbgValueError as e:
        raise _Invalid(path, f"table {name!r} is not parquet ({e})") from None
    table = _safe_table(data, pairs, lambda why: _Invalid(path, f"table {name!r} is not parquet ({why})"),
                        lambda why: _Invalid(path, f"table {name!r}: {why}"))
    return _frame(path, name, table, dtypes)


def _frame(path: pathlib.Path, name: str, table: Any, dtypes: Dict[str, Any]) -> "pandas.DataFrame":
    """The table as a DataFrame built from its plain columns (its ``pandas`` metadata
    ignored), with its recorded dtypes, its columns checked."""
    for field in table.schema:
        bad = _arrow_type_problem(field)
        if bad:
            raise _Invalid(path, f"column {field.name!r} of table {name!r} {bad}")
    table = table.drop_columns([c for c in table.column_names if c.startswith("__index_level_")])
    try:
        frame = table.replace_schema_metadata(None).to_pandas(ignore_metadata=True)
    except Exception as e:
        raise _Invalid(path, f"table {name!r} cannot be read ({type(e).__name__}: {e})") from None
    recorded = dtypes[""].get(name) or {}
    frame = _restore(frame, recorded, dtypes["categories"].get(name) or {})
    missing = [c for c in _REQUIRED[name] if c not in frame.columns]
    missing += [c for c in recorded if c not in frame.columns and c not in missing]
    if missing:
        raise _Invalid(path, f"table {name!r} has no column {', '.join(map(repr, missing))} "
                             f"(its columns: {[str(c) for c in frame.columns]})")
    if len(frame) == 0:  # no values to check: the dtypes of the known columns, whatever the file said
        return _typed_if_empty(name, frame)
    for col in frame.columns:
        kind = _kind(frame[col].dtype)
        want = _KINDS[name].get(str(col))
        was = _kind_of_name(recorded.get(str(col)))
        if (want is not None and kind not in want) or (was not in (None, "other") and kind != was):
            expected = " or ".join(want) if want is not None else was
            raise _Invalid(path, f"column {str(col)!r} of table {name!r} holds {frame[col].dtype} "
                                 f"values, expected {expected}")
    return frame


def _arrow_type_problem(field: Any) -> Optional[str]:
    """What is wrong with a column's Arrow type for a run file (None when it is plain:
    numbers, booleans, times, text, a dictionary of text, or null for an empty column)."""
    import pyarrow as pa

    t = field.type
    if isinstance(t, pa.ExtensionType) or any(k.startswith(b"ARROW:extension") for k in (field.metadata or {})):
        return (f"has an extension type ({getattr(t, 'extension_name', None) or 'ARROW:extension:name'}); "
                f"run files hold plain columns only: refused")
    types = pa.types
    is_text = lambda u: types.is_string(u) or types.is_large_string(u) or getattr(types, "is_string_view", bool)(u)  # noqa: E731
    value = t.value_type if types.is_dictionary(t) else t
    if types.is_dictionary(t) and not types.is_integer(t.index_type):
        value = None
    if value is not None and (types.is_null(value) or types.is_boolean(value) or types.is_integer(value)
                              or types.is_floating(value) or types.is_temporal(value) or is_text(value)):
        return None
    return f"has Arrow type {t}; expected numbers, booleans, times or text"


def _typed_if_empty(name: str, frame: "pandas.DataFrame") -> "pandas.DataFrame":
    """An empty table with its known columns in their dtypes (a run stopped in its first step
    has empty tables whose columns hold no values to give them one); others as they are."""
    if len(frame) or not len(frame.columns):
        return frame
    kinds = {**(_EMPTY_LEDGER if name == "ledger" else {}), **_KINDS.get(name, {})}
    out = frame.copy()
    for col in frame.columns:
        want = kinds.get(str(col))
        if want is not None and _kind(frame[col].dtype) not in want:
            out[col] = frame[col].astype(_EMPTY_DTYPE["float" if "float" in want else want[0]])
    return out


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
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), buf, compression="zstd")
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
    for col in ("global_norm", "clipped_norm", "loss", "scale", "lr"):
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
