"""The step audit (issue 39, point 1): on sampled steps each parameter's change is compared
with what the optimizer's own rule gives from the gradients and the state it had. Every bug
here has a healthy twin that must stay silent, and the audit leaves the training, the
optimizer and the host synchronisations as they were."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import graddbg
from graddbg._args import STEP_AUDIT


def _model(dtype=torch.float32, norm=False):
    torch.manual_seed(0)
    mid = nn.LayerNorm(16) if norm else nn.ReLU()
    return nn.Sequential(nn.Linear(8, 16), mid, nn.Linear(16, 1)).to(dtype)


def _train(model, opt, steps=12, dtype=torch.float32, hook=None, after=None, autocast=None, **kw):
    """``hook``: a step pre-hook (it runs inside the step); ``after``: called with the model
    after each step; ``autocast``: the forward pass under torch.autocast of that dtype."""
    torch.manual_seed(1)
    x, y = torch.randn(64, 8, dtype=dtype), torch.randn(64, 1, dtype=dtype)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model, opt, **kw) as w:
            if hook is not None:
                opt.register_step_pre_hook(hook)  # (after the watch's own: it runs inside the step)
            for _ in range(steps):
                with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                    loss = ((model(x).to(dtype) - y) ** 2).mean()
                loss.backward()
                opt.step()
                if after is not None:
                    after(model)
                opt.zero_grad()
                losses.append(loss.item())
    return w, losses


def _audits(w):
    return [a for a in w.anomalies if a.kind == "update_rule"]


OPTIMIZERS = [
    (torch.optim.SGD, dict(lr=0.05)),
    (torch.optim.SGD, dict(lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4)),
    (torch.optim.Adam, dict(lr=1e-3)),
    (torch.optim.AdamW, dict(lr=1e-3, amsgrad=True)),
    (torch.optim.RMSprop, dict(lr=1e-3, centered=True, momentum=0.5)),
    (torch.optim.Adagrad, dict(lr=1e-2)),
    (torch.optim.NAdam, dict(lr=1e-3)),
    (torch.optim.RAdam, dict(lr=1e-3)),
    (torch.optim.Adamax, dict(lr=1e-3)),
    (torch.optim.Adadelta, dict()),
    (torch.optim.ASGD, dict(lr=1e-2)),
    (torch.optim.Rprop, dict(lr=1e-3)),
    (torch.optim.Adafactor, dict(lr=1e-2)),
]


@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=lambda v: getattr(v, "__name__", None) or "-".join(map(str, v)))
def test_every_torch_optimizer_follows_its_own_rule_and_the_audit_is_silent(cls, kw):
    model = _model(norm=True)
    w, _ = _train(model, cls(model.parameters(), **kw))
    assert not _audits(w), _audits(w)[0].message


def test_the_audit_leaves_training_and_host_reads_as_they_were():
    """Same losses as an unwatched run (the real optimizer's state untouched by the shadow
    step), and one host synchronisation per step with the audit on, as with it off."""
    def plain():
        model = _model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(1)
        x, y = torch.randn(64, 8), torch.randn(64, 1)
        out = []
        for _ in range(12):
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    model = _model()
    w, losses = _train(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    assert losses == plain()
    assert w.host_syncs == 12
    model = _model()
    off, _ = _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), update_rule=None)
    assert off.host_syncs == w.host_syncs
    assert [i for i in range(12) if STEP_AUDIT.includes(i)] == [0, 1, 2, 10]


def test_bf16_weights_whose_updates_round_away_are_named_and_fp32_weights_under_autocast_are_not():
    """Weights kept in bf16 with AdamW: a LayerNorm weight at 1.0 never moves (the rule's
    changes are under bf16's spacing at 1.0). Its twin keeps fp32 weights (autocast)."""
    model = _model(torch.bfloat16, norm=True)
    w, _ = _train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), dtype=torch.bfloat16)
    found = _audits(w)
    assert len(found) == 1 and found[0].step == 0
    a = found[0]
    assert a.params == ("1.weight",)
    assert "did not move" in a.message and "bfloat16" in a.message and "100% of the elements" in a.message
    assert "AdamW's own update rule" in a.message and "0 observed" in a.message

    model = _model(norm=True)
    twin, _ = _train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), autocast=torch.bfloat16)
    assert not _audits(twin)


