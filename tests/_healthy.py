"""The healthy suite (issue 23, point 3): run each script of tests/healthy/ unwatched
(``python script.py``) and under ``graddbg run``, and compare. Shared by
tests/test_healthy.py and bench/healthy_suite.py.

A healthy run under ``graddbg run`` must: exit 0, print the same losses (``loss <step>
<value>`` lines, compared exactly) as the unwatched run, record 0 anomalies in every run it
saved (``stats*.parquet``), and put no graddbg text (a GraddbgWarning, an AnomalyWarning,
"graddbg run: ..." on stderr) and no warning the unwatched run did not print on stderr.

The DDP script runs unwatched as ``python ddp.py`` (it spawns its 2 ranks) and watched as
``torchrun --nproc-per-node=2 -m graddbg run --out DIR ddp.py`` (graddbg started in each
rank, as under any torchrun launch); its losses are printed by rank 0.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import pathlib
import re
import socket
import subprocess
import sys
import time
import warnings
from typing import Dict, List, Optional, Sequence

from _preloaded import Zygote

HEALTHY = pathlib.Path(__file__).parent / "healthy"
ROOT = HEALTHY.parent.parent
SCRIPTS = sorted(p.stem for p in HEALTHY.glob("*.py"))
DISTRIBUTED = {"ddp"}  # launched by torchrun under graddbg run
#: the scripts the test suite runs (the ones that cried wolf before, and one of each other
#: kind: two optimizers, one optimizer per layer, a closure, a hand-written update, AMP, DDP,
#: a third-party library's own training code: PEFT's LoRA, a frozen base and zero-initialised
#: adapters, the cheapest of the three third-party programs); bench/healthy_suite.py runs
#: all of SCRIPTS
CI_SCRIPTS = ["adam_warmup", "amp_clip", "amp_gradscaler", "ddp", "dcgan", "forward_forward", "lbfgs_sine",
              "peft_lora", "poly_regression", "transformer_lm"]
TIMEOUT = 240.0

_WARNING = re.compile(r"\b\w*(Warning|warning)\b")


@dataclasses.dataclass
class Outcome:
    """What one run of a script printed and (watched) recorded."""

    script: str
    returncode: int
    losses: List[str]
    stdout: str
    stderr: str
    seconds: float
    anomalies: Optional[List] = None  # graddbg.Anomaly of every saved run (watched only)
    load_error: Optional[str] = None  # a saved run that graddbg.load refused
    saved: int = 0  # stats*.parquet files written (watched only)

    def kinds(self) -> Dict[str, int]:
        return dict(collections.Counter(a.kind for a in self.anomalies or []))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> Dict[str, str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               MPLBACKEND="Agg")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _losses(stdout: str) -> List[str]:
    return [line for line in stdout.splitlines() if line.startswith("loss ")]


def _run(script: str, cmd: Sequence[str], cwd: pathlib.Path, zygote: Optional[Zygote] = None) -> Outcome:
    """``cmd`` (``[python, *args]``) run in ``cwd``: a fresh interpreter, or with ``zygote``
    the same arguments run in a process forked from it (tests/_preloaded.py)."""
    t0 = time.perf_counter()
    if zygote is not None:
        module = cmd[1] == "-m"
        rc, out, err, late = zygote.run(cmd[2:] if module else cmd[1:], cwd, TIMEOUT, module=module)
        if late:
            err += f"\n(timed out after {TIMEOUT:g} s)"
        return Outcome(script, rc, _losses(out), out, err, time.perf_counter() - t0)
    try:
        proc = subprocess.run(list(cmd), cwd=cwd, env=_env(), capture_output=True, text=True,
                              timeout=TIMEOUT, stdin=subprocess.DEVNULL)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = -9, _text(e.stdout), _text(e.stderr) + f"\n(timed out after {TIMEOUT:g} s)"
    return Outcome(script, rc, _losses(out), out, err, time.perf_counter() - t0)


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def run_plain(script: str, workdir: pathlib.Path, zygote: Optional[Zygote] = None) -> Outcome:
    """``python script.py``, unwatched (forked from ``zygote`` when given, except the
    distributed scripts)."""
    return _run(script, [sys.executable, str(HEALTHY / f"{script}.py")], workdir,
                None if script in DISTRIBUTED else zygote)


def watched_command(script: str, out: pathlib.Path) -> List[str]:
    graddbg_run = ["-m", "graddbg", "run", "--out", str(out), str(HEALTHY / f"{script}.py")]
    if script in DISTRIBUTED:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                "--master-addr=127.0.0.1", f"--master-port={_free_port()}", *graddbg_run]
    return [sys.executable, *graddbg_run]


def run_watched(script: str, out: pathlib.Path, zygote: Optional[Zygote] = None) -> Outcome:
    """``graddbg run --out OUT script.py`` (torchrun for the distributed ones), then every
    run it saved under OUT loaded with graddbg.load. Forked from ``zygote`` when given,
    except the distributed scripts."""
    res = _run(script, watched_command(script, out), out.parent, None if script in DISTRIBUTED else zygote)
    res.anomalies = []
    try:
        import graddbg

        for path in sorted(out.rglob("stats*.parquet")):
            res.saved += 1
            res.anomalies += graddbg.load(path).anomalies
    except Exception as e:  # reported by the tests, not raised here
        res.load_error = f"{type(e).__name__}: {e}"
    return res


def graddbg_lines(watched: Outcome, plain: Outcome) -> List[str]:
    """stderr lines of the watched run that speak of graddbg, or that are warnings the
    unwatched run did not print."""
    seen = set(plain.stderr.splitlines())
    return [line for line in watched.stderr.splitlines()
            if "graddbg" in line.lower() or (_WARNING.search(line) and line not in seen)]


#: what the zygotes import before they fork (tests/_preloaded.py): for ``python script.py``
#: torch, and torch._dynamo, which torch.optim imports at the first step; for ``graddbg run``
#: also graddbg's command line and matplotlib (its report's figures). Not pandas: its
#: pyarrow starts a thread (jemalloc's) as it is imported, and a zygote with two threads
#: does not fork. (A module that fails to import here is left to the run, which then fails.)
PRELOAD_PLAIN = ["torch", "torch._dynamo"]
PRELOAD_WATCHED = ["torch", "torch._dynamo", "graddbg", "graddbg.cli", "matplotlib.figure"]


def run_suite(scripts: Sequence[str], workdir: pathlib.Path, workers: int = 3, preload: bool = False):
    """{script: (plain, watched)}, runs spread over ``workers`` processes at a time, the
    distributed scripts (the longest) first. ``preload``: the other scripts' runs are forked
    from two zygotes, one that imported :data:`PRELOAD_PLAIN` for the unwatched runs and
    one that imported :data:`PRELOAD_WATCHED` for the watched runs (tests/_preloaded.py:
    each run is still its own process, run as python would, but starts without the 3-5 s
    of imports); fresh interpreters when a zygote cannot fork safely."""
    workdir.mkdir(parents=True, exist_ok=True)
    order = sorted(scripts, key=lambda s: s not in DISTRIBUTED)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as starter:
        zygotes = [starter.submit(Zygote.start, modules, _env()) if preload else None
                   for modules in (PRELOAD_PLAIN, PRELOAD_WATCHED)]

        def zygote(i: int) -> Optional[Zygote]:
            if zygotes[i] is None:
                return None
            z = zygotes[i].result()
            if z is None and not warned:
                warned.append(i)
                warnings.warn("tests/_healthy.py: a zygote could not fork (more than one thread after its "
                              "imports, or it did not start): the runs start fresh interpreters, 3-5 s each")
            return z

        warned: List[int] = []

        try:
            with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
                plain, watched = {}, {}
                for s in order:
                    plain[s] = pool.submit(lambda s=s: run_plain(s, workdir, zygote(0)))
                    watched[s] = pool.submit(lambda s=s: run_watched(s, workdir / f"out-{s}", zygote(1)))
                return {s: (plain[s].result(), watched[s].result()) for s in scripts}
        finally:
            for z in zygotes:
                if z is not None and z.result() is not None:
                    z.result().close()
