"""graddbg.graph vs torchviz.make_dot (+ dot), side by side on the same graphs, in one run.

For each model: node counts; time of extraction + DOT text (graddbg with module
attribution, torchviz.make_dot + .source); the forward-pass cost of recording modules
(trace_modules); and the time to render SVG, everything through the graphviz Python
package and its dot subprocess: torchviz's full graph (what torchviz users get) and
graddbg's full graph with clusters, collapsed to depth 2 and to depth 3 (render_source),
so that the report says where a speed-up comes from: fewer nodes to lay out. Depth d draws
every module at depth d as one node (the model's children are depth 1). Timings are
medians over interleaved repeats (A, B, A, B, ...) so that machine noise hits both sides
alike; renders under 20 ms are averaged over several calls per sample. Ratios are printed.

Targets (issue 5): extraction + DOT within 2x of make_dot and linear in node count (chains
up to 8,000 nodes: graddbg's walk stops at WALK_LIMIT = 10,000 autograd nodes); depth 2
gives >= 10x fewer SVG nodes and renders >= 5x faster than torchviz's full graph; the
96-layer transformer renders in full with clusters.

    python bench/graph_render.py            # 4/24/96-layer transformers, ResNet, chains
    python bench/graph_render.py --quick    # 4/24-layer transformers, ResNet, 2 chains

The transformers are bench/_models.transformer(layers) (d=256) on a batch of 1 x 16 tokens:
the autograd graph does not depend on batch size, and small batches keep the forward cheap.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from typing import Dict  # noqa: E402

from graddbg.graphviz import WALK_LIMIT, collapse, extract, render_source, to_dot, trace_modules  # noqa: E402


class _Step(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 1.0001).sin()  # two autograd nodes per module


def chain(nodes: int):
    model = nn.Sequential(*[_Step() for _ in range(nodes // 2)])
    x = torch.randn(4, requires_grad=True)
    return model, (lambda: (x, None)), (lambda out, y: out.sum())


def _problem(name: str):
    from _models import resnet18ish, transformer

    if name.startswith("transformer"):
        model, make_batch, loss_fn = transformer(int(name[len("transformer"):]))
        x, y = make_batch()
        x, y = x[:1, :16], y[:1, :16]
        return model, (lambda: (x, y)), loss_fn
    if name == "resnet18ish":
        model, make_batch, loss_fn = resnet18ish()
        x, y = make_batch()
        x, y = x[:2], y[:2]
        return model, (lambda: (x, y)), loss_fn
    if name.startswith("chain"):
        return chain(int(name[len("chain"):]))
    raise ValueError(name)


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _svg_nodes(svg: bytes) -> int:
    return svg.count(b'class="node"')


def run_case(name: str, repeats: int, render_repeats: int, render_tv: bool) -> dict:
    """Chains (render_tv=False) are timed for extraction only: dot needs gigabytes for
    thousands of sibling clusters, and the chain is there for linearity."""
    import torchviz

    model, make_batch, loss_fn = _problem(name)
    x, y = make_batch()
    params = dict(model.named_parameters())

    def forward():
        return loss_fn(model(x), y)

    def forward_traced():
        with trace_modules(model) as tr:
            return loss_fn(model(x), y), tr

    loss, (loss_tr, tr) = forward(), forward_traced()  # warm-up
    first, _unused = _timed(lambda: torchviz.make_dot(loss, params=params).source)
    inner = max(1, int(0.05 / max(first, 1e-6)))  # small graphs: average a few runs per sample
    t_fwd, t_fwd_tr, t_tv, t_ours = [], [], [], []
    for _ in range(repeats):
        t, loss = _timed(forward)
        t_fwd.append(t)
        t, (loss_tr, tr) = _timed(forward_traced)
        t_fwd_tr.append(t)
        t = time.perf_counter()
        for _unused in range(inner):
            dot_tv = torchviz.make_dot(loss, params=params)
            dot_tv.source  # the DOT text is part of make_dot's work for its users
        t_tv.append((time.perf_counter() - t) / inner)
        t = time.perf_counter()
        for _unused in range(inner):
            src = to_dot(extract(loss_tr, model=tr, max_nodes=None))
        t_ours.append((time.perf_counter() - t) / inner)
    g = extract(loss_tr, model=tr, max_nodes=None)
    srcs = {"full": src, "d2": to_dot(collapse(g, 2)), "d3": to_dot(collapse(g, 3))}
    nodes = {"full": len(g.nodes), "d2": len(collapse(g, 2).nodes), "d3": len(collapse(g, 3).nodes)}
    n_tv = sum(1 for line in dot_tv.body if " -> " not in line and "[label=" in line)

    # renderers, timed interleaved, all through the graphviz package's dot subprocess:
    # torchviz's graph as its users render it, graddbg's as render_source does
    jobs = {"tv": lambda: dot_tv.pipe(format="svg"), "empty": lambda: render_source("digraph {}")}
    for k, text in srcs.items():
        jobs[k] = (lambda t=text: render_source(t, "svg"))
    times: Dict[str, list] = {k: [] for k in jobs}
    svgs: Dict[str, bytes] = {}
    inner = {k: 1 for k in jobs}
    once = set()  # renders over a second: the warm-up run is the measurement
    for k, fn in jobs.items():  # warm-up, and how many calls per sample
        t, svgs[k] = _timed(fn) if render_tv else (float("nan"), b"")
        if t < 0.02:
            inner[k] = max(1, min(50, int(0.02 / max(t, 1e-5))))
        elif t > 1.0:
            times[k].append(t)
            once.add(k)
    for _ in range(render_repeats if render_tv else 0):
        for k, fn in jobs.items():
            if k in once:
                continue
            t = time.perf_counter()
            for _unused in range(inner[k]):
                fn()
            times[k].append((time.perf_counter() - t) / inner[k])

    def med(xs: list) -> float:
        return statistics.median(xs) if xs else float("nan")

    out = {
        "name": name, "nodes_tv": n_tv, "nodes_ours": nodes["full"], "nodes_d2": nodes["d2"],
        "nodes_d3": nodes["d3"], "nodes_full": nodes["full"], "clusters": src.count("subgraph cluster_"),
        "fwd": med(t_fwd), "fwd_traced": med(t_fwd_tr),
        "trace_overhead": med([b - a for a, b in zip(t_fwd, t_fwd_tr)]),  # paired differences
        "extract_tv": med(t_tv), "extract_ours": med(t_ours),
        "svg_tv": _svg_nodes(svgs.get("tv", b"")),
    }
    for k in jobs:
        out[f"render_{k}"] = med(times[k])
    for k in srcs:
        out[f"svg_{k}"] = _svg_nodes(svgs.get(k, b""))
    return out


def torchviz_recursion_check(nodes: int) -> str:
    """Does make_dot survive a chain this deep under the default recursion limit?"""
    import torchviz

    x = torch.randn(2, requires_grad=True)
    y = x
    for _ in range(nodes):
        y = y * 1.0001
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        torchviz.make_dot(y.sum())
        tv = "ok"
    except RecursionError:
        tv = "RecursionError"
    finally:
        sys.setrecursionlimit(old)
    g = extract(y.sum(), max_nodes=None)
    return f"{nodes}-op chain at recursion limit 1000: torchviz {tv}, graddbg ok ({len(g.nodes)} nodes)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a fast subset")
    parser.add_argument("--repeats", type=int, default=None, help="extraction repeats")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # torchviz uses distutils
    torch.manual_seed(0)
    if args.quick:
        cases = ["transformer4", "transformer24", "resnet18ish", "chain2000", "chain8000"]
        repeats = args.repeats or 3
    else:
        cases = ["transformer4", "transformer24", "transformer96", "resnet18ish",
                 "chain1000", "chain2000", "chain4000", "chain8000"]
        repeats = args.repeats or 5
    # torchviz recurses once per node of depth: give it room (graddbg does not need it)
    sys.setrecursionlimit(1_000_000)
    print(torchviz_recursion_check(3000))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, repeats={repeats}, "
          f"graddbg's walk stops at {WALK_LIMIT} autograd nodes")
    rows = []
    for name in cases:
        big = name in ("transformer96",) or name.startswith("chain")
        rows.append(run_case(name, repeats=repeats if not name == "transformer96" else max(2, repeats // 2),
                             render_repeats=1 if big else 5, render_tv=not name.startswith("chain")))
        r = rows[-1]
        print(f"\n== {name}: nodes torchviz {r['nodes_tv']}, graddbg {r['nodes_ours']} "
              f"({r['clusters']} clusters), depth 2: {r['nodes_d2']}, depth 3: {r['nodes_d3']}")
        print(f"   extract+DOT  torchviz {r['extract_tv'] * 1e3:8.1f} ms   graddbg {r['extract_ours'] * 1e3:8.1f} ms"
              f"   ratio graddbg/torchviz {r['extract_ours'] / r['extract_tv']:.2f}x (target <= 2)"
              f"   {r['extract_ours'] / max(r['nodes_ours'], 1) * 1e6:.1f} us/node")
        over = r["trace_overhead"]
        print(f"   forward      plain {r['fwd'] * 1e3:8.1f} ms   with trace_modules {r['fwd_traced'] * 1e3:8.1f} ms"
              f"   (median paired difference {over * 1e3:+.1f} ms);  extract+DOT+that vs torchviz: "
              f"{(r['extract_ours'] + over) / r['extract_tv']:.2f}x")
        if not r["svg_tv"]:
            continue

        def ms(key: str) -> str:
            v = r.get(f"render_{key}", float("nan"))
            return "       n/a" if v != v else f"{v * 1e3:8.1f} ms"
        print(f"   render svg   torchviz full {ms('tv')}   ({r['svg_tv']} SVG nodes);"
              f"  dot start-up (empty graph) {ms('empty')}")
        for k, label in (("full", "full+clusters"), ("d2", "depth 2"), ("d3", "depth 3")):
            print(f"   graddbg {label:<13} ({r['svg_' + k]:5d} SVG nodes)   {ms(k)}"
                  f"   ratio torchviz/graddbg {r['render_tv'] / r['render_' + k]:6.1f}x")
        for k in ("d2", "d3"):
            fewer = r["svg_tv"] / max(r["svg_" + k], 1)
            target = "  TARGET" if k == "d2" else "  (one level more)"
            print(f"   depth {k[1]} vs torchviz full:{target}: {fewer:5.1f}x fewer SVG nodes (target >= 10);"
                  f" renders {r['render_tv'] / r['render_' + k]:6.1f}x faster (target >= 5)")
        sys.stdout.flush()
    chains = [r for r in rows if r["name"].startswith("chain")]
    if len(chains) >= 2:
        print("\nlinearity (graddbg extract+DOT with modules, us per node):")
        for r in chains:
            print(f"   {r['name']:>12}: {r['nodes_ours']:6d} nodes  {r['extract_ours'] * 1e3:8.1f} ms"
                  f"  {r['extract_ours'] / r['nodes_ours'] * 1e6:6.2f} us/node"
                  f"   (torchviz {r['extract_tv'] / r['nodes_tv'] * 1e6:6.2f} us/node)")
        a, b = chains[0], chains[-1]
        print(f"   time ratio {b['extract_ours'] / a['extract_ours']:.2f}x for node ratio "
              f"{b['nodes_ours'] / a['nodes_ours']:.2f}x")


if __name__ == "__main__":
    threading.stack_size(512 * 1024 * 1024)  # torchviz's recursion on deep graphs
    failed = []

    def target() -> None:
        try:
            main()
        except BaseException as exc:  # report, and exit non-zero from the main thread
            failed.append(exc)
            raise

    t = threading.Thread(target=target)
    t.start()
    t.join()
    sys.exit(1 if failed else 0)
