"""Anomalies under watch(): planted bugs, the producer blamed, policies, AMP overflow."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn
import torch.nn.functional as F

import graddbg
from graddbg.anomaly import Anomaly, AnomalyWarning, anomalies_frame

THIS_FILE = __file__


class PairwiseDistance(nn.Module):
    """Distances between all points of the batch, each to itself included: sqrt(0)."""

    def forward(self, x):
        d2 = (x[:, None, :] - x[None, :, :]).pow(2).sum(-1)
        return d2.sqrt()  # finite forward, NaN backward at the diagonal


class PreCulpritPost(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.culprit = PairwiseDistance()
        self.post = nn.Linear(8, 1)

    def forward(self, x):
        return self.post(self.culprit(self.pre(x)))


def _line_of(text: str) -> int:
    import inspect

    src, start = inspect.getsourcelines(PairwiseDistance.forward)
    for i, line in enumerate(src):
        if text in line:
            return start + i
    raise AssertionError(text)


def test_sqrt_at_zero_blames_culprit_module_and_sqrt_op():
    torch.manual_seed(0)
    model = PreCulpritPost()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(graddbg.NonFiniteError) as info:
        with graddbg.watch(model, opt) as w:
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
    a = info.value.anomaly
    assert a.kind == "nonfinite" and a.step == 0
    assert a.module == "culprit"  # not 'pre', whose gradients are NaN too
    assert "Sqrt" in a.op
    assert a.source == f"{THIS_FILE}:{_line_of('d2.sqrt()')}"
    assert set(a.params) == {"pre.weight", "pre.bias"} and a.name == "pre.weight"
    # the error is raised before the optimizer moves: weights unchanged, and nothing lost
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert w.anomalies == [a]
    assert w.stats.loc[w.stats.name == "pre.weight", "nonfinite"].item() == 16
    assert w.stats.loc[w.stats.name == "post.weight", "nonfinite"].item() == 0


def test_backward_producer_from_activation_gradients_without_replay():
    torch.manual_seed(0)
    model = PreCulpritPost()
    with pytest.raises(graddbg.NonFiniteError) as info:
        with graddbg.watch(model, activations=True, localize=False) as w:
            model(torch.randn(8, 4)).sum().backward()
    a = info.value.anomaly
    assert a.module == "culprit" and a.op is None
    assert "gradients at module outputs" in a.message
    act = w.activations.set_index("module")["grad_norm"]
    assert np.isnan(act["pre"]) and np.isfinite(act["culprit"]) and np.isfinite(act["post"])


def test_error_message_text_for_a_real_case():
    torch.manual_seed(0)
    model = PreCulpritPost()
    with pytest.raises(graddbg.NonFiniteError) as info:
        with graddbg.watch(model):
            model(torch.randn(8, 4)).sum().backward()
    msg = str(info.value)
    assert msg.startswith("graddbg: non-finite gradient at step 0: 20 NaN/Inf entries in 2 parameter(s): "
                          "pre.weight (4, 4), pre.bias (4,). It started in module 'culprit', op SqrtBackward0, "
                          f"created at {THIS_FILE}:")
    assert "graddbg.find_nonfinite(model)" in msg
    assert isinstance(info.value, graddbg.GradientAnomalyError) and isinstance(info.value, RuntimeError)


def test_error_survives_warning_filters():
    torch.manual_seed(0)
    model = PreCulpritPost()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(graddbg.NonFiniteError, match="culprit"):
            with graddbg.watch(model):
                model(torch.randn(8, 4)).sum().backward()


class ZeroNorm(nn.Module):
    """Normalises each row by its norm: an all-zero row gives 0/0 in the forward pass."""

    def forward(self, x):
        return x / x.norm(dim=1, keepdim=True)


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.relu = nn.ReLU()
        self.normalise = ZeroNorm()
        self.post = nn.Linear(4, 2)

    def forward(self, x):
        return self.post(self.normalise(self.relu(self.pre(x))))


def test_zero_over_zero_forward_nan_blames_module_with_activations():
    model = NormNet()
    with torch.no_grad():
        model.pre.weight.zero_()
        model.pre.bias.fill_(-1.0)  # relu(pre(x)) is an all-zero row
    with pytest.raises(graddbg.NonFiniteError) as info:
        with graddbg.watch(model, activations=True, localize=False) as w:
            model(torch.randn(3, 4)).sum().backward()
    a = info.value.anomaly
    assert a.module == "normalise"
    assert "forward activations" in a.message
    assert w.activations.set_index("module").loc["normalise", "out_nonfinite"] == 1
    assert w.activations.set_index("module").loc["relu", "out_nonfinite"] == 0


def test_zero_over_zero_replay_names_the_div_op():
    model = NormNet()
    with torch.no_grad():
        model.pre.weight.zero_()
        model.pre.bias.fill_(-1.0)
    with pytest.raises(graddbg.NonFiniteError) as info:
        with graddbg.watch(model):
            model(torch.randn(3, 4)).sum().backward()
    a = info.value.anomaly
    assert a.module == "normalise" and "div" in a.op.lower()


class Layer(nn.Module):
    def __init__(self, inject: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.inject = inject

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        if self.inject:
            h = h * torch.where(torch.arange(6) == 0, torch.tensor(float("nan")), torch.tensor(1.0))
        return h


class DictNet(nn.Module):
    def __init__(self, k: int, n: int = 5) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(i == k) for i in range(n)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return {"out": x.sum(1), "n": torch.tensor(len(self.layers))}


@pytest.mark.parametrize("k", [1, 3])
def test_nan_injected_in_layer_k_blames_only_k_with_dict_outputs(k):
    model = DictNet(k)
    with pytest.raises(graddbg.NonFiniteError) as info:
        with graddbg.watch(model, activations=True):
            model(torch.randn(4, 6))["out"].sum().backward()
    a = info.value.anomaly
    # every layer's gradients are NaN (before k through the backward pass, after k through
    # the forward); only layer k made the NaN
    assert a.module == f"layers.{k}"
    assert a.name == f"layers.{k}.fc.weight"
    assert len(a.params) == 10


def test_learning_rate_jump_is_an_explosion_at_that_step_before_any_nan():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 8)
    y = torch.randn(64, 1)
    seen = []
    with graddbg.watch(model, opt, explode=graddbg.Explode(factor=10, policy=seen.append)) as w:
        for step in range(30):
            if step == 20:
                with torch.no_grad():  # what a learning-rate jump does to the weights
                    for p in model.parameters():
                        p.mul_(1000.0)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert seen, "no explosion reported"
    first = seen[0]
    assert first.kind == "explode" and first.step == 20
    assert first.value > 10 * first.threshold / 10  # above the threshold it names
    assert first.value > first.threshold
    assert first.params, "the explosion names the parameters that jumped most"
    assert w.steps.loc[w.steps.step == 20, "nonfinite"].item() == 0  # before any NaN
    assert not [a for a in w.anomalies if a.kind == "nonfinite"]


def test_absolute_explosion_bound():
    model = nn.Linear(2, 1)
    with graddbg.watch(model, explode=graddbg.Explode(factor=None, absolute=1.0, policy="record")) as w:
        model(torch.full((1, 2), 100.0)).sum().backward()
    assert [a.kind for a in w.anomalies] == ["explode"]
    assert w.anomalies[0].threshold == 1.0


def test_two_hundred_healthy_adam_steps_report_no_explosion():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AnomalyWarning)
        with graddbg.watch(model, opt, explode="warn", vanish="warn") as w:
            for _ in range(200):
                x = torch.randn(32, 10, generator=gen)
                y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    assert w.anomalies == []
    assert len(w.steps) == 200


def test_thirty_layer_sigmoid_net_vanish_names_first_layers():
    torch.manual_seed(0)
    layers = []
    for _ in range(30):
        layers += [nn.Linear(16, 16), nn.Sigmoid()]
    model = nn.Sequential(*layers, nn.Linear(16, 1))
    with graddbg.watch(model, vanish=graddbg.Vanish(below=1e-6, patience=3, policy="record"),
                       explode=None) as w:
        for _ in range(4):
            model.zero_grad()
            model(torch.randn(8, 16)).pow(2).mean().backward()
    vanish = [a for a in w.anomalies if a.kind == "vanish"]
    assert len(vanish) == 1
    a = vanish[0]
    assert a.name == "0.weight" and a.module == "0"
    assert a.step == 2  # the third recorded step completes the patience
    assert "58.weight" not in a.params and "60.weight" not in a.params  # the last layers are fine
    norms = w.stats[w.stats.step == 3].set_index("name")["norm"]
    assert norms["0.weight"] < 1e-6 < norms["60.weight"]


def test_skip_policy_leaves_weights_finite():
    torch.manual_seed(0)
    model = PreCulpritPost()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with graddbg.watch(model, opt, nonfinite="skip") as w:
        for _ in range(3):
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert [a.step for a in w.anomalies] == [0, 1, 2]
    assert w.anomalies[0].module == "culprit"
    # post.* were finite and were updated; pre.* were skipped
    assert w.stats.loc[w.stats.name == "post.weight", "nonfinite"].eq(0).all()


def test_warn_and_callable_policies():
    torch.manual_seed(0)
    model = PreCulpritPost()
    with pytest.warns(AnomalyWarning, match="non-finite gradient at step 0"):
        with graddbg.watch(model, nonfinite="warn"):
            model(torch.randn(8, 4)).sum().backward()
    got = []
    with graddbg.watch(model, nonfinite=got.append) as w:
        model.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
    assert len(got) == 1 and isinstance(got[0], Anomaly) and got[0] is w.anomalies[0]


def test_nan_from_the_loss_is_blamed_on_the_loss():
    model = nn.Linear(3, 1)
    with pytest.raises(graddbg.NonFiniteError, match="'<loss>'"):
        with graddbg.watch(model):
            out = model(torch.ones(2, 3))
            (out * torch.tensor(float("nan"))).sum().backward()


def test_gradscaler_overflow_is_recorded_not_raised():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127)  # overflows at once
    x = torch.randn(8, 4) * 1e4
    with graddbg.watch(model, opt, scaler=scaler) as w:
        for _ in range(3):
            scaler.scale(model(x).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    steps = w.steps
    assert steps["overflow"].sum() >= 1
    assert not w.anomalies  # an overflow is information, not an error
    assert w.last_step_skipped in (True, False)
    assert steps.loc[steps.overflow, "scale"].iloc[0] == 2.0 ** 127


def test_amp_statistics_are_of_unscaled_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    import copy

    ref = copy.deepcopy(model)
    x = torch.randn(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with graddbg.watch(model, opt, scaler=scaler) as w:
        scaler.scale(model(x).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
    ref(x).pow(2).mean().backward()
    for name, p in ref.named_parameters():
        got = w.stats.loc[w.stats.name == name, "norm"].item()
        assert got == pytest.approx(p.grad.norm().item(), rel=1e-5)
    assert w.steps["scale"].iloc[0] == 1024.0 and not w.steps["overflow"].any()


def test_anomaly_json_round_trip_and_frame():
    a = Anomaly(step=1, kind="explode", name="w", module="", op=None, value=math.inf, threshold=2.0,
                source=None, message="m", params=("w", "b"))
    b = Anomaly.from_dict(a.to_dict())
    assert b == a
    import json

    json.dumps(a.to_dict())  # JSON has no inf: stored as text
    df = anomalies_frame([a, b])
    assert list(df.columns[:9]) == ["step", "kind", "name", "module", "op", "value", "threshold", "source", "message"]
    assert len(df) == 2


def _closure_run(plant):
    """SGD stepped through ``step(closure)`` (as Lightning steps): ``plant(step, model, out)``
    may make a NaN; the gradients are read after the update applied them."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with graddbg.watch(m, opt, nonfinite="record") as w:
        for step in range(3):
            def closure():
                opt.zero_grad()
                out = plant(step, m, m(torch.randn(2, 4)))
                loss = out.pow(2).mean()
                loss.backward()
                return loss
            opt.step(closure)
    return w.anomalies


