"""Files written atomically: the one writer of every file graddbg makes.

`replacing` yields a temporary path in the target's folder; when the block ends
without error the file is flushed to disk and renamed over the target (``os.replace``),
so a failed write (a full disk, a file size limit, no permission) leaves the previous file
whole and raises a `graddbg.GraddbgError` naming the path. `write_atomic`
writes text or bytes through it. ``graddbg.run`` (``Run.save``, ``Watch.save``), the report
and ``Graph.render`` all write through here.

This module imports nothing of graddbg but ``_errors``.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
from typing import Any, Iterator, Union

from graddbg._errors import GraddbgError, GraddbgTypeError, GraddbgValueError

__all__ = ["replacing", "write_atomic", "as_path", "file_target"]

PathLike = Union[str, "os.PathLike[str]"]


@contextlib.contextmanager
def replacing(path: PathLike) -> Iterator[pathlib.Path]:
    """Write ``path`` atomically: yields a temporary path in the same folder for the
    writer to fill; when the block ends without error the file is flushed to disk and
    renamed over ``path`` (``os.replace``). When writing fails (a full disk, a file size
    limit, no permission) the temporary file is removed, the previous ``path`` is left
    whole, and a `GraddbgError` names the path.

    >>> import tempfile, os
    >>> with tempfile.TemporaryDirectory() as d:
    ...     with replacing(os.path.join(d, "a.txt")) as tmp:
    ...         _ = tmp.write_text("hello")
    ...     sorted(os.listdir(d))
    ['a.txt']
    """
    path = as_path(path, "path")
    tmp = path.with_name(f".{path.name[:120]}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as e:
        raise _write_error(path, e) from e
    done = False
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, path)
        done = True
    except OSError as e:
        raise _write_error(path, e) from e
    finally:
        if not done:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    with contextlib.suppress(OSError):  # make the rename itself durable where we can
        _fsync(path.parent, directory=True)


def write_atomic(path: PathLike, data: Union[str, bytes]) -> pathlib.Path:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` through `replacing`;
    returns the path.

    >>> import tempfile, os
    >>> with tempfile.TemporaryDirectory() as d:
    ...     write_atomic(os.path.join(d, "r.html"), "<p>hi</p>").read_text()
    '<p>hi</p>'
    """
    if not isinstance(data, (str, bytes)):
        raise GraddbgTypeError(f"write_atomic(data=...) must be str or bytes; got {type(data).__name__}")
    path = as_path(path, "path")
    with replacing(path) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def _fsync(path: pathlib.Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_error(path: pathlib.Path, e: OSError) -> GraddbgError:
    reason = os.strerror(e.errno) if e.errno else (e.strerror or str(e))  # pyarrow adds its own words
    kept = "the previous file is left as it was" if path.exists() else "nothing was written"
    return GraddbgError(f"could not write {str(path)!r}: {reason}; {kept}")


def as_path(path: Any, arg: str) -> pathlib.Path:
    if not isinstance(path, (str, os.PathLike)):
        raise GraddbgTypeError(f"{arg}: expected a file name (str or os.PathLike); "
                               f"got {type(path).__name__}")
    return pathlib.Path(os.fspath(path))


def file_target(path: Any, example: str) -> pathlib.Path:
    """``path`` as a Path to write a file to; a folder is a usage error (naming
    ``example``, a file name to give instead)."""
    path = as_path(path, "path")
    if path.is_dir():
        raise GraddbgValueError(f"path: {str(path)!r} is a directory; give a file name such "
                                f"as {str(path / example)!r}")
    return path
