"""Pipeline parallelism (torch.distributed.pipelining) watched on every rank, and layouts
that must never hang a job: real processes, gloo, 127.0.0.1 (tests/_pipeline_worker.py)."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import _pipeline_worker as worker
from _dist import spawn


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline")
    return spawn(worker.main, 4, lambda r, port: (r, 4, port, str(out)), lambda r: out / f"rank{r}.json", timeout=240)


def _unsplit(replicas):
    """Per-parameter gradient norms and the global norm of the unsplit model at step 0,
    the mean loss over the micro-batches of every data-parallel replica."""
    model = worker.full_model()
    xs, ys = zip(*[worker.data(r, 0) for r in replicas])
    nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
    norms = {n: p.grad.norm().item() for n, p in model.named_parameters()}
    return norms, math.sqrt(sum(v * v for v in norms.values()))


@pytest.mark.timeout(300)
def test_pp4_uneven_stages_global_norm_is_the_unsplit_models(runs):
    norms, total = _unsplit([0])
    for r in range(4):
        got = runs[r]["pp4"]
        assert got["meta"]["layout"] == "pipeline" and got["meta"]["stage"] == r and got["meta"]["num_stages"] == 4
        for name, norm in zip(got["names"], got["norms"]):  # the gradient the optimizer applies
            assert norm == pytest.approx(norms[name], rel=1e-5), (r, name)
        assert got["global"][0] == pytest.approx(total, rel=1e-6)
        assert got["global"][0] == pytest.approx(got["torch_norm"], rel=1e-6)  # torch's, in the same run
        assert got["global"] == runs[0]["pp4"]["global"]  # identical on every rank
        assert got["anomalies"] == [] and got["warnings"] == []
    assert sorted(n for r in range(4) for n in runs[r]["pp4"]["names"]) == sorted(norms)  # each once


@pytest.mark.timeout(300)
def test_dp2_x_pp2_with_ddp(runs):
    norms, total = _unsplit([0, 1])
    for r in range(4):
        got = runs[r]["dp2pp2"]
        assert got["meta"]["stage"] == got["pp"] and got["meta"]["dp_size"] == 2 and got["meta"]["pp_size"] == 2
        for name, norm in zip(got["names"], got["norms"]):
            assert norm == pytest.approx(norms[name], rel=1e-5), (r, name)
        assert got["global"][0] == pytest.approx(total, rel=1e-6)
        assert got["global"][0] == pytest.approx(got["torch_norm"], rel=1e-6)  # torch's, in the same run
        assert got["global"] == runs[0]["dp2pp2"]["global"]
        # the replica check compares the dp replicas only (same stage), never stages: silent
        assert got["anomalies"] == [] and got["warnings"] == []


@pytest.mark.timeout(300)
def test_a_nan_in_stage_2_is_blamed_there_and_every_rank_stops_at_that_step(runs):
    msgs = {r: runs[r]["nan"]["anomalies"] for r in range(4)}
    for r in range(4):
        assert [(s, k) for s, k, _, _ in msgs[r]] == [(1, "nonfinite")], msgs[r]
    made = msgs[2][0][3]
    assert "on rank 2" in made and "module '7'" in made and "op SqrtBackward0" in made, made  # module and op of stage 2
    assert "_pipeline_worker.py" in made, made
    assert "arrived non-finite from stage 2, rank 2" in msgs[1][0][3], msgs[1][0][3]
    assert "arrived non-finite from stage 1, rank 1" in msgs[0][0][3] and "started in stage 2, rank 2" in msgs[0][0][3]
    # stage 3's own gradients stay finite: it names stage 2, never a parameter of its own
    assert msgs[3][0][2] is None and "stage 2, rank 2" in msgs[3][0][3], msgs[3][0][3]
    for r in (0, 1, 2):  # each names only its own parameters
        assert msgs[r][0][2] in runs[r]["nan"]["names"], (r, msgs[r][0][2])


@pytest.mark.timeout(300)
def test_under_the_raise_policy_every_stage_stops_at_the_same_step(runs):
    for r in range(4):
        got = runs[r]["nan_raise"]
        assert got["stopped"] == [1, "nonfinite", "NonFiniteError"], (r, got)  # (a GradientAnomalyError)
        assert got["seconds"] < 60


@pytest.mark.timeout(300)
def test_a_mesh_only_some_stages_hold_is_never_flattened(runs):
    """Making a process group is a call every rank of the world makes, in the same order
    (a rank that makes one the others do not puts the groups made after it, the user's own,
    out of step across ranks): a stage on a 2-D mesh next to a plain stage must not flatten
    its mesh. The job finishes; stage 0 says once that it records its own shards; the plain
    stage's norms are the unsplit model's."""
    norms, _ = _unsplit([0])
    for r in range(4):
        got = runs[r]["mixed_meshes"]
        assert got["seconds"] < 60 and got["anomalies"] == []
        if got["pp"] == 0:
            assert len(got["warnings"]) == 1 and "its own shards" in got["warnings"][0], got["warnings"]
        else:
            assert got["warnings"] == []
            for name, norm in zip(got["names"], got["norms"]):
                assert norm == pytest.approx(norms[name], rel=1e-5), (r, name)


@pytest.mark.timeout(300)
def test_a_stage_watched_without_an_optimizer_never_leaves_its_peers_waiting(runs):
    for r in range(4):
        got = runs[r]["stepless"]
        assert got["seconds"] < 30, got["seconds"]
        assert len(got["warnings"]) == 1, got["warnings"]
        if r == 2:
            assert got["layout"] == "local: a pipeline stage watched without an optimizer"
            assert got["steps"] == worker.STEPS * worker.N_MB  # (each backward pass a step)
        else:
            assert got["layout"] == "local: a peer takes part in no exchange" and got["steps"] == worker.STEPS
            assert "rank(s) 2 of 4 watch a pipeline stage without an optimizer" in got["warnings"][0]


@pytest.mark.timeout(300)
def test_ranks_holding_different_parameters_never_mix_sizes(runs):
    """No pipeline library: each rank holds a module of its own size. The flags go through a
    fixed-size exchange (a mixed-size all-reduce would deadlock); a NaN written on rank 2
    is known to every rank at that step; the global norm counts every rank's parameters."""
    last = worker.STEPS - 1
    for r in range(4):
        got = runs[r]["uneven"]
        assert got["layout"] == "different parameters on each rank"
        assert [(s, k) for s, k, _, _ in got["anomalies"]] == [(last, "nonfinite")], got["anomalies"]
        assert "rank 2" in got["anomalies"][0][3]
        assert (got["anomalies"][0][2] is None) == (r != 2)  # no rank reports another's parameter
        for step in range(last):
            want = math.sqrt(sum(runs[q]["uneven"]["own_sq"][step] for q in range(4)))
            assert got["global"][step] == pytest.approx(want, rel=1e-6)
        assert got["seconds"] < 60


