"""Ending a process right after graddbg's collectives (graddbg/_dist/collective.py).

A gloo collective's tensors are freed on the process group's worker thread, which needs the
GIL for it; if the interpreter is already shutting down, the process aborts (SIGABRT). Ended
this way right after the last collective (tests/_exit_worker.py), a pair of ranks aborted in
2 of 8 rounds with torch's own ``dist.all_reduce`` (the worker's "torch" mode) and in 3 of 8
with watched steps before graddbg kept its CPU works for the main thread to free; the
processes must now always exit with 0. Each mode runs several rounds, since this is a race
(the torch control is not run here: how often it aborts depends on the machine)."""
from __future__ import annotations


import pytest

import _exit_worker as worker
from _dist import context, free_port

ROUNDS = 6


def _exit_codes(mode: str) -> list:
    ctx = context()
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


def test_keep_work_keeps_cpu_works_for_a_while_and_a_bounded_number(monkeypatch):
    import torch

    from graddbg._dist import collective as _collective

    monkeypatch.setattr(_collective, "_HELD", __import__("collections").deque())
    clock = [100.0]
    monkeypatch.setattr(_collective.time, "monotonic", lambda: clock[0])
    kept = lambda: [w for _, w in _collective._HELD]  # noqa: E731
    a, b, meta = object(), object(), object()
    _collective.keep_work(a, [torch.zeros(2)])
    _collective.keep_work(meta, torch.zeros(2, device="meta"))   # not CPU memory: not kept
    _collective.keep_work(None, torch.zeros(1))                   # a rank outside the group
    clock[0] += _collective.KEEP_SECONDS / 2
    _collective.keep_work(b, torch.zeros(1))
    assert kept() == [a, b]                  # a is younger than KEEP_SECONDS: still kept
    clock[0] += _collective.KEEP_SECONDS * 0.75
    _collective.keep_work(None, torch.zeros(1))
    assert kept() == [b]                     # a is older now: let go; b is not
    monkeypatch.setattr(_collective, "KEEP_MOST", 3)
    works = [object() for _ in range(5)]
    for w in works:
        _collective.keep_work(w, torch.zeros(1))
    assert kept() == works[-3:]              # at most KEEP_MOST, the newest
