"""A NaN or Inf made in the loss code, between the model's output and backward(), is named
by watch() itself with its op and its line (issue "Where users already look", point 3), as
graddbg.find_nonfinite names it, and the recording of that code leaves nothing behind."""
from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch import nn

import graddbg

THIS_FILE = __file__


def _line(fn, text: str) -> str:
    src, start = inspect.getsourcelines(fn)
    return f"{THIS_FILE}:{start + next(i for i, line in enumerate(src) if text in line)}"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1), nn.Sigmoid())


def _log_loss(model, x, healthy):
    p = model(x).squeeze(1) * (x[:, 0] > 0)  # p = 0 on about half the batch
    if healthy:
        p = p.clamp_min(1e-6)
    return -torch.log(p).mean()


def _inverse_loss(model, x, healthy):
    d = model(x).squeeze(1) * (x[:, 1] > 0)
    return (1 / (d + 1e-3 if healthy else d)).mean()


def _sqrt_loss(model, x, healthy):
    r = model(x).squeeze(1) * (x[:, 2] > 0)  # sqrt(0) is finite, its derivative is not
    return torch.sqrt(r + 1e-6 if healthy else r).mean()


def _train(loss_fn, healthy, steps=3, bad_step=2):
    """A loop whose loss code makes a NaN/Inf at ``bad_step`` (never when ``healthy``)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    with graddbg.watch(model, opt, nonfinite="record") as w:
        for step in range(steps):
            x = torch.randn(16, 4, generator=gen).abs()
            if step == bad_step:
                x[:, :3] *= torch.where(torch.arange(16) % 2 == 0, -1.0, 1.0)[:, None]
            loss = loss_fn(model, x, healthy)
            loss.backward()
            opt.step()
            opt.zero_grad()
            assert torch._C._len_torch_function_stack() == 0  # the recording ended with the step
    return w


@pytest.mark.parametrize("loss_fn, op, text", [
    (_log_loss, "aten.log", "-torch.log(p)"),          # -log(0) = inf, in the forward pass
    (_inverse_loss, "aten.reciprocal", "(1 / (d"),      # 1/0 = inf, in the forward pass
    (_sqrt_loss, "SqrtBackward0", "torch.sqrt(r"),      # d sqrt(r)/dr at 0 = inf, in the backward pass
])
def test_nonfinite_made_in_loss_code_is_named_with_op_and_line(loss_fn, op, text):
    w = _train(loss_fn, healthy=False)
    assert [a.kind for a in w.anomalies] == ["nonfinite"]
    a = w.anomalies[0]
    assert a.step == 2 and a.module == "<loss>"
    assert (a.op, a.source) == (op, _line(loss_fn, text))
    assert f"op {op}, created at {a.source}" in a.message and "loss code" in a.message
    assert a.name == "2.weight" and "2.weight is the one nearest it" in a.message  # nearest the loss
    assert a.reproduced is True

    # find_nonfinite names the same op and line on the same step
    model = _model()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 4, generator=gen).abs()
    x[:, :3] *= torch.where(torch.arange(16) % 2 == 0, -1.0, 1.0)[:, None]
    with pytest.raises(graddbg.NonFiniteError) as info:
        with graddbg.find_nonfinite(model):
            loss_fn(model, x, False).backward()
    assert (info.value.anomaly.op, info.value.anomaly.source) == (op, a.source)

    # the healthy twin: no finding
    assert _train(loss_fn, healthy=True).anomalies == []


def test_loss_code_nan_raises_with_op_and_line_by_default():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(graddbg.NonFiniteError) as info:
        with graddbg.watch(model, opt):
            out = model(torch.randn(8, 4))
            p = out * 0.0
            loss = -torch.log(p).mean()  # log(0)
            loss.backward()
            opt.step()
    a = info.value.anomaly
    assert (a.module, a.op) == ("<loss>", "aten.log")
    assert a.source == _line(test_loss_code_nan_raises_with_op_and_line_by_default, "# log(0)")
    assert torch._C._len_torch_function_stack() == 0


def test_loss_code_recording_without_optimizer_and_with_accumulation_leaves_no_mode():
    # no optimizer: each backward pass is a step (ended inside the backward pass); the
    # recording leaves the mode stack at the next forward pass, and at close
    model = _model()
    with graddbg.watch(model, nonfinite="record") as w:
        for step in range(3):
            out = model(torch.randn(8, 4))
            p = out if step != 1 else out * 0.0
            (-torch.log(p)).mean().backward()
            model.zero_grad()
    assert torch._C._len_torch_function_stack() == 0
    assert [(a.step, a.module, a.op) for a in w.anomalies] == [(1, "<loss>", "aten.log")]

    # two micro-batches per step: the NaN of the second is named
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with graddbg.watch(model, opt, nonfinite="record") as w:
        for step in range(2):
            for micro in range(2):
                out = model(torch.randn(8, 4))
                bad = step == 1 and micro == 1
                (1 / (out * 0.0 if bad else out)).mean().backward()
            opt.step()
            opt.zero_grad()
    assert torch._C._len_torch_function_stack() == 0
    assert [(a.step, a.module, a.op) for a in w.anomalies] == [(1, "<loss>", "aten.reciprocal")]


def test_nan_in_forward_is_still_named_in_its_module():
    class Norm(nn.Module):
        def forward(self, x):
            return x / x.norm(dim=1, keepdim=True)  # 0/0 on an all-zero row

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8, bias=False), Norm(), nn.Linear(8, 1))
    x = torch.randn(8, 4)
    x[2] = 0.0
    with pytest.raises(graddbg.NonFiniteError) as info:
        with graddbg.watch(model):
            model(x).pow(2).mean().backward()
    a = info.value.anomaly
    assert (a.module, a.op) == ("1", "aten.div")
    assert a.source == _line(Norm.forward, "x / x.norm")
    assert a.name == "2.weight" and "2.weight is the one nearest it" in a.message  # the module holds none


def test_only_the_loss_code_is_recorded_not_the_backward_pass_nor_the_step(monkeypatch):
    """The tape records the calls between the model's output and backward(): not what runs
    inside the backward pass (a user's gradient hook, graddbg's own end of backward), nor
    the host reads graddbg makes when the optimizer's step begins (each would pay the mode's
    dispatch, once per parameter)."""
    from graddbg import blame

    seen = []
    record = blame.LossTape._record
    monkeypatch.setattr(blame.LossTape, "_record", lambda self, func, *a: (seen.append(func), record(self, func, *a)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(12)])
    model[0].weight.register_hook(lambda g: g * torch.ones_like(g))  # (torch calls inside backward)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    with graddbg.watch(model, opt):
        for _ in range(3):
            out = model(x)
            seen.clear()
            loss = (out ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            names = [getattr(f, "__name__", str(f)) for f in seen]
            # (and at most the optimizer's own record_function, entered before its pre-hooks)
            assert names[:2] == ["pow", "mean"] and names[2:] in ([], ["_record_function_enter_new"]), names


# --------------------------------------------------------------------------- a loss term with no gradient
def _penalised(penalty, steps=4, **kw):
    """A regression with a gradient penalty on the inputs, ``penalty(out, x, fit)`` giving the loss."""
    import warnings
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(1)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model, opt, **kw) as w:
            for _ in range(steps):
                xs = x.clone().requires_grad_(True)
                opt.zero_grad()
                out = model(xs)
                fit = ((out - y) ** 2).mean()
                penalty(out, xs, fit).backward()
                opt.step()
    return [a for a in w.anomalies if a.kind == "loss_pattern"], w


def _gp(out, xs, create_graph):
    g, = torch.autograd.grad(out.sum(), xs, retain_graph=True, create_graph=create_graph)
    return g


def test_a_gradient_penalty_computed_without_create_graph_is_named_with_its_lines():
    found, _ = _penalised(lambda out, xs, fit: fit + 10.0 * _gp(out, xs, False).pow(2).sum(1).mean())
    assert len(found) == 1 and found[0].step == 0
    msg = found[0].message
    assert "carries no gradient" in msg and "without create_graph=True" in msg and "test_loss_code.py:" in msg, msg
    assert "create_graph=True) for a term meant to train" in msg


def test_a_wgan_style_penalty_subtracted_and_scaled_is_named():
    def wgan(out, xs, fit):
        gp = ((_gp(out, xs, False).norm(2, dim=1) - 1) ** 2).mean()
        return (out.mean() - fit + gp) / 2.0  # (the penalty inside a sum, halved)
    found, _ = _penalised(wgan)
    assert len(found) == 1


@pytest.mark.parametrize("penalty", [
    lambda out, xs, fit: fit + 10.0 * _gp(out, xs, True).pow(2).sum(1).mean(),          # the fix
    lambda out, xs, fit: fit + ((_gp(out, xs, True) - _gp(out, xs, False)) ** 2).mean(),  # gradient matching
    lambda out, xs, fit: fit * (1 + _gp(out, xs, False).abs().mean()),                   # a constant weight
    lambda out, xs, fit: (_gp(out, xs, False).norm(), fit)[1],                          # logged, not in the loss
    lambda out, xs, fit: torch.zeros(()) + fit,                                          # an accumulator of 0
], ids=["create_graph", "gradient matching", "a constant weight", "logged only", "zero accumulator"])
def test_constants_that_are_not_a_term_adding_nothing_are_silent(penalty):
    found, w = _penalised(penalty)
    assert found == [] and not w.anomalies, [a.message for a in w.anomalies]


def test_without_the_loss_tape_a_constant_term_is_not_looked_at():
    found, _ = _penalised(lambda out, xs, fit: fit + _gp(out, xs, False).pow(2).mean(), localise=False)
    assert found == []


# --------------------------------------------------------------------------- kl_div given probabilities
def _distil(student, steps=4):
    """Distillation of a fixed soft teacher: ``student(logits, teacher)`` gives the loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    x, teacher = torch.randn(32, 6), torch.softmax(torch.randn(32, 5), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model, opt) as w:
            for _ in range(steps):
                opt.zero_grad()
                student(model(x), teacher).backward()
                opt.step()
    return [a for a in w.anomalies if a.kind == "loss_pattern"], w