@pytest.mark.timeout(300)
def test_a_hand_written_pipeline_with_ddp_per_stage_compares_each_stages_replicas_only(runs):
    """No PipelineStage: ranks holding different parameters, each stage's in DDP over its dp
    group. The global norm counts each stage once (at step 0, before any drift); the gradient
    edited on rank 3 after its reduction is a replica drift found at step 1 by ranks 1 and 3
    (its dp group), and by neither rank of the other stage."""
    for r in range(4):
        got = runs[r]["handmade"]
        assert got["meta"] == {"layout": "different parameters on each rank", "dp_size": 2}, got["meta"]
        want = math.sqrt(sum(runs[q]["handmade"]["own_sq"][0] for q in (0, 1)))  # (ranks 0, 1: pp 0 and 1)
        assert got["global"][0] == pytest.approx(want, rel=1e-6)
        kinds = [(s, k) for s, k, _, _ in got["anomalies"]]
        assert kinds == ([(1, "ddp_mismatch")] if got["pp"] == 1 else []), (r, got["anomalies"])


@pytest.mark.timeout(300)
def test_an_unwatched_peer_is_found_within_seconds_and_the_job_goes_on(runs):
    for r in (0, 1, 2):
        got = runs[r]["unwatched"]
        assert got["steps"] == worker.STEPS and got["layout"] == "local: not every peer is watched"
        assert len(got["warnings"]) == 1 and "rank(s) 3 of 4 did not check in" in got["warnings"][0]
        assert got["seconds"] < 30, got["seconds"]


