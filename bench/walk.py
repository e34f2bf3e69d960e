"""One gradient's walk through graddbg, counted: from the optimizer's step pre-hook (the step
boundary) to the row written into the history behind ``w.stats``.

Prints the graddbg frames on the stack when the row is written (the depth of the walk),
the graddbg function calls made during the boundary (every frame the walk enters) and the
files they live in. No timing: a count of the code's shape, to compare before and after a
restructure.

    .venv/bin/python bench/walk.py
"""
from __future__ import annotations

import os
import sys

import torch

import graddbg
from graddbg import stats as gstats

PKG = os.path.dirname(graddbg.__file__)


def main() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    depth_at_write = []
    calls = []
    original = gstats.History.append

    def append(self, rec):  # the row of w.stats / w.steps
        f, frames = sys._getframe(1), []
        while f is not None:
            if f.f_code.co_filename.startswith(PKG):
                frames.append(f"{os.path.relpath(f.f_code.co_filename, PKG)}:{f.f_code.co_name}")
            f = f.f_back
        depth_at_write.append(frames)
        return original(self, rec)

    deepest = [[]]

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PKG):
            calls.append(f"{os.path.relpath(frame.f_code.co_filename, PKG)}:{frame.f_code.co_name}")
            f, path = frame, []
            while f is not None:
                if f.f_code.co_filename.startswith(PKG):
                    path.append(f"{os.path.relpath(f.f_code.co_filename, PKG)}:{f.f_code.co_name}")
                f = f.f_back
            if len(path) > len(deepest[0]):
                deepest[0] = path

    gstats.History.append = append
    try:
        with graddbg.watch(model, opt) as w:
            for i in range(3):
                model(torch.randn(4, 8)).sum().backward()
                if i == 2:
                    sys.setprofile(profile)
                opt.step()
                sys.setprofile(None)
                opt.zero_grad()
    finally:
        gstats.History.append = original
    frames = depth_at_write[-1]
    print(f"graddbg frames on the stack at the row's write: {len(frames) + 1} (the write included)")
    for fr in reversed(frames):
        print("   ", fr)
    print(f"the deepest graddbg stack during the boundary: {len(deepest[0])} frames, in "
          f"{len({p.split(':')[0] for p in deepest[0]})} files")
    for fr in reversed(deepest[0]):
        print("   ", fr)
    files = sorted({c.split(":")[0] for c in calls})
    print(f"graddbg calls during one step boundary: {len(calls)} in {len(set(calls))} distinct functions, "
          f"{len(files)} files: {', '.join(files)}")
    assert len(w.stats) == 3 * 4


if __name__ == "__main__":
    main()
