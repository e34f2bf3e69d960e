"""Cost of a watch under frequent anomalies: a NaN gradient every other step for 50,000 steps.

A tiny model (``nn.Linear(4, 1)``, SGD, 64 batches in turn) is trained under
``graddbg.watch(model, opt, nonfinite="skip", history=200)``; on every odd step a NaN is
planted into the weight's gradient after ``backward()`` (``--plant input`` puts it into the
input instead). The history is full after a few hundred steps, ``w.anomalies`` after
``MAX_KEPT_PER_KIND`` nonfinite findings; from then on the cost of a step and the memory
should stay flat. The bench prints, at steps 1k, 10k, 25k and 50k (the median step time of
the 1,000 steps before each point):

- the step time and its ratio to the first block (measured side by side in one run), in
  wall time (``time.perf_counter``) and in this thread's CPU time (``time.thread_time``:
  not counting the time the process waited for a core, on a machine shared with others),
- the process's resident memory (current, not peak) and, with ``--trace``, the memory
  traced by ``tracemalloc`` (on from the first step, so every block pays its overhead
  alike: the step times are then about 3x longer), each with its growth since 1k,
- the sizes of the bounded containers: ``len(w.anomalies)``, the findings counted but not
  kept, the kept anomalies' steps still in the history (kept from thinning), the recorded
  steps (``w.stats``) and the step rows (``w.steps``) of the history.

    python bench/anomaly_heavy.py                  # 50,000 steps
    python bench/anomaly_heavy.py --trace --steps 20000
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import tracemalloc

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import graddbg  # noqa: E402


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run(steps: int, history: int, plant: str, trace: bool, block: int = 1000) -> list:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = torch.randn(64, 8, 4)  # (batches in turn: the gradient never settles to exactly zero)
    y = torch.randn(64, 8, 1)
    bad = xs.clone()
    bad[:, 0, 0] = float("nan")
    points = sorted({p for p in (1000, 10_000, 25_000, 50_000, steps) if p <= steps})
    times, cpu = np.zeros(steps), np.zeros(steps)
    rows = []
    import pandas  # noqa: F401  (imported now: w.steps at the first point would count its import)

    if trace:
        tracemalloc.start()
    with graddbg.watch(model, opt, nonfinite="skip", explode=None, history=history) as w:
        for i in range(steps):
            t0, c0 = time.perf_counter(), time.thread_time()
            opt.zero_grad()
            x = (bad if plant == "input" and i % 2 else xs)[i % 64]
            (model(x) - y[i % 64]).pow(2).mean().backward()
            if plant == "grad" and i % 2:
                model.weight.grad[0, 0] = float("nan")
            opt.step()
            times[i], cpu[i] = time.perf_counter() - t0, time.thread_time() - c0
            if i + 1 in points:
                kept = w.steps["step"]
                recorded = int(w.stats["step"].nunique())
                traced = tracemalloc.get_traced_memory()[0] / 2**20 if tracemalloc.is_tracing() else float("nan")
                rows.append({"step": i + 1, "ms": 1e3 * float(np.median(times[i + 1 - block: i + 1])),
                             "cpu": 1e3 * float(np.median(cpu[i + 1 - block: i + 1])),
                             "rss": _rss_mb(), "traced": traced, "kept": len(w.anomalies),
                             "counted": sum(getattr(w.anomalies, "not_kept", {}).values()),  # (0 before the limit existed)
                             "protected": int(kept.isin([a.step for a in w.anomalies]).sum()),
                             "rows": recorded, "step_rows": len(kept)})
    tracemalloc.stop()
    return rows


def main(argv: list = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50_000)
    ap.add_argument("--history", type=int, default=200)
    ap.add_argument("--plant", choices=("grad", "input"), default="grad")
    ap.add_argument("--trace", action="store_true", help="also trace the memory with tracemalloc (slower)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = run(a.steps, a.history, a.plant, a.trace)
    print(f"graddbg {graddbg.__version__}, torch {torch.__version__}: nn.Linear(4, 1), a NaN {a.plant} every "
          f"other step, nonfinite='skip', history={a.history}, {a.steps:,} steps in "
          f"{time.perf_counter() - t0:.0f} s")
    first = rows[0]
    print(f"{'step':>7} {'ms/step':>8} {'ratio':>6} {'cpu ms':>7} {'ratio':>6} {'RSS MiB':>8} {'(+)':>6} {'traced MiB':>10} {'(+)':>6} "
          f"{'anomalies':>9} {'counted':>8} {'anom.steps':>10} {'stats':>5} {'steps':>5}")
    for r in rows:
        print(f"{r['step']:>7,} {r['ms']:>8.3f} {r['ms'] / first['ms']:>6.2f} {r['cpu']:>7.3f} "
              f"{r['cpu'] / first['cpu']:>6.2f} {r['rss']:>8.1f} "
              f"{r['rss'] - first['rss']:>+6.1f} {r['traced']:>10.2f} {r['traced'] - first['traced']:>+6.2f} "
              f"{r['kept']:>9,} {r['counted']:>8,} {r['protected']:>10,} {r['rows']:>5} {r['step_rows']:>5}")


if __name__ == "__main__":
    main()
