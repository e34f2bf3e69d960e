"""graddbg.stats: the bounded history and its thinning."""
from __future__ import annotations

import numpy as np

from graddbg.stats import History, StepRecord, StepStats


def _fill(h: History, steps: int, marked=lambda step: False) -> None:
    st = StepStats(norm=np.ones(2), absmax=np.ones(2), nonfinite=np.zeros(2, np.int64),
                   has_grad=np.ones(2, bool))
    for step in range(steps):
        h.append(StepRecord(step, per_param=st, global_norm=1.0))
        if marked(step):
            h.mark(step)


def test_few_marked_steps_all_stay_with_the_first_and_latest():
    h = History(["w", "b"], [4, 1], (), max_steps=100, max_rows=200)
    marks = {7, 333, 2_500, 4_321, 9_000}
    _fill(h, 10_000, marks.__contains__)
    steps = set(h.steps_frame()["step"])
    stats = set(h.stats_frame()["step"])
    assert marks | {0, 9_999} <= steps and marks | {0, 9_999} <= stats
    assert len(steps) <= 100 and h.sizes()["rows"] <= 100


def test_thinning_drops_a_share_at_once_under_a_mark_every_other_step():
    """An anomaly every other step: the history stays bounded, each thinning drops a share of
    the rows at once (amortised O(1) per step: not a thinning per step), the first marked
    steps stay and the rest of the run is thinned evenly."""
    h = History(["w", "b"], [4, 1], (), max_steps=200, max_rows=400)
    _fill(h, 50_000, lambda step: step % 2 == 1)
    sizes = h.sizes()
    assert sizes["rows"] <= 200 and sizes["step_rows"] <= 200 and sizes["pending"] == 0
    # each thinning drops at least a quarter of the thinnable rows (>= 3/8 of 200): at most
    # 2 x 50,000 / 18 thinnings for the two tables (one per append before)
    assert sizes["thinnings"] < 50_000 // 8, sizes
    steps = h.steps_frame()["step"].to_numpy()
    assert steps[0] == 0 and steps[-1] == 49_999
    assert set(range(1, 100, 2)) <= set(steps)  # the first 50 marked steps (cap // 4) stay
    cut = np.flatnonzero(np.diff(steps) != 1)[-1] + 1
    latest = steps[cut:]  # the latest steps, whole: at least cap // 4
    assert len(latest) >= 50 and latest[-1] == 49_999
    middle = steps[(steps > 200) & (steps < latest[0])]
    gaps = np.unique(np.diff(middle))
    assert len(middle) > 20 and len(gaps) == 1, gaps  # evenly spaced


def test_absmax_of_on_the_cpu_is_each_tensors_largest_magnitude_in_chunks_of_bounded_memory(monkeypatch):
    import torch
    import graddbg.stats as stats
    torch.manual_seed(0)
    ts = [torch.randn(64, 64) for _ in range(5)] + [torch.randn(300)] + [torch.randn(64) for _ in range(5)]
    ts[1][3, 4], ts[7][0] = float("nan"), -float("inf")
    ts[2][0, 0] = -1e3  # (a negative entry is the largest magnitude)
    want = torch.stack([t.abs().max() for t in ts])
    monkeypatch.setattr(stats, "_ABS_CHUNK", 300 * 4)  # (the 300-entry tensor fills a chunk; 64x64 ones are over)
    assert [len(c) for c in stats._chunks(ts, stats._ABS_CHUNK)] == [1, 1, 1, 1, 1, 1, 4, 1]
    got = stats.absmax_of(ts)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])
    assert got[2].item() == 1e3 and got[7].item() == float("inf")
