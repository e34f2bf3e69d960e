"""The ``graddbg`` command line: ``demo``, ``run`` and ``report``.

Exit codes: 0 healthy, 1 anomalies found (see ``--fail-on``), the script failed or an
output could not be written, 2 usage errors and bad input (one line on stderr, no
traceback); ``graddbg run`` stopped by a signal exits 128 + its number (130 for Ctrl-C,
143 for SIGTERM, 129 for SIGHUP) after writing what was recorded, and a script that calls
``sys.exit(code)`` exits as Python would (its message printed, 1 for a string).
"""
from __future__ import annotations

import argparse
import math
import os
import pathlib
import runpy
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from graddbg._launch import child_records, follow_children, rank_folder, record_folder
from graddbg._errors import GraddbgError, GraddbgValueError, GradientAnomalyError
from graddbg._io import write_atomic
from graddbg.anomaly import HYGIENE_KINDS
from graddbg.options import WatchOptions

__all__ = ["main", "demo", "run_script", "report"]

POLICIES = ("raise", "warn", "skip", "record", "none")
FAIL_ON = ("any", "nonfinite", "never")
SAVE_EVERY = 30.0  # seconds between the statistics snapshots of `graddbg run`


class UsageError(GraddbgValueError):
    """A bad command line or bad input: exit code 2, one line on stderr."""


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line (no usage dump)."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


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
        out.append(f"  step {a.step:>4}  {a.kind:<12} {a.name or '-':<16} {where}")
        if a.kind in HYGIENE_KINDS:
            out.append(f"             {_fix(a.message)}")
    if len(anomalies) > len(shown):
        out.append(f"  ... and {len(anomalies) - len(shown)} more")
    return "\n".join(out)


# --------------------------------------------------------------------------- demo

