"""A recorded run as data: :class:`Run`, saved to and loaded from one parquet file.

``Watch.to_run()`` gives a :class:`Run`; ``graddbg.load(path)`` reads one back. A Run has
the attributes of the run contract (``stats``, ``steps``, ``anomalies``, ``histograms``,
``activations``, ``meta``) and the methods that work on them: ``summary``, ``plot``,
``report``, ``save`` and ``to_tensorboard``.

The file format is plain parquet, no pickle: the table is ``stats`` (so any parquet
reader, ``pandas.read_parquet(path)`` included, reads the statistics directly), and the
schema metadata holds the rest: a JSON document under the key ``graddbg`` (format version,
anomalies through ``Anomaly.to_dict``, ``meta``, column dtypes) and the other tables
(``steps``, ``histograms``, ``activations``) as base64-encoded parquet under
``graddbg.<table>``.

pandas and pyarrow are imported inside the functions that need them.
"""
from __future__ import annotations

import base64
import io
import json
import os
import pathlib
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Union

from graddbg._errors import GraddbgError
from graddbg.anomaly import Anomaly

if TYPE_CHECKING:  # pragma: no cover - type names only
    import pandas
    from matplotlib.figure import Figure

__all__ = ["Run", "load", "FORMAT_VERSION"]

FORMAT_VERSION = 1
_META_KEY = b"graddbg"
_TABLES = ("steps", "histograms", "activations")
PathLike = Union[str, "os.PathLike[str]"]


class Run:
    """The data of one recorded run (see the run contract), with plots, report and export.

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
                 meta: Optional[Dict[str, Any]] = None) -> None:
        import pandas as pd

        for arg, value, optional in (("stats", stats, False), ("steps", steps, False),
                                     ("histograms", histograms, True),
                                     ("activations", activations, True)):
            if not isinstance(value, pd.DataFrame) and not (optional and value is None):
                accepted = "a pandas DataFrame" + (" or None" if optional else "")
                raise TypeError(f"Run({arg}=...) must be {accepted}; got {type(value).__name__}")
        anomalies = list(anomalies)
        for a in anomalies:
            if not isinstance(a, Anomaly):
                raise TypeError(f"Run(anomalies=...) must hold graddbg.anomaly.Anomaly records; "
                                f"got {type(a).__name__}")
        if meta is not None and not isinstance(meta, dict):
            raise TypeError(f"Run(meta=...) must be a dict or None; got {type(meta).__name__}")
        self.stats = stats
        self.steps = steps
        self.anomalies: List[Anomaly] = anomalies
        self.histograms = histograms
        self.activations = activations
        self.meta: Dict[str, Any] = dict(meta or {})

    def __repr__(self) -> str:
        n_rec = self.stats["step"].nunique() if "step" in self.stats.columns else 0
        n_par = self.stats["name"].nunique() if "name" in self.stats.columns else 0
        return (f"Run(recorded_steps={n_rec}, steps={len(self.steps)}, params={n_par}, "
                f"anomalies={len(self.anomalies)})")

    # ------------------------------------------------------------------ views
    def summary(self, by: str = "param") -> "pandas.DataFrame":
        """One row per parameter (``by="param"``) or module (``by="module"``, norms rolled up
        as the root of the sum of squares) over all recorded steps; see
        :func:`graddbg.stats.summarize`."""
        from graddbg.stats import summarize

        return summarize(self.stats, by=by)

    def plot(self, kind: str = "flow", **kw: Any) -> "Figure":
        """A matplotlib Figure of this run: ``kind`` is "flow", "norms", "heatmap", "update"
        or "hist"; keywords go to the function of :mod:`graddbg.plots`.

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
        """Write one self-contained HTML report (see :func:`graddbg.report.write_report`)."""
        from graddbg.report import write_report

        return write_report(self, path, graph=graph, title=title)

    # ------------------------------------------------------------------ persistence
    def save(self, path: PathLike) -> pathlib.Path:
        """Write the run to one parquet file (no pickle) that :func:`load` reads back.

        >>> import pandas as pd, tempfile, os
        >>> run = Run(pd.DataFrame({"step": [1], "name": ["w"], "norm": [float("nan")]}),
        ...           pd.DataFrame({"step": [1], "global_norm": [float("nan")]}))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     back = load(run.save(os.path.join(d, "run.parquet")))
        >>> back.stats.equals(run.stats)
        True
        """
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = pathlib.Path(os.fspath(path))
        if path.is_dir():
            raise IsADirectoryError(f"path: {str(path)!r} is a directory; give a file name "
                                    f"such as {str(path / 'run.parquet')!r}")
        table = pa.Table.from_pandas(self.stats)
        doc = {
            "format": "graddbg.run",
            "version": FORMAT_VERSION,
            "anomalies": [a.to_dict() for a in self.anomalies],
            "meta": self.meta,
            "dtypes": {"stats": _dtypes(self.stats)},
            "tables": [],
        }
        extra: Dict[bytes, bytes] = {}
        for name in _TABLES:
            frame = getattr(self, name)
            if frame is None:
                continue
            doc["tables"].append(name)
            doc["dtypes"][name] = _dtypes(frame)
            buf = io.BytesIO()
            pq.write_table(pa.Table.from_pandas(frame), buf, compression="zstd")
            extra[b"graddbg." + name.encode()] = base64.b64encode(buf.getvalue())
        try:
            text = json.dumps(doc, allow_nan=True)
        except TypeError as e:
            raise TypeError(f"Run.meta must hold JSON-able values only (str, numbers, bool, "
                            f"None, lists, dicts): {e}") from e
        metadata = dict(table.schema.metadata or {})
        metadata[_META_KEY] = text.encode("utf-8")
        metadata.update(extra)
        pq.write_table(table.replace_schema_metadata(metadata), path, compression="zstd")
        return path

    def to_tensorboard(self, writer: Any, *, prefix: str = "graddbg") -> None:
        """Write the run to TensorBoard: per-step scalars (global norm, non-finite count,
        overflow, scale, lr), per-parameter scalars (``norm``, ``absmax``,
        ``update_ratio``, ``nonfinite``), the ``|grad|`` histograms and the anomalies as
        text. ``writer`` is a ``SummaryWriter`` or a log directory.

        TensorBoard cannot show NaN/Inf, so non-finite values are left out of the value
        series and counted in the ``nonfinite`` series instead.

        >>> import pandas as pd, tempfile
        >>> run = Run(pd.DataFrame({"step": [1], "name": ["w"], "norm": [0.5]}),
        ...           pd.DataFrame({"step": [1], "global_norm": [0.5]}))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     run.to_tensorboard(d)
        """
        if isinstance(writer, (str, os.PathLike)):
            SummaryWriter = _summary_writer_class()
            with SummaryWriter(log_dir=os.fspath(writer)) as w:
                _write_tensorboard(self, w, prefix)
            return
        if not hasattr(writer, "add_scalar"):
            raise TypeError("writer must be a tensorboard SummaryWriter (something with "
                            f"add_scalar) or a log directory; got {type(writer).__name__}")
        _write_tensorboard(self, writer, prefix)
        writer.flush()


