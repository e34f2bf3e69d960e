"""Subprocesses of a test module started together, each test waiting for its own.

A test that runs ``graddbg run`` or a fresh interpreter spends most of its time in the child:
an interpreter start and ``import torch`` (3-4 s of CPU, and more of waiting on a loaded
machine), while the test process waits. Started at once, two at a time, the children of a
module overlap one another and the module's in-process tests; each test still asserts on its
own child's exit status, output and files. Only the children of the tests selected in this
session are started (``pytest -k one_of_them`` runs one).

A test whose assertions are about time calls :meth:`Together.drain` first, so that nothing
started here runs beside it.

A child started from a worker thread gets its environment as a list built in Python (``env=``),
never the C ``environ`` that ``execv`` would read: a test in the main thread may set a variable
at that moment (``monkeypatch.setenv``), and glibc may move ``environ`` under a ``vfork``ed
child's ``execv``, which then fails with EFAULT ("Bad address"). :func:`run` does this; the
environment is the one of when :meth:`Together.start` was called."""
from __future__ import annotations

import concurrent.futures
import os
import pathlib
import subprocess
import sys
import threading
from typing import Callable, Dict, Iterable, Optional

import pytest

# Two at a time: the children are CPU-bound once torch is read from disk, and the suite's
# machine has two cores.
WORKERS = 2

_LOCAL = threading.local()  # .env: the environment its Together.start saw, in a worker thread


def _with_env(env: dict, fn: Callable, args: tuple, kwargs: dict):
    _LOCAL.env = env
    try:
        return fn(*args, **kwargs)
    finally:
        del _LOCAL.env


class Together:
    """Children keyed by name; :meth:`result` waits for one (a test fails with its error)."""

    def __init__(self, workers: int = WORKERS) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="together")
        self._futures: Dict[str, concurrent.futures.Future] = {}

    def start(self, key: str, fn: Callable, *args, **kwargs) -> None:
        self._futures[key] = self._pool.submit(_with_env, dict(os.environ), fn, args, kwargs)

    def result(self, key: str):
        if key not in self._futures:
            raise KeyError(f"{key!r} was not started: its test was not selected when the children started")
        return self._futures[key].result()

    def drain(self) -> None:
        """Wait until every child started here has ended (whatever its outcome)."""
        concurrent.futures.wait(list(self._futures.values()))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def selected(request: pytest.FixtureRequest, names: Iterable[str]) -> Dict[str, list]:
    """Of the test functions ``names`` in the requesting module, those selected this session:
    {name: [the parameter ids selected, or [""] when the test is not parametrized]}."""
    wanted = set(names)
    module = request.node.path if hasattr(request.node, "path") else None
    got: Dict[str, list] = {}
    for item in request.session.items:
        if getattr(item, "originalname", None) in wanted and getattr(item, "path", None) == module:
            spec = getattr(item, "callspec", None)
            got.setdefault(item.originalname, []).append(spec.id if spec is not None else "")
    return got


def run(cmd: list, cwd: Optional[pathlib.Path] = None, timeout: float = 180, **kw) -> subprocess.CompletedProcess:
    """``subprocess.run`` as the tests call it: output captured as text, no stdin, and the
    environment passed explicitly (see the module's docstring)."""
    kw.setdefault("env", getattr(_LOCAL, "env", None) or dict(os.environ))
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          stdin=subprocess.DEVNULL, **kw)


def python(*args: str, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, *args], **kw)
