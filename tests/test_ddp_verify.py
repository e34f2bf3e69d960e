"""Tests of graddbg.ddp_verify.

Local tests check the fingerprints against naive references and the verdict logic on
synthetic tables. Distributed tests spawn real gloo worlds on 127.0.0.1 (tests/_ddp_workers.py):
one 2-rank and one 3-rank world, each running many scenarios, with every rank writing what
it saw; the tests below assert on those records, for every rank.
"""
from __future__ import annotations

import math
import time
import random
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import _ddp_workers as workers
from conftest import requires_cuda
from graddbg import DDPInconsistencyError, DDPTimeoutError, GraddbgError, ddp_verify
from graddbg import _fingerprint, _verdict
from graddbg._dist import rendezvous as _rendezvous
from graddbg._dist import replicas as _replicas
from graddbg._errors import GraddbgTypeError, GraddbgValueError

# --------------------------------------------------------------------------- references

_M64 = 1 << 64


def _signed(v: int, bits: int) -> int:
    v &= (1 << bits) - 1
    return v - (1 << bits) if v >= 1 << (bits - 1) else v


def _raw_words(t: torch.Tensor) -> list:
    """The tensor's bytes as little-endian unsigned 32-bit words, the last zero-padded."""
    flat = t.detach()
    if flat.layout != torch.strided:
        flat = flat.to_dense()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    flat = flat.reshape(-1).contiguous()
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    raw = bytes(flat.view(torch.uint8).tolist())
    raw += bytes(-len(raw) % 4)
    return [int.from_bytes(raw[i:i + 4], "little") for i in range(0, len(raw), 4)]


def _splitmix64_finaliser(z: int) -> int:
    z %= _M64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % _M64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % _M64
    return z ^ (z >> 31)


def naive_bitwise(t: torch.Tensor) -> list:
    """The bitwise fingerprint written out with Python integers, from the tensor's bytes.

    Words: little-endian 32-bit, the last one zero-padded; each mixed, h = fold(M *
    fold(w)) with fold(x) = x ^ (x >> 16) on 32 bits, read as a signed 32-bit integer; per
    block of _fingerprint._BLOCK words the sum of K_j * h_j modulo 2**64 (K the fixed odd
    weight of position j) is the block's value v_b; each lane is the sum of mix64(v_b + b *
    golden + seed) over the blocks b, modulo 2**64.
    """
    keys = _fingerprint._keys(torch.device("cpu")).tolist()
    words = _raw_words(t)

    def fold(x):
        x &= 0xFFFFFFFF
        return x ^ (x >> 16)
    block = _fingerprint._BLOCK
    values = []
    for start in range(0, len(words), block):
        h = [_signed(fold(fold(w) * _fingerprint._MIX32), 32) for w in words[start:start + block]]
        values.append(sum(k * x for k, x in zip(keys, h)) % _M64)
    lanes = [sum(_splitmix64_finaliser(v + b * 0x9E3779B97F4A7C15 + seed)
                 for b, v in enumerate(values)) for seed in _fingerprint._LANE_SEEDS]
    return [1] + [_signed(v % _M64, 64) for v in lanes]


def naive_tolerance(t: torch.Tensor) -> list:
    vals = [float(v) for v in t.detach().reshape(-1).double().tolist()]
    finite = [v for v in vals if math.isfinite(v)]
    return [1, sum(math.isnan(v) for v in vals), vals.count(math.inf), vals.count(-math.inf),
            math.fsum(finite), math.fsum(v * v for v in finite), math.fsum(abs(v) for v in finite)]


SHAPES = [(), (7,), (3, 5), (1024,), (2, 1024), (2500,), (3, 1100), (4097,), (4201,)]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.uint8,
          torch.int8, torch.bool]


