"""The step ledger (issue 31): what each step recorded, and the findings read from it as
broken invariants of a healthy step. Every finding has a buggy loop and a healthy twin."""
from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import graddbg


def _data(i, n=32, d=8):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(n, d, generator=g)
    return x, (x[:, 0] > 0).long()


def _mlp(dropout=0.0, out=2):
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.ReLU()] + ([nn.Dropout(dropout)] if dropout else []) + [nn.Linear(16, out)]
    return nn.Sequential(*layers)


def _run(model, opt, body, steps=8, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model, opt, **kw) as w:
            for i in range(steps):
                body(i)
    return w


def _kinds(w):
    return [a.kind for a in w.anomalies]


def _standard(model, opt, loss_fn=None):
    loss_fn = loss_fn or (lambda out, y: F.cross_entropy(out, y))

    def body(i):
        x, y = _data(i)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return body


# --------------------------------------------------------------------------- the ledger itself
def test_ledger_records_accumulation_clip_lr_and_moved_parameters():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body(i):
        for k in range(2):  # two micro-batches, one step
            x, y = _data(2 * i + k)
            F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        opt.step()
        opt.zero_grad()

    w = _run(model, opt, body, steps=3)
    led = w.ledger
    assert list(led["step"]) == [0, 1, 2]
    assert list(led["backwards"]) == [2, 2, 2] and list(led["forwards"]) == [2, 2, 2]
    assert list(led["held_before"])[1:] == ["none,kept", "none,kept"]  # (zero_grad(set_to_none) after the step)
    assert set(led["between"]) == {"clipped"}  # the clip: version counters moved, the norm went down
    assert list(led["lr"]) == ["0.1"] * 3 and list(led["moved"]) == [4, 4, 4]
    assert (led["clipped_norm"] < led["global_norm"]).all()
    assert set(led["mode"]) == {"train"} and set(led["grad_mode"]) == {"on"}
    text = w.what_happened(1)
    assert "backward 1: the gradient held before it kept" in text and "learning rates: group 0: 0.1" in text
    for bad in ("1", 1.0, True):  # (a str was looked up and "not in the ledger")
        with pytest.raises(TypeError, match=rf"^what_happened\(step=...\): got {re.escape(repr(bad))} "
                                            rf"\({type(bad).__name__}\); accepted: an int$"):
            w.what_happened(bad)


def test_ledger_sees_autocast_and_eval_mode():
    model = _mlp(dropout=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body(i):
        x, y = _data(i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()

    w = _run(model, opt, body, steps=2)
    assert set(w.ledger["autocast"]) == {"bfloat16"}


# --------------------------------------------------------------------------- empty_step: precision
def test_one_skipped_batch_is_not_a_finding():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body(i):
        opt.zero_grad()
        if i == 3:  # a skipped batch: step() without backward, once
            opt.step()
            return
        x, y = _data(i)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    w = _run(model, opt, body)
    assert _kinds(w) == []
    assert w.ledger.loc[3, "grads"] == 0 and w.ledger.loc[3, "backwards"] == 0


# --------------------------------------------------------------------------- no_update: no sampling
@pytest.mark.parametrize("start", [0, 12])
def test_lr_set_to_zero_later_is_found_within_a_few_steps(start):
    model = _mlp()
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=0.1)
    body = _standard(model, opt)

    def buggy(i):
        if i == start:
            opt.param_groups[0]["lr"] = 0.0
        body(i)

    w = _run(model, opt, buggy, steps=start + 6)
    found = [a for a in w.anomalies if a.kind == "no_update"]
    assert len(found) == 1 and set(found[0].params) == {"0.weight", "0.bias"}
    assert start <= found[0].step <= start + 3, found[0].message
    assert "learning rate is 0" in found[0].message


def test_a_schedule_that_ends_at_zero_is_not_a_finding():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.0, total_iters=9)  # lr 0 at the last step only
    body = _standard(model, opt)

    def healthy(i):
        body(i)
        sched.step()

    assert _kinds(_run(model, opt, healthy, steps=10)) == []


def test_a_parameter_another_optimizer_updates_is_not_an_orphan():
    model = _mlp()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    other = torch.optim.SGD(model[2].parameters(), lr=0.1)  # (two optimizers, one watched)

    def body(i):
        x, y = _data(i)
        opt.zero_grad()
        other.zero_grad()
        F.cross_entropy(model(x), y).backward()
        other.step()
        opt.step()

    assert _kinds(_run(model, opt, body)) == []


