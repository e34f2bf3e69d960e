"""graddbg.gradcheck against torch.autograd.gradcheck on PyTorch's OpInfo database.

For every op of ``torch.testing._internal.common_methods_invocations.op_db`` that supports
autograd on CPU, and every dtype asked for (float64 and complex128 by default) that it
supports, take its first sample input (built the way PyTorch's own test_ops gradcheck
does: tensor lists splatted, non-differentiable arguments put back by a wrapper). On the
samples where ``torch.autograd.gradcheck(fast_mode=False)`` passes, run

    torch slow   torch.autograd.gradcheck(fn, args, fast_mode=False, raise_exception=False)
    torch fast   torch.autograd.gradcheck(fn, args, fast_mode=True, raise_exception=False)
    graddbg full graddbg.gradcheck(fn, args, fast_mode=False, raise_exception=False)
    graddbg fast graddbg.gradcheck(fn, args, fast_mode=True, raise_exception=False)

(graddbg in torch's calling convention: the same call with ``torch.autograd`` swapped for
``graddbg``; both run torch's default further checks), interleaved per sample (the order
rotates), and print the agreement (graddbg passes where torch passes: target 100%), the
samples where it does not with the reason, the total time of each checker with the
ratios, per dtype, and the 10 most expensive ops of each checker next to the other
checker of the same kind (full with torch slow, fast with torch fast).

Sparse samples (``--sparse``, on by default): for every op that supports sparse COO or CSR
inputs and autograd, its first 2-D dense sample input is made sparse (every other element
unspecified) and checked with ``masked=False`` and ``masked=True`` (outputs densified with
``to_dense()``, as torch requires). torch's verdict may be a pass or a fail here (masked
semantics decide it): the agreement counts both; a sample torch cannot run at all is
skipped. Needs the dev extras expecttest, hypothesis.

    python bench/opinfo_agreement.py                      # the whole corpus
    python bench/opinfo_agreement.py --limit 50           # the first 50 ops
    python bench/opinfo_agreement.py --dtypes float64     # real samples only
"""
from __future__ import annotations

import argparse
import time
import traceback
import warnings

import torch


_DTYPES = {"float64": torch.float64, "complex128": torch.complex128}


def _samples(limit, only, dtypes):
    from torch.testing._internal.common_methods_invocations import op_db

    n = 0
    for op in op_db:
        if only and op.name not in only:
            continue
        if not op.supports_autograd:
            continue
        found = False
        for dtype in dtypes:
            try:
                if dtype not in op.supported_dtypes("cpu"):
                    continue
                sample = next(iter(op.sample_inputs("cpu", dtype, requires_grad=True)), None)
            except Exception:  # noqa: BLE001 - a broken sample generator is not our concern
                continue
            if sample is None:
                continue
            name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
            yield f"{name}[{str(dtype)[6:]}]", op, sample
            found = True
        n += found
        if limit and n >= limit:
            return


def _sparse_problems(limit, only):
    """(name, fn, (sparse input,), masked) for the ops that take sparse COO/CSR inputs."""
    from torch.testing._internal.common_methods_invocations import op_db

    n = 0
    for op in op_db:
        if (only and op.name not in only) or not op.supports_autograd:
            continue
        layouts = [(lay, tag) for lay, tag, ok in ((torch.sparse_coo, "coo", op.supports_sparse),
                                                   (torch.sparse_csr, "csr", op.supports_sparse_csr)) if ok]
        if not layouts:
            continue
        try:
            sample = next((sm for _, sm in zip(range(8), op.sample_inputs("cpu", torch.float64))
                           if isinstance(sm.input, torch.Tensor) and sm.input.dim() == 2
                           and sm.input.numel() > 1), None)
        except Exception:  # noqa: BLE001
            continue
        if sample is None:
            continue
        dense = sample.input.detach().clone()
        dense.view(-1)[::2] = 0                       # every other element unspecified
        for layout, tag in layouts:
            x = (dense.to_sparse() if layout == torch.sparse_coo else dense.to_sparse_csr())
            fn = _sparse_fn(op, sample)
            for masked in (False, True):
                yield (f"{op.name}[{tag}, masked={masked}]", fn,
                       (x.detach().clone().requires_grad_(),), masked)
        n += 1
        if limit and n >= limit:
            return


