"""A rank of the pipeline tests (tests/test_pipeline.py): torch.distributed.pipelining
stages watched on every rank, several layouts in one process group of 4 ranks.

Scenarios, in this order on every rank: "pp4" (4 uneven stages, GPipe), "dp2pp2" (2 x 2,
1F1B, each stage wrapped in DDP over its data-parallel group), "nan" (4 stages, 1F1B, a NaN
made in stage 2's backward at step 1), "uneven" (each rank a module of its own size, no
pipelining library: ranks that hold different parameters), "unwatched" (DDP, rank 3 not
watched: the others find out at the first step and go on with local statistics),
"interleaved" (dp 2 x pp 2, 4 stages, two per rank). With 8 ranks: "dp_tp_pp" (a 3-D mesh). Each
scenario's record (per rank) goes into the JSON the test reads."""
from __future__ import annotations

import os
import time
import warnings

import torch
from torch import nn

MB, N_MB = 2, 4          # micro-batch size, micro-batches per step
STEPS = 3


class Boom(nn.Module):
    """Identity forward; with ``on``, a NaN in the backward pass (sqrt at 0 times 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sqrt(x * 0.0) if self.on else x


def full_model() -> nn.Sequential:
    """The unsplit model (the same on every rank and in the test)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8),
                         nn.Tanh(), nn.Linear(8, 8), Boom(), nn.Tanh(), nn.Linear(8, 2))


#: the pieces of the unsplit model: 4 uneven stages (4, 2, 2, 2 parameters), or 2 (4, 6)
CUTS = {4: [(0, 3), (3, 5), (5, 8), (8, 10)], 2: [(0, 3), (3, 10)]}
WIDTH = {0: 4, 3: 16, 5: 8, 8: 8, 10: 2}   # features entering piece starting at index i


def data(replica: int, step: int):
    g = torch.Generator().manual_seed(100 * replica + step)
    return torch.randn(MB * N_MB, 4, generator=g), torch.randn(MB * N_MB, 2, generator=g)


def _pipeline_stage(mod: nn.Module, n: int, s: int, group):
    """Stage ``s`` of ``n`` (its piece of the unsplit model, wrapped or not, in ``mod``), with
    the static shapes of its input and output."""
    from torch.distributed.pipelining import PipelineStage

    a, b = CUTS[n][s]
    x = torch.randn(MB, WIDTH[a], requires_grad=s > 0)
    y = torch.randn(MB, WIDTH[b], requires_grad=True)
    return PipelineStage(mod, s, n, torch.device("cpu"), input_args=(x,), output_args=y, group=group)


def _stage(full: nn.Sequential, n: int, s: int, group, dp_group=None, fsdp_mesh=None):
    a, b = CUTS[n][s]
    part = full[a:b]
    mod = nn.parallel.DistributedDataParallel(part, process_group=dp_group) if dp_group is not None else part
    if fsdp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        mod = fully_shard(part, mesh=fsdp_mesh)
    return _pipeline_stage(mod, n, s, group), mod, part


def schedule_step(sched, stages, x, y) -> None:
    """One ``schedule.step`` as each rank makes it: the inputs where a stage of this rank's is
    the first, the targets where one is the last."""
    if any(s.is_first for s in stages):
        sched.step(x)
    elif any(s.is_last for s in stages):
        sched.step(target=y, losses=[])
    else:
        sched.step()


def _torchtitan_norm(mod: nn.Module, pp_group) -> float:
    """The global norm as torchtitan's clip computes it, in the same run: torch's
    ``get_total_norm`` of this rank's gradients (a DTensor's full norm over its mesh), its
    square summed over the pipeline group."""
    import torch.distributed as dist

    by_mesh = {}  # (torch's total norm takes DTensors of one mesh at a time: tp+dp and dp-only here)
    for p in mod.parameters():
        if p.grad is not None:
            by_mesh.setdefault(id(getattr(p.grad, "device_mesh", None)), []).append(p.grad)
    sq = torch.zeros((), dtype=torch.float64)
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        sq = sq + norm.detach().double().pow(2)
    dist.all_reduce(sq, group=pp_group)
    return float(sq.sqrt())


