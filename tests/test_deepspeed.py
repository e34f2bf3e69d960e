"""watch() under DeepSpeed ZeRO (stages 0-3): real 2-rank gloo processes on 127.0.0.1 (CPU,
``DS_ACCELERATOR=cpu``), one spawned world shared by every case (tests/_deepspeed_worker.py).

Every rank's table holds the statistics of the full, reduced gradient: equal to
``deepspeed.utils.safe_get_full_grad``'s norms read at the same moment, pre-clip, one record
per optimizer step, the same on every rank; a NaN planted on one rank makes every rank raise
at the same step."""
from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import math
import os
import pathlib
import sys
import tempfile
import time

import pytest

import _deepspeed_worker as worker
from conftest import requires_cuda
from _dist import spawn

# (deepspeed is imported only in the spawned ranks: importing it here would change the
# process that runs the rest of the suite)
pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                 reason="deepspeed is not installed (pip install graddbg[dev])")]


def extensions_dir() -> pathlib.Path:
    """Where the ranks' DeepSpeed keeps the CPU op that ``deepspeed.init_distributed`` builds
    (deepspeed_shm_comm: 30-60 s of compiling on the 2-core machine, minutes under load):
    one folder per virtual environment under ~/.cache, so that it is built once, not again
    on every run. (torch's default, ~/.cache/torch_extensions/py311_cpu, is one folder for
    every environment: ninja rebuilds the op whenever the last build came from another
    checkout, whose include paths differ.) Keyed by the environment, the interpreter, torch
    and deepspeed; torch itself rebuilds in it when the op's sources or flags change."""
    key = "\n".join([os.path.realpath(sys.prefix), sys.version, importlib.metadata.version("torch"),
                     importlib.metadata.version("deepspeed")])
    name = hashlib.sha256(key.encode()).hexdigest()[:16]
    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    try:
        (cache / "graddbg-tests" / "torch_extensions").mkdir(parents=True, exist_ok=True)
    except OSError:  # (no writable home: the temporary folder's, per user)
        cache = pathlib.Path(tempfile.gettempdir()) / f"graddbg-tests-{os.getuid()}"
    return cache / "graddbg-tests" / "torch_extensions" / name


