"""The ``graddbg`` command line: ``demo``, ``run`` and ``report``.

Exit codes: 0 healthy, 1 anomalies found (see ``--fail-on``), the script failed or an
output could not be written, 2 usage errors and bad input (one line on stderr, no
traceback); ``graddbg run`` stopped by a signal exits 128 + its number (130 for Ctrl-C,
143 for SIGTERM, 129 for SIGHUP) after writing what was recorded, and a script that calls
``sys.exit(code)`` exits as Python would (its message printed, 1 for a string).
"""
from __future__ import annotations

import argparse
import html
import importlib.util
import math
import os
import pathlib
import platform
import runpy
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from graddbg._args import did_you_mean
from graddbg._launch import Children, child_records, follow_children, rank_folder, record_folder
from graddbg._demo_model import demo_loss, demo_model, train as train_demo
from graddbg._errors import GraddbgError, GraddbgValueError, GradientAnomalyError
from graddbg._io import write_atomic
from graddbg._script import ScriptWatcher, Signals, Snapshots, Terminated, outputs
from graddbg.anomaly import HYGIENE_KINDS
from graddbg.options import WatchOptions
from graddbg.plots import counted

__all__ = ["main", "demo", "run_script", "report"]

POLICIES = ("raise", "warn", "skip", "record", "none")
FAIL_ON = ("any", "nonfinite", "never")
SAVE_EVERY = 30.0  # seconds between the statistics snapshots of `graddbg run`

# The last script's __main__ module, kept to the end of the process: its objects die at the
# interpreter's exit as under plain python (a DataLoader's workers terminated at exit). Freed
# earlier, a cycle holding a DataLoader iterator and its queues is collected while the report
# is written: the queues' finalizers run first and each worker's join waits out 5 s.
_SCRIPT_NAMESPACE: List[Any] = []


class UsageError(GraddbgValueError):
    """A bad command line or bad input: exit code 2, one line on stderr."""


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line (no usage dump), and an unknown command or
    option named with the closest one accepted (as ``watch()`` names an unknown keyword)."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = self._commands().get(getattr(parsed, "command", None) or "", self)
            unknown = next((a for a in extras if a.startswith("-")), None)
            if unknown is None:
                command.error(f"unrecognized arguments: {' '.join(extras)}")
            name = unknown.split("=", 1)[0]
            accepted = [o for a in command._actions for o in a.option_strings if o.startswith("--")]
            command.error(f"unknown option {name!r}{did_you_mean(name, accepted)}")
        return parsed

    def _commands(self) -> Dict[str, argparse.ArgumentParser]:
        return next((dict(a.choices) for a in self._actions if isinstance(a, argparse._SubParsersAction)), {})

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if isinstance(action, argparse._SubParsersAction) and value not in action.choices:
            raise argparse.ArgumentError(None, f"unknown command {value!r}{did_you_mean(value, list(action.choices))}; "
                                               f"accepted: {', '.join(action.choices)}")
        super()._check_value(action, value)  # type: ignore[misc]


def _policy(value: str) -> Optional[str]:
    return None if value == "none" else value


def _out_folder(out: Any, arg: str = "--out") -> Tuple[pathlib.Path, bool]:
    """The output folder, created if needed and checked writable before anything runs:
    (folder, whether it was created here). A folder that cannot be made or written is a
    UsageError."""
    if not isinstance(out, (str, os.PathLike)):
        raise UsageError(f"{arg}: expected a folder name, got {type(out).__name__}")
    folder = pathlib.Path(out)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{arg}: {str(folder)!r} exists and is not a folder")
    existed = folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{arg}: cannot create the folder {str(folder)!r}: {e.strerror or e}") from None
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise UsageError(f"{arg}: cannot write in the folder {str(folder)!r}: {e.strerror or e}") from None
    return folder, not existed


def _out_file(out: Any, arg: str = "--out") -> pathlib.Path:
    """An output file whose folder exists and is writable (checked before any work)."""
    path = pathlib.Path(out)
    if path.is_dir():
        raise UsageError(f"{arg}: {str(path)!r} is a folder; give a file name such as "
                         f"{str(path / 'report.html')!r}")
    folder = path.parent
    if not folder.is_dir():
        raise UsageError(f"{arg}: the folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{arg}: cannot write in the folder {str(folder)!r}")
    return path


# --------------------------------------------------------------------------- output helpers

