"""The optimizer-hygiene checks (graddbg/checks/hygiene.py): each finding shown by a buggy
loop, and a healthy twin of each that stays silent (no anomaly, no warning)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graddbg
from graddbg.anomaly import HYGIENE_KINDS
from graddbg.checks.hygiene import DEAD_PATIENCE, PATIENCE

RECORD = {k: "record" for k in HYGIENE_KINDS}


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g)


def _train(model, opt, steps=8, *, zero="before", accumulate=1, watch_kwargs=None, order="normal", **kw):
    """A classification loop with the order of zero_grad/backward/step as asked; returns
    the watch (its findings recorded, never raised or warned)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a healthy twin makes no warning at all
        with graddbg.watch(model, opt, **{**RECORD, **(watch_kwargs or {})}) as w:
            for i in range(steps):
                if zero == "before":
                    opt.zero_grad()
                if order == "step_first":
                    opt.step()
                for k in range(accumulate):
                    x, y = _batch(i * accumulate + k)
                    (F.cross_entropy(model(x), y) / accumulate).backward()
                if zero == "between":
                    opt.zero_grad()
                if order == "normal":
                    opt.step()
    return w


def _kinds(w):
    return [(a.kind, a.step) for a in w.anomalies]


# ----------------------------------------------------------------------------- stale_grad
def test_missing_zero_grad_is_named_at_the_first_step_it_happens():
    model = _net()
    w = _train(model, torch.optim.SGD(model.parameters(), lr=0.05), zero="never")
    assert _kinds(w) == [("stale_grad", 1)]  # step 1 applies step 0's gradient again
    msg = w.anomalies[0].message
    assert "zero_grad() is missing" in msg and "step 1" in msg


@pytest.mark.parametrize("accumulate", [1, 4])
def test_zero_grad_present_and_gradient_accumulation_are_silent(accumulate):
    model = _net()
    w = _train(model, torch.optim.SGD(model.parameters(), lr=0.05), accumulate=accumulate)
    assert w.anomalies == [] and w.current_step == 8


def test_zero_grad_without_set_to_none_is_silent():
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with graddbg.watch(model, opt, **RECORD) as w:
        for i in range(6):
            opt.zero_grad(set_to_none=False)
            x, y = _batch(i)
            F.cross_entropy(model(x), y).backward()
            opt.step()
    assert w.anomalies == []


# ----------------------------------------------------------------------------- empty_step
def test_zero_grad_between_backward_and_step():
    model = _net()
    w = _train(model, torch.optim.SGD(model.parameters(), lr=0.05), zero="between")
    assert _kinds(w) == [("empty_step", PATIENCE - 1)]
    assert "zero_grad() between backward() and step()" in w.anomalies[0].message


def test_step_before_backward():
    model = _net()
    w = _train(model, torch.optim.SGD(model.parameters(), lr=0.05), order="step_first")
    assert _kinds(w)[:1] == [("empty_step", PATIENCE - 1)]
    assert "before any backward pass" in w.anomalies[0].message


def _copy_loop(train_copy):
    """The loss computed with a deep copy of the watched model (``train_copy``), or with the
    model while the copy only evaluates under no_grad (a healthy EMA-style copy)."""
    import copy
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model, opt, **RECORD) as w:
            net = copy.deepcopy(model)
            for i in range(6):
                opt.zero_grad()
                x, y = _batch(i)
                loss = F.cross_entropy((net if train_copy else model)(x), y)
                loss.backward()
                with torch.no_grad():
                    held_out = F.cross_entropy(net(x), y)  # noqa: F841 (a copy that only evaluates)
                opt.step()
    return w


def test_a_loss_computed_with_a_copy_of_the_model_names_the_copy_not_step_order():
    """The ledger saw no backward pass, but one ran: through the copy's parameters. The
    finding says so (not "step() before backward()", a cause the ledger cannot show)."""
    w = _copy_loop(train_copy=True)
    assert [k for k, _ in _kinds(w)] == ["empty_step", "unused_param"]
    for a in w.anomalies:
        assert "the loss 'loss' (" in a.message and "test_hygiene.py:" in a.message
        assert "went through module 'net' (Sequential: 0.weight, 0.bias, 2.weight, 2.bias), none of them a " \
               "parameter of the watched model, which the SGD holds; those have gradients, so a backward pass ran " \
               "through them" in a.message, a.message
        assert "before loss.backward()" not in a.message and "model.forward(" not in a.message


