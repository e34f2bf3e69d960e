"""Step-time overhead of graddbg.watch on a 2-rank FSDP2 (``fully_shard``) model, against the
unwatched step and against the least such a watch can do, measured side by side.

gloo, 2 spawned ranks on 127.0.0.1, 1 torch thread per rank by default. Each rank holds
one copy of the model per variant (same initial weights, each sharded by ``fully_shard``:
every encoder layer, then the root), and the variants run interleaved, in the same shuffled
order on both ranks each repeat:

- bare:       forward, backward (FSDP's reduce-scatter), optimizer step, zero_grad
- floor:      bare + the least a watch of the full gradients can do: one local read of the
              gradient shards (one ``torch._foreach_norm`` over them) plus one small
              all_gather of a table of 12 bytes per parameter (3 float32), read to the host
- watch:      bare under graddbg.watch(model, opt) with the defaults (every step: norm,
              absmax, non-finite check; explode detector)
- watch:norm: graddbg.watch(stats=("norm",)): norms and the non-finite check, no absmax

Each timing of n steps starts after one untimed step of the same variant (bringing its
copy back into the caches, a cost of the interleaving that training does not pay) and a
barrier, and ends with a barrier, so it is the wall time of the slower rank. Rank 0
prints medians and spread (IQR) per step, the paired ratio to bare (the median over
repeats of each repeat's time over the bare time of the same repeat), the overhead as a
multiple of the floor's overhead (target: watch <= 1.5x), and the bytes each recorded step
of the watch sends per rank in its all_gathers (counted at ``graddbg.stats``' collectives,
see `_Gathers`, over the steps; per parameter: about 8 with absmax, 4 without), not the
gradients, and its exact re-reads (gathers beyond one per recorded step).

    .venv/bin/python bench/fsdp_watch.py                  # transformer_small and launchbound
    .venv/bin/python bench/fsdp_watch.py --models transformer4 --repeats 9 --steps 2
    .venv/bin/python bench/fsdp_watch.py --models launchbound --repeats 5 --steps 5
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
import socket
import statistics
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORLD = 2
VARIANTS = ("bare", "floor", "watch", "watch:norm")
CLOCKS = ("wall", "cpu")
STEPS = {"transformer_small": 10, "launchbound": 10, "transformer4": 2, "mlp8m": 3}


def transformer_small():
    """bench/_models.py's transformer at d=64, vocab 256, sequence 32, batch 8: the same 51
    parameter tensors as transformer4, a step short enough that the watch's cost shows."""
    import torch.nn.functional as F
    import _models

    model = _models.Transformer(4, d=64, vocab=256)
    x, y = torch.randint(0, 256, (8, 32)), torch.randint(0, 256, (8, 32))
    return model, (lambda: (x, y)), (lambda out, y: F.cross_entropy(out.reshape(-1, 256), y.reshape(-1)))


def _problem(name):
    import _models

    return transformer_small() if name == "transformer_small" else _models.MODELS[name]()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shard(model: torch.nn.Module) -> torch.nn.Module:
    """fully_shard every encoder layer (transformer4), then the root."""
    from torch.distributed.fsdp import fully_shard

    encoder = getattr(model, "encoder", None)
    for layer in getattr(encoder, "layers", []):
        fully_shard(layer)
    fully_shard(model)
    return model


class _Gathers:
    """Counts the all-gathers graddbg's statistics make (calls and bytes this rank sends),
    by wrapping the collective runner that graddbg.stats calls, while a variant steps."""

    def __init__(self) -> None:
        import graddbg.stats as stats

        self.calls, self.bytes, self.on = 0, 0, False
        inner = stats.run_collective

        def counted(fn, *args, **kw):
            if self.on and fn is dist.all_gather:
                self.calls += 1
                self.bytes += args[1].numel() * args[1].element_size()
            return inner(fn, *args, **kw)

        stats.run_collective = counted


GATHERS = None


class Variant:
    def __init__(self, name, model, batch, loss_fn):
        import graddbg

        self.name, self.model, self.batch, self.loss_fn = name, _shard(model), batch, loss_fn
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4, momentum=0.9)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.ctx = None
        if name == "watch":
            self.ctx = graddbg.watch(self.model, self.opt)
        elif name == "watch:norm":
            self.ctx = graddbg.watch(self.model, self.opt, stats=("norm",))
        self.times, self.steps = {clock: [] for clock in CLOCKS}, 0
        self.calls, self.sent = 0, 0     # the watch's all_gathers and the bytes this rank sent

    def step(self):
        global GATHERS
        if GATHERS is None:
            GATHERS = _Gathers()
        calls, sent = GATHERS.calls, GATHERS.bytes
        GATHERS.on = self.ctx is not None   # (the floor's own all_gather is not the watch's)
        try:
            x, y = self.batch
            self.loss_fn(self.model(x), y).backward()
            if self.name == "floor":
                _floor([p.grad for p in self.params])
            self.opt.step()
            self.opt.zero_grad()
        finally:
            GATHERS.on = False
        self.calls += GATHERS.calls - calls
        self.sent += GATHERS.bytes - sent
        self.steps += 1

    def bytes_per_step(self):
        """Bytes this rank sent in the watch's all_gathers, per recorded step."""
        if self.ctx is None:
            return None
        return self.sent / self.steps

    def rescues_per_step(self):
        """The watch's exact re-reads per step (tiny or non-finite norms: one more gather)."""
        return None if self.ctx is None else (self.calls - self.steps) / self.steps

    def close(self):
        if self.ctx is not None:
            self.ctx.close()