class Progress:
    """A one-line progress bar on a terminal; a line every ``every`` steps elsewhere."""

    def __init__(self, total: int, stream: Any = None, width: int = 30) -> None:
        self.total, self.width = total, width
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = max(1, total // 5)

    def update(self, i: int, note: str = "") -> None:
        done = int(self.width * i / self.total)
        line = f"[{'#' * done}{'.' * (self.width - done)}] step {i}/{self.total} {note}"
        if self.tty:
            self.stream.write("\r" + line[:120].ljust(120))
            if i == self.total:
                self.stream.write("\n")
        elif i % self.every == 0 or i == self.total:
            self.stream.write(line + "\n")
        self.stream.flush()


def _table(frame: Any, columns: Sequence[str], max_rows: int = 20) -> str:
    """A plain-text table of a DataFrame's columns (numbers in 4 significant digits)."""
    rows = [list(columns)]
    for _, r in frame.head(max_rows).iterrows():
        cells = []
        for c in columns:
            v = r[c]
            cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(w) if j else cell.ljust(w) for j, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if len(frame) > max_rows:
        lines.append(f"... {len(frame) - max_rows} more rows")
    return "\n".join(lines)


def _fix(message: str) -> str:
    """The likely cause and the fix of a hygiene finding's message."""
    i = message.find("Likely cause")
    return message[i:] if i >= 0 else message


def _anomaly_lines(anomalies: Sequence[Any]) -> str:
    if not anomalies:
        return "no anomalies"
    out = []
    shown = list(anomalies)[:12]
    for a in shown:
        where = f"module {a.module or '<root>'}" + (f", op {a.op}" if a.op else "") + \
                (f", {a.source}" if a.source else "")
        if a.kind == "explode" and a.module is None:  # (named by its cause, not by a module)
            first = a.message.split(", and then")[0].split(". ")[0].replace("graddbg: ", "", 1)
            where = first if len(first) <= 150 else first[:146] + " ..."
        rank = f"  rank {a.rank}" if getattr(a, "rank", None) is not None else ""
        out.append(f"  step {a.step:>4}{rank}  {a.kind:<12} {a.name or '-':<16} {where}")
        if a.kind in HYGIENE_KINDS:
            out.append(f"             {_fix(a.message)}")
    if len(anomalies) > len(shown):
        out.append(f"  ... and {len(anomalies) - len(shown)} more")
    return "\n".join(out)


# --------------------------------------------------------------------------- demo

def demo(out: str = "graddbg-out", steps: int = 120, *, nan_step: int = 30, jump_step: int = 80,
         stream: Any = None, seed: int = 0) -> Dict[str, Any]:
    """Train a small regression model with two planted faults and watch catch both.

    - at step ``nan_step`` a batch holds an all-zero row: ``RowNorm`` computes 0/0 in the
      forward pass (NaN), caught as ``nonfinite`` and skipped (the weights stay finite);
    - at step ``jump_step`` the learning rate jumps 1000x for one step: the next gradient
      norm explodes and is caught as ``explode``.

    Writes ``report.html``, ``graph.svg`` (the annotated autograd graph of the NaN's step,
    the node that made it outlined; ``graph.dot``,
    with a note on ``stream``, when Graphviz's ``dot`` is not installed) and
    ``stats.parquet`` to ``out``, and prints a progress bar (on stderr), the per-parameter
    summary and the anomalies caught (on ``stream``). ``graddbg demo`` calls it.

    Args:
        out: the output folder, created if needed (with its parents).
        steps: the number of training steps (an int >= 1).
        nan_step: the step (counted from 0) whose batch holds the all-zero row (from
            ``steps`` on: no NaN is planted).
        jump_step: the step (counted from 0) whose learning rate is 1000 times larger
            (from ``steps`` on: no jump is planted).
        stream: where the summary is printed (None: ``sys.stdout``).
        seed: the seed of the model's initialisation and of the data.

    Returns:
        dict: ``"watch"``, the closed `graddbg.Watch` of the run, ``"files"``, a dict
            of the paths written (``"report"``, ``"graph"``, ``"stats"``, each a
            ``pathlib.Path``), and ``"graph"``, the `graddbg.graphviz.Graph` drawn (the
            NaN's step, its producer outlined).

    Raises:
        UsageError: ``steps``, ``nan_step`` or ``jump_step`` is not an int (or is a bool),
            ``steps`` < 1 or a step < 0, or ``out`` is not a folder name, names a file, or
            cannot be created or written in (checked before training). A ``UsageError`` is
            a `GraddbgValueError`.
        GraddbgError: the statistics or the report could not be written.
    """
    for arg, value in (("steps", steps), ("nan_step", nan_step), ("jump_step", jump_step)):
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if arg == "steps" else 0):
            raise UsageError(f"demo({arg}=...) must be an int >= {1 if arg == 'steps' else 0}, got {value!r}")
    stream = stream or sys.stdout
    outdir, _ = _out_folder(out, "out")
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = demo_model()
    true_w = torch.randn(16, generator=gen)
    print(f"graddbg demo: training {sum(p.numel() for p in model.parameters())} parameters for {steps} "
          f"steps, faults planted at step {nan_step} (0/0 in a normalisation) and step {jump_step} "
          f"(learning rate x1000 for one step)", file=stream)
    kept: Dict[str, Any] = {}  # (the NaN step's batch and weights: its graph is drawn)
    w = _demo_train(model, true_w, gen, steps, nan_step, jump_step, kept)
    print("\nper-parameter summary:", file=stream)
    print(_table(w.summary(), ["name", "numel", "norm_mean", "norm_max", "nonfinite_steps",
                               "update_ratio_mean"]), file=stream)
    print("\nanomalies caught:", file=stream)
    print(_anomaly_lines(w.anomalies), file=stream)
    files = _demo_files(w, model, true_w, gen, outdir, stream, kept)
    print(f"\nwrote {files['report']}\n      {files['graph']}\n      {files['stats']}", file=stream)
    print(f"done in {time.perf_counter() - t0:.1f} s", file=stream)
    return {"watch": w, "files": files, "graph": kept["graph"]}


