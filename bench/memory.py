"""Memory and scale of a watch's history: bytes per retained row, the row cap holding, and
the time to build the table and the report for a large model.

A model of many parameter tensors (default 5,000: 2,500 Linear(4, 4) layers) is trained
without an optimizer (each backward pass a step) under graddbg.watch for many steps
(default 1,000); the bench prints

- the rows kept against graddbg.hooks.MAX_ROWS (and with a small cap, that it holds
  while the first, latest and anomaly steps stay),
- bytes per retained row of ``w.stats`` (pandas' deep memory usage: categoricals for
  name and module), and the resident memory the process gained per step,
- the time to build ``w.stats`` and to write the HTML report.

    python bench/memory.py                      # 5,000 parameters x 1,000 steps
    python bench/memory.py --params 1000 --steps 200
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import graddbg  # noqa: E402
import graddbg.hooks  # noqa: E402


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(params: int, steps: int, cap: int = None) -> dict:
    if cap is not None:
        graddbg.hooks.MAX_ROWS = cap
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(params // 2)])
    x = torch.ones(1, 4)
    rss0 = _rss_mb()
    t0 = time.perf_counter()
    with graddbg.watch(model, explode=None, nonfinite="record") as w:
        for step in range(steps):
            model.zero_grad(set_to_none=False)
            out = model(x).sum()
            (out * float("nan") if step == steps // 3 else out).backward()
    train_s = time.perf_counter() - t0
    rss1 = _rss_mb()
    t0 = time.perf_counter()
    df = w.stats
    frame_s = time.perf_counter() - t0
    kept = sorted(df["step"].unique())
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        w.report(os.path.join(tmp, "report.html"))
        report_s = time.perf_counter() - t0
    return {"params": params, "steps": steps, "cap": graddbg.hooks.MAX_ROWS, "rows": len(df),
            "steps_kept": len(kept), "first": int(kept[0]), "last": int(kept[-1]),
            "anomaly_kept": steps // 3 in kept, "bytes_per_row": df.memory_usage(deep=True).sum() / max(len(df), 1),
            "rss_growth_mb": rss1 - rss0, "train_s": train_s, "frame_s": frame_s, "report_s": report_s}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=5000)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--small-cap", type=int, default=200_000, help="a second run with this row cap")
    args = ap.parse_args(argv)
    default_cap = graddbg.hooks.MAX_ROWS
    for cap in (default_cap, args.small_cap):
        r = run(args.params, args.steps, cap)
        print(f"{r['params']} parameters x {r['steps']} steps, cap {r['cap']:,} rows: kept {r['rows']:,} rows "
              f"({r['steps_kept']} steps, first {r['first']}, last {r['last']}, anomaly step kept: "
              f"{r['anomaly_kept']}); {r['bytes_per_row']:.1f} bytes per row of w.stats; max RSS grew "
              f"{r['rss_growth_mb']:.0f} MB while training ({r['train_s']:.1f} s); w.stats built in "
              f"{r['frame_s']:.2f} s; report written in {r['report_s']:.2f} s")
        assert r["rows"] <= r["cap"], "the row cap did not hold"


if __name__ == "__main__":
    main()