def test_a_parameter_stepped_twice_within_the_step_is_named_with_both_numbers():
    """A hook inside the step doubles the gradients: the weights move twice the rule's
    change; without the hook, silence."""
    def double(opt, args, kwargs):
        for g in opt.param_groups:
            for p in g["params"]:
                p.grad.mul_(2)

    model = _model()
    w, _ = _train(model, torch.optim.SGD(model.parameters(), lr=0.05), hook=double)
    found = _audits(w)
    assert len(found) == 1 and found[0].step == 0
    assert "moved twice the change SGD's own update rule" in found[0].message
    assert set(found[0].params) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    model = _model()
    twin, _ = _train(model, torch.optim.SGD(model.parameters(), lr=0.05))
    assert not _audits(twin)


def test_a_step_whose_change_is_discarded_is_named_in_fp32():
    """A hook inside the step clears one layer's gradients: the rule moves it (by changes
    float32 holds), the step does not."""
    def clear(opt, args, kwargs):
        for p in opt.param_groups[0]["params"][:2]:
            p.grad.zero_()

    model = _model()
    w, _ = _train(model, torch.optim.SGD(model.parameters(), lr=0.05), hook=clear)
    found = _audits(w)
    assert len(found) == 1
    assert set(found[0].params) == {"0.weight", "0.bias"}
    assert "did not move" in found[0].message and "something discarded the step's change" in found[0].message


def test_an_optimizer_the_shadow_cannot_reproduce_switches_the_audit_off_and_training_goes_on():
    class Picky(torch.optim.Optimizer):
        """Steps only the tensors it was built with (a twin's copies fail its check)."""

        def __init__(self, params, lr):
            super().__init__(params, dict(lr=lr))
            self.ids = {id(p) for g in self.param_groups for p in g["params"]}

        @torch.no_grad()
        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    assert id(p) in self.ids
                    p.add_(p.grad, alpha=-g["lr"])

    model = _model()
    opt = Picky(model.parameters(), 0.05)
    torch.manual_seed(1)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    with pytest.warns(graddbg.GraddbgWarning, match="the step audit .update_rule. is off from now on"):
        with graddbg.watch(model, opt) as w:
            for _ in range(4):
                ((model(x) - y) ** 2).mean().backward()
                opt.step()
                opt.zero_grad()
    assert w.steps["step"].tolist() == [0, 1, 2, 3]
    assert not _audits(w)


def test_a_custom_optimizer_with_its_own_rule_is_audited_by_that_rule():
    """A sign-SGD written as a torch.optim.Optimizer: its own rule, reproduced; silent."""
    class SignSGD(torch.optim.Optimizer):
        def __init__(self, params, lr):
            super().__init__(params, dict(lr=lr))

        @torch.no_grad()
        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        st = self.state[p]
                        st["n"] = st.get("n", 0) + 1
                        p.add_(p.grad.sign(), alpha=-g["lr"] / st["n"])

    model = _model()
    w, _ = _train(model, SignSGD(model.parameters(), lr=1e-2))
    assert not _audits(w)


def test_update_rule_none_turns_the_audit_off():
    model = _model(torch.bfloat16, norm=True)
    w, _ = _train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), dtype=torch.bfloat16, update_rule=None)
    assert not _audits(w)


# --------------------------------------------------------------------------- hand-written loops (point 2)
def _manual(update, clear, steps=8, accumulate=1):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    torch.manual_seed(1)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model) as w:  # (no optimizer: each backward pass is a step)
            for i in range(steps):
                ((model(x) - y) ** 2).mean().backward()
                if (i + 1) % accumulate:
                    continue
                with torch.no_grad():
                    for p in model.parameters():
                        update(p)
                for p in model.parameters():
                    clear(p)
    return w


def _sub(p):
    p -= 0.01 * p.grad


def _sub_data(p):
    p.data.sub_(0.01 * p.grad.data)


def _keep(p):
    pass


def _none(p):
    p.grad = None


def _zero(p):
    p.grad.zero_()


def _zero_data(p):
    p.grad.data.zero_()


@pytest.mark.parametrize("update", [_sub, _sub_data], ids=["in-place", "through .data"])
def test_a_hand_written_loop_that_never_clears_its_gradients_is_named(update):
    w = _manual(update, _keep)
    found = [a for a in w.anomalies if a.kind == "stale_grad"]
    assert len(found) == 1 and found[0].step == 2
    assert "hand-written update loop (no optimizer)" in found[0].message
    assert "the weights changed" in found[0].message and "p.grad = None" in found[0].message


@pytest.mark.parametrize("clear", [_none, _zero, _zero_data], ids=["None", "zero_", ".data.zero_"])
def test_hand_written_loops_that_clear_their_gradients_are_silent(clear):
    assert not _manual(_sub, clear).anomalies


