"""The pytest plugin: loaded through the pytest11 entry point, fixture seeds and helps."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from graddbg.pytest_plugin import GradcheckHelpers

USER_TESTS = textwrap.dedent('''
    import random
    import torch
    import pytest
    from graddbg import GradientMismatchError

    class Cube(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x ** 3

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 3 * x * x * g

    class WrongCube(Cube):
        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * x * g

    def test_good(graddbg_check):
        x = torch.randn(5, dtype=torch.float64, requires_grad=True)
        graddbg_check.assert_gradients_close(Cube.apply, x)
        assert graddbg_check.gradcheck(Cube.apply, x, mode="fast").ok
        assert graddbg_check.check_module(torch.nn.Linear(3, 2), torch.randn(2, 3)).ok

    def test_seed_option(graddbg_check):
        print("SEED", graddbg_check.seed)

    def test_seed_value_torch(graddbg_check):
        a = torch.rand(3)
        torch.manual_seed(graddbg_check.seed)
        assert torch.equal(a, torch.rand(3))

    def test_seed_value_python(graddbg_check):
        a = random.random()
        random.seed(graddbg_check.seed)
        assert a == random.random()

    def test_state_1_set_outside():
        torch.manual_seed(99)
        random.seed(99)

    def test_state_2_fixture_reseeds(graddbg_check):
        torch.rand(5)
        random.random()

    def test_state_3_put_back():
        a, b = torch.rand(1), random.random()
        torch.manual_seed(99)
        random.seed(99)
        assert torch.equal(a, torch.rand(1)) and b == random.random()

    def test_wrong_fails_with_table(graddbg_check):
        x = torch.randn(4, dtype=torch.float64, requires_grad=True)
        graddbg_check.assert_gradients_close(WrongCube.apply, x)
''')


def _run_pytest(tmp_path, *args):
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    # a fresh interpreter: the fixture can only come from the installed entry point
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
           "ignore::DeprecationWarning", str(tmp_path / "test_user.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)


@pytest.mark.slow
def test_fixture_from_entry_point_in_a_fresh_pytest(tmp_path):
    out = _run_pytest(tmp_path, "--graddbg-seed", "7", "-s")
    text = out.stdout + out.stderr
    assert "1 failed, 7 passed" in text, text
    assert "SEED 7" in text
    # the failing test shows our bounded table, as an assertion failure
    assert "GradientMismatchError: gradcheck FAILED (mode=full" in text
    assert "worst 4 of 4" in text
    assert "fixture 'graddbg_check' not found" not in text


def test_helpers_in_process():
    helpers = GradcheckHelpers(seed=3)
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert helpers.gradcheck(torch.sin, x).ok
    assert helpers.check_module(torch.nn.Linear(2, 2), torch.randn(1, 2), wrt="params").ok
    helpers.assert_gradients_close(torch.tanh, x)
    assert repr(helpers) == "GradcheckHelpers(seed=3)"


@pytest.mark.parametrize("seed, error, match", [
    (-1, ValueError, r"GradcheckHelpers: seed=-1 must be an int in \[0, 2\*\*32\)"),
    (2 ** 32, ValueError, r"seed=4294967296 must be an int in \[0, 2\*\*32\)"),
    ("0", TypeError, r"GradcheckHelpers: seed='0' must be an int in \[0, 2\*\*32\), got str"),
    (True, TypeError, r"seed=True must be an int"),
])
def test_bad_seed_is_a_value_or_type_error(seed, error, match):
    with pytest.raises(error, match=match):
        GradcheckHelpers(seed=seed)


@pytest.mark.parametrize("value", ["-1", "seven"])
def test_bad_seed_option_is_a_usage_error_naming_it(tmp_path, value):
    (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--graddbg-seed={value}",
           str(tmp_path / "test_nothing.py")]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 4, out.stdout + out.stderr          # pytest's usage error
    assert (f"argument --graddbg-seed: got '{value}', expected an int in [0, 2**32)"
            in out.stderr), out.stderr


def test_helpers_pass_bad_arguments_on_as_value_or_type_errors():
    helpers = GradcheckHelpers()
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match=r"^gradcheck\(mode=...\): got 'slow'; accepted: 'full', 'fast'"):
        helpers.gradcheck(torch.sin, x, mode="slow")
    with pytest.raises(TypeError, match=r"^check_module\(module=...\): got the class Linear"):
        helpers.check_module(torch.nn.Linear, x)
    with pytest.raises(TypeError, match=r"^assert_gradients_close\(\): unknown keyword\(s\) \['atoll'\]"):
        helpers.assert_gradients_close(torch.sin, x, atoll=1.0)
