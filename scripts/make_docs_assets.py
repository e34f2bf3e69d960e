#!/usr/bin/env python
"""Make the pictures that README.md and the docs show, into docs/assets/.

    .venv/bin/python scripts/make_docs_assets.py

- ``norms.png``: gradient norms of a watched run whose learning rate jumps at step 60
  (``w.plot("norms")``);
- ``flow.png``: the gradient flow by layer at the last step whose max |grad| was measured
  (on the CPU every 10th recorded step: ``w.plot("flow", step=...)``);
- ``graph.svg``: the autograd graph of a small model with gradients (``graddbg.graph``);
- ``modules.svg``: graddbg's modules and their imports, parsed from the code;
- ``events.svg``: the step's path in ten boxes, from the hooks to the read side;
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


def module_imports() -> dict:
    """{module: sorted graddbg modules it imports}, from the source (any depth of import)."""
    import ast

    pkg = ROOT / "graddbg"
    mods = {p.stem for p in pkg.glob("*.py") if p.stem not in ("__main__", "__init__")}
    mods |= {p.name for p in pkg.iterdir() if (p / "__init__.py").exists()}
    arrows = {}
    for m in sorted(mods):
        path = pkg / f"{m}.py" if (pkg / f"{m}.py").exists() else pkg / m / "__init__.py"
        files = [path] if path.name != "__init__.py" else sorted(path.parent.glob("*.py"))
        seen = set()
        for f in files:
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    # "from graddbg import stats" imports the module graddbg.stats
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                else:
                    names = []
                for n in names:
                    parts = n.split(".")
                    if parts[0] == "graddbg" and len(parts) > 1 and parts[1] in mods and parts[1] != m:
                        seen.add(parts[1])
        arrows[m] = sorted(seen)
    return arrows


def modules_dot() -> str:
    rank = {"cli": 0, "report": 1, "callbacks": 1, "pytest_plugin": 1, "hooks": 2, "checks": 2,
            "options": 3, "run": 3, "plots": 3, "ddp_verify": 3, "blame": 3, "gradcheck": 3,
            "graphviz": 3, "stats": 4, "anomaly": 4, "_io": 5, "_source": 5, "_model": 5, "_errors": 6}
    arrows = module_imports()
    lines = ["digraph {", '  graph [rankdir=TB fontname="Helvetica" nodesep=0.3 ranksep=0.45]',
             '  node [shape=box style="rounded,filled" fillcolor="#eef2ff" fontname="Helvetica" fontsize=11]',
             '  edge [color="#64748b" arrowsize=0.6]']
    by_rank: dict = {}
    for m in arrows:
        by_rank.setdefault(rank.get(m, 3), []).append(m)
    for r, ms in sorted(by_rank.items()):
        lines.append("  { rank=same; " + " ".join(f'"{m}";' for m in ms) + " }")
    for m, deps in arrows.items():
        for d in deps:
            if d != "_errors":  # everything imports the errors: drawn once, as a note
                lines.append(f'  "{m}" -> "{d}"')
    lines.append('  note [shape=note fillcolor="#fff7ed" label="every module imports _errors"]')
    lines.append("}")
    return "\n".join(lines)


EVENTS_DOT = """digraph {
  graph [rankdir=TB fontname="Helvetica" nodesep=0.3 ranksep=0.3]
  node [fontname="Helvetica" fontsize=11 shape=box style="rounded,filled" fillcolor="#eef2ff" width=5.2]
  edge [color="#64748b" arrowsize=0.6]
  hooks [label="1. hooks (HookSet): root forward, end of backward (after DDP's reducer),\noptimizer pre/post step  ->  StepPipeline's events"]
  clock [label="2. StepClock: is this a step boundary? (optimizer step, backward without one, w.step())"]
  keeper [label="3. LedgerKeeper.begin: the step's host facts (StepEntry: passes, grads touched, lrs)"]
  queue [label="4. queue: the recorder and each check add device reads to the Readback\n(and int64 sums to the step's PackedSum)" fillcolor="#f0fdf4"]
  reduce [label="5. one collective (PackedSum.run: non-finite flags, replica hash), all ranks arrived"]
  fetch [label="6. one read-back (Readback.fetch): the step's only host synchronisation"]
  read [label="7. read: each check, in the order its `after` declares, reads its slots\nand returns Findings" fillcolor="#f0fdf4"]
  record [label="8. Step.record_into: the row of w.stats / w.steps (History) and the ledger entry,\nunder one retention rule (Retained)"]
  policy [label="9. policies, once per step: raise / warn / skip / record -> anomalies, log_to" fillcolor="#fff7ed"]
  run [label="10. the read side: Watch -> Run (stats, steps, ledger, plot, report, save)"]
  hooks -> clock -> keeper -> queue -> reduce -> fetch -> read -> record -> policy -> run
}"""



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
    stats = w.stats
    measured = int(stats.loc[stats["absmax"].notna(), "step"].max())
    for kind, kw in (("norms", {}), ("flow", {"step": measured})):
        fig = w.plot(kind, **kw)
        fig.savefig(ASSETS / f"{kind}.png", dpi=80, bbox_inches="tight")
    small = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    g = graddbg.graph(lambda: small(torch.randn(2, 4)).sum(), model=small, grads=True)
    (ASSETS / "graph.svg").write_bytes(graddbg.graphviz.render_source(g.source, "svg"))
    (ASSETS / "modules.svg").write_bytes(graddbg.graphviz.render_source(modules_dot(), "svg"))
    (ASSETS / "events.svg").write_bytes(graddbg.graphviz.render_source(EVENTS_DOT, "svg"))
    with tempfile.TemporaryDirectory(prefix="graddbg-assets-") as tmp:
        report = w.report(Path(tmp) / "report.html")
        screenshot(report, ASSETS / "report.png")
    for p in sorted(ASSETS.iterdir()):
        print(f"{p.relative_to(ROOT)}: {p.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