@contextlib.contextmanager
def holding(folder: pathlib.Path, wait: float = 120.0):
    """This session's hold on ``folder``: an flock, which the kernel drops when its holder
    ends, however it ends (waited for at most ``wait`` seconds: another session using the
    same environment). While it is held nobody else builds in the folder, so a ``lock``
    file that torch's build left there is stale (a run killed mid-build), and is removed:
    torch would wait on it forever."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "graddbg-tests.lock", "w") as f:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"{folder} stayed locked by another test session for {wait:g} s")
                time.sleep(0.2)
        try:
            for stale in folder.glob("*/lock"):
                stale.unlink(missing_ok=True)
            yield folder
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("deepspeed")
    cases = list(worker.CASES) + ["verify0", "verify1", "verify2", "verify3", "verify3p",
                                    "accelerate", "trainer"]
    # (ranks forked from tests/_dist's server, which has torch and graddbg but not deepspeed:
    # each rank imports deepspeed itself, with DS_ACCELERATOR=cpu)
    with holding(extensions_dir()) as ext:
        return spawn(worker.main, 2, lambda r, port: (r, 2, port, str(out), cases, str(ext)),
                     lambda r: out / f"rank{r}.json", timeout=240)


def _assert_tables_agree(world: dict, case: str, rel: float) -> None:
    r0, r1 = world[0][case], world[1][case]
    assert r0["unwrapped"]  # graddbg._model.unwrap(engine) is the user's model
    assert r0["restored"] and r1["restored"]  # engine.step is the engine's own again after the watch
    assert r0["meta"] == f"ZeRO stage {worker.CASES[case]['stage']}"
    assert r0["names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]  # the model's own names
    assert r0["norms"] == r1["norms"] and r0["absmax"] == r1["absmax"], "the ranks' tables differ"
    assert sorted(r0["norms"]) == [str(s) for s in range(worker.STEPS)]  # one record per optimizer step
    for rec in (r0, r1):
        for step, ref in rec["ref"].items():
            got = rec["norms"][step]
            for name, want in ref.items():
                assert got[name] == pytest.approx(want, rel=rel), (case, step, name)
            ds = rec["ds_norm"][step]  # DeepSpeed's own (pre-clip) global norm, where it keeps one
            if not math.isnan(ds):
                assert rec["global"][int(step)] == pytest.approx(ds, rel=rel)


@pytest.mark.parametrize("case", ["z0", "z1", "z2", "z3"])
def test_fp32_norms_equal_safe_get_full_grad_at_every_stage(world, case):
    _assert_tables_agree(world, case, 1e-5)


@pytest.mark.parametrize("case", ["z0_bf16", "z2_bf16", "z3_bf16"])
def test_bf16_norms_equal_safe_get_full_grad(world, case):
    _assert_tables_agree(world, case, 1e-5)


@pytest.mark.parametrize("case", ["z0_clip", "z1_gas_clip", "z2_gas_clip", "z3_gas_clip"])
def test_accumulation_and_clipping_record_the_pre_clip_gradient_once_per_step(world, case):
    _assert_tables_agree(world, case, 1e-5)
    rec = world[0][case]
    clip = worker.CASES[case]["clip"]
    assert all(g > 4 * clip for g in rec["global"])  # the clip really cut these steps


def test_zero3_partitioned_weights(world):
    """ZeRO-3 with every weight partitioned away (persistence threshold 0), accumulating 2."""
    _assert_tables_agree(world, "z3_part", 1e-5)
    assert world[0]["z3_part"]["local_numel"] == [0, 0, 0, 0]
    # the first step's batches and weights are those of z3_gas_clip (whose clip changes later steps)
    assert world[0]["z3_part"]["norms"]["0"] == pytest.approx(world[0]["z3_gas_clip"]["norms"]["0"], rel=1e-5)


@pytest.mark.parametrize("case", ["z0_pair", "z2_pair", "z3_pair"])
def test_watch_model_and_optimizer_given_to_initialize(world, case):
    _assert_tables_agree(world, case, 1e-5)
    assert world[0][case]["norms"] == world[0][case.replace("_pair", "")]["norms"]
    assert world[0][case]["found_by_search"]  # the fallback without the engine's hooks finds it too


@pytest.mark.parametrize("case, origin", [
    ("z0_nan", 1), ("z1_nan", 1), ("z2_nan", 1), ("z3_nan", 1), ("z1_nan0", 0), ("z2_nan0", 0), ("z3_nan0", 0)])
def test_nan_on_one_rank_raises_on_every_rank_at_the_same_step_naming_that_rank(world, case, origin):
    """A NaN input on one rank: after DeepSpeed's reduction every rank's partition holds the
    NaN; the rank it came from is named from each rank's own loss (kept before the reduction)."""
    for r in (0, 1):
        raised = world[r][case]["raised"]
        assert raised is not None, f"rank {r} did not raise"
        assert raised["step"] == 1
        assert f"on rank {r}" in raised["text"] and "shards were on rank(s) 0, 1" in raised["text"]
        assert f"first seen on rank(s) {origin} (its loss was non-finite" in raised["text"], raised["text"]
        assert sorted(world[r][case]["norms"]) == ["0", "1"]  # the good step was recorded


def test_nan_made_in_the_backward_pass_on_one_rank_is_named_from_its_output_gradient(world):
    """A finite loss whose gradient is NaN on rank 1 (d sqrt(0)): named from the gradient of
    rank 1's model output, which the watch reduces to one number on the device."""
    for r in (0, 1):
        raised = world[r]["z2_nan_bw"]["raised"]
        assert raised is not None and raised["step"] == 1
        assert "first seen on rank(s) 1 (the gradient of its model's output was non-finite" in raised["text"]


