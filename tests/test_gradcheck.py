"""graddbg.gradcheck: full and fast modes against planted bugs and naive references."""
from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import graddbg
from graddbg import GradientMismatchError, GraddbgError, PrecisionWarning
from graddbg.gradcheck import GradcheckResult, assert_gradients_close, check_module, gradcheck
import _together
from _together import Together, selected

MODES = ["full", "fast"]


# --------------------------------------------------------------------------- problems


class Cube(torch.autograd.Function):
    """x**3 with a hand-written backward (correct)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x * x * g


class CubeOneWrong(Cube):
    """x**3 whose derivative at flat element 7 is doubled: one wrong Jacobian entry."""

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        d = 3 * x * x
        d = d.reshape(-1).clone()
        d[7] = 2 * d[7]
        return d.reshape(x.shape) * g


class _TimesTwoWrongBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, g):
        return 3 * g            # wrong: should be 2 * g


class SquareBadDouble(torch.autograd.Function):
    """x**2 whose first derivative is right, but whose second derivative is wrong."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return _TimesTwoWrongBackward.apply(x) * g


class Sin(torch.autograd.Function):
    """sin with a hand-written backward (correct); subclasses plant bugs in the backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return x.cos() * g


class NoisyBackward(Sin):
    """sin with a backward that adds fresh noise each time it runs."""

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return x.cos() * g + 1e-3 * torch.randn_like(x)


class SinWrongJvp(torch.autograd.Function):
    """sin with a right backward and a wrong forward-mode derivative."""

    @staticmethod
    def forward(x):
        return x.sin()

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x,) = inputs
        ctx.save_for_backward(x)
        ctx.x = x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return x.cos() * g

    @staticmethod
    def jvp(ctx, t):
        return -ctx.x.cos() * t      # wrong sign


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, bug):
        ctx.save_for_backward(x, w)
        ctx.bug = bug
        return x @ w.T + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gw = g.T @ x
        if ctx.bug == "scale":
            gw = gw * 1.01
        elif ctx.bug == "transpose":
            gw = gw.T
        return g @ w, gw, g.sum(0), None


class CustomLinear(nn.Module):
    def __init__(self, n: int, bug: str = "") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, n) / n ** 0.5)
        self.bias = nn.Parameter(torch.randn(n))
        self.bug = bug

    def forward(self, x):
        return _LinearFn.apply(x, self.weight, self.bias, self.bug)


def x64(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()


# --------------------------------------------------------------------------- correct functions


@pytest.mark.parametrize("mode", MODES)
def test_correct_custom_function_passes(mode):
    r = gradcheck(Cube.apply, x64(4, 5), mode=mode)
    assert isinstance(r, GradcheckResult)
    assert r.ok and bool(r)
    assert r.n_mismatched == 0 and len(r.table) == 0
    assert r.max_abs_err < 1e-4          # forward-difference screen: ~eps * f''
    assert "passed" in str(r)


def test_full_mode_compares_every_entry_against_naive_jacobian():
    x, w = x64(3, 4), x64(4, 2, seed=1)
    r = gradcheck(lambda a, b: (a @ b).tanh(), x, w)
    assert r.ok
    assert r.n_compared == (3 * 2) * (3 * 4 + 4 * 2)     # every (output, input) entry


@pytest.mark.parametrize("mode", MODES)
def test_nested_inputs_integer_passthrough_and_several_outputs(mode):
    a, b = x64(3), x64(2, 3, seed=1)
    frozen = torch.randn(3, dtype=torch.float64)            # no grad: passes through
    idx = torch.tensor([2, 0])

    def fn(pair, cfg):
        x, y = pair
        return {"s": (x * cfg["w"]).sin()[idx], "m": y @ x}, idx

    r = gradcheck(fn, (a, b), {"w": frozen, "name": "ignored"}, mode=mode)
    assert r.ok, str(r)


# --------------------------------------------------------------------------- planted bugs


@pytest.mark.parametrize("mode", MODES)
def test_single_wrong_entry_fails_and_first_row_is_that_entry(mode):
    x = x64(3, 4)
    r = gradcheck(CubeOneWrong.apply, x, mode=mode)
    assert not r.ok
    assert r.n_mismatched == 1
    first = r.table.iloc[0]
    assert first["input"] == "input0"
    assert first["index"] == (1, 3) and first["output_index"] == (1, 3)   # flat 7 of (3, 4)
    expected = 3 * float(x[1, 3].detach()) ** 2
    assert first["numerical"] == pytest.approx(expected, rel=1e-6)
    assert first["analytic"] == pytest.approx(2 * expected, rel=1e-9)
    assert first["abs_err"] == pytest.approx(expected, rel=1e-6)


def test_table_worst_first_and_str_bounded():
    x = x64(12, 12)
    r = gradcheck(lambda t: _TimesTwoWrongBackward.apply(t) * t, x)
    assert not r.ok and r.n_mismatched == 144
    errs = r.table["abs_err"].tolist()
    assert errs == sorted(errs, reverse=True)
    text = str(r)
    assert len(text.splitlines()) <= 16                        # never the whole Jacobian
    assert "worst 10 of 144" in text


def test_wrong_double_backward_caught_only_with_second_order():
    x = x64(5)
    assert gradcheck(SquareBadDouble.apply, x).ok
    r = gradcheck(SquareBadDouble.apply, x, second_order=True)
    assert not r.ok
    assert set(r.table["check"]) == {"second_order"}
    assert "second-order" in str(r)
    # d/dx (g * 2x) = 2 g ; the planted backward gives 3 g
    row = r.table[r.table["input"] == "input0"].iloc[0]
    assert row["analytic"] / row["numerical"] == pytest.approx(1.5, rel=1e-6)


def test_wrong_forward_ad_caught_only_with_forward_ad():
    x = x64(4)
    assert gradcheck(SinWrongJvp.apply, x).ok
    r = gradcheck(SinWrongJvp.apply, x, forward_ad=True)
    assert not r.ok
    assert {"forward_ad", "forward_vs_reverse"} <= set(r.table["check"])


@pytest.mark.parametrize("mode", MODES)
def test_nondeterministic_backward_reported_as_such(mode):
    r = gradcheck(NoisyBackward.apply, x64(6), mode=mode, atol=1e-6, rtol=1e-6)
    assert not r.ok
    assert r.nondeterministic
    assert 1e-5 < r.nondet_spread < 1e-1
    assert "nondeterministic backward" in str(r)
    assert "not a wrong gradient" in str(r)
    assert r.n_mismatched == 0                    # the mean gradient is not called wrong


def test_nondeterminism_within_nondet_tol_passes_and_is_reported():
    r = gradcheck(NoisyBackward.apply, x64(6), nondet_tol=1.0)
    assert r.ok and not r.nondeterministic
    assert r.nondet_spread > 0
    assert "varies between runs" in str(r)


def test_fast_mode_catches_one_percent_scale_that_torch_fast_mode_misses():
    class Scaled(Sin):
        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 1.01 * x.cos() * g

    x = x64(10_000)
    assert torch.autograd.gradcheck(Scaled.apply, (x,), fast_mode=True, raise_exception=False)
    r = gradcheck(Scaled.apply, x, mode="fast")
    assert not r.ok
    assert r.localised is None                    # too large for full mode: projections only
    assert set(r.table["check"]) == {"projection"}
    ratio = r.table["analytic"] / r.table["numerical"]
    assert ratio.between(1.0099, 1.0101).all()


# --------------------------------------------------------------------------- kinks


def test_kink_is_labelled_non_differentiable_point():
    x = torch.tensor([0.0, 1.0, -2.0], dtype=torch.float64, requires_grad=True)
    r = gradcheck(torch.relu, x)
    assert r.ok                                   # analytic 0 is the left derivative
    assert len(r.kinks) == 1 and "input0[0]" in r.kinks[0]
    assert "non-differentiable point" in str(r)
    strict = gradcheck(torch.relu, x, kinks="fail")
    assert not strict.ok
    assert strict.table.iloc[0]["note"] == "non-differentiable point"
    assert strict.table.iloc[0]["index"] == (0,)


# --------------------------------------------------------------------------- modules


def test_float32_linear_passes_via_check_module():
    lin = nn.Linear(4, 3)
    x = torch.randn(5, 4)
    r = check_module(lin, x)
    assert r.ok, str(r)
    assert r.dtype == torch.float64
    assert r.n_compared == 15 * (12 + 3 + 20)


def test_float32_module_checked_and_left_unchanged():
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 4)
    x_before = x.clone()
    r = check_module(model, x, wrt="all")
    assert r.ok
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32
        assert torch.equal(v, before[k])
    assert all(p.grad is None for p in model.parameters())
    assert x.dtype == torch.float32 and torch.equal(x, x_before) and not x.requires_grad


def test_forcing_float32_warns():
    lin = nn.Linear(3, 2)
    with pytest.warns(PrecisionWarning, match="float32"):
        r = check_module(lin, torch.randn(2, 3), dtype=torch.float32)
    assert r.dtype == torch.float32 and r.eps == 1e-3
    with pytest.warns(PrecisionWarning, match="float32"):
        gradcheck(torch.sin, torch.randn(3, requires_grad=True), dtype=None)


@pytest.mark.parametrize("bug", ["scale", "transpose"])
@pytest.mark.parametrize("mode", MODES)
def test_wrong_custom_weight_backward_names_the_parameter(bug, mode):
    torch.manual_seed(1)
    model = CustomLinear(5, bug=bug)
    x = torch.randn(4, 5)
    assert check_module(CustomLinear(5), x, mode=mode).ok
    r = check_module(model, x, mode=mode)
    assert not r.ok
    assert set(r.table["input"]) == {"weight"}
    assert "weight" in str(r)
    with pytest.raises(GradientMismatchError, match="weight") as info:
        assert_gradients_close(model, x, mode=mode)
    assert isinstance(info.value, AssertionError)
    assert not info.value.result.ok


@pytest.mark.parametrize("wrt, names", [("params", {"weight", "bias"}), ("inputs", {"input0"}),
                                        (["bias"], {"bias"})])
def test_wrt_selects_what_is_checked(wrt, names):
    model = CustomLinear(3, bug="scale")
    x = torch.randn(2, 3)
    r = check_module(model, x, wrt=wrt)
    assert set(r.table["input"]) <= names
    assert r.ok == ("weight" not in names)


def test_dropout_in_train_mode_checks_with_fixed_rng():
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2)).train()
    x = torch.randn(3, 4)
    state = torch.get_rng_state()
    assert check_module(model, x).ok
    assert torch.equal(torch.get_rng_state(), state)        # global RNG put back


def test_assert_gradients_close_message_is_result_text():
    x = x64(3, 4)
    r = gradcheck(CubeOneWrong.apply, x)
    with pytest.raises(GradientMismatchError) as info:
        assert_gradients_close(CubeOneWrong.apply, x)
    assert str(info.value) == str(r)
    assert_gradients_close(Cube.apply, x)                    # passes: returns None


# --------------------------------------------------------------------------- bad input


def test_no_input_requiring_grad():
    with pytest.raises(GraddbgError, match="no input requires grad.*requires_grad=False"):
        gradcheck(torch.sin, torch.randn(3, dtype=torch.float64))
    with pytest.raises(GraddbgError, match="no input requires grad"):
        gradcheck(lambda n: torch.ones(n), 3)


def test_non_tensor_output():
    with pytest.raises(GraddbgError, match=r"output\[1\] is a float, not a tensor"):
        gradcheck(lambda t: (t.sin(), 1.0), x64(3))
    with pytest.raises(GraddbgError, match="no floating-point output"):
        gradcheck(lambda t: (t > 0), x64(3))


def test_complex_input_is_checked_through_its_real_and_imaginary_parts():
    z = torch.randn(3, dtype=torch.complex128, requires_grad=True)
    r = gradcheck(torch.sin, z)
    assert r.ok and r.n_compared == (3 * 2) ** 2     # (real, imag) x (real, imag) per element


def test_complex_output_checked_as_real_and_imaginary_parts():
    x = x64(3, 2)
    r = gradcheck(lambda t: torch.view_as_complex(t) * (1 + 2j), x)
    assert r.ok and r.n_compared == 36
    x = (x64(4).detach().abs() + 0.1).requires_grad_()     # polar needs abs >= 0
    r = gradcheck(lambda t: torch.polar(t, t).exp(), x)
    assert r.ok


def test_bad_strings_and_options():
    x = x64(3)
    with pytest.raises(GraddbgError, match=r"\(mode=...\): got 'slow'; accepted: 'full', 'fast'"):
        gradcheck(torch.sin, x, mode="slow")
    with pytest.raises(GraddbgError, match=r"\(kinks=...\): got 'ignore'; accepted: "):
        gradcheck(torch.sin, x, kinks="ignore")
    with pytest.raises(GraddbgError, match=r"\(eps=...\): got -1.0; accepted: a finite number > 0"):
        gradcheck(torch.sin, x, eps=-1.0)
    with pytest.raises(GraddbgError, match=r"\(dtype=...\): got torch.int64; accepted: a floating-point torch.dtype"):
        gradcheck(torch.sin, x, dtype=torch.int64)
    with pytest.raises(GraddbgError, match="max_entries=10"):
        gradcheck(torch.sin, x64(20), max_entries=10)
    lin = nn.Linear(2, 2)
    with pytest.raises(GraddbgError, match=r"wrt='weights' is not supported.*'params'"):
        check_module(lin, torch.randn(1, 2), wrt="weights")
    with pytest.raises(GraddbgError, match=r"wrt names \['wieght'\].*parameters: \['weight', 'bias'\]"):
        check_module(lin, torch.randn(1, 2), wrt=["wieght"])
    with pytest.raises(GraddbgError, match=r"unknown keyword\(s\) \['atoll'\]"):
        check_module(lin, torch.randn(1, 2), atoll=1.0)
    with pytest.raises(GraddbgError, match="got the class Linear, expected an nn.Module instance; "
                                           "instantiate it first"):
        check_module(nn.Linear, torch.randn(1, 2))
    with pytest.raises(GraddbgError, match="must be a torch.nn.Module, got function"):
        check_module(lambda t: t, torch.randn(1, 2))


def test_gradcheck_leaves_inputs_and_global_state_alone():
    x = torch.randn(4, requires_grad=True)                   # float32: checked on a copy
    before = x.detach().clone()
    rng = torch.get_rng_state()
    assert gradcheck(torch.exp, x).ok
    assert x.dtype == torch.float32 and torch.equal(x.detach(), before) and x.grad is None
    assert torch.equal(torch.get_rng_state(), rng)


# ----------------------------------------------------------------- fresh interpreters

LIGHT_IMPORT = ("import sys, graddbg.gradcheck, graddbg.pytest_plugin; "
                "print(sorted(m for m in ('pandas', 'matplotlib', 'numpy.testing', 'graphviz') "
                "if m in sys.modules))")


def _fresh(code: str) -> subprocess.CompletedProcess:
    return _together.run([sys.executable, "-c", code])


@pytest.fixture(scope="module")
def fresh_interpreters(request):
    """The fresh interpreters of the selected import tests below, started together
    (tests/_together.py): {test (and import order): its CompletedProcess, once ended}."""
    together = Together()
    for name, ids in selected(request, ["test_import_is_light",
                                        "test_gradcheck_is_the_function_in_every_import_order"]).items():
        for first in ids:
            code = LIGHT_IMPORT if not first else IMPORT_ORDERS[first] + IMPORT_ORDER_CHECK
            together.start(f"{name}[{first}]", _fresh, code)
    yield together
    together.close()


def test_import_is_light(fresh_interpreters):
    out = fresh_interpreters.result("test_import_is_light[]")
    out.check_returncode()
    assert out.stdout.strip() == "[]"


def test_public_names():
    # graddbg.gradcheck is the function (as torch.autograd.gradcheck is); the submodule
    # is sys.modules["graddbg.gradcheck"]. Import orders: test_gradcheck_is_the_function_*
    assert graddbg.gradcheck is gradcheck
    assert isinstance(graddbg.gradcheck(torch.sin, x64(2)), GradcheckResult)
    assert sys.modules["graddbg.gradcheck"].gradcheck is gradcheck
    assert graddbg.check_module is check_module
    assert graddbg.assert_gradients_close is assert_gradients_close
    assert graddbg.GradcheckResult is GradcheckResult


IMPORT_ORDERS = {
    "package first": "import graddbg",
    "submodule first": "import graddbg.gradcheck",
    "from the submodule first": "from graddbg.gradcheck import check_module",
}


IMPORT_ORDER_CHECK = textwrap.dedent("""
    import sys, torch, graddbg
    assert graddbg.gradcheck(torch.sin, torch.randn(3, dtype=torch.float64, requires_grad=True)).ok
    module = sys.modules["graddbg.gradcheck"]
    assert type(module) is type(sys), type(module)           # a plain module: no class swap
    assert graddbg.gradcheck is module.gradcheck, graddbg.gradcheck
    from graddbg.gradcheck import check_module, gradcheck
    assert gradcheck is graddbg.gradcheck and check_module is graddbg.check_module
    print("OK")
