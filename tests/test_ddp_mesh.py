"""ddp_verify's replica checks on sharded models: HSDP, pure FSDP2, and tensor parallelism
under data parallelism (issue 19, point 3).

Each rank fingerprints what it holds (a DTensor's local shard); the fingerprints are
exchanged once over the default group, and each rank is compared with its replicas only:
the ranks that hold the same shard of every tensor (HSDP's replicate dimension, the
data-parallel dimension over tensor parallelism), or the ranks of ``group=``. Distributed
tests spawn real gloo worlds on 127.0.0.1 (tests/_ddp_mesh_worker.py), each running many
scenarios, every rank writing what it saw; the tests assert on those records, for every rank.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import _ddp_mesh_worker as workers
from graddbg import ddp_verify
from graddbg import _verdict
from graddbg._errors import GraddbgTypeError

REPLICAS = [[0, 2], [1, 3]]        # on a 2 x 2 mesh: the ranks that hold the same shards
# dp x tp: RowwiseParallel's bias is Replicate over tp, so it is compared across all four
EVERY_AND_REPLICAS = [[0, 1, 2, 3], [0, 2], [1, 3]]


def distributed(test):
    """Marks of a test that spawns (or reuses) a real world: slow, and bounded in time."""
    return pytest.mark.slow(pytest.mark.timeout(240)(test))


def _world(tmp_path_factory, name: str, nprocs: int) -> dict:
    out = tmp_path_factory.mktemp(f"mesh_{name}")
    results = workers.run_world(name, nprocs, str(out), timeout_s=180)
    assert sorted(results) == list(range(nprocs)), "a rank wrote no results"
    return results


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory):
    """A 4-rank world, HSDP on a 2 x 2 (replicate, shard) mesh: {rank: {scenario: record}}."""
    return _world(tmp_path_factory, "hsdp", 4)


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    """A 2-rank world, pure FSDP2 on a 1-D mesh."""
    return _world(tmp_path_factory, "fsdp", 2)


@pytest.fixture(scope="module")
def dp_tp(tmp_path_factory):
    """A 4-rank world, a 2 x 2 (dp, tp) mesh: tensor parallel over tp, data parallel over dp."""
    return _world(tmp_path_factory, "dp_tp", 4)


def _scenario(world: dict, name: str) -> list:
    records = [world[r][name] for r in sorted(world)]
    for r, rec in enumerate(records):
        assert "traceback" not in rec, f"rank {r} failed in {name}:\n{rec.get('traceback')}"
    return records


def _same_verdict(reports: list) -> dict:
    """Every rank reached the same verdict (rows, replica groups, text but for its rank)."""
    first = reports[0]
    for r, rep in enumerate(reports):
        assert rep["rank"] == r
        assert (rep["ok"], rep["rows"], rep["groups"]) == (first["ok"], first["rows"], first["groups"])
        assert rep["text"].replace(f"[rank {r}]", "") == first["text"].replace("[rank 0]", "")
    return first


def _same_error(results: list, error: str = "GraddbgValueError") -> str:
    """Every rank raised the same error, with the same message."""
    assert all(res["error"] == error and res["value_error"] for res in results), results
    assert len({res["message"] for res in results}) == 1, [res["message"] for res in results]
    return results[0]["message"]


# --------------------------------------------------------------------------- local
def test_verdict_compares_each_replica_group_within_itself():
    """Ranks 0 and 1 hold different shards (different fingerprints by design); rank 3
    differs from its replica, rank 1: only rank 3 is reported, against rank 1."""
    shard_a = ddp_verify.fingerprints([torch.arange(4.0)])
    shard_b = ddp_verify.fingerprints([torch.arange(4.0) + 10])
    bad_b = ddp_verify.fingerprints([torch.arange(4.0) + 11])
    table = torch.stack([shard_a, shard_b, shard_a, bad_b])
    meta = [("w", (8,), "float32")]
    assert _verdict.disagreements(table, ["w"], meta, "bitwise", 0.0, 0.0, REPLICAS) == \
        [(0, 3, 1, "bits differ")]
    assert _verdict.disagreements(table[[0, 1, 2, 1]], ["w"], meta, "bitwise", 0.0, 0.0, REPLICAS) == []


def test_a_dimension_name_on_a_plain_model_is_a_type_error_before_any_collective():
    with pytest.raises(GraddbgTypeError, match=r"check_gradients\(group=...\): got str; .*"
                                               r"needs a model holding DTensors.*holds none"):
        ddp_verify.check_gradients(nn.Linear(2, 2), group="replicate")
    with pytest.raises(GraddbgTypeError, match=r"prepare\(group=...\): got str"):
        ddp_verify.prepare("replicate")


# --------------------------------------------------------------------------- HSDP, 4 ranks
@distributed
def test_hsdp_replicas_agree_after_a_normal_step(hsdp):
    records = _scenario(hsdp, "healthy")
    for key in ("auto", "tolerance", "params", "named"):
        rep = _same_verdict([rec[key] for rec in records])
        assert rep["ok"] and rep["world_size"] == 4 and rep["checked"] == 6, rep["text"]
        assert rep["groups"] == REPLICAS
        assert "shard by shard within the replica groups [0, 2] [1, 3]: consistent" in rep["text"]


@distributed
def test_hsdp_group_accepts_a_dimension_name_a_1d_mesh_and_a_process_group(hsdp):
    for rec in _scenario(hsdp, "healthy"):
        for key in ("named", "mesh", "pg"):
            assert rec[key]["ok"] and rec[key]["groups"] == REPLICAS, (key, rec[key]["text"])


@distributed
def test_hsdp_one_perturbed_gradient_shard_is_named_on_every_rank(hsdp):
    records = _scenario(hsdp, "perturbed_grad")
    for key in ("auto", "named"):
        rep = _same_verdict([rec[key] for rec in records])
        assert not rep["ok"] and rep["rows"] == [["2.weight", 2, 0, "bits differ"]]
        (local_shape, shard), = rep["shards"]
        assert local_shape == [4, 10]
        assert shard == ("(Replicate(), Shard(dim=0)) over the mesh (replicate=2, shard=2), "
                         "shard at (*, 0), local shape (4, 10)")
    for rec in records:  # details=True: the largest difference, and where, in rank 2's shard
        (max_abs_diff, n_diff, index), = rec["auto"]["details"]
        assert max_abs_diff == pytest.approx(1e-3, rel=1e-3) and n_diff == 1 and index == [1, 2]


@distributed
def test_hsdp_tolerance_mode_compares_shards_too(hsdp):
    records = _scenario(hsdp, "perturbed_grad")
    caught = _same_verdict([rec["tolerance_catches"] for rec in records])
    assert caught["rows"] == [["2.weight", 2, 0, "values differ beyond atol/rtol"]]
    allowed = _same_verdict([rec["tolerance_allows"] for rec in records])
    assert allowed["ok"] and allowed["mode"] == "tolerance"


@distributed
def test_hsdp_raise_on_mismatch_raises_on_every_rank(hsdp):
    for rec in _scenario(hsdp, "perturbed_grad"):
        assert rec["raised"]["error"] == "DDPInconsistencyError"
        assert rec["raised"]["names"] == ["2.weight"]


@distributed
def test_hsdp_one_perturbed_parameter_shard_is_named_on_every_rank(hsdp):
    records = _scenario(hsdp, "perturbed_param")
    rep = _same_verdict([rec["params"] for rec in records])
    assert rep["rows"] == [["0.bias", 3, 1, "bits differ"]] and rep["shards"][0][0] == [5]
    assert all(rec["grads"]["ok"] for rec in records)


@distributed
def test_plain_buffers_of_a_sharded_model_are_compared_across_every_rank(hsdp):
    rep = _same_verdict(_scenario(hsdp, "buffer"))
    assert rep["groups"] == [[0, 1, 2, 3]]
    assert rep["rows"] == [["scale", 3, 0, "bits differ"]] and rep["shards"] == [[None, None]]


@distributed
def test_a_group_over_the_sharded_dimension_is_refused_naming_the_parameter(hsdp):
    records = _scenario(hsdp, "wrong_dimension")
    for key, fn in (("named", "check_gradients"), ("pg", "check_parameters")):
        message = _same_error([rec[key] for rec in records])
        assert message.startswith(f"{fn}(group=...): ranks 0 and 1 are in one replica group but "
                                  f"hold different shards of '0.weight'")
        assert "shard at (*, 0)" in message and "shard at (*, 1)" in message
        assert "'replicate'" in message


@distributed
def test_bad_group_arguments_raise_before_any_collective(hsdp):
    for rec in _scenario(hsdp, "bad_args"):
        assert rec["unknown"]["error"] == "GraddbgValueError"
        assert "no dimension 'nope'; its dimensions: ['replicate', 'shard']" in rec["unknown"]["message"]
        assert rec["two_d"]["error"] == "GraddbgValueError"
        assert "got a 2-D DeviceMesh ('replicate', 'shard'); accepted: a 1-D mesh" in rec["two_d"]["message"]
        assert rec["int"]["error"] == "GraddbgTypeError" and rec["int"]["type_error"]
        assert "group=...): got int; accepted: None" in rec["int"]["message"]
        assert rec["after"]["ok"]       # no rank was left inside a collective


@distributed
def test_a_1d_mesh_as_the_group_of_a_plain_model_is_its_process_group(hsdp):
    records = _scenario(hsdp, "groups")
    for r, rec in enumerate(records):
        plain = rec["plain"]
        assert plain["ok"] and plain["world_size"] == 2 and plain["groups"] == [], plain["text"]
        assert plain["rank"] == r // 2       # its rank in the replicate group: [0, 2] or [1, 3]


@distributed
def test_groups_that_do_not_split_the_world_into_replica_groups_are_refused(hsdp):
    records = _scenario(hsdp, "groups")
    message = _same_error([rec["mixed"] for rec in records])
    assert message.startswith("check_parameters(group=...): the groups passed do not split the 4 "
                              "ranks into replica groups")
    assert all(rec["after"]["ok"] for rec in records)


@distributed
def test_a_rank_that_never_calls_is_named_by_the_others_within_the_timeout(hsdp):
    records = _scenario(hsdp, "skip")
    assert records[3] == {"skipped": True}
    for rec in records[:3]:
        assert rec["error"] == "DDPTimeoutError", rec
        assert "rank(s) [3] of the group (world size 4) did not enter the check" in rec["message"]
        assert rec["elapsed"] < 10


# --------------------------------------------------------------------------- pure FSDP, 2 ranks
@distributed
def test_pure_fsdp_has_no_replicas_and_says_so(fsdp):
    records = _scenario(fsdp, "no_replicas")
    for key, fn in (("grads", "check_gradients"), ("params", "check_parameters")):
        message = _same_error([rec[key] for rec in records])
        assert message.startswith(f"{fn}: no replicas to compare: every parameter is sharded over "
                                  f"the whole mesh (pure FSDP")
        assert "'0.weight': (Shard(dim=0)) over a mesh of shape (2,)" in message
        assert "HSDP or DDP replicas are what these checks compare" in message
    message = _same_error([rec["world"] for rec in records])
    assert "ranks 0 and 1 are in one replica group but hold different shards" in message
    for rec in records:     # its plain buffers are replicas all the same
        assert rec["buffers"]["ok"] and rec["buffers"]["groups"] == [[0, 1]]


# --------------------------------------------------------------------------- dp x tp, 4 ranks
@distributed
def test_tensor_parallel_under_replicate_is_compared_across_dp(dp_tp):
    records = _scenario(dp_tp, "replicate")
    assert records[0]["placements"][0] == "(Replicate(), Shard(dim=0))"
    for key, groups in (("auto", EVERY_AND_REPLICAS), ("named", REPLICAS)):
        rep = _same_verdict([rec[key] for rec in records])
        assert rep["ok"] and rep["groups"] == groups, rep["text"]
    rep = _same_verdict([rec["perturbed"] for rec in records])
    assert rep["rows"] == [["0.weight", 3, 1, "bits differ"]]


@distributed
def test_replicas_outside_the_dtensors_mesh_are_found_and_named_by_dimension(dp_tp):
    """DTensors on the 1-D tp mesh, gradients averaged over dp by hand: group='dp' is found
    on the mesh the tp mesh was cut from, and group='tp' is refused."""
    records = _scenario(dp_tp, "manual")
    for key, groups in (("auto", EVERY_AND_REPLICAS), ("named", REPLICAS)):
        rep = _same_verdict([rec[key] for rec in records])
        assert rep["ok"] and rep["groups"] == groups, rep["text"]
    assert "hold different shards of '0.weight'" in _same_error([rec["wrong"] for rec in records])
    rep = _same_verdict([rec["perturbed"] for rec in records])
    assert rep["rows"] == [["2.bias", 2, 0, "bits differ"]]   # a Replicate bias: compared over dp


@distributed
def test_ddp_over_tensor_parallel_compares_the_local_shards_across_dp(dp_tp):
    records = _scenario(dp_tp, "ddp")
    rep = _same_verdict([rec["auto"] for rec in records])
    assert rep["ok"] and rep["groups"] == EVERY_AND_REPLICAS, rep["text"]
    rep = _same_verdict([rec["perturbed"] for rec in records])
    assert rep["rows"] == [["0.weight", 3, 1, "bits differ"]] and rep["shards"][0][0] == [4, 6]


# --------------------------------------------------------------------------- replicas (issue 24)
@distributed
def test_hsdp_shard_drift_by_a_uniform_offset_is_named(hsdp):
    """Rank 2's shard of 0.weight moved by 1e-3 (values of both signs: the words move in
    opposite directions); its replica, rank 0, is the reference. The same move on both
    replicas of the shard (the twin) is consistent."""
    records = _scenario(hsdp, "offset")
    rep = _same_verdict([rec["one"] for rec in records])
    assert rep["rows"] == [["0.weight", 2, 0, "bits differ"]], rep["text"]
    assert [w[:3] for w in rep["why"]] == [["0.weight", "parameters", 2]]
    assert rep["why"][0][3].startswith("the gradients agree but the parameters do not")
    for rec in records:
        assert rec["twin"]["ok"] and rec["twin"]["groups"] == REPLICAS, rec["twin"]["text"]


TP_REPLICATED = ["2.bias", "3.weight", "3.bias"]   # the Replicate bias and the LayerNorm


@distributed
def test_tensor_parallel_replicas_are_compared_across_the_tp_group(fsdp):
    """2-rank tensor parallelism, no data parallelism: the LayerNorm left out of the plan
    and RowwiseParallel's Replicate bias are replicas on both ranks (the shards are not).
    Clipping by a norm of this rank's shards only (the BLOOM-176B bug) makes them differ
    from the first clipped gradients on; the twin, without it, is silent throughout."""
    records = _scenario(fsdp, "tp_layernorm")
    for case in ("clipped", "healthy"):
        for key in ("initial", "step0", "step1", "after"):
            rep = _same_verdict([rec[case][key] for rec in records])
            assert rep["groups"] == [[0, 1]], rep["text"]          # compared, not refused
    clipped = records[0]["clipped"]
    assert clipped["initial"]["ok"]
    rows = [w[:3] for w in clipped["step0"]["why"]]
    assert rows == [[n, "gradients", 1] for n in TP_REPLICATED], clipped["step0"]["text"]
    assert all("tensor-parallel group" in w[3] for w in clipped["step0"]["why"])
    assert [w[:3] for w in clipped["after"]["why"]] == [[n, "parameters", 1] for n in TP_REPLICATED]
    for key in ("initial", "step0", "step1", "after"):
        assert records[0]["healthy"][key]["ok"], records[0]["healthy"][key]["text"]


@distributed
def test_a_tensor_parallel_layernorm_that_drifts_on_one_rank_is_named(fsdp):
    rep = _same_verdict([rec["drift"] for rec in _scenario(fsdp, "tp_layernorm")])
    assert rep["rows"] == [["3.weight", 1, 0, "bits differ"]], rep["text"]
    assert "LayerNorm weight left out of the parallelize plan" in rep["why"][0][3]
