"""Runs of ``python script.py`` and ``python -m module ...`` forked from one process that
imported the heavy modules once (a "zygote"), for tests/_healthy.py.

Most of a short training script's run is the interpreter's start and ``import torch`` (and
``torch._dynamo``, which the optimizers import on their first step; under ``graddbg run``
also graddbg, pandas, pyarrow and matplotlib): 3-5 s of CPU, of a run that trains for a
fraction of a second. Forked from a zygote that imported them, a run starts at once.

A forked run is still its own process, run as python runs a script or a module: the
script (``runpy.run_path``, its folder first on ``sys.path``) or the module
(``runpy._run_module_as_main``, as ``python -m`` does, the current folder first) as
``__main__``, ``sys.argv`` as given, its own stdout and stderr files, stdin from
/dev/null, the exit status python would give (``SystemExit``'s code, 1 for an uncaught
exception with its traceback on stderr), then python's own shutdown: non-daemon threads
joined, ``atexit`` handlers run, streams flushed. What the zygote printed on stderr while it
imported (a warning raised by an import) is put first in every run's stderr, as a fresh
interpreter would have printed it.

The zygote only forks when importing left it with one thread (forking a process with more
is unsafe); otherwise :func:`Zygote.start` returns None and the caller runs fresh
interpreters."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
from typing import Dict, List, Optional, Sequence, Tuple


class Zygote:
    """A zygote process (this file run as a script) and the runs forked from it."""

    def __init__(self, proc: subprocess.Popen, preload_stderr: str) -> None:
        self._proc = proc
        self.preload_stderr = preload_stderr
        self._lock = threading.Lock()
        self._next = 0
        self._events: Dict[int, threading.Event] = {}
        self._replies: Dict[int, dict] = {}
        self._reader = threading.Thread(target=self._read, daemon=True, name="zygote-reader")
        self._reader.start()

    @classmethod
    def start(cls, modules: Sequence[str], env: Dict[str, str], timeout: float = 120) -> Optional["Zygote"]:
        """A zygote that imported ``modules`` (in the environment ``env``), or None when it
        could not fork safely (more than one thread after the imports) or did not start."""
        fd, err_path = tempfile.mkstemp(prefix="zygote-", suffix=".stderr")
        os.close(fd)
        proc = subprocess.Popen([sys.executable, __file__, err_path, *modules], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, bufsize=1)
        ready: List[str] = []
        reader = threading.Thread(target=lambda: ready.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        err = pathlib.Path(err_path).read_text(errors="replace")
        os.unlink(err_path)
        hello = json.loads(ready[0]) if ready and ready[0].strip() else {}
        if hello.get("threads") != 1:
            proc.kill()
            proc.wait()
            return None
        return cls(proc, err)

    def _read(self) -> None:
        for line in self._proc.stdout:
            msg = json.loads(line)
            with self._lock:
                self._replies.setdefault(msg["id"], {}).update(msg)
                event = self._events.get(msg["id"])
            if event is not None:
                event.set()
        with self._lock:  # the zygote ended: nothing more will come
            for event in self._events.values():
                event.set()

    def _wait(self, rid: int, key: str, timeout: Optional[float]) -> Optional[dict]:
        while True:
            with self._lock:
                reply = self._replies.get(rid, {})
                if key in reply or self._proc.poll() is not None:
                    return reply if key in reply else None
                event = self._events[rid]
                event.clear()
            if not event.wait(timeout):
                return None

    def run(self, argv: Sequence[str], cwd: pathlib.Path, timeout: float, module: bool = False
            ) -> Tuple[int, str, str, bool]:
        """Run ``argv`` (``[script, *args]``, or ``[module, *args]`` with ``module``) in a
        forked child: (exit status, stdout, stderr, timed out). A child past ``timeout``
        seconds is killed (-9, as subprocess gives it)."""
        with tempfile.TemporaryDirectory(prefix="zygote-run-") as d:
            out, err = pathlib.Path(d, "stdout"), pathlib.Path(d, "stderr")
            with self._lock:
                rid, self._next = self._next, self._next + 1
                self._events[rid] = threading.Event()
                request = dict(id=rid, argv=list(argv), cwd=str(cwd), out=str(out), err=str(err), module=module)
                self._proc.stdin.write(json.dumps(request) + "\n")
                self._proc.stdin.flush()
            started = self._wait(rid, "pid", 60)
            if started is None:
                raise RuntimeError("the zygote did not fork the run")
            timed_out = False
            done = self._wait(rid, "status", timeout)
            if done is None:
                timed_out = True
                try:
                    os.kill(started["pid"], 9)
                except ProcessLookupError:
                    pass
                done = self._wait(rid, "status", 30) or {"status": -9}
            with self._lock:
                self._events.pop(rid, None)
                self._replies.pop(rid, None)
            return (done["status"], out.read_text(errors="replace"),
                    self.preload_stderr + err.read_text(errors="replace"), timed_out)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()  # the zygote ends when its stdin does
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


# ---- the zygote itself (this file run as a script) ----

def _exit_status(code) -> int:
    """The exit status of ``sys.exit(code)``, as python gives it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _child(req: dict) -> None:
    """In the forked child: run the request as python would, then end with its status."""
    import atexit
    import runpy
    import signal
    import traceback

    status = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.chdir(req["cwd"])
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        sys.argv = list(req["argv"])
        if req["module"]:
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(req["argv"][0])  # what python -m does
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(req["argv"][0]))
            runpy.run_path(req["argv"][0], run_name="__main__")
        status = 0
    except SystemExit as e:
        status = _exit_status(e.code)
    except BaseException as e:  # noqa: BLE001 (python prints it with sys.excepthook and exits 1)
        tb = e.__traceback__
        if req["module"]:  # python -m shows runpy's frames from _run_module_as_main on
            tb = tb.tb_next if tb is not None else tb
        else:  # python script.py shows the script's frames only
            script = os.path.abspath(req["argv"][0])
            while tb is not None and tb.tb_frame.f_code.co_filename != script:
                tb = tb.tb_next
        e.__traceback__ = tb or e.__traceback__  # (what the hook prints)
        try:
            sys.excepthook(type(e), e, e.__traceback__)
        except BaseException:  # noqa: BLE001
            traceback.print_exception(e)
        status = 1
        if isinstance(e, KeyboardInterrupt):  # python ends by SIGINT then
            status = -signal.SIGINT
    finally:
        try:
            threading._shutdown()  # (python's shutdown: non-daemon threads joined, then atexit)
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            if status < 0:
                signal.signal(-status, signal.SIG_DFL)
                os.kill(os.getpid(), -status)
            os._exit(status & 0xFF)