def test_a_copy_that_only_evaluates_is_silent():
    assert _copy_loop(train_copy=False).anomalies == []


def test_step_before_backward_with_the_last_loss_still_held_keeps_its_cause():
    """The loop's frame holds the previous iteration's loss, whose graph reaches the watched
    model: not a copy, so the step order is named as before."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with graddbg.watch(model, opt, **RECORD) as w:
        for i in range(6):
            opt.zero_grad()
            opt.step()
            x, y = _batch(i)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
    assert _kinds(w)[:1] == [("empty_step", PATIENCE - 1)]
    assert "optimizer.step() is called before loss.backward()" in w.anomalies[0].message


# ----------------------------------------------------------------------------- orphan_param
def test_head_replaced_after_the_optimizer_was_built():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model[2] = nn.Linear(16, 3)  # the bug: the new head is in no param group
    w = _train(model, opt)
    assert _kinds(w) == [("orphan_param", PATIENCE - 1)]
    assert set(w.anomalies[0].params) == {"2.weight", "2.bias"} and w.anomalies[0].module == "2"


def test_batchnorm_left_out_of_the_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    model[0].requires_grad_(False)  # "frozen" layers passed in, the trainable BatchNorm left out
    opt = torch.optim.SGD([*model[0].parameters(), *model[3].parameters()], lr=0.05)
    w = _train(model, opt)
    assert [a.kind for a in w.anomalies] == ["orphan_param"]
    assert set(w.anomalies[0].params) == {"1.weight", "1.bias"}


def test_optimizer_rebuilt_after_the_head_changed_is_silent():
    model = _net()
    model[2] = nn.Linear(16, 3)
    w = _train(model, torch.optim.SGD(model.parameters(), lr=0.05))
    assert w.anomalies == []


# ----------------------------------------------------------------------------- no_update
def test_param_group_with_lr_zero():
    model = _net()
    opt = torch.optim.Adam([{"params": model[0].parameters()},
                            {"params": model[2].parameters(), "lr": 0.0}], lr=1e-3)
    w = _train(model, opt)
    assert _kinds(w) == [("no_update", PATIENCE - 1)]
    a = w.anomalies[0]
    assert set(a.params) == {"2.weight", "2.bias"} and "learning rate is 0" in a.message


def test_lr_warmup_from_zero_is_silent():
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: s / 4)  # lr 0 at the first step only
    with graddbg.watch(model, opt, **RECORD) as w:
        for i in range(8):
            opt.zero_grad()
            x, y = _batch(i)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
    assert w.anomalies == []


# ----------------------------------------------------------------------------- dead_grad
def test_dead_relu_layer_is_named():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with graddbg.watch(model, opt, **RECORD) as w:
        for i in range(4 + DEAD_PATIENCE + 2):
            if i == 3:  # a bad step pushes every hidden unit negative: the ReLUs die
                with torch.no_grad():
                    model[0].bias.fill_(-100.0)
            opt.zero_grad()
            x, y = _batch(i)
            F.cross_entropy(model(x), y).backward()
            opt.step()
    kinds = [(a.kind, a.step) for a in w.anomalies]
    assert kinds == [("dead_grad", 3 + DEAD_PATIENCE - 1)], kinds
    a = w.anomalies[0]
    # (the next layer's weight sees only zeros from the dead units: its gradient is zero too)
    assert set(a.params) == {"0.weight", "0.bias", "2.weight"} and a.module == "0" and "exactly zero" in a.message


def test_a_healthy_relu_net_has_no_dead_gradients():
    model = _net()
    w = _train(model, torch.optim.SGD(model.parameters(), lr=0.05), steps=12)
    assert w.anomalies == []


# ----------------------------------------------------------------------------- policies
def test_each_finding_has_a_policy_and_none_turns_it_off():
    model = _net()
    w = _train(model, torch.optim.SGD(model.parameters(), lr=0.05), zero="never",
               watch_kwargs={"stale_grad": None})
    assert w.anomalies == []
    with pytest.warns(graddbg.GraddbgWarning, match="stale gradients"):
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with graddbg.watch(model, opt) as w:  # the default policy: warn, once per finding
            for i in range(6):
                x, y = _batch(i)
                F.cross_entropy(model(x), y).backward()
                opt.step()
    assert [a.kind for a in w.anomalies] == ["stale_grad"]
    with pytest.raises(ValueError, match=r"stale_grad=...\): got 'loud'"):
        graddbg.watch(model, opt, stale_grad="loud")


def test_findings_survive_save_and_load(tmp_path):
    model = _net()
    w = _train(model, torch.optim.SGD(model.parameters(), lr=0.05), zero="never")
    run = graddbg.load(w.save(tmp_path / "run.parquet"))
    assert [(a.kind, a.step, a.params) for a in run.anomalies] == [(a.kind, a.step, a.params) for a in w.anomalies]
    html = w.report(tmp_path / "r.html").read_text()
    assert "Training hygiene" in html and "zero_grad() is missing" in html


def test_the_warning_points_at_the_users_line():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.warns(graddbg.GraddbgWarning) as rec:
        with graddbg.watch(model, opt):
            for i in range(3):
                x, y = _batch(i)
                F.cross_entropy(model(x), y).backward()
                opt.step()  # <- the warning's line
    assert rec[0].filename == __file__


# ----------------------------------------------------------------------------- AMP
def test_gradscaler_skipped_steps_are_overflow_never_anomalies():
    """A GradScaler not passed to the watch, whose steps overflow now and then (an
    overflowing batch, as every long AMP run has): found at the first backward pass (it
    scaled the loss handed to backward()), so even the first step's overflow is recorded as
    one; statistics unscaled on every step, no anomaly, no warning."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=3)
    norms = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with graddbg.watch(model, opt) as w:
            for i in range(12):
                opt.zero_grad()
                x = torch.randn(8, 4) * (1e30 if i in (0, 5, 6) else 1.0)  # these overflow
                scaler.scale(model(x).pow(2).mean()).backward()
                scale = scaler.get_scale()
                norm = torch.linalg.vector_norm(torch.stack([(p.grad / scale).norm() for p in model.parameters()]))
                if torch.isfinite(norm):
                    norms.append(float(norm))
                scaler.step(opt)
                scaler.update()
    steps = w.steps
    assert w.anomalies == [] and steps["overflow"].tolist() == [True] + [False] * 4 + [True, True] + [False] * 5
    assert steps.loc[~steps["overflow"], "global_norm"].tolist() == pytest.approx(norms, rel=1e-5)
    assert steps["scale"].tolist()[:5] == [2.0 ** 16] + [2.0 ** 15] * 3 + [2.0 ** 16]  # skipped, halved, grown after 3


