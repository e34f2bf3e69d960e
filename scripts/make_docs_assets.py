#!/usr/bin/env python
"""Make the pictures that README.md and the docs show, into docs/assets/.

    .venv/bin/python scripts/make_docs_assets.py

- ``norms.png``: gradient norms of a watched run whose learning rate jumps at step 60
  (``w.plot("norms")``);
- ``flow.png``: the gradient flow by layer at the last step (``w.plot("flow")``);
- ``graph.svg``: the autograd graph of a small model with gradients (``graddbg.graph``);
- ``report.png``: a screenshot of the run's HTML report, taken with headless Chromium
  (Debian's ``chromium``; when it is missing the old picture is kept and a line says so).

The same code as the README's examples, on a model that gives something to see. Run it
after a change that alters these pictures and commit them.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "docs" / "assets"
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars"]


def watched_run():
    import torch
    import torch.nn.functional as F
    from torch import nn

    import graddbg

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with graddbg.watch(model, opt, explode="record") as w:
        for step in range(100):
            if step == 60:
                for group in opt.param_groups:
                    group["lr"] = 2.0  # a learning-rate spike
            x = torch.randn(64, 10)
            F.cross_entropy(model(x), (x[:, 0] > 0).long()).backward()
            opt.step()
            opt.zero_grad()
    return model, w


def screenshot(html: Path, png: Path, size: str = "1280,900") -> bool:
    if not Path(CHROMIUM).exists():
        print(f"{CHROMIUM} is missing (apt-get install -y chromium): {png.name} kept as it is",
              file=sys.stderr)
        return False
    with tempfile.TemporaryDirectory(prefix="graddbg-chromium-") as profile:
        subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", f"--window-size={size}",
                        f"--screenshot={png}", html.resolve().as_uri()],
                       check=True, capture_output=True, timeout=120)
    return True


def main() -> int:
    import matplotlib

    matplotlib.use("Agg")
    import torch

    import graddbg

    ASSETS.mkdir(parents=True, exist_ok=True)
    model, w = watched_run()
    for kind in ("norms", "flow"):
        fig = w.plot(kind)
        fig.savefig(ASSETS / f"{kind}.png", dpi=80, bbox_inches="tight")
    small = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    g = graddbg.graph(lambda: small(torch.randn(2, 4)).sum(), model=small, grads=True)
    (ASSETS / "graph.svg").write_bytes(graddbg.graphviz.render_source(g.source, "svg"))
    with tempfile.TemporaryDirectory(prefix="graddbg-assets-") as tmp:
        report = w.report(Path(tmp) / "report.html")
        screenshot(report, ASSETS / "report.png")
    for p in sorted(ASSETS.iterdir()):
        print(f"{p.relative_to(ROOT)}: {p.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
