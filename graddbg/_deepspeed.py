"""DeepSpeed (ZeRO stages 0-3): what ``watch()`` needs to know of a ``DeepSpeedEngine``.

- `find`: the engine of ``watch(engine)`` or of ``watch(model, optimizer)`` with the
  objects given to ``deepspeed.initialize``; None when DeepSpeed is not in use;
- `Zero`: the engine's module, its torch optimizer (under ZeRO's wrappers), its loss
  scale, the accumulation boundary, a hook around ``engine.step()``, and this rank's piece
  of each parameter's reduced gradient;
- `gather_stats`: per-parameter statistics of the full, reduced gradient from every
  rank's pieces: one all-gather of a small table (a norm and a largest magnitude per
  parameter), never of the gradients.

DeepSpeed is imported lazily (only when it is already imported by the user's program):
``import graddbg`` never imports it. Imports torch, `graddbg._errors` and
`graddbg.stats` only.
"""
from __future__ import annotations

import gc
import math
import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from graddbg._dist.collective import run_collective
from graddbg.stats import StepStats, absmax_of

__all__ = ["is_engine", "find", "Zero", "Origin", "gather_stats", "local_table", "exact_table"]


def is_engine(obj: Any) -> bool:
    """Whether ``obj`` is a ``deepspeed.DeepSpeedEngine`` (without importing deepspeed)."""
    return "deepspeed" in sys.modules and any(c.__name__ == "DeepSpeedEngine" for c in type(obj).__mro__)


def _engine_of(model: Any, optimizer: Any) -> Any:
    """The engine that ``deepspeed.initialize`` built around ``model`` (or around the
    optimizer it was given): found among the objects that refer to them, a few levels up."""
    targets = [t for t in (model, optimizer) if t is not None]
    frontier, seen = list(targets), {id(t) for t in targets}
    for _ in range(3):
        nxt = []
        for ref in gc.get_referrers(*frontier):
            if is_engine(ref) and (ref.module is model or _torch_optimizer(ref.optimizer) is optimizer):
                return ref
            if id(ref) not in seen and (isinstance(ref, dict) or hasattr(ref, "__dict__")):
                seen.add(id(ref))
                nxt.append(ref)
        frontier = [r for r in nxt if not isinstance(r, (type, type(sys)))][:256]
        if not frontier:
            break
    return None


def find(model: Any, optimizer: Any) -> Optional["Zero"]:
    """The `Zero` view of the DeepSpeed engine that ``model`` is (or wraps
    ``model``, stepped by ``optimizer``), or None when DeepSpeed is not in use."""
    if "deepspeed" not in sys.modules:
        return None
    if is_engine(model):
        return Zero(model)
    if optimizer is not None and is_engine(getattr(optimizer, "engine", None)):
        return Zero(optimizer.engine)  # (accelerate's DeepSpeedOptimizerWrapper has none; kept for others)
    if not isinstance(model, nn.Module):
        return None
    engine = _engine_from_hooks(model)
    if engine is None and _marked(model, optimizer):
        engine = _engine_of(model, optimizer)
    return Zero(engine) if engine is not None else None


def _engine_from_hooks(model: nn.Module) -> Any:
    """The engine whose forward hooks are on ``model`` (every ``DeepSpeedEngine`` puts two
    on its module; their closures hold the engine). Cheap: no search of the heap."""
    # (torch has no public way to list a module's hooks)
    hooks = list(model.__dict__.get("_forward_pre_hooks", {}).values())
    hooks += list(model.__dict__.get("_forward_hooks", {}).values())
    for fn in hooks:
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                obj = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if is_engine(obj) and obj.module is model:
                return obj
    return None


def _marked(model: nn.Module, optimizer: Any) -> bool:
    """Signs of ZeRO on a model: parameters that its optimizers tagged, or an optimizer
    whose param groups ZeRO replaced (it holds none of the model's parameters)."""
    params = list(model.parameters())
    if any(hasattr(p, "ds_id") or hasattr(p, "_hp_mapping") or hasattr(p, "_dp_group") for p in params[:8]):
        return True
    groups = getattr(optimizer, "param_groups", None)
    if not groups or not params:
        return False
    held = {id(p) for g in groups for p in g["params"]}
    return not any(id(p) in held for p in params)


