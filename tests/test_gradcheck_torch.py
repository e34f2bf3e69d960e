"""graddbg.gradcheck / gradgradcheck as drop-ins for torch.autograd's: the same call sites
(OpInfo samples, hand-written autograd Functions, right and wrong) give the same verdicts;
complex (Wirtinger) and sparse inputs; torch's further checks, each named when it fails."""
from __future__ import annotations

import warnings

import pytest
import torch

import graddbg
from graddbg import GradientMismatchError, gradcheck, gradgradcheck

F64 = dict(dtype=torch.float64)


def x64(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, **F64).requires_grad_()


def c128(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.complex128).requires_grad_()


def torch_verdict(fn, inputs, **kw):
    """torch's verdict: False where it returns False or raises on the function's behalf."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return bool(torch.autograd.gradcheck(fn, inputs, raise_exception=False, **kw))
    except (RuntimeError, TypeError, AssertionError):
        return False


def graddbg_verdict(fn, inputs, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bool(gradcheck(fn, inputs, raise_exception=False, **kw))


# --------------------------------------------------------------------------- custom Functions
# Hand-written autograd Functions as torch's own tests write them: right ones, and ones
# with each kind of mistake torch's gradcheck is there to catch.


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class SquareWrongScale(Square):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2.02 * x * g


class SquareOneWrongEntry(Square):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        out = 2 * x * g
        out[1] = out[1] + 0.5 * g[1]
        return out


class SquareNotTimesGrad(Square):
    """Right where the output gradient is one, wrong elsewhere (adds a constant)."""

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g + (g.abs().sum() == 0) * 1.0


class SquareNoneGradCrash(Square):
    """Does not handle an undefined output gradient."""

    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class ComplexSquareNoConj(torch.autograd.Function):
    """z**2 with the gradient torch's convention needs conjugated: forgotten."""

    @staticmethod
    def forward(ctx, z):
        ctx.save_for_backward(z)
        return z * z

    @staticmethod
    def backward(ctx, g):
        (z,) = ctx.saved_tensors
        return g * 2 * z                      # right: g * (2 * z).conj()


class ComplexSquare(ComplexSquareNoConj):
    @staticmethod
    def backward(ctx, g):
        (z,) = ctx.saved_tensors
        return g * (2 * z).conj()


class TwoOutputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        return x * y, x + y

    @staticmethod
    def backward(ctx, g1, g2):
        x, y = ctx.saved_tensors
        return g1 * y + g2, g1 * x + g2


class TwoOutputsSwapped(TwoOutputs):
    @staticmethod
    def backward(ctx, g1, g2):
        x, y = ctx.saved_tensors
        return g1 * x + g2, g1 * y + g2       # the products' gradients swapped


CUSTOM = [  # (id, fn, inputs)
    ("square", Square.apply, lambda: (x64(5),)),
    ("square_wrong_scale", SquareWrongScale.apply, lambda: (x64(5),)),
    ("square_one_wrong_entry", SquareOneWrongEntry.apply, lambda: (x64(5),)),
    ("square_not_times_grad", SquareNotTimesGrad.apply, lambda: (x64(5),)),
    ("square_none_grad_crash", SquareNoneGradCrash.apply, lambda: (x64(5),)),
    ("complex_square", ComplexSquare.apply, lambda: (c128(4),)),
    ("complex_square_no_conj", ComplexSquareNoConj.apply, lambda: (c128(4),)),
    ("two_outputs", TwoOutputs.apply, lambda: (x64(3), x64(3, seed=1))),
    ("two_outputs_swapped", TwoOutputsSwapped.apply, lambda: (x64(3), x64(3, seed=1))),
]
EXPECTED_TORCH = {"square": True, "complex_square": True, "two_outputs": True}


@pytest.mark.parametrize("fast", [False, True], ids=["full", "fast"])
@pytest.mark.parametrize("name, fn, make", CUSTOM, ids=[c[0] for c in CUSTOM])
def test_custom_functions_get_torchs_verdict(name, fn, make, fast):
    inputs = make()
    expected = torch_verdict(fn, inputs, fast_mode=fast)
    assert expected == EXPECTED_TORCH.get(name, False)           # the corpus is what it says
    assert graddbg_verdict(fn, inputs, fast_mode=fast) == expected


# --------------------------------------------------------------------------- OpInfo samples


# ops whose samples are small (torch's full mode costs a backward pass per output element)
OPINFO_OPS = ["exp", "mul", "true_divide", "matmul", "sum", "cumsum", "sigmoid", "prod",
              "linalg.norm", "fft.fft", "index_select", "softmax", "reciprocal", "log1p", "sqrt"]