def test_nan_planted_in_a_reduced_partition_says_the_rank_is_unknown(world):
    """A NaN written by hand into rank 1's reduced partition: no rank's evidence shows it, so
    the origin is unknown (said, not guessed); the partition's rank is still named."""
    for r in (0, 1):
        raised = world[r]["z2_nan_planted"]["raised"]
        assert raised is not None and raised["step"] == 1
        assert "shards were on rank(s) 1." in raised["text"] and "first seen" not in raised["text"]
        assert "The rank where it started is unknown" in raised["text"]


@pytest.mark.parametrize("case", ["z1", "z2", "z3"])
def test_healthy_twins_of_the_nan_cases_find_nothing(world, case):
    for r in (0, 1):
        assert world[r][case]["raised"] is None and world[r][case]["anomalies"] == []


@pytest.mark.parametrize("case", ["z1_fp16", "z2_fp16"])
def test_fp16_norms_are_unscaled_and_equal_safe_get_full_grad_over_the_loss_scale(world, case):
    """fp16 with DeepSpeed's dynamic loss scaler (its CPU accelerator told that fp16 is
    supported): safe_get_full_grad gives the reduced fp16 gradients still scaled (x256 here);
    graddbg records them unscaled, and its global norm is DeepSpeed's own (unscaled) one."""
    for rec in (world[0][case], world[1][case]):
        assert rec["scale"] == [256.0] * worker.STEPS and not any(rec["overflow"]) and rec["ds_skipped"] == 0
        assert rec["anomalies"] == [] and rec["raised"] is None
        for step, ref in rec["ref"].items():
            scale = rec["ds_scale"][step]
            assert scale == 256.0
            for name, want in ref.items():
                assert rec["norms"][step][name] == pytest.approx(want / scale, rel=1e-4), (case, step, name)
            assert rec["global"][int(step)] == pytest.approx(rec["ds_norm"][step], rel=1e-4)
    assert world[0][case]["norms"] == world[1][case]["norms"]


def test_fp16_overflow_is_a_skipped_step_not_an_anomaly(world):
    """A loss scale of 2**32 overflows fp16 at every step: DeepSpeed skips each step (and
    lowers the scale); graddbg records each as an overflow step, with no anomaly and no
    exception although every gradient is non-finite."""
    for rec in (world[0]["z2_fp16_overflow"], world[1]["z2_fp16_overflow"]):
        assert rec["ds_skipped"] == worker.STEPS
        assert rec["overflow"] == [True] * worker.STEPS
        assert rec["scale"][0] == 2.0 ** 32 and rec["scale"][-1] < 2.0 ** 32  # lowered as DeepSpeed did
        assert rec["scale"] == [rec["ds_scale"][str(s)] for s in range(worker.STEPS)]
        assert rec["raised"] is None and rec["anomalies"] == [] and rec["norms"] == {}


@requires_cuda
def test_fp16_zero2_on_one_gpu(tmp_path):
    """fp16 ZeRO-2 on one GPU (one rank, nccl, DeepSpeed's CUDA accelerator, no patch):
    unscaled norms equal to safe_get_full_grad's over the loss scale; an overflow is a
    skipped step, not an anomaly."""
    rec = spawn(worker.main_cuda, 1, lambda r, port: (r, 1, port, str(tmp_path)), lambda r: tmp_path / f"rank{r}.json",
                timeout=240, fresh=True)[0]
    ok = rec["z2_fp16"]
    assert ok["meta"] == "ZeRO stage 2" and ok["anomalies"] == [] and not any(ok["overflow"])
    assert sorted(ok["norms"]) == [str(s) for s in range(worker.STEPS)]
    for step, ref in ok["ref"].items():
        for name, want in ref.items():
            assert ok["norms"][step][name] == pytest.approx(want / ok["ds_scale"][step], rel=1e-3), (step, name)
    over = rec["z2_fp16_overflow"]
    assert over["overflow"] == [True] * worker.STEPS and over["ds_skipped"] == worker.STEPS
    assert over["raised"] is None and over["anomalies"] == []