def test_hand_written_gradient_accumulation_is_not_stale():
    """Four backward passes add up before each update (no update between them): silent."""
    assert not _manual(_sub, _none, steps=12, accumulate=4).anomalies


def test_a_custom_rule_that_depends_on_a_groups_place_is_reproduced():
    """Another optimizer's groups are audited at their places in the twin (the others
    empty): a rule that steps group k with lr * (k + 1) is reproduced; silent."""
    class ByPlace(torch.optim.Optimizer):
        def __init__(self, groups):
            super().__init__(groups, dict(lr=0.01))

        @torch.no_grad()
        def step(self, closure=None):
            for k, g in enumerate(self.param_groups):
                for p in g["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-g["lr"] * (k + 1))

    model = _model()
    w, _ = _train(model, ByPlace([{"params": model[0].parameters()}, {"params": model[2].parameters()}]))
    assert not _audits(w)


def _update_loop(which, steps=12):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    torch.manual_seed(1)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model) as w:
            for i in range(steps):
                ((model(x) - y) ** 2).mean().backward()
                with torch.no_grad():
                    for p in which(model, i):
                        p -= 0.01 * p.grad
                model.zero_grad()
    return w


def test_a_hand_written_update_of_only_some_parameters_is_named():
    w = _update_loop(lambda m, i: m[2].parameters())
    found = [a for a in w.anomalies if a.kind == "no_update"]
    assert len(found) == 1 and found[0].step == 1 and set(found[0].params) == {"0.weight", "0.bias"}
    assert "an update moved 2.weight, 2.bias but left 0.weight, 0.bias bitwise unchanged" in found[0].message


@pytest.mark.parametrize("which", [lambda m, i: m.parameters(),
                                   lambda m, i: m[0].parameters() if i % 2 else m[2].parameters(),
                                   lambda m, i: m.parameters() if i % 3 == 2 else ()],
                         ids=["all", "alternating layers", "accumulating"])
def test_hand_written_updates_of_every_parameter_are_silent(which):
    assert not _update_loop(which).anomalies


