"""Cross-rank consistency checks: do gradients, parameters and buffers agree on every rank?

Every check is *collective*: every rank of the group calls it at the same point of the
program, and every rank gets the same `ConsistencyReport`. A check is a short
list of steps (see ``_check``):

1. the arguments, validated once (bad ones raise ``GraddbgValueError`` /
   ``GraddbgTypeError`` on the calling rank, before any collective);
2. local fingerprints of every tensor (`fingerprints`), computed with torch's own
   kernels on the tensors' device, the same code on CPU and GPU: every word of every
   tensor mixed with its position, in one fused kernel where ``torch.compile`` made one
   (`set_fingerprint_kernel`), else in chunks that stay near the cache, then a few kernels
   over the small table of block values, no host synchronisation; the result is an int64
   ``[tensors x k]`` table
   and its digest (two hashes modulo primes near 2**31), one host synchronisation;
3. the rendezvous: one all-gather of a 7-integer header
   on a gloo group (the group itself when it is a gloo group, a gloo side group
   otherwise, created once per group and cached, see `prepare`), waited for at
   most ``timeout``: a hash of the names, shapes and dtypes of the tensors, their count,
   a hash of what was asked, the world size, the digest, and the time the rank started
   waiting. When the exchange has not ended within a quarter of a second, this rank
   writes its count of checks entered to the process group's store (healthy checks make
   no store round trip). When some rank never arrives, the others' wait times out and
   every rank that did arrive raises `DDPTimeoutError` naming the ranks whose counters
   are behind its own, instead of hanging; a rank that arrives after the others gave up sees from
   their times that it is late, and raises too. (Where the store cannot be reached, a
   monitored barrier on that gloo group names the missing ranks first.)
4. the structure, before any value: a rank whose fingerprinting failed says so in its
   header, so that every rank raises; ranks whose models differ raise
   `DDPInconsistencyError` naming the first difference (only then are the names
   themselves exchanged). When every digest is equal the check is over: consistent.
5. only when the digests differ, one all-gather of the fingerprint tables, to find which
   tensors differ on which ranks; with ``details=True``, then, the differing tensors
   themselves (and only those) to report the largest difference per rank. Whole tensors
   never travel otherwise.

Two modes. With ``atol == rtol == 0`` (the default) the comparison is *bitwise*: a
fingerprint is two 64-bit lanes in which every element's bits are mixed with its
position, exact integer arithmetic (see `fingerprints` for what is guaranteed): any
change of a single element is always caught, and every other change (a permutation, a
transpose, swapped rows, a uniform offset, sign flips, any number of one-ulp changes)
escapes with a probability of about 2**-62 to 2**-64 when it was not built against the
fixed weights; the same NaN on every rank is consistent. Weakened against the word sums
this replaced: a change of several elements in one block that altered the block's word
sum was always caught, and is now caught with that probability; and the fingerprint
reads every word several times from the cache (several times the cost of one read of the
tensors on a CPU; bench/ddp_check.py measures it).

With a tolerance, the fingerprint is the float64 sum, sum of squares and sum of absolute
values of the finite elements and the counts of NaN, +Inf and -Inf; two ranks disagree when a count differs or a sum differs by more than elementwise
``|a - b| <= atol + rtol * |b|`` allows. A tolerance mismatch is therefore certain; a
pass means the sums agree within those bounds. Tolerance mode exchanges the sums first
and the counts only for tensors whose sums are not finite on some rank. It casts every
element to float64 (in slices of bounded size): prefer the bitwise mode for checks on
every step.

When several ranks disagree, the reference is the largest group of ranks that agree
(ties go to the group holding the lowest rank), and every other rank is reported.

Usage with DDP (``torchrun --nproc-per-node=4 train.py`` on one machine, or
``torchrun --nnodes=2 --node-rank=$NODE_RANK --nproc-per-node=8 --rdzv-endpoint=$MASTER_ADDR:29500 train.py``
on several)::

    model = DDP(net)
    ddp_verify.prepare()        # once, on every rank: creates the gloo side group under NCCL
    for step, (x, y) in enumerate(loader):
        loss_fn(model(x), y).backward()
        if step % 100 == 0:
            report = ddp_verify.check_gradients(model)     # before optimizer.step()
            if not report.ok:
                print(report)
        opt.step(); opt.zero_grad()

Gradient accumulation with ``no_sync``: check right before ``optimizer.step()``, that is
after the backward that should have synchronised. If a loop got its ``no_sync`` logic
wrong (the last micro-batch inside ``no_sync``, an off-by-one), the gradients the
optimizer is about to use differ across ranks and the check names them;
`check_parameters` after the step catches weights that have already drifted apart.

Sharded models (FSDP2's ``fully_shard``, HSDP, DTensor tensor parallelism). The checks
compare replicas, tensor by tensor and shard by shard. Each rank fingerprints what it
holds of every tensor (a DTensor's ``to_local()`` shard) and each tensor is compared with
exactly the ranks that should hold the same values: by default the ranks holding the
same shard of it (the same coordinates on every mesh dimension over which it is not
``Replicate``), found from a hash of each rank's shard gathered with the fingerprints;
the exchange runs over the default group: every rank calls the check, gets the same
verdict, and ranks are named by their global rank. On HSDP (a ``(replicate, shard)``
mesh) a parameter's replicas lie along ``replicate``; under tensor parallelism over ``tp``
with data parallelism over ``dp`` (``replicate``, ``DistributedDataParallel(...,
device_mesh=mesh["dp"])`` or gradients averaged by hand), a shard's along ``dp``; a
``Replicate`` placement and a plain (non-DTensor) tensor of a sharded model, such as a
LayerNorm weight left out of a tensor-parallel plan or a buffer, are compared across
every rank (the TP group included). ``group=`` may name the replicas instead, for every
tensor: a mesh dimension name (``group="replicate"``, looked up on the DTensors' mesh, or
on the mesh it was sliced from), a 1-D ``DeviceMesh`` or a ProcessGroup (each rank passes
its own). A group that puts ranks holding different shards together is refused
(GraddbgValueError, naming the tensor and both shards). Only when no tensor is replicated
anywhere (pure FSDP, every parameter sharded over the whole mesh) do the checks say that
there is nothing to compare (GraddbgValueError) rather than compare shards that differ by
design; ``graddbg.watch`` gives the statistics of the full gradients there. A sharded model's
check gathers every rank's fingerprint table (24 bytes per tensor) besides the header.
``report.replica_groups`` lists the groups compared; a differing shard's row carries its
``local_shape`` and ``shard`` (placements, mesh, coordinates)::

    mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("replicate", "shard"))
    model = fully_shard(model, mesh=mesh)                      # HSDP
    ...
    loss.backward()
    report = ddp_verify.check_gradients(model)                 # or group="replicate"
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import re
import time
from datetime import timedelta
from typing import Any, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from graddbg._collective import keep_work, run_collective
from graddbg._compiled import KINDS, Twin
from graddbg._errors import (DDPInconsistencyError, DDPTimeoutError, GraddbgError,
                             GraddbgTypeError, GraddbgValueError)
from graddbg._model import check_model, clean_name, is_dtensor, local_tensor, unwrap

__all__ = [
    "ConsistencyReport",
    "Mismatch",
    "check_gradients",
    "check_parameters",
    "check_buffers",
    "check_replicas",
    "fingerprints",
    "prepare",
    "set_fingerprint_kernel",
]

_BLOCK = 1024                   # int32 words per block of the bitwise fingerprint
_ROWS = 512                     # blocks mixed per chunk (2 MB of words: few calls, near the cache)
_SMALL = 16 * 1024              # tensors of at most this many words are mixed together
_KEY_SEED = 0x67726164646267    # seeds the fixed keys (_keys)
_MIX32 = 0x45D9F3B              # odd multiplier between the two folds of a word
_MIN_COMPILED_ROWS = 2          # fewer blocks: eager (a compiled call would specialise on 1)
_RENT = 2.0                     # seconds of eager fingerprints after which they are compiled
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: a block's position, spread
_LANE_SEEDS = (0x243F6A8885A308D3, 0x13198A2E03707344)   # one per 64-bit lane
_DIGEST_PRIMES = (2_147_483_647, 2_147_483_629)  # the digest of a table: two primes below 2**31
_MULT = 1_103_515_245           # digest weight of position i is (i + 1) * _MULT mod the prime
_CHUNK = 1 << 20                # tolerance sums cast at most this many elements at a time
_MAX_DETAIL_TENSORS = 16        # details=True gathers at most this many differing tensors
_DETAIL_BYTES = 1 << 25         # ... in slices of at most this many bytes over all ranks
_MAX_STR_ROWS = 10              # str(report) shows at most this many rows
_BITWISE_K = 3                  # present, two 64-bit lanes
_TOLERANCE_K = 7                # present, nan, +inf, -inf, sum, sum of squares, sum of |x|

Timeout = Union[timedelta, float, int]
_KEY_CACHE: dict = {}           # the fingerprint keys, per device (_keys)


# --------------------------------------------------------------------------- fingerprints
def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a flat tensor in row-major order (dense; complex as its real view)."""
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.reshape(-1)