class RowNorm(nn.Module):
    """Scales each row to unit length: an all-zero row is 0/0 (the planted fault)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=1, keepdim=True)


def demo_model() -> nn.Module:
    return nn.Sequential(OrderedDict(
        embed=nn.Linear(16, 32, bias=False), act=nn.ReLU(), norm=RowNorm(),
        hidden=nn.Linear(32, 32), act2=nn.Tanh(), head=nn.Linear(32, 1)))


def demo(out: str = "graddbg-out", steps: int = 120, *, nan_step: int = 30, jump_step: int = 80,
         stream: Any = None, seed: int = 0) -> Dict[str, Any]:
    """Train a small regression model with two planted faults and watch catch both.

    - at step ``nan_step`` a batch holds an all-zero row: ``RowNorm`` computes 0/0 in the
      forward pass (NaN), caught as ``nonfinite`` and skipped (the weights stay finite);
    - at step ``jump_step`` the learning rate jumps 1000x for one step: the next gradient
      norm explodes and is caught as ``explode``.

    Writes ``report.html``, ``graph.svg`` (the annotated autograd graph; ``graph.dot``,
    with a note on ``stream``, when Graphviz's ``dot`` is not installed) and
    ``stats.parquet`` to ``out``, and prints a progress bar (on stderr), the per-parameter
    summary and the anomalies caught (on ``stream``). ``graddbg demo`` calls it.

    Args:
        out: the output folder, created if needed (with its parents).
        steps: the number of training steps (an int >= 1).
        nan_step: the step (counted from 0) whose batch holds the all-zero row; a step
            >= ``steps`` plants no NaN.
        jump_step: the step (counted from 0) whose learning rate is 1000 times larger; a
            step >= ``steps`` plants no jump.
        stream: where the summary is printed (None: ``sys.stdout``).
        seed: the seed of the model's initialisation and of the data.

    Returns:
        dict: ``"watch"``, the closed `graddbg.Watch` of the run, and ``"files"``, a dict
            of the paths written (``"report"``, ``"graph"``, ``"stats"``, each a
            ``pathlib.Path``).

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
    w = _demo_train(model, true_w, gen, steps, nan_step, jump_step)
    print("\nper-parameter summary:", file=stream)
    print(_table(w.summary(), ["name", "numel", "norm_mean", "norm_max", "nonfinite_steps",
                               "update_ratio_mean"]), file=stream)
    print("\nanomalies caught:", file=stream)
    print(_anomaly_lines(w.anomalies), file=stream)
    files = _demo_files(w, model, true_w, gen, outdir, stream)
    print(f"\nwrote {files['report']}\n      {files['graph']}\n      {files['stats']}", file=stream)
    print(f"done in {time.perf_counter() - t0:.1f} s", file=stream)
    return {"watch": w, "files": files}


def _demo_train(model: nn.Module, true_w: torch.Tensor, gen: torch.Generator, steps: int,
                nan_step: int, jump_step: int) -> Any:
    import graddbg

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    bar = Progress(steps)
    with graddbg.watch(model, opt, nonfinite="skip", explode=graddbg.Explode(factor=20, policy="record"),
                       histograms=10, update_every=5) as w:
        for i in range(steps):
            x = torch.randn(32, 16, generator=gen)
            if i == nan_step:
                x[3] = 0.0  # fault 1: an all-zero row
            if i in (jump_step, jump_step + 1):
                for g in opt.param_groups:  # fault 2: a one-step learning-rate spike
                    g["lr"] = g["lr"] * 1000.0 if i == jump_step else g["lr"] / 1000.0
            loss = nn.functional.mse_loss(model(x), torch.tanh(x @ true_w)[:, None])
            loss.backward()
            opt.step()
            opt.zero_grad()
            bar.update(i + 1, f"loss {loss.item():.4g}  anomalies {len(w.anomalies)}")
    return w


def _demo_files(w: Any, model: nn.Module, true_w: torch.Tensor, gen: torch.Generator,
                outdir: pathlib.Path, stream: Any) -> Dict[str, pathlib.Path]:
    """The annotated autograd graph of one more (healthy) step, the report and the run."""
    import graddbg

    x = torch.randn(8, 16, generator=gen)
    graph = graddbg.graph(lambda: nn.functional.mse_loss(model(x), torch.tanh(x @ true_w)[:, None]),
                          model=model, grads=True, watch=w)
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

class _ParamHolder(nn.Module):
    """Stands for a model graddbg never saw: the optimizer's parameters, by group (when no
    module owning them was called, as with bare tensors trained directly)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__()
        # kept aside, not registered: an optimizer may hold plain tensors, not Parameters
        self.held = [(f"group{gi}_param{pi}", p) for gi, group in enumerate(optimizer.param_groups)
                     for pi, p in enumerate(group["params"])]

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        seen: Set[int] = set()
        for name, p in self.held:
            if not (remove_duplicate and id(p) in seen):
                seen.add(id(p))
                yield prefix + ("." if prefix else "") + name, p

    def parameters(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        for _, p in self.named_parameters():
            yield p


def _held(optimizer: torch.optim.Optimizer) -> Set[int]:
    return {id(p) for g in optimizer.param_groups for p in g["params"]}


def _frame_modules(limit: int = 256, kind: type = nn.Module) -> List[Any]:
    """The modules (or objects of ``kind``) the calling frames hold in their local
    variables (``self`` of a LightningModule's ``optimizer_step``, a ``model`` of a training
    function), and in the globals of the script run as ``__main__``; innermost frame first."""
    found: List[Any] = []
    frame: Any = sys._getframe(1)
    try:
        for _ in range(limit):
            if frame is None:
                break
            names = frame.f_locals
            values = list(names.values())
            if frame.f_globals is not names and frame.f_globals.get("__name__") == "__main__":
                values += list(frame.f_globals.values())
            found += [v for v in values if isinstance(v, kind)]
            frame = frame.f_back
    finally:
        del frame
    return found


def _choose(candidates: Iterable[nn.Module], held: Set[int]) -> Optional[nn.Module]:
    """The model of an optimizer holding the parameters ``held`` (by id), among
    ``candidates``: the modules owning most of them; of those, the ones with the fewest
    trainable parameters (not a container that also holds an EMA copy or a second model);
    of those, the outermost (a LightningModule rather than the submodule its
    training_step calls, a wrapper rather than what it wraps). None when none owns any."""
    scored, seen = [], set()
    for m in candidates:
        if id(m) in seen or isinstance(m, _ParamHolder):
            continue
        seen.add(id(m))
        params = list(m.parameters())
        n = sum(id(p) in held for p in params)
        if n:
            scored.append((m, n, sum(bool(p.requires_grad) for p in params)))
    if not scored:
        return None
    most = max(n for _, n, _ in scored)
    fewest = min(t for _, n, t in scored if n == most)
    kept = [m for m, n, t in scored if n == most and t == fewest]
    inner = [{id(s) for s in m.modules()} for m in kept]
    return max(zip(kept, inner), key=lambda mi: sum(id(o) in mi[1] for o in kept))[0]


def _closure(args: Any, kwargs: Any) -> Any:
    """The closure an optimizer step was called with (``args[0]`` is the optimizer), or None."""
    return args[1] if len(args) > 1 else kwargs.get("closure")


class _Deferred:
    """An optimizer whose first step began before any module owning its parameters was
    called (the step's closure makes the first forward pass): the watch of a stand-in
    (``_ParamHolder``) and the step's arguments, kept until that forward pass replaces the
    stand-in or the step ends (the stand-in stays: no module owns the parameters)."""

    def __init__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any, watch: Any) -> None:
        self.optimizer = weakref.ref(optimizer)
        self.held = _held(optimizer)
        self.args, self.kwargs, self.watch = args, kwargs, watch


class ScriptWatcher:
    """Watches what a script trains, through PyTorch's global optimizer and module hook
    registries (no monkeypatching):

    - every optimizer the script steps, from its first step, with its model: of the
      outermost modules called and the modules that the calling frames hold, the one that
      owns the optimizer's parameters (see `_choose`). When the first step begins
      before any such module was called and has a closure (LBFGS in pytorch/examples'
      time_sequence_prediction: the closure makes the first forward pass), the model is
      the module owning them that the closure calls first: its watch replaces, within that
      step, the stand-in (``_ParamHolder``) watched from the step's start, which stays only
      when no module owns the parameters;
    - without any optimizer (an update by hand, as in word_language_model): the first
      outermost module called with grad enabled whose output requires grad and which has
      trainable parameters, each backward pass a step. If an optimizer stepping the same
      parameters comes later, its watch replaces that one.

    ``after_step`` (optional) is called after every optimizer step and, while only a watch
    without an optimizer runs, before each outermost forward pass (``graddbg run`` writes
    its snapshots there)."""

    def __init__(self, watch_kwargs: Dict[str, Any],
                 after_step: Optional[Callable[[], None]] = None) -> None:
        self.kwargs = watch_kwargs
        self.after_step = after_step
        self.watches: List[Any] = []
        self._seen: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
        self._roots: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
        self._deferred: Dict[int, _Deferred] = {}
        self._free: Optional[Tuple[Any, "weakref.ref[nn.Module]"]] = None  # (watch, model)
        self._looking = True  # for a model without an optimizer (until any watch starts)
        self._depth = 0
        self._handles: List[Any] = []
        self._failed = False
        self.pid = os.getpid()
        self.outdir: Optional[pathlib.Path] = None  # where forked workers write their records
        self._in_child = False
        self._rng: Optional[torch.Tensor] = None

    def __enter__(self) -> "ScriptWatcher":
        from torch.nn.modules import module as module_mod
        from torch.optim import optimizer as optim_mod

        try:
            self._handles.append(module_mod.register_module_forward_pre_hook(self._pre))
            self._handles.append(module_mod.register_module_forward_hook(self._post, always_call=True))
            self._handles.append(optim_mod.register_optimizer_step_pre_hook(self._on_step))
            self._handles.append(optim_mod.register_optimizer_step_post_hook(self._after))
        except BaseException:
            self._remove()
            raise
        return self

    def _pre(self, module: nn.Module, args: Any) -> None:
        if self._depth == 0:
            self._roots.add(module)
            if self._looking:  # (what a replay of this forward pass needs, should it be watched)
                self._rng = torch.get_rng_state()
            if self._deferred:
                self._safely(self._resolve_deferred, module)
            if self._free is not None and self.after_step is not None:
                self.after_step()
        self._depth += 1

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0 and self._looking:
            self._safely(self._maybe_watch_free, module, args, output)

    def _on_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer in self._seen:
            d = self._deferred.get(id(optimizer))
            if d is not None:  # the first step raised before its end: this one
                d.args, d.kwargs = args, kwargs
            return
        self._seen.add(optimizer)
        self._safely(self._first_step, optimizer, args, kwargs)

    def _first_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        model = _choose([*self._roots, *_frame_modules()], _held(optimizer))
        w = self._start(model if model is not None else _ParamHolder(optimizer), optimizer)
        # this step's boundary: the watch's own step hook joins the hooks being run now
        if model is None and _closure(args, kwargs) is not None:  # the closure may call the model
            self._deferred[id(optimizer)] = _Deferred(optimizer, args, kwargs, w)

    def _resolve_deferred(self, module: nn.Module) -> None:
        """The first forward pass, inside a deferred optimizer's first step, of a module
        owning its parameters: its model's watch replaces the stand-in's (which has read
        nothing of this step yet), in the step under way."""
        for key, d in list(self._deferred.items()):
            opt = d.optimizer()
            if opt is None or not any(id(p) in d.held for p in module.parameters()):
                continue
            del self._deferred[key]
            d.watch.close()
            self.watches.remove(d.watch)
            model = _choose([module, *self._roots, *_frame_modules()], d.held)
            w = self._start(model if model is not None else module, opt)
            w.begin_step(_closure(d.args, d.kwargs))  # the step began before this watch did

    def _maybe_watch_free(self, module: nn.Module, args: Any, output: Any) -> None:
        """A model trained without an optimizer: the first outermost module called with
        grad enabled, its output requiring grad, with trainable parameters. The forward pass
        that ran is handed to the new watch, so that a NaN at this very step is blamed (and
        replayed) as under watch()."""
        from graddbg._model import in_backward, tensors_in
        if not torch.is_grad_enabled() or in_backward() or isinstance(module, torch.jit.ScriptModule):
            return
        if not any(t.requires_grad for t in tensors_in(output)):
            return
        if not any(p.requires_grad for p in module.parameters()):
            return  # a loss function, a frozen encoder
        w = self._start(module, None)
        w.adopt_forward(args, {}, output, rng_state=self._rng)
        self._free = (w, weakref.ref(module))

    def _start(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Any:
        import graddbg

        if optimizer is not None:
            self._retire_free(_held(optimizer))
        kwargs = dict(self.kwargs)
        if kwargs.get("scaler") is None:  # the script's GradScaler, when it has one in its frames
            scalers = [s for s in _frame_modules(kind=torch.amp.GradScaler) if s.is_enabled()]
            kwargs["scaler"] = scalers[0] if scalers else None
        w = graddbg.watch(model, optimizer, **kwargs)
        self.watches.append(w)
        self._looking = False
        if os.getpid() != self.pid:  # a forked worker (torch.multiprocessing, Hogwild)
            self._in_worker(w)
        return w

    def _in_worker(self, w: Any) -> None:
        """A watch started in a forked worker process: the worker writes its own record,
        ``worker-<pid>/`` under the output folder, when it exits (multiprocessing runs its
        finalizers before the worker ends)."""
        import multiprocessing.util

        if not self._in_child:
            self._in_child = True
            self.watches = [w]  # (the parent's watches, copied by the fork, are the parent's)
            multiprocessing.util.Finalize(self, _save_worker, args=(self, self.outdir), exitpriority=10)

    def _retire_free(self, held: Set[int]) -> None:
        """An optimizer now steps the parameters of the model watched without one: its
        watch (from this step on) replaces that one."""
        if self._free is None:
            return
        w, ref = self._free
        model = ref()
        if model is not None and not any(id(p) in held for p in model.parameters()):
            return
        self._free = None
        w.close()
        self.watches.remove(w)

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._deferred.pop(id(optimizer), None)  # no module owning them ran: the stand-in stays
        if self.after_step is not None:
            self.after_step()

    def _safely(self, fn: Callable[..., Any], *args: Any) -> None:
        """Choosing and starting a watch never takes the script down: a failure is said
        once on stderr, and the script goes on unwatched by it."""
        try:
            fn(*args)
        except Exception as e:
            if not self._failed:
                print(f"graddbg run: could not start watching ({type(e).__name__}: {e}); "
                      f"the script goes on", file=sys.stderr)
            self._failed = True

    def _remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __exit__(self, *exc: Any) -> None:
        self._remove()
        self._deferred.clear()
        for w in self.watches:
            w.close()
        if self._free is not None and self._free[0].current_step == 0 and not self._free[0].anomalies:
            self.watches.remove(self._free[0])  # forward passes only, never a backward: nothing to show
        self._free = None


def _save_worker(watcher: "ScriptWatcher", outdir: Optional[pathlib.Path]) -> None:
    """In a forked worker at exit: its watches' records under ``outdir/worker-<pid>``."""
    watches = watcher.watches
    if outdir is None:
        return
    folder = outdir / f"worker-{os.getpid()}"
    try:
        folder.mkdir(exist_ok=True)
        for i, w in enumerate(watches):
            w.close()
            stats_path, report_path = _outputs(folder, i)
            w.save(stats_path)
            w.report(report_path)
    except Exception as e:  # (a worker's exit must not fail because of its record)
        print(f"graddbg run: worker {os.getpid()} could not write its record: {e}", file=sys.stderr)


def _worker_records(outdir: pathlib.Path, since: float) -> List[pathlib.Path]:
    """The records written by forked workers during this run."""
    return sorted(p for p in outdir.glob("worker-*/stats.parquet") if p.stat().st_mtime >= since)


def _outputs(outdir: pathlib.Path, i: int) -> Tuple[pathlib.Path, pathlib.Path]:
    """(statistics, report) of the i-th watch: stats.parquet, report.html, stats-2.parquet, ..."""
    suffix = "" if i == 0 else f"-{i + 1}"
    return outdir / f"stats{suffix}.parquet", outdir / f"report{suffix}.html"


class Snapshots:
    """Saves every watch's statistics (``stats.parquet``, atomically) every ``every``
    seconds while the script runs, so that a hard kill (``kill -9``, an out-of-memory
    kill) loses at most the last interval. Called after each optimizer step; a snapshot
    that takes long pushes the next one back (saving takes at most about a tenth of the
    run). A snapshot that cannot be written is said once on stderr; training goes on."""

    def __init__(self, outdir: pathlib.Path, every: float, watches: List[Any]) -> None:
        import pandas  # noqa: F401 - imported now, not on the clock of the first snapshot
        import pyarrow.parquet  # noqa: F401

        self.outdir, self.every, self.watches = outdir, every, watches
        self.due = time.monotonic() + every if every > 0 else math.inf
        self.saved = 0
        self.failed = False

    def __call__(self) -> None:
        if time.monotonic() < self.due:
            return
        t0 = time.monotonic()
        try:
            for i, w in enumerate(self.watches):
                w.save(_outputs(self.outdir, i)[0])
            self.saved += 1
        except Exception as e:  # a full disk must not stop the training
            if not self.failed:
                print(f"graddbg run: could not write a snapshot ({e}); training goes on",
                      file=sys.stderr)
            self.failed = True
        spent = time.monotonic() - t0
        self.due = time.monotonic() + max(self.every, 10.0 * spent)


class _Terminated(BaseException):
    """SIGTERM / SIGHUP under ``graddbg run``: unwinds the script like KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class Signals:
    """While entered (in the main thread), SIGTERM and SIGHUP raise ``_Terminated`` in the
    script once, as Ctrl-C raises KeyboardInterrupt, so that what was recorded is written
    before the exit; a signal after that (while the results are being written) is only
    remembered. The previous handlers are put back on exit."""

    NAMES = ("SIGTERM", "SIGHUP")

    def __init__(self) -> None:
        self.previous: Dict[int, Any] = {}
        self.armed = False
        self.received: Optional[int] = None
        self.pid = os.getpid()

    def __enter__(self) -> "Signals":
        if threading.current_thread() is threading.main_thread():
            try:
                for name in self.NAMES:
                    signum = getattr(signal, name, None)
                    if signum is not None:
                        self.previous[signum] = signal.signal(signum, self._handle)
            except BaseException:
                self.__exit__()
                raise
        self.armed = True
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self.pid:  # a forked child (a DataLoader worker): die as it would have
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.received is None:
            self.received = signum
        if self.armed:
            self.armed = False
            raise _Terminated(signum)

    def disarm(self) -> None:
        self.armed = False

    def __exit__(self, *exc: Any) -> None:
        self.armed = False
        for signum, handler in self.previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self.previous = {}


#: watch()'s options that take a policy, each a flag of ``graddbg run`` (``--stale-grad``)
POLICY_OPTIONS = ("nonfinite", "explode", "vanish") + HYGIENE_KINDS


def _check_run_args(script: Any, fail_on: Any, save_every: Any) -> pathlib.Path:
    """The arguments of run_script that are its own, checked before anything runs
    (UsageError: exit 2)."""
    if not isinstance(script, (str, os.PathLike)) or not pathlib.Path(script).is_file():
        raise UsageError(f"script: {script!r} does not exist or is not a file")
    if fail_on not in FAIL_ON:
        raise UsageError(f"--fail-on: got {fail_on!r}; accepted: {', '.join(FAIL_ON)}")
    if isinstance(save_every, bool) or not isinstance(save_every, (int, float)) \
            or not math.isfinite(save_every) or save_every < 0:
        raise UsageError(f"--save-every must be a number of seconds >= 0 (0: only at exit), "
                         f"got {save_every!r}")
    return pathlib.Path(script)


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
               save_every: float = SAVE_EVERY, stream: Any = None, **watch_options: Any) -> int:
    """Run ``script`` unchanged with what it trains watched; ``graddbg run`` calls it.

    What is watched: every optimizer the script steps, with its model; without an
    optimizer, the model it runs backward through, a step per backward pass (see
    `ScriptWatcher`). The statistics (``stats.parquet``) and the report (``report.html``)
    are written to ``out`` at exit, also when the script crashes, is interrupted (Ctrl-C)
    or is stopped by SIGTERM / SIGHUP, and the statistics every ``save_every`` seconds on
    the way. Every argument and the ``out`` folder are checked before the script starts.
    The script's own exceptions are not raised: they are printed on stderr and make the
    exit code (see the module docstring).

    Args:
        script: the path of the Python script, run as ``__main__``.
        args: the script's command-line arguments (its ``sys.argv[1:]``).
        out: the output folder, created if needed (removed again when it was created here
            and nothing was watched).
        fail_on: which findings make the exit code 1: ``"any"`` (every anomaly),
            ``"nonfinite"`` (NaN/Inf only) or ``"never"``.
        save_every: seconds between the statistics snapshots written while the script
            runs (0: only at exit).
        stream: where the summary lines are printed (None: ``sys.stdout``).
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
    path = _check_run_args(script, fail_on, save_every)
    kwargs = _watch_options(watch_options)
    outdir, created = _out_folder(out)
    outdir = rank_folder(outdir)  # (under torchrun: each rank's own folder)
    watcher = ScriptWatcher(kwargs)
    watcher.outdir = outdir.resolve()
    started = time.time() - 1.0
    watcher.after_step = Snapshots(outdir, float(save_every), watcher.watches)
    with Signals() as signals:
        with follow_children(outdir, kwargs):  # (processes the script starts are watched too)
            status, failure = _execute(path, args, watcher, signals)
        if failure:
            print(f"graddbg run: {failure}", file=sys.stderr)
        status = _finish(watcher.watches, outdir, created, status, fail_on, stream, since=started)
    if signals.received is not None and status == 0:  # a signal while the results were written
        status = 128 + signals.received
    return status


def _execute(path: pathlib.Path, args: Sequence[str], watcher: ScriptWatcher,
             signals: Signals) -> Tuple[int, Optional[str]]:
    """Run the script as ``__main__``: (exit status, what went wrong or None)."""
    old_argv, folder = sys.argv[:], str(path.resolve().parent)
    sys.argv = [str(path), *args]
    sys.path.insert(0, folder)
    try:
        with watcher:
            try:
                runpy.run_path(str(path.resolve()), run_name="__main__")  # (__file__ absolute, as python gives it)
            finally:
                signals.disarm()
    except _Terminated as e:
        return 128 + e.signum, f"terminated by {signal.Signals(e.signum).name}; saving what was recorded"
    except SystemExit as e:
        return _exit_status(e.code), None
    except KeyboardInterrupt:
        return 130, "interrupted"
    except GradientAnomalyError as e:
        return 1, f"stopped by graddbg: {e}"
    except BaseException as e:
        return 1, "the script raised:\n" + _script_traceback(e, path)
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
    """The traceback from the script's own frames on (graddbg's and runpy's left out)."""
    target = os.path.realpath(script)
    tb = exc.__traceback__
    while tb is not None and os.path.realpath(tb.tb_frame.f_code.co_filename) != target:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))


