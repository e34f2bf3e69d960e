"""Overhead of graddbg.find_nonfinite against torch.autograd.detect_anomaly.

One forward + backward of each bench model (bench/_models.py), timed three ways,
interleaved in the same run: bare, under ``find_nonfinite(model)``, and under
``torch.autograd.detect_anomaly()``. Prints medians over the repeats and the ratios;
the target is find_nonfinite / detect_anomaly <= 1.0. It also checks that the gradients
under find_nonfinite are bitwise identical to the bare ones.

    .venv/bin/python bench/find_nonfinite.py [--repeats 7] [--models mlp8m,transformer4,resnet18ish]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _models import MODELS  # noqa: E402

from graddbg.blame import find_nonfinite  # noqa: E402


def _step(model: torch.nn.Module, make_batch: Callable, loss_fn: Callable) -> None:
    x, y = make_batch()
    model.zero_grad(set_to_none=True)
    loss_fn(model(x), y).backward()


def _grads(model: torch.nn.Module) -> List[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def run(name: str, repeats: int) -> Dict[str, float]:
    torch.manual_seed(0)
    model, make_batch, loss_fn = MODELS[name]()
    modes = {
        "bare": lambda: _step(model, make_batch, loss_fn),
        "find_nonfinite": None,
        "detect_anomaly": None,
    }

    def nonfinite() -> None:
        with find_nonfinite(model):
            _step(model, make_batch, loss_fn)

    def anomaly() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # detect_anomaly warns that it is slow
            with torch.autograd.detect_anomaly():
                _step(model, make_batch, loss_fn)

    modes["find_nonfinite"] = nonfinite
    modes["detect_anomaly"] = anomaly

    modes["bare"]()
    reference = _grads(model)
    nonfinite()
    same = all(torch.equal(a, b) for a, b in zip(reference, _grads(model)))
    anomaly()
    times: Dict[str, List[float]] = {k: [] for k in modes}
    for _ in range(repeats):
        for key, fn in modes.items():  # interleaved: noise hits all three alike
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    med["bitwise_identical"] = float(same)
    return med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--models", default="mlp8m,transformer4,resnet18ish")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), median of {args.repeats} "
          "interleaved repeats, one forward+backward each")
    print(f"{'model':<14}{'bare ms':>10}{'find ms':>10}{'anomaly ms':>12}"
          f"{'find/bare':>11}{'anomaly/bare':>14}{'find/anomaly':>14}  identical")
    for name in args.models.split(","):
        m = run(name, args.repeats)
        print(f"{name:<14}{m['bare'] * 1e3:>10.1f}{m['find_nonfinite'] * 1e3:>10.1f}"
              f"{m['detect_anomaly'] * 1e3:>12.1f}{m['find_nonfinite'] / m['bare']:>11.2f}"
              f"{m['detect_anomaly'] / m['bare']:>14.2f}"
              f"{m['find_nonfinite'] / m['detect_anomaly']:>14.2f}  "
              f"{bool(m['bitwise_identical'])}")


if __name__ == "__main__":
    main()