def _demo_train(model: nn.Module, true_w: torch.Tensor, gen: torch.Generator, steps: int,
                nan_step: int, jump_step: int, kept: Optional[Dict[str, Any]] = None) -> Any:
    bar = Progress(steps)
    return train_demo(model, true_w, gen, steps, nan_step, jump_step, on_step=lambda i, loss, w: bar.update(
        i + 1, f"loss {loss:.4g}  anomalies {len(w.anomalies)}"), kept=kept)


def _demo_files(w: Any, model: nn.Module, true_w: torch.Tensor, gen: torch.Generator,
                outdir: pathlib.Path, stream: Any, kept: Optional[Dict[str, Any]] = None) -> Dict[str, pathlib.Path]:
    """The annotated autograd graph of the NaN's step (its batch and weights, the node that
    made the NaN outlined; of one more, healthy, step when no NaN was caught), the report and
    the run."""
    import graddbg

    nan = next((a for a in w.anomalies if a.kind == "nonfinite"), None)
    if nan is not None and kept and "nan_x" in kept:
        at = demo_model()
        at.load_state_dict(kept["nan_state"])
        x, where = kept["nan_x"], f"{nan.op} in module '{nan.module}'" if nan.op else f"module '{nan.module}'"
        graph = graddbg.graph(lambda: demo_loss(at, x, true_w), model=at, grads=True, mark=nan,
                              caption=f"The autograd graph of step {nan.step}, the step of the NaN: its batch and "
                                      f"weights. Outlined in orange: the node that made it ({where}).")
    else:
        x = torch.randn(8, 16, generator=gen)
        graph = graddbg.graph(lambda: demo_loss(model, x, true_w), model=model, grads=True, watch=w,
                              caption="The autograd graph of one more step after training, on a new batch.")
    kept = kept if kept is not None else {}
    kept["graph"] = graph
    files = {"report": outdir / "report.html", "graph": outdir / "graph.svg", "stats": outdir / "stats.parquet"}
    try:
        graph.render(files["graph"], format="svg")
    except GraddbgError as e:  # no `dot`: keep the DOT text and say so
        files["graph"] = write_atomic(outdir / "graph.dot", graph.source)
        print(f"note: {e}", file=stream)
    w.save(files["stats"])
    w.report(files["report"], graph=graph)
    return files


# --------------------------------------------------------------------------- run


#: watch()'s options that take a policy, each a flag of ``graddbg run`` (``--stale-grad``)
POLICY_OPTIONS = ("nonfinite", "explode", "vanish") + HYGIENE_KINDS


def _check_run_args(script: Any, fail_on: Any, save_every: Any, module: bool = False) -> pathlib.Path:
    """The arguments of run_script that are its own, checked before anything runs
    (UsageError: exit 2); the file of the script (or of the module) to run."""
    if module:
        path = _module_file(script)
    elif not isinstance(script, (str, os.PathLike)) or not pathlib.Path(script).is_file():
        raise UsageError(f"script: {script!r} does not exist or is not a file")
    else:
        path = pathlib.Path(script)
    if fail_on not in FAIL_ON:
        raise UsageError(f"--fail-on: got {fail_on!r}; accepted: {', '.join(FAIL_ON)}")
    if isinstance(save_every, bool) or not isinstance(save_every, (int, float)) \
            or not math.isfinite(save_every) or save_every < 0:
        raise UsageError(f"--save-every must be a number of seconds >= 0 (0: only at exit), "
                         f"got {save_every!r}")
    return path


def _module_file(name: Any) -> pathlib.Path:
    """The file ``python -m name`` runs (a package's ``__main__``), found as python finds
    it, from the current folder first (its parent packages are imported, as python does)."""
    if not isinstance(name, str) or not name or name.startswith("."):
        raise UsageError(f"-m: expected a module name such as 'package.train', got {name!r}")
    sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:  # a package: its __main__
            spec = importlib.util.find_spec(name + ".__main__")
            if spec is None:
                raise UsageError(f"-m: {name!r} is a package and cannot be run (it has no __main__ module)")
    except (ImportError, ValueError) as e:
        raise UsageError(f"-m: error while finding the module {name!r} ({type(e).__name__}: {e})") from None
    finally:
        sys.path.remove(os.getcwd())
    if spec is None:
        raise UsageError(f"-m: no module named {name!r} (from the current folder {os.getcwd()!r} or sys.path)")
    if not spec.origin or not os.path.isfile(spec.origin):
        raise UsageError(f"-m: the module {name!r} has no Python source file to run ({spec.origin})")
    return pathlib.Path(spec.origin)


