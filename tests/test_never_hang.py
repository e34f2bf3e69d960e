"""graddbg never hangs a distributed job: a signal while graddbg waits on a peer ends the
process at once and the record is written (tests/_signal_worker.py). The other planted
hangs (stages of different sizes, an unwatched peer) are in tests/test_pipeline.py."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time

import pytest

import _signal_worker as worker
from _dist import free_port


@pytest.mark.timeout(240)
def test_sigterm_and_sigint_end_a_rank_waiting_on_a_peer_and_the_record_is_written(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=worker.main, args=(r, 3, port, str(tmp_path)), daemon=True) for r in range(3)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 150
        while not all((tmp_path / f"waiting{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline, "ranks 0 and 1 never reached the third step"
            assert all(p.is_alive() for p in procs[:2]), [p.exitcode for p in procs]
            time.sleep(0.1)
        time.sleep(1.5)  # (now inside graddbg's exchange, waiting for rank 2)
        assert procs[0].is_alive() and procs[1].is_alive()
        sent = time.monotonic()
        os.kill(procs[0].pid, signal.SIGTERM)
        os.kill(procs[1].pid, signal.SIGINT)
        for p in procs[:2]:
            p.join(timeout=30)
        took = time.monotonic() - sent
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert took < 10, f"ranks took {took:.1f} s to end after the signal"
    got = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert got[0]["status"] == "Terminated" and got[1]["status"] == "KeyboardInterrupt", got
    for r in (0, 1):
        assert got[r]["steps"] == 2  # the two steps before the wait are recorded
        assert (tmp_path / f"record{r}").exists()