def _torch_optimizer(opt: Any) -> Optional[torch.optim.Optimizer]:
    """The torch optimizer inside ZeRO's (and accelerate's) wrappers."""
    for _ in range(6):
        if isinstance(opt, torch.optim.Optimizer) and not hasattr(opt, "optimizer"):
            return opt
        inner = getattr(opt, "optimizer", None)
        if inner is None or inner is opt:
            break
        opt = inner
    return opt if isinstance(opt, torch.optim.Optimizer) else None


class _Wrap:
    """A method of the engine wrapped on the instance (DeepSpeed offers no hook for it);
    ``remove()`` puts the engine's own back."""

    def __init__(self, engine: Any, name: str, wrapper: Callable[..., Any]) -> None:
        self.engine, self.name, self.wrapper = engine, name, wrapper
        object.__setattr__(engine, name, wrapper)

    def remove(self) -> None:
        if self.engine is not None and self.engine.__dict__.get(self.name) is self.wrapper:
            del self.engine.__dict__[self.name]
        self.engine = None


def _step_hook(engine: Any, pre: Callable[[], None], post: Callable[[], None]) -> _Wrap:
    """``engine.step`` wrapped: ``pre`` and ``post`` run around the steps at an accumulation
    boundary."""
    original = engine.step

    def step(*args: Any, **kwargs: Any) -> Any:
        at = engine.is_gradient_accumulation_boundary()
        if at:
            pre()
        try:
            return original(*args, **kwargs)
        finally:
            if at:
                post()

    return _Wrap(engine, "step", step)


def _keep(kept: List[Tensor], t: Tensor, most: int = 64) -> None:
    """``t`` into ``kept``; past ``most`` (backward passes that no step read), folded into
    one sum on the device (non-finite when one of them was)."""
    kept.append(t)
    if len(kept) > most:
        kept[:] = [torch.stack([k.float().reshape(-1).sum() for k in kept]).sum()]


class Origin:
    """Where a non-finite gradient started, from evidence each rank keeps before DeepSpeed
    reduces its gradients (after the reduction every rank's partition holds the NaN): the
    loss of each of its micro-batches (a reference to the 0-dim tensor given to
    ``engine.backward``: no kernel, no host read) and the sum of the gradient of its model's
    output (one reduction on the device per micro-batch, no host read).
    Read only when the reduced gradients are non-finite: one all-gather of 3 numbers per
    rank, which every rank enters at the same step (they all see the same table)."""

    def __init__(self) -> None:
        self.losses: List[Tensor] = []
        self.out_grads: List[Tensor] = []

    def loss(self, loss: Any) -> None:
        if isinstance(loss, Tensor):
            _keep(self.losses, loss.detach())

    def output_grad(self, grad: Tensor) -> None:
        # (one reduction, non-finite when an entry is; float32, so that a finite fp16 gradient's
        # sum does not overflow)
        _keep(self.out_grads, grad.detach().sum(dtype=torch.float32))

    def clear(self) -> None:
        self.losses.clear()
        self.out_grads.clear()

    def local(self) -> Tensor:
        """``[3]`` float32: whether a loss, an output's gradient was non-finite; how many losses seen."""
        def bad(ts: List[Tensor]) -> float:
            return float(not bool(torch.isfinite(torch.stack([t.float().reshape(-1).sum() for t in ts])).all())) \
                if ts else 0.0
        return torch.tensor([bad(self.losses), bad(self.out_grads), float(len(self.losses))])

    def find(self, group: Any, ranks: Sequence[int]) -> Tuple[Tuple[int, ...], str]:
        """``(the global ranks where it was first seen, the evidence)``; no ranks when no
        rank's evidence shows it (it arose later: in the backward pass, the reduction, or an
        edit of the reduced gradients)."""
        got = gather(self.local(), group).numpy()
        for col, what in ((0, "its loss was non-finite"), (1, "the gradient of its model's output was non-finite")):
            found = tuple(int(ranks[r]) for r in np.nonzero(got[:, col] > 0)[0])
            if found:
                return found, f"{what}, before DeepSpeed reduced the gradients"
        if not got[:, 2].all():
            return (), "a rank passed no loss to engine.backward()"
        return (), ("every rank's loss and output gradient were finite: it arose after them, in the "
                    "backward pass, the reduction or an edit of the reduced gradients")