def _watch_options(given: Dict[str, Any]) -> Dict[str, Any]:
    """watch()'s options from the command line's spelling (a policy "none" is None),
    validated through `graddbg.options.WatchOptions` (UsageError: exit 2)."""
    every = given.get("every", 1)
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise UsageError(f"--every must be >= 1, got {every!r}")
    kw = dict(given)
    for arg in POLICY_OPTIONS:
        value = kw.get(arg)
        if isinstance(value, str):
            if value not in POLICIES:
                raise UsageError(f"--{arg.replace('_', '-')}: got {value!r}; accepted: {', '.join(POLICIES)}")
            kw[arg] = _policy(value)
    kw.setdefault("vanish", None)
    try:
        WatchOptions.parse("graddbg run", kw)
    except GraddbgError as err:
        raise UsageError(str(err)) from None
    return kw


def run_script(script: str, args: Sequence[str], *, out: str = "graddbg-out", fail_on: str = "any",
               save_every: float = SAVE_EVERY, stream: Any = None, module: bool = False,
               **watch_options: Any) -> int:
    """Run ``script`` unchanged with what it trains watched; ``graddbg run`` calls it.

    What is watched: every optimizer the script steps, with its model; without an
    optimizer, the model it runs backward through, a step per backward pass (see
    `ScriptWatcher`). The statistics (``stats.parquet``) and the report (``report.html``)
    are written to ``out`` at exit, also when the script crashes, is interrupted (Ctrl-C)
    or is stopped by SIGTERM / SIGHUP, and the statistics every ``save_every`` seconds on
    the way. Every argument and the ``out`` folder are checked before the script starts.
    Several watches (a grid search trains a model per fit) give a report each and
    ``index.html``, which links them in order. A script that fails before anything was
    watched (a SyntaxError, an exception at import) shows its own traceback alone, as
    python would.
    The script's own exceptions are not raised: they are printed on stderr and make the
    exit code (see the module docstring).

    Args:
        script: the path of the Python script, run as ``__main__`` (with ``module``: the
            name of a module, run as ``python -m script`` runs it).
        args: the script's command-line arguments (its ``sys.argv[1:]``).
        out: the output folder, created if needed (removed again when it was created here
            and nothing was watched).
        fail_on: which findings make the exit code 1: ``"any"`` (every anomaly),
            ``"nonfinite"`` (NaN/Inf only) or ``"never"``.
        save_every: seconds between the statistics snapshots written while the script
            runs (0: only at exit).
        stream: where the summary lines are printed (None: ``sys.stdout``).
        module: ``script`` is a module's name (``graddbg run -m``), found from the current
            folder first, as python finds it.
        **watch_options: `graddbg.watch`'s keyword options; a policy may be spelled
            ``"none"`` (for None).

    Returns:
        int: the exit code, 0 healthy, 1 anomalies counted by ``fail_on``, a script that failed
            or an output not written, 128 + the signal's number when stopped by a signal,
            or the code of the script's own ``sys.exit``.

    Raises:
        UsageError: ``script`` is not an existing file, ``fail_on`` or ``save_every`` is
            not accepted, a watch option is unknown or has a bad value (``every`` < 1, a
            policy that is not one of ``"raise"``, ``"warn"``, ``"skip"``, ``"record"``,
            ``"none"``), or ``out`` cannot be created or written in. A ``UsageError`` is a
            `GraddbgValueError` (a ``ValueError``).
    """
    stream = stream or sys.stdout
    path = _check_run_args(script, fail_on, save_every, module)
    kwargs = _watch_options(watch_options)
    outdir, created = _out_folder(out)
    outdir = rank_folder(outdir)  # (under torchrun: each rank's own folder)
    watcher = ScriptWatcher(kwargs)
    watcher.outdir = outdir.resolve()
    started = time.time() - 1.0
    watcher.after_step = Snapshots(outdir, float(save_every), watcher.watches)
    with Signals() as signals:  # (from the script's end on, a signal waits for the record to be written)
        with follow_children(outdir, kwargs) as children:  # (processes the script starts are watched too)
            status, failure = _execute(path, args, watcher, signals, script if module else None)
        if failure and failure.startswith(_RAISED) and not watcher.watches:  # (as python shows it)
            print(failure[len(_RAISED):], file=sys.stderr, end="")
        elif failure:
            print(f"graddbg run: {failure}", file=sys.stderr)
        status = _finish(watcher.watches, outdir, created, status, fail_on, stream, since=started,
                         children=children, stop=lambda: bool(signals.deferred))
    if signals.deferred:
        print(f"graddbg run: {signal.Signals(signals.deferred[0]).name} while the record was written: "
              f"it was written first", file=sys.stderr)
    if signals.received is not None and status <= 128:  # a signal while the results were written
        status = 128 + signals.received
    _SCRIPT_NAMESPACE[:] = [watcher.namespace]  # freed at exit, as plain python frees a script's objects
    return status