def _run(stage, schedule_cls, mod, replica: int, steps: int = STEPS, boom=None, edit=None, stages=None,
         after_step=None, **watch_kw):
    import graddbg

    loss = lambda out, tgt: nn.functional.mse_loss(out, tgt)  # noqa: E731
    sched = schedule_cls(stages or stage, n_microbatches=N_MB, loss_fn=loss)
    opt = torch.optim.SGD(mod.parameters(), lr=0.05)
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with graddbg.watch(mod, opt, nonfinite="record", **watch_kw) as w:
            for step in range(steps):
                if boom is not None:
                    boom.on = step == 1
                x, y = data(replica, step)
                opt.zero_grad()
                schedule_step(sched, stages or [stage], x, y)
                if edit is not None and step == 1:
                    edit()
                if step == 0:
                    theirs = _torchtitan_norm(mod, stage.group)
                opt.step()
                if after_step is not None and step == 1:
                    after_step()
    st = w.stats
    first = st[st.step == 0]
    return {"names": list(first["name"]), "norms": [float(v) for v in first["norm"]],
            "stages": [int(v) for v in first["stage"]] if "stage" in first else None,
            "global": [float(v) for v in w.steps["global_norm"]], "meta": {k: w.meta.get(k) for k in (
                "layout", "stage", "num_stages", "pp_size", "dp_size", "rank", "stage_mesh")},
            "anomalies": [(a.step, a.kind, a.name, a.message) for a in w.anomalies],
            "warnings": [str(c.message) for c in caught if "graddbg" in str(c.message)],
            "seconds": time.monotonic() - t0, "torch_norm": theirs}


def pp4(rank: int) -> dict:
    from torch.distributed.pipelining import ScheduleGPipe

    stage, mod, _ = _stage(full_model(), 4, rank, None)
    return _run(stage, ScheduleGPipe, mod, 0)


