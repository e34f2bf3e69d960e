"""Cross-rank consistency checks: do gradients, parameters and buffers agree on every rank?

Every check is *collective*: every rank of the group calls it at the same point of the
program, and every rank gets the same :class:`ConsistencyReport`. A check costs:

1. local fingerprints of every tensor, computed on the tensors' own device (one streaming
   integer reduction per tensor that reads it once, no host synchronisation), stacked
   into a small ``[tensors x k]`` integer table, and a digest of that table (two hashes
   modulo primes near 2**31);
2. a check-in: this rank writes its count of checks entered to the process group's
   store (a ``set``, which awaits no reply; nothing waits on it);
3. one all-gather of a 7-integer header, on a gloo group (the group itself when it is a
   gloo group, a gloo side group otherwise, created once per group and cached, see
   :func:`prepare`), waited for at most ``timeout``: a hash of the names, shapes and
   dtypes of the tensors, a hash of what was asked, the digest, and the time the rank
   started waiting. It is also the rendezvous: when some rank never arrives, the others'
   wait times out and every rank that did arrive raises :class:`DDPTimeoutError` naming
   the ranks whose counters are behind its own, instead of hanging; a rank that arrives
   after the others gave up sees from their times that it is late, and raises too. A
   rank whose fingerprinting fails says so in its header, so that every rank raises.
   Ranks whose models differ raise :class:`DDPInconsistencyError` naming the first
   difference (only then are the names themselves exchanged). When every digest is
   equal the check is over: consistent.
   (Where the store cannot be reached, a monitored barrier on that gloo group, run in a
   helper thread during step 1, names the missing ranks instead, and the header goes
   over the group itself.)
4. Only when the digests differ, one all-gather of the fingerprint tables, to find which
   tensors differ on which ranks; with ``details=True``, then, the differing tensors
   themselves (and only those) to report the largest difference per rank. Whole tensors
   never travel otherwise.

Two modes. With ``atol == rtol == 0`` (the default) the comparison is *bitwise*: a
fingerprint is a word sum and two position-weighted hashes of the raw bits, exact integer
arithmetic (see :func:`fingerprints` for what is guaranteed): any change of a single
element is always caught, a swap of two elements in different blocks of 1024 words
with overwhelming probability, a reordering inside one block never; the same NaN on every
rank is consistent. With a tolerance, the fingerprint is the float64 sum, sum of squares
and sum of absolute values of the finite elements and the counts of NaN, +Inf and -Inf;
two ranks disagree when a count differs or a sum differs by more than elementwise
``|a - b| <= atol + rtol * |b|`` allows. A tolerance mismatch is therefore certain; a
pass means the sums agree within those bounds. Tolerance mode exchanges the sums first
and the counts only for tensors whose sums are not finite on some rank. It casts every
element to float64: prefer the bitwise mode for checks on every step.

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
:func:`check_parameters` after the step catches weights that have already drifted apart.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import re
import threading
import time
from datetime import timedelta
from typing import Any, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from graddbg._errors import DDPInconsistencyError, DDPTimeoutError, GraddbgError

__all__ = [
    "ConsistencyReport",
    "Mismatch",
    "check_gradients",
    "check_parameters",
    "check_buffers",
    "fingerprints",
    "prepare",
]

_BLOCK = 1024                   # words per block: the bitwise fingerprint sums each block once
_WEIGHT_MULTS = (0x5BD1E995, 0x27D4EB2F)        # odd multipliers: one per hash (_cell_plan)
_PRIME = 2_147_483_647          # 2**31 - 1: the digest of a whole table uses primes below 2**31
_MULT = 1_103_515_245           # digest weight of position i is (i + 1) * _MULT mod the prime
_MAX_DETAIL_TENSORS = 16        # details=True gathers at most this many differing tensors
_DETAIL_BYTES = 1 << 25         # ... in slices of at most this many bytes over all ranks
_MAX_STR_ROWS = 10              # str(report) shows at most this many rows
_BITWISE_K = 4                  # present, word sum, two block hashes
_PY_DIGEST = 1024                # tables of at most this many values are digested in Python
_TOLERANCE_K = 7                # present, nan, +inf, -inf, sum, sum of squares, sum of |x|

Timeout = Union[timedelta, float, int]


# --------------------------------------------------------------------------- fingerprints
def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a flat tensor in row-major order (dense; complex as its real view)."""
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.reshape(-1)


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; asynchronous only towards an accelerator (a non-blocking copy
    to the host could be read before it has landed)."""
    return t.to(device, non_blocking=device.type != "cpu")


def _words(t: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The bytes of ``t`` as words: (body, last).

    8-byte elements: int64 words, one per element, ``last`` is None. Otherwise int32 words
    (little-endian; 1- and 2-byte elements packed 4 or 2 to a word); when the byte count
    is not a multiple of 4, ``last`` is one more int32 word holding the 1 to 3 bytes left
    over, zero-padded. No copy unless ``t`` is not contiguous (or, for 1- and 2-byte
    elements, its start is not aligned to a word). Contiguous real 4- and 8-byte tensors
    keep their shape (their words in row-major order all the same); others come flat.
    """
    size = t.element_size()
    if (size == 4 or size == 8) and t.layout == torch.strided and not t.is_complex() \
            and t.is_contiguous():     # the common case, in one launch: words in t's shape
        return t.view(torch.int32 if size == 4 else torch.int64), None
    flat = _flat(t).contiguous()       # a no-op unless t is a strided 1-D view
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    size = flat.element_size()
    if size == 8:
        return flat.view(torch.int64), None
    if size == 4:
        return flat.view(torch.int32), None
    per = 4 // size
    n = flat.numel()
    m = n - n % per
    body = flat[:m]
    try:
        words = body.view(torch.int32)
    except RuntimeError:                 # a view that does not start on a word boundary
        words = body.clone().view(torch.int32)
    last = None
    if m < n:
        rest = flat[m:].view(torch.uint8)
        padded = torch.zeros(4, dtype=torch.uint8, device=flat.device)
        padded[: rest.numel()] = rest
        last = padded.view(torch.int32)
    return words, last