def test_a_nan_made_in_backward_under_step_closure_is_not_blamed_on_the_weights_it_reached():
    """The update had put the NaN gradient into every weight by the time graddbg read it:
    those weights are victims. The ledger says nothing else wrote them since the last step."""
    got = _closure_run(lambda step, m, out: out + torch.sqrt(out * 0.0) if step == 1 else out)
    first = got[0]
    assert (first.step, first.kind) == (1, "nonfinite")
    assert "non-finite gradient at step 1" in first.message and "It started in module '2'" in first.message
    assert "read after step(closure) had applied them" in first.message and "entered from outside" not in first.message


def test_a_nan_weight_written_between_steps_under_step_closure_is_still_its_own_producer():
    def run():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with graddbg.watch(m, opt, nonfinite="record") as w:
            for step in range(3):
                if step == 1:
                    with torch.no_grad():
                        m[0].weight[1, 1] = float("nan")  # (a bad checkpoint, say)

                def closure():
                    opt.zero_grad()
                    loss = m(torch.randn(2, 4)).pow(2).mean()
                    loss.backward()
                    return loss
                opt.step(closure)
        return w.anomalies

    first = run()[0]
    assert first.step == 1 and "non-finite parameter 0.weight" in first.message
    assert "entered from outside the autograd graph" in first.message