def _rule_loop(update, steps=12):
    """A hand-written loop whose ``update(p, state)`` runs per parameter under no_grad."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    torch.manual_seed(1)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    state = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model) as w:
            for _ in range(steps):
                ((model(x) - y) ** 2).mean().backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                with torch.no_grad():
                    for p in model.parameters():
                        update(p, state)
                model.zero_grad()
    return [a for a in w.anomalies if a.kind == "update_rule"], w


def _momentum(p, state, lr=0.01, mu=0.9):
    v = state.setdefault(id(p), torch.zeros_like(p))
    v.mul_(mu).add_(p.grad)
    p -= lr * v


def test_a_hand_written_weight_decay_with_the_wrong_sign_is_named():
    found, _ = _rule_loop(lambda p, s: p.sub_(0.05 * (p.grad - 0.1 * p)))
    # (2.bias has one element: its gradient lies along its weight, a and b are not told apart)
    assert len(found) == 1 and found[0].step == 1 and found[0].params == ("0.weight", "0.bias", "2.weight")
    msg = found[0].message
    assert "pushes the weights away from zero" in msg and "is exactly a * grad + b * w with b > 0 (a = -0.05, " \
        "b = 0.005 for 0.weight)" in msg and "multiplies the weights by 1.005" in msg, msg


@pytest.mark.parametrize("update", [
    lambda p, s: p.sub_(0.05 * p.grad),
    lambda p, s: p.sub_(0.05 * (p.grad + 0.1 * p)),
    lambda p, s: p.mul_(0.999).sub_(0.05 * p.grad),
    lambda p, s: p.add_(0.05 * p.grad),
    _momentum,
], ids=["SGD", "weight decay", "decoupled decay", "ascent (REINFORCE by hand)", "momentum"])
def test_hand_written_updates_that_follow_a_rule_are_silent(update):
    found, w = _rule_loop(update)
    assert found == [] and w.current_step == 12


class _Clamped(nn.Module):
    """A model whose forward clamps its first layer's weights in place through .data (a
    constraint written into forward: autograd does not see it)."""

    def __init__(self, clamp=True):
        super().__init__()
        self.body, self.head, self.clamp = nn.Linear(8, 16), nn.Linear(16, 1), clamp

    def forward(self, x):
        if self.clamp:
            self.body.weight.data.clamp_(-0.05, 0.05)
        return self.head(torch.relu(self.body(x)))


def _during_loop(model, where="after", steps=12, forwards=1):
    """A hand-written SGD loop; ``where`` the update runs: after backward(), or between the
    forward pass and backward() (through .data, so autograd raises nothing)."""
    torch.manual_seed(1)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model) as w:
            for i in range(steps):
                for _ in range(forwards - 1):
                    model(x)  # (a forward pass no backward pass follows)
                loss = ((model(x) - y) ** 2).mean()
                if where == "before" and i:
                    for p in model.parameters():
                        p.data.sub_(0.01 * p.grad)
                    model.zero_grad()
                loss.backward()
                if where == "after":
                    with torch.no_grad():
                        for p in model.parameters():
                            p -= 0.01 * p.grad
                    model.zero_grad()
    return [a for a in w.anomalies if a.kind == "update_rule"], w


def test_weights_written_in_place_inside_forward_are_named():
    torch.manual_seed(0)
    found, _ = _during_loop(_Clamped())
    assert len(found) == 1 and found[0].step == 0 and found[0].params == ("body.weight",), found
    msg = found[0].message
    assert "between the start of the forward pass of step 0 and the end of its backward pass, body.weight changed" \
        in msg and "|weight|" in msg and "torch.nn.utils.parametrize" in msg, msg


def test_an_update_placed_between_the_forward_pass_and_backward_is_named():
    torch.manual_seed(0)
    found, _ = _during_loop(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)), where="before")
    assert len(found) == 1 and found[0].step == 1
    assert set(found[0].params) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert "the update placed before loss.backward()" in found[0].message


class _Embedded(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(10, 8, max_norm=0.5), nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.emb((x.abs() * 3).long().clamp(max=9)[:, 0]))


@pytest.mark.parametrize("make, forwards", [
    (lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)), 1),
    (lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)), 2),
    (lambda: _Clamped(clamp=False), 1),
    (_Embedded, 1),
], ids=["SGD after backward", "an extra forward pass", "the clamp's fixed twin", "Embedding max_norm"])
def test_weights_left_alone_during_each_pass_are_silent(make, forwards):
    torch.manual_seed(0)
    model = make()
    found, w = _during_loop(model, forwards=forwards)
    assert found == [] and not w.anomalies and w.current_step == 12, [a.message for a in w.anomalies]


# --------------------------------------------------------------------------- explosions with their cause (point 4)
def _unfreezing(unfreeze_at):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = nn.Linear(8, 8), nn.Linear(8, 1)

        def forward(self, x):  # (the body's bias reaches the loss with a large factor)
            return self.head(self.body(x)) + 300 * self.body.bias.sum() * x[:, :1]

    torch.manual_seed(0)
    model = Net()
    for p in model.body.parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    torch.manual_seed(1)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model, opt) as w:
            for i in range(40):
                if i == unfreeze_at:
                    for p in model.body.parameters():
                        p.requires_grad_(True)
                ((model(x) - y) ** 2).mean().backward()
                opt.step()
                opt.zero_grad()
    return [a for a in w.anomalies if a.kind == "explode"]


def test_an_explosion_right_after_layers_are_unfrozen_names_the_unfreezing():
    found = _unfreezing(30)
    assert len(found) == 1 and found[0].step == 30
    assert "after parameters were unfrozen: body.weight, body.bias had no gradient before and are trained " \
           "from step 30" in found[0].message


def test_layers_never_unfrozen_give_no_explosion():
    assert _unfreezing(None) == []


def _teacher(write, steps=40, lr=0.3):
    """An online layer trained to match a frozen teacher layer; ``write(i, model)`` runs
    before step i's forward pass (a copy into the teacher, or into the online layer)."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.online, self.teacher = nn.Linear(8, 1), nn.Linear(8, 1)
            self.teacher.requires_grad_(False)

        def forward(self, x):
            return self.online(x) - self.teacher(x)

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.online.parameters(), lr=lr)
    torch.manual_seed(1)
    x = torch.randn(256, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model, opt) as w:
            for i in range(steps):
                with torch.no_grad():
                    write(i, model)
                (model(x) ** 2).mean().backward()
                opt.step()
                opt.zero_grad()
    return [a for a in w.anomalies if a.kind == "explode"]


def _load(layer, scale):
    layer.load_state_dict({"weight": torch.full((1, 8), scale), "bias": torch.zeros(1)})


def test_an_explosion_after_a_teacher_network_is_swapped_names_the_swap():
    found = _teacher(lambda i, m: _load(m.teacher, 300.0) if i == 30 else None)
    assert len(found) == 1 and found[0].step == 30, [a.message for a in found]
    msg = found[0].message
    assert "after the weights of module 'teacher' were written between steps: weights the optimizer does not " \
           "train (a target, teacher or EMA network), changed outside the optimizer's step before step 30 " \
           "(this step; never before)" in msg, msg
    assert "a target or teacher network copied or swapped" in msg and found[0].name is None