def _finish(watches: List[Any], outdir: pathlib.Path, created: bool, status: int,
            fail_on: str, stream: Any, since: float = 0.0) -> int:
    """Write each watch's statistics and report (under distribution, rank 0 writes: the
    table is the same on every rank); the exit status."""
    workers = child_records(outdir, since)
    if not watches and not workers:
        print("graddbg run: the script stepped no optimizer and ran no backward pass through a module "
              "in this process; nothing was watched (a script that trains in spawned worker processes "
              "is not followed: call graddbg.watch(model, optimizer) inside the worker)", file=stream)
        if created:
            try:
                outdir.rmdir()  # leave no empty folder behind
            except OSError:
                pass
        return status
    written = all(_write(w, outdir, i, stream) for i, w in enumerate(watches))
    anomalies = [a for w in watches for a in w.anomalies]
    for path in workers:
        import graddbg

        run = graddbg.load(path)
        anomalies += run.anomalies
        print(f"graddbg run: a worker process ({path.parent.name}) recorded {len(run.stats['step'].unique())} "
              f"steps; {len(run.anomalies)} anomalies; report: {path.parent / 'report.html'}", file=stream)
    if anomalies:
        print(_anomaly_lines(anomalies), file=stream)
    counted = list(anomalies)  # (a GradScaler's skipped steps are never anomalies)
    if fail_on == "nonfinite":
        counted = [a for a in counted if a.kind == "nonfinite"]
    if status == 0 and ((fail_on != "never" and counted) or not written):
        status = 1
    return status