# --------------------------------------------------------------------------- double_step
def test_step_called_twice_is_found_and_its_twin_is_silent():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    body = _standard(model, opt)

    def buggy(i):
        body(i)
        opt.step()  # bug: the same gradients applied again

    w = _run(model, opt, buggy, steps=4)
    assert _kinds(w) == ["double_step"]
    assert "applied twice" in w.anomalies[0].message and w.anomalies[0].step == 3
    model, opt = _mlp(), None
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    assert _kinds(_run(model, opt, _standard(model, opt), steps=4)) == []


# --------------------------------------------------------------------------- eval_mode
def _eval_loop(model, opt, undo):
    body = _standard(model, opt)

    def loop(i):
        if i == 3:  # a validation pass
            model.eval()
            with torch.no_grad():
                model(_data(99)[0])
            if undo:
                model.train()
        body(i)
    return loop


def test_eval_mode_not_undone_is_found():
    model = _mlp(dropout=0.3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    w = _run(model, opt, _eval_loop(model, opt, undo=False))
    assert _kinds(w) == ["eval_mode"]
    assert w.anomalies[0].step == 4 and "model.train()" in w.anomalies[0].message


@pytest.mark.parametrize("dropout", [0.3, 0.0], ids=["undone", "no-mode-layers"])
def test_eval_mode_twins_are_silent(dropout):
    model = _mlp(dropout=dropout)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    w = _run(model, opt, _eval_loop(model, opt, undo=dropout > 0))
    assert _kinds(w) == []


# --------------------------------------------------------------------------- loss_pattern
PATTERNS = {
    "softmax before cross_entropy": (lambda out, y: F.cross_entropy(F.softmax(out, -1), y), 2),
    "nll_loss on probabilities": (lambda out, y: F.nll_loss(F.softmax(out, -1), y), 2),
    "nll_loss on raw scores": (lambda out, y: F.nll_loss(out, y), 2),
    "log(softmax(x))": (lambda out, y: F.nll_loss(torch.log(F.softmax(out, -1)), y), 2),
    "log_softmax over the wrong dim": (lambda out, y: F.nll_loss(F.log_softmax(out, 0), y), 2),
    "sigmoid before BCEWithLogitsLoss": (lambda out, y: F.binary_cross_entropy_with_logits(
        torch.sigmoid(out), y.float()[:, None]), 1),
    "a target that broadcasts": (lambda out, y: F.mse_loss(out, y.float()), 1),
}
HEALTHY_LOSSES = {
    "cross_entropy": (lambda out, y: F.cross_entropy(out, y), 2),
    "log_softmax + nll_loss": (lambda out, y: F.nll_loss(F.log_softmax(out, -1), y), 2),
    "bce_with_logits": (lambda out, y: F.binary_cross_entropy_with_logits(out, y.float()[:, None]), 1),
    "sigmoid + bce": (lambda out, y: F.binary_cross_entropy(torch.sigmoid(out), y.float()[:, None]), 1),
    "mse same shape": (lambda out, y: F.mse_loss(out.squeeze(-1), y.float()), 1),
}


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_loss_patterns_are_named(pattern):
    loss_fn, out = PATTERNS[pattern]
    model = _mlp(out=out)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's own broadcasting warning)
        w = _run(model, opt, _standard(model, opt, loss_fn), steps=3)
    assert _kinds(w) == ["loss_pattern"]
    assert pattern in w.anomalies[0].message and w.anomalies[0].step == 0


@pytest.mark.parametrize("loss", list(HEALTHY_LOSSES))
def test_healthy_losses_are_silent(loss):
    loss_fn, out = HEALTHY_LOSSES[loss]
    model = _mlp(out=out)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    assert _kinds(_run(model, opt, _standard(model, opt, loss_fn), steps=3)) == []


# --------------------------------------------------------------------------- hidden_param
class _Scaled(nn.Module):
    def __init__(self, registered: bool):
        super().__init__()
        self.body = nn.Linear(8, 2)
        t = torch.ones(1)
        self.temperature = nn.Parameter(t) if registered else t.requires_grad_()

    def forward(self, x):
        return self.body(x) * self.temperature


class _Stack(nn.Module):
    def __init__(self, registered: bool):
        super().__init__()
        layers = [nn.Linear(8, 8), nn.Linear(8, 2)]
        self.layers = nn.ModuleList(layers) if registered else layers

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("cls,where", [(_Scaled, "temperature"), (_Stack, "layers[0].weight")])
def test_hidden_parameters_are_found_and_twins_silent(cls, where):
    torch.manual_seed(0)
    buggy = cls(registered=False)
    params = list(buggy.parameters())
    extra = nn.Linear(1, 1) if not params else None  # (an optimizer needs a parameter)
    opt = torch.optim.SGD(params or list(extra.parameters()), lr=0.05)
    if extra is not None:
        buggy.extra = extra
    w = _run(buggy, opt, _standard(buggy, opt), steps=3)
    hidden = [a for a in w.anomalies if a.kind == "hidden_param"]
    assert len(hidden) == 1 and where in hidden[0].params, [a.message for a in w.anomalies]
    assert "nn.Parameter" in hidden[0].message
    torch.manual_seed(0)
    twin = cls(registered=True)
    opt = torch.optim.SGD(twin.parameters(), lr=0.05)
    assert _kinds(_run(twin, opt, _standard(twin, opt), steps=3)) == []


class _Cast(nn.Module):
    """An output scale and shift from float64 arrays, wrapped then cast (the bug) or cast then
    wrapped (the twin)."""

    def __init__(self, registered: bool, cast=lambda t: t.float()):
        super().__init__()
        self.body = nn.Linear(8, 2)
        scale, shift = torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
        if registered:
            self.scale, self.shift = nn.Parameter(cast(scale)), nn.Parameter(cast(shift))
        else:
            self.scale, self.shift = cast(nn.Parameter(scale)), cast(nn.Parameter(shift))

    def forward(self, x):
        return torch.tanh(self.body(x)) * self.scale + self.shift


@pytest.mark.parametrize("cast", [lambda t: t.float(), lambda t: t.to(torch.float32)], ids=["float", "to"])
def test_a_parameter_cast_after_wrapping_is_named_and_its_twin_silent(cast):
    torch.manual_seed(0)
    buggy = _Cast(False, cast)
    opt = torch.optim.SGD(buggy.parameters(), lr=0.05)
    w = _run(buggy, opt, _standard(buggy, opt), steps=3)
    hidden = [a for a in w.anomalies if a.kind == "hidden_param"]
    assert len(hidden) == 1 and set(hidden[0].params) == {"scale", "shift"}, [a.message for a in w.anomalies]
    assert "made by ToCopy" in hidden[0].message and "nn.Parameter(t.float())" in hidden[0].message
    torch.manual_seed(0)
    twin = _Cast(True, cast)
    opt = torch.optim.SGD(twin.parameters(), lr=0.05)
    assert _kinds(_run(twin, opt, _standard(twin, opt), steps=3)) == []


def test_a_weight_computed_in_forward_from_a_registered_parameter_is_not_a_lost_one():
    """A module attribute computed from a parameter that the model does register (a weight
    normalised in forward, kept for reuse) is not a cast of a lost one."""
    class _Normed(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(8, 2)

        def forward(self, x):
            self.w = self.body.weight / self.body.weight.norm()
            return x @ self.w.t() + self.body.bias

    torch.manual_seed(0)
    model = _Normed()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    assert _kinds(_run(model, opt, _standard(model, opt), steps=3)) == []


# --------------------------------------------------------------------------- dead_grad since the first step
def test_gradients_dead_from_initialisation_are_found():
    model = _mlp()
    nn.init.zeros_(model[0].weight)
    nn.init.constant_(model[0].bias, -1.0)  # every ReLU dead from the start
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    w = _run(model, opt, _standard(model, opt), steps=8)
    dead = [a for a in w.anomalies if a.kind == "dead_grad"]
    assert len(dead) == 1 and {"0.weight", "0.bias"} <= set(dead[0].params)
    assert "since the first step" in dead[0].message


def test_a_zero_initialised_lora_branch_is_not_dead():
    class _WithLora(nn.Module):
        def __init__(self):
            super().__init__()
            self.base = _mlp()
            self.lora_a = nn.Linear(8, 4, bias=False)
            self.lora_b = nn.Linear(4, 2, bias=False)
            nn.init.zeros_(self.lora_b.weight)  # LoRA: B = 0, so A's gradient is 0 at the first step only

        def forward(self, x):
            return self.base(x) + self.lora_b(self.lora_a(x))

    net = _WithLora()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    w = _run(net, opt, _standard(net, opt), steps=8)
    assert _kinds(w) == []
    assert w.ledger.loc[0, "grads"] == 6


# --------------------------------------------------------------------------- cost: host reads
def test_gradscaler_scale_is_never_read_on_the_host_between_recorded_steps():
    """Issue 33 point 5: the scale rides the one read-back of a recorded step."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    calls = {"get_scale": 0}
    real = scaler.get_scale

    def counted():
        calls["get_scale"] += 1
        return real()

    scaler.get_scale = counted
    with graddbg.watch(model, opt, scaler=scaler, every=10, nonfinite=graddbg.NonFinite(every=10)) as w:
        for i in range(40):
            x, y = _data(i)
            opt.zero_grad()
            scaler.scale(F.cross_entropy(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
    assert calls["get_scale"] == 0
    assert w.host_syncs == 4  # steps 0, 10, 20, 30: one read-back each, the scale in it
    recorded = w.steps[w.steps["recorded"]]
    assert list(recorded["scale"]) == [256.0] * 4
    assert w.anomalies == []


# --------------------------------------------------------------------------- unused_param: what cut it off
class _Cut(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 2)
        self.spare = nn.Linear(8, 8)

    def forward(self, x):
        if self.how == "no_grad":
            with torch.no_grad():
                h = self.a(x)
        elif self.how == "checkpoint":
            from torch.utils.checkpoint import checkpoint

            h = checkpoint(self.a, x, use_reentrant=True)  # x does not require grad
        else:
            h = self.a(x)
        if self.how == "detach":
            h = h.detach()
        elif self.how == "healthy":
            h = h + 1e-3 * self.spare(x)
        return self.b(torch.relu(h))


@pytest.mark.parametrize("how,cause,params", [
    ("detach", "does not reach the loss", {"a.weight", "a.bias"}),
    ("no_grad", "grad disabled", {"a.weight", "a.bias"}),
    ("checkpoint", "reentrant activation checkpoint", {"a.weight", "a.bias"}),
    ("unused", "never ran", {"spare.weight", "spare.bias"}),
])
def test_parameters_cut_off_from_the_loss_are_named_with_the_cut(how, cause, params):
    torch.manual_seed(0)
    model = _Cut(how)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    w = _run(model, opt, _standard(model, opt), steps=6)
    unused = [a for a in w.anomalies if a.kind == "unused_param"]
    assert len(unused) == 1, [a.message for a in w.anomalies]
    assert params <= set(unused[0].params) and cause in unused[0].message, unused[0].message
    assert unused[0].step == 3


def test_every_parameter_reaching_the_loss_is_not_cut_off():
    torch.manual_seed(0)
    model = _Cut("healthy")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    assert _kinds(_run(model, opt, _standard(model, opt), steps=6)) == []


# --------------------------------------------------------------------------- healthy twins of the dev-half invariants
def test_clip_after_unscale_and_scaler_step_is_not_scaled_grad():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)

    def body(i):
        x, y = _data(i)
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()

    w = _run(model, opt, body, steps=5)
    assert _kinds(w) == [] and set(w.ledger["path"]) == {"scaler"}


def test_optimizer_step_on_scaled_gradients_is_scaled_grad():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)

    def body(i):
        x, y = _data(i)
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        opt.step()  # bug: not scaler.step(opt)

    w = _run(model, opt, body, steps=3, explode=None)
    assert _kinds(w) == ["scaled_grad"] and w.anomalies[0].step == 0
    assert "scale 1024" in w.anomalies[0].message


def test_weight_clipping_after_each_step_is_not_a_foreign_update():
    model = _mlp()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    body = _standard(model, opt)

    def wgan(i):  # a WGAN critic: weights clamped after every step
        body(i)
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-0.05, 0.05)

    assert _kinds(_run(model, opt, wgan, steps=6)) == []


def test_an_optimizer_recreated_each_epoch_is_a_foreign_update():
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = {"opt": opt}

    def body(i):
        if i and i % 3 == 0:
            state["opt"] = torch.optim.Adam(model.parameters(), lr=1e-2)  # bug
        x, y = _data(i)
        state["opt"].zero_grad()
        F.cross_entropy(model(x), y).backward()
        state["opt"].step()

    w = _run(model, opt, body, steps=8)
    assert _kinds(w) == ["foreign_update"] and "re-created" in w.anomalies[0].message


def _folds(make_opt, reset=None, rewind_to="first", lr=0.1, steps=12, **kw):
    """Two runs of 6 steps (k-fold cross-validation): the weights reloaded before the second
    (``rewind_to``: the first step's, or those after step 3), with the same optimizer and an
    exponential scheduler unless ``reset`` starts them again."""
    model = _mlp()
    opt = make_opt(model.parameters(), lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8)
    saved = {}

    def body(i):
        nonlocal sched, opt
        if i == 0 or (i == 3 and rewind_to == "step 3"):
            saved["w"] = {k: v.clone() for k, v in model.state_dict().items()}
        if i == steps // 2:
            model.load_state_dict(saved["w"])  # the next fold starts from the saved weights
            if reset is not None:
                opt, sched = reset(opt, sched)
        x, y = _data(i)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()

    return _run(model, opt, body, steps=steps, **kw)


def _momentum(params, lr):
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def test_weights_rewound_to_the_first_step_with_the_optimizer_and_schedule_kept_are_named():
    w = _folds(_momentum)
    assert _kinds(w) == ["foreign_update"] and w.anomalies[0].step == 6
    msg = w.anomalies[0].message
    assert "the weights were rewound at step 6" in msg and "back to the values it had at the first step" in msg
    assert "the SGD kept its state of 4 of 4 parameters (momentum_buffer)" in msg, msg
    assert "group 0: 0.02621, 0.1 at the first step" in msg and "make a new optimizer and scheduler" in msg, msg


def test_a_rewind_on_a_step_that_is_not_recorded_is_named_with_no_read_of_its_own():
    sparse = dict(every=4, nonfinite=graddbg.NonFinite(every=4))
    w = _folds(_momentum, **sparse)  # (the rewind at step 6: not recorded)
    assert _kinds(w) == ["foreign_update"] and w.anomalies[0].step == 6
    off = _folds(_momentum, foreign_update=None, **sparse)
    assert _kinds(off) == [] and w.host_syncs == off.host_syncs


def test_a_rewind_with_adams_moments_kept_names_them():
    def clear_lr(opt, sched):  # (the schedule starts again, the moments are kept)
        for g in opt.param_groups:
            g["lr"] = g["initial_lr"]
        return opt, torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8)

    w = _folds(torch.optim.Adam, reset=clear_lr, lr=1e-2)
    assert _kinds(w) == ["foreign_update"]
    msg = w.anomalies[0].message
    assert "the Adam kept its state of 4 of 4 parameters (exp_avg, exp_avg_sq)" in msg and "learning rate" not in msg


def _fresh(opt, sched):
    opt.state.clear()
    for g in opt.param_groups:
        g["lr"] = g["initial_lr"]
    return opt, torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8)


def _new(opt, sched):
    new = torch.optim.SGD(opt.param_groups[0]["params"], lr=0.1, momentum=0.9)
    return new, torch.optim.lr_scheduler.ExponentialLR(new, gamma=0.8)


@pytest.mark.parametrize("make_opt, reset, rewind_to, lr", [
    (_momentum, _fresh, "first", 0.1),
    (_momentum, None, "step 3", 0.1),
    (_momentum, None, "first", 0.0),
], ids=["optimizer and schedule reset", "rewound to a later checkpoint", "weights never trained (lr 0)"])
def test_rewinds_that_restart_the_optimizer_or_are_no_restart_are_silent(make_opt, reset, rewind_to, lr):
    w = _folds(make_opt, reset=reset, rewind_to=rewind_to, lr=lr)
    assert "foreign_update" not in _kinds(w), [a.message for a in w.anomalies]


def test_weights_swapped_for_an_evaluation_and_back_are_silent():
    """An EMA-style swap between steps: every weight written twice, back to its own values."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    body = _standard(model, opt)
    ema = {k: v.clone() for k, v in model.state_dict().items()}

    def swapping(i):
        body(i)
        keep = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(ema)  # (evaluate the averaged weights)
        model.load_state_dict(keep)

    assert _kinds(_run(model, opt, swapping, steps=8)) == []


def _adam(make_opt, steps=12, **kw):
    model = _mlp()
    opt = make_opt(model.parameters())
    w = _run(model, opt, _standard(model, opt), steps=steps, **kw)
    return [a for a in w.anomalies if a.kind == "optimizer_setup"], w


@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.Adam(ps, lr=0.01, eps=1.0),
                                      lambda ps: torch.optim.AdamW(ps, lr=0.01, eps=2.0, foreach=False)],
                         ids=["Adam eps=1", "AdamW eps=2"])
def test_an_adam_eps_above_the_gradients_is_named(make_opt):
    found, _ = _adam(make_opt)
    assert len(found) == 1 and found[0].step == 1 and found[0].severity == "bug"
    msg = found[0].message
    assert "eps" in msg and "larger than the gradients it divides at steps 0 and 1" in msg, msg
    assert re.search(r"for (9\d|100)% of the weights \(median gradient RMS sqrt\(v\) [0-9.e-]+\)", msg), msg
    assert "each step is lr * m / eps" in msg and "eps=1e-8" in msg


@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.Adam(ps, lr=0.01),
                                      lambda ps: torch.optim.Adam(ps, lr=3e-4, eps=1e-5),
                                      lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
                                      lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)],
                         ids=["Adam default eps", "eps=1e-5 (PPO's)", "fused", "SGD (no second moment)"])
