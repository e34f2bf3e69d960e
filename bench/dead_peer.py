"""How soon a DDP job's survivor ends after a peer dies, plain and under ``watch()``, side by side.

Two gloo ranks on 127.0.0.1 (tests/_fault_worker.py: a small DDP model, SGD), the process group's
timeout 300 s (a wait that ignored a dead peer would show). For each kill point (the rank that
dies, the step, and where: before the forward pass, or between the backward pass and
``optimizer.step()``), the plain job and the watched job run at the same time, and the script
prints the seconds from the death to the survivor's end (torch's own error in its next
collective), and the difference. graddbg's target: a few seconds at most (its wait notices a dead
peer when the peer's pulse has stood still for ``graddbg._dist.peers.SILENT_SECONDS``, or at once when
the store is gone).

    .venv/bin/python bench/dead_peer.py [--repeats 1]
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

KILLS = [(1, 0, "step"), (1, 0, "forward"), (1, 3, "step"), (0, 0, "step"), (0, 3, "forward")]


def main() -> None:
    from test_faults import _run_side_by_side

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    print(f"{'victim':>6} {'step':>4} {'where':>8} {'plain s':>8} {'watched s':>9} {'extra s':>8}")
    for victim, at, where in KILLS:
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                got = _run_side_by_side(pathlib.Path(tmp), fault="die", victim=victim, at=at, where=where,
                                        pg_timeout=300)
            ends = [got[w]["records"][1 - victim]["end"] - got[w]["died"] for w in (False, True)]
            print(f"{victim:>6} {at:>4} {where:>8} {ends[0]:>8.2f} {ends[1]:>9.2f} {ends[1] - ends[0]:>8.2f}")


if __name__ == "__main__":
    main()
