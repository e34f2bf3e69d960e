"""bench/ddp_check.py runs end to end (1 repeat of 1 step): a benchmark that breaks when
the code it measures changes is caught here, not when someone next wants its figures."""
from __future__ import annotations

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
