"""graddbg._compiled.Twin: compile on demand (ski rental), use the compiled twin only after
it matched the eager function, and fall back to eager for good when compiling fails."""
from __future__ import annotations

import torch

from graddbg._compiled import Twin

CPU = torch.device("cpu")


def _mix(x: torch.Tensor) -> torch.Tensor:
    return ((x ^ (x >> 3)) * 5).sum(1)


def _samples(device):
    return [(torch.arange(4096, dtype=torch.int32, device=device).view(64, 64),)]


def test_auto_pays_the_eager_cost_until_it_adds_up_to_the_rent_then_compiles():
    twin = Twin(_mix, _samples, rent=1.0)
    assert twin.due(CPU) is None and twin.why_not(CPU) is None     # nothing tried yet
    twin.charge(0.6)
    assert twin.due(CPU) is None
    twin.charge(0.6)
    compiled = twin.due(CPU)
    assert compiled is not None, twin.why_not(CPU)
    x = torch.randint(-2 ** 31, 2 ** 31 - 1, (300, 64), dtype=torch.int64).to(torch.int32)
    assert torch.equal(compiled(x), _mix(x))
    assert twin.due(CPU) is compiled                                # compiled once
    assert twin.select("eager", CPU) == "eager" and twin.due(CPU) is None
    assert twin.select("auto", CPU) == "auto" and twin.due(CPU) is compiled


def test_a_failing_compilation_falls_back_to_eager_for_good_and_says_why():
    def bad_samples(device):
        return [(torch.ones(2, 3), torch.ones(4))]                  # the call itself fails
    twin = Twin(lambda a, b: a + b, bad_samples, rent=0.0)
    assert twin.due(CPU) is None
    assert twin.why_not(CPU).startswith("torch.compile failed (") and "RuntimeError" in twin.why_not(CPU)
    assert twin.select("compiled", CPU).startswith("eager: torch.compile failed")
    assert twin.kind == "eager" and twin.due(CPU) is None


def test_a_compiled_result_that_differs_is_never_used():
    calls = []

    def fn(x):
        calls.append(torch.compiler.is_compiling())
        # eager and compiled disagree: the traced branch is taken only while compiling
        return x + 1 if torch.compiler.is_compiling() else x
    twin = Twin(fn, lambda d: [(torch.zeros(3),)], rent=0.0)
    assert twin.due(CPU) is None
    assert "differed" in twin.why_not(CPU)
    assert True in calls and False in calls
