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

With ``--copies``, the memory of the update/weight ratio's copies of the weights instead: a
stack of ``--layers`` nn.Linear(4096, 4096) (18: 302M float32 parameters, 1.21 GB) trained
with SGD without momentum (the optimizer holds nothing) for ``--steps`` steps (2), the ratio
measured at step 0, each configuration alone in a fresh process (one at a time: several GB
each); the bench prints each one's peak resident memory and what it adds to the unwatched
run, as a share of the weights' bytes:

    python bench/memory.py --copies             # unwatched / watched without the ratio /
                                                # copy_budget=1 (every weight) / the default
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
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


#: the configurations of ``--copies``: the keywords of watch() (None: unwatched)
COPY_RUNS = {"unwatched": None, "watched, update_every=None": {"update_every": None},
             "watched, copy_budget=1 (every weight)": {"copy_budget": 1.0},
             "watched, default copy_budget=0.1": {}}


def copies_child(name: str, layers: int, steps: int) -> dict:
    """One configuration of ``--copies``, in this (fresh) process: its peak RSS."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(8, 4096)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kw = COPY_RUNS[name]
    w = graddbg.watch(model, opt, explode=None, **kw) if kw is not None else None
    try:
        for _ in range(steps):
            model(x).square().mean().backward()
            opt.step()                                  # (step 0: the ratio is measured)
            opt.zero_grad(set_to_none=True)
    finally:
        if w is not None:
            w.close()
    copied = 0
    if w is not None and "update_ratio" in w.stats:
        at0 = w.stats[(w.stats.step == 0) & w.stats.update_ratio.notna()]
        copied = int(at0.numel.sum()) * 4
    return {"name": name, "peak_rss_mb": _rss_mb(), "weights_mb": weights / 2**20, "copied_mb": copied / 2**20,
            "params": sum(p.numel() for p in model.parameters())}


def copies(layers: int, steps: int) -> None:
    """Run every configuration of ``--copies`` in its own process, one at a time."""
    rows = []
    for name in COPY_RUNS:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--copies-child", name,
                              "--layers", str(layers), "--steps", str(steps)],
                             check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    base = rows[0]["peak_rss_mb"]
    print(f"{rows[0]['params'] / 1e6:.0f}M parameters ({layers} x nn.Linear(4096, 4096)), weights "
          f"{rows[0]['weights_mb']:.0f} MB, SGD without momentum, {steps} steps, the update ratio at step 0:")
    for r in rows:
        extra = r["peak_rss_mb"] - base
        print(f"  {r['name']:<40} peak RSS {r['peak_rss_mb']:7.0f} MB  +{extra:6.0f} MB over unwatched "
              f"({100 * extra / r['weights_mb']:5.1f}% of the weights); copied at step 0: "
              f"{r['copied_mb']:.0f} MB ({100 * r['copied_mb'] / r['weights_mb']:.1f}%)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=5000)
    ap.add_argument("--steps", type=int, default=None, help="steps (1000; with --copies: 2)")
    ap.add_argument("--small-cap", type=int, default=200_000, help="a second run with this row cap")
    ap.add_argument("--copies", action="store_true", help="the memory of the update ratio's copies instead")
    ap.add_argument("--layers", type=int, default=18, help="--copies: nn.Linear(4096, 4096) layers")
    ap.add_argument("--copies-child", choices=list(COPY_RUNS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.copies_child:
        print(json.dumps(copies_child(args.copies_child, args.layers, args.steps)))
        return
    if args.copies:
        copies(args.layers, args.steps or 2)
        return
    args.steps = args.steps or 1000
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