def test_an_explosion_after_the_trained_weights_are_overwritten_names_the_load():
    found = _teacher(lambda i, m: _load(m.online, 300.0) if i == 30 else None)
    assert len(found) == 1 and found[0].step == 30
    assert "the weights of module 'online' were written between steps: weights the optimizer trains" \
        in found[0].message


def test_a_teacher_copied_on_a_schedule_gives_no_explosion_finding():
    """A target network copied every 8 steps (DQN's hard update): each copy makes the
    gradient jump, on the program's own schedule."""
    flip = lambda i, m: _load(m.teacher, 3.0 if i // 8 % 2 else -3.0) if i % 8 == 1 else None  # noqa: E731
    assert _teacher(flip, steps=60) == []


def test_a_teacher_never_written_and_a_continuous_ema_give_no_swap():
    assert _teacher(lambda i, m: None) == []

    def ema_then_spike(i, m):  # an EMA of the online layer every step; the online layer overwritten at 30
        for t, o in zip(m.teacher.parameters(), m.online.parameters()):
            t.mul_(0.99).add_(o, alpha=0.01)
        if i == 30:
            m.online.weight.mul_(300.0)

    found = _teacher(ema_then_spike)
    assert len(found) == 1 and "module 'online'" in found[0].message and "'teacher'" not in found[0].message


def _two_optimizers(after_step):
    model = _model()
    w, _ = _train(model, torch.optim.Adam(model.parameters(), lr=1e-3), after=after_step)
    return _audits(w)


def test_a_parameter_a_second_optimizer_steps_after_the_watched_one_is_named():
    """The first layer is held by a second Adam too, stepped after the watched one (CURL's
    encoder): it moves again, outside the watched step, in that step's direction."""
    second = {}

    def step_again(model):
        if "opt" not in second:
            second["opt"] = torch.optim.Adam(model[0].parameters(), lr=1e-3)
        second["opt"].step()

    found = _two_optimizers(step_again)
    assert len(found) == 1 and found[0].step == 0
    assert set(found[0].params) == {"0.weight", "0.bias"}
    assert "moved again before step 1 began, outside Adam's step" in found[0].message


@pytest.mark.parametrize("after_step", [
    lambda m: None,
    lambda m: [p.data.clamp_(-0.05, 0.05) for p in m.parameters()],  # (WGAN's weight clipping)
    lambda m: m[0].weight.data.div_(m[0].weight.data.norm(dim=1, keepdim=True)),  # (a projection)
], ids=["nothing", "weight clipping", "row normalisation"])
def test_what_healthy_loops_do_to_the_weights_after_the_step_is_not_a_second_step(after_step):
    assert not _two_optimizers(after_step)


# --------------------------------------------------------------------------- the gradients applied (point 1)
def _applied(between, steps=12, accumulate=1, scaler=False, **kw):
    """SGD with momentum; ``between(model)`` runs after the backward passes, before the step
    (under no_grad, as gradient edits are written); under ``scaler``, a GradScaler whose
    ``unscale_`` comes first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler else None
    torch.manual_seed(1)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model, opt, **kw) as w:
            for _ in range(steps):
                opt.zero_grad()
                for k in range(accumulate):
                    loss = ((model(x[k::accumulate]) - y[k::accumulate]) ** 2).mean() / accumulate
                    (sc.scale(loss) if sc else loss).backward()
                if sc:
                    sc.unscale_(opt)
                with torch.no_grad():
                    between(model)
                if sc:
                    sc.step(opt)
                    sc.update()
                else:
                    opt.step()
    return w, [a for a in w.anomalies if a.kind == "applied_grad"]


def _each(params, f):
    for p in params:
        f(p.grad)


@pytest.mark.parametrize("edit,says", [
    (lambda m: _each(m[0].parameters(), lambda g: g.mul_(2)), "were multiplied by 2 between the end of the last "
     "backward pass and SGD.step() (|grad| 0.39 after backward, 0.78 at the step, for 0.weight, in the same line)"),
    (lambda m: _each(m[0].parameters(), lambda g: g.neg_()), "were multiplied by -1 between the end of the last "
     "backward pass and SGD.step() (|grad| 0.39 after backward, 0.39 at the step, for 0.weight, in the same line): "
     "their sign flipped"),
    (lambda m: m[0].zero_grad(), "had gradients when the last backward pass ended, but they were set to None between "
     "the end of the last backward pass and SGD.step(), while the optimizer's other parameters kept theirs"),
    (lambda m: m[0].zero_grad(set_to_none=False), "but they were zeroed between the end of the last backward pass "
     "and SGD.step(), while the optimizer's other parameters kept theirs (|grad| 0.39 after backward, 0 at the step"),
], ids=["doubled", "flipped", "set to None", "zeroed"])
def test_gradients_edited_between_backward_and_step_are_named(edit, says):
    _, found = _applied(edit)
    assert len(found) == 1 and found[0].step == 0 and found[0].params == ("0.weight", "0.bias"), found
    assert says in found[0].message, found[0].message


@pytest.mark.parametrize("edit,kw", [
    (lambda m: None, {}),
    (lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01), {}),
    (lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01), dict(accumulate=4)),
    (lambda m: (torch.nn.utils.clip_grad_norm_(m[0].parameters(), 0.01),
                torch.nn.utils.clip_grad_norm_(m[2].parameters(), 0.05)), {}),
    (lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 0.01), {}),
    (lambda m: _each(m.parameters(), lambda g: g.clamp_(-0.05, 0.05)), {}),
    (lambda m: [p.grad.add_(p, alpha=1e-2) for p in m.parameters()], {}),
    (lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01), dict(scaler=True)),
    (lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 0.01), dict(scaler=True)),
    (lambda m: [p.grad.mul_(0.5) for p in m.parameters()], {}),
    (lambda m: _each(m[0].parameters(), lambda g: g.mul_(torch.rand_like(g) < 0.5)), {}),
    (lambda m: _each(m[0].parameters(), lambda g: g.add_(torch.randn_like(g) * g.std())), {}),
    (lambda m: m[2].bias.grad.mul_(3.0), {}),
], ids=["untouched", "clip by norm", "accumulated, clipped", "clip per module", "clip by value", "clamp_",
        "L2 term", "GradScaler then clip", "GradScaler then clip by value", "halved",
        "half masked (not judged)", "noise added (not judged)", "one-element bias tripled (no direction)"])
def test_gradients_the_ledger_explains_are_silent(edit, kw):
    w, found = _applied(edit, **kw)
    assert found == [] and w.current_step == 12, found[0].message if found else w.current_step


def test_the_gradient_audit_adds_no_host_read_and_is_off_with_its_policy():
    clip = lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)  # noqa: E731
    on, _ = _applied(clip)
    off, _ = _applied(clip, applied_grad=None)
    assert on.host_syncs == off.host_syncs == 12
    _, found = _applied(lambda m: _each(m[0].parameters(), lambda g: g.mul_(2)), applied_grad=None)
    assert found == []


def test_gradients_edited_only_between_audited_steps_are_not_seen_there():
    """The audit samples steps (0, 1, 2, 10, ...): an edit made at step 5 only is not
    compared (its cost is paid on audited steps only)."""
    calls = []

    def at_five(m):
        calls.append(1)
        if len(calls) == 6:
            _each(m[0].parameters(), lambda g: g.mul_(2))

    _, found = _applied(at_five)
    assert found == [] and not STEP_AUDIT.includes(5)


def test_no_host_read_on_steps_neither_recorded_nor_audited():
    """Recorded every 7th step, both halves of the audit on, every step clipped: a read-back
    on the recorded steps and on the audited steps whose gradients were touched (0, 1, 2,
    10), none on any other step (issue 39, point 7)."""
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    synced = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model, opt, every=7, nonfinite=graddbg.NonFinite(every=7), explode=None) as w:
            for i in range(30):
                before = w.host_syncs
                ((model(x) - y) ** 2).mean().backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
                opt.step()
                opt.zero_grad()
                if w.host_syncs > before:
                    synced.append(i)
    assert synced == [0, 1, 2, 7, 10, 14, 21, 28] and not w.anomalies


def _rounds(rollout, spike_at=None, rounds=4, steps=128):
    """A DQN-like loop: rounds of gradient steps against a target network hard-copied
    (through .data, as stable-baselines3 does) before each round; ``rollout``: the round
    begins with forward passes of the watched network without grad (acting in the
    environment); ``spike_at``: a step whose lr is 1000x."""
    import copy
    torch.manual_seed(0)
    q = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    target = copy.deepcopy(q)
    opt = torch.optim.Adam(q.parameters(), lr=2.3e-3)
    g = torch.Generator().manual_seed(1)
    s, s2 = torch.randn(512, 4, generator=g), torch.randn(512, 4, generator=g)
    a, r = torch.randint(0, 2, (512,), generator=g), torch.ones(512)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(q, opt) as w:
            for k in range(rounds):
                with torch.no_grad():
                    for p, tp in zip(q.parameters(), target.parameters()):
                        tp.data.copy_(p.data)
                    for _ in range(rollout):
                        q(torch.randn(1, 4, generator=g))
                for i in range(steps):
                    idx = torch.randint(0, 512, (64,), generator=g)
                    with torch.no_grad():
                        y = r[idx] + 0.99 * target(s2[idx]).max(1).values
                    loss = F.smooth_l1_loss(q(s[idx]).gather(1, a[idx, None]).squeeze(1), y)
                    opt.zero_grad()
                    loss.backward()
                    nn.utils.clip_grad_norm_(q.parameters(), 10)
                    for group in opt.param_groups:
                        group["lr"] = 2.3 if k * steps + i == spike_at else 2.3e-3
                    opt.step()
    return [x for x in w.anomalies if x.kind == "explode"]


def test_a_jump_right_after_a_rollout_starts_a_new_level_and_no_finding():
    """Each round's first steps jump (new data, a new target): after forward passes without
    grad (the program acting), the level starts again. Without them, the same jumps are
    explosions: the phase is what tells them apart."""
    assert _rounds(rollout=32) == []
    assert len(_rounds(rollout=0)) >= 2


def test_an_lr_spike_inside_a_round_is_still_named():
    found = _rounds(rollout=32, spike_at=100)
    assert len(found) == 1 and found[0].step in (101, 102) and "after a learning-rate change" in found[0].message, \
        [x.message for x in found]


def test_an_lr_that_a_schedule_brings_to_zero_is_not_a_parameter_left_unchanged():
    """stable-baselines3's linear schedule writes lr = 1e-3 * progress into the param groups
    before each round, 0 for the last one: the schedule's end, not a frozen group. Its twin,
    a group at lr 0 from the start, is named."""
    for start in (1e-3, 0.0):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))
        opt = torch.optim.Adam(model.parameters(), lr=start)
        x, y = torch.randn(256, 4), torch.randn(256, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with graddbg.watch(model, opt) as w:
                for it in range(1, 9):
                    for group in opt.param_groups:
                        group["lr"] = start * (1 - it / 8)
                    for _ in range(20):
                        opt.zero_grad()
                        F.mse_loss(model(x), y).backward()
                        opt.step()
        kinds = [a.kind for a in w.anomalies]
        assert ("no_update" in kinds) == (start == 0.0), [a.message for a in w.anomalies]


def test_weights_in_shared_memory_are_not_audited():
    """Hogwild: the weights live in shared memory and other processes step them during this
    one's step (here a pre-hook stands in for them): the audit cannot tell whose change is
    whose and leaves them alone; the same edit on private weights is named."""
    def others(opt, args, kwargs):
        with torch.no_grad():
            for p in opt.param_groups[0]["params"]:
                p.add_(torch.randn_like(p) * 0.01)

    for shared in (True, False):
        model = _model()
        if shared:
            model.share_memory()
        w, _ = _train(model, torch.optim.SGD(model.parameters(), lr=0.05), hook=others)
        assert bool(_audits(w)) is not shared, [a.message for a in _audits(w)]


def test_adam_on_fp16_weights_is_judged_only_for_lost_updates():
    """Adam on float16 weights keeps its moments in float16: its step differs from the
    float64 shadow by more than a direction or a factor the audit can judge there, so only a
    lost update (rounded away) may be named; with updates larger than fp16's spacing, none."""
    model = _model(torch.float16)
    w, losses = _train(model, torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4), dtype=torch.float16)
    assert _audits(w) == [] and all(math.isfinite(v) for v in losses)