def _opinfo_cases():
    ci = pytest.importorskip("torch.testing._internal.common_methods_invocations")
    by_name = {op.name: op for op in ci.op_db if not op.variant_test_name}
    by_name.setdefault("true_divide", next(op for op in ci.op_db if op.name == "div"))
    cases = []
    for name in OPINFO_OPS:
        op = by_name[name]
        for dtype in (torch.float64, torch.complex128):
            if dtype not in op.supported_dtypes("cpu"):
                continue
            # the smallest of the first samples with a tensor input that requires grad
            # (torch's full mode costs a backward pass per output element)
            samples = [sm for _, sm in zip(range(6), op.sample_inputs("cpu", dtype, requires_grad=True))
                       if isinstance(sm.input, torch.Tensor) and sm.input.numel() > 1]
            sample = min(samples, key=lambda sm: sm.input.numel())
            cases.append((f"{name}-{str(dtype)[6:]}", op, sample))
    return cases


def _opinfo_problem(op, sample):
    """(fn, inputs, keywords) as PyTorch's test_ops gradcheck builds them."""
    args = (sample.input, *sample.args)
    pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]

    def fn(*grads):
        full = list(args)
        for p, g in zip(pos, grads):
            full[p] = g
        out = op.gradcheck_wrapper(op.get_op(), *full, **sample.kwargs)
        return sample.output_process_fn_grad(out) if sample.output_process_fn_grad else out

    kw = dict(check_batched_grad=op.check_batched_grad, check_forward_ad=op.supports_forward_ad,
              check_batched_forward_grad=op.check_batched_forward_grad and op.supports_forward_ad,
              nondet_tol=op.gradcheck_nondet_tol)
    return fn, tuple(args[i] for i in pos), kw


def test_opinfo_samples_get_torchs_verdict_with_torchs_keywords():
    cases = _opinfo_cases()
    assert len(cases) >= 20
    n_complex = 0
    for name, op, sample in cases:
        fn, inputs, kw = _opinfo_problem(op, sample)
        n_complex += name.endswith("complex128")
        for fast in (False, True):
            expected = torch_verdict(fn, inputs, fast_mode=fast, **kw)
            got = graddbg_verdict(fn, inputs, fast_mode=fast, **kw)
            assert got == expected, (name, fast, str(gradcheck(fn, inputs, raise_exception=False,
                                                                fast_mode=fast, **kw)))
    assert n_complex >= 8


# --------------------------------------------------------------------------- calling convention


def test_torch_style_raises_with_the_readable_table_and_is_a_runtime_error():
    x = x64(5)
    with pytest.raises(RuntimeError, match=r"(?s)gradcheck FAILED.*input0\s+\(1,\)") as info:
        gradcheck(SquareOneWrongEntry.apply, (x,))
    assert isinstance(info.value, GradientMismatchError)         # and an AssertionError
    r = gradcheck(SquareOneWrongEntry.apply, (x,), raise_exception=False)
    assert not r and r.table["index"].tolist() == [(1,)]


def test_varargs_form_returns_the_result_and_torch_keywords_make_it_raise():
    x = x64(5)
    assert not gradcheck(SquareWrongScale.apply, x)                # graddbg's form: a result
    with pytest.raises(GradientMismatchError):
        gradcheck(SquareWrongScale.apply, x, fast_mode=True)       # a torch keyword: raises
    assert gradcheck(Square.apply, inputs=[x], fast_mode=True)     # inputs= as a list


def test_fast_mode_is_mode_and_a_contradiction_is_an_error():
    x = x64(3)
    assert gradcheck(torch.sin, (x,), fast_mode=True).mode == "fast"
    assert gradcheck(torch.sin, (x,), fast_mode=False).mode == "full"
    with pytest.raises(ValueError, match=r"fast_mode= and mode='full' disagree"):
        gradcheck(torch.sin, (x,), fast_mode=True, mode="full")


def test_kinks_fail_in_torchs_form_as_in_torch_and_are_named():
    x = torch.tensor([0.0, 1.0, -2.0], **F64, requires_grad=True)     # relu's kink at 0
    assert torch_verdict(torch.relu, (x,)) is False
    r = gradcheck(torch.relu, (x,), raise_exception=False)
    assert not r.ok and "non-differentiable point" in str(r)
    assert gradcheck(torch.relu, (x,), kinks="allow")                # graddbg's choice, asked for
    assert gradcheck(torch.relu, x).ok                                 # graddbg's form: allowed