""")


@pytest.mark.parametrize("first", list(IMPORT_ORDERS))
def test_gradcheck_is_the_function_in_every_import_order(first, fresh_interpreters):
    out = fresh_interpreters.result(f"test_gradcheck_is_the_function_in_every_import_order[{first}]")
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stderr


# --------------------------------------------------------------------------- options


DESIGN_OPTIONS = dict(mode="full", eps=None, atol=None, rtol=None, forward_ad=False,
                      second_order=False)
EXTRA_OPTIONS = dict(nondet_tol=None, dtype=torch.float64, kinks="allow", seed=0, probes=2,
                     max_entries=2 ** 27, localise_entries=1_000_000, compress=True,
                     check_backward_ad=True, check_undefined_grad=True, check_grad_dtypes=False,
                     check_batched_grad=False, check_batched_forward_grad=False, masked=None)
TORCH_STYLE_EXTRA = dict(raise_exception=None)   # gradcheck only


@pytest.mark.parametrize("fn, head", [(gradcheck, ["fn", "inputs"]),
                                      (check_module, ["module", "inputs", "wrt"]),
                                      (assert_gradients_close, ["fn_or_module", "inputs", "wrt"])],
                         ids=["gradcheck", "check_module", "assert_gradients_close"])
def test_every_entry_point_shows_the_same_options_in_its_signature(fn, head):
    params = inspect.signature(fn).parameters
    assert list(params)[:len(head)] == head
    options = {name: p.default for name, p in params.items() if name not in head}
    extra = TORCH_STYLE_EXTRA if fn is gradcheck else {}
    assert list(options) == [*DESIGN_OPTIONS, *EXTRA_OPTIONS, *extra]
    assert options == {**DESIGN_OPTIONS, **EXTRA_OPTIONS, **extra}
    assert all(params[name].kind is inspect.Parameter.KEYWORD_ONLY for name in options)


ENTRY_POINTS = {"gradcheck": gradcheck, "check_module": check_module,
                "assert_gradients_close": assert_gradients_close}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_unknown_keyword_is_a_type_error_naming_it_and_the_accepted_ones(entry):
    fn = ENTRY_POINTS[entry]
    wrt = ", 'wrt'" if entry != "gradcheck" else ""
    torch_style = "'inputs', " if entry == "gradcheck" else ""
    raising = "'raise_exception', " if entry == "gradcheck" else ""
    match = (rf"^{entry}\(\): unknown keyword\(s\) \['atoll', 'zzz'\] \(did you mean 'atol'\?\); accepted: \['atol', "
             rf"'check_backward_ad', 'check_batched_forward_grad', 'check_batched_grad', "
             rf"'check_forward_ad', 'check_grad_dtypes', 'check_sparse_nnz', 'check_undefined_grad', "
             rf"'compress', 'dtype', 'eps', 'fast_mode', 'forward_ad', {torch_style}'kinks', "
             rf"'localise_entries', 'masked', 'max_entries', 'mode', 'nondet_tol', 'probes', {raising}"
             rf"'rtol', 'second_order', 'seed'{wrt}\]$")
    with pytest.raises(TypeError, match=match) as info:
        fn(nn.Linear(2, 2), torch.randn(1, 2), atoll=1e-3, zzz=1)
    assert isinstance(info.value, GraddbgError)


BAD_OPTIONS = [  # (keywords, error, message)
    (dict(mode="slow"), ValueError, r"\(mode=...\): got 'slow'; accepted: 'full', 'fast'$"),
    (dict(mode=1), TypeError, r"\(mode=...\): got 1 \(int\); accepted: 'full', 'fast'$"),
    (dict(kinks="ignore"), ValueError, r"\(kinks=...\): got 'ignore'; accepted: 'allow', 'fail'$"),
    (dict(eps=0.0), ValueError, r"\(eps=...\): got 0.0; accepted: a finite number > 0 \(or None for the default"),
    (dict(atol=-1), ValueError, r"\(atol=...\): got -1; accepted: a finite number >= 0"),
    (dict(rtol=float("inf")), ValueError, r"\(rtol=...\): got inf; accepted: a finite number >= 0"),
    (dict(atol="1e-5"), TypeError, r"\(atol=...\): got '1e-5' \(str\); accepted: a finite number >= 0 \(or None for the default"),
    (dict(nondet_tol=True), TypeError, r"\(nondet_tol=...\): got True \(bool\); accepted: a finite number"),
    (dict(forward_ad="yes"), TypeError, r"\(forward_ad=...\): got 'yes' \(str\); accepted: True or False$"),
    (dict(second_order=None), TypeError, r"\(second_order=...\): got None \(NoneType\); accepted: True or False$"),
    (dict(compress=2), TypeError, r"\(compress=...\): got 2 \(int\); accepted: True or False$"),
    (dict(probes=0), ValueError, r"\(probes=...\): got 0; accepted: an int >= 1$"),
    (dict(probes=2.0), TypeError, r"\(probes=...\): got 2.0 \(float\); accepted: an int >= 1$"),
    (dict(seed="0"), TypeError, r"\(seed=...\): got '0' \(str\); accepted: an int$"),
    (dict(max_entries=0), ValueError, r"\(max_entries=...\): got 0; accepted: an int >= 1$"),
    (dict(localise_entries=-1), ValueError, r"\(localise_entries=...\): got -1; accepted: an int >= 0$"),
    (dict(dtype=torch.int64), ValueError, r"\(dtype=...\): got torch.int64; accepted: a floating-point torch.dtype"),
    (dict(dtype="float64"), TypeError, r"\(dtype=...\): got 'float64' \(str\); accepted: a floating-point torch.dtype"),
]


@pytest.mark.parametrize("kw, error, match", BAD_OPTIONS, ids=[repr(kw) for kw, _, _ in BAD_OPTIONS])
def test_bad_option_is_a_value_or_type_error_naming_it(kw, error, match):
    with pytest.raises(error, match=r"^gradcheck" + match) as info:
        gradcheck(torch.sin, x64(3), **kw)
    assert isinstance(info.value, GraddbgError)


def test_good_options_are_normalised():
    r = gradcheck(torch.sin, x64(3), eps=1, atol=0, rtol=0.5, forward_ad=1, probes=3)
    assert r.eps == 1.0 and r.atol == 0.0 and isinstance(r.eps, float)


def test_bad_fn_inputs_and_outputs_are_value_or_type_errors():
    x = x64(3)
    with pytest.raises(TypeError, match=r"^gradcheck\(fn=...\): got int, expected a callable"):
        gradcheck(3, x)
    with pytest.raises(TypeError, match=r"^gradcheck\(fn=...\): got the class Linear, expected an "
                                        r"nn.Module instance; instantiate it first: Linear\(...\)"):
        gradcheck(nn.Linear, x)
    with pytest.raises(TypeError, match=r"got the autograd.Function class Cube; pass Cube.apply"):
        gradcheck(Cube, x)
    with pytest.raises(ValueError, match=r"^gradcheck: no input requires grad; give at least one "
                                         r"floating-point tensor with requires_grad=True \(got "
                                         r"Tensor\(torch.float64, requires_grad=False\), int\)"):
        gradcheck(torch.sin, x.detach(), 3)
    with pytest.raises(TypeError, match=r"^gradcheck: the function's output is a str, not a tensor"):
        gradcheck(lambda t: "sin", x)
    with pytest.raises(TypeError, match=r"^assert_gradients_close: the function's output\[1\] is a "
                                        r"float, not a tensor"):
        assert_gradients_close(lambda t: (t.sin(), 1.0), x)
    with pytest.raises(TypeError, match=r"the function returned NoneType with no tensor in it"):
        gradcheck(lambda t: None, x)
    with pytest.raises(ValueError, match=r"no floating-point output to differentiate \(outputs: "
                                         r"output\[0\]: torch.bool, output\[1\]: torch.int64\)"):
        gradcheck(lambda t: (t > 0, t.argmax()), x)
    with pytest.raises(ValueError, match=r"the Jacobian has 20 x 20 = 400 entries, more than "
                                         r"max_entries=10; use mode='fast'"):
        gradcheck(torch.sin, x64(20), max_entries=10)


def test_bad_module_arguments_are_value_or_type_errors():
    lin, x = nn.Linear(2, 2), torch.randn(1, 2)
    with pytest.raises(TypeError, match=r"^check_module\(module=...\): got the class Linear, expected "
                                        r"an nn.Module instance; instantiate it first"):
        check_module(nn.Linear, x)
    with pytest.raises(TypeError, match=r"^check_module\(module=...\): must be a torch.nn.Module, got "
                                        r"function; use gradcheck\(\) for functions"):
        check_module(lambda t: t, x)
    with pytest.raises(TypeError, match=r"^check_module\(module=...\): got Tensor, expected a torch.nn.Module"):
        check_module(x, x)
    with pytest.raises(ValueError, match=r"^check_module: wrt='weights' is not supported; use one of "
                                         r"\('all', 'params', 'inputs'\)"):
        check_module(lin, x, wrt="weights")
    with pytest.raises(TypeError, match=r"^check_module: wrt must be 'all', 'params', 'inputs' or a "
                                        r"list of names \(str\), got 3"):
        check_module(lin, x, wrt=3)
    with pytest.raises(ValueError, match=r"wrt names \['input1'\] are neither trainable parameters nor "
                                         r"floating-point inputs; parameters: \['weight', 'bias'\]; "
                                         r"inputs: \['input0'\]"):
        check_module(lin, x, wrt=["input1"])
    with pytest.raises(ValueError, match=r"^check_module: nothing to check for wrt=\[\]"):
        check_module(lin, x, wrt=[])
    with pytest.raises(TypeError, match=r"^assert_gradients_close: wrt=\['weight'\] selects parameters "
                                        r"or inputs of an nn.Module, but fn_or_module is a function"):
        assert_gradients_close(lambda t: t, x64(2), wrt=["weight"])
    with pytest.raises(ValueError, match=r"^assert_gradients_close\(mode=...\): got 'slow'"):
        assert_gradients_close(lin, x, mode="slow")


def test_wrapped_module_is_checked_as_the_module_it_wraps():
    torch.manual_seed(1)
    inner = CustomLinear(3, bug="scale")
    wrapped = nn.DataParallel(inner)                  # on the CPU it only holds the module
    r = check_module(wrapped, torch.randn(2, 3), wrt=["weight"])   # not "module.weight"
    assert not r.ok and set(r.table["input"]) == {"weight"}
    assert inner.weight.dtype == torch.float32


def test_a_tuple_argument_reaches_the_function_as_a_tuple():
    seen = []

    def first_sin(pair):
        seen.append(type(pair))
        return pair[0].sin()

    # a lone tuple is torch's ``inputs``: a tuple argument is passed inside one
    r = gradcheck(first_sin, ((x64(3),),))
    assert r.ok and r.n_compared == 3 * 3 and set(seen) == {tuple}


def test_outputs_in_dataclasses_are_walked_and_named():
    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        ids: torch.Tensor
        aux: tuple

    x = x64(3, 4)
    r = gradcheck(lambda t: Out(t.sin(), t.argmax(), (None, CubeOneWrong.apply(t))), x)
    assert not r.ok and r.n_mismatched == 1
    assert r.n_compared == (12 + 12) * 12                       # logits and aux[1]; not ids
    row = r.table.iloc[0]
    assert (row["output"], row["output_index"], row["index"]) == ("output.aux[1]", (1, 3), (1, 3))


def test_outputs_that_change_structure_between_calls_are_a_value_error():
    calls = []

    def fn(t):
        calls.append(None)
        return {"a": t.sin()} if len(calls) == 1 else {"b": t.sin()}

    with pytest.raises(ValueError, match=r"^gradcheck: the function returned outputs \['b'\] on one "
                                         r"call and \['a'\] on the first"):
        gradcheck(fn, x64(3))


# --------------------------------------------------------------------------- devices


@pytest.mark.parametrize("mode", MODES)
def test_runs_on_the_inputs_device(device, mode):
    x = torch.randn(3, 4, dtype=torch.float64, device=device, requires_grad=True)
    assert gradcheck(Cube.apply, x, mode=mode).ok
    r = gradcheck(CubeOneWrong.apply, x, mode=mode)
    assert not r.ok and r.table.iloc[0]["index"] == (1, 3)
    lin = nn.Linear(4, 2).to(device)
    assert check_module(lin, torch.randn(5, 4, device=device), mode=mode).ok
    assert lin.weight.device.type == device.type and lin.weight.dtype == torch.float32


# --------------------------------------------------------------------------- compressed full mode


class SortValues(torch.autograd.Function):
    """Sorted values with a hand-written backward that scatters ``g`` through the sort's
    permutation. ``bug``: None (correct), "entry" (the entry of output 5 doubled),
    "swap" (the permutation with outputs 10 and 11 exchanged), "inverse" (a gather
    instead of the scatter: the inverse permutation)."""

    @staticmethod
    def forward(ctx, x, bug):
        values, perm = x.sort()
        ctx.save_for_backward(perm)
        ctx.bug = bug
        return values

    @staticmethod
    def backward(ctx, g):
        (perm,) = ctx.saved_tensors
        gi = torch.zeros_like(g)
        if ctx.bug == "inverse":
            gi = g[perm]
        elif ctx.bug == "swap":
            p = perm.clone()
            p[[10, 11]] = p[[11, 10]]
            gi[p] = g
        else:
            gi[perm] = g
        if ctx.bug == "entry":
            gi[perm[5]] = 2 * g[5]
        return gi, None


class ShiftMissingTerm(torch.autograd.Function):
    """y = x + x[0] / 2 whose backward forgets the x[0] term: a whole column of the
    Jacobian the analytic pattern does not have (rows without a column of its colour)."""

    @staticmethod
    def forward(ctx, x):
        return x + 0.5 * x[:1]

    @staticmethod
    def backward(ctx, g):
        return g


def spaced(n, seed=0):
    """A shuffled grid with gaps of 0.01 (>> eps): sort has no near-ties, so no kinks."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(n, generator=g).to(torch.float64) * 0.01).requires_grad_()