def _tensor(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(-100 if dtype.is_signed else 0, 200 if dtype != torch.int8 else 100,
                         shape, generator=g).to(dtype)


def _fp(t: torch.Tensor) -> list:
    return ddp_verify.fingerprints([t])[0].tolist()


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# --------------------------------------------------------------------------- fingerprints


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bitwise_fingerprint_matches_naive_reference(shape, dtype):
    t = _tensor(shape, dtype)
    assert _fp(t) == naive_bitwise(t)


def test_a_batch_of_mixed_tensors_matches_the_reference_one_by_one():
    """Every dtype and shape, a NaN, an empty tensor, None, a transposed view and a large
    float64 tensor in one call: each row is the naive reference's."""
    ts = [_tensor(s, d, seed=i) for i, (s, d) in enumerate(zip(SHAPES * 2, DTYPES + DTYPES[::-1]))]
    ts += [None, torch.zeros(0), _tensor((64, 70), torch.float32).t(), _tensor((300000,), torch.float64)]
    ts[3][0] = float("nan")
    table = ddp_verify.fingerprints(ts)
    for i, t in enumerate(ts):
        assert table[i].tolist() == ([0, 0, 0] if t is None else naive_bitwise(t)), i


def test_small_tensors_weighted_sums_wrap_modulo_2_32():
    """Tensors of fewer than _BLOCK words (one block each) of extreme words, batched with
    empty ones: the same as the reference."""
    big = torch.full((1000,), 0x7FFFFFF0, dtype=torch.int32)
    ts = [big.view(10, 100), torch.zeros(0, dtype=torch.int32), torch.tensor([-5, 3], dtype=torch.int32),
          -big, big[:999]]
    table = ddp_verify.fingerprints(ts)
    assert [table[i].tolist() for i in range(len(ts))] == [naive_bitwise(t) for t in ts]


def test_digest_is_the_weighted_sum_modulo_two_primes():
    rng = random.Random(3)
    extremes = [-(2**63), 2**63 - 1, -1, 0, 2_147_483_647, -2_147_483_629]
    for n in (0, 1, 7, 400):
        values = [rng.choice(extremes) if rng.random() < 0.3 else rng.randrange(-(2**63), 2**63)
                  for _ in range(4 * n)]
        want = [sum((v % p) * ((i + 1) * _fingerprint._MULT % p) for i, v in enumerate(values)) % p
                for p in _fingerprint._DIGEST_PRIMES]
        got = _fingerprint.digest(torch.tensor(values, dtype=torch.int64).reshape(n, 4)).tolist()
        assert [g % p for g, p in zip(got, _fingerprint._DIGEST_PRIMES)] == want


def test_bitwise_fingerprint_wraps_a_partial_block_and_its_padded_last_word():
    """A partial last block whose last word is zero-padded: as in the reference (the
    missing words count as zeros)."""
    h = torch.zeros(2101, dtype=torch.float16)          # 1024 + 26 words and a half word
    halves = h.view(torch.int16)
    halves[2048], halves[2049] = -16, 0x7FFF             # word 1024 = 0x7FFFFFF0
    halves[2100] = 0x7FFF                                # the last, padded word: 0x00007FFF
    assert _fp(h) == naive_bitwise(h)


def test_bitwise_fingerprint_batches_like_one_at_a_time():
    ts = [_tensor(s, d, seed=i) for i, (s, d) in enumerate(zip(SHAPES, DTYPES))]
    table = ddp_verify.fingerprints(ts + [None] + ts[:2])
    assert table.shape == (len(ts) + 3, 3)
    for i, t in enumerate(ts + [None] + ts[:2]):
        assert table[i].tolist() == (_fp(t) if t is not None else [0, 0, 0])


# Every position, last element included: tensors with full blocks and a partial one, an odd
# count of 2-byte elements (a zero-padded last word), 8-byte elements, bytes, a transposed view.
SINGLE_CHANGE_CASES = {
    "float32": lambda: _tensor((2500,), torch.float32),
    "float16-odd": lambda: _tensor((2049,), torch.float16),
    "bfloat16": lambda: _tensor((3, 700), torch.bfloat16),
    "float64": lambda: _tensor((1030,), torch.float64),
    "uint8-odd": lambda: _tensor((4099,), torch.uint8),
    "non-contiguous": lambda: _tensor((70, 40), torch.float32).t(),
}


@pytest.mark.parametrize("case", list(SINGLE_CHANGE_CASES))
def test_a_change_of_any_single_element_is_always_detected(case):
    t = SINGLE_CHANGE_CASES[case]()
    n = t.numel()
    # n copies laid out like t (same strides), copy k with one random bit of element k flipped
    batch = torch.empty_strided((n,) + t.shape, (n,) + t.stride(), dtype=t.dtype)
    batch.copy_(t.expand(n, *t.shape))
    ints = batch.view(_INT_OF_SIZE[t.element_size()])
    index = (torch.arange(n),) + torch.unravel_index(torch.arange(n), t.shape)  # every position
    g = torch.Generator().manual_seed(len(case))
    bit = torch.randint(0, 8 * t.element_size(), (n,), generator=g).to(ints.dtype)
    ints[index] = ints[index] ^ torch.bitwise_left_shift(torch.ones_like(bit), bit)
    copies = list(batch.unbind(0))
    assert copies[-1].stride() == t.stride()
    assert not torch.equal(copies[-1].reshape(-1)[-1:], t.reshape(-1)[-1:])  # last one changed
    table = ddp_verify.fingerprints([t] + copies)      # batched: the same as one by one
    differs = (table[1:] != table[0]).any(dim=1)
    assert bool(differs.all()), (~differs).nonzero().flatten().tolist()


def test_an_8_byte_element_whose_32_bit_halves_change_in_opposite_ways_is_detected():
    """The low word +1, the high word -1: a sum of 32-bit words would not see it."""
    t = _tensor((2000,), torch.float64)
    for k in (0, 999, 1999):
        u = t.clone()
        halves = u.view(torch.int32)
        halves[2 * k] += 1
        halves[2 * k + 1] -= 1
        assert _fp(u) != _fp(t), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
def test_two_elements_swapped_across_blocks_are_detected(dtype):
    size = torch.empty(0, dtype=dtype).element_size()
    per_block = _fingerprint._BLOCK * max(1, 4 // size)                 # elements per block
    t = _tensor((3 * per_block + 100,), dtype)
    base = _fp(t)
    rng = random.Random(1)
    pairs = [(0, t.numel() - 1), (per_block - 1, per_block)]       # first/last, across a boundary
    pairs += [(rng.randrange(t.numel()), rng.randrange(t.numel())) for _ in range(300)]
    checked = 0
    for i, j in pairs:
        if i // per_block == j // per_block or torch.equal(t[i:i + 1].view(torch.uint8),
                                                             t[j:j + 1].view(torch.uint8)):
            continue
        u = t.clone()
        u[i], u[j] = t[j], t[i]
        assert _fp(u) != base, (i, j)
        checked += 1
    assert checked > 150
    # x and -x swapped (the words differ in the sign bit only)
    far = 2 * per_block + 7
    u = t.clone()
    u[far] = -u[10]
    swapped = u.clone()
    swapped[10], swapped[far] = u[far], u[10]
    assert _fp(swapped) != _fp(u)


def test_swaps_inside_one_block_are_detected():
    """Every word is mixed with its position in the block: no reordering is invisible
    (the block sums this replaced did not see these)."""
    t = _tensor((3000,), torch.float32)
    for i, j in ((5, 900), (0, 1), (1022, 1023), (2048, 2999)):
        u = t.clone()
        u[i], u[j] = t[j], t[i]
        assert _fp(u) != _fp(t), (i, j)


def test_same_nan_is_consistent_but_signed_zero_and_nan_payloads_are_not_bitwise():
    a = torch.tensor([1.0, float("nan"), float("inf"), 0.0] * 700)
    b = a.clone()
    assert torch.equal(ddp_verify.fingerprints([a]), ddp_verify.fingerprints([b]))
    b[-1] = -0.0
    assert not torch.equal(ddp_verify.fingerprints([a]), ddp_verify.fingerprints([b]))
    other_nan = a.clone()
    other_nan.view(torch.int32)[1] |= 1              # a NaN with another payload
    assert math.isnan(other_nan[1].item())
    assert _fp(other_nan) != _fp(a)
    # the tolerance fingerprint treats -0.0 and 0.0 alike
    assert torch.equal(ddp_verify.fingerprints([a], mode="tolerance"),
                       ddp_verify.fingerprints([b], mode="tolerance"))


def test_fingerprints_of_other_layouts_and_dtypes():
    dense = torch.tensor([[0.0, 2.0], [3.0, 0.0]])
    assert torch.equal(ddp_verify.fingerprints([dense.to_sparse()]), ddp_verify.fingerprints([dense]))
    noncontig = torch.randn(6, 4).t()
    assert torch.equal(ddp_verify.fingerprints([noncontig]),
                       ddp_verify.fingerprints([noncontig.contiguous()]))
    z = torch.randn(5, dtype=torch.complex64)
    assert _fp(z) == naive_bitwise(torch.view_as_real(z))
    z = torch.randn(1500, dtype=torch.complex128)                     # 8-byte words
    assert _fp(z) == naive_bitwise(torch.view_as_real(z))
    assert _fp(torch.tensor([True, False, True])) == naive_bitwise(torch.tensor([1, 0, 1], dtype=torch.uint8))
    assert _fp(torch.empty(0)) == [1, 0, 0]
    assert ddp_verify.fingerprints([]).shape == (0, 3)
    # a half-precision view that does not start on a 4-byte boundary, strided 1-D views:
    # the same as fresh copies
    h = _tensor((2101,), torch.float16)
    for view in (h[1:], h[::2], _tensor((3000,), torch.float32)[1::2]):
        assert _fp(view) == _fp(view.clone()) == naive_bitwise(view)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2500,), (3, 50000)], ids=str)   # last: chunked