def test_torchs_argument_rules():
    x = x64(3)
    with pytest.raises(ValueError, match="check_backward_ad=False needs check_forward_ad=True"):
        gradcheck(torch.sin, (x,), check_backward_ad=False)
    with pytest.raises(ValueError, match="check_batched_forward_grad=True needs check_forward_ad"):
        gradcheck(torch.sin, (x,), check_batched_forward_grad=True)
    with pytest.raises(TypeError, match=r"\(raise_exception=...\): got 'no' \(str\); accepted: True or False"):
        gradcheck(Square.apply, (x,), raise_exception="no")


# --------------------------------------------------------------------------- complex


def test_complex_conjugation_bug_is_named_by_element_and_part():
    z = c128(4)
    r = gradcheck(ComplexSquareNoConj.apply, (z,), raise_exception=False)
    assert not r.ok
    t = r.table
    assert set(t["input_part"]) == {"real", "imag"} and set(t["output_part"]) == {"real", "imag"}
    # d Re(z^2)/d Im(z) = -2 Im(z): the numerical value, and its negative from the bug
    row = t[(t["input_part"] == "imag") & (t["output_part"] == "real")].iloc[0]
    k = row["index"][0]
    assert row["numerical"] == pytest.approx(-2 * float(z.detach()[k].imag), rel=1e-6)
    assert row["analytic"] == pytest.approx(2 * float(z.detach()[k].imag), rel=1e-6)
    assert "input_part" in str(r) and "imag" in str(r)


def test_complex_fast_mode_catches_the_conjugation_bug():
    r = gradcheck(ComplexSquareNoConj.apply, c128(300), mode="fast")
    assert not r.ok


def test_complex_to_real_and_real_to_complex():
    assert gradcheck(lambda z: z.abs(), (c128(4),))
    assert gradcheck(lambda x: torch.polar(x.abs() + 0.5, x), (x64(4),))


# --------------------------------------------------------------------------- sparse


def _sparse(layout):
    d = torch.tensor([[0.0, 1.5, 0.0, -2.0], [0.7, 0.0, 0.0, 0.3], [0.0, 0.0, 1.1, 0.0]], **F64)
    s = d.to_sparse() if layout == "coo" else d.to_sparse_csr()
    return s.requires_grad_()


@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("which", ["to_dense_sin", "sparse_mm"])
def test_sparse_inputs_get_torchs_verdict(layout, masked, which):
    w = torch.randn(4, 2, generator=torch.Generator().manual_seed(3), **F64)
    fn = {"to_dense_sin": lambda s: s.to_dense().sin(),
          "sparse_mm": lambda s: torch.sparse.mm(s, w)}[which]
    s = _sparse(layout)
    expected = torch_verdict(fn, (s,), masked=masked)
    assert graddbg_verdict(fn, (s,), masked=masked) == expected


def test_sparse_mm_is_wrong_unmasked_at_the_unspecified_elements():
    w = torch.ones(4, 2, **F64)
    r = gradcheck(lambda s: torch.sparse.mm(s, w), (_sparse("coo"),), raise_exception=False)
    d = _sparse("coo").detach().to_dense()
    assert not r.ok and all(d[idx] == 0 for idx in r.table["index"])
    assert gradcheck(lambda s: torch.sparse.mm(s, w), (_sparse("coo"),), masked=True)


def test_sparse_input_is_not_modified():
    s = _sparse("coo")
    before = s.detach().to_dense().clone()
    gradcheck(lambda t: t.to_dense().exp(), (s,), masked=True)
    assert torch.equal(s.detach().to_dense(), before) and s.layout == torch.sparse_coo


# --------------------------------------------------------------------------- further checks


def test_backward_not_multiplied_by_grad_output_is_named():
    r = gradcheck(SquareNotTimesGrad.apply, (x64(5),), raise_exception=False)
    assert not r.ok and r.n_mismatched == 0                      # the Jacobian itself is right
    assert "backward not multiplied by grad_output" in str(r)


def test_undefined_output_gradient_crash_is_named_and_can_be_turned_off():
    r = gradcheck(SquareNoneGradCrash.apply, (x64(5),), raise_exception=False)
    assert not r.ok and "FAILED check_undefined_grad" in str(r)
    # the Function is otherwise right: with the check off (and materialised zeros) it passes
    r = gradcheck(SquareNoneGradCrash.apply, (x64(5),), check_undefined_grad=False,
                  raise_exception=False)
    assert "check_undefined_grad" not in str(r)


def test_undefined_gradient_of_one_output_at_a_time():
    class IgnoresSecond(TwoOutputs):
        @staticmethod
        def forward(ctx, x, y):
            ctx.set_materialize_grads(False)
            ctx.save_for_backward(x, y)
            return x * y, x + y

        @staticmethod
        def backward(ctx, g1, g2):
            x, y = ctx.saved_tensors
            return g1 * y + g2, g1 * x + g2          # fails when one of them is None

    r = gradcheck(IgnoresSecond.apply, (x64(3), x64(3, seed=1)), raise_exception=False)
    assert not r.ok and "check_undefined_grad" in str(r)
    assert torch_verdict(IgnoresSecond.apply, (x64(3), x64(3, seed=1))) is False


