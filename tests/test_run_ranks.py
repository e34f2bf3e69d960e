"""`graddbg run` across processes (graddbg/_launch.py): a script that starts its own ranks
with torch.multiprocessing.spawn has every rank watched and every rank's record written,
with its rank; the script's exit code is kept."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

SCRIPTS = pathlib.Path(__file__).parent / "scripts"


@pytest.mark.timeout(240)
def test_every_rank_that_torch_multiprocessing_spawn_starts_is_watched(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "graddbg", "run", "--out", str(out), "--nonfinite", "record",
                          str(SCRIPTS / "spawn_ddp_train.py")], capture_output=True, text=True, timeout=200,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 3, res.stderr[-3000:]  # the script's own exit code
    import graddbg

    for rank in (0, 1):
        run = graddbg.load(out / f"rank-{rank}" / "stats.parquet")
        assert run.meta["rank"] == rank and run.meta["world_size"] == 2
        assert sorted(run.stats["step"].unique()) == [0, 1, 2]
        kinds = [(a.step, a.kind) for a in run.anomalies]
        assert kinds == [(2, "nonfinite")], run.anomalies  # both ranks know, at the same step
        assert (out / f"rank-{rank}" / "report.html").exists()
    assert "rank-1" in res.stdout and "rank-0" in res.stdout, res.stdout


@pytest.mark.timeout(240)
def test_under_torchrun_each_rank_writes_its_own_record(tmp_path):
    from _dist import free_port

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "graddbg", "run", "--out", str(out),
           str(SCRIPTS / "torchrun_ddp_train.py")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=200, stdin=subprocess.DEVNULL)
    assert res.returncode != 0 and "exitcode  : 4" in res.stderr + res.stdout, res.stderr[-3000:]  # kept
    import graddbg

    for rank in (0, 1):
        run = graddbg.load(out / f"rank-{rank}" / "stats.parquet")
        assert run.meta["rank"] == rank and sorted(run.stats["step"].unique()) == [0, 1, 2]
