"""Property tests of ddp_verify's bitwise fingerprint (issue 24, point 1): no structured
blind spot.

The reference compares the bytes directly: two tensors are the same exactly when their
bytes are. For thousands of structured changes (transposes, reversed and swapped rows,
elements swapped inside one block, a uniform drift of mixed-sign values, sign flips, k
one-ulp changes) and random ones, the fingerprints must differ exactly when the bytes do:
zero escapes. Every change is built without looking at the fingerprint's weights.
"""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graddbg import ddp_verify
from graddbg import _fingerprint

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SETTINGS = settings(max_examples=150, deadline=None, derandomize=True)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The reference: equal bytes, in row-major order."""
    def raw(t):
        return t.detach().contiguous().reshape(-1).view(torch.uint8)
    return a.shape == b.shape and torch.equal(raw(a), raw(b))


def _escapes(base: torch.Tensor, changed: list) -> list:
    """Indices of the changed tensors whose fingerprint equals the base's although their
    bytes differ, and of those whose fingerprint differs although the bytes are equal
    (both must be empty). One batched call, as the checks make it."""
    table = ddp_verify.fingerprints([base] + changed)
    wrong = []
    for i, t in enumerate(changed):
        same_fp = torch.equal(table[i + 1], table[0])
        if same_fp != _same_bytes(base, t):
            wrong.append(i)
    return wrong


def _values(seed: int, shape, dtype, low=-0.2, high=0.2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g, dtype=torch.float64) * (high - low) + low).to(dtype)


def _ulp_step(t: torch.Tensor, index: torch.Tensor, up: bool) -> torch.Tensor:
    """``t`` with the elements at the flat ``index`` moved one ulp away from zero (``up``)
    or towards it (finite, non-zero elements): +-1 on the integer view of their bits."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    out = t.clone().reshape(-1)
    bits = out.view(ints)
    bits[index] += 1 if up else -1
    return out.view(t.shape)


dtypes = st.sampled_from(DTYPES)
seeds = st.integers(0, 2 ** 31)


# --------------------------------------------------------------------------- structured
@SETTINGS
@given(n=st.integers(2, 80), dtype=dtypes, seed=seeds)
def test_a_transposed_square_matrix_is_detected(n, dtype, seed):
    w = _values(seed, (n, n), dtype, -1, 1)
    changed = [w.t().contiguous(), w.t(), w.flip(0), w.flip(1), w.rot90(1, (0, 1))]
    assert _escapes(w, changed) == []


@SETTINGS
@given(rows=st.integers(2, 64), cols=st.integers(1, 300), dtype=dtypes, seed=seeds, data=st.data())
def test_reversed_and_swapped_rows_are_detected(rows, cols, dtype, seed, data):
    w = _values(seed, (rows, cols), dtype, -1, 1)
    i = data.draw(st.integers(0, rows - 1))
    j = data.draw(st.integers(0, rows - 1))
    swapped = w.clone()
    swapped[[i, j]] = w[[j, i]]
    rolled = w.roll(1, 0)
    assert _escapes(w, [w.flip(0), swapped, rolled, w.flip(1)]) == []


@SETTINGS
@given(dtype=dtypes, seed=seeds, data=st.data())
def test_elements_swapped_inside_one_block_are_detected(dtype, seed, data):
    per_block = _fingerprint._BLOCK * 4 // torch.empty(0, dtype=dtype).element_size()
    t = _values(seed, (per_block + 77,), dtype, -1, 1)
    changed = []
    for _ in range(8):
        i = data.draw(st.integers(0, per_block - 1))
        j = data.draw(st.integers(0, per_block - 1))
        u = t.clone()
        u[i], u[j] = t[j], t[i]
        changed.append(u)
    block = t[:per_block]
    changed.append(torch.cat([block.flip(0), t[per_block:]]))        # a block reversed
    assert _escapes(t, changed) == []


@SETTINGS
@given(shape=st.sampled_from([(16, 16), (32, 32), (1000,), (3, 1100), (4097,)]), dtype=dtypes,
       seed=seeds, offset=st.sampled_from([1e-3, -1e-3, 2.0 ** -10, 1e-2, 0.1]))
