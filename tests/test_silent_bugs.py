"""The silent bugs of issue 23 (point 1): each buggy loop of tests/silent_bugs.py is named by
exactly one finding of its kind (the right parameter, at the right step), and each fixed
twin gives no anomaly and no warning. Under `graddbg run` too, for one buggy loop per kind
and two twins. And first, that each case really is what it says (its bug happens, its twin
is healthy), checked without graddbg.
"""
from __future__ import annotations

import pathlib
import subprocess
import sys
import warnings

import pytest
import torch

import graddbg
import silent_bugs
from silent_bugs import BUGGY, CASES, TWINS
import _together
from _together import Together, selected

# the warnings a buggy case may give: the finding itself (policy "warn") and coverage notes
FINDING_WARNINGS = ("AnomalyWarning", "CoverageWarning")


def _run(case):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w = case.run({})
    return w, caught


def _graddbg_warnings(caught):
    return [c for c in caught if issubclass(c.category, graddbg.GraddbgWarning)]


def _describe(anomalies):
    return "\n".join(f"step {a.step} {a.kind} {a.name}: {a.message}" for a in anomalies) or "no anomaly"


# ----------------------------------------------------------------------------- graddbg.watch

@pytest.mark.parametrize("name", BUGGY)
def test_buggy_loop_gives_one_finding_of_its_kind(name):
    case = CASES[name]()
    w, _ = _run(case)
    assert [a.kind for a in w.anomalies] == [case.kind], _describe(w.anomalies)


@pytest.mark.parametrize("name", BUGGY)
def test_the_finding_names_the_parameter_and_the_step(name):
    case = CASES[name]()
    w, _ = _run(case)
    found = [a for a in w.anomalies if a.kind == case.kind]
    assert found, _describe(w.anomalies)
    a = found[0]
    assert a.name in case.params, f"{a.name!r} is not one of {case.params}\n{_describe(found)}"
    assert case.first_step <= a.step <= case.last_step, _describe(found)
    for p in case.params:  # the message names every parameter concerned
        assert p in a.message, f"{p!r} not named in: {a.message}"


@pytest.mark.parametrize("name", BUGGY)
def test_buggy_loop_gives_no_internal_warning(name):
    _, caught = _run(CASES[name]())
    other = [f"{c.category.__name__}: {c.message}" for c in _graddbg_warnings(caught)
             if c.category.__name__ not in FINDING_WARNINGS]
    assert other == [], "\n".join(other)


@pytest.mark.parametrize("name", TWINS)
def test_fixed_twin_gives_no_anomaly(name):
    w, _ = _run(CASES[name]())
    assert w.anomalies == [], _describe(w.anomalies)


@pytest.mark.parametrize("name", TWINS)
def test_fixed_twin_gives_no_warning(name):
    _, caught = _run(CASES[name]())
    shown = [f"{c.category.__name__}: {c.message}" for c in _graddbg_warnings(caught)]
    assert shown == [], "\n".join(shown)


def test_every_kind_has_a_buggy_case_and_a_twin():
    kinds = {CASES[n]().kind for n in BUGGY}
    assert kinds == set(silent_bugs.KINDS)
    for kind in silent_bugs.KINDS:
        assert any(n.startswith(kind) for n in TWINS), kind


# ----------------------------------------------------------------------------- graddbg run

CLI_CASES = ["stale_grad", "empty_step_zero_grad_between", "orphan_param_bn_left_out", "no_update_lr_zero",
             "dead_grad", "unused_param", "stale_grad_twin_accumulation", "dead_grad_twin"]


def _graddbg_run(script, out, cwd):
    return _together.run([sys.executable, "-m", "graddbg", "run", "--out", str(out), str(script)], cwd=cwd)


@pytest.fixture(scope="module")
def console_runs(request, tmp_path_factory):
    """`graddbg run` of each selected case's standalone script, started together
    (tests/_together.py): {name: (CompletedProcess, its folder)}."""
    together, dirs = Together(), {}
    for name in selected(request, ["test_graddbg_run_names_it_on_the_console"]).get(
            "test_graddbg_run_names_it_on_the_console", []):
        dirs[name] = tmp_path_factory.mktemp(name[:40])
        script = dirs[name] / f"{name}.py"
        script.write_text(CASES[name]().standalone(), encoding="utf-8")
        together.start(name, _graddbg_run, script, dirs[name] / "out", pathlib.Path.cwd())
    yield lambda name: (together.result(name), dirs[name])
    together.close()


@pytest.mark.parametrize("name", CLI_CASES)
def test_graddbg_run_names_it_on_the_console(name, console_runs):
    case = CASES[name]()
    res, tmp_path = console_runs(name)  # (tmp_path / f"{name}.py": case.standalone(), run with --out tmp_path / "out")
    out = tmp_path / "out"
    plain = [f"loss {i} {v:.8e}" for i, v in enumerate(case.train())]
    assert [line for line in res.stdout.splitlines() if line.startswith("loss ")] == plain
    run = graddbg.load(out / "stats.parquet")
    if case.kind is None:
        assert run.anomalies == [], _describe(run.anomalies)
        assert res.returncode == 0, res.stderr[-2000:]
    else:
        assert [a.kind for a in run.anomalies] == [case.kind], _describe(run.anomalies)
        assert case.kind in res.stdout  # the console summary shows the finding