def test_an_optimizer_stepped_in_backward_is_healthy():
    """torch's own pattern (fusing the optimizer step into the backward pass): each parameter's
    post-accumulate-grad hook steps its optimizer and clears its gradient. The weights are
    written inside the backward pass by design: no finding, and a coverage note instead of
    "never received a gradient"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opts = {p: torch.optim.SGD([p], lr=0.05) for p in model.parameters()}

    def hook(p):
        opts[p].step()
        opts[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(graddbg.CoverageWarning, match="stepped inside the backward pass"):
        with graddbg.watch(model) as w:
            for _ in range(12):
                torch.nn.functional.mse_loss(model(x), y).backward()
    assert w.anomalies == [], [a.message for a in w.anomalies]
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def _spent_loop(keep_generator, steps=12):
    """A hand-written SGD loop over ``params``: a generator kept across steps (spent after its
    first pass: the bug) or model.parameters() anew each step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    torch.manual_seed(1)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    params = model.parameters()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model) as w:
            for _ in range(steps):
                model.zero_grad()
                ((model(x) - y) ** 2).mean().backward()
                with torch.no_grad():
                    for p in (params if keep_generator else model.parameters()):
                        p -= 0.05 * p.grad
    return [a for a in w.anomalies if a.kind == "update_rule"], w