def _cells(words: torch.Tensor, last: Optional[torch.Tensor]) -> Tuple[List[torch.Tensor], bool]:
    """The block sums of one tensor's words (see :func:`_words`), in one read: "cells".

    int32 words: one cell per block of ``_BLOCK`` words, its sum modulo 2**32 (a signed
    int32 value). int64 words (8-byte elements): each block's sum modulo 2**64 gives two
    cells, its low and its high 32 bits. Returns (pieces, wide) with wide for int64 words.
    """
    wide = words.dtype == torch.int64
    n = words.numel()
    full = n // _BLOCK
    parts = []
    if full:                # wrapping integer sums: one streaming pass, no cast, no copy
        body = words if n == full * _BLOCK else words.reshape(-1)[: full * _BLOCK]
        parts.append(body.view(full, _BLOCK).sum(1, dtype=words.dtype))
    if n > full * _BLOCK or last is not None or not full:
        rest = words.reshape(-1)[full * _BLOCK:].sum(dtype=words.dtype).reshape(1)
        if last is not None:                                     # add it modulo 2**32
            rest = (rest.to(torch.int64) + last.to(torch.int64)).to(torch.int32)
        parts.append(rest)
    if wide:
        parts = [p.view(torch.int32) for p in parts]             # (low, high) per block
    return parts, wide


def _small_cells(pieces: List[torch.Tensor], counts: List[int]) -> torch.Tensor:
    """One cell each for several tensors of fewer than ``_BLOCK`` int32 words, in a few
    kernels for all of them: ``pieces`` are their words laid end to end, ``counts`` how
    many words each has. Each cell is the sum of its words modulo 2**32 (signed)."""
    running = torch.cat([torch.zeros(1, dtype=torch.int64, device=pieces[0].device),
                         torch.cat([p.reshape(-1) for p in pieces]).to(torch.int64).cumsum(0)])
    ends = _constant(("ends", tuple(counts), str(running.device)), lambda: torch.tensor(
        counts, dtype=torch.int64).cumsum(0).to(running.device))
    starts = ends - torch.tensor(counts, dtype=torch.int64).to(running.device)
    return (running[ends] - running[starts]).to(torch.int32)      # wraps modulo 2**32


def _cell_plan(layout: Tuple[Tuple[int, bool, bool], ...],
               device: torch.device) -> Tuple[torch.Tensor, ...]:
    """For the cells of several tensors laid end to end (those of the large tensors in
    order, then one cell per small tensor, see _small_cells): where each tensor's cells
    start and end, the present flags, the shift that puts each cell in place in the word
    sum (0, or 32 for the high half of a 64-bit block sum) and the [2, cells] odd weights
    of the two hashes (the weight of the cell at position i of its tensor is
    2 * ((i * mult) mod 2**31) + 1: odd, and distinct for i < 2**31)."""
    def build() -> Tuple[torch.Tensor, ...]:
        order = [i for i, (_, _, small) in enumerate(layout) if not small] + \
                [i for i, (_, _, small) in enumerate(layout) if small]
        counts = [layout[i][0] for i in order]
        ends_in_order = torch.tensor(counts, dtype=torch.int64).cumsum(0) if counts else \
            torch.zeros(0, dtype=torch.int64)
        ends = torch.zeros(len(layout), dtype=torch.int64)
        ends[torch.tensor(order, dtype=torch.int64)] = ends_in_order
        starts = ends - torch.tensor([c for c, _, _ in layout], dtype=torch.int64)
        position = torch.cat([torch.arange(c, dtype=torch.int64) for c in counts]) \
            if counts else torch.zeros(0, dtype=torch.int64)
        wide = torch.repeat_interleave(torch.tensor([layout[i][1] for i in order],
                                                    dtype=torch.bool),
                                       torch.tensor(counts, dtype=torch.int64))
        shift = torch.where(wide & (position % 2 == 1), 32, 0).to(torch.int64)
        weights = torch.stack([(position * m).bitwise_and_((1 << 31) - 1).mul_(2).add_(1)
                               for m in _WEIGHT_MULTS])
        present = torch.tensor([c > 0 for c, _, _ in layout], dtype=torch.int64)
        return tuple(x.to(device) for x in (starts, ends, present, shift, weights))
    return _constant(("cells", layout, str(device)), build)


# Constant index tensors, by (what, size or layout, device): the same model asks for the
# same ones at every check, so they are built once. Bounded; cleared when full.
_CONSTANTS: dict = {}


def _constant(key: tuple, build: Any) -> Any:
    value = _CONSTANTS.get(key)
    if value is None:
        if len(_CONSTANTS) > 64:
            _CONSTANTS.clear()
        value = _CONSTANTS[key] = build()
    return value


# CPU fingerprints finish on the host in numpy (see _bitwise_fingerprints); False makes
# them take the torch path that accelerators take (the tests compare the two)
_HOST_FINISH = True


def _scan(tensors: Sequence[Optional[torch.Tensor]], host: bool) -> Tuple[List[Any], List[Tuple[int, bool, bool]]]:
    """The one pass over the data: every tensor's cells (see :func:`_cells`), in order,
    then one cell per tensor of fewer than ``_BLOCK`` int32 words, summed together (see
    :func:`_small_cells`); and the layout ``(cells, wide, small)`` per tensor. ``host``:
    the small tensors' sums in numpy (CPU tensors only)."""
    cells: List[Any] = []
    layout: List[Tuple[int, bool, bool]] = []
    small_pieces: List[torch.Tensor] = []
    small_counts: List[int] = []
    small_device = None
    for t in tensors:
        if t is None:
            layout.append((0, False, False))
            continue
        words, last = _words(t)
        if words.dtype == torch.int32 and words.numel() < _BLOCK and \
                (small_device is None or words.device == small_device):
            small_device = words.device             # batched: one cell, summed with the others
            small_pieces += [words] if last is None else [words, last]
            small_counts.append(words.numel() + (last is not None))
            layout.append((1, False, True))
            continue
        parts, wide = _cells(words, last)
        cells += parts
        layout.append((sum(p.numel() for p in parts), wide, False))
    if small_counts:
        cells.append(_small_cells_host(small_pieces, small_counts) if host
                     else _small_cells(small_pieces, small_counts))
    return cells, layout


