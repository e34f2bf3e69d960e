"""The step audit's cost (issue 39, point 1): what an audited step costs over the same step
with the audit off, measured side by side, and that the steps between audits cost nothing.

For each model (bench/_models.py) and optimizer, two copies of the model train in one
process, one under ``graddbg.watch(model, opt)`` (both halves of the audit on their schedule:
steps 0, 1, 2, 10, 100, ...) and one under ``graddbg.watch(model, opt, update_rule=None,
applied_grad=None)``, alternating step by step. With ``--clip`` both clip the gradients
(``clip_grad_norm_``) between backward and the step, so that the gradient half compares them
(it compares only gradients something touched after backward). A repeat times every step of both; the audited steps' times (steps 1, 2 and
10: step 0 is the warm-up) are compared with the same steps of the other copy, and the other
steps likewise. Prints the median ratio (audit on / off) of the audited steps and of the
others, over the repeats, with their spread, and the bytes the audit copies per audited step.

    PYTHONPATH=$PWD .venv/bin/python bench/audit_cost.py [--models launchbound mlp8m] [--repeats 5] [--clip]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _models  # noqa: E402

import graddbg  # noqa: E402
from graddbg._args import STEP_AUDIT  # noqa: E402

STEPS = 14


def _run(name, opt_name, steps, clip=False):
    model, make_batch, loss_fn = _models.MODELS[name]()
    twins = []
    for kw in ({}, {"update_rule": None, "applied_grad": None}):
        m = copy.deepcopy(model)
        opt = {"sgd": lambda p: torch.optim.SGD(p, lr=1e-4, momentum=0.9),
               "adamw": lambda p: torch.optim.AdamW(p, lr=1e-4)}[opt_name](m.parameters())
        twins.append((m, opt, graddbg.watch(m, opt, **kw)))
    batch = make_batch()
    times = [[], []]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k, (m, opt, w) in enumerate(twins):
            w.__enter__()
        try:
            for _ in range(steps):
                for k, (m, opt, _) in enumerate(twins):
                    t = time.perf_counter()
                    out = m(batch[0])
                    loss_fn(out, batch[1]).backward()
                    if clip:
                        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                    opt.step()
                    opt.zero_grad()
                    times[k].append(time.perf_counter() - t)
        finally:
            for m, opt, w in twins:
                w.__exit__(None, None, None)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return times, params


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["launchbound", "mlp8m"], choices=list(_models.MODELS))
    ap.add_argument("--optimizers", nargs="+", default=["sgd", "adamw"], choices=["sgd", "adamw"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--clip", action="store_true", help="clip the gradients between backward and the step")
    args = ap.parse_args(argv)
    audited = [i for i in range(1, STEPS) if STEP_AUDIT.includes(i)]
    others = [i for i in range(3, STEPS) if i not in audited]
    print(f"audited steps timed: {audited}; the others: {others}")
    print(f"{'model':<12} {'optimizer':<9} {'audited on/off':>16} {'IQR':>13} {'others on/off':>15} "
          f"{'IQR':>13} {'weights MB':>11}")
    for name in args.models:
        for opt_name in args.optimizers:
            a_ratios, o_ratios = [], []
            for _ in range(args.repeats):
                (on, off), nbytes = _run(name, opt_name, STEPS, args.clip)
                a_ratios.append(statistics.median(on[i] / off[i] for i in audited))
                o_ratios.append(statistics.median(on[i] / off[i] for i in others))
            qa = statistics.quantiles(a_ratios, n=4) if len(a_ratios) > 1 else [a_ratios[0]] * 3
            qo = statistics.quantiles(o_ratios, n=4) if len(o_ratios) > 1 else [o_ratios[0]] * 3
            print(f"{name:<12} {opt_name:<9} {statistics.median(a_ratios):>16.2f} {qa[0]:>6.2f}-{qa[2]:<6.2f} "
                  f"{statistics.median(o_ratios):>15.2f} {qo[0]:>6.2f}-{qo[2]:<6.2f} {nbytes / 2**20:>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
