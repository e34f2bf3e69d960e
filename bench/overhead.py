"""Step-time overhead of graddbg.watch against a bare training step, measured side by side.

For each model (bench/_models.py) the variants run interleaved in one process, in a
shuffled order each repeat, each with its own copy of the model (same initial weights):

- bare:      forward, backward, optimizer step, zero_grad
- floor:     bare + one torch._foreach_norm over all gradients (one read of them)
- watch:     bare under graddbg.watch(model, opt) with the defaults (every step: norm,
             absmax, non-finite check; explode detector)
- watch:norm: graddbg.watch(stats=("norm",)): the non-finite check and norms, no absmax
             (absmax needs a second reduction pass over the gradients)
- watch:noloc: the defaults with localise=False (no per-forward capture of the inputs,
             RNG state and output gradient for replaying a non-finite step)
- watch:nohyg: the defaults with the invariant checks read from the ledger off (stale_grad,
             empty_step, double_step, orphan_param, no_update, hidden_param, eval_mode,
             loss_pattern, dead_grad = None; the ledger itself is kept): watch over
             watch:nohyg is their cost
- watch:noupd: the defaults with update_every=None (no update/weight ratio on its log cadence)
- watch:notape: the defaults with the loss tape off (the torch-function mode that records the
             code between the model's output and backward(), so that a NaN born there is
             named with its op and line): watch over watch:notape is the tape's cost. There is
             no option to turn it off; this bench makes graddbg.blame.LossTape.begin return
             None (as it does inside a compiled region) around each of that variant's steps
             and puts it back after: a switch of this bench only
- watch/10:  graddbg.watch(every=10, nonfinite=NonFinite(every=10)): 9 steps in 10 make no
             host synchronisation
- skeleton:  the least a watch that records every step can be, hand-written here: a step
             pre-hook on the optimizer that runs the floor's one foreach norm, stacks the
             norms, reads them to the host (the one read-back), checks them finite and keeps
             the row; no ledger, no checks. watch over skeleton is what graddbg's host work
             per step costs beyond the least that recording every step needs
- item:      the usual hand-written recipe: a post-accumulate-grad hook per parameter
             doing grad.norm().item()
- anomaly:   bare under torch.autograd.detect_anomaly()

Each timing of n steps starts after one untimed step of the same variant: the first step
after another variant ran pays for bringing its copy of the model back into the caches
(measured at 2-3x a step on the launch-bound net), a cost of the interleaving itself that
a training loop, which runs one model, does not pay.

Prints medians and spread (IQR) of the time per step, the ratio of the medians to bare's,
the paired ratio (the median over repeats of each repeat's time over the bare time of the
same repeat, which cancels the machine's slow drifts in load) with its IQR, the overhead
as a multiple of the floor's overhead (paired), and host synchronisations per step;
the ratio of the mean step times over all repeats ("mean ratio": unlike the medians it
counts every rare step, such as the update/weight ratio's every update_every steps, in
full), and writes JSON.

    python bench/overhead.py                 # all four models, 7 repeats
    python bench/overhead.py --models launchbound --repeats 9
    python bench/overhead.py --models launchbound --variants bare watch watch:notape --loss heavy

``--loss heavy`` replaces each model's loss by loss code of many ops, as users write it:
cross-entropy by hand (log_softmax, gather, mean), label smoothing, and an L2 penalty over
the parameters (three ops per parameter tensor), the tape's worst case in these models.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import random
import statistics
import sys
import time
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _models  # noqa: E402

import torch.nn.functional as F  # noqa: E402

import graddbg  # noqa: E402
from graddbg.blame import LossTape  # noqa: E402

STEPS = {"mlp8m": 8, "transformer4": 3, "resnet18ish": 2, "launchbound": 40}
from graddbg.anomaly import HYGIENE_KINDS  # noqa: E402

HYGIENE = tuple(k for k in HYGIENE_KINDS if k != "unused_param")  # the ledger's invariants


@contextlib.contextmanager
def no_loss_tape():
    """The loss tape off for what runs inside: LossTape.begin gives None (no tape), as it
    does inside a compiled region; put back after (this bench's switch, not an option)."""
    begin = LossTape.__dict__["begin"]
    LossTape.begin = classmethod(lambda cls, outputs: None)
    try:
        yield
    finally:
        LossTape.begin = begin


def heavy_loss(model):
    """Loss code of many ops on ``model``'s output (see the docstring: ``--loss heavy``)."""
    params = [p for p in model.parameters() if p.requires_grad]

    def loss_fn(out, y):
        logp = F.log_softmax(out.reshape(-1, out.shape[-1]), dim=-1)
        nll = -logp.gather(1, y.reshape(-1, 1)).mean()
        smooth = -logp.mean()
        l2 = sum(p.pow(2).sum() for p in params)
        return 0.9 * nll + 0.1 * smooth + 1e-6 * l2

    return loss_fn


class Variant:
    def __init__(self, name, model, make_batch, loss_fn):
        self.name = name
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        self.batch = make_batch()
        self.loss_fn = heavy_loss(model) if loss_fn == "heavy" else loss_fn
        self.ctx = None
        self.handles = []
        self.times = []
        params = [p for p in model.parameters() if p.requires_grad]
        if name in ("watch", "watch:notape"):
            self.ctx = graddbg.watch(model, self.opt)
        elif name == "watch:noupd":
            self.ctx = graddbg.watch(model, self.opt, update_every=None)
        elif name == "watch:noloc":
            self.ctx = graddbg.watch(model, self.opt, localise=False)
        elif name == "watch:nohyg":
            self.ctx = graddbg.watch(model, self.opt, **{k: None for k in HYGIENE})
        elif name == "watch:norm":
            self.ctx = graddbg.watch(model, self.opt, stats=("norm",))
        elif name == "watch/10":
            self.ctx = graddbg.watch(model, self.opt, every=10, nonfinite=graddbg.NonFinite(every=10))
        elif name == "skeleton":
            self.rows = []

            def record(opt, args, kwargs):
                norms = torch.stack(torch._foreach_norm([p.grad for p in self.params if p.grad is not None]))
                row = norms.cpu().numpy()
                if not np.isfinite(row.sum()):
                    raise FloatingPointError("a non-finite gradient")
                self.rows.append(row)

            self.handles.append(self.opt.register_step_pre_hook(record))
        elif name == "item":
            self.norms = {}
            for i, p in enumerate(params):
                self.handles.append(p.register_post_accumulate_grad_hook(
                    lambda t, i=i: self.norms.__setitem__(i, t.grad.norm().item())))
        self.params = params

    def step(self):
        if self.name == "watch:notape":
            with no_loss_tape():
                return self._step()
        return self._step()

    def _step(self):
        x, y = self.batch
        if self.name == "anomaly":
            with torch.autograd.detect_anomaly():
                self.loss_fn(self.model(x), y).backward()
        else:
            self.loss_fn(self.model(x), y).backward()
        if self.name == "floor":
            torch._foreach_norm([p.grad for p in self.params])
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)

    def close(self):
        if self.ctx is not None:
            self.ctx.close()
        for h in self.handles:
            h.remove()