def load(path: PathLike) -> Run:
    """Read a run written by ``Watch.save`` / :meth:`Run.save`.

    >>> import pandas as pd, tempfile, os
    >>> run = Run(pd.DataFrame({"step": [1], "name": ["w"]}), pd.DataFrame({"step": [1]}),
    ...           meta={"model": "Linear"})
    >>> with tempfile.TemporaryDirectory() as d:
    ...     load(run.save(os.path.join(d, "run.parquet"))).meta
    {'model': 'Linear'}
    """
    import pyarrow.parquet as pq

    path = pathlib.Path(os.fspath(path))
    if not path.exists():
        raise FileNotFoundError(f"path: no such file {str(path)!r}")
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid for non-parquet input
        raise GraddbgError(f"path: {str(path)!r} is not a parquet file written by "
                           f"Watch.save / Run.save ({type(e).__name__}: {e})") from e
    metadata = table.schema.metadata or {}
    if _META_KEY not in metadata:
        raise GraddbgError(f"path: {str(path)!r} is a parquet file but not a graddbg run "
                           f"(it has no 'graddbg' metadata); write runs with Watch.save or "
                           f"Run.save")
    doc = json.loads(metadata[_META_KEY].decode("utf-8"))
    version = doc.get("version")
    if doc.get("format") != "graddbg.run" or not isinstance(version, int) \
            or version > FORMAT_VERSION:
        raise GraddbgError(f"path: {str(path)!r} holds graddbg run format version {version!r}; "
                           f"this graddbg reads versions up to {FORMAT_VERSION} (upgrade graddbg)")
    dtypes = doc.get("dtypes", {})
    stats = _restore(table.to_pandas(), dtypes.get("stats", {}))
    frames: Dict[str, Any] = {}
    for name in _TABLES:
        raw = metadata.get(b"graddbg." + name.encode())
        if name in doc.get("tables", []) and raw is not None:
            sub = pq.read_table(io.BytesIO(base64.b64decode(raw)))
            frames[name] = _restore(sub.to_pandas(), dtypes.get(name, {}))
        else:
            frames[name] = None
    steps = frames["steps"]
    if steps is None:
        import pandas as pd

        steps = pd.DataFrame({"step": pd.Series([], dtype="int64")})
    anomalies = [Anomaly.from_dict(d) for d in doc.get("anomalies", [])]
    return Run(stats, steps, anomalies, histograms=frames["histograms"],
               activations=frames["activations"], meta=doc.get("meta") or {})


# ---------------------------------------------------------------------- helpers

def _dtypes(frame: "pandas.DataFrame") -> Dict[str, str]:
    return {str(c): str(t) for c, t in frame.dtypes.items()}


def _restore(frame: "pandas.DataFrame", dtypes: Dict[str, str]) -> "pandas.DataFrame":
    """Put back dtypes that parquet does not keep (object columns read back as strings)."""
    for col, dtype in dtypes.items():
        if col in frame.columns and dtype == "object" and str(frame[col].dtype) != "object":
            frame[col] = frame[col].astype(object)
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
        import math

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
