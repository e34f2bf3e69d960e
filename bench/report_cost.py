"""CPU cost of the reports of several models watched in one process (issue 40: "one index
page linking each run's report ... with no per-model cost beyond a second per report").

Each repeat is a fresh process (the first report of a process also pays for importing
matplotlib), which runs a script of N small fits the way a grid search does (MLPs with
Adam and small CNNs with SGD, momentum and a cosine schedule, alternating, each with its
own size, learning rate and seed):

1. bare: the script's fits, unwatched, one after the other (CPU seconds per fit);
2. graddbg run: the same script under ``graddbg.cli.run_script``, the path of
   ``graddbg run script.py``: every fit watched, then its record (``Run.save``) and its
   report (``Run.report``) written, and ``index.html`` linking them. Each save and report
   is timed (CPU seconds of this process) by a wrapper put around ``Run.save`` and
   ``Run.report`` for the run and taken off after it.

torch runs on one thread (on a shared 2-core machine two threads spinning against other
work made a fit 3-30x slower, and noisy). Prints, per process and as medians over the processes: the first report's CPU seconds,
a warm report's (the median of reports 2..N), a save's and a bare fit's, and the ratios
measured side by side in the same process: warm report / save, warm report / bare fit,
first report / bare fit. Absolute seconds on a shared machine mean little; the ratios
are what to compare between versions.

    python bench/report_cost.py                       # 8 fits, 3 processes
    python bench/report_cost.py --models 26 --repeats 5
    python bench/report_cost.py --profile             # one process, cProfile of a warm report
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

SCRIPT = textwrap.dedent('''
    """N small fits, as a grid search runs them (the bench's script)."""
    import math
    import sys

    import torch
    from torch import nn


    def mlp(i):
        width = (32, 64, 128)[i % 3]
        return nn.Sequential(nn.Linear(20, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                             nn.Linear(width, 3))


    def cnn(i):
        c = (8, 16)[i % 2]
        return nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                             nn.Flatten(), nn.Linear(2 * c, 10))


    def fit(i, steps=None):
        torch.manual_seed(i)
        gen = torch.Generator().manual_seed(i)
        if i % 2 == 0:
            model, steps = mlp(i), steps or 120
            opt = torch.optim.Adam(model.parameters(), lr=(1e-3, 3e-3, 1e-2)[i % 3])
            sched = None
            x, y = torch.randn(256, 20, generator=gen), torch.randint(0, 3, (256,), generator=gen)
        else:
            model, steps = cnn(i), steps or 40
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
            x, y = torch.randn(64, 1, 16, 16, generator=gen), torch.randint(0, 10, (64,), generator=gen)
        for s in range(steps):
            b = slice((s % 4) * (len(x) // 4), (s % 4 + 1) * (len(x) // 4))
            loss = nn.functional.cross_entropy(model(x[b]), y[b])
            loss.backward()
            opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()
        return float(loss.detach())


    if __name__ == "__main__":
        for i in range(int(sys.argv[1])):
            fit(i)
''')


def _timed(cls, name, into):
    """``cls.name`` wrapped to append its CPU seconds to ``into``; returns the original."""
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        t0 = time.process_time()
        try:
            return original(self, *args, **kwargs)
        finally:
            into.append(time.process_time() - t0)

    setattr(cls, name, wrapper)
    return original


def worker(n: int, folder: str, profile: bool) -> dict:
    """One process: the bare fits, then the same script under graddbg run."""
    import importlib.util
    import warnings

    warnings.simplefilter("ignore")
    import torch

    torch.set_num_threads(1)  # (steadier on a shared machine: two threads spin against other work)
    script = os.path.join(folder, "fits.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    spec = importlib.util.spec_from_file_location("fits", script)
    fits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fits)
    bare = []
    for i in range(n):
        t0 = time.process_time()
        fits.fit(i)
        bare.append(time.process_time() - t0)

    import graddbg.cli
    from graddbg.run import Run

    saves, reports = [], []
    old = {"save": _timed(Run, "save", saves), "report": _timed(Run, "report", reports)}
    try:
        with open(os.devnull, "w") as devnull:
            status = graddbg.cli.run_script(script, [str(n)], out=os.path.join(folder, "out"),
                                            fail_on="never", save_every=0, stream=devnull)
    finally:
        for name, fn in old.items():
            setattr(Run, name, fn)
    index = os.path.exists(os.path.join(folder, "out", "index.html"))
    result = {"bare": bare, "save": saves, "report": reports, "status": status, "index": index}
    if profile:
        result["profile"] = _profile_one(folder)
    return result


def _profile_one(folder: str) -> str:
    """cProfile of a warm report of the first fit's record, loaded back."""
    import cProfile
    import io
    import pstats

    import graddbg

    run = graddbg.load(os.path.join(folder, "out", "stats.parquet"))  # (the first fit's record)
    run.report(os.path.join(folder, "warm.html"))
    pr = cProfile.Profile()
    pr.enable()
    run.report(os.path.join(folder, "profiled.html"))
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(40)
    return buf.getvalue()


def summarise(r: dict) -> dict:
    warm = statistics.median(r["report"][1:]) if len(r["report"]) > 1 else float("nan")
    save, bare = statistics.median(r["save"]), statistics.median(r["bare"])
    return {"first": r["report"][0], "warm": warm, "save": save, "bare": bare,
            "warm/save": warm / save, "warm/bare": warm / bare, "first/bare": r["report"][0] / bare}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=int, default=8, help="fits per process (>= 2)")
    ap.add_argument("--repeats", type=int, default=3, help="processes")
    ap.add_argument("--profile", action="store_true", help="one process; print a warm report's cProfile")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "report_cost.json"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.models < 2:
        ap.error("--models must be at least 2 (a first and a warm report)")
    if args.worker is not None:
        print(json.dumps(worker(args.models, args.worker, args.profile)))
        return
    import graddbg

    print(f"graddbg {graddbg.__version__} from {os.path.dirname(graddbg.__file__)}; {args.models} fits per "
          f"process, {1 if args.profile else args.repeats} processes; CPU seconds (time.process_time)")
    rows = []
    for rep in range(1 if args.profile else args.repeats):
        with tempfile.TemporaryDirectory() as folder:
            cmd = [sys.executable, os.path.abspath(__file__), "--models", str(args.models), "--worker", folder]
            out = subprocess.run(cmd + (["--profile"] if args.profile else []), check=True,
                                 capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
        if r["status"] != 0 or not r["index"] or len(r["report"]) != args.models:
            raise SystemExit(f"graddbg run did not write {args.models} reports and the index: {r}")
        s = summarise(r)
        rows.append(s)
        print(f"process {rep + 1}: report first {s['first']:.3f} s, warm {s['warm']:.3f} s (median of "
              f"{args.models - 1}); save {s['save']:.3f} s; bare fit {s['bare']:.3f} s | warm/save "
              f"{s['warm/save']:.1f}x, warm/bare fit {s['warm/bare']:.2f}x, first/bare fit {s['first/bare']:.2f}x")
        if args.profile:
            print(r["profile"])
    med = {k: statistics.median(s[k] for s in rows) for k in rows[0]}
    print(f"\nmedian over {len(rows)} processes: report first {med['first']:.3f} s, warm {med['warm']:.3f} s; "
          f"save {med['save']:.3f} s; bare fit {med['bare']:.3f} s")
    print(f"  warm report / save {med['warm/save']:.1f}x; warm report / bare fit {med['warm/bare']:.2f}x; "
          f"first report / bare fit {med['first/bare']:.2f}x")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"models": args.models, "processes": rows, "median": med}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
