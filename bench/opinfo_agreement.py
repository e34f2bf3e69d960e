"""graddbg.gradcheck against torch.autograd.gradcheck on PyTorch's OpInfo database.

For every op of ``torch.testing._internal.common_methods_invocations.op_db`` that supports
autograd and float64 on CPU, take its first sample input (built the way PyTorch's own
test_ops gradcheck does: tensor lists splatted, non-differentiable arguments put back by a
wrapper). On the samples where ``torch.autograd.gradcheck(fast_mode=False)`` passes, run

    torch slow   torch.autograd.gradcheck(fast_mode=False)
    torch fast   torch.autograd.gradcheck(fast_mode=True)
    graddbg full graddbg.gradcheck(mode="full")
    graddbg fast graddbg.gradcheck(mode="fast")

interleaved per sample (the order rotates), and print the agreement (graddbg passes where
torch passes; target >= 99%), the samples where it does not with the reason, the total
time of each checker with the ratios, and the 10 most expensive ops of each checker next
to the other checker of the same kind (full with torch slow, fast with torch fast). Needs the dev extras expecttest, hypothesis.

    python bench/opinfo_agreement.py            # the whole corpus
    python bench/opinfo_agreement.py --limit 50 # the first 50 ops
"""
from __future__ import annotations

import argparse
import time
import traceback
import warnings

import torch


def _samples(limit, only):
    from torch.testing._internal.common_methods_invocations import op_db

    n = 0
    for op in op_db:
        if only and op.name not in only:
            continue
        if not op.supports_autograd:
            continue
        try:
            if torch.float64 not in op.supported_dtypes("cpu"):
                continue
            sample = next(iter(op.sample_inputs("cpu", torch.float64, requires_grad=True)), None)
        except Exception:  # noqa: BLE001 - a broken sample generator is not our concern
            continue
        if sample is None:
            continue
        name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        yield name, op, sample
        n += 1
        if limit and n >= limit:
            return


def _problem(op, sample):
    """(fn, grad_args) as PyTorch's test_ops._gradcheck_helper builds them."""
    from torch.testing._internal.common_utils import is_iterable_of_tensors

    listed = is_iterable_of_tensors(sample.input)
    all_args = (*sample.input, *sample.args) if listed else (sample.input, *sample.args)
    grad_pos = [i for i, a in enumerate(all_args) if isinstance(a, torch.Tensor) and a.requires_grad]
    variant = op.get_op()

    def fn(*grads):
        args = list(all_args)
        for p, g in zip(grad_pos, grads):
            args[p] = g
        if listed:
            n = len(sample.input)
            args = [args[:n], *args[n:]]
        out = op.gradcheck_wrapper(variant, *args, **sample.kwargs)
        if sample.output_process_fn_grad is not None:
            return sample.output_process_fn_grad(out)
        return out

    return fn, tuple(all_args[i] for i in grad_pos), op.gradcheck_nondet_tol


def _checkers():
    import graddbg

    def torch_slow(fn, args, nd):
        return torch.autograd.gradcheck(fn, args, fast_mode=False, nondet_tol=nd,
                                        raise_exception=False)

    def torch_fast(fn, args, nd):
        return torch.autograd.gradcheck(fn, args, fast_mode=True, nondet_tol=nd,
                                        raise_exception=False)

    def graddbg_full(fn, args, nd):
        return graddbg.gradcheck(fn, *args, mode="full", nondet_tol=nd or None)

    def graddbg_fast(fn, args, nd):
        return graddbg.gradcheck(fn, *args, mode="fast", nondet_tol=nd or None)

    return {"torch slow": torch_slow, "torch fast": torch_fast,
            "graddbg full": graddbg_full, "graddbg fast": graddbg_fast}


