"""graddbg._model: what every part knows about a user's model, written once; here the one
name for this rank's values of a tensor (`local_values`)."""
from __future__ import annotations

import ast
import pathlib

import torch
import torch.distributed as dist

import graddbg
from graddbg._model import is_dtensor, local_values

PKG = pathlib.Path(graddbg.__file__).parent


def test_local_values_of_a_plain_tensor_is_the_tensor_detached():
    w = torch.randn(3, requires_grad=True)
    got = local_values(w)
    assert not got.requires_grad and got.data_ptr() == w.data_ptr() and torch.equal(got, w)


def test_local_values_of_a_dtensor_is_its_local_shard_and_reduces_pending_sums_when_asked():
    from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", [0])
        full = torch.arange(6.0).reshape(3, 2).requires_grad_()
        sharded = distribute_tensor(full.detach(), mesh, [Shard(0)])
        assert is_dtensor(sharded) and not is_dtensor(full)
        got = local_values(sharded)
        assert type(got) is torch.Tensor and torch.equal(got, full.detach())
        pending = DTensor.from_local(torch.ones(2), mesh, [Partial()])
        assert type(local_values(pending)) is torch.Tensor
        reduced = local_values(pending, reduce_partial=True)
        assert type(reduced) is torch.Tensor and torch.equal(reduced, torch.ones(2))  # (one rank: the sum)
    finally:
        dist.destroy_process_group()


def test_one_name_for_this_ranks_values():
    """The names that once meant the same thing are gone (local_tensor, _local_shard, _dense,
    _held, _sharded, blame._local): every module calls local_values."""
    old = {("_model", "local_tensor"), ("stats", "_local_shard"), ("stats", "_dense"),
           ("stats", "_sharded"), ("stats", "local_values"), ("ddp_verify", "_held"), ("blame", "_local")}
    defined = {(path.stem, node.name) for path in sorted(PKG.rglob("*.py"))
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)}
    assert defined & old == set()
    from graddbg import stats

    assert stats.local_values is local_values     # (the name the checks import from stats)