_RAISED = "the script raised:\n"


def _execute(path: pathlib.Path, args: Sequence[str], watcher: ScriptWatcher,
             signals: Signals, module: Optional[str] = None) -> Tuple[int, Optional[str]]:
    """Run the script (or the module ``module``, whose file is ``path``) as ``__main__``:
    (exit status, what went wrong or None)."""
    old_argv, folder = sys.argv[:], os.getcwd() if module else str(path.resolve().parent)
    sys.argv = [module or str(path), *args]  # (run_module puts the module's file in argv[0])
    sys.path.insert(0, folder)
    try:
        with watcher:
            try:
                if module:
                    runpy.run_module(module, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(str(path.resolve()), run_name="__main__")  # (__file__ absolute, as python gives it)
            finally:
                signals.disarm()
    except Terminated as e:
        return 128 + e.signum, f"terminated by {signal.Signals(e.signum).name}; saving what was recorded"
    except SystemExit as e:
        return _exit_status(e.code), None
    except KeyboardInterrupt:
        return 130, "interrupted"
    except GradientAnomalyError as e:
        return 1, f"stopped by graddbg: {e}"
    except BaseException as e:
        return 1, _RAISED + _script_traceback(e, path)
    finally:
        sys.argv = old_argv
        if sys.path and sys.path[0] == folder:
            sys.path.pop(0)
    return 0, None


def _exit_status(code: Any) -> int:
    """The exit status of ``sys.exit(code)``, as Python gives it: None is 0, an int itself,
    anything else is printed on stderr and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _script_traceback(exc: BaseException, script: pathlib.Path) -> str:
    """The traceback from the script's own frames on (graddbg's and runpy's left out); a
    SyntaxError in the script (no frame of its own ran) as python shows it, alone."""
    target = os.path.realpath(script)
    tb = exc.__traceback__
    while tb is not None and os.path.realpath(tb.tb_frame.f_code.co_filename) != target:
        tb = tb.tb_next
    if tb is None and isinstance(exc, SyntaxError):
        return "".join(traceback.format_exception_only(type(exc), exc))
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))


def _finish(watches: List[Any], outdir: pathlib.Path, created: bool, status: int,
            fail_on: str, stream: Any, since: float = 0.0, children: Optional[Children] = None,
            stop: Any = None) -> int:
    """Write each watch's statistics and report (under distribution, rank 0 writes: the
    table is the same on every rank); the exit status. The watched children are waited for
    first (until ``stop()``), and their markers' folder removed."""
    if children is not None:
        if outdir.is_dir():
            children.wait(stop=stop)  # (ranks a framework started and does not wait for: Lightning's ddp)
        children.close()
    workers = child_records(outdir, since)
    if not watches and not workers and status != 0:  # (the script failed or stopped: it says why)
        _remove_empty(outdir, created)
        return status
    if not watches and not workers:
        print("graddbg run: the script stepped no optimizer and ran no backward pass through a module "
              "in this process; nothing was watched (a script that trains in spawned worker processes "
              "is not followed: call graddbg.watch(model, optimizer) inside the worker)", file=stream)
        _remove_empty(outdir, created)
        return status
    reports = [_write(w, outdir, i, stream) for i, w in enumerate(watches)]
    written = all(r is not None for r in reports)
    if len(watches) > 1:
        print(f"graddbg run: {len(watches)} models watched, a report each; index of the reports: "
              f"{_write_index(watches, reports, outdir)}", file=stream)
    anomalies = [a for w in watches for a in w.anomalies]
    for path in workers:
        import graddbg

        run = graddbg.load(path)
        anomalies += run.anomalies
        print(f"graddbg run: a worker process ({path.parent.name}) recorded "
              f"{counted(len(run.stats['step'].unique()), 'step')}; {counted(len(run.anomalies), 'anomaly')}; "
              f"report: {path.parent / 'report.html'}", file=stream)
    if anomalies:
        print(_anomaly_lines(anomalies), file=stream)
    # (a GradScaler's skipped steps are never anomalies; a fact, such as a layer a library
    # leaves unused by design, is named but never fails the run)
    found = [a for a in anomalies if getattr(a, "severity", "bug") != "fact"]
    if fail_on == "nonfinite":
        found = [a for a in found if a.kind == "nonfinite"]
    if status == 0 and ((fail_on != "never" and found) or not written):
        status = 1
    return status


