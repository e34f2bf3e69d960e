"""watch() in the ways real training stacks use it (issue 16): closures, copies, late
parameters, library source lines, outside NaNs, early explosions, sparse gradients, loops
that skip a NaN step, and graddbg's own failures never taking training down."""
from __future__ import annotations

import copy
import io
import math
import os
import pickle
import textwrap
import warnings

import numpy as np
import pytest
import torch
from torch import nn
import torch.nn.functional as F

import graddbg
from graddbg.checks import StatsRecorder
from graddbg import _source
from problems import PROBLEMS, hook_counts


def _global_norm(model: nn.Module) -> float:
    return torch.linalg.vector_norm(torch.stack([p.grad.detach().double().norm()
                                                 for p in model.parameters() if p.grad is not None])).item()


# ------------------------------------------------------------------ step(closure)
def test_lbfgs_records_the_first_closure_evaluation_of_each_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    evaluations = []

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        evaluations.append(_global_norm(model))
        return loss

    firsts = []
    with graddbg.watch(model, opt) as w:
        for _ in range(3):
            n = len(evaluations)
            opt.step(closure)
            firsts.append(evaluations[n])
    assert len(evaluations) > 3  # several evaluations per step
    assert w.steps["global_norm"].tolist() == pytest.approx(firsts, rel=1e-6)


def test_sgd_step_with_closure_records_that_closures_gradients():
    torch.manual_seed(0)
    model = PROBLEMS["mlp"].make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = PROBLEMS["mlp"].make_batch(torch.device("cpu"))
    seen = []

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        seen.append(_global_norm(model))
        return loss

    with graddbg.watch(model, opt) as w:
        for _ in range(4):
            opt.step(closure)
    assert w.steps["global_norm"].tolist() == pytest.approx(seen, rel=1e-6)


