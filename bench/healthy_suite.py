"""False alarms on healthy training (issue 23, point 3): every script of tests/healthy/ run
unwatched (``python script.py``) and unchanged under ``graddbg run`` (the DDP script under
``torchrun --nproc-per-node=2 -m graddbg run``), side by side in one run. Prints one row
per script: the exit code under graddbg run, the anomalies recorded in the saved runs by
kind, the graddbg lines on stderr (warnings and messages), whether the losses equal the
unwatched run's exactly, and the seconds of each run; then the totals (scripts with a false
alarm, anomalies, warnings, non-zero exits, differing losses) and every anomaly and
stderr line in full.

    PYTHONPATH=$PWD .venv/bin/python bench/healthy_suite.py [--workers 3] [--only dcgan,vae]
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

import _healthy  # noqa: E402


def _row(script, plain, watched):
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(watched.kinds().items())) or "-"
    if watched.load_error:
        kinds += " (load failed)"
    warn = len(_healthy.graddbg_lines(watched, plain))
    same = "yes" if watched.losses == plain.losses and plain.losses else "NO"
    return [script, str(plain.returncode), str(watched.returncode), kinds, str(warn), same,
            f"{plain.seconds:.1f}", f"{watched.seconds:.1f}"]


def _table(rows):
    head = ["script", "exit plain", "exit graddbg run", "anomalies by kind", "graddbg lines on stderr",
            "losses equal", "s plain", "s watched"]
    rows = [head] + rows
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=3, help="runs at a time (default 3)")
    p.add_argument("--only", default="", help="comma-separated script names (default: all)")
    args = p.parse_args(argv)
    scripts = [s for s in args.only.split(",") if s] or _healthy.SCRIPTS
    unknown = sorted(set(scripts) - set(_healthy.SCRIPTS))
    if unknown:
        p.error(f"--only: unknown scripts {unknown}; known: {', '.join(_healthy.SCRIPTS)}")
    with tempfile.TemporaryDirectory() as d:
        results = _healthy.run_suite(scripts, pathlib.Path(d), workers=args.workers)
    rows = [_row(s, *results[s]) for s in scripts]
    print(_table(rows))
    alarmed = [s for s in scripts if results[s][1].anomalies or _healthy.graddbg_lines(*results[s][::-1])
               or results[s][1].returncode != 0 or results[s][1].losses != results[s][0].losses]
    n_anom = sum(len(w.anomalies or []) for _, w in results.values())
    n_warn = sum(len(_healthy.graddbg_lines(w, pl)) for pl, w in results.values())
    print(f"\n{len(scripts)} scripts; {len(alarmed)} with a false alarm or a difference "
          f"({', '.join(alarmed) or 'none'}); {n_anom} anomalies; {n_warn} graddbg lines on stderr; "
          f"{sum(w.returncode != 0 for _, w in results.values())} non-zero exits under graddbg run; "
          f"{sum(w.losses != pl.losses for pl, w in results.values())} with different losses")
    for s in scripts:
        plain, watched = results[s]
        details = [f"  anomaly: step {a.step} {a.kind} {a.name}: {a.message}" for a in watched.anomalies or []]
        details += [f"  stderr: {line}" for line in _healthy.graddbg_lines(watched, plain)]
        if watched.load_error:
            details.append(f"  load: {watched.load_error}")
        if watched.returncode != 0 and not details:
            details.append("  stderr tail: " + watched.stderr[-800:].replace("\n", "\n  "))
        if details:
            print(f"\n{s}:\n" + "\n".join(details))
    return 0


if __name__ == "__main__":
    sys.exit(main())