def _remove_empty(outdir: pathlib.Path, created: bool) -> None:
    """The output folder made by this run, removed when nothing was written in it."""
    if created:
        try:
            outdir.rmdir()  # leave no empty folder behind
        except OSError:
            pass


def _write(w: Any, outdir: pathlib.Path, i: int, stream: Any) -> Optional[pathlib.Path]:
    """One watch's record and its line on the console; its report, or None when it could not
    be written. The report names the run file (``graddbg.load(...)``), not ``w``."""
    stats_path, report_path = outputs(record_folder(outdir, w.meta), i)  # (each rank its own)
    try:
        run = w.to_run()
        run.save(stats_path)  # the data first: it is what a report can be made from again
        run.source = stats_path
        rep = run.report(report_path)
    except GraddbgError as e:
        print(f"graddbg run: error: {e}", file=sys.stderr)
        return None
    how = (f"with {w.meta['optimizer']}" if w.meta["optimizer"]
           else "without an optimizer (a step per backward pass)")
    print(f"graddbg run: watched {w.meta['model']} {how} for {counted(w.current_step, 'step')}; "
          f"{counted(len(w.anomalies), 'anomaly')}; report: {rep}", file=stream)
    return rep


_INDEX_CSS = ("body{font-family:system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:24px;"
              "color:#222} h1{font-size:20px} p{color:#555;font-size:13px} ol{list-style:none;padding:0}"
              "li{margin:6px 0} a{color:#1f4e79} li.bad a{color:#c62828}")


def _write_index(watches: List[Any], reports: List[Optional[pathlib.Path]], outdir: pathlib.Path) -> pathlib.Path:
    """``index.html``: every watch of the run in order, each line its model, optimizer, steps
    and findings, linking its report ("1. MLP with Adam — 48 steps, 3 findings")."""
    items = []
    for i, (w, rep) in enumerate(zip(watches, reports), 1):
        how = f" with {w.meta['optimizer']}" if w.meta.get("optimizer") else ""
        text = html.escape(f"{i}. {w.meta['model']}{how}")
        facts = html.escape(f" — {counted(w.current_step, 'step')}, {counted(len(w.anomalies), 'finding')}")
        link = f'<a href="{html.escape(os.path.relpath(rep, outdir))}">{text}</a>' if rep else f"{text} (not written)"
        bad = ' class="bad"' if w.anomalies else ""
        items.append(f"<li{bad}>{link}{facts}</li>")
    title = f"graddbg run: {len(watches)} models watched"
    page = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f'<link rel="icon" href="data:,"><style>{_INDEX_CSS}</style></head><body><h1>{title}</h1>'
            f"<p>a report for each model, in the order they were trained</p>"
            f'<ol>{"".join(items)}</ol></body></html>\n')
    return write_atomic(outdir / "index.html", page)


# --------------------------------------------------------------------------- report

def report(run_path: str, out: Optional[str] = None) -> pathlib.Path:
    """Render a saved run (``w.save``) as an HTML report; ``graddbg report`` calls it.
    It never writes over its input: an ``out`` that is the run file, or one of the runs in
    the folder given, is refused before anything is read or written.

    Args:
        run_path: a file written by `Watch.save` or `Run.save`, or the folder that
            ``graddbg run`` / ``graddbg demo`` wrote (its ``stats.parquet`` is read).
        out: the HTML file to write (its folder must exist). None: next to the run, with
            its name and ``.html`` (``out/stats.parquet`` -> ``out/stats.html``).

    Returns:
        pathlib.Path: the report written.

    Raises:
        UsageError: ``run_path`` is neither an existing file nor a folder with a run, or
            is not a run that `graddbg.load` reads; ``out`` is a folder, its folder does
            not exist or cannot be written in, or it is the run itself, one of the runs in
            the folder given, or another parquet file (checked before the run is read).
            A ``UsageError`` is a `GraddbgValueError`: the command exits with 2.
        GraddbgError: the report could not be written.
    """
    import graddbg

    source, inputs = _run_input(run_path)
    target = _out_file(source.with_suffix(".html") if out is None else out)
    _not_an_input(target, source, inputs, out)
    try:
        run = graddbg.load(source)
    except GraddbgError as e:
        raise UsageError(str(e)) from None
    return run.report(target)


