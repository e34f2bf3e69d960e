"""Worker for tests/test_hooks_ddp.py: graddbg.watch on a real 2-rank gloo DDP world."""
from __future__ import annotations

import json
import os
import traceback
from datetime import timedelta

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _data(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def _nan_on_one_rank(model: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, at: int = 2) -> dict:
    """Train until graddbg raises; a NaN is written into rank 1's first gradient after the
    backward pass of step ``at``. Returns the step it raised at and the ranks it named."""
    import graddbg

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with graddbg.watch(model, opt, localise=False):
            for step in range(4):
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                if rank == 1 and step == at:
                    next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
                opt.step()
    except graddbg.NonFiniteError as e:
        dist.barrier()  # (every rank gets here: none is left in a collective)
        return {"step": e.anomaly.step, "message": e.anomaly.message}
    return {"step": None}


def _not_wrapped(rank: int) -> nn.Module:
    return _model()  # (DDP forgotten: each rank trains its own copy on its own data)


def _replaced_after_wrapping(rank: int) -> nn.Module:
    model = DDP(_model(), find_unused_parameters=True)  # (as the report's code: the old layer goes unused)
    torch.manual_seed(100 + rank)  # (pytorch issue 104336: a layer replaced after DDP wrapped the model)
    model.module[2] = nn.Linear(8, 2)
    return model


def _zeroing_comm_hook(rank: int) -> nn.Module:
    model = DDP(_model())

    def lose(state, bucket):  # (a link that silently zeroes part of an all-reduce on one rank)
        def finish(f):
            buf = f.value()[0].div_(dist.get_world_size())
            if dist.get_rank() == 1:
                buf[: buf.numel() // 2] = 0.0
            return buf

        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(finish)

    model.register_comm_hook(None, lose)
    return model


_DESYNC = {"healthy": lambda rank: DDP(_model()), "unwrapped": _not_wrapped,
           "replaced": _replaced_after_wrapping, "lost_allreduce": _zeroing_comm_hook}


def _default_watch(build, x: torch.Tensor, y: torch.Tensor, rank: int, steps: int = 3) -> list:
    """watch() with its defaults (ddp_check_every="auto"); the anomalies found."""
    import graddbg

    model = build(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with graddbg.watch(model, opt, nonfinite="record") as w:
        for _ in range(steps):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return [(a.kind, a.step, a.name, a.message) for a in w.anomalies]


def _through_the_compiled_kernel(x: torch.Tensor, y: torch.Tensor, rank: int) -> dict:
    import graddbg
    from graddbg import ddp_verify

    got = {"kernel": ddp_verify.set_fingerprint_kernel("compiled")}
    try:
        for case in ("healthy", "transposed"):
            torch.manual_seed(0)
            model = DDP(nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                                      nn.Linear(64, 2)))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with graddbg.watch(model, opt, ddp_check_every=1, nonfinite="record") as w:
                for step in range(3):
                    opt.zero_grad()
                    nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
                    if case == "transposed" and rank == 1 and step == 1:
                        with torch.no_grad():
                            model.module[2].weight.copy_(model.module[2].weight.t().clone())
            got[case] = [(a.kind, a.step, a.name) for a in w.anomalies]
    finally:
        ddp_verify.set_fingerprint_kernel("auto")
    return got


def _drift(x: torch.Tensor, y: torch.Tensor, rank: int, at: Optional[int], steps: int = 8) -> list:
    """watch()'s defaults over 8 steps; ``at``: from that step on, rank 1 doubles its first
    layer's reduced gradient before the step (a rank-local edit: the replicas drift apart from
    then on, long before the scheduled check at step 100)."""
    import graddbg

    torch.manual_seed(0)
    model = DDP(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with graddbg.watch(model, opt, nonfinite="record") as w:
        for step in range(steps):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if at is not None and step >= at and rank == 1:
                model.module[0].weight.grad.mul_(2.0)
            opt.step()
    return [(a.kind, a.step, a.name) for a in w.anomalies]


def main(rank: int, world: int, port: int, out: str) -> None:
    import graddbg

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    record = {}
    try:
        # 1. statistics are of the all-reduced gradient, the same on every rank
        model = DDP(_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = _data(rank)
        with graddbg.watch(model, opt, ddp_check_every=1) as w:
            nn.functional.mse_loss(model(x), y).backward()
            local = {n: p.grad.norm().item() for n, p in model.module.named_parameters()}
            opt.step()
        record["names"] = w.stats["name"].tolist()
        record["norms"] = w.stats["norm"].tolist()
        record["local"] = local
        record["anomalies_ok"] = [a.kind for a in w.anomalies]
        record["meta"] = {k: w.meta[k] for k in ("world_size", "rank")}

        # 2. a comm hook that corrupts one element on rank 1: ddp_mismatch on every rank
        model2 = DDP(_model())

        def corrupt(state, bucket):
            buf = bucket.buffer()
            if dist.get_rank() == 1:
                buf[0] += 1.0
            fut = torch.futures.Future()
            fut.set_result(buf)
            return fut

        model2.register_comm_hook(None, corrupt)
        opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
        with graddbg.watch(model2, opt2, ddp_check_every=1, nonfinite="record") as w2:
            nn.functional.mse_loss(model2(x), y).backward()
            opt2.step()
        record["mismatch"] = [(a.kind, a.name) for a in w2.anomalies]

        # 3. a NaN in rank 1's batch only: after the all-reduce every rank sees it, every
        #    rank skips the step alike, and the weights stay finite and equal
        model3 = DDP(_model())
        opt3 = torch.optim.SGD(model3.parameters(), lr=0.1)
        with graddbg.watch(model3, opt3, nonfinite="skip") as w3:
            for step in range(3):
                xb = x.clone()
                if rank == 1 and step == 1:
                    xb[0, 0] = float("nan")
                nn.functional.mse_loss(model3(xb), y).backward()
                opt3.step()
                opt3.zero_grad()
        record["skip_steps"] = [a.step for a in w3.anomalies]
        record["weights"] = [p.detach().flatten().tolist() for p in model3.module.parameters()]

        # 4. a NaN written into rank 1's gradient after backward (a hand edit): every rank
        #    raises at the same step, naming rank 1; no rank is left waiting in a collective
        record["edited"] = _nan_on_one_rank(DDP(_model()), x, y, rank)

        # 5. the replica check is on by default: the desync bugs users reported, each found
        #    with watch()'s defaults, and a healthy twin that reports nothing
        record["defaults"] = {name: _default_watch(build, x, y, rank) for name, build in _DESYNC.items()}

        # 6. the same check through the compiled fingerprint kernel (a model of 4-block
        #    weights): a square weight transposed on rank 1 after step 1 is found at step 2;
        #    its healthy twin is silent
        record["compiled"] = _through_the_compiled_kernel(x, y, rank)

        # 7. the replicas compared at every recorded step from the reduced norms (issue 31):
        #    a drift that starts at step 5 is found at step 5, not at step 100; 8 healthy steps
        #    are silent
        record["drift"] = {"healthy": _drift(x, y, rank, None), "at5": _drift(x, y, rank, 5)}
    except Exception:
        record["error"] = traceback.format_exc()
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(record, f)
        dist.destroy_process_group()