def _scaled_sqrt(eps, steps, init_scale=2.0 ** 16, **kw):
    """A loss with sqrt(x + eps) of a term that is 0 on some rows (an infinite gradient at
    eps=0: NaN after the chain rule), under a GradScaler found in the loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model, opt, **kw) as w:
            for _ in range(steps):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x).float()
                d = (out[:, None] - out[None]).pow(2).sum(-1)  # (0 on the diagonal)
                loss = F.mse_loss(out, y) - 0.01 * torch.sqrt(d + eps).mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    return w


def test_a_gradscaler_skipping_every_step_below_scale_one_is_nonfinite():
    """A NaN gradient at every step: the GradScaler skips them all, halving its scale each
    time; past a scale of 1 no overflow explains it, and it is named (recorded here)."""
    w = _scaled_sqrt(0.0, 30, nonfinite="record")
    found = [a for a in w.anomalies if a.kind == "nonfinite"]
    assert len(found) == 1, [a.message for a in w.anomalies]
    a = found[0]
    assert 16 <= a.step <= 30 and a.value < 1.0
    assert "skipped every step from step 0" in a.message and "not finite at any scale" in a.message, a.message
    assert "since the watch began" in a.message
    assert w.steps["overflow"].all()


def test_a_gradscaler_skipping_every_step_raises_by_default():
    with pytest.raises(graddbg.GradientAnomalyError, match="not finite at any scale"):
        _scaled_sqrt(0.0, 30)


@pytest.mark.parametrize("eps, init_scale, overflows", [(1e-6, 2.0 ** 16, 0), (1e-6, 2.0 ** 50, 20)],
                         ids=["the fix", "a long run of overflows from a huge initial scale"])
def test_gradscaler_skips_that_end_above_scale_one_are_silent(eps, init_scale, overflows):
    """Overflows that a lower scale cures, even 20 and more in a row, are the scaler's design."""
    w = _scaled_sqrt(eps, 50, init_scale=init_scale)
    assert w.anomalies == [], [a.message for a in w.anomalies]
    flags = w.steps["overflow"].tolist()
    assert all(flags[:overflows]) and not any(flags[-5:]), flags