def _bitwise_fingerprints(tensors: Sequence[Optional[torch.Tensor]],
                          device: torch.device) -> torch.Tensor:
    if _HOST_FINISH and device.type == "cpu" and all(t is None or t.is_cpu for t in tensors):
        return _bitwise_fingerprints_host(tensors)
    cells, layout = _scan(tensors, host=False)
    cells = [_to(c, device) for c in cells]
    starts, ends, present, shift, weights = _cell_plan(tuple(layout), device)
    u = torch.cat(cells).to(torch.int64) if cells else \
        torch.zeros(0, dtype=torch.int64, device=device)         # signed 32-bit values
    placed = torch.bitwise_left_shift(u, shift) if any(w for _, w, _ in layout) else u
    # Word sum and the two hashes of every tensor, all modulo 2**64 (int64 arithmetic wraps):
    # running sums over all cells, differenced at the tensors' boundaries.
    terms = torch.cat([placed.unsqueeze(0), u * weights])          # [3, cells]
    running = torch.cat([torch.zeros(3, 1, dtype=torch.int64, device=device),
                         terms.cumsum(1)], dim=1)
    sums = running[:, ends] - running[:, starts]                   # [3, tensors]
    return torch.cat([present.unsqueeze(0), sums]).t().contiguous()


def _small_cells_host(pieces: List[torch.Tensor], counts: List[int]) -> Any:
    """:func:`_small_cells` of CPU words, in numpy: int64 sums of each tensor's words, not
    yet wrapped (the finish casts them to int32, which wraps them modulo 2**32). Two numpy
    calls: inside a training step each costs tens of µs, cold."""
    import numpy as np

    words = np.concatenate([p.numpy() for p in pieces], axis=None, dtype=np.int64)
    if 0 in counts:            # reduceat cannot sum an empty run: running sums instead
        running = np.concatenate([[0], words.cumsum()])
        ends = np.cumsum(counts)
        return running[ends] - running[ends - np.array(counts)]
    return np.add.reduceat(words, list(itertools.accumulate(counts, initial=0))[:-1])


class _HostFinish:
    """The host finish of one layout of cells (see :func:`_bitwise_fingerprints_host`): its
    constants, and work buffers reused from check to check. A training loop checks the
    same model at every step; fresh buffers of a few hundred kB would be fresh pages to
    fault in each time, inside the step, and every numpy call there costs tens of µs
    (cold): the finish is four of them."""

    def __init__(self, layout: Tuple[Tuple[int, bool, bool], ...]) -> None:
        import numpy as np

        starts, _, present, shift, weights = (x.numpy() for x in _cell_plan(layout, torch.device("cpu")))
        cells = int(weights.shape[1])
        order = sorted((i for i, (c, _, _) in enumerate(layout) if c > 0), key=lambda i: int(starts[i]))
        self.rows = np.array(order, dtype=np.int64)           # the tensors, in their cells' order
        self.seg_starts = np.array([int(starts[i]) for i in order], dtype=np.int64)
        # row 0 places each cell in the word sum: u << shift, that is u * 2**shift modulo 2**64
        self.factors = np.concatenate([np.left_shift(np.ones((1, cells), dtype=np.int64), shift), weights])
        self.template = np.zeros((len(layout), _BITWISE_K), dtype=np.int64)
        self.template[:, 0] = present
        self.u = np.empty(cells, dtype=np.int32)
        self.terms = np.empty((3, cells), dtype=np.int64)
        self.lock = threading.Lock()

    def __call__(self, cells: List[Any]) -> torch.Tensor:
        import numpy as np

        table = self.template.copy()
        if not len(self.rows):
            return torch.from_numpy(table)
        arrays = [c if isinstance(c, np.ndarray) else c.numpy() for c in cells]
        mine = self.lock.acquire(blocking=False)     # another thread inside: fresh buffers
        try:
            u = self.u if mine else np.empty_like(self.u)
            terms = self.terms if mine else np.empty_like(self.terms)
            # signed 32-bit values (the small tensors' int64 sums wrap modulo 2**32 here)
            np.concatenate(arrays, out=u, casting="same_kind")
            np.multiply(u, self.factors, out=terms)               # as int64: wraps mod 2**64
            # the word sum and the two hashes of every tensor, modulo 2**64 (numpy's integer
            # arithmetic wraps, as torch's does): sums over each tensor's cells
            table[self.rows, 1:] = np.add.reduceat(terms, self.seg_starts, axis=1).T
        finally:
            if mine:
                self.lock.release()
        return torch.from_numpy(table)