@pytest.mark.timeout(300)
def test_fsdp2_x_pp2_full_norms_and_a_nan_written_into_one_shard_after_backward(runs):
    norms, total = _unsplit([0, 1])
    for r in range(4):
        got = runs[r]["fsdp_pp"]
        assert got["meta"]["stage"] == got["pp"] and got["meta"]["dp_size"] == 2
        for name, norm in zip(got["names"], got["norms"]):  # full (unsharded) gradients
            assert norm == pytest.approx(norms[name], rel=1e-5), (r, name)
        assert got["global"][0] == pytest.approx(total, rel=1e-6)
        assert got["global"][0] == pytest.approx(got["torch_norm"], rel=1e-6)  # torch's, in the same run
        (step, kind, name, text), = got["anomalies"]
        assert (step, kind) == (1, "nonfinite"), got["anomalies"]
        if got["pp"] == 0:  # the stage of the edited shard: every dp rank names it and rank 2
            assert name == "0.weight" and "rank(s) 2" in text, text
        else:               # the other stage stops at the same step, naming stage 0
            assert name is None and "stage 0, rank" in text, text


@pytest.mark.timeout(300)
def test_interleaved_dp2_x_pp2_two_stages_per_rank(runs):
    """ScheduleInterleaved1F1B: 4 stages on a pipeline of 2 (rank p holds stages p and p + 2),
    each stage in DDP over its data-parallel group, watched as one ModuleList. The norms and
    the global norm are the unsplit model's; rows say each parameter's stage; the NaN made in
    stage 2 is named there (module, op, line) and said to have arrived at stage 1."""
    norms, total = _unsplit([0, 1])
    for r in range(4):
        got = runs[r]["interleaved"]
        pp = got["pp"]
        assert got["meta"]["stage"] == [pp, pp + 2] and got["meta"]["num_stages"] == 4, got["meta"]
        assert got["meta"]["pp_size"] == 2 and got["meta"]["dp_size"] == 2
        own = [n.split(".module.", 1)[1] for n in got["names"]]  # (names in the ModuleList of DDP-wrapped stages)
        for name, norm in zip(own, got["norms"]):
            assert norm == pytest.approx(norms[name], rel=1e-5), (r, name)
        want = {n: s for s, (a, b) in enumerate(worker.CUTS[4]) for n in norms if a <= int(n.split(".")[0]) < b}
        assert got["stages"] == [want[n] for n in own], got["stages"]
        assert got["global"][0] == pytest.approx(total, rel=1e-6)
        assert got["global"][0] == pytest.approx(got["torch_norm"], rel=1e-6)  # torch's, in the same run
        assert got["global"] == runs[0]["interleaved"]["global"]
        (step, kind, name, text), = got["anomalies"]
        assert (step, kind) == (1, "nonfinite"), got["anomalies"]
        if pp == 0:  # stages 0 and 2: the one that made it, found by a replay of stage 2 alone
            assert "It started in module '1.module.7'" in text and "op SqrtBackward0" in text, text
            assert "_pipeline_worker.py" in text, text
            assert name == "1.module.6.weight"
        else:        # stages 1 and 3: stage 1 got it from stage 2, on the pipeline rank 0 of its replica
            assert "arrived non-finite from stage 2, rank" in text and "It started in module" not in text, text
            assert name.startswith("0.module.4.")
    assert sorted(n.split(".module.", 1)[1] for r in (0, 1) for n in runs[r]["interleaved"]["names"]) == sorted(norms)


