"""watch(): statistics against naive references, step semantics, lifecycle, bad input."""
from __future__ import annotations

import copy
import gc
import inspect
import io
import math
import pickle
import warnings

import numpy as np
import pytest
import torch
from torch import nn
import torch.nn.functional as F

import graddbg
from graddbg.checks import UpdateRatio
from graddbg._errors import CompileWarning, CoverageWarning
from problems import PROBLEMS, hook_counts, optimizer_hook_counts


def _naive(model, names_grads=None):
    """Reference statistics computed the obvious way, in float64."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.detach().double()
        fin = torch.isfinite(g)
        out[name] = {
            "norm": g.norm().item(), "absmax": g.abs().max().item(),
            "nonfinite": int((~fin).sum()), "mean": g.mean().item(),
            "std": g.std().item() if g.numel() > 1 else 0.0, "zero_frac": (g == 0).double().mean().item(),
        }
    return out


@pytest.mark.parametrize("problem", list(PROBLEMS), ids=list(PROBLEMS))
def test_statistics_equal_naive_reference(problem, device):
    pb = PROBLEMS[problem]
    model = pb.make_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    refs = []
    with graddbg.watch(model, opt, stats=("norm", "absmax", "nonfinite", "mean", "std", "zero_frac")) as w:
        for i in range(3):
            x, y = pb.make_batch(device)
            pb.loss(model(x), y).backward()
            refs.append(_naive(model))
            opt.step()
            opt.zero_grad()
    df = w.stats
    assert sorted(df["step"].unique()) == [0, 1, 2]
    assert list(df[df.step == 0]["name"]) == [n for n, _ in model.named_parameters()]
    for step, ref in enumerate(refs):
        for name, r in ref.items():
            row = df[(df.step == step) & (df.name == name)].iloc[0]
            for key in ("norm", "absmax", "mean", "std", "zero_frac"):
                assert row[key] == pytest.approx(r[key], rel=1e-5, abs=1e-12), (step, name, key)
            assert row["nonfinite"] == r["nonfinite"]
            assert row["module"] == name.rsplit(".", 1)[0]
    # the global norm is the root of the sum of squares of the parameter norms
    for step, ref in enumerate(refs):
        gn = math.sqrt(sum(r["norm"] ** 2 for r in ref.values()))
        assert w.steps.loc[w.steps.step == step, "global_norm"].item() == pytest.approx(gn, rel=1e-6)


def test_one_shot_grad_stats_matches_watch():
    model = PROBLEMS["mlp"].make_model()
    x, y = PROBLEMS["mlp"].make_batch(torch.device("cpu"))
    F.cross_entropy(model(x), y).backward()
    df = graddbg.stats.grad_stats(model)
    ref = _naive(model)
    for _, row in df.iterrows():
        assert row["norm"] == pytest.approx(ref[row["name"]]["norm"], rel=1e-6)
        assert row["zero_frac"] == pytest.approx(ref[row["name"]]["zero_frac"])
    assert hook_counts(model) == hook_counts(PROBLEMS["mlp"].make_model())


def test_huge_finite_gradients_give_exact_finite_norm():
    p = nn.Parameter(torch.zeros(1000))
    model = nn.Module()
    model.p = p
    with graddbg.watch(model, nonfinite="raise") as w:
        p.grad = torch.full((1000,), 1e20)
        w.step()
    row = w.stats.iloc[0]
    assert math.isfinite(row["norm"])
    assert row["norm"] == pytest.approx(1e20 * math.sqrt(1000), rel=1e-6)
    assert row["absmax"] == pytest.approx(1e20)
    assert row["nonfinite"] == 0
    assert not w.anomalies


@pytest.mark.parametrize("stats", [("norm", "absmax"), ("norm",)])
def test_vanishing_gradients_get_torchs_own_norm_without_a_second_read(stats):
    # squares of 1e-26 are below float32's smallest number: torch's float32 norm is 0, and
    # the watch says what torch says (no second read: a vanishing layer is common, and its
    # norm is below any threshold either way); the largest magnitude still tells it apart
    # from a gradient that really is 0
    model = nn.Module()
    model.a = nn.Parameter(torch.zeros(8, 8))
    model.c = nn.Parameter(torch.zeros(30))
    model.big = nn.Parameter(torch.zeros(1 << 17))
    model.zero = nn.Parameter(torch.zeros(1 << 17))
    torch.manual_seed(0)
    with graddbg.watch(model, stats=stats) as w:
        for p in (model.a, model.c, model.big):
            p.grad = torch.randn(p.shape) * 1e-26
        model.zero.grad = torch.zeros(1 << 17)
        w.step()
    df = w.stats.set_index("name")
    for name, p in model.named_parameters():
        assert df.loc[name, "norm"] == float(torch.linalg.vector_norm(p.grad)), name
    if "absmax" in stats:
        assert df.loc["a", "absmax"] > 0 and df.loc["zero", "absmax"] == 0
    assert w.host_syncs == 1
    assert [a.kind for a in w.anomalies] == []


def test_statistics_of_many_small_layers_equal_reference():
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with graddbg.watch(model, opt) as w:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(3, 16)).sum().backward()
            opt.step()
    last = w.stats[w.stats.step == 1].set_index("name")["norm"]
    for name, p in model.named_parameters():
        assert last[name] == pytest.approx(float(p.grad.double().norm()), rel=1e-6)


def test_large_gradients_match_reference():
    # large gradients: one foreach norm in float32 and (absmax) one aminmax pass each on the CPU
    n = (1 << 19) + 12345
    model = nn.Module()
    for name in ("plain", "huge", "nan_last", "inf_first"):
        setattr(model, name, nn.Parameter(torch.zeros(n)))
    torch.manual_seed(0)
    with graddbg.watch(model, nonfinite="record") as w:
        model.plain.grad = torch.randn(n)
        model.huge.grad = torch.full((n,), 1e20)
        model.nan_last.grad = torch.randn(n)
        model.nan_last.grad[-1] = float("nan")
        model.inf_first.grad = torch.randn(n)
        model.inf_first.grad[0] = -float("inf")
        w.step()
    df = w.stats.set_index("name")
    ref = model.plain.grad.double()
    # (float32 accumulation over 500,000 entries, as torch.linalg.vector_norm's own)
    assert df.loc["plain", "norm"] == pytest.approx(float(ref.norm()), rel=1e-5)
    assert df.loc["plain", "absmax"] == float(ref.abs().max())
    assert df.loc["huge", "norm"] == pytest.approx(1e20 * math.sqrt(n), rel=1e-6)
    assert df.loc["huge", "nonfinite"] == 0
    assert math.isnan(df.loc["nan_last", "norm"]) and df.loc["nan_last", "nonfinite"] == 1
    assert df.loc["inf_first", "absmax"] == math.inf and df.loc["inf_first", "nonfinite"] == 1


def test_gradient_accumulation_gives_one_record_equal_to_accumulated_gradient():
    torch.manual_seed(0)
    model = PROBLEMS["mlp"].make_model()
    ref_model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    with graddbg.watch(model, opt) as w:
        for k in range(4):  # four micro-batches, one optimizer step
            (F.cross_entropy(model(x[4 * k: 4 * k + 4]), y[4 * k: 4 * k + 4]) / 4).backward()
        opt.step()
        opt.zero_grad()
    F.cross_entropy(ref_model(x), y).backward()  # the same gradient in one batch
    df = w.stats
    assert df["step"].unique().tolist() == [0]
    assert len(w.steps) == 1
    for name, p in ref_model.named_parameters():
        assert df.loc[df.name == name, "norm"].item() == pytest.approx(p.grad.norm().item(), rel=1e-5)


def test_record_holds_pre_clip_gradient_and_post_clip_norm():
    model = PROBLEMS["mlp"].make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = PROBLEMS["mlp"].make_batch(torch.device("cpu"))
    with graddbg.watch(model, opt) as w:
        F.cross_entropy(model(x), y).backward()
        pre = _naive(model)
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
        opt.step()
    for name, r in pre.items():
        assert w.stats.loc[w.stats.name == name, "norm"].item() == pytest.approx(r["norm"], rel=1e-5)
    steps = w.steps.iloc[0]
    assert steps["global_norm"] == pytest.approx(total.item(), rel=1e-5)
    assert steps["clipped_norm"] == pytest.approx(1e-3, rel=1e-3)


def test_no_clip_means_no_post_clip_norm():
    model = PROBLEMS["mlp"].make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = PROBLEMS["mlp"].make_batch(torch.device("cpu"))
    with graddbg.watch(model, opt) as w:
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert math.isnan(w.steps["clipped_norm"].iloc[0])


class TiedFrozenUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.emb.weight  # tied
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(4, 4)

    def forward(self, tok):
        return self.out(self.frozen(self.emb(tok)))


def test_tied_frozen_and_unused_parameters():
    model = TiedFrozenUnused()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    tok = torch.randint(0, 10, (6,))
    with pytest.warns(CoverageWarning, match="unused.weight"):
        with graddbg.watch(model, opt) as w:
            F.cross_entropy(model(tok), tok).backward()
            tied_norm = model.emb.weight.grad.norm().item()
            opt.step()
    df = w.stats
    assert df["name"].tolist() == ["emb.weight", "unused.weight", "unused.bias"]  # tied once, frozen not at all
    assert df.loc[df.name == "emb.weight", "norm"].item() == pytest.approx(tied_norm, rel=1e-6)
    unused = df[df.name.str.startswith("unused")]
    assert not unused["has_grad"].any() and unused["norm"].isna().all()
    cov = w.coverage()
    assert set(cov.loc[~cov.covered, "name"]) == {"unused.weight", "unused.bias"}
    assert w.to_run().meta["uncovered"] == ["unused.weight", "unused.bias"]


def test_no_optimizer_boundary_is_end_of_backward_and_manual_step():
    model = PROBLEMS["mlp"].make_model()
    x, y = PROBLEMS["mlp"].make_batch(torch.device("cpu"))
    with graddbg.watch(model) as w:
        for _ in range(3):
            F.cross_entropy(model(x), y).backward()
        assert w.current_step == 3
        w.step()  # by hand
    assert w.stats["step"].unique().tolist() == [0, 1, 2, 3]
    # gradients accumulate without zero_grad: step 1 holds twice step 0's gradient
    n0 = w.stats[w.stats.step == 0]["norm"].to_numpy()
    n1 = w.stats[w.stats.step == 1]["norm"].to_numpy()
    np.testing.assert_allclose(n1, 2 * n0, rtol=1e-5)
    assert w.stats["update_ratio"].isna().all()


def test_every_k_records_every_kth_step_and_syncs_only_when_due():
    model = PROBLEMS["mlp"].make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = PROBLEMS["mlp"].make_batch(torch.device("cpu"))
    with graddbg.watch(model, opt, every=4, nonfinite=graddbg.NonFinite(every=4), explode=None) as w:
        for i in range(12):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            assert w.host_syncs == i // 4 + 1  # one read-back on each due step, none between
    assert w.stats["step"].unique().tolist() == [0, 4, 8]
    assert w.steps["recorded"].tolist() == [i % 4 == 0 for i in range(12)]


def test_default_makes_exactly_one_sync_per_step():
    model = PROBLEMS["mlp"].make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = PROBLEMS["mlp"].make_batch(torch.device("cpu"))
    with graddbg.watch(model, opt, update_every=None) as w:
        for _ in range(5):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert w.host_syncs == 5


def test_deferred_nonfinite_check_names_first_bad_step():
    model = nn.Linear(3, 1)
    with graddbg.watch(model, every=5, nonfinite=graddbg.NonFinite(policy="record", every=5)) as w:
        for i in range(10):
            model.weight.grad = torch.ones(1, 3)
            model.bias.grad = torch.full((1,), float("inf") if i == 2 else 1.0)
            w.step()
            assert w.host_syncs == (1 if i < 5 else 2)  # read-backs only at steps 0 and 5
    assert len(w.anomalies) == 1
    a = w.anomalies[0]
    assert a.kind == "nonfinite" and a.step == 2 and a.name == "bias"


def test_deferred_nonfinite_check_ignores_parameters_without_gradient():
    # an unused layer has no gradient: nothing in it is non-finite (this once flagged it)
    model = nn.Module()
    model.used = nn.Linear(4, 4)
    model.unused = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(CoverageWarning):
        with graddbg.watch(model, opt, every=3, nonfinite=graddbg.NonFinite(policy="record", every=3)) as w:
            for i in range(7):
                opt.zero_grad()
                model.used(torch.randn(2, 4)).sum().backward()
                if i == 4:
                    model.used.bias.grad[1] = float("nan")
                opt.step()
    assert [(a.step, a.name) for a in w.anomalies if a.kind == "nonfinite"] == [(4, "used.bias")]


def test_update_ratio_matches_reference():
    torch.manual_seed(0)
    model = PROBLEMS["mlp"].make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = PROBLEMS["mlp"].make_batch(torch.device("cpu"))
    expected = {}
    with graddbg.watch(model, opt, update_every=1) as w:
        for step in range(3):
            F.cross_entropy(model(x), y).backward()
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
            for n, p in model.named_parameters():
                expected[(step, n)] = ((p.detach() - before[n]).norm() / before[n].norm()).item()
    for (step, n), r in expected.items():
        got = w.stats.loc[(w.stats.step == step) & (w.stats.name == n), "update_ratio"].item()
        assert got == pytest.approx(r, rel=1e-5)


def test_update_ratio_every_k_recorded_steps():
    model = PROBLEMS["mlp"].make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = PROBLEMS["mlp"].make_batch(torch.device("cpu"))
    with graddbg.watch(model, opt, update_every=2) as w:
        for _ in range(4):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    per_step = w.stats.groupby("step")["update_ratio"].apply(lambda s: s.notna().all())
    assert per_step.tolist() == [True, False, True, False]


def test_update_ratio_default_cadence_is_the_log_cadence():
    # the default (documented in watch()): steps 0, 1, 2, 5, 10, 20, 50, 100, 200, then every
    # 200th, so a short run has a plot and a long one copies its weights rarely
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    with graddbg.watch(model, opt) as w:
        for _ in range(401):
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    measured = w.stats.groupby("step")["update_ratio"].apply(lambda s: s.notna().all())
    assert measured[measured].index.tolist() == [0, 1, 2, 5, 10, 20, 50, 100, 200, 400]
    assert w.stats.loc[w.stats.step == 200, "update_ratio"].gt(0).all()


def test_the_log_cadence_counts_recorded_steps_and_update_every_n_keeps_its_meaning():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    for kw, expected in [({"every": 2}, [0, 2, 4, 10, 20, 40]), ({"update_every": 5}, [0, 5, 10, 15, 20, 25, 30, 35, 40, 45])]:
        with graddbg.watch(model, opt, **kw) as w:
            for _ in range(48):
                model(x).square().sum().backward()
                opt.step()
                opt.zero_grad()
        measured = w.stats.groupby("step")["update_ratio"].apply(lambda s: s.notna().all())
        assert measured[measured].index.tolist() == expected, kw


def test_no_memory_for_the_update_ratio_copy_warns_and_training_goes_on(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    calls = []

    def no_memory(params):
        calls.append(len(params))
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.00 B")

    with pytest.warns(graddbg.GraddbgWarning, match=r"update_every=None.*out of memory") as rec:
        with graddbg.watch(model, opt, update_every=1) as w:
            monkeypatch.setattr(UpdateRatio, "copy_weights", staticmethod(no_memory))
            before = model.weight.detach().clone()
            for _ in range(3):
                model(x).square().sum().backward()
                opt.step()
                opt.zero_grad()
    assert calls == [2]                                   # asked once, then switched off
    assert sum("update/weight ratio" in str(r.message) for r in rec) == 1
    assert not torch.equal(model.weight, before)          # the optimizer stepped every time
    assert len(w.stats) == 3 * 2 and w.stats["update_ratio"].isna().all()
    assert w.stats["norm"].notna().all()                  # the statistics were still recorded


def test_histograms_count_every_finite_entry():
    model = PROBLEMS["mlp"].make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = PROBLEMS["mlp"].make_batch(torch.device("cpu"))
    with graddbg.watch(model, opt, histograms=True) as w:
        F.cross_entropy(model(x), y).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    h = w.histograms
    for n, g in grads.items():
        rows = h[(h.step == 0) & (h.name == n)]
        assert rows["count"].sum() == g.numel()
        # the count in each bin is the naive count of |g| in [lo, hi)
        a = g.abs()
        for _, r in rows.iterrows():
            assert r["count"] == int(((a >= r["lo"]) & (a < r["hi"])).sum()), (n, r["lo"])


def test_watch_leaves_training_bitwise_identical():
    def train(watched: bool):
        torch.manual_seed(0)
        model = PROBLEMS["resnetlike"].make_model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        x, y = PROBLEMS["resnetlike"].make_batch(torch.device("cpu"))
        ctx = graddbg.watch(model, opt, stats=("norm", "mean"), activations=True, histograms=2,
                            update_every=1) if watched else None
        try:
            for _ in range(5):
                F.cross_entropy(model(x), y).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
        finally:
            if ctx is not None:
                ctx.close()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(train(False), train(True)):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- lifecycle

@pytest.mark.parametrize("activations", [False, True])
def test_hooks_removed_after_normal_exit(activations):
    model = PROBLEMS["resnetlike"].make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before, obefore = hook_counts(model), optimizer_hook_counts(opt)
    with graddbg.watch(model, opt, activations=activations) as w:
        assert hook_counts(model) != before
        x, y = PROBLEMS["resnetlike"].make_batch(torch.device("cpu"))
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert hook_counts(model) == before
    assert optimizer_hook_counts(opt) == obefore
    assert w._ctx.model is None and w._ctx.params == []  # no tensors of the user's kept


def test_hooks_removed_when_body_raises_and_data_kept():
    model = PROBLEMS["mlp"].make_model()
    before = hook_counts(model)
    x, y = PROBLEMS["mlp"].make_batch(torch.device("cpu"))
    with pytest.raises(KeyError, match="boom"):
        with graddbg.watch(model, activations=True) as w:
            F.cross_entropy(model(x), y).backward()
            raise KeyError("boom")
    assert hook_counts(model) == before
    assert len(w.stats) == 6 and w.activations["step"].unique().tolist() == [0]  # kept


class RaisingForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x):
        raise ValueError("forward failed")


def test_hooks_removed_when_forward_raises():
    model = RaisingForward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before, obefore = hook_counts(model), optimizer_hook_counts(opt)
    with pytest.raises(ValueError, match="forward failed"):
        with graddbg.watch(model, opt, activations=True):
            model(torch.ones(1, 2))
    assert hook_counts(model) == before and optimizer_hook_counts(opt) == obefore


def test_close_is_idempotent_and_works_without_with():
    model = nn.Linear(2, 2)
    before = hook_counts(model)
    w = graddbg.watch(model)
    model(torch.ones(1, 2)).sum().backward()
    w.close()
    w.close()
    assert hook_counts(model) == before
    assert len(w.stats) == 2
    with pytest.raises(RuntimeError, match="closed"):
        w.step()


def test_model_pickles_deepcopies_and_saves_during_and_after_watch(tmp_path):
    model = PROBLEMS["mlp"].make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = PROBLEMS["mlp"].make_batch(torch.device("cpu"))
    with graddbg.watch(model, opt, activations=True):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        copy.deepcopy(model.state_dict())
        torch.save(model.state_dict(), tmp_path / "sd.pt")
        assert torch.equal(copy.deepcopy(model)(x), model(x))
    pickle.loads(pickle.dumps(model))
    buf = io.BytesIO()
    torch.save(model, buf)
    clone = copy.deepcopy(model)
    assert hook_counts(clone) == hook_counts(PROBLEMS["mlp"].make_model())
    assert not any(k.startswith("_graddbg") for k in vars(model))


def test_hundred_enter_exit_cycles_leave_nothing_behind():
    model = PROBLEMS["mlp"].make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = PROBLEMS["mlp"].make_batch(torch.device("cpu"))
    before = hook_counts(model)
    gc.collect()
    n_tensors = sum(type(o) in (torch.Tensor, nn.Parameter) for o in gc.get_objects())
    for _ in range(100):
        with graddbg.watch(model, opt, activations=True):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    gc.collect()
    assert hook_counts(model) == before
    assert sum(type(o) in (torch.Tensor, nn.Parameter) for o in gc.get_objects()) <= n_tensors + 5


def test_memory_is_bounded_over_many_steps():
    model = nn.Linear(4, 2)
    with graddbg.watch(model, history=50) as w:
        for _ in range(400):
            model.zero_grad()
            model(torch.ones(1, 4)).sum().backward()
    # thinned in the middle: the first and the latest steps stay, evenly spaced between
    steps = w.steps["step"].tolist()
    assert 25 <= len(steps) <= 50 and steps[0] == 0 and steps[-1] == 399
    assert w.stats["step"].min() == 0 and w.stats["step"].max() == 399
    assert len(steps) + w.to_run().meta["steps_dropped"] == 400


def test_two_watches_on_one_model_both_record():
    model = PROBLEMS["mlp"].make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = PROBLEMS["mlp"].make_batch(torch.device("cpu"))
    before = hook_counts(model)
    with graddbg.watch(model, opt) as w1, graddbg.watch(model, opt, every=2) as w2:
        for _ in range(2):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert len(w1.stats) == 2 * 6 and len(w2.stats) == 6
    np.testing.assert_array_equal(w1.stats[w1.stats.step == 0]["norm"], w2.stats["norm"])
    assert hook_counts(model) == before


def test_names_strip_wrapper_prefixes_of_compiled_model():
    torch._dynamo.reset()
    model = PROBLEMS["mlp"].make_model()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
    x, y = PROBLEMS["mlp"].make_batch(torch.device("cpu"))
    from torch._dynamo.utils import counters

    counters.clear()
    with graddbg.watch(compiled, opt) as w:
        for _ in range(2):
            F.cross_entropy(compiled(x), y).backward()
            opt.step()
            opt.zero_grad()
    breaks = sum(counters["graph_break"].values())
    assert breaks == 0
    assert w.stats["name"].tolist()[:2] == ["0.weight", "0.bias"]
    F.cross_entropy(ref(x), y).backward()
    assert w.stats.loc[(w.stats.step == 0) & (w.stats.name == "0.weight"), "norm"].item() == \
        pytest.approx(ref[0].weight.grad.norm().item(), rel=1e-5)
    torch._dynamo.reset()


def test_activations_on_compiled_model_warn_once():
    torch._dynamo.reset()
    compiled = torch.compile(PROBLEMS["mlp"].make_model(), backend="eager")
    with pytest.warns(CompileWarning, match="activations=True"):
        w = graddbg.watch(compiled, activations=True)
    w.close()
    torch._dynamo.reset()


def test_activations_with_inplace_relu_residual_identity_and_dict_outputs():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # like pytest -W error: no deprecation or hook warnings
        for key in ("resnetlike", "dictout"):
            pb = PROBLEMS[key]
            model = pb.make_model()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            x, y = pb.make_batch(torch.device("cpu"))
            with graddbg.watch(model, opt, activations=True) as w:
                for _ in range(2):
                    pb.loss(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
            act = w.activations
            assert set(act["step"]) == {0, 1}
            assert (act["grad_norm"] > 0).all() and np.isfinite(act["grad_norm"]).all()
            assert w.coverage()["covered"].all()


def test_activation_gradient_norm_matches_reference_and_module_reuse_adds_up():
    lin = nn.Linear(3, 3)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(self.lin(x))

    model = Twice()
    x = torch.randn(2, 3)
    with graddbg.watch(model, activations=True) as w:
        h1 = model.lin(x)
        h1.retain_grad()
        h2 = model.lin(h1)
        h2.retain_grad()
        h2.sum().backward()
        ref = math.sqrt(h1.grad.pow(2).sum().item() + h2.grad.pow(2).sum().item())
    act = w.activations
    assert act.loc[act.module == "lin", "grad_norm"].item() == pytest.approx(ref, rel=1e-6)


def test_activation_checkpointing_is_not_double_counted():
    from torch.utils.checkpoint import checkpoint

    class Ck(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 1)

        def forward(self, x):
            return self.b(checkpoint(self.a, x, use_reentrant=False))

    model = Ck()
    x = torch.randn(5, 4)
    with graddbg.watch(model, activations=True) as w:
        model(x).sum().backward()
    ref_model = copy.deepcopy(model)
    h = ref_model.a(x)
    h.retain_grad()
    ref_model.b(h).sum().backward()
    act = w.activations
    assert len(act[act.module == "a"]) == 1
    assert act.loc[act.module == "a", "grad_norm"].item() == pytest.approx(h.grad.norm().item(), rel=1e-6)


def test_direct_forward_call_is_reported_as_uncovered_module():
    class Direct(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(2, 2)
            self.direct = nn.Linear(2, 2)

        def forward(self, x):
            return self.direct.forward(self.used(x))  # .forward() bypasses module hooks

    model = Direct()
    with graddbg.watch(model, activations=True) as w:
        model(torch.ones(1, 2)).sum().backward()
    cov = w.coverage()
    mods = cov[cov.kind == "module"].set_index("name")["covered"]
    assert bool(mods["used"]) and not bool(mods["direct"])


# ---------------------------------------------------------------- bad input

def test_bad_model_arguments():
    with pytest.raises(TypeError, match=r"watch\(model=...\): got list, expected a torch.nn.Module"):
        graddbg.watch([nn.Linear(2, 2)])
    with pytest.raises(TypeError, match="instantiate it first"):
        graddbg.watch(nn.Linear)


# every option of watch(), a bad value for it, and the error: naming the option, what was
# given and what is accepted (issue 33: "ddp_timeout accepts anything")
BAD_OPTIONS = [
    ({"every": 0}, ValueError, r"^watch\(every=...\): got 0; accepted: an int >= 1$"),
    ({"every": 1.5}, TypeError, r"^watch\(every=...\): got 1.5 \(float\); accepted: an int >= 1$"),
    ({"stats": ("norm", "median")}, ValueError,
     r"^watch\(stats=...\): got unknown statistic\(s\) \['median'\]; accepted: norm, absmax"),
    ({"nonfinite": "explode"}, ValueError, r"^watch\(nonfinite=...\): got 'explode'; accepted: 'raise', 'warn'"),
    ({"explode": graddbg.Vanish()}, TypeError, r"^watch\(explode=...\): got a Vanish detector; accepted: a Explode"),
    ({"vanish": 3}, ValueError, r"^watch\(vanish=...\): got 3; accepted: 'raise'"),
    ({"stale_grad": "loud"}, ValueError, r"^watch\(stale_grad=...\): got 'loud'; accepted: 'raise'"),
    ({"empty_step": 1}, ValueError, r"^watch\(empty_step=...\): got 1; accepted"),
    ({"orphan_param": "x"}, ValueError, r"^watch\(orphan_param=...\): got 'x'; accepted"),
    ({"no_update": "x"}, ValueError, r"^watch\(no_update=...\): got 'x'; accepted"),
    ({"dead_grad": "x"}, ValueError, r"^watch\(dead_grad=...\): got 'x'; accepted"),
    ({"double_step": "x"}, ValueError, r"^watch\(double_step=...\): got 'x'; accepted"),
    ({"scaled_grad": "x"}, ValueError, r"^watch\(scaled_grad=...\): got 'x'; accepted"),
    ({"foreign_update": "x"}, ValueError, r"^watch\(foreign_update=...\): got 'x'; accepted"),
    ({"update_rule": "x"}, ValueError, r"^watch\(update_rule=...\): got 'x'; accepted"),
    ({"applied_grad": "x"}, ValueError, r"^watch\(applied_grad=...\): got 'x'; accepted"),
    ({"module_setup": "x"}, ValueError, r"^watch\(module_setup=...\): got 'x'; accepted"),
    ({"optimizer_setup": "x"}, ValueError, r"^watch\(optimizer_setup=...\): got 'x'; accepted"),
    ({"lr_schedule": "x"}, ValueError, r"^watch\(lr_schedule=...\): got 'x'; accepted"),
    ({"hidden_param": "x"}, ValueError, r"^watch\(hidden_param=...\): got 'x'; accepted"),
    ({"eval_mode": "x"}, ValueError, r"^watch\(eval_mode=...\): got 'x'; accepted"),
    ({"loss_pattern": "x"}, ValueError, r"^watch\(loss_pattern=...\): got 'x'; accepted"),
    ({"unused_param": "x"}, ValueError, r"^watch\(unused_param=...\): got 'x'; accepted"),
    ({"activations": "yes"}, TypeError, r"^watch\(activations=...\): got 'yes' \(str\); accepted: True or False$"),
    ({"histograms": "yes"}, TypeError, r"^watch\(histograms=...\): got 'yes' \(str\); accepted: None, a bool or an int"),
    ({"histograms": -2}, ValueError, r"^watch\(histograms=...\): got -2; accepted: an int >= 1$"),
    ({"scaler": object()}, TypeError, r"^watch\(scaler=...\): got <object object .*\(object\); accepted: a torch.amp.GradScaler"),
    ({"history": 0}, ValueError, r"^watch\(history=...\): got 0; accepted: an int >= 1$"),
    ({"ddp_check_every": 0}, ValueError, r"^watch\(ddp_check_every=...\): got 0; accepted: None, 'auto' or an int >= 1$"),
    ({"ddp_check_every": "sometimes"}, TypeError, r"^watch\(ddp_check_every=...\): got 'sometimes' \(str\)"),
    ({"update_every": -1}, ValueError, r"^watch\(update_every=...\): got -1; accepted: an int >= 1$"),
    ({"update_every": "often"}, ValueError, r"^watch\(update_every=...\): got 'often'; accepted: None, 'log' or an int >= 1$"),
    ({"copy_budget": 0}, ValueError, r"^watch\(copy_budget=...\): got 0; accepted: a fraction in \(0, 1\]"),
    ({"localise": 2}, TypeError, r"^watch\(localise=...\): got 2 \(int\); accepted: True or False$"),
    ({"ddp_timeout": "10s"}, TypeError,
     r"^watch\(ddp_timeout=...\): got '10s' \(str\); accepted: a datetime.timedelta or a number of seconds > 0$"),
    ({"ddp_timeout": -5}, ValueError, r"^watch\(ddp_timeout=...\): got -5; accepted: a positive duration"),
    ({"ddp_timeout": float("nan")}, ValueError, r"^watch\(ddp_timeout=...\): got nan; accepted: a positive duration"),
    ({"log_to": "neptune"}, ValueError, r"^watch\(log_to=...\): got 'neptune'; accepted: None, a torch.utils"),
    ({"log_detail": "layer"}, ValueError, r"^watch\(log_detail=...\): got 'layer'; accepted: 'module'"),
]


@pytest.mark.parametrize("kw,exc,match", BAD_OPTIONS, ids=[f"{k}={v!r}" for kw, _, _ in BAD_OPTIONS for k, v in kw.items()])
def test_bad_options(kw, exc, match):
    model = nn.Linear(2, 2)
    before = hook_counts(model)
    with pytest.raises(exc, match=match):
        graddbg.watch(model, **kw)
    assert hook_counts(model) == before


def test_every_option_of_watch_is_validated_at_the_call():
    """Each keyword option of watch() has a bad value above that is refused when watch() is
    called (not later, at the step that uses it)."""
    options = {n for n, p in inspect.signature(graddbg.watch).parameters.items() if p.kind == p.KEYWORD_ONLY}
    assert options and options == {next(iter(kw)) for kw, _, _ in BAD_OPTIONS}


def test_good_options_are_normalised():
    from datetime import timedelta

    with graddbg.watch(nn.Linear(2, 2), ddp_timeout=2.5, localise=1, histograms=True, ddp_check_every=None) as w:
        opts = w.options
    assert opts.ddp_timeout == timedelta(seconds=2.5) and opts.localise is True and opts.histograms == 1
    assert opts.record_schedule.includes(0) and opts.histogram_schedule.includes(7)


def test_optimizer_of_another_model_is_refused():
    model = nn.Linear(2, 2)
    other = torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="holds none of the model's 2 trainable parameters"):
        graddbg.watch(model, other)
    with pytest.raises(TypeError, match=r"optimizer=...\): got str, expected a torch.optim.Optimizer"):
        graddbg.watch(model, "sgd")


def test_bad_detector_arguments():
    with pytest.raises(ValueError, match=r"^NonFinite\(every=...\): got 0; accepted: an int >= 1$"):
        graddbg.NonFinite(every=0)
    with pytest.raises(ValueError, match=r"^Explode\(factor=...\): got 0.5; accepted: a number > 1$"):
        graddbg.Explode(factor=0.5)
    with pytest.raises(TypeError, match=r"^Explode\(absolute=...\): got '1e3' \(str\); accepted: a number > 0$"):
        graddbg.Explode(absolute="1e3")
    with pytest.raises(ValueError, match=r"^Explode\(factor=None, absolute=None\): nothing to compare"):
        graddbg.Explode(factor=None)
    with pytest.raises(ValueError, match=r"^Vanish\(below=...\): got 0; accepted: a number > 0$"):
        graddbg.Vanish(below=0)
    with pytest.raises(ValueError, match=r"^Vanish\(policy=...\): got 'loud'; accepted: 'raise'"):
        graddbg.Vanish(policy="loud")


def test_forwards_without_backward_do_not_pile_up():
    model = PROBLEMS["resnetlike"].make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = PROBLEMS["resnetlike"].make_batch(torch.device("cpu"))
    with graddbg.watch(model, opt, activations=True) as w:
        for _ in range(50):  # an evaluation loop that forgot torch.no_grad()
            model(x)
        assert len(w._steps._tap.handles) <= 20 and w._steps.activations.pending() <= 20
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert len(w.stats) == 8 and w.activations["step"].unique().tolist() == [0]
    assert len(w.activations) == len(w.activations["module"].unique())  # one forward counted


def test_a_model_without_trainable_parameters_warns():
    model = nn.Linear(2, 2).requires_grad_(False)
    with pytest.warns(CoverageWarning, match="has no trainable parameter"):
        w = graddbg.watch(model)
    w.close()


def test_history_is_bounded_in_rows_and_keeps_the_ends_and_anomalies(monkeypatch):
    import graddbg.hooks as hooks

    monkeypatch.setattr(hooks, "MAX_ROWS", 400)  # 40 steps of the 10 parameters below
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(5)])
    with graddbg.watch(model, nonfinite="record", explode=None) as w:
        for step in range(500):
            model.zero_grad()
            out = model(torch.ones(1, 3)).sum()
            (out * float("nan") if step == 123 else out).backward()
    df = w.stats
    steps = sorted(df["step"].unique())
    assert len(df) <= 400 and len(steps) <= 40
    assert steps[0] == 0 and steps[-1] == 499 and 123 in steps  # the ends and the anomaly stay
    middle = [s for s in steps[5:-10] if s != 123]  # between the first steps and the latest ones
    gaps = np.diff(middle)
    assert len(middle) >= 10 and gaps.max() <= 2 * np.median(gaps)  # thinned evenly, not a hole
    assert [a.step for a in w.anomalies] == [123]


def test_stats_rows_are_compact():
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(50)])
    with graddbg.watch(model, explode=None) as w:
        for _ in range(20):
            model.zero_grad()
            model(torch.ones(1, 8)).sum().backward()
    df = w.stats
    assert len(df) == 20 * 100
    assert str(df["name"].dtype) == "category" and str(df["module"].dtype) == "category"
    assert df.memory_usage(deep=True).sum() / len(df) <= 64


def test_watch_signature_is_the_options_object():
    """watch()'s keyword options (what help() and IDEs show) are WatchOptions' fields, with
    the same defaults, in the same order; Watch shows the same signature."""
    import dataclasses
    import inspect

    from graddbg.options import WatchOptions

    fields = [(f.name, f.default) for f in dataclasses.fields(WatchOptions) if f.init]
    params = inspect.signature(graddbg.watch).parameters.values()
    shown = [(p.name, p.default) for p in params if p.kind is p.KEYWORD_ONLY]
    assert shown == fields
    on_class = [(p.name, p.default) for p in inspect.signature(graddbg.Watch).parameters.values()
                if p.kind is p.KEYWORD_ONLY]
    assert on_class == fields
    doc = graddbg.watch.__doc__
    assert all(f"        {name}: " in doc for name, _ in fields)  # an Args entry per option


def test_old_spelling_localize_is_accepted():
    model = torch.nn.Linear(2, 1)
    with graddbg.watch(model, localize=False) as w:
        model(torch.ones(1, 2)).sum().backward()
    assert w.options.localise is False
    with pytest.raises(TypeError, match="not both"):
        graddbg.Watch(model, localize=False, localise=True)


def test_watch_is_a_small_face_over_the_step_pipeline():
    """Watch, counted with its graddbg base classes, has at most 30 methods (properties
    included): the step's machinery is StepPipeline's, the read side Run's."""
    import inspect

    from graddbg import hooks

    own = [c for c in inspect.getmro(hooks.Watch) if c.__module__.startswith("graddbg")]
    methods = {name for c in own for name, v in vars(c).items()
               if inspect.isfunction(v) or isinstance(v, property)}
    assert len(methods) <= 30, sorted(methods)
    assert not any(hasattr(c, "_part") for c in own)