def test_tolerance_fingerprint_matches_naive_reference(shape, dtype, monkeypatch):
    monkeypatch.setattr(_fingerprint, "_CHUNK", 4096)     # float64 casts in slices of 4096
    t = _tensor(shape, dtype)
    t.reshape(-1)[0] = float("nan")
    t.reshape(-1)[-1] = float("-inf")
    row = ddp_verify.fingerprints([t], mode="tolerance")[0]
    ref = naive_tolerance(t)
    assert row[:4].tolist() == ref[:4]
    got = row[4:].view(torch.float64).tolist()
    # and the quick first round (sums of everything): NaN propagates
    quick = _fingerprint.tolerance_quick_table([t], torch.device("cpu"))[0]
    assert quick[0] == 1 and all(math.isnan(v) for v in quick[1:].view(torch.float64).tolist())
    finite = t.clone()
    finite.reshape(-1)[0] = 1.0
    finite.reshape(-1)[-1] = -2.0
    quick = _fingerprint.tolerance_quick_table([finite], torch.device("cpu"))[0]
    assert quick[1:].view(torch.float64).tolist() == pytest.approx(naive_tolerance(finite)[4:],
                                                                     rel=1e-12)
    assert got == pytest.approx(ref[4:], rel=1e-12)


def test_fingerprints_under_deterministic_algorithms(device):
    """Users debugging gradients often run with torch.use_deterministic_algorithms(True):
    the fingerprint kernels must not refuse it (on CUDA, a 2-D scatter_add_ would)."""
    ts = [_tensor((2500,), torch.float32), None, _tensor((7,), torch.float64), _tensor((3, 5), torch.bfloat16)]
    ts = [None if t is None else t.to(device) for t in ts]
    want = ddp_verify.fingerprints([None if t is None else t.cpu() for t in ts])
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        got = ddp_verify.fingerprints(ts)
    finally:
        torch.use_deterministic_algorithms(before)
    assert got.device == ts[0].device and torch.equal(got.cpu(), want)


def test_fingerprints_leave_their_tensors_unchanged():
    ts = [_tensor((2500,), torch.float64), -_tensor((7,), torch.float32), _tensor((5,), torch.float16)]
    ts[0][3] = -math.inf
    before = [t.clone() for t in ts]
    for mode in ("bitwise", "tolerance"):
        ddp_verify.fingerprints(ts, mode=mode)
    _fingerprint.tolerance_quick_table(ts, torch.device("cpu"))
    assert all(torch.equal(t, b) for t, b in zip(ts, before))


def test_fingerprints_rejects_unknown_mode():
    with pytest.raises(GraddbgValueError, match=r"mode=.*'exact'.*accepted: 'bitwise', 'tolerance'"):
        ddp_verify.fingerprints([torch.ones(2)], mode="exact")


# --------------------------------------------------------------------------- the verdict


def _table(rows_per_rank, mode="bitwise"):
    return torch.stack([ddp_verify.fingerprints(rows, mode=mode) for rows in rows_per_rank])


def test_verdict_reports_the_minority_and_breaks_ties_towards_rank_0():
    a, b = torch.ones(3), torch.tensor([1.0, 2.0, 1.0])
    meta = [("w", (3,), "float32")]
    # three ranks, rank 0 is the odd one: the majority {1, 2} is the reference
    found = _verdict.disagreements(_table([[b], [a], [a]]), ["w"], meta, "bitwise", 0.0, 0.0)
    assert found == [(0, 0, 1, "bits differ")]
    # two ranks: a tie, the group holding rank 0 is the reference
    found = _verdict.disagreements(_table([[b], [a]]), ["w"], meta, "bitwise", 0.0, 0.0)
    assert found == [(0, 1, 0, "bits differ")]
    # a missing tensor on one rank of three
    found = _verdict.disagreements(_table([[a], [None], [a]]), ["w"], meta + [], "bitwise", 0.0, 0.0)
    assert found == [(0, 1, 0, "no gradient on this rank")]


