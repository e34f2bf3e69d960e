"""Fingerprints of tensors, computed locally: the hashing behind `graddbg.ddp_verify`.

Bitwise fingerprints mix every word of a tensor with its position (two 64-bit lanes, exact
integer arithmetic, the same on every device); tolerance fingerprints are float64 sums and
NaN/Inf counts. See `fingerprints` for the construction and what it guarantees, and
docs/explain/fingerprint.md. Nothing here communicates.
"""
from __future__ import annotations

import math
import time
from typing import Any, List, Optional, Sequence, Tuple

import torch

from graddbg._compiled import KINDS, Twin
from graddbg._errors import GraddbgValueError

__all__ = ["fingerprints", "set_fingerprint_kernel", "digest", "flat_values", "tolerance_quick_table",
           "TOLERANCE_K"]

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
_BITWISE_K = 3                  # present, two 64-bit lanes
TOLERANCE_K = 7                # present, nan, +inf, -inf, sum, sum of squares, sum of |x|
_KEY_CACHE: dict = {}           # the fingerprint keys, per device (_keys)


# --------------------------------------------------------------------------- fingerprints
def flat_values(t: torch.Tensor) -> torch.Tensor:
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
    flat = flat_values(t).contiguous()
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


def digest(table: torch.Tensor) -> torch.Tensor:
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
        return torch.zeros(TOLERANCE_K if counts else 4, dtype=torch.int64)
    sums = _float_sums(flat_values(t), counts)
    one = torch.ones(1, dtype=torch.int64, device=sums.device)
    if not counts:
        return torch.cat([one, sums.view(torch.int64)])
    return torch.cat([one, sums[:3].to(torch.int64), sums[3:].view(torch.int64)])


def _tolerance_table(tensors: Sequence[Optional[torch.Tensor]], device: torch.device,
                     counts: bool = True) -> torch.Tensor:
    """The tolerance rows of every tensor (see `_tolerance_row`), on ``device``."""
    k = TOLERANCE_K if counts else 4
    if not tensors:
        return torch.zeros(0, k, dtype=torch.int64, device=device)
    return torch.stack([_tolerance_row(t, counts).to(device) for t in tensors])


def tolerance_quick_table(tensors: Sequence[Optional[torch.Tensor]],
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
