"""The verdict of a cross-rank check: the ranks' headers checked for comparable models,
the fingerprint tables compared within each replica group, the rank that differs named
against the reference (the largest group of ranks that agree), and with ``details=True``
the largest difference measured (steps 4 and 5 of `graddbg.ddp_verify`'s module docstring).
"""
from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from graddbg._errors import DDPInconsistencyError
from graddbg._fingerprint import TOLERANCE_K, fingerprints, flat_values
from graddbg._dist.collective import all_gather
from graddbg._dist.rendezvous import raise_if_late
from graddbg._dist.replicas import CheckOptions, gather_tables, no_replicas, tensor_sets

__all__ = ["ABSENCE", "NO_GRADIENT", "ONLY_GRADIENT", "compare", "details", "disagreements",
           "fingerprint_text", "raise_unless_comparable"]

#: the reasons of a mismatch in presence (a gradient on one rank and not the other); the
#: other reasons compare values ("bits differ", "NaN/Inf counts differ", ...)
NO_GRADIENT = "no gradient on this rank"
ONLY_GRADIENT = "has a gradient, the reference rank has none"
ABSENCE = (NO_GRADIENT, ONLY_GRADIENT)

_MAX_DETAIL_TENSORS = 16        # details=True gathers at most this many differing tensors
_DETAIL_BYTES = 1 << 25         # ... in slices of at most this many bytes over all ranks


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


def fingerprint_text(row: torch.Tensor, mode: str) -> str:
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
            reason = NO_GRADIENT if not int(rows[r, 0]) else ONLY_GRADIENT
        elif mode == "bitwise":
            reason = "bits differ"
        elif not torch.equal(rows[r, 1:4], rows[ref, 1:4]):
            reason = "NaN/Inf counts differ"
        else:
            reason = "values differ beyond atol/rtol"
        out.append((r, ref, reason))
    return out


def disagreements(table: torch.Tensor, names: List[str], meta: List[tuple], mode: str,
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
    for p, groups in enumerate(per_tensor):
        for ranks in groups:
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


def _wire(t: Optional[torch.Tensor], length: int, device: torch.device) -> torch.Tensor:
    """What a rank sends of one tensor for details=True: flat float64 (complex tensors as
    their real view), zero-padded to ``length`` (all zeros where it has none)."""
    x = torch.zeros(length, dtype=torch.float64, device=device)
    if t is not None:
        flat = flat_values(t)
        x[: flat.numel()] = flat.to(device=device, dtype=torch.float64)
    return x


def _largest_differences(x: torch.Tensor, pairs: List[Tuple[int, int]], group: Any) -> dict:
    """Gather ``x`` from every rank in bounded slices; for each (rank, reference rank) pair:
    rank -> [largest difference, elements that differ, flat index, value, reference value]."""
    chunk = max(16, _DETAIL_BYTES // (8 * dist.get_world_size(group)))
    best = {r: [-1.0, 0, -1, float("nan"), float("nan")] for r, _ in pairs}
    for start in range(0, x.numel(), chunk):
        gathered = all_gather(x[start:start + chunk], group).cpu()
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


def details(found: List[Tuple[int, int, int, str]], tensors: List[Optional[torch.Tensor]],
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
    table = torch.zeros(world, count, TOLERANCE_K, dtype=torch.int64)
    table[:, :, 0] = first[:, :, 0]
    table[:, :, 4:] = first[:, :, 1:]
    sums = first[:, :, 1:].contiguous().view(torch.float64)
    again = ((~torch.isfinite(sums)).any(dim=2) & (first[:, :, 0] == 1)).any(dim=0)
    redo = again.nonzero().flatten().tolist()
    if redo:
        full = fingerprints([tensors[p] for p in redo], mode="tolerance", device=device)
        table[:, redo, :] = all_gather(full, group).cpu()
    return table


# --------------------------------------------------------------------------- the check


def raise_unless_comparable(options: CheckOptions, rows: List[List[int]], meta: List[tuple],
                            error: Optional[BaseException]) -> None:
    """On every rank alike: a rank that came too late, a rank that could not fingerprint,
    ranks holding different models or asking different checks."""
    raise_if_late(options.fn, [row[-1] for row in rows], options.timeout,
                  dist.get_rank(options.group))
    failed = [r for r, row in enumerate(rows) if all(v == -1 for v in row[:4])]
    if failed:
        raise DDPInconsistencyError(
            f"{options.fn}: rank(s) {failed} could not compute their fingerprints"
            + (f" ({type(error).__name__}: {error})" if error else
               "; see the error on those ranks")) from error
    if any(row[:4] != rows[0][:4] for row in rows):
        _structure_error(options.fn, options.kind, options.call, meta, options.group)


def compare(options: CheckOptions, rows: List[List[int]], sets: Optional[List[List[int]]],
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
        first, numels, shards = gather_tables(options, local, meta, layout)   # find who differs
        if options.sharded:
            per_tensor = tensor_sets(shards, sets)
            if world > 1 and all(len(s) == 1 for groups in per_tensor for s in groups):
                raise no_replicas(options, names, layout)
    table = first if options.mode == "bitwise" else \
        _tolerance_finish(first, tensors, options.group, device)
    return table, disagreements(table, [], meta, options.mode, options.atol, options.rtol,
                                numels=numels, per_tensor=per_tensor), per_tensor