def _sparse_fn(op, sample):
    def fn(x):
        out = op(x, *sample.args, **sample.kwargs)
        return out.to_dense() if isinstance(out, torch.Tensor) and out.layout != torch.strided else out
    return fn


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

    def make(check, fast):
        def run(fn, args, nd, **kw):
            return check(fn, args, fast_mode=fast, nondet_tol=nd, raise_exception=False, **kw)
        return run

    return {"torch slow": make(torch.autograd.gradcheck, False),
            "torch fast": make(torch.autograd.gradcheck, True),
            "graddbg full": make(graddbg.gradcheck, False),
            "graddbg fast": make(graddbg.gradcheck, True)}


def _timed(check, fn, args, nd, **kw):
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = check(fn, args, nd, **kw)
        verdict, why = bool(out), (None if bool(out) else str(out))
    except Exception as exc:  # noqa: BLE001 - record the reason
        verdict, why = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return verdict, why, time.perf_counter() - t0


def _run_dense(args, checkers):
    """Every dense sample through the four checkers; returns the per-sample records."""
    names = list(checkers)
    records, torch_failed, skipped = [], [], []
    dtypes = [_DTYPES[d] for d in args.dtypes]
    for i, (name, op, sample) in enumerate(_samples(args.limit, set(args.ops or ()), dtypes)):
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
        results = {"torch slow": (ok, why, dt)}
        rest = names[1:]
        k = i % len(rest)
        for n in rest[k:] + rest[:k]:                    # rotate the order
            results[n] = _timed(checkers[n], fn, gargs, nd)
        records.append((name, results))
        if args.verbose:
            print(f"{name:48s} " + "  ".join(f"{n}={'ok' if r[0] else 'FAIL'} {r[2]*1e3:7.1f}ms"
                                             for n, r in results.items()), flush=True)
    return records, torch_failed, skipped


def _summary(label, records, names):
    """Agreement and total times of one group of samples."""
    totals = {n: sum(r[n][2] for _, r in records) for n in names}
    print(f"\n{label}: {len(records)} samples where torch slow gradcheck passes")
    for n in names:
        p = sum(r[n][0] for _, r in records)
        print(f"  {n:13s} passes {p:4d}/{len(records)} ({100 * p / max(len(records), 1):6.2f}%)"
              f"   total time {totals[n]:8.2f}s")
    print(f"  speed: graddbg full is {totals['torch slow'] / max(totals['graddbg full'], 1e-9):.2f}x "
          f"torch slow;  graddbg fast is {totals['torch fast'] / max(totals['graddbg fast'], 1e-9):.2f}x "
          f"torch fast  (>1 means graddbg is faster)")
    return totals


def _top(per_op, totals):
    import math
    import statistics

    def gmean(a, b):
        return math.exp(statistics.fmean(math.log(max(t[a], 1e-6) / max(t[b], 1e-6)) for _, t in per_op))

    print(f"\n  per-sample geometric mean: graddbg full {gmean('torch slow', 'graddbg full'):.2f}x "
          f"faster than torch slow; graddbg fast {gmean('torch fast', 'graddbg fast'):.2f}x torch fast")
    for a, b in (("torch slow", "graddbg full"), ("torch fast", "graddbg fast")):
        for who in (a, b):
            top = sorted(per_op, key=lambda p: -p[1][who])[:10]
            share = sum(t[who] for _, t in top) / max(totals[who], 1e-9)
            print(f"\n  top 10 samples by {who} time ({100 * share:.0f}% of its total):")
            for name, t in top:
                print(f"    {name:48s} {a} {t[a]:7.3f}s  {b} {t[b]:7.3f}s  "
                      f"ratio {t[a] / max(t[b], 1e-9):6.2f}x")