def _entries(result):
    return {(r["index"], r["output_index"]): (r["analytic"], r["numerical"])
            for r in result.rows}


def test_compressed_sort_finds_single_wrong_entry_first_in_table():
    x = spaced(2000)
    r = gradcheck(SortValues.apply, x, "entry")
    assert r.colours is not None and r.colours == 1          # the compressed path ran
    assert r.n_evaluations < 200                              # per column: >= 2000
    assert not r.ok and r.n_mismatched == 1
    perm = x.detach().sort().indices
    first = r.table.iloc[0]
    assert first["index"] == (int(perm[5]),) and first["output_index"] == (5,)
    assert first["analytic"] == pytest.approx(2.0, rel=1e-12)
    assert first["numerical"] == pytest.approx(1.0, rel=1e-6)
    assert "compressed into 1 colour group" in str(r)
    assert r.n_compared == 2000 * 2000


@pytest.mark.parametrize("seed", range(3))
def test_compressed_catches_two_swapped_rows_of_a_permutation(seed):
    x = spaced(1000, seed)
    r = gradcheck(SortValues.apply, x, "swap", seed=seed)
    assert r.colours == 1 and not r.ok
    perm = x.detach().sort().indices.tolist()
    expected = {((perm[11],), (10,)): (1.0, 0.0), ((perm[10],), (11,)): (1.0, 0.0),
                ((perm[10],), (10,)): (0.0, 1.0), ((perm[11],), (11,)): (0.0, 1.0)}
    got = _entries(r)
    assert set(got) == set(expected) and r.n_mismatched == 4
    for key, (a, n) in expected.items():
        assert got[key] == pytest.approx((a, n), abs=1e-6)