def test_the_checks_order_follows_from_what_each_declares_it_reads():
    """Every check but the three that read nothing of the others (the keeper, the copy guard,
    the recorder) declares what it reads after (`after`), and `ordered` honours every
    declaration whatever the order the checks are listed in."""
    import random

    from graddbg.checks import CopyGuard, LedgerKeeper, StatsRecorder, default_checks, ordered
    from graddbg.options import WatchOptions

    parts = default_checks(nn.Linear(2, 2), WatchOptions(activations=True, histograms=2))
    for c in parts.checks:
        assert isinstance(c, (LedgerKeeper, CopyGuard, StatsRecorder)) or c.after, type(c).__name__
    rng = random.Random(0)
    for _ in range(20):
        listed = list(parts.checks)
        rng.shuffle(listed)
        out = ordered(listed)
        assert sorted(map(id, out)) == sorted(map(id, listed))
        at = {id(c): i for i, c in enumerate(out)}
        for c in out:
            for d in out:
                if any(isinstance(d, t) for t in c.after):
                    assert at[id(d)] < at[id(c)], (type(d).__name__, type(c).__name__)


def test_a_step_is_a_frozen_record_each_field_written_once_by_its_one_writer():
    """The checks only read a step: assigning to it raises; a measured field is written by
    the watch from what its one writer returned (`wrote`), once, and by no other part."""
    import dataclasses as dc

    from graddbg.checks import StatsRecorder
    from graddbg.checks.base import Measured, Step, wrote
    from graddbg.checks.histograms import Histograms

    step = Step(3, [], True)
    with pytest.raises(dc.FrozenInstanceError):
        step.measured = Measured()  # type: ignore[misc]
    recorder, hist = StatsRecorder.__new__(StatsRecorder), Histograms()
    m = Measured(lr=0.5)
    assert step.accept(recorder, wrote(["token"], measured=m)) == ["token"]
    assert step.measured is m
    with pytest.raises(AttributeError, match="written twice at step 3"):
        step.accept(recorder, wrote([], measured=Measured()))
    with pytest.raises(AttributeError, match="Histograms may not write Step.measured"):
        Step(4, [], True).accept(hist, wrote([], measured=m))
    with pytest.raises(AttributeError, match="the watch, when it makes the step"):
        Step(4, [], True).accept(recorder, wrote([], index=9))
    assert step.accept(hist, [1, 2]) == [1, 2]  # (a plain result: nothing written)
    fields = {f.name for f in dc.fields(Step)}
    assert set(Step.WRITERS) <= fields