def dp2pp2(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp, pp = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    stage, mod, _ = _stage(full_model(), 2, pp, mesh["pp"].get_group(), mesh["dp"].get_group())
    out = _run(stage, Schedule1F1B, mod, dp)
    out["dp"], out["pp"] = dp, pp
    return out


class Poison(nn.Module):
    """Identity forward; with ``on``, a NaN made in the forward pass (the log of a negative)."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.log(-1.0 - x.abs()) if self.on else x


def _dp2pp2_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    return mesh, mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()


def dp2pp2_forward_nan(rank: int) -> dict:
    """dp 2 x pp 2 (1F1B, DDP per stage): a NaN made in stage 1's forward pass at step 1:
    every rank must name stage 1, none its own module."""
    from torch.distributed.pipelining import Schedule1F1B

    mesh, dp, pp = _dp2pp2_mesh()
    full = full_model()
    full[7] = Poison()
    stage, mod, _ = _stage(full, 2, pp, mesh["pp"].get_group(), mesh["dp"].get_group())
    out = _run(stage, Schedule1F1B, mod, dp, boom=full[7])
    out["dp"], out["pp"] = dp, pp
    return out


def dp2pp2_drift_raise(rank: int) -> dict:
    """dp 2 x pp 2 (1F1B, DDP per stage), under the default policy ("raise") with the replica
    check every step: rank 2 (stage 0, replica 1) edits a weight after step 1: every rank of
    both stages must stop at step 2 (stage 1's ranks would otherwise go on into step 3 and
    wait forever in the schedule's receive)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B

    import graddbg

    mesh, dp, pp = _dp2pp2_mesh()
    out = {"dp": dp, "pp": pp}
    full = full_model()
    stage, mod, part = _stage(full, 2, pp, mesh["pp"].get_group(), mesh["dp"].get_group())
    sched = Schedule1F1B(stage, n_microbatches=N_MB, loss_fn=lambda o, t: nn.functional.mse_loss(o, t))
    opt = torch.optim.SGD(mod.parameters(), lr=0.05)
    stopped = None
    try:
        with graddbg.watch(mod, opt, ddp_check_every=1):
            for step in range(STEPS + 1):
                x, y = data(dp, step)
                opt.zero_grad()
                schedule_step(sched, [stage], x, y)
                opt.step()
                if step == 1 and rank == 2:
                    with torch.no_grad():
                        next(part.parameters()).view(-1)[0] += 1e-3
    except graddbg.GradientAnomalyError as err:
        stopped = (err.anomaly.step, err.anomaly.kind, err.anomaly.message)
    dist.barrier()  # (every rank is here: none is left inside a collective or a receive)
    out["stopped"] = stopped
    return out


def fsdp_pp(rank: int) -> dict:
    """dp 2 x pp 2 with FSDP2 over the dp dimension; at step 1 a NaN is written into one
    rank's shard of 0.weight's gradient after the schedule's backward, before the step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp, pp = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    stage, mod, part = _stage(full_model(), 2, pp, mesh["pp"].get_group(), fsdp_mesh=mesh["dp"])

    def edit():
        if dp == 1 and pp == 0:
            dict(part.named_parameters())["0.weight"].grad.to_local().view(-1)[0] = float("nan")

    out = _run(stage, Schedule1F1B, mod, dp, steps=2, edit=edit)
    out["dp"], out["pp"] = dp, pp
    return out


def nan(rank: int) -> dict:
    from torch.distributed.pipelining import Schedule1F1B

    full = full_model()
    stage, mod, _ = _stage(full, 4, rank, None)
    return _run(stage, Schedule1F1B, mod, 0, steps=2, boom=full[7])


def interleaved(rank: int) -> dict:
    """dp 2 x pp 2 with an interleaved 1F1B schedule: 4 stages, two on each rank (stage s on
    pipeline rank s % 2), each wrapped in DDP over its data-parallel group and watched
    together as one ``nn.ModuleList``; at step 1 a NaN is made in stage 2's backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp, pp = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    full = full_model()
    stages, parts = [], []
    for s in (pp, pp + 2):
        a, b = CUTS[4][s]
        part = nn.parallel.DistributedDataParallel(full[a:b], process_group=mesh["dp"].get_group())
        stages.append(_pipeline_stage(part, 4, s, mesh["pp"].get_group()))
        parts.append(part)
    mod = nn.ModuleList(parts)
    out = _run(stages[0], ScheduleInterleaved1F1B, mod, dp, steps=2, boom=full[7], stages=stages)
    out["dp"], out["pp"] = dp, pp
    return out


def dp_tp_pp(rank: int) -> dict:
    """dp 2 x tp 2 x pp 2 on a 3-D mesh (torchtitan's order: pp, dp, tp): each stage's
    Linear layers split over tp (column- then row-wise), FSDP2 over dp, 1F1B over pp. At
    step 1 a NaN is written into rank 5's shard of 6.weight's gradient after backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import Schedule1F1B
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    a, b = CUTS[2][pp]
    part = full_model()[a:b]
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()} if pp == 0 else \
        {"4": ColwiseParallel(), "6": RowwiseParallel()}
    parallelize_module(part, mesh["tp"], plan)
    fully_shard(part, mesh=mesh["dp"])
    stage = _pipeline_stage(part, 2, pp, mesh["pp"].get_group())

    def edit():
        if rank == 5:
            dict(part.named_parameters())["6.weight"].grad.to_local().view(-1)[0] = float("nan")

    out = _run(stage, Schedule1F1B, part, dp, steps=2, edit=edit)
    out["dp"], out["pp"] = dp, pp
    return out


def nan_raise(rank: int) -> dict:
    """4 stages (GPipe), the default non-finite policy ("raise"): a NaN made in stage 2 at
    step 1 stops every rank at that step, with no rank left waiting on another."""
    import graddbg
    from torch.distributed.pipelining import ScheduleGPipe

    full = full_model()
    stage, mod, _ = _stage(full, 4, rank, None)
    sched = ScheduleGPipe(stage, n_microbatches=N_MB, loss_fn=lambda o, t: nn.functional.mse_loss(o, t))
    opt = torch.optim.SGD(mod.parameters(), lr=0.05)
    t0, stopped = time.monotonic(), None
    try:
        with graddbg.watch(mod, opt):
            for step in range(STEPS):
                full[7].on = step == 1
                x, y = data(0, step)
                opt.zero_grad()
                schedule_step(sched, [stage], x, y)
                opt.step()
    except graddbg.GradientAnomalyError as err:
        stopped = (err.anomaly.step, err.anomaly.kind, type(err).__name__)
    import torch.distributed as dist

    dist.barrier()  # (every rank is here: none is left inside a collective)
    return {"stopped": stopped, "seconds": time.monotonic() - t0}


def hsdp_pp(rank: int) -> dict:
    """pp 2 x HSDP (replicate 2 x shard 2) on a 3-D mesh: FSDP2 over the 2-D (rep, shard)
    mesh of each stage; after step 1 rank 5 (stage 1, replica 0, shard 1) edits a weight
    of its shard, as a rank that drifted would; the replica check (every step here) runs
    within each stage only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import Schedule1F1B

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "rep", "shard"))
    pp, rep = mesh["pp"].get_local_rank(), mesh["rep"].get_local_rank()
    a, b = CUTS[2][pp]
    part = full_model()[a:b]
    fully_shard(part, mesh=mesh["rep", "shard"])
    stage = _pipeline_stage(part, 2, pp, mesh["pp"].get_group())

    def drift():
        if rank == 5:
            with torch.no_grad():
                dict(part.named_parameters())["6.weight"].to_local().view(-1)[0] += 1e-3

    out = _run(stage, Schedule1F1B, part, rep, after_step=drift, ddp_check_every=1)
    out["pp"] = pp
    return out