def test_a_uniform_drift_of_mixed_sign_values_is_detected(shape, dtype, seed, offset):
    """[-0.2, 0.2] + 1e-3: the words of positive and negative values move by the same
    amount in opposite directions (a sum of words does not see it)."""
    t = _values(seed, shape, dtype)
    assert _escapes(t, [t + offset, t - offset, t * (1 + offset)]) == []


@SETTINGS
@given(shape=st.sampled_from([(7,), (16, 16), (2500,), (5000,)]), dtype=dtypes, seed=seeds,
       data=st.data())
def test_sign_flips_are_detected(shape, dtype, seed, data):
    t = _values(seed, shape, dtype, -1, 1)
    flat = t.reshape(-1)
    k = data.draw(st.integers(1, flat.numel()))
    g = torch.Generator().manual_seed(seed + 1)
    index = torch.randperm(flat.numel(), generator=g)[:k]
    some = flat.clone()
    some[index] = -some[index]
    pair = flat.clone()
    pair[:2] = -pair[:2]
    assert _escapes(t, [(-t), some.view(shape), pair.view(shape), t.abs()]) == []


@SETTINGS
@given(shape=st.sampled_from([(9,), (33, 33), (2048,), (4100,)]), dtype=dtypes, seed=seeds,
       data=st.data())
def test_any_number_of_one_ulp_changes_is_detected(shape, dtype, seed, data):
    t = _values(seed, shape, dtype, -1, 1)
    t[t == 0] = 0.5
    n = t.numel()
    k = data.draw(st.integers(1, n))
    g = torch.Generator().manual_seed(seed + 2)
    index = torch.randperm(n, generator=g)[:k]
    changed = [_ulp_step(t, index, up=True), _ulp_step(t, index, up=False),
               _ulp_step(t, torch.arange(n), up=True)]
    assert _escapes(t, changed) == []


@SETTINGS
@given(shape=st.sampled_from([(5,), (100,), (1024,), (3000,), (64, 64)]), dtype=dtypes,
       seed=seeds, data=st.data())
def test_random_changes_are_detected(shape, dtype, seed, data):
    t = _values(seed, shape, dtype, -3, 3)
    bits = t.view(torch.int16 if t.element_size() == 2 else
                  torch.int32 if t.element_size() == 4 else torch.int64).reshape(-1)
    changed = []
    for k in range(4):
        g = torch.Generator().manual_seed(seed + 10 + k)
        count = data.draw(st.integers(1, bits.numel()))
        index = torch.randperm(bits.numel(), generator=g)[:count]
        u = bits.clone()
        u[index] = u[index] ^ (1 << data.draw(st.integers(0, 8 * t.element_size() - 2)))
        changed.append(u.view(t.dtype).view(shape))
    changed.append(_values(seed + 99, shape, dtype, -3, 3))
    changed.append(t.reshape(-1)[torch.randperm(t.numel(), generator=g)].view(shape))
    assert _escapes(t, changed) == []


# --------------------------------------------------------------------------- counted
def _structured_changes(t: torch.Tensor, seed: int) -> list:
    """A fixed family of structured changes of a square matrix ``t``."""
    g = torch.Generator().manual_seed(seed)
    flat = t.reshape(-1)
    out = [t.t().contiguous(), t.flip(0), t.flip(1), t + 1e-3, t - 1e-3, -t]
    i, j = torch.randint(0, t.shape[0], (2,), generator=g).tolist()
    swapped = t.clone()
    swapped[[i, j]] = t[[j, i]]
    out.append(swapped)
    a, b = torch.randint(0, min(flat.numel(), 1024), (2,), generator=g).tolist()
    u = flat.clone()
    u[a], u[b] = flat[b], flat[a]
    out.append(u.view(t.shape))
    k = int(torch.randint(1, flat.numel() + 1, (1,), generator=g))
    index = torch.randperm(flat.numel(), generator=g)[:k]
    out += [_ulp_step(t, index, True), _ulp_step(t, index, False)]
    v = flat.clone()
    v[index] = -v[index]
    out.append(v.view(t.shape))
    return out


