"""graddbg._blas: the BLAS norm and largest magnitude that CPU statistics are read with."""
from __future__ import annotations

import copy
import math
import os
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import graddbg
from graddbg import _blas

MKL = "mkl" in torch.__config__.show().lower() and sys.platform.startswith("linux")


@pytest.fixture
def b():
    got = _blas.blas()
    if got is None:
        assert not MKL, "this torch carries MKL, whose snrm2/isamax graddbg should have bound"
        pytest.skip("this torch build carries no BLAS with nrm2/iamax that graddbg can bind")
    return got


def test_binds_mkl_where_torch_carries_it():
    if not MKL:
        pytest.skip("a torch build without MKL")
    assert _blas.blas() is not None and "mkl_blas" in _blas.blas().where


def _reference(t):
    t64 = t.double()
    return float(torch.linalg.vector_norm(t64)), float(t64.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 2, 17, 1000, 4096, 70001, 1 << 20])
def test_norm_and_absmax_equal_torch(b, dtype, n):
    x = torch.randn(n, dtype=dtype)
    x[(2 * n) // 3] = -50.0  # the largest magnitude, negative, away from the ends
    norm, amax = b.norm_absmax(x)
    ref_norm, ref_max = _reference(x)
    assert norm == pytest.approx(ref_norm, rel=1e-5 if dtype == torch.float32 else 1e-12)
    assert amax == ref_max == 50.0 if n > 1 else amax == ref_max
    norms, maxes, grads, finite, sumsq, complete = b.reduce_all([x, None, x[:0]], b.layout([x, x, x[:0]]))
    assert not complete
    assert finite and sumsq == pytest.approx(norm * norm, rel=1e-12)
    assert grads[0] is x and grads[1] is None
    assert norms[0] == norm and maxes[0] == amax
    assert math.isnan(norms[1]) and math.isnan(maxes[1])  # no gradient
    assert math.isnan(norms[2])  # empty


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("value", [1e-26, 1e20, 3e-39])  # vanishing, huge, subnormal
def test_exact_over_the_whole_range(b, dtype, value):
    x = torch.full((3000,), value, dtype=dtype)
    x[7] = -value
    norm, amax = b.norm_absmax(x)
    v = float(x[0])  # (the value as stored in the dtype)
    assert norm == pytest.approx(abs(v) * math.sqrt(3000), rel=1e-5)
    assert amax == abs(v)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("pos", [0, 1, 2047, 4999])
def test_nonfinite_entries_give_nonfinite_norm_and_absmax(b, bad, pos):
    x = torch.randn(5000)
    x[pos] = bad
    if math.isnan(bad):
        x[100] = math.inf  # NaN wins over Inf, as in torch
    norm, amax = b.norm_absmax(x)
    (norms,), (maxes,), _, finite, _, _ = b.reduce_all([x], b.layout([x]))
    assert not finite
    for got in (norm, norms):
        assert math.isnan(got) if math.isnan(bad) else got == math.inf
    for got in (amax, maxes):
        assert math.isnan(got) if math.isnan(bad) else got == math.inf


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("value", [1e-26, 1e20, 3e-39])
@pytest.mark.parametrize("n", [1, 3000, 70001])  # short vectors (the GIL kept, ?lange) and a long one
def test_reduce_all_is_exact_over_the_whole_range(b, dtype, value, n):
    x = torch.full((n,), value, dtype=dtype)
    x[n // 2] = -2 * value  # the largest magnitude, negative
    (norm,), (amax,), _, finite, _, _ = b.reduce_all([x], b.layout([x]))
    v = float(torch.tensor(value, dtype=dtype))  # (the value as stored in the dtype)
    assert finite and amax == abs(float(x[n // 2]))
    assert norm == pytest.approx(abs(v) * math.sqrt(n + 3), rel=1e-5)


def test_short_vectors_use_the_calls_that_keep_the_gil_and_lange(b):
    small, mid, large = (b.entry(torch.float32, n) for n in (4096, _blas._LANGE_MAX + 1, _blas._KEEP_GIL))
    assert small[3] is mid[3] is b._small[torch.float32][0] and large[3] is b._fns[torch.float32][0]
    assert mid[-1] is None and large[-1] is None  # longer vectors: isamax, which reads twice as fast
    if MKL:
        assert small[-1] is not None and b._small[torch.float64][-1] is not None
    # the largest magnitude of every short vector comes from ?lange, equal to torch's
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, generator=g) * 10.0 ** e for n, e in ((1, 0), (7, -30), (4096, 15), (8192, 0), (65535, 0))]
    got = b.reduce_all(xs, b.layout(xs))
    assert got.maxes == [float(x.abs().max()) for x in xs]


def test_a_wrong_lange_binding_fails_the_self_test(b):
    import ctypes

    path, name = b.where.split(":")
    if name not in _blas._LANGE or b._small[torch.float32][-1] is None:
        pytest.skip("this BLAS carries no ?lange")
    full = os.path.join(os.path.dirname(torch.__file__), "lib", path)
    names = next(ns for ns in _blas._NAMES if ns[0] == name)

    def fresh():
        # function objects of our own (Blas sets their return types; a library object
        # hands out the same function object for a name each time)
        lib, keeps = ctypes.CDLL(full), ctypes.PyDLL(full)
        return ([getattr(lib, n) for n in names], [getattr(keeps, n) for n in names[:4]],
                [getattr(keeps, n) for n in _blas._LANGE[name]])

    fns, small, (s_lange, d_lange) = fresh()
    assert not _blas._self_test(_blas.Blas(*fns, where="lange widths swapped", small=small, lange=(d_lange, s_lange)))
    fns, small, lange = fresh()
    assert _blas._self_test(_blas.Blas(*fns, where="as bound", small=small, lange=lange))
    # without ?lange (a BLAS that lacks it, or one that failed): isamax's index gives the value
    no_lange = _blas.Blas(*fns, where="no lange", small=small, lange=None)
    assert _blas._self_test(no_lange)
    xs = [torch.randn(n) for n in (1, 5, 4096)] + [torch.randn(9, dtype=torch.float64)]
    for x in xs:
        x[len(x) // 2] = -1e3
    got = no_lange.reduce_all(xs, [no_lange.entry(x.dtype, x.numel()) for x in xs])
    assert got.maxes == [1e3] * 4 and got.norms == b.reduce_all(xs, b.layout(xs)).norms


def test_binding_keeps_nrm2_and_isamax_when_lange_fails_its_self_test(b, monkeypatch):
    _, name = b.where.split(":")
    if name not in _blas._LANGE or b._small[torch.float32][-1] is None:
        pytest.skip("this BLAS carries no ?lange")
    s_name, d_name = _blas._LANGE[name]
    monkeypatch.setitem(_blas._LANGE, name, (d_name, s_name))  # widths swapped: wrong answers
    other = _blas._bind()
    assert other is not None and other.where == b.where
    assert other._small[torch.float32][-1] is None and other._small[torch.float64][-1] is None
    x = torch.randn(300)
    x[7] = 55.0
    assert other.reduce_all([x], [other.entry(x.dtype, 300)]).maxes == [55.0]


def test_finite_entries_whose_norm_overflows(b):
    x = torch.full((100,), 3e38)
    norm, amax = b.norm_absmax(x)
    assert norm == math.inf  # beyond float32: the caller recomputes it in float64
    assert amax == pytest.approx(3e38, rel=1e-7)


def test_lengths_beyond_the_chunk_are_split(b, monkeypatch):
    monkeypatch.setattr(_blas, "_CHUNK", 1000)
    x = torch.randn(4321)
    x[3500] = 99.0
    norm, amax = b.norm_absmax(x)
    assert norm == pytest.approx(_reference(x)[0], rel=1e-6) and amax == 99.0
    lay = _blas.Layout([(torch.float32, (4321,))])
    assert lay[0][2] is None  # (reduce_all hands these to norm_absmax)
    assert b.reduce_all([x], lay)[:2] == ([norm], [amax])


def test_tensors_it_cannot_read_are_refused(b):
    x = torch.randn(8, 8)
    lay = b.layout([x])
    unreadable = [x.t(), x.to_sparse(), x.double(), x.to_mkldnn()]  # not contiguous, sparse, dtype, opaque
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (sparse CSR is in beta)
        unreadable.append(x.to_sparse_csr())
    for bad in unreadable:
        norms, maxes, grads, _, _, _ = b.reduce_all([bad, x], b.layout([x, x]))
        assert norms is None and maxes is None and grads[0] is bad and grads[1] is x
    # reading the parameters' .grad in the same loop, refused midway: every gradient still comes back
    p, q = nn.Parameter(x.clone()), nn.Parameter(x.clone())
    p.grad, q.grad = torch.ones(8, 8).t(), torch.ones(8, 8)
    norms, _, grads, _, _, _ = b.reduce_all([p, q], b.layout([p, q]), of_params=True)
    assert norms is None and grads[0] is p.grad and grads[1] is q.grad
    p.grad = p.grad.contiguous()
    norms, _, grads, _, _, _ = b.reduce_all([p, q], b.layout([p, q]), of_params=True)
    assert norms == [8.0, 8.0] and grads[0] is p.grad and grads[1] is q.grad
    assert b.layout([x.half()]) is None and b.layout([torch.randn(3, device="meta")]) is None
    assert not b.eligible(x.t()) and b.eligible(x) and not b.eligible(nn.Parameter(x))


def test_watch_falls_back_to_torch_kernels_for_such_gradients(b):
    model = nn.Module()
    model.a = nn.Parameter(torch.zeros(6, 4))
    model.b = nn.Parameter(torch.zeros(5))
    with graddbg.watch(model) as w:
        model.a.grad = torch.randn(4, 6).t()  # a transposed view: not contiguous
        model.b.grad = torch.randn(5)
        w.step()
        assert not w._plan.last_exact
        model.a.grad = model.a.grad.contiguous()
        w.step()
        assert w._plan.last_exact
    for step in (0, 1):
        got = w.stats[w.stats.step == step].set_index("name")
        for name, p in model.named_parameters():
            assert got.loc[name, "norm"] == pytest.approx(float(p.grad.double().norm()), rel=1e-6)
            assert got.loc[name, "absmax"] == float(p.grad.abs().max())


def test_a_wrong_binding_fails_the_self_test(b):
    import ctypes

    assert _blas._self_test(b)
    path, name = b.where.split(":")
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", path))  # its own function objects
    names = next(ns for ns in _blas._NAMES if ns[0] == name)
    s_nrm2, s_amax, d_nrm2, d_amax, s_axpy, d_axpy = (getattr(lib, n) for n in names)
    swapped = _blas.Blas(d_nrm2, s_amax, s_nrm2, d_amax, s_axpy, d_axpy, where="float32 and float64 norms swapped")
    assert not _blas._self_test(swapped)
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", path))
    s_nrm2, s_amax, d_nrm2, d_amax, s_axpy, d_axpy = (getattr(lib, n) for n in names)
    wrong_axpy = _blas.Blas(s_nrm2, s_amax, d_nrm2, d_amax, d_axpy, s_axpy, where="axpy widths swapped")
    assert not _blas._self_test(wrong_axpy)


def test_binding_pickles_and_deep_copies_as_the_process_one(b):
    assert copy.deepcopy(b) is b and pickle.loads(pickle.dumps(b)) is b
    lay = b.layout([torch.zeros(3), torch.zeros(2, dtype=torch.float64)])
    for other in (copy.deepcopy(lay), pickle.loads(pickle.dumps(lay))):
        assert other.specs == lay.specs and len(other) == 2
        assert b.reduce_all([torch.ones(3), torch.ones(2, dtype=torch.float64)], other)[0] == pytest.approx(
            [math.sqrt(3), math.sqrt(2)])


def test_a_watched_model_unpickles_where_no_blas_can_be_bound(b, monkeypatch):
    model = nn.Linear(3, 2)
    with graddbg.watch(model) as w:
        model(torch.randn(4, 3)).sum().backward()
        data = pickle.dumps(model)  # (its hooks reach the watch, its plan and its layout)
        plan = pickle.dumps(w._plan)
    monkeypatch.setattr(_blas, "_state", [None])  # as in a process with GRADDBG_BLAS=0
    assert isinstance(pickle.loads(data), nn.Linear)
    other = pickle.loads(plan)
    assert other._blas is None and len(other._blas_layout) == 0
    got = other.compute([torch.ones(2, 3), torch.ones(2)])
    assert torch.allclose(got[:, 0], torch.tensor([math.sqrt(6), math.sqrt(2)], dtype=torch.float64))


def test_environment_variable_turns_it_off():
    code = "from graddbg import _blas; print(_blas.blas() is None)"
    env = dict(os.environ, GRADDBG_BLAS="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"



def test_threads_calling_at_once_get_their_own_answers(b):
    # the calls release the GIL: nothing shared may carry one thread's tensor into another's
    import threading

    sets = [[torch.randn(n) * (k + 1) for n in (5, 4096, 70000)] for k in range(4)]
    expected = [b.reduce_all(ts, b.layout(ts)) for ts in sets]
    errors = []

    def work(k):
        lay = b.layout(sets[k])
        for _ in range(200):
            got = b.reduce_all(sets[k], lay)
            if got.norms != expected[k].norms or got.maxes != expected[k].maxes or got.sumsq != expected[k].sumsq:
                errors.append(k)
                return

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors


def test_update_ratio_from_a_memmove_snapshot_and_its_fallbacks(b):
    from graddbg.stats import StatPlan

    params = [nn.Parameter(torch.randn(6, 6)), nn.Parameter(torch.zeros(3)), nn.Parameter(torch.randn(5).double()),
              nn.Parameter(torch.randn(0))]
    plan = StatPlan(params)
    assert plan._blas is not None

    def step(ps):
        with torch.no_grad():
            ps[0].add_(0.5)          # moved
            ps[1].add_(1.0)          # from zero: infinite ratio
            ps[2].mul_(1.0)          # unchanged: 0

    def reference(before, after):
        out = []
        for o, n in zip(before, after):
            wn, dn = float(o.double().norm()), float((o - n.detach()).double().norm())
            out.append(dn / wn if wn > 0 else (math.inf if dn > 0 else 0.0))
        return out

    before = [p.detach().clone() for p in params]
    snap = plan.snapshot(params)
    assert isinstance(snap, torch.Tensor) and snap.dtype == torch.uint8  # one buffer, not clones
    step(params)
    got = plan.update_ratio(snap, params)
    assert list(got) == pytest.approx(reference(before, params), rel=1e-6)
    # a parameter swapped for a non-contiguous one between snapshot and step: torch finishes
    before = [p.detach().clone() for p in params]
    snap = plan.snapshot(params)
    params[0].data = params[0].data.t().contiguous().t()
    step(params)
    got = plan.update_ratio(snap, params)
    assert isinstance(got, torch.Tensor)
    assert got.tolist() == pytest.approx(reference(before, params), rel=1e-6)
    # a snapshot that cannot be taken in one buffer: clones
    assert isinstance(plan.snapshot(params), list)


def test_snapshot_buffer_is_kept_between_update_steps_and_freed_on_exit(b):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with graddbg.watch(model, opt, update_every=1) as w:
        bufs = []
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            bufs.append(w._plan._snap_buf)
        assert bufs[0] is not None and all(x is bufs[0] for x in bufs)
    assert w._plan._snap_buf is None
    assert w.stats["update_ratio"].notna().all() and (w.stats["update_ratio"] > 0).all()


def test_norms_only_skip_iamax_and_still_see_nonfinite(b):
    x, y = torch.randn(100), torch.randn(50)
    y[7] = math.nan
    lay = b.layout([x, y])
    got = b.reduce_all([x, None], lay, want_max=False)
    assert got.norms[0] == pytest.approx(float(x.norm()), rel=1e-6) and math.isnan(got.maxes[0])
    assert got.finite and not got.complete
    got = b.reduce_all([x, y], lay, want_max=False)
    assert math.isnan(got.norms[1]) and not got.finite and got.complete
