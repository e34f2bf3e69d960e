"""watch() on sharded models (FSDP2, HSDP, tensor parallel): real gloo processes on 127.0.0.1.

Every rank's table holds the statistics of the full, unsharded gradients, equal to
``p.grad.full_tensor()``'s and the same on every rank."""
from __future__ import annotations

import math

import pytest
import torch

import _sharded_worker as worker
from _dist import spawn


def _launch(case: str, world: int, out, target=None) -> dict:
    if target is None:
        return spawn(worker.main, world, lambda r, port: (case, r, world, port, str(out)),
                     lambda r: out / f"{case}-rank{r}.json")
    return spawn(target, world, lambda r, port: (r, world, port, str(out)), lambda r: out / f"{case}-rank{r}.json")


def _check_full_norms(results: dict, steps=(0, 1)) -> None:
    r0 = results[0]
    assert r0["names"] == r0["model_names"]  # the unsharded model's names
    for r, rec in results.items():
        assert rec["norms"] == r0["norms"], f"rank {r}'s table differs from rank 0's"
        for step in steps:
            for name, ref in rec["ref"][step].items():
                assert rec["norms"][str(step)][name] == pytest.approx(ref, rel=1e-5), (r, step, name)


@pytest.mark.timeout(300)
def test_fsdp2_two_ranks_full_norms_and_a_nan_shard_named_with_its_rank(tmp_path):
    results = _launch("fsdp", 2, tmp_path)
    _check_full_norms(results)
    for r, rec in results.items():
        assert all(v > 0 for v in rec["absmax"])
        assert all(u > 0 for u in rec["update"][:10])  # update ratios of the full weights
        (kind, step, name, text), = rec["anomalies"]
        assert (kind, step, name) == ("nonfinite", 2, "2.weight"), rec["anomalies"]
        assert "rank(s) 1" in text
        switched_off = [m for m in rec["warnings"] if "ddp_check_every is switched off" in m]
        assert len(switched_off) == 1 and "no replicas" in switched_off[0]
    _check_hand_edit(results)
    for r, rec in results.items():  # a NaN written into rank 1's shard of the weight: named so on every rank
        got = rec["weight_edited"]
        assert got["step"] == 2 and got["name"] == "2.weight", (r, got)
        assert "non-finite parameter 2.weight" in got["message"] and "on rank(s) 1 hold NaN/Inf" in got["message"]


def _check_hand_edit(results: dict) -> None:
    """A NaN written into rank 1's shard between backward and step: every rank raised at
    that step, naming rank 1 (issue 24 point 4, issue 27 point 3)."""
    for r, rec in results.items():
        got = rec["edited"]
        assert got["step"] == 1 and "rank(s) 1" in got["message"], (r, got)


@pytest.mark.timeout(300)
def test_hsdp_four_ranks_on_a_2x2_mesh(tmp_path):
    _check_full_norms(_launch("hsdp", 4, tmp_path))


@pytest.mark.timeout(300)
def test_tensor_parallel_two_ranks(tmp_path):
    results = _launch("tp", 2, tmp_path)
    _check_full_norms(results)
    _check_hand_edit(results)


@pytest.mark.timeout(300)
def test_mixed_sharded_and_plain_parameters(tmp_path):
    results = _launch("mixed", 2, tmp_path)
    r0 = results[0]
    assert r0["names"] == r0["model_names"]
    for step in ("0", "1", "2"):
        assert all(math.isfinite(v) and v > 0 for v in r0["norms"][step].values())


@pytest.mark.timeout(300)
def test_check_module_refuses_a_sharded_model_saying_what_to_pass(tmp_path):
    results = _launch("check", 2, tmp_path, target=worker.check_module_refuses)
    for rec in results.values():
        assert rec["raised"] is not None
        assert "sharded (DTensor) parameters" in rec["raised"] and "before sharding" in rec["raised"]


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: 2 GPUs")
@pytest.mark.timeout(300)
def test_fsdp2_cuda_nccl_on_two_gpus(tmp_path):
    results = spawn(worker.main_nccl, 2, lambda r, port: ("fsdp", r, 2, port, str(tmp_path)),
                    lambda r: tmp_path / f"fsdp-rank{r}.json")
    _check_full_norms(results)
    for rec in results.values():
        assert [(k, s, n) for k, s, n, _ in rec["anomalies"]] == [("nonfinite", 2, "2.weight")]