def test_optimizers_whose_eps_is_small_are_silent(make_opt):
    found, w = _adam(make_opt)
    assert found == [] and not w.anomalies, [a.message for a in w.anomalies]


def test_an_adam_eps_above_the_gradients_is_named_when_recording_sparsely_with_no_read_of_its_own():
    sparse = dict(every=5, nonfinite=graddbg.NonFinite(every=5))
    found, w = _adam(lambda ps: torch.optim.Adam(ps, lr=0.01, eps=1.0), **sparse)
    assert len(found) == 1 and found[0].step == 1  # (steps 0 and 1's moments, read at step 5)
    _, off = _adam(lambda ps: torch.optim.Adam(ps, lr=0.01, eps=1.0), optimizer_setup=None, **sparse)
    assert w.host_syncs == off.host_syncs


def test_optimizer_setup_none_turns_it_off():
    found, _ = _adam(lambda ps: torch.optim.Adam(ps, lr=0.01, eps=1.0), optimizer_setup=None)
    assert found == []


@pytest.mark.parametrize("per_micro", [True, False], ids=["per-micro-batch", "per-step"])
def test_a_scheduler_stepped_per_micro_batch_is_lr_schedule(per_micro):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.99)

    def body(i):
        opt.zero_grad()
        for k in range(3):
            x, y = _data(3 * i + k)
            F.cross_entropy(model(x), y).backward()
            if per_micro:
                sched.step()
        opt.step()
        if not per_micro:
            sched.step()

    w = _run(model, opt, body, steps=4)
    assert _kinds(w) == (["lr_schedule"] if per_micro else [])