def test_a_hand_written_update_that_stops_is_named():
    found, _ = _spent_loop(True)
    assert len(found) == 1 and found[0].step == 2, [a.message for a in found]
    msg = found[0].message
    assert "stopped: the weights moved in the interval after step 0" in msg and "steps 1 and 2" in msg, msg
    assert "a generator, spent after one pass" in msg


def test_a_hand_written_update_that_goes_on_is_silent():
    found, w = _spent_loop(False)
    assert found == [] and not w.anomalies, [a.message for a in w.anomalies]


def _hooked_loop(hook, steps=6, clamp=False):
    """An optimizer loop whose parameters carry a post-accumulate-grad hook ``hook(p)``."""
    torch.manual_seed(0)
    model = _Clamped(clamp=clamp)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if hook is not None:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)
    torch.manual_seed(1)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model, opt) as w:
            for _ in range(steps):
                opt.zero_grad()
                ((model(x) - y) ** 2).mean().backward()
                opt.step()
    return [a for a in w.anomalies if a.kind == "foreign_update"], w


def _divide_param(p):  # (the bug: the hook is handed the parameter, not its gradient)
    with torch.no_grad():
        p.div_(2.0)


def _divide_grad(p):  # (the fix)
    p.grad.div_(2.0)


def test_a_hook_that_writes_the_parameter_during_backward_is_named_with_an_optimizer():
    found, _ = _hooked_loop(_divide_param)
    assert len(found) == 1 and found[0].step == 0, [a.message for a in found]
    msg = found[0].message
    assert "inside a backward pass" in msg and "SGD then stepped them" in msg, msg
    assert "register_post_accumulate_grad_hook hands the hook the parameter" in msg