# --------------------------------------------------------------------------- bounded under frequent anomalies
def _nan_every_other_step(w, model, opt, steps, times=None):
    """SGD on nn.Linear(4, 1) over 4 batches in turn (the gradient never settles to exactly
    zero); a NaN planted into the weight's gradient on every odd step."""
    import time

    gen = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(4, 8, 4, generator=gen), torch.randn(4, 8, 1, generator=gen)
    for i in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        (model(xs[i % 4]) - ys[i % 4]).pow(2).mean().backward()
        if i % 2:
            model.weight.grad[0, 0] = float("nan")
        opt.step()
        if times is not None:
            times[i] = time.perf_counter() - t0


def test_findings_past_the_limit_are_counted_by_kind_and_parameter_not_kept(monkeypatch, tmp_path):
    import graddbg.anomaly

    monkeypatch.setattr(graddbg.anomaly, "MAX_KEPT_PER_KIND", 20)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with graddbg.watch(model, opt, nonfinite="skip", explode=None, history=50) as w:
        _nan_every_other_step(w, model, opt, 200)
    assert [a.step for a in w.anomalies] == list(range(1, 40, 2))  # the first 20 kept
    assert w.anomalies.not_kept == {("nonfinite", "weight"): 80}  # the other 80 counted
    assert torch.isfinite(model.weight).all()  # "skip" still skipped the steps not kept
    assert "80 more counted, not kept" in repr(w)
    # the first kept anomalies' steps stay in the thinned history, with its first and last steps
    steps = set(w.steps["step"])
    assert {0, 199, 1, 3, 5, 7, 9} <= steps and len(steps) <= 50
    run = graddbg.load(w.save(tmp_path / "run.parquet"))
    assert len(run.anomalies) == 20
    assert run.meta["anomalies_not_kept"] == [{"kind": "nonfinite", "name": "weight", "count": 80}]
    html = w.report(tmp_path / "report.html").read_text()
    assert "80 more nonfinite findings on weight not kept" in html
    assert graddbg.anomaly.not_kept_text(run.meta["anomalies_not_kept"]) == \
        ["80 more nonfinite findings on weight not kept"]