def _run_sparse(args, checkers):
    """Sparse samples: torch's verdict (pass or fail) against graddbg's, both modes."""
    rows, skipped = [], []
    for name, fn, xs, masked in _sparse_problems(args.limit, set(args.ops or ())):
        verdicts = {}
        for n, check in checkers.items():
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    t0 = time.perf_counter()
                    out = check(fn, xs, 0.0, masked=masked)
                verdicts[n] = (bool(out), time.perf_counter() - t0, None if out else str(out))
            except Exception as exc:  # noqa: BLE001
                verdicts[n] = (None, 0.0, f"{type(exc).__name__}: {str(exc)[:160]}")
        if verdicts["torch slow"][0] is None:
            skipped.append((name, verdicts["torch slow"][2]))
            continue
        rows.append((name, verdicts))
    # the reference verdict is torch's full (slow) mode, for both graddbg modes and for
    # torch's own fast mode (which can miss what slow mode finds)
    pairs = (("torch slow", "graddbg full"), ("torch slow", "graddbg fast"), ("torch slow", "torch fast"))
    print(f"\nSparse samples (COO/CSR, masked=False and True): {len(rows)} torch can run "
          f"({len(skipped)} it cannot, skipped); torch slow passes "
          f"{sum(v['torch slow'][0] for _, v in rows)}, fails {sum(not v['torch slow'][0] for _, v in rows)}")
    for a, b in pairs:
        same = sum(v[a][0] == v[b][0] for _, v in rows)
        base = "torch fast" if b == "graddbg fast" else a
        ta, tb = (sum(v[n][1] for _, v in rows) for n in (base, b))
        print(f"  {b:12s} verdict == {a} verdict on {same}/{len(rows)} "
              f"({100 * same / max(len(rows), 1):.2f}%); time {tb:.2f}s vs {base} {ta:.2f}s "
              f"({ta / max(tb, 1e-9):.2f}x)")
        for name, v in rows:
            if v[a][0] != v[b][0]:
                print(f"    differs: {name}: {a} {v[a][0]}, {b} {v[b][0]} "
                      f"{(v[b][2] or '').splitlines()[0][:200] if v[b][2] else ''}")
    if args.verbose:
        for name, why in skipped:
            print(f"    skipped {name}: {why}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=0, help="only the first N eligible ops")
    ap.add_argument("--ops", nargs="*", default=None, help="only these op names")
    ap.add_argument("--dtypes", nargs="*", default=list(_DTYPES), choices=list(_DTYPES))
    ap.add_argument("--no-sparse", dest="sparse", action="store_false", help="skip sparse samples")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    checkers = _checkers()
    names = list(checkers)
    t_start = time.perf_counter()
    records, torch_failed, skipped = _run_dense(args, checkers)
    print(f"\nOpInfo corpus (first sample per op and dtype, CPU): {len(records)} samples where torch "
          f"slow gradcheck passes; {len(torch_failed)} where it fails (excluded), {len(skipped)} "
          f"skipped; wall {time.perf_counter() - t_start:.1f}s, torch threads {args.threads}")
    totals = _summary("all dtypes", records, names)
    for d in args.dtypes:
        _summary(d, [r for r in records if r[0].endswith(f"[{d}]")], names)
    if records:
        _top([(name, {n: r[n][2] for n in names}) for name, r in records], totals)
    for n in names[2:]:
        bad = [(name, (r[n][1] or "").replace("\n", " | ")[:400]) for name, r in records if not r[n][0]]
        if bad:
            print(f"\n{n}: {len(bad)} disagreement(s)")
            for name, why in bad:
                print(f"  {name}: {why}")
    if args.verbose and torch_failed:
        print("\ntorch slow gradcheck failed (excluded):")
        for name, why in torch_failed:
            print(f"  {name}: {(why or '')[:200]}")
    if args.sparse:
        _run_sparse(args, checkers)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        traceback.print_exc()