# ------------------------------------------------------------------ copies
@pytest.mark.parametrize("activations", [False, True], ids=["default", "activations"])
def test_copies_made_while_watched_carry_nothing_of_graddbg(activations, tmp_path):
    model = PROBLEMS["mlp"].make_model()
    fresh = hook_counts(PROBLEMS["mlp"].make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = PROBLEMS["mlp"].make_batch(torch.device("cpu"))
    with graddbg.watch(model, opt, activations=activations):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        ema = copy.deepcopy(model)
        blob = pickle.dumps(model)
        buf = io.BytesIO()
        torch.save(model, buf)
        torch.save(model.state_dict(), tmp_path / "weights.pt")
        assert hook_counts(model) != fresh  # the watched model itself is hooked
    assert hook_counts(ema) == fresh
    assert hook_counts(pickle.loads(blob)) == fresh
    assert b"graddbg" not in blob and b"graddbg" not in buf.getvalue()
    assert "__getstate__" not in vars(model) and hook_counts(model) == fresh
    torch.load(tmp_path / "weights.pt", weights_only=True)
    # a NaN in the copy is the copy's own business: nothing of the closed watch fires
    with torch.no_grad():
        ema[0].weight[0, 0] = float("nan")
    ema(x).sum().backward()


def test_copy_taken_inside_watch_is_not_watched_while_the_watch_runs():
    model = PROBLEMS["mlp"].make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = PROBLEMS["mlp"].make_batch(torch.device("cpu"))
    with graddbg.watch(model, opt) as w:
        ema = copy.deepcopy(model)
        for _ in range(3):
            F.cross_entropy(model(x), y).backward()
            ema(x).sum().backward()  # the EMA copy trains its own way: no record, no boundary
            opt.step()
            opt.zero_grad()
    assert w.current_step == 3 and len(w.stats) == 3 * 6


# ------------------------------------------------------------------ late parameters
def test_parameter_unfrozen_at_step_3_is_recorded_from_step_3():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    ref = {}
    with graddbg.watch(model, opt) as w:
        for step in range(6):
            if step == 3:
                model[0].requires_grad_(True)
            model(x).pow(2).mean().backward()
            ref[step] = model[0].weight.grad.norm().item() if model[0].weight.grad is not None else None
            opt.step()
            opt.zero_grad()
    rows = w.stats[w.stats.name == "0.weight"]
    assert rows["step"].tolist() == [3, 4, 5]
    assert rows["norm"].tolist() == pytest.approx([ref[3], ref[4], ref[5]], rel=1e-6)
    assert w.stats[w.stats.step == 0]["name"].tolist() == ["2.weight", "2.bias"]


def test_parametrized_weight_belongs_to_its_layer():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    torch.nn.utils.parametrizations.weight_norm(model[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with graddbg.watch(model, opt) as w:
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
    mods = dict(zip(w.stats["name"].astype(str), w.stats["module"].astype(str)))
    assert {n: m for n, m in mods.items() if "parametrizations" in n} == {
        "0.parametrizations.weight.original0": "0", "0.parametrizations.weight.original1": "0"}
    assert set(w.summary(by="module")["module"]) == {"0", "1"}


def test_update_ratio_of_a_zero_initialised_bias_is_nan_not_inf():
    model = nn.Linear(3, 2)
    nn.init.zeros_(model.bias)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with graddbg.watch(model, opt, update_every=1) as w:
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
    ratio = w.stats.set_index("name")["update_ratio"]
    assert math.isnan(ratio["bias"]) and ratio["weight"] > 0
    assert not np.isinf(w.summary()["update_ratio_mean"]).any()


# ------------------------------------------------------------------ source lines
def test_libraries_next_to_torch_are_user_code():
    torch_dir = os.path.dirname(torch.__file__)
    assert _source.is_internal(os.path.join(torch_dir, "nn", "modules", "linear.py"))
    for lib in ("torchvision", "torchaudio", "torch_geometric", "torchmetrics"):
        assert not _source.is_internal(os.path.join(os.path.dirname(torch_dir), lib, "models", "x.py")), lib


def test_source_of_a_nan_made_in_a_library_next_to_torch_is_its_own_file(tmp_path, monkeypatch):
    fake_torch = tmp_path / "torch"
    lib = tmp_path / "torchvisionish"
    fake_torch.mkdir()
    lib.mkdir()
    (lib / "layers.py").write_text(textwrap.dedent("""
        import torch
        class Bad(torch.nn.Module):
            def forward(self, x):
                return torch.log(x - x)   # log(0): -inf in forward
    """))
    monkeypatch.setattr(_source, "_SKIP", (os.path.join(str(fake_torch), ""),) + _source._SKIP)
    monkeypatch.syspath_prepend(str(tmp_path))
    from torchvisionish.layers import Bad  # noqa: E402

    with pytest.raises(graddbg.NonFiniteError) as info:
        with graddbg.find_nonfinite(Bad()):
            Bad()(torch.ones(3))
    assert info.value.anomaly.source.startswith(str(lib / "layers.py"))


# ------------------------------------------------------------------ outside NaNs
def _nan_weight_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[2].weight[1, 3] = float("nan")
    return model


def test_nan_weight_is_blamed_on_itself_in_watch():
    model = _nan_weight_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(graddbg.NonFiniteError, match=r"non-finite parameter 2.weight") as info:
        with graddbg.watch(model, opt):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
    a = info.value.anomaly
    assert (a.name, a.module) == ("2.weight", "2")


def test_nan_weight_stops_find_nonfinite():
    model = _nan_weight_model()
    with pytest.raises(graddbg.NonFiniteError, match=r"non-finite parameter 2.weight") as info:
        with graddbg.find_nonfinite(model):
            model(torch.randn(3, 4)).sum().backward()
    assert info.value.anomaly.module == "2"


def test_nan_buffer_is_blamed_on_itself():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    model[1].running_mean[0] = float("inf")
    model.eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(graddbg.NonFiniteError, match=r"non-finite buffer 1.running_mean"):
        with graddbg.watch(model, opt):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()


# ------------------------------------------------------------------ explosions, replay verdict
def test_a_million_fold_jump_at_step_1_is_flagged_at_step_1():
    model = nn.Linear(4, 1)
    with graddbg.watch(model, explode="record") as w:
        for scale in (1.0, 1e6, 1.0, 1.0):
            model.zero_grad()
            (model(torch.ones(2, 4)).sum() * scale).backward()
    assert [(a.kind, a.step) for a in w.anomalies] == [("explode", 1)]


class _Sqrt0(nn.Module):
    def forward(self, x):
        return (x - x).sqrt()  # sqrt(0): an infinite derivative in backward


def _watched_sqrt0_step():
    """One watched step of a model whose backward makes a NaN, deterministically."""
    model = nn.Sequential(nn.Linear(3, 3), _Sqrt0(), nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with graddbg.watch(model, opt, nonfinite="record") as w:
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
    return w


def test_replay_verdict_reproduced_for_a_deterministic_nan():
    w = _watched_sqrt0_step()
    a = w.anomalies[0]
    assert a.reproduced is True and a.op == "SqrtBackward0"
    assert "reproduced by a replay" in str(a)


def test_replay_verdict_not_reproduced_when_the_nan_does_not_come_back():
    calls = []

    class Flaky(nn.Module):  # a one-off corruption in backward, as faulty hardware would make
        def forward(self, x):
            y = x * 1.0
            if y.requires_grad:
                y.register_hook(lambda g: g * float("nan") if not calls.append(1) and len(calls) == 1 else g)
            return y

    model = nn.Sequential(nn.Linear(3, 3), Flaky(), nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with graddbg.watch(model, opt, nonfinite="record") as w:
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
    assert len(calls) == 2  # the step and its replay
    a = w.anomalies[0]
    assert a.reproduced is False and "NOT reproduced" in str(a)


# ------------------------------------------------------------------ never crash training
def test_sparse_embedding_with_sparse_adam_records_torch_norms():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 8, sparse=True))
    opt = torch.optim.SparseAdam(model.parameters(), lr=0.1)
    refs = []
    with graddbg.watch(model, opt) as w:
        for _ in range(3):
            model(torch.tensor([1, 2, 2, 7])).sum().backward()
            g = model[0].weight.grad
            refs.append(torch.linalg.vector_norm(g.coalesce().values()).item())
            opt.step()
            opt.zero_grad()
    assert w.stats["norm"].tolist() == pytest.approx(refs, rel=1e-6)


def test_a_skipped_nan_step_leaves_an_anomaly():
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    with graddbg.watch(model, opt, nonfinite="record") as w:
        for i in range(4):
            loss = model(x).sum() * (float("nan") if i == 1 else 1.0)
            loss.backward()
            if not torch.isfinite(loss):  # the usual guard: drop the step
                opt.zero_grad()
                continue
            opt.step()
            opt.zero_grad()
    assert [a.kind for a in w.anomalies] == ["nonfinite"]
    assert w.anomalies[0].params == ("weight", "bias")


def test_an_internal_failure_warns_once_and_training_goes_on(monkeypatch):
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()

    def broken(*a, **k):
        raise RuntimeError("a bug inside graddbg")

    monkeypatch.setattr(StatsRecorder, "read", broken)
    with pytest.warns(graddbg.GraddbgWarning) as rec:  # (and the coverage warning: nothing was read)
        with graddbg.watch(model, opt) as w:
            for _ in range(3):
                model(torch.randn(4, 3)).sum().backward()
                opt.step()
                opt.zero_grad()
    errors = [str(r.message) for r in rec if "internal error" in str(r.message)]
    assert len(errors) == 1 and "_on_opt_pre" in errors[0] and "a bug inside graddbg" in errors[0]
    assert not torch.equal(model.weight, before) and w.current_step == 3


def test_accelerate_prepared_optimizer_is_unwrapped():
    accelerate = pytest.importorskip("accelerate")  # a dev dependency (pyproject's [dev])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    seen = []
    with graddbg.watch(model, opt) as w:
        for i in range(8):
            with acc.accumulate(model):
                acc.backward(model(torch.randn(4, 4)).pow(2).mean())
                if acc.sync_gradients:
                    seen.append(_global_norm(model))
                    acc.clip_grad_norm_(model.parameters(), 0.01)
                opt.step()
                opt.zero_grad()
    assert len(w.steps) == 4
    assert w.steps["global_norm"].tolist() == pytest.approx(seen, rel=1e-6)
    assert (w.steps["clipped_norm"] <= 0.0100001).all()


# ------------------------------------------------------------------ a real model from transformers
def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")  # a dev dependency (pyproject's [dev])
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    model.gradient_checkpointing_enable()
    model.train()
    return model


def test_gpt2_with_checkpointing_matches_torchs_norms_and_reports_tied_weights_once():
    model = _tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    seen = []
    with graddbg.watch(model, opt, update_every=1) as w:
        for _ in range(3):
            model(input_ids=ids, labels=ids).loss.backward()
            seen.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
            opt.step()
            opt.zero_grad()
    names = [n for n, _ in model.named_parameters()]
    assert w.stats[w.stats.step == 0]["name"].astype(str).tolist() == names  # lm_head tied to wte: once
    assert w.steps["global_norm"].tolist() == pytest.approx(seen, rel=1e-5)
    assert w.anomalies == []


def test_gpt2_nan_weight_is_blamed_on_the_weight():
    model = _tiny_gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[0, 0] = float("nan")
    ids = torch.randint(0, 50, (2, 12))
    with pytest.raises(graddbg.NonFiniteError) as info:
        with graddbg.watch(model, opt):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
    assert info.value.anomaly.name == "transformer.h.1.mlp.c_fc.weight"
    assert info.value.anomaly.module == "transformer.h.1.mlp.c_fc"
    with pytest.raises(graddbg.NonFiniteError, match="non-finite parameter transformer.h.1.mlp.c_fc.weight"):
        with graddbg.find_nonfinite(model):
            model(input_ids=ids, labels=ids).loss.backward()


def test_replay_verdict_survives_save_load_and_shows_in_the_report(tmp_path):
    w = _watched_sqrt0_step()
    w.save(tmp_path / "run.parquet")
    assert graddbg.load(tmp_path / "run.parquet").anomalies[0].reproduced is True
    html = w.report(tmp_path / "report.html").read_text()
    assert "reproduced: a deterministic bug" in html


def test_a_gradscaler_that_was_not_passed_is_found_and_used():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with graddbg.watch(model, opt) as w:  # not passed: found at the first step, silently
            for _ in range(3):
                scaler.scale(model(torch.randn(4, 3)).sum()).backward()
                seen.append(_global_norm(model) / scaler.get_scale())
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
    assert w.meta["scaler"] == "found"
    assert w.steps["global_norm"].tolist() == pytest.approx(seen, rel=1e-6)  # unscaled on every step
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with graddbg.watch(model, opt, scaler=scaler) as w:  # passed: the same, unscaled norms
            scaler.scale(model(torch.randn(4, 3)).sum()).backward()
            seen = _global_norm(model) / scaler.get_scale()
            scaler.step(opt)
            scaler.update()
    assert w.steps["global_norm"].iloc[0] == pytest.approx(seen, rel=1e-6)


def test_a_failure_inside_the_backward_pass_never_raises_there(monkeypatch):
    """graddbg's work at the end of a backward pass (inside autograd's engine) fails: the
    user's backward returns normally, one warning says so, the training goes on."""
    from graddbg.checks.ledger import LedgerKeeper

    def broken(*a, **k):
        raise RuntimeError("a bug inside graddbg's backward hook")

    monkeypatch.setattr(LedgerKeeper, "on_backward_end", broken)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(graddbg.GraddbgWarning) as rec:
        with graddbg.watch(model, opt) as w:
            for _ in range(3):
                model(torch.randn(4, 3)).sum().backward()   # (raises nothing)
                opt.step()
                opt.zero_grad()
    errors = [str(r.message) for r in rec if "internal error" in str(r.message)]
    assert len(errors) == 1 and "a bug inside graddbg's backward hook" in errors[0], errors
    assert w.current_step == 3 and len(w.steps) == 3


def test_an_optimizer_whose_step_calls_super_step_is_one_step_per_call():
    """torch hooks each optimizer class's step, so a subclass whose step calls super().step()
    runs the step hooks twice, nested (once a plain instance of the base class exists): one
    step for the watch, no double_step, and the step audit's twin runs none of them."""
    class MySGD(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure=None):
            return super().step(closure)

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # (the base class's step hooked)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = MySGD(model.parameters(), lr=0.01)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append(1))
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model, opt) as w:
            for _ in range(8):
                F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    assert len(calls) == 16  # (torch's own behaviour: the user's hook, twice per step)
    assert w.steps["step"].tolist() == list(range(8))
    assert not w.anomalies