def _run_input(run_path: Any) -> Tuple[pathlib.Path, List[pathlib.Path]]:
    """(the run file to read, every run file the input holds): a file is itself; the
    folder ``graddbg run`` / ``demo`` wrote is its ``stats.parquet``, and holds the runs
    of its ranks and workers too."""
    if not isinstance(run_path, (str, os.PathLike)) or not pathlib.Path(run_path).exists():
        raise UsageError(f"run: {run_path!r} does not exist (expected a file written by Watch.save, "
                         f"or the folder graddbg run / demo wrote)")
    path = pathlib.Path(run_path)
    if not path.is_dir():
        return path, [path]
    inputs = sorted(path.glob("*.parquet")) + sorted(path.glob("*/*.parquet"))
    if (path / "stats.parquet").is_file():
        return path / "stats.parquet", inputs
    found = ", ".join(str(p.relative_to(path)) for p in inputs[:5]) or "no .parquet file"
    raise UsageError(f"run: the folder {str(path)!r} holds no stats.parquet (it holds {found}); give a run "
                     f"file written by Watch.save, graddbg run or graddbg demo, or the folder they wrote")


def _not_an_input(target: pathlib.Path, source: pathlib.Path, inputs: List[pathlib.Path], out: Any) -> None:
    """A report is never written over a run: not over the input, not over another run in the
    folder given, not over any other parquet file."""
    from graddbg._io import same_file

    given = f"--out: {str(target)!r}" if out is not None else f"--out: not given, and the default {str(target)!r}"
    hit = next((p for p in inputs if same_file(target, p)), None)
    if hit is not None:
        what = "the run being read" if same_file(hit, source) else f"a run in the folder being read ({str(hit)!r})"
        instead = source.with_suffix(".html")
        instead = instead if not same_file(instead, hit) else source.with_name(source.stem + "-report.html")
        raise UsageError(f"{given} is {what}; the report would overwrite it. --out accepts a new or HTML file "
                         f"that is not an input, such as {str(instead)!r}")
    try:
        with open(target, "rb") as f:
            parquet = f.read(4) == b"PAR1"
    except OSError:
        parquet = False
    if parquet:
        raise UsageError(f"{given} is a parquet file (a saved run?), which the report would overwrite. "
                         f"--out accepts a new or HTML file, such as {str(target.with_suffix('.html'))!r}")


# --------------------------------------------------------------------------- main

class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Help with every option's default, descriptions as written, and a script's arguments
    shown as the optional tail they are (``script [args ...]``)."""

    def _format_args(self, action: argparse.Action, default_metavar: str) -> str:
        if action.dest == "module":
            return "MODULE [ARGS ...]"
        if action.dest == "script":
            return "script"  # (required, unless -m names a module)
        if action.nargs == argparse.REMAINDER:
            return "[%s ...]" % self._metavar_formatter(action, default_metavar)(1)
        return super()._format_args(action, default_metavar)

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or not action.option_strings:
            return action.help or ""  # (the help says what no value means; positionals have none)
        return super()._get_help_string(action)


_DEMO = """Train a small regression model (1,601 parameters, 120 steps on the CPU) with two
planted faults, and watch graddbg catch both: a 0/0 in a row normalisation at step 30 (a
NaN, named at its source line and skipped) and a learning rate 1000x too large for one
step at step 80 (an exploding gradient norm). Writes report.html, graph.svg (the
annotated autograd graph) and stats.parquet to --out. Takes about 25 seconds on two CPU
cores, the report and the graph included."""
_RUN = """Run a training script unchanged (as `python script.py args ...` would), or a
module with -m (as `python -m module args ...` would), with what it trains watched: every optimizer it steps, with its model (or, without an optimizer, the
model it runs backward through). At exit (also on a crash, Ctrl-C or SIGTERM) writes
stats.parquet and report.html to --out, and prints the anomalies found.