@pytest.mark.parametrize("act", [None, "relu"])
def test_a_dead_gradient_names_relus_only_when_the_model_has_them(act):
    """Issue 39, point 3: a cause the ledger contradicts is worse than none. A layer whose
    gradient goes to exactly zero after 3 steps (a gate closes) is named; "ReLU" appears in
    the cause only when the model holds ReLU modules."""
    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1)
            self.act = nn.ReLU() if act else nn.Identity()
            self.open = True

        def forward(self, x):
            h = self.a(x)
            return self.b(self.act(h) * (1.0 if self.open else 0.0))  # (closed: exactly zero gradients)

    torch.manual_seed(0)
    model = Gated()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model, opt) as w:
            for i in range(12):
                model.open = i < 3
                ((model(x) - y) ** 2).mean().backward()
                opt.step()
                opt.zero_grad()
    dead = [a for a in w.anomalies if a.kind == "dead_grad"]
    assert dead and {"a.weight", "a.bias"} <= set(dead[0].params)  # (and b.weight: its input is 0)
    if act:
        assert "ReLU units only see negative inputs" in dead[0].message
    else:
        assert "ReLU" not in dead[0].message.replace("no ReLU module", "")
        assert "the model has no ReLU module" in dead[0].message


def test_a_target_network_no_optimizer_holds_is_named_once_as_a_fact():
    """A DQN-style target network (trainable flags left on, copied from the online network,
    held by no param group) never receives a gradient by design: named once as a fact (never
    raised, even under unused_param="raise"), not as a bug. Its twin, a layer the optimizer
    holds but the forward never calls, is named as a bug."""
    class QNets(nn.Module):
        def __init__(self):
            super().__init__()
            self.online, self.target, self.spare = nn.Linear(4, 2), nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, x):
            return self.online(x), self.target(x).detach()

    for spare_in_optimizer in (False, True):
        torch.manual_seed(0)
        model = QNets()
        held = list(model.online.parameters()) + (list(model.spare.parameters()) if spare_in_optimizer else [])
        opt = torch.optim.SGD(held, lr=0.01)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with graddbg.watch(model, opt, unused_param="raise" if not spare_in_optimizer else "warn") as w:
                for i in range(6):
                    q, t = model(torch.randn(8, 4))
                    ((q - t) ** 2).mean().backward()
                    opt.step()
                    opt.zero_grad()
                    if i % 3 == 2:
                        model.target.load_state_dict(model.online.state_dict())
        bugs = [a for a in w.anomalies if a.kind == "unused_param" and a.severity == "bug"]
        facts = [a for a in w.anomalies if a.kind == "unused_param" and a.severity == "fact"]
        assert len(facts) == 1 and facts[0].message.startswith("graddbg.watch: a fact, not a bug: ")
        assert "no param group of the SGD holds them, so the optimizer never trains them" in facts[0].message
        assert "to silence it, freeze them (requires_grad_(False)) or pass unused_param=None" in facts[0].message
        assert sum(issubclass(c.category, graddbg.CoverageWarning) for c in caught) == 1 + spare_in_optimizer
        if spare_in_optimizer:
            assert set(facts[0].params) == {"target.weight", "target.bias"}
            assert len(bugs) == 1 and set(bugs[0].params) == {"spare.weight", "spare.bias"}
        else:
            assert set(facts[0].params) == {"target.weight", "target.bias", "spare.weight", "spare.bias"}
            assert not bugs, bugs[0].message