# ----------------------------------------------------------------------------- the data itself

def _probe(case):
    """Without graddbg: per step, the gradients the optimizer saw and the parameters before
    and after its step, by name."""
    model, opt = case.build(case.seed)
    names = {id(p): n for n, p in model.named_parameters()}
    seen = []

    def pre(o, args, kwargs):
        seen.append({"grad": {names[id(p)]: None if p.grad is None else p.grad.detach().clone()
                              for p in model.parameters()},
                     "before": {names[id(p)]: p.detach().clone() for p in model.parameters()}})

    def post(o, args, kwargs):
        seen[-1]["after"] = {names[id(p)]: p.detach().clone() for p in model.parameters()}

    h1, h2 = opt.register_step_pre_hook(pre), opt.register_step_post_hook(post)
    try:
        case.loop(model, opt, case.steps, case.seed)
    finally:
        h1.remove()
        h2.remove()
    held = {names.get(id(p)) for g in opt.param_groups for p in g["params"]}
    return seen, held


def test_stale_grad_applies_the_sum_of_the_gradients():
    bug, _ = _probe(CASES["stale_grad"]())
    twin, _ = _probe(CASES["stale_grad_twin"]())
    for n in silent_bugs.MLP_PARAMS:
        assert torch.equal(bug[0]["grad"][n], twin[0]["grad"][n])
        assert torch.allclose(bug[1]["grad"][n], twin[0]["grad"][n] + twin[1]["grad"][n], atol=1e-6)


def test_accumulation_twin_has_no_gradient_across_steps():
    seen, _ = _probe(CASES["stale_grad_twin_accumulation"]())
    assert len(seen) == 5  # 5 steps of 4 micro-batches: one step each


@pytest.mark.parametrize("name", ["empty_step_zero_grad_between", "empty_step_before_backward"])
def test_empty_step_has_no_gradient(name):
    seen, _ = _probe(CASES[name]())
    assert all(g is None for g in seen[0]["grad"].values())


@pytest.mark.parametrize("name", ["orphan_param_replaced_head", "orphan_param_bn_left_out"])
def test_orphans_get_gradients_but_no_group(name):
    case = CASES[name]()
    seen, held = _probe(case)
    for p in case.params:
        assert p not in held
        assert all(s["grad"][p] is not None and s["grad"][p].abs().sum() > 0 for s in seen)
        assert all(torch.equal(s["before"][p], s["after"][p]) for s in seen)


@pytest.mark.parametrize("name", ["no_update_lr_zero", "no_update_skipped_group"])
def test_no_update_leaves_parameters_with_gradients_unchanged(name):
    case = CASES[name]()
    seen, held = _probe(case)
    for s in seen:
        for n, g in s["grad"].items():
            assert g is not None and g.abs().sum() > 0
            assert torch.equal(s["before"][n], s["after"][n]) == (n in case.params), n
    assert set(case.params) <= held


def test_dead_grad_is_exactly_zero_after_being_non_zero():
    case = CASES["dead_grad"]()
    seen, _ = _probe(case)
    for p in case.params:
        assert all(s["grad"][p].abs().sum() > 0 for s in seen[:silent_bugs.DEATH_STEP])
        assert all(torch.count_nonzero(s["grad"][p]) == 0 for s in seen[silent_bugs.DEATH_STEP:])
    assert all(torch.count_nonzero(s["grad"]["head.weight"]) > 0 for s in seen)  # the head still learns


def test_dead_grad_twin_keeps_every_gradient_non_zero():
    seen, _ = _probe(CASES["dead_grad_twin"]())
    assert all(torch.count_nonzero(g) > 0 for s in seen for g in s["grad"].values())


def test_unused_param_never_gets_a_gradient():
    case = CASES["unused_param"]()
    seen, held = _probe(case)
    assert all(s["grad"][p] is None for s in seen for p in case.params)
    assert set(case.params) <= held


@pytest.mark.parametrize("name", TWINS)
def test_twins_change_every_parameter_with_a_gradient(name):
    seen, _ = _probe(CASES[name]())
    skip_first = name == "no_update_twin_warmup"  # lr 0 on step 0, on purpose
    for s in seen[1 if skip_first else 0:]:
        for n, g in s["grad"].items():
            if g is not None and g.norm() > 1e-6:  # (a bias before BatchNorm: ~1e-9, see below)
                assert not torch.equal(s["before"][n], s["after"][n]), n


def test_bias_before_batchnorm_has_a_rounding_gradient_and_stays_unchanged():
    seen, _ = _probe(CASES["no_update_twin_bias_before_bn"]())
    for s in seen:
        g = s["grad"]["body.bias"]
        assert 0 < g.norm() < 1e-6  # not exactly zero: rounding of a mathematically zero gradient
        assert torch.equal(s["before"]["body.bias"], s["after"]["body.bias"])


@pytest.mark.parametrize("name", list(CASES))
def test_cases_are_deterministic(name):
    assert CASES[name]().train() == CASES[name]().train()