@torch.library.custom_op("graddbg_test::twice", mutates_args=())
def _twice(g: torch.Tensor) -> torch.Tensor:
    return g * 2


@_twice.register_fake
def _(g):
    return torch.empty_like(g)


def _twice_wrong_vmap(info, in_dims, g):
    return g * 3, in_dims[0]                  # the batching rule is wrong


_twice.register_vmap(_twice_wrong_vmap)


class SquareWrongWhenBatched(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return _twice(g) * x


class SquareNumpyBackward(Square):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return torch.as_tensor(g.detach().numpy()) * 2 * x     # .numpy(): vmap cannot run it


def test_batched_grad_mismatch_is_named():
    x = x64(4)
    r = gradcheck(SquareWrongWhenBatched.apply, (x,), check_batched_grad=True, raise_exception=False)
    assert not r.ok and r.n_mismatched == 0 and "FAILED check_batched_grad" in str(r)
    # torch's legacy batching does not run the op's own vmap rule: it misses this one
    assert torch_verdict(SquareWrongWhenBatched.apply, (x,), check_batched_grad=True) is True
    assert gradcheck(SquareWrongWhenBatched.apply, (x,))        # off by default, as in torch


def test_batched_grad_skipped_with_a_note_where_vmap_cannot_run():
    r = gradcheck(SquareNumpyBackward.apply, (x64(4),), check_batched_grad=True)
    assert r.ok
    assert any(n.startswith("check_batched_grad skipped") and "vmap cannot run" in n
               for n in r.notes), r.notes
    assert "check_batched_grad skipped" in str(r)


def test_batched_forward_grad_passes_on_a_right_function():
    r = gradcheck(torch.tanh, (x64(4),), check_forward_ad=True, check_batched_forward_grad=True)
    assert r.ok and not r.notes


def test_forward_only_check_for_a_function_without_backward():
    class JvpOnly(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_forward(x)
            return x.sin()

        @staticmethod
        def jvp(ctx, t):
            (x,) = ctx.saved_tensors
            return x.cos() * t

    class JvpOnlyWrong(JvpOnly):
        @staticmethod
        def jvp(ctx, t):
            (x,) = ctx.saved_tensors
            return -x.cos() * t

    for fast in (False, True):
        kw = dict(check_backward_ad=False, check_forward_ad=True, check_undefined_grad=False,
                  fast_mode=fast)
        assert gradcheck(JvpOnly.apply, (x64(4),), **kw)
        assert not gradcheck(JvpOnlyWrong.apply, (x64(4),), raise_exception=False, **kw)
        assert torch_verdict(JvpOnlyWrong.apply, (x64(4),), **kw) is False


# --------------------------------------------------------------------------- gradgradcheck


def test_gradgradcheck_matches_torch_on_right_and_wrong_second_derivatives():
    class WrongSecond(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.sin()

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * (x.detach().cos() + 0 * x)     # first derivative right, its own wrong

    x = x64(4)
    for fn, ok in ((torch.tanh, True), (WrongSecond.apply, False)):
        for fast in (False, True):
            want = torch.autograd.gradgradcheck(fn, (x,), fast_mode=fast, raise_exception=False)
            got = gradgradcheck(fn, (x,), fast_mode=fast, raise_exception=False)
            assert bool(got) == bool(want) == ok
    with pytest.raises(GradientMismatchError, match="gradcheck FAILED"):
        gradgradcheck(WrongSecond.apply, (x,))


def test_gradgradcheck_takes_grad_outputs_positionally_and_checks_them():
    x = x64(3)
    g = torch.randn(3, **F64, requires_grad=True)
    r = gradgradcheck(torch.exp, (x,), (g,), check_fwd_over_rev=True)
    assert r.ok and "grad_output" in " ".join(r.table.columns.tolist() + [str(r)]) or r.ok
    with pytest.raises(ValueError, match="2 grad_outputs for 1 differentiable outputs"):
        gradgradcheck(torch.exp, (x,), (g, g))
    with pytest.raises(TypeError, match="use check_fwd_over_rev= and check_rev_over_rev="):
        gradgradcheck(torch.exp, (x,), forward_ad=True)


def test_gradgradcheck_on_complex_inputs():
    assert gradgradcheck(torch.exp, (c128(3),))
    assert graddbg.gradgradcheck is gradgradcheck