def _write(w: Any, outdir: pathlib.Path, i: int, stream: Any) -> bool:
    """One watch's record and its line on the console; False when it could not be written."""
    stats_path, report_path = _outputs(record_folder(outdir, w.meta), i)  # (each rank its own)
    try:
        w.save(stats_path)  # the data first: it is what a report can be made from again
        rep = w.report(report_path)
    except GraddbgError as e:
        print(f"graddbg run: error: {e}", file=sys.stderr)
        return False
    how = (f"with {w.meta['optimizer']}" if w.meta["optimizer"]
           else "without an optimizer (a step per backward pass)")
    print(f"graddbg run: watched {w.meta['model']} {how} for {w.current_step} steps; "
          f"{len(w.anomalies)} anomalies; report: {rep}", file=stream)
    return True


# --------------------------------------------------------------------------- report

def report(run_path: str, out: str) -> pathlib.Path:
    """Render a saved run (``w.save``) as an HTML report; ``graddbg report`` calls it.

    Args:
        run_path: a file written by `Watch.save` or `Run.save`.
        out: the HTML file to write (its folder must exist).

    Returns:
        pathlib.Path: the report written (``out``).

    Raises:
        UsageError: ``run_path`` is not an existing file or is not a run that `graddbg.load`
            reads; ``out`` is a folder, or its folder does not exist or cannot be written
            in (checked before the run is read). A ``UsageError`` is a `GraddbgValueError`:
            the command exits with 2.
        GraddbgError: the report could not be written.
    """
    import graddbg

    if not isinstance(run_path, (str, os.PathLike)) or not pathlib.Path(run_path).is_file():
        raise UsageError(f"run: {run_path!r} does not exist (expected a file written by Watch.save)")
    target = _out_file(out)
    try:
        run = graddbg.load(run_path)
    except GraddbgError as e:
        raise UsageError(str(e)) from None
    return run.report(target)


