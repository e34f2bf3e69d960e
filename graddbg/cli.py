"""The ``graddbg`` command line: ``demo``, ``run`` and ``report``.

Exit codes: 0 healthy, 1 anomalies found (see ``--fail-on``) or the script failed,
2 usage errors.
"""
from __future__ import annotations

import argparse
import pathlib
import runpy
import sys
import time
import traceback
import weakref
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from graddbg._errors import GraddbgError, GradientAnomalyError

__all__ = ["main", "demo", "run_script", "report"]

POLICIES = ("raise", "warn", "skip", "record", "none")
FAIL_ON = ("any", "nonfinite", "never")


class UsageError(Exception):
    """A bad command line: exit code 2."""


def _policy(value: str) -> Optional[str]:
    return None if value == "none" else value


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


def _anomaly_lines(anomalies: Sequence[Any]) -> str:
    if not anomalies:
        return "no anomalies"
    out = []
    shown = list(anomalies)[:12]
    for a in shown:
        where = f"module {a.module or '<root>'}" + (f", op {a.op}" if a.op else "") + \
                (f", {a.source}" if a.source else "")
        out.append(f"  step {a.step:>4}  {a.kind:<12} {a.name or '-':<16} {where}")
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
    """Train a small regression model with two planted faults and watch catch both:

    - at step ``nan_step`` a batch holds an all-zero row: ``RowNorm`` computes 0/0 in the
      forward pass (NaN), caught as ``nonfinite`` and skipped (the weights stay finite);
    - at step ``jump_step`` the learning rate jumps 1000x for one step: the next gradient
      norm explodes and is caught as ``explode``.

    Writes ``report.html``, ``graph.svg`` (the annotated autograd graph) and
    ``stats.parquet`` to ``out`` and returns their paths and the watch.
    """
    import graddbg

    stream = stream or sys.stdout
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = demo_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    true_w = torch.randn(16, generator=gen)
    outdir = pathlib.Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    print(f"graddbg demo: training {sum(p.numel() for p in model.parameters())} parameters for {steps} "
          f"steps, faults planted at step {nan_step} (0/0 in a normalisation) and step {jump_step} "
          f"(learning rate x1000 for one step)", file=stream)
    bar = Progress(steps)
    loss_value = float("nan")
    with graddbg.watch(model, opt, nonfinite="skip", explode=graddbg.Explode(factor=20, policy="record"),
                       histograms=10, update_every=5) as w:
        for i in range(steps):
            x = torch.randn(32, 16, generator=gen)
            if i == nan_step:
                x[3] = 0.0  # fault 1: an all-zero row
            if i in (jump_step, jump_step + 1):
                for g in opt.param_groups:  # fault 2: a one-step learning-rate spike
                    g["lr"] = g["lr"] * 1000.0 if i == jump_step else g["lr"] / 1000.0
            y = torch.tanh(x @ true_w)[:, None]
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss_value = loss.item()
            bar.update(i + 1, f"loss {loss_value:.4g}  anomalies {len(w.anomalies)}")
    summary = w.summary()
    print("\nper-parameter summary:", file=stream)
    print(_table(summary, ["name", "numel", "norm_mean", "norm_max", "nonfinite_steps", "update_ratio_mean"]),
          file=stream)
    print("\nanomalies caught:", file=stream)
    print(_anomaly_lines(w.anomalies), file=stream)

    # the annotated autograd graph of one more (healthy) step
    x = torch.randn(8, 16, generator=gen)
    graph = graddbg.graph(lambda: nn.functional.mse_loss(model(x), torch.tanh(x @ true_w)[:, None]),
                          model=model, grads=True, watch=w)
    files = {"report": outdir / "report.html", "graph": outdir / "graph.svg", "stats": outdir / "stats.parquet"}
    try:
        graph.render(files["graph"], format="svg")
    except GraddbgError as e:  # no `dot`: keep the DOT text and say so
        files["graph"] = outdir / "graph.dot"
        files["graph"].write_text(graph.source)
        print(f"note: {e}", file=stream)
    w.report(files["report"], graph=graph)
    w.save(files["stats"])
    print(f"\nwrote {files['report']}\n      {files['graph']}\n      {files['stats']}", file=stream)
    print(f"done in {time.perf_counter() - t0:.1f} s", file=stream)
    return {"watch": w, "files": files}


# --------------------------------------------------------------------------- run