def test_unused_parameters_of_a_model_whose_forward_was_never_seen_claim_no_forward_cause():
    """Issue 39, point 3: the model is called as model.forward(x) (no forward hook runs): the
    finding says the watch never saw the forward pass, not "unused in the forward pass"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model.add_module("spare", nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model, opt) as w:
            for _ in range(4):
                x = torch.randn(8, 4)
                model[1](model[0](x)).pow(2).mean().backward()  # (the spare layer is never called)
                opt.step()
                opt.zero_grad()
    unused = [a for a in w.anomalies if a.kind == "unused_param"]
    assert len(unused) == 1 and set(unused[0].params) == {"spare.weight", "spare.bias"}
    assert "never saw the model's forward pass run" in unused[0].message
    assert "unused in the forward pass" not in unused[0].message


def test_a_library_layer_unused_by_design_is_a_fact_and_the_users_own_unused_layer_a_bug():
    """BERT's pooler under mean pooling (transformers builds it whatever the loss uses) is
    named once, at close, as a fact; the same model with an unused head of the user's own is
    named as a bug (cut off from the loss)."""
    from transformers import BertConfig, BertModel

    for spare in (False, True):
        torch.manual_seed(0)
        cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64)
        model = nn.ModuleDict({"bert": BertModel(cfg), "head": nn.Linear(32, 2)})
        if spare:  # (a layer of the user's that the forward never calls)
            model["spare"] = nn.Linear(32, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids, y = torch.randint(0, 100, (8, 12)), torch.randint(0, 2, (8,))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with graddbg.watch(model, opt) as w:
                for _ in range(5):
                    h = model["bert"](input_ids=ids).last_hidden_state.mean(1)
                    F.cross_entropy(model["head"](h), y).backward()
                    opt.step()
                    opt.zero_grad()
        facts = [a for a in w.anomalies if a.severity == "fact"]
        bugs = [a for a in w.anomalies if a.severity == "bug"]
        assert len(facts) == 1 and facts[0].params == ("bert.pooler.dense.weight", "bert.pooler.dense.bias")
        assert "they belong to bert.pooler (BertPooler, from transformers), a layer the library builds" \
            in facts[0].message
        if spare:
            assert [a.kind for a in bugs] == ["unused_param"] and bugs[0].params == ("spare.weight", "spare.bias")
        else:
            assert bugs == []


# --------------------------------------------------------------------------- passes thrown away before the step
def _accumulate(where, steps=4, accum=4, closure=False, **kw):
    """Gradient accumulation over ``accum`` micro-batches per step; ``where`` says what runs
    around the micro-batches: "outside" (zero_grad once per step: healthy), "inside" (the
    bug), "pcgrad" (per-task gradients summed by hand), "two lines" (a GAN-like pair of
    losses), "sam" (a second pass at perturbed weights)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model, opt, **kw) as w:
            for s in range(steps):
                if where != "inside":
                    opt.zero_grad()
                kept = []
                for m in range(accum if where != "two lines" else 1):
                    xb, yb = x[(s * accum + m) * 4:][:4], y[(s * accum + m) * 4:][:4]
                    if where in ("inside", "pcgrad"):
                        opt.zero_grad()
                    if where == "sam" and m == 1:  # (the ascent to the perturbed weights, undone before the step)
                        saved = [p.detach().clone() for p in model.parameters()]
                        with torch.no_grad():
                            for p in model.parameters():
                                p.add_(0.01 * torch.sign(p.grad))
                        opt.zero_grad()
                    F.mse_loss(model(xb), yb).backward()
                    if where == "pcgrad":
                        kept.append([p.grad.clone() for p in model.parameters()])
                if where == "two lines":
                    F.mse_loss(model(x[:4]), y[:4]).backward()   # the other network's loss
                    opt.zero_grad()
                    F.mse_loss(model(x[4:8]), y[4:8]).backward()
                if where == "pcgrad":
                    for p, *gs in zip(model.parameters(), *kept):
                        p.grad = torch.stack(gs).mean(0)
                if where == "sam":
                    with torch.no_grad():
                        for p, q in zip(model.parameters(), saved):
                            p.copy_(q)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
    return [a for a in w.anomalies if a.kind == "applied_grad"], w


