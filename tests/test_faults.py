"""graddbg is never the thing that breaks a distributed job (tests/_fault_worker.py): a dead
peer ends the survivors about as soon as it does without graddbg, and ranks that step
differently run exactly as they do unwatched, with the drift named. The waits themselves
(`graddbg._dist.peers.Peers`) are tested in one process, ranks simulated over one store."""
from __future__ import annotations

import json
import pathlib
import threading
import time

import pytest
import torch.distributed as dist

import _fault_worker as worker
from _dist import context, free_port
from graddbg._dist import peers as _peers
from graddbg._dist.peers import Peers, Position


def _job(tmp: pathlib.Path, watched: bool, world: int = 2, **kw) -> dict:
    ctx = context()
    port = free_port()
    out = tmp / ("watched" if watched else "plain")
    out.mkdir()
    procs = [ctx.Process(target=worker.main, args=(r, world, port, str(out), watched), kwargs=kw, daemon=True)
             for r in range(world)]
    return {"procs": procs, "out": out}


def _run_side_by_side(tmp: pathlib.Path, timeout: float = 150, **kw) -> dict:
    """The same job plain and watched, at the same time (the same load on both)."""
    jobs = {w: _job(tmp, w, **kw) for w in (False, True)}
    for j in jobs.values():
        for p in j["procs"]:
            p.start()
    deadline = time.monotonic() + timeout
    for j in jobs.values():
        for p in j["procs"]:
            p.join(timeout=max(deadline - time.monotonic(), 0.1))
    hung = [(w, r) for w, j in jobs.items() for r, p in enumerate(j["procs"]) if p.is_alive()]
    for j in jobs.values():
        for p in j["procs"]:
            if p.is_alive():
                p.kill()
    assert not hung, f"(watched, rank) hung: {hung}"
    got = {}
    for w, j in jobs.items():
        out = j["out"]
        died = [float(f.read_text()) for f in out.glob("died*")]
        recs = {int(f.stem[4:]): json.loads(f.read_text()) for f in out.glob("rank*.json")}
        got[w] = {"records": recs, "died": min(died) if died else None}
    return got


# ----------------------------------------------------------------- a dead peer
@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("victim, at, where", [(1, 0, "step"), (1, 0, "forward"), (1, 3, "step"), (0, 0, "step")],
                         ids=["rank1-step0-before-step", "rank1-step0-before-forward", "rank1-step3-before-step",
                              "rank0-store-host-step0"])
def test_a_dead_peer_ends_the_survivor_within_seconds_of_plain_torch(tmp_path, victim, at, where):
    # a process group timeout of 5 minutes: a wait that ignored dead peers would show
    got = _run_side_by_side(tmp_path, fault="die", victim=victim, at=at, where=where, pg_timeout=300)
    survivor = 1 - victim
    ends = {}
    for w in (False, True):
        rec = got[w]["records"][survivor]
        assert rec["status"] == "RuntimeError", rec  # (torch's own error in the next collective)
        assert "graddbg" not in rec.get("error_text", ""), rec["error_text"]
        ends[w] = rec["end"] - got[w]["died"]
    assert ends[True] <= ends[False] + 4.0, f"the survivor ended {ends[True]:.1f} s after the death watched, " \
                                            f"{ends[False]:.1f} s plain"
    said = " ".join(got[True]["records"][survivor]["warnings"])
    if where == "step":  # (it died where graddbg waits for it: graddbg says so, naming it)
        assert f"rank(s) {victim}" in said or "store stopped answering" in said, said
        assert "internal error" not in said, said


# ----------------------------------------------------------------- ranks that step differently
@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("fault", ["skip", "repeat"])
def test_ranks_that_step_differently_run_as_unwatched_and_the_drift_is_named(tmp_path, fault):
    skips = (3, 5, 6)
    got = _run_side_by_side(tmp_path, fault=fault, skips=skips, steps=10, pg_timeout=60)
    for w in (False, True):
        for r in (0, 1):
            assert got[w]["records"][r]["status"] == "finished", got[w]["records"][r]
    # the job runs exactly as unwatched: the same weights on every rank, bit for bit
    for r in (0, 1):
        assert got[True]["records"][r]["weights"] == got[False]["records"][r]["weights"]
    assert got[False]["records"][0]["weights"] != got[False]["records"][1]["weights"]  # (the drift is real)
    for r in (0, 1):
        found = [a for a in got[True]["records"][r]["anomalies"] if a["kind"] == "ddp_mismatch"]
        assert len(found) == 1, got[True]["records"][r]["anomalies"]
        msg = found[0]["message"]
        at = 3 if fault == "skip" else 4  # (the step rank 1 skipped; its second step after step 3's backward)
        assert found[0]["step"] == at and f"stepped differently at step {at}" in msg, msg
        assert "replicas now differ" in msg
        if fault == "skip":
            assert "rank 1 skipped step 3" in msg and "rank 1: 7 step(s) over 10 backward pass(es) (3 fewer)" in msg
        else:
            assert "rank 1 called optimizer.step() again (its step 4) with no backward pass" in msg, msg
            assert "rank 0: 10 step(s) over 10 backward pass(es) (3 fewer)" in msg, msg
        # nothing else: no internal error, no other finding
        assert not [x for x in got[True]["records"][r]["warnings"] if "internal error" in x]
        kinds = [a["kind"] for a in got[True]["records"][r]["anomalies"]]
        # (rank 1's second step is also its own finding, the step without a backward pass)
        assert kinds == (["ddp_mismatch", "double_step"] if fault == "repeat" and r == 1 else ["ddp_mismatch"])