def test_the_context_is_read_only_to_the_checks_and_no_check_assigns_to_a_step():
    """After the checks are attached the watch's context refuses assignment; and no module of
    graddbg/checks assigns to an attribute of a step or of the context (read by its AST)."""
    import ast
    import pathlib

    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with graddbg.watch(model, opt) as w:
        ctx = w._steps.ctx
        with pytest.raises(AttributeError, match="read-only to its checks"):
            ctx.host_syncs = 0
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        assert w.host_syncs == 1 and ctx.host_syncs == 1
    root = pathlib.Path(graddbg.__file__).parent / "checks"
    bad = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                leaves = t.elts if isinstance(t, ast.Tuple) else [t]
                for leaf in leaves:  # (step.x = ..., self.ctx.x = ..., step.x[i] = ...)
                    while isinstance(leaf, ast.Subscript):
                        leaf = leaf.value
                    if isinstance(leaf, ast.Attribute):
                        base = leaf.value
                        name = base.id if isinstance(base, ast.Name) else \
                            base.attr if isinstance(base, ast.Attribute) else None
                        if name in ("step", "ctx"):
                            bad.append(f"{path.name}:{leaf.lineno}")
    assert not bad, bad


def test_a_watch_does_not_walk_the_heap_for_pipeline_stages_without_a_process_group(monkeypatch):
    """A program that imported torch.distributed.pipelining but has no process group (so no
    stage) pays no heap walk per watch (2M objects on the heap: 760 ms a watch before)."""
    import gc

    import torch.distributed.pipelining  # noqa: F401

    def walked(*args):
        raise AssertionError("the heap was walked")

    monkeypatch.setattr(gc, "get_objects", walked)
    monkeypatch.setattr(gc, "get_referrers", walked)
    model = nn.Linear(4, 2)
    with graddbg.watch(model) as w:
        model(torch.randn(2, 4)).sum().backward()
    assert len(w.stats) == 2


