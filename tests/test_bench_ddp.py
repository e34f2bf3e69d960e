"""bench/ddp_check.py runs end to end (1 repeat of 1 step): a benchmark that breaks when
the code it measures changes is caught here, not when someone next wants its figures.
(Its figures themselves are not asserted: one repeat on a shared machine says nothing.)"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ddp_check_benchmark_runs_and_counts_the_bytes_the_check_exchanges():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ddp_check.py"),
                           "--repeats", "1", "--steps", "1"],
                          capture_output=True, text=True, timeout=200, cwd=ROOT,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    # one all-gather of the 7-integer header per check, nothing else on the healthy path
    found = re.search(r"check (\d+) B in (\d+) all_gathers, all_reduce of all gradients (\d+) B: "
                      r"(\d+)x fewer", proc.stdout)
    assert found, proc.stdout
    check, calls, grads, fewer = map(int, found.groups())
    assert (check, calls) == (56, 1)
    assert grads == 4 * 8_403_978 and fewer >= 1000          # the 8.4M float32 parameters
    for line in ("bitwise", "inside the every-step blocks", "check_gradients, bitwise:"):
        assert line in proc.stdout
    # the floor (one read of the gradients + one rendezvous), measured beside the check,
    # and the check's overhead as a multiple of the floor's, from the blocks, from the
    # calls inside the step (one line per rank) and standalone
    assert re.search(r"floor: read \+ gather +plain step +[\d.]+ ms, adds +-?[\d.]+ ms/step", proc.stdout)
    assert re.search(r"check overhead / floor overhead \(blocks\): (-?[\d.]+x|undefined)", proc.stdout)
    inside = re.findall(r"rank (\d): check overhead / floor overhead \(calls inside the step\): "
                        r"([\d.]+)x", proc.stdout)
    assert [r for r, _ in inside] == ["0", "1"] and all(float(x) > 0 for _, x in inside)
    alone = re.search(r"floor \(one read \+ one all_gather\): +([\d.]+) ms .* check / floor = "
                      r"([\d.]+)x", proc.stdout)
    assert alone and float(alone.group(1)) > 0 and float(alone.group(2)) > 0
    # the cost of one check_replicas as a share of a step, per model, and the proposed N
    costs = re.findall(r"  (\w+) +[\d.]+M parameters in +(\d+) tensors: step +([\d.]+) ms, check +"
                       r"([\d.]+) ms = +([\d.]+)% of a step; every N >= (\d+) steps costs <= 1%",
                       proc.stdout)
    assert [c[0] for c in costs] == ["mlp8m", "launchbound"], proc.stdout
    assert [int(c[1]) for c in costs] == [8, 130]
    for _, _, step, check, share, n in costs:
        assert float(step) > 0 and float(check) > 0
        assert abs(int(n) - max(1, math.ceil(float(share)))) <= 1    # N from the unrounded share
    proposed = re.search(r"proposed default: check every N = (\d+) steps", proc.stdout)
    assert proposed and int(proposed.group(1)) == max(int(c[5]) for c in costs)