def _close(a, b, numel, atol, rtol):
    """Could two tolerance fingerprints come from tensors with |a - b| <= atol + rtol |b|?"""
    return bool(_verdict._close_matrix(torch.stack([a, b]), numel, atol, rtol)[0, 1])


@pytest.mark.parametrize("seed", range(20))
def test_tolerance_bounds_never_flag_elementwise_close_tensors(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 400, (1,), generator=g))
    b = torch.randn(n, generator=g, dtype=torch.float64) * 10 ** float(torch.randint(-3, 3, (1,), generator=g))
    atol, rtol = [1e-6, 0.0, 1e-3][seed % 3], [1e-5, 1e-3, 0.0][seed % 3]
    a = b + (atol + rtol * b.abs()) * (2 * torch.rand(n, generator=g, dtype=torch.float64) - 1)
    assert torch.all((a - b).abs() <= atol + rtol * b.abs())
    fa, fb = (ddp_verify.fingerprints([x], mode="tolerance")[0] for x in (a, b))
    assert _close(fa, fb, n, atol, rtol)
    far = b.clone()
    far[0] += 10 * (atol * n + rtol * b.abs().sum().item() + 1.0)
    assert not _close(ddp_verify.fingerprints([far], mode="tolerance")[0], fb, n, atol, rtol)


# --------------------------------------------------------------------------- one process