def test_warn_policy_past_the_limit_warns_once_more_then_counts(monkeypatch):
    import graddbg.anomaly

    monkeypatch.setattr(graddbg.anomaly, "MAX_KEPT_PER_KIND", 3)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with graddbg.watch(model, opt, nonfinite="warn", explode=None) as w:
            _nan_every_other_step(w, model, opt, 20)
    texts = [str(g.message) for g in got if issubclass(g.category, AnomalyWarning)]
    assert len(texts) == 4 and "keeps the first 3 nonfinite findings" in texts[-1]
    # (not skipped, the NaN reaches the weight: every step from step 1 on is non-finite)
    assert [a.step for a in w.anomalies] == [1, 2, 3] and w.anomalies.not_kept == {("nonfinite", "weight"): 16}


@pytest.mark.slow
def test_step_time_and_memory_stay_flat_under_a_nan_every_other_step(monkeypatch):
    """A NaN gradient every other step with nonfinite="skip" and a small history: once the
    history and w.anomalies are full, a step costs what it cost at the start and nothing
    grows (bench/anomaly_heavy.py measures 50,000 steps)."""
    import gc

    import graddbg.anomaly

    monkeypatch.setattr(graddbg.anomaly, "MAX_KEPT_PER_KIND", 100)
    steps = 8_000
    times = np.zeros(steps)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sizes = []

    def size(w):
        h = w._ctx.history
        gc.collect()
        return (len(w.anomalies), len(w.anomalies.not_kept), h.sizes(), len(gc.get_objects()))

    with graddbg.watch(model, opt, nonfinite="skip", explode=None, history=200, localise=False) as w:
        _nan_every_other_step(w, model, opt, steps // 2, times[: steps // 2])
        sizes.append(size(w))
        _nan_every_other_step(w, model, opt, steps // 2, times[steps // 2:])
        sizes.append(size(w))
    # each block's time: the least of the medians of its quarters (a quarter slowed by the
    # other processes of a shared machine does not count; a cost that grew slows them all)
    early = min(np.median(q) for q in np.split(times[1000:2000], 4))
    late = min(np.median(q) for q in np.split(times[-2000:], 4))
    assert late / early < 1.5, (early, late)
    (kept0, keys0, hist0, objects0), (kept1, keys1, hist1, objects1) = sizes
    assert kept0 == kept1 == 100 and keys0 == keys1 == 1
    assert hist1["rows"] <= 200 and hist1["marked"] <= hist0["marked"] and hist1["pending"] == 0
    assert objects1 - objects0 < 200, (objects0, objects1)
    assert sum(w.anomalies.not_kept.values()) == steps // 2 - 100