def mixed_meshes(rank: int) -> dict:
    """pp 2 on a ("pp", "dp", "tp") mesh of (2, 1, 2): stage 0's Linear layers split over tp
    and put under FSDP2 over dp (a 2-D mesh), stage 1 plain. Flattening stage 0's mesh would
    be a collective that stage 1's ranks never join: graddbg must not try."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import ScheduleGPipe
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    pp = mesh["pp"].get_local_rank()
    a, b = CUTS[2][pp]
    part = full_model()[a:b]
    if pp == 0:
        parallelize_module(part, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(part, mesh=mesh["dp"])
    stage = _pipeline_stage(part, 2, pp, mesh["pp"].get_group())
    out = _run(stage, ScheduleGPipe, part, 0, steps=2)
    out["pp"] = pp
    return out


def stepless(rank: int) -> dict:
    """4 stages (GPipe); rank 2 watches its stage without an optimizer (each of its backward
    passes, inside the schedule, is a step there: no exchange is safe): it tells its peers,
    and every rank goes on with local statistics at once."""
    import graddbg
    from torch.distributed.pipelining import ScheduleGPipe

    stage, mod, _ = _stage(full_model(), 4, rank, None)
    sched = ScheduleGPipe(stage, n_microbatches=N_MB, loss_fn=lambda o, t: nn.functional.mse_loss(o, t))
    opt = torch.optim.SGD(mod.parameters(), lr=0.05)
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with graddbg.watch(mod, None if rank == 2 else opt) as w:
            for step in range(STEPS):
                x, y = data(0, step)
                opt.zero_grad()
                schedule_step(sched, [stage], x, y)
                opt.step()
    return {"seconds": time.monotonic() - t0, "layout": w.meta.get("layout"), "steps": len(w.steps),
            "warnings": [str(c.message) for c in caught if "graddbg" in str(c.message)]}


def uneven(rank: int) -> dict:
    """Ranks holding different parameters (sizes differ) with no pipeline stage: the flag
    exchange must not mix sizes; a NaN on rank 2 is known to every rank at the same step."""
    import graddbg

    torch.manual_seed(rank)
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(rank + 1)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t0 = time.monotonic()
    own_sq = []
    with graddbg.watch(model, opt, nonfinite="record") as w:
        for step in range(STEPS):
            opt.zero_grad()
            model(torch.randn(2, 3)).pow(2).sum().backward()
            if rank == 2 and step == STEPS - 1:
                model[0].weight.grad[0, 0] = float("nan")
            own_sq.append(sum(float(p.grad.norm()) ** 2 for p in model.parameters()))
            opt.step()
    return {"global": [float(v) for v in w.steps["global_norm"]], "layout": w.meta.get("layout"),
            "anomalies": [(a.step, a.kind, a.name, a.message) for a in w.anomalies],
            "own_sq": own_sq, "seconds": time.monotonic() - t0}


def handmade(rank: int) -> dict:
    """A hand-written pipeline's parameters (no PipelineStage): dp 2 x pp 2, each rank a
    module of its pipeline rank's size, in DDP over its data-parallel group. After the
    backward pass of step 1, rank 3 (pp 1, dp 1) edits its reduced gradient: its replica,
    rank 1, holds another. The replica check compares the dp group only."""
    import graddbg
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp, pp = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    torch.manual_seed(pp)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(*[nn.Linear(3, 3) for _ in range(pp + 1)]),
                                                process_group=mesh["dp"].get_group())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    own_sq = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with graddbg.watch(model, opt, nonfinite="record") as w:
            for step in range(STEPS):
                opt.zero_grad()
                g = torch.Generator().manual_seed(10 * dp + step)
                model(torch.randn(2, 3, generator=g)).pow(2).sum().backward()
                if rank == 3 and step == 1:
                    with torch.no_grad():
                        model.module[0].weight.grad[0, 0] += 1e-3
                own_sq.append(sum(float(p.grad.norm()) ** 2 for p in model.parameters()))
                opt.step()
    return {"global": [float(v) for v in w.steps["global_norm"]], "meta": {k: w.meta.get(k) for k in (
                "layout", "dp_size")}, "anomalies": [(a.step, a.kind, a.name, a.message) for a in w.anomalies],
            "own_sq": own_sq, "pp": pp, "dp": dp,
            "warnings": [str(c.message) for c in caught if "graddbg" in str(c.message)]}


def unwatched(rank: int) -> dict:
    """Rank 3 trains the same DDP model without graddbg (as a worker a framework started
    itself): the watched ranks wait at most the check-in time, warn once, go on."""
    import graddbg

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t0 = time.monotonic()

    def train():
        for _ in range(STEPS):
            opt.zero_grad()
            model(torch.randn(3, 4)).pow(2).mean().backward()
            opt.step()

    if rank == 3:
        train()
        return {"seconds": time.monotonic() - t0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with graddbg.watch(model, opt) as w:
            train()
    return {"seconds": time.monotonic() - t0, "steps": len(w.steps), "layout": w.meta.get("layout"),
            "warnings": [str(c.message) for c in caught if "graddbg" in str(c.message)]}


def body(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for fn in (pp4, dp2pp2, dp2pp2_forward_nan, dp2pp2_drift_raise, fsdp_pp, interleaved, nan, nan_raise, mixed_meshes, stepless, uneven, handmade, unwatched) \
            if world == 4 \
            else (dp_tp_pp, hsdp_pp):
        out[fn.__name__] = fn(rank)
    return out


def main(rank: int, world: int, port: int, outdir: str) -> None:
    os.environ["GRADDBG_CHECKIN_SECONDS"] = "3"
    from _dist import run_rank

    run_rank(rank, world, port, os.path.join(outdir, f"rank{rank}.json"), lambda: body(rank, world))