def test_compressed_catches_wrong_permutation_exactly_like_uncompressed():
    x = spaced(400, seed=3)
    r = gradcheck(SortValues.apply, x, "inverse")
    ref = gradcheck(SortValues.apply, x, "inverse", compress=False)
    assert r.colours == 1 and ref.colours is None
    perm = x.detach().sort().indices.tolist()
    analytic = {(j, perm[j]) for j in range(400)}            # (input, output) of the gather
    true = {(perm[i], i) for i in range(400)}
    assert not r.ok and r.n_mismatched == len(analytic ^ true) == ref.n_mismatched
    assert set(_entries(r)) == set(_entries(ref)) == {((j,), (i,)) for j, i in analytic ^ true}


def test_compressed_finds_a_column_missing_from_the_analytic_pattern():
    x = x64(300)
    r = gradcheck(ShiftMissingTerm.apply, x)
    ref = gradcheck(ShiftMissingTerm.apply, x, compress=False)
    assert r.colours == 1 and not r.ok
    assert r.n_mismatched == ref.n_mismatched == 300
    assert set(_entries(r)) == set(_entries(ref)) == {((0,), (i,)) for i in range(300)}
    for key, (a, n) in _entries(r).items():
        ra, rn = _entries(ref)[key]
        assert a == ra and n == pytest.approx(rn, abs=1e-9)


