#!/usr/bin/env python
"""Execute the notebooks in notebooks/ and store them with their outputs.

    .venv/bin/python scripts/run_notebooks.py                 # all of them
    .venv/bin/python scripts/run_notebooks.py 04_graphs.ipynb # some of them
    .venv/bin/python scripts/run_notebooks.py --check         # compare, write nothing

Each notebook runs in a fresh ``python3`` kernel (this interpreter, importing this
checkout's graddbg) with a temporary working directory, so the files it writes land
there. Outputs are stored as the code makes them, less what changes from run to run
without the code changing (cell timings). Run it after a change that alters what a
notebook shows; tests/test_notebooks.py fails until the stored outputs match again
(compared through :func:`normalise`, which hides addresses, temporary paths, timings and
the last digits of floating-point numbers).

``normalise`` is imported by the tests: it is the one definition of "the same output".
"""
from __future__ import annotations

import argparse
import base64
import os
import re
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
CELL_TIMEOUT_S = 180
MAX_BYTES = 400_000  # each stored notebook, outputs included (tests/test_notebooks.py)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
_TMP = re.compile(r"(/private)?/(tmp|var/folders)/[^\s'\")<>:]*")
#: a file of the graddbg package, wherever the checkout (or the install) lies
_PACKAGE = re.compile(r"[^\s'\"(<>]*/graddbg/(?=[\w/]+\.py)")
_SITE = re.compile(r"[^\s'\"]*/site-packages/")
_RELATIVE = re.compile(r"(\.\./)+")
_LINE = re.compile(r"\.py:\d+")
_SECONDS = re.compile(r"\b\d+(\.\d+)?\s?(s|ms|µs|us|seconds?)\b")
_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(\.\d+)?([eE][-+]?\d+)?(?![\w.]*\w)")
_SVG_TEXT = re.compile(r"<text[^>]*>(.*?)</text>", re.S)
_SVG_TITLE = re.compile(r"<title>(.*?)</title>", re.S)


def _numbers_to_3_digits(text: str) -> str:
    """Round every number with a fraction or exponent to 3 significant digits.

    A model trained for a few steps with another BLAS build differs in the last bits;
    three digits keep what a reader sees (a norm of 0.0123, a count of 200).
    """
    def round3(m: "re.Match[str]") -> str:
        s = m.group(0)
        if re.fullmatch(r"[-+]?\d+", s):
            return s  # integers (counts, steps, shapes) stay exact
        try:
            v = float(s)
        except ValueError:
            return s
        return f"{v:.2e}"

    return _NUMBER.sub(round3, text)


def _text(text: str) -> str:
    text = _ANSI.sub("", text)
    text = _ADDRESS.sub("0x…", text)
    text = _PACKAGE.sub("<repo>/graddbg/", text)  # (before the temporary paths: a clone may lie in /tmp)
    text = text.replace(str(ROOT), "<repo>")  # where the checkout lies
    text = _TMP.sub("<tmp>", text)
    text = _SITE.sub("<site-packages>/", text)
    text = _RELATIVE.sub("<up>/", text)
    text = _LINE.sub(".py:<line>", text)  # line numbers move with every edit of the code
    text = _SECONDS.sub("<time>", text)
    text = _numbers_to_3_digits(text)
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _png_size(data: str) -> tuple:
    raw = base64.b64decode(data)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", raw[16:24])


def _svg(svg: str) -> str:
    """An SVG by what it says (titles and labels), not where dot put it."""
    words = _SVG_TITLE.findall(svg) + _SVG_TEXT.findall(svg)
    return _text("\n".join(words))


def normalise(cell_outputs: List[Dict[str, Any]]) -> List[Any]:
    """What a code cell shows, without what changes between two runs of the same code.

    Stream text and text/plain, text/html and text/markdown are compared as text after
    hiding addresses, temporary paths, where the checkout and the packages lie, line
    numbers in ``file.py:N``, timings and digits past the third; PNG images by
    their pixel size (their pixels depend on the font and the renderer); SVG images by
    their titles and text labels (their coordinates depend on the dot version); errors
    by their exception name.
    """
    out: List[Any] = []
    streams: List[Any] = []  # consecutive writes to one stream are one text
    for o in cell_outputs:
        if o["output_type"] == "stream":
            text = o["text"] if isinstance(o["text"], str) else "".join(o["text"])
            if streams and streams[-1][0] == o["name"]:
                streams[-1][1] += text
            else:
                streams.append([o["name"], text])
        else:
            streams.append([None, o])
    for name, o in streams:
        if name is not None:
            out.append((("stream", name), _text(o)))
            continue
        kind = o["output_type"]
        if kind in ("execute_result", "display_data"):
            data = o["data"]
            shown: Dict[str, Any] = {}
            for mime, value in sorted(data.items()):
                value = value if isinstance(value, str) else "".join(value)
                if mime == "image/png":
                    shown[mime] = _png_size(value)
                elif mime == "image/svg+xml":
                    shown[mime] = _svg(value)
                elif mime.startswith("text/"):
                    shown[mime] = _text(value)
                else:
                    shown[mime] = None  # present; its content is the library's
            out.append((kind, shown))
        elif kind == "error":
            out.append(("error", o["ename"]))
    return out


def execute(nb: Any, workdir: Path, timeout: int = CELL_TIMEOUT_S) -> Any:
    """Run ``nb`` in place in a fresh python3 kernel whose working directory is ``workdir``."""
    import nbclient

    client = nbclient.NotebookClient(
        nb, timeout=timeout, kernel_name="python3", allow_errors=False, record_timing=False,
        resources={"metadata": {"path": str(workdir)}})
    client.execute()
    return nb


def clean_for_storage(nb: Any) -> Any:
    """Drop what nbclient adds that is not output (per-cell execution metadata)."""
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            for o in cell.outputs:
                o.get("metadata", {}).pop("execution", None)
    nb.metadata.pop("widgets", None)
    return nb


def _env() -> None:
    # the kernel inherits these: this checkout's graddbg, a non-interactive backend
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    os.environ.setdefault("MPLBACKEND", "Agg")


def run_one(path: Path, check: bool) -> Optional[str]:
    import nbformat

    stored = nbformat.read(str(path), as_version=4)
    fresh = nbformat.read(str(path), as_version=4)
    for cell in fresh.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    with tempfile.TemporaryDirectory(prefix="graddbg-nb-") as tmp:
        execute(fresh, Path(tmp))
    clean_for_storage(fresh)
    if check:
        a = [normalise(c.outputs) for c in stored.cells if c.cell_type == "code"]
        b = [normalise(c.outputs) for c in fresh.cells if c.cell_type == "code"]
        return None if a == b else f"{path.name}: stored outputs differ from a fresh run"
    nbformat.validate(fresh)
    nbformat.write(fresh, str(path))
    size = path.stat().st_size
    print(f"{path.name}: {size:,} bytes")
    return f"{path.name}: {size:,} bytes > {MAX_BYTES:,}" if size > MAX_BYTES else None


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="notebook file names (default: all)")
    ap.add_argument("--check", action="store_true", help="compare with a fresh run, write nothing")
    args = ap.parse_args(argv)
    _env()
    paths = [NOTEBOOK_DIR / n for n in args.names] or sorted(NOTEBOOK_DIR.glob("*.ipynb"))
    problems = [p for p in (run_one(path, args.check) for path in paths) if p]
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