def _zygote(err_path: str, modules: Sequence[str]) -> None:
    import importlib
    import select

    reply = sys.stdout
    err = os.open(err_path, os.O_WRONLY | os.O_TRUNC)
    os.dup2(err, 2)
    os.close(err)
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 (left to the runs, which import it themselves and fail visibly)
            pass
    sys.stderr.flush()
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()
    reply.write(json.dumps({"id": -1, "threads": threads}) + "\n")
    reply.flush()
    if threads != 1:
        return
    running: Dict[int, int] = {}  # pid -> request id
    requests = sys.stdin.buffer.raw if hasattr(sys.stdin.buffer, "raw") else sys.stdin.buffer
    pending, open_ = b"", True
    while open_ or running:
        if open_:
            ready, _, _ = select.select([requests], [], [], 0.02)
            if ready:
                chunk = os.read(requests.fileno(), 65536)
                open_ = bool(chunk)
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    req = json.loads(line)
                    pid = os.fork()
                    if pid == 0:
                        _child(req)
                    running[pid] = req["id"]
                    reply.write(json.dumps({"id": req["id"], "pid": pid}) + "\n")
                    reply.flush()
        else:
            select.select([], [], [], 0.02)
        while running:
            pid, how = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            rid = running.pop(pid, None)
            if rid is not None:
                status = os.waitstatus_to_exitcode(how)
                reply.write(json.dumps({"id": rid, "status": status}) + "\n")
                reply.flush()


if __name__ == "__main__":
    _zygote(sys.argv[1], sys.argv[2:])
