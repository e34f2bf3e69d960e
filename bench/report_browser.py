"""Open graddbg HTML reports in a real headless browser (Debian's chromium) and check that
they render with no console errors and no resource loads.

    python bench/report_browser.py                 # builds two reports and checks them
    python bench/report_browser.py report.html ... # checks existing reports
    python bench/report_browser.py --screenshot out.png   # also saves a screenshot
    python bench/report_browser.py --params 5000   # a large model's (aggregated) report

The synthetic report's build time is printed (wall clock and CPU), also without chromium.

For each report: chromium loads the file:// URL with console logging on stderr and dumps
the DOM; the check fails on any console message, any "Failed to load resource", or a DOM
that lost the figures or tables of the file. A control page that logs a console error
first proves that the capture works (so a silent browser is not mistaken for a clean page).

Installs nothing. Exit status: 0 clean, 1 a problem was found, 2 chromium is missing.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Tuple

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         "--enable-logging=stderr", "--v=0", "--window-size=1280,2000"]
CONSOLE_RE = re.compile(r"CONSOLE|Uncaught|Failed to load resource|net::ERR_", re.I)


def run_chromium(url: str, *, screenshot: str = None, timeout: float = 90.0) -> Tuple[str, str, int]:
    """(dumped DOM, stderr, exit code) of one headless chromium run on ``url``."""
    with tempfile.TemporaryDirectory(prefix="graddbg-chromium-") as profile:
        cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}"]
        cmd += [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
        proc = subprocess.run(cmd + [url], capture_output=True, text=True, timeout=timeout)
    return proc.stdout, proc.stderr, proc.returncode


def console_lines(stderr: str) -> List[str]:
    return [line for line in stderr.splitlines() if CONSOLE_RE.search(line)]


def check_report(path: Path, screenshot: str = None) -> List[str]:
    """Problems found with one report (empty list: clean)."""
    text = path.read_text(encoding="utf-8")
    t0 = time.perf_counter()
    dom, stderr, rc = run_chromium(path.resolve().as_uri())
    elapsed = time.perf_counter() - t0
    problems = []
    if rc != 0:
        problems.append(f"chromium exited with status {rc}")
    problems += [f"console: {line.strip()}" for line in console_lines(stderr)]
    want_svg, got_svg = text.count("<svg"), dom.count("<svg")
    want_tables, got_tables = text.count("<table"), dom.count("<table")
    if got_svg != want_svg:
        problems.append(f"the rendered DOM has {got_svg} <svg> elements, the file {want_svg}")
    if got_tables != want_tables:
        problems.append(f"the rendered DOM has {got_tables} tables, the file {want_tables}")
    if "<script" in dom:
        problems.append("the rendered DOM holds a <script> element")
    print(f"{path.name}: {path.stat().st_size / 1e6:.2f} MB, {got_svg} svg, {got_tables} tables, "
          f"{len(console_lines(stderr))} console lines, chromium {elapsed:.1f} s -> "
          f"{'OK' if not problems else 'PROBLEMS'}")
    if screenshot:
        _, _, rc = run_chromium(path.resolve().as_uri(), screenshot=screenshot)
        print(f"  screenshot: {screenshot} (exit {rc})")
    return problems


def control_page(tmp: Path) -> List[str]:
    """A page that logs a console error: the capture must see it."""
    page = tmp / "control.html"
    page.write_text('<!DOCTYPE html><html><head><meta charset="utf-8"><link rel="icon" '
                    'href="data:,"></head><body><script>console.error("graddbg-canary")'
                    "</script></body></html>")
    _, stderr, _ = run_chromium(page.resolve().as_uri())
    return [line for line in console_lines(stderr) if "graddbg-canary" in line]


def synthetic_run(n_steps: int = 1000, n_params: int = 100):
    """``n_steps`` x ``n_params`` (default 1,000 x 100) with a NaN burst, an Inf, 1e38 and
    histograms; name and module are categoricals, as ``w.stats`` holds them."""
    import numpy as np
    import pandas as pd

    from graddbg.anomaly import Anomaly
    from graddbg.run import Run

    rng = np.random.default_rng(0)
    names = [f"blocks.{i // 2}.{'weight' if i % 2 == 0 else 'bias'}" for i in range(n_params)]
    modules = [n.rsplit(".", 1)[0] for n in names]
    S, P = n_steps, n_params
    norm = np.exp(rng.normal(-3, 0.5, (S, P)))
    norm[400:410, 7] = np.nan
    norm[700, 20] = np.inf
    norm[100, 50] = 1e38
    nonfinite = np.where(np.isfinite(norm), 0, 5).astype(np.int64)
    stats = pd.DataFrame({
        "step": np.repeat(np.arange(S, dtype=np.int64), P),
        "name": pd.Categorical.from_codes(np.tile(np.arange(P), S), categories=pd.Index(names, dtype=object)),
        "module": pd.Categorical(np.tile(np.array(modules, dtype=object), S)),
        "numel": np.full(S * P, 256, dtype=np.int64),
        "norm": norm.ravel(), "absmax": norm.ravel() / 4, "nonfinite": nonfinite.ravel(),
        "update_ratio": np.exp(rng.normal(math.log(1e-3), 0.7, S * P)),
        "has_grad": np.ones(S * P, dtype=bool)})
    g = np.sqrt((np.where(np.isnan(norm), np.inf, norm) ** 2).sum(1))
    steps = pd.DataFrame({"step": np.arange(S, dtype=np.int64), "global_norm": g,
                          "clipped_norm": np.nan, "nonfinite": nonfinite.sum(1), "overflow": False,
                          "scale": np.nan, "recorded": True, "lr": 1e-3})
    lo = np.array([0.0] + [10.0 ** (e / 2) for e in range(-24, 8)])
    hi = np.append(lo[1:], np.inf)
    hsteps = np.arange(0, S, 50)
    B = len(lo)
    hist = pd.DataFrame({
        "step": np.repeat(hsteps, P * B), "name": np.tile(np.repeat(names, B), len(hsteps)),
        "lo": np.tile(lo, len(hsteps) * P), "hi": np.tile(hi, len(hsteps) * P),
        "count": rng.integers(0, 30, len(hsteps) * P * B)})
    anomalies = [Anomaly(step=s, kind="nonfinite", name=names[7], module=modules[7],
                         op="DivBackward0", value=math.nan, threshold=None,
                         source="model.py:88", message=f"NaN in <{names[7]}>")
                 for s in range(400, 410)]
    return Run(stats, steps, anomalies, histograms=hist, meta={"model": "Synthetic<100>"})


def recorded_report(tmp: Path) -> Path:
    """A real run: a small model trained under graddbg.watch, a NaN input at step 3, and
    its autograd graph."""
    import warnings

    import torch

    import graddbg

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model, opt, histograms=True, nonfinite="skip", update_every=1) as w:
            for i in range(8):
                x = torch.randn(16, 4)
                if i == 3:
                    x[0, 0] = float("nan")
                (model(x) ** 2).mean().backward()
                opt.step()
                opt.zero_grad()
    loss = (model(torch.randn(2, 4)) ** 2).mean()
    g = graddbg.graph(loss, model=model, watch=w)
    return w.report(tmp / "recorded.html", graph=g)


def build_reports(tmp: Path, n_params: int, n_steps: int) -> List[Path]:
    """The synthetic report (timed: wall clock and CPU) and the recorded one."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from graddbg.report import write_report

    run = synthetic_run(n_steps, n_params)
    t0, c0 = time.perf_counter(), time.process_time()
    path = write_report(run, tmp / f"synthetic-{n_steps}x{n_params}.html")
    print(f"built the {n_steps} steps x {n_params} parameters report ({len(run.stats):,} rows) in "
          f"{time.perf_counter() - t0:.1f} s wall, {time.process_time() - c0:.1f} s CPU: "
          f"{path.stat().st_size / 1e6:.2f} MB")
    return [path, recorded_report(tmp)]


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="*", help="existing report files (default: build two)")
    parser.add_argument("--screenshot", help="also save a PNG screenshot of the first report")
    parser.add_argument("--params", type=int, default=100,
                        help="parameters of the synthetic run (default 100; 5000 shows the "
                             "aggregated report of a large model)")
    parser.add_argument("--steps", type=int, default=1000, help="steps of the synthetic run")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="graddbg-report-browser-") as d:
        tmp = Path(d)
        paths = [Path(p) for p in args.reports] or build_reports(tmp, args.params, args.steps)
        if not os.path.exists(CHROMIUM):
            print(f"{CHROMIUM} is missing: install Debian's chromium with `apt-get install -y "
                  "chromium` (as root) and run this again.", file=sys.stderr)
            return 2
        seen = control_page(tmp)
        if not seen:
            print("control page: the console error was NOT captured; this check cannot see "
                  "console errors with this chromium", file=sys.stderr)
            return 1
        print(f"control page: console capture works ({seen[0].strip()[:100]})")
        problems = []
        for i, p in enumerate(paths):
            found = check_report(p, args.screenshot if i == 0 else None)
            problems += [f"{p.name}: {x}" for x in found]
        for line in problems:
            print("  " + line)
        return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
