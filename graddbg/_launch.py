"""``graddbg run`` across processes: every rank watched, every rank's record written.

- Under torchrun (``RANK`` and ``WORLD_SIZE`` in the environment), each rank runs
  ``graddbg run`` itself and writes under ``<out>/rank-<r>/`` (`rank_folder`).
- Processes the script starts itself (``torch.multiprocessing.spawn``, Lightning's
  ``strategy="ddp"``, which starts the script again with ``subprocess``, accelerate) are
  watched too: while the script runs, `follow_children` puts ``graddbg/_boot`` (a folder
  holding only the start-up hook, ``sitecustomize.py``) first on ``PYTHONPATH``, the run's
  settings in ``GRADDBG_RUN_CHILD`` (with the absolute path of this graddbg) and this
  interpreter's identity in ``GRADDBG_RUN_PYTHON`` (`interpreter`). Python imports the hook
  at the start of every child process. In a process of another interpreter or environment
  (a tool of another Python, the system python) it only runs the ``sitecustomize`` it hides
  and takes its folder off ``sys.path``: nothing of graddbg or of this environment is
  imported or reachable there. In a process of this interpreter and environment it waits,
  at no cost, for the first import of torch (a child that never imports torch never
  imports graddbg); then it calls `boot`: a `graddbg.cli.ScriptWatcher` for the child's
  lifetime, its records written at exit under ``<out>/rank-<r>/`` (its rank in the
  process group it joined) or ``<out>/worker-<pid>/``. The child's own exit code is left
  as it is.
- A watched child marks itself running with an empty file ``<out>/.graddbg-running/<pid>``
  (`MARKERS`, a folder of graddbg's own, removed at the end when this run made it); the
  parent waits for those (`Children.wait`) and reports the children's records with its own
  (`child_records`). No other file in the output folder is ever touched.

This module imports nothing of graddbg; `graddbg.cli` uses it.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import pathlib
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

__all__ = ["ENV", "ENV_PYTHON", "MARKERS", "Children", "interpreter", "rank_folder", "record_folder",
           "follow_children", "boot", "child_records", "wait_for_children"]

#: the environment variable that tells a child process to watch itself (JSON settings)
ENV = "GRADDBG_RUN_CHILD"
#: the identity of the interpreter and environment whose child processes are watched (`interpreter`)
ENV_PYTHON = "GRADDBG_RUN_PYTHON"
#: the folder, under the output folder, of the watched children's markers (one empty file per pid)
MARKERS = ".graddbg-running"
BOOT = pathlib.Path(__file__).resolve().parent / "_boot"


def interpreter() -> str:
    """This interpreter and environment: its version (and build), ``sys.prefix`` and the real
    path of its executable. The start-up hook (graddbg/_boot/sitecustomize.py) computes the
    same text in each child, and watches the child only when the two are equal."""
    return "\n".join((sys.version, sys.prefix, os.path.realpath(sys.executable)))


def env_rank() -> Optional[int]:
    """This process's rank as a launcher gave it (torchrun's ``RANK`` with a
    ``WORLD_SIZE`` above 1), or None."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", "1"))
    except (KeyError, ValueError):
        return None
    return rank if world > 1 else None


def rank_folder(outdir: pathlib.Path) -> pathlib.Path:
    """``outdir/rank-<r>`` under a launcher that gave this process a rank; else ``outdir``."""
    rank = env_rank()
    if rank is None:
        return outdir
    folder = outdir / f"rank-{rank}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def record_folder(outdir: pathlib.Path, meta: Dict[str, Any]) -> pathlib.Path:
    """Where a watch's record goes: under distribution, ``outdir/rank-<its rank>`` (unless
    ``outdir`` is that rank's folder already); else ``outdir``."""
    if meta.get("world_size", 1) <= 1 or outdir.name.startswith("rank-"):
        return outdir
    folder = outdir / f"rank-{meta.get('rank', 0)}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class Children:
    """The watched child processes of one ``graddbg run`` (see `follow_children`): their
    markers' folder, ``<out>/.graddbg-running``, and whether this run made it."""

    def __init__(self, outdir: pathlib.Path) -> None:
        self.outdir = outdir
        self.folder = outdir / MARKERS
        self.created = False
        try:
            self.folder.mkdir()
            self.created = True
        except OSError:  # there already (another run's), or not writable: the children try
            pass

    def wait(self, seconds: float = 30.0, stop: Optional[Callable[[], bool]] = None) -> List[int]:
        """`wait_for_children`."""
        return wait_for_children(self.outdir, seconds, stop)

    def close(self) -> None:
        """Remove the markers' folder if this run made it and it is empty (a child still
        running keeps it)."""
        if self.created:
            with contextlib.suppress(OSError):
                self.folder.rmdir()
            self.created = False