def bench_model(name, repeats, variants, steps=None, loss="model"):
    torch.manual_seed(0)
    model, make_batch, loss_fn = _models.MODELS[name]()
    if loss == "heavy":
        loss_fn = "heavy"  # (each variant writes it over its own copy's parameters)
    vs = [Variant(v, copy.deepcopy(model), make_batch, loss_fn) for v in variants]
    n = steps or STEPS[name]
    for v in vs:  # warm-up
        for _ in range(2):
            v.step()
    syncs0 = {v.name: v.ctx.host_syncs for v in vs if v.ctx is not None}
    order = list(vs)
    for _ in range(repeats):
        random.shuffle(order)
        for v in order:
            v.step()  # untimed: brings this copy back into the caches (see the docstring)
            t0 = time.perf_counter()
            for _ in range(n):
                v.step()
            v.times.append((time.perf_counter() - t0) / n)
    result = {}
    for v in vs:
        med = statistics.median(v.times)
        q = statistics.quantiles(v.times, n=4) if len(v.times) >= 2 else [med, med, med]
        syncs = None
        if v.ctx is not None:
            syncs = (v.ctx.host_syncs - syncs0[v.name]) / (repeats * (n + 1))  # (+ the untimed step)
        result[v.name] = {"median_s": med, "q1_s": q[0], "q3_s": q[2], "syncs_per_step": syncs,
                          "times": list(v.times)}
        v.close()
    bare = result["bare"]["median_s"]
    bare_times = next(v.times for v in vs if v.name == "bare")
    for v in vs:  # paired: each repeat's time over the bare time of the same repeat
        paired = [t / b for t, b in zip(v.times, bare_times)]
        q = statistics.quantiles(paired, n=4) if len(paired) >= 2 else [paired[0]] * 3
        result[v.name].update(paired_ratio=statistics.median(paired), paired_q1=q[0], paired_q3=q[2],
                              mean_ratio=sum(v.times) / sum(bare_times))
    floor_over = result["floor"]["paired_ratio"] - 1 if "floor" in result else float("nan")
    for r in result.values():
        r["ratio"] = r["median_s"] / bare
        r["over_floor"] = (r["paired_ratio"] - 1) / floor_over if floor_over > 0 else float("nan")
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(_models.MODELS), choices=list(_models.MODELS))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--variants", nargs="+",
                    default=["bare", "floor", "watch", "watch:norm", "watch/10", "item", "anomaly"])
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per timing (default per model: " + ", ".join(f"{k} {v}" for k, v in STEPS.items())
                    + "); fewer steps and more repeats give more pairs for the paired ratio")
    ap.add_argument("--loss", choices=("model", "heavy"), default="model",
                    help="the model's own loss (cross-entropy) or loss code of many ops (see above)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's own; 1 is steadier on a shared machine)")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "overhead.json"))
    args = ap.parse_args(argv)
    if args.repeats < 7:
        print(f"note: {args.repeats} repeats (the target is measured with >= 7)")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")  # detect_anomaly announces itself
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} repeats, "
          f"variants interleaved in shuffled order, {args.loss} loss")
    all_results = {}
    for name in args.models:
        res = bench_model(name, args.repeats, args.variants, args.steps, args.loss)
        all_results[name] = res
        print(f"\n{name} ({args.steps or STEPS[name]} steps per timing)")
        print(f"  {'variant':11s} {'ms/step':>8s} {'IQR ms':>13s} {'ratio':>6s} {'paired ratio, IQR':>20s} "
              f"{'x floor':>7s} {'mean ratio':>10s} {'syncs/step':>10s}")
        for v in args.variants:
            r = res[v]
            syncs = "" if r["syncs_per_step"] is None else f"{r['syncs_per_step']:.2f}"
            print(f"  {v:11s} {r['median_s'] * 1e3:8.2f} {r['q1_s'] * 1e3:6.2f}-{r['q3_s'] * 1e3:<6.2f} "
                  f"{r['ratio']:6.3f} {r['paired_ratio']:8.3f} {r['paired_q1']:5.3f}-{r['paired_q3']:<5.3f} "
                  f"{r['over_floor']:7.2f} {r['mean_ratio']:10.3f} {syncs:>10s}")
        if "watch:nohyg" in res and "watch" in res:
            hyg = [t / u for t, u in zip(res["watch"]["times"], res["watch:nohyg"]["times"])]
            print(f"  hygiene checks: watch / watch:nohyg (paired median) = {statistics.median(hyg):.4f}")
        if "watch:notape" in res and "watch" in res:
            tape = [t / u for t, u in zip(res["watch"]["times"], res["watch:notape"]["times"])]
            q = statistics.quantiles(tape, n=4) if len(tape) >= 2 else [tape[0]] * 3
            print(f"  loss tape: watch / watch:notape (paired median) = {statistics.median(tape):.4f} "
                  f"(IQR {q[0]:.4f}-{q[2]:.4f})")
        if "item" in res and "watch" in res:
            wo = res["watch"]["paired_ratio"] - 1
            io = res["item"]["paired_ratio"] - 1
            print(f"  watch overhead / item-recipe overhead (paired): {wo / io:.2f}" if io > 0 else "")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(all_results, f, indent=1)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
