"""The silent-bug corpus (bench/corpus/, issue 31 point 5) under graddbg.watch: how many
bugs the default watch names, mis-names or misses, and how many fixed twins it flags.

For every case of the split, the buggy loop and its fixed twin each run inside
``graddbg.watch(model, optimizer)`` with the default options (warnings captured; a
``GradientAnomalyError`` raised by the watch counts as a finding of its anomaly's kind and
ends that loop). The buggy run is

- ``named``: some finding's kind is one the case expects and, when the case names
  parameters, the finding's ``name`` or ``params`` includes one of them;
- ``mis-named``: findings, none of them correct;
- ``missed``: no finding.

A fixed twin with any finding is a false alarm. Cases whose bug no finding kind can name
(bad data, a freeze that freezes nothing: empty ``expected_kinds``) are counted apart: for
them a finding is a mis-naming and silence is expected.

Prints one row per case (case, split, outcome, the kinds found on the buggy run, the first
finding's step, the kinds found on the twin) and the totals: recall on the split (named over
the cases a kind can name), mis-named, missed, false alarms on the twins. ``--no-graddbg``
runs the loops unwatched and checks only that each bug manifests and each fix trains.

    PYTHONPATH=$PWD .venv/bin/python bench/corpus_run.py --split dev [--json out.json]
    PYTHONPATH=$PWD .venv/bin/python bench/corpus_run.py --split all --no-graddbg

The held-out half is run with graddbg once, when the detection code is final.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import corpus
from corpus._common import Case


@dataclasses.dataclass
class Finding:
    """What one anomaly says, reduced to what the classification needs."""

    kind: str
    step: Optional[int]
    name: Optional[str]
    params: tuple
    message: str
    raised: bool = False


@dataclasses.dataclass
class Run:
    """One watched (or unwatched) run of one variant."""

    findings: List[Finding]
    result: Optional[Dict[str, Any]]
    error: Optional[str]
    warnings: int
    seconds: float


def _finding(anomaly: Any, raised: bool = False) -> Finding:
    params = getattr(anomaly, "params", None) or ()
    return Finding(kind=str(anomaly.kind), step=getattr(anomaly, "step", None),
                   name=getattr(anomaly, "name", None), params=tuple(params),
                   message=str(getattr(anomaly, "message", "")), raised=raised)


def run_variant(case: Case, which: str, watched: bool, seed: int = 0) -> Run:
    """Build and run one variant, under ``graddbg.watch`` (defaults) when ``watched``."""
    build, loop = case.variant(which)
    model, opt, extras = build(seed)
    findings: List[Finding] = []
    result, error = None, None
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if watched:
            result, error = _watched(model, opt, extras, loop, case.steps, findings)
        else:
            result = loop(model, opt, extras, case.steps)
    return Run(findings, result, error, len(caught), time.perf_counter() - start)


def _watched(model, opt, extras, loop, steps, findings):
    import graddbg

    result, error, raised = None, None, None
    try:
        w = graddbg.watch(model, opt)
    except graddbg.GraddbgError as exc:  # watch() refused the model and optimizer: said, and
        # counted as its own kind ("refused"), which no case expects: conservative for recall
        findings.append(Finding(kind="refused", step=None, name=None, params=(), message=str(exc)))
        return None, f"{type(exc).__name__}: {exc}"
    try:
        with w:
            result = loop(model, opt, extras, steps)
    except graddbg.GradientAnomalyError as exc:
        raised = exc.anomaly
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    except Exception as exc:  # the loop itself failed: reported, never hidden
        error = f"{type(exc).__name__}: {exc}"
    seen = set()
    for anomaly in list(w.anomalies) + ([raised] if raised is not None else []):
        key = (anomaly.kind, getattr(anomaly, "step", None), getattr(anomaly, "name", None))
        if key not in seen:
            seen.add(key)
            findings.append(_finding(anomaly, raised=anomaly is raised))
    return result, error


def correct(case: Case, finding: Finding) -> bool:
    """Whether ``finding`` names ``case``'s bug: an expected kind and, when the case lists
    parameters, one of them among the finding's name and params."""
    if finding.kind not in case.expected_kinds:
        return False
    if not case.params:
        return True
    named = set(finding.params) | ({finding.name} if finding.name else set())
    return bool(named & set(case.params))


def classify(case: Case, findings: Sequence[Finding]) -> str:
    """``named``, ``mis-named`` or ``missed`` for a buggy run's findings."""
    if not findings:
        return "missed"
    return "named" if any(correct(case, f) for f in findings) else "mis-named"


def _kinds(findings: Sequence[Finding]) -> str:
    out: Dict[str, int] = {}
    for f in findings:
        out[f.kind] = out.get(f.kind, 0) + 1
    return ", ".join(f"{k}{'' if n == 1 else ' x' + str(n)}" for k, n in out.items()) or "-"