@contextlib.contextmanager
def follow_children(outdir: pathlib.Path, watch_kwargs: Dict[str, Any]) -> Iterator[Children]:
    """While entered, every Python process of this interpreter and environment started from
    this one watches itself once it imports torch (see the module's docstring); the
    environment is put back on exit. Yields the `Children`, whose markers' folder outlives
    the block (``close`` it after waiting for them)."""
    settings: Dict[str, Any] = {"out": str(outdir.resolve()), "graddbg": str(BOOT.parent), "watch": watch_kwargs}
    try:
        text = json.dumps(settings)
    except (TypeError, ValueError):  # (an option that is not plain data: the children use the defaults)
        text = json.dumps({**settings, "watch": {}})
    saved = {k: os.environ.get(k) for k in (ENV, ENV_PYTHON, "PYTHONPATH")}
    parts = [str(BOOT)] + [p for p in (saved["PYTHONPATH"] or "").split(os.pathsep) if p]
    children = Children(outdir)
    os.environ[ENV] = text
    os.environ[ENV_PYTHON] = interpreter()
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    try:
        yield children
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def boot(script_watcher: Any) -> None:
    """In a child process started while ``graddbg run`` ran a script: watch what it
    trains with ``script_watcher`` (`graddbg.cli.ScriptWatcher`), and write the records
    at exit."""
    settings = json.loads(os.environ[ENV])
    watcher = script_watcher(dict(settings.get("watch", {})))
    watcher.outdir = pathlib.Path(settings["out"])
    # (once it watches something, the parent waits for its record: `wait_for_children`; a process
    # that never trains, such as a data loader's worker, is not waited for)
    made: List[pathlib.Path] = []
    watcher.on_watch = lambda w: _mark_running(watcher.outdir, made)
    watcher.__enter__()
    atexit.register(_finish, watcher, watcher.outdir, made)


def _mark_running(outdir: pathlib.Path, made: List[pathlib.Path]) -> None:
    """This child's marker, ``<outdir>/.graddbg-running/<pid>`` (the folder made if the parent
    could not: noted in ``made``, for this child to remove)."""
    folder = outdir / MARKERS
    try:
        if not folder.is_dir():
            outdir.mkdir(parents=True, exist_ok=True)
            folder.mkdir()
            made.append(folder)
        (folder / str(os.getpid())).touch()
    except OSError:
        pass


def _finish(watcher: Any, outdir: pathlib.Path, made: Optional[List[pathlib.Path]] = None) -> None:
    """At a child's exit: each watch's statistics and report under its rank's folder."""
    try:
        watcher.__exit__(None, None, None)
        for i, w in enumerate(watcher.watches):
            folder = record_folder(outdir, w.meta)
            if folder == outdir:
                folder = outdir / f"worker-{os.getpid()}"
                folder.mkdir(parents=True, exist_ok=True)
            suffix = "" if i == 0 else f"-{i + 1}"
            w.save(folder / f"stats{suffix}.parquet")
            w.report(folder / f"report{suffix}.html")
    except Exception as err:  # (a child's exit must not fail because of its record)
        print(f"graddbg run: process {os.getpid()} could not write its record: {err}", file=sys.stderr)
    finally:
        with contextlib.suppress(OSError):
            (outdir / MARKERS / str(os.getpid())).unlink()
        for folder in made or ():
            with contextlib.suppress(OSError):
                folder.rmdir()


def wait_for_children(outdir: pathlib.Path, seconds: float = 30.0,
                      stop: Optional[Callable[[], bool]] = None) -> List[int]:
    """Wait (at most ``seconds``, and only while ``stop()`` is false) for the watched child
    processes still running to write their records (Lightning's ``strategy="ddp"`` does not
    wait for the ranks it started); the pids of those that had not when the wait ended. Only
    graddbg's own markers are read (and removed, those of processes gone without their
    record): ``<outdir>/.graddbg-running/<pid>``."""
    end, delay = time.monotonic() + seconds, 0.01
    folder = outdir / MARKERS
    while True:
        left = []
        try:
            markers = list(folder.iterdir())
        except OSError:  # (none yet, or removed)
            markers = []
        for marker in markers:
            if not marker.name.isdigit() or not 0 < int(marker.name) < 2 ** 31:
                continue  # (not a marker; never os.kill(0 or -1, 0): a process group, every process)
            try:
                os.kill(int(marker.name), 0)
                left.append(int(marker.name))
            except OSError:  # (gone without its record, a crash or a kill; or the pid is another user's now)
                with contextlib.suppress(OSError):
                    marker.unlink()
        if not left or time.monotonic() > end or (stop is not None and stop()):
            return left
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def child_records(outdir: pathlib.Path, since: float) -> List[pathlib.Path]:
    """The records written by other processes of this run (children, forked workers)."""
    found = list(outdir.glob("worker-*/stats.parquet")) + list(outdir.glob("rank-*/stats.parquet"))
    return sorted(p for p in found if p.stat().st_mtime >= since)
