"""Ending a process right after graddbg's collectives (graddbg/_collective.py).

A gloo collective's tensors are freed on the process group's worker thread, which needs the
GIL for it; if the interpreter is already shutting down, the process aborts (SIGABRT). Ended
this way right after the last collective (tests/_exit_worker.py), a pair of ranks aborted in
2 of 8 rounds with torch's own ``dist.all_reduce`` (the worker's "torch" mode) and in 3 of 8
with watched steps before graddbg kept its last CPU work for the main thread to free; the
processes must now always exit with 0. Each mode runs several rounds, since this is a race
(the torch control is not run here: how often it aborts depends on the machine)."""
from __future__ import annotations

import multiprocessing

import pytest

import _exit_worker as worker
from _dist import free_port

ROUNDS = 6


def _exit_codes(mode: str) -> list:
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=worker.main, args=(rank, 2, port, mode)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
    return [p.exitcode for p in procs]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["run", "watch", "check"])
def test_a_process_may_end_right_after_graddbgs_collectives(mode):
    codes = [_exit_codes(mode) for _ in range(ROUNDS)]
    assert all(c == [0, 0] for c in codes), f"exit codes per round (-6: SIGABRT): {codes}"


def test_keep_work_keeps_cpu_work_only():
    import torch

    from graddbg import _collective

    cpu, meta = object(), object()
    _collective.keep_work(cpu, [torch.zeros(2)])
    assert _collective._HELD[0] is cpu
    _collective.keep_work(meta, torch.zeros(2, device="meta"))   # not CPU memory: not kept
    assert _collective._HELD[0] is cpu
    _collective.keep_work(None, torch.zeros(1))                   # a rank outside the group
    assert _collective._HELD[0] is None