def test_a_long_cosine_schedule_to_zero_is_not_a_collapse():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=200, eta_min=0.0)
    body = _standard(model, opt)

    def healthy(i):
        body(i)
        sched.step()

    assert _kinds(_run(model, opt, healthy, steps=200)) == []


def test_the_ledger_and_the_steps_table_keep_the_same_steps_under_one_retention_rule():
    """w.ledger and w.steps are two views under one retention rule (graddbg.stats.Retained):
    with history=40 over 300 steps both keep the first steps, the latest, the step of a
    finding and an evenly spaced middle, the same steps in both."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with graddbg.watch(model, opt, history=40, nonfinite="skip", explode=None) as w:
        for i in range(300):
            x, y = _data(i)
            loss = F.cross_entropy(model(x), y)
            if i == 150:
                loss = loss * float("nan")  # (a finding at step 150: its step stays in both)
            opt.zero_grad()
            loss.backward()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the skip policy's warning at step 150)
                opt.step()
    steps, ledger = w.steps["step"].tolist(), w.ledger["step"].tolist()
    assert steps == ledger
    assert len(ledger) <= 40 and ledger[:3] == [0, 1, 2] and ledger[-1] == 299 and 150 in ledger
    assert any(k == "nonfinite" for k in w.ledger.set_index("step").loc[150, "findings"].split(","))
    gaps = {b - a for a, b in zip(ledger, ledger[1:]) if 20 < a < 250 and a != 150 and b != 150}
    assert len(gaps) <= 2, gaps  # (the middle evenly spaced)
    assert w.what_happened(150).startswith("Step 150") or "150" in w.what_happened(150)