def _bitwise_fingerprints_host(tensors: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
    """:func:`_bitwise_fingerprints` of CPU tensors, bit for bit the same table: the block
    sums (the one pass over the data) in torch, the rest (a few thousand cells: shifts,
    weights, sums per tensor) in numpy, with constants and buffers kept per layout. Inside
    a training step each torch launch on those few cells costs tens of microseconds, cold;
    numpy's loops cost a few."""
    cells, layout = _scan(tensors, host=True)
    key = tuple(layout)
    return _constant(("host-finish", key), lambda: _HostFinish(key))(cells)


def _position_weights(n: int, device: torch.device, prime: int = _PRIME) -> torch.Tensor:
    """Weight of position i: (i + 1) * _MULT mod prime, distinct for every i < prime."""
    return _constant(("weights", n, str(device), prime), lambda: torch.arange(
        1, n + 1, device=device, dtype=torch.int64).mul_(_MULT).remainder_(prime))


_DIGEST_PRIMES = (2_147_483_647, 2_147_483_629)   # two primes below 2**31


def _digest_ints(values: List[int]) -> List[int]:
    """:func:`_digest` of a table given as its values (row-major), in Python: for the small
    tables of most models this costs less than a few tensor launches inside a step."""
    out = []
    n = len(values)
    for p in _DIGEST_PRIMES:
        weights = _constant(("weight-ints", n, p),
                            lambda: _position_weights(n, torch.device("cpu"), p).tolist())
        out.append(sum((v % p) * w % p for v, w in zip(values, weights)))
    return out


def _digest(table: torch.Tensor) -> torch.Tensor:
    """Two int64 hashes of a whole fingerprint table (weighted sums modulo two primes).

    Equal tables give equal digests; tables that differ give different digests unless a
    difference is a multiple of both primes (about 2**62) or the differences cancel in both
    weighted sums at once.
    """
    flat = table.reshape(-1)
    out = [flat.remainder(p).mul_(_position_weights(flat.numel(), flat.device, p))
               .remainder_(p).sum() for p in _DIGEST_PRIMES]
    return torch.stack(out) if flat.numel() else torch.zeros(2, dtype=torch.int64, device=flat.device)


_CHUNK = 1 << 16     # CPU float64 sums go chunk by chunk, each chunk cast while in cache


def _float_sums(x: torch.Tensor) -> torch.Tensor:
    """float64 [sum, sum of squares, sum of |x|] of a flat tensor (NaN/Inf propagate)."""
    if x.device.type != "cpu" or x.numel() <= _CHUNK:
        if x.dtype == torch.float64 and x.numel() > _CHUNK:       # no copy: three reads
            return torch.stack([x.sum(), torch.dot(x, x), torch.linalg.vector_norm(x, 1)])
        d = x.to(torch.float64, copy=True)
        return torch.stack([d.sum(), torch.dot(d, d), d.abs_().sum()])
    # CPU: chunk by chunk, each cast into one float64 buffer that stays in cache
    pieces = x.split(_CHUNK)
    acc = torch.empty(len(pieces), 3, dtype=torch.float64)
    buf = torch.empty(_CHUNK, dtype=torch.float64)
    for i, piece in enumerate(pieces):
        d = buf[: piece.numel()]
        d.copy_(piece)
        torch.sum(d, dim=0, out=acc[i, 0])
        torch.dot(d, d, out=acc[i, 1])
        torch.sum(d.abs_(), dim=0, out=acc[i, 2])
    return acc.sum(0)


def _tolerance_quick(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[present, sum, sumsq, sumabs]: the cheap first round of tolerance mode."""
    x = _flat(t)
    one = torch.ones(1, dtype=torch.int64, device=x.device)
    return _to(torch.cat([one, _float_sums(x).view(torch.int64)]), device)


def _tolerance_row(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[present, nan, +inf, -inf, sum, sumsq, sumabs] with the sums over finite elements."""
    x = _flat(t)
    if not (x.is_floating_point()):
        counts = torch.zeros(3, dtype=torch.int64, device=x.device)
    else:
        counts = torch.stack([torch.isnan(x).sum(), (x == float("inf")).sum(),
                              (x == float("-inf")).sum()])
        x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    one = torch.ones(1, dtype=torch.int64, device=x.device)
    return _to(torch.cat([one, counts, _float_sums(x).view(torch.int64)]), device)


def _tolerance_fingerprints(tensors: Sequence[Optional[torch.Tensor]],
                            device: torch.device) -> torch.Tensor:
    rows = [torch.zeros(_TOLERANCE_K, dtype=torch.int64, device=device) if t is None
            else _tolerance_row(t, device) for t in tensors]
    return torch.stack(rows)


def fingerprints(tensors: Sequence[Optional[torch.Tensor]], *, mode: str = "bitwise",
                 device: Optional[torch.device] = None) -> torch.Tensor:
    """Per-tensor fingerprints, computed locally (no communication), as an int64 ``[n, k]`` table.

    ``mode="bitwise"``: columns ``present, word_sum, hash_a, hash_b``, computed from the raw
    bits with integer arithmetic only, so they are exact and the same on every machine
    and device (any summation order gives the same result). The bytes of a tensor (dense,
    row-major; complex as its real view) are read as little-endian int32 words, the last
    one zero-padded (int64 words for 8-byte element types); each block of ``_BLOCK``
    (1024) words is summed modulo 2**32 (2**64) in one streaming pass, which reads every
    tensor once. Those block sums (two 32-bit cells per block for int64 words) give
    ``word_sum``, their sum modulo 2**64, and two hashes ``sum(w_i * cell_i) mod 2**64``
    with odd weights ``w_i`` distinct for every block (two different weight sequences).
    Guaranteed:

    * a change of any single element (any of its bits) is always detected, and so is any
      change confined to one block that changes that block's word sum modulo 2**32
      (2**64 for 8-byte types);
    * a change confined to two blocks of 32-bit words: whatever the change of one block's
      sum, at most one change of the other's escapes each hash. In particular exchanging
      two 32-bit words that lie in different blocks (two float32 elements, say) escapes
      a hash only when the difference of the two words is one of at most six values
      determined by the two blocks (their weights and sums), and it must escape both;
    * not detected: any reordering of the words inside one block (a block sum does not
      depend on their order).

    Other changes are caught unless they cancel in the word sum and in both hashes at
    once (heuristically, for changes not built to cancel, about 1 in 2**64). NaNs compare by
    their bits: the same NaN is consistent, ``-0.0`` differs from ``0.0``.

    ``mode="tolerance"``: ``present, nan, posinf, neginf`` and the float64
    ``sum, sum_of_squares, sum_abs`` of the finite elements, stored bit for bit in int64
    (``table[:, 4:].view(torch.float64)``). ``None`` entries get ``present == 0``.
    The table lands on ``device`` (default: the first tensor's device).

    >>> a = torch.tensor([1.0, float("nan"), 3.0])
    >>> b = a.clone(); b[2] = 3.0000002
    >>> fp = fingerprints([a, a.clone(), b, None])
    >>> fp.shape
    torch.Size([4, 4])
    >>> bool((fp[0] == fp[1]).all()), bool((fp[0] == fp[2]).all()), fp[3, 0].item()
    (True, False, 0)
    """
    if mode not in ("bitwise", "tolerance"):
        raise GraddbgError(f"fingerprints(mode=...): got {mode!r}; accepted: 'bitwise', 'tolerance'")
    if device is None:
        device = next((t.device for t in tensors if t is not None), torch.device("cpu"))
    if not tensors:
        k = _BITWISE_K if mode == "bitwise" else _TOLERANCE_K
        return torch.zeros(0, k, dtype=torch.int64, device=device)
    if mode == "bitwise":
        return _bitwise_fingerprints(tensors, device)
    return _tolerance_fingerprints(tensors, device)


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


@dataclasses.dataclass(frozen=True)
class ConsistencyReport:
    """The verdict of a collective check; the same on every rank.

    ``ok`` (also ``bool(report)``), ``world_size``, ``rank`` (this process's rank in the
    group), ``kind`` ("gradients", "parameters" or "buffers"), ``mode`` ("bitwise" or
    "tolerance"), ``checked`` (number of tensors compared), ``rows`` (the
    :class:`Mismatch` records) and ``mismatches``, the same as a DataFrame.
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
        if self.ok:
            return f"{head}: consistent ({self.checked} tensors)"
        first = self.rows[0]
        return (f"{head}: {len(self.names)} of {self.checked} tensors differ, first "
                f"{first.name!r} on rank(s) {sorted({m.rank for m in self.rows if m.name == first.name})} "
                f"({first.reason}); ranks that differ: {self.ranks}")

    def __str__(self) -> str:
        lines = [f"ConsistencyReport[rank {self.rank}]: {self.summary()}"]
        if not self.ok:
            header = ("name", "rank", "ref", "reason", "max_abs_diff")
            table = [header] + [
                (m.name, str(m.rank), str(m.reference_rank), m.reason,
                 "" if m.max_abs_diff != m.max_abs_diff else f"{m.max_abs_diff:.4g}")
                for m in self.rows[:_MAX_STR_ROWS]]
            widths = [max(len(r[i]) for r in table) for i in range(len(header))]
            lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
            if len(self.rows) > _MAX_STR_ROWS:
                lines.append(f"  ... and {len(self.rows) - _MAX_STR_ROWS} more rows "
                             "(report.mismatches has them all)")
        return "\n".join(lines)


# --------------------------------------------------------------------------- plumbing
def _unwrap(model: Any, fn: str) -> nn.Module:
    if isinstance(model, type) and issubclass(model, nn.Module):
        raise GraddbgError(f"{fn}(model=...): got the class {model.__name__}, expected an "
                           f"nn.Module instance; instantiate it first")
    if not isinstance(model, nn.Module):
        raise GraddbgError(f"{fn}(model=...): got {type(model).__name__}, expected an nn.Module "
                           f"(a DistributedDataParallel wrapper or a plain module)")
    seen = 0
    while seen < 8:
        seen += 1
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            mods = model.__dict__.get("_modules")  # (not hasattr: a Module raises and formats a message)
            orig = mods.get("_orig_mod") if isinstance(mods, dict) else getattr(model, "_orig_mod", None)
            if not isinstance(orig, nn.Module):  # torch.compile's wrapper holds the model there
                break
            model = orig
    return model


def _validate(fn: str, group: Any, atol: float, rtol: float, timeout: Timeout) -> timedelta:
    if not (dist.is_available() and dist.is_initialized()):
        raise GraddbgError(f"{fn}: torch.distributed is not initialized; call "
                           f"torch.distributed.init_process_group(...) on every rank first "
                           f"(or launch with torchrun)")
    for arg, val in (("atol", atol), ("rtol", rtol)):
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not val >= 0 \
                or val == float("inf"):
            raise GraddbgError(f"{fn}({arg}=...): got {val!r}; accepted: a finite number >= 0")
    if isinstance(timeout, bool) or not isinstance(timeout, (timedelta, int, float)):
        raise GraddbgError(f"{fn}(timeout=...): got {timeout!r}; accepted: a datetime.timedelta "
                           f"or a number of seconds > 0")
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if timeout.total_seconds() <= 0:
        raise GraddbgError(f"{fn}(timeout=...): got {timeout}; accepted: a positive duration")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise GraddbgError(f"{fn}(group=...): got {type(group).__name__}; accepted: None (the "
                           f"default group) or a torch.distributed.ProcessGroup")
    if _group_info(group) is None:
        raise GraddbgError(f"{fn}(group=...): this process (global rank {dist.get_rank()}) is not "
                           f"a member of the group; call the check only on its members")
    return timeout


def _backend(group: Any) -> str:
    return str(dist.get_backend(group)).lower()


# What a check asks of its group at every call, by the group's id: (the group, its backend,
# this process's rank in it, its size, this rank's counter key). Fixed for the group's
# life; the entry keeps the group alive, so that its id is not reused. Bounded.
_GROUPS: dict = {}


def _group_info(group: Any) -> Optional[Tuple[str, int, int, str]]:
    """``(backend, rank, world size, counter key)`` of ``group`` for this process, or None
    when this process is not a member. Each is a few torch.distributed calls, and inside a
    training step every call counts."""
    g = group if group is not None else dist.group.WORLD
    entry = _GROUPS.get(id(g))
    if entry is None or entry[0] is not g:
        rank = dist.get_rank(group)
        if rank < 0:
            return None
        if len(_GROUPS) > 16:
            _GROUPS.clear()
        entry = _GROUPS[id(g)] = (g, _backend(group), rank, dist.get_world_size(group),
                                  _counter_key(group, dist.get_rank()))
    return entry[1:]


def _comm_device(group: Any, tensors: Iterable[Optional[torch.Tensor]]) -> torch.device:
    backend = _group_info(group)[0]
    if backend in ("gloo", "mpi"):
        return torch.device("cpu")
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    first = next((t.device for t in tensors if t is not None), torch.device("cpu"))
    if "cpu:" in backend and first.type == "cpu":
        return first
    if first.type == "cuda" and first.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return first


# Barrier groups by group: creating a group is collective, so it happens once per group
# (in prepare() or in the first check) and is cached for the life of the process. The
# entry keeps the group itself alive, so that its id is not reused.
_SIDE_GROUPS: dict = {}


def _barrier_group(group: Any, timeout: timedelta, force_side: bool = False) -> Any:
    if not force_side and _group_info(group)[0] == "gloo":   # monitored_barrier takes pure gloo only
        return group
    key = id(group if group is not None else dist.group.WORLD)
    entry = _SIDE_GROUPS.get(key)
    if entry is None:
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
        entry = (group, side)
        _SIDE_GROUPS[key] = entry
    return entry[1]


def prepare(group: Any = None, *, timeout: Timeout = timedelta(seconds=300)) -> None:
    """Create (once, cached) the gloo group the checks exchange on (and detect missing ranks with).

    Needed only for groups of another backend than gloo (NCCL, for instance), and even then
    optional: the first check creates it. Creating a group is collective, so call this
    on every rank of ``group`` at the same point, right after ``init_process_group``,
    when a later check may be reached by some ranks only.

    >>> prepare()  # doctest: +SKIP
    """
    timeout = _validate("prepare", group, 0.0, 0.0, timeout)
    _barrier_group(group, timeout)


def _barrier(fn: str, group: Any, timeout: timedelta) -> None:
    bgroup = _barrier_group(group, timeout)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    try:
        dist.monitored_barrier(bgroup, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as err:
        text = str(err)
        found = re.search(r"Ranks? ([\d,\s]+) failed to pass monitoredBarrier", text)
        secs = timeout.total_seconds()
        if found:
            missing = [int(r) for r in re.findall(r"\d+", found.group(1))]
            message = (f"{fn}: rank(s) {missing} of the group (world size {world}) did not "
                       f"enter the check within {secs:g} s (seen from rank {rank}). Every rank "
                       f"must call {fn} at the same point of the program.")
        else:
            missing = []
            message = (f"{fn}: rank {rank} entered the check, but the group did not complete its "
                       f"barrier within {secs:g} s: rank 0, or a rank that rank 0 names in its own "
                       f"error, did not enter it. Every rank must call {fn} at the same point "
                       f"of the program.")
        error = DDPTimeoutError(f"{message} (torch.distributed said: {text.strip()[:300]})")
        error.missing_ranks = missing  # type: ignore[attr-defined]
        raise error from err


def _barrier_into(fn: str, group: Any, timeout: timedelta, errors: List[BaseException]) -> None:
    try:
        _barrier(fn, group, timeout)
    except BaseException as err:  # re-raised by the calling thread
        errors.append(err)


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
# store holds a copy, written at each check
_ENTERED: dict = {}


def _check_in(group: Any, store: Any) -> int:
    """Count this rank into a check on ``group``: how many checks it has entered so far.

    The count is kept here and written to the process group's store with ``set``, which
    awaits no reply (``add`` would be a round trip inside every check), right before the
    exchange: the other ranks read it only after their exchange has timed out, seconds
    later. A failed write is let go (it only names missing ranks after a timeout): every
    rank must take part in the same exchange."""
    key = _group_info(group)[3]
    entry = (id(dist.group.WORLD), key)
    count = _ENTERED[entry] = _ENTERED.get(entry, 0) + 1
    try:
        store.set(key, str(count))
    except Exception:
        pass
    return count


def _entered(store: Any, key: str) -> int:
    """How many checks the rank of ``key`` has entered, as its last ``set`` says (0: none)."""
    try:
        return int(store.get(key)) if store.check([key]) else 0
    except Exception:   # unreadable: count it as absent, the error then names it
        return 0


def _exchange_header(fn: str, header: torch.Tensor, group: Any, exchange_group: Any,
                     timeout: timedelta, arrived: int) -> List[List[int]]:
    """All-gather the headers over the gloo ``exchange_group``, waiting at most ``timeout``;
    on a timeout, name the ranks that have entered fewer checks than this one."""
    _, rank, world, _ = _group_info(group)
    out = [torch.empty_like(header) for _ in range(world)]
    # the process group's own all-gather: torch.distributed.all_gather checks and looks up
    # what the check has checked and looked up already (two dozen Python calls in the step)
    pg = exchange_group if exchange_group is not None else dist.group.WORLD
    work = pg.allgather([out], [header])
    try:
        work.wait(timeout=timeout)
    except RuntimeError as err:
        store = _store()
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        counts = [_entered(store, _counter_key(group, g)) for g in ranks]
        missing = [r for r, c in enumerate(counts) if c < arrived]
        secs = timeout.total_seconds()
        if missing:
            message = (f"{fn}: rank(s) {missing} of the group (world size {world}) did not "
                       f"enter the check within {secs:g} s (seen from rank {rank}). Every rank "
                       f"must call {fn} at the same point of the program.")
        else:
            message = (f"{fn}: every rank of the group entered the check, but the exchange "
                       f"did not complete within {secs:g} s (seen from rank {rank}).")
        error = DDPTimeoutError(f"{message} After this error the process group may not be "
                                f"usable. (torch.distributed said: {str(err).strip()[:200]})")
        error.missing_ranks = missing  # type: ignore[attr-defined]
        raise error from err
    return [row.tolist() for row in out]


def _late_ranks_error(fn: str, starts: Sequence[int], timeout: timedelta, rank: int) -> None:
    """Raise on every rank when some rank started the exchange so late that the ranks that
    were waiting may have given up (their pending exchange then completes for the late
    rank, which must not carry on as if the check had passed). ``starts``: every rank's
    wall-clock time (µs) when it started waiting; clocks are assumed to agree to within
    the margin, min(1 s, timeout / 10)."""
    secs = timeout.total_seconds()
    limit = (secs - min(1.0, secs / 10)) * 1e6
    first = min(starts)
    late = [r for r, t in enumerate(starts) if t - first > limit]
    if late:
        error = DDPTimeoutError(
            f"{fn}: rank(s) {late} entered the check more than {secs:g} s after the first rank "
            f"(seen from rank {rank}); the ranks that were waiting have given up (raised "
            f"DDPTimeoutError). Every rank must call {fn} at the same point of the program.")
        error.missing_ranks = late  # type: ignore[attr-defined]
        raise error


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _meta_hash(meta: List[tuple]) -> int:
    """The hash of a model's metadata: asked for at every check, computed once."""
    key = tuple(meta)
    return _constant(("meta-hash", key), lambda: _hash64(repr(meta)))


def _call_hash(call: str) -> int:
    return _constant(("call-hash", call), lambda: _hash64(call))


def _all_gather(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    world = dist.get_world_size(group)
    out = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return torch.stack(out)


def _collect(model: nn.Module, kind: str) -> Tuple[List[str], List[Optional[torch.Tensor]], List[tuple]]:
    ignore = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()) or ())
    names: List[str] = []
    tensors: List[Optional[torch.Tensor]] = []
    meta: List[tuple] = []
    if kind == "buffers":
        items: Iterable = model.named_buffers()
    else:
        items = model.named_parameters()
    for name, t in items:
        if name in ignore:
            continue
        names.append(name)
        entry = (name, tuple(t.shape), str(t.dtype).replace("torch.", ""))
        if kind == "gradients":
            entry += (bool(t.requires_grad),)
            tensors.append(t.grad)
        else:
            tensors.append(t)
        meta.append(entry)
    return names, tensors, meta


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


def _verdict(table: torch.Tensor, names: List[str], meta: List[tuple], mode: str,
             atol: float, rtol: float) -> List[Tuple[int, int, int, str]]:
    """(param index, rank, reference rank, reason) for every entry that disagrees.

    The reference of a tensor is the rank that agrees with the most ranks (ties: the lowest
    rank); every rank that does not agree with it is reported.
    """
    world = table.shape[0]
    equal = (table == table[0:1]).all(dim=2).all(dim=0)
    out: List[Tuple[int, int, int, str]] = []
    for p in (~equal).nonzero().flatten().tolist():
        rows = table[:, p, :]
        if mode == "bitwise":
            _, label = torch.unique(rows, dim=0, return_inverse=True)
            same = label[:, None] == label[None, :]
        else:
            numel = 1
            for size in meta[p][1]:
                numel *= size
            same = _close_matrix(rows, numel, atol, rtol)
        support = same.sum(dim=1).tolist()
        ref = max(range(world), key=lambda r: (support[r], -r))
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
            out.append((p, r, ref, reason))
    return out


def _wire(t: Optional[torch.Tensor], shape: Tuple[int, ...], dtype: str,
          device: torch.device) -> Tuple[torch.Tensor, Tuple[int, ...]]:
    """What a rank sends of one tensor for details=True: flat float64 (zeros where it has
    none), and the shape its flat index refers to (complex tensors as their real view)."""
    real_shape = tuple(shape) + ((2,) if dtype.startswith("complex") else ())
    if t is None:
        numel = 1
        for s in real_shape:
            numel *= s
        return torch.zeros(numel, dtype=torch.float64, device=device), real_shape
    return _flat(t).to(device=device, dtype=torch.float64), real_shape


def _details(found: List[Tuple[int, int, int, str]], tensors: List[Optional[torch.Tensor]],
             meta: List[tuple], group: Any, device: torch.device) -> dict:
    """Gather the offending tensors (at most _MAX_DETAIL_TENSORS, in bounded slices) and
    measure, for each differing rank, the largest difference from its reference rank."""
    params = list(dict.fromkeys(p for p, _, _, _ in found))[:_MAX_DETAIL_TENSORS]
    world = dist.get_world_size(group)
    chunk = max(16, _DETAIL_BYTES // (8 * world))
    result = {}
    for p in params:
        x, shape = _wire(tensors[p], meta[p][1], meta[p][2], device)
        pairs = [(r, ref) for q, r, ref, _ in found if q == p]
        best = {r: [-1.0, 0, -1, float("nan"), float("nan")] for r, _ in pairs}
        for start in range(0, x.numel(), chunk):
            gathered = _all_gather(x[start:start + chunk], group).cpu()
            for r, ref in pairs:
                a, b = gathered[r], gathered[ref]
                same = (a == b) | (torch.isnan(a) & torch.isnan(b))
                diff = torch.where(same, torch.zeros_like(a), (a - b).abs()).nan_to_num(
                    nan=float("inf"))
                at = int(diff.argmax())
                entry = best[r]
                entry[1] += int((~same).sum())
                if float(diff[at]) > entry[0]:
                    entry[0], entry[2] = float(diff[at]), start + at
                    entry[3], entry[4] = float(a[at]), float(b[at])
        for r, (worst, n_diff, at, value, ref_value) in best.items():
            if at < 0:
                result[(p, r)] = (0.0, 0, None, None, None)
                continue
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(at), shape)) \
                if shape else ()
            result[(p, r)] = (worst, n_diff, index, value, ref_value)
    return result