Exit code: 0 healthy, 1 anomalies counted by --fail-on or a script that failed, 2 a
usage error, 128 + N when stopped by signal N; a script's own sys.exit(code) is kept.
Everything after the script's name (or -m's module) goes to the script.
Several models trained in one run (a grid search's fits) get a report each, and
index.html links them in order.

A POLICY is what to do on a finding: raise (stop the script with an error), warn,
skip (drop the affected gradients this step), record (only in the report), none (off)."""
_REPORT = """Render a run saved by `graddbg run`, `graddbg demo` or Watch.save (a .parquet file,
or the folder `graddbg run` / `demo` wrote) as a self-contained HTML report. Without --out
the report is written next to the run, with the run's name: out/stats.parquet ->
out/stats.html. Prints where it wrote. It never writes over a run: an --out that is the run,
a run in the folder given or any parquet file is refused (exit code 2)."""


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="graddbg", description="Find out what is wrong with the gradients of a PyTorch "
                "program, and where.", formatter_class=_Help)
    from graddbg import __version__

    p.add_argument("--version", action="version", help="print graddbg's version (and torch's, Python's) and exit",
                   version=f"graddbg {__version__} (torch {torch.__version__}, Python {platform.python_version()})")
    sub = p.add_subparsers(dest="command", metavar="{demo,run,report}")
    d = sub.add_parser("demo", help="train a small model with planted faults and show watch catch them",
                       description=_DEMO, formatter_class=_Help)
    d.add_argument("--out", default="graddbg-out", metavar="DIR", help="output folder, created if needed")
    d.add_argument("--steps", type=int, default=120, help="training steps")
    r = sub.add_parser("run", help="run a training script unchanged, with what it trains watched",
                       description=_RUN, formatter_class=_Help)
    r.add_argument("--out", default="graddbg-out", metavar="DIR", help="output folder, created if needed")
    r.add_argument("--every", type=int, default=1, metavar="N",
                   help="record the statistics every N optimizer steps (NaN/Inf are checked every step)")
    for kind, default, what in (("nonfinite", "raise", "a NaN/Inf gradient"),
                                ("explode", "warn", "a global gradient norm far above its running level"),
                                ("vanish", "none", "a parameter whose gradient stays under 1e-8")):
        r.add_argument(f"--{kind}", choices=POLICIES, default=default, metavar="POLICY",
                       help=f"policy on {what}")
    for kind in HYGIENE_KINDS:
        r.add_argument(f"--{kind.replace('_', '-')}", choices=POLICIES, default="warn", metavar="POLICY",
                       help=f"policy on {kind} findings (see the docs' Silent bugs page)")
    r.add_argument("--fail-on", choices=FAIL_ON, default="any",
                   help="which findings make the exit code 1: any (every anomaly - non-finite, "
                        "explosion, vanishing, replica mismatch or a training-hygiene finding; a "
                        "GradScaler's skipped steps never count), nonfinite (NaN/Inf only) or never. "
                        "A script that fails exits with its own code")
    r.add_argument("--save-every", type=float, default=SAVE_EVERY, metavar="SECONDS",
                   help="write the statistics every SECONDS while the script runs, so that a "
                        "hard kill loses at most that much (0: only at exit)")
    r.add_argument("-m", dest="module", nargs=argparse.REMAINDER, default=None,
                   help="run the module MODULE as __main__, as python -m does (found from the current "
                        "folder), instead of a script; what follows goes to the module (default: none, "
                        "a script is run)")
    r.add_argument("script", nargs="?", help="the training script (a .py file), run as __main__")
    r.add_argument("args", nargs=argparse.REMAINDER, default=[],
                   help="the script's own arguments (its sys.argv[1:])").required = False
    rep = sub.add_parser("report", help="render a saved run (stats.parquet) as an HTML report",
                         description=_REPORT, formatter_class=_Help)
    rep.add_argument("run", help="a .parquet file written by graddbg run, graddbg demo or Watch.save, "
                                 "or the folder graddbg run / demo wrote")
    rep.add_argument("--out", default=None, metavar="FILE",
                     help="the HTML file to write (default: next to the run, with its name: out/stats.parquet -> out/stats.html)")
    return p


def _command(args: argparse.Namespace) -> int:
    if args.command == "demo":
        if args.steps < 1:
            raise UsageError(f"--steps must be >= 1, got {args.steps}")
        res = demo(args.out, steps=args.steps, nan_step=min(30, args.steps - 1),
                   jump_step=min(80, args.steps - 1))
        return 0 if res["files"]["report"].exists() else 1
    if args.command == "run":
        if args.module is not None and not args.module:
            raise UsageError("argument -m: expected a module name (graddbg run -m MODULE [ARGS ...])")
        if args.module is None and args.script is None:
            raise UsageError("the following arguments are required: script (or -m MODULE)")
        script, script_args = (args.module[0], args.module[1:]) if args.module else (args.script, args.args)
        return run_script(script, script_args, module=bool(args.module), out=args.out, every=args.every,
                          fail_on=args.fail_on, save_every=args.save_every,
                          **{k: getattr(args, k) for k in POLICY_OPTIONS})
    path = report(args.run, args.out)
    print(f"graddbg report: wrote {path}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``graddbg`` console script and ``python -m graddbg``.

    Runs one command (``demo``, ``run`` or ``report``; see `demo`, `run_script` and
    `report`). Errors are exit codes, not exceptions: a usage error or bad input prints
    one line on stderr (no traceback) and returns 2; an output that could not be written
    prints one line and returns 1.

    Args:
        argv: the command-line arguments, without the program name (None:
            ``sys.argv[1:]``).

    Returns:
        int: the exit code, 0 healthy, 1 anomalies found, a failed script or an output not
            written, 2 a usage error or bad input (also when no command is given),
            ``graddbg run``'s own codes (see `run_script`), 0 for ``--help``.

    Raises:
        TypeError: ``argv`` holds something other than strings (argparse's own error).

    Examples:
        >>> main(["report", "no-such-run.parquet"])
        2
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return _exit_status(e.code)
    if args.command is None:
        print(parser.format_usage().strip(), file=sys.stderr)
        return 2
    try:
        return _command(args)
    except UsageError as e:
        print(f"graddbg {args.command}: error: {e}", file=sys.stderr)
        return 2
    except GraddbgError as e:  # an output that could not be written
        print(f"graddbg {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