@pytest.mark.parametrize("case", ["verify0", "verify1", "verify2", "verify3"])
def test_replica_check_compares_full_weights_where_every_rank_holds_them(world, case):
    """Stages 0-2 (and ZeRO-3's small, persistent parameters) keep the whole weights on every
    rank: ddp_verify compares them, through the engine or its module, and names a change
    made on one rank only."""
    for r in (0, 1):
        rec = world[r][case]
        assert all(n > 0 for n in rec["local_numel"])
        for what in ("module", "engine"):
            assert rec[f"same-{what}"] == {"ok": True, "mismatches": 0}
            assert rec[f"changed-{what}"] == {"ok": False, "mismatches": 1}


def test_replica_check_on_zero3_partitions_says_there_is_nothing_to_compare(world):
    rec = world[0]["verify3p"]
    assert rec["local_numel"] == [0, 0, 0, 0]  # every weight partitioned away
    assert "error" in rec["same-module"] and "nothing to compare" in rec["same-module"]["error"]


def test_accelerate_with_a_deepspeed_plugin(world):
    """accelerate's DeepSpeedPlugin (ZeRO-2, accumulation 2, clipping): watch(model, optimizer)
    with what accelerator.prepare returned; the same batches as the z1_gas_clip case, so
    the same norms as safe_get_full_grad's there."""
    r0, r1 = world[0]["accelerate"], world[1]["accelerate"]
    assert r0["meta"] == "ZeRO stage 2" and r0["norms"] == r1["norms"] and not r0["anomalies"]
    ref = world[0]["z1_gas_clip"]["ref"]
    for step, want in ref.items():
        for name, v in want.items():
            assert r0["norms"][step][name] == pytest.approx(v, rel=1e-5)
    assert r0["global"] == pytest.approx(r0["ds_norms"], rel=1e-5)  # DeepSpeed's pre-clip global norm


def test_transformers_trainer_with_a_deepspeed_config_and_the_callback(world):
    """transformers.Trainer(args=TrainingArguments(deepspeed={ZeRO-2 ...}), callbacks=[
    TransformersCallback()]): one record per optimizer step (3 steps of 2 micro-batches), the
    same on both ranks, whose global norms are the Trainer's own logged (pre-clip) grad_norm."""
    r0, r1 = world[0]["trainer"], world[1]["trainer"]
    assert r0["meta"] == "ZeRO stage 2" and r0["norms"] == r1["norms"] and not r0["anomalies"]
    assert sorted(r0["norms"]) == ["0", "1", "2"]
    assert list(r0["norms"]["0"]) == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
    assert len(r0["trainer_grad_norm"]) == 3
    assert r0["global"] == pytest.approx(r0["trainer_grad_norm"], rel=1e-5)


def test_the_table_combines_partitions_in_quadrature_and_names_non_finite_ranks():
    """graddbg._deepspeed.gather_stats on a hand-made table of 2 ranks x 3 parameters."""
    import numpy as np

    from graddbg._deepspeed import gather_stats

    got = np.zeros((2, 3, 3), dtype=np.float32)
    got[0, 0], got[1, 0] = (3.0, 2.0, 1), (4.0, 5.0, 1)  # split over both ranks: norm 5, absmax 5
    got[0, 1] = (0.0, 0.0, 0); got[1, 1] = (2.0, 1.0, 1)  # held by rank 1 only
    got[0, 2] = (np.nan, np.nan, 1); got[1, 2] = (1.0, 1.0, 1)  # NaN in rank 0's piece
    st = gather_stats(got, absmax=True, div=2.0, ranks=[4, 5])
    assert st.norm[:2] == pytest.approx([2.5, 1.0]) and np.isnan(st.norm[2])
    assert st.absmax[:2] == pytest.approx([2.5, 0.5]) and np.isnan(st.absmax[2])
    assert st.has_grad.tolist() == [True, True, True]
    assert st.shard_ranks == {2: [4]}  # the global rank of group rank 0