def evaluate(case: Case, watched: bool, seed: int = 0) -> Dict[str, Any]:
    """Run both variants of one case; the row of the table, as data."""
    buggy = run_variant(case, "buggy", watched, seed)
    fixed = run_variant(case, "fixed", watched, seed)
    manifest = None
    if buggy.result is not None and fixed.result is not None:
        manifest = bool(case.manifest(buggy.result, fixed.result))
    row: Dict[str, Any] = {
        "case": case.name, "split": corpus.split_of(case.name), "family": case.family,
        "expected_kinds": list(case.expected_kinds), "params": list(case.params),
        "manifest": manifest, "seconds": round(buggy.seconds + fixed.seconds, 3),
        "errors": {"buggy": buggy.error, "fixed": fixed.error},
    }
    if watched:
        row.update({
            "outcome": classify(case, buggy.findings),
            "buggy_findings": [dataclasses.asdict(f) for f in buggy.findings],
            "fixed_findings": [dataclasses.asdict(f) for f in fixed.findings],
            "false_alarm": bool(fixed.findings),
            "first_step": buggy.findings[0].step if buggy.findings else None,
            "warnings": {"buggy": buggy.warnings, "fixed": fixed.warnings},
        })
    return row


def totals(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Recall and the other counts over the rows of one run."""
    out: Dict[str, Any] = {"cases": len(rows),
                           "manifest_failed": [r["case"] for r in rows if r["manifest"] is False]}
    if rows and "outcome" in rows[0]:
        nameable = [r for r in rows if r["expected_kinds"]]
        silent = [r for r in rows if not r["expected_kinds"]]
        named = sum(r["outcome"] == "named" for r in nameable)
        out.update({
            "nameable": len(nameable), "named": named,
            "recall": round(named / len(nameable), 3) if nameable else None,
            "mis_named": sum(r["outcome"] == "mis-named" for r in nameable),
            "missed": sum(r["outcome"] == "missed" for r in nameable),
            "no_kind_cases": len(silent),
            "no_kind_flagged": sum(r["outcome"] != "missed" for r in silent),
            "false_alarms": sum(r["false_alarm"] for r in rows),
        })
    return out


def _table(rows: List[Dict[str, Any]], watched: bool) -> str:
    if watched:
        head = ["case", "split", "outcome", "found on buggy", "1st step", "found on fixed"]
        body = [[r["case"], r["split"], r["outcome"] if r["expected_kinds"] else r["outcome"] + " (no kind)",
                 _kinds([Finding(**f) for f in r["buggy_findings"]]),
                 "-" if r["first_step"] is None else str(r["first_step"]),
                 _kinds([Finding(**f) for f in r["fixed_findings"]])] for r in rows]
    else:
        head = ["case", "split", "family", "manifest", "seconds"]
        body = [[r["case"], r["split"], r["family"], str(r["manifest"]), f"{r['seconds']:.2f}"]
                for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(line, widths)) for line in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _summary(t: Dict[str, Any], split: str) -> str:
    lines = [f"cases: {t['cases']} ({split})"]
    if "recall" in t:
        lines += [
            f"recall: {t['named']}/{t['nameable']} = {t['recall']} (cases a finding kind can name)",
            f"mis-named: {t['mis_named']}   missed: {t['missed']}",
            f"cases no kind can name: {t['no_kind_cases']}, flagged anyway: {t['no_kind_flagged']}",
            f"false alarms on the fixed twins: {t['false_alarms']}/{t['cases']}",
        ]
    failed = t["manifest_failed"]
    lines.append("manifest (bug shows, fix trains): "
                 + ("all hold" if not failed else "FAILED for " + ", ".join(failed)))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", choices=corpus.SPLITS, default="dev")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="write the rows here")
    parser.add_argument("--no-graddbg", action="store_true",
                        help="run unwatched; check only that the bugs manifest")
    parser.add_argument("--only", default="", help="comma-separated case names")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    names = corpus.names(args.split)
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - set(corpus.CASES))
        if unknown:
            parser.error(f"--only: unknown case(s) {unknown}; known: {sorted(corpus.CASES)}")
        names = [n for n in names if n in wanted]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add contention
    try:
        rows = [evaluate(corpus.CASES[n], not args.no_graddbg, args.seed) for n in names]
    finally:
        torch.set_num_threads(threads)
    t = totals(rows)
    print(_table(rows, not args.no_graddbg))
    print()
    print(_summary(t, args.split))
    if args.json:
        args.json.write_text(json.dumps({"split": args.split, "watched": not args.no_graddbg,
                                         "seed": args.seed, "rows": rows, "totals": t},
                                        indent=1, default=str))
    return 0 if not t["manifest_failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