def test_thousands_of_structured_changes_zero_escapes():
    """A counted run (the figure in bench/RESULTS.md): 4 dtypes x 5 sizes x 25 seeds x 11
    structured changes; every change whose bytes differ is detected, and none whose bytes
    are equal is flagged."""
    changed_total = 0
    for dtype in DTYPES:
        for n in (4, 16, 31, 32, 64):
            for seed in range(25):
                t = _values(seed, (n, n), dtype)
                t[t == 0] = 0.125
                changes = _structured_changes(t, seed)
                assert _escapes(t, changes) == [], (dtype, n, seed)
                changed_total += sum(not _same_bytes(t, c) for c in changes)
    assert changed_total >= 5000, changed_total


def test_fingerprints_are_exact_integer_functions_of_the_bytes():
    """The same bytes give the same fingerprint whatever their dtype, layout or batch."""
    t = _values(3, (40, 50), torch.float32)
    assert torch.equal(ddp_verify.fingerprints([t])[0],
                       ddp_verify.fingerprints([t.view(torch.int32)])[0])
    assert torch.equal(ddp_verify.fingerprints([t.t().contiguous().t()])[0],
                       ddp_verify.fingerprints([t])[0])


# --------------------------------------------------------------------------- the compiled kernel
def _assorted() -> list:
    """Tensors that reach every path of the block sums: a big one with a partial last block
    (compiled: its full blocks), a float64 one of exactly 70 blocks, 100 small tensors
    packed together (100 blocks), 1- and 2-byte dtypes, special values."""
    g = torch.Generator().manual_seed(3)
    big = torch.randn(300, 3 * 1024 + 5, generator=g)
    big[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-45])
    small = [torch.randn(1000, generator=g) * (k + 1) for k in range(100)]
    return [big, torch.randn(70 * 512, generator=g, dtype=torch.float64),
            torch.randn(4097, 33, generator=g).half(), torch.randn(999, 70, generator=g).bfloat16(),
            torch.randint(-128, 127, (70 * 4096 + 3,), generator=g, dtype=torch.int8),
            torch.rand(70 * 4096, generator=g) > 0.5, big.t()] + small


def test_the_compiled_kernel_gives_the_eager_fingerprints_bit_for_bit():
    """Ranks may use either kernel (one compiled, one not): their fingerprints must agree on
    every path: one tensor's full blocks, a partial block, packed small tensors, any dtype."""
    tensors = _assorted()
    try:
        assert ddp_verify.set_fingerprint_kernel("eager") == "eager"
        eager = ddp_verify.fingerprints(tensors)
        assert _fingerprint._KERNEL.due(torch.device("cpu")) is None
        in_use = ddp_verify.set_fingerprint_kernel("compiled")
        assert in_use == "compiled", f"torch.compile is needed here (a C++ compiler): {in_use}"
        assert _fingerprint._KERNEL.due(torch.device("cpu")) is not None
        compiled = ddp_verify.fingerprints(tensors)
    finally:
        ddp_verify.set_fingerprint_kernel("auto")
    assert torch.equal(compiled, eager)
    # and still no escape through the compiled path: a transposed 256 x 256 block and a
    # sign flip in a 64-block tensor
    w = tensors[0][:256, :256].contiguous()
    flipped = w.clone().reshape(-1)
    flipped[12345] = -flipped[12345]
    try:
        ddp_verify.set_fingerprint_kernel("compiled")
        assert _escapes(w, [w.t().contiguous(), flipped.view(256, 256), w.clone()]) == []
    finally:
        ddp_verify.set_fingerprint_kernel("auto")


def test_set_fingerprint_kernel_names_bad_arguments():
    import pytest

    from graddbg import GraddbgValueError

    with pytest.raises(GraddbgValueError, match=r"kind=\.\.\.\): got 'fast'; accepted: 'auto', "
                                                r"'compiled', 'eager'"):
        ddp_verify.set_fingerprint_kernel("fast")
    with pytest.raises(GraddbgValueError, match=r"device=\.\.\.\): got 'gpu7'"):
        ddp_verify.set_fingerprint_kernel("auto", device="gpu7")
    assert _fingerprint._KERNEL.kind == "auto"
