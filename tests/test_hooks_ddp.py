"""watch() under DistributedDataParallel: real processes, gloo, 127.0.0.1."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import _watch_ddp_worker as worker
from _dist import spawn


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("watch_ddp")
    return spawn(worker.main, 2, lambda r, port: (r, 2, port, str(out)), lambda r: out / f"rank{r}.json", timeout=150)


@pytest.mark.timeout(240)
def test_statistics_are_of_the_all_reduced_gradient(ddp_results):
    r0, r1 = ddp_results[0], ddp_results[1]
    assert r0["names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]  # no 'module.' prefix
    assert r0["norms"] == r1["norms"]  # identical on every rank
    # and equal to the gradient of the mean loss over both ranks' data, computed here
    model = worker._model()
    x = torch.cat([worker._data(0)[0], worker._data(1)[0]])
    y = torch.cat([worker._data(0)[1], worker._data(1)[1]])
    losses = [nn.functional.mse_loss(model(x[:6]), y[:6]), nn.functional.mse_loss(model(x[6:]), y[6:])]
    ((losses[0] + losses[1]) / 2).backward()
    for name, norm in zip(r0["names"], r0["norms"]):
        assert norm == pytest.approx(dict(model.named_parameters())[name].grad.norm().item(), rel=1e-5)
    assert r0["anomalies_ok"] == [] and r0["meta"] == {"world_size": 2, "rank": 0}


@pytest.mark.timeout(240)
def test_ddp_check_every_records_a_mismatch_on_every_rank(ddp_results):
    for r in (0, 1):
        kinds = [k for k, _ in ddp_results[r]["mismatch"]]
        assert kinds == ["ddp_mismatch"], ddp_results[r]["mismatch"]


@pytest.mark.timeout(240)
def test_skip_policy_decides_alike_on_every_rank(ddp_results):
    r0, r1 = ddp_results[0], ddp_results[1]
    assert r0["skip_steps"] == r1["skip_steps"] == [1]
    assert r0["weights"] == r1["weights"]
    assert all(math.isfinite(v) for p in r0["weights"] for v in p)


@pytest.mark.timeout(240)
def test_a_nan_on_one_rank_after_backward_stops_every_rank_at_the_same_step(ddp_results):
    for r in (0, 1):
        got = ddp_results[r]["edited"]
        assert got["step"] == 2, got
        assert "rank(s) 1" in got["message"], got["message"]


@pytest.mark.timeout(240)
def test_the_replica_check_is_on_by_default_and_names_what_happened(ddp_results):
    """Issue 24: with watch()'s defaults the desync bugs users reported are found at the
    first step, on every rank, naming the parameter and the probable cause; plain DDP is
    silent."""
    for r in (0, 1):
        found = ddp_results[r]["defaults"]
        assert found["healthy"] == [], found["healthy"]
        for bug in ("unwrapped", "replaced", "lost_allreduce"):
            kinds = [(k, step) for k, step, _, _ in found[bug]]
            assert kinds == [("ddp_mismatch", 0)], (bug, found[bug])
        assert found["replaced"][0][2].startswith("2.")  # the replaced layer is named
        for bug in ("unwrapped", "lost_allreduce"):  # what probably happened, in the message
            assert "a model not wrapped in DDP on every rank" in found[bug][0][3]
            assert "communication that lost or corrupted data" in found[bug][0][3]


@pytest.mark.timeout(240)
def test_the_replica_check_through_the_compiled_fingerprint_kernel(ddp_results):
    """Issue 24: with the fused (compiled) fingerprint kernel, a square weight transposed on
    one rank is found at the next step on every rank; the healthy twin is silent."""
    for r in (0, 1):
        got = ddp_results[r]["compiled"]
        assert got["kernel"] == "compiled", got["kernel"]
        assert got["healthy"] == [], got["healthy"]
        assert [tuple(a) for a in got["transposed"]] == [("ddp_mismatch", 2, "2.weight")], got["transposed"]


@pytest.mark.timeout(240)
def test_replicas_are_compared_at_every_recorded_step(ddp_results):
    """Issue 31: a hash of the reduced gradient norms, compared across the replicas at every
    recorded step (16 bytes), finds a drift at the step it starts and the full check names
    the parameter then; eight healthy steps stay silent."""
    for r in (0, 1):
        drift = ddp_results[r]["drift"]
        assert drift["healthy"] == [], drift["healthy"]
        assert [tuple(a) for a in drift["at5"]] == [("ddp_mismatch", 5, "0.weight")], drift["at5"]
