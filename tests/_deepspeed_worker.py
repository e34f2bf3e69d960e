"""Spawned by tests/test_deepspeed.py: one 2-rank gloo world on 127.0.0.1 that runs every
case (ZeRO stage, dtype, accumulation, clipping, how the watch is given the engine) and
writes, per case, the watch's table beside ``deepspeed.utils.safe_get_full_grad``'s norms
read at the same moment (after the boundary's backward, before ``engine.step()``)."""
from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from datetime import timedelta

import torch

STEPS = 3


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    # 96 + 16 + 64 + 4 = 180 elements: ZeRO's 2 partitions split the first weight
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)


def _config(stage: int, bf16: bool, gas: int, clip: float, fp16: bool = False, scale_power: int = 8) -> dict:
    return {"fp16": {"enabled": fp16, "initial_scale_power": scale_power},"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas, "steps_per_print": 10 ** 6,
            "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}, "gradient_clipping": clip,
            "wall_clock_breakdown": False}


def _batch(rank: int, micro: int, dtype: torch.dtype, nan: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + micro)
    x = torch.randn(4, 6, generator=g) * 3
    if nan:
        x[0, 0] = float("nan")
    return x.to(dtype)


def run_case(stage: int, bf16: bool = False, gas: int = 1, clip: float = 0.0, form: str = "engine",
             nan_at: int = -1, fp16: bool = False, partitioned: bool = False, nan_rank: int = 1,
             nan_how: str = "input", scale_power: int = 8) -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    import graddbg
    import graddbg._model

    rank = torch.distributed.get_rank()
    dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
    model = _model(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = _config(stage, bf16, gas, clip, fp16, scale_power)
    if partitioned:  # (by default ZeRO-3 keeps small parameters whole on every rank)
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    target = (engine,) if form == "engine" else (model, opt)
    from graddbg._deepspeed import _engine_of

    found_by_search = form == "pair" and _engine_of(model, opt) is engine
    rec: dict = {"ref": {}, "ds_norm": {}, "anomalies": [], "raised": None, "ds_scale": {}}
    micro, t0 = 0, time.perf_counter()
    try:
        with graddbg.watch(*target, explode=None) as w:
            for step in range(STEPS):
                for _ in range(gas):
                    here = step == nan_at and rank == nan_rank
                    x = _batch(rank, micro, dtype, nan=here and nan_how == "input").to(engine.device)
                    micro += 1
                    out = engine(x).float()
                    loss = out.pow(2).mean()
                    if here and nan_how == "backward":  # a finite loss whose gradient is NaN: d sqrt(0) * 0
                        loss = loss + torch.sqrt(out[0, 0] * 0)
                    engine.backward(loss)
                    if here and nan_how == "planted":  # into this rank's reduced partition, by hand
                        _plant_nan(engine)
                    if engine.is_gradient_accumulation_boundary():
                        rec["ref"][step] = {n: float(safe_get_full_grad(p).float().norm())
                                            for n, p in engine.module.named_parameters()}
                        if fp16:  # (safe_get_full_grad's fp16 gradients still carry the loss scale)
                            rec["ds_scale"][step] = float(engine.optimizer.cur_scale)
                    engine.step()
                rec["ds_norm"][step] = float(engine.get_global_grad_norm() or float("nan"))
    except graddbg.NonFiniteError as err:
        rec["raised"] = {"step": err.anomaly.step, "text": str(err)}
    rec["seconds"] = time.perf_counter() - t0
    rec["restored"] = "step" not in vars(engine) and w.anomalies is not None  # the step hook is gone
    df = w.stats
    rec["norms"] = {int(s): dict(zip(g["name"], g["norm"])) for s, g in df.groupby("step")}
    rec["absmax"] = {int(s): dict(zip(g["name"], g["absmax"])) for s, g in df.groupby("step")}
    rec["global"] = [float(v) for v in w.steps["global_norm"]]
    rec["overflow"] = [bool(v) for v in w.steps["overflow"]]
    rec["scale"] = [float(v) for v in w.steps["scale"]]
    rec["ds_skipped"] = int(engine.skipped_steps)
    rec["names"] = list(dict.fromkeys(df["name"]))
    rec["anomalies"] = [(a.kind, a.step, a.name, a.message) for a in w.anomalies]
    rec["meta"] = w.meta.get("deepspeed")
    rec["unwrapped"] = graddbg._model.unwrap(engine) is model
    rec["found_by_search"] = found_by_search
    rec["local_numel"] = [p.numel() for p in model.parameters()]
    engine.destroy() if hasattr(engine, "destroy") else None
    return rec


def _plant_nan(engine) -> None:
    """A NaN written into this rank's piece of the first weight's reduced gradient."""
    from graddbg._deepspeed import Zero

    piece = Zero(engine).pieces(list(engine.module.parameters()))[0]
    piece.view(-1)[:1].fill_(float("nan"))


CASES = {
    "z0": dict(stage=0), "z1": dict(stage=1), "z2": dict(stage=2), "z3": dict(stage=3),
    "z0_bf16": dict(stage=0, bf16=True), "z2_bf16": dict(stage=2, bf16=True), "z3_bf16": dict(stage=3, bf16=True),
    "z1_gas_clip": dict(stage=1, gas=2, clip=0.05), "z2_gas_clip": dict(stage=2, gas=3, clip=0.05),
    "z3_gas_clip": dict(stage=3, gas=2, clip=0.05), "z3_part": dict(stage=3, gas=2, partitioned=True), "z0_clip": dict(stage=0, clip=0.05),
    "z2_pair": dict(stage=2, form="pair"), "z3_pair": dict(stage=3, form="pair"), "z0_pair": dict(stage=0, form="pair"),
    "z2_nan": dict(stage=2, nan_at=1), "z0_nan": dict(stage=0, nan_at=1), "z3_nan": dict(stage=3, nan_at=1),
    "z1_nan": dict(stage=1, nan_at=1),
    "z1_nan0": dict(stage=1, nan_at=1, nan_rank=0), "z2_nan0": dict(stage=2, nan_at=1, nan_rank=0),
    "z3_nan0": dict(stage=3, nan_at=1, nan_rank=0),
    "z1_fp16": dict(stage=1, fp16=True), "z2_fp16": dict(stage=2, fp16=True, gas=2, clip=0.05),
    "z2_fp16_overflow": dict(stage=2, fp16=True, scale_power=32),
    "z2_nan_bw": dict(stage=2, nan_at=1, nan_how="backward"), "z2_nan_planted": dict(stage=2, nan_at=1, nan_how="planted"),
}


@contextlib.contextmanager
def _cpu_fp16():
    """DeepSpeed's CPU accelerator refuses fp16 unless oneDNN has fp16 kernels: told that it
    has, so that its real fp16 optimizer and dynamic loss scaler run (torch computes fp16 on
    the CPU, slowly). Put back after."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    acc.is_fp16_supported = lambda: True
    try:
        yield
    finally:
        del acc.is_fp16_supported


def main(rank: int, world: int, port: int, out: str, cases: list, extensions: str = "") -> None:
    """``extensions``: where DeepSpeed builds (once) and loads its CPU ops (TORCH_EXTENSIONS_DIR)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world), DS_ACCELERATOR="cpu")
    if extensions:
        os.environ["TORCH_EXTENSIONS_DIR"] = extensions
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60))
    record: dict = {}
    try:
        for case in cases:
            if case == "trainer":
                record[case] = run_trainer(out)
            elif case == "accelerate":
                record[case] = run_accelerate()
            elif case.startswith("verify"):
                record[case] = run_verify(int(case[6]), case.endswith("p"))
            elif CASES[case].get("fp16"):
                with _cpu_fp16():
                    record[case] = run_case(**CASES[case])
            else:
                record[case] = run_case(**CASES[case])
    except BaseException:
        record = {"error": traceback.format_exc()}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    torch.distributed.destroy_process_group()