def _timed(check, fn, args, nd):
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = check(fn, args, nd)
        verdict, why = bool(out), (None if bool(out) else str(out))
    except Exception as exc:  # noqa: BLE001 - record the reason
        verdict, why = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return verdict, why, time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=0, help="only the first N eligible ops")
    ap.add_argument("--ops", nargs="*", default=None, help="only these op names")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    checkers = _checkers()
    names = list(checkers)
    totals = dict.fromkeys(names, 0.0)
    passes = dict.fromkeys(names, 0)
    disagree = {n: [] for n in names if n.startswith("graddbg")}
    torch_failed, skipped, corpus = [], [], 0
    per_op = []
    t_start = time.perf_counter()
    for i, (name, op, sample) in enumerate(_samples(args.limit, set(args.ops or ()))):
        try:
            fn, gargs, nd = _problem(op, sample)
        except Exception:  # noqa: BLE001
            skipped.append((name, "could not build the problem"))
            continue
        if not gargs:
            skipped.append((name, "no input requires grad"))
            continue
        ok, why, dt = _timed(checkers["torch slow"], fn, gargs, nd)
        if not ok:
            torch_failed.append((name, why))
            continue
        corpus += 1
        results = {"torch slow": (ok, why, dt)}
        rest = names[1:]
        k = i % len(rest)
        for n in rest[k:] + rest[:k]:                    # rotate the order
            results[n] = _timed(checkers[n], fn, gargs, nd)
        per_op.append((name, {n: r[2] for n, r in results.items()}))
        for n, (ok_n, why_n, dt_n) in results.items():
            totals[n] += dt_n
            passes[n] += ok_n
            if n in disagree and not ok_n:
                disagree[n].append((name, (why_n or "").replace("\n", " | ")[:400]))
        if args.verbose:
            print(f"{name:40s} " + "  ".join(f"{n}={'ok' if r[0] else 'FAIL'} {r[2]*1e3:7.1f}ms"
                                             for n, r in results.items()), flush=True)
    wall = time.perf_counter() - t_start
    print(f"\nOpInfo corpus: {corpus} ops (first sample, float64, CPU) where torch slow "
          f"gradcheck passes; {len(torch_failed)} where it fails (excluded), "
          f"{len(skipped)} skipped; wall {wall:.1f}s, torch threads {args.threads}")
    for n in names:
        print(f"  {n:13s} passes {passes[n]:4d}/{corpus} ({100 * passes[n] / max(corpus, 1):6.2f}%)"
              f"   total time {totals[n]:8.2f}s")
    print(f"  speed: graddbg full is {totals['torch slow'] / max(totals['graddbg full'], 1e-9):.2f}x "
          f"torch slow;  graddbg fast is {totals['torch fast'] / max(totals['graddbg fast'], 1e-9):.2f}x "
          f"torch fast  (>1 means graddbg is faster)")
    if per_op:
        import math
        import statistics

        def gmean(a, b):
            return math.exp(statistics.fmean(math.log(t[a] / t[b]) for _, t in per_op))

        big = [name for name, t in per_op if t["torch slow"] > 5.0]
        small = [t for name, t in per_op if name not in big]
        print(f"  per-op geometric mean: graddbg full {gmean('torch slow', 'graddbg full'):.2f}x "
              f"faster than torch slow; graddbg fast {gmean('torch fast', 'graddbg fast'):.2f}x "
              f"torch fast")
        print(f"  the {len(big)} ops where torch slow takes > 5 s ({', '.join(big)}) take "
              f"{sum(t['torch slow'] for n, t in per_op if n in big):.1f}s torch slow, "
              f"{sum(t['graddbg full'] for n, t in per_op if n in big):.1f}s graddbg full; "
              f"the other {len(small)}: {sum(t['torch slow'] for t in small):.1f}s vs "
              f"{sum(t['graddbg full'] for t in small):.1f}s")
        for a, b in (("torch slow", "graddbg full"), ("torch fast", "graddbg fast")):
            for who in (a, b):
                top = sorted(per_op, key=lambda p: -p[1][who])[:10]
                share = sum(t[who] for _, t in top) / max(totals[who], 1e-9)
                print(f"\n  top 10 ops by {who} time ({100 * share:.0f}% of its total):")
                for name, t in top:
                    print(f"    {name:44s} {a} {t[a]:7.3f}s  {b} {t[b]:7.3f}s  "
                          f"ratio {t[a] / max(t[b], 1e-9):6.2f}x")
    for n, rows in disagree.items():
        if rows:
            print(f"\n{n}: {len(rows)} disagreement(s)")
            for name, why in rows:
                print(f"  {name}: {why}")
    if args.verbose and torch_failed:
        print("\ntorch slow gradcheck failed (excluded):")
        for name, why in torch_failed:
            print(f"  {name}: {(why or '')[:200]}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        traceback.print_exc()