def test_dense_jacobian_takes_the_per_column_path():
    w = torch.randn(20, 300, dtype=torch.float64)
    x = x64(300)
    r = gradcheck(lambda t: (w @ t).tanh(), x)
    assert r.ok and r.colours is None
    assert r.n_evaluations >= 300
    assert "compressed" not in str(r)


def _blockwise(t):
    return t.view(16, 40).logsumexp(1)                 # 40 colours of 16 columns


def _banded(t):
    w = torch.tensor([[[0.5, -1.0, 2.0, 1.0, 0.25]]], dtype=t.dtype)
    return torch.nn.functional.conv1d(t.view(1, 1, -1), w, padding=2).sin()


SPARSE_FUNCTIONS = {
    "sort": (lambda t: t.sort().values, lambda: spaced(600)),
    "elementwise": (lambda t: t.sin() * t, lambda: x64(500)),
    "blockwise": (_blockwise, lambda: x64(640)),
    "banded (general colouring)": (_banded, lambda: x64(400)),
    "slice_scatter": (lambda t: torch.slice_scatter(t, t[:, :3] ** 2, 1, 0, 3),
                      lambda: x64(40, 8)),
}


@pytest.mark.parametrize("name", list(SPARSE_FUNCTIONS))
def test_compressed_agrees_with_per_column_on_correct_functions(name):
    fn, make = SPARSE_FUNCTIONS[name]
    x = make()
    r = gradcheck(fn, x)
    ref = gradcheck(fn, x, compress=False)
    assert r.ok and ref.ok, (str(r), str(ref))
    assert r.colours is not None and ref.colours is None
    assert r.n_compared == ref.n_compared == x.numel() * fn(x).numel()
    assert r.n_evaluations * 4 <= ref.n_evaluations
    assert r.max_abs_err < 1e-5 and ref.max_abs_err < 1e-5