# --------------------------------------------------------------------------- main

def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="graddbg", description="Find out what is wrong with your gradients.")
    sub = p.add_subparsers(dest="command", metavar="{demo,run,report}")
    d = sub.add_parser("demo", help="train a small model with planted faults and show watch catch them")
    d.add_argument("--out", default="graddbg-out", help="output folder (default: graddbg-out)")
    d.add_argument("--steps", type=int, default=120, help="training steps (default: 120)")
    r = sub.add_parser("run", help="run a training script with what it trains watched")
    r.add_argument("--out", default="graddbg-out", help="output folder (default: graddbg-out)")
    r.add_argument("--every", type=int, default=1, help="record statistics every N steps")
    r.add_argument("--nonfinite", choices=POLICIES, default="raise")
    r.add_argument("--explode", choices=POLICIES, default="warn")
    r.add_argument("--vanish", choices=POLICIES, default="none")
    for kind in HYGIENE_KINDS:
        r.add_argument(f"--{kind.replace('_', '-')}", choices=POLICIES, default="warn",
                       help=f"policy for {kind} findings (see the README's list of findings)")
    r.add_argument("--fail-on", choices=FAIL_ON, default="any",
                   help="which findings make the exit code 1: any (default: any anomaly - non-finite, "
                        "explosion, vanishing, replica mismatch or a training-hygiene finding; a "
                        "GradScaler's skipped steps never count), nonfinite (NaN/Inf only) or never. "
                        "A script that fails exits with its own code")
    r.add_argument("--save-every", type=float, default=SAVE_EVERY, metavar="SECONDS",
                   help=f"write the statistics every SECONDS while the script runs, so that a "
                        f"hard kill loses at most that much (default: {SAVE_EVERY:g}; 0: only at exit)")
    r.add_argument("script", help="the training script")
    r.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    rep = sub.add_parser("report", help="render a saved run (stats.parquet) as HTML")
    rep.add_argument("run", help="a file written by Watch.save")
    rep.add_argument("--out", default="report.html", help="the HTML file to write")
    return p


def _command(args: argparse.Namespace) -> int:
    if args.command == "demo":
        if args.steps < 1:
            raise UsageError(f"--steps must be >= 1, got {args.steps}")
        res = demo(args.out, steps=args.steps, nan_step=min(30, args.steps - 1),
                   jump_step=min(80, args.steps - 1))
        return 0 if res["files"]["report"].exists() else 1
    if args.command == "run":
        return run_script(args.script, args.args, out=args.out, every=args.every,
                          fail_on=args.fail_on, save_every=args.save_every,
                          **{k: getattr(args, k) for k in POLICY_OPTIONS})
    path = report(args.run, args.out)
    print(f"wrote {path}")
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