@pytest.fixture(scope="module")
def runs3d(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline3d")
    return spawn(worker.main, 8, lambda r, port: (r, 8, port, str(out)), lambda r: out / f"rank{r}.json", timeout=240)


@pytest.mark.timeout(300)
def test_dp2_x_tp2_x_pp2_on_a_3d_mesh(runs3d):
    """torchtitan's layout on 8 ranks: full gradients' norms (tp shards counted once, across
    the FSDP2 shards too) equal to the unsplit model's, the global norm summed over the
    pipeline only, and a NaN written into one rank's shard named with that rank by every
    rank of its stage, while the other stage stops at the same step naming it."""
    norms, total = _unsplit([0, 1])
    for r in range(8):
        got = runs3d[r]["dp_tp_pp"]
        assert got["meta"]["stage"] == got["pp"] and got["meta"]["pp_size"] == 2, got["meta"]
        assert got["meta"]["stage_mesh"] == {"dp": 2, "tp": 2} and got["meta"]["dp_size"] == 2, got["meta"]
        for name, norm in zip(got["names"], got["norms"]):
            assert norm == pytest.approx(norms[name], rel=1e-5), (r, name)
        assert got["stages"] == [got["pp"]] * len(got["names"])
        assert got["global"][0] == pytest.approx(total, rel=1e-6)
        assert got["global"][0] == pytest.approx(got["torch_norm"], rel=1e-6)  # torch's, in the same run
        assert got["global"][0] == runs3d[0]["dp_tp_pp"]["global"][0]
        (step, kind, name, text), = got["anomalies"]
        assert (step, kind) == (1, "nonfinite"), got["anomalies"]
        if got["pp"] == 1:
            assert name == "6.weight" and "rank(s) 5" in text, text
        else:
            assert name is None and "stage 1, rank" in text, text


@pytest.mark.timeout(300)
def test_hsdp_x_pp_replicas_are_compared_within_each_stage_only(runs3d):
    """pp 2 x HSDP (replicate 2 x shard 2): full norms equal to the unsplit model's and to
    torch's in the same run; a weight edited on rank 5 after step 1 is a replica drift found
    at step 2 by every rank of stage 1 (which compares only the ranks holding the same
    shards), and by no rank of stage 0 (never compared with stage 1)."""
    norms, total = _unsplit([0, 1])
    for r in range(8):
        got = runs3d[r]["hsdp_pp"]
        assert got["meta"]["stage_mesh"] == {"rep": 2, "shard": 2} and got["meta"]["dp_size"] == 4, got["meta"]
        for name, norm in zip(got["names"], got["norms"]):
            assert norm == pytest.approx(norms[name], rel=1e-5), (r, name)
        assert got["global"][0] == pytest.approx(total, rel=1e-6)
        assert got["global"][0] == pytest.approx(got["torch_norm"], rel=1e-6)
        kinds = [(s, k) for s, k, _, _ in got["anomalies"]]
        if got["pp"] == 1:
            assert kinds == [(2, "ddp_mismatch")], got["anomalies"]
            assert "in pipeline stage 1" in got["anomalies"][0][3]
        else:
            assert kinds == [], got["anomalies"]
        assert len(got["warnings"]) == 1 and "per-step hash" in got["warnings"][0], got["warnings"]


@pytest.mark.timeout(300)
def test_a_nan_made_in_stage_1s_forward_is_blamed_on_stage_1_by_every_rank(runs):
    """dp 2 x pp 2, 1F1B: a log of a negative in stage 1's forward at step 1. Stage 1's ranks
    find it by a replay; stage 0's ranks, which it reached through the gradient of their
    output, name the same module, op and line (told through the store), never their own."""
    for r in range(4):
        got = runs[r]["dp2pp2_forward_nan"]
        first = [a for a in got["anomalies"] if a[0] == 1]
        assert [(a[0], a[1]) for a in first] == [(1, "nonfinite")], got["anomalies"]
        text = first[0][3]
        assert "module '7'" in text and "aten.log" in text and "_pipeline_worker.py" in text, text
        if got["pp"] == 0:
            assert "arrived non-finite from stage 1" in text and "it started there in module '7'" in text, text
            assert first[0][2] in got["names"]  # (the parameter it reached here: this stage's own)


@pytest.mark.timeout(300)
def test_a_replica_drift_under_raise_stops_every_stage_at_the_same_step(runs):
    """dp 2 x pp 2, the replica check every step, the default policy: rank 2 (stage 0) edits a
    weight after step 1. Stage 0's ranks find it at step 2; stage 1's learn it through the
    stage summary; every rank raises at the same boundary (none is left in a receive)."""
    for r in range(4):
        got = runs[r]["dp2pp2_drift_raise"]
        step, kind, text = got["stopped"]
        assert (step, kind) == (2, "ddp_mismatch"), (r, got["stopped"])
        if got["pp"] == 1:
            assert "replicas differ in pipeline stage(s) [0] at step 2" in text, text
