"""Detection power of gradient checkers on planted bugs, and their cost.

Three families of functions, each a custom autograd.Function whose backward can carry a
planted bug, at sizes of 10 to 10,000 input elements:

- ``elementwise``: y = sin(x) * x                    (diagonal Jacobian)
- ``matmul``:      y = X @ W + W, W the input (q x q), X fixed   (dense Jacobian)
- ``complex``:     y = z * exp(z), z complex128      (holomorphic; backward g * conj(f'(z)))

Bugs: ``scale`` (the gradient times 1.01), ``dropped`` (one derivative term left out:
sin(x), the residual, resp. exp(z)), ``transposed`` (the weight gradient transposed;
matmul only), ``conj`` (f'(z) not conjugated, the Wirtinger mistake; complex only),
``entry`` (one Jacobian entry doubled). ``none`` is the correct function (false alarms).
For every (family, size, bug, seed) the checkers below run interleaved, all in torch's
calling convention (graddbg as the drop-in):

    torch slow    torch.autograd.gradcheck(fn, (x,), fast_mode=False)   (sizes <= --slow-max)
    torch fast    torch.autograd.gradcheck(fn, (x,), fast_mode=True)
    graddbg full  graddbg.gradcheck(fn, (x,), fast_mode=False)          (sizes <= --full-max)
    graddbg fast  graddbg.gradcheck(fn, (x,), fast_mode=True, seed=seed)

and the script prints the detection rate of each checker per bug and size, the false
alarm rate, and the median cost of graddbg fast over torch fast on the correct functions.

    python bench/gradcheck_power.py                 # sizes 10 100 1000 10000, 5 seeds
    python bench/gradcheck_power.py --seeds 3 --sizes 10 100
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections import defaultdict

import torch

BUGS = ("none", "scale", "dropped", "transposed", "conj", "entry")
FAMILIES = {"elementwise": ("none", "scale", "dropped", "entry"),
            "matmul": ("none", "scale", "dropped", "transposed", "entry"),
            "complex": ("none", "scale", "dropped", "conj", "entry")}


class _Elementwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bug, j):
        ctx.save_for_backward(x)
        ctx.bug, ctx.j = bug, j
        return x.sin() * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if ctx.bug == "dropped":
            d = x.cos() * x                               # forgot + sin(x)
        else:
            d = x.cos() * x + x.sin()
        if ctx.bug == "scale":
            d = d * 1.01
        if ctx.bug == "entry":
            d = d.reshape(-1).clone()
            d[ctx.j] = 2 * d[ctx.j]
            d = d.reshape(x.shape)
        return g * d, None, None


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, xmat, bug, ij):
        ctx.save_for_backward(w, xmat)
        ctx.bug, ctx.ij = bug, ij
        return xmat @ w + w

    @staticmethod
    def backward(ctx, g):
        w, xmat = ctx.saved_tensors
        gw = xmat.T @ g
        if ctx.bug == "transposed":
            gw = gw.T
        if ctx.bug != "dropped":
            gw = gw + g                                   # the residual's term
        if ctx.bug == "scale":
            gw = gw * 1.01
        if ctx.bug == "entry":
            # d y[i, k] / d w[j, k] = X[i, j]: count that one entry twice
            i, j, k = ctx.ij
            gw = gw.clone()
            gw[j, k] = gw[j, k] + xmat[i, j] * g[i, k]
        return gw, None, None, None


class _ComplexExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, bug, j):
        ctx.save_for_backward(z)
        ctx.bug, ctx.j = bug, j
        return z * z.exp()

    @staticmethod
    def backward(ctx, g):
        (z,) = ctx.saved_tensors
        d = z * z.exp() if ctx.bug == "dropped" else (1 + z) * z.exp()   # f'(z)
        if ctx.bug != "conj":
            d = d.conj()                                  # torch's convention: g * conj(f')
        if ctx.bug == "scale":
            d = d * 1.01
        if ctx.bug == "entry":
            d = d.reshape(-1).clone()
            d[ctx.j] = 2 * d[ctx.j]
            d = d.reshape(z.shape)
        return g * d, None, None


def problem(family: str, size: int, bug: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    if family == "elementwise":
        x = torch.randn(size, generator=gen, dtype=torch.float64).requires_grad_()
        j = int(torch.randint(size, (1,), generator=gen))
        return (lambda t: _Elementwise.apply(t, bug, j)), x
    if family == "complex":
        z = (0.5 * torch.randn(size, generator=gen, dtype=torch.complex128)).requires_grad_()
        j = int(torch.randint(size, (1,), generator=gen))
        return (lambda t: _ComplexExp.apply(t, bug, j)), z
    q = max(2, round(size ** 0.5))
    w = (torch.randn(q, q, generator=gen, dtype=torch.float64) / q ** 0.5).requires_grad_()
    xmat = torch.randn(q, q, generator=gen, dtype=torch.float64) / q ** 0.5
    ij = tuple(int(v) for v in torch.randint(q, (3,), generator=gen))
    return (lambda t: _Matmul.apply(t, xmat, bug, ij)), w


def checkers(full_max: int, slow_max: int):
    import graddbg

    def torch_slow(fn, x, seed):
        return torch.autograd.gradcheck(fn, (x,), fast_mode=False, raise_exception=False)

    def torch_fast(fn, x, seed):
        return torch.autograd.gradcheck(fn, (x,), fast_mode=True, raise_exception=False)

    def graddbg_full(fn, x, seed):
        return graddbg.gradcheck(fn, (x,), fast_mode=False, raise_exception=False).ok

    def graddbg_fast(fn, x, seed):
        return graddbg.gradcheck(fn, (x,), fast_mode=True, seed=seed, raise_exception=False).ok

    return {"torch slow": (torch_slow, slow_max), "torch fast": (torch_fast, None),
            "graddbg full": (graddbg_full, full_max), "graddbg fast": (graddbg_fast, None)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[10, 100, 1000, 10000])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--full-max", type=int, default=1000, help="largest size for graddbg full")
    ap.add_argument("--slow-max", type=int, default=100, help="largest size for torch slow")
    ap.add_argument("--families", nargs="*", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cks = checkers(args.full_max, args.slow_max)
    flagged = defaultdict(int)        # (checker, family, size, bug) -> flagged count
    runs = defaultdict(int)
    cost = defaultdict(list)          # (family, size) -> [graddbg fast / torch fast] on bug none
    t_start = time.perf_counter()
    for family in args.families:
        for size in args.sizes:
            for bug in FAMILIES[family]:
                for seed in range(args.seeds):
                    fn, x = problem(family, size, bug, seed)
                    times = {}
                    names = list(cks)
                    k = seed % len(names)
                    for name in names[k:] + names[:k]:        # rotate the order
                        check, limit = cks[name]
                        if limit is not None and size > limit:
                            continue
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            t0 = time.perf_counter()
                            ok = check(fn, x, seed)
                            times[name] = time.perf_counter() - t0
                        flagged[name, family, size, bug] += not ok
                        runs[name, family, size, bug] += 1
                    if bug == "none":
                        cost[family, size].append(times["graddbg fast"] / times["torch fast"])
    wall = time.perf_counter() - t_start
    print(f"planted-bug detection over {args.seeds} seeds (sizes = input elements); "
          f"wall {wall:.1f}s, torch threads {args.threads}")
    for family in args.families:
        print(f"\n{family}:  rate flagged (bug 'none' = false alarms)")
        header = f"  {'checker':13s} {'bug':10s}" + "".join(f"{s:>9d}" for s in args.sizes)
        print(header)
        for bug in FAMILIES[family]:
            for name in cks:
                cells = []
                for size in args.sizes:
                    n = runs[name, family, size, bug]
                    cells.append(f"{100 * flagged[name, family, size, bug] / n:8.0f}%" if n else f"{'-':>9s}")
                print(f"  {name:13s} {bug:10s}" + "".join(cells))
        print("  cost graddbg fast / torch fast (median, correct function): " +
              ", ".join(f"{s}: {statistics.median(cost[family, s]):.2f}x" for s in args.sizes))
    fams = args.families
    for who in ("graddbg fast", "torch fast"):
        for label, planted in (("scale/dropped/transposed/conj", ("scale", "dropped", "transposed", "conj")),
                               ("one-element (entry)", ("entry",))):
            tot = sum(runs[who, f, s, b] for f in fams for s in args.sizes for b in planted)
            hit = sum(flagged[who, f, s, b] for f in fams for s in args.sizes for b in planted)
            print(f"\n{who}: {label} bugs detected in {hit}/{tot} ({100 * hit / max(tot, 1):.1f}%)", end="")
        fa_n = sum(runs[who, f, s, "none"] for f in fams for s in args.sizes)
        fa = sum(flagged[who, f, s, "none"] for f in fams for s in args.sizes)
        print(f"\n{who}: false alarms {fa}/{fa_n}")


if __name__ == "__main__":
    main()
