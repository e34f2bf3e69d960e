"""Dev cases of the second corpus, mechanism "distributed" (see mechanisms.py); each runs in
one process."""
from __future__ import annotations

from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from .._common import Case, trains
from .._mech_d import opt_build


def _sampler_loop(set_epoch: bool):
    """Rank 0 of 2 (DistributedSampler told its rank and world size, as after
    init_process_group); 4 batches of 32 per epoch."""
    def loop(model, opt, ex, steps):
        ds = TensorDataset(ex["x"], ex["y"])
        sampler = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=0)
        loader = DataLoader(ds, batch_size=32, sampler=sampler)
        losses, orders, epoch, it = [], [], 0, iter(())
        for _ in range(steps):
            pair = next(it, None)
            if pair is None:  # a new epoch
                if set_epoch:
                    sampler.set_epoch(epoch)
                orders.append(list(sampler))
                epoch += 1
                it = iter(loader)
                pair = next(it)
            x, y = pair
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses, "orders": orders}
    return loop


def _sampler_manifest(b, f):
    same = all(o == b["orders"][0] for o in b["orders"])
    differ = len({tuple(o) for o in f["orders"]}) == len(f["orders"])
    return len(b["orders"]) >= 3 and same and differ and trains(f, 0.3)


DIST_SET_EPOCH = Case(
    name="distributed_sampler_without_set_epoch",
    family="distributed",
    source="pytorch/pytorch issue #31771 ('DistributedSampler can't shuffle the dataset': 'each "
           "epoch samples the data in the same order'); lucidrains/DALLE-pytorch pull request "
           "#230 ('use data_sampler.set_epoch to avoid having the same order in each epoch'); "
           "pytorch/pytorch issue #11324",
    description="I train with DistributedSampler(shuffle=True) but never call set_epoch; every "
                "epoch each rank sees its samples in exactly the same order.",
    expected_kinds=(),
    params=(),
    manifest=_sampler_manifest,
    build_buggy=opt_build(),
    loop_buggy=_sampler_loop(False),
    build_fixed=opt_build(),
    loop_fixed=_sampler_loop(True),
    steps=60,
)


CASES = [DIST_SET_EPOCH]