class Zero:
    """What the watch needs of one ``DeepSpeedEngine`` (ZeRO stage 0-3)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.stage = int(engine.zero_optimization_stage())
        self.zero_optimizer = engine.optimizer  #: ZeRO's optimizer (or the torch one at stage 0, fp32)
        self.optimizer = _torch_optimizer(engine.optimizer)  #: the torch optimizer under it
        self._group: Any = None
        self._ranks: Optional[List[int]] = None
        self._where: Optional[Tuple[int, int, bool]] = None  # (this rank in the group, its size, NCCL)
        self._cache: dict = {}  # (local_table's constants)
        self.origin = Origin()  #: each rank's evidence of where a non-finite gradient started

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    def loss_scale(self) -> float:
        """The loss scale the gradients carry (fp16's dynamic scale; 1 otherwise)."""
        if not self.engine.fp16_enabled():
            return 1.0
        opt = self.zero_optimizer
        scale = getattr(opt, "cur_scale", None)
        if scale is None:
            scale = getattr(getattr(opt, "loss_scale_config", None), "cur_scale", 1.0)
        return float(scale)

    def skips_overflow(self) -> bool:
        """Whether DeepSpeed skips a step whose gradients overflowed (fp16, dynamic loss scale)."""
        return bool(self.engine.fp16_enabled() and self.engine.dynamic_loss_scale())

    def hook_step(self, pre: Callable[[], None], post: Callable[[], None]) -> _Wrap:
        """``pre``/``post`` around each ``engine.step()`` at an accumulation boundary."""
        return _step_hook(self.engine, pre, post)

    def hook_backward(self) -> _Wrap:
        """``engine.backward(loss)`` keeps a reference to each micro-batch's loss (`Origin`)."""
        original, origin = self.engine.backward, self.origin

        def backward(loss: Any, *args: Any, **kwargs: Any) -> Any:
            origin.loss(loss)
            return original(loss, *args, **kwargs)

        return _Wrap(self.engine, "backward", backward)

    def find_origin(self) -> Tuple[Tuple[int, ...], str]:
        """Where this step's non-finite gradients started (see `Origin.find`): call it on
        every rank at the same step."""
        if self._ranks is None:
            self._ranks = global_ranks(self.group)
        return self.origin.find(self.group, self._ranks)

    @property
    def group(self) -> Any:
        """The data-parallel process group the gradients are reduced over."""
        if self._group is None:
            opt = self.zero_optimizer
            group = getattr(opt, "dp_process_group", None)
            if group is None:
                group = getattr(self.engine, "seq_data_parallel_group", None)
            self._group = group if group is not None else torch.distributed.group.WORLD
        return self._group

    def pieces(self, params: Sequence[Tensor]) -> List[Optional[Tensor]]:
        """This rank's piece (1-D) of each parameter's reduced gradient, the pieces of
        all ranks making each gradient once; None where this rank holds none of it."""
        if self._where is None:
            dist = torch.distributed
            self._where = (dist.get_rank(self.group), dist.get_world_size(self.group),
                           dist.get_backend(self.group) == "nccl")
        rank, world, _ = self._where
        return [_piece(p, rank, world) for p in params]

    def numel(self, p: Tensor) -> int:
        """The full size of a parameter (ZeRO-3 leaves an empty tensor in its place)."""
        return int(getattr(p, "ds_numel", p.numel()))

    def read(self, params: Sequence[Tensor], absmax: bool) -> Tuple[List[Optional[Tensor]], Tensor]:
        """This rank's pieces and every rank's table of them, ``[world, P, 3]`` (one
        all-gather: the collective of a recorded step)."""
        pieces = self.pieces(params)
        _, world, nccl = self._where
        return pieces, gather(local_table(pieces, absmax, self._cache), self.group, world, nccl)

    def combine(self, got: np.ndarray, absmax: bool, div: float) -> StepStats:
        """The full gradients' statistics from the gathered table (see `gather_stats`)."""
        if self._ranks is None:
            self._ranks = global_ranks(self.group)
        return gather_stats(got, absmax, div, self._ranks)

    def rescue(self, st: StepStats, pieces: Sequence[Optional[Tensor]], div: float) -> bool:
        return rescue(st, pieces, self.group, div)

    def adjust(self, options: Any) -> Any:
        """The watch's options under ZeRO: the checks of the user's own ``zero_grad`` and
        param groups are off (DeepSpeed owns both), and so is the replay (it would run
        ZeRO's collectives on one rank); from stage 1 the gradients are partitioned (no
        replicas to compare); at stage 3 the weights are too, so the checks that compare
        them before and after the step are off."""
        off: dict = dict(stale_grad=None, empty_step=None, orphan_param=None, localise=False)
        if self.stage >= 1:
            off.update(ddp_check_every=None)
        if self.stage == 3:
            off.update(no_update=None, update_every=None)
        return options.replace(**off)

    def describe(self) -> str:
        return f"ZeRO stage {self.stage}"


def _piece(p: Tensor, rank: int, world: int) -> Optional[Tensor]:
    """This rank's part of ``p``'s reduced gradient (see `Zero.pieces`)."""
    if hasattr(p, "ds_id"):  # ZeRO-3: the local partition (padded at the end)
        from deepspeed.utils import safe_get_local_grad

        g = safe_get_local_grad(p)
        if g is None:
            return None
        n = g.numel()
        return g.reshape(-1).narrow(0, 0, max(0, min(n, int(p.ds_numel) - rank * n)))
    if hasattr(p, "_hp_mapping"):  # ZeRO-1/2, BF16_Optimizer: the fragment this rank's partition holds
        mapping = p._hp_mapping
        if mapping is None:
            return None
        try:
            g = mapping.get_lp_grad_fragment(p._index_in_param_group).reshape(-1)
        except (ValueError, KeyError, IndexError, TypeError):
            return None  # (no gradient: after the step, or before any backward)
        if g.numel() == p.numel():
            address = mapping.lp_fragment_address
            g = g.narrow(0, address.start, address.numel)
        return g
    g = p.grad  # stage 0: every rank holds the whole reduced gradient; each reads its slice
    if g is None:
        return None
    g, n = g.reshape(-1), g.numel()
    lo, hi = rank * n // world, (rank + 1) * n // world
    return g.narrow(0, lo, hi - lo)


def local_table(pieces: Sequence[Optional[Tensor]], absmax: bool, cache: Optional[dict] = None) -> Tensor:
    """``[P, 3]`` float32 on this rank: each piece's norm, largest magnitude (0 when not
    asked for) and whether it exists (1/0). One batched kernel for the norms, one pass for
    the largest magnitudes (`graddbg.stats.absmax_of` picks the fast one for the device); a
    missing or empty piece counts as a zero. ``cache``: the caller's dict, where constants
    (a zero, the presence column) are kept between calls."""
    dev = next((g.device for g in pieces if g is not None), torch.device("cpu"))
    if not pieces:
        return torch.zeros(0, 3, device=dev)
    cache = {} if cache is None else cache
    zero = cache.get(dev)
    if zero is None:
        zero = cache[dev] = torch.zeros((), device=dev)
    ts = [g if g is not None and g.numel() else zero for g in pieces]
    norms = torch.stack(torch._foreach_norm(ts, 2, dtype=torch.float32))
    if absmax:
        maxes = absmax_of(ts).float()
    else:
        maxes = cache.get((dev, len(ts)))
        if maxes is None:
            maxes = cache[(dev, len(ts))] = torch.zeros(len(ts), device=dev)
    present = (dev, tuple(g is not None for g in pieces))
    flags = cache.get(present)
    if flags is None:
        flags = cache[present] = torch.tensor(present[1], dtype=torch.float32, device=dev)
    return torch.stack([norms, maxes, flags], 1)


def gather(table: Tensor, group: Any, world: Optional[int] = None, nccl: Optional[bool] = None) -> Tensor:
    """Every rank's table, ``[world, ...]``: the one collective of a recorded step (into one
    tensor: no list of outputs to allocate and stack). ``world``, ``nccl``: the group's size
    and whether its backend is NCCL, when the caller knows them."""
    dist = torch.distributed
    world = dist.get_world_size(group) if world is None else world
    nccl = dist.get_backend(group) == "nccl" if nccl is None else nccl
    if nccl and table.device.type != "cuda":
        table = table.to(torch.device("cuda", torch.cuda.current_device()))  # (nccl gathers CUDA tensors only)
    table = table.contiguous()
    out = table.new_empty((world * table.shape[0],) + tuple(table.shape[1:]))
    _all_gather_single(out, table, group)
    return out.view((world,) + tuple(table.shape))


def _all_gather_single(out: Tensor, t: Tensor, group: Any) -> None:
    dist = torch.distributed
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (the newer name first)
    run_collective(fn, out, t, group=group)


def gather_stats(got: np.ndarray, absmax: bool, div: float, ranks: Sequence[int]) -> StepStats:
    """The full gradients' statistics from every rank's table ``got`` ``[world, P, 3]``:
    norms add in quadrature, the largest magnitude is the largest; ``div`` unscales;
    ``shard_ranks`` names the (global) ranks whose piece was non-finite."""
    P = got.shape[1]
    norms = got[:, :, 0].astype(np.float64)
    has = got[:, :, 2].max(axis=0) > 0
    norm = np.sqrt(np.einsum("wp,wp->p", norms, norms))  # (squares of float32 values cannot overflow float64)
    if div != 1.0:
        norm /= div
    norm[~has] = np.nan
    if absmax:
        amax = got[:, :, 1].max(axis=0).astype(np.float64)  # (NaN propagates through max)
        if div != 1.0:
            amax /= div
        amax[~has] = np.nan
    else:
        amax = np.full(P, np.nan)
    st = StepStats(norm, amax, np.zeros(P, dtype=np.int64), has, shard_ranks={})
    if not np.isfinite(norm[has]).all():  # (a sum of squares is finite when every piece is)
        bad = ~np.isfinite(norms)
        st.shard_ranks = {int(i): [int(ranks[r]) for r in np.nonzero(bad[:, i])[0]] for i in np.nonzero(bad.any(0))[0]}
    return st


def exact_table(pieces: Sequence[Optional[Tensor]], idx: Sequence[int]) -> Tensor:
    """``[len(idx), 2]`` float64 of the suspects (a non-finite norm): the count of NaN/Inf
    entries of this rank's piece, and the norm of the piece scaled by its largest finite
    magnitude (so that squares cannot overflow) times that magnitude."""
    rows = []
    for i in idx:
        g = pieces[i]
        if g is None or not g.numel():
            rows.append(torch.zeros(2, dtype=torch.float64))
            continue
        g = g.detach().double()
        bad = (~torch.isfinite(g)).sum().double()
        m = g.abs().max()
        norm = (g / m).norm() * m if torch.isfinite(m) and m > 0 else g.norm()
        rows.append(torch.stack([bad, norm]).cpu())
    return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.float64)


def rescue(st: StepStats, pieces: Sequence[Optional[Tensor]], group: Any, div: float) -> bool:
    """Exact counts and float64 norms of the parameters whose norm is non-finite (every
    rank has the same suspects, so every rank makes the same one collective). Returns
    whether it ran."""
    if not st.shard_ranks:  # (a norm is non-finite only where a rank's piece is)
        return False
    idx = [int(i) for i in np.nonzero(st.has_grad & ~np.isfinite(st.norm))[0]]
    if not idx:
        return False
    got = gather(exact_table(pieces, idx), group).numpy()
    for k, i in enumerate(idx):
        st.nonfinite[i] = int(got[:, k, 0].sum())
        if not st.nonfinite[i]:
            st.norm[i] = math.sqrt(float(np.dot(got[:, k, 1], got[:, k, 1]))) / div
    return True


def global_ranks(group: Any) -> List[int]:
    """The global rank of each rank of ``group``."""
    dist = torch.distributed
    return [dist.get_global_rank(group, r) if group is not dist.group.WORLD else r
            for r in range(dist.get_world_size(group))]