def _tolerance_quick_table(tensors: List[Optional[torch.Tensor]],
                           device: torch.device) -> torch.Tensor:
    if not tensors:
        return torch.zeros(0, 4, dtype=torch.int64, device=device)
    return torch.stack([torch.zeros(4, dtype=torch.int64, device=device) if t is None
                        else _tolerance_quick(t, device) for t in tensors])


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


def _check(fn: str, kind: str, model: Any, group: Any, atol: float, rtol: float,
           timeout: Timeout, details: bool, raise_on_mismatch: bool) -> ConsistencyReport:
    module = _unwrap(model, fn)
    timeout = _validate(fn, group, atol, rtol, timeout)
    mode = "bitwise" if atol == 0 and rtol == 0 else "tolerance"
    names, tensors, meta = _collect(module, kind)
    device = _comm_device(group, itertools.chain(module.parameters(), tensors))  # (read lazily)
    _, rank, world, _ = _group_info(group)
    call = (f"{fn}(mode={mode}, atol={float(atol)!r}, rtol={float(rtol)!r}, "
            f"details={bool(details)})")

    # The local work, then the check-in (a counter per rank in the process group's store)
    # and the header exchange itself, on a gloo group, waited for at most `timeout`. A rank
    # that does not arrive makes the others' wait time out; the counters then name it.
    # Without a store to count in, a monitored barrier (in a helper thread, overlapping
    # the local work) comes first instead.
    exchange_group = _barrier_group(group, timeout)     # created here, in the calling thread
    store = _store()
    helper, barrier_errors = None, []
    if store is None:
        helper = threading.Thread(target=_barrier_into, args=(fn, group, timeout, barrier_errors),
                                  name="graddbg-ddp-barrier", daemon=True)
        helper.start()
    local_error: Optional[BaseException] = None
    try:
        if mode == "bitwise":
            local = fingerprints(tensors, mode=mode, device=device)
        else:
            local = _tolerance_quick_table(tensors, device)
        digest = _digest_ints(local.reshape(-1).tolist()) if local.numel() <= _PY_DIGEST \
            else _digest(local).tolist()
        header = [_meta_hash(meta), len(meta), _call_hash(call), world] + digest
    except Exception as err:   # tell the other ranks, so that every rank raises, none hangs
        local_error = err
        header = [-1] * 6
    if helper is not None:
        helper.join(timeout.total_seconds() + 60.0)   # the barrier has its own timeout
        if helper.is_alive():
            raise DDPTimeoutError(f"{fn}: the monitored barrier did not return within {timeout} "
                                  f"(+60 s); the process group is not usable")
        if barrier_errors:
            raise barrier_errors[0]
    else:
        arrived = _check_in(group, store)
    # last in the header: when this rank starts waiting, in µs
    wire = torch.tensor(header + [int(time.time() * 1e6)], dtype=torch.int64)
    if helper is not None:
        rows = _all_gather(wire.to(device), group).cpu().tolist()
    else:
        rows = _exchange_header(fn, wire, group, exchange_group, timeout, arrived)
    # (then a few Python comparisons: no launches inside the step)
    _late_ranks_error(fn, [r[6] for r in rows], timeout, rank)
    failed = [r for r, row in enumerate(rows) if all(v == -1 for v in row[:4])]
    if failed:
        raise DDPInconsistencyError(
            f"{fn}: rank(s) {failed} could not compute their fingerprints"
            + (f" ({type(local_error).__name__}: {local_error})" if local_error else
               "; see the error on those ranks")) from local_error
    if any(row[:4] != rows[0][:4] for row in rows):
        _structure_error(fn, kind, call, meta, group)  # raises on every rank
    agree = all(row[4:6] == rows[0][4:6] for row in rows)
    if agree and mode == "bitwise":      # every table the same: nothing differs
        table, found = None, []
    else:
        if agree:
            first = local.cpu().unsqueeze(0).expand(world, *local.shape)
        else:
            first = _all_gather(local, group).cpu()                      # find who differs
        table = first if mode == "bitwise" else _tolerance_finish(first, tensors, group, device)
        found = _verdict(table, names, meta, mode, float(atol), float(rtol))
    measured = _details(found, tensors, meta, group, device) if (details and found) else {}

    rows = []
    for p, r, ref, reason in found:
        extra = measured.get((p, r))
        rows.append(Mismatch(
            name=names[p], rank=r, reference_rank=ref, reason=reason, shape=meta[p][1],
            dtype=meta[p][2], fingerprint=_fp_text(table[r, p], mode),
            reference_fingerprint=_fp_text(table[ref, p], mode),
            **({} if extra is None else dict(zip(
                ("max_abs_diff", "n_diff", "index", "value", "reference_value"), extra)))))
    report = ConsistencyReport(ok=not rows, world_size=world, rank=rank, kind=kind, mode=mode,
                               checked=len(names), rows=tuple(rows), atol=float(atol),
                               rtol=float(rtol))
    if rows and raise_on_mismatch:
        raise DDPInconsistencyError(f"{fn}: the ranks disagree (raise_on_mismatch=True)\n{report}",
                                    report=report)
    return report