def test_needs_an_initialized_process_group(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(GraddbgError, match="not initialized.*init_process_group"):
        ddp_verify.check_gradients(torch.nn.Linear(2, 2))


@pytest.fixture
def one_rank_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_report_fields_and_argument_errors_in_a_one_rank_world(one_rank_world):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model(torch.randn(5, 3)).sum().backward()
    report = ddp_verify.check_gradients(model, details=True)
    assert (report.ok, bool(report), report.world_size, report.rank, report.kind, report.mode,
            report.checked) == (True, True, 1, 0, "gradients", "bitwise", 4)
    assert list(report.mismatches.columns)[:4] == ["name", "rank", "reference_rank", "reason"]
    assert len(report.mismatches) == 0
    assert ddp_verify.check_buffers(model).checked == 3
    assert ddp_verify.check_parameters(model, rtol=1e-3).mode == "tolerance"
    assert ddp_verify.check_parameters(model, timeout=5).ok
    with pytest.raises(GraddbgError, match=r"rtol=.*got -0.5.*finite number >= 0"):
        ddp_verify.check_gradients(model, rtol=-0.5)
    with pytest.raises(GraddbgError, match=r"timeout=.*got 0:00:00.*positive"):
        ddp_verify.check_gradients(model, timeout=timedelta(0))
    with pytest.raises(GraddbgError, match=r"model=.*got str.*nn.Module"):
        ddp_verify.check_gradients("model")
    with pytest.raises(GraddbgError, match=r"group=.*got int.*ProcessGroup"):
        ddp_verify.check_gradients(model, group=3)


BAD_ARGUMENTS = {  # keyword arguments -> (the error's class, what its message names)
    "atol negative": (dict(atol=-1e-3), GraddbgValueError, r"check_parameters\(atol=...\): got -0.001; accepted: a finite number >= 0"),
    "rtol infinite": (dict(rtol=math.inf), GraddbgValueError, r"rtol=...\): got inf; accepted"),
    "rtol NaN": (dict(rtol=math.nan), GraddbgValueError, r"rtol=...\): got nan; accepted"),
    "atol a string": (dict(atol="1e-3"), GraddbgTypeError, r"atol=...\): got '1e-3' \(str\); accepted: a finite number"),
    "atol a bool": (dict(atol=True), GraddbgTypeError, r"atol=...\): got True \(bool\)"),
    "timeout a string": (dict(timeout="soon"), GraddbgTypeError, r"timeout=...\): got 'soon' \(str\); accepted: a datetime.timedelta"),
    "timeout negative": (dict(timeout=-2), GraddbgValueError, r"timeout=...\): got -2; accepted: a positive duration"),
    "timeout NaN": (dict(timeout=math.nan), GraddbgValueError, r"timeout=...\): got nan; accepted"),
    "timeout too large": (dict(timeout=1e30), GraddbgValueError, r"timeout=...\): got 1e\+30; accepted"),
    "group a string": (dict(group="world"), GraddbgTypeError, r"group=...\): got str; accepted: None \(the default group\) or a torch.distributed.ProcessGroup"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_arguments_are_value_or_type_errors_naming_the_argument(case, one_rank_world):
    kwargs, error, message = BAD_ARGUMENTS[case]
    with pytest.raises(error, match=message) as info:
        ddp_verify.check_parameters(torch.nn.Linear(2, 2), **kwargs)
    assert isinstance(info.value, GraddbgError)
    assert isinstance(info.value, ValueError if error is GraddbgValueError else TypeError)


def test_bad_arguments_are_reported_before_the_missing_process_group(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(GraddbgTypeError, match=r"model=...\): got the class Linear.*instantiate it first"):
        ddp_verify.check_gradients(torch.nn.Linear)
    with pytest.raises(GraddbgValueError, match="atol"):
        ddp_verify.check_gradients(torch.nn.Linear(2, 2), atol=-1.0)
    with pytest.raises(GraddbgError, match="not initialized") as info:    # a state, not an argument
        ddp_verify.check_gradients(torch.nn.Linear(2, 2))
    assert not isinstance(info.value, (ValueError, TypeError))


@pytest.mark.timeout(60)
def test_missing_ranks_are_named_from_the_store_or_not_at_all(one_rank_world, monkeypatch):
    """After a timed-out exchange, the counters in the store name the ranks that did not
    enter the check; when the store cannot be read, no rank is blamed. A rank writes its
    counter only when its exchange is slow."""
    ddp_verify.check_parameters(torch.nn.Linear(2, 2))
    key = _rendezvous._counter_key(None, 0)
    entered = _rendezvous._ENTERED[(id(dist.group.WORLD), key)]

    class Slow:                                             # an exchange still running
        waited = None

        def is_completed(self):
            return False

        def wait(self, timeout):
            Slow.waited = timeout
    started = time.perf_counter()
    _rendezvous._settle(Slow(), _rendezvous._store(), key, entered, timedelta(seconds=2))
    assert _rendezvous._QUIET <= time.perf_counter() - started < 1.5
    assert timedelta(seconds=1.5) < Slow.waited < timedelta(seconds=2)
    assert _rendezvous._behind(None, entered) == []
    assert _rendezvous._behind(None, entered + 1) == [0]

    class Gone:
        def check(self, keys):
            raise RuntimeError("connection reset")
    monkeypatch.setattr(_rendezvous, "_store", lambda: Gone())
    assert _rendezvous._behind(None, entered) is None


def test_report_str_is_bounded():
    rows = tuple(ddp_verify.Mismatch(name=f"layer{i}.weight", rank=1, reference_rank=0,
                                     reason="bits differ", shape=(2,), dtype="float32",
                                     fingerprint="x", reference_fingerprint="y")
                 for i in range(50))
    report = ddp_verify.ConsistencyReport(ok=False, world_size=2, rank=0, kind="gradients",
                                          mode="bitwise", checked=60, rows=rows)
    text = str(report)
    assert "50 of 60 tensors differ" in text and "'layer0.weight'" in text
    assert "layer9.weight" in text and "layer10.weight" not in text
    assert "and 40 more rows" in text
    assert len(text.splitlines()) == 13
    assert report.names[:2] == ["layer0.weight", "layer1.weight"] and report.ranks == [1]
    assert math.isnan(report.max_abs_diff)


# --------------------------------------------------------------------------- real worlds

def distributed(test):
    """Marks of a test that spawns (or reuses) a real world: slow, and bounded in time."""
    return pytest.mark.slow(pytest.mark.timeout(240)(test))


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """A 2-rank gloo world running every scenario of WORLDS['two']: {rank: {scenario: record}}."""
    out = tmp_path_factory.mktemp("ddp_two")
    results = workers.run_world("two", 2, str(out), timeout_s=180)
    assert sorted(results) == [0, 1], "a rank wrote no results"
    return results


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_three")
    results = workers.run_world("three", 3, str(out), timeout_s=180)
    assert sorted(results) == [0, 1, 2], "a rank wrote no results"
    return results


def _scenario(world, name, nranks):
    records = [world[r][name] for r in range(nranks)]
    for r, rec in enumerate(records):
        assert "traceback" not in rec, f"rank {r} failed in {name}: {rec}"
    return records


def _assert_same_verdict(reports):
    """Every rank reached the same verdict (same names, ranks and rows)."""
    assert all(r["rows"] == reports[0]["rows"] and r["ok"] == reports[0]["ok"] for r in reports)
    assert [r["rank"] for r in reports] == list(range(len(reports)))


@distributed
@pytest.mark.parametrize("world,n", [("two", 2), ("three", 3)])
def test_healthy_ddp_is_consistent_and_the_group_stays_usable(world, n, request):
    records = _scenario(request.getfixturevalue(world), "healthy", n)
    for rec in records:
        for key in ("grads", "params", "buffers", "tolerance", "plain_module"):
            assert rec[key]["ok"] and rec[key]["world_size"] == n, (key, rec[key]["text"])
        assert rec["grads"]["checked"] == 4 and rec["buffers"]["checked"] == 0
        assert rec["allreduce_after"] == [float(n)] * 3


@distributed
def test_find_unused_parameters_static_graph_and_bucket_views(two):
    for rec in _scenario(two, "find_unused", 2):
        assert rec["report"]["ok"] and rec["unused_grad_none"]
    for rec in _scenario(two, "static_bucket_view", 2):
        assert rec["oks"] == [True] * 6


@distributed
@pytest.mark.parametrize("world,n", [("two", 2), ("three", 3)])
def test_comm_hook_corrupting_rank_1_is_reported_on_every_rank(world, n, request):
    records = _scenario(request.getfixturevalue(world), "comm_hook", n)
    expected = records[0]["expected"]
    assert expected and all(rec["expected"] == expected for rec in records)
    reports = [rec["report"] for rec in records]
    _assert_same_verdict(reports)
    for rep in reports:
        assert not rep["ok"] and rep["names"] == [expected] and rep["ranks"] == [1]
        (name, rank, ref, reason, max_abs_diff, n_diff), = rep["rows"]
        assert (rank, ref, reason, n_diff) == (1, 0, "bits differ", 1)
        assert rep["where"][0][1] - rep["where"][0][2] == pytest.approx(1.0, rel=1e-5)
        assert max_abs_diff == pytest.approx(1.0, rel=1e-5) == rep["max_abs_diff"]
        assert rep["df_len"] == 1 and expected in rep["text"]
    for rec in records:
        assert rec["raised"]["error"] == DDPInconsistencyError.__name__
        assert rec["raised"]["names"] == [expected]


@distributed
def test_three_ranks_blame_the_minority_even_when_it_is_rank_0(three):
    reports = [rec["report"] for rec in _scenario(three, "comm_hook_rank0", 3)]
    _assert_same_verdict(reports)
    for rep in reports:
        assert rep["ranks"] == [0] and [row[2] for row in rep["rows"]] == [1]


@distributed
def test_weights_drifted_on_rank_1_are_named_by_check_parameters(two):
    for rec in _scenario(two, "drift", 2):
        assert rec["before"]["ok"]
        after = rec["after"]
        assert after["names"] == ["2.weight"] and after["ranks"] == [1]
        assert after["rows"][0][4] == pytest.approx(1e-3, rel=1e-3)
        assert after["rows"][0][5] == 1 and after["where"][0][0] == [1, 3]
        assert rec["sliced"]["rows"] == after["rows"] and rec["sliced"]["where"] == after["where"]
        assert not rec["after_tol"]["ok"] and rec["after_tol"]["names"] == ["2.weight"]
    rank0, rank1 = _scenario(two, "drift", 2)
    assert rank0["after"]["where"][0][2] == rank0["reference"]          # rank 0's value
    assert rank0["after"]["where"][0][1] == rank1["reference"]          # rank 1's drifted value


@distributed
def test_the_same_nan_on_every_rank_is_consistent(two):
    for rec in _scenario(two, "same_nan", 2):
        assert rec["bitwise"]["ok"] and rec["tolerance"]["ok"]


@distributed
def test_nan_on_rank_1_only_is_reported_by_name(two):
    records = _scenario(two, "nan_rank1", 2)
    _assert_same_verdict([rec["bitwise"] for rec in records])
    for rec in records:
        assert rec["bitwise"]["names"] == ["0.bias"] and rec["bitwise"]["ranks"] == [1]
        assert rec["bitwise"]["rows"][0][4] == math.inf and rec["bitwise"]["rows"][0][5] == 1
        tol = rec["tolerance"]
        assert tol["names"] == ["0.bias"] and tol["rows"][0][3] == "NaN/Inf counts differ"


@distributed
def test_no_sync_off_by_one_is_detected(two):
    for rec in _scenario(two, "no_sync", 2):
        assert rec["correct"]["grads"]["ok"] and rec["correct"]["params"]["ok"]
        buggy = rec["buggy"]
        assert not buggy["grads"]["ok"] and buggy["grads"]["ranks"] == [1]
        assert "0.weight" in buggy["grads"]["names"]
        assert buggy["params"]["names"] == buggy["grads"]["names"]


@distributed
def test_a_gradient_missing_on_one_rank_is_reported_by_name_and_rank(two):
    for rec in _scenario(two, "missing_grad", 2):
        (row,) = rec["report"]["rows"]
        assert row[:4] == ["2.weight", 1, 0, "no gradient on this rank"]


@distributed
def test_check_buffers_finds_batchnorm_statistics_that_drifted(two):
    for rec in _scenario(two, "batchnorm", 2):
        assert rec["same"]["ok"] and rec["same"]["checked"] == 3
        assert rec["different"]["names"] == ["1.running_mean", "1.running_var"]
        assert rec["different"]["ranks"] == [1]


@distributed
def test_tolerance_mode_passes_float_noise_that_bitwise_mode_flags(two):
    for rec in _scenario(two, "tolerance", 2):
        assert rec["bitwise"]["names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
        assert rec["tolerance"]["ok"] and rec["tolerance"]["mode"] == "tolerance"
        assert not rec["tight"]["ok"]
        big = rec["big"]
        assert big["names"] == ["0.weight"] and big["ranks"] == [1]
        assert big["rows"][0][4] == pytest.approx(0.05, rel=1e-3)


@distributed
def test_hand_all_reduced_plain_model(two):
    for rec in _scenario(two, "hand_allreduce", 2):
        assert not rec["before"]["ok"] and rec["before"]["ranks"] == [1]
        assert rec["after"]["ok"]


@distributed
def test_different_architectures_raise_a_clear_error_on_every_rank(two):
    for rec in _scenario(two, "architecture", 2):
        width = rec["width"]
        assert width["error"] == DDPInconsistencyError.__name__
        assert "rank 0 has '0.weight' shape (16, 8) float32, rank 1 has '0.weight' shape (12, 8)" \
            in width["message"]
        assert "Ranks that differ from rank 0: [1]" in width["message"]
        assert "rank 0 has 2 parameters, rank 1 has 4" in rec["depth"]["message"]
        assert "rank 0: check_gradients" in rec["calls"]["message"]
        assert "rank 1: check_parameters" in rec["calls"]["message"]
        assert rec["after"]["ok"]


@distributed
def test_bad_arguments_raise_before_any_collective(two):
    for rec in _scenario(two, "bad_args", 2):
        assert rec["atol"]["error"] == "GraddbgValueError" and "atol" in rec["atol"]["message"]
        assert rec["timeout"]["error"] == "GraddbgTypeError" and "timeout" in rec["timeout"]["message"]
        assert rec["model"]["error"] == "GraddbgTypeError"
        assert "instantiate it first" in rec["model"]["message"]
        assert rec["after"]["ok"]


@distributed
def test_a_rank_that_fails_to_fingerprint_makes_every_rank_raise(two):
    records = _scenario(two, "local_failure", 2)
    for rank, rec in enumerate(records):
        assert rec["error"] == DDPInconsistencyError.__name__
        assert "rank(s) [1] could not compute their fingerprints" in rec["message"]
        assert rec["after"]["ok"]       # and the group still works
    assert "simulated failure while fingerprinting" in records[1]["message"]


@distributed
def test_without_a_store_the_checks_use_a_monitored_barrier(two):
    records = _scenario(two, "no_store", 2)
    _assert_same_verdict([rec["bad"] for rec in records])
    for rec in records:
        assert rec["healthy"]["ok"]
        assert rec["bad"]["names"] == ["0.bias"] and rec["bad"]["ranks"] == [1]
        assert not rec["after"]["ok"]        # the NaN is still there, found with the store


# "two" (gloo) exchanges on the group itself, "three" ("cpu:gloo") on a gloo side group, as NCCL does
@distributed
@pytest.mark.parametrize("world,n,skipper", [("two", 2, 1), ("three", 3, 2)])
def test_a_rank_that_skips_the_check_makes_the_others_raise_within_the_timeout(world, n, skipper, request):
    records = _scenario(request.getfixturevalue(world), "skip", n)
    assert records[skipper] == {"skipped": True}
    for rank, rec in enumerate(records):
        if rank == skipper:
            continue
        assert rec["error"] == DDPTimeoutError.__name__, rec
        assert 2.0 <= rec["elapsed"] < 2.0 + 3.0
        assert f"rank(s) [{skipper}] of the group (world size {n}) did not enter the check " \
               f"within 2 s (seen from rank {rank})" in rec["message"]


@distributed
def test_a_rank_arriving_after_the_others_gave_up_raises_too(two):
    rank0, rank1 = _scenario(two, "late", 2)
    assert rank0["error"] == rank1["error"] == DDPTimeoutError.__name__
    assert 2.0 <= rank0["elapsed"] < 2.0 + 3.0
    assert "rank(s) [1] of the group (world size 2) did not enter the check" in rank0["message"]
    assert rank1["elapsed"] < 2.0     # it finds out at once
    assert "rank(s) [1] entered the check more than 2 s after the first rank" in rank1["message"]
    assert rank0["after"]["ok"] and rank1["after"]["ok"]


@distributed
def test_side_group_is_created_once_and_works(three):
    for rec in _scenario(three, "side_group", 3):
        assert rec["cached"] and rec["side_world"] == 3 and rec["check"]["ok"]
        assert rec["backend"] == "cpu:gloo" and rec["side_groups"] == 1


@distributed
def test_checks_run_on_a_subgroup(three):
    records = _scenario(three, "subgroup", 3)
    assert records[2] == {"skipped": True}
    for rec in records[:2]:
        assert rec["ok"] and rec["world_size"] == 2
        assert rec["side_groups"] == 2     # a side group of ranks 0 and 1 only, made by them


@requires_cuda
@pytest.mark.timeout(240)
def test_fingerprints_on_cuda_match_cpu():
    ts = [_tensor(s, torch.float32, seed=i) for i, s in enumerate(SHAPES)]
    for mode in ("bitwise", "tolerance"):
        cpu = ddp_verify.fingerprints(ts, mode=mode)
        gpu = ddp_verify.fingerprints([t.cuda() for t in ts], mode=mode)
        assert gpu.device.type == "cuda"
        if mode == "bitwise":
            assert torch.equal(cpu, gpu.cpu())
        else:
            assert torch.equal(cpu[:, :4], gpu.cpu()[:, :4])
            assert torch.allclose(cpu[:, 4:].view(torch.float64), gpu.cpu()[:, 4:].view(torch.float64),
                                  rtol=1e-12)


@requires_cuda
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cuda_model_over_gloo(tmp_path):
    results = workers.run_world("cuda", 2, str(tmp_path), timeout_s=180, device="cuda")
    for r in (0, 1):
        rec = results[r]["cuda_gloo"]
        assert "traceback" not in rec, rec
        assert rec["healthy"]["ok"]
        assert rec["nan"]["names"] == ["0.bias"] and rec["nan"]["ranks"] == [1]
        assert rec["tolerance"]["rows"][0][3] == "NaN/Inf counts differ"


def test_digest_tells_tables_apart():
    ts = [_tensor(s, torch.float32, seed=i) for i, s in enumerate(SHAPES)]
    table = ddp_verify.fingerprints(ts)
    same = _fingerprint.digest(table.clone())
    assert torch.equal(_fingerprint.digest(table), same) and same.shape == (2,)
    for p in range(table.shape[0]):
        for k in range(table.shape[1]):
            other = table.clone()
            other[p, k] += 1
            assert not torch.equal(_fingerprint.digest(other), same), (p, k)
    swapped = table[[1, 0] + list(range(2, table.shape[0]))]
    assert not torch.equal(_fingerprint.digest(swapped), same)
    assert _fingerprint.digest(table[:0]).tolist() == [0, 0]


def test_verdict_scales_to_many_ranks_and_tensors():
    """64 ranks x 300 tensors, all different on rank 5: linear work, a fraction of a second."""
    import time

    base = ddp_verify.fingerprints([torch.full((4,), float(i)) for i in range(300)])
    table = base.unsqueeze(0).repeat(64, 1, 1)
    table[5, :, 1] += 1
    meta = [(f"p{i}", (4,), "float32") for i in range(300)]
    start = time.perf_counter()
    found = _verdict.disagreements(table, [m[0] for m in meta], meta, "bitwise", 0.0, 0.0)
    assert time.perf_counter() - start < 5.0
    assert found == [(p, 5, 0, "bits differ") for p in range(300)]


# --------------------------------------------------------------------------- replicas (issue 24)
# What watch(ddp_check_every=1) does, by hand: check_replicas(initial=True) on the parameters
# before the first step, then gradients and parameters after each backward (see
# _ddp_workers._steps). Each bug has a healthy twin that must stay silent.
ALL = ["0.weight", "0.bias", "2.weight", "2.bias"]


def _why(report, kind):
    """(name, rank) and the causes of the rows of one kind."""
    rows = [w for w in report["why"] if w[1] == kind]
    return [(w[0], w[2]) for w in rows], {w[3] for w in rows}


@distributed
def test_forgotten_ddp_wrapping_is_found_at_the_first_gradient_check(two):
    """Rank 0 wraps its model in DDP over a group of its own (or no rank wraps it): the
    parameters agree at first (same seed), the gradients differ from the first backward,
    the parameters from the first step on; with DDP everywhere nothing is reported."""
    records = _scenario(two, "unwrapped", 2)
    for case in ("one", "every"):
        reps = [rec[case] for rec in records]
        _assert_same_verdict([r["step0"] for r in reps])
        first = reps[0]
        assert first["initial"]["ok"], first["initial"]["text"]
        names, causes = _why(first["step0"], "gradients")
        assert names == [("0.weight", 1), ("0.bias", 1), ("2.weight", 1)]   # sum(): equal bias grads
        assert _why(first["step0"], "parameters") == ([], set())
        assert len(causes) == 1 and "not wrapped in DDP on every rank" in causes.pop()
        names, causes = _why(first["step1"], "parameters")
        assert ("0.weight", 1) in names and causes == {
            "its gradient differs too, so the updates diverged with the gradients (see the "
            "gradient's row)"}
        assert "probably ('0.weight' gradients, rank 1)" in first["step0"]["text"]
    for rec in records:
        assert all(rec["healthy"][k]["ok"] for k in ("initial", "step0", "step1")), rec["healthy"]


@distributed
def test_parameters_replaced_after_wrapping_are_found_before_the_first_step(two):
    """pytorch issue 104336: a layer replaced (and initialised per rank) after DDP wrapped
    the model: its parameters differ at the first check, and DDP reduces no gradient of
    the bucket that held the old ones. Replaced before wrapping: nothing to report."""
    records = _scenario(two, "replaced", 2)
    _assert_same_verdict([rec["after"]["initial"] for rec in records])
    after = records[0]["after"]
    names, causes = _why(after["initial"], "parameters")
    assert names == [("2.weight", 1), ("2.bias", 1)]
    assert len(causes) == 1 and "replaced after DDP wrapped them" in causes.pop()
    names, causes = _why(after["step0"], "gradients")
    assert ("2.weight", 1) in names
    assert all("replaced after DDP wrapped the model" in c for c in causes)
    for rec in records:
        assert rec["before"]["initial"]["ok"] and rec["before"]["step0"]["ok"], rec["before"]


@distributed
def test_a_comm_hook_that_zeroes_one_bucket_on_one_rank_is_named_bucket_by_bucket(two):
    """pytorch issues 84803, 96600: from the second step, bucket 0 zeroed on rank 1 after
    the all-reduce. Its parameters, and only those, are named at that step; the first
    step is clean; the same hook without the zeroing is silent."""
    records = _scenario(two, "zeroed_bucket", 2)
    _assert_same_verdict([rec["zeroed"]["step1"] for rec in records])
    zeroed = records[0]["zeroed"]
    bucket0 = zeroed["buckets"]["0"]
    assert len(zeroed["buckets"]) >= 2 and 0 < len(bucket0) < 4, zeroed["buckets"]
    assert zeroed["step0"]["ok"], zeroed["step0"]["text"]
    names, causes = _why(zeroed["step1"], "gradients")
    assert sorted(names) == sorted((n, 1) for n in bucket0)
    assert all("communication that lost or corrupted data" in c for c in causes)
    for rec in records:
        assert all(rec["healthy"][k]["ok"] for k in ("initial", "step0", "step1"))


@distributed
def test_a_transposed_square_weight_and_a_uniform_drift_on_one_rank_are_named(two):
    records = _scenario(two, "transposed", 2)
    _assert_same_verdict([rec["one"] for rec in records])
    _assert_same_verdict([rec["one_drift"] for rec in records])
    assert _why(records[0]["one"], "parameters")[0] == [("2.weight", 1)]
    assert _why(records[0]["one_drift"], "parameters")[0] == [("0.bias", 1), ("2.weight", 1)]
    for rec in records:                  # the same transpose and drift on both ranks
        assert rec["both"]["ok"] and rec["both_drift"]["ok"], rec["both"]["text"]


def test_check_replicas_refuses_bad_flags_before_any_collective():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(GraddbgValueError, match=r"check_replicas\(gradients=False, parameters=False\): "
                                                r"nothing to check"):
        ddp_verify.check_replicas(model, gradients=False, parameters=False)
    with pytest.raises(GraddbgTypeError, match=r"check_replicas\(gradients=...\): got 'yes' \(str\); "
                                               r"accepted: True or False"):
        ddp_verify.check_replicas(model, gradients="yes")


def test_each_tensor_is_compared_with_the_ranks_holding_the_same_shard_of_it():
    """Four ranks: tensor 0 is plain (hash 0 everywhere: one group of all), tensor 1 is
    sharded in two with replicas [0, 2] and [1, 3], tensor 2 is sharded four ways (no
    replica: not compared). Within group= sets, only those ranks."""
    shards = [[0, 11, 21], [0, 12, 22], [0, 11, 23], [0, 12, 24]]
    assert _replicas.tensor_sets(shards, None) == [[[0, 1, 2, 3]], [[0, 2], [1, 3]],
                                                     [[0], [1], [2], [3]]]
    assert _replicas.tensor_sets(shards, [[0, 2], [1, 3]])[0] == [[0, 2], [1, 3]]
    per_tensor = _replicas.tensor_sets(shards, None)
    a, b = (ddp_verify.fingerprints([torch.full((3,), v)]) for v in (1.0, 2.0))
    # rank 2 differs on the plain tensor; rank 3 from its replica, rank 1, on tensor 1; the
    # unreplicated tensor 2 differs everywhere, by design
    table = torch.stack([torch.cat([a, a, a]), torch.cat([a, b, b]), torch.cat([b, a, a]),
                         torch.cat([a, a, b])])        # [rank, tensor, k]
    meta = [(f"t{i}", (3,), "float32") for i in range(3)]
    found = _verdict.disagreements(table, [], meta, "bitwise", 0.0, 0.0, per_tensor=per_tensor)
    assert found == [(0, 2, 0, "bits differ"), (1, 3, 1, "bits differ")]
    assert ddp_verify._groups_compared(per_tensor) == ((0, 1, 2, 3), (0, 2), (1, 3))