def _floor(grads):
    """One local read of the gradient shards, one all_gather of 12 bytes per parameter,
    one read of the gathered table to the host."""
    norms = torch._foreach_norm([g.to_local() for g in grads])
    table = torch.stack(norms).float()[:, None].expand(-1, 3).contiguous()
    out = [torch.empty_like(table) for _ in range(dist.get_world_size())]
    dist.all_gather(out, table)
    return torch.stack(out).tolist()


def _time(v: Variant, n: int) -> None:
    """n steps after an untimed one: the wall time (between barriers: the slower rank's)
    and the CPU time of both ranks' processes together, per step."""
    v.step()  # untimed (see the docstring)
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        v.step()
    cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
    dist.barrier()
    v.times["wall"].append((time.perf_counter() - t0) / n)
    dist.all_reduce(cpu)
    v.times["cpu"].append(cpu.item() / n)


def bench_model(name, repeats, steps):
    torch.manual_seed(0)
    model, make_batch, loss_fn = _problem(name)
    torch.manual_seed(1 + dist.get_rank())  # each rank its own batch, as data parallelism has it
    _, make_batch, _ = _problem(name)
    vs = [Variant(v, copy.deepcopy(model), make_batch(), loss_fn) for v in VARIANTS]
    for v in vs:  # warm-up
        for _ in range(2):
            v.step()
    order, rng = list(vs), random.Random(0)  # the same order on every rank
    for _ in range(repeats):
        rng.shuffle(order)
        for v in order:
            _time(v, steps)
    result = {"params": len(vs[0].params)}
    for v in vs:
        result[v.name] = {clock: _summary(v.times[clock], vs[0].times[clock]) for clock in CLOCKS}
        result[v.name].update(bytes_per_step=v.bytes_per_step(), rescues_per_step=v.rescues_per_step())
        v.close()
    for clock in CLOCKS:
        floor_over = result["floor"][clock]["paired_ratio"] - 1
        for v in VARIANTS:
            r = result[v][clock]
            r["over_floor"] = (r["paired_ratio"] - 1) / floor_over if floor_over > 0 else float("nan")
    return result


def _summary(times, bare_times):
    """Median and IQR of the times per step, and paired against bare's of the same repeat:
    the median ratio (with IQR) and the median difference."""
    med = statistics.median(times)
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [med] * 3
    paired = [t / b for t, b in zip(times, bare_times)]
    pq = statistics.quantiles(paired, n=4) if len(paired) >= 2 else [paired[0]] * 3
    extra = statistics.median([t - b for t, b in zip(times, bare_times)])
    return {"median_s": med, "q1_s": q[0], "q3_s": q[2], "paired_ratio": statistics.median(paired),
            "paired_q1": pq[0], "paired_q3": pq[2], "extra_s": extra}


def _print(name, steps, res):
    P = res["params"]
    print(f"\n{name} ({P} parameter tensors, {steps} steps per timing)")
    for clock, what in (("wall", "wall time per step (the slower rank)"),
                        ("cpu", "CPU time per step (both ranks' processes together)")):
        print(f"  {what}")
        print(f"    {'variant':11s} {'ms/step':>8s} {'IQR ms':>15s} {'paired ratio, IQR':>20s} {'+ms':>7s} "
              f"{'x floor':>7s}")
        for v in VARIANTS:
            r = res[v][clock]
            print(f"    {v:11s} {r['median_s'] * 1e3:8.2f} {r['q1_s'] * 1e3:7.2f}-{r['q3_s'] * 1e3:<7.2f} "
                  f"{r['paired_ratio']:8.3f} {r['paired_q1']:5.3f}-{r['paired_q3']:<5.3f} "
                  f"{r['extra_s'] * 1e3:7.2f} {r['over_floor']:7.2f}")
        w, f = res["watch"][clock], res["floor"][clock]
        print(f"    watched/bare {w['paired_ratio']:.3f}, floor/bare {f['paired_ratio']:.3f}, "
              f"watch overhead / floor overhead {w['over_floor']:.2f} (target <= 1.5)")
    print(f"  sent per recorded step, per rank (all_gather): floor {12 * P} B (12.0 B/parameter)")
    for v in ("watch", "watch:norm"):
        b, resc = res[v]["bytes_per_step"], res[v]["rescues_per_step"]
        print(f"    {v:11s} {b:.0f} B ({b / P:.1f} B/parameter); exact re-reads (tiny or non-finite "
              f"norms, one more gather each) per step: {resc:.2f}")


def _rank(rank, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    try:
        if rank == 0:
            print(f"torch {torch.__version__}, {WORLD} ranks (gloo, 127.0.0.1), {args.threads} thread(s) "
                  f"per rank, {args.repeats} repeats, variants interleaved in shuffled order", flush=True)
        results = {}
        for name in args.models:
            steps = args.steps or STEPS[name]
            results[name] = bench_model(name, args.repeats, steps)
            if rank == 0:
                _print(name, steps, results[name])
                sys.stdout.flush()
        if rank == 0 and out:
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with open(out, "w") as f:
                json.dump(results, f, indent=1)
            print(f"\nwrote {out}")
    finally:
        dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["transformer_small", "launchbound"], choices=list(STEPS))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per timing (default per model: " + ", ".join(f"{k} {v}" for k, v in STEPS.items()) + ")")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds before the ranks are killed")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "fsdp_watch.json"))
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, args, args.json), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    for p in procs:
        p.join(timeout=max(deadline - time.monotonic(), 1))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    codes = [p.exitcode for p in procs]
    if any(c != 0 for c in codes):
        raise SystemExit(f"a rank failed or hung: exit codes {codes}")


if __name__ == "__main__":
    main()