class _ParamHolder(nn.Module):
    """Stands for a model graddbg never saw called: the optimizer's parameters, by group."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__()
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                self.register_parameter(f"group{gi}_param{pi}", p)


class ScriptWatcher:
    """Attaches a watch to every optimizer a script steps, through PyTorch's global
    optimizer and module hook registries (no monkeypatching): a model is the outermost
    module called whose parameters the optimizer holds."""

    def __init__(self, watch_kwargs: Dict[str, Any]) -> None:
        self.kwargs = watch_kwargs
        self.watches: List[Any] = []
        self._seen: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
        self._roots: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
        self._depth = 0
        self._handles: List[Any] = []

    def __enter__(self) -> "ScriptWatcher":
        from torch.nn.modules import module as module_mod
        from torch.optim import optimizer as optim_mod

        try:
            self._handles.append(module_mod.register_module_forward_pre_hook(self._pre))
            self._handles.append(module_mod.register_module_forward_hook(self._post, always_call=True))
            self._handles.append(optim_mod.register_optimizer_step_pre_hook(self._on_step))
        except BaseException:
            self._remove()
            raise
        return self

    def _pre(self, module: nn.Module, args: Any) -> None:
        if self._depth == 0:
            self._roots.add(module)
        self._depth += 1

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)

    def _on_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer in self._seen:
            return
        self._seen.add(optimizer)
        import graddbg

        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        best, best_n = None, 0
        for m in list(self._roots):
            n = sum(id(p) in held for p in m.parameters())
            if n > best_n:
                best, best_n = m, n
        model = best if best is not None else _ParamHolder(optimizer)
        w = graddbg.watch(model, optimizer, **self.kwargs)
        self.watches.append(w)
        # this step's boundary: the watch's own step hook joins the hooks being run now

    def _remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __exit__(self, *exc: Any) -> None:
        self._remove()
        for w in self.watches:
            w.close()


def run_script(script: str, args: Sequence[str], *, out: str = "graddbg-out", every: int = 1,
               nonfinite: str = "raise", explode: str = "warn", vanish: str = "none",
               fail_on: str = "any", stream: Any = None) -> int:
    """Run ``script`` unchanged with every optimizer it steps watched; write the report
    at exit, also when the script crashes or is interrupted. Returns the exit code."""
    stream = stream or sys.stdout
    path = pathlib.Path(script)
    if not path.is_file():
        raise UsageError(f"script: {script!r} does not exist or is not a file")
    outdir = pathlib.Path(out)
    kwargs = dict(every=every, nonfinite=_policy(nonfinite), explode=_policy(explode), vanish=_policy(vanish))
    import graddbg

    for k, v in kwargs.items():  # validate the options before running anything
        if k != "every" and v is not None:
            graddbg.anomaly.check_policy(v, f"--{k}")
    old_argv = sys.argv[:]
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.resolve().parent))
    status, failure = 0, None
    watcher = ScriptWatcher(kwargs)
    try:
        with watcher:
            try:
                runpy.run_path(str(path), run_name="__main__")
            except SystemExit as e:
                status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except KeyboardInterrupt:
                failure, status = "interrupted", 130
            except GradientAnomalyError as e:
                failure, status = f"stopped by graddbg: {e}", 1
            except BaseException:
                failure, status = "the script raised:\n" + traceback.format_exc(), 1
    finally:
        sys.argv = old_argv
        if sys.path and sys.path[0] == str(path.resolve().parent):
            sys.path.pop(0)
    anomalies = [a for w in watcher.watches for a in w.anomalies]
    if failure:
        print(f"graddbg run: {failure}", file=sys.stderr)
    if not watcher.watches:
        print("graddbg run: the script stepped no optimizer; nothing was watched", file=stream)
        return status
    outdir.mkdir(parents=True, exist_ok=True)
    for i, w in enumerate(watcher.watches):
        suffix = "" if i == 0 else f"-{i + 1}"
        rep = w.report(outdir / f"report{suffix}.html")
        w.save(outdir / f"stats{suffix}.parquet")
        print(f"graddbg run: watched {w.meta['model']} with {w.meta['optimizer']} for {w.current_step} "
              f"steps; {len(w.anomalies)} anomalies; report: {rep}", file=stream)
    if anomalies:
        print(_anomaly_lines(anomalies), file=stream)
    counted = [a for a in anomalies if a.kind != "overflow"]
    if fail_on == "nonfinite":
        counted = [a for a in counted if a.kind == "nonfinite"]
    if fail_on != "never" and counted and status == 0:
        status = 1
    return status


# --------------------------------------------------------------------------- report

def report(run_path: str, out: str) -> pathlib.Path:
    """Render a saved run (``w.save``) as an HTML report."""
    import graddbg

    if not pathlib.Path(run_path).is_file():
        raise UsageError(f"run: {run_path!r} does not exist (expected a file written by Watch.save)")
    run = graddbg.load(run_path)
    return run.report(out)


# --------------------------------------------------------------------------- main

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="graddbg", description="Find out what is wrong with your gradients.")
    sub = p.add_subparsers(dest="command", metavar="{demo,run,report}")
    d = sub.add_parser("demo", help="train a small model with planted faults and show watch catch them")
    d.add_argument("--out", default="graddbg-out", help="output folder (default: graddbg-out)")
    d.add_argument("--steps", type=int, default=120, help="training steps (default: 120)")
    r = sub.add_parser("run", help="run a training script with every optimizer watched")
    r.add_argument("--out", default="graddbg-out", help="output folder (default: graddbg-out)")
    r.add_argument("--every", type=int, default=1, help="record statistics every N steps")
    r.add_argument("--nonfinite", choices=POLICIES, default="raise")
    r.add_argument("--explode", choices=POLICIES, default="warn")
    r.add_argument("--vanish", choices=POLICIES, default="none")
    r.add_argument("--fail-on", choices=FAIL_ON, default="any",
                   help="which anomalies make the exit code 1 (default: any)")
    r.add_argument("script", help="the training script")
    r.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    rep = sub.add_parser("report", help="render a saved run (stats.parquet) as HTML")
    rep.add_argument("run", help="a file written by Watch.save")
    rep.add_argument("--out", default="report.html", help="the HTML file to write")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``graddbg`` console script and ``python -m graddbg``."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: 2 for usage errors, 0 for --help
        return int(e.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        if args.command == "demo":
            if args.steps < 1:
                raise UsageError(f"--steps must be >= 1, got {args.steps}")
            res = demo(args.out, steps=args.steps, nan_step=min(30, args.steps - 1),
                       jump_step=min(80, args.steps - 1))
            return 0 if res["files"]["report"].exists() else 1
        if args.command == "run":
            if args.every < 1:
                raise UsageError(f"--every must be >= 1, got {args.every}")
            return run_script(args.script, args.args, out=args.out, every=args.every,
                              nonfinite=args.nonfinite, explode=args.explode, vanish=args.vanish,
                              fail_on=args.fail_on)
        if args.command == "report":
            path = report(args.run, args.out)
            print(f"wrote {path}")
            return 0
    except UsageError as e:
        print(f"graddbg {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
