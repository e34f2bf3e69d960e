"""Train a small model under graddbg.watch and print the per-parameter summary table.

    .venv/bin/python examples/quickstart.py
"""
import torch
from torch import nn
import torch.nn.functional as F

import graddbg


def main(steps: int = 100) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    w_true = torch.randn(20, 4)
    with graddbg.watch(model, opt, update_every=10) as w:
        for _ in range(steps):
            x = torch.randn(128, 20)
            y = (x @ w_true).argmax(1)
            F.cross_entropy(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    import pandas as pd

    with pd.option_context("display.width", 120, "display.max_columns", 20):
        print(w.summary()[["name", "numel", "norm_mean", "norm_max", "absmax_max", "nonfinite_total",
                           "update_ratio_mean"]].to_string(index=False))
    steps_df = w.steps
    print(f"\n{len(steps_df)} steps, global norm (pre-clip) median {steps_df.global_norm.median():.3g}, "
          f"post-clip max {steps_df.clipped_norm.max():.3g}, anomalies: {len(w.anomalies)}")


if __name__ == "__main__":
    main()
