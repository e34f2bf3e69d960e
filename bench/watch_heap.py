"""What a watch costs to open and close as the heap grows, side by side in one run.

A long process holds millions of Python objects (a dataset in lists, a tokenizer's vocab).
Opening a ``watch()`` must not walk them: this times five enter/step/exit cycles of a watch
on a small model with a small heap, then with ``--objects`` more lists alive, in a process
that imported ``torch.distributed.pipelining`` (whose stages a watch looks for only when a
process group exists), and prints the ratio (about 1 when nothing scales with the heap).

    .venv/bin/python bench/watch_heap.py [--objects 2000000]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed.pipelining  # noqa: F401  (imported, as a program using it would)

import graddbg


def cycles(n: int = 5) -> float:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t = time.perf_counter()
    for _ in range(n):
        with graddbg.watch(model, opt):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    return (time.perf_counter() - t) / n * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=2_000_000)
    args = ap.parse_args()
    cycles(1)  # (first-use costs out of the timing)
    small = cycles()
    junk = [[i] for i in range(args.objects)]
    large = cycles()
    print(f"ms per watch cycle: {small:.1f} with a small heap, {large:.1f} with {len(junk):,} more objects "
          f"(ratio {large / small:.2f})")


if __name__ == "__main__":
    main()
