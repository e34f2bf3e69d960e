"""Files written atomically: the one writer of every file graddbg makes.

`replacing` yields a temporary path in the target's folder; when the block ends
without error the file is flushed to disk and renamed over the target (``os.replace``),
so a failed write (a full disk, a file size limit, no permission) leaves the previous file
whole and raises a `graddbg.GraddbgError` naming the path. `write_atomic`
writes text or bytes through it. ``graddbg.run`` (``Run.save``, ``Watch.save``), the report
and ``Graph.render`` all write through here.

Reading a run file, which is untrusted input, starts here too: `parquet_key_values` reads
a parquet file's key/value metadata from its footer with a small Thrift decoder of its own,
before pyarrow sees the file, and `arrow_schema_extensions` says whether the Arrow schema
stored there declares an extension type (whose deserialisation may run code: pyarrow
before 14.0.1 unpickled ``arrow.py_extension_type`` metadata, CVE-2023-47248).

This module imports nothing of graddbg but ``_errors``.
"""
from __future__ import annotations

import base64
import binascii
import contextlib
import os
import pathlib
import secrets
import struct
from typing import Any, Dict, Iterator, List, Tuple, Union

from graddbg._errors import GraddbgError, GraddbgTypeError, GraddbgValueError

__all__ = ["replacing", "write_atomic", "as_path", "file_target", "parquet_key_values",
           "arrow_schema_extensions", "same_file"]

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


def same_file(a: Any, b: Any) -> bool:
    """Whether the paths ``a`` and ``b`` name one file: the same resolved path (links
    followed), or, when both exist, the same file on disk (`os.path.samefile`: hard links).

    >>> same_file("x/../run.parquet", "run.parquet")
    True
    """
    a, b = pathlib.Path(os.fspath(a)), pathlib.Path(os.fspath(b))
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


# ------------------------------------------------------------ parquet footers, read by hand

_MAGIC = b"PAR1"
_KEY_VALUE_METADATA = 5  # FileMetaData's field 5: list<KeyValue{1: key, 2: value}>
_MAX_DEPTH = 64


def parquet_key_values(data: bytes) -> List[Tuple[bytes, bytes]]:
    """The key/value metadata in the footer of the parquet file ``data`` (its bytes), in
    file order, read without pyarrow, so that nothing in it is interpreted before it is
    checked. Raises `GraddbgValueError` saying what is wrong when ``data`` is not a plain
    (unencrypted) parquet file.

    >>> import io, pyarrow as pa, pyarrow.parquet as pq
    >>> buf = io.BytesIO()
    >>> pq.write_table(pa.table({"x": [1]}).replace_schema_metadata({"k": "v"}), buf)
    >>> [kv for kv in parquet_key_values(buf.getvalue()) if kv[0] == b"k"]
    [(b'k', b'v')]
    """
    if len(data) < 12 or data[:4] != _MAGIC:
        raise GraddbgValueError("it does not start with the parquet magic bytes 'PAR1'")
    if data[-4:] != _MAGIC:
        what = "an encrypted footer" if data[-4:] == b"PARE" else "no parquet magic bytes at its end"
        raise GraddbgValueError(f"it has {what}")
    (length,) = struct.unpack("<I", data[-8:-4])
    if length > len(data) - 12:
        raise GraddbgValueError(f"its footer length ({length} bytes) exceeds the file")
    footer = _Thrift(data[len(data) - 8 - length:len(data) - 8]).struct()
    pairs = []
    for kv in footer.get(_KEY_VALUE_METADATA, []):
        if not isinstance(kv, dict) or not isinstance(kv.get(1), bytes):
            raise GraddbgValueError("its footer holds a key/value entry without a key")
        value = kv.get(2, b"")
        pairs.append((kv[1], value if isinstance(value, bytes) else b""))
    return pairs


def arrow_schema_extensions(pairs: List[Tuple[bytes, bytes]]) -> List[str]:
    """What is wrong with the Arrow schema(s) stored in parquet key/value metadata
    (``ARROW:schema``, base64 of a serialised schema) for a reader that must never
    deserialise an extension type: one line per problem, empty when none. A schema that
    is not strict base64 is a problem (it could not be checked).

    >>> import base64
    >>> arrow_schema_extensions([(b"ARROW:schema", base64.b64encode(b"..ARROW:extension:name.."))])
    ["the Arrow schema declares an extension type ('ARROW:extension:name')"]
    """
    problems = []
    for key, value in pairs:
        if key != b"ARROW:schema":
            continue
        try:
            schema = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            problems.append("its 'ARROW:schema' metadata is not valid base64")
            continue
        if b"ARROW:extension:" in schema:
            problems.append("the Arrow schema declares an extension type ('ARROW:extension:name')")
    return problems


class _Thrift:
    """A reader of Thrift's compact protocol, enough for a parquet footer: every value is
    decoded into plain ints, floats, bytes, lists and {field id: value} dicts, each size
    checked against the bytes that are left."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos, self.depth = data, 0, 0

    def _take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise GraddbgValueError("its footer is truncated or damaged")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def _varint(self) -> int:
        out = shift = 0
        while True:
            b = self._take(1)[0]
            out |= (b & 0x7F) << shift
            if not b & 0x80:
                return out
            shift += 7
            if shift > 63:
                raise GraddbgValueError("its footer holds an integer longer than 64 bits")

    def _zigzag(self) -> int:
        n = self._varint()
        return (n >> 1) ^ -(n & 1)

    def _count(self, n: int) -> int:
        if n > len(self.data) - self.pos:  # (every element takes at least one byte)
            raise GraddbgValueError("its footer declares more elements than it holds")
        return n

    def value(self, kind: int) -> Any:
        if kind in (1, 2):  # a bool inside a list or map: one byte
            return self._take(1)[0] == 1
        if kind == 3:
            return self._take(1)[0]
        if kind in (4, 5, 6):
            return self._zigzag()
        if kind == 7:
            return struct.unpack("<d", self._take(8))[0]
        if kind == 8:
            return self._take(self._count(self._varint()))
        if kind == 13:  # uuid
            return self._take(16)
        if kind not in (9, 10, 11, 12):
            raise GraddbgValueError(f"its footer holds an unknown Thrift type {kind}")
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise GraddbgValueError(f"its footer nests deeper than {_MAX_DEPTH} levels")
        out = self._container(kind)
        self.depth -= 1
        return out

    def _container(self, kind: int) -> Any:
        if kind in (9, 10):  # list, set
            head = self._take(1)[0]
            n = head >> 4 if head >> 4 != 15 else self._varint()
            return [self.value(head & 0x0F) for _ in range(self._count(n))]
        if kind == 11:  # map
            n = self._count(self._varint())
            types = self._take(1)[0] if n else 0
            return [(self.value(types >> 4), self.value(types & 0x0F)) for _ in range(n)]
        fields: Dict[int, Any] = {}
        last = 0
        while True:
            head = self._take(1)[0]
            if head == 0:
                return fields
            kind, delta = head & 0x0F, head >> 4
            last = last + delta if delta else self._zigzag()
            fields[last] = kind == 1 if kind in (1, 2) else self.value(kind)

    def struct(self) -> Dict[int, Any]:
        return self.value(12)