def _words(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as flat little-endian int32 words (8-byte elements give two
    words each; 1- and 2-byte elements are packed 4 or 2 to a word, the last word
    zero-padded). A view, unless ``t`` is not contiguous, its byte count is not a multiple
    of 4 or its start is not on a word boundary."""
    if t.layout == torch.strided and t.element_size() == 4 and t.is_contiguous() \
            and not t.is_complex():
        return t.detach().view(-1).view(torch.int32)            # the common case, quickly
    flat = _flat(t).contiguous()
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    if flat.element_size() in (4, 8):
        return flat.view(torch.int32)
    raw = flat.view(torch.uint8)
    if raw.numel() % 4:
        raw = torch.cat([raw, raw.new_zeros(-raw.numel() % 4)])
    try:
        return raw.view(torch.int32)
    except RuntimeError:                 # a view that does not start on a word boundary
        return raw.clone().view(torch.int32)


def _keys(device: torch.device) -> torch.Tensor:
    """The fixed weights, ``[_BLOCK]`` int64 on ``device``: one odd 64-bit weight per
    position in a block. Drawn once from a seeded CPU generator, so they are the same on
    every machine and device; cached per device."""
    key = str(device)
    if key not in _KEY_CACHE:
        g = torch.Generator().manual_seed(_KEY_SEED)
        keys = torch.randint(-2 ** 63, 2 ** 63 - 1, (_BLOCK,), generator=g, dtype=torch.int64)
        _KEY_CACHE[key] = (keys | 1).to(device)
    return _KEY_CACHE[key]


def _block_kernel(rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The int64 value of each block (row) of int32 words: ``sum_j K_j h_j`` modulo 2**64
    of the mixed words ``h_j = fold(M * fold(w_j))`` (sign-extended), ``fold(x) = x ^
    (x >>> 16)``, j the position in the block, K_j odd (`_keys`). Rows shorter than a block
    take the first weights. Written as one expression so that ``torch.compile`` fuses it
    into one pass (`_KERNEL`); it is also the eager reference of that kernel's self-test."""
    h = rows ^ ((rows >> 16) & 0xFFFF)
    h = h * _MIX32
    h = h ^ ((h >> 16) & 0xFFFF)
    return (h.to(torch.int64) * keys[: rows.shape[1]]).sum(1)


def _kernel_samples(device: torch.device) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Words for the compiled kernel's self-test: every bit pattern class, two heights."""
    g = torch.Generator().manual_seed(_KEY_SEED + 1)
    words = torch.randint(-2 ** 31, 2 ** 31, (67, _BLOCK), generator=g, dtype=torch.int64)
    words[0, :4] = torch.tensor([0, -1, -2 ** 31, 2 ** 31 - 1])
    words = words.to(torch.int32).to(device)
    return [(words, _keys(device)), (words[: _MIN_COMPILED_ROWS + 3], _keys(device))]


# the fused fingerprint kernel: compiled once eager fingerprints have cost about as much
_KERNEL = Twin(_block_kernel, _kernel_samples, rent=_RENT)


def _fold(x: torch.Tensor, out: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """``out = x ^ (x >>> 16)`` on int32 words (a logical shift: a bijection of each word)."""
    torch.bitwise_right_shift(x, 16, out=tmp)
    return torch.bitwise_xor(x, tmp.bitwise_and_(0xFFFF), out=out)


def _eager_blocks(rows: torch.Tensor, keys: torch.Tensor, buffers: Tuple[torch.Tensor, torch.Tensor]
                  ) -> torch.Tensor:
    """`_block_kernel` in place, in scratch ``buffers`` (two int32 rows and one int64 row
    of a chunk's size): the same values."""
    shape, width = rows.shape, rows.shape[1]
    h, tmp = (b[: rows.numel()].view(shape) for b in buffers[0])
    _fold(rows, h, tmp).mul_(_MIX32)
    _fold(h, h, tmp)
    wide = buffers[1][: rows.numel()].view(shape)
    wide.copy_(h)
    return wide.mul_(keys[:width]).sum(1)


def _full_blocks(rows: torch.Tensor, keys: torch.Tensor,
                 buffers: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The block values of ``[blocks, _BLOCK]`` words: through the compiled kernel in one
    call where there is one (`_KERNEL`), else eagerly in chunks of ``_ROWS`` blocks (the
    mixed words of a chunk stay in cache), their time counted towards compiling."""
    kernel = _KERNEL.due(rows.device) if rows.shape[0] >= _MIN_COMPILED_ROWS else None
    if kernel is not None:
        return kernel(rows, keys)
    start = time.perf_counter()
    out = torch.cat([_eager_blocks(rows[s: s + _ROWS], keys, buffers)
                     for s in range(0, rows.shape[0], _ROWS)])
    _KERNEL.charge(time.perf_counter() - start)
    return out


def _tensor_blocks(words: torch.Tensor, keys: torch.Tensor,
                   buffers: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The block values (see `_block_kernel`) of one tensor's words; the last block may be
    partial. No words: no blocks."""
    n = words.numel()
    full = n // _BLOCK
    parts = [_full_blocks(words[: full * _BLOCK].view(full, _BLOCK), keys, buffers)] if full else []
    if n > full * _BLOCK:
        parts.append(_eager_blocks(words[full * _BLOCK:].view(1, -1), keys, buffers))
    return torch.cat(parts) if parts else words.new_zeros(0, dtype=torch.int64)


def _buffers(device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Scratch rows for `_eager_blocks` on ``device``."""
    return (torch.empty(2, _ROWS * _BLOCK, dtype=torch.int32, device=device),
            torch.empty(_ROWS * _BLOCK, dtype=torch.int64, device=device))


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser (a bijection of int64, with logical shifts), in place."""
    for shift, mult in ((30, -4658895280553007687), (27, -7723592293110705685), (31, None)):
        z.bitwise_xor_((z >> shift) & ((1 << (64 - shift)) - 1))
        if mult is not None:
            z.mul_(mult)
    return z


def _finish(segments: List[Tuple[torch.Tensor, List[int], List[int]]], present: List[bool],
            device: torch.device) -> torch.Tensor:
    """The ``[tensors, 3]`` bitwise table on ``device`` from ``segments`` of block values
    (values, the tensors they belong to, in order, and how many blocks each has): present,
    then two lanes, each the sum modulo 2**64 of ``mix64(value_b + b * G + seed)`` over the
    tensor's blocks b (one seed per lane)."""
    n = len(present)
    ks = [k for _, owners, _ in segments for k in owners]
    counts = [c for _, _, cs in segments for c in cs]
    value = (torch.cat([vals.to(device) for vals, _, _ in segments]) if segments else
             torch.zeros(0, dtype=torch.int64, device=device))
    # one host-to-device copy of the owners and counts; the rest on ``device``
    host = torch.tensor([ks, counts], dtype=torch.int64).to(device) if ks else \
        torch.zeros(2, 0, dtype=torch.int64, device=device)
    starts = torch.cumsum(host[1], 0) - host[1]
    owner = torch.repeat_interleave(host[0], host[1], output_size=value.numel())
    block = torch.arange(value.numel(), device=device) - torch.repeat_interleave(
        starts, host[1], output_size=value.numel())
    z = (value + block * _GOLDEN)[None] + torch.tensor(_LANE_SEEDS, device=device)[:, None]
    slots = owner + torch.arange(0, 2 * n, n, device=device)[:, None]      # (lane, tensor), flat
    sums = torch.zeros(2 * n, dtype=torch.int64, device=device).scatter_add_(
        0, slots.reshape(-1), _mix64(z).reshape(-1))    # wraps modulo 2**64; 1-D: deterministic
    flags = torch.tensor(present, dtype=torch.int64, device=device)
    return torch.cat([flags, sums]).view(3, n).t().contiguous()


def _small_words(small: List[Tuple[int, torch.Tensor]]) -> List[Tuple[List[int], torch.Tensor]]:
    """Small tensors as rows of int32 words, in groups: tensors of one 4-byte dtype and
    shape stacked into one ``[count, words]`` matrix (one copy, whatever their strides),
    any other alone (`_words`); with the indices of the tensors of each group."""
    groups: dict = {}
    for k, t in small:
        fast = t.layout == torch.strided and t.element_size() == 4 and not t.is_complex()
        groups.setdefault((t.dtype, tuple(t.shape)) if fast else k, []).append((k, t))
    out = []
    with torch.no_grad():
        for key, members in groups.items():
            if isinstance(key, tuple):
                rows = torch.stack([t for _, t in members]).reshape(len(members), -1)
                out.append(([k for k, _ in members], rows.view(torch.int32)))
            else:
                out.append(([key], _words(members[0][1]).reshape(1, -1)))
    return out


def _packed_blocks(small: List[Tuple[int, torch.Tensor]], keys: torch.Tensor,
                   buffers: Tuple[torch.Tensor, torch.Tensor]) -> Tuple[torch.Tensor, List[int], List[int]]:
    """The block values of many small tensors (one device) in one pass: their words laid
    out block-aligned, each padded with the zeros that fill its last block (as
    `_tensor_blocks` counts them), in one concatenation; the values, the tensors
    they belong to, in order, and how many blocks each has."""
    pieces: List[torch.Tensor] = []
    ks: List[int] = []
    counts: List[int] = []
    for members, rows in _small_words(small):
        width = rows.shape[1]
        count = -(-width // _BLOCK)
        if count * _BLOCK > width:
            rows = torch.cat([rows, rows.new_zeros(rows.shape[0], count * _BLOCK - width)], dim=1)
        pieces.append(rows.reshape(-1))
        ks += members
        counts += [count] * len(members)
    return _tensor_blocks(torch.cat(pieces), keys, buffers), ks, counts


def _bitwise_table(tensors: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
    """The bitwise table (see `fingerprints`) on the first tensor's device. Tensors
    of at most ``_SMALL`` words are mixed together, per device (`_packed_blocks`)."""
    home = next(t.device for t in tensors if t is not None)
    buffers: dict = {}
    segments: List[Tuple[torch.Tensor, List[int], List[int]]] = []
    small: dict = {}
    for k, t in enumerate(tensors):
        if t is None:
            continue
        if t.device not in buffers:
            buffers[t.device] = _buffers(t.device)
        if t.numel() * t.element_size() <= 4 * _SMALL:
            small.setdefault(t.device, []).append((k, t))
        else:
            vals = _tensor_blocks(_words(t), _keys(t.device), buffers[t.device])
            segments.append((vals, [k], [vals.numel()]))
    for device, items in small.items():
        segments.append(_packed_blocks(items, _keys(device), buffers[device]))
    return _finish(segments, [t is not None for t in tensors], home)


def _digest(table: torch.Tensor) -> torch.Tensor:
    """Two int64 hashes of a whole fingerprint table (weighted sums modulo two primes).

    Equal tables give equal digests; tables that differ give different digests unless a
    difference is a multiple of both primes (about 2**62) or the differences cancel in both
    weighted sums at once.
    """
    flat = table.reshape(1, -1)
    primes = torch.tensor(_DIGEST_PRIMES, dtype=torch.int64).to(flat.device)[:, None]
    weights = torch.arange(1, flat.shape[1] + 1, device=flat.device).mul_(_MULT).remainder(primes)
    return flat.remainder(primes).mul_(weights).remainder_(primes).sum(1)


def _float_sums(x: torch.Tensor, counts: bool) -> torch.Tensor:
    """float64 ``[sum, sum of squares, sum of |x|]`` of a flat tensor (NaN/Inf propagate),
    or with ``counts`` ``[nan, +inf, -inf, sum, ...]``: the counts, then the sums of the
    finite elements. Cast to float64 in slices of at most ``_CHUNK`` elements, one buffer
    for all of them (bounded memory that stays in cache)."""
    acc = torch.zeros(6 if counts else 3, dtype=torch.float64, device=x.device)
    buffer = torch.empty(min(x.numel(), _CHUNK), dtype=torch.float64, device=x.device)
    for piece in x.split(_CHUNK):
        d = buffer[: piece.numel()].copy_(piece)
        parts = []
        if counts:
            parts = [torch.isnan(d).sum(), (d == math.inf).sum(), (d == -math.inf).sum()]
            d.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        acc += torch.stack([p.to(torch.float64) for p in parts] +
                           [d.sum(), torch.dot(d, d), d.abs_().sum()])
    return acc


def _tolerance_row(t: Optional[torch.Tensor], counts: bool) -> torch.Tensor:
    """``[present, nan, +inf, -inf, sum, sumsq, sumabs]`` with the sums over the finite
    elements (``counts``), or the cheap first round ``[present, sum, sumsq, sumabs]`` over
    every element; zeros for an absent tensor."""
    if t is None:
        return torch.zeros(_TOLERANCE_K if counts else 4, dtype=torch.int64)
    sums = _float_sums(_flat(t), counts)
    one = torch.ones(1, dtype=torch.int64, device=sums.device)
    if not counts:
        return torch.cat([one, sums.view(torch.int64)])
    return torch.cat([one, sums[:3].to(torch.int64), sums[3:].view(torch.int64)])


def _tolerance_table(tensors: Sequence[Optional[torch.Tensor]], device: torch.device,
                     counts: bool = True) -> torch.Tensor:
    """The tolerance rows of every tensor (see `_tolerance_row`), on ``device``."""
    k = _TOLERANCE_K if counts else 4
    if not tensors:
        return torch.zeros(0, k, dtype=torch.int64, device=device)
    return torch.stack([_tolerance_row(t, counts).to(device) for t in tensors])


def _tolerance_quick_table(tensors: Sequence[Optional[torch.Tensor]],
                           device: torch.device) -> torch.Tensor:
    """Round one of tolerance mode: ``[present, sum, sumsq, sumabs]`` per tensor."""
    return _tolerance_table(tensors, device, counts=False)


def fingerprints(tensors: Sequence[Optional[torch.Tensor]], *, mode: str = "bitwise",
                 device: Optional[torch.device] = None) -> torch.Tensor:
    """Per-tensor fingerprints, computed locally (no communication), as an int64 ``[n, k]`` table.

    ``mode="bitwise"``: columns ``present, lane_a, lane_b``, computed from the raw bits
    with integer arithmetic only, so they are exact and the same on every machine and
    device. The bytes of a tensor (dense, row-major; complex as its real view) are read as
    little-endian int32 words (8-byte elements give two; 1- and 2-byte elements are packed,
    the last word zero-padded), in blocks of ``_BLOCK`` (1024) words. Every word ``w`` at
    position j of its block is mixed, ``h = fold(M * fold(w))`` with ``fold(x) = x ^
    (x >>> 16)`` (a bijection: any change of a word changes h, and high bits reach the low
    ones), and each block gets one weighted sum ``v = sum_j K_j h_j`` modulo 2**64 (h
    sign-extended) with a fixed odd 64-bit weight per position (from a seeded generator).
    The value of block b is mixed with b and a seed per lane by SplitMix64's finaliser (a
    bijection) and each lane is the sum of those over the blocks, modulo 2**64.
    Guaranteed:

    * a change of a single element is always detected (fold and multiply are bijections,
      so its mixed word changes, by less than 2**32 in absolute value, and an odd weight
      times such a difference is not 0 modulo 2**64); so is any change that alters one
      block's value alone (the finaliser is a bijection, so that block's term changes in
      both lanes);
    * everything else (permutations, transposes, swapped rows, uniform offsets, sign
      flips, many one-ulp changes, changes over many blocks) escapes only if the weighted
      sum of every changed block cancels, or the changed blocks' terms cancel in both
      64-bit lanes at once. For weights drawn independently of the change (odd: 63 random
      bits each) the first has probability at most 2**-(63 - v), v the lowest changed bit
      of the mixed words (0 for all but contrived changes: the two folds bring changes of
      the high bits, a sign flip included, down to the low ones); the second about 2**-64
      for the SplitMix64 finaliser. About 1 in 2**63 overall; weaker than the "always" of
      the word sums this replaced only for changes that sums could see anyway.

    The block sums run as one fused kernel (``torch.compile``, used only after it matched
    the eager kernel bit for bit on a self-test) once eager fingerprints have cost about two
    seconds in this process, or at once after ``set_fingerprint_kernel("compiled")``; both
    give the same values, so ranks may differ in which they use.

    Every element's position enters (its weights within the block, its block through the
    mix), so no reordering is invisible by construction. Not cryptographic: the weights
    are fixed and public, so a change built against them can collide. NaNs compare by
    their bits: the same NaN is consistent, ``-0.0`` differs from ``0.0``.

    ``mode="tolerance"``: ``present, nan, posinf, neginf`` and the float64
    ``sum, sum_of_squares, sum_abs`` of the finite elements, stored bit for bit in int64
    (``table[:, 4:].view(torch.float64)``). ``None`` entries get ``present == 0``.
    Computed on the tensors' device; the table lands on ``device`` (default: the first
    tensor's device).

    Args:
        tensors: the tensors, or None for an absent one (entries are not checked: anything
            else fails inside torch).
        mode: ``"bitwise"`` or ``"tolerance"``.
        device: where the table lands (None: the first tensor's device, or the CPU when
            every entry is None).

    Returns:
        torch.Tensor: the int64 ``[len(tensors), k]`` table, k = 3 (bitwise) or 7
            (tolerance); no rows for an empty ``tensors``.

    Raises:
        GraddbgValueError: ``mode`` is neither ``"bitwise"`` nor ``"tolerance"``.

    Examples:
        >>> a = torch.tensor([1.0, float("nan"), 3.0])
        >>> b = a.clone(); b[2] = 3.0000002
        >>> fp = fingerprints([a, a.clone(), b, None])
        >>> fp.shape
        torch.Size([4, 3])
        >>> bool((fp[0] == fp[1]).all()), bool((fp[0] == fp[2]).all()), fp[3, 0].item()
        (True, False, 0)
    """
    if mode not in ("bitwise", "tolerance"):
        raise GraddbgValueError(f"fingerprints(mode=...): got {mode!r}; accepted: 'bitwise', "
                                f"'tolerance'")
    if device is None:
        device = next((t.device for t in tensors if t is not None), torch.device("cpu"))
    if mode == "tolerance":
        return _tolerance_table(tensors, device)
    if all(t is None for t in tensors):
        return torch.zeros(len(tensors), _BITWISE_K, dtype=torch.int64, device=device)
    return _bitwise_table(tensors).to(device)


def set_fingerprint_kernel(kind: str = "auto", *, device: Any = "cpu") -> str:
    """Choose how the bitwise fingerprints compute their block sums (local to this process).

    ``"auto"`` (the default): eagerly, in a few torch kernels per chunk, until that has
    cost about two seconds in this process, then through one fused kernel compiled by
    ``torch.compile`` (a few seconds, once; used only after it gave the eager result bit
    for bit on a self-test, else eager for good). ``"compiled"``: compile for ``device``
    now (a predictable moment, e.g. before training) and use it from now on.
    ``"eager"``: never compile. The fingerprints are the same whichever is used, so ranks
    may choose differently. On a CPU the compiled kernel reads the words once (about 1.5-2x
    one read of the data against about 15-20x eagerly); it needs a C++ compiler on CPUs and
    triton on GPUs.

    Args:
        kind: ``"auto"``, ``"compiled"`` or ``"eager"``.
        device: the device to compile for with ``"compiled"`` (a ``torch.device`` or its
            name; other devices compile when first used).

    Returns:
        str: the kind now in use: ``"auto"``, ``"compiled"``, ``"eager"``, or ``"eager:
        <why>"`` when compiling failed (the reason, e.g. no C++ compiler).

    Raises:
        GraddbgValueError: ``kind`` is not one of the three, or ``device`` is not a device.

    Examples:
        >>> set_fingerprint_kernel("eager")
        'eager'
        >>> set_fingerprint_kernel()
        'auto'
    """
    if kind not in KINDS:
        raise GraddbgValueError(f"set_fingerprint_kernel(kind=...): got {kind!r}; accepted: "
                                f"{', '.join(map(repr, KINDS))}")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise GraddbgValueError(f"set_fingerprint_kernel(device=...): got {device!r}; accepted: "
                                f"a torch.device or a device name such as 'cpu' or 'cuda'") from exc
    return _KERNEL.select(kind, device)


# --------------------------------------------------------------------------- the report
@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One tensor on one rank that disagrees with the reference rank."""

    name: str
    rank: int
    reference_rank: int
    reason: str
    shape: Tuple[int, ...]
    dtype: str
    fingerprint: str
    reference_fingerprint: str
    max_abs_diff: float = float("nan")     # details=True only
    n_diff: Optional[int] = None           # details=True: elements that differ
    index: Optional[Tuple[int, ...]] = None  # details=True: where the largest difference is
    value: Optional[float] = None          # details=True: this rank's value there
    reference_value: Optional[float] = None
    local_shape: Optional[Tuple[int, ...]] = None  # a DTensor: the shape of this rank's shard
    shard: Optional[str] = None            # a DTensor: its placements and this rank's coordinates
    kind: str = ""                         # "gradients", "parameters" or "buffers"
    cause: str = ""                        # what probably happened, in plain words


@dataclasses.dataclass(frozen=True)
class ConsistencyReport:
    """The verdict of a collective check; the same on every rank.

    ``ok`` (also ``bool(report)``), ``world_size``, ``rank`` (this process's rank in the
    group), ``kind`` ("gradients", "parameters" or "buffers"), ``mode`` ("bitwise" or
    "tolerance"), ``checked`` (number of tensors compared), ``rows`` (the
    `Mismatch` records) and ``mismatches``, the same as a DataFrame. On a sharded
    model, ``replica_groups`` holds the groups of (global) ranks that were compared with
    each other, shard by shard; it is empty otherwise (every rank of the group compared).
    """

    ok: bool
    world_size: int
    rank: int
    kind: str
    mode: str
    checked: int
    rows: Tuple[Mismatch, ...] = ()
    atol: float = 0.0
    rtol: float = 0.0
    replica_groups: Tuple[Tuple[int, ...], ...] = ()

    def __bool__(self) -> bool:
        return self.ok

    @property
    def names(self) -> List[str]:
        """Names of the tensors that differ somewhere, in model order, without repeats."""
        return list(dict.fromkeys(m.name for m in self.rows))

    @property
    def ranks(self) -> List[int]:
        """Ranks that differ from the reference on some tensor, sorted."""
        return sorted({m.rank for m in self.rows})

    @property
    def max_abs_diff(self) -> float:
        """The largest difference measured (``details=True``); NaN when none was measured."""
        values = [m.max_abs_diff for m in self.rows if m.max_abs_diff == m.max_abs_diff]
        return max(values) if values else float("nan")

    @property
    def mismatches(self) -> Any:
        """A pandas DataFrame, one row per (tensor, rank) that differs from the reference."""
        import pandas as pd

        columns = [f.name for f in dataclasses.fields(Mismatch)]
        return pd.DataFrame([dataclasses.astuple(m) for m in self.rows], columns=columns)

    def summary(self) -> str:
        """One line: the verdict, the first differing tensor and the ranks."""
        head = f"{self.kind} ({self.mode}) across {self.world_size} ranks"
        if len(self.replica_groups) > 1:
            head += (", shard by shard within the replica groups "
                     + " ".join(str(list(g)) for g in self.replica_groups))
        if self.ok:
            return f"{head}: consistent ({self.checked} tensors)"
        first = self.rows[0]
        return (f"{head}: {len(self.names)} of {self.checked} tensors differ, first "
                f"{first.name!r} on rank(s) {sorted({m.rank for m in self.rows if m.name == first.name})} "
                f"({first.reason}); ranks that differ: {self.ranks}")

    def __str__(self) -> str:
        lines = [f"ConsistencyReport[rank {self.rank}]: {self.summary()}"]
        if not self.ok:
            mixed = len({m.kind for m in self.rows}) > 1 or " and " in self.kind
            header = ("name",) + (("of",) if mixed else ()) + ("rank", "ref", "reason", "max_abs_diff")
            table = [header] + [
                (m.name,) + ((m.kind,) if mixed else ()) + (str(m.rank), str(m.reference_rank), m.reason,
                 "" if m.max_abs_diff != m.max_abs_diff else f"{m.max_abs_diff:.4g}")
                for m in self.rows[:_MAX_STR_ROWS]]
            widths = [max(len(r[i]) for r in table) for i in range(len(header))]
            lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
            if len(self.rows) > _MAX_STR_ROWS:
                lines.append(f"  ... and {len(self.rows) - _MAX_STR_ROWS} more rows "
                             "(report.mismatches has them all)")
            causes = list(dict.fromkeys((m.cause, m.kind) for m in self.rows if m.cause))
            for cause, kind in causes[:_MAX_STR_ROWS]:
                first = next(m for m in self.rows if m.cause == cause)
                lines.append(f"  probably ({first.name!r} {kind}, rank {first.rank}): {cause}")
        return "\n".join(lines)


# --------------------------------------------------------------------------- arguments
@dataclasses.dataclass(frozen=True)
class _Options:
    """One check's arguments, validated once (see `_options`)."""

    fn: str
    kind: str
    group: Any                  # the group the fingerprints are exchanged over
    atol: float
    rtol: float
    timeout: timedelta
    details: bool
    raise_on_mismatch: bool
    sharded: bool = False       # the model holds DTensors: compare shard by shard, within replicas
    replicas: Optional[Tuple[int, ...]] = None  # sharded, group= given: this rank's replicas
    initial: bool = False       # check_replicas(initial=True): before any optimizer step

    @property
    def parts(self) -> Tuple[str, ...]:
        """What is fingerprinted, in order: "gradients", "parameters" or "buffers"."""
        return tuple(k for k in ("gradients", "parameters", "buffers") if k in self.kind)

    @property
    def mode(self) -> str:
        return "bitwise" if self.atol == 0 and self.rtol == 0 else "tolerance"

    @property
    def call(self) -> str:
        """What was asked; every rank must ask the same (its hash is in the header)."""
        what = f"{self.kind}, initial={self.initial}, " if self.fn == "check_replicas" else ""
        return (f"{self.fn}({what}mode={self.mode}, atol={self.atol!r}, rtol={self.rtol!r}, "
                f"details={self.details})")


def _tolerance_arg(fn: str, arg: str, value: Any) -> float:
    accepted = "accepted: a finite number >= 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GraddbgTypeError(f"{fn}({arg}=...): got {value!r} ({type(value).__name__}); {accepted}")
    try:
        number = float(value)
    except OverflowError:           # an int too large for a float
        number = math.inf
    if not (number >= 0 and math.isfinite(number)):
        raise GraddbgValueError(f"{fn}({arg}=...): got {value!r}; {accepted}")
    return number


def _timeout_arg(fn: str, timeout: Any) -> timedelta:
    if isinstance(timeout, bool) or not isinstance(timeout, (timedelta, int, float)):
        raise GraddbgTypeError(f"{fn}(timeout=...): got {timeout!r} ({type(timeout).__name__}); "
                               f"accepted: a datetime.timedelta or a number of seconds > 0")
    try:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        if seconds > 0 and math.isfinite(seconds):
            return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)
    except OverflowError:
        pass
    shown = timeout if isinstance(timeout, timedelta) else repr(timeout)
    raise GraddbgValueError(f"{fn}(timeout=...): got {shown}; accepted: a positive duration "
                            f"(a datetime.timedelta or a finite number of seconds > 0)")


def _is_mesh(group: Any) -> bool:
    return type(group).__name__ == "DeviceMesh" and hasattr(group, "mesh")


def _group_type(fn: str, group: Any, sharded: Optional[bool]) -> None:
    """``group``'s type: None or a ProcessGroup; with a model (``sharded`` not None), a
    DeviceMesh too, and a mesh dimension name when the model holds DTensors."""
    if group is None or isinstance(group, dist.ProcessGroup) or (
            sharded is not None and (_is_mesh(group) or (sharded and isinstance(group, str)))):
        return
    accepted = "None (the default group) or a torch.distributed.ProcessGroup"
    if sharded is not None:
        accepted += (", a 1-D DeviceMesh, or the name of a DeviceMesh dimension of the model's "
                     "DTensors (such as 'replicate')")
    if isinstance(group, str) and sharded is not None:
        accepted += ("; a dimension name needs a model holding DTensors (fully_shard, "
                     "parallelize_module), and this model holds none")
    raise GraddbgTypeError(f"{fn}(group=...): got {type(group).__name__}; accepted: {accepted}")


def _group_arg(fn: str, group: Any, sharded: Optional[bool] = None) -> None:
    """A bad ``group`` is an argument error; no process group at all is a state error.
    ``sharded``: whether the model holds DTensors (None: there is no model)."""
    if not dist.is_available():
        raise GraddbgError(f"{fn}: this build of torch has no torch.distributed")
    _group_type(fn, group, sharded)
    if _is_mesh(group) and group.ndim != 1:
        raise GraddbgValueError(f"{fn}(group=...): got a {group.ndim}-D DeviceMesh "
                                f"{tuple(group.mesh_dim_names or ())}; accepted: a 1-D mesh, such "
                                f"as mesh['replicate'], or a dimension name, such as 'replicate'")
    if not dist.is_initialized():
        raise GraddbgError(f"{fn}: torch.distributed is not initialized; call "
                           f"torch.distributed.init_process_group(...) on every rank first "
                           f"(or launch with torchrun)")
    if (isinstance(group, dist.ProcessGroup) and dist.get_rank(group) < 0) or \
            (_is_mesh(group) and group.get_coordinate() is None):
        raise GraddbgValueError(f"{fn}(group=...): this process (global rank {dist.get_rank()}) is "
                                f"not a member of the group; call the check only on its members")


def _options(fn: str, kind: str, group: Any, atol: Any, rtol: Any, timeout: Any,
             details: bool, raise_on_mismatch: bool, mesh: Any) -> _Options:
    """The arguments, validated; ``mesh``: the DeviceMesh of the model's DTensors (None
    when it holds none, see `_collect_all`)."""
    options = _Options(fn, kind, group, _tolerance_arg(fn, "atol", atol),
                       _tolerance_arg(fn, "rtol", rtol), _timeout_arg(fn, timeout),
                       bool(details), bool(raise_on_mismatch))
    _group_arg(fn, group, sharded=mesh is not None)
    return _resolve(options, mesh)


# --------------------------------------------------------------------------- sharded models
def _spec(t: Any) -> Optional[Tuple[Any, Tuple[Any, ...], Tuple[int, ...]]]:
    """(mesh, placements, global shape) of a DTensor (FSDP2, HSDP, tensor parallel), or of
    a parameter that ``DistributedDataParallel(model, device_mesh=mesh["dp"])`` holds as its
    local shard of a tensor-parallel DTensor (torch keeps the spec as ``_st_info``); None
    for a plain tensor. Recognised without importing DTensor."""
    if is_dtensor(t):
        return t.device_mesh, tuple(t.placements), tuple(t.shape)
    info = getattr(t, "_st_info", None)
    if info is not None and hasattr(info, "mesh") and hasattr(info, "placements"):
        return info.mesh, tuple(info.placements), tuple(info.shape)
    return None


def _held(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """What this rank holds of ``t``: a DTensor's local shard, else ``t``."""
    return None if t is None else local_tensor(t)


def _layout_entry(spec: tuple, local_shape: Tuple[int, ...]) -> tuple:
    """Which shard of a tensor this rank holds: the mesh (dimension names and sizes), the
    placements, this rank's coordinate on every dimension that is not ``Replicate`` (None
    on those that are) and the local shape. Two ranks holding equal entries hold the same
    shard, so their local tensors should be equal."""
    mesh, placements, _ = spec
    names = tuple(mesh.mesh_dim_names or range(mesh.ndim))
    coords = mesh.get_coordinate() or [None] * mesh.ndim
    held = tuple(None if p.is_replicate() else c for p, c in zip(placements, coords))
    return (names, tuple(mesh.shape), tuple(repr(p) for p in placements), held, local_shape)


def _placement_text(entry: tuple) -> str:
    """Placements and mesh of a layout entry, such as ``(Replicate(), Shard(dim=0)) over
    the mesh (replicate=2, shard=2)``: the same on every rank."""
    names, sizes, placements = entry[:3]
    if all(isinstance(n, str) for n in names):
        mesh = "the mesh (" + ", ".join(f"{n}={k}" for n, k in zip(names, sizes)) + ")"
    else:
        mesh = f"a mesh of shape {tuple(sizes)}"
    return f"({', '.join(placements)}) over {mesh}"


def _shard_text(entry: tuple) -> str:
    """A layout entry for a person: placements, mesh, the shard's coordinates ("*" on the
    dimensions it is replicated over) and the local shape."""
    where = ", ".join("*" if c is None else str(c) for c in entry[3])
    return f"{_placement_text(entry)}, shard at ({where}), local shape {tuple(entry[4])}"


def _model_mesh(model: nn.Module, skip_parameters: bool = False) -> Any:
    """The DeviceMesh of the model's first DTensor parameter or buffer; None when it has
    none (``skip_parameters``: the parameters are known to hold none)."""
    tensors = model.buffers() if skip_parameters else itertools.chain(model.parameters(),
                                                                      model.buffers())
    for t in tensors:
        spec = _spec(t)
        if spec is not None:
            return spec[0]
    return None


def _dim_ranks(fn: str, mesh: Any, name: str) -> List[int]:
    """The global ranks along the mesh dimension ``name`` through this rank: found on the
    DTensors' mesh or, when that is a slice (``mesh["tp"]``), on the mesh it was cut from."""
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    for candidate in (mesh, root):
        names = tuple(candidate.mesh_dim_names or ())
        coords = candidate.get_coordinate()
        if name in names and coords is not None:
            at = tuple(slice(None) if d == names.index(name) else c for d, c in enumerate(coords))
            return candidate.mesh[at].flatten().tolist()
    known = sorted(set(mesh.mesh_dim_names or ()) | set(root.mesh_dim_names or ()))
    raise GraddbgValueError(f"{fn}(group={name!r}): the DeviceMesh of the model's DTensors has no "
                            f"dimension {name!r}; its dimensions: {known} (init_device_mesh(..., "
                            f"mesh_dim_names=...) names them)")


def _resolve(options: _Options, mesh: Any) -> _Options:
    """Where the fingerprints go and who is compared with whom.

    A plain model (``mesh`` None): exchanged over ``group`` (a 1-D DeviceMesh: its process
    group), every rank compared. A model holding DTensors on ``mesh``: exchanged over the
    default group (every rank takes part and gets the same verdict), each rank compared
    with its replicas only: the ranks of ``group`` (a dimension name, a 1-D DeviceMesh or a
    ProcessGroup), or by default the ranks that hold the same shard of every tensor (see
    `_replica_header`)."""
    group = options.group
    if mesh is None:
        exchange = group.get_group() if _is_mesh(group) else group
        return dataclasses.replace(options, group=exchange)
    if group is None:
        return dataclasses.replace(options, group=None, sharded=True)
    if isinstance(group, str):
        ranks = _dim_ranks(options.fn, mesh, group)
    elif _is_mesh(group):
        ranks = group.mesh.flatten().tolist()
    else:
        ranks = dist.get_process_group_ranks(group)
    return dataclasses.replace(options, group=None, sharded=True, replicas=tuple(sorted(ranks)))


def _entry(name: str, t: torch.Tensor, kind: str) -> Tuple[Optional[torch.Tensor], tuple,
                                                          Optional[tuple]]:
    """What one parameter or buffer contributes to a check of ``kind``: the tensor this
    rank holds (a gradient may be None; a DTensor's local shard), its metadata (name,
    global shape, dtype, and for gradients requires_grad) and layout (see
    `_layout_entry`; None for a plain tensor)."""
    source = t.grad if kind == "gradients" else t
    spec = (_spec(source) if source is not None else None) or _spec(t)
    entry = (name, spec[2] if spec else tuple(t.shape), str(t.dtype).replace("torch.", ""))
    if kind == "gradients":
        entry += (bool(t.requires_grad),)
    return _held(source), entry, (None if spec is None else _layout_entry(spec, tuple(_held(t).shape)))


def _collect_all(model: nn.Module, parts: Sequence[str]) -> Tuple[
        List[str], List[Optional[torch.Tensor]], List[tuple], List[Optional[tuple]], List[str], Any]:
    """Names, tensors, metadata and layouts (see `_entry`) of every kind in
    ``parts``, laid end to end, without DDP's ignored ones; the kind of each tensor (a
    gradient's metadata has one field more than a parameter's, so the two are told apart
    in the structure hash); and the DeviceMesh of the model's DTensors (None when it holds
    none). One walk over the parameters (and one over the buffers where needed)."""
    ignore = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()) or ())
    walks = [("buffers", model.named_buffers())] if "buffers" in parts else []
    wanted = [k for k in parts if k != "buffers"]
    if wanted:
        walks.insert(0, ("params", model.named_parameters()))
    found: dict = {k: ([], [], [], []) for k in parts}
    mesh = None
    partitioned = 0
    for walk, items in walks:
        for name, t in items:
            if name in ignore:
                continue
            if walk == "params" and _zero3_partitioned(t):
                partitioned += 1  # (each rank holds other bytes of it: not a replica)
                continue
            if mesh is None and _spec(t) is not None:
                mesh = _spec(t)[0]
            clean = clean_name(name)
            for kind in (["buffers"] if walk == "buffers" else wanted):
                held, entry, lay = _entry(clean, t, kind)
                for column, value in zip(found[kind], (clean, held, entry, lay)):
                    column.append(value)
    if mesh is None:
        mesh = _model_mesh(model, skip_parameters=bool(wanted))
    columns = [sum((found[k][c] for k in parts), []) for c in range(4)]
    kinds = sum(([k] * len(found[k][0]) for k in parts), [])
    if partitioned and not columns[0]:
        raise GraddbgValueError(
            f"nothing to compare: every one of the model's {partitioned} parameters is partitioned by "
            f"DeepSpeed ZeRO-3 (each rank holds different bytes of it, and no two ranks hold the same); "
            f"at ZeRO stages 0-2 every rank holds the full parameters and they are compared")
    return columns[0], columns[1], columns[2], columns[3], kinds, mesh


def _zero3_partitioned(t: Any) -> bool:
    """A parameter that DeepSpeed ZeRO-3 partitioned away: empty here, its full size kept
    as ``ds_numel`` (recognised without importing deepspeed)."""
    return hasattr(t, "ds_id") and t.numel() == 0 and getattr(t, "ds_numel", 0) > 0


# --------------------------------------------------------------------------- groups
def _backend(group: Any) -> str:
    return str(dist.get_backend(group)).lower()


def _comm_device(group: Any, tensors: Sequence[Optional[torch.Tensor]],
                 model: nn.Module) -> torch.device:
    """The device the group's collectives take tensors on."""
    backend = _backend(group)
    if backend in ("gloo", "mpi"):
        return torch.device("cpu")
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    first = next((t.device for t in tensors if t is not None),
                 next((p.device for p in model.parameters()), torch.device("cpu")))
    if first.type == "cuda" and first.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return first


# Barrier groups by group: creating a group is collective, so it happens once per group
# (in prepare() or in the first check) and is cached for the life of the process. The
# entry keeps the group itself alive, so that its id is not reused.
_SIDE_GROUPS: dict = {}


def _barrier_group(group: Any, timeout: timedelta, force_side: bool = False) -> Any:
    """The gloo group the header goes over: ``group`` itself when it is a gloo group, else
    a gloo side group of the same ranks (``monitored_barrier`` and timed waits need gloo)."""
    if not force_side and _backend(group) == "gloo":
        return group
    key = id(group if group is not None else dist.group.WORLD)
    if key not in _SIDE_GROUPS:
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        try:
            side = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout,
                                  use_local_synchronization=True)
        except RuntimeError as err:
            raise DDPTimeoutError(
                f"graddbg.ddp_verify: could not create the gloo side group used to detect "
                f"missing ranks (ranks {ranks}); some rank did not arrive within {timeout}. "
                f"Call graddbg.ddp_verify.prepare() on every rank right after "
                f"init_process_group. Cause: {err}") from err
        _SIDE_GROUPS[key] = (group, side)
    return _SIDE_GROUPS[key][1]


def prepare(group: Any = None, *, timeout: Timeout = timedelta(seconds=300)) -> None:
    """Create (once, cached) the gloo group the checks exchange on (and detect missing ranks with).

    Needed only for groups of another backend than gloo (NCCL, for instance), and even then
    optional: the first check creates it. Creating a group is collective, so call this
    on every rank of ``group`` at the same point, right after ``init_process_group``,
    when a later check may be reached by some ranks only. Checks of a model holding
    DTensors exchange over the default group, whatever their ``group=``: ``prepare()``.
    For a gloo group there is nothing to create.

    Args:
        group: the process group the checks will be given (None: the default group).
        timeout: how long creating the group may wait for the other ranks (a
            ``datetime.timedelta`` or a number of seconds > 0; 300 s).

    Returns:
        None.

    Raises:
        GraddbgTypeError: ``group`` is not None or a ``ProcessGroup``, or ``timeout`` has a
            wrong type.
        GraddbgValueError: a timeout <= 0 or not finite, or a ``group`` this rank is not a
            member of.
        GraddbgError: ``torch.distributed`` is unavailable or not initialized.
        DDPTimeoutError: the gloo group could not be created (some rank did not arrive
            within ``timeout``).

    Examples:
        >>> prepare()  # doctest: +SKIP
    """
    timeout = _timeout_arg("prepare", timeout)
    _group_arg("prepare", group)
    _barrier_group(group, timeout)


# --------------------------------------------------------------------------- the rendezvous
def _timeout_error(fn: str, group: Any, timeout: timedelta, missing: List[int], what: str,
                   said: str) -> DDPTimeoutError:
    """A DDPTimeoutError naming the ranks that did not enter the check (``missing``; when
    they are not known, ``what`` did not complete), carrying them as ``missing_ranks``."""
    rank, world, secs = dist.get_rank(group), dist.get_world_size(group), timeout.total_seconds()
    if missing:
        message = (f"{fn}: rank(s) {missing} of the group (world size {world}) did not enter "
                   f"the check within {secs:g} s (seen from rank {rank}).")
    else:
        message = f"{fn}: {what} did not complete within {secs:g} s (seen from rank {rank})."
    error = DDPTimeoutError(f"{message} Every rank must call {fn} at the same point of the "
                            f"program. After this error the process group may not be usable. "
                            f"(torch.distributed said: {said.strip()[:300]})")
    error.missing_ranks = missing  # type: ignore[attr-defined]
    return error


def _barrier(fn: str, group: Any, timeout: timedelta) -> None:
    """A monitored barrier on the gloo group, naming the ranks that do not arrive (the
    rendezvous where the process group's store cannot be reached)."""
    try:
        dist.monitored_barrier(_barrier_group(group, timeout), timeout=timeout, wait_all_ranks=True)
    except RuntimeError as err:
        found = re.search(r"Ranks? ([\d,\s]+) failed to pass monitoredBarrier", str(err))
        missing = [int(r) for r in re.findall(r"\d+", found.group(1))] if found else []
        raise _timeout_error(fn, group, timeout, missing, "the group's barrier (rank 0, or a "
                             "rank that rank 0 names in its own error, did not enter it)",
                             str(err)) from err


def _store() -> Any:
    """The default process group's store, or None where it cannot be reached."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:   # a private function: absent or failing, checks use a monitored barrier
        return None


def _counter_key(group: Any, global_rank: int) -> str:
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return f"graddbg/ddp_verify/checks/{','.join(map(str, ranks))}/{global_rank}"


# Checks this process has entered, by default group and counter key (group and rank); the
# store gets a copy when an exchange is slow (`_settle`)
_ENTERED: dict = {}
_QUIET = 0.25       # seconds an exchange may take before this rank's count goes to the store


def _check_in(group: Any) -> Tuple[str, int]:
    """Count this rank into a check on ``group``: its store key and how many checks it has
    entered so far (kept here; `_settle` writes it to the store when the exchange is slow)."""
    key = _counter_key(group, dist.get_rank())
    entry = (id(dist.group.WORLD), key)
    count = _ENTERED[entry] = _ENTERED.get(entry, 0) + 1
    return key, count


def _settle(work: Any, store: Any, key: str, count: int, timeout: timedelta) -> None:
    """Wait for the exchange ``work``, at most ``timeout``. A healthy exchange ends within
    milliseconds and costs no store operation (a ``set`` waits for a round trip to rank 0's
    host). One still running after ``_QUIET`` s writes this rank's check count to the store
    first, so that ranks whose exchange times out (after at least seconds more) can name
    the ranks that never entered the check (`_behind`); a failed write is let go."""
    quiet = min(_QUIET, timeout.total_seconds() / 4)
    start = time.perf_counter()
    pause = 0.0
    while not work.is_completed() and time.perf_counter() - start < quiet:
        time.sleep(pause)
        pause = min(2 * pause or 1e-5, 1e-4)     # ends at most 0.1 ms after the exchange
    if not work.is_completed() and store is not None:
        try:
            store.set(key, str(count))
        except Exception:
            pass
    work.wait(timeout=max(timeout - timedelta(seconds=time.perf_counter() - start),
                          timedelta(milliseconds=1)))


def _behind(group: Any, arrived: int) -> Optional[List[int]]:
    """The ranks of ``group`` whose counters in the store say they entered fewer than
    ``arrived`` checks; None when the store cannot be read (who is missing is unknown)."""
    store = _store()
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    keys = [_counter_key(group, global_rank) for global_rank in ranks]
    try:
        entered = [int(store.get(key)) if store.check([key]) else 0 for key in keys]
    except Exception:   # no store, or its host is gone
        return None
    return [r for r, count in enumerate(entered) if count < arrived]


def _rendezvous(options: _Options, header: List[int]) -> List[List[int]]:
    """Check in, then all-gather the headers over the gloo group, waiting at most the
    timeout (see the module docstring, step 3): every rank's header, in rank order, with
    the time it started waiting (µs) last."""
    exchange = _barrier_group(options.group, options.timeout)
    store = _store()
    if store is None:
        _barrier(options.fn, options.group, options.timeout)
    key, arrived = _check_in(options.group)
    wire = torch.tensor(header + [int(time.time() * 1e6)], dtype=torch.int64)
    out = [torch.empty_like(wire) for _ in range(dist.get_world_size(options.group))]
    work = dist.all_gather(out, wire, group=exchange, async_op=True)
    keep_work(work, out)
    try:
        _settle(work, store, key, arrived, options.timeout)
    except RuntimeError as err:
        behind = _behind(options.group, arrived)
        what = ("every rank entered the check, but the exchange" if behind == [] else
                "the exchange (the process group's store could not be read to name the ranks "
                "that did not enter it)")
        raise _timeout_error(options.fn, options.group, options.timeout, behind or [], what,
                             str(err)) from err
    return [row.tolist() for row in out]


def _late_ranks_error(fn: str, starts: Sequence[int], timeout: timedelta, rank: int) -> None:
    """Raise on every rank when some rank started the exchange so late that the ranks that
    were waiting may have given up (their pending exchange then completes for the late
    rank, which must not carry on as if the check had passed). ``starts``: every rank's
    wall-clock time (µs) when it started waiting; clocks are assumed to agree to within
    the margin, min(1 s, timeout / 10)."""
    secs = timeout.total_seconds()
    limit = (secs - min(1.0, secs / 10)) * 1e6
    late = [r for r, t in enumerate(starts) if t - min(starts) > limit]
    if late:
        error = DDPTimeoutError(
            f"{fn}: rank(s) {late} entered the check more than {secs:g} s after the first rank "
            f"(seen from rank {rank}); the ranks that were waiting have given up (raised "
            f"DDPTimeoutError). Every rank must call {fn} at the same point of the program.")
        error.missing_ranks = late  # type: ignore[attr-defined]
        raise error


def _all_gather(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    run_collective(dist.all_gather, out, tensor.contiguous(), group=group)
    return torch.stack(out)


# --------------------------------------------------------------------------- the verdict
def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _describe(entry: Optional[tuple]) -> str:
    if entry is None:
        return "nothing there"
    text = f"{entry[0]!r} shape {entry[1]} {entry[2]}"
    if len(entry) > 3:
        text += f" requires_grad={entry[3]}"
    return text


def _structure_error(fn: str, kind: str, call: str, meta: List[tuple], group: Any) -> None:
    world = dist.get_world_size(group)
    everything: List[Any] = [None] * world
    dist.all_gather_object(everything, (call, meta), group=group)
    calls = [c for c, _ in everything]
    if len(set(calls)) > 1:
        raise DDPInconsistencyError(
            f"{fn}: the ranks called different checks: "
            + "; ".join(f"rank {r}: {c}" for r, c in enumerate(calls))
            + ". Every rank must call the same check with the same atol and rtol.")
    metas = [m for _, m in everything]
    ref = metas[0]
    first, differing = None, []
    for r, other in enumerate(metas[1:], start=1):
        if other == ref:
            continue
        differing.append(r)
        idx = next((i for i, (a, b) in enumerate(zip(ref, other)) if a != b), min(len(ref), len(other)))
        if first is None or idx < first[0]:
            first = (idx, r)
    if first is None:  # the hashes differed but the descriptions agree: should not happen
        raise DDPInconsistencyError(f"{fn}: the ranks' headers differ but their models and calls "
                                    f"agree; this is a bug in graddbg.ddp_verify")
    idx, r = first
    what = "parameter" if kind != "buffers" else "buffer"
    counts = ""
    if len(metas[r]) != len(ref):
        counts = f" (rank 0 has {len(ref)} {what}s, rank {r} has {len(metas[r])})"
    raise DDPInconsistencyError(
        f"{fn}: the ranks hold different models{counts}; first difference at {what} #{idx}: "
        f"rank 0 has {_describe(ref[idx] if idx < len(ref) else None)}, rank {r} has "
        f"{_describe(metas[r][idx] if idx < len(metas[r]) else None)}. Ranks that differ from "
        f"rank 0: {differing}. Build the same model on every rank (same layers, shapes, dtypes"
        f"{' and requires_grad' if kind == 'gradients' else ''}).")


def _fp_text(row: torch.Tensor, mode: str) -> str:
    if not int(row[0]):
        return "absent"
    if mode == "bitwise":
        return "-".join(f"{int(v) & 0xFFFFFFFFFFFFFFFF:016x}" for v in row[1:])
    s, q, l1 = row[4:].view(torch.float64).tolist()
    return (f"sum={s:.9g} sumsq={q:.9g} sumabs={l1:.9g} nan={int(row[1])} "
            f"+inf={int(row[2])} -inf={int(row[3])}")


def _close_matrix(rows: torch.Tensor, numel: int, atol: float, rtol: float) -> torch.Tensor:
    """[W, W] bool: could ranks i and j hold tensors with ``|a - b| <= atol + rtol |b|``?

    ``rows`` are the [W, 7] tolerance fingerprints of one tensor. Presence and NaN/Inf
    counts must be equal; the float64 sums may differ by what the elementwise tolerance
    allows, plus a margin for the rounding of float64 sums over ``numel`` elements.
    """
    counts_equal = (rows[:, None, :4] == rows[None, :, :4]).all(dim=2)
    f = rows[:, 4:].contiguous().view(torch.float64)                   # [W, 3]
    s, q, l1 = f[:, 0], f[:, 1], f[:, 2]
    big_l = torch.maximum(l1[:, None], l1[None, :])
    big_q = torch.maximum(q[:, None], q[None, :])
    slack = (numel + 64) * 2.3e-16 * (big_l + big_q) + 1e-300
    ok = ((s[:, None] - s[None, :]).abs() <= atol * numel + rtol * big_l + slack) \
        & ((l1[:, None] - l1[None, :]).abs() <= atol * numel + rtol * big_l + slack) \
        & ((q[:, None] - q[None, :]).abs() <= atol * atol * numel + 2 * atol * (1 + rtol) * big_l
           + rtol * (2 + rtol) * big_q + slack)
    absent = (rows[:, 0] == 0)
    return counts_equal & (ok | (absent[:, None] & absent[None, :]))


def _close(a: torch.Tensor, b: torch.Tensor, numel: int, atol: float, rtol: float) -> bool:
    """Could two tolerance fingerprints come from tensors with |a - b| <= atol + rtol |b|?"""
    return bool(_close_matrix(torch.stack([a, b]), numel, atol, rtol)[0, 1])


def _disagree(rows: torch.Tensor, mode: str, numel: int, atol: float,
              rtol: float) -> List[Tuple[int, int, str]]:
    """(row, reference row, reason) for every row of one tensor's fingerprints (``[n, k]``)
    that does not agree with the reference: the row that agrees with the most rows (ties:
    the first)."""
    if mode == "bitwise":
        _, label = torch.unique(rows, dim=0, return_inverse=True)
        same = label[:, None] == label[None, :]
    else:
        same = _close_matrix(rows, numel, atol, rtol)
    support = same.sum(dim=1).tolist()
    ref = max(range(rows.shape[0]), key=lambda r: (support[r], -r))
    out = []
    for r in (~same[:, ref]).nonzero().flatten().tolist():
        if int(rows[r, 0]) != int(rows[ref, 0]):
            reason = ("no gradient on this rank" if not int(rows[r, 0])
                      else "has a gradient, the reference rank has none")
        elif mode == "bitwise":
            reason = "bits differ"
        elif not torch.equal(rows[r, 1:4], rows[ref, 1:4]):
            reason = "NaN/Inf counts differ"
        else:
            reason = "values differ beyond atol/rtol"
        out.append((r, ref, reason))
    return out


def _verdict(table: torch.Tensor, names: List[str], meta: List[tuple], mode: str,
             atol: float, rtol: float, sets: Optional[List[List[int]]] = None,
             numels: Optional[List[List[int]]] = None,
             per_tensor: Optional[List[List[List[int]]]] = None) -> List[Tuple[int, int, int, str]]:
    """(param index, rank, reference rank, reason) for every entry that disagrees, by
    parameter, then rank.

    Ranks are compared within each of ``sets`` (default: all together), or for tensor p
    within each of ``per_tensor[p]`` (on a sharded model: the ranks holding the same shard
    of it). The reference of a tensor is the rank of the set that agrees with the most of
    its ranks (ties: the lowest rank); every rank that does not agree with it is reported.
    ``numels[r][p]``: how many elements rank r holds of tensor p, for the tolerance bounds
    (default: the number of elements of ``meta``'s shape).
    """
    if per_tensor is None:
        per_tensor = [sets or [list(range(table.shape[0]))]] * table.shape[1]
    by_sets: dict = {}
    for p, tensor_sets in enumerate(per_tensor):
        for ranks in tensor_sets:
            if len(ranks) > 1:
                by_sets.setdefault(tuple(ranks), []).append(p)
    out: List[Tuple[int, int, int, str]] = []
    for group, tensors in by_sets.items():
        ranks = list(group)
        sub = table[ranks][:, tensors]
        equal = (sub == sub[0:1]).all(dim=2).all(dim=0)
        for p in [tensors[i] for i in (~equal).nonzero().flatten().tolist()]:
            numel = numels[ranks[0]][p] if numels is not None else math.prod(meta[p][1])
            out += [(p, ranks[r], ranks[ref], reason)
                    for r, ref, reason in _disagree(table[ranks, p, :], mode, numel, atol, rtol)]
    return sorted(out)


def _local_shapes(meta: List[tuple], layouts: Optional[List[List[Optional[tuple]]]],
                  world: int) -> List[List[Tuple[int, ...]]]:
    """``[rank][tensor]``: the shape of what each rank holds (its shard of a DTensor, from
    every rank's layouts; else the shape in ``meta``)."""
    plain = [tuple(m[1]) for m in meta]
    if layouts is None:
        return [plain] * world
    return [[tuple(e[-1]) if e is not None else plain[p] for p, e in enumerate(rank_layout)]
            for rank_layout in layouts]


def _wire(t: Optional[torch.Tensor], length: int, device: torch.device) -> torch.Tensor:
    """What a rank sends of one tensor for details=True: flat float64 (complex tensors as
    their real view), zero-padded to ``length`` (all zeros where it has none)."""
    x = torch.zeros(length, dtype=torch.float64, device=device)
    if t is not None:
        flat = _flat(t)
        x[: flat.numel()] = flat.to(device=device, dtype=torch.float64)
    return x


def _largest_differences(x: torch.Tensor, pairs: List[Tuple[int, int]], group: Any) -> dict:
    """Gather ``x`` from every rank in bounded slices; for each (rank, reference rank) pair:
    rank -> [largest difference, elements that differ, flat index, value, reference value]."""
    chunk = max(16, _DETAIL_BYTES // (8 * dist.get_world_size(group)))
    best = {r: [-1.0, 0, -1, float("nan"), float("nan")] for r, _ in pairs}
    for start in range(0, x.numel(), chunk):
        gathered = _all_gather(x[start:start + chunk], group).cpu()
        for r, ref in pairs:
            a, b = gathered[r], gathered[ref]
            same = (a == b) | (torch.isnan(a) & torch.isnan(b))
            diff = torch.where(same, torch.zeros_like(a), (a - b).abs()).nan_to_num(nan=float("inf"))
            at = int(diff.argmax())
            entry = best[r]
            entry[1] += int((~same).sum())
            if float(diff[at]) > entry[0]:
                entry[0], entry[2] = float(diff[at]), start + at
                entry[3], entry[4] = float(a[at]), float(b[at])
    return best


def _details(found: List[Tuple[int, int, int, str]], tensors: List[Optional[torch.Tensor]],
             meta: List[tuple], shapes: List[List[Tuple[int, ...]]], group: Any,
             device: torch.device) -> dict:
    """Gather the offending tensors (at most _MAX_DETAIL_TENSORS, in bounded slices) and
    measure, for each differing rank, the largest difference from its reference rank.
    ``shapes[r][p]``: what rank r holds of tensor p (a shard's index is into the shard)."""
    params = list(dict.fromkeys(p for p, _, _, _ in found))[:_MAX_DETAIL_TENSORS]
    result = {}
    for p in params:
        complex_ = meta[p][2].startswith("complex")
        real = [tuple(s[p]) + ((2,) if complex_ else ()) for s in shapes]
        x = _wire(tensors[p], max(math.prod(shape) for shape in real), device)
        best = _largest_differences(x, [(r, ref) for q, r, ref, _ in found if q == p], group)
        for r, (worst, n_diff, at, value, ref_value) in best.items():
            if at < 0:
                result[(p, r)] = (0.0, 0, None, None, None)
                continue
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(at), real[r])) \
                if real[r] else ()
            result[(p, r)] = (worst, n_diff, index, value, ref_value)
    return result


def _tolerance_finish(first: torch.Tensor, tensors: List[Optional[torch.Tensor]], group: Any,
                      device: torch.device) -> torch.Tensor:
    """From the round-one tables ([W, P, 4]: present and float64 sums) to [W, P, 7].

    Where some rank's sums are not finite (a NaN or an Inf somewhere), round two, for those
    tensors only, gathers the NaN/+Inf/-Inf counts and the sums of the finite elements.
    Every rank holds the same round-one tables, so every rank agrees on whether there is a
    round two and what it holds.
    """
    world, count = first.shape[0], first.shape[1]
    table = torch.zeros(world, count, _TOLERANCE_K, dtype=torch.int64)
    table[:, :, 0] = first[:, :, 0]
    table[:, :, 4:] = first[:, :, 1:]
    sums = first[:, :, 1:].contiguous().view(torch.float64)
    again = ((~torch.isfinite(sums)).any(dim=2) & (first[:, :, 0] == 1)).any(dim=0)
    redo = again.nonzero().flatten().tolist()
    if redo:
        full = fingerprints([tensors[p] for p in redo], mode="tolerance", device=device)
        table[:, redo, :] = _all_gather(full, group).cpu()
    return table


# --------------------------------------------------------------------------- the check
_KEY, _COUNT, _SHARDS = 6, 7, 8     # sharded models' header: replica key, count, layout hash


def _replica_header(options: _Options, layout: List[Optional[tuple]]) -> List[int]:
    """On a sharded model, [replica key, replica count, layout hash] (nothing otherwise:
    every rank is compared). Ranks with the same key are compared with each other. The key
    is the hash of the layout (the ranks that hold the same shard of every tensor) unless
    ``group=`` named the replicas: then the hash of the group's ranks, and the count is
    their number."""
    if not options.sharded:
        return []
    shards = _hash64(repr(layout))
    if options.replicas is None:
        return [shards, 0, shards]
    return [_hash64(repr(options.replicas)), len(options.replicas), shards]


def _local(options: _Options, tensors: List[Optional[torch.Tensor]], meta: List[tuple],
           layout: List[Optional[tuple]],
           device: torch.device) -> Tuple[Optional[torch.Tensor], List[int], Optional[BaseException]]:
    """This rank's fingerprint table (round one in tolerance mode) on ``device`` and its
    header: [metadata hash, tensor count, call hash, world size, digest a, digest b], then
    on a sharded model the replica fields (`_replica_header`). A failure is told to
    the other ranks (a header of -1s), so that every rank raises."""
    try:
        if options.mode == "bitwise":
            local = fingerprints(tensors, device=device)
        else:
            local = _tolerance_quick_table(tensors, device)
        header = [_hash64(repr(meta)), len(meta), _hash64(options.call),
                  dist.get_world_size(options.group)] + _digest(local).tolist()
        return local, header + _replica_header(options, layout), None
    except Exception as err:
        return None, [-1] * (9 if options.sharded else 6), err


def _raise_unless_comparable(options: _Options, rows: List[List[int]], meta: List[tuple],
                             error: Optional[BaseException]) -> None:
    """On every rank alike: a rank that came too late, a rank that could not fingerprint,
    ranks holding different models or asking different checks."""
    _late_ranks_error(options.fn, [row[-1] for row in rows], options.timeout,
                      dist.get_rank(options.group))
    failed = [r for r, row in enumerate(rows) if all(v == -1 for v in row[:4])]
    if failed:
        raise DDPInconsistencyError(
            f"{options.fn}: rank(s) {failed} could not compute their fingerprints"
            + (f" ({type(error).__name__}: {error})" if error else
               "; see the error on those ranks")) from error
    if any(row[:4] != rows[0][:4] for row in rows):
        _structure_error(options.fn, options.kind, options.call, meta, options.group)


def _all_layouts(options: _Options, layout: List[Optional[tuple]], world: int,
                 wanted: Optional[Iterable[int]] = None) -> List[List[Optional[tuple]]]:
    """Every rank's layout (a plain model's are all None; a sharded model's come from one
    small object gather, of the ``wanted`` tensors only when given: None for the others)."""
    if not options.sharded:
        return [layout] * world
    mine: Any = layout if wanted is None else {p: layout[p] for p in wanted}
    everything: List[Any] = [None] * world
    dist.all_gather_object(everything, mine, group=options.group)
    if wanted is None:
        return everything
    return [[held.get(p) for p in range(len(layout))] for held in everything]


def _shards_differ(options: _Options, ranks: List[int], names: List[str],
                   layout: List[Optional[tuple]]) -> None:
    """Raise (on every rank alike) naming the first tensor of which two ranks that
    ``group=`` puts together hold different shards."""
    layouts = _all_layouts(options, layout, dist.get_world_size(options.group))
    for p, name in enumerate(names):
        held = {r: layouts[r][p] for r in ranks}
        other = next((r for r in ranks if held[r] != held[ranks[0]]), None)
        if other is None:
            continue
        a, b = ranks[0], other
        texts = [_shard_text(held[r]) if held[r] is not None else "a plain tensor" for r in (a, b)]
        raise GraddbgValueError(
            f"{options.fn}(group=...): ranks {a} and {b} are in one replica group but hold "
            f"different shards of {name!r} (rank {a}: {texts[0]}; rank {b}: {texts[1]}), so "
            f"they are not replicas. Pass the mesh dimension over which the tensors are "
            f"Replicate (such as 'replicate' for HSDP or 'dp' over tensor parallelism), or "
            f"group=None to find the replicas from the shards every rank holds")
    raise GraddbgValueError(f"{options.fn}(group=...): the ranks of a replica group hold "
                            f"different shards ({ranks})")


def _no_replicas(options: _Options, names: List[str], layout: List[Optional[tuple]]) -> GraddbgValueError:
    example = next(((n, e) for n, e in zip(names, layout)
                    if e is not None and any(c is not None for c in e[3])), None)
    shown = f" (such as {example[0]!r}: {_placement_text(example[1])})" if example else ""
    return GraddbgValueError(
        f"{options.fn}: no replicas to compare: every parameter is sharded over the whole "
        f"mesh (pure FSDP, or tensor parallelism in which every tensor is sharded), so no two "
        f"of the {dist.get_world_size(options.group)} ranks hold the same shard of any "
        f"tensor{shown}, and shards differ by design. HSDP or DDP replicas are what these "
        f"checks compare: the replicate dimension of HSDP (fully_shard on a 2-D mesh), "
        f"data-parallel copies of a tensor-parallel model, and the plain parameters and "
        f"Replicate placements of a tensor-parallel model across its tensor-parallel group. "
        f"For the gradients of a sharded model use graddbg.watch, whose statistics are those "
        f"of the full gradients, on every rank.")


def _replica_sets(options: _Options, rows: List[List[int]], names: List[str],
                  layout: List[Optional[tuple]]) -> Optional[List[List[int]]]:
    """The sets of ranks compared with each other (see `_replica_header`), the same
    on every rank; None on a sharded model without ``group=``: its replicas are found
    tensor by tensor (`_tensor_sets`). Raises on every rank alike when the groups
    passed do not split the ranks into replica groups, when a group holds different
    shards, or when no two ranks of such a group hold the same shards."""
    if not options.sharded:
        return [list(range(len(rows)))]
    if options.replicas is None:
        return None
    by_key: dict = {}
    for r, row in enumerate(rows):
        by_key.setdefault(row[_KEY], []).append(r)
    sets = list(by_key.values())
    odd = [s for s in sets if options.replicas is not None and len(s) != rows[s[0]][_COUNT]]
    if odd:
        raise GraddbgValueError(
            f"{options.fn}(group=...): the groups passed do not split the {len(rows)} ranks "
            f"into replica groups: " + "; ".join(
                f"rank(s) {s} passed a group of {rows[s[0]][_COUNT]} ranks, but only they "
                f"passed it" for s in odd)
            + ". Every rank must pass its own replica group (the same dimension name on every rank)")
    for s in sets:
        if any(rows[r][_SHARDS] != rows[s[0]][_SHARDS] for r in s):
            _shards_differ(options, s, names, layout)
    if len(rows) > 1 and all(len(s) == 1 for s in sets):
        raise _no_replicas(options, names, layout)
    return sets


def _gather_tables(options: _Options, local: torch.Tensor, meta: List[tuple],
                   layout: List[Optional[tuple]]) -> Tuple[torch.Tensor, List[List[int]], Any]:
    """Every rank's table ``[W, P, k]``, ``[rank][tensor]`` how many elements it holds and,
    on a sharded model, ``[rank][tensor]`` a hash of which shard it holds (0 for a plain
    tensor): columns of the same gather (shards may differ in size); None otherwise."""
    world = dist.get_world_size(options.group)
    if not options.sharded:
        return (_all_gather(local, options.group).cpu(), [[math.prod(m[1]) for m in meta]] * world,
                None)
    held = _local_shapes(meta, [layout], 1)[0]
    extra = torch.tensor([[math.prod(shape) for shape in held],
                          [0 if e is None else _hash64(repr(e)) for e in layout]],
                         dtype=torch.int64).reshape(2, len(layout)).t()
    both = _all_gather(torch.cat([local, extra.to(local.device)], dim=1), options.group).cpu()
    return both[:, :, :-2], both[:, :, -2].tolist(), both[:, :, -1].tolist()


def _tensor_sets(shards: List[List[int]], sets: Optional[List[List[int]]]) -> List[List[List[int]]]:
    """Per tensor, the sets of ranks compared: within each of ``sets`` (every rank when
    None), the ranks that hold the same shard of it (``shards[r][p]``, see
    `_gather_tables`): a plain tensor or a ``Replicate`` placement on every rank, a
    sharded one along the dimensions it is replicated over."""
    outer = sets if sets is not None else [list(range(len(shards)))]
    count = len(shards[0]) if shards else 0
    result = []
    for p in range(count):
        groups: dict = {}
        for k, ranks in enumerate(outer):
            for r in ranks:
                groups.setdefault((k, shards[r][p]), []).append(r)
        result.append(sorted(groups.values()))
    return result


def _compare(options: _Options, rows: List[List[int]], sets: Optional[List[List[int]]],
             local: torch.Tensor, tensors: List[Optional[torch.Tensor]], meta: List[tuple],
             layout: List[Optional[tuple]], device: torch.device, names: List[str]
             ) -> Tuple[Optional[torch.Tensor], List[Tuple[int, int, int, str]], List[List[List[int]]]]:
    """Every rank's table ``[W, P, k]`` (None when, in bitwise mode, every digest agrees:
    nothing differs), the entries that disagree (see `_verdict`) and per tensor the
    sets of ranks compared. A plain model whose digests agree needs nothing more; a
    sharded one gathers the tables, which say which shard each rank holds."""
    world = len(rows)
    if not options.sharded:
        per_tensor = [sets or [list(range(world))]] * len(meta)
        agree = all(row[4:6] == rows[0][4:6] for row in rows)
        if agree and options.mode == "bitwise":
            return None, [], per_tensor
    if not options.sharded and agree:
        first = local.cpu().unsqueeze(0).expand(world, *local.shape)
        numels = [[math.prod(m[1]) for m in meta]] * world
    else:
        first, numels, shards = _gather_tables(options, local, meta, layout)   # find who differs
        if options.sharded:
            per_tensor = _tensor_sets(shards, sets)
            if world > 1 and all(len(s) == 1 for groups in per_tensor for s in groups):
                raise _no_replicas(options, names, layout)
    table = first if options.mode == "bitwise" else \
        _tolerance_finish(first, tensors, options.group, device)
    return table, _verdict(table, [], meta, options.mode, options.atol, options.rtol,
                           numels=numels, per_tensor=per_tensor), per_tensor


_CAUSES = {
    "absent": "rank {rank} and rank {ref} disagree on whether it has a gradient: a branch of "
              "the model that some ranks skip (DDP needs the same graph on every rank, or "
              "find_unused_parameters=True), or a parameter frozen on some ranks only",
    "gradients": "the gradient all-reduce did not make them equal: communication that lost or "
                 "corrupted data (a DDP communication hook, a faulty link), a parameter that "
                 "DDP no longer reduces (replaced after DDP wrapped the model, so DDP reduces "
                 "the old tensor), a rank that skipped the all-reduce (no_sync on its last "
                 "micro-batch, a rank-dependent branch), or a model not wrapped in DDP on every "
                 "rank",
    "initial": "the replicas differ before training: the model is not wrapped in DDP on every "
               "rank, was initialised differently on some rank (seed), or its parameters were "
               "replaced after DDP wrapped them (DDP copies rank 0's parameters only when it "
               "wraps the model)",
    "both": "its gradient differs too, so the updates diverged with the gradients (see the "
            "gradient's row)",
    "updated": "the gradients agree but the parameters do not: a replica was updated "
               "differently (an optimizer step that depends on the rank, clipping by a norm "
               "computed on some ranks only, a learning rate that differs, or a change of the "
               "parameter outside the optimizer on some ranks)",
    "parameters": "the replicas drifted apart: gradients that differed at an earlier step "
                  "(check_gradients before optimizer.step() tells), or a replica updated "
                  "differently (an optimizer step, clipping or learning rate that depends on "
                  "the rank)",
    "buffers": "buffers differ: DDP(broadcast_buffers=False), a training forward on other "
               "data since the last broadcast, or a buffer changed on some ranks only",
    "tp": " (a tensor replicated across the tensor-parallel group, such as a LayerNorm weight "
          "left out of the parallelize plan: its gradient must be all-reduced over that group "
          "and clipping must use the norm of the whole model)",
}


def _cause(options: _Options, found: List[Tuple[int, int, int, str]], names: List[str],
           kinds: List[str], layout: List[Optional[tuple]], row: Tuple[int, int, int, str]) -> str:
    """What probably happened to one mismatch, from what else differs (see ``_CAUSES``)."""
    p, r, ref, reason = row
    kind = kinds[p]
    if reason.startswith(("no gradient", "has a gradient")):
        key = "absent"
    elif kind == "parameters":
        grads = {(names[q], rr) for q, rr, _, _ in found if kinds[q] == "gradients"}
        key = ("initial" if options.initial else "both" if (names[p], r) in grads
               else "updated" if "gradients" in options.parts else "parameters")
    else:
        key = kind
    replicated = options.sharded and (layout[p] is None or all(c is None for c in layout[p][3]))
    tp = _CAUSES["tp"] if replicated and key in ("gradients", "updated", "parameters") else ""
    return _CAUSES[key].format(rank=r, ref=ref) + tp


def _report(options: _Options, names: List[str], meta: List[tuple], table: Optional[torch.Tensor],
            found: List[Tuple[int, int, int, str]], measured: dict,
            per_tensor: List[List[List[int]]],
            layouts: Optional[List[List[Optional[tuple]]]], kinds: List[str],
            layout: List[Optional[tuple]]) -> ConsistencyReport:
    rows = []
    for p, r, ref, reason in found:
        extra = measured.get((p, r))
        held = layouts[r][p] if layouts is not None else None
        rows.append(Mismatch(
            name=names[p], rank=r, reference_rank=ref, reason=reason, shape=meta[p][1],
            dtype=meta[p][2], fingerprint=_fp_text(table[r, p], options.mode),
            reference_fingerprint=_fp_text(table[ref, p], options.mode),
            local_shape=None if held is None else tuple(held[-1]),
            shard=None if held is None else _shard_text(held), kind=kinds[p],
            cause=_cause(options, found, names, kinds, layout, (p, r, ref, reason)),
            **({} if extra is None else dict(zip(
                ("max_abs_diff", "n_diff", "index", "value", "reference_value"), extra)))))
    return ConsistencyReport(ok=not rows, world_size=dist.get_world_size(options.group),
                             rank=dist.get_rank(options.group), kind=options.kind,
                             mode=options.mode, checked=len(names), rows=tuple(rows),
                             atol=options.atol, rtol=options.rtol,
                             replica_groups=_groups_compared(per_tensor) if options.sharded else ())


def _groups_compared(per_tensor: List[List[List[int]]]) -> Tuple[Tuple[int, ...], ...]:
    """The distinct sets of two or more ranks that some tensor was compared within, sorted."""
    return tuple(sorted({tuple(s) for groups in per_tensor for s in groups if len(s) > 1}))


def _check(fn: str, kind: str, model: Any, group: Any, atol: Any, rtol: Any, timeout: Any,
           details: bool, raise_on_mismatch: bool, initial: bool = False) -> ConsistencyReport:
    check_model(model, fn)
    parts = tuple(k for k in ("gradients", "parameters", "buffers") if k in kind)
    names, tensors, meta, layout, kinds, mesh = _collect_all(unwrap(model), parts)
    options = dataclasses.replace(_options(fn, kind, group, atol, rtol, timeout, details,
                                           raise_on_mismatch, mesh), initial=bool(initial))
    device = _comm_device(options.group, tensors, model)
    local, header, error = _local(options, tensors, meta, layout, device)
    rows = _rendezvous(options, header)
    _raise_unless_comparable(options, rows, meta, error)
    sets = _replica_sets(options, rows, names, layout)
    table, found, per_tensor = _compare(options, rows, sets, local, tensors, meta, layout, device,
                                        names)
    layouts = _all_layouts(options, layout, len(rows), {p for p, *_ in found}) if found else None
    measured = {} if not (details and found) else _details(
        found, tensors, meta, _local_shapes(meta, layouts, len(rows)), options.group, device)
    report = _report(options, names, meta, table, found, measured, per_tensor, layouts, kinds,
                     layout)
    if not report.ok and options.raise_on_mismatch:
        raise DDPInconsistencyError(f"{fn}: the ranks disagree (raise_on_mismatch=True)\n{report}",
                                    report=report)
    return report


_DEFAULT_TIMEOUT = timedelta(seconds=60)


def check_gradients(model: nn.Module, *, group: Any = None, atol: float = 0.0, rtol: float = 0.0,
                    timeout: Timeout = _DEFAULT_TIMEOUT, details: bool = False,
                    raise_on_mismatch: bool = False) -> ConsistencyReport:
    """Check that every parameter's ``.grad`` is the same on every rank of ``group``.

    Collective: call it on every rank at the same point (after the synchronising backward,
    before ``optimizer.step()``). A parameter whose gradient is ``None`` on some ranks only
    is reported by name and rank.

    On a model holding DTensors (FSDP2, HSDP, tensor parallel) every rank of the default
    group calls it, and each rank's shards are compared with its replicas' (see the module
    docstring); ``group`` may then also be a mesh dimension name (``"replicate"``) or a 1-D
    ``DeviceMesh``. Pure FSDP has no replicas: ``GraddbgValueError``.

    Args:
        model: a ``DistributedDataParallel`` or a plain module (names never carry DDP's
            ``module.`` prefix).
        group: the process group (None: the default group). On a model holding DTensors
            also a 1-D ``DeviceMesh`` or the name of a mesh dimension of the model's
            DTensors (such as ``"replicate"``).
        atol: the absolute tolerance (a finite number >= 0); ``atol`` or ``rtol`` > 0
            switches from the bitwise comparison to tolerance mode.
        rtol: the relative tolerance (a finite number >= 0).
        timeout: how long to wait for the other ranks (a ``datetime.timedelta`` or a
            number of seconds > 0; 60 s).
        details: gather the differing tensors (only those) to report the largest
            difference per rank.
        raise_on_mismatch: raise `DDPInconsistencyError` on every rank, after all of them
            have reached the same verdict, when the ranks disagree.

    Returns:
        ConsistencyReport: the same verdict on every rank, truthy when consistent, with
            one `Mismatch` row per differing tensor and rank.

    Raises:
        GraddbgTypeError: ``model`` is not an ``nn.Module`` instance, or ``atol``,
            ``rtol``, ``timeout`` or ``group`` has a wrong type (on the calling rank,
            before any collective).
        GraddbgValueError: a negative or non-finite tolerance, a timeout <= 0, a ``group``
            this rank is not a member of or a mesh that is not 1-D, or a sharded model with
            no replicas to compare (pure FSDP).
        GraddbgError: ``torch.distributed`` is unavailable or not initialized.
        DDPTimeoutError: some rank did not enter the check within ``timeout`` (naming the
            ranks whose counters are behind).
        DDPInconsistencyError: the ranks hold different models or called different checks
            (naming the first difference), a rank could not compute its fingerprints, or
            the ranks disagree and ``raise_on_mismatch`` is set.

    Examples:
        >>> import os, tempfile, torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = torch.nn.Linear(3, 2)
        >>> model(torch.randn(4, 3)).sum().backward()
        >>> report = check_gradients(model)
        >>> report.ok, report.world_size, report.checked
        (True, 1, 2)
        >>> dist.destroy_process_group()
    """
    return _check("check_gradients", "gradients", model, group, atol, rtol, timeout, details,
                  raise_on_mismatch)


def check_parameters(model: nn.Module, *, group: Any = None, atol: float = 0.0,
                     rtol: float = 0.0, timeout: Timeout = _DEFAULT_TIMEOUT,
                     details: bool = False, raise_on_mismatch: bool = False) -> ConsistencyReport:
    """Check that every parameter's value is the same on every rank (see `check_gradients`).

    Collective, like `check_gradients`. Run it after ``optimizer.step()`` to catch weights
    that drifted apart.

    Args:
        model: a ``DistributedDataParallel`` or a plain module.
        group: the process group (None: the default group). On a model holding DTensors
            also a 1-D ``DeviceMesh`` or the name of a mesh dimension of the model's
            DTensors (such as ``"replicate"``).
        atol: the absolute tolerance (a finite number >= 0); ``atol`` or ``rtol`` > 0
            switches from the bitwise comparison to tolerance mode.
        rtol: the relative tolerance (a finite number >= 0).
        timeout: how long to wait for the other ranks (a ``datetime.timedelta`` or a
            number of seconds > 0; 60 s).
        details: gather the differing tensors (only those) to report the largest
            difference per rank.
        raise_on_mismatch: raise `DDPInconsistencyError` on every rank, after all of them
            have reached the same verdict, when the ranks disagree.

    Returns:
        ConsistencyReport: the same verdict on every rank, truthy when consistent, with
            one `Mismatch` row per differing tensor and rank.

    Raises:
        GraddbgTypeError: ``model`` is not an ``nn.Module`` instance, or ``atol``,
            ``rtol``, ``timeout`` or ``group`` has a wrong type (on the calling rank,
            before any collective).
        GraddbgValueError: a negative or non-finite tolerance, a timeout <= 0, a ``group``
            this rank is not a member of or a mesh that is not 1-D, or a sharded model with
            no replicas to compare (pure FSDP).
        GraddbgError: ``torch.distributed`` is unavailable or not initialized.
        DDPTimeoutError: some rank did not enter the check within ``timeout`` (naming the
            ranks whose counters are behind).
        DDPInconsistencyError: the ranks hold different models or called different checks
            (naming the first difference), a rank could not compute its fingerprints, or
            the ranks disagree and ``raise_on_mismatch`` is set.

    Examples:
        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> print(check_parameters(torch.nn.Linear(3, 2)))
        ConsistencyReport[rank 0]: parameters (bitwise) across 1 ranks: consistent (2 tensors)
        >>> dist.destroy_process_group()
    """
    return _check("check_parameters", "parameters", model, group, atol, rtol, timeout, details,
                  raise_on_mismatch)


def check_buffers(model: nn.Module, *, group: Any = None, atol: float = 0.0, rtol: float = 0.0,
                  timeout: Timeout = _DEFAULT_TIMEOUT, details: bool = False,
                  raise_on_mismatch: bool = False) -> ConsistencyReport:
    """Check that every buffer (BatchNorm statistics, for instance) is the same on every rank.

    Collective, like `check_gradients`. Buffers drift apart under
    ``DistributedDataParallel(..., broadcast_buffers=False)``. With
    ``broadcast_buffers=True`` DDP copies rank 0's buffers at the start of every forward,
    so a training forward on different data leaves them different until the next one:
    check before the forward (or after an eval-mode forward) to test the broadcast.

    Args:
        model: a ``DistributedDataParallel`` or a plain module.
        group: the process group (None: the default group). On a model holding DTensors
            also a 1-D ``DeviceMesh`` or the name of a mesh dimension of the model's
            DTensors (such as ``"replicate"``).
        atol: the absolute tolerance (a finite number >= 0); ``atol`` or ``rtol`` > 0
            switches from the bitwise comparison to tolerance mode.
        rtol: the relative tolerance (a finite number >= 0).
        timeout: how long to wait for the other ranks (a ``datetime.timedelta`` or a
            number of seconds > 0; 60 s).
        details: gather the differing tensors (only those) to report the largest
            difference per rank.
        raise_on_mismatch: raise `DDPInconsistencyError` on every rank, after all of them
            have reached the same verdict, when the ranks disagree.

    Returns:
        ConsistencyReport: the same verdict on every rank, truthy when consistent, with
            one `Mismatch` row per differing tensor and rank.

    Raises:
        GraddbgTypeError: ``model`` is not an ``nn.Module`` instance, or ``atol``,
            ``rtol``, ``timeout`` or ``group`` has a wrong type (on the calling rank,
            before any collective).
        GraddbgValueError: a negative or non-finite tolerance, a timeout <= 0, a ``group``
            this rank is not a member of or a mesh that is not 1-D, or a sharded model with
            no replicas to compare (pure FSDP).
        GraddbgError: ``torch.distributed`` is unavailable or not initialized.
        DDPTimeoutError: some rank did not enter the check within ``timeout`` (naming the
            ranks whose counters are behind).
        DDPInconsistencyError: the ranks hold different models or called different checks
            (naming the first difference), a rank could not compute its fingerprints, or
            the ranks disagree and ``raise_on_mismatch`` is set.

    Examples:
        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> check_buffers(torch.nn.BatchNorm1d(4)).names
        []
        >>> dist.destroy_process_group()
    """
    return _check("check_buffers", "buffers", model, group, atol, rtol, timeout, details,
                  raise_on_mismatch)


def _replica_kind(gradients: Any, parameters: Any) -> str:
    """check_replicas' ``gradients``/``parameters`` flags as the kind of check."""
    for arg, value in (("gradients", gradients), ("parameters", parameters)):
        if not isinstance(value, bool):
            raise GraddbgTypeError(f"check_replicas({arg}=...): got {value!r} "
                                   f"({type(value).__name__}); accepted: True or False")
    if not (gradients or parameters):
        raise GraddbgValueError("check_replicas(gradients=False, parameters=False): nothing to "
                                "check; accepted: gradients=True, parameters=True or both")
    return " and ".join(k for k, on in (("gradients", gradients), ("parameters", parameters)) if on)


def check_replicas(model: nn.Module, *, gradients: bool = True, parameters: bool = True,
                   initial: bool = False, group: Any = None, atol: float = 0.0,
                   rtol: float = 0.0, timeout: Timeout = _DEFAULT_TIMEOUT, details: bool = False,
                   raise_on_mismatch: bool = False) -> ConsistencyReport:
    """Check gradients and parameters across the replicas in one exchange (what ``watch`` needs).

    Every tensor that should be equal across some ranks is compared with exactly those
    ranks (DDP, HSDP's replicate dimension, data-parallel copies and the replicated tensors
    of a tensor-parallel model). Collective, like `check_gradients`. Call it after backward
    and before ``optimizer.step()``: then the gradients are those the step will use and the
    parameters those of the previous step. Each mismatch has a ``kind`` ("gradients" or
    "parameters") and a ``cause``: what probably happened, judged from what else differs
    (parameters that differ while their gradients agree: a replica updated differently).

    Args:
        model: a ``DistributedDataParallel``, a plain module or a model holding DTensors.
        gradients: compare the parameters' gradients (True or False).
        parameters: compare the parameters' values (True or False; at least one of the two).
        initial: no optimizer step has run yet (differing parameters then mean a model not
            wrapped in DDP on every rank, initialised differently, or parameters replaced
            after wrapping).
        group: the process group (None: the default group). On a model holding DTensors
            also a 1-D ``DeviceMesh`` or the name of a mesh dimension of the model's
            DTensors (such as ``"replicate"``).
        atol: the absolute tolerance (a finite number >= 0); ``atol`` or ``rtol`` > 0
            switches from the bitwise comparison to tolerance mode.
        rtol: the relative tolerance (a finite number >= 0).
        timeout: how long to wait for the other ranks (a ``datetime.timedelta`` or a
            number of seconds > 0; 60 s).
        details: gather the differing tensors (only those) to report the largest
            difference per rank.
        raise_on_mismatch: raise `DDPInconsistencyError` on every rank, after all of them
            have reached the same verdict, when the ranks disagree.

    Returns:
        ConsistencyReport: the same verdict on every rank, truthy when consistent, with
            one `Mismatch` row per differing tensor and rank, with its ``kind`` and
            ``cause``.

    Raises:
        GraddbgTypeError: ``model`` is not an ``nn.Module`` instance, ``gradients`` or
            ``parameters`` is not a bool, or ``atol``, ``rtol``, ``timeout`` or ``group``
            has a wrong type (on the calling rank, before any collective).
        GraddbgValueError: ``gradients`` and ``parameters`` both False, a negative or
            non-finite tolerance, a timeout <= 0, a ``group``
            this rank is not a member of or a mesh that is not 1-D, or a sharded model with
            no replicas to compare (pure FSDP).
        GraddbgError: ``torch.distributed`` is unavailable or not initialized.
        DDPTimeoutError: some rank did not enter the check within ``timeout`` (naming the
            ranks whose counters are behind).
        DDPInconsistencyError: the ranks hold different models or called different checks
            (naming the first difference), a rank could not compute its fingerprints, or
            the ranks disagree and ``raise_on_mismatch`` is set.

    Examples:
        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = torch.nn.Linear(3, 2)
        >>> model(torch.randn(4, 3)).sum().backward()
        >>> print(check_replicas(model))
        ConsistencyReport[rank 0]: gradients and parameters (bitwise) across 1 ranks: consistent (4 tensors)
        >>> dist.destroy_process_group()
    """
    kind = _replica_kind(gradients, parameters)
    return _check("check_replicas", kind, model, group, atol, rtol, timeout, details,
                  raise_on_mismatch, initial=initial)