@pytest.mark.parametrize("seed", range(4))
def test_column_colouring_is_valid(seed):
    mod = sys.modules["graddbg.gradcheck"]      # the module (the package attribute is the function)
    g = torch.Generator().manual_seed(seed)
    m, n = 60, 300
    pattern = torch.rand(m, n, generator=g) < 0.02
    pattern[:, ::7] |= torch.rand(m, 1, generator=g) < 0.3    # some columns in many rows
    rows, cols = pattern.nonzero().unbind(1)
    colour, count = mod._colour_columns(rows, cols, m, n, n)
    assert colour.shape == (n,) and int(colour.max()) < count
    per_row = pattern.double() @ torch.nn.functional.one_hot(colour, count).double()
    assert per_row.max() <= 1                                 # no row sees a colour twice
    assert count >= int(pattern.sum(1).max())                 # a lower bound on any colouring
    assert count <= int(pattern.sum(1).max()) * 4 + 8         # and not far above it
    # every column in at most one row: the rank in its row, optimal
    single = torch.zeros(m, n, dtype=torch.bool)
    single[torch.randint(0, m, (n,), generator=g), torch.arange(n)] = True
    rows, cols = single.nonzero().unbind(1)
    colour, count = mod._colour_columns(rows, cols, m, n, n)
    assert count == int(single.sum(1).max())
    per_row = single.double() @ torch.nn.functional.one_hot(colour, count).double()
    assert per_row.max() <= 1


def test_compressed_runs_on_the_inputs_device(device):
    x = spaced(300).detach().to(device).requires_grad_()
    r = gradcheck(SortValues.apply, x, "entry")
    assert r.colours == 1 and not r.ok and r.n_mismatched == 1
    perm = x.detach().sort().indices
    assert r.table.iloc[0]["index"] == (int(perm[5]),)
    assert gradcheck(SortValues.apply, x, None).ok


def test_forward_ad_on_a_module_warns_nothing():
    import warnings

    lin = nn.Linear(6, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_module(lin, torch.randn(4, 6), forward_ad=True).ok