def test_zero_grad_inside_the_accumulation_loop_is_named_with_its_line():
    found, _ = _accumulate("inside")
    assert len(found) == 1, found
    msg = found[0].message
    assert "4 backward passes ran from the same line" in msg and "test_hygiene.py:" in msg, msg
    assert "first 3 passes' gradients were thrown away" in msg and "zero_grad() inside" in msg
    assert found[0].step == PATIENCE - 1


@pytest.mark.parametrize("where", ["outside", "pcgrad", "two lines", "sam"])
def test_passes_that_accumulate_or_are_combined_by_hand_are_not_discarded(where):
    found, w = _accumulate(where, steps=5, accum=2 if where == "sam" else 4)
    assert found == [] and not w.anomalies, [a.message for a in w.anomalies]


def test_lbfgs_closure_evaluations_are_not_discarded_passes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    x, y = torch.randn(32, 4), torch.randn(32, 1)

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    with graddbg.watch(model, opt) as w:
        for _ in range(5):
            opt.step(closure)
    assert not [a for a in w.anomalies if a.kind == "applied_grad"], [a.message for a in w.anomalies]


@pytest.mark.parametrize("max_norm", [0.0, 0.5])
def test_gradients_clipped_to_zero_before_every_step_are_empty_steps(max_norm):
    """clip_grad_norm_(max_norm=0), meant as "no clipping", multiplies every gradient by 0:
    non-zero where backward ended, exactly zero at the step. A real clip stays silent."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model, opt, empty_step="record") as w:
            for _ in range(6):
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                opt.step()
    found = [a for a in w.anomalies if a.kind == "empty_step"]
    if max_norm:
        assert not w.anomalies, [a.message for a in w.anomalies]
        return
    assert len(found) == 1 and found[0].step == PATIENCE - 1, [a.message for a in w.anomalies]
    assert "multiplied to exactly 0 before the step" in found[0].message and "max of 0" in found[0].message


# --------------------------------------------------------------------------- a bug in one check costs that check alone
@pytest.mark.parametrize("name, event", [("EmptyStep", "read"), ("EmptyStep", "on_backward_end"),
                                         ("ExplodeCheck", "read")])
def test_a_failing_check_is_switched_off_and_the_record_and_other_findings_stand(monkeypatch, name, event):
    """A bug inside one detector (made to raise; ExplodeCheck reads before StaleGrad) warns
    once, naming it, and switches it off; every step is still recorded and the other checks
    still find the missing zero_grad()."""
    import graddbg.checks as checks

    def broken(self, *args):
        raise RuntimeError("boom")

    monkeypatch.setattr(getattr(checks, name), event, broken)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with graddbg.watch(model, opt, stale_grad="record") as w:
            for i in range(6):
                x, y = _batch(i)
                F.cross_entropy(model(x), y).backward()  # (zero_grad() missing: stale gradients)
                opt.step()
    errors = [str(r.message) for r in rec if "internal error" in str(r.message)]
    assert len(errors) == 1 and f"{name}.{event}" in errors[0] and "That check is off" in errors[0], errors
    assert len(w.steps) == 6 and w.steps["global_norm"].notna().all()
    assert [a.kind for a in w.anomalies] == ["stale_grad"], [a.message for a in w.anomalies]


def test_under_several_processes_a_failing_check_is_not_switched_off_on_one_rank(monkeypatch):
    """A check off on one rank only would leave its collectives (and the step's packed sum)
    different on the others: with a world size over 1 the step-level guard handles it, as
    before (one warning naming the boundary; the check stays on)."""
    import graddbg.checks as checks

    calls = []

    def broken(self, step):
        calls.append(step.index)
        raise RuntimeError("boom")

    monkeypatch.setattr(checks.EmptyStep, "read", broken)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        w = graddbg.Watch(model, opt)
        object.__setattr__(w._steps.ctx, "world_size", 2)  # (as under torchrun: the rule, not the collectives)
        try:
            for i in range(4):
                opt.zero_grad()
                x, y = _batch(i)
                F.cross_entropy(model(x), y).backward()
                opt.step()
        finally:
            w.close()
    errors = [str(r.message) for r in rec if "internal error" in str(r.message)]
    assert len(errors) == 1 and "internal error in _on_opt_pre" in errors[0] and "That check is off" not in errors[0]
    assert calls == [0, 1, 2, 3]  # (still on at every step)