def main_cuda(rank: int, world: int, port: int, out: str) -> None:
    """One rank on one GPU (nccl): fp16 ZeRO-2 with DeepSpeed's CUDA accelerator, healthy
    (accumulation 2, clipping) and overflowing (a loss scale of 2**32)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world), DS_ACCELERATOR="cuda")
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl", timeout=timedelta(seconds=60))
    try:
        record = {case: run_case(**CASES[case]) for case in ("z2_fp16", "z2_fp16_overflow")}
    except BaseException:
        record = {"error": traceback.format_exc()}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    torch.distributed.destroy_process_group()


def run_verify(stage: int, partitioned: bool = False) -> dict:
    """graddbg.ddp_verify's replica checks on a ZeRO engine: as trained, then with one
    weight changed on rank 1 only (stage 0-2: every rank holds the full weights)."""
    import deepspeed

    from graddbg import ddp_verify

    model = _model(torch.float32)
    config = _config(stage, False, 1, 0.0)
    if partitioned:  # (by default ZeRO-3 keeps small parameters whole on every rank)
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1),
                                      config=config)
    rank = torch.distributed.get_rank()
    engine.backward(engine(_batch(rank, 0, torch.float32)).pow(2).mean())
    engine.step()
    out: dict = {"local_numel": [p.numel() for p in engine.module.parameters()]}
    for label in ("same", "changed"):
        if label == "changed" and rank == 1:
            with torch.no_grad():
                next(engine.module.parameters()).view(-1)[:1].add_(1.0)
        for what, target in (("module", engine.module), ("engine", engine)):
            try:
                rep = ddp_verify.check_parameters(target, timeout=timedelta(seconds=30))
                out[f"{label}-{what}"] = {"ok": bool(rep.ok), "mismatches": len(rep.mismatches)}
            except Exception as err:  # noqa: BLE001 (recorded: the test reads it)
                out[f"{label}-{what}"] = {"error": f"{type(err).__name__}: {err}"[:400]}
    return out


class _LossModel(torch.nn.Module):
    """The worker's model, returning ``{"loss": ...}`` as the transformers Trainer expects."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _model(torch.float32)

    def forward(self, x, labels=None):
        return {"loss": self.net(x).pow(2).mean()}