def _masters(write_back, steps=5):
    """Hand-written mixed precision: a bfloat16 model, fp32 master copies in the optimizer,
    gradients copied to the masters, and (or not) the masters written back."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(torch.bfloat16)
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.SGD(master, lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with graddbg.watch(model, opt) as w:
            for _ in range(steps):
                model.zero_grad()
                F.mse_loss(model(x.bfloat16()).float(), y).backward()
                for m, p in zip(master, model.parameters()):
                    m.grad = p.grad.float()
                opt.step()
                if write_back:
                    with torch.no_grad():
                        for m, p in zip(master, model.parameters()):
                            p.copy_(m)
    return w


def test_an_optimizer_over_master_copies_is_watched_as_the_model_alone():
    """The optimizer steps fp32 copies of a bf16 model's weights: healthy while the copies
    are written back; named once the model's weights never change."""
    w = _masters(True)
    assert w.anomalies == [], [a.message for a in w.anomalies]
    assert w.meta["optimizer_holds"] == "masters" and len(w.stats) == 4 * 5  # (4 parameters, 5 steps)
    w = _masters(False)
    found = [a for a in w.anomalies if a.kind == "orphan_param"]
    assert len(found) == 1 and "master copies of its weights in torch.float32" in found[0].message, w.anomalies
    assert "never written back" in found[0].message


def test_an_optimizer_over_a_copy_of_the_model_is_named_at_once():
    model = nn.Linear(2, 2)
    copy = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)  # (the model built twice)
    with pytest.warns(graddbg.GraddbgWarning, match="trains another copy of the model"):
        with graddbg.watch(model, copy) as w:
            for _ in range(3):
                copy.zero_grad()
                model(torch.randn(4, 2)).sum().backward()
                copy.step()
    assert [a.kind for a in w.anomalies][:1] == ["orphan_param"] and w.anomalies[0].step == 0
    assert w.meta["optimizer_holds"] == "copies"
    before = dict(model.named_parameters())
    with pytest.raises(graddbg.GradientAnomalyError, match="another copy"):
        graddbg.watch(model, copy, orphan_param="raise")
    assert all(not h for p in before.values() for h in [getattr(p, "_post_accumulate_grad_hooks", None)])
    assert not model._forward_hooks and not model._forward_pre_hooks