_DEFAULT_TIMEOUT = timedelta(seconds=60)


def check_gradients(model: nn.Module, *, group: Any = None, atol: float = 0.0, rtol: float = 0.0,
                    timeout: Timeout = _DEFAULT_TIMEOUT, details: bool = False,
                    raise_on_mismatch: bool = False) -> ConsistencyReport:
    """Check that every parameter's ``.grad`` is the same on every rank of ``group``.

    Collective: call it on every rank at the same point (after the synchronising backward,
    before ``optimizer.step()``). ``model`` is a ``DistributedDataParallel`` or a plain
    module (names never carry DDP's ``module.`` prefix). A parameter whose gradient is
    ``None`` on some ranks only is reported by name and rank. ``atol``/``rtol`` > 0 switch
    from the bitwise comparison to tolerance mode; ``details=True`` gathers the differing
    tensors (only those) to report the largest difference per rank;
    ``raise_on_mismatch=True`` raises :class:`DDPInconsistencyError` on every rank after
    all of them have reached the same verdict. A rank that does not arrive within
    ``timeout`` makes the others raise :class:`DDPTimeoutError`; ranks holding different
    models raise :class:`DDPInconsistencyError` naming the first difference.

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
    """Check that every parameter's value is the same on every rank (see :func:`check_gradients`).

    Run it after ``optimizer.step()`` to catch weights that drifted apart.

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

    Buffers drift apart under ``DistributedDataParallel(..., broadcast_buffers=False)``.
    With ``broadcast_buffers=True`` DDP copies rank 0's buffers at the start of every
    forward, so a training forward on different data leaves them different until the next
    one: check before the forward (or after an eval-mode forward) to test the broadcast.
    See :func:`check_gradients` for the arguments.

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> check_buffers(torch.nn.BatchNorm1d(4)).names
    []
    >>> dist.destroy_process_group()
    """
    return _check("check_buffers", "buffers", model, group, atol, rtol, timeout, details,
                  raise_on_mismatch)