@pytest.mark.parametrize("hook, clamp", [(_divide_grad, False), (None, True), (None, False)],
                         ids=["the hook on the gradient", "a clamp in forward (a projection)", "plain"])
def test_weights_written_before_use_or_not_at_all_are_silent_with_an_optimizer(hook, clamp):
    found, w = _hooked_loop(hook, clamp=clamp)
    assert found == [] and not w.anomalies, [a.message for a in w.anomalies]


class _PolySGD(torch.optim.SGD):
    """SGD whose step() sets the lr from a step count it keeps itself (a polynomial decay
    written into the optimizer, as segmentation codes do)."""

    def __init__(self, params, lr, max_step):
        super().__init__(params, lr, momentum=0.9, weight_decay=5e-4)
        self.global_step, self.max_step = 0, max_step
        self.initial_lr = [g["lr"] for g in self.param_groups]

    def step(self, closure=None):
        mult = (1 - self.global_step / self.max_step) ** 0.9
        for g, lr in zip(self.param_groups, self.initial_lr):
            g["lr"] = lr * mult
        out = super().step(closure)
        self.global_step += 1
        return out


def test_an_optimizer_that_counts_its_own_steps_is_shadowed_as_the_step_found_it():
    """The audit's twin takes the optimizer's attributes from before the step (its step count
    was 0, not the 1 the real step left): no false 'moved 1.02x the rule'."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = _PolySGD(model.parameters(), lr=0.02, max_step=20)
    x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
    with graddbg.watch(model, opt) as w:
        for _ in range(12):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    assert w.anomalies == [], [a.message for a in w.anomalies]


def test_weights_written_during_the_pass_are_still_looked_at_after_layers_are_unfrozen():
    """Unfreezing adds parameters while graddbg's own post-accumulate-grad hooks are on the
    others (a hand-written loop): only the user's hooks, taken as each parameter is added,
    exempt a parameter, so an update placed before backward() is still named."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    model[0].requires_grad_(False)
    torch.manual_seed(1)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model) as w:
            for i in range(12):
                if i == 3:
                    model[0].requires_grad_(True)
                loss = ((model(x) - y) ** 2).mean()
                if i > 3:  # (the update placed between the forward pass and backward())
                    for p in model.parameters():
                        if p.grad is not None:
                            p.data.sub_(0.01 * p.grad)
                    model.zero_grad()
                loss.backward()
    found = [a for a in w.anomalies if a.kind == "update_rule"]
    assert len(found) == 1 and found[0].step == 10, [a.message for a in w.anomalies]
    assert {"0.weight", "2.weight"} <= set(found[0].params), found[0].params  # (2.*: hooked by graddbg itself)