# ----------------------------------------------------------------- the waits, in one process
class _Ranks:
    """``world`` simulated ranks over one in-process store."""

    def __init__(self, world: int, seconds: float = 30.0) -> None:
        store = dist.HashStore()
        self.peers = [Peers(store, "t/", r, world, seconds) for r in range(world)]

    def close(self) -> None:
        for p in self.peers:
            p.close()


@pytest.fixture
def ranks():
    made = []

    def make(world: int, seconds: float = 30.0) -> _Ranks:
        made.append(_Ranks(world, seconds))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _arrive_in_thread(peers: Peers, steps: int, comparable: bool = True) -> dict:
    got = {}
    t = threading.Thread(target=lambda: got.update(v=peers.arrive(steps, comparable)), daemon=True)
    t.start()
    got["thread"] = t
    return got


def test_every_rank_at_the_boundary_is_ok(ranks):
    rs = ranks(3)
    for p in rs.peers:
        p.backward_ended()
    waits = [_arrive_in_thread(p, 0) for p in rs.peers]
    for w in waits:
        w["thread"].join(10)
        assert w["v"].ok, w["v"]
        assert w["v"].positions == (Position(1, 0, True),) * 3


def test_a_peer_that_went_past_the_boundary_without_a_step_is_a_skip(ranks):
    rs = ranks(2)
    a, b = rs.peers
    for p in (a, b):
        p.backward_ended()
    b.forward_began(0)  # (rank 1 went on to its next forward pass without the step rank 0 takes)
    v = a.arrive(0, comparable=True)
    assert not v.ok and v.kind == "desync" and v.ranks == (1,), v
    assert "rank 1 skipped step 0" in v.why


def test_accumulation_on_a_slow_peer_is_not_a_skip(ranks):
    rs = ranks(2, seconds=0.6)
    a, b = rs.peers
    for _ in range(4):
        a.backward_ended()
    b.backward_ended()
    b.forward_began(0)  # (rank 1 is at its second micro-batch of four: behind, not past)
    v = a.arrive(0, comparable=True)
    assert not v.ok and v.kind == "late" and v.ranks == (1,), v  # (only the bound ends the wait)
    assert "within 0.6 s" in v.why


def test_a_peer_that_stepped_more_often_is_out_of_step(ranks):
    rs = ranks(2)
    a, b = rs.peers
    a.backward_ended()
    b.backward_ended()
    b._publish(Position(1, 2, True))  # (rank 1 at its third boundary after one backward pass)
    v = a.arrive(0, comparable=False)
    assert not v.ok and v.kind == "desync" and "more often" in v.why


def test_a_peer_whose_pulse_stopped_is_gone_within_seconds(ranks, monkeypatch):
    monkeypatch.setattr(_peers, "SILENT_SECONDS", 0.5)
    rs = ranks(2, seconds=60)
    a, b = rs.peers
    b.close()  # (its process died: its pulse stands still)
    start = time.monotonic()
    v = a.arrive(0, comparable=True)
    took = time.monotonic() - start
    assert not v.ok and v.kind == "gone" and v.ranks == (1,), v
    assert took < 3, took


def test_a_live_peer_that_does_not_come_is_late_at_the_bound(ranks):
    rs = ranks(2, seconds=0.5)
    start = time.monotonic()
    v = rs.peers[0].arrive(0, comparable=True)
    assert not v.ok and v.kind == "late" and time.monotonic() - start < 3, v


def test_a_stop_written_by_a_peer_ends_every_wait(ranks):
    rs = ranks(3)
    w = _arrive_in_thread(rs.peers[0], 0)
    time.sleep(0.1)
    assert rs.peers[2].stop("desync|rank 1 skipped step 0") == "desync|rank 1 skipped step 0"
    assert rs.peers[1].stop("gone|later") == "desync|rank 1 skipped step 0"  # (the first reason wins)
    w["thread"].join(10)
    assert w["v"].kind == "stopped" and w["v"].why == "desync|rank 1 skipped step 0"


def test_a_store_that_stops_answering_is_gone_at_once():
    class Dead:
        def __getattr__(self, name):
            def fail(*a, **k):
                raise RuntimeError("Connection reset by peer")
            return fail

    store = dist.HashStore()
    p = Peers(store, "d/", 0, 2, 60.0)
    try:
        p.store = Dead()
        v = p.arrive(0, comparable=True)
        assert not v.ok and v.kind == "gone" and "store stopped answering" in v.why
    finally:
        p.close()