def test_kl_div_given_probabilities_is_named_at_its_line():
    # (torch records no KlDivBackward node: kl_div's graph is the ops it is made of, so the call is judged)
    def student(z, t):
        return nn.functional.kl_div(torch.softmax(z, 1), t, reduction="batchmean")  # the bug
    found, _ = _distil(student)
    assert len(found) == 1 and found[0].step == 0, [a.message for a in found]
    msg = found[0].message
    assert "kl_div on probabilities" in msg and _line(student, "# the bug") in msg, msg
    assert "F.log_softmax(x, dim)" in msg


def test_kl_div_loss_module_given_probabilities_is_named():
    crit = nn.KLDivLoss(reduction="batchmean")
    found, _ = _distil(lambda z, t: crit(torch.softmax(z, 1), t))
    assert len(found) == 1 and "kl_div on probabilities" in found[0].message


@pytest.mark.parametrize("student", [
    lambda z, t: nn.functional.kl_div(torch.log_softmax(z, 1), t, reduction="batchmean"),       # the fix
    lambda z, t: nn.functional.kl_div(torch.log_softmax(z, 1), t.log(), reduction="batchmean",
                                      log_target=True),                                          # log targets
    lambda z, t: nn.functional.kl_div(t.log(), torch.softmax(z, 1), reduction="batchmean"),      # reverse KL's target
    lambda z, t: -(t * torch.log_softmax(z, 1)).sum(1).mean(),                                   # soft cross-entropy
], ids=["log_softmax", "log_target", "softmax as the target", "soft cross-entropy"])
def test_kl_div_given_log_probabilities_is_silent(student):
    found, w = _distil(student)
    assert found == [] and not w.anomalies, [a.message for a in w.anomalies]