def _table(w) -> dict:
    df = w.stats
    return {"norms": {int(s): dict(zip(g["name"], g["norm"])) for s, g in df.groupby("step")},
            "global": [float(v) for v in w.steps["global_norm"]], "meta": w.meta.get("deepspeed"),
            "anomalies": [(a.kind, a.step, a.message) for a in w.anomalies]}


def run_trainer(out: str) -> dict:
    """transformers.Trainer with a ZeRO-2 config and graddbg's TransformersCallback."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from graddbg.callbacks import TransformersCallback

    rank = torch.distributed.get_rank()
    data = [{"x": _batch(rank, i, torch.float32)[0]} for i in range(64)]
    norms: list = []

    class Log(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "grad_norm" in logs:
                norms.append(float(logs["grad_norm"]))

    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "zero_optimization": {"stage": 2}, "train_batch_size": "auto"}
    args = TrainingArguments(output_dir=os.path.join(out, "trainer"), per_device_train_batch_size=4, max_steps=3,
                             gradient_accumulation_steps=2, max_grad_norm=0.05, logging_steps=1, report_to=[],
                             save_strategy="no", deepspeed=ds, use_cpu=True, disable_tqdm=True)
    cb = TransformersCallback(explode=None)
    Trainer(model=_LossModel(), args=args, train_dataset=data, callbacks=[cb, Log()]).train()
    return dict(_table(cb.watch), trainer_grad_norm=norms)


def run_accelerate() -> dict:
    """accelerate with a DeepSpeed plugin (ZeRO-2, accumulation 2): watch(model, optimizer)
    with what accelerator.prepare returned."""
    from accelerate import Accelerator, DeepSpeedPlugin

    import graddbg

    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=2,
                                                                 gradient_clipping=0.05))
    net = _model(torch.float32)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    acc.deepspeed_plugin.deepspeed_config.update(train_micro_batch_size_per_gpu=4, train_batch_size=16)
    model, opt = acc.prepare(net, opt)
    rank, ds_norms = torch.distributed.get_rank(), []
    with graddbg.watch(model, opt, explode=None) as w:
        for i in range(6):
            with acc.accumulate(model):
                acc.backward(model(_batch(rank, i, torch.float32)).pow(2).mean())
                opt.step()
                opt.zero_grad()
            if acc.sync_gradients:
                ds_norms.append(float(model.get_global_grad_norm()))
    return dict(_table(w), ds_norms=ds_norms)
